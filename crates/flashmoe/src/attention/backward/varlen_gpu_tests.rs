//! GPU tests of [`VarlenBackwardPlan`]: packed batches of ragged sequences against the f64
//! reference run sequence by sequence (head dims 32/64/96/128, bf16 and f16, causal
//! bottom-right per sequence, windows, softcap, GQA/MQA, lengths 1, 63, 64, 65, primes,
//! sk > sq and sk < sq, sequences with no queries or no keys, packed rows past the last
//! sequence), global relative L2 and a per-row bound; rows outside every sequence stay
//! untouched; determinism (bit-identical reruns); equal lengths bit-identical to the dense
//! plan; the varlen forward → backward chain (sm_90a); bad input. Every output and the
//! workspace are poisoned (NaN) before a run. Each test prints "skipped: no GPU" and
//! passes on a machine without one. Inputs are fresh random values (seed printed).

use super::gpu_tests::{errors, poisoned};
use super::varlen::{VarlenBackwardArgs, VarlenBackwardPlan};
use super::{
    default_kernel, sm90_serves, AttentionBackwardPlan, BackwardArgs, BwdKernel, BwdMode,
    Sm90BwdTile,
};
use crate::attention::plan::AttentionClass;
use crate::attention::varlen::{VarlenArgs, VarlenPlan};
use crate::dtype::DType;
use crate::gpu::raw::{RawIndex, RawWorkspace};
use crate::gpu::test_support::{addr, fresh_seed, with_gpu};
use crate::gpu::{Device, RawTensor};
use crate::inputs::{generate, TensorId};
use crate::problem::NO_WINDOW;
use crate::reference::attention::{attention_f64, AttentionInputs};
use crate::reference::attention_backward::attention_backward_f64;
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

#[derive(Debug, Clone)]
struct Case {
    d: usize,
    dtype: DType,
    hq: usize,
    hkv: usize,
    /// (sq, sk) per sequence.
    lens: Vec<(usize, usize)>,
    /// Packed rows past the last sequence (q, k): never read into a gradient, never written.
    tail: (usize, usize),
    causal: bool,
    window: (i32, i32),
    softcap: f32,
}

