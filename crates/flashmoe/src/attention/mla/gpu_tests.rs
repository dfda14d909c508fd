//! GPU tests of [`MlaDecodePlan`] against the f64 MLA reference
//! ([`crate::reference::mla`]): shuffled page tables, ragged cache lengths (1, page ± 1,
//! 4097), Sq 1..4, B 1..16, Hq 16 and 128, bf16 and f16, unsplit / heuristic / forced and
//! over-split calls, strided q and cache blocks, bit-identical reruns, the cudarc path and
//! bad input; plus one timing print. Each prints "skipped: no GPU" and passes without one.
//! Inputs are fresh random values (seed printed); cache rows past `seqused_k` and unused
//! blocks hold NaN, and outputs and the workspace start poisoned (NaN), so a read of an
//! unused row, an unwritten output or a partial read before it is written fails the check.

use super::{MlaArgs, MlaDecodeClass, MlaDecodePlan, RawIndex, D_QK, D_V};
use crate::accuracy::{check_lse, check_rows};
use crate::attention::plan::Bshd;
use crate::dtype::DType;
use crate::gpu::test_support::{addr, fresh_seed, with_gpu, Rng};
use crate::gpu::{Device, RawTensor};
use crate::reference::attention::AttentionOutput;
use crate::reference::mla::{mla_decode_f64, MlaDecodeInputs, MlaDecodeSpec};
use cudarc::driver::{sys, CudaSlice, CudaStream};
use std::sync::Arc;

const NAN16: u16 = 0xFFFF;

fn poison<T>(stream: &Arc<CudaStream>, s: &mut CudaSlice<T>) {
    let n = s.len() * std::mem::size_of::<T>();
    if n == 0 {
        return;
    }
    let (p, _g) = cudarc::driver::DevicePtrMut::device_ptr_mut(s, stream);
    unsafe { sys::cuMemsetD8Async(p, 0xFF, n, stream.cu_stream()) }
        .result()
        .unwrap();
}

/// DeepSeek's scale (1/sqrt(192)) times a yarn-like factor: not derived from 576.
fn scale() -> f32 {
    1.2 / (192f32).sqrt()
}

/// One scenario: a paged latent cache with shuffled block ids.
struct Mla {
    class: MlaDecodeClass,
    spec: MlaDecodeSpec,
    host: MlaDecodeInputs,
    block_elems: usize,
    q_head_stride: usize,
    q: CudaSlice<u16>,
    kv: CudaSlice<u16>,
    bt: CudaSlice<i32>,
    su: CudaSlice<i32>,
    o: CudaSlice<u16>,
    lse: CudaSlice<f32>,
}

