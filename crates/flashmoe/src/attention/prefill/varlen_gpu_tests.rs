//! GPU tests of [`VarlenPlan`]: packed batches of ragged sequences against the f64
//! reference, sequence by sequence (GQA, causal and not, head dims 64 and 128, bf16 and
//! f16, lengths 1, 63, 64, 65, 127, primes, sk > sq, sk < sq and empty sequences), a
//! many-sequence batch over several waves, run-to-run determinism, the cudarc path and bad
//! input. Outputs are poisoned (NaN) before each launch. Each test prints "skipped: no
//! GPU" and passes on a machine without one. Inputs are fresh random values (seed printed).

use super::plan::AttentionClass;
use super::varlen::{VarlenArgs, VarlenPlan};
use crate::accuracy::{check, check_lse};
use crate::attention::decode::RawIndex;
use crate::dtype::DType;
use crate::gpu::test_support::{addr, fresh_seed, with_gpu};
use crate::gpu::{Device, RawTensor};
use crate::inputs::{generate, TensorId};
use crate::reference::attention::{attention_f64, AttentionInputs};
use cudarc::driver::{sys, CudaSlice, CudaStream};
use std::sync::Arc;

pub(super) fn to_bits(v: &[f32], dtype: DType) -> Vec<u16> {
    v.iter()
        .map(|&x| match dtype {
            DType::Bf16 => half::bf16::from_f32(x).to_bits(),
            _ => half::f16::from_f32(x).to_bits(),
        })
        .collect()
}

pub(super) fn from_bits(v: &[u16], dtype: DType) -> Vec<f32> {
    v.iter()
        .map(|&b| match dtype {
            DType::Bf16 => half::bf16::from_bits(b).to_f32(),
            _ => half::f16::from_bits(b).to_f32(),
        })
        .collect()
}

fn poison<T>(stream: &Arc<CudaStream>, s: &mut CudaSlice<T>) {
    // 0xFF bytes: NaN in bf16, f16 and f32.
    let n = s.len() * std::mem::size_of::<T>();
    let (p, _g) = cudarc::driver::DevicePtrMut::device_ptr_mut(s, stream);
    unsafe { sys::cuMemsetD8Async(p, 0xFF, n, stream.cu_stream()) }
        .result()
        .unwrap();
}

/// One packed batch: host inputs (dtype-rounded f32), offsets and device buffers.
struct Packed {
    class: AttentionClass,
    lens: Vec<(usize, usize)>,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dq: CudaSlice<u16>,
    dk: CudaSlice<u16>,
    dv: CudaSlice<u16>,
    dcu_q: CudaSlice<i32>,
    dcu_k: CudaSlice<i32>,
    o: CudaSlice<u16>,
    lse: CudaSlice<f32>,
}

fn offsets(lens: impl Iterator<Item = usize>) -> Vec<i32> {
    let mut cu = vec![0i32];
    for l in lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    cu
}

