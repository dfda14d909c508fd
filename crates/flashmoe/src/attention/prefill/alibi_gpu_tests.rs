//! GPU tests of ALiBi on the portable prefill kernel ([`AttentionPlan::new_alibi`]): head
//! dims of the v1 table and between (40, 80, 160, 192), no mask / causal / sliding windows / softcap, Sq != Sk, GQA,
//! one slope vector or a [batch, heads_q] matrix, against the f64 reference
//! ([`attention_f64_alibi`]); the cudarc path; bad slopes. Outputs are poisoned (NaN)
//! before each launch, inputs fresh (seed printed). Each prints "skipped: no GPU" and passes
//! on a machine without one.

use super::plan::{AttentionArgs, AttentionClass, AttentionPlan, Bshd};
use crate::dtype::DType;
use crate::gpu::test_support::{addr, fresh_seed, with_gpu};
use crate::gpu::{Device, RawTensor};
use crate::problem::NO_WINDOW;
use crate::reference::attention::attention_f64_alibi;
use crate::reference::AttentionInputs;
use cudarc::driver::{sys, CudaSlice, CudaStream};
use std::sync::Arc;

pub(super) fn poisoned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> CudaSlice<T> {
    // 0xFF bytes: NaN in bf16, f16 and f32.
    let mut s = stream.alloc_zeros::<T>(n).unwrap();
    let bytes = n * std::mem::size_of::<T>();
    let (p, _g) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut s, stream);
    unsafe { sys::cuMemsetD8Async(p, 0xFF, bytes, stream.cu_stream()) }
        .result()
        .unwrap();
    drop(_g);
    s
}

fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect()
}

/// ALiBi's usual slopes for `h` heads (a geometric series from 2^(-8/h)), permuted by the
/// seed and scaled per batch so a [batch, heads] matrix differs between sequences.
fn slopes(h: usize, batch: usize, seed: u64) -> Vec<f32> {
    let mut out = Vec::with_capacity(batch * h);
    for b in 0..batch {
        for i in 0..h {
            let j = (i + seed as usize) % h;
            let base = 2f32.powf(-8.0 * (j + 1) as f32 / h as f32);
            out.push(base * (1.0 + 0.5 * b as f32));
        }
    }
    out
}

/// One case: head dim, (left, right) window of the class (`NO_WINDOW` = none), causal,
/// softcap, (batch, Sq, Sk), slopes per batch.
#[derive(Clone, Copy, Debug)]
struct Case {
    d: usize,
    causal: bool,
    window: (i32, i32),
    softcap: f32,
    b: usize,
    sq: usize,
    sk: usize,
    per_batch: bool,
}

fn class(c: &Case) -> AttentionClass {
    AttentionClass {
        dtype: DType::Bf16,
        head_dim: c.d,
        heads_q: 8,
        heads_kv: 2,
        causal: c.causal,
        softmax_scale: None,
        window: c.window,
        softcap: c.softcap,
    }
}

