//! GPU checks of the entry points against plain candle ops on the CPU in f32:
//! softmax(mask(softcap(Q Kᵀ · scale))) V with bottom-right masks, on deterministic
//! pseudo-random inputs. `flash_attn` (GQA, causal and not, bf16 and f16, strided inputs);
//! `flash_attn_varlen` (ragged lengths incl. 1 and primes, strided q/k/v); the paged
//! `flash_attn_varlen_paged_windowed` (shuffled pages, windows, softcap, u32 and i32 block
//! tables); sliding windows and softcap of prefill-sized dense and varlen calls (the sm_90a
//! kernel: these tests expect a Hopper GPU, as the varlen ones do); decode-shaped softcap /
//! sliding windows of the dense functions (the decode plan at head dims 128 and 256);
//! `mla_decode` (module `mla`: shuffled latent pages, Sq 1..4, Hq 16/128); a value head dim
//! other than the query/key one (dense and varlen, 192/128, 64/32, 96/128). Each test returns
//! early with a note when there is no CUDA device (the CPU CI machine).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, IndexOp, Result, Tensor, D};
use flashmoe_candle::{
    flash_attn, flash_attn_alibi, flash_attn_alibi_windowed, flash_attn_alibi_windowed_softcap,
    flash_attn_varlen, flash_attn_varlen_alibi_windowed_softcap, flash_attn_varlen_paged_windowed,
    flash_attn_varlen_windowed, flash_attn_windowed, FlashAttn,
};

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
    let window = if causal { (-1, 0) } else { (-1, -1) };
    reference_masked(q, k, v, scale, window, None)
}