impl Packed {
    fn new(
        stream: &Arc<CudaStream>,
        class: AttentionClass,
        lens: &[(usize, usize)],
        seed: u64,
    ) -> Packed {
        let cu_q = offsets(lens.iter().map(|l| l.0));
        let cu_k = offsets(lens.iter().map(|l| l.1));
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        let (hq, hkv, d, dt) = (class.heads_q, class.heads_kv, class.head_dim, class.dtype);
        let q = generate(seed, TensorId::Q, tq * hq * d, 1.0, dt);
        let k = generate(seed, TensorId::K, tk * hkv * d, 1.0, dt);
        let v = generate(seed, TensorId::V, tk * hkv * d, 1.0, dt);
        let up = |x: &[f32]| stream.clone_htod(&to_bits(x, dt)).unwrap();
        Packed {
            dq: up(&q),
            dk: up(&k),
            dv: up(&v),
            dcu_q: stream.clone_htod(&cu_q).unwrap(),
            dcu_k: stream.clone_htod(&cu_k).unwrap(),
            o: stream.alloc_zeros(tq * hq * d).unwrap(),
            lse: stream.alloc_zeros(hq * tq).unwrap(),
            class,
            lens: lens.to_vec(),
            cu_q,
            cu_k,
            q,
            k,
            v,
        }
    }
    fn totals(&self) -> (usize, usize) {
        (
            *self.cu_q.last().unwrap() as usize,
            *self.cu_k.last().unwrap() as usize,
        )
    }
    fn args(&self, stream: &Arc<CudaStream>) -> VarlenArgs {
        let (tq, tk) = self.totals();
        let c = &self.class;
        let (hq, hkv, d, dt) = (c.heads_q, c.heads_kv, c.head_dim, c.dtype);
        let t = |p, s: &[usize]| RawTensor::contiguous(p, dt, s).unwrap();
        VarlenArgs {
            q: t(addr(&self.dq, stream), &[tq, hq, d]),
            k: t(addr(&self.dk, stream), &[tk, hkv, d]),
            v: t(addr(&self.dv, stream), &[tk, hkv, d]),
            o: t(addr(&self.o, stream), &[tq, hq, d]),
            lse: RawTensor::contiguous(addr(&self.lse, stream), DType::F32, &[hq, tq]).unwrap(),
            cu_seqlens_q: RawIndex::vector(addr(&self.dcu_q, stream), self.cu_q.len()),
            cu_seqlens_k: RawIndex::vector(addr(&self.dcu_k, stream), self.cu_k.len()),
            max_seqlen_q: self.lens.iter().map(|l| l.0).max().unwrap().max(1),
            max_seqlen_k: self.lens.iter().map(|l| l.1).max().unwrap().max(1),
        }
    }
    /// Poison o and lse, launch once (raw layer), read both back.
    fn run(&mut self, stream: &Arc<CudaStream>, plan: &VarlenPlan) -> (Vec<u16>, Vec<f32>) {
        poison(stream, &mut self.o);
        poison(stream, &mut self.lse);
        let ws = plan.alloc_workspace(stream).unwrap();
        let args = self.args(stream);
        unsafe { plan.forward_raw(stream.cu_stream(), &args, ws.raw()) }.unwrap();
        let o = stream.clone_dtoh(&self.o).unwrap();
        let l = stream.clone_dtoh(&self.lse).unwrap();
        stream.synchronize().unwrap();
        (o, l)
    }
    /// Every sequence's O and LSE against the f64 reference of that sequence alone.
    fn verify(&self, o: &[u16], lse: &[f32]) -> Vec<String> {
        let c = &self.class;
        let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
        let (tq, _) = self.totals();
        let o = from_bits(o, c.dtype);
        let mut failures = Vec::new();
        for (b, &(sq, sk)) in self.lens.iter().enumerate() {
            if sq == 0 {
                continue;
            }
            let (q0, k0) = (self.cu_q[b] as usize, self.cu_k[b] as usize);
            let o_seq = &o[q0 * hq * d..(q0 + sq) * hq * d];
            // lse (hq, total_q) -> this sequence's (hq, sq), the reference's order.
            let lse_seq: Vec<f32> = (0..hq)
                .flat_map(|h| lse[h * tq + q0..h * tq + q0 + sq].iter().copied())
                .collect();
            if sk == 0 {
                // No key: O = 0, LSE = -inf.
                if o_seq.iter().any(|&x| x != 0.0)
                    || lse_seq.iter().any(|&x| x != f32::NEG_INFINITY)
                {
                    failures.push(format!(
                        "seq {b} ({sq}, {sk}): expected O = 0 and LSE = -inf"
                    ));
                }
                continue;
            }
            let p = c.problem(1, sq, sk);
            let x = AttentionInputs {
                q: self.q[q0 * hq * d..(q0 + sq) * hq * d].to_vec(),
                k: self.k[k0 * hkv * d..(k0 + sk) * hkv * d].to_vec(),
                v: self.v[k0 * hkv * d..(k0 + sk) * hkv * d].to_vec(),
            };
            let r = attention_f64(&p, &x).unwrap();
            let co = check(o_seq, &r.o, c.dtype);
            let cl = check_lse(&lse_seq, &r.lse);
            if !co.passed || !cl.passed {
                failures.push(format!(
                    "seq {b} ({sq}, {sk}): o {:?} lse {:?}",
                    co.reason, cl.reason
                ));
            }
        }
        failures
    }
}

/// Lengths (sq, sk): the tile edges of both kernels' tiles (BM 128/192, BN 128), 1, primes,
/// chunked prefill (sk > sq), sk < sq (causal: early rows see no key), empty sequences.
fn ragged_lens() -> Vec<(usize, usize)> {
    vec![
        (65, 65),
        (1, 1),
        (63, 63),
        (0, 0),
        (64, 64),
        (127, 127),
        (128, 128),
        (129, 129),
        (37, 300),
        (0, 17),
        (193, 193),
        (200, 513),
        (5, 0),
        (100, 40),
        (257, 257),
        (1, 211),
        (31, 31),
    ]
}

