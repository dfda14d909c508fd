//! GPU tests of [`DecodePlan`] against the f64 paged reference
//! ([`crate::reference::decode`]): shuffled page tables, ragged lengths, GQA 1..16, Sq
//! 1..16, windows, softcap, forced and heuristic splits, append then decode, a dense cache,
//! CUDA-graph replay, the cudarc path and bad input. Each prints "skipped: no GPU" and
//! passes without one. Inputs are fresh random values (seed printed); cache rows past
//! `seqused_k` and unused blocks hold NaN, and outputs start poisoned (NaN), so a read of
//! an unused row or an unwritten output fails the check.

use super::{
    identity_block_table, AppendArgs, DecodeArgs, DecodeClass, DecodePlan, RawIndex,
    MAX_SPLIT_GROUPS,
};
use crate::accuracy::{check, check_lse};
use crate::attention::plan::Bshd;
use crate::dtype::DType;
use crate::gpu::test_support::{addr, fresh_seed, with_gpu, Rng};
use crate::gpu::{Device, RawTensor};
use crate::reference::decode::{
    paged_decode_f64, paged_decode_f64_alibi, PagedDecodeInputs, PagedDecodeSpec,
};
use cudarc::driver::{sys, CudaSlice, CudaStream};
use std::sync::Arc;

const NAN16: u16 = 0xFFFF;

fn poison<T>(stream: &Arc<CudaStream>, s: &mut CudaSlice<T>) {
    let n = s.len() * std::mem::size_of::<T>();
    let (p, _g) = cudarc::driver::DevicePtrMut::device_ptr_mut(s, stream);
    unsafe { sys::cuMemsetD8Async(p, 0xFF, n, stream.cu_stream()) }
        .result()
        .unwrap();
}

/// One decode scenario.
#[derive(Clone, Debug)]
struct Case {
    class: DecodeClass,
    seqused: Vec<usize>,
    sq: usize,
    splits: Option<usize>,
    /// Elements of padding after each cache block (a strided block dimension).
    block_pad: usize,
    /// Multiplies q (makes softcap bite).
    q_gain: f32,
    /// Mixed batch: rows per sequence (cu_seqlens_q, packed q); None: `sq` each.
    lens_q: Option<Vec<usize>>,
}

impl Case {
    fn new(class: DecodeClass, seqused: &[usize], sq: usize, splits: Option<usize>) -> Case {
        Case {
            class,
            seqused: seqused.to_vec(),
            sq,
            splits,
            block_pad: 0,
            q_gain: 1.0,
            lens_q: None,
        }
    }

    /// A mixed batch: sequence b has `lens_q[b]` rows (0..=max_q_per_seq).
    fn mixed(
        class: DecodeClass,
        seqused: &[usize],
        lens_q: &[usize],
        splits: Option<usize>,
    ) -> Case {
        Case {
            lens_q: Some(lens_q.to_vec()),
            ..Case::new(class, seqused, class.max_q_per_seq, splits)
        }
    }

    /// Query tokens of the call and the cu_seqlens_q offsets (mixed batches).
    fn tokens(&self) -> (usize, Option<Vec<usize>>) {
        match &self.lens_q {
            None => (self.seqused.len() * self.sq, None),
            Some(l) => {
                let mut cu = vec![0];
                for &n in l {
                    cu.push(cu.last().unwrap() + n);
                }
                (*cu.last().unwrap(), Some(cu))
            }
        }
    }
}

/// Host and device state of a scenario: a paged cache with shuffled block ids.
struct Paged {
    spec: PagedDecodeSpec,
    host: PagedDecodeInputs,
    /// Host cache bits in the device layout (with block padding).
    kc_bits: Vec<u16>,
    vc_bits: Vec<u16>,
    block_elems: usize,
    q: CudaSlice<u16>,
    kc: CudaSlice<u16>,
    vc: CudaSlice<u16>,
    bt: CudaSlice<i32>,
    su: CudaSlice<i32>,
    cu: Option<CudaSlice<i32>>,
    o: CudaSlice<u16>,
    lse: CudaSlice<f32>,
}

fn cls(dtype: DType, d: usize, hq: usize, hkv: usize, ps: usize, maxq: usize) -> DecodeClass {
    DecodeClass::causal(dtype, d, hq, hkv, ps, maxq)
}

