//! flashmoe-candle: candle-flash-attn's functions, same names and signatures, running
//! flashmoe's attention kernels (compiled at run time by NVRTC, so no nvcc build of our
//! own kernels). Swap `use candle_flash_attn::flash_attn;` for
//! `use flashmoe_candle::flash_attn;`.
//!
//! Layout as in candle-flash-attn: q is (batch, seq_q, heads_q, head_dim), k and v are
//! (batch, seq_k, heads_kv, head_dim) with heads_kv dividing heads_q (GQA / MQA), any
//! strides with a contiguous last dim; the output has q's shape, contiguous. bf16 or f16.
//! Causal masking is bottom-right aligned.
//!
//! Supported today: no mask and causal (`flash_attn`, and `flash_attn_windowed` with
//! windows that amount to those). ALiBi, softcapping, sliding windows, variable-length and
//! paged batches return an error that names the missing feature.
//!
//! Modules: `check` (shape/dtype/window checks and the plan-cache key, GPU-free),
//! `cuda_fwd` (the `CustomOp3::cuda_fwd` body: candle storage → cudarc views),
//! `plans` (plans and workspaces cached per device/stream), `flashmoe_api` (the only
//! code that names flashmoe's attention API).

pub mod check;
#[cfg(feature = "cuda")]
mod cuda_fwd;
#[cfg(feature = "cuda")]
mod flashmoe_api;
#[cfg(feature = "cuda")]
mod plans;

#[cfg(feature = "cuda")]
pub use plans::clear_caches;

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};

/// Dense attention `softmax(Q Kᵀ · softmax_scale) V` as a candle op. The window sizes
/// follow candle-flash-attn: `(None, Some(0))` is causal, `(None, None)` no mask.
pub struct FlashAttn {
    pub softmax_scale: f32,
    pub window_size_left: Option<usize>,
    pub window_size_right: Option<usize>,
}

impl candle_core::CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flashmoe-flash-attn"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("no cpu support for flash-attn")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda_fwd::forward(self, q, q_l, k, k_l, v, v_l)
    }
}

/// Flash attention: `softmax(Q Kᵀ · softmax_scale) V`, causal (bottom-right) or not.
///
/// * `q` - (batch, seq_len_q, num_heads_q, head_size)
/// * `k`, `v` - (batch, seq_len_kv, num_heads_kv, head_size), num_heads_kv dividing num_heads_q
///
/// Returns (batch, seq_len_q, num_heads_q, head_size).
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let op = FlashAttn {
        softmax_scale,
        window_size_left: None,
        window_size_right: if causal { Some(0) } else { None },
    };
    q.apply_op3(k, v, op)
}

/// Flash attention with candle-flash-attn's window arguments. Only windows that amount to
/// no mask or a causal mask are supported: `(None, Some(0))` is causal, `(None, None)` and
/// windows covering the whole sequence mask nothing; anything narrower is an error.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let op = FlashAttn {
        softmax_scale,
        window_size_left,
        window_size_right,
    };
    q.apply_op3(k, v, op)
}

/// Not supported yet: returns an error (ALiBi biases).
pub fn flash_attn_alibi(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _alibi_slopes: &Tensor,
    _softmax_scale: f32,
    _causal: bool,
) -> Result<Tensor> {
    Err(check::unsupported("ALiBi (flash_attn_alibi)"))
}

/// Not supported yet: returns an error (ALiBi biases).
pub fn flash_attn_alibi_windowed(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _alibi_slopes: &Tensor,
    _softmax_scale: f32,
    _window_size_left: Option<usize>,
    _window_size_right: Option<usize>,
) -> Result<Tensor> {
    Err(check::unsupported("ALiBi (flash_attn_alibi_windowed)"))
}

/// Not supported yet: returns an error (softcapping; ALiBi).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _alibi_slopes: Option<&Tensor>,
    _softmax_scale: f32,
    _window_size_left: Option<usize>,
    _window_size_right: Option<usize>,
    _softcap: f32,
) -> Result<Tensor> {
    Err(check::unsupported(
        "softcapping (flash_attn_alibi_windowed_softcap)",
    ))
}

/// Not supported yet: returns an error (variable-length batches).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _seqlens_q: &Tensor,
    _seqlens_k: &Tensor,
    _max_seqlen_q: usize,
    _max_seqlen_k: usize,
    _softmax_scale: f32,
    _causal: bool,
) -> Result<Tensor> {
    Err(check::unsupported(
        "variable-length batches (flash_attn_varlen)",
    ))
}

