//! GPU tests of [`MoePlan`]: against the lab's runner (bit-identical: same kernels) and
//! the CPU f64 reference, both grouped-GEMM paths, a shared expert, the cudarc path,
//! CUDA-graph replay of two layers with new inputs, two streams at once, and bad input.
//! Each prints "skipped: no GPU" and passes on a machine without one. Inputs are fresh
//! random values (seed printed); outputs are poisoned (NaN) first, and every compared
//! output is checked finite first, so a NaN never passes a bit-equality check.
//!
//! On the GPU machine: `cargo test -p flashmoe --release --lib -- moe::plan_gpu_tests
//! --nocapture --test-threads=1`.

use super::plan::{MoeArgs, MoeClass, MoePlan, MoeRouting, MoeWeights, RawU32, RoutingArgs};
use crate::accuracy::error_metrics;
use crate::dtype::DType;
use crate::error::Error;
use crate::gpu::test_support::{addr, fresh_seed, with_gpu};
use crate::gpu::{Device, RawTensor};
use crate::moe::{GpuRouting, MoeRunner};
use crate::problem::{MoeProblem, Scoring};
use crate::reference::moe::{compare_routing, moe_f64, MoeInputs};
use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtrMut};
use std::sync::Arc;

fn class(max_tokens: usize, top_k: usize, scoring: Scoring, dtype: DType) -> MoeClass {
    // hidden and intermediate are multiples of the sm_90 tiles (256 and 128 columns).
    MoeClass {
        dtype,
        hidden: 512,
        intermediate: 256,
        experts: 16,
        top_k,
        scoring,
        renormalize: true,
        shared_expert: false,
        max_tokens,
    }
}

/// 0xFF bytes on `stream`: NaN in f32 / f16 / bf16, 0xFFFFFFFF in u32.
fn poison<T>(stream: &Arc<CudaStream>, s: &mut CudaSlice<T>) {
    let n = s.len() * std::mem::size_of::<T>();
    let (p, _g) = s.device_ptr_mut(stream);
    unsafe { sys::cuMemsetD8Async(p, 0xFF, n, stream.cu_stream()) }
        .result()
        .unwrap();
}

fn bf16_buffer(stream: &Arc<CudaStream>, bits: &[u16]) -> CudaSlice<half::bf16> {
    let v: Vec<half::bf16> = bits.iter().map(|&b| half::bf16::from_bits(b)).collect();
    stream.clone_htod(&v).unwrap()
}

/// A layer's weights on the device (16-bit bits of the class's dtype).
struct Weights {
    router: CudaSlice<u16>,
    w13: CudaSlice<u16>,
    w2: CudaSlice<u16>,
    shared: Option<(CudaSlice<u16>, CudaSlice<u16>)>,
}

impl Weights {
    fn upload(stream: &Arc<CudaStream>, dt: DType, x: &MoeInputs) -> Weights {
        let up = |v: &[f32]| stream.clone_htod(&dt.encode_u16(v)).unwrap();
        Weights {
            router: up(&x.router),
            w13: up(&x.w13),
            w2: up(&x.w2),
            shared: match (&x.shared_w13, &x.shared_w2) {
                (Some(a), Some(b)) => Some((up(a), up(b))),
                _ => None,
            },
        }
    }
}

/// One call's activations and outputs, sized for `tokens`.
struct Io {
    tokens: usize,
    x: CudaSlice<u16>,
    out: CudaSlice<u16>,
    routing: MoeRouting,
}

