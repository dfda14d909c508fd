//! GPU tests of [`AttentionPlan`]: strided views, concurrent streams, CUDA-graph replay,
//! the cudarc (candle-storage) path and bad input. Each prints "skipped: no GPU" and
//! passes on a machine without one. Inputs are fresh random values (seed printed).

use super::plan::{AttentionArgs, AttentionClass, AttentionPlan, Bshd};
use crate::dtype::DType;
use crate::gpu::test_support::{addr, fresh_seed, with_gpu};
use crate::gpu::{Device, RawTensor};
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use std::sync::Arc;

/// `n` values uniform in [-1, 1) (splitmix64), as bf16 bits.
fn random_bf16(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let x = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            half::bf16::from_f32(x).to_bits()
        })
        .collect()
}

fn upload(stream: &Arc<CudaStream>, v: &[u16]) -> CudaSlice<u16> {
    stream.clone_htod(v).unwrap()
}

fn poisoned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> CudaSlice<T> {
    // 0xFF bytes: NaN in bf16, f16 and f32.
    let mut s = stream.alloc_zeros::<T>(n).unwrap();
    poison_in_place(stream, &mut s);
    s
}

fn poison_in_place<T>(stream: &Arc<CudaStream>, s: &mut CudaSlice<T>) {
    let n = s.len() * std::mem::size_of::<T>();
    let (p, _g) = cudarc::driver::DevicePtrMut::device_ptr_mut(s, stream);
    unsafe { sys::cuMemsetD8Async(p, 0xFF, n, stream.cu_stream()) }
        .result()
        .unwrap();
}

fn bf16_to_f32(v: &[u16]) -> Vec<f32> {
    v.iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect()
}

/// One call's buffers: contiguous q, k, v, o, lse of a class.
struct Call {
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    o: CudaSlice<u16>,
    lse: CudaSlice<f32>,
    shape: (usize, usize, usize),
}

impl Call {
    fn new(
        stream: &Arc<CudaStream>,
        c: &AttentionClass,
        b: usize,
        sq: usize,
        sk: usize,
        seed: u64,
    ) -> Call {
        let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
        Call {
            q: upload(stream, &random_bf16(b * sq * hq * d, seed)),
            k: upload(stream, &random_bf16(b * sk * hkv * d, seed ^ 1)),
            v: upload(stream, &random_bf16(b * sk * hkv * d, seed ^ 2)),
            o: poisoned(stream, b * sq * hq * d),
            lse: poisoned(stream, b * hq * sq),
            shape: (b, sq, sk),
        }
    }
    fn args(&self, stream: &Arc<CudaStream>, c: &AttentionClass) -> AttentionArgs {
        let (b, sq, sk) = self.shape;
        let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
        let t = |p, s: &[usize]| RawTensor::contiguous(p, DType::Bf16, s).unwrap();
        AttentionArgs {
            q: t(addr(&self.q, stream), &[b, sq, hq, d]),
            k: t(addr(&self.k, stream), &[b, sk, hkv, d]),
            v: t(addr(&self.v, stream), &[b, sk, hkv, d]),
            o: t(addr(&self.o, stream), &[b, sq, hq, d]),
            lse: RawTensor::contiguous(addr(&self.lse, stream), DType::F32, &[b, hq, sq]).unwrap(),
        }
    }
    fn outputs(&self, stream: &Arc<CudaStream>) -> (Vec<u16>, Vec<f32>) {
        let o = stream.clone_dtoh(&self.o).unwrap();
        let l = stream.clone_dtoh(&self.lse).unwrap();
        stream.synchronize().unwrap();
        (o, l)
    }
}

fn class(d: usize, hq: usize, hkv: usize, causal: bool) -> AttentionClass {
    AttentionClass {
        dtype: DType::Bf16,
        head_dim: d,
        heads_q: hq,
        heads_kv: hkv,
        causal,
        softmax_scale: None,
        window: crate::problem::NO_WINDOW,
        softcap: 0.0,
    }
}