/// Run one case on the raw layer and compare with the f64 reference: global relative L2
/// of O, per-row relative error of O, LSE per row; rows the reference leaves empty (no
/// visible key) must be O = 0, LSE = -inf. NaN never passes (every comparison is written
/// so that NaN fails it).
fn run_case(dev: &Device, case: Case, seed: u64) {
    let s = dev.stream();
    let c = class(&case);
    let v = super::select::select_v1_alibi(&c.problem(1, 1, 1)).unwrap();
    if let Err(why) = v.runs_on(dev.arch()) {
        eprintln!("{case:?}: skipped on this GPU ({why})");
        return;
    }
    let plan = AttentionPlan::new_alibi(dev, c).unwrap();
    assert!(plan.alibi());
    assert_eq!(plan.variant().entry, super::abi::FLASH_ENTRY);
    let ws = plan.alloc_workspace(s).unwrap();
    let (b, sq, sk) = (case.b, case.sq, case.sk);
    let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
    let p = c.problem(b, sq, sk);
    let x = AttentionInputs::generate(&p, seed);
    let sl = slopes(hq, if case.per_batch { b } else { 1 }, seed);
    let want = attention_f64_alibi(&p, &x, &sl, if case.per_batch { hq } else { 0 }).unwrap();

    let q = s.clone_htod(&bf16_bits(&x.q)).unwrap();
    let k = s.clone_htod(&bf16_bits(&x.k)).unwrap();
    let v = s.clone_htod(&bf16_bits(&x.v)).unwrap();
    let slopes_d = s.clone_htod(&sl).unwrap();
    let o: CudaSlice<u16> = poisoned(s, b * sq * hq * d);
    let lse: CudaSlice<f32> = poisoned(s, b * hq * sq);
    let t = |p, sh: &[usize]| RawTensor::contiguous(p, DType::Bf16, sh).unwrap();
    let args = AttentionArgs {
        q: t(addr(&q, s), &[b, sq, hq, d]),
        k: t(addr(&k, s), &[b, sk, hkv, d]),
        v: t(addr(&v, s), &[b, sk, hkv, d]),
        o: t(addr(&o, s), &[b, sq, hq, d]),
        lse: RawTensor::contiguous(addr(&lse, s), DType::F32, &[b, hq, sq]).unwrap(),
    };
    let sshape: &[usize] = if case.per_batch { &[b, hq] } else { &[hq] };
    let st = RawTensor::contiguous(addr(&slopes_d, s), DType::F32, sshape).unwrap();
    unsafe { plan.forward_raw_alibi(s.cu_stream(), &args, Some(&st), ws.raw()) }.unwrap();
    let got_o: Vec<f32> = s
        .clone_dtoh(&o)
        .unwrap()
        .iter()
        .map(|&u| half::bf16::from_bits(u).to_f32())
        .collect();
    let got_l = s.clone_dtoh(&lse).unwrap();
    s.synchronize().unwrap();
    compare(&format!("{case:?} seed {seed}"), &p, &want, &got_o, &got_l);
}

pub(super) fn compare(
    tag: &str,
    p: &crate::problem::AttentionProblem,
    want: &crate::reference::AttentionOutput<f64>,
    got_o: &[f32],
    got_l: &[f32],
) {
    let (b, sq, hq, d) = (p.batch, p.seqlen_q, p.heads_q, p.head_dim);
    let (mut num, mut den, mut worst_row, mut worst_lse) = (0f64, 0f64, 0f64, 0f64);
    let mut empty = 0;
    for bi in 0..b {
        for h in 0..hq {
            for i in 0..sq {
                let li = (bi * hq + h) * sq + i;
                let off = ((bi * sq + i) * hq + h) * d;
                let (w, g) = (&want.o[off..off + d], &got_o[off..off + d]);
                let (wl, gl) = (want.lse[li], got_l[li] as f64);
                if wl == f64::NEG_INFINITY {
                    empty += 1;
                    assert!(
                        gl == f64::NEG_INFINITY && g.iter().all(|&x| x == 0.0),
                        "{tag}: row (b {bi}, h {h}, i {i}) sees no key: want O = 0, LSE = -inf, \
                         got LSE {gl}, O[0] {}",
                        g[0]
                    );
                    continue;
                }
                let (mut rn, mut rd) = (0f64, 0f64);
                for (&a, &r) in g.iter().zip(w) {
                    rn += (a as f64 - r).powi(2);
                    rd += r * r;
                }
                num += rn;
                den += rd;
                // Per row: relative to the row's norm, with a floor for rows whose output
                // is near zero (bf16 rounding of O is absolute at that scale).
                let row = rn.sqrt() / rd.sqrt().max(0.05 * (d as f64).sqrt());
                let le = (gl - wl).abs() / wl.abs().max(1.0);
                assert!(
                    row < 3e-2,
                    "{tag}: row (b {bi}, h {h}, i {i}) rel err {row:.3e}"
                );
                // tanh.approx (about 2^-11 relative) moves softcapped logits by up to
                // softcap * 2^-11.
                let lse_tol = if p.softcap > 0.0 { 1e-2 } else { 2e-3 };
                assert!(
                    le < lse_tol,
                    "{tag}: row (b {bi}, h {h}, i {i}) LSE {gl} vs {wl} ({le:.3e})"
                );
                worst_row = worst_row.max(row);
                worst_lse = worst_lse.max(le);
            }
        }
    }
    let rel = (num / den).sqrt();
    eprintln!(
        "{tag}: rel L2 {rel:.2e}, worst row {worst_row:.2e}, worst LSE {worst_lse:.2e}, \
         {empty} empty rows"
    );
    assert!(rel < 1e-2, "{tag}: global rel L2 {rel:.3e}");
}