impl Io {
    fn new(stream: &Arc<CudaStream>, c: &MoeClass, x: &[u16]) -> Io {
        let tokens = x.len() / c.hidden;
        let rc = MoeClass {
            max_tokens: tokens,
            ..*c
        };
        let mut io = Io {
            tokens,
            x: stream.clone_htod(x).unwrap(),
            out: stream.alloc_zeros::<u16>(tokens * c.hidden).unwrap(),
            routing: MoeRouting::new(stream, &rc).unwrap(),
        };
        io.poison(stream);
        io
    }
    fn poison(&mut self, stream: &Arc<CudaStream>) {
        poison(stream, &mut self.out);
        poison(stream, &mut self.routing.topk_ids);
        poison(stream, &mut self.routing.topk_w);
        poison(stream, &mut self.routing.counts);
        poison(stream, &mut self.routing.losses);
    }
    fn args(&self, stream: &Arc<CudaStream>, c: &MoeClass, w: &Weights) -> MoeArgs {
        let (t, h, i, e, k, dt) = (
            self.tokens,
            c.hidden,
            c.intermediate,
            c.experts,
            c.top_k,
            c.dtype,
        );
        let r = |p, s: &[usize]| RawTensor::contiguous(p, dt, s).unwrap();
        let f = |p, s: &[usize]| RawTensor::contiguous(p, DType::F32, s).unwrap();
        MoeArgs {
            x: r(addr(&self.x, stream), &[t, h]),
            router: r(addr(&w.router, stream), &[h, e]),
            w13: r(addr(&w.w13, stream), &[e, h, 2 * i]),
            w2: r(addr(&w.w2, stream), &[e, i, h]),
            shared_w13: w
                .shared
                .as_ref()
                .map(|s| r(addr(&s.0, stream), &[h, 2 * i])),
            shared_w2: w.shared.as_ref().map(|s| r(addr(&s.1, stream), &[i, h])),
            out: r(addr(&self.out, stream), &[t, h]),
            routing: RoutingArgs {
                topk_ids: RawU32 {
                    ptr: addr(&self.routing.topk_ids, stream),
                    len: t * k,
                },
                topk_w: f(addr(&self.routing.topk_w, stream), &[t, k]),
                counts: RawU32 {
                    ptr: addr(&self.routing.counts, stream),
                    len: e,
                },
                losses: f(addr(&self.routing.losses, stream), &[2]),
            },
            gate_up: None,
        }
    }
    /// (out as f32, topk_ids, topk_w, counts, losses), after the stream drains.
    fn results(&self, stream: &Arc<CudaStream>, dt: DType) -> Results {
        let out = stream.clone_dtoh(&self.out).unwrap();
        let ids = stream.clone_dtoh(&self.routing.topk_ids).unwrap();
        let w = stream.clone_dtoh(&self.routing.topk_w).unwrap();
        let counts = stream.clone_dtoh(&self.routing.counts).unwrap();
        let losses = stream.clone_dtoh(&self.routing.losses).unwrap();
        stream.synchronize().unwrap();
        Results {
            out: dt.decode_u16(&out),
            ids,
            w,
            counts,
            losses: [losses[0], losses[1]],
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Results {
    out: Vec<f32>,
    ids: Vec<u32>,
    w: Vec<f32>,
    counts: Vec<u32>,
    losses: [f32; 2],
}

impl Results {
    /// Everything written: finite floats, valid ids, counts summing to T·k.
    fn assert_written(&self, tag: &str, c: &MoeClass) {
        assert!(
            self.out.iter().all(|v| v.is_finite()),
            "{tag}: non-finite out"
        );
        assert!(
            self.w.iter().all(|v| v.is_finite()),
            "{tag}: non-finite topk_w"
        );
        assert!(
            self.losses.iter().all(|v| v.is_finite()),
            "{tag}: losses {:?}",
            self.losses
        );
        assert!(
            self.ids.iter().all(|&i| (i as usize) < c.experts),
            "{tag}: invalid id"
        );
        assert_eq!(
            self.counts.iter().map(|&n| n as usize).sum::<usize>(),
            self.ids.len(),
            "{tag}: counts"
        );
    }
    /// Bit-identical to `o` (floats compared by bits, after `assert_written`).
    fn assert_same(&self, tag: &str, o: &Results) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&self.out), bits(&o.out), "{tag}: out differs");
        assert_eq!(self.ids, o.ids, "{tag}: topk_ids differ");
        assert_eq!(bits(&self.w), bits(&o.w), "{tag}: topk_w differ");
        assert_eq!(self.counts, o.counts, "{tag}: counts differ");
        assert_eq!(bits(&self.losses), bits(&o.losses), "{tag}: losses differ");
    }
}