/// o: finite everywhere; lse finite (every row sees a key in these shapes).
fn assert_written(tag: &str, o: &[u16], lse: &[f32]) {
    assert!(
        bf16_to_f32(o).iter().all(|x| x.is_finite()),
        "{tag}: o has NaN/inf"
    );
    assert!(lse.iter().all(|x| x.is_finite()), "{tag}: lse has NaN/inf");
}

/// Relative L2 error of the plan's o against the lab's fp32 GPU reference kernel.
fn rel_l2_vs_reference(dev: &Device, c: &AttentionClass, call: &Call, o: &[u16]) -> f64 {
    let (b, sq, sk) = call.shape;
    let p = c.problem(b, sq, sk);
    let s = dev.stream();
    let q = bf16_to_f32(&s.clone_dtoh(&call.q).unwrap());
    let k = bf16_to_f32(&s.clone_dtoh(&call.k).unwrap());
    let v = bf16_to_f32(&s.clone_dtoh(&call.v).unwrap());
    let mut r = crate::attention::AttentionRunner::new(dev, &p, &q, &k, &v).unwrap();
    let (ro, _) = r.run_reference(dev).unwrap();
    let got = bf16_to_f32(o);
    let num: f64 = got
        .iter()
        .zip(&ro)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = ro.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// q, k and v as views into one packed (b, s, hq + 2 hkv, d) QKV buffer give the same
/// bits as contiguous tensors, and both match the fp32 reference.
#[test]
fn plan_strided_qkv_views_match_contiguous() {
    with_gpu("plan-strided", |dev| {
        let s = dev.stream();
        let seed = fresh_seed("plan-strided");
        for (d, causal, sq) in [
            (128, false, 300),
            (128, true, 257),
            (64, false, 129),
            (64, true, 300),
        ] {
            let c = class(d, 8, 2, causal);
            let plan = AttentionPlan::new(dev, c).unwrap();
            let ws = plan.alloc_workspace(s).unwrap();
            let b = 2;
            let call = Call::new(s, &c, b, sq, sq, seed + d as u64);
            unsafe { plan.forward_raw(s.cu_stream(), &call.args(s, &c), ws.raw()) }.unwrap();
            let (o_ref, lse_ref) = call.outputs(s);
            assert_written("contiguous", &o_ref, &lse_ref);
            let err = rel_l2_vs_reference(dev, &c, &call, &o_ref);
            eprintln!("plan D={d} causal={causal} Sq={sq}: rel L2 vs fp32 reference {err:.2e}");
            assert!(err < 1e-2, "rel L2 {err}");

            // Pack the same q, k, v into one buffer: row = [q heads | k heads | v heads].
            let (hq, hkv) = (c.heads_q, c.heads_kv);
            let w = hq + 2 * hkv;
            let (qh, kh, vh) = (
                s.clone_dtoh(&call.q).unwrap(),
                s.clone_dtoh(&call.k).unwrap(),
                s.clone_dtoh(&call.v).unwrap(),
            );
            let mut packed = vec![0u16; b * sq * w * d];
            for r in 0..b * sq {
                let dst = &mut packed[r * w * d..(r + 1) * w * d];
                dst[..hq * d].copy_from_slice(&qh[r * hq * d..(r + 1) * hq * d]);
                dst[hq * d..(hq + hkv) * d].copy_from_slice(&kh[r * hkv * d..(r + 1) * hkv * d]);
                dst[(hq + hkv) * d..].copy_from_slice(&vh[r * hkv * d..(r + 1) * hkv * d]);
            }
            let qkv = upload(s, &packed);
            let base = addr(&qkv, s);
            let strides = [sq * w * d, w * d, d, 1];
            let view = |off: usize, h: usize| {
                RawTensor::new(base + 2 * off as u64, DType::Bf16, &[b, sq, h, d], &strides)
                    .unwrap()
            };
            let o2: CudaSlice<u16> = poisoned(s, b * sq * hq * d);
            let lse2: CudaSlice<f32> = poisoned(s, b * hq * sq);
            let mut args = call.args(s, &c);
            args.q = view(0, hq);
            args.k = view(hq * d, hkv);
            args.v = view((hq + hkv) * d, hkv);
            args.o.ptr = addr(&o2, s);
            args.lse.ptr = addr(&lse2, s);
            // Both kernels take strided q, k and v (the portable one since issue 36).
            unsafe { plan.forward_raw(s.cu_stream(), &args, ws.raw()) }.unwrap();
            let o = s.clone_dtoh(&o2).unwrap();
            let l = s.clone_dtoh(&lse2).unwrap();
            assert!(
                o == o_ref,
                "D={d} causal={causal}: strided o differs from contiguous"
            );
            assert!(
                l.iter()
                    .zip(&lse_ref)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "strided lse differs"
            );
        }
    });
}

/// Two launches of one plan on two streams at the same time, each with its own
/// workspace, give the single-stream bits. D=128 non-causal at S=4096 so the kernel's
/// key-range split (its workspace records) is in use.
#[test]
fn plan_runs_on_two_streams_at_once() {
    with_gpu("plan-two-streams", |dev| {
        let s0 = dev.stream();
        let s1 = dev.context().new_stream().unwrap();
        let s2 = dev.context().new_stream().unwrap();
        let seed = fresh_seed("plan-two-streams");
        for (d, causal) in [(128, false), (64, true)] {
            let c = class(d, 16, 16, causal);
            let plan = AttentionPlan::new(dev, c).unwrap();
            let (b, sq) = (4, 4096);
            let calls = [
                Call::new(s0, &c, b, sq, sq, seed),
                Call::new(s0, &c, b, sq, sq, seed ^ 77),
            ];
            // Expected bits: each call alone on the lab stream.
            let ws0 = plan.alloc_workspace(s0).unwrap();
            let mut want = Vec::new();
            for call in &calls {
                unsafe { plan.forward_raw(s0.cu_stream(), &call.args(s0, &c), ws0.raw()) }.unwrap();
                want.push(call.outputs(s0));
                assert_written("alone", &want.last().unwrap().0, &want.last().unwrap().1);
            }
            let ws1 = plan.alloc_workspace(&s1).unwrap();
            let ws2 = plan.alloc_workspace(&s2).unwrap();
            s0.synchronize().unwrap();
            let (a0, a1) = (calls[0].args(s0, &c), calls[1].args(s0, &c));
            for _ in 0..20 {
                unsafe {
                    plan.forward_raw(s1.cu_stream(), &a0, ws1.raw()).unwrap();
                    plan.forward_raw(s2.cu_stream(), &a1, ws2.raw()).unwrap();
                }
            }
            s1.synchronize().unwrap();
            s2.synchronize().unwrap();
            for (i, call) in calls.iter().enumerate() {
                let got = call.outputs(s0);
                assert!(got.0 == want[i].0, "D={d}: stream {} o differs", i + 1);
                assert!(
                    got.1
                        .iter()
                        .zip(&want[i].1)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "D={d}: stream {} lse differs",
                    i + 1
                );
            }
            eprintln!("plan D={d} causal={causal}: 2 streams x 20 launches, bit-identical");
        }
    });
}

/// Several layers captured into a CUDA graph replay correctly, 100 times, with new data
/// written into the same input buffers between replays.
#[test]
fn plan_replays_in_a_cuda_graph() {
    with_gpu("plan-graph", |dev| {
        let s = dev.context().new_stream().unwrap();
        let seed = fresh_seed("plan-graph");
        let (b, sq) = (2, 512);
        // Layers of different classes; layer i reads q_i, k_i, v_i, writes o_i.
        let classes = [
            class(128, 32, 8, true),
            class(64, 16, 16, false),
            class(128, 16, 4, false),
        ];
        let plans: Vec<AttentionPlan> = classes
            .iter()
            .map(|c| AttentionPlan::new(dev, *c).unwrap())
            .collect();
        let wss: Vec<_> = plans
            .iter()
            .map(|p| p.alloc_workspace(&s).unwrap())
            .collect();
        let mut calls: Vec<Call> = classes
            .iter()
            .enumerate()
            .map(|(i, c)| Call::new(&s, c, b, sq, sq, seed + i as u64))
            .collect();
        let args: Vec<AttentionArgs> = calls
            .iter()
            .zip(&classes)
            .map(|(k, c)| k.args(&s, c))
            .collect();
        let mut eager_out: Vec<(CudaSlice<u16>, CudaSlice<f32>)> = calls
            .iter()
            .map(|c| (poisoned(&s, c.o.len()), poisoned(&s, c.lse.len())))
            .collect();
        let enqueue = |st: &Arc<CudaStream>| {
            for ((p, a), w) in plans.iter().zip(&args).zip(&wss) {
                unsafe { p.forward_raw(st.cu_stream(), a, w.raw()) }.unwrap();
            }
        };
        s.synchronize().unwrap();
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        enqueue(&s);
        let graph = s
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .unwrap()
            .expect("a captured graph");
        let mut checked = 0;
        for replay in 0..100u64 {
            if replay % 10 == 0 {
                // New inputs in the same buffers (the graph holds their addresses).
                for (i, call) in calls.iter_mut().enumerate() {
                    let n = call.q.len();
                    s.memcpy_htod(
                        &random_bf16(n, seed ^ (replay << 8) ^ i as u64),
                        &mut call.q,
                    )
                    .unwrap();
                }
            }
            graph.launch().unwrap();
            if replay % 10 == 9 {
                let got: Vec<_> = calls.iter().map(|c| c.outputs(&s)).collect();
                // Expected: the same layers run eagerly into their own poisoned outputs.
                for (((p, a), w), (o, l)) in
                    plans.iter().zip(&args).zip(&wss).zip(eager_out.iter_mut())
                {
                    poison_in_place(&s, o);
                    poison_in_place(&s, l);
                    let mut e = *a;
                    e.o.ptr = addr(o, &s);
                    e.lse.ptr = addr(l, &s);
                    unsafe { p.forward_raw(s.cu_stream(), &e, w.raw()) }.unwrap();
                }
                let want: Vec<(Vec<u16>, Vec<f32>)> = eager_out
                    .iter()
                    .map(|(o, l)| (s.clone_dtoh(o).unwrap(), s.clone_dtoh(l).unwrap()))
                    .collect();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_written("graph", &g.0, &g.1);
                    assert!(
                        g.0 == w.0,
                        "replay {replay}, layer {i}: graph o differs from eager"
                    );
                    assert!(
                        g.1.iter()
                            .zip(&w.1)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "replay {replay}, layer {i}: lse differs"
                    );
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 10);
        eprintln!("plan graph: 3 layers, 100 replays, 10 checkpoints with new inputs, bit-identical to eager");
    });
}

/// The cudarc path a candle user takes: a context with cudarc's event tracking on (as
/// candle leaves it), `CudaSlice<bf16>` storage, a plan from `Device::from_context`.
#[test]
fn plan_forward_on_cudarc_slices_of_a_borrowed_context() {
    with_gpu("plan-cudarc", |_| {
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let dev = Device::from_context(ctx.clone()).unwrap();
        let seed = fresh_seed("plan-cudarc");
        let c = class(128, 8, 2, true);
        let plan = AttentionPlan::new(&dev, c).unwrap();
        let mut ws = plan.alloc_workspace(&stream).unwrap();
        let (b, sq, sk) = (2, 200, 333);
        let (hq, hkv, d) = (8, 2, 128);
        let to_bf16 =
            |v: Vec<u16>| -> Vec<half::bf16> { v.into_iter().map(half::bf16::from_bits).collect() };
        let q = stream
            .clone_htod(&to_bf16(random_bf16(b * sq * hq * d, seed)))
            .unwrap();
        let k = stream
            .clone_htod(&to_bf16(random_bf16(b * sk * hkv * d, seed ^ 1)))
            .unwrap();
        let v = stream
            .clone_htod(&to_bf16(random_bf16(b * sk * hkv * d, seed ^ 2)))
            .unwrap();
        let mut o = stream.alloc_zeros::<half::bf16>(b * sq * hq * d).unwrap();
        let mut lse = stream.alloc_zeros::<f32>(b * hq * sq).unwrap();
        plan.forward(
            &stream,
            Bshd::contiguous(&q, [b, sq, hq, d]),
            Bshd::contiguous(&k, [b, sk, hkv, d]),
            Bshd::contiguous(&v, [b, sk, hkv, d]),
            Bshd::contiguous(&mut o, [b, sq, hq, d]),
            &mut lse,
            &mut ws,
        )
        .unwrap();
        let got: Vec<u16> = stream
            .clone_dtoh(&o)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let l = stream.clone_dtoh(&lse).unwrap();
        assert_written("cudarc", &got, &l);
        // Against the raw path on the lab device (same kernel, same bits).
        let labdev = Device::open(0).unwrap();
        let ls = labdev.stream();
        let lab_plan = AttentionPlan::new(&labdev, c).unwrap();
        let lws = lab_plan.alloc_workspace(ls).unwrap();
        let mut call = Call::new(ls, &c, b, sq, sk, seed);
        call.q = upload(ls, &random_bf16(b * sq * hq * d, seed));
        unsafe { lab_plan.forward_raw(ls.cu_stream(), &call.args(ls, &c), lws.raw()) }.unwrap();
        let (want, _) = call.outputs(ls);
        assert!(got == want, "cudarc path differs from the raw path");
        let err = rel_l2_vs_reference(&labdev, &c, &call, &want);
        assert!(err < 1e-2, "rel L2 {err}");

        // Bad input: each is an error naming the tensor and the rule.
        let bad = |r: crate::Result<()>, want: &str| {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(want), "expected '{want}' in: {e}");
        };
        bad(
            plan.forward(
                &stream,
                Bshd::contiguous(&q, [b, sq, hq, d]),
                Bshd::contiguous(&k, [b, sk, hkv + 1, d]),
                Bshd::contiguous(&v, [b, sk, hkv, d]),
                Bshd::contiguous(&mut o, [b, sq, hq, d]),
                &mut lse,
                &mut ws,
            ),
            "k has shape",
        );
        bad(
            plan.forward(
                &stream,
                Bshd::contiguous(&q, [b, sq + 1, hq, d]),
                Bshd::contiguous(&k, [b, sk, hkv, d]),
                Bshd::contiguous(&v, [b, sk, hkv, d]),
                Bshd::contiguous(&mut o, [b, sq + 1, hq, d]),
                &mut lse,
                &mut ws,
            ),
            "q's view",
        );
        let other = ctx.new_stream().unwrap();
        bad(
            plan.forward(
                &other,
                Bshd::contiguous(&q, [b, sq, hq, d]),
                Bshd::contiguous(&k, [b, sk, hkv, d]),
                Bshd::contiguous(&v, [b, sk, hkv, d]),
                Bshd::contiguous(&mut o, [b, sq, hq, d]),
                &mut lse,
                &mut ws,
            ),
            "another stream",
        );
        let mut args = call.args(ls, &c);
        args.k.ptr += 2;
        bad(
            unsafe { lab_plan.forward_raw(ls.cu_stream(), &args, lws.raw()) },
            "k at",
        );
        let mut args = call.args(ls, &c);
        args.v.ptr = 0;
        bad(
            unsafe { lab_plan.forward_raw(ls.cu_stream(), &args, lws.raw()) },
            "v is a null",
        );
        bad(
            unsafe { lab_plan.forward_raw(ls.cu_stream(), &call.args(ls, &c), Default::default()) },
            "workspace",
        );
        let mut args = call.args(ls, &c);
        args.q.dtype = DType::F16;
        bad(
            unsafe { lab_plan.forward_raw(ls.cu_stream(), &args, lws.raw()) },
            "q holds f16",
        );
        eprintln!("plan cudarc path: bit-identical to the raw path, bad input rejected");
    });
}

/// Sliding windows and softcap on the dense sm_90a kernel against the f64 reference: the
/// varlen tests' (causal, window, softcap) cases over square, chunked-prefill (Sk > Sq),
/// Sk < Sq and single-row shapes at both head dims, GQA, bf16 and f16. Outputs poisoned.
#[test]
fn plan_windows_and_softcap_match_the_reference() {
    use super::varlen_gpu_tests::{from_bits, to_bits};
    use crate::accuracy::{check, check_lse};
    use crate::reference::attention::{attention_f64, AttentionInputs};
    with_gpu("plan-window-softcap", |dev| {
        let s = dev.stream();
        let seed = fresh_seed("plan-window-softcap");
        let mut failures = Vec::new();
        let mut n = 0;
        // Besides the shared cases: logits pushed against the cap (scale 20 makes |scores| up
        // to ~75), below the kernel's fixed-max limit (softcap 30 in bf16) and above it (100).
        let saturating = [
            (true, (200, -1), 30.0, 20.0),
            (false, crate::problem::NO_WINDOW, 100.0, 20.0),
        ];
        let cases = super::varlen_gpu_tests::WINDOW_CASES
            .iter()
            .map(|&(c, w, cap)| (c, w, cap, None))
            .chain(
                saturating
                    .iter()
                    .map(|&(c, w, cap, sc)| (c, w, cap, Some(sc))),
            );
        let cases: Vec<_> = cases.collect();
        for (d, hq, hkv, dtype) in [
            (128, 4, 2, DType::Bf16),
            (64, 6, 2, DType::F16),
            (64, 4, 1, DType::Bf16),
            (128, 2, 2, DType::F16),
        ] {
            for &(causal, window, softcap, softmax_scale) in &cases {
                let c = AttentionClass {
                    dtype,
                    head_dim: d,
                    heads_q: hq,
                    heads_kv: hkv,
                    causal,
                    softmax_scale,
                    window,
                    softcap,
                };
                let plan = AttentionPlan::new(dev, c).unwrap();
                let ws = plan.alloc_workspace(s).unwrap();
                for (b, sq, sk) in [(2, 333, 333), (1, 200, 700), (1, 700, 200), (3, 1, 513)] {
                    let p = c.problem(b, sq, sk);
                    let x = AttentionInputs::generate(&p, seed ^ n);
                    let up = |v: &[f32]| s.clone_htod(&to_bits(v, dtype)).unwrap();
                    let call = Call {
                        q: up(&x.q),
                        k: up(&x.k),
                        v: up(&x.v),
                        o: poisoned(s, b * sq * hq * d),
                        lse: poisoned(s, b * hq * sq),
                        shape: (b, sq, sk),
                    };
                    let mut args = call.args(s, &c);
                    for t in [&mut args.q, &mut args.k, &mut args.v, &mut args.o] {
                        t.dtype = dtype;
                    }
                    unsafe { plan.forward_raw(s.cu_stream(), &args, ws.raw()) }.unwrap();
                    let (o, lse) = call.outputs(s);
                    let r = attention_f64(&p, &x).unwrap();
                    let o = from_bits(&o, dtype);
                    let (co, cl) = (check(&o, &r.o, dtype), check_lse(&lse, &r.lse));
                    if !co.passed || !cl.passed {
                        failures.push(format!("{p}: o {:?} lse {:?}", co.reason, cl.reason));
                    }
                    n += 1;
                }
            }
        }
        eprintln!("{n} window/softcap problems checked");
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    });
}