fn case(dev: &Device, class: AttentionClass, lens: &[(usize, usize)], tag: &str) -> Vec<String> {
    let stream = dev.stream().clone();
    let seed = fresh_seed(tag);
    let plan = VarlenPlan::new(dev, class).unwrap();
    let mut p = Packed::new(&stream, class, lens, seed);
    let (o, l) = p.run(&stream, &plan);
    p.verify(&o, &l)
        .into_iter()
        .map(|f| format!("{tag}: {f}"))
        .collect()
}

#[test]
fn varlen_matches_the_reference_per_sequence() {
    with_gpu("varlen_matches_the_reference_per_sequence", |dev| {
        let mut failures = Vec::new();
        let mut cases = 0;
        for (d, hq, hkv) in [(128, 8, 2), (64, 6, 3)] {
            for dtype in [DType::Bf16, DType::F16] {
                for causal in [false, true] {
                    let class = AttentionClass {
                        dtype,
                        head_dim: d,
                        heads_q: hq,
                        heads_kv: hkv,
                        causal,
                        softmax_scale: None,
                        window: crate::problem::NO_WINDOW,
                        softcap: 0.0,
                    };
                    let tag = format!("D={d} {dtype:?} Hq={hq} Hkv={hkv} causal={causal}");
                    failures.extend(case(dev, class, &ragged_lens(), &tag));
                    cases += 1;
                }
            }
        }
        eprintln!("{cases} classes x {} sequences", ragged_lens().len());
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    });
}

/// Sliding windows and softcap on the varlen kernel, sequence by sequence against the f64
/// reference: windows narrower than a key tile, wider than the work tile, one-sided either
/// way, right > 0 with and without causal, softcap alone and with a window.
#[test]
fn varlen_windows_and_softcap_match_the_reference() {
    with_gpu("varlen_windows_and_softcap_match_the_reference", |dev| {
        let mut failures = Vec::new();
        let mut lens = ragged_lens();
        lens.extend([(700, 700), (300, 1100), (1000, 257)]);
        let mut cases = 0;
        for (d, hq, hkv) in [(128, 8, 2), (64, 6, 3)] {
            for dtype in [DType::Bf16, DType::F16] {
                for (causal, window, softcap) in WINDOW_CASES {
                    let class = AttentionClass {
                        dtype,
                        head_dim: d,
                        heads_q: hq,
                        heads_kv: hkv,
                        causal,
                        softmax_scale: None,
                        window,
                        softcap,
                    };
                    let tag = format!(
                        "D={d} {dtype:?} causal={causal} window={window:?} softcap={softcap}"
                    );
                    failures.extend(case(dev, class, &lens, &tag));
                    cases += 1;
                }
            }
        }
        eprintln!("{cases} classes x {} sequences", lens.len());
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    });
}

/// (causal, window, softcap) cases of the window tests.
pub(super) const WINDOW_CASES: [(bool, (i32, i32), f32); 9] = [
    (true, (100, -1), 0.0),
    (true, (0, -1), 0.0),
    (true, (300, 0), 30.0),
    (false, (64, 64), 0.0),
    (false, (-1, 37), 0.0),
    (false, (200, -1), 0.0),
    (false, (5, 129), 0.0),
    (false, crate::problem::NO_WINDOW, 5.0),
    (true, crate::problem::NO_WINDOW, 50.0),
];

/// 24 sequences of 100..1500 tokens (several waves of work tiles over the SMs, tiles of
/// unequal cost drawn by every CTA), MQA and MHA, both masks.
#[test]
fn varlen_many_sequences_over_several_waves() {
    with_gpu("varlen_many_sequences_over_several_waves", |dev| {
        let seed = fresh_seed("varlen lengths");
        let mut s = seed;
        let lens: Vec<(usize, usize)> = (0..24)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let l = 100 + (s >> 33) as usize % 1400;
                (l, l)
            })
            .collect();
        let mut failures = Vec::new();
        for (d, hq, hkv, causal) in [(128, 4, 1, true), (64, 4, 4, false), (128, 2, 2, false)] {
            let class = AttentionClass {
                dtype: DType::Bf16,
                head_dim: d,
                heads_q: hq,
                heads_kv: hkv,
                causal,
                softmax_scale: Some(0.07),
                window: crate::problem::NO_WINDOW,
                softcap: 0.0,
            };
            failures.extend(case(
                dev,
                class,
                &lens,
                &format!("D={d} Hq={hq} Hkv={hkv} causal={causal}"),
            ));
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    });
}

