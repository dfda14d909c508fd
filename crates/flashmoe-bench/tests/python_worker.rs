//! The Python side against the Rust side, without a GPU and without torch:
//!
//! - `python/flashmoe_inputs.py` reproduces `flashmoe::inputs` bit for bit (values,
//!   dtype rounding edge cases, per-tensor and per-problem checksums);
//! - the real worker without torch says so in one line and `baselines` returns that line;
//! - the protocol survives workers that never say hello, hang, crash, print garbage or
//!   speak another protocol version (fake workers, short timeouts), and a crashed worker
//!   is restarted at the next `prepare`;
//! - the gate checks O alone when a baseline provides no LSE.
//!
//! With `FLASHMOE_TEST_TORCH_PYTHON=/path/to/python` (a Python with torch), one more test
//! runs the real worker in its CPU development mode through the whole pipeline.
//!
//! Tests that need `python3` with numpy print "SKIPPED" and pass when it is missing.

use flashmoe::inputs::{checksum, generate, TensorId};
use flashmoe::reference::attention::AttentionOutput;
use flashmoe::{AttentionProblem, DType, MoeProblem, Scoring};
use flashmoe_bench::config::Suite;
use flashmoe_bench::results::ProblemSpec;
use flashmoe_bench::runner::pipeline::{gate, generated_inputs_checksum, inputs_checksum};
use flashmoe_bench::runner::python::{
    baselines, baselines_with, PythonWorker, WorkerError, WorkerOptions, ATTENTION_BASELINES,
};
use flashmoe_bench::runner::{Outputs, ReferenceOutputs, SuiteInputs};
use flashmoe_bench::varlen::VarlenProblem;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn pydir() -> PathBuf {
    repo().join("python")
}