impl Case {
    fn new(d: usize, dtype: DType, hq: usize, hkv: usize, lens: &[(usize, usize)]) -> Case {
        Case {
            d,
            dtype,
            hq,
            hkv,
            lens: lens.to_vec(),
            tail: (0, 0),
            causal: false,
            window: NO_WINDOW,
            softcap: 0.0,
        }
    }
    fn causal(mut self) -> Case {
        self.causal = true;
        self
    }
    fn masks(mut self, window: (i32, i32), softcap: f32) -> Case {
        self.window = window;
        self.softcap = softcap;
        self
    }
    fn tail(mut self, q: usize, k: usize) -> Case {
        self.tail = (q, k);
        self
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
    fn cu(&self) -> (Vec<i32>, Vec<i32>) {
        let (mut cq, mut ck) = (vec![0i32], vec![0i32]);
        for &(sq, sk) in &self.lens {
            cq.push(cq.last().unwrap() + sq as i32);
            ck.push(ck.last().unwrap() + sk as i32);
        }
        (cq, ck)
    }
    fn totals(&self) -> (usize, usize) {
        let (cq, ck) = self.cu();
        (
            *cq.last().unwrap() as usize + self.tail.0,
            *ck.last().unwrap() as usize + self.tail.1,
        )
    }
    fn max_lens(&self) -> (usize, usize) {
        let mq = self.lens.iter().map(|l| l.0).max().unwrap_or(0).max(1);
        let mk = self.lens.iter().map(|l| l.1).max().unwrap_or(0).max(1);
        (mq, mk)
    }
}

/// Host data of one packed call: inputs (dtype-rounded), the forward's o and lse, d_o, and
/// the f64 gradients, all in the packed layouts (rows past the last sequence: random
/// inputs, NaN reference gradients, which the checks skip).
struct Host {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    lse: Vec<f32>,
    d_o: Vec<f32>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn host(c: &Case, seed: u64) -> Host {
    let (tq, tk) = c.totals();
    let (cq, ck) = c.cu();
    let (hq, hkv, d) = (c.hq, c.hkv, c.d);
    let (rq, rk) = (hq * d, hkv * d);
    let rnd = |id: TensorId, n: usize, s: u64| generate(s, id, n, 1.0, c.dtype);
    let mut h = Host {
        q: rnd(TensorId::Q, tq * rq, seed ^ 0xA1),
        k: rnd(TensorId::K, tk * rk, seed ^ 0xA2),
        v: rnd(TensorId::V, tk * rk, seed ^ 0xA3),
        o: vec![0.0; tq * rq],
        lse: vec![f32::NEG_INFINITY; hq * tq],
        d_o: rnd(TensorId::MoeX, tq * rq, seed ^ 0xA4),
        dq: vec![f64::NAN; tq * rq],
        dk: vec![f64::NAN; tk * rk],
        dv: vec![f64::NAN; tk * rk],
    };
    for (b, &(sq, sk)) in c.lens.iter().enumerate() {
        let (q0, k0) = (cq[b] as usize, ck[b] as usize);
        // Empty sides: a query with no key has o = 0, lse = -inf, dq = 0; a key no query
        // sees has dk = dv = 0.
        h.dq[q0 * rq..(q0 + sq) * rq].fill(0.0);
        h.dk[k0 * rk..(k0 + sk) * rk].fill(0.0);
        h.dv[k0 * rk..(k0 + sk) * rk].fill(0.0);
        if sq == 0 || sk == 0 {
            continue;
        }
        let p = c.class().problem(1, sq, sk);
        let x = AttentionInputs::generate(&p, seed.wrapping_add(b as u64));
        let d_o = generate(
            seed.wrapping_add(b as u64) ^ 0x5EED,
            TensorId::Q,
            x.q.len(),
            1.0,
            c.dtype,
        );
        let f = attention_f64(&p, &x).unwrap();
        let g = attention_backward_f64(&p, &x, &d_o).unwrap();
        let (qs, ks) = (q0 * rq..(q0 + sq) * rq, k0 * rk..(k0 + sk) * rk);
        h.q[qs.clone()].copy_from_slice(&x.q);
        h.d_o[qs.clone()].copy_from_slice(&d_o);
        h.k[ks.clone()].copy_from_slice(&x.k);
        h.v[ks.clone()].copy_from_slice(&x.v);
        for (dst, &s) in h.o[qs.clone()].iter_mut().zip(&f.o) {
            *dst = c.dtype.round(s as f32);
        }
        for head in 0..hq {
            for i in 0..sq {
                h.lse[head * tq + q0 + i] = f.lse[head * sq + i] as f32;
            }
        }
        h.dq[qs].copy_from_slice(&g.dq);
        h.dk[ks.clone()].copy_from_slice(&g.dk);
        h.dv[ks].copy_from_slice(&g.dv);
    }
    h
}

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
    cu_q: CudaSlice<i32>,
    cu_k: CudaSlice<i32>,
    ws: CudaSlice<u8>,
}

impl Bufs {
    fn new(s: &Arc<CudaStream>, c: &Case, h: &Host, ws_bytes: usize) -> Bufs {
        let up = |v: &[f32]| s.clone_htod(&c.dtype.encode_u16(v)).unwrap();
        let (cq, ck) = c.cu();
        Bufs {
            q: up(&h.q),
            k: up(&h.k),
            v: up(&h.v),
            o: up(&h.o),
            d_o: up(&h.d_o),
            lse: s.clone_htod(&h.lse).unwrap(),
            dq: poisoned(s, h.q.len()),
            dk: poisoned(s, h.k.len()),
            dv: poisoned(s, h.v.len()),
            cu_q: s.clone_htod(&cq).unwrap(),
            cu_k: s.clone_htod(&ck).unwrap(),
            ws: poisoned(s, ws_bytes),
        }
    }
    fn args(&self, s: &Arc<CudaStream>, c: &Case) -> VarlenBackwardArgs {
        let (tq, tk) = c.totals();
        let (mq, mk) = c.max_lens();
        let (qs, ks) = ([tq, c.hq, c.d], [tk, c.hkv, c.d]);
        let t = |p, sh: &[usize]| RawTensor::contiguous(p, c.dtype, sh).unwrap();
        VarlenBackwardArgs {
            q: t(addr(&self.q, s), &qs),
            k: t(addr(&self.k, s), &ks),
            v: t(addr(&self.v, s), &ks),
            o: t(addr(&self.o, s), &qs),
            d_o: t(addr(&self.d_o, s), &qs),
            lse: RawTensor::contiguous(addr(&self.lse, s), DType::F32, &[c.hq, tq]).unwrap(),
            dq: t(addr(&self.dq, s), &qs),
            dk: t(addr(&self.dk, s), &ks),
            dv: t(addr(&self.dv, s), &ks),
            cu_seqlens_q: RawIndex::vector(addr(&self.cu_q, s), c.lens.len() + 1),
            cu_seqlens_k: RawIndex::vector(addr(&self.cu_k, s), c.lens.len() + 1),
            max_seqlen_q: mq,
            max_seqlen_k: mk,
        }
    }
    fn ws(&self, s: &Arc<CudaStream>) -> RawWorkspace {
        RawWorkspace {
            ptr: addr(&self.ws, s),
            bytes: self.ws.len(),
        }
    }
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

/// Check gradients against the reference: rows inside a sequence (reference finite) by
/// the global relative L2 and the per-row bound, with no non-finite value; rows past the
/// last sequence (reference NaN) still hold the poison (never written). Returns (worst
/// rel L2, worst row).
fn judge(c: &Case, got: &[Vec<u16>; 3], h: &Host, seed: u64) -> (f64, f64) {
    let tol = crate::accuracy::tolerance(c.dtype).rel_l2;
    let row_tol = 4.0 * tol;
    let mut worst = (0f64, 0f64);
    let mut report = String::new();
    for (name, g, r) in [
        ("dq", &got[0], &h.dq),
        ("dk", &got[1], &h.dk),
        ("dv", &got[2], &h.dv),
    ] {
        let out = c.dtype.decode_u16(g);
        let (mut o_in, mut r_in) = (Vec::new(), Vec::new());
        for (orow, rrow) in out.chunks(c.d).zip(r.chunks(c.d)) {
            if rrow[0].is_nan() {
                assert!(
                    orow.iter().all(|x| x.is_nan()),
                    "{c:?}: {name} wrote a row outside every sequence (seed {seed})"
                );
            } else {
                o_in.extend_from_slice(orow);
                r_in.extend_from_slice(rrow);
            }
        }
        let (rel, row, bad) = errors(&o_in, &r_in, c.d);
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
    eprintln!(
        "varlen bwd D={} {:?} Hq={} Hkv={} lens={:?} tail={:?} causal={} window={:?} \
         softcap={}:{report}",
        c.d, c.dtype, c.hq, c.hkv, c.lens, c.tail, c.causal, c.window, c.softcap
    );
    worst
}

fn check_case(dev: &Device, c: &Case, seed: u64) -> (f64, f64) {
    check_case_on(dev, c, seed, BwdKernel::Portable)
}

fn check_case_on(dev: &Device, c: &Case, seed: u64, kernel: BwdKernel) -> (f64, f64) {
    let s = dev.stream();
    let h = host(c, seed);
    let plan = VarlenBackwardPlan::with_kernel(dev, c.class(), kernel).unwrap();
    let mut bufs = Bufs::new(s, c, &h, plan.workspace_bytes(c.totals().0));
    unsafe { plan.backward_raw(s.cu_stream(), &bufs.args(s, c), bufs.ws(s)) }.unwrap();
    let got = bufs.grads(s);
    let worst = judge(c, &got, &h, seed);
    // Deterministic: a rerun into fresh NaN buffers gives the same bits.
    bufs.repoison(s);
    unsafe { plan.backward_raw(s.cu_stream(), &bufs.args(s, c), bufs.ws(s)) }.unwrap();
    let again = bufs.grads(s);
    for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
        assert!(got[i] == again[i], "{c:?}: {name} differs between two runs");
    }
    worst
}

#[test]
fn varlen_backward_matches_f64_reference() {
    with_gpu("varlen-bwd-reference", |dev| {
        let seed = fresh_seed("varlen-bwd-reference");
        use DType::{Bf16, F16};
        let ragged = [(1, 1), (63, 63), (64, 64), (65, 65), (130, 130), (7, 7)];
        let skew = [(17, 90), (90, 17), (1, 200), (200, 1), (64, 65), (33, 33)];
        let cases = vec![
            Case::new(64, Bf16, 4, 4, &ragged),
            Case::new(64, Bf16, 4, 4, &ragged).causal(),
            Case::new(128, Bf16, 4, 2, &skew),
            Case::new(128, Bf16, 4, 2, &skew).causal(),
            Case::new(64, F16, 8, 2, &skew).causal(),
            Case::new(128, F16, 4, 1, &ragged),
            Case::new(32, Bf16, 2, 2, &skew).causal(),
            Case::new(96, F16, 2, 1, &ragged).causal(),
            Case::new(96, Bf16, 4, 2, &skew),
            Case::new(32, F16, 4, 4, &ragged),
            // Empty sides: no queries (its keys get zero dk, dv), no keys (its queries get
            // zero dq), a one-row sequence; packed rows past the last sequence.
            Case::new(
                64,
                Bf16,
                4,
                2,
                &[(0, 40), (50, 0), (1, 1), (0, 0), (77, 77)],
            )
            .causal()
            .tail(5, 9),
            Case::new(128, F16, 2, 2, &[(100, 0), (0, 100), (3, 129)]).tail(3, 0),
            // Windows and softcap, per sequence.
            Case::new(64, Bf16, 4, 2, &skew).masks((32, 8), 0.0),
            Case::new(128, F16, 4, 4, &ragged)
                .causal()
                .masks((48, -1), 0.0),
            Case::new(128, Bf16, 2, 2, &skew).masks((-1, 20), 0.0),
            Case::new(64, Bf16, 4, 2, &ragged)
                .causal()
                .masks(NO_WINDOW, 5.0),
            Case::new(96, Bf16, 2, 1, &skew).masks((40, 0), 3.0),
            Case::new(32, F16, 2, 2, &ragged)
                .causal()
                .masks((10, -1), 30.0),
            // Many sequences (grid z), one long one among short ones.
            Case::new(
                64,
                Bf16,
                2,
                1,
                &(0..40)
                    .map(|i| {
                        if i == 17 {
                            (700, 900)
                        } else {
                            (1 + 13 * i % 97, 1 + 7 * i % 61)
                        }
                    })
                    .collect::<Vec<_>>(),
            )
            .causal(),
        ];
        let mut worst = (0f64, 0f64);
        let mut worst90 = (0f64, 0f64);
        for (n, c) in cases.iter().enumerate() {
            let sd = seed.wrapping_add(1000 * n as u64);
            let e = check_case(dev, c, sd);
            worst = (worst.0.max(e.0), worst.1.max(e.1));
            // Compute capability 9.0: the sm_90a pair too, every dQ-kernel tile the lab
            // times for the head dim (64, 128).
            if dev.arch() == 90 && sm90_serves(&c.class()) {
                // The production selection on this device.
                let plan = VarlenBackwardPlan::new(dev, c.class()).unwrap();
                let prod = default_kernel(&c.class(), BwdMode::Deterministic, 90);
                assert_eq!(plan.kernel(), prod, "{c:?}");
                for t in Sm90BwdTile::lab_tiles(c.d)
                    .into_iter()
                    .filter(|t| !t.dq.fused() && !t.producer() && t.serves(&c.class()))
                {
                    eprintln!("  sm_90a tile {t:?}:");
                    let e = check_case_on(dev, c, sd, BwdKernel::Sm90(t));
                    worst90 = (worst90.0.max(e.0), worst90.1.max(e.1));
                }
            }
        }
        eprintln!(
            "varlen bwd: {} cases passed; worst rel L2 {:.2e}, worst row {:.2e}; sm_90a pair \
             worst rel L2 {:.2e}, worst row {:.2e}",
            cases.len(),
            worst.0,
            worst.1,
            worst90.0,
            worst90.1
        );
    });
}

/// Sequences of one length packed are a dense batch: the varlen gradients must be
/// bit-identical to the dense plan's on the portable kernels (same tiles, same order).
#[test]
fn varlen_backward_equals_dense_on_equal_lengths() {
    with_gpu("varlen-bwd-dense", |dev| {
        let seed = fresh_seed("varlen-bwd-dense");
        let s = dev.stream();
        for (n, c) in [
            Case::new(64, DType::Bf16, 4, 2, &[(150, 150); 3]).causal(),
            Case::new(128, DType::F16, 2, 2, &[(70, 130); 2]).masks((20, 5), 2.0),
        ]
        .iter()
        .enumerate()
        {
            let h = host(c, seed + n as u64);
            // The portable kernels, and on compute capability 9.0 the sm_90a pair (its
            // production dQ-kernel tile), each against the dense plan on the same kernels.
            let mut kernels = vec![BwdKernel::Portable];
            if dev.arch() == 90 && sm90_serves(&c.class()) {
                kernels.push(BwdKernel::Sm90(Sm90BwdTile::for_head_dim(c.d).unwrap()));
            }
            for kernel in kernels {
                let vplan = VarlenBackwardPlan::with_kernel(dev, c.class(), kernel).unwrap();
                let dplan =
                    AttentionBackwardPlan::with_kernel(dev, c.class(), Some(kernel)).unwrap();
                let (b, (sq, sk)) = (c.lens.len(), c.lens[0]);
                let vb = Bufs::new(s, c, &h, vplan.workspace_bytes(c.totals().0));
                unsafe { vplan.backward_raw(s.cu_stream(), &vb.args(s, c), vb.ws(s)) }.unwrap();
                let vg = vb.grads(s);
                judge(c, &vg, &h, seed);
                // The dense call: lse from (heads, total) to (batch, heads, seq).
                let mut lse = vec![0f32; h.lse.len()];
                for bi in 0..b {
                    for head in 0..c.hq {
                        for i in 0..sq {
                            lse[(bi * c.hq + head) * sq + i] = h.lse[head * b * sq + bi * sq + i];
                        }
                    }
                }
                let db = Bufs::new(s, c, &h, dplan.workspace_bytes(b, sq));
                let dl = s.clone_htod(&lse).unwrap();
                let (qs, ks) = ([b, sq, c.hq, c.d], [b, sk, c.hkv, c.d]);
                let t = |p, sh: &[usize]| RawTensor::contiguous(p, c.dtype, sh).unwrap();
                let da = BackwardArgs {
                    q: t(addr(&db.q, s), &qs),
                    k: t(addr(&db.k, s), &ks),
                    v: t(addr(&db.v, s), &ks),
                    o: t(addr(&db.o, s), &qs),
                    d_o: t(addr(&db.d_o, s), &qs),
                    lse: RawTensor::contiguous(addr(&dl, s), DType::F32, &[b, c.hq, sq]).unwrap(),
                    dq: t(addr(&db.dq, s), &qs),
                    dk: t(addr(&db.dk, s), &ks),
                    dv: t(addr(&db.dv, s), &ks),
                };
                unsafe { dplan.backward_raw(s.cu_stream(), &da, db.ws(s)) }.unwrap();
                let dg = db.grads(s);
                for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                    assert!(
                        vg[i] == dg[i],
                        "{c:?}: varlen {name} differs from the dense plan's"
                    );
                }
                eprintln!("varlen bwd == dense bwd bit for bit ({kernel:?}): {c:?}");
            }
        }
    });
}

/// The varlen forward plan's o and lse feed the varlen backward (sm_90a only: the varlen
/// forward's kernel).
#[test]
fn varlen_backward_after_varlen_forward() {
    with_gpu("varlen-bwd-after-fwd", |dev| {
        if dev.arch() < 90 {
            eprintln!("skipped: the varlen forward needs sm_90a");
            return;
        }
        let seed = fresh_seed("varlen-bwd-after-fwd");
        let s = dev.stream();
        for c in [
            Case::new(
                128,
                DType::Bf16,
                8,
                2,
                &[(333, 333), (1, 1), (64, 200), (150, 90)],
            )
            .causal(),
            Case::new(64, DType::F16, 4, 4, &[(100, 130), (257, 257), (5, 5)]),
        ] {
            let h = host(&c, seed);
            let fplan = VarlenPlan::new(dev, c.class()).unwrap();
            let fws = fplan.alloc_workspace(s).unwrap();
            let plan = VarlenBackwardPlan::new(dev, c.class()).unwrap();
            let mut bufs = Bufs::new(s, &c, &h, plan.workspace_bytes(c.totals().0));
            bufs.o = poisoned(s, h.o.len());
            bufs.lse = poisoned(s, h.lse.len());
            let a = bufs.args(s, &c);
            let fa = VarlenArgs {
                q: a.q,
                k: a.k,
                v: a.v,
                o: a.o,
                lse: a.lse,
                cu_seqlens_q: a.cu_seqlens_q,
                cu_seqlens_k: a.cu_seqlens_k,
                max_seqlen_q: a.max_seqlen_q,
                max_seqlen_k: a.max_seqlen_k,
            };
            unsafe { fplan.forward_raw(s.cu_stream(), &fa, fws.raw()) }.unwrap();
            unsafe { plan.backward_raw(s.cu_stream(), &a, bufs.ws(s)) }.unwrap();
            let got = bufs.grads(s);
            judge(&c, &got, &h, seed);
        }
    });
}

#[test]
fn varlen_backward_rejects_bad_input() {
    with_gpu("varlen-bwd-bad-input", |dev| {
        let s = dev.stream();
        let c = Case::new(64, DType::Bf16, 4, 2, &[(30, 30), (34, 40)]);
        for (d, dtype) in [(256, DType::Bf16), (80, DType::Bf16), (64, DType::F32)] {
            let mut bad = c.class();
            bad.head_dim = d;
            bad.dtype = dtype;
            let e = VarlenBackwardPlan::new(dev, bad).unwrap_err().to_string();
            eprintln!("D={d} {dtype:?}: {e}");
            assert!(e.contains("varlen attention backward"), "{e}");
        }
        let plan = VarlenBackwardPlan::new(dev, c.class()).unwrap();
        let h = host(&c, 1);
        let bufs = Bufs::new(s, &c, &h, plan.workspace_bytes(c.totals().0));
        let good = bufs.args(s, &c);
        plan.check(&good).unwrap();
        let expect_err = |a: VarlenBackwardArgs, ws: RawWorkspace, what: &str| {
            let e = unsafe { plan.backward_raw(s.cu_stream(), &a, ws) }
                .unwrap_err()
                .to_string();
            eprintln!("{what}: {e}");
            assert!(e.contains(what), "{what}: {e}");
        };
        let mut a = good;
        a.dq.shape[0] = 63;
        expect_err(a, bufs.ws(s), "dq");
        let mut a = good;
        a.lse = RawTensor::contiguous(a.lse.ptr, DType::F32, &[64, 4]).unwrap();
        expect_err(a, bufs.ws(s), "lse");
        let mut a = good;
        a.max_seqlen_k = 71;
        expect_err(a, bufs.ws(s), "max_seqlen_k");
        let small = RawWorkspace {
            ptr: addr(&bufs.ws, s),
            bytes: 16,
        };
        expect_err(good, small, "workspace");
        s.synchronize().unwrap();
    });
}

/// Small ragged cases with partial tiles, empty sides, GQA, a window and a softcap: the
/// run compute-sanitizer (memcheck, racecheck) goes through, on the portable kernels and
/// (compute capability 9.0) the sm_90a pair.
#[test]
fn varlen_backward_sanitizer_cases() {
    with_gpu("varlen-bwd-sanitizer", |dev| {
        let seed = fresh_seed("varlen-bwd-sanitizer");
        for (n, c) in [
            Case::new(64, DType::F16, 2, 2, &[(37, 100), (0, 5), (5, 0), (70, 45)])
                .causal()
                .tail(2, 3),
            Case::new(128, DType::Bf16, 4, 2, &[(77, 150), (1, 1)])
                .causal()
                .masks((40, -1), 5.0),
        ]
        .iter()
        .enumerate()
        {
            check_case(dev, c, seed + n as u64);
            // Compute capability 9.0: the sm_90a pair on the same cases.
            if dev.arch() == 90 {
                let t = Sm90BwdTile::for_head_dim(c.d).unwrap();
                check_case_on(dev, c, seed + n as u64, BwdKernel::Sm90(t));
            }
        }
    });
}

/// Speed of the varlen backward (all three launches), bf16, 16k packed tokens, model dim
/// 2048: equal lengths beside the dense plan on the same shape, and ragged lengths; on
/// compute capability 9.0 the sm_90a pair beside the portable kernels. Host
/// wall time over back-to-back calls (synchronised before and after); TFLOP/s with FLOPs =
/// 2.5 × the forward's, summed per sequence. o and lse are random (speed does not depend
/// on them; finite values keep every P finite).
#[test]
fn varlen_backward_speed() {
    with_gpu("varlen-bwd-speed", |dev| {
        let s = dev.stream();
        for (d, causal) in [(64, false), (64, true), (128, false), (128, true)] {
            let heads = 2048 / d;
            let equal: Vec<(usize, usize)> = vec![(1024, 1024); 16];
            // Ragged: 16384 tokens in lengths from 64 to 4000.
            let mut ragged = Vec::new();
            let mut left = 16384usize;
            for i in 0.. {
                let l = [3072, 64, 1500, 700, 2048, 333, 1024, 4000][i % 8].min(left);
                ragged.push((l, l));
                left -= l;
                if left == 0 {
                    break;
                }
            }
            for (what, lens) in [("equal 16 x 1024", equal), ("ragged", ragged)] {
                let mut c = Case::new(d, DType::Bf16, heads, heads, &lens);
                c.causal = causal;
                let (tq, tk) = c.totals();
                let flops: f64 = lens
                    .iter()
                    .map(|&(sq, sk)| super::backward_flops(&c.class().problem(1, sq, sk)))
                    .sum();
                let n = tq * heads * d;
                let rnd = |id: TensorId, n: usize| {
                    s.clone_htod(&DType::Bf16.encode_u16(&generate(7, id, n, 1.0, DType::Bf16)))
                        .unwrap()
                };
                let plan =
                    VarlenBackwardPlan::with_kernel(dev, c.class(), BwdKernel::Portable).unwrap();
                let (cq, ck) = c.cu();
                let bufs = Bufs {
                    q: rnd(TensorId::Q, n),
                    k: rnd(TensorId::K, tk * heads * d),
                    v: rnd(TensorId::V, tk * heads * d),
                    o: rnd(TensorId::MoeX, n),
                    d_o: rnd(TensorId::MoeW13, n),
                    // lse = 10 everywhere: P = exp(s - 10), finite.
                    lse: s.clone_htod(&vec![10f32; heads * tq]).unwrap(),
                    dq: poisoned(s, n),
                    dk: poisoned(s, tk * heads * d),
                    dv: poisoned(s, tk * heads * d),
                    cu_q: s.clone_htod(&cq).unwrap(),
                    cu_k: s.clone_htod(&ck).unwrap(),
                    ws: poisoned(s, plan.workspace_bytes(tq)),
                };
                let a = bufs.args(s, &c);
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
                let bwd = || unsafe { plan.backward_raw(s.cu_stream(), &a, ws) }.unwrap();
                time(2, &bwd);
                let once = time(1, &bwd);
                let iters = ((0.3 / once) as usize).clamp(3, 50);
                let t = time(iters, &bwd);
                let g = bufs.grads(s);
                let finite = g
                    .iter()
                    .all(|v| DType::Bf16.decode_u16(v).iter().all(|x| x.is_finite()));
                let mut line = format!(
                    "varlen bwd speed D={d} H={heads} causal={causal} {what} ({} seqs): portable \
                     {:.3} ms = {:.1} TFLOP/s",
                    lens.len(),
                    t * 1e3,
                    flops / t / 1e12
                );
                if dev.arch() == 90 {
                    // The sm_90a pair (its production dQ-kernel tile) on the same call.
                    let t90 = Sm90BwdTile::for_head_dim(d).unwrap();
                    let p90 = VarlenBackwardPlan::with_kernel(dev, c.class(), BwdKernel::Sm90(t90))
                        .unwrap();
                    let bwd90 = || unsafe { p90.backward_raw(s.cu_stream(), &a, ws) }.unwrap();
                    time(2, &bwd90);
                    let t9 = time(iters, &bwd90);
                    line.push_str(&format!(
                        "; sm_90a pair {:.3} ms = {:.1} TFLOP/s ({:.2}x)",
                        t9 * 1e3,
                        flops / t9 / 1e12,
                        t / t9
                    ));
                }
                if what.starts_with("equal") {
                    // The dense plan on the same (16, 1024) batch: the same tiles and work.
                    let dplan = AttentionBackwardPlan::with_kernel(
                        dev,
                        c.class(),
                        Some(BwdKernel::Portable),
                    )
                    .unwrap();
                    let sh = [16, 1024, heads, d];
                    let tt = |p, sh: &[usize]| RawTensor::contiguous(p, DType::Bf16, sh).unwrap();
                    let da = BackwardArgs {
                        q: tt(a.q.ptr, &sh),
                        k: tt(a.k.ptr, &sh),
                        v: tt(a.v.ptr, &sh),
                        o: tt(a.o.ptr, &sh),
                        d_o: tt(a.d_o.ptr, &sh),
                        lse: RawTensor::contiguous(a.lse.ptr, DType::F32, &[16, heads, 1024])
                            .unwrap(),
                        dq: a.dq,
                        dk: a.dk,
                        dv: a.dv,
                    };
                    let da = BackwardArgs {
                        dq: tt(da.dq.ptr, &sh),
                        dk: tt(da.dk.ptr, &sh),
                        dv: tt(da.dv.ptr, &sh),
                        ..da
                    };
                    let dense = || unsafe { dplan.backward_raw(s.cu_stream(), &da, ws) }.unwrap();
                    time(2, &dense);
                    let td = time(iters, &dense);
                    line.push_str(&format!(
                        "; dense plan (portable) {:.3} ms = {:.1} TFLOP/s",
                        td * 1e3,
                        flops / td / 1e12
                    ));
                }
                eprintln!("{line}; gradients finite: {finite}");
                assert!(finite);
            }
        }
    });
}