impl Paged {
    /// Pages for `capacity[b]` keys per sequence (>= seqused), filled for `seqused` keys.
    fn build(s: &Arc<CudaStream>, c: &Case, capacity: &[usize], rng: &mut Rng) -> Paged {
        let cl = &c.class;
        let dt = cl.dtype;
        let (b, hq, hkv, d) = (c.seqused.len(), cl.heads_q, cl.heads_kv, cl.head_dim);
        let ps = cl.page_size;
        let pages: Vec<usize> = capacity.iter().map(|&n| n.div_ceil(ps).max(1)).collect();
        let max_blocks = pages.iter().max().copied().unwrap() + 1;
        let num_blocks = pages.iter().sum::<usize>() + 3;
        let mut perm: Vec<usize> = (0..num_blocks).collect();
        for i in (1..num_blocks).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        let mut table = vec![-1i32; b * max_blocks];
        let mut next = 0;
        for (bi, &np) in pages.iter().enumerate() {
            for j in 0..np {
                table[bi * max_blocks + j] = perm[next] as i32;
                next += 1;
            }
        }
        let row = hkv * d;
        let block_elems = ps * row + c.block_pad;
        let mut kc_bits = vec![NAN16; num_blocks * block_elems];
        let mut vc_bits = kc_bits.clone();
        // Host f32 caches in the reference layout (no padding): NaN where the device has NaN.
        let mut kh = vec![f32::NAN; num_blocks * ps * row];
        let mut vh = kh.clone();
        for (bi, &n) in c.seqused.iter().enumerate() {
            for j in 0..n {
                let blk = table[bi * max_blocks + j / ps] as usize;
                let dev_off = blk * block_elems + (j % ps) * row;
                let host_off = (blk * ps + j % ps) * row;
                for e in 0..row {
                    let (kx, vx) = (dt.round(rng.uniform()), dt.round(rng.uniform()));
                    kc_bits[dev_off + e] = dt.encode_one_u16(kx);
                    vc_bits[dev_off + e] = dt.encode_one_u16(vx);
                    kh[host_off + e] = kx;
                    vh[host_off + e] = vx;
                }
            }
        }
        let (tokens, cu) = c.tokens();
        let qf: Vec<f32> = (0..tokens * hq * d)
            .map(|_| dt.round(c.q_gain * rng.uniform()))
            .collect();
        let spec = PagedDecodeSpec {
            batch: b,
            seqlen_q: c.sq,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            num_blocks,
            page_size: ps,
            max_blocks,
            window: (cl.window.0 as i64, cl.window.1 as i64),
            softcap: cl.softcap as f64,
            scale: cl.scale() as f64,
        };
        let su: Vec<i32> = c.seqused.iter().map(|&n| n as i32).collect();
        let mut o = s.alloc_zeros::<u16>(tokens * hq * d).unwrap();
        let mut lse = s.alloc_zeros::<f32>(tokens * hq).unwrap();
        poison(s, &mut o);
        poison(s, &mut lse);
        let cu_dev = cu.as_ref().map(|cu| {
            s.clone_htod(&cu.iter().map(|&x| x as i32).collect::<Vec<_>>())
                .unwrap()
        });
        Paged {
            q: s.clone_htod(&dt.encode_u16(&qf)).unwrap(),
            kc: s.clone_htod(&kc_bits).unwrap(),
            vc: s.clone_htod(&vc_bits).unwrap(),
            bt: s.clone_htod(&table).unwrap(),
            su: s.clone_htod(&su).unwrap(),
            cu: cu_dev,
            o,
            lse,
            host: PagedDecodeInputs {
                q: qf,
                k_cache: kh,
                v_cache: vh,
                block_table: table,
                seqused_k: c.seqused.clone(),
                cu_seqlens_q: cu,
            },
            kc_bits,
            vc_bits,
            block_elems,
            spec,
        }
    }

    fn cache_tensor(
        &self,
        s: &Arc<CudaStream>,
        c: &DecodeClass,
        buf: &CudaSlice<u16>,
    ) -> RawTensor {
        let (hkv, d, ps) = (c.heads_kv, c.head_dim, self.spec.page_size);
        RawTensor::new(
            addr(buf, s),
            c.dtype,
            &[self.spec.num_blocks, ps, hkv, d],
            &[self.block_elems, hkv * d, d, 1],
        )
        .unwrap()
    }

    fn args(&self, s: &Arc<CudaStream>, c: &DecodeClass) -> DecodeArgs {
        let (b, sq, hq, d) = (self.spec.batch, self.spec.seqlen_q, c.heads_q, c.head_dim);
        let max_sk = self.host.seqused_k.iter().copied().max().unwrap_or(0);
        let t = |buf: &CudaSlice<u16>, shape: &[usize]| {
            RawTensor::contiguous(addr(buf, s), c.dtype, shape).unwrap()
        };
        let lse =
            |shape: &[usize]| RawTensor::contiguous(addr(&self.lse, s), DType::F32, shape).unwrap();
        let (q, o, lse, cu) = match &self.cu {
            None => (
                t(&self.q, &[b, sq, hq, d]),
                t(&self.o, &[b, sq, hq, d]),
                lse(&[b, hq, sq]),
                None,
            ),
            Some(cu) => {
                let total = self.host.cu_seqlens_q.as_ref().unwrap()[b];
                (
                    t(&self.q, &[total, hq, d]),
                    t(&self.o, &[total, hq, d]),
                    lse(&[hq, total]),
                    Some(RawIndex::vector(addr(cu, s), b + 1)),
                )
            }
        };
        DecodeArgs {
            q,
            k_cache: self.cache_tensor(s, c, &self.kc),
            v_cache: self.cache_tensor(s, c, &self.vc),
            block_table: RawIndex::matrix(addr(&self.bt, s), b, self.spec.max_blocks),
            seqused_k: RawIndex::vector(addr(&self.su, s), b),
            o,
            lse,
            max_seqlen_k: Some(max_sk.max(1)),
            cu_seqlens_q: cu,
        }
    }

    fn outputs(&self, s: &Arc<CudaStream>, dt: DType) -> (Vec<f32>, Vec<f32>) {
        let o = s.clone_dtoh(&self.o).unwrap();
        let l = s.clone_dtoh(&self.lse).unwrap();
        s.synchronize().unwrap();
        (dt.decode_u16(&o), l)
    }