/// The same inputs twice into re-poisoned outputs: bit-identical (the dispenser's order
/// changes nothing but which CTA computes a tile).
#[test]
fn varlen_is_deterministic_and_reuses_its_workspace() {
    with_gpu("varlen_is_deterministic_and_reuses_its_workspace", |dev| {
        let stream = dev.stream().clone();
        let class = AttentionClass {
            dtype: DType::Bf16,
            head_dim: 128,
            heads_q: 16,
            heads_kv: 4,
            causal: true,
            softmax_scale: None,
            window: crate::problem::NO_WINDOW,
            softcap: 0.0,
        };
        let plan = VarlenPlan::new(dev, class).unwrap();
        let lens: Vec<(usize, usize)> = (0..40)
            .map(|i| (1 + 97 * i % 700, 1 + 97 * i % 700))
            .collect();
        let mut p = Packed::new(&stream, class, &lens, fresh_seed("varlen determinism"));
        let ws = plan.alloc_workspace(&stream).unwrap();
        let args = p.args(&stream);
        let mut first = None;
        for _ in 0..3 {
            poison(&stream, &mut p.o);
            poison(&stream, &mut p.lse);
            unsafe { plan.forward_raw(stream.cu_stream(), &args, ws.raw()) }.unwrap();
            let o = stream.clone_dtoh(&p.o).unwrap();
            let l = stream.clone_dtoh(&p.lse).unwrap();
            match &first {
                None => {
                    let f = p.verify(&o, &l);
                    assert!(f.is_empty(), "{}", f.join("\n"));
                    first = Some((o, l));
                }
                Some((o0, l0)) => {
                    assert!(o == *o0, "O differs between launches");
                    let same = l.iter().zip(l0).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "LSE differs between launches");
                }
            }
        }
        // The workspace is left zeroed (the dispenser reset itself).
        let w: Vec<u8> = stream.clone_dtoh(ws.buffer()).unwrap();
        assert!(
            w.iter().all(|&x| x == 0),
            "workspace not zero after the launches"
        );
    });
}

/// The cudarc layer: typed buffers, lengths checked.
#[test]
fn varlen_cudarc_path_and_bad_input() {
    with_gpu("varlen_cudarc_path_and_bad_input", |dev| {
        let stream = dev.stream().clone();
        let class = AttentionClass {
            dtype: DType::Bf16,
            head_dim: 64,
            heads_q: 4,
            heads_kv: 2,
            causal: true,
            softmax_scale: None,
            window: crate::problem::NO_WINDOW,
            softcap: 0.0,
        };
        let plan = VarlenPlan::new(dev, class).unwrap();
        let lens = [(77, 77), (3, 130), (150, 150)];
        let p = Packed::new(&stream, class, &lens, fresh_seed("varlen cudarc"));
        let (tq, tk) = p.totals();
        let typed = |x: &[f32]| -> CudaSlice<half::bf16> {
            let v: Vec<half::bf16> = x.iter().map(|&f| half::bf16::from_f32(f)).collect();
            stream.clone_htod(&v).unwrap()
        };
        let (q, k, v) = (typed(&p.q), typed(&p.k), typed(&p.v));
        let mut o: CudaSlice<half::bf16> = stream.alloc_zeros(tq * 4 * 64).unwrap();
        let mut lse: CudaSlice<f32> = stream.alloc_zeros(4 * tq).unwrap();
        poison(&stream, &mut o);
        poison(&stream, &mut lse);
        let mut ws = plan.alloc_workspace(&stream).unwrap();
        plan.forward(
            &stream, &q, &k, &v, &mut o, &mut lse, &p.dcu_q, &p.dcu_k, 150, 150, &mut ws,
        )
        .unwrap();
        let o_h: Vec<u16> = stream
            .clone_dtoh(&o)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let l_h = stream.clone_dtoh(&lse).unwrap();
        stream.synchronize().unwrap();
        let f = p.verify(&o_h, &l_h);
        assert!(f.is_empty(), "{}", f.join("\n"));

        // Bad input: errors naming the problem, nothing launched.
        let good = p.args(&stream);
        let err = |a: VarlenArgs| {
            let ws = plan.alloc_workspace(&stream).unwrap();
            unsafe { plan.forward_raw(stream.cu_stream(), &a, ws.raw()) }
                .unwrap_err()
                .to_string()
        };
        let mut a = good;
        a.k = RawTensor::contiguous(good.k.ptr, DType::Bf16, &[tk, 3, 64]).unwrap();
        let e = err(a);
        assert!(e.contains("k has shape"), "{e}");
        let mut a = good;
        a.q = RawTensor::contiguous(good.q.ptr, DType::Bf16, &[1, tq, 4, 64]).unwrap();
        let e = err(a);
        assert!(e.contains("must be 3-D"), "{e}");
        let mut a = good;
        a.cu_seqlens_k = RawIndex::vector(good.cu_seqlens_k.ptr, 3);
        let e = err(a);
        assert!(e.contains("cu_seqlens_k"), "{e}");
        let mut a = good;
        a.max_seqlen_q = 0;
        let e = err(a);
        assert!(e.contains("max_seqlen_q = 0"), "{e}");
        let mut a = good;
        a.lse = RawTensor::contiguous(good.lse.ptr, DType::F32, &[tq, 4]).unwrap();
        let e = err(a);
        assert!(e.contains("lse"), "{e}");
        let mut short: CudaSlice<f32> = stream.alloc_zeros(4 * tq - 1).unwrap();
        let e = plan
            .forward(
                &stream, &q, &k, &v, &mut o, &mut short, &p.dcu_q, &p.dcu_k, 150, 150, &mut ws,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("lse holds"), "{e}");
    });
}

