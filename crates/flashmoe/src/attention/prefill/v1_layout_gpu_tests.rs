//! GPU tests of the portable prefill kernel's head dims and layouts: every multiple of 8 up
//! to 256 is served (here 8, 40, 80, 96, 120, 160, 192, 256: table and in-between head
//! dims), and q, k, v and o may be any strided views with a contiguous last dimension
//! (transposed (batch, heads, seq, dim) memory viewed as (batch, seq, heads, dim)). Against
//! the f64 reference with poisoned outputs and fresh inputs (seed printed). Each prints
//! "skipped: no GPU" and passes on a machine without one.

use super::alibi_gpu_tests::{compare, poisoned};
use super::plan::{AttentionArgs, AttentionClass, AttentionPlan};
use super::{abi, select};
use crate::dtype::DType;
use crate::gpu::test_support::{fresh_seed, with_gpu};
use crate::gpu::{Device, RawTensor};
use crate::problem::NO_WINDOW;
use crate::reference::{attention_f64, AttentionInputs};
use cudarc::driver::{CudaSlice, DevicePtr};

fn class(d: usize, causal: bool) -> AttentionClass {
    AttentionClass {
        dtype: DType::Bf16,
        head_dim: d,
        heads_q: 6,
        heads_kv: 2,
        causal,
        softmax_scale: None,
        window: NO_WINDOW,
        softcap: 0.0,
    }
}

/// (batch, seq, heads, dim) values laid out as (batch, heads, seq, dim): the buffer and the
/// strides that view it as (batch, seq, heads, dim).
fn transposed(x: &[f32], b: usize, s: usize, h: usize, d: usize) -> (Vec<u16>, [usize; 4]) {
    let mut out = vec![0u16; x.len()];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let src = ((bi * s + si) * h + hi) * d;
                let dst = ((bi * h + hi) * s + si) * d;
                for e in 0..d {
                    out[dst + e] = half::bf16::from_f32(x[src + e]).to_bits();
                }
            }
        }
    }
    (out, [h * s * d, d, s * d, 1])
}

fn contiguous(x: &[f32], s: usize, h: usize, d: usize) -> (Vec<u16>, [usize; 4]) {
    let out = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    (out, [s * h * d, h * d, d, 1])
}

/// One call of `plan` with q, k, v and o laid out by `layout` (contiguous or transposed);
/// checked against the f64 reference.
fn run(
    dev: &Device,
    plan: &AttentionPlan,
    (b, sq, sk): (usize, usize, usize),
    transpose: bool,
    seed: u64,
) {
    let s = dev.stream();
    let c = *plan.class();
    let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
    let p = c.problem(b, sq, sk);
    let x = AttentionInputs::generate(&p, seed);
    let lay = |v: &[f32], n: usize, h: usize| {
        if transpose {
            transposed(v, b, n, h, d)
        } else {
            contiguous(v, n, h, d)
        }
    };
    let (qh, qs) = lay(&x.q, sq, hq);
    let (kh, ks) = lay(&x.k, sk, hkv);
    let (vh, vs) = lay(&x.v, sk, hkv);
    let (q, k, v) = (
        s.clone_htod(&qh).unwrap(),
        s.clone_htod(&kh).unwrap(),
        s.clone_htod(&vh).unwrap(),
    );
    let os = if transpose {
        [hq * sq * d, d, sq * d, 1]
    } else {
        [sq * hq * d, hq * d, d, 1]
    };
    let o: CudaSlice<u16> = poisoned(s, b * sq * hq * d);
    let lse: CudaSlice<f32> = poisoned(s, b * hq * sq);
    let a = |t: &CudaSlice<u16>| t.device_ptr(s).0;
    let t = |p, sh: [usize; 4], st: [usize; 4]| RawTensor::new(p, DType::Bf16, &sh, &st).unwrap();
    let args = AttentionArgs {
        q: t(a(&q), [b, sq, hq, d], qs),
        k: t(a(&k), [b, sk, hkv, d], ks),
        v: t(a(&v), [b, sk, hkv, d], vs),
        o: t(a(&o), [b, sq, hq, d], os),
        lse: RawTensor::contiguous(lse.device_ptr(s).0, DType::F32, &[b, hq, sq]).unwrap(),
    };
    let ws = plan.alloc_workspace(s).unwrap();
    unsafe { plan.forward_raw(s.cu_stream(), &args, ws.raw()) }.unwrap();
    let raw = s.clone_dtoh(&o).unwrap();
    let got_l = s.clone_dtoh(&lse).unwrap();
    s.synchronize().unwrap();
    // Back to (batch, seq, heads, dim) for the comparison.
    let mut got_o = vec![0f32; raw.len()];
    for bi in 0..b {
        for si in 0..sq {
            for hi in 0..hq {
                let src = bi * os[0] + si * os[1] + hi * os[2];
                let dst = ((bi * sq + si) * hq + hi) * d;
                for e in 0..d {
                    got_o[dst + e] = half::bf16::from_bits(raw[src + e]).to_f32();
                }
            }
        }
    }
    let want = attention_f64(&p, &x).unwrap();
    let tag = format!(
        "D={d} causal={} window={:?} softcap={} transposed={transpose} b={b} sq={sq} sk={sk} \
         seed {seed}",
        c.causal, c.window, c.softcap
    );
    compare(&tag, &p, &want, &got_o, &got_l);
}

