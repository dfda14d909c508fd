//! Times varlen prefill ([`VarlenPlan`]) against the dense sm_90a kernel on the same total
//! tokens: issue 22's target shape, 16 sequences with lengths drawn uniformly from
//! 100..=4000 (fixed seed, the generator `tools/probes/varlen_baseline.py` mirrors), bf16,
//! model dim 2048 (D = 128, H = 16 and D = 64, H = 32), causal and not. The dense
//! problem is B = 16, S = total / 16 (rounded). Both kernels are timed with CUDA events
//! after an L2 flush, interleaved round by round; TFLOP/s by FlashAttention's convention
//! (4·H·sq·sk·D per sequence, halved for causal). A development probe: the lab's varlen
//! suite (`flashmoe bench varlen --preset varlen`) measures the same shapes with its gates,
//! statistics and baselines; inputs here are random, not zeros.
//!
//! ```text
//! cargo run --release -p flashmoe-bench --example varlen_probe [rounds]
//! ```

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use flashmoe::attention::decode::RawIndex;
use flashmoe::attention::{AttentionArgs, AttentionClass, AttentionPlan, VarlenArgs, VarlenPlan};
use flashmoe::gpu::{Device, RawTensor};
use flashmoe::DType;
use flashmoe_bench::gpu::{EventTimer, L2Flusher};
use std::sync::Arc;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The preset's lengths: 64-bit LCG (Knuth's MMIX constants), length = 100 + (s >> 33) %
/// 3901 per sequence ([`flashmoe_bench::varlen::random_lengths`], the lab's varlen preset).
/// tools/probes/varlen_baseline.py draws the same.
pub fn lengths(seed: u64, n: usize) -> Vec<usize> {
    flashmoe_bench::varlen::random_lengths(seed, n, 100, 4000)
}

fn random_bf16(s: &Arc<CudaStream>, n: usize, seed: u64) -> Res<CudaSlice<u16>> {
    let mut x = seed | 1;
    let v: Vec<u16> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            half::bf16::from_f32(u).to_bits()
        })
        .collect();
    Ok(s.clone_htod(&v)?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() -> Res<()> {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(40);
    let dev = Device::open(0)?;
    println!("{}", dev.info());
    let s = dev.stream().clone();
    let timer = EventTimer::new(&dev)?;
    let mut flush = L2Flusher::new(&dev)?;
    let lens = lengths(22, 16);
    let total: usize = lens.iter().sum();
    let (b, sd) = (16usize, (total + 8) / 16);
    println!("lengths {lens:?} total {total}; dense B={b} S={sd}");
    let mut cu = vec![0i32];
    for &l in &lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    let cu_d = s.clone_htod(&cu)?;
    let addr = |x: &CudaSlice<u16>| x.device_ptr(&s).0;
    for (d, h) in [(128usize, 16usize), (64, 32)] {
        let q = random_bf16(&s, total.max(b * sd) * h * d, 1)?;
        let k = random_bf16(&s, total.max(b * sd) * h * d, 2)?;
        let v = random_bf16(&s, total.max(b * sd) * h * d, 3)?;
        let o = s.alloc_zeros::<u16>(total.max(b * sd) * h * d)?;
        let lse = s.alloc_zeros::<f32>(total.max(b * sd) * h)?;
        for causal in [false, true] {
            let class = AttentionClass {
                dtype: DType::Bf16,
                head_dim: d,
                heads_q: h,
                heads_kv: h,
                causal,
                softmax_scale: None,
                window: flashmoe::problem::NO_WINDOW,
                softcap: 0.0,
            };
            let t =
                |x: &CudaSlice<u16>, sh: &[usize]| RawTensor::contiguous(addr(x), DType::Bf16, sh);
            let va = VarlenArgs {
                q: t(&q, &[total, h, d])?,
                k: t(&k, &[total, h, d])?,
                v: t(&v, &[total, h, d])?,
                o: t(&o, &[total, h, d])?,
                lse: RawTensor::contiguous(lse.device_ptr(&s).0, DType::F32, &[h, total])?,
                cu_seqlens_q: RawIndex::vector(cu_d.device_ptr(&s).0, cu.len()),
                cu_seqlens_k: RawIndex::vector(cu_d.device_ptr(&s).0, cu.len()),
                max_seqlen_q: *lens.iter().max().unwrap(),
                max_seqlen_k: *lens.iter().max().unwrap(),
            };
            let da = AttentionArgs {
                q: t(&q, &[b, sd, h, d])?,
                k: t(&k, &[b, sd, h, d])?,
                v: t(&v, &[b, sd, h, d])?,
                o: t(&o, &[b, sd, h, d])?,
                lse: RawTensor::contiguous(lse.device_ptr(&s).0, DType::F32, &[b, h, sd])?,
            };
            let vp = VarlenPlan::new(&dev, class)?;
            let dp = AttentionPlan::new(&dev, class)?;
            let vws = vp.alloc_workspace(&s)?;
            let dws = dp.alloc_workspace(&s)?;
            let (mut tv, mut td) = (Vec::new(), Vec::new());
            for r in 0..rounds + 3 {
                // Alternate which goes first; the first 3 rounds warm up.
                for which in [r % 2, 1 - r % 2] {
                    flush.flush()?;
                    // SAFETY: every buffer lives to the end of main and holds the larger
                    // of the two problems; each workspace is its plan's, on this stream.
                    let ms = if which == 0 {
                        timer.time(|| unsafe { vp.forward_raw(s.cu_stream(), &va, vws.raw()) })?
                    } else {
                        timer.time(|| unsafe { dp.forward_raw(s.cu_stream(), &da, dws.raw()) })?
                    };
                    if r >= 3 {
                        if which == 0 {
                            tv.push(ms)
                        } else {
                            td.push(ms)
                        }
                    }
                }
            }
            let half = if causal { 0.5 } else { 1.0 };
            let fv: f64 = lens
                .iter()
                .map(|&l| 4.0 * (h * d) as f64 * (l * l) as f64 * half)
                .sum();
            let fd = 4.0 * (b * h * d) as f64 * (sd * sd) as f64 * half;
            let (mv, md) = (median(tv), median(td));
            let (tfv, tfd) = (fv / (mv * 1e-3) / 1e12, fd / (md * 1e-3) / 1e12);
            println!(
                "D={d} H={h} causal={causal}: varlen {:.1} us {tfv:.0} TFLOP/s | dense B={b} S={sd} {:.1} us {tfd:.0} TFLOP/s | ratio {:.3}",
                mv * 1e3,
                md * 1e3,
                tfv / tfd
            );
        }
    }
    Ok(())
}
