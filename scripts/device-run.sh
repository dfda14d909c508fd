#!/usr/bin/env bash
# One call on the GPU machine (see docs/gpu.md): runs the named stages in order, each
# with its own time limit, appending to $OUT/run.log and copying result JSON to $OUT.
# Builds nothing: carry target/release/flashmoe (and target/release/flashmoe-gpu-tests).
#   scripts/device-run.sh probe unit check-quick bench-quick
set -uo pipefail
OUT=${OUT:-/tmp/flashmoe-out}
mkdir -p "$OUT"
BIN=${FLASHMOE_BIN:-./target/release/flashmoe}
NCU="/usr/local/cuda/bin/ncu --clock-control none"
# Sections read by the ncu stages: throughput vs peak, pipes, memory, issue and stalls.
NCU_SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy"
LOG="$OUT/run.log"
export PYTHONUNBUFFERED=1
export FLASHMOE_CACHE_DIR=${FLASHMOE_CACHE_DIR:-/tmp/flashmoe-cache}

stage() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S)) ===" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s ===" | tee -a "$LOG"
  SUMMARY+="$name rc=$rc $((SECONDS - t0))s; "
}

# Time limit per MoE preset, seconds. Measured on the H100:
# seed003 135 s; deepseek-v3 2 of 4 configs in ~125 s (45 GB of f32 inputs generated and
# uploaded twice per config). mixtral and qwen3-30b (small weights) are estimates.
moe_limit() {
  case $1 in seed003) echo 300 ;; mixtral|qwen3-30b) echo 70 ;; deepseek-v3) echo 270 ;; *) echo 240 ;; esac
}

moe_preset() {  # preset name
  stage "moe-$1" "$(moe_limit "$1")" $BIN bench moe --preset "$1" --out "/tmp/moe-$1"
  cp "/tmp/moe-$1/results.json" "$OUT/moe-$1.json" 2>/dev/null
  cp "/tmp/moe-$1/results.md" "$OUT/moe-$1.md" 2>/dev/null
  cp "/tmp/moe-$1/report.html" "$OUT/moe-$1.html" 2>/dev/null
}

# One `bench --against` run (family, preset, implementations, time limit): this build
# against target/release/flashmoe-base, interleaved; $OUT/against.tgz repacked after it.
against_run() {
  stage "against-$1-$2" "$4" $BIN bench "$1" --preset "$2" --impl "$3" --no-baselines \
    --against ./target/release/flashmoe-base --max-time "${AGAINST_MAX_TIME:-0.5}" --out "/tmp/against/$1-$2"
  tar -C /tmp -czf "$OUT/against.tgz" against 2>>"$LOG"
}

# The third-party baselines unpacked by an earlier `baselines` stage (this call or one
# before it on the same warm machine). PYTHONPATH skips .pth files, so the dsl_packages
# folder that nvidia_cutlass_dsl's .pth adds goes on it too. FA4 and FlashInfer keep their
# compiled kernels on disk, so later processes reuse them; FlashInfer compiles with the
# toolkit's nvcc.
BASELINES_SITE=/root/baselines-site
use_baselines_site() {
  [ -d "$BASELINES_SITE/flashinfer" ] || [ -d "$BASELINES_SITE/flash_attn" ] || return 0
  case ":${PYTHONPATH:-}:" in *":$BASELINES_SITE:"*) return 0 ;; esac
  export PYTHONPATH=$BASELINES_SITE:$BASELINES_SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
  export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  export FLASHINFER_WORKSPACE_BASE=/root
}
use_baselines_site