    /// Gate the device outputs against the f64 reference; panics with `tag` on failure.
    fn verify(&self, s: &Arc<CudaStream>, dt: DType, tag: &str) -> (Vec<f32>, Vec<f32>) {
        let (o, l) = self.outputs(s, dt);
        let want = paged_decode_f64(&self.spec, &self.host).unwrap();
        let co = check(&o, &want.o, dt);
        let cl = check_lse(&l, &want.lse);
        assert!(
            co.passed,
            "{tag}: o fails: {:?} (rel L2 {:.2e}, max abs {:.2e})",
            co.reason, co.metrics.rel_l2, co.metrics.max_abs
        );
        assert!(cl.passed, "{tag}: lse fails: {:?}", cl.reason);
        eprintln!(
            "{tag}: ok (o rel L2 {:.2e}, max abs {:.2e}; lse max abs {:.2e})",
            co.metrics.rel_l2, co.metrics.max_abs, cl.metrics.max_abs
        );
        (o, l)
    }
}

/// Build, run and verify one case; returns the plan's split count.
fn run_case(dev: &Device, c: &Case, rng: &mut Rng) -> usize {
    let s = dev.stream();
    let p = Paged::build(s, c, &c.seqused, rng);
    let plan = DecodePlan::new(dev, c.class).unwrap().with_splits(c.splits);
    let a = p.args(s, &c.class);
    let shape = plan.check(&a).unwrap();
    let ws = plan
        .alloc_workspace(s, shape.batch, shape.max_seqlen_k)
        .unwrap();
    unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
    let tag = format!(
        "{} D={} Hq={} Hkv={} page={} Sq={} lens_q={:?} seqused={:?} window={:?} softcap={} splits={} (m_blocks {})",
        c.class.dtype,
        c.class.head_dim,
        c.class.heads_q,
        c.class.heads_kv,
        c.class.page_size,
        c.sq,
        c.lens_q,
        c.seqused,
        c.class.window,
        c.class.softcap,
        shape.splits,
        shape.m_blocks
    );
    let (o1, l1) = p.verify(s, c.class.dtype, &tag);
    if shape.splits > 1 {
        // The merge left every ticket at zero, and a second launch over the same workspace
        // gives the same bits (the merge order does not depend on arrival order).
        let t = s
            .clone_dtoh(&ws.buffer().slice(0..MAX_SPLIT_GROUPS * 4))
            .unwrap();
        assert!(t.iter().all(|&x| x == 0), "{tag}: tickets not reset");
        let mut p = p;
        poison(s, &mut p.o);
        poison(s, &mut p.lse);
        unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
        let (o2, l2) = p.outputs(s, c.class.dtype);
        assert!(
            o1.iter().zip(&o2).all(|(x, y)| x.to_bits() == y.to_bits())
                && l1.iter().zip(&l2).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{tag}: a second launch differs"
        );
    }
    shape.splits
}

/// Mixed batches (cu_seqlens_q): decode, speculative and chunked rows (0..=max_q_per_seq,
/// empty sequences too) in one packed call, against the reference per sequence; GQA 1..16,
/// pages 16..256, windows touching both ends, softcap, splits 1 / heuristic / many.
#[test]
fn decode_mixed_batches_match_reference() {
    with_gpu("decode-mixed", |dev| {
        let mut rng = Rng(fresh_seed("decode-mixed"));
        let bf = DType::Bf16;
        let mut n = 0;
        for &(hq, hkv, maxq, ps, window, softcap) in &[
            (32, 8, 1, 16, (-1, 0), 0.0),
            (32, 8, 4, 16, (-1, 0), 0.0),
            (8, 8, 16, 64, (-1, 0), 0.0),
            (16, 1, 16, 256, (-1, 0), 0.0),
            (14, 2, 7, 48, (33, 0), 0.0),
            (32, 2, 5, 128, (-1, 0), 30.0),
            (8, 4, 3, 16, (5, 2), 0.0),
        ] {
            let c = DecodeClass {
                window,
                softcap,
                ..cls(bf, 128, hq, hkv, ps, maxq)
            };
            // Ragged rows per sequence (1 and the maximum always present, 0 when it fits).
            let lens: Vec<usize> = [1, maxq, maxq / 2, 0, (maxq + 1) / 3, maxq]
                .iter()
                .map(|&x| x.min(maxq))
                .collect();
            let seqused = [1, ps - 1, ps + 1, 97, 1031, 2999];
            for splits in [Some(1), None, Some(11)] {
                let mut case = Case::mixed(c, &seqused, &lens, splits);
                case.q_gain = if softcap > 0.0 { 4.0 } else { 1.0 };
                run_case(dev, &case, &mut rng);
                n += 1;
            }
        }
        // f16, D = 64 and 256, and a batch of one-row decodes next to a 16-row chunk.
        for d in [64, 256] {
            let c = cls(DType::F16, d, 16, 4, 32, 16);
            let lens = [16, 1, 1, 1, 9];
            run_case(
                dev,
                &Case::mixed(c, &[700, 33, 64, 1, 2000], &lens, None),
                &mut rng,
            );
            n += 1;
        }
        eprintln!("decode-mixed: {n} cases passed");
    });
}

