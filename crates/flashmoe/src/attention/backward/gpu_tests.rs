//! GPU tests of [`AttentionBackwardPlan`]: dq, dk and dv against the f64 reference
//! (global relative L2 and a per-row bound), over head dims, dtypes, masks, Sq ≠ Sk,
//! GQA/MQA, windows, softcap and odd lengths; determinism (bit-identical reruns); bad
//! input; the forward → backward chain on the forward plan's o and lse; and the backward's
//! speed (TFLOP/s, 2.5 × the forward's FLOPs). Each prints "skipped: no GPU" and passes on
//! a machine without one. Inputs are fresh random values (seed printed); every output and
//! the workspace are poisoned (NaN) before a run.

use super::{
    backward_flops, default_kernel, sm90_serves, AttentionBackwardPlan, BackwardArgs, BwdKernel,
    BwdMode, Sm90BwdTile,
};
use crate::attention::plan::{AttentionArgs, AttentionClass, AttentionPlan};
use crate::dtype::DType;
use crate::gpu::raw::RawWorkspace;
use crate::gpu::test_support::{addr, fresh_seed, with_gpu};
use crate::gpu::{Device, RawTensor};
use crate::inputs::{generate, TensorId};
use crate::problem::{AttentionProblem, NO_WINDOW};
use crate::reference::attention::{attention_f64, AttentionInputs};
use crate::reference::attention_backward::attention_backward_f64;
use cudarc::driver::{sys, CudaSlice, CudaStream};
use std::sync::Arc;

pub(super) fn poisoned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> CudaSlice<T> {
    // 0xFF bytes: NaN in bf16, f16 and f32.
    let mut s = stream.alloc_zeros::<T>(n.max(1)).unwrap();
    let bytes = s.len() * std::mem::size_of::<T>();
    let (p, _g) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut s, stream);
    unsafe { sys::cuMemsetD8Async(p, 0xFF, bytes, stream.cu_stream()) }
        .result()
        .unwrap();
    drop(_g);
    s
}

#[derive(Debug, Clone, Copy)]
struct Case {
    d: usize,
    dtype: DType,
    hq: usize,
    hkv: usize,
    b: usize,
    sq: usize,
    sk: usize,
    causal: bool,
    window: (i32, i32),
    softcap: f32,
}

impl Case {
    fn new(
        d: usize,
        dtype: DType,
        hq: usize,
        hkv: usize,
        sq: usize,
        sk: usize,
        causal: bool,
    ) -> Case {
        Case {
            d,
            dtype,
            hq,
            hkv,
            b: 2,
            sq,
            sk,
            causal,
            window: NO_WINDOW,
            softcap: 0.0,
        }
    }
    fn class(&self) -> AttentionClass {
        AttentionClass {
            dtype: self.dtype,
            head_dim: self.d,
            heads_q: self.hq,
            heads_kv: self.hkv,
            causal: self.causal,
            softmax_scale: None,
            window: self.window,
            softcap: self.softcap,
        }
    }
    fn problem(&self) -> AttentionProblem {
        self.class().problem(self.b, self.sq, self.sk)
    }
}

/// Device buffers of one backward call (16-bit tensors as raw bits).
struct Bufs {
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    o: CudaSlice<u16>,
    d_o: CudaSlice<u16>,
    lse: CudaSlice<f32>,
    dq: CudaSlice<u16>,
    dk: CudaSlice<u16>,
    dv: CudaSlice<u16>,
    ws: CudaSlice<u8>,
}

impl Bufs {
    fn args(&self, s: &Arc<CudaStream>, c: &Case) -> BackwardArgs {
        let (qs, ks) = ([c.b, c.sq, c.hq, c.d], [c.b, c.sk, c.hkv, c.d]);
        let t = |p, sh: &[usize]| RawTensor::contiguous(p, c.dtype, sh).unwrap();
        BackwardArgs {
            q: t(addr(&self.q, s), &qs),
            k: t(addr(&self.k, s), &ks),
            v: t(addr(&self.v, s), &ks),
            o: t(addr(&self.o, s), &qs),
            d_o: t(addr(&self.d_o, s), &qs),
            lse: RawTensor::contiguous(addr(&self.lse, s), DType::F32, &[c.b, c.hq, c.sq]).unwrap(),
            dq: t(addr(&self.dq, s), &qs),
            dk: t(addr(&self.dk, s), &ks),
            dv: t(addr(&self.dv, s), &ks),
        }
    }
    fn ws(&self, s: &Arc<CudaStream>) -> RawWorkspace {
        RawWorkspace {
            ptr: addr(&self.ws, s),
            bytes: self.ws.len(),
        }
    }
    /// Fresh NaN gradients and workspace.
    fn repoison(&mut self, s: &Arc<CudaStream>) {
        self.dq = poisoned(s, self.dq.len());
        self.dk = poisoned(s, self.dk.len());
        self.dv = poisoned(s, self.dv.len());
        self.ws = poisoned(s, self.ws.len());
    }
    fn grads(&self, s: &Arc<CudaStream>) -> [Vec<u16>; 3] {
        let g = [
            s.clone_dtoh(&self.dq).unwrap(),
            s.clone_dtoh(&self.dk).unwrap(),
            s.clone_dtoh(&self.dv).unwrap(),
        ];
        s.synchronize().unwrap();
        g
    }
}

/// A case's inputs, upstream gradient, and the f64 forward's o (rounded to the dtype) and
/// lse: what a backward call reads.
struct CaseData {
    x: AttentionInputs,
    d_o: Vec<f32>,
    o: Vec<f32>,
    lse: Vec<f32>,
}