/// As [`reference`] with a (left, right) window around each row's bottom-right diagonal
/// (-1 = unbounded; (-1, 0) is causal) and an optional softcap (softcap · tanh(s / softcap)
/// of the scaled scores). Every row must see at least one key.
fn reference_masked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    window: (i64, i64),
    softcap: Option<f32>,
) -> Result<Tensor> {
    let (b, sq, hq, _) = q.dims4()?;
    let (_, sk, hkv, _) = k.dims4()?;
    let group = hq / hkv;
    let q = q.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?; // (b, hq, sq, d)
    let expand = |t: &Tensor| -> Result<Tensor> {
        // (b, sk, hkv, d) -> (b, hq, sk, d), kv head h serving q heads h*group.. (v may
        // have a head dim of its own)
        let d = t.dim(3)?;
        t.to_dtype(DType::F32)?
            .transpose(1, 2)? // (b, hkv, sk, d)
            .unsqueeze(2)?
            .broadcast_as((b, hkv, group, sk, d))?
            .reshape((b, hq, sk, d))
    };
    let (k, v) = (expand(k)?, expand(v)?);
    let mut scores = (q.matmul(&k.t()?.contiguous()?)? * scale as f64)?; // (b, hq, sq, sk)
    if let Some(c) = softcap {
        scores = ((scores / c as f64)?.tanh()? * c as f64)?;
    }
    let offset = sk as i64 - sq as i64;
    let (left, right) = window;
    let mask: Vec<f32> = (0..sq as i64)
        .flat_map(|i| {
            (0..sk as i64).map(move |j| {
                let p = i + offset;
                let seen = (left < 0 || j >= p - left) && (right < 0 || j <= p + right);
                if seen {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (sq, sk), q.device())?;
    scores = scores.broadcast_add(&mask)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let p = scores.broadcast_sub(&max)?.exp()?;
    let p = p.broadcast_div(&p.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)?.contiguous() // (b, sq, hq, d)
}

/// As [`reference_masked`] plus ALiBi (FlashAttention's convention): the capped, scaled
/// score of query i and key j gets `-slopes[h] · |i + sk - sq - j|`.
fn reference_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    window: (i64, i64),
    softcap: Option<f32>,
    slopes: &[f32],
) -> Result<Tensor> {
    let (b, sq, hq, d) = q.dims4()?;
    let (_, sk, hkv, _) = k.dims4()?;
    let group = hq / hkv;
    let q = q.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
    let expand = |t: &Tensor| -> Result<Tensor> {
        t.to_dtype(DType::F32)?
            .transpose(1, 2)?
            .unsqueeze(2)?
            .broadcast_as((b, hkv, group, sk, d))?
            .reshape((b, hq, sk, d))
    };
    let (k, v) = (expand(k)?, expand(v)?);
    let mut scores = (q.matmul(&k.t()?.contiguous()?)? * scale as f64)?;
    if let Some(c) = softcap {
        scores = ((scores / c as f64)?.tanh()? * c as f64)?;
    }
    let offset = sk as i64 - sq as i64;
    let (left, right) = window;
    let mut bias = Vec::with_capacity(hq * sq * sk);
    for &slope in slopes.iter().take(hq) {
        for i in 0..sq as i64 {
            for j in 0..sk as i64 {
                let p = i + offset;
                let seen = (left < 0 || j >= p - left) && (right < 0 || j <= p + right);
                bias.push(if seen {
                    -slope * (p - j).abs() as f32
                } else {
                    f32::NEG_INFINITY
                });
            }
        }
    }
    let bias = Tensor::from_vec(bias, (hq, sq, sk), q.device())?;
    scores = scores.broadcast_add(&bias)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let p = scores.broadcast_sub(&max)?.exp()?;
    let p = p.broadcast_div(&p.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)?.contiguous()
}

/// (seq_q, seq_k, head_dim, window left, window right, softcap)
type AlibiCase = (
    usize,
    usize,
    usize,
    Option<usize>,
    Option<usize>,
    Option<f32>,
);

/// `flash_attn_alibi*` (the portable kernel on every GPU): no mask, causal, sliding windows
/// and softcap, bf16 and f16, GQA, against candle ops in f32.
#[test]
fn flash_attn_alibi_matches_candle_reference() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    let (b, hq, hkv) = (2, 8, 2);
    let slopes: Vec<f32> = (0..hq).map(|h| 2f32.powf(-(h as f32 + 1.0))).collect();
    let sl = Tensor::from_vec(slopes.clone(), hq, &Device::Cpu)?.to_device(&dev)?;
    let mut seed = 900;
    let cases: [AlibiCase; 6] = [
        (97, 211, 128, None, None, None),
        (128, 128, 64, None, Some(0), None),
        (100, 300, 80, Some(40), Some(0), None),
        (150, 150, 96, Some(20), Some(10), Some(5.0)),
        (1, 300, 256, None, Some(0), Some(30.0)),
        (64, 64, 192, None, None, Some(2.0)),
    ];
    for (sq, sk, d, left, right, softcap) in cases {
        for dtype in [DType::BF16, DType::F16] {
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
            let got = match softcap {
                Some(c) => {
                    flash_attn_alibi_windowed_softcap(&q, &k, &v, Some(&sl), scale, left, right, c)?
                }
                None if left.is_none() && right.is_none() => {
                    flash_attn_alibi(&q, &k, &v, &sl, scale, false)?
                }
                None => flash_attn_alibi_windowed(&q, &k, &v, &sl, scale, left, right)?,
            };
            let side = |s: Option<usize>| s.map_or(-1, |s| s as i64);
            let want = reference_alibi(
                &q.to_device(&Device::Cpu)?,
                &k.to_device(&Device::Cpu)?,
                &v.to_device(&Device::Cpu)?,
                scale,
                (side(left), side(right)),
                softcap,
                &slopes,
            )?;
            let (err, nan) = rel_l2(&got.to_device(&Device::Cpu)?, &want)?;
            println!("alibi sq={sq} sk={sk} d={d} window=({left:?}, {right:?}) softcap={softcap:?} {dtype:?}: rel L2 {err:.2e}");
            assert!(!nan, "NaN/inf in the output");
            assert!(err < 2e-2, "rel L2 {err}");
        }
    }
    // The op as candle-flash-attn's users build it (`FlashAttn { alibi_slopes, .. }`) is the
    // same call as flash_attn_alibi: the same bits.
    let q = random((b, 77, hq, 128), 950)?
        .to_dtype(DType::BF16)?
        .to_device(&dev)?;
    let kv = random((b, 131, hkv, 128), 951)?
        .to_dtype(DType::BF16)?
        .to_device(&dev)?;
    let op = FlashAttn {
        softmax_scale: 0.1,
        alibi_slopes: Some(sl.clone()),
        window_size_left: None,
        window_size_right: Some(0),
        softcap: None,
    };
    let via_op = q.apply_op3(&kv, &kv, op)?.to_device(&Device::Cpu)?;
    let via_fn = flash_attn_alibi(&q, &kv, &kv, &sl, 0.1, true)?.to_device(&Device::Cpu)?;
    let diff = (via_op.to_dtype(DType::F32)? - via_fn.to_dtype(DType::F32)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert_eq!(
        diff, 0.0,
        "FlashAttn with alibi_slopes differs from flash_attn_alibi"
    );
    // Wrong slopes: an error naming them.
    let q = random((b, 4, hq, 64), 1)?
        .to_dtype(DType::BF16)?
        .to_device(&dev)?;
    let bad = Tensor::zeros(3, DType::F32, &dev)?;
    let e = flash_attn_alibi(&q, &q, &q, &bad, 0.125, true).unwrap_err();
    assert!(e.to_string().contains("alibi_slopes"), "{e}");
    Ok(())
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
    // A sliding window with a softcap on the same strided views.
    let got = flash_attn_alibi_windowed_softcap(&q, &k, &v, None, scale, Some(30), Some(0), 20.0)?;
    let want = reference_masked(&q, &k, &v, scale, (30, 0), Some(20.0))?;
    let (err, nan) = rel_l2(&got, &want)?;
    println!("strided window (30, 0) softcap 20: rel L2 {err:.2e}");
    assert!(!nan && err < 1e-2, "relative L2 error {err}, nan {nan}");
    Ok(())
}

/// candle-flash-attn's window sizes as the reference's sides: None is unbounded (-1).
fn sides(left: Option<usize>, right: Option<usize>) -> (i64, i64) {
    let s = |w: Option<usize>| w.map_or(-1, |w| w as i64);
    (s(left), s(right))
}

#[test]
fn prefill_windows_and_softcap_match_candle_reference() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    // (batch, seq_q, seq_k, heads_q, heads_kv, head_dim, (left, right), softcap); every row
    // sees at least its diagonal key (seq_q <= seq_k, right >= 0).
    let cases = [
        // Mistral-like: a causal sliding window much shorter than the sequence.
        (2, 300, 300, 8, 2, 128, (Some(64), Some(0)), None),
        // Window + softcap with seq_q < seq_k (the diagonal shifted right), head dim 64.
        (1, 200, 457, 4, 4, 64, (Some(100), Some(0)), Some(30.0)),
        // Gemma-2 27B-like: causal softcap 50, MQA, a ragged tile.
        (2, 257, 257, 8, 1, 128, (None, Some(0)), Some(50.0)),
        // A local window on both sides (not causal).
        (1, 190, 190, 4, 2, 64, (Some(20), Some(13)), None),
        // Left side only (the right unbounded), and a window one key wide.
        (1, 150, 300, 4, 2, 128, (Some(40), None), None),
        (1, 129, 129, 4, 2, 128, (Some(0), Some(0)), None),
        // Softcap without a mask; a small cap so tanh bends the scores.
        (2, 130, 130, 8, 8, 128, (None, None), Some(2.0)),
    ];
    let mut seed = 20_000;
    for (b, sq, sk, hq, hkv, d, (left, right), softcap) in cases {
        for dtype in [DType::BF16, DType::F16] {
            seed += 10;
            let r =
                |shape, s| -> Result<Tensor> { random(shape, s)?.to_dtype(dtype)?.to_device(&dev) };
            let q = r((b, sq, hq, d), seed)?;
            let k = r((b, sk, hkv, d), seed + 1)?;
            let v = r((b, sk, hkv, d), seed + 2)?;
            // Scores of unit-variance size, so the softcap matters.
            let scale = 3.0 / (d as f32).sqrt();
            let got = match softcap {
                Some(c) => {
                    flash_attn_alibi_windowed_softcap(&q, &k, &v, None, scale, left, right, c)?
                }
                None => flash_attn_windowed(&q, &k, &v, scale, left, right)?,
            };
            assert_eq!(got.dims4()?, (b, sq, hq, d));
            assert_eq!(got.dtype(), dtype);
            let want = reference_masked(&q, &k, &v, scale, sides(left, right), softcap)?;
            let (err, nan) = rel_l2(&got, &want)?;
            println!(
                "prefill b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} window=({left:?}, {right:?}) softcap={softcap:?} {dtype:?}: rel L2 {err:.2e}"
            );
            assert!(!nan, "non-finite output");
            assert!(err < 1e-2, "relative L2 error {err}");
        }
    }
    Ok(())
}

/// Cumulative offsets `[0, l0, l0 + l1, ..]` as u32.
fn cumulative(lens: &[usize]) -> Vec<u32> {
    let mut out = vec![0u32];
    for &l in lens {
        out.push(out.last().unwrap() + l as u32);
    }
    out
}

/// Packed rows `off .. off + len` of a (total, h, d) tensor as a (1, len, h, d) batch.
fn rows(t: &Tensor, off: u32, len: usize) -> Result<Tensor> {
    t.narrow(0, off as usize, len)?.unsqueeze(0)
}

#[test]
fn flash_attn_varlen_matches_candle_reference() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    // Per-sequence (seq_q, seq_k), seq_k >= seq_q so no causal row is fully masked: lengths
    // 1, primes, a block multiple, and one longer than a 128-row tile.
    let lens_q = [1usize, 7, 13, 64, 131, 2];
    let lens_k = [1usize, 11, 13, 97, 131, 263];
    let (cq, ck) = (cumulative(&lens_q), cumulative(&lens_k));
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    let (max_q, max_k) = (*lens_q.iter().max().unwrap(), *lens_k.iter().max().unwrap());
    let seqlens_q = Tensor::new(cq.as_slice(), &dev)?;
    let seqlens_k = Tensor::new(ck.as_slice(), &dev)?;
    let mut seed = 1000;
    for (hq, hkv, d) in [(8, 2, 128), (4, 4, 64), (6, 1, 128)] {
        for dtype in [DType::BF16, DType::F16] {
            for causal in [false, true] {
                seed += 1;
                let r = |n, h, s| -> Result<Tensor> {
                    let t = random((1, n, h, d), s)?.squeeze(0)?.to_dtype(dtype)?;
                    t.to_device(&dev)
                };
                let (q, k, v) = (
                    r(tq, hq, seed)?,
                    r(tk, hkv, seed + 100)?,
                    r(tk, hkv, seed + 200)?,
                );
                let scale = 1.0 / (d as f32).sqrt();
                let got = flash_attn_varlen(
                    &q, &k, &v, &seqlens_q, &seqlens_k, max_q, max_k, scale, causal,
                )?;
                assert_eq!(got.dims3()?, (tq, hq, d));
                assert_eq!(got.dtype(), dtype);
                let (qc, kc, vc) = (
                    q.to_device(&Device::Cpu)?,
                    k.to_device(&Device::Cpu)?,
                    v.to_device(&Device::Cpu)?,
                );
                let mut want = Vec::new();
                for b in 0..lens_q.len() {
                    let qb = rows(&qc, cq[b], lens_q[b])?;
                    let kb = rows(&kc, ck[b], lens_k[b])?;
                    let vb = rows(&vc, ck[b], lens_k[b])?;
                    want.push(reference(&qb, &kb, &vb, scale, causal)?.squeeze(0)?);
                }
                let want = Tensor::cat(&want, 0)?;
                let (err, nan) = rel_l2(&got.to_device(&Device::Cpu)?, &want)?;
                println!(
                    "varlen hq={hq} hkv={hkv} d={d} {dtype:?} causal={causal}: rel L2 {err:.2e}"
                );
                assert!(!nan, "non-finite output");
                assert!(err < 1e-2, "relative L2 error {err}");
            }
        }
    }
    Ok(())
}

#[test]
fn flash_attn_varlen_reads_strided_inputs_and_windows() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    let (hq, hkv, d) = (4, 2, 128);
    let lens = [5usize, 1, 29, 70];
    let cu = cumulative(&lens);
    let total = *cu.last().unwrap() as usize;
    let seqlens = Tensor::new(cu.as_slice(), &dev)?;
    // One packed (total, hq + 2 hkv, d) QKV; q, k, v are head slices of it.
    let qkv = random((1, total, hq + 2 * hkv, d), 77)?
        .squeeze(0)?
        .to_dtype(DType::BF16)?
        .to_device(&dev)?;
    let q = qkv.narrow(1, 0, hq)?;
    let k = qkv.narrow(1, hq, hkv)?;
    let v = qkv.narrow(1, hq + hkv, hkv)?;
    assert!(!q.is_contiguous());
    let scale = 0.1;
    // (None, Some(0)) is causal; a left window wider than every sequence masks nothing more;
    // then sliding windows (the longest sequence is 70), with and without a softcap.
    for (left, right, softcap) in [
        (None, Some(0), None),
        (Some(70), Some(0), None),
        (None, None, None),
        (Some(8), Some(0), None),
        (Some(3), Some(5), None),
        (Some(16), Some(0), Some(10.0)),
        (None, None, Some(1.0)),
    ] {
        let got = match softcap {
            Some(c) => flash_attn_varlen_alibi_windowed_softcap(
                &q, &k, &v, None, &seqlens, &seqlens, 70, 70, scale, left, right, c,
            )?,
            None => flash_attn_varlen_windowed(
                &q, &k, &v, &seqlens, &seqlens, 70, 70, scale, left, right,
            )?,
        };
        let qkv_c = qkv.to_device(&Device::Cpu)?;
        let mut want = Vec::new();
        for b in 0..lens.len() {
            let t = rows(&qkv_c, cu[b], lens[b])?;
            let (qb, kb, vb) = (
                t.narrow(2, 0, hq)?,
                t.narrow(2, hq, hkv)?,
                t.narrow(2, hq + hkv, hkv)?,
            );
            let o = reference_masked(&qb, &kb, &vb, scale, sides(left, right), softcap)?;
            want.push(o.squeeze(0)?);
        }
        let want = Tensor::cat(&want, 0)?;
        let (err, nan) = rel_l2(&got.to_device(&Device::Cpu)?, &want)?;
        println!(
            "varlen strided window ({left:?}, {right:?}) softcap {softcap:?}: rel L2 {err:.2e}"
        );
        assert!(!nan && err < 1e-2, "relative L2 error {err}, nan {nan}");
    }
    Ok(())
}

