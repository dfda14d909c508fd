//! A value head dim other than the query/key one (D_v ≠ D_qk; DeepSeek MLA's prefill is
//! 192 / 128) for the dense and varlen functions: the call runs exactly on the kernels of one
//! head dim D = max(D_qk, D_v), by the library router's rule
//! ([`flashmoe::attention::route::pad_value_head_dim`], the same one flashmoe-py uses):
//! D_v < D_qk zero-pads v to D_qk and keeps o's first D_v columns (the others are P·0 = 0);
//! D_v > D_qk zero-pads q and k to D_v (Q·Kᵀ unchanged). candle-flash-attn's functions take
//! the scale explicitly, so it passes through unchanged.
//!
//! Cost: the padded tensor(s) are new contiguous copies made with candle ops on the call's
//! device (v at D_qk, or q and k at D_v), the kernel does the padded product's FLOPs (P·V
//! over D_qk columns, or Q·Kᵀ over D_v), and when v was padded, o's first D_v columns are
//! copied into a contiguous output. The unpadded tensors are passed as they are (strided
//! views included).

use crate::check::candle_err;
use candle_core::{bail, Result, Tensor, D};
use flashmoe::attention::route;

/// `run(q, k, v)` — a flashmoe op over tensors of one head dim — on the call padded to one
/// head dim when v's last dim differs from k's, else on the tensors as they are. `what` names
/// the function for errors: q and k must share the query/key head dim and v must have k's
/// shape but for its last dim; both head dims must be multiples of 8 up to 256.
pub(crate) fn with_value_head_dim(
    what: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    run: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (kd, vd) = (k.dims(), v.dims());
    if kd.last() == vd.last() {
        return run(q, k, v);
    }
    let (qd, rank) = (q.dims(), kd.len());
    if rank == 0
        || qd.len() != rank
        || vd.len() != rank
        || qd[rank - 1] != kd[rank - 1]
        || kd[..rank - 1] != vd[..rank - 1]
    {
        bail!(
            "flash-attn ({what}): q and k share the query/key head dim and v has k's shape but \
             for its last dim (the value head dim); got q {qd:?}, k {kd:?}, v {vd:?}"
        )
    }
    let (head_dim_qk, head_dim_v) = (kd[rank - 1], vd[rank - 1]);
    let pad = route::pad_value_head_dim(head_dim_qk, head_dim_v, Some(softmax_scale))
        .map_err(candle_err)?;
    if pad.pad_qk() > 0 {
        let q = q.pad_with_zeros(D::Minus1, 0, pad.pad_qk())?;
        let k = k.pad_with_zeros(D::Minus1, 0, pad.pad_qk())?;
        return run(&q, &k, v);
    }
    let v = v.pad_with_zeros(D::Minus1, 0, pad.pad_v())?;
    run(q, k, &v)?
        .narrow(D::Minus1, 0, head_dim_v)?
        .contiguous()
}