fn runner_results(dev: &Device, r: &mut MoeRunner) -> (Results, GpuRouting) {
    r.poison_outputs(dev).unwrap();
    r.run(dev).unwrap();
    dev.synchronize().unwrap();
    let g = r.gpu_routing(dev).unwrap();
    let res = Results {
        out: r.output(dev).unwrap(),
        ids: g.topk_ids.clone(),
        w: g.topk_w.clone(),
        counts: g.counts.clone(),
        losses: g.device_losses,
    };
    (res, g)
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// One call of `plan` at `tokens` (fresh inputs) against the runner on the same inputs
/// (bit-identical) and the CPU f64 reference (tolerance). `safe`: through the cudarc
/// wrapper instead of forward_raw.
fn check_against_runner(
    dev: &Device,
    plan: &MoePlan,
    ws: &mut crate::gpu::Workspace,
    tokens: usize,
    path: Option<&str>,
    safe: bool,
) {
    let c = *plan.class();
    let p: MoeProblem = c.problem(tokens);
    let tag = format!("{p} path {path:?} safe {safe}");
    let inputs = MoeInputs::generate(&p, fresh_seed(&tag));
    let stream = dev.stream();
    let w = Weights::upload(stream, c.dtype, &inputs);
    let mut io = Io::new(stream, &c, &c.dtype.encode_u16(&inputs.x));
    poison(stream, ws.buffer_mut());
    let (got, gate_up) = if safe {
        // The cudarc path over `half::bf16` buffers (candle's storage type).
        assert_eq!(c.dtype, DType::Bf16, "the safe path test uses bf16");
        let up = |v: &[f32]| bf16_buffer(stream, &c.dtype.encode_u16(v));
        let (router, w13, w2) = (up(&inputs.router), up(&inputs.w13), up(&inputs.w2));
        let shared = match (&inputs.shared_w13, &inputs.shared_w2) {
            (Some(a), Some(b)) => Some((up(a), up(b))),
            _ => None,
        };
        let weights = MoeWeights {
            router: &router,
            w13: &w13,
            w2: &w2,
            shared: shared.as_ref().map(|(a, b)| (a, b)),
        };
        let x = up(&inputs.x);
        let mut out = stream.alloc_zeros::<half::bf16>(tokens * c.hidden).unwrap();
        poison(stream, &mut out);
        plan.forward(stream, &x, tokens, &weights, &mut out, &mut io.routing, ws)
            .unwrap_or_else(|e| panic!("{tag}: {e}"));
        let mut r = io.results(stream, c.dtype);
        let o = stream.clone_dtoh(&out).unwrap();
        stream.synchronize().unwrap();
        r.out = o.iter().map(|v| v.to_f32()).collect();
        (r, None)
    } else {
        // The raw path also keeps the routed rows' gate/up (checked below; `out` must not
        // change, so the runner comparison covers it too).
        let rows = tokens * c.top_k;
        let mut gu = stream
            .alloc_zeros::<u16>(rows * 2 * c.intermediate)
            .unwrap();
        poison(stream, &mut gu);
        let gu_t =
            RawTensor::contiguous(addr(&gu, stream), c.dtype, &[rows, 2 * c.intermediate]).unwrap();
        let a = MoeArgs {
            gate_up: Some(gu_t),
            ..io.args(stream, &c, &w)
        };
        unsafe { plan.forward_raw(stream.cu_stream(), &a, ws.raw()) }
            .unwrap_or_else(|e| panic!("{tag}: {e}"));
        let gu_host = c.dtype.decode_u16(&stream.clone_dtoh(&gu).unwrap());
        (io.results(stream, c.dtype), Some(gu_host))
    };
    got.assert_written(&tag, &c);

    let mut runner = MoeRunner::with_gemm_path(dev, &p, &inputs, path).unwrap();
    assert_eq!(
        runner.gemm_path(),
        plan.gemm_path(tokens).unwrap(),
        "{tag}: same kernels"
    );
    let (want, g) = runner_results(dev, &mut runner);
    want.assert_written(&format!("{tag} runner"), &c);
    got.assert_same(&tag, &want);
    // Device losses (f32) against the host's f64 finish of the same sums.
    assert!(
        rel(got.losses[0] as f64, g.aux_loss) <= 1e-6,
        "{tag}: aux {:?} vs {}",
        got.losses,
        g.aux_loss
    );
    assert!(
        rel(got.losses[1] as f64, g.z_loss) <= 1e-6,
        "{tag}: z {:?} vs {}",
        got.losses,
        g.z_loss
    );

    // The CPU f64 reference (routing may differ only at near ties).
    let reference = moe_f64(&p, &inputs).unwrap();
    let cmp = compare_routing(&got.ids, &reference.routing, c.experts);
    assert_eq!(cmp.mismatched, 0, "{tag}: routing {cmp:?}");
    if cmp.near_ties == 0 {
        let counts: Vec<u32> = reference
            .routing
            .expert_counts
            .iter()
            .map(|&n| n as u32)
            .collect();
        assert_eq!(got.counts, counts, "{tag}: counts");
        assert!(
            rel(got.losses[0] as f64, reference.routing.aux_loss) <= 1e-4,
            "{tag}: aux"
        );
        assert!(
            rel(got.losses[1] as f64, reference.routing.z_loss) <= 1e-4,
            "{tag}: z"
        );
    }
    let m = error_metrics(&got.out, &reference.out);
    let tol = if c.dtype == DType::Bf16 { 1.6e-2 } else { 4e-3 };
    // The saved gate/up: x·W13 of every permuted row (experts ascending, tokens ascending
    // inside one: the reference's permutation) against f64.
    if let (Some(gu), 0) = (&gate_up, cmp.near_ties) {
        let perm = crate::reference::moe_grouped::permute(&p, &reference.routing);
        let (h, i2) = (c.hidden, 2 * c.intermediate);
        let mut want = vec![0f64; gu.len()];
        for e in 0..c.experts {
            for r in perm.offsets[e]..perm.offsets[e + 1] {
                let tok = perm.rows[r].0 as usize;
                for n in 0..i2 {
                    want[r * i2 + n] = (0..h)
                        .map(|k| {
                            inputs.x[tok * h + k] as f64 * inputs.w13[(e * h + k) * i2 + n] as f64
                        })
                        .sum();
                }
            }
        }
        let gm = error_metrics(gu, &want);
        assert_eq!(gm.non_finite, 0, "{tag}: gate_up has non-finite values");
        assert!(
            gm.rel_l2 <= tol,
            "{tag}: gate_up rel_l2 {} > {tol}",
            gm.rel_l2
        );
        eprintln!("  {tag}: gate_up rel_l2 {:.2e}", gm.rel_l2);
    }
    eprintln!(
        "  {tag}: {} | rel_l2 {:.2e} near ties {}",
        plan.gemm_path(tokens).unwrap(),
        m.rel_l2,
        cmp.near_ties
    );
    assert!(m.rel_l2 <= tol, "{tag}: rel_l2 {} > {tol}", m.rel_l2);
}

/// The paths to test on this device: auto and portable everywhere, sm90 forced on 9.0.
fn paths(dev: &Device) -> Vec<Option<&'static str>> {
    let mut v = vec![None, Some("portable")];
    if dev.arch() == 90 {
        v.push(Some("sm90"));
    } else {
        eprintln!(
            "  sm90 path skipped: compute capability {} is not 9.0",
            dev.arch()
        );
    }
    v
}