#[test]
fn flash_attn_varlen_windows_and_softcap_match_candle_reference() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    // Ragged (seq_q, seq_k), seq_k >= seq_q: lengths 1, primes, one over a 128-row tile.
    let lens_q = [1usize, 7, 64, 131, 200, 2];
    let lens_k = [1usize, 11, 97, 131, 333, 263];
    let (cq, ck) = (cumulative(&lens_q), cumulative(&lens_k));
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    let (max_q, max_k) = (*lens_q.iter().max().unwrap(), *lens_k.iter().max().unwrap());
    let seqlens_q = Tensor::new(cq.as_slice(), &dev)?;
    let seqlens_k = Tensor::new(ck.as_slice(), &dev)?;
    // (hq, hkv, d, (left, right), softcap)
    let cases = [
        (8, 2, 128, (Some(50), Some(0)), None),
        (4, 4, 64, (Some(30), Some(0)), Some(20.0)),
        (6, 1, 128, (None, Some(0)), Some(50.0)),
        (4, 2, 64, (Some(17), Some(9)), None),
        (8, 8, 128, (Some(60), None), Some(5.0)),
    ];
    let mut seed = 30_000;
    for (hq, hkv, d, (left, right), softcap) in cases {
        for dtype in [DType::BF16, DType::F16] {
            seed += 10;
            let r = |n, h, s| -> Result<Tensor> {
                random((1, n, h, d), s)?
                    .squeeze(0)?
                    .to_dtype(dtype)?
                    .to_device(&dev)
            };
            let (q, k, v) = (
                r(tq, hq, seed)?,
                r(tk, hkv, seed + 1)?,
                r(tk, hkv, seed + 2)?,
            );
            let scale = 2.0 / (d as f32).sqrt();
            let (sq, sk) = (&seqlens_q, &seqlens_k);
            let got = match softcap {
                Some(c) => flash_attn_varlen_alibi_windowed_softcap(
                    &q, &k, &v, None, sq, sk, max_q, max_k, scale, left, right, c,
                )?,
                None => flash_attn_varlen_windowed(
                    &q, &k, &v, sq, sk, max_q, max_k, scale, left, right,
                )?,
            };
            assert_eq!(got.dims3()?, (tq, hq, d));
            let (qc, kc, vc) = (
                q.to_device(&Device::Cpu)?,
                k.to_device(&Device::Cpu)?,
                v.to_device(&Device::Cpu)?,
            );
            let mut want = Vec::new();
            for b in 0..lens_q.len() {
                let qb = rows(&qc, cq[b], lens_q[b])?;
                let kb = rows(&kc, ck[b], lens_k[b])?;
                let vb = rows(&vc, ck[b], lens_k[b])?;
                let o = reference_masked(&qb, &kb, &vb, scale, sides(left, right), softcap)?;
                want.push(o.squeeze(0)?);
            }
            let want = Tensor::cat(&want, 0)?;
            let (err, nan) = rel_l2(&got.to_device(&Device::Cpu)?, &want)?;
            println!(
                "varlen hq={hq} hkv={hkv} d={d} window=({left:?}, {right:?}) softcap={softcap:?} {dtype:?}: rel L2 {err:.2e}"
            );
            assert!(!nan, "non-finite output");
            assert!(err < 1e-2, "relative L2 error {err}");
        }
    }
    Ok(())
}