/// GQA ratios 1, 2, 4, 7, 8, 16 × Sq 1..16 × page sizes × ragged lengths (1, page ± 1,
/// primes, one long sequence) × splits forced 1 / heuristic / many, bf16 D = 128.
#[test]
fn decode_matches_reference_gqa_sq_pages_splits() {
    with_gpu("decode-matrix", |dev| {
        let mut rng = Rng(fresh_seed("decode-matrix"));
        let bf = DType::Bf16;
        let mut n = 0;
        for &(hq, hkv, sq, ps) in &[
            (8, 8, 1, 16),
            (8, 4, 2, 16),
            (16, 4, 1, 256),
            (14, 2, 3, 48),
            (32, 4, 1, 16),
            (32, 2, 1, 128),
            (8, 1, 16, 16),
            (4, 4, 16, 32),
            (16, 1, 5, 64),
            (12, 3, 7, 16),
        ] {
            let c = cls(bf, 128, hq, hkv, ps, sq.max(2));
            let seqused = [1, ps - 1, ps + 1, 97, 1031, 2999];
            for splits in [Some(1), None, Some(13)] {
                run_case(dev, &Case::new(c, &seqused, sq, splits), &mut rng);
                n += 1;
            }
        }
        // The heuristic splits a lone long sequence.
        let c = cls(bf, 128, 32, 8, 16, 1);
        let got = run_case(dev, &Case::new(c, &[8192], 1, None), &mut rng);
        assert!(got > 1, "B=1 Hkv=8 Sk=8192 ran unsplit");
        // Many splits: more than the tiles of most sequences (empty splits).
        run_case(dev, &Case::new(c, &[5, 300, 4000], 1, Some(100)), &mut rng);
        eprintln!("decode-matrix: {} cases passed", n + 2);
    });
}

/// f16, head dims 64 and 256, strided cache blocks.
#[test]
fn decode_matches_reference_dtypes_and_head_dims() {
    with_gpu("decode-dims", |dev| {
        let mut rng = Rng(fresh_seed("decode-dims"));
        for dt in [DType::F16, DType::Bf16] {
            for d in [64, 128, 256] {
                for &(hq, hkv, sq) in &[(8, 2, 1), (16, 2, 4), (7, 1, 16)] {
                    let c = cls(dt, d, hq, hkv, 32, sq);
                    let mut case = Case::new(c, &[33, 1, 700, 64], sq, None);
                    case.block_pad = 8 * (d % 3 + 1);
                    run_case(dev, &case, &mut rng);
                    case.splits = Some(5);
                    run_case(dev, &case, &mut rng);
                }
            }
        }
    });
}

/// Sliding windows touching both ends of the keys, right windows, softcap and a custom
/// scale, with and without splits.
#[test]
fn decode_windows_and_softcap_match_reference() {
    with_gpu("decode-window", |dev| {
        let mut rng = Rng(fresh_seed("decode-window"));
        for window in [
            (0, 0),
            (7, 0),
            (31, 2),
            (200, -1),
            (-1, 5),
            (5000, 0),
            (64, 64),
            (-1, -1),
        ] {
            for (softcap, scale) in [(0.0, None), (2.0, None), (30.0, Some(0.3))] {
                for dt in [DType::Bf16, DType::F16] {
                    let c = DecodeClass {
                        window,
                        softcap,
                        softmax_scale: scale,
                        ..cls(dt, 128, 16, 4, 16, 4)
                    };
                    let mut case = Case::new(c, &[3, 17, 200, 1500], 4, None);
                    case.q_gain = 4.0;
                    run_case(dev, &case, &mut rng);
                    case.splits = Some(9);
                    run_case(dev, &case, &mut rng);
                }
            }
        }
    });
}

/// Append Snew rows into the pages (positions seqused .. + Snew), advance seqused, decode
/// the Snew new rows: the caches equal the host's bit for bit and the output matches the
/// reference.
#[test]
fn append_then_decode() {
    with_gpu("decode-append", |dev| {
        let s = dev.stream();
        let mut rng = Rng(fresh_seed("decode-append"));
        for (ps, snew) in [(16, 1), (16, 3), (64, 16), (32, 5)] {
            let c = cls(DType::Bf16, 128, 16, 4, ps, snew);
            let before = [5usize, 16, 31, 100, 0];
            let after: Vec<usize> = before.iter().map(|n| n + snew).collect();
            let case = Case::new(c, &before, snew, None);
            let mut p = Paged::build(s, &case, &after, &mut rng);
            let plan = DecodePlan::new(dev, c).unwrap();
            let (b, hkv, d) = (before.len(), c.heads_kv, c.head_dim);
            let row = hkv * d;
            let mut kn = vec![0f32; b * snew * row];
            let mut vn = kn.clone();
            for x in kn.iter_mut().chain(vn.iter_mut()) {
                *x = c.dtype.round(rng.uniform());
            }
            let knd = s.clone_htod(&c.dtype.encode_u16(&kn)).unwrap();
            let vnd = s.clone_htod(&c.dtype.encode_u16(&vn)).unwrap();
            let t = |buf: &CudaSlice<u16>| {
                RawTensor::contiguous(addr(buf, s), c.dtype, &[b, snew, hkv, d]).unwrap()
            };
            let a = p.args(s, &c);
            let app = AppendArgs {
                k_new: t(&knd),
                v_new: t(&vnd),
                k_cache: a.k_cache,
                v_cache: a.v_cache,
                block_table: a.block_table,
                seqused_k: a.seqused_k,
            };
            unsafe { plan.append_kv_raw(s.cu_stream(), &app) }.unwrap();
            // Host: the same rows at the same places.
            let mb = p.spec.max_blocks;
            for (bi, &n0) in before.iter().enumerate() {
                for t in 0..snew {
                    let pos = n0 + t;
                    let blk = p.host.block_table[bi * mb + pos / ps] as usize;
                    let src = (bi * snew + t) * row;
                    let dev_off = blk * p.block_elems + (pos % ps) * row;
                    let host_off = (blk * ps + pos % ps) * row;
                    for e in 0..row {
                        p.kc_bits[dev_off + e] = c.dtype.encode_one_u16(kn[src + e]);
                        p.vc_bits[dev_off + e] = c.dtype.encode_one_u16(vn[src + e]);
                        p.host.k_cache[host_off + e] = kn[src + e];
                        p.host.v_cache[host_off + e] = vn[src + e];
                    }
                }
            }
            let kc = s.clone_dtoh(&p.kc).unwrap();
            let vc = s.clone_dtoh(&p.vc).unwrap();
            assert!(
                kc == p.kc_bits,
                "page {ps} snew {snew}: k cache after append differs"
            );
            assert!(
                vc == p.vc_bits,
                "page {ps} snew {snew}: v cache after append differs"
            );
            // The caller advances seqused_k, then decodes the new rows.
            let su: Vec<i32> = after.iter().map(|&n| n as i32).collect();
            s.memcpy_htod(&su, &mut p.su).unwrap();
            p.host.seqused_k = after.clone();
            let mut a = p.args(s, &c);
            a.max_seqlen_k = Some(*after.iter().max().unwrap());
            let shape = plan.check(&a).unwrap();
            let ws = plan.alloc_workspace(s, b, shape.max_seqlen_k).unwrap();
            unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
            p.verify(
                s,
                c.dtype,
                &format!("append page {ps} snew {snew} then decode"),
            );
        }
    });
}