fn python() -> String {
    std::env::var("FLASHMOE_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// python3 with numpy, or None (the caller prints SKIPPED).
fn python_with_numpy() -> Option<String> {
    let py = python();
    let ok = Command::new(&py)
        .args(["-c", "import numpy"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        Some(py)
    } else {
        eprintln!("SKIPPED: {py} with numpy is not available");
        None
    }
}

fn run_inputs_py(py: &str, args: &[&str]) -> String {
    let out = Command::new(py)
        .arg(pydir().join("flashmoe_inputs.py"))
        .args(args)
        .output()
        .expect("run flashmoe_inputs.py");
    assert!(
        out.status.success(),
        "flashmoe_inputs.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn tensor_id(n: u64) -> TensorId {
    match n {
        1 => TensorId::Q,
        2 => TensorId::K,
        3 => TensorId::V,
        4 => TensorId::DOut,
        10 => TensorId::MoeX,
        11 => TensorId::MoeRouter,
        12 => TensorId::MoeW13,
        13 => TensorId::MoeW2,
        14 => TensorId::MoeSharedW13,
        15 => TensorId::MoeSharedW2,
        16 => TensorId::MoeDOut,
        _ => panic!("unknown tensor id {n}"),
    }
}

#[test]
fn python_selftest_passes() {
    let Some(py) = python_with_numpy() else {
        return;
    };
    let out = run_inputs_py(&py, &["--selftest"]);
    assert!(out.contains("selftest passed"), "{out}");
}

/// The package baselines' mask arguments (pure Python, no torch): FlashAttention's
/// `window_size` and FlashInfer's `window_left` / `logits_soft_cap` for flashmoe's windows
/// (bottom-right aligned, causal folded in as a right edge of 0).
#[test]
fn package_baselines_map_windows_and_softcap() {
    let script = r#"
import sys
sys.path.insert(0, sys.argv[1])
import flashmoe_packages as pk

def attn(causal, window, softcap=0.0):
    return pk.Attn(None, None, None, None, 1, 8, 2, 64, 64, 64, causal, 0.125, window, softcap)

# FlashInfer: plain, causal, causal window, non-causal left-only window, softcap.
assert pk._flashinfer_mask(attn(False, (-1, -1))) == {"causal": False, "window_left": -1}
assert pk._flashinfer_mask(attn(True, (-1, 0))) == {"causal": True, "window_left": -1}
assert pk._flashinfer_mask(attn(True, (31, 0))) == {"causal": True, "window_left": 31}
assert pk._flashinfer_mask(attn(False, (31, -1))) == {"causal": False, "window_left": 31}
assert pk._flashinfer_mask(attn(True, (-1, 0), 30.0))["logits_soft_cap"] == 30.0
try:
    pk._flashinfer_mask(attn(False, (31, 5)))
    raise SystemExit("a right edge past the diagonal must be n/a")
except pk.Unavailable as e:
    assert "window_left only" in str(e), e
# FlashAttention: FA4 writes an unbounded side as None, FA2/FA3 as -1.
assert attn(True, (-1, 0)).fa_window_kwargs(True) == {"causal": True}
assert attn(True, (31, 0)).fa_window_kwargs(True) == {"causal": False, "window_size": (31, 0)}
assert attn(False, (31, -1)).fa_window_kwargs(False) == {"causal": False, "window_size": (31, -1)}
assert attn(False, (31, -1)).fa_window_kwargs(True) == {"causal": False, "window_size": (31, None)}
assert attn(False, (-1, -1), 50.0).fa_window_kwargs(True) == {"causal": False, "softcap": 50.0}
print("mask mappings ok")
"#;
    let out = Command::new(python())
        .args(["-c", script])
        .arg(pydir())
        .output()
        .expect("run python3");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("mask mappings ok"),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn generator_matches_python_bit_for_bit() {
    let Some(py) = python_with_numpy() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let inv_sqrt = |n: f32| 1.0 / n.sqrt(); // as MoeInputs::generate computes its scales
    let cases: Vec<(u64, u64, usize, f32, DType)> = vec![
        (42, 1, 1000, 1.0, DType::F32),
        (42, 1, 1000, 1.0, DType::Bf16),
        (0, 2, 4097, 1.0, DType::Bf16),
        (u64::MAX, 3, 1000, 3.0, DType::F16),
        (7, 12, 70_001, inv_sqrt(4096.0), DType::Bf16),
        (7, 13, 5000, inv_sqrt(11008.0), DType::F16),
        (9, 11, 3000, inv_sqrt(2048.0), DType::F32),
        // f16 subnormals and underflow to zero.
        (1, 10, 3000, 1e-5, DType::F16),
        (1, 10, 3000, 1e-7, DType::F16),
        // f16 overflow to infinity (max finite 65504).
        (2, 14, 2000, 70_000.0, DType::F16),
        // bf16 near its largest finite value: rounding may carry into infinity.
        (3, 15, 2000, 3.39e38, DType::Bf16),
        // bf16 subnormal range.
        (4, 1, 2000, 1e-39, DType::Bf16),
    ];
    for (i, &(seed, tid, len, scale, dt)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("case{i}.f32"));
        let out = run_inputs_py(
            &py,
            &[
                "--dump",
                &seed.to_string(),
                &tid.to_string(),
                &len.to_string(),
                &format!("0x{:08x}", scale.to_bits()),
                dt.name(),
                path.to_str().unwrap(),
            ],
        );
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        let rust = generate(seed, tensor_id(tid), len, scale, dt);
        let bytes = std::fs::read(&path).unwrap();
        let py_vals: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(py_vals.len(), len, "case {i}");
        let diff = rust
            .iter()
            .zip(&py_vals)
            .position(|(r, p)| r.to_bits() != *p);
        assert!(
            diff.is_none(),
            "case {i} {:?}: first difference at {}: rust {:08x} python {:08x}",
            cases[i],
            diff.unwrap(),
            rust[diff.unwrap()].to_bits(),
            py_vals[diff.unwrap()]
        );
        assert_eq!(
            v["checksum"].as_str().unwrap(),
            format!("{:016x}", checksum(&rust, dt)),
            "case {i} checksum"
        );
    }
}

#[test]
fn rounding_edge_cases_match_python() {
    let Some(py) = python_with_numpy() else {
        return;
    };
    let mut bits: Vec<u32> = vec![
        0x0000_0000,
        0x8000_0000,
        0x3f80_0000,
        0x3f80_8000,
        0x3f81_8000,
        0x3f80_8001,
        0x3f80_ffff,
        0x7f7f_ffff,
        0x7f7f_7fff,
        0x7f7f_8000,
        0xff7f_ffff,
        0x7f80_0000,
        0xff80_0000,
        0x0000_8000,
        0x0001_8000,
        0x0000_0001,
        0x807f_ffff,
        0x3a80_1000,
        0x3380_0000,
        0x3370_0000,
        0x3300_0000,
        0x3880_0000,
        0x387f_c000,
        0x4780_0000,
        0x477f_f000,
        0x477f_efff,
        0x477f_f001,
        0xc77f_f000,
        0x3f80_1000,
        0x3f80_3000,
        0x3f80_2000,
        0x3f80_2001,
    ];
    // A spread of values with every low-bit pattern (NaN payloads excluded: the generator
    // never produces NaN, and quieting rules differ between libraries).
    bits.extend(
        (0..400u32)
            .map(|i| 0x3000_0000u32.wrapping_add(i.wrapping_mul(0x0123_4567)) ^ (i << 31))
            .filter(|&b| !f32::from_bits(b).is_nan()),
    );
    let hex: Vec<String> = bits.iter().map(|b| format!("{b:08x}")).collect();
    for dt in [DType::F16, DType::Bf16] {
        let mut args = vec!["--round", dt.name()];
        args.extend(hex.iter().map(String::as_str));
        let out = run_inputs_py(&py, &args);
        let got: Vec<u32> = out
            .split_whitespace()
            .map(|h| u32::from_str_radix(h, 16).unwrap())
            .collect();
        assert_eq!(got.len(), bits.len());
        for ((&b, &g), h) in bits.iter().zip(&got).zip(&hex) {
            let want = dt.round(f32::from_bits(b)).to_bits();
            assert_eq!(
                g, want,
                "{dt}: rounding {h}: python {g:08x}, rust {want:08x}"
            );
        }
    }
}

fn attention_problem() -> AttentionProblem {
    AttentionProblem {
        seqlen_q: 5,
        seqlen_k: 9,
        heads_kv: 2,
        causal: true,
        ..AttentionProblem::new(2, 4, 5, 32, true, DType::Bf16)
    }
}

fn moe_problem(dtype: DType, shared: bool) -> MoeProblem {
    MoeProblem {
        tokens: 7,
        hidden: 64,
        intermediate: 48,
        experts: 6,
        top_k: 2,
        scoring: Scoring::Softmax,
        renormalize: true,
        dtype,
        shared_expert: shared,
    }
}

#[test]
fn problem_checksum_matches_inputs_checksum() {
    let Some(py) = python_with_numpy() else {
        return;
    };
    let mut problems = vec![ProblemSpec::Attention(attention_problem())];
    for dt in [DType::F16, DType::Bf16, DType::F32] {
        problems.push(ProblemSpec::Attention(AttentionProblem {
            dtype: dt,
            ..attention_problem()
        }));
        problems.push(ProblemSpec::Moe(moe_problem(dt, dt == DType::Bf16)));
        // Varlen: the packed tensors of ragged sequences, empty ones included.
        let mut v = VarlenProblem::new(&[], 6, 2, 64, true, dt);
        v.seqlens = vec![(37, 300), (0, 5), (129, 129), (7, 0), (1, 1)];
        problems.push(ProblemSpec::Varlen(v));
        // MLA: q and the dense latent (no value tensor); f32 has no MLA kernel but the
        // generator is the same.
        let mut m = flashmoe_bench::mla::MlaProblem::new(2, 3, 2, 70, 16, dt);
        m.seqlens_k = vec![70, 5];
        problems.push(ProblemSpec::Mla(m));
    }
    // Gradient configs: the forward's tensors, then d_out (`grad_specs`).
    {
        use flashmoe_bench::grad::{GradLayer, GradProblem, Pass};
        let mut v = VarlenProblem::new(&[], 4, 2, 32, true, DType::F16);
        v.seqlens = vec![(9, 30), (0, 5), (17, 17)];
        for layer in [
            GradLayer::Attention(attention_problem()),
            GradLayer::Moe(moe_problem(DType::Bf16, true)),
            GradLayer::Varlen(v),
        ] {
            problems.push(ProblemSpec::Grad(GradProblem::new(Pass::Bwd, layer)));
        }
    }
    for (i, p) in problems.iter().enumerate() {
        let seed = 0x5eed + i as u64;
        let dtype = p.workload().dtype();
        let inputs = SuiteInputs::generate(p, seed);
        let want = generated_inputs_checksum(p, seed, &inputs);
        if !matches!(p, ProblemSpec::Mla(_)) {
            assert_eq!(want, inputs_checksum(&inputs, dtype));
        }
        let out = run_inputs_py(
            &py,
            &[
                "--problem-checksum",
                &serde_json::to_string(p).unwrap(),
                &seed.to_string(),
            ],
        );
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["input_checksum"].as_str().unwrap(), want, "{}", p.label());
    }
}

/// A directory with a `torch` package that fails to import, put first on PYTHONPATH, so
/// the test sees "no torch" even where torch is installed.
fn no_torch_env(dir: &Path) -> Vec<(String, String)> {
    let t = dir.join("torch");
    std::fs::create_dir_all(&t).unwrap();
    std::fs::write(
        t.join("__init__.py"),
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n",
    )
    .unwrap();
    vec![("PYTHONPATH".into(), dir.to_string_lossy().into_owned())]
}

#[test]
fn worker_without_torch_gives_one_clear_line() {
    let Some(py) = python_with_numpy() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut opts = WorkerOptions::new(&py);
    opts.env = no_torch_env(dir.path());
    opts.start_timeout = Duration::from_secs(60);
    let t0 = Instant::now();
    let err = match baselines_with(Suite::Attention, opts, 1) {
        Ok(_) => panic!("baselines without torch must fail"),
        Err(e) => e,
    };
    assert!(err.contains("torch not installed"), "{err}");
    assert!(!err.contains('\n'), "one line: {err}");
    assert!(t0.elapsed() < Duration::from_secs(60));
}

#[test]
fn missing_python_gives_one_clear_line() {
    let err = match baselines(Suite::Moe, Path::new("/nonexistent/python3"), 1) {
        Ok(_) => panic!("must fail"),
        Err(e) => e,
    };
    assert!(err.contains("/nonexistent/python3"), "{err}");
    assert!(err.contains("--python"), "{err}");
    assert!(!err.contains('\n'));
}

#[test]
fn missing_script_is_reported() {
    let Some(py) = python_with_numpy() else {
        return;
    };
    let mut opts = WorkerOptions::new(&py);
    opts.script = Some(PathBuf::from("/nonexistent/flashmoe_worker.py"));
    let err = PythonWorker::start(&opts).err().expect("must fail");
    assert!(err.contains("exited before its hello"), "{err}");
    assert!(err.contains("flashmoe_worker.py"), "{err}");
}

// ------------------------------------------------------------------ fake workers

const FAKE_WORKER: &str = r#"
import json, os, sys, time
mode = os.environ.get("FAKE_MODE", "ok")
crash_at = int(os.environ.get("FAKE_CRASH_AT_SAMPLE", "0"))

def send(o):
    sys.stdout.write(json.dumps(o) + "\n")
    sys.stdout.flush()

if mode == "no_hello":
    time.sleep(120)
if mode == "garbage_hello":
    print("Hello from a chatty library", flush=True)
    time.sleep(120)
send({"type": "hello", "protocol": 99 if mode == "old_protocol" else 1, "ok": True,
      "versions": {"python": "3.fake", "torch": "9.9-fake", "cuda": "13.0", "cudnn": "91900", "triton": "3.6"},
      "gpu": {"name": "Fake GPU", "l2_bytes": 52428800}, "device": "cuda", "timer": "cuda events",
      "flush_bytes": 104857600, "pid": os.getpid()})
samples = 0
handles = {}
next_handle = 1
while True:
    line = sys.stdin.readline()
    if not line:
        break
    req = json.loads(line)
    rid, op = req["id"], req["op"]
    if op == "quit":
        send({"id": rid, "ok": True})
        break
    if mode == "hang":
        time.sleep(120)
    if mode == "crash":
        sys.stderr.write("Traceback (most recent call last):\nRuntimeError: boom: simulated crash\n")
        sys.stderr.flush()
        sys.exit(3)
    if mode == "garbage":
        print("this is not json", flush=True)
        continue
    if op == "oom":
        send({"id": rid, "ok": False, "kind": "oom", "error": "CUDA out of memory (fake)"})
    elif op == "na":
        send({"id": rid, "ok": False, "kind": "na", "error": "head dim 48 not supported (fake)"})
    elif op == "fail":
        send({"id": rid, "ok": False, "kind": "error", "error": "ValueError: fake"})
    elif op == "prepare":
        sys.path.insert(0, os.environ["FLASHMOE_PYDIR"])
        import flashmoe_inputs as fi
        if req["impl"] == "sdpa-efficient":
            send({"id": rid, "ok": False, "kind": "na", "error": "No available kernel (fake)"})
            continue
        _, cs = fi.generate_problem(req["problem"], req["seed"])
        if req["impl"] == "sdpa-cudnn":
            cs = "0" * 16
        h = next_handle
        next_handle += 1
        handles[h] = req["problem"]
        send({"id": rid, "ok": True, "handle": h, "input_checksum": cs, "outputs": ["o"],
              "ceiling_only": False, "compile_ms": None, "notes": ["fake note"]})
    elif op == "run_for_check":
        p = handles[req["handle"]]
        n = p["batch"] * p["seqlen_q"] * p["heads_q"] * p["head_dim"]
        path = os.path.join(req["dir"], "o.f32")
        import struct
        with open(path, "wb") as f:
            f.write(struct.pack("<%df" % n, *([0.5] * n)))
        send({"id": rid, "ok": True, "files": {"o": {"path": path, "len": n}}, "peak_extra_bytes": 1234})
    elif op == "sample":
        samples += 1
        if samples == crash_at:
            sys.stderr.write("fake worker: crashing at sample %d\n" % samples)
            sys.exit(4)
        send({"id": rid, "ok": True, "ms": [0.125] * int(req.get("n", 1))})
    elif op == "release":
        send({"id": rid, "ok": True, "released": handles.pop(req["handle"], None) is not None})
    else:
        send({"id": rid, "ok": False, "kind": "protocol", "error": "unknown op %r" % op})
"#;

fn fake_options(dir: &Path, mode: &str, extra: &[(&str, &str)]) -> WorkerOptions {
    let script = dir.join("fake_worker.py");
    std::fs::write(&script, FAKE_WORKER).unwrap();
    let mut o = WorkerOptions::new(python());
    o.script = Some(script);
    o.env = vec![
        ("FAKE_MODE".into(), mode.into()),
        (
            "FLASHMOE_PYDIR".into(),
            pydir().to_string_lossy().into_owned(),
        ),
    ];
    o.env
        .extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    o.start_timeout = Duration::from_secs(30);
    o.request_timeout = Duration::from_secs(2);
    o.prepare_timeout = Duration::from_secs(30);
    o
}

fn have_python() -> bool {
    let ok = Command::new(python()).arg("-V").output().is_ok();
    if !ok {
        eprintln!("SKIPPED: no {}", python());
    }
    ok
}

#[test]
fn fake_worker_hello_fills_the_manifest() {
    if !have_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut w = PythonWorker::start(&fake_options(dir.path(), "ok", &[])).unwrap();
    let m = w.manifest();
    assert_eq!(m.torch, "9.9-fake");
    assert_eq!(m.gpu_name, "Fake GPU");
    assert_eq!(m.cudnn, "91900");
    assert_eq!(w.hello().flush_bytes, Some(104_857_600));
    assert!(w.is_alive());
    // Error kinds map to their variants and the worker goes on.
    let t = Duration::from_secs(5);
    assert!(
        matches!(w.request("oom", json!({}), t), Err(WorkerError::OutOfMemory(m)) if m.contains("fake"))
    );
    assert!(matches!(
        w.request("na", json!({}), t),
        Err(WorkerError::NotApplicable(_))
    ));
    assert!(matches!(
        w.request("fail", json!({}), t),
        Err(WorkerError::Failed(_))
    ));
    assert!(matches!(
        w.request("bogus", json!({}), t),
        Err(WorkerError::Protocol(_))
    ));
    assert!(w.request("sample", json!({"handle": 1, "n": 3}), t).is_ok());
    assert!(w.is_alive());
}

#[test]
fn a_worker_that_never_says_hello_times_out() {
    if !have_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut o = fake_options(dir.path(), "no_hello", &[]);
    o.start_timeout = Duration::from_secs(2);
    let t0 = Instant::now();
    let err = PythonWorker::start(&o).err().expect("must fail");
    assert!(err.contains("no hello within 2 s"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[test]
fn garbage_instead_of_hello_and_old_protocols_are_refused() {
    if !have_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let err = PythonWorker::start(&fake_options(dir.path(), "garbage_hello", &[]))
        .err()
        .expect("must fail");
    assert!(
        err.contains("not its hello") && err.contains("chatty"),
        "{err}"
    );
    let err = PythonWorker::start(&fake_options(dir.path(), "old_protocol", &[]))
        .err()
        .expect("must fail");
    assert!(err.contains("protocol 99"), "{err}");
}

#[test]
fn a_hanging_worker_is_killed_after_the_request_timeout() {
    if !have_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut w = PythonWorker::start(&fake_options(dir.path(), "hang", &[])).unwrap();
    let t0 = Instant::now();
    let e = w
        .request(
            "sample",
            json!({"handle": 1, "n": 1}),
            Duration::from_secs(1),
        )
        .unwrap_err();
    assert!(matches!(e, WorkerError::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(!w.is_alive());
    // Later requests fail at once instead of waiting again.
    let t1 = Instant::now();
    let e = w
        .request("sample", json!({"handle": 1}), Duration::from_secs(30))
        .unwrap_err();
    assert!(matches!(e, WorkerError::Died(_)), "{e}");
    assert!(t1.elapsed() < Duration::from_secs(1));
}

#[test]
fn a_crashing_worker_is_reported_with_its_stderr() {
    if !have_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut w = PythonWorker::start(&fake_options(dir.path(), "crash", &[])).unwrap();
    let e = w
        .request("sample", json!({"handle": 1}), Duration::from_secs(10))
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, WorkerError::Died(_)), "{msg}");
    assert!(
        msg.contains("exit status 3") && msg.contains("boom: simulated crash"),
        "{msg}"
    );
    assert!(!w.is_alive());
}

#[test]
fn garbage_on_stdout_is_a_protocol_error() {
    if !have_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut w = PythonWorker::start(&fake_options(dir.path(), "garbage", &[])).unwrap();
    let e = w
        .request("sample", json!({"handle": 1}), Duration::from_secs(10))
        .unwrap_err();
    assert!(
        matches!(&e, WorkerError::Protocol(m) if m.contains("this is not json")),
        "{e}"
    );
    assert!(!w.is_alive());
}

#[test]
fn implementations_check_inputs_and_restart_a_crashed_worker() {
    let Some(_) = python_with_numpy() else { return };
    let dir = tempfile::tempdir().unwrap();
    let opts = fake_options(dir.path(), "ok", &[("FAKE_CRASH_AT_SAMPLE", "3")]);
    let seed = 77;
    let (impls, manifest) = baselines_with(Suite::Attention, opts, seed).unwrap();
    assert_eq!(manifest.torch, "9.9-fake");
    let names: Vec<&str> = impls.iter().map(|i| i.name()).collect();
    assert_eq!(names, ATTENTION_BASELINES);
    let problem = ProblemSpec::Attention(attention_problem());
    let inputs = SuiteInputs::generate(&problem, seed);
    let by_name = |n: &str| impls.iter().find(|i| i.name() == n).unwrap();

    let moe = ProblemSpec::Moe(moe_problem(DType::Bf16, false));
    assert!(by_name("sdpa-flash").supports(&moe).is_err());
    assert!(by_name("sdpa-flash").supports(&problem).is_ok());

    // The worker's inputs checksum matches: prepared; outputs read back; no LSE.
    let mut p = by_name("sdpa-flash").prepare(&problem, &inputs).unwrap();
    match p.run_for_check().unwrap() {
        Outputs::Attention { o, lse } => {
            assert_eq!(o.len(), attention_problem().q_elems());
            assert!(o.iter().all(|&x| x == 0.5));
            assert!(lse.is_empty(), "no LSE file means an empty LSE");
        }
        _ => panic!("attention outputs expected"),
    }
    assert_eq!(p.peak_extra_bytes(), Some(1234));
    assert_eq!(p.sample().unwrap(), 0.125);
    assert_eq!(p.sample().unwrap(), 0.125);

    // A wrong checksum is refused; n/a comes back as "n/a: reason".
    let e = by_name("sdpa-cudnn")
        .prepare(&problem, &inputs)
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("inputs differ"), "{e:#}");
    let e = by_name("sdpa-efficient")
        .prepare(&problem, &inputs)
        .err()
        .unwrap();
    assert!(
        format!("{e:#}").starts_with("n/a: No available kernel"),
        "{e:#}"
    );

    // The worker crashes at its third sample: the error names it, the handle is gone.
    let e = p.sample().unwrap_err();
    assert!(format!("{e:#}").contains("crashing at sample 3"), "{e:#}");
    assert!(p.sample().is_err());
    // The next prepare restarts the worker; the old handle stays dead.
    let mut q = by_name("torch-naive").prepare(&problem, &inputs).unwrap();
    assert_eq!(q.sample().unwrap(), 0.125);
    let e = p.sample().unwrap_err();
    assert!(format!("{e:#}").contains("restarted"), "{e:#}");
    drop(p);
    drop(q);
}

#[test]
fn gate_checks_o_alone_when_no_lse_is_provided() {
    let p = attention_problem();
    let problem = ProblemSpec::Attention(p.clone());
    let n = p.q_elems();
    let reference = ReferenceOutputs::Attention(AttentionOutput {
        o: (0..n).map(|i| (i % 7) as f64 * 0.125).collect(),
        lse: vec![1.5; p.lse_elems()],
    });
    let o: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.125).collect();
    let no_lse = gate(
        &problem,
        &Outputs::Attention {
            o: o.clone(),
            lse: Vec::new(),
        },
        &reference,
        "ref",
    );
    assert!(no_lse.passed, "{no_lse:?}");
    assert!(
        no_lse.note.as_deref().unwrap().contains("LSE not provided"),
        "{no_lse:?}"
    );
    let bad_lse = gate(
        &problem,
        &Outputs::Attention {
            o: o.clone(),
            lse: vec![9.0; p.lse_elems()],
        },
        &reference,
        "ref",
    );
    assert!(!bad_lse.passed, "{bad_lse:?}");
    let good = gate(
        &problem,
        &Outputs::Attention {
            o,
            lse: vec![1.5; p.lse_elems()],
        },
        &reference,
        "ref",
    );
    assert!(good.passed, "{good:?}");
    let mut o_bad = vec![0.0f32; n];
    o_bad[0] = f32::NAN;
    let nan = gate(
        &problem,
        &Outputs::Attention {
            o: o_bad,
            lse: Vec::new(),
        },
        &reference,
        "ref",
    );
    assert!(!nan.passed, "NaN never passes, LSE or not");
}

/// Opt-in: the real worker with torch, in its CPU development mode, through the pipeline.
#[test]
fn real_worker_on_cpu_through_the_pipeline() {
    let Ok(py) = std::env::var("FLASHMOE_TEST_TORCH_PYTHON") else {
        eprintln!(
            "SKIPPED: set FLASHMOE_TEST_TORCH_PYTHON to a Python with torch to run this test"
        );
        return;
    };
    use flashmoe_bench::results::MeasureSettings;
    use flashmoe_bench::runner::cpu::CpuReference;
    use flashmoe_bench::runner::pipeline::Pipeline;
    use flashmoe_bench::runner::Implementation;
    use std::sync::atomic::AtomicBool;

    let settings = MeasureSettings {
        warmup_ms: 0.0,
        min_samples: 3,
        max_samples: 5,
        max_time_ms: 2000.0,
        ..MeasureSettings::default()
    };
    for (suite, problem) in [
        (
            Suite::Attention,
            ProblemSpec::Attention(attention_problem()),
        ),
        (
            Suite::Attention,
            ProblemSpec::Attention(AttentionProblem::new(1, 2, 64, 64, false, DType::F16)),
        ),
        (Suite::Moe, ProblemSpec::Moe(moe_problem(DType::Bf16, true))),
        (Suite::Varlen, {
            let mut v = VarlenProblem::new(&[], 4, 2, 64, true, DType::Bf16);
            v.seqlens = vec![(37, 60), (17, 17), (64, 64)];
            ProblemSpec::Varlen(v)
        }),
        (Suite::Mla, {
            let mut m = flashmoe_bench::mla::MlaProblem::new(2, 4, 2, 70, 16, DType::Bf16);
            m.seqlens_k = vec![70, 33];
            ProblemSpec::Mla(m)
        }),
    ] {
        let mut opts = WorkerOptions::new(&py);
        opts.device = Some("cpu".into());
        let (impls, manifest) = baselines_with(suite, opts, settings.seed).unwrap();
        assert!(!manifest.torch.is_empty());
        let refs: Vec<&dyn Implementation> = impls.iter().map(|b| b.as_ref()).collect();
        let pipeline = Pipeline {
            implementations: refs,
            reference: &CpuReference,
            candidate: impls[0].name().to_string(),
            settings: settings.clone(),
            ceilings: None,
            calibration: None,
        };
        let res = pipeline
            .run_config(&problem, &AtomicBool::new(false), |_| {})
            .unwrap();
        for row in &res.implementations {
            eprintln!(
                "{}: {:?} error={:?} acc={:?}",
                row.name,
                row.samples_ms.len(),
                row.error,
                row.accuracy
                    .as_ref()
                    .map(|a| (a.passed, a.rel_l2, a.note.clone()))
            );
        }
        let must_pass: &[&str] = match suite {
            Suite::Attention => &["sdpa-math", "torch-naive"],
            Suite::Moe => &["moe-naive-loop", "moe-grouped-mm"],
            Suite::Decode => &[],
            // The per-sequence SDPA loop (SDPA's CPU backend in development mode).
            Suite::Varlen => &["sdpa-cudnn-loop"],
            // SDPA on the gathered latent (the package baselines need CUDA).
            Suite::Mla => &["sdpa-mla"],
        };
        for name in must_pass {
            let row = res
                .implementations
                .iter()
                .find(|r| r.name == *name)
                .unwrap();
            assert!(row.is_usable(), "{name}: {row:?}");
            assert_eq!(row.input_checksum.as_deref().map(str::len), Some(16));
        }
    }
}