/// A shuffled paged cache for sequences of `lens_k` keys: (k_cache, v_cache) of shape
/// (num_blocks, page, hkv, d) on the CPU and the (batch, max_blocks) table. Every block is
/// filled (unused ones too) so a wrong block id shows up in the output.
fn paged_cache(
    lens_k: &[usize],
    page: usize,
    hkv: usize,
    d: usize,
    seed: u64,
) -> Result<(Tensor, Tensor, Vec<u32>, usize)> {
    let max_blocks = lens_k.iter().map(|l| l.div_ceil(page)).max().unwrap();
    let used: usize = lens_k.iter().map(|l| l.div_ceil(page)).sum();
    let num_blocks = used + 3;
    // A fixed permutation of the block ids (stride coprime with num_blocks).
    let mut stride = 7;
    while gcd(stride, num_blocks) != 1 {
        stride += 1;
    }
    let mut next = 0;
    let mut table = vec![0u32; lens_k.len() * max_blocks];
    for (b, &l) in lens_k.iter().enumerate() {
        for j in 0..l.div_ceil(page) {
            table[b * max_blocks + j] = ((next * stride + 1) % num_blocks) as u32;
            next += 1;
        }
    }
    let k = random((num_blocks, page, hkv, d), seed)?;
    let v = random((num_blocks, page, hkv, d), seed + 1)?;
    Ok((k, v, table, max_blocks))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The keys of sequence `b` gathered out of a paged cache: (1, len, hkv, d).
fn gather(
    cache: &Tensor,
    table: &[u32],
    max_blocks: usize,
    b: usize,
    len: usize,
) -> Result<Tensor> {
    let (nb, page, hkv, d) = cache.dims4()?;
    let flat = cache.reshape((nb * page, hkv, d))?;
    let ids: Vec<u32> = (0..len)
        .map(|j| table[b * max_blocks + j / page] * page as u32 + (j % page) as u32)
        .collect();
    flat.index_select(&Tensor::new(ids.as_slice(), &Device::Cpu)?, 0)?
        .unsqueeze(0)
}

#[test]
fn flash_attn_varlen_paged_matches_candle_reference() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    // Mixed decode (1 row), speculative (3, 4) and 16-row sequences; key counts 1, primes,
    // a page multiple; every sequence has at least as many keys as rows.
    let lens_q = [1usize, 4, 1, 3, 16, 1];
    let lens_k = [1usize, 17, 131, 257, 64, 300];
    let (cq, ck) = (cumulative(&lens_q), cumulative(&lens_k));
    let tq = *cq.last().unwrap() as usize;
    let max_k = *lens_k.iter().max().unwrap();
    let seqlens_q = Tensor::new(cq.as_slice(), &dev)?;
    let seqlens_k = Tensor::new(ck.as_slice(), &dev)?;
    let mut seed = 5000;
    // (hq, hkv, d, page, window, softcap, block table dtype)
    let cases = [
        (8, 2, 128, 16, (None, Some(0)), None, DType::U32),
        (8, 2, 128, 32, (None, None), None, DType::I32),
        (4, 4, 64, 16, (Some(40), Some(0)), None, DType::U32),
        (8, 1, 128, 64, (None, Some(0)), Some(30.0), DType::U32),
        (16, 2, 256, 16, (Some(100), Some(2)), Some(10.0), DType::I32),
    ];
    for (hq, hkv, d, page, (left, right), softcap, bt_dtype) in cases {
        for dtype in [DType::BF16, DType::F16] {
            seed += 10;
            let q = random((1, tq, hq, d), seed)?.squeeze(0)?.to_dtype(dtype)?;
            let (kc, vc, table, max_blocks) = paged_cache(&lens_k, page, hkv, d, seed + 1)?;
            let (kc, vc) = (kc.to_dtype(dtype)?, vc.to_dtype(dtype)?);
            let shape = (lens_k.len(), max_blocks);
            let bt = match bt_dtype {
                DType::I32 => {
                    let t: Vec<i32> = table.iter().map(|&x| x as i32).collect();
                    Tensor::from_vec(t, shape, &dev)?
                }
                _ => Tensor::from_vec(table.clone(), shape, &dev)?,
            };
            assert_eq!(bt.dtype(), bt_dtype);
            let scale = 1.0 / (d as f32).sqrt();
            let got = flash_attn_varlen_paged_windowed(
                &q.to_device(&dev)?,
                &kc.to_device(&dev)?,
                &vc.to_device(&dev)?,
                &seqlens_q,
                &seqlens_k,
                &bt,
                None,
                16,
                max_k,
                scale,
                left,
                right,
                page,
                softcap,
            )?;
            assert_eq!(got.dims3()?, (tq, hq, d));
            let w = |x: Option<usize>| x.filter(|&x| x <= max_k).map_or(-1, |x| x as i64);
            let mut want = Vec::new();
            for b in 0..lens_q.len() {
                let qb = rows(&q, cq[b], lens_q[b])?;
                let kb = gather(&kc, &table, max_blocks, b, lens_k[b])?;
                let vb = gather(&vc, &table, max_blocks, b, lens_k[b])?;
                let o = reference_masked(&qb, &kb, &vb, scale, (w(left), w(right)), softcap)?;
                want.push(o.squeeze(0)?);
            }
            let want = Tensor::cat(&want, 0)?;
            let (err, nan) = rel_l2(&got.to_device(&Device::Cpu)?, &want)?;
            println!(
                "paged hq={hq} hkv={hkv} d={d} page={page} window=({left:?}, {right:?}) softcap={softcap:?} {dtype:?} table {bt_dtype:?}: rel L2 {err:.2e}"
            );
            assert!(!nan, "non-finite output");
            assert!(err < 1e-2, "relative L2 error {err}");
        }
    }
    Ok(())
}