/// A contiguous cache [B, Sk, Hkv, D] (Sk not a multiple of 16) through the same kernel:
/// class page_size 0, one page per sequence, the identity table.
#[test]
fn dense_cache_is_one_page_per_sequence() {
    with_gpu("decode-dense", |dev| {
        let s = dev.stream();
        let mut rng = Rng(fresh_seed("decode-dense"));
        let (b, sk, hq, hkv, d, sq) = (3, 333, 16, 2, 128, 2);
        let c = cls(DType::Bf16, d, hq, hkv, 0, sq);
        let plan = DecodePlan::new(dev, c).unwrap();
        let n = b * sk * hkv * d;
        let kf: Vec<f32> = (0..n).map(|_| c.dtype.round(rng.uniform())).collect();
        let vf: Vec<f32> = (0..n).map(|_| c.dtype.round(rng.uniform())).collect();
        let qf: Vec<f32> = (0..b * sq * hq * d)
            .map(|_| c.dtype.round(rng.uniform()))
            .collect();
        let kd = s.clone_htod(&c.dtype.encode_u16(&kf)).unwrap();
        let vd = s.clone_htod(&c.dtype.encode_u16(&vf)).unwrap();
        let qd = s.clone_htod(&c.dtype.encode_u16(&qf)).unwrap();
        let bt = s.clone_htod(&identity_block_table(b)).unwrap();
        let seqused = [333usize, 200, 1];
        let su = s
            .clone_htod(&seqused.iter().map(|&x| x as i32).collect::<Vec<_>>())
            .unwrap();
        let mut o = s.alloc_zeros::<u16>(b * sq * hq * d).unwrap();
        let mut lse = s.alloc_zeros::<f32>(b * hq * sq).unwrap();
        poison(s, &mut o);
        poison(s, &mut lse);
        let t = |buf: &CudaSlice<u16>, sh: &[usize]| {
            RawTensor::contiguous(addr(buf, s), c.dtype, sh).unwrap()
        };
        let a = DecodeArgs {
            q: t(&qd, &[b, sq, hq, d]),
            k_cache: t(&kd, &[b, sk, hkv, d]),
            v_cache: t(&vd, &[b, sk, hkv, d]),
            block_table: RawIndex::matrix(addr(&bt, s), b, 1),
            seqused_k: RawIndex::vector(addr(&su, s), b),
            o: t(&o, &[b, sq, hq, d]),
            lse: RawTensor::contiguous(addr(&lse, s), DType::F32, &[b, hq, sq]).unwrap(),
            max_seqlen_k: None,
            cu_seqlens_q: None,
        };
        let shape = plan.check(&a).unwrap();
        let ws = plan.alloc_workspace(s, b, shape.max_seqlen_k).unwrap();
        unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
        let spec = PagedDecodeSpec {
            batch: b,
            seqlen_q: sq,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            num_blocks: b,
            page_size: sk,
            max_blocks: 1,
            window: (-1, 0),
            softcap: 0.0,
            scale: c.scale() as f64,
        };
        let host = PagedDecodeInputs {
            q: qf,
            k_cache: kf,
            v_cache: vf,
            block_table: identity_block_table(b),
            seqused_k: seqused.to_vec(),
            cu_seqlens_q: None,
        };
        let want = paged_decode_f64(&spec, &host).unwrap();
        let og = c.dtype.decode_u16(&s.clone_dtoh(&o).unwrap());
        let lg = s.clone_dtoh(&lse).unwrap();
        let co = check(&og, &want.o, c.dtype);
        assert!(co.passed, "dense o: {:?}", co.reason);
        let cl = check_lse(&lg, &want.lse);
        assert!(cl.passed, "dense lse: {:?}", cl.reason);
        eprintln!(
            "decode-dense: ok (splits {}, rel L2 {:.2e})",
            shape.splits, co.metrics.rel_l2
        );
    });
}