impl CaseData {
    fn generate(c: &Case, seed: u64) -> CaseData {
        let p = c.problem();
        let x = AttentionInputs::generate(&p, seed);
        let d_o = generate(seed ^ 0x5EED, TensorId::Q, x.q.len(), 1.0, c.dtype);
        let fwd = attention_f64(&p, &x).unwrap();
        let o = fwd.o.iter().map(|&v| c.dtype.round(v as f32)).collect();
        let lse = fwd.lse.iter().map(|&v| v as f32).collect();
        CaseData { x, d_o, o, lse }
    }
    /// Device copies, NaN gradients and a NaN workspace of `ws_bytes`.
    fn upload(&self, s: &Arc<CudaStream>, c: &Case, ws_bytes: usize) -> Bufs {
        let up = |v: &[f32]| s.clone_htod(&c.dtype.encode_u16(v)).unwrap();
        Bufs {
            q: up(&self.x.q),
            k: up(&self.x.k),
            v: up(&self.x.v),
            o: up(&self.o),
            d_o: up(&self.d_o),
            lse: s.clone_htod(&self.lse).unwrap(),
            dq: poisoned(s, self.x.q.len()),
            dk: poisoned(s, self.x.k.len()),
            dv: poisoned(s, self.x.v.len()),
            ws: poisoned(s, ws_bytes),
        }
    }
}