/// Head dims 32 to 256 (table and in-between ones) with causal + slopes per batch, and at D = 64 and
/// 128 every mask: none, causal, sliding windows (left only, both sides, right only),
/// softcap, window + softcap; Sq < Sk, Sq > Sk (rows that see no key), ragged tiles.
#[test]
fn alibi_matches_f64_reference() {
    with_gpu("alibi-ref", |dev| {
        let seed = fresh_seed("alibi-ref");
        let base = Case {
            d: 128,
            causal: false,
            window: NO_WINDOW,
            softcap: 0.0,
            b: 2,
            sq: 173,
            sk: 301,
            per_batch: false,
        };
        let mut cases = Vec::new();
        for d in [32, 40, 64, 80, 96, 128, 160, 192, 256] {
            cases.push(Case {
                d,
                causal: true,
                per_batch: true,
                ..base
            });
        }
        for d in [64, 128] {
            let c = Case { d, ..base };
            cases.extend([
                c,
                Case { causal: true, ..c },
                Case {
                    causal: true,
                    sq: 300,
                    sk: 130,
                    ..c
                },
                Case {
                    causal: true,
                    window: (45, -1),
                    ..c
                },
                Case {
                    window: (30, 17),
                    per_batch: true,
                    ..c
                },
                Case {
                    window: (-1, 5),
                    sq: 257,
                    sk: 64,
                    ..c
                },
                Case { softcap: 5.0, ..c },
                Case {
                    causal: true,
                    window: (60, -1),
                    softcap: 2.0,
                    sq: 400,
                    sk: 400,
                    ..c
                },
                Case {
                    b: 1,
                    sq: 1,
                    sk: 999,
                    ..c
                },
            ]);
        }
        for (i, case) in cases.into_iter().enumerate() {
            run_case(dev, case, seed.wrapping_add(i as u64 * 7919));
        }
    });
}