/// An error unless the paged caches share one head dim: a value cache of its own head dim
/// would have to be padded whole at every step.
pub(crate) fn check_paged_caches(k: &Tensor, v: &Tensor) -> Result<()> {
    let (kd, vd) = (k.dims().last(), v.dims().last());
    if kd != vd {
        bail!(
            "flashmoe-candle: flash_attn_varlen_paged_windowed: v has head dim {} but k has {}; \
             the paged kernels take one head dim, and padding a value cache would copy all of it \
             at every step (DeepSeek MLA decode over its latent cache: mla_decode; prefill with \
             its own value head dim: flash_attn / flash_attn_varlen)",
            vd.copied().unwrap_or(0),
            kd.copied().unwrap_or(0)
        )
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, IndexOp};

    /// Pseudo-random f64 values in [-1, 1) (xorshift, fixed seed).
    fn random(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let data: Vec<f64> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    /// f64 attention of dense (b, s, h, d) tensors, v of its own head dim, GQA, bottom-right
    /// causal or no mask: the stand-in for the kernels (and, unpadded, the reference).
    fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
        let (b, sq, hq, _) = q.dims4()?;
        let (_, sk, hkv, _) = k.dims4()?;
        let group = hq / hkv;
        let expand = |t: &Tensor| -> Result<Tensor> {
            let d = t.dim(3)?;
            t.transpose(1, 2)?
                .unsqueeze(2)?
                .broadcast_as((b, hkv, group, sk, d))?
                .reshape((b, hq, sk, d))
        };
        let q = q.transpose(1, 2)?.contiguous()?;
        let (k, v) = (expand(k)?, expand(v)?);
        let mut s = (q.matmul(&k.t()?.contiguous()?)? * scale as f64)?;
        if causal {
            let off = sk as i64 - sq as i64;
            let mask: Vec<f64> = (0..sq as i64)
                .flat_map(|i| {
                    (0..sk as i64).map(move |j| if j > i + off { f64::NEG_INFINITY } else { 0.0 })
                })
                .collect();
            s = s.broadcast_add(&Tensor::from_vec(mask, (sq, sk), &Device::Cpu)?)?;
        }
        let p = s.broadcast_sub(&s.max_keepdim(D::Minus1)?)?.exp()?;
        let p = p.broadcast_div(&p.sum_keepdim(D::Minus1)?)?;
        p.matmul(&v.contiguous()?)?.transpose(1, 2)?.contiguous()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        assert_eq!(a.dims(), b.dims());
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    #[test]
    fn padding_is_exact_against_the_unpadded_call() -> Result<()> {
        // (D_qk, D_v), (b, sq, sk, hq, hkv), causal
        for (i, &((dqk, dv), (b, sq, sk, hq, hkv), causal)) in [
            ((192, 128), (2, 5, 7, 4, 2), true),
            ((64, 32), (1, 6, 6, 3, 1), false),
            ((96, 128), (2, 4, 9, 2, 2), true),
            ((32, 64), (1, 8, 3, 4, 2), false),
        ]
        .iter()
        .enumerate()
        {
            let seed = 10 * i as u64;
            let q = random(&[b, sq, hq, dqk], seed + 1);
            let k = random(&[b, sk, hkv, dqk], seed + 2);
            let v = random(&[b, sk, hkv, dv], seed + 3);
            let scale = 1.0 / (dqk as f32).sqrt();
            let mut seen = Vec::new();
            let o = with_value_head_dim("flash_attn", &q, &k, &v, scale, |q, k, v| {
                seen.push([q.dim(3)?, k.dim(3)?, v.dim(3)?]);
                attention(q, k, v, scale, causal)
            })?;
            let pad = dqk.max(dv);
            assert_eq!(seen, vec![[pad; 3]], "the op sees one head dim");
            assert_eq!(o.dims(), &[b, sq, hq, dv]);
            assert!(o.is_contiguous());
            let want = attention(&q, &k, &v, scale, causal)?;
            let err = max_abs_diff(&o, &want);
            assert!(err < 1e-12, "({dqk}, {dv}): max abs error {err:e}");
        }
        Ok(())
    }

    #[test]
    fn equal_head_dims_and_strided_inputs_pass_through() -> Result<()> {
        // one packed (b, s, 3h, d) tensor: q, k, v are strided views handed over as they are
        let qkv = random(&[1, 4, 6, 64], 7);
        let (q, k, v) = (
            qkv.i((.., .., 0..2))?,
            qkv.i((.., .., 2..4))?,
            qkv.i((.., .., 4..6))?,
        );
        let o = with_value_head_dim("flash_attn", &q, &k, &v, 0.125, |a, b, c| {
            assert!(!a.is_contiguous() && !b.is_contiguous() && !c.is_contiguous());
            Ok(a.clone())
        })?;
        assert_eq!(o.dims(), q.dims());
        // D_v < D_qk: q and k stay the caller's views, only v is copied (padded)
        let v = random(&[1, 4, 2, 32], 8);
        with_value_head_dim("flash_attn", &q, &k, &v, 0.125, |a, b, c| {
            assert!(!a.is_contiguous() && !b.is_contiguous());
            assert!(c.is_contiguous() && c.dim(3)? == 64);
            assert_eq!(
                c.i((.., .., .., 32..))?
                    .abs()?
                    .sum_all()?
                    .to_scalar::<f64>()?,
                0.0
            );
            Ok(a.clone())
        })?;
        Ok(())
    }

    #[test]
    fn bad_calls_name_the_problem() {
        let z = |s: &[usize]| Tensor::zeros(s, DType::BF16, &Device::Cpu).unwrap();
        let never = |_: &Tensor, _: &Tensor, _: &Tensor| -> Result<Tensor> { unreachable!() };
        let e = with_value_head_dim(
            "flash_attn",
            &z(&[1, 4, 2, 192]),
            &z(&[1, 4, 2, 192]),
            &z(&[1, 4, 2, 100]),
            0.1,
            never,
        )
        .unwrap_err();
        assert!(e.to_string().contains("value head dim 100"), "{e}");
        let e = with_value_head_dim(
            "flash_attn",
            &z(&[1, 4, 2, 264]),
            &z(&[1, 4, 2, 264]),
            &z(&[1, 4, 2, 128]),
            0.1,
            never,
        )
        .unwrap_err();
        assert!(e.to_string().contains("query/key head dim 264"), "{e}");
        let e = with_value_head_dim(
            "flash_attn",
            &z(&[1, 4, 2, 192]),
            &z(&[1, 4, 2, 192]),
            &z(&[1, 5, 2, 128]),
            0.1,
            never,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("v has k's shape but for its last dim"),
            "{e}"
        );
        let e = with_value_head_dim(
            "flash_attn_varlen",
            &z(&[4, 2, 128]),
            &z(&[4, 2, 192]),
            &z(&[4, 2, 64]),
            0.1,
            never,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("q and k share the query/key head dim"),
            "{e}"
        );
        let e = check_paged_caches(&z(&[2, 16, 1, 192]), &z(&[2, 16, 1, 128])).unwrap_err();
        assert!(
            e.to_string().contains("v has head dim 128 but k has 192"),
            "{e}"
        );
        assert!(check_paged_caches(&z(&[2, 16, 1, 128]), &z(&[2, 16, 1, 128])).is_ok());
    }
}