#[test]
fn decode_shaped_softcap_and_windows_of_dense_calls() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    // Decode-shaped (<= 16 rows): the decode plan over the dense cache at both head dims
    // (seq_k 200 is no multiple of 16: one page per sequence).
    let (b, sk, hq, hkv) = (3, 200, 8, 2);
    let mut seed = 9000;
    for d in [128, 256] {
        for sq in [1, 5, 16] {
            for dtype in [DType::BF16, DType::F16] {
                seed += 10;
                let r = |shape, s| -> Result<Tensor> {
                    random(shape, s)?.to_dtype(dtype)?.to_device(&dev)
                };
                let q = r((b, sq, hq, d), seed)?;
                let k = r((b, sk, hkv, d), seed + 1)?;
                let v = r((b, sk, hkv, d), seed + 2)?;
                let scale = 0.09;
                let got = flash_attn_alibi_windowed_softcap(
                    &q,
                    &k,
                    &v,
                    None,
                    scale,
                    None,
                    Some(0),
                    20.0,
                )?;
                let want = reference_masked(&q, &k, &v, scale, (-1, 0), Some(20.0))?;
                let (err, nan) = rel_l2(&got, &want)?;
                println!("dense softcap d={d} sq={sq} {dtype:?}: rel L2 {err:.2e}");
                assert!(!nan && err < 1e-2, "relative L2 error {err}, nan {nan}");
                let got = flash_attn_windowed(&q, &k, &v, scale, Some(50), Some(0))?;
                let want = reference_masked(&q, &k, &v, scale, (50, 0), None)?;
                let (err, nan) = rel_l2(&got, &want)?;
                println!("dense window (50, 0) d={d} sq={sq} {dtype:?}: rel L2 {err:.2e}");
                assert!(!nan && err < 1e-2, "relative L2 error {err}, nan {nan}");
            }
        }
    }
    // Prefill-sized window + softcap at head dim 256: the portable kernel serves it where the
    // device has the shared memory for its D = 256 tile (Hopper); elsewhere an error naming
    // the head dim.
    let q = random((1, 64, hq, 256), 1)?
        .to_dtype(DType::BF16)?
        .to_device(&dev)?;
    let kv = q.i((.., .., 0..hkv, ..))?;
    match flash_attn_alibi_windowed_softcap(&q, &kv, &kv, None, 0.1, Some(32), Some(0), 30.0) {
        Ok(got) => {
            let want = reference_masked(&q, &kv, &kv, 0.1, (32, 0), Some(30.0))?;
            let (err, nan) = rel_l2(&got, &want)?;
            println!("prefill window (32, 0) + softcap d=256 sq=64 BF16: rel L2 {err:.2e}");
            assert!(!nan && err < 1e-2, "relative L2 error {err}, nan {nan}");
        }
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("head dim 256"), "head dim 256 missing from: {e}");
        }
    }
    Ok(())
}