/// Relative L2 over everything, and the worst row's ‖out_r − ref_r‖ / max(‖ref_r‖, the
/// rms norm of the rows with a gradient / 4) (a floor so that rows of near-zero gradient,
/// whose few terms cancel, are judged at the tensor's scale; rows that see no key, exactly
/// zero, do not lower it). Also the count of non-finite outputs.
pub(super) fn errors(out: &[f32], reference: &[f64], row: usize) -> (f64, f64, usize) {
    let (mut num, mut den) = (0f64, 0f64);
    let mut bad = 0usize;
    for (&a, &r) in out.iter().zip(reference) {
        if !a.is_finite() {
            bad += 1;
            continue;
        }
        num += (a as f64 - r).powi(2);
        den += r * r;
    }
    let rows = reference
        .chunks(row)
        .filter(|r| r.iter().any(|&x| x != 0.0))
        .count();
    let floor = (den / rows.max(1) as f64).sqrt() / 4.0;
    let mut worst = 0f64;
    for (o, r) in out.chunks(row).zip(reference.chunks(row)) {
        let e: f64 = o
            .iter()
            .zip(r)
            .map(|(&a, &b)| (a as f64 - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let n: f64 = r.iter().map(|b| b * b).sum::<f64>().sqrt();
        worst = worst.max(e / n.max(floor).max(1e-30));
    }
    let rel = if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    (rel, worst, bad)
}

/// Run one case against the f64 reference on the kernels `new` selects; returns (worst
/// rel L2, worst row error).
fn check_case(dev: &Device, c: &Case, seed: u64) -> (f64, f64) {
    check_case_on(dev, c, seed, None)
}

/// [`check_case`] on the given kernels (`None`: the plan's selection).
fn check_case_on(dev: &Device, c: &Case, seed: u64, kernel: Option<BwdKernel>) -> (f64, f64) {
    let s = dev.stream();
    let data = CaseData::generate(c, seed);
    let want = attention_backward_f64(&c.problem(), &data.x, &data.d_o).unwrap();

    let plan = AttentionBackwardPlan::with_kernel(dev, c.class(), kernel).unwrap();
    let mut bufs = data.upload(s, c, plan.workspace_bytes(c.b, c.sq));
    unsafe { plan.backward_raw(s.cu_stream(), &bufs.args(s, c), bufs.ws(s)) }.unwrap();
    let got = bufs.grads(s);

    let tol = crate::accuracy::tolerance(c.dtype).rel_l2;
    let row_tol = 4.0 * tol;
    let mut worst = (0f64, 0f64);
    let mut report = String::new();
    for (name, g, r) in [
        ("dq", &got[0], &want.dq),
        ("dk", &got[1], &want.dk),
        ("dv", &got[2], &want.dv),
    ] {
        let (rel, row, bad) = errors(&c.dtype.decode_u16(g), r, c.d);
        report.push_str(&format!(" {name} rel L2 {rel:.2e} worst row {row:.2e};"));
        assert_eq!(
            bad, 0,
            "{c:?}: {name} has {bad} non-finite values (seed {seed})"
        );
        assert!(
            rel <= tol && row <= row_tol,
            "{c:?}: {name} rel L2 {rel:.3e} (tol {tol:.1e}), worst row {row:.3e} (tol \
             {row_tol:.1e}) (seed {seed})"
        );
        worst = (worst.0.max(rel), worst.1.max(row));
    }
    let kname = match plan.kernel() {
        BwdKernel::Portable => "portable",
        BwdKernel::Sm90(_) => "sm90",
    };
    eprintln!(
        "bwd[{kname}] D={} {:?} B={} Hq={} Hkv={} Sq={} Sk={} causal={} window={:?} \
         softcap={}:{report}",
        c.d, c.dtype, c.b, c.hq, c.hkv, c.sq, c.sk, c.causal, c.window, c.softcap
    );

    // Deterministic: a rerun into fresh NaN buffers gives the same bits (dk and dv always;
    // dq unless the sm_90a tile adds it with unordered reductions).
    bufs.repoison(s);
    unsafe { plan.backward_raw(s.cu_stream(), &bufs.args(s, c), bufs.ws(s)) }.unwrap();
    let again = bufs.grads(s);
    let dq_det = !matches!(plan.kernel(), BwdKernel::Sm90(t) if !t.dq.deterministic());
    for (name, a, b) in [("dq", 0, 0), ("dk", 1, 1), ("dv", 2, 2)] {
        if name == "dq" && !dq_det {
            continue;
        }
        assert!(got[a] == again[b], "{c:?}: {name} differs between two runs");
    }
    worst
}

#[test]
fn backward_matches_f64_reference() {
    with_gpu("bwd-reference", |dev| {
        let seed = fresh_seed("bwd-reference");
        use DType::{Bf16, F16};
        let mut cases = vec![
            Case::new(64, Bf16, 4, 4, 200, 200, false),
            Case::new(64, Bf16, 4, 4, 77, 77, true),
            Case::new(128, Bf16, 4, 4, 200, 200, false),
            Case::new(128, Bf16, 4, 4, 200, 200, true),
            Case::new(64, F16, 4, 4, 200, 200, false),
            Case::new(128, F16, 4, 4, 77, 77, true),
            // Sq != Sk, both ways (causal Sq > Sk: the first rows see no key)
            Case::new(128, Bf16, 2, 2, 77, 200, true),
            Case::new(64, F16, 2, 2, 200, 77, true),
            Case::new(64, Bf16, 2, 2, 200, 77, false),
            Case::new(128, F16, 2, 2, 77, 200, false),
            // GQA and MQA
            Case::new(128, Bf16, 8, 2, 130, 130, true),
            Case::new(64, Bf16, 8, 2, 200, 150, false),
            Case::new(64, F16, 4, 1, 100, 100, true),
            Case::new(128, Bf16, 4, 1, 96, 160, false),
            // other head dims
            Case::new(32, Bf16, 2, 2, 150, 150, true),
            Case::new(96, F16, 2, 2, 150, 130, false),
            // longer: many blocks in both loops
            Case::new(128, Bf16, 2, 1, 1024, 1024, true),
            Case::new(64, Bf16, 2, 2, 700, 900, false),
        ];
        let mut w = |mut c: Case, window: (i32, i32), softcap: f32| {
            c.window = window;
            c.softcap = softcap;
            cases.push(c);
        };
        w(Case::new(64, Bf16, 4, 2, 200, 200, false), (32, 8), 0.0);
        w(Case::new(128, F16, 4, 4, 200, 260, true), (48, -1), 0.0);
        w(Case::new(128, Bf16, 4, 4, 300, 200, false), (-1, 20), 0.0);
        w(Case::new(64, Bf16, 2, 2, 200, 200, false), (100, 100), 0.0);
        w(Case::new(128, Bf16, 4, 2, 200, 200, true), NO_WINDOW, 5.0);
        w(Case::new(64, F16, 2, 2, 150, 150, false), NO_WINDOW, 2.0);
        w(Case::new(64, Bf16, 2, 1, 200, 180, false), (40, 0), 3.0);
        w(Case::new(128, F16, 2, 2, 77, 77, true), (10, -1), 30.0);
        let mut worst = (0f64, 0f64);
        for (n, c) in cases.iter().enumerate() {
            let e = check_case(dev, c, seed.wrapping_add(n as u64));
            worst = (worst.0.max(e.0), worst.1.max(e.1));
        }
        eprintln!(
            "bwd: {} cases passed; worst rel L2 {:.2e}, worst row {:.2e}",
            cases.len(),
            worst.0,
            worst.1
        );
    });
}

/// Both kernel paths on the classes the sm_90a backward serves (head dims 64/128, bf16 and
/// f16, causal or not, Sq ≠ Sk both ways, GQA/MQA, partial tiles, several blocks in both
/// loops), each against the f64 reference and rerun for identical bits; the sm_90a path
/// with every lab tile on a few of them. The sm_90a half needs compute capability 9.0
/// (it says so and checks only the portable path elsewhere).
#[test]
fn backward_sm90_and_portable_match_f64_reference() {
    with_gpu("bwd-sm90-reference", |dev| {
        let seed = fresh_seed("bwd-sm90-reference");
        use DType::{Bf16, F16};
        let cases = [
            Case::new(64, Bf16, 4, 4, 200, 200, false),
            Case::new(64, Bf16, 4, 4, 77, 77, true),
            Case::new(128, Bf16, 4, 4, 200, 200, false),
            Case::new(128, Bf16, 4, 4, 200, 200, true),
            Case::new(64, F16, 4, 4, 200, 200, true),
            Case::new(128, F16, 4, 4, 77, 77, false),
            Case::new(128, Bf16, 2, 2, 77, 200, true),
            Case::new(64, F16, 2, 2, 200, 77, true),
            Case::new(128, Bf16, 2, 2, 300, 130, false),
            Case::new(128, Bf16, 8, 2, 130, 130, true),
            Case::new(64, Bf16, 8, 2, 200, 150, false),
            Case::new(64, F16, 4, 1, 100, 100, true),
            Case::new(128, Bf16, 4, 1, 96, 160, false),
            Case::new(128, Bf16, 2, 1, 1024, 1024, true),
            Case::new(64, Bf16, 2, 2, 700, 900, false),
            Case::new(128, F16, 2, 2, 640, 384, true),
            // D = 96 (two panels, the second half-used): the kernel pair's tiles.
            Case::new(96, Bf16, 4, 2, 200, 177, true),
            Case::new(96, F16, 2, 2, 130, 300, false),
            Case::new(96, Bf16, 8, 1, 257, 257, true),
        ]
        .into_iter()
        .chain(
            // Sliding windows (left, right; -1 unbounded), bottom-right like the forward's:
            // key blocks skipped at both ends, rows seeing a band, Sq != Sk, GQA.
            [
                (Case::new(64, Bf16, 8, 2, 300, 333, true), (64, -1)),
                (Case::new(128, Bf16, 4, 4, 257, 257, false), (48, 16)),
                (Case::new(64, F16, 2, 1, 1000, 1000, true), (100, 0)),
                (Case::new(128, Bf16, 2, 2, 130, 400, false), (-1, 8)),
                (Case::new(96, Bf16, 4, 2, 300, 280, true), (70, 0)),
            ]
            .map(|(mut c, w)| {
                c.window = w;
                c
            }),
        )
        .chain(
            // Softcap (the tanh recovered from P for dS): small and large caps, with a
            // window, Sq != Sk, GQA, both dtypes and head dims.
            [
                (Case::new(64, Bf16, 4, 2, 200, 177, true), NO_WINDOW, 5.0),
                (Case::new(128, F16, 2, 2, 130, 200, false), NO_WINDOW, 30.0),
                (Case::new(64, F16, 2, 1, 257, 257, false), (48, 16), 2.0),
                (Case::new(128, Bf16, 8, 2, 300, 333, true), (64, -1), 50.0),
                (Case::new(96, F16, 4, 4, 177, 200, false), NO_WINDOW, 30.0),
            ]
            .map(|(mut c, w, cap)| {
                c.window = w;
                c.softcap = cap;
                c
            }),
        )
        .collect::<Vec<_>>();
        let sm90 = dev.arch() == 90;
        if !sm90 {
            eprintln!(
                "bwd-sm90-reference: compute capability {} — the sm_90a half is skipped",
                dev.arch()
            );
        }
        let mut worst = [(0f64, 0f64); 2];
        for (n, c) in cases.iter().enumerate() {
            assert!(sm90_serves(&c.class()));
            let sd = seed.wrapping_add(n as u64);
            let e = check_case_on(dev, c, sd, Some(BwdKernel::Portable));
            worst[0] = (worst[0].0.max(e.0), worst[0].1.max(e.1));
            if sm90 {
                let e = check_case_on(dev, c, sd, None);
                worst[1] = (worst[1].0.max(e.0), worst[1].1.max(e.1));
                // The production selection on this device is the sm_90a kernel, in both
                // modes; the deterministic one says so.
                for mode in [BwdMode::Fast, BwdMode::Deterministic] {
                    let plan = AttentionBackwardPlan::new(dev, c.class(), mode).unwrap();
                    assert_eq!(plan.kernel(), default_kernel(&c.class(), mode, 90), "{c:?}");
                    assert_eq!(plan.deterministic(), mode == BwdMode::Deterministic);
                }
                // The deterministic production tile (run above as the default, unless that
                // is the portable pair for this class); then every case: the fused-dQ
                // tiles, every fourth: the other lab tiles too.
                let det = Sm90BwdTile::for_class(&c.class(), BwdMode::Deterministic).unwrap();
                if !default_kernel(&c.class(), BwdMode::Deterministic, 90).is_sm90() {
                    eprintln!("  deterministic tile {det:?}:");
                    let e = check_case_on(dev, c, sd, Some(BwdKernel::Sm90(det)));
                    worst[1] = (worst[1].0.max(e.0), worst[1].1.max(e.1));
                }
                for t in Sm90BwdTile::lab_tiles(c.d) {
                    if t != det
                        && t.serves(&c.class())
                        && (t.dq.fused() || t.producer() || n % 4 == 1)
                    {
                        eprintln!("  tile {t:?}:");
                        let e = check_case_on(dev, c, sd, Some(BwdKernel::Sm90(t)));
                        worst[1] = (worst[1].0.max(e.0), worst[1].1.max(e.1));
                    }
                }
            }
        }
        eprintln!(
            "bwd-sm90-reference: {} cases; portable worst rel L2 {:.2e} row {:.2e}; sm90 worst \
             rel L2 {:.2e} row {:.2e}",
            cases.len(),
            worst[0].0,
            worst[0].1,
            worst[1].0,
            worst[1].1
        );
    });
}

/// The forward plan's o and lse feed the backward (the chain a training step runs), on
/// the kernel the forward plan picks for this device.
#[test]
fn backward_after_forward_plan() {
    with_gpu("bwd-after-fwd", |dev| {
        let seed = fresh_seed("bwd-after-fwd");
        let s = dev.stream();
        let cases = [
            Case::new(128, DType::Bf16, 8, 2, 333, 333, true),
            Case::new(64, DType::Bf16, 4, 4, 256, 300, false),
        ];
        for (c, mode) in cases
            .into_iter()
            .flat_map(|c| [(c, BwdMode::Fast), (c, BwdMode::Deterministic)])
        {
            let p = c.problem();
            let x = AttentionInputs::generate(&p, seed);
            let d_o = generate(seed ^ 0x5EED, TensorId::Q, x.q.len(), 1.0, c.dtype);
            let want = attention_backward_f64(&p, &x, &d_o).unwrap();
            let fplan = AttentionPlan::new(dev, c.class()).unwrap();
            let fws = fplan.alloc_workspace(s).unwrap();
            let plan = AttentionBackwardPlan::new(dev, c.class(), mode).unwrap();
            let up = |v: &[f32]| s.clone_htod(&c.dtype.encode_u16(v)).unwrap();
            let bufs = Bufs {
                q: up(&x.q),
                k: up(&x.k),
                v: up(&x.v),
                o: poisoned(s, x.q.len()),
                d_o: up(&d_o),
                lse: poisoned(s, c.b * c.hq * c.sq),
                dq: poisoned(s, x.q.len()),
                dk: poisoned(s, x.k.len()),
                dv: poisoned(s, x.v.len()),
                ws: poisoned(s, plan.workspace_bytes(c.b, c.sq)),
            };
            let a = bufs.args(s, &c);
            let fa = AttentionArgs {
                q: a.q,
                k: a.k,
                v: a.v,
                o: a.o,
                lse: a.lse,
            };
            unsafe { fplan.forward_raw(s.cu_stream(), &fa, fws.raw()) }.unwrap();
            unsafe { plan.backward_raw(s.cu_stream(), &a, bufs.ws(s)) }.unwrap();
            let got = bufs.grads(s);
            // The portable kernels on the same o and lse: the sm_90a kernels accumulate dk
            // and dv in the same order, so they give the same bits; dq too unless the tile
            // makes it in the dK/dV kernel (per key block of 128, summed in f32).
            if let BwdKernel::Sm90(t) = plan.kernel() {
                let port =
                    AttentionBackwardPlan::with_kernel(dev, c.class(), Some(BwdKernel::Portable))
                        .unwrap();
                let pws = poisoned::<u8>(s, port.workspace_bytes(c.b, c.sq));
                let pws_raw = RawWorkspace {
                    ptr: addr(&pws, s),
                    bytes: pws.len(),
                };
                unsafe { port.backward_raw(s.cu_stream(), &a, pws_raw) }.unwrap();
                let other = bufs.grads(s);
                let first = if t.dq.fused() { 1 } else { 0 };
                let same = (first..3).all(|i| got[i] == other[i]);
                eprintln!(
                    "{c:?}: sm90 gradients bit-identical to the portable kernels' (from {}): \
                     {same}",
                    ["dq", "dk"][first]
                );
                assert!(same, "{c:?}: sm90 and portable gradients differ");
            }
            let tol = crate::accuracy::tolerance(c.dtype).rel_l2;
            for (name, g, r) in [
                ("dq", &got[0], &want.dq),
                ("dk", &got[1], &want.dk),
                ("dv", &got[2], &want.dv),
            ] {
                let (rel, row, bad) = errors(&c.dtype.decode_u16(g), r, c.d);
                eprintln!(
                    "fwd {} -> bwd {c:?} {mode:?}: {name} rel L2 {rel:.2e} worst row {row:.2e}",
                    fplan.variant().entry
                );
                assert_eq!(bad, 0);
                // The per-row bound is twice the reference tests': here D = rowsum(dO ∘ O)
                // comes from the forward's bf16-rounded o, not the exact one, and a causal row
                // that sees few keys has a near-zero exact dq, so o's rounding is most of
                // what it carries (a row measured 7.1e-2 against 4 × tol = 6.4e-2). A wrong
                // layout of o or lse gives errors of order 1.
                assert!(
                    rel <= tol && row <= 8.0 * tol,
                    "{name}: rel L2 {rel:.3e}, worst row {row:.3e} (seed {seed})"
                );
            }
        }
    });
}

#[test]
fn backward_rejects_bad_input() {
    with_gpu("bwd-bad-input", |dev| {
        let s = dev.stream();
        let c = Case::new(64, DType::Bf16, 4, 2, 64, 64, false);
        for (d, dtype) in [(256, DType::Bf16), (80, DType::Bf16), (64, DType::F32)] {
            let mut bad = c.class();
            bad.head_dim = d;
            bad.dtype = dtype;
            let e = AttentionBackwardPlan::new(dev, bad, BwdMode::Fast)
                .unwrap_err()
                .to_string();
            eprintln!("D={d} {dtype:?}: {e}");
            assert!(e.contains("attention backward"), "{e}");
        }
        let plan = AttentionBackwardPlan::new(dev, c.class(), BwdMode::Fast).unwrap();
        let n = c.b * c.sq * c.hq * c.d;
        let nk = c.b * c.sk * c.hkv * c.d;
        let bufs = Bufs {
            q: poisoned(s, n),
            k: poisoned(s, nk),
            v: poisoned(s, nk),
            o: poisoned(s, n),
            d_o: poisoned(s, n),
            lse: poisoned(s, c.b * c.hq * c.sq),
            dq: poisoned(s, n),
            dk: poisoned(s, nk),
            dv: poisoned(s, nk),
            ws: poisoned(s, plan.workspace_bytes(c.b, c.sq)),
        };
        let good = bufs.args(s, &c);
        plan.check(&good).unwrap();
        let expect_err = |a: BackwardArgs, ws: RawWorkspace, what: &str| {
            let e = unsafe { plan.backward_raw(s.cu_stream(), &a, ws) }
                .unwrap_err()
                .to_string();
            eprintln!("{what}: {e}");
            assert!(e.contains(what), "{what}: {e}");
        };
        let mut a = good;
        a.d_o.dtype = DType::F16;
        expect_err(a, bufs.ws(s), "d_o");
        let mut a = good;
        a.dk.shape[2] = 4;
        expect_err(a, bufs.ws(s), "dk");
        let mut a = good;
        a.lse.shape[2] = 63;
        expect_err(a, bufs.ws(s), "lse");
        let mut a = good;
        a.q = RawTensor::new(
            a.q.ptr,
            DType::Bf16,
            &[2, 32, 4, 64],
            &[2 * 64 * 256, 2 * 256, 64, 1],
        )
        .unwrap();
        a.d_o.shape[1] = 32;
        a.o.shape[1] = 32;
        a.dq.shape[1] = 32;
        a.lse = RawTensor::contiguous(a.lse.ptr, DType::F32, &[2, 4, 32]).unwrap();
        expect_err(a, bufs.ws(s), "strided");
        let mut a = good;
        a.dq = a.q;
        expect_err(a, bufs.ws(s), "same buffer");
        let small = RawWorkspace {
            ptr: addr(&bufs.ws, s),
            bytes: 16,
        };
        expect_err(good, small, "workspace");
        s.synchronize().unwrap();
    });
}

/// Speed of the backward (all three launches) on the 16k-token sweep shapes (S = 1k, 4k,
/// 16k; D = 64, 128; causal and not), model dim 2048, bf16; o and lse from the forward
/// plan. The portable kernels and (compute capability 9.0) the sm_90a kernels with each
/// lab tile, timed in two interleaved rounds in the same process. Host wall time over
/// back-to-back calls (synchronised before and after), TFLOP/s with FLOPs = 2.5 × the
/// forward's.
#[test]
fn backward_speed() {
    with_gpu("bwd-speed", |dev| {
        let s = dev.stream();
        let mut configs = Vec::new();
        for d in [64, 128] {
            for seq in [1024, 4096, 16384] {
                for causal in [false, true] {
                    configs.push((d, seq, causal, 0.0));
                }
            }
            // Softcap (Gemma-2's 50) at 4k: the sm_90a build beside the portable kernels.
            for causal in [false, true] {
                configs.push((d, 4096, causal, 50.0));
            }
        }
        // D = 96 (21 heads: model dim 2016) at 4k: the kernel pair against the portable one.
        for causal in [false, true] {
            configs.push((96, 4096, causal, 0.0));
        }
        for (d, seq, causal, softcap) in configs {
            let c = speed_case(d, seq, causal, softcap);
            let (b, heads) = (c.b, c.hq);
            let p = c.problem();
            let mut kernels = vec![BwdKernel::Portable];
            if dev.arch() == 90 {
                // The class's deterministic production tile and the fused-dQ tiles (the
                // other kernel-pair tiles were timed in v2, docs/design/attention-backward.md).
                let tiles = Sm90BwdTile::lab_tiles(d);
                let prod = Sm90BwdTile::for_class(&c.class(), BwdMode::Deterministic).unwrap();
                kernels.extend(
                    tiles
                        .into_iter()
                        .filter(|t| {
                            (*t == prod || t.dq.fused() || t.producer()) && t.serves(&c.class())
                        })
                        .map(BwdKernel::Sm90),
                );
            }
            let plans: Vec<AttentionBackwardPlan> = kernels
                .iter()
                .map(|&k| AttentionBackwardPlan::with_kernel(dev, c.class(), Some(k)).unwrap())
                .collect();
            let ws_bytes = plans
                .iter()
                .map(|p| p.workspace_bytes(b, seq))
                .max()
                .unwrap();
            let (bufs, fplan, fws) = speed_inputs(dev, &c, ws_bytes);
            let a = bufs.args(s, &c);
            let fa = forward_args(&a);
            let ws = bufs.ws(s);
            let time = |iters: usize, f: &dyn Fn()| {
                s.synchronize().unwrap();
                let t0 = std::time::Instant::now();
                for _ in 0..iters {
                    f();
                }
                s.synchronize().unwrap();
                t0.elapsed().as_secs_f64() / iters as f64
            };
            let fwd = || unsafe { fplan.forward_raw(s.cu_stream(), &fa, fws.raw()) }.unwrap();
            let mut best = vec![f64::INFINITY; plans.len()];
            let mut grads = Vec::new();
            for round in 0..2 {
                for (i, plan) in plans.iter().enumerate() {
                    let bwd = || unsafe { plan.backward_raw(s.cu_stream(), &a, ws) }.unwrap();
                    time(2, &bwd);
                    let once = time(1, &bwd);
                    let iters = ((0.15 / once) as usize).clamp(3, 50);
                    best[i] = best[i].min(time(iters, &bwd));
                    if round == 1 {
                        grads.push(bufs.grads(s));
                    }
                }
            }
            let tf = time(5, &fwd);
            let mut line = format!(
                "bwd speed B={b} H={heads} S={seq} D={d} causal={causal} softcap={softcap}: \
                 forward ({}) {:.1} TFLOP/s; backward",
                fplan.variant().entry,
                p.flops() / tf / 1e12
            );
            for (k, t) in kernels.iter().zip(&best) {
                let name = match k {
                    BwdKernel::Portable => "portable".to_string(),
                    BwdKernel::Sm90(t) => {
                        // "+pN": the producer warpgroup's build, N loading warps.
                        let p = if t.producer() {
                            format!("+p{}", t.producer_warps)
                        } else {
                            String::new()
                        };
                        if t.dq.fused() {
                            format!("sm90[{:?} m{} s{}{p}]", t.dq, t.kv_block_m, t.stages)
                        } else {
                            format!("sm90[m{} n{} s{}{p}]", t.kv_block_m, t.q_block_n, t.stages)
                        }
                    }
                };
                line.push_str(&format!(
                    " {name} {:.3} ms = {:.1} TFLOP/s;",
                    t * 1e3,
                    backward_flops(&p) / t / 1e12
                ));
            }
            // Gradients finite on every path, and every sm_90a tile's close to the portable
            // kernels' (same inputs; different summation orders).
            for g in &grads {
                for v in g {
                    assert!(DType::Bf16.decode_u16(v).iter().all(|x| x.is_finite()));
                }
            }
            let mut agree = 0f64;
            for g in grads.iter().skip(1) {
                for (x, y) in g.iter().zip(&grads[0]) {
                    let r: Vec<f64> = DType::Bf16
                        .decode_u16(y)
                        .iter()
                        .map(|&v| v as f64)
                        .collect();
                    let (rel, _, _) = errors(&DType::Bf16.decode_u16(x), &r, d);
                    agree = agree.max(rel);
                }
            }
            line.push_str(&format!(" max rel L2 vs portable {agree:.2e}"));
            eprintln!("{line}");
            assert!(agree < 2e-2, "{line}");
        }
    });
}

/// The speed table's shape: 16k tokens, model dim 2048, MHA, bf16.
fn speed_case(d: usize, seq: usize, causal: bool, softcap: f32) -> Case {
    let heads = 2048 / d;
    let mut c = Case::new(d, DType::Bf16, heads, heads, seq, seq, causal);
    c.b = 16384 / seq;
    c.softcap = softcap;
    c
}

/// The forward's view of a backward call's tensors.
fn forward_args(a: &BackwardArgs) -> AttentionArgs {
    AttentionArgs {
        q: a.q,
        k: a.k,
        v: a.v,
        o: a.o,
        lse: a.lse,
    }
}

/// Random q, k, v, dO for `c`, poisoned outputs and a `ws_bytes` workspace, and the forward
/// run on them (o and lse in place); the forward plan and its workspace are returned so
/// they outlive the calls that time them.
fn speed_inputs(
    dev: &Device,
    c: &Case,
    ws_bytes: usize,
) -> (Bufs, AttentionPlan, crate::gpu::Workspace) {
    let s = dev.stream();
    let n = c.b * c.sq * c.hq * c.d;
    let rnd = |id: TensorId| {
        s.clone_htod(&DType::Bf16.encode_u16(&generate(7, id, n, 1.0, DType::Bf16)))
            .unwrap()
    };
    let fplan = AttentionPlan::new(dev, c.class()).unwrap();
    let fws = fplan.alloc_workspace(s).unwrap();
    let bufs = Bufs {
        q: rnd(TensorId::Q),
        k: rnd(TensorId::K),
        v: rnd(TensorId::V),
        o: poisoned(s, n),
        d_o: rnd(TensorId::MoeX),
        lse: poisoned(s, c.b * c.hq * c.sq),
        dq: poisoned(s, n),
        dk: poisoned(s, n),
        dv: poisoned(s, n),
        ws: poisoned(s, ws_bytes),
    };
    let fa = forward_args(&bufs.args(s, c));
    unsafe { fplan.forward_raw(s.cu_stream(), &fa, fws.raw()) }.unwrap();
    (bufs, fplan, fws)
}

/// One backward call per fused-dQ producer tile (4 loading warps, then 1) after its
/// consumer-loaded twin, non-causal and causal, D = 64 and 128 at 4k (v6's outcome: the
/// 4-warp producer loses 16-30 % non-causal and gains 3-8 % causal), for Nsight Compute
/// (stage `ncu-bwd-producer`: 12 dK/dV kernels in this order). Ignored: it times nothing
/// and checks only that the gradients are finite.
#[test]
#[ignore]
fn producer_profile_pairs() {
    with_gpu("bwd-producer-profile", |dev| {
        let s = dev.stream();
        for d in [64, 128] {
            for causal in [false, true] {
                let c = speed_case(d, 4096, causal, 0.0);
                let producers: Vec<Sm90BwdTile> = Sm90BwdTile::lab_tiles(d)
                    .into_iter()
                    .filter(|t| t.producer() && t.dq.fused())
                    .collect();
                assert_eq!(producers.len(), 2, "{producers:?}");
                let twin = Sm90BwdTile {
                    producer_warps: 0,
                    ..producers[0]
                };
                let plans: Vec<AttentionBackwardPlan> = std::iter::once(twin)
                    .chain(producers.iter().copied())
                    .map(|t| {
                        AttentionBackwardPlan::with_kernel(dev, c.class(), Some(BwdKernel::Sm90(t)))
                            .unwrap()
                    })
                    .collect();
                let ws_bytes = plans
                    .iter()
                    .map(|p| p.workspace_bytes(c.b, c.sq))
                    .max()
                    .unwrap();
                let (bufs, _fplan, _fws) = speed_inputs(dev, &c, ws_bytes);
                let a = bufs.args(s, &c);
                for plan in &plans {
                    unsafe { plan.backward_raw(s.cu_stream(), &a, bufs.ws(s)) }.unwrap();
                    for g in bufs.grads(s) {
                        assert!(DType::Bf16.decode_u16(&g).iter().all(|x| x.is_finite()));
                    }
                }
                eprintln!(
                    "producer profile D={d} causal={causal}: {twin:?}, then producer warps {:?}",
                    producers
                        .iter()
                        .map(|t| t.producer_warps)
                        .collect::<Vec<_>>()
                );
            }
        }
    });
}

/// A few small cases with partial tiles, Sq != Sk, GQA, a window and a softcap: the run
/// compute-sanitizer (memcheck, racecheck) goes through.
#[test]
fn backward_sanitizer_cases() {
    with_gpu("bwd-sanitizer", |dev| {
        let seed = fresh_seed("bwd-sanitizer");
        let mut c = Case::new(128, DType::Bf16, 4, 2, 77, 150, true);
        c.b = 1;
        c.window = (40, -1);
        c.softcap = 5.0;
        for (n, c) in [
            Case::new(64, DType::F16, 2, 2, 100, 37, true),
            Case::new(64, DType::Bf16, 2, 1, 45, 70, false),
            c,
        ]
        .iter()
        .enumerate()
        {
            check_case(dev, c, seed + n as u64);
        }
        // The sm_90a kernels on partial tiles, GQA, Sq != Sk, a window and a softcap: each
        // dQ mode.
        if dev.arch() == 90 {
            let mut w = Case::new(128, DType::Bf16, 4, 2, 150, 77, true);
            w.window = (40, 8);
            let mut cap = Case::new(64, DType::Bf16, 8, 2, 129, 130, false);
            cap.softcap = 5.0;
            for (n, c) in [
                Case::new(64, DType::Bf16, 8, 2, 129, 130, true),
                Case::new(128, DType::Bf16, 8, 2, 129, 130, false),
                Case::new(128, DType::F16, 2, 2, 130, 65, true),
                Case::new(96, DType::Bf16, 4, 2, 129, 130, true),
                w,
                cap,
            ]
            .iter()
            .enumerate()
            {
                for t in sanitizer_tiles(c) {
                    check_case_on(dev, c, seed + 10 + n as u64, Some(BwdKernel::Sm90(t)));
                }
            }
        }
    });
}

/// The production sm_90a tiles of the case's class (both modes), their producer builds and
/// the 2-slot tiles of each fused-dQ mode that serve its masking.
fn sanitizer_tiles(c: &Case) -> Vec<Sm90BwdTile> {
    let mut tiles = Sm90BwdTile::lab_tiles(c.d);
    let prod = Sm90BwdTile::for_class(&c.class(), BwdMode::Deterministic).unwrap();
    let fast = Sm90BwdTile::for_class(&c.class(), BwdMode::Fast);
    tiles.retain(|t| {
        (*t == prod || Some(*t) == fast || t.producer() || (t.dq.fused() && t.stages == 2))
            && t.serves(&c.class())
    });
    tiles
}

/// Bit-identity under repetition: partial-tile shapes (Sq, Sk not multiples of the tiles,
/// Sq != Sk, GQA) run `FLASHMOE_BWD_REPEATS` times (default 30) on each deterministic
/// sm_90a tile, every run's dq, dk and dv compared bit for bit with the first; a second
/// stream keeps another backward running beside them. An unordered hand-off of a
/// shared-memory slot or of a dQ tile would show up as a differing run (and under
/// compute-sanitizer's racecheck as a hazard).
#[test]
fn backward_repeats_give_identical_bits() {
    with_gpu("bwd-repeats", |dev| {
        if dev.arch() != 90 {
            eprintln!(
                "bwd-repeats: compute capability {} — sm_90a only, skipped",
                dev.arch()
            );
            return;
        }
        let repeats: usize = std::env::var("FLASHMOE_BWD_REPEATS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(30);
        let seed = fresh_seed("bwd-repeats");
        let s = dev.stream();
        let s2 = dev.context().new_stream().unwrap();
        let cases = [
            Case::new(64, DType::Bf16, 8, 2, 129, 130, true),
            Case::new(128, DType::Bf16, 8, 2, 129, 130, false),
            Case::new(128, DType::Bf16, 4, 4, 333, 200, true),
            Case::new(64, DType::F16, 4, 1, 200, 333, false),
            Case::new(128, DType::Bf16, 2, 2, 1000, 1000, true),
            Case::new(96, DType::Bf16, 8, 2, 129, 130, false),
        ];
        for (n, c) in cases.iter().enumerate() {
            let data = CaseData::generate(c, seed + n as u64);
            for t in Sm90BwdTile::lab_tiles(c.d) {
                if !t.dq.deterministic() {
                    continue;
                }
                let plan =
                    AttentionBackwardPlan::with_kernel(dev, c.class(), Some(BwdKernel::Sm90(t)))
                        .unwrap();
                let ws_bytes = plan.workspace_bytes(c.b, c.sq);
                let mut bufs = data.upload(s, c, ws_bytes);
                // The same call on the second stream, into its own outputs and workspace.
                let side = data.upload(s, c, ws_bytes);
                s.synchronize().unwrap();
                let mut first: Option<[Vec<u16>; 3]> = None;
                for r in 0..repeats {
                    unsafe {
                        plan.backward_raw(s2.cu_stream(), &side.args(s, c), side.ws(s))
                            .unwrap();
                        plan.backward_raw(s.cu_stream(), &bufs.args(s, c), bufs.ws(s))
                            .unwrap();
                    }
                    let got = bufs.grads(s);
                    for g in &got {
                        assert!(
                            c.dtype.decode_u16(g).iter().all(|v| v.is_finite()),
                            "{c:?} {t:?}: non-finite gradient on run {r}"
                        );
                    }
                    match &first {
                        None => first = Some(got),
                        Some(f) => {
                            for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                                assert!(
                                    f[i] == got[i],
                                    "{c:?} {t:?}: {name} of run {r} differs from run 0"
                                );
                            }
                        }
                    }
                    bufs.repoison(s);
                }
                s2.synchronize().unwrap();
                eprintln!("bwd-repeats {c:?} {t:?}: {repeats} runs bit-identical");
            }
        }
    });
}