SUMMARY=""
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >>"$LOG" 2>&1
for s in "$@"; do
  case $s in
    probe)        stage probe 300 python3 tools/probes/kernel_probe.py --quick --out /tmp/probe
                  cp /tmp/probe/probe.json "$OUT/" 2>/dev/null ;;
    probe-full)   stage probe-full 400 python3 tools/probes/kernel_probe.py --out /tmp/probe
                  cp /tmp/probe/probe.json "$OUT/" 2>/dev/null ;;
    unit)         stage unit 300 ./target/release/flashmoe-gpu-tests gpu_tests --test-threads=1 --nocapture
                  # the lab's timing and ceiling tests (flashmoe-bench lib), when carried
                  [ -x ./target/release/flashmoe-bench-gpu-tests ] && stage unit-bench 120 ./target/release/flashmoe-bench-gpu-tests gpu:: --test-threads=1 --nocapture ;;
    # flashmoe-candle's GPU tests (tests/gpu.rs): carry crates/flashmoe-candle/target/candle-gpu-tests.xz
    # (the stripped test executable, xz'd). Links libcuda, libcublas.so.13, libcurand.so.10,
    # libcudart.so.13 (cudarc's dynamic-linking): the toolkit's lib64 is put first.
    candle)       c=crates/flashmoe-candle/target/candle-gpu-tests
                  [ -x $c ] || { xz -dkf $c.xz >>"$LOG" 2>&1; chmod +x $c; }
                  stage candle 300 env LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
                    $c --test-threads=1 --nocapture ;;
    # candle-transformers' Llama, unmodified, on flashmoe-candle vs candle's own attention
    # (crates/flashmoe-candle/examples-llama): carry crates/flashmoe-candle/examples-llama/target/llama-check.xz.
    # Head dims 128/64 (sm_90a on Hopper) and 96/80 (portable kernel); exit 1 on FAIL.
    candle-llama) c=crates/flashmoe-candle/examples-llama/target/llama-check
                  [ -f $c.xz ] && { xz -dkf $c.xz >>"$LOG" 2>&1; chmod +x $c; }
                  stage candle-llama 300 env LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
                    $c --head-dims 128,64,96,80 --prompt 333 --decode 8 --batch 2 ;;
    env)          stage env 60 $BIN env ;;
    # Expert parallelism (issue 25) on a machine with several GPUs: nvidia-h100-x2 or larger.
    # The launcher sets NCCL_NVLS_ENABLE=0 etc. in every rank; topology goes in the report.
    ep-smoke)     stage ep-smoke 240 $BIN bench moe --gpus 2 --preset deepseek-v3 --tokens 512,2048 \
                    --rounds 3 --timeout 60 --out /tmp/ep-smoke
                  for f in results.md results.json; do cp /tmp/ep-smoke/$f "$OUT/ep-smoke-$f" 2>/dev/null; done ;;
    ep)           for p in deepseek-v3 seed003; do
                    stage "ep-$p" 300 $BIN bench moe --gpus 2 --preset $p --tokens 4096,8192,16384 \
                      --rounds 10 --timeout 60 --out /tmp/ep-$p
                    for f in results.md results.json report.html; do
                      cp /tmp/ep-$p/$f "$OUT/ep-$p-2gpu-$f" 2>/dev/null
                    done
                  done ;;
    # Overlap knobs at DeepSeek-V3, 8192 tokens per GPU: expert chunks, NCCL's CTA cap.
    ep-knobs)     for p in deepseek-v3 seed003; do for k in "--chunks 1" "--chunks 4"; do
                    n=ep-knob-$p$(echo $k | tr -d ' -')
                    stage "$n" 200 $BIN bench moe --gpus 2 --preset $p --tokens 4096,8192,16384 \
                      $k --rounds 10 --timeout 60 --out /tmp/ep-knobs/$n
                  done; done
                  tar -C /tmp/ep-knobs -czf "$OUT/ep-knobs.tgz" . 2>/dev/null ;;
    # Failure handling: rank 1 exits / hangs before its first call; rank 0 must report an
    # error within --timeout and the launcher exit 2 (rc=2 expected here).
    ep-fault)     for f in exit hang; do
                    stage "ep-fault-$f" 120 env FLASHMOE_EP_FAULT=1:$f $BIN bench moe --gpus 2 \
                      --preset deepseek-v3 --tokens 512 --rounds 1 --timeout 20 --out /tmp/ep-fault-$f
                    cp /tmp/ep-fault-$f/results.md "$OUT/ep-fault-$f.md" 2>/dev/null
                  done ;;
    # A Python plug-in on the GPU (issue 24 item 2): torch SDPA as `py:` implementations, one
    # correct (forward) and one with SDPA's top-left causal mask (top_left: the gate must
    # reject it on the Sq != Sk causal config).
    plugin-gpu)   stage plugin-gpu 300 $BIN bench attention --config configs/attention-gqa.toml --no-baselines \
                    --impl flashmoe-sm90,py:python/plugin_examples/torch_sdpa.py:forward,py:python/plugin_examples/torch_sdpa.py:top_left \
                    --max-time 3 --out /tmp/plugin-gpu
                  cp /tmp/plugin-gpu/results.md "$OUT/plugin-gpu.md" 2>/dev/null ;;
    ep-1gpu)      stage ep-1gpu 200 $BIN bench moe --gpus 1 --preset deepseek-v3 --tokens 4096 \
                    --rounds 5 --timeout 60 --out /tmp/ep-1gpu
                  cp /tmp/ep-1gpu/results.md "$OUT/ep-deepseek-v3-1gpu.md" 2>/dev/null ;;
    # the Python package: carry target/py-device (scripts/device-python.sh --pack)
    python)       stage python 420 bash scripts/device-python.sh target/py-device ;;
    # bench e2e (python/flashmoe_e2e.py) with the Python package installed from target/py-device
    # (scripts/device-python.sh --pack): seed 003's dense models, the MoE stacks, and the
    # large / Qwen3 models under torch.compile; e2e-train: training steps (forward, backward,
    # AdamW) and the loss-curve check on the small and medium models and a Qwen3-shaped stack.
    e2e|e2e-moe|e2e-compile)
                  python3 -m pip install -q --no-deps --no-index --target /tmp/flashmoe-site \
                    target/py-device/flashmoe-*.whl >>"$LOG" 2>&1
                  case $s in
                    e2e)     stage e2e 300 env PYTHONPATH=/tmp/flashmoe-site $BIN bench e2e --preset seed003 --out /tmp/$s ;;
                    e2e-moe) stage e2e-moe 240 env PYTHONPATH=/tmp/flashmoe-site $BIN bench e2e --preset moe --out /tmp/$s ;;
                    *)       stage e2e-compile 300 env PYTHONPATH=/tmp/flashmoe-site python3 python/flashmoe_e2e.py --preset all \
                               --only large:8x2048,qwen3-30b-a3b:8x2048 --impl sdpa-cudnn,sdpa-cudnn+compile,flashmoe,flashmoe+compile --out /tmp/$s
                               $BIN bench e2e --from-samples /tmp/$s/e2e-samples.json --out /tmp/$s >>"$LOG" 2>&1 ;;
                  esac
                  for f in results.json results.md e2e-samples.json; do cp /tmp/$s/$f "$OUT/$s-$f" 2>/dev/null; done ;;
    # E2E_LRS: learning rates to run (one run each, outputs e2e-train-LR-*; default: the
    # script's), E2E_STEPS: steps per implementation.
    e2e-train)    python3 -m pip install -q --no-deps --no-index --target /tmp/flashmoe-site \
                    target/py-device/flashmoe-*.whl >>"$LOG" 2>&1
                  for lr in ${E2E_LRS:-default}; do
                    d=/tmp/e2e-train-$lr; lr_arg=(); [ "$lr" = default ] || lr_arg=(--lr "$lr")
                    stage e2e-train-$lr 480 env PYTHONPATH=/tmp/flashmoe-site python3 python/flashmoe_e2e.py --train \
                      --steps "${E2E_STEPS:-60}" "${lr_arg[@]}" --preset all --only small:4x512,medium:4x512,qwen3-30b-a3b:4x512 \
                      --impl sdpa-cudnn,sdpa-flash,flashmoe-attn,flashmoe,planted-wrong-dk --out $d
                    $BIN bench e2e --from-samples $d/e2e-samples.json --out $d >>"$LOG" 2>&1
                    for f in results.json results.md report.html e2e-samples.json; do cp $d/$f "$OUT/e2e-train-$lr-$f" 2>/dev/null; done
                  done ;;
    check-quick)  stage check-quick 300 $BIN check --suite attention --quick ;;
    # The attention plans' GPU tests (dense, varlen, decode; windows and softcap included).
    # The attention backward (issue 40): the f64 gate on both kernel paths and every sm_90a
    # tile, both modes after the forward plan, bad input, bit-identity over repeats (beside a
    # second stream); the speed table (host timing of every tile); memcheck and racecheck over
    # the partial-tile cases of each dQ mode and two repeats; the Python package's backward
    # tests (carry target/py-device: scripts/device-python.sh --pack).
    bwd-unit)     stage bwd-unit 240 ./target/release/flashmoe-gpu-tests attention::backward::gpu_tests:: --skip backward_speed \
                      --skip backward_sanitizer_cases --test-threads=1 --nocapture ;;
    # The varlen backward: the f64 gate on the portable kernels and (9.0) the sm_90a pair's
    # dQ-kernel tiles, equal lengths bit-identical to the dense plan on each, after the
    # varlen forward, bad input; then both sanitizers over its small ragged cases.
    bwd-varlen)   stage bwd-varlen 300 ./target/release/flashmoe-gpu-tests attention::backward::varlen_gpu_tests:: \
                      --skip varlen_backward_speed --skip varlen_backward_sanitizer_cases --test-threads=1 --nocapture
                  for tool in memcheck racecheck; do
                    stage bwd-varlen-$tool 240 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 \
                      ./target/release/flashmoe-gpu-tests attention::backward::varlen_gpu_tests::varlen_backward_sanitizer_cases \
                      --test-threads=1 --nocapture
                  done ;;
    bwd-varlen-speed) stage bwd-varlen-speed 240 ./target/release/flashmoe-gpu-tests \
                      attention::backward::varlen_gpu_tests::varlen_backward_speed --nocapture ;;
    bwd-speed)    stage bwd-speed 420 ./target/release/flashmoe-gpu-tests attention::backward::gpu_tests::backward_speed --nocapture ;;
    bwd-sanitize) for tool in memcheck racecheck; do
                    FLASHMOE_BWD_REPEATS=2 stage bwd-$tool 240 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 \
                      ./target/release/flashmoe-gpu-tests attention::backward::gpu_tests::backward_sanitizer_cases \
                      attention::backward::gpu_tests::backward_repeats --test-threads=1 --nocapture
                  done ;;
    python-bwd)   PYTEST_FILES="tests/test_torch_gpu.py tests/test_torch_ops.py tests/test_flash_attn_interface.py" \
                    PYTEST_K="grad or determin or graph or backward or differentiable" \
                    stage python-bwd 300 bash scripts/device-python.sh target/py-device ;;
    # The PyTorch front end's padded head dims (odd, varlen, backward) and in-call rotary.
    python-pad)   PYTEST_FILES="tests/test_torch_gpu.py" PYTEST_K="value_head_dim or rotary or attention_errors" \
                    stage python-pad 240 bash scripts/device-python.sh target/py-device ;;
    unit-attn)    stage unit-attn 300 ./target/release/flashmoe-gpu-tests attention:: --test-threads=1 --nocapture ;;
    # Sliding windows and softcap beside plain attention of the same visible length (issue 22).
    bench-window) stage bench-window 420 $BIN bench attention --preset window --max-time 1 --out /tmp/bench-window
                  for f in results.json results.md report.html; do cp /tmp/bench-window/$f "$OUT/window-$f" 2>/dev/null; done ;;
    # This build's sm_90a kernel against target/release/flashmoe-base's, interleaved in one run
    # (bench --against), on the window / softcap shapes of configs/dev/attention-window-ab.toml.
    window-ab)    stage window-ab 400 $BIN bench attention --config configs/dev/attention-window-ab.toml --impl flashmoe-sm90 \
                    --no-baselines --against ./target/release/flashmoe-base --max-time 0.5 --out /tmp/window-ab
                  for f in results.json results.md; do cp /tmp/window-ab/$f "$OUT/window-ab-$f" 2>/dev/null; done ;;
    # The varlen suite (issue 22): its check matrix against the per-sequence references, and
    # the varlen preset with the PyTorch baselines (torch varlen_attn, SDPA cuDNN per sequence).
    # Head dims 96 and 256 on the sm_90a forward's lab tiles (issue 43): the GPU test against
    # the reference kernel, then the timing against the portable kernel and the baselines
    # (configs/dev/attention-lab-dims.toml); `check-d96`: the whole attention check suite (f64)
    # with the tile override, where its D = 96 and 256 configs run on sm_90a.
    check-d96)    FLASHMOE_SM90_TILE="96:128,2,2,0,qregs=1;256:64,2,2,0" stage check-d96 580 $BIN check --suite attention ;;
    fwd-d96)      stage fwd-d96-unit 200 ./target/release/flashmoe-gpu-tests gpu::gpu_tests::attention_sm90_lab_head_dims_match_reference \
                      --test-threads=1 --nocapture
                  FLASHMOE_SM90_TILE="96:128,2,2,0,qregs=1;256:64,2,2,0" stage fwd-d96-bench 400 $BIN bench attention \
                      --config configs/dev/attention-lab-dims.toml --impl flashmoe-sm90,flashmoe-v1,sdpa-cudnn,fa4 --max-time 0.5 --out /tmp/fwd-d96
                  cp /tmp/fwd-d96/results.json "$OUT/fwd-d96.json" 2>/dev/null ;;
    check-varlen) stage check-varlen 200 $BIN check --suite varlen ;;
    bench-varlen) stage bench-varlen 360 $BIN bench varlen --preset varlen --max-time 0.5 --out /tmp/bench-varlen
                  for f in results.json results.md report.html; do cp /tmp/bench-varlen/$f "$OUT/varlen-$f" 2>/dev/null; done ;;
    # compute-sanitizer memcheck + racecheck of the windowed and softcapped sm_90a variants
    # through their GPU unit tests (small shapes, dense and varlen).
    sanitize-window)
                  for tool in memcheck racecheck; do
                    stage "sanitize-window-$tool" 200 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 \
                      ./target/release/flashmoe-gpu-tests windows_and_softcap --test-threads=1
                  done ;;
    check)        stage check 580 $BIN check --suite attention ;;
    # Behaviour and speed unchanged by a refactor: this build against target/release/flashmoe-base
    # (bench --against, interleaved in one run) on the quick presets of every family and the
    # attention sweep, our implementations only; results packed into $OUT/against.tgz after
    # each run. The decode preset and the sweep take most of a call each: `against-decode`,
    # `against-sweep` run them alone; `against-quick` runs the three others.
    against-base) for run in "attention quick flashmoe-sm90,flashmoe-v1 300" "moe quick flashmoe-moe 300" \
                             "decode decode flashmoe-decode 300" "varlen varlen flashmoe-sm90 300" \
                             "attention sweep flashmoe-sm90 300"; do
                    against_run $run
                  done ;;
    against-quick) for run in "attention quick flashmoe-sm90,flashmoe-v1 300" "moe quick flashmoe-moe 300" \
                              "varlen varlen flashmoe-sm90 300"; do
                    against_run $run
                  done ;;
    against-decode) against_run decode decode flashmoe-decode 560 ;;
    against-sweep)  against_run attention sweep flashmoe-sm90 560 ;;
    bench-quick)  stage bench-quick 400 $BIN bench attention --preset quick --out /tmp/bench-quick
                  cp /tmp/bench-quick/results.json "$OUT/bench-quick.json" 2>/dev/null ;;
    sweep)        stage sweep 590 $BIN bench attention --preset sweep --out /tmp/sweep
                  for f in results.json results.md report.html; do cp /tmp/sweep/$f "$OUT/sweep-$f" 2>/dev/null; done ;;
    # The sweep with the kernels that matter for issue 6 only (faster than the full list):
    # bf16 (the preset) and fp16 (configs/attention-sweep-fp16.toml).
    sweep-core)   stage sweep-bf16 300 $BIN bench attention --preset sweep --impl flashmoe-sm90,flashmoe-v1,sdpa-cudnn,sdpa-flash,flex --max-time 1 --out /tmp/sweep-bf16
                  for f in results.json results.md; do cp /tmp/sweep-bf16/$f "$OUT/sweep-bf16-$f" 2>/dev/null; done ;;
    sweep-fp16)   stage sweep-fp16 300 $BIN bench attention --config configs/attention-sweep-fp16.toml --impl flashmoe-sm90,sdpa-cudnn,sdpa-flash --max-time 1 --out /tmp/sweep-fp16
                  for f in results.json results.md; do cp /tmp/sweep-fp16/$f "$OUT/sweep-fp16-$f" 2>/dev/null; done ;;
    check-moe)    stage check-moe 240 $BIN check --suite moe ;;
    # Gradients (--pass bwd): the backward plans against the f64 backward, one row per
    # gradient; then the backward against SDPA / FA4 / Flex and torch._grouped_mm autograd.
    check-grad)   for suite in attention varlen moe; do
                    stage check-grad-$suite 300 $BIN check --suite $suite --pass bwd
                  done ;;
    # The sm_90a backward at head dim 96 (FLASHMOE_BWD_KERNEL=sm90: not yet its default)
    # against SDPA cuDNN and FA4 in both modes (configs/dev/attention-bwd-d96.toml).
    bwd-d96-bench) FLASHMOE_BWD_KERNEL=sm90 stage bwd-d96-bench 400 $BIN bench attention --pass bwd \
                      --config configs/dev/attention-bwd-d96.toml --impl flashmoe-grad,flashmoe-grad-det,sdpa-cudnn,fa4,fa4-det \
                      --max-time 0.3 --out /tmp/bwd-d96
                   cp /tmp/bwd-d96/results.json "$OUT/bwd-d96.json" 2>/dev/null ;;
    bench-grad)   stage bench-grad-attn 540 $BIN bench attention --pass bwd --preset sweep --out /tmp/grad-attn
                  cp /tmp/grad-attn/results.json "$OUT/grad-attention-sweep.json" 2>/dev/null
                  stage bench-grad-moe 400 $BIN bench moe --pass fwd+bwd --preset qwen3-30b --out /tmp/grad-moe
                  cp /tmp/grad-moe/results.json "$OUT/grad-moe-qwen3-30b.json" 2>/dev/null ;;
    # Paged-KV decode (issue 22): its GPU unit tests, the check matrix, the decode preset
    # with the SDPA baselines and the paged preset (page 16 / 128 / Sk) without them.
    unit-decode)  stage unit-decode 200 ./target/release/flashmoe-gpu-tests attention::decode::gpu_tests --test-threads=1 --nocapture ;;
    check-decode) stage check-decode 240 $BIN check --suite decode ;;
    bench-decode) stage bench-decode 300 $BIN bench decode --preset decode --max-time 0.5 --out /tmp/bench-decode
                  for f in results.json results.md report.html; do cp /tmp/bench-decode/$f "$OUT/decode-$f" 2>/dev/null; done ;;
    bench-paged)  stage bench-paged 240 $BIN bench decode --preset paged --no-baselines --max-time 0.3 --out /tmp/bench-paged
                  for f in results.json results.md; do cp /tmp/bench-paged/$f "$OUT/paged-$f" 2>/dev/null; done ;;
    # MLA decode (issue 35): the check matrix against the library's f64 reference, and the mla
    # preset (DeepSeek-V3 shapes) with the SDPA / FlashInfer / FlashMLA baselines. The large
    # configs are checked against the key-blocked f64 computation on the host (no GPU
    # reference has MLA's head dims): most of the stage's time is that reference.
    check-mla)    stage check-mla 240 $BIN check --suite mla ;;
    bench-mla)    stage bench-mla 540 $BIN bench mla --preset mla --max-time 0.5 --out /tmp/bench-mla
                  for f in results.json results.md report.html; do cp /tmp/bench-mla/$f "$OUT/mla-$f" 2>/dev/null; done ;;
    # Whether the lab's memset flush sets a floor under B=1 decode (docs/design/attention-decode.md).
    flush-probe)  stage flush-probe 120 python3 tools/probes/l2_flush_probe.py ;;
    # memcheck + racecheck of the decode kernel on small paged shapes: a forced 6-way split
    # with the fused merge (graph replays) and the unsplit dense-cache case.
    sanitize-decode)
                  for tool in memcheck racecheck; do
                    stage "sanitize-decode-$tool" 150 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 \
                      ./target/release/flashmoe-gpu-tests attention::decode::gpu_tests::decode_replays_in_a_cuda_graph attention::decode::gpu_tests::dense_cache_is_one_page_per_sequence --test-threads=1
                  done ;;
    unit-moe)     stage unit-moe 120 ./target/release/flashmoe-gpu-tests moe:: --test-threads=1 --nocapture ;;
    # The MoE backward (issue 41): every gradient vs f64 on each row-GEMM path (portable,
    # sm_90a), bit-identity, graph replay, bad input; the per-kernel speed of both paths
    # at the issue's shapes; memcheck + racecheck over the bit-identity cases.
    moe-bwd-unit) stage moe-bwd-unit 300 ./target/release/flashmoe-gpu-tests moe::backward::gpu_tests:: --test-threads=1 --nocapture ;;
    moe-bwd-speed) stage moe-bwd-speed 420 ./target/release/flashmoe-gpu-tests moe::backward::gpu_tests::speed --ignored --nocapture ;;
    moe-train)    stage moe-train 540 $BIN bench moe --pass fwd+bwd --config configs/moe-train.toml \
                    --impl flashmoe-grad,moe-grouped-mm --out /tmp/moe-train
                  for f in results.json results.md report.html; do cp /tmp/moe-train/$f "$OUT/moe-train-$f" 2>/dev/null; done ;;
    moe-train-seed003) stage moe-train-seed003 540 env FLASHMOE_HOST_MEM_LIMIT_GB=118 $BIN bench moe --pass fwd+bwd \
                    --config configs/moe-train-seed003.toml --impl flashmoe-grad,moe-grouped-mm --out /tmp/moe-train-s3
                  for f in results.json results.md report.html; do cp /tmp/moe-train-s3/$f "$OUT/moe-train-seed003-$f" 2>/dev/null; done ;;
    moe-bwd-sanitize) for tool in memcheck racecheck; do
                    stage moe-bwd-$tool 200 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 \
                      ./target/release/flashmoe-gpu-tests moe::backward::gpu_tests::backward_is_bit_identical_run_to_run --test-threads=1
                  done ;;
    # The four MoE model presets with the PyTorch baselines, each with its own limit
    # (moe_limit); results are written after every config, so a stage cut by its limit
    # keeps the configs it finished. One JSON each: $OUT/moe-<preset>.json. Expected
    # ~8 min together, 9.7 min at the limits: give the call timeout_s 600.
    moe-presets)  for p in seed003 mixtral qwen3-30b deepseek-v3; do moe_preset $p; done ;;
    moe-seed003|moe-mixtral|moe-qwen3-30b|moe-deepseek-v3)
                  moe_preset "${s#moe-}" ;;
    moe-probe)    stage moe-probe 200 python3 tools/probes/moe_gemm_probe.py --quick ;;
    moe-small)    stage moe-small 300 $BIN bench moe --config configs/moe-small.toml --out /tmp/moe-small
                  cp /tmp/moe-small/results.json "$OUT/moe-small.json" 2>/dev/null ;;
    seeds)        stage seed002 200 $BIN bench attention --preset seed002 --out /tmp/seed002
                  cp /tmp/seed002/results.json "$OUT/seed002.json" 2>/dev/null
                  stage seed003 300 $BIN bench attention --preset seed003 --out /tmp/seed003
                  cp /tmp/seed003/results.json "$OUT/seed003.json" 2>/dev/null ;;
    gqa)          stage gqa 200 $BIN bench attention --config configs/attention-gqa.toml --out /tmp/gqa
                  cp /tmp/gqa/results.json "$OUT/gqa.json" 2>/dev/null ;;
    # seed003 2048 tokens with the 64- and 128-row sm_90 tiles and the portable kernels
    # (the 2048-token target; see docs/design/moe.md).
    moe-tiles)    for o in sm90-bm64 sm90-bm128 portable; do
                    stage "moe-tiles-$o" 150 env FLASHMOE_MOE_GEMM=$o $BIN bench moe --config configs/moe-2048.toml --impl flashmoe-moe,moe-grouped-mm --out /tmp/moe-tiles-$o
                    cp /tmp/moe-tiles-$o/results.json "$OUT/moe-tiles-$o.json" 2>/dev/null
                  done ;;
    # seed003 at 768-1536 tokens: 64-row tiles against the automatic 128-row choice.
    moe-tile-range) for o in sm90-bm64 auto; do
                    stage "moe-range-$o" 120 env FLASHMOE_MOE_GEMM=$o $BIN bench moe --config configs/dev/moe-tile-range.toml --impl flashmoe-moe --no-baselines --out /tmp/moe-range-$o
                    cp /tmp/moe-range-$o/results.json "$OUT/moe-range-$o.json" 2>/dev/null
                  done ;;
    # compute-sanitizer memcheck + racecheck over the sm_90a kernels on small shapes
    # (issue 6 asks for both on the attention kernel). Few samples: the tools are slow.
    # Only our kernels are checked (--kernel-name): racecheck reports hazards inside
    # cuBLAS's TMA GEMM (the bench's ceiling measurement), which it cannot model, and
    # stops recording after its hazard limit.
    sanitize|racecheck)
                  tools="memcheck racecheck"; [ "$s" = racecheck ] && tools=racecheck
                  for tool in $tools; do
                    stage "sanitize-attn-$tool" 240 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 --kernel-name kns=flash_attn_fwd_sm90 \
                      $BIN bench attention --config configs/dev/attention-sanitize.toml --impl flashmoe-sm90 --no-baselines --max-time 0.2 --out /tmp/san-attn-$tool
                    stage "sanitize-moe-$tool" 240 env FLASHMOE_MOE_GEMM=sm90 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 --kernel-name kns=moe_ \
                      $BIN bench moe --config configs/dev/moe-sanitize.toml --impl flashmoe-moe --no-baselines --max-time 0.2 --out /tmp/san-moe-$tool
                  done ;;
    # racecheck through the GPU unit tests instead (small sm_90a attention shapes: D 64
    # and 128, causal and not, GQA; the forced sm_90 MoE GEMM matrix): no cuBLAS in them.
    # (Through the bench, racecheck with --kernel-name crashed inside the bench's cuBLAS ceiling GEMM,
    # "Sanitizer failed to handle a hardware exception", before our kernels ran.)
    # Whether racecheck models mbarrier hand-offs (tools/probes/racecheck_mbarrier_probe.cu):
    # mode 0 mbarriers (warp arrival), 1 __syncthreads, 2 unsynchronised, 3 mbarriers (thread arrival).
    racecheck-probe)
                  stage racecheck-probe-build 120 /usr/local/cuda/bin/nvcc -arch=sm_90a -o /tmp/rc-probe tools/probes/racecheck_mbarrier_probe.cu
                  for m in 0 1 2 3; do
                    stage "racecheck-probe-mode$m" 60 /usr/local/cuda/bin/compute-sanitizer --tool racecheck /tmp/rc-probe $m
                  done ;;
    # A/B of sm_90a tiles on configs/dev/attention-tile-ab.toml: "default" plus each entry of
    # $TILE_AB (FLASHMOE_SM90_TILE values separated by '|'); one JSON per variant.
    tile-ab)      i=0
                  for t in default ${TILE_AB//|/ }; do
                    if [ "$t" = default ]; then envs=(); else envs=(FLASHMOE_SM90_TILE="$t"); fi
                    stage "tile-ab-$i" 150 env "${envs[@]}" $BIN bench attention --config configs/dev/attention-tile-ab.toml --impl flashmoe-sm90 --no-baselines --max-time 0.5 --out /tmp/tile-ab-$i
                    cp /tmp/tile-ab-$i/results.json "$OUT/tile-ab-$i.json" 2>/dev/null
                    echo "tile-ab-$i: $t" | tee -a "$LOG"
                    i=$((i + 1))
                  done ;;
    # A/B of builds (kernel sources differ): each entry of
    # $AB_BINS (executables taking flashmoe's arguments; a wrapper script may set
    # FLASHMOE_SM90_TILE) in turn, $AB_ROUNDS rounds (default 2), on $AB_CONFIG (default
    # configs/dev/attention-tile-ab.toml); JSON bin-ab-<round>-<index>.
    bin-ab)       read -r -a bins <<<"${AB_BINS:-$BIN}"
                  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
                    for k in "${!bins[@]}"; do
                      stage "bin-ab-$r-$k" 150 "${bins[$k]}" bench attention --config "${AB_CONFIG:-configs/dev/attention-tile-ab.toml}" --impl flashmoe-sm90 --no-baselines --max-time 0.5 --out /tmp/bin-ab-$r-$k
                      cp /tmp/bin-ab-$r-$k/results.json "$OUT/bin-ab-$r-$k.json" 2>/dev/null
                      echo "bin-ab-$r-$k: ${bins[$k]}" | tee -a "$LOG"
                    done
                  done ;;
    memcheck-unit)
                  stage memcheck-attn 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 \
                    ./target/release/flashmoe-gpu-tests attention_v1_matches_gpu_reference --test-threads=1 ;;
    racecheck-unit)
                  stage racecheck-attn 400 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 9 \
                    ./target/release/flashmoe-gpu-tests attention_v1_matches_gpu_reference --test-threads=1
                  stage racecheck-moe 200 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 9 \
                    ./target/release/flashmoe-gpu-tests moe_sm90_gemms_match_cpu_reference --test-threads=1 ;;
    # ncu over the MoE layer at seed003 2048 tokens: every layer kernel's time and bytes
    # (8 launches = one layer), then the full sections of both sm_90 GEMMs for the
    # 64-row (auto) and 128-row tiles. Text in $OUT/ncu-moe.txt.
    ncu-moe)      stage ncu-moe-layer 150 bash -c "$NCU -k regex:'^moe_(router|expert|permute|gather|gemm|combine)' --launch-count 8 \
                      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
                      $BIN bench moe --config configs/moe-2048.toml --impl flashmoe-moe --no-baselines --max-time 0.1 --out /tmp/ncu-moe-l >>$OUT/ncu-moe.txt 2>&1"
                  for o in sm90-bm64 sm90-bm128; do
                    stage "ncu-moe-$o" 200 bash -c "FLASHMOE_MOE_GEMM=$o $NCU -k regex:'^moe_gemm' --launch-count 2 $NCU_SECTIONS \
                      $BIN bench moe --config configs/moe-2048.toml --impl flashmoe-moe --no-baselines --max-time 0.1 --out /tmp/ncu-moe-$o >>$OUT/ncu-moe.txt 2>&1"
                  done ;;
    # ncu sections of the sm_90a attention kernel at D=128 S=4096 (configs/dev/attention-ncu.toml).
    ncu-attn)     stage ncu-attn 200 bash -c "$NCU -k regex:'^flash_attn_fwd_sm90' --launch-skip 2 --launch-count 1 $NCU_SECTIONS \
                      $BIN bench attention --config ${NCU_ATTN_CONFIG:-configs/dev/attention-ncu.toml} --impl flashmoe-sm90 --no-baselines --max-time 0.1 --out /tmp/ncu-attn >>$OUT/ncu-attn.txt 2>&1" ;;
    # ncu sections of the fast backward's dK/dV kernel (fused dQ), same shape, --pass bwd.
    # Per-instruction warp stalls of the fast dK/dV kernel (SourceCounters' pc sampling): the
    # stall reasons summed (details page) and the most-stalled SASS lines (scripts/ncu-sass-top.py);
    # the source page's CSV comes back as $OUT/ncu-src-bwd.csv.
    ncu-src-bwd)  stage ncu-src-bwd 240 bash -c "$NCU -k regex:'^flash_attn_bwd_sm90_dkdv' --launch-skip 2 --launch-count 1 \
                      --section SourceCounters --section WarpStateStats --metrics regex:smsp__pcsamp_warps_issue_stalled_.* \
                      --import-source no -f -o /tmp/ncu-src \
                      $BIN bench attention --pass bwd --config ${NCU_ATTN_CONFIG:-configs/dev/attention-ncu.toml} --impl flashmoe-grad --no-baselines --max-time 0.1 --out /tmp/ncu-src-b >>$OUT/ncu-src-bwd.txt 2>&1;
                    /usr/local/cuda/bin/ncu -i /tmp/ncu-src.ncu-rep --page details --print-details all >>$OUT/ncu-src-bwd.txt 2>&1;
                    /usr/local/cuda/bin/ncu -i /tmp/ncu-src.ncu-rep --page source --csv --print-source sass >$OUT/ncu-src-bwd.csv 2>>$OUT/ncu-src-bwd.txt;
                    python3 scripts/ncu-sass-top.py $OUT/ncu-src-bwd.csv >>$OUT/ncu-src-bwd.txt 2>&1" ;;
    ncu-bwd)      stage ncu-bwd 200 bash -c "$NCU -k regex:'^flash_attn_bwd_sm90_dkdv' --launch-skip 2 --launch-count 1 $NCU_SECTIONS \
                      $BIN bench attention --pass bwd --config ${NCU_ATTN_CONFIG:-configs/dev/attention-ncu.toml} --impl flashmoe-grad --no-baselines --max-time 0.1 --out /tmp/ncu-bwd >>$OUT/ncu-bwd.txt 2>&1" ;;
    # The v6 producer builds (4 loading warps, 1) beside their consumer-loaded twin (fused dQ, D 64/128 at 4k,
    # non-causal then causal; the test's order: twin, 4 warps, 1 warp): ncu sections of each
    # dK/dV kernel, to see why the producer loses non-causal (docs/design/attention-backward.md v6).
    ncu-bwd-producer) stage ncu-bwd-producer 300 bash -c "$NCU -k regex:'^flash_attn_bwd_sm90_dkdv' --launch-count 12 $NCU_SECTIONS \
                      ./target/release/flashmoe-gpu-tests attention::backward::gpu_tests::producer_profile_pairs --ignored \
                      --test-threads=1 --nocapture >>$OUT/ncu-bwd-producer.txt 2>&1" ;;
    worker-probe) stage worker-probe 300 python3 tools/probes/worker_gpu_probe.py ;;
    # Third-party baselines (docs/baselines.md, scripts/stage-baselines.sh). The archive
    # travels in parts of ≤ 33 MiB: `baselines-part` (one call per part but the last) keeps
    # the carried .baselines/part-* in /root/baselines-parts; `baselines` (the call with the
    # last part, each inside the warm window of the one before) adds this call's part,
    # checks the sha256, unpacks to /root/baselines-site and imports the packages. Every
    # later stage and call puts that site on PYTHONPATH (see the top of this script).
    baselines-part) mkdir -p /root/baselines-parts && cp .baselines/part-* /root/baselines-parts/ && ls -l /root/baselines-parts | tee -a "$LOG" ;;
    baselines)    mkdir -p /root/baselines-parts "$BASELINES_SITE"
                  cp .baselines/part-* /root/baselines-parts/ 2>/dev/null
                  cat /root/baselines-parts/part-* >/root/baselines-site.tar.xz
                  want=$(cut -d' ' -f1 .baselines/baselines-site.sha256 2>/dev/null)
                  got=$(sha256sum /root/baselines-site.tar.xz | cut -d' ' -f1)
                  echo "baselines archive sha256 $got (expected ${want:-unknown})" | tee -a "$LOG"
                  [ -n "$want" ] && [ "$want" != "$got" ] && echo "baselines: archive sha256 MISMATCH (a part is missing?)" | tee -a "$LOG"
                  stage baselines-unpack 180 tar -xJf /root/baselines-site.tar.xz -C "$BASELINES_SITE"
                  use_baselines_site
                  stage baselines-import 180 python3 -c "import flash_attn.cute, quack.gemm_interface, sys; sys.path.insert(0, 'python'); import flashmoe_packages as p; print(p.availability())" ;;
    # The sweep with the package baselines (FA4, FlashInfer, xFormers; after `baselines`)
    # beside cuDNN and FA2 (issue 24). FA4 alone took 177 s at --max-time 0.5 (2026-11-25).
    sweep-baselines)
                  stage sweep-baselines ${SWEEP_LIMIT:-480} $BIN bench attention --preset sweep \
                    --impl ${SWEEP_IMPLS:-flashmoe-sm90,fa4,flashinfer-prefill,xformers,sdpa-cudnn,sdpa-flash} \
                    --max-time ${SWEEP_MAX_TIME:-0.4} --out /tmp/sweep-baselines
                  for f in results.json results.md report.html; do cp /tmp/sweep-baselines/$f "$OUT/sweep-$f" 2>/dev/null; done ;;
    # ncu profiles of the sweep's key configs (D=128 S=4096 causal and not, D=64 S=8192):
    # about 20 s per (config, implementation) on the H100 (run of 2026-11-25).
    profile-key)  stage profile-key ${PROFILE_LIMIT:-540} $BIN profile attention --preset sweep --select sq4096_sk4096_d128,sq8192_sk8192_d64_full \
                    --impl ${PROFILE_IMPLS:-flashmoe-sm90,fa4,sdpa-cudnn,sdpa-flash,flashinfer-prefill} --out /tmp/profile-key
                  tar -C /tmp -czf "$OUT/profile-key.tgz" profile-key 2>/dev/null ;;
    *) echo "unknown stage $s" | tee -a "$LOG" ;;
  esac
done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw,clocks_event_reasons.active --format=csv >>"$LOG" 2>&1
echo "SUMMARY: $SUMMARY"