/// Captured once into a CUDA graph, replayed with new offsets written into the same
/// cu_seqlens buffers: the kernel reads the offsets at run time, so each replay matches
/// the reference of its own lengths. (The batch size and the totals are launch parameters,
/// fixed by the capture; only the split of the rows changes.)
#[test]
fn varlen_replays_in_a_cuda_graph_with_new_lengths() {
    with_gpu("varlen_replays_in_a_cuda_graph_with_new_lengths", |dev| {
        let stream = dev.stream().clone();
        let class = AttentionClass {
            dtype: DType::Bf16,
            head_dim: 128,
            heads_q: 8,
            heads_kv: 2,
            causal: true,
            softmax_scale: None,
            window: crate::problem::NO_WINDOW,
            softcap: 0.0,
        };
        let plan = VarlenPlan::new(dev, class).unwrap();
        let seed = fresh_seed("varlen graph");
        // Three splits of the same 1200 query and 1500 key rows into 3 sequences.
        let splits: [&[(usize, usize)]; 3] = [
            &[(600, 700), (1, 1), (599, 799)],
            &[(100, 100), (1100, 1300), (0, 100)],
            &[(1200, 1500), (0, 0), (0, 0)],
        ];
        let mut runs: Vec<Packed> = splits
            .iter()
            .map(|l| Packed::new(&stream, class, l, seed))
            .collect();
        let ws = plan.alloc_workspace(&stream).unwrap();
        // max_seqlen_q only sizes the grid: the capture uses the largest.
        let mut args = runs[0].args(&stream);
        args.max_seqlen_q = 1200;
        args.max_seqlen_k = 1500;
        stream.synchronize().unwrap();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        unsafe { plan.forward_raw(stream.cu_stream(), &args, ws.raw()) }.unwrap();
        let graph = stream
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .unwrap()
            .expect("a captured graph");
        let mut failures = Vec::new();
        for (i, lens) in splits.iter().enumerate() {
            let (cu_q, cu_k) = (runs[i].cu_q.clone(), runs[i].cu_k.clone());
            let r0 = &mut runs[0];
            stream.memcpy_htod(&cu_q, &mut r0.dcu_q).unwrap();
            stream.memcpy_htod(&cu_k, &mut r0.dcu_k).unwrap();
            poison(&stream, &mut r0.o);
            poison(&stream, &mut r0.lse);
            graph.launch().unwrap();
            let o = stream.clone_dtoh(&r0.o).unwrap();
            let l = stream.clone_dtoh(&r0.lse).unwrap();
            stream.synchronize().unwrap();
            // Same seed and totals: runs[i] holds the same q, k, v with its own offsets.
            assert_eq!(runs[i].q, runs[0].q);
            failures.extend(
                runs[i]
                    .verify(&o, &l)
                    .into_iter()
                    .map(|f| format!("lengths {lens:?}: {f}")),
            );
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    });
}