#[test]
fn plan_matches_runner_and_reference() {
    with_gpu("moe_plan_vs_runner", |dev| {
        for path in paths(dev) {
            for (top_k, scoring) in [(2, Scoring::Softmax), (8, Scoring::Sigmoid)] {
                let c = class(300, top_k, scoring, DType::Bf16);
                let plan = MoePlan::with_gemm_path(dev, c, 1, path).unwrap();
                eprintln!("{:?}", plan.token_ranges());
                let mut ws = plan.alloc_workspace(dev.stream()).unwrap();
                // One plan, several token counts (several ranges: regimes and, on the
                // auto path on an H100, portable below 48 rows per expert, sm_90 above).
                for (i, tokens) in [1, 7, 100, 300].into_iter().enumerate() {
                    check_against_runner(dev, &plan, &mut ws, tokens, path, i == 2);
                }
            }
        }
    });
}

#[test]
fn plan_shared_expert_and_fp16() {
    with_gpu("moe_plan_shared", |dev| {
        for path in paths(dev) {
            for dt in [DType::Bf16, DType::F16] {
                let c = MoeClass {
                    shared_expert: true,
                    renormalize: dt == DType::Bf16,
                    ..class(256, 2, Scoring::Softmax, dt)
                };
                let plan = MoePlan::with_gemm_path(dev, c, 1, path).unwrap();
                let mut ws = plan.alloc_workspace(dev.stream()).unwrap();
                for tokens in [7, 256] {
                    check_against_runner(dev, &plan, &mut ws, tokens, path, false);
                }
            }
        }
    });
}