/// Split decode captured in a CUDA graph replays with new q values written into the same
/// buffer: bit-identical to eager launches (deterministic), and right against the reference.
#[test]
fn decode_replays_in_a_cuda_graph() {
    with_gpu("decode-graph", |dev| {
        let s = dev.context().new_stream().unwrap();
        let mut rng = Rng(fresh_seed("decode-graph"));
        let c = cls(DType::Bf16, 128, 32, 8, 16, 2);
        let case = Case::new(c, &[1000, 77, 4096], 2, Some(6));
        let mut p = Paged::build(&s, &case, &case.seqused, &mut rng);
        let plan = DecodePlan::new(dev, c).unwrap().with_splits(Some(6));
        let a = p.args(&s, &c);
        let ws = plan.alloc_workspace(&s, 3, 4096).unwrap();
        s.synchronize().unwrap();
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
        let graph = s
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .unwrap()
            .expect("a captured graph");
        for replay in 0..20 {
            if replay % 5 == 0 {
                let qf: Vec<f32> = (0..p.host.q.len())
                    .map(|_| c.dtype.round(rng.uniform()))
                    .collect();
                s.memcpy_htod(&c.dtype.encode_u16(&qf), &mut p.q).unwrap();
                p.host.q = qf;
            }
            poison(&s, &mut p.o);
            poison(&s, &mut p.lse);
            graph.launch().unwrap();
            if replay % 5 == 4 {
                let (go, gl) = p.verify(&s, c.dtype, &format!("graph replay {replay}"));
                poison(&s, &mut p.o);
                poison(&s, &mut p.lse);
                unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
                let (eo, el) = p.outputs(&s, c.dtype);
                assert!(
                    go.iter().zip(&eo).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "replay {replay}: graph o differs from eager"
                );
                assert!(
                    gl.iter().zip(&el).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "replay {replay}: graph lse differs from eager"
                );
            }
        }
    });
}

/// The cudarc path (CudaSlice<bf16>) gives the raw path's bits; bad input is an error that
/// names the tensor and the rule.
#[test]
fn decode_cudarc_path_and_bad_input() {
    with_gpu("decode-cudarc", |dev| {
        let s = dev.stream();
        let mut rng = Rng(fresh_seed("decode-cudarc"));
        let c = cls(DType::Bf16, 64, 8, 2, 16, 4);
        let case = Case::new(c, &[50, 3000, 16], 4, None);
        let p = Paged::build(s, &case, &case.seqused, &mut rng);
        let plan = DecodePlan::new(dev, c).unwrap();
        let raw_args = p.args(s, &c);
        let ws_raw = plan.alloc_workspace(s, 3, 3000).unwrap();
        unsafe { plan.forward_raw(s.cu_stream(), &raw_args, ws_raw.raw()) }.unwrap();
        let (want_o, want_l) = p.verify(s, c.dtype, "raw");

        let bf = |v: &CudaSlice<u16>| -> CudaSlice<half::bf16> {
            let h: Vec<half::bf16> = s
                .clone_dtoh(v)
                .unwrap()
                .into_iter()
                .map(half::bf16::from_bits)
                .collect();
            s.clone_htod(&h).unwrap()
        };
        let (q, kc, vc) = (bf(&p.q), bf(&p.kc), bf(&p.vc));
        let (b, sq, hq, hkv, d) = (3, 4, 8, 2, 64);
        let nb = p.spec.num_blocks;
        let cache_shape = [nb, 16, hkv, d];
        let cache_strides = [p.block_elems, hkv * d, d, 1];
        let mut o = s.alloc_zeros::<half::bf16>(b * sq * hq * d).unwrap();
        let mut lse = s.alloc_zeros::<f32>(b * hq * sq).unwrap();
        let mut ws = plan.alloc_workspace(s, b, 3000).unwrap();
        plan.forward(
            s,
            Bshd::contiguous(&q, [b, sq, hq, d]),
            Bshd::new(&kc, cache_shape, cache_strides),
            Bshd::new(&vc, cache_shape, cache_strides),
            &p.bt,
            &p.su,
            Bshd::contiguous(&mut o, [b, sq, hq, d]),
            &mut lse,
            Some(3000),
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
        assert!(
            got_o
                .iter()
                .zip(&want_o)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "cudarc path o differs from raw"
        );
        assert!(
            got_l
                .iter()
                .zip(&want_l)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "cudarc path lse differs from raw"
        );

        let bad = |r: crate::Result<()>, want: &str| {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(want), "expected '{want}' in: {e}");
            eprintln!("decode-cudarc: rejected as expected: {e}");
        };
        // Sq above the class's max_q_per_seq.
        let mut a = raw_args;
        a.q = RawTensor::contiguous(a.q.ptr, c.dtype, &[b, 5, hq, d]).unwrap();
        a.o = RawTensor::contiguous(a.o.ptr, c.dtype, &[b, 5, hq, d]).unwrap();
        a.lse = RawTensor::contiguous(a.lse.ptr, DType::F32, &[b, hq, 5]).unwrap();
        bad(plan.check(&a).map(|_| ()), "max_q_per_seq");
        // Mixed batches: q must be packed 3-D, cu_seqlens_q has batch + 1 entries, and the
        // rows fit batch × max_q_per_seq.
        let mut a = raw_args;
        a.cu_seqlens_q = Some(RawIndex::vector(addr(&p.su, s), b));
        bad(plan.check(&a).map(|_| ()), "must be 3-D (total_q");
        let packed = |t: usize| {
            (
                RawTensor::contiguous(raw_args.q.ptr, c.dtype, &[t, hq, d]).unwrap(),
                RawTensor::contiguous(raw_args.o.ptr, c.dtype, &[t, hq, d]).unwrap(),
                RawTensor::contiguous(raw_args.lse.ptr, DType::F32, &[hq, t]).unwrap(),
            )
        };
        (a.q, a.o, a.lse) = packed(b * sq);
        bad(
            plan.check(&a).map(|_| ()),
            "cu_seqlens_q is int32 [3, 1] but [4, 1]",
        );
        a.cu_seqlens_q = Some(RawIndex::vector(addr(&p.su, s), b + 1));
        plan.check(&a).unwrap();
        (a.q, a.o, a.lse) = packed(b * sq + 1);
        bad(plan.check(&a).map(|_| ()), "at most max_q_per_seq = 4");
        // Wrong dtype of the cache.
        let mut a = raw_args;
        a.k_cache.dtype = DType::F16;
        bad(plan.check(&a).map(|_| ()), "k_cache holds f16");
        // Table rows differ from the batch.
        let mut a = raw_args;
        a.block_table.rows = 2;
        bad(plan.check(&a).map(|_| ()), "block_table is int32 [2");
        // max_seqlen_k above the table's capacity.
        let mut a = raw_args;
        a.max_seqlen_k = Some(1 << 20);
        bad(plan.check(&a).map(|_| ()), "capacity");
        // A workspace too small for the splits.
        let forced = DecodePlan::new(dev, c).unwrap().with_splits(Some(8));
        let small = super::RawWorkspace {
            ptr: ws_raw.raw().ptr,
            bytes: 16,
        };
        bad(
            unsafe { forced.forward_raw(s.cu_stream(), &raw_args, small) },
            "workspace",
        );
        // Page size that is not the class's.
        let other = DecodePlan::new(dev, DecodeClass { page_size: 32, ..c }).unwrap();
        bad(other.check(&raw_args).map(|_| ()), "page_size 32");
        s.synchronize().unwrap();
    });
}

