//! GPU check of `flash_attn` against plain candle ops: softmax(Q Kᵀ · scale) V in f32 with
//! a bottom-right causal mask, on deterministic pseudo-random inputs, with GQA, causal and
//! not, bf16 and f16, and a strided input (q/k/v narrowed out of one packed tensor).
//! Returns early with a note when there is no CUDA device (the CPU CI machine).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor, D};
use flashmoe_candle::flash_attn;

fn cuda() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("note: no CUDA device ({e}); skipping the flashmoe-candle GPU test");
            None
        }
    }
}

/// Uniform values in [-1, 1) from a fixed-seed xorshift generator.
fn random(shape: (usize, usize, usize, usize), seed: u64) -> Result<Tensor> {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// softmax(Q Kᵀ · scale) V in f32; q (b, sq, hq, d), k/v (b, sk, hkv, d) of any dtype.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
    let (b, sq, hq, d) = q.dims4()?;
    let (_, sk, hkv, _) = k.dims4()?;
    let group = hq / hkv;
    let q = q.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?; // (b, hq, sq, d)
    let expand = |t: &Tensor| -> Result<Tensor> {
        // (b, sk, hkv, d) -> (b, hq, sk, d), kv head h serving q heads h*group..
        t.to_dtype(DType::F32)?
            .transpose(1, 2)? // (b, hkv, sk, d)
            .unsqueeze(2)?
            .broadcast_as((b, hkv, group, sk, d))?
            .reshape((b, hq, sk, d))
    };
    let (k, v) = (expand(k)?, expand(v)?);
    let mut scores = (q.matmul(&k.t()?.contiguous()?)? * scale as f64)?; // (b, hq, sq, sk)
    if causal {
        let offset = sk as i64 - sq as i64;
        let mask: Vec<f32> = (0..sq as i64)
            .flat_map(|i| {
                (0..sk as i64).map(move |j| {
                    if j <= i + offset {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (sq, sk), q.device())?;
        scores = scores.broadcast_add(&mask)?;
    }
    let max = scores.max_keepdim(D::Minus1)?;
    let p = scores.broadcast_sub(&max)?.exp()?;
    let p = p.broadcast_div(&p.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)?.contiguous() // (b, sq, hq, d)
}

fn rel_l2(got: &Tensor, want: &Tensor) -> Result<(f32, bool)> {
    let got = got.to_dtype(DType::F32)?;
    let has_nan = got
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .any(|x| !x.is_finite());
    let err = (&got - want)?.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
    let norm = want.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
    Ok((err / norm, has_nan))
}

#[test]
fn flash_attn_matches_candle_reference() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    // (batch, seq_q, seq_k, heads_q, heads_kv, head_dim); seq_q <= seq_k so no causal row
    // is fully masked.
    let cases = [
        (2, 128, 128, 8, 8, 64),
        (2, 97, 211, 8, 2, 128), // GQA, ragged lengths, seq_q < seq_k
        (1, 1, 300, 4, 1, 128),  // decode-like, MQA
        (3, 64, 64, 6, 3, 64),
    ];
    let mut seed = 1;
    for (b, sq, sk, hq, hkv, d) in cases {
        for dtype in [DType::BF16, DType::F16] {
            for causal in [false, true] {
                seed += 1;
                let q = random((b, sq, hq, d), seed)?
                    .to_dtype(dtype)?
                    .to_device(&dev)?;
                let k = random((b, sk, hkv, d), seed + 100)?
                    .to_dtype(dtype)?
                    .to_device(&dev)?;
                let v = random((b, sk, hkv, d), seed + 200)?
                    .to_dtype(dtype)?
                    .to_device(&dev)?;
                let scale = 1.0 / (d as f32).sqrt();
                let got = flash_attn(&q, &k, &v, scale, causal)?;
                assert_eq!(got.dims4()?, (b, sq, hq, d));
                assert_eq!(got.dtype(), dtype);
                let want = reference(&q, &k, &v, scale, causal)?;
                let (err, nan) = rel_l2(&got, &want)?;
                println!(
                    "b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} {dtype:?} causal={causal}: rel L2 {err:.2e}"
                );
                assert!(!nan, "non-finite output");
                assert!(err < 1e-2, "relative L2 error {err}");
            }
        }
    }
    Ok(())
}

#[test]
fn flash_attn_reads_strided_inputs() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    let (b, s, h, d) = (2, 77, 4, 128);
    // One packed (b, s, 3h, d) tensor; q, k, v are head slices of it (offsets, head stride 3h·d).
    let qkv = random((b, s, 3 * h, d), 7)?
        .to_dtype(DType::BF16)?
        .to_device(&dev)?;
    let q = qkv.narrow(2, 0, h)?;
    let k = qkv.narrow(2, h, h)?;
    let v = qkv.narrow(2, 2 * h, h)?;
    assert!(!k.is_contiguous());
    let scale = 1.0 / (d as f32).sqrt();
    for causal in [false, true] {
        let got = flash_attn(&q, &k, &v, scale, causal)?;
        let want = reference(&q, &k, &v, scale, causal)?;
        let (err, nan) = rel_l2(&got, &want)?;
        println!("strided causal={causal}: rel L2 {err:.2e}");
        assert!(!nan && err < 1e-2, "relative L2 error {err}, nan {nan}");
    }
    Ok(())
}