fn random_x(c: &MoeClass, tokens: usize, seed: u64) -> Vec<u16> {
    let p = c.problem(tokens);
    c.dtype.encode_u16(&MoeInputs::generate(&p, seed).x)
}

/// Two layers captured in one CUDA graph (layer 2 reads layer 1's output), replayed 100
/// times with new x uploaded between replays, each replay compared bit for bit with the
/// same two layers run eagerly.
#[test]
fn plan_graph_replay_matches_eager() {
    with_gpu("moe_plan_graph", |dev| {
        let seed = fresh_seed("moe_plan_graph");
        let stream = dev.stream();
        let tokens = 200;
        // 200 tokens x 8 / 16 experts = 100 rows per expert: the sm_90 path on an H100.
        let c = class(tokens, 8, Scoring::Softmax, DType::Bf16);
        let plan = MoePlan::with_gemm_path(dev, c, 1, None).unwrap();
        eprintln!("  {}", plan.gemm_path(tokens).unwrap());
        let mut ws = plan.alloc_workspace(stream).unwrap();
        let p = c.problem(tokens);
        let w1 = Weights::upload(stream, c.dtype, &MoeInputs::generate(&p, seed ^ 1));
        let w2 = Weights::upload(stream, c.dtype, &MoeInputs::generate(&p, seed ^ 2));
        // Graph buffers: x → l1.out; l2.x is l1.out (same address).
        let mut l1 = Io::new(stream, &c, &random_x(&c, tokens, seed));
        let mut l2 = Io::new(stream, &c, &random_x(&c, tokens, seed ^ 3));
        let a1 = l1.args(stream, &c, &w1);
        let mut a2 = l2.args(stream, &c, &w2);
        a2.x = RawTensor::contiguous(addr(&l1.out, stream), c.dtype, &[tokens, c.hidden]).unwrap();
        // Eager buffers, same wiring.
        let mut e1 = Io::new(stream, &c, &random_x(&c, tokens, seed));
        let mut e2 = Io::new(stream, &c, &random_x(&c, tokens, seed ^ 3));
        let mut ws_e = plan.alloc_workspace(stream).unwrap();
        let b1 = e1.args(stream, &c, &w1);
        let mut b2 = e2.args(stream, &c, &w2);
        b2.x = RawTensor::contiguous(addr(&e1.out, stream), c.dtype, &[tokens, c.hidden]).unwrap();
        dev.synchronize().unwrap();

        let cu = stream.cu_stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        unsafe {
            plan.forward_raw(cu, &a1, ws.raw()).unwrap();
            plan.forward_raw(cu, &a2, ws.raw()).unwrap();
        }
        let graph = stream
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .unwrap()
            .expect("a captured graph");
        let mut prev = Vec::new();
        for replay in 0..100u64 {
            let x = random_x(&c, tokens, seed.wrapping_add(1000 + replay));
            l1.poison(stream);
            l2.poison(stream);
            poison(stream, ws.buffer_mut());
            stream.memcpy_htod(&x, &mut l1.x).unwrap();
            graph.launch().unwrap();
            e1.poison(stream);
            e2.poison(stream);
            poison(stream, ws_e.buffer_mut());
            stream.memcpy_htod(&x, &mut e1.x).unwrap();
            unsafe {
                plan.forward_raw(cu, &b1, ws_e.raw()).unwrap();
                plan.forward_raw(cu, &b2, ws_e.raw()).unwrap();
            }
            let tag = format!("replay {replay}");
            let (g1, g2) = (l1.results(stream, c.dtype), l2.results(stream, c.dtype));
            let (r1, r2) = (e1.results(stream, c.dtype), e2.results(stream, c.dtype));
            for (g, r, layer) in [(&g1, &r1, 1), (&g2, &r2, 2)] {
                let tag = format!("{tag} layer {layer}");
                g.assert_written(&tag, &c);
                r.assert_written(&tag, &c);
                g.assert_same(&tag, r);
            }
            // New x each replay: the graph really reads the buffer's new contents.
            assert_ne!(prev, g1.out, "{tag}: same output as the previous replay");
            prev = g1.out;
        }
    });
}