/// ALiBi slopes for `rows` × `hq` (rows 1: one vector): FlashAttention-style powers of two
/// 2^(-8(h+1)/hq), scaled per row so sequences differ, rotated by the seed.
fn alibi_slopes(rows: usize, hq: usize, rng: &mut Rng) -> Vec<f32> {
    let rot = rng.below(hq);
    (0..rows * hq)
        .map(|i| {
            let (r, h) = (i / hq, (i % hq + rot) % hq);
            2f32.powf(-8.0 * (h + 1) as f32 / hq as f32) * (1.0 + 0.5 * r as f32)
        })
        .collect()
}

/// Run one case on an ALiBi plan (slopes `[Hq]` or `[B, Hq]`) and gate o and lse against the
/// f64 reference with the same slopes, globally and row by row (a row's max abs error within
/// 8× the global tolerance's scale: bf16 / f16 rounding of O in [-1, 1]).
fn run_alibi_case(dev: &Device, c: &Case, per_batch: bool, rng: &mut Rng) {
    let s = dev.stream();
    let p = Paged::build(s, c, &c.seqused, rng);
    let (b, hq, d) = (c.seqused.len(), c.class.heads_q, c.class.head_dim);
    let rows = if per_batch { b } else { 1 };
    let sl = alibi_slopes(rows, hq, rng);
    let sl_dev = s.clone_htod(&sl).unwrap();
    let sl_shape: Vec<usize> = if per_batch { vec![b, hq] } else { vec![hq] };
    let st = RawTensor::contiguous(addr(&sl_dev, s), DType::F32, &sl_shape).unwrap();
    let plan = DecodePlan::new_alibi(dev, c.class)
        .unwrap()
        .with_splits(c.splits);
    assert!(plan.is_alibi());
    let a = p.args(s, &c.class);
    let shape = plan.check(&a).unwrap();
    let ws = plan
        .alloc_workspace(s, shape.batch, shape.max_seqlen_k)
        .unwrap();
    unsafe { plan.forward_raw_alibi(s.cu_stream(), &a, Some(&st), ws.raw()) }.unwrap();
    let tag = format!(
        "alibi {} D={d} Hq={hq} Hkv={} page={} Sq={} lens_q={:?} seqused={:?} window={:?} \
         softcap={} per_batch={per_batch} splits={} (m_blocks {})",
        c.class.dtype,
        c.class.heads_kv,
        c.class.page_size,
        c.sq,
        c.lens_q,
        c.seqused,
        c.class.window,
        c.class.softcap,
        shape.splits,
        shape.m_blocks
    );
    let (o, l) = p.outputs(s, c.class.dtype);
    let stride = if per_batch { hq } else { 0 };
    let want = paged_decode_f64_alibi(&p.spec, &p.host, Some(&sl), stride).unwrap();
    let co = check(&o, &want.o, c.class.dtype);
    let cl = check_lse(&l, &want.lse);
    assert!(
        co.passed,
        "{tag}: o fails: {:?} (rel L2 {:.2e}, max abs {:.2e})",
        co.reason, co.metrics.rel_l2, co.metrics.max_abs
    );
    assert!(cl.passed, "{tag}: lse fails: {:?}", cl.reason);
    // Per row: no row may hide behind the global figure.
    let bound = match c.class.dtype {
        DType::Bf16 => 8.0 * 2f64.powi(-8),
        _ => 8.0 * 2f64.powi(-11),
    };
    let mut worst = 0f64;
    for (r, (got, want)) in o.chunks(d).zip(want.o.chunks(d)).enumerate() {
        let e = got
            .iter()
            .zip(want)
            .map(|(&g, &w)| {
                if g.is_nan() {
                    f64::INFINITY
                } else {
                    (g as f64 - w).abs()
                }
            })
            .fold(0.0, f64::max);
        assert!(
            e <= bound,
            "{tag}: row {r} max abs error {e:.3e} > {bound:.3e}"
        );
        worst = worst.max(e);
    }
    // The bias matters here: the result is not the plain one.
    let plain = paged_decode_f64(&p.spec, &p.host).unwrap();
    let moved = plain
        .lse
        .iter()
        .zip(&want.lse)
        .any(|(x, y)| x.is_finite() && (x - y).abs() > 1e-2);
    assert!(
        moved,
        "{tag}: the slopes do not change the reference (a weak case)"
    );
    eprintln!(
        "{tag}: ok (o rel L2 {:.2e}, worst row max abs {worst:.2e}; lse max abs {:.2e})",
        co.metrics.rel_l2, cl.metrics.max_abs
    );
}