/// The cudarc (candle-storage) path: `forward_alibi` over `CudaSlice<bf16>` gives the raw
/// layer's bits.
#[test]
fn alibi_cudarc_path_matches_raw() {
    with_gpu("alibi-cudarc", |dev| {
        let s = dev.stream();
        let seed = fresh_seed("alibi-cudarc");
        let case = Case {
            d: 64,
            causal: true,
            window: NO_WINDOW,
            softcap: 0.0,
            b: 2,
            sq: 150,
            sk: 150,
            per_batch: false,
        };
        let c = class(&case);
        let plan = AttentionPlan::new_alibi(dev, c).unwrap();
        let mut ws = plan.alloc_workspace(s).unwrap();
        let (b, sq, sk, hq, hkv, d) = (2, 150, 150, 8, 2, 64);
        let p = c.problem(b, sq, sk);
        let x = AttentionInputs::generate(&p, seed);
        let bf =
            |v: &[f32]| -> Vec<half::bf16> { v.iter().map(|&x| half::bf16::from_f32(x)).collect() };
        let (q, k, v) = (
            s.clone_htod(&bf(&x.q)).unwrap(),
            s.clone_htod(&bf(&x.k)).unwrap(),
            s.clone_htod(&bf(&x.v)).unwrap(),
        );
        let sl = slopes(hq, 1, seed);
        let sd = s.clone_htod(&sl).unwrap();
        let mut o: CudaSlice<half::bf16> = poisoned(s, b * sq * hq * d);
        let mut lse: CudaSlice<f32> = poisoned(s, b * hq * sq);
        plan.forward_alibi(
            s,
            Bshd::contiguous(&q, [b, sq, hq, d]),
            Bshd::contiguous(&k, [b, sk, hkv, d]),
            Bshd::contiguous(&v, [b, sk, hkv, d]),
            Bshd::contiguous(&mut o, [b, sq, hq, d]),
            &mut lse,
            (&sd, &[hq]),
            &mut ws,
        )
        .unwrap();
        let got_o: Vec<f32> = s
            .clone_dtoh(&o)
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let got_l = s.clone_dtoh(&lse).unwrap();
        s.synchronize().unwrap();
        let want = attention_f64_alibi(&p, &x, &sl, 0).unwrap();
        compare(&format!("cudarc seed {seed}"), &p, &want, &got_o, &got_l);
        // A short slope buffer is refused before any launch.
        let short = s.clone_htod(&sl[..hq - 1]).unwrap();
        let e = plan
            .forward_alibi(
                s,
                Bshd::contiguous(&q, [b, sq, hq, d]),
                Bshd::contiguous(&k, [b, sk, hkv, d]),
                Bshd::contiguous(&v, [b, sk, hkv, d]),
                Bshd::contiguous(&mut o, [b, sq, hq, d]),
                &mut lse,
                (&short, &[hq]),
                &mut ws,
            )
            .unwrap_err();
        assert!(e.to_string().contains("alibi_slopes"), "{e}");
    });
}

/// Bad slopes are errors naming the rule: missing on an ALiBi plan, passed to a plain plan,
/// wrong dtype, wrong shape, a strided head dimension.
#[test]
fn alibi_bad_slopes_are_errors() {
    with_gpu("alibi-bad", |dev| {
        let s = dev.stream();
        let case = Case {
            d: 64,
            causal: false,
            window: NO_WINDOW,
            softcap: 0.0,
            b: 2,
            sq: 16,
            sk: 16,
            per_batch: false,
        };
        let c = class(&case);
        let plan = AttentionPlan::new_alibi(dev, c).unwrap();
        let plain = AttentionPlan::new(dev, c).unwrap();
        let buf: CudaSlice<f32> = s.alloc_zeros(64).unwrap();
        let p = addr(&buf, s);
        let f = |sh: &[usize]| RawTensor::contiguous(p, DType::F32, sh).unwrap();
        assert_eq!(plan.check_alibi(Some(&f(&[8])), 2).unwrap(), 0);
        assert_eq!(plan.check_alibi(Some(&f(&[2, 8])), 2).unwrap(), 8);
        let msg = |r: crate::error::Result<i32>| r.unwrap_err().to_string();
        assert!(msg(plan.check_alibi(None, 2)).contains("pass the slopes"));
        assert!(msg(plain.check_alibi(Some(&f(&[8])), 2)).contains("without ALiBi"));
        assert!(msg(plan.check_alibi(Some(&f(&[4])), 2)).contains("shape"));
        assert!(msg(plan.check_alibi(Some(&f(&[3, 8])), 2)).contains("shape"));
        assert!(msg(plan.check_alibi(Some(&f(&[2, 2, 8])), 2)).contains("shape"));
        let bf = RawTensor::contiguous(p, DType::Bf16, &[8]).unwrap();
        assert!(msg(plan.check_alibi(Some(&bf), 2)).contains("f32"));
        let strided = RawTensor::new(p, DType::F32, &[8], &[2]).unwrap();
        assert!(msg(plan.check_alibi(Some(&strided), 2)).contains("contiguous"));
    });
}
