//! Times paged-KV decode on issue 22's decode shapes (bf16, D = 128, causal, page sizes 16
//! and 128, shuffled block tables) with CUDA events after an L2 flush, and prints µs and
//! GB/s of KV read (the floor: the cache read once). A development probe until the lab's
//! `decode` preset exists; inputs are random, not zeros.
//!
//! ```text
//! cargo run --release -p flashmoe-bench --example decode_probe
//! ```

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use flashmoe::attention::decode::{DecodeArgs, DecodeClass, DecodePlan, RawIndex};
use flashmoe::gpu::{Device, RawTensor};
use flashmoe::DType;
use flashmoe_bench::gpu::{EventTimer, L2Flusher};
use std::sync::Arc;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// xorshift64: cheap random bits for the inputs and the page shuffle.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// `n` random bf16 values in [-1, 1): a 16 MiB random block uploaded once, then copied
/// device to device until the buffer is full (filling GBs from the host would take long).
fn random_bf16(s: &Arc<CudaStream>, n: usize, rng: &mut Rng) -> Res<CudaSlice<u16>> {
    let block: Vec<u16> = (0..(8usize << 20).min(n))
        .map(|_| {
            let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            half::bf16::from_f32(u).to_bits()
        })
        .collect();
    let src = s.clone_htod(&block)?;
    let mut dst = s.alloc_zeros::<u16>(n)?;
    let mut off = 0;
    while off < n {
        let len = block.len().min(n - off);
        let mut view = dst.slice_mut(off..off + len);
        s.memcpy_dtod(&src.slice(..len), &mut view)?;
        off += len;
    }
    Ok(dst)
}

fn main() -> Res<()> {
    let dev = Device::open(0)?;
    println!("{}", dev.info());
    let s = dev.stream().clone();
    let timer = EventTimer::new(&dev)?;
    let mut flush = L2Flusher::new(&dev)?;
    let mut rng = Rng(0x5eed_1234_abcd_9876);
    let addr = |b: &CudaSlice<u16>| b.device_ptr(&s).0;
    for &(b, hq, hkv, sq, sk) in &[
        (1usize, 32usize, 8usize, 1usize, 8192usize),
        (8, 32, 8, 1, 4096),
        (64, 32, 8, 1, 8192),
        (128, 32, 8, 1, 2048),
        (16, 64, 8, 1, 32768),
        (32, 32, 32, 1, 4096),
        (64, 32, 8, 4, 4096),
    ] {
        for ps in [16usize, 128] {
            let d = 128;
            let c = DecodeClass::causal(DType::Bf16, d, hq, hkv, ps, sq);
            let (mb, nb) = (sk / ps, b * sk / ps);
            let mut perm: Vec<i32> = (0..nb as i32).collect();
            for i in (1..nb).rev() {
                perm.swap(i, (rng.next() % (i as u64 + 1)) as usize);
            }
            let kc = random_bf16(&s, nb * ps * hkv * d, &mut rng)?;
            let vc = random_bf16(&s, nb * ps * hkv * d, &mut rng)?;
            let q = random_bf16(&s, b * sq * hq * d, &mut rng)?;
            let o = s.alloc_zeros::<u16>(b * sq * hq * d)?;
            let lse = s.alloc_zeros::<f32>(b * hq * sq)?;
            let bt = s.clone_htod(&perm)?;
            let su = s.clone_htod(&vec![sk as i32; b])?;
            let t = |buf: &CudaSlice<u16>, sh: &[usize]| {
                RawTensor::contiguous(addr(buf), DType::Bf16, sh)
            };
            let a = DecodeArgs {
                q: t(&q, &[b, sq, hq, d])?,
                k_cache: t(&kc, &[nb, ps, hkv, d])?,
                v_cache: t(&vc, &[nb, ps, hkv, d])?,
                block_table: RawIndex::matrix(bt.device_ptr(&s).0, b, mb),
                seqused_k: RawIndex::vector(su.device_ptr(&s).0, b),
                o: t(&o, &[b, sq, hq, d])?,
                lse: RawTensor::contiguous(lse.device_ptr(&s).0, DType::F32, &[b, hq, sq])?,
                max_seqlen_k: Some(sk),
            };
            let plan = DecodePlan::new(&dev, c)?;
            let shape = plan.check(&a)?;
            let ws = plan.alloc_workspace(&s, b, sk)?;
            let mut ts = Vec::new();
            for _ in 0..30 {
                flush.flush()?;
                // SAFETY: every buffer above lives to the end of this iteration and is
                // sized for its tensor; the workspace is the plan's, on this stream.
                ts.push(timer.time(|| unsafe { plan.forward_raw(s.cu_stream(), &a, ws.raw()) })?);
            }
            ts.sort_by(|x, y| x.partial_cmp(y).unwrap());
            let ms = ts[ts.len() / 2];
            let bytes = c.kv_bytes(&vec![sk; b], sq) as f64;
            println!(
                "B={b} Hq={hq} Hkv={hkv} Sq={sq} Sk={sk} page={ps}: splits {} ({} CTAs/SM) {:.1} us, {:.0} GB/s of KV",
                shape.splits,
                plan.ctas_per_sm(),
                ms * 1e3,
                bytes / (ms * 1e-3) / 1e9
            );
        }
    }
    Ok(())
}