/// ALiBi on the decode kernel (FlashAttention's convention: `-slope · |d_i - j|` after the
/// softcap) against the f64 reference: GQA packing (one and two m16 tiles), Sq 1..16, pages,
/// ragged lengths, windows, softcap, forced and heuristic splits, slopes `[Hq]` and
/// `[B, Hq]`, a mixed batch (cu_seqlens_q), bf16 and f16, head dims 64 / 128 / 256.
#[test]
fn decode_alibi_matches_reference() {
    with_gpu("decode-alibi", |dev| {
        let mut rng = Rng(fresh_seed("decode-alibi"));
        let (bf, f16) = (DType::Bf16, DType::F16);
        let mut n = 0;
        for &(dt, d, hq, hkv, sq, ps, window, softcap, splits, per_batch) in &[
            (bf, 128, 32, 8, 1, 16, (-1, 0), 0.0, None, true),
            (bf, 128, 32, 8, 1, 16, (-1, 0), 0.0, Some(1), false),
            (bf, 64, 8, 8, 4, 64, (-1, 0), 0.0, Some(7), false),
            (bf, 128, 4, 1, 16, 32, (-1, -1), 0.0, Some(3), true),
            (bf, 128, 16, 2, 3, 48, (100, 0), 0.0, None, true),
            (bf, 256, 16, 2, 2, 32, (-1, 0), 30.0, None, false),
            (f16, 256, 8, 8, 1, 16, (-1, 0), 0.0, Some(5), true),
            (f16, 64, 16, 4, 8, 128, (40, 3), 0.0, None, false),
        ] {
            let c = DecodeClass {
                window,
                softcap,
                ..cls(dt, d, hq, hkv, ps, sq)
            };
            let mut case = Case::new(c, &[1, ps - 1, 97, 1031, 2999], sq, splits);
            case.q_gain = if softcap > 0.0 { 4.0 } else { 1.0 };
            run_alibi_case(dev, &case, per_batch, &mut rng);
            n += 1;
        }
        // A mixed batch: decode, speculative and empty sequences in one packed call.
        let c = cls(bf, 128, 16, 4, 16, 8);
        for per_batch in [false, true] {
            let case = Case::mixed(c, &[700, 33, 64, 1, 2000], &[8, 1, 0, 1, 5], Some(4));
            run_alibi_case(dev, &case, per_batch, &mut rng);
            n += 1;
        }
        eprintln!("decode-alibi: {n} cases passed");
    });
}

/// Slopes on a plain plan, none on an ALiBi plan, a wrong shape or dtype: clear errors, no
/// launch.
#[test]
fn decode_alibi_bad_slopes_are_errors() {
    with_gpu("decode-alibi-bad", |dev| {
        let mut rng = Rng(fresh_seed("decode-alibi-bad"));
        let c = cls(DType::Bf16, 128, 8, 2, 16, 1);
        let case = Case::new(c, &[40, 50], 1, Some(1));
        let s = dev.stream();
        let p = Paged::build(s, &case, &case.seqused, &mut rng);
        let a = p.args(s, &c);
        let buf = s.clone_htod(&vec![0.5f32; 16]).unwrap();
        let t =
            |shape: &[usize], dt: DType| RawTensor::contiguous(addr(&buf, s), dt, shape).unwrap();
        let ws = crate::gpu::Workspace::zeroed(s, 0).unwrap();
        let plain = DecodePlan::new(dev, c).unwrap();
        let ali = DecodePlan::new_alibi(dev, c).unwrap();
        let err = |r: crate::Result<()>| r.unwrap_err().to_string();
        let e = err(unsafe {
            plain.forward_raw_alibi(s.cu_stream(), &a, Some(&t(&[8], DType::F32)), ws.raw())
        });
        assert!(e.contains("without ALiBi"), "{e}");
        let e = err(unsafe { ali.forward_raw(s.cu_stream(), &a, ws.raw()) });
        assert!(e.contains("pass the slopes"), "{e}");
        let e = err(unsafe {
            ali.forward_raw_alibi(s.cu_stream(), &a, Some(&t(&[7], DType::F32)), ws.raw())
        });
        assert!(e.contains("alibi_slopes"), "{e}");
        let e = err(unsafe {
            ali.forward_raw_alibi(s.cu_stream(), &a, Some(&t(&[3, 8], DType::F32)), ws.raw())
        });
        assert!(e.contains("alibi_slopes"), "{e}");
        let e = err(unsafe {
            ali.forward_raw_alibi(
                s.cu_stream(),
                &a,
                Some(&t(&[2, 2, 4], DType::F32)),
                ws.raw(),
            )
        });
        assert!(e.contains("alibi_slopes must have shape"), "{e}");
        let e = err(unsafe {
            ali.forward_raw_alibi(s.cu_stream(), &a, Some(&t(&[8], DType::Bf16)), ws.raw())
        });
        assert!(e.contains("alibi_slopes"), "{e}");
        // The good call runs.
        unsafe {
            ali.forward_raw_alibi(s.cu_stream(), &a, Some(&t(&[2, 8], DType::F32)), ws.raw())
        }
        .unwrap();
        s.synchronize().unwrap();
        eprintln!("decode-alibi-bad: ok");
    });
}