mod mla {
    //! `mla_decode` (DeepSeek MLA paged decode). GPU check against plain candle ops on the CPU in f32: per sequence,
    //! softmax(mask(Q Cᵀ · scale)) C[:, :512] over the sequence's latent rows C (bottom-right
    //! causal across the Sq rows), with the 128 or 16 query heads of a row folded into the
    //! rows. Shuffled pages, NaN in every cache row no sequence uses, ragged lengths (1, page
    //! ± 1, a split-many-ways 4099), Sq 1..4, bf16 and f16, u32 and i32 tables, a strided q,
    //! the 4-D cache layout, a rerun bit-identical, and bad calls as errors. Returns early with
    //! a note when there is no CUDA device (the CPU CI machine).
    use super::cuda;
    use candle_core::{DType, Device, Result, Tensor, D};
    use flashmoe_candle::mla_decode;

    /// xorshift64 stream: uniform values in [-1, 1) and indices.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.uniform()).collect()
        }
    }

    /// Round f32 values to `dt` and back (what the GPU sees).
    fn rounded(v: Vec<f32>, dt: DType) -> Result<Vec<f32>> {
        let n = v.len();
        Tensor::from_vec(v, n, &Device::Cpu)?
            .to_dtype(dt)?
            .to_dtype(DType::F32)?
            .to_vec1()
    }

    struct Case {
        hq: usize,
        sq: usize,
        page: usize,
        lens: Vec<usize>,
        dt: DType,
        i32_table: bool,
        strided_q: bool,
        four_d_cache: bool,
    }

    fn run_case(dev: &Device, c: &Case, seed: u64) -> Result<()> {
        const DQ: usize = 576;
        const DV: usize = 512;
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let b = c.lens.len();
        let (hq, sq, page) = (c.hq, c.sq, c.page);
        let scale = 1.2 / (192f32).sqrt();
        let pages: Vec<usize> = c.lens.iter().map(|&n| n.div_ceil(page)).collect();
        let max_blocks = pages.iter().max().copied().unwrap() + 1;
        let num_blocks = pages.iter().sum::<usize>() + 2;
        // A shuffled block order (Fisher–Yates).
        let mut perm: Vec<usize> = (0..num_blocks).collect();
        for i in (1..num_blocks).rev() {
            perm.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        let mut table = vec![0u32; b * max_blocks];
        let mut cache = vec![f32::NAN; num_blocks * page * DQ];
        let mut latent: Vec<Vec<f32>> = Vec::new();
        let mut next = 0;
        for (bi, &n) in c.lens.iter().enumerate() {
            let rows = rounded(rng.vec(n * DQ), c.dt)?;
            for j in 0..pages[bi] {
                table[bi * max_blocks + j] = perm[next] as u32;
                next += 1;
            }
            for j in 0..n {
                let blk = table[bi * max_blocks + j / page] as usize;
                let at = (blk * page + j % page) * DQ;
                cache[at..at + DQ].copy_from_slice(&rows[j * DQ..(j + 1) * DQ]);
            }
            latent.push(rows);
        }
        let q_host = rounded(rng.vec(b * sq * hq * DQ), c.dt)?;

        // Device tensors.
        let q = Tensor::from_vec(q_host.clone(), (b, sq, hq, DQ), &Device::Cpu)?;
        let q = if c.strided_q {
            // The same values in a wider row: strides (sq·hq·584, hq·584, 584, 1).
            let pad = Tensor::zeros((b, sq, hq, 8), DType::F32, &Device::Cpu)?;
            Tensor::cat(&[&q, &pad], 3)?
                .to_dtype(c.dt)?
                .to_device(dev)?
                .narrow(3, 0, DQ)?
        } else {
            q.to_dtype(c.dt)?.to_device(dev)?
        };
        let kv = Tensor::from_vec(cache, (num_blocks, page, DQ), &Device::Cpu)?.to_dtype(c.dt)?;
        let kv = if c.four_d_cache {
            kv.reshape((num_blocks, page, 1, DQ))?
        } else {
            kv
        };
        let kv = kv.to_device(dev)?;
        let bt = if c.i32_table {
            let t: Vec<i32> = table.iter().map(|&x| x as i32).collect();
            Tensor::from_vec(t, (b, max_blocks), dev)?
        } else {
            Tensor::from_vec(table, (b, max_blocks), dev)?
        };
        let lens: Vec<u32> = c.lens.iter().map(|&n| n as u32).collect();
        let seqlens = Tensor::from_vec(lens, b, &Device::Cpu)?.to_device(dev)?;
        let max_k = *c.lens.iter().max().unwrap();

        let got = mla_decode(&q, &kv, &bt, &seqlens, scale, Some(max_k))?;
        assert_eq!(got.dims(), &[b, sq, hq, DV]);
        let again = mla_decode(&q, &kv, &bt, &seqlens, scale, None)?;
        let got = got.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        let again = again.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;

        // Reference per sequence: rows (i, h) folded, bottom-right causal over the Sq rows.
        let mut worst = 0f32;
        let mut err2 = 0f64;
        let mut ref2 = 0f64;
        for (bi, &n) in c.lens.iter().enumerate() {
            let cmat = Tensor::from_vec(latent[bi].clone(), (n, DQ), &Device::Cpu)?;
            let qb = Tensor::from_vec(
                q_host[bi * sq * hq * DQ..(bi + 1) * sq * hq * DQ].to_vec(),
                (sq * hq, DQ),
                &Device::Cpu,
            )?;
            let scores = (qb.matmul(&cmat.t()?)? * scale as f64)?;
            let mask: Vec<f32> = (0..sq * hq)
                .flat_map(|r| {
                    let last = n as i64 - sq as i64 + (r / hq) as i64;
                    (0..n as i64).map(move |j| if j <= last { 0.0 } else { f32::NEG_INFINITY })
                })
                .collect();
            let mask = Tensor::from_vec(mask, (sq * hq, n), &Device::Cpu)?;
            let p = candle_nn_softmax(&(scores + mask)?)?;
            let want = p.matmul(&cmat.narrow(1, 0, DV)?.contiguous()?)?; // (sq·hq, 512)
            let want: Vec<Vec<f32>> = want.to_vec2()?;
            let gb: Vec<f32> = got.get(bi)?.flatten_all()?.to_vec1()?;
            for (r, wrow) in want.iter().enumerate() {
                let grow = &gb[r * DV..(r + 1) * DV];
                for (g, w) in grow.iter().zip(wrow) {
                    assert!(g.is_finite(), "non-finite output: seq {bi} row {r}");
                    worst = worst.max((g - w).abs());
                    err2 += ((g - w) as f64).powi(2);
                    ref2 += (*w as f64).powi(2);
                }
            }
        }
        let rel = (err2 / ref2.max(1e-30)).sqrt();
        let (tol_rel, tol_abs) = if c.dt == DType::BF16 {
            (1.6e-2, 2e-2)
        } else {
            (4e-3, 5e-3)
        };
        println!(
            "mla_decode Hq={} Sq={} page={} lens={:?} {:?}: rel-L2 {rel:.2e}, max abs {worst:.2e}",
            hq, sq, page, c.lens, c.dt
        );
        assert!(
            rel < tol_rel && worst < tol_abs,
            "rel-L2 {rel:.2e} / max abs {worst:.2e}"
        );
        let diff = (got - again)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "a rerun (default max_seqlen_k) differs");
        Ok(())
    }

    /// Row softmax over the last dim, -inf entries giving 0.
    fn candle_nn_softmax(x: &Tensor) -> Result<Tensor> {
        let m = x.max_keepdim(D::Minus1)?;
        let e = x.broadcast_sub(&m)?.exp()?;
        e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
    }

    #[test]
    fn mla_decode_matches_candle_reference() -> Result<()> {
        let Some(dev) = cuda() else { return Ok(()) };
        let cases = [
            Case {
                hq: 128,
                sq: 1,
                page: 64,
                lens: vec![1, 63, 65, 300],
                dt: DType::BF16,
                i32_table: false,
                strided_q: false,
                four_d_cache: false,
            },
            Case {
                hq: 16,
                sq: 4,
                page: 16,
                lens: vec![4, 17, 100],
                dt: DType::F16,
                i32_table: true,
                strided_q: true,
                four_d_cache: false,
            },
            Case {
                hq: 128,
                sq: 2,
                page: 64,
                lens: vec![4099, 2],
                dt: DType::BF16,
                i32_table: true,
                strided_q: false,
                four_d_cache: true,
            },
            Case {
                hq: 128,
                sq: 3,
                page: 64,
                lens: vec![777],
                dt: DType::F16,
                i32_table: false,
                strided_q: true,
                four_d_cache: false,
            },
        ];
        for (i, c) in cases.iter().enumerate() {
            run_case(&dev, c, 100 + i as u64)?;
        }
        Ok(())
    }

    #[test]
    fn mla_decode_rejects_bad_calls() -> Result<()> {
        let Some(dev) = cuda() else { return Ok(()) };
        let q = Tensor::zeros((2, 1, 16, 576), DType::BF16, &dev)?;
        let kv = Tensor::zeros((4, 64, 576), DType::BF16, &dev)?;
        let bt = Tensor::zeros((2, 2), DType::U32, &dev)?;
        let sk = Tensor::ones(2, DType::U32, &dev)?;
        let e = |r: Result<Tensor>| r.unwrap_err().to_string();
        assert!(e(mla_decode(
            &q,
            &kv.to_dtype(DType::F16)?,
            &bt,
            &sk,
            0.1,
            None
        ))
        .contains("both"));
        assert!(e(mla_decode(&q.narrow(3, 0, 512)?, &kv, &bt, &sk, 0.1, None)).contains("576"));
        assert!(e(mla_decode(&q, &kv, &bt, &sk, 0.1, Some(129))).contains("capacity"));
        assert!(e(mla_decode(&q, &kv, &bt.narrow(0, 0, 1)?, &sk, 0.1, None)).contains("batch = 2"));
        // A one-key call runs (O = that key's first 512 columns).
        let got = mla_decode(&q, &kv, &bt, &sk, 0.1, None)?;
        assert_eq!(got.dims(), &[2, 1, 16, 512]);
        Ok(())
    }
}