impl Mla {
    /// `block_pad` / `q_pad`: extra elements after each cache block / q head (strided views).
    #[allow(clippy::too_many_arguments)]
    fn build(
        s: &Arc<CudaStream>,
        dt: DType,
        hq: usize,
        sq: usize,
        page: usize,
        seqused: &[usize],
        block_pad: usize,
        q_pad: usize,
        rng: &mut Rng,
    ) -> Mla {
        let b = seqused.len();
        let pages: Vec<usize> = seqused.iter().map(|&n| n.div_ceil(page).max(1)).collect();
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
        let block_elems = page * D_QK + block_pad;
        let mut kv_bits = vec![NAN16; num_blocks * block_elems];
        let mut kv_host = vec![f32::NAN; num_blocks * page * D_QK];
        for (bi, &n) in seqused.iter().enumerate() {
            for j in 0..n {
                let blk = table[bi * max_blocks + j / page] as usize;
                let dev = blk * block_elems + (j % page) * D_QK;
                let host = (blk * page + j % page) * D_QK;
                for e in 0..D_QK {
                    let x = dt.round(rng.uniform());
                    kv_bits[dev + e] = dt.encode_one_u16(x);
                    kv_host[host + e] = x;
                }
            }
        }
        let rows = b * sq * hq;
        let qh = D_QK + q_pad;
        let mut q_bits = vec![NAN16; rows * qh];
        let mut q_host = vec![0f32; rows * D_QK];
        for r in 0..rows {
            for e in 0..D_QK {
                let x = dt.round(rng.uniform());
                q_bits[r * qh + e] = dt.encode_one_u16(x);
                q_host[r * D_QK + e] = x;
            }
        }
        let class = MlaDecodeClass {
            dtype: dt,
            heads_q: hq,
            head_dim_qk: D_QK,
            head_dim_v: D_V,
            page_size: page,
            max_q_per_seq: sq,
            max_batch: b,
            max_seqlen_k: max_blocks * page,
            softmax_scale: scale(),
        };
        let spec = MlaDecodeSpec {
            batch: b,
            seqlen_q: sq,
            heads_q: hq,
            d_qk: D_QK,
            d_v: D_V,
            num_blocks,
            page_size: page,
            max_blocks,
            scale: scale() as f64,
        };
        let su: Vec<i32> = seqused.iter().map(|&n| n as i32).collect();
        let mut o = s.alloc_zeros::<u16>(rows * D_V).unwrap();
        let mut lse = s.alloc_zeros::<f32>(rows).unwrap();
        poison(s, &mut o);
        poison(s, &mut lse);
        Mla {
            class,
            spec,
            q: s.clone_htod(&q_bits).unwrap(),
            kv: s.clone_htod(&kv_bits).unwrap(),
            bt: s.clone_htod(&table).unwrap(),
            su: s.clone_htod(&su).unwrap(),
            o,
            lse,
            host: MlaDecodeInputs {
                q: q_host,
                kv_cache: kv_host,
                block_table: table,
                seqused_k: seqused.to_vec(),
            },
            block_elems,
            q_head_stride: qh,
        }
    }

    fn args(&self, s: &Arc<CudaStream>) -> MlaArgs {
        let (b, sq, hq) = (self.spec.batch, self.spec.seqlen_q, self.spec.heads_q);
        let dt = self.class.dtype;
        let qh = self.q_head_stride;
        MlaArgs {
            q: RawTensor::new(
                addr(&self.q, s),
                dt,
                &[b, sq, hq, D_QK],
                &[sq * hq * qh, hq * qh, qh, 1],
            )
            .unwrap(),
            kv_cache: RawTensor::new(
                addr(&self.kv, s),
                dt,
                &[self.spec.num_blocks, self.spec.page_size, 1, D_QK],
                &[self.block_elems, D_QK, D_QK, 1],
            )
            .unwrap(),
            block_table: RawIndex::matrix(addr(&self.bt, s), b, self.spec.max_blocks),
            seqused_k: RawIndex::vector(addr(&self.su, s), b),
            o: RawTensor::contiguous(addr(&self.o, s), dt, &[b, sq, hq, D_V]).unwrap(),
            lse: RawTensor::contiguous(addr(&self.lse, s), DType::F32, &[b, sq, hq]).unwrap(),
            max_seqlen_k: Some(self.host.seqused_k.iter().copied().max().unwrap().max(1)),
        }
    }