/// One plan on two streams at the same time, each with its own workspace, activations
/// and outputs: every result equals the same call run alone.
#[test]
fn plan_two_streams_concurrently() {
    with_gpu("moe_plan_streams", |dev| {
        let seed = fresh_seed("moe_plan_streams");
        let s1 = dev.stream().clone();
        let s2 = dev.context().new_stream().unwrap();
        let tokens = 512;
        let c = class(tokens, 8, Scoring::Softmax, DType::Bf16);
        let plan = MoePlan::with_gemm_path(dev, c, 1, None).unwrap();
        let p = c.problem(tokens);
        let w = Weights::upload(&s1, c.dtype, &MoeInputs::generate(&p, seed));
        let mut io1 = Io::new(&s1, &c, &random_x(&c, tokens, seed ^ 1));
        let mut io2 = Io::new(&s2, &c, &random_x(&c, tokens, seed ^ 2));
        let mut ws1 = plan.alloc_workspace(&s1).unwrap();
        let mut ws2 = plan.alloc_workspace(&s2).unwrap();
        s1.synchronize().unwrap();
        s2.synchronize().unwrap();
        let a1 = io1.args(&s1, &c, &w);
        let a2 = io2.args(&s2, &c, &w);
        // Alone, one after the other.
        unsafe { plan.forward_raw(s1.cu_stream(), &a1, ws1.raw()) }.unwrap();
        let alone1 = io1.results(&s1, c.dtype);
        unsafe { plan.forward_raw(s2.cu_stream(), &a2, ws2.raw()) }.unwrap();
        let alone2 = io2.results(&s2, c.dtype);
        alone1.assert_written("alone 1", &c);
        alone2.assert_written("alone 2", &c);
        assert_ne!(
            alone1.ids, alone2.ids,
            "different inputs, different routing"
        );
        // Together: 20 calls on each stream, interleaved, no sync in between.
        for round in 0..3 {
            io1.poison(&s1);
            io2.poison(&s2);
            poison(&s1, ws1.buffer_mut());
            poison(&s2, ws2.buffer_mut());
            for _ in 0..20 {
                unsafe {
                    plan.forward_raw(s1.cu_stream(), &a1, ws1.raw()).unwrap();
                    plan.forward_raw(s2.cu_stream(), &a2, ws2.raw()).unwrap();
                }
            }
            let (r1, r2) = (io1.results(&s1, c.dtype), io2.results(&s2, c.dtype));
            r1.assert_written("stream 1", &c);
            r2.assert_written("stream 2", &c);
            r1.assert_same(&format!("round {round} stream 1"), &alone1);
            r2.assert_same(&format!("round {round} stream 2"), &alone2);
        }
    });
}