/// A value head dim other than the query/key one (DeepSeek MLA prefill 192/128, and both
/// directions of the padding): against the reference, bit-identical to the call padded by
/// hand, on strided q/k views, and through the varlen function.
#[test]
fn value_head_dim_matches_candle_reference() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    // (batch, seq_q, seq_k, heads_q, heads_kv, d_qk, d_v, causal)
    let cases = [
        (2, 130, 130, 8, 2, 192, 128, true),
        (1, 77, 200, 4, 4, 192, 128, false),
        (2, 97, 97, 4, 1, 64, 32, true),
        (2, 60, 150, 4, 2, 96, 128, true),
    ];
    let mut seed = 5000;
    for (b, sq, sk, hq, hkv, dqk, dv, causal) in cases {
        for dtype in [DType::BF16, DType::F16] {
            seed += 1;
            let r =
                |shape, s| -> Result<Tensor> { random(shape, s)?.to_dtype(dtype)?.to_device(&dev) };
            let q = r((b, sq, hq, dqk), seed)?;
            let k = r((b, sk, hkv, dqk), seed + 100)?;
            let v = r((b, sk, hkv, dv), seed + 200)?;
            let scale = 1.0 / (dqk as f32).sqrt();
            let got = flash_attn(&q, &k, &v, scale, causal)?;
            assert_eq!(got.dims4()?, (b, sq, hq, dv));
            assert!(got.is_contiguous());
            let want = reference(&q, &k, &v, scale, causal)?;
            let (err, nan) = rel_l2(&got, &want)?;
            println!("value head dim {dqk}/{dv} b={b} sq={sq} sk={sk} {dtype:?} causal={causal}: rel L2 {err:.2e}");
            assert!(!nan && err < 1e-2, "relative L2 error {err}, nan {nan}");
            // exactly the call padded by hand
            let pad = dqk.max(dv);
            let by_hand = if dv < dqk {
                let vp = v.pad_with_zeros(D::Minus1, 0, pad - dv)?;
                flash_attn(&q, &k, &vp, scale, causal)?.narrow(D::Minus1, 0, dv)?
            } else {
                let qp = q.pad_with_zeros(D::Minus1, 0, pad - dqk)?;
                let kp = k.pad_with_zeros(D::Minus1, 0, pad - dqk)?;
                flash_attn(&qp, &kp, &v, scale, causal)?
            };
            let diff = (got.to_dtype(DType::F32)? - by_hand.to_dtype(DType::F32)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{dqk}/{dv}: differs from the hand-padded call");
        }
    }
    // strided q/k views of one packed projection (only v is padded and copied)
    let (b, s, h) = (2, 77, 4);
    let qk = random((b, s, 2 * h, 192), 77)?
        .to_dtype(DType::BF16)?
        .to_device(&dev)?;
    let (q, k) = (qk.narrow(2, 0, h)?, qk.narrow(2, h, h)?);
    let v = random((b, s, h, 128), 78)?
        .to_dtype(DType::BF16)?
        .to_device(&dev)?;
    let got = flash_attn(&q, &k, &v, 0.07, true)?;
    let (err, nan) = rel_l2(&got, &reference(&q, &k, &v, 0.07, true)?)?;
    println!("value head dim 192/128 on strided views: rel L2 {err:.2e}");
    assert!(!nan && err < 1e-2, "relative L2 error {err}, nan {nan}");
    // varlen: padded head dims the sm_90a varlen kernel serves (64, 128)
    let lens = [1usize, 37, 130];
    let cu = cumulative(&lens);
    let total = *cu.last().unwrap() as usize;
    let seqlens = Tensor::new(cu.as_slice(), &dev)?;
    for (dqk, dv) in [(64, 32), (96, 128)] {
        seed += 1;
        let r = |h, d, s| -> Result<Tensor> {
            random((1, total, h, d), s)?
                .squeeze(0)?
                .to_dtype(DType::BF16)?
                .to_device(&dev)
        };
        let (q, k, v) = (r(4, dqk, seed)?, r(2, dqk, seed + 1)?, r(2, dv, seed + 2)?);
        let scale = 1.0 / (dqk as f32).sqrt();
        let got = flash_attn_varlen(&q, &k, &v, &seqlens, &seqlens, 130, 130, scale, true)?;
        assert_eq!(got.dims3()?, (total, 4, dv));
        let (qc, kc, vc) = (
            q.to_device(&Device::Cpu)?,
            k.to_device(&Device::Cpu)?,
            v.to_device(&Device::Cpu)?,
        );
        let mut want = Vec::new();
        for (i, &n) in lens.iter().enumerate() {
            let (qb, kb, vb) = (
                rows(&qc, cu[i], n)?,
                rows(&kc, cu[i], n)?,
                rows(&vc, cu[i], n)?,
            );
            want.push(reference(&qb, &kb, &vb, scale, true)?.squeeze(0)?);
        }
        let (err, nan) = rel_l2(&got.to_device(&Device::Cpu)?, &Tensor::cat(&want, 0)?)?;
        println!("varlen value head dim {dqk}/{dv}: rel L2 {err:.2e}");
        assert!(!nan && err < 1e-2, "relative L2 error {err}, nan {nan}");
    }
    Ok(())
}