    /// The f64 reference, one thread per sequence (outputs are batch-major).
    fn reference(&self) -> AttentionOutput<f64> {
        let b = self.spec.batch;
        let mb = self.spec.max_blocks;
        let per_q = self.spec.seqlen_q * self.spec.heads_q * D_QK;
        let parts: Vec<AttentionOutput<f64>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..b)
                .map(|bi| {
                    sc.spawn(move || {
                        let spec = MlaDecodeSpec {
                            batch: 1,
                            ..self.spec.clone()
                        };
                        let x = MlaDecodeInputs {
                            q: self.host.q[bi * per_q..(bi + 1) * per_q].to_vec(),
                            kv_cache: self.host.kv_cache.clone(),
                            block_table: self.host.block_table[bi * mb..(bi + 1) * mb].to_vec(),
                            seqused_k: vec![self.host.seqused_k[bi]],
                        };
                        mla_decode_f64(&spec, &x).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut out = AttentionOutput {
            o: Vec::new(),
            lse: Vec::new(),
        };
        for p in parts {
            out.o.extend(p.o);
            out.lse.extend(p.lse);
        }
        out
    }

    fn outputs(&self, s: &Arc<CudaStream>) -> (Vec<f32>, Vec<f32>) {
        let o = s.clone_dtoh(&self.o).unwrap();
        let l = s.clone_dtoh(&self.lse).unwrap();
        s.synchronize().unwrap();
        (self.class.dtype.decode_u16(&o), l)
    }

    fn verify(&self, s: &Arc<CudaStream>, want: &AttentionOutput<f64>, tag: &str) {
        let (o, l) = self.outputs(s);
        let co = check_rows(&o, &want.o, self.class.dtype, D_V);
        let cl = check_lse(&l, &want.lse);
        assert!(
            co.passed,
            "{tag}: o fails: {:?} (rel L2 {:.2e}, worst row {:.2e})",
            co.reason, co.metrics.rel_l2, co.metrics.max_row_rel_l2
        );
        assert!(cl.passed, "{tag}: lse fails: {:?}", cl.reason);
        eprintln!(
            "{tag}: ok (o rel L2 {:.2e}, worst row {:.2e}; lse max abs {:.2e})",
            co.metrics.rel_l2, co.metrics.max_row_rel_l2, cl.metrics.max_abs
        );
    }
}

/// Run `m` with each kernel build the device runs (sm_90a: wgmma and mma.sync) and each
/// split choice against one reference: poisoned outputs and workspace, then a second launch
/// that must give the same bits.
fn run_splits(dev: &Device, m: &mut Mla, splits: &[Option<usize>], tag: &str) {
    let s = dev.stream();
    let want = m.reference();
    let a = m.args(s);
    let kernels = MlaDecodePlan::kernels_for(dev, m.class.dtype).unwrap();
    for (kernel, &sp) in kernels
        .iter()
        .flat_map(|k| splits.iter().map(move |sp| (k, sp)))
    {
        let plan = MlaDecodePlan::with_kernel(dev, m.class, kernel.clone())
            .unwrap()
            .with_splits(sp);
        let shape = plan.check(&a).unwrap();
        let mut ws = plan.alloc_workspace(s).unwrap();
        poison(s, ws.buffer_mut());
        poison(s, &mut m.o);
        poison(s, &mut m.lse);
        unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
        let tag = format!(
            "{tag} {} Hq={} Sq={} page={} seqused={:?} splits={} (m_blocks {}, BN {}, {})",
            m.class.dtype,
            m.class.heads_q,
            m.spec.seqlen_q,
            m.spec.page_size,
            m.host.seqused_k,
            shape.splits,
            shape.m_blocks,
            plan.kernel().block_n,
            if plan.kernel().wgmma {
                "wgmma"
            } else {
                "mma.sync"
            }
        );
        m.verify(s, &want, &tag);
        let (o1, l1) = m.outputs(s);
        poison(s, &mut m.o);
        poison(s, &mut m.lse);
        unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
        let (o2, l2) = m.outputs(s);
        assert!(
            o1.iter().zip(&o2).all(|(x, y)| x.to_bits() == y.to_bits())
                && l1.iter().zip(&l2).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{tag}: a second launch differs"
        );
    }
}

/// Hq 16 and 128 × Sq 1..4 × bf16/f16 over ragged lengths (1, 63, 64, 65, 4097 and more),
/// shuffled pages, unsplit / heuristic / forced / over-split (more splits than tiles).
#[test]
fn mla_matches_reference_heads_sq_dtypes_splits() {
    with_gpu("mla-matrix", |dev| {
        let s = dev.stream();
        let mut rng = Rng(fresh_seed("mla-matrix"));
        let mut n = 0;
        for dt in [DType::Bf16, DType::F16] {
            for sq in 1..=4 {
                // Hq = 16: one row tile holds every head × Sq row.
                let mut m = Mla::build(s, dt, 16, sq, 64, &[1, 63, 64, 65, 4097], 0, 0, &mut rng);
                run_splits(dev, &mut m, &[Some(1), None, Some(7), Some(64)], "mla");
                n += 4;
                // Hq = 128 (DeepSeek-V3): 2 · Sq row tiles per sequence.
                let mut m = Mla::build(s, dt, 128, sq, 64, &[1, 65, 700], 0, 0, &mut rng);
                run_splits(dev, &mut m, &[Some(1), None, Some(5)], "mla");
                n += 3;
            }
        }
        eprintln!("mla-matrix: {n} runs passed");
    });
}

/// DeepSeek's decode shape with a long cache, B 1..16 with random lengths, odd head counts,
/// page sizes 16 and 128, strided q heads and cache blocks, fewer keys than query rows.
#[test]
fn mla_matches_reference_batches_pages_strides() {
    with_gpu("mla-shapes", |dev| {
        let s = dev.stream();
        let mut rng = Rng(fresh_seed("mla-shapes"));
        let mut m = Mla::build(s, DType::Bf16, 128, 1, 64, &[4097, 64], 0, 0, &mut rng);
        run_splits(dev, &mut m, &[Some(1), None], "deepseek");
        for &(b, hq, sq, page, bpad, qpad) in &[
            (16, 16, 2, 64, 0, 0),
            (9, 24, 3, 16, 8, 8),
            (4, 5, 4, 128, 16, 0),
            (1, 1, 1, 32, 0, 8),
            (3, 80, 4, 64, 0, 0),
        ] {
            let seqused: Vec<usize> = (0..b).map(|_| 1 + rng.below(900)).collect();
            let mut m = Mla::build(s, DType::Bf16, hq, sq, page, &seqused, bpad, qpad, &mut rng);
            run_splits(dev, &mut m, &[Some(1), None, Some(3)], "shapes");
        }
        // Fewer keys than query rows: the first rows see nothing (O = 0, LSE = -inf).
        let mut m = Mla::build(s, DType::F16, 16, 4, 16, &[1, 2, 3, 0], 0, 0, &mut rng);
        run_splits(dev, &mut m, &[Some(1), Some(4)], "short");
    });
}

/// The cudarc path gives the raw path's bits; a captured CUDA graph replays bit-identically;
/// bad input is an error that names the tensor and the rule.
#[test]
fn mla_cudarc_graph_and_bad_input() {
    with_gpu("mla-api", |dev| {
        let s = dev.stream();
        let mut rng = Rng(fresh_seed("mla-api"));
        let (hq, sq) = (32, 2);
        let seqused = [300usize, 1000, 64];
        let mut m = Mla::build(s, DType::Bf16, hq, sq, 64, &seqused, 0, 0, &mut rng);
        let plan = MlaDecodePlan::new(dev, m.class)
            .unwrap()
            .with_splits(Some(4));
        let a = m.args(s);
        let ws = plan.alloc_workspace(s).unwrap();
        unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
        let want = m.reference();
        m.verify(s, &want, "raw");
        let (want_o, want_l) = m.outputs(s);

        let bf = |v: &CudaSlice<u16>| -> CudaSlice<half::bf16> {
            let h: Vec<half::bf16> = s
                .clone_dtoh(v)
                .unwrap()
                .into_iter()
                .map(half::bf16::from_bits)
                .collect();
            s.clone_htod(&h).unwrap()
        };
        let (q, kv) = (bf(&m.q), bf(&m.kv));
        let b = seqused.len();
        let nb = m.spec.num_blocks;
        let mut o = s.alloc_zeros::<half::bf16>(b * sq * hq * D_V).unwrap();
        let mut lse = s.alloc_zeros::<f32>(b * sq * hq).unwrap();
        let mut wsc = plan.alloc_workspace(s).unwrap();
        plan.forward(
            s,
            Bshd::contiguous(&q, [b, sq, hq, D_QK]),
            Bshd::new(&kv, [nb, 64, 1, D_QK], [m.block_elems, D_QK, D_QK, 1]),
            &m.bt,
            &m.su,
            Bshd::contiguous(&mut o, [b, sq, hq, D_V]),
            &mut lse,
            Some(1000),
            &mut wsc,
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
                .all(|(x, y)| x.to_bits() == y.to_bits())
                && got_l
                    .iter()
                    .zip(&want_l)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
            "cudarc path differs from raw"
        );

        // CUDA graph: two launches (forward + merge) captured, replayed with new q values.
        let gs = dev.context().new_stream().unwrap();
        let a = m.args(&gs);
        let wsg = plan.alloc_workspace(&gs).unwrap();
        gs.synchronize().unwrap();
        gs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        unsafe { plan.forward_raw(gs.cu_stream(), &a, wsg.raw()) }.unwrap();
        let graph = gs
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .unwrap()
            .expect("a captured graph");
        for replay in 0..2 {
            let qf: Vec<f32> = (0..m.host.q.len())
                .map(|_| m.class.dtype.round(rng.uniform()))
                .collect();
            gs.memcpy_htod(&m.class.dtype.encode_u16(&qf), &mut m.q)
                .unwrap();
            m.host.q = qf;
            poison(&gs, &mut m.o);
            poison(&gs, &mut m.lse);
            graph.launch().unwrap();
            let want = m.reference();
            m.verify(&gs, &want, &format!("graph replay {replay}"));
        }

        let bad = |r: crate::Result<()>, want: &str| {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(want), "expected '{want}' in: {e}");
            eprintln!("mla-api: rejected as expected: {e}");
        };
        let a = m.args(s);
        let c = m.class;
        let mut x = a;
        x.q = RawTensor::contiguous(a.q.ptr, c.dtype, &[b, 3, hq, D_QK]).unwrap();
        x.o = RawTensor::contiguous(a.o.ptr, c.dtype, &[b, 3, hq, D_V]).unwrap();
        x.lse = RawTensor::contiguous(a.lse.ptr, DType::F32, &[b, 3, hq]).unwrap();
        bad(plan.check(&x).map(|_| ()), "max_q_per_seq = 2");
        let mut x = a;
        x.kv_cache.dtype = DType::F16;
        bad(plan.check(&x).map(|_| ()), "kv_cache holds f16");
        let mut x = a;
        x.q = RawTensor::contiguous(a.q.ptr, c.dtype, &[b, sq, hq, 512]).unwrap();
        bad(plan.check(&x).map(|_| ()), "q has shape");
        let mut x = a;
        x.block_table.rows = 2;
        bad(plan.check(&x).map(|_| ()), "block_table is int32 [2");
        let mut x = a;
        x.max_seqlen_k = Some(1 << 20);
        bad(plan.check(&x).map(|_| ()), "capacity");
        let small = super::RawWorkspace {
            ptr: ws.raw().ptr,
            bytes: 16,
        };
        bad(
            unsafe { plan.forward_raw(s.cu_stream(), &a, small) },
            "workspace",
        );
        let other = MlaDecodePlan::new(dev, MlaDecodeClass { page_size: 32, ..c }).unwrap();
        bad(other.check(&a).map(|_| ()), "page_size 32");
        s.synchronize().unwrap();
    });
}

/// Throughput print (no assertion) at DeepSeek-V3's decode shape (Hq = 128, bf16): cache
/// bytes read per second and TFLOP/s for B=128 × 4096 keys at Sq = 1, 2, 4 (memory- then
/// compute-bound), B=64 × 16384 keys at Sq = 1 and B=1 × 32768 keys (split). Random q and
/// cache (zeros can run faster than real data); the median of 7 host-timed batches of 10
/// launches after a warm-up.
#[test]
fn mla_decode_timing_print() {
    with_gpu("mla-timing", |dev| {
        let s = dev.stream();
        let mut rng = Rng(fresh_seed("mla-timing"));
        let rand_bits = |rng: &mut Rng, n: usize| -> Vec<u16> {
            (0..n)
                .map(|_| DType::Bf16.encode_one_u16(rng.uniform()))
                .collect()
        };
        for &(b, sk, sq) in &[
            (128usize, 4096usize, 1usize),
            (128, 4096, 2),
            (128, 4096, 4),
            (64, 16384, 1),
            (1, 32768, 1),
        ] {
            let page = 64;
            let pages = sk / page;
            let nb = b * pages;
            let c = MlaDecodeClass::deepseek_v3(DType::Bf16, sq, b, sk);
            let kv = s
                .clone_htod(&rand_bits(&mut rng, nb * page * D_QK))
                .unwrap();
            let q = s
                .clone_htod(&rand_bits(&mut rng, b * sq * 128 * D_QK))
                .unwrap();
            let o = s.alloc_zeros::<u16>(b * sq * 128 * D_V).unwrap();
            let lse = s.alloc_zeros::<f32>(b * sq * 128).unwrap();
            // Pages in a shuffled order (a serving engine's table is not sequential).
            let mut table: Vec<i32> = (0..nb as i32).collect();
            for i in (1..nb).rev() {
                table.swap(i, rng.below(i + 1));
            }
            let bt = s.clone_htod(&table).unwrap();
            let su = s.clone_htod(&vec![sk as i32; b]).unwrap();
            let a = MlaArgs {
                q: RawTensor::contiguous(addr(&q, s), c.dtype, &[b, sq, 128, D_QK]).unwrap(),
                kv_cache: RawTensor::contiguous(addr(&kv, s), c.dtype, &[nb, page, D_QK]).unwrap(),
                block_table: RawIndex::matrix(addr(&bt, s), b, pages),
                seqused_k: RawIndex::vector(addr(&su, s), b),
                o: RawTensor::contiguous(addr(&o, s), c.dtype, &[b, sq, 128, D_V]).unwrap(),
                lse: RawTensor::contiguous(addr(&lse, s), DType::F32, &[b, sq, 128]).unwrap(),
                max_seqlen_k: Some(sk),
            };
            for kernel in MlaDecodePlan::kernels_for(dev, c.dtype).unwrap() {
                let plan = MlaDecodePlan::with_kernel(dev, c, kernel).unwrap();
                let shape = plan.check(&a).unwrap();
                let ws = plan.alloc_workspace(s).unwrap();
                for _ in 0..3 {
                    unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
                }
                s.synchronize().unwrap();
                let iters = 10;
                let mut times: Vec<f64> = (0..7)
                    .map(|_| {
                        let t0 = std::time::Instant::now();
                        for _ in 0..iters {
                            unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) }.unwrap();
                        }
                        s.synchronize().unwrap();
                        t0.elapsed().as_secs_f64() / iters as f64
                    })
                    .collect();
                times.sort_by(|x, y| x.partial_cmp(y).unwrap());
                let dt = times[times.len() / 2];
                let bytes = c.kv_bytes(&vec![sk; b]) as f64;
                eprintln!(
                "mla-timing: B={b} Sk={sk} Hq=128 Sq={sq} bf16 splits={} BN={} {}: {:.1} us/step \
                 (spread {:.1}..{:.1}), {:.0} GB/s of cache ({:.1} MB), {:.1} TFLOP/s",
                shape.splits,
                plan.kernel().block_n,
                if plan.kernel().wgmma { "wgmma" } else { "mma.sync" },
                dt * 1e6,
                times[0] * 1e6,
                times[times.len() - 1] * 1e6,
                bytes / dt / 1e9,
                bytes / 1e6,
                c.flops(&vec![sk; b], sq) / dt / 1e12
            );
            }
        }
    });
}