/// Head dims between and at the table's on the portable kernel (the plan's own choice for
/// every head dim but 64 and 128 on Hopper; forced for those), causal and not, Sq != Sk.
#[test]
fn v1_head_dims_match_f64_reference() {
    with_gpu("v1-head-dims", |dev| {
        let seed = fresh_seed("v1-head-dims");
        for (i, d) in [8, 40, 64, 80, 96, 120, 128, 160, 192, 256]
            .into_iter()
            .enumerate()
        {
            for causal in [false, true] {
                let c = class(d, causal);
                let v = select::select_v1(&c.problem(1, 1, 1)).unwrap();
                if let Err(why) = v.runs_on(dev.arch()) {
                    eprintln!("D={d}: skipped on this GPU ({why})");
                    continue;
                }
                let plan = AttentionPlan::with_variant(dev, c, v).unwrap();
                assert_eq!(plan.variant().entry, abi::FLASH_ENTRY);
                for (j, shape) in [(2, 131, 257), (1, 300, 77)].into_iter().enumerate() {
                    run(dev, &plan, shape, false, seed + (i * 10 + j) as u64);
                }
            }
        }
    });
}

/// Transposed views ((batch, heads, seq, dim) memory seen as (batch, seq, heads, dim)) for
/// q, k, v and o on the portable kernel: no copy, same results as the reference.
#[test]
fn v1_strided_views_match_f64_reference() {
    with_gpu("v1-strided", |dev| {
        let seed = fresh_seed("v1-strided");
        for (i, d) in [40, 64, 128, 192].into_iter().enumerate() {
            for causal in [false, true] {
                let c = class(d, causal);
                let v = select::select_v1(&c.problem(1, 1, 1)).unwrap();
                if let Err(why) = v.runs_on(dev.arch()) {
                    eprintln!("D={d}: skipped on this GPU ({why})");
                    continue;
                }
                let plan = AttentionPlan::with_variant(dev, c, v).unwrap();
                run(dev, &plan, (2, 200, 333), true, seed + i as u64);
            }
        }
    });
}

/// Sliding windows and softcap without ALiBi on the portable kernel (`select_v1`: what runs
/// them off Hopper and for head dims other than 64 and 128; forced here on every GPU), the
/// masks alone and together, Sq != Sk, contiguous and transposed layouts.
#[test]
fn v1_windows_and_softcap_match_f64_reference() {
    with_gpu("v1-masks", |dev| {
        let seed = fresh_seed("v1-masks");
        let mut n = 0;
        for (i, d) in [32, 64, 96, 128, 192, 256].into_iter().enumerate() {
            for (j, (causal, window, softcap)) in [
                (true, (45, -1), 0.0),
                (false, (30, 17), 0.0),
                (false, (-1, -1), 5.0),
                (true, (60, -1), 2.0),
            ]
            .into_iter()
            .enumerate()
            {
                let c = AttentionClass {
                    window,
                    softcap,
                    ..class(d, causal)
                };
                let v = select::select_v1(&c.problem(1, 1, 1)).unwrap();
                if let Err(why) = v.runs_on(dev.arch()) {
                    eprintln!("D={d}: skipped on this GPU ({why})");
                    continue;
                }
                assert_eq!(v.define("FM_WINDOW").is_some(), window != NO_WINDOW);
                assert_eq!(v.define("FM_SOFTCAP").is_some(), softcap > 0.0);
                assert!(v.define("FM_ALIBI").is_none());
                let plan = AttentionPlan::with_variant(dev, c, v).unwrap();
                let s0 = seed + (i * 100 + j * 10) as u64;
                run(dev, &plan, (2, 173, 301), false, s0);
                run(dev, &plan, (1, 300, 130), j == 3, s0 + 1);
                n += 2;
            }
        }
        // The plan's own choice off the sm_90a kernel's head dims (any GPU): the portable one.
        let c = AttentionClass {
            window: (64, -1),
            softcap: 30.0,
            ..class(96, true)
        };
        let plan = AttentionPlan::new(dev, c).unwrap();
        assert_eq!(plan.variant().entry, abi::FLASH_ENTRY);
        run(dev, &plan, (2, 257, 257), false, seed + 7);
        eprintln!("v1-masks: {} calls passed", n + 1);
    });
}