/// Not supported yet: returns an error (variable-length batches).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _seqlens_q: &Tensor,
    _seqlens_k: &Tensor,
    _max_seqlen_q: usize,
    _max_seqlen_k: usize,
    _softmax_scale: f32,
    _window_size_left: Option<usize>,
    _window_size_right: Option<usize>,
) -> Result<Tensor> {
    Err(check::unsupported(
        "variable-length batches (flash_attn_varlen_windowed)",
    ))
}

/// Not supported yet: returns an error (paged KV; variable-length batches).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _seqlens_q: &Tensor,
    _seqlens_k: &Tensor,
    _block_table: &Tensor,
    _mm_prefix_ranges: Option<&Tensor>,
    _max_seqlen_q: usize,
    _max_seqlen_k: usize,
    _softmax_scale: f32,
    _window_size_left: Option<usize>,
    _window_size_right: Option<usize>,
    _page_block_size: usize,
    _softcap: Option<f32>,
) -> Result<Tensor> {
    Err(check::unsupported(
        "paged KV (flash_attn_varlen_paged_windowed)",
    ))
}

/// Not supported yet: returns an error (ALiBi; variable-length batches).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _alibi_slopes: &Tensor,
    _seqlens_q: &Tensor,
    _seqlens_k: &Tensor,
    _max_seqlen_q: usize,
    _max_seqlen_k: usize,
    _softmax_scale: f32,
    _causal: bool,
) -> Result<Tensor> {
    Err(check::unsupported(
        "ALiBi with variable-length batches (flash_attn_varlen_alibi)",
    ))
}

/// Not supported yet: returns an error (ALiBi; variable-length batches).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _alibi_slopes: &Tensor,
    _seqlens_q: &Tensor,
    _seqlens_k: &Tensor,
    _max_seqlen_q: usize,
    _max_seqlen_k: usize,
    _softmax_scale: f32,
    _window_size_left: Option<usize>,
    _window_size_right: Option<usize>,
) -> Result<Tensor> {
    Err(check::unsupported(
        "ALiBi with variable-length batches (flash_attn_varlen_alibi_windowed)",
    ))
}

/// Not supported yet: returns an error (softcapping; variable-length batches).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _alibi_slopes: Option<&Tensor>,
    _seqlens_q: &Tensor,
    _seqlens_k: &Tensor,
    _max_seqlen_q: usize,
    _max_seqlen_k: usize,
    _softmax_scale: f32,
    _window_size_left: Option<usize>,
    _window_size_right: Option<usize>,
    _softcap: f32,
) -> Result<Tensor> {
    Err(check::unsupported(
        "softcapping with variable-length batches (flash_attn_varlen_alibi_windowed_softcap)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn t(shape: (usize, usize, usize, usize)) -> Tensor {
        Tensor::zeros(shape, DType::BF16, &Device::Cpu).unwrap()
    }

    #[test]
    fn unsupported_entry_points_say_what_is_missing() {
        let (q, k, v) = (t((1, 4, 2, 64)), t((1, 4, 2, 64)), t((1, 4, 2, 64)));
        let s = Tensor::zeros(3, DType::U32, &Device::Cpu).unwrap();
        let slopes = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let e = flash_attn_varlen(&q, &k, &v, &s, &s, 4, 4, 0.125, true).unwrap_err();
        assert!(e.to_string().contains("variable-length"), "{e}");
        let e = flash_attn_alibi(&q, &k, &v, &slopes, 0.125, false).unwrap_err();
        assert!(e.to_string().contains("ALiBi"), "{e}");
        let e =
            flash_attn_alibi_windowed_softcap(&q, &k, &v, None, 0.1, None, None, 30.0).unwrap_err();
        assert!(e.to_string().contains("softcapping"), "{e}");
    }

    #[test]
    fn cpu_tensors_are_refused() {
        let (q, k, v) = (t((1, 4, 2, 64)), t((1, 4, 2, 64)), t((1, 4, 2, 64)));
        let e = flash_attn(&q, &k, &v, 0.125, false).unwrap_err();
        assert!(e.to_string().contains("no cpu support"), "{e}");
    }
}