/// Bad calls are errors naming the tensor and the rule; nothing is launched, and a
/// good call afterwards works.
#[test]
fn plan_bad_input_is_a_clear_error() {
    with_gpu("moe_plan_errors", |dev| {
        let stream = dev.stream();
        let c = class(16, 2, Scoring::Softmax, DType::Bf16);
        let plan = MoePlan::with_gemm_path(dev, c, 1, None).unwrap();
        let mut ws = plan.alloc_workspace(stream).unwrap();
        let p = c.problem(16);
        let inputs = MoeInputs::generate(&p, fresh_seed("moe_plan_errors"));
        let w = Weights::upload(stream, c.dtype, &inputs);
        let mut io = Io::new(stream, &c, &c.dtype.encode_u16(&inputs.x));
        let good = io.args(stream, &c, &w);
        let (h, i, e) = (c.hidden, c.intermediate, c.experts);
        let call = |a: &MoeArgs, ws_addr: u64, ws_bytes: usize| -> String {
            let ws = crate::gpu::RawWorkspace {
                ptr: ws_addr,
                bytes: ws_bytes,
            };
            match unsafe { plan.forward_raw(stream.cu_stream(), a, ws) } {
                Ok(()) => panic!("accepted a bad call: {a:?}"),
                Err(e) => e.to_string(),
            }
        };
        let expect = |what: &str, msg: String, needle: &str| {
            assert!(msg.contains(needle), "{what}: {msg}");
            eprintln!("  {what}: {msg}");
        };
        let (wa, wb) = (ws.raw().ptr, ws.raw().bytes);
        let mut a = good;
        a.w13 = RawTensor::contiguous(a.w13.ptr, c.dtype, &[e, h, i]).unwrap();
        expect("wrong shape", call(&a, wa, wb), "w13 has shape");
        let mut a = good;
        a.x.ptr += 2;
        expect("misaligned", call(&a, wa, wb), "x at");
        let mut a = good;
        a.w2.ptr += 8;
        expect("misaligned", call(&a, wa, wb), "16-byte aligned");
        let mut a = good;
        a.out.ptr = 0;
        expect("null", call(&a, wa, wb), "out is a null");
        let mut a = good;
        a.x.dtype = DType::F16;
        expect("dtype", call(&a, wa, wb), "x holds f16");
        let mut a = good;
        a.x = RawTensor::contiguous(a.x.ptr, c.dtype, &[17, h]).unwrap();
        a.out = RawTensor::contiguous(a.out.ptr, c.dtype, &[17, h]).unwrap();
        expect("too many tokens", call(&a, wa, wb), "17 tokens");
        let mut a = good;
        a.routing.topk_ids.len = 3;
        expect("topk_ids", call(&a, wa, wb), "topk_ids has 3");
        let mut a = good;
        a.shared_w13 = Some(a.w2);
        expect("shared", call(&a, wa, wb), "no shared expert");
        let mut a = good;
        a.x = RawTensor::new(a.x.ptr, c.dtype, &[16, h], &[2 * h, 1]).unwrap();
        expect("strided x", call(&a, wa, wb), "x must be contiguous");
        let need = plan.workspace_bytes(16).unwrap();
        expect("small workspace", call(&good, wa, need - 1), "workspace of");
        expect(
            "null workspace",
            call(&good, 0, wb),
            "at 0x0: the MoePlan needs",
        );
        expect(
            "misaligned workspace",
            call(&good, wa + 16, wb - 16),
            "256-byte aligned",
        );
        // The safe path: short buffers, another stream's workspace, no tokens.
        let up = |v: &[f32]| bf16_buffer(stream, &c.dtype.encode_u16(v));
        let (x, router, w13, w2) = (
            up(&inputs.x),
            up(&inputs.router),
            up(&inputs.w13),
            up(&inputs.w2),
        );
        let wts = MoeWeights {
            router: &router,
            w13: &w13,
            w2: &w2,
            shared: None,
        };
        let x = &x;
        let mut out = stream.alloc_zeros::<half::bf16>(8 * h).unwrap();
        match plan.forward(stream, x, 16, &wts, &mut out, &mut io.routing, &mut ws) {
            Err(Error::BufferSize { name, .. }) => assert_eq!(name, "out"),
            other => panic!("{other:?}"),
        }
        let s2 = dev.context().new_stream().unwrap();
        let mut ws2 = plan.alloc_workspace(&s2).unwrap();
        let mut out = stream.alloc_zeros::<half::bf16>(16 * h).unwrap();
        let e2 = plan
            .forward(stream, x, 16, &wts, &mut out, &mut io.routing, &mut ws2)
            .unwrap_err()
            .to_string();
        assert!(e2.contains("another stream"), "{e2}");
        let e3 = plan
            .forward(stream, x, 0, &wts, &mut out, &mut io.routing, &mut ws)
            .unwrap_err()
            .to_string();
        assert!(e3.contains("0 tokens"), "{e3}");
        // Plans that cannot be built.
        let e4 = MoePlan::with_gemm_path(dev, class(0, 2, Scoring::Softmax, DType::Bf16), 1, None)
            .unwrap_err()
            .to_string();
        assert!(e4.contains("max_tokens"), "{e4}");
        let e5 = MoePlan::with_gemm_path(dev, MoeClass { experts: 300, ..c }, 1, None)
            .unwrap_err()
            .to_string();
        assert!(e5.contains("experts = 300"), "{e5}");
        // Nothing bad was launched: a good call still works.
        io.poison(stream);
        unsafe { plan.forward_raw(stream.cu_stream(), &good, ws.raw()) }.unwrap();
        io.results(stream, c.dtype)
            .assert_written("after errors", &c);
    });
}

/// The expert-parallel layer with one rank (no communicator: the same code path with
/// nothing exchanged) against the single-GPU plan: output, routing and losses
/// bit-identical, at token counts on both GEMM paths, several calls of one layer.
#[test]
fn expert_parallel_world_one_matches_the_plan() {
    use crate::moe::ep::{ExpertParallelMoe, ExpertPlacement};
    with_gpu("moe_ep_world1_vs_plan", |dev| {
        if dev.arch() != 90 {
            eprintln!("  skipped: the expert-parallel layer needs the sm_90 token gather");
            return;
        }
        for (top_k, scoring) in [(2, Scoring::Softmax), (8, Scoring::Sigmoid)] {
            let c = class(300, top_k, scoring, DType::Bf16);
            let plan = MoePlan::new(dev, c).unwrap();
            let ws = plan.alloc_workspace(dev.stream()).unwrap();
            let placement = ExpertPlacement::even(c.experts, 1).unwrap();
            let mut ep = ExpertParallelMoe::new(dev, c, placement, None, 2).unwrap();
            let stream = dev.stream();
            for tokens in [1, 37, 300, 129] {
                let p = c.problem(tokens);
                let tag = format!("EP world 1 {p}");
                let inputs = MoeInputs::generate(&p, fresh_seed(&tag));
                let w = Weights::upload(stream, c.dtype, &inputs);
                let mut io = Io::new(stream, &c, &c.dtype.encode_u16(&inputs.x));
                let a = io.args(stream, &c, &w);
                unsafe { plan.forward_raw(stream.cu_stream(), &a, ws.raw()) }.unwrap();
                let want = io.results(stream, c.dtype);
                want.assert_written(&tag, &c);
                io.poison(stream);
                unsafe { ep.forward_raw(stream.cu_stream(), &a) }
                    .unwrap_or_else(|e| panic!("{tag}: {e}"));
                unsafe { ep.wait_stream(stream.cu_stream()) }.unwrap();
                let got = io.results(stream, c.dtype);
                got.assert_written(&tag, &c);
                got.assert_same(&tag, &want);
                let x = ep.last_exchange().unwrap();
                assert_eq!(
                    (x.rows, x.rows_sent(), x.rows_received()),
                    (tokens * top_k, 0, 0)
                );
                eprintln!(
                    "  {tag}: bit-identical ({})",
                    plan.gemm_path(tokens).unwrap()
                );
            }
        }
        // Bad set-ups are errors naming the rule.
        let c = class(64, 2, Scoring::Softmax, DType::Bf16);
        let shared = MoeClass {
            shared_expert: true,
            ..c
        };
        let one = ExpertPlacement::even(c.experts, 1).unwrap();
        let e = ExpertParallelMoe::new(dev, shared, one.clone(), None, 1).unwrap_err();
        assert!(e.to_string().contains("no shared expert"), "{e}");
        let two = ExpertPlacement::even(c.experts, 2).unwrap();
        let e = ExpertParallelMoe::new(dev, c, two, None, 1).unwrap_err();
        assert!(e.to_string().contains("communicator has 1"), "{e}");
        let e = ExpertParallelMoe::new(dev, c, one, None, 99).unwrap_err();
        assert!(e.to_string().contains("chunks"), "{e}");
    });
}
