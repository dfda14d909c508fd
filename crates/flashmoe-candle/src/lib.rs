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
//! Supported today:
//! - `flash_attn`, `flash_attn_windowed` and `flash_attn_alibi_windowed_softcap` (without
//!   slopes): flashmoe's prefill plan (`AttentionPlan`). No mask and causal on any GPU (the
//!   sm_90a kernel on Hopper for head dims 64/128, the portable kernel otherwise); sliding
//!   windows (e.g. Mistral's `(Some(4096), Some(0))`) and softcap (e.g. Gemma-2's 50) on the
//!   sm_90a kernel (compute capability 9.0, head dims 64 and 128, any number of rows), and on
//!   the portable kernel for the other head dims that are multiples of 8 up to 256 (above
//!   128 only where the device has Hopper's shared memory).
//! - The same dense calls with a window or softcap that the sm_90a kernel does not serve
//!   (head dim 256, or another GPU) when they are decode-shaped (seq_q <= 16, head dim
//!   64/128/256): `DecodePlan` over the dense cache.
//! - `flash_attn_varlen`, `flash_attn_varlen_windowed` and
//!   `flash_attn_varlen_alibi_windowed_softcap` (without slopes): packed sequences (q
//!   (total_q, heads_q, d), k/v (total_k, heads_kv, d), u32 cumulative `seqlens_q/k` of
//!   `batch + 1` elements), masks bottom-right per sequence, windows and softcap:
//!   `VarlenPlan` (sm_90a, head dim 64 or 128).
//! - `flash_attn_varlen_paged_windowed`: a paged K/V cache (num_blocks, page_block_size,
//!   heads_kv, d) with a (batch, max_blocks) u32/i32 block table, windows and softcap, for
//!   up to 16 query rows per sequence (decode and speculative steps): `DecodePlan`.
//!
//! - `flash_attn_alibi`, `flash_attn_alibi_windowed` and `flash_attn_alibi_windowed_softcap`
//!   with slopes (f32 `(num_heads_q)` or `(batch, num_heads_q)`; FlashAttention's bias
//!   `-slope · |i + seq_k - seq_q - j|` after the softcap): the prefill plan's portable
//!   kernel on every GPU, any mask and softcap, head dims that are multiples of 8 up to 256.
//!   The op struct [`FlashAttn`] carries candle-flash-attn's fields, `alibi_slopes`
//!   included, for code that builds the op itself.
//!
//! - `mla_decode`: DeepSeek-V2/V3 MLA decode over a paged latent cache (q (batch, seq_q,
//!   heads_q, 576), one latent KV head of 576 columns whose first 512 are the value, u32/i32
//!   block table and cache lengths, up to 16 query rows per sequence): `MlaDecodePlan`
//!   (`mla.rs`, which holds its own plan and workspace caches).
//!
//! - A value head dim other than the query/key one (v `(.., heads_kv, head_size_v)`, e.g.
//!   DeepSeek MLA prefill at 192/128) in the dense and varlen functions: output
//!   `(.., num_heads_q, head_size_v)`, run exactly on the kernels of head dim
//!   max(head_size, head_size_v) over zero-padded copies of v (or of q and k), by the
//!   library router's rule (`value_dim.rs`; both head dims multiples of 8 up to 256; the
//!   padded head dim goes where any call of it goes: varlen only at 64/128). Costs a padded
//!   copy, the padded product's FLOPs and, when v is padded, a copy of the output's first
//!   head_size_v columns. A paged V cache of its own head dim is an error (`mla_decode`
//!   serves MLA decode).
//!
//! Everything else (ALiBi with variable-length or paged batches, prefill-sized windows or
//! softcap at head dims above 128 off Hopper, chunked prefill on a paged
//! cache, `mm_prefix_ranges`) returns an error that names the feature and the kernels'
//! limits.
//!
//! Modules: `check` (candle's shape/dtype checks, then the library's call router
//! `flashmoe::attention::route` for the window, softcap and plan-cache key; GPU-free),
//! `cuda_fwd` (the `CustomOp3::cuda_fwd` body: candle storage → cudarc views),
//! `plans` (plans and workspaces cached per device/stream), `flashmoe_api` (the only
//! code that names flashmoe's attention API), `value_dim` (the padding of a value head dim
//! other than the query/key one).

pub mod check;
#[cfg(feature = "cuda")]
mod cuda_fwd;
#[cfg(feature = "cuda")]
mod cuda_index;
#[cfg(feature = "cuda")]
mod flashmoe_api;
mod mla;
#[cfg(feature = "cuda")]
mod plans;
mod value_dim;

pub use mla::mla_decode;

/// Drop every cached plan, device and workspace (their GPU memory is freed in stream
/// order). Later calls make them again.
#[cfg(feature = "cuda")]
pub fn clear_caches() {
    plans::clear();
    mla::clear_caches();
}

/// One `CustomOp3` boilerplate for the three ops: no CPU path, `cuda_fwd` in `cuda_fwd.rs`.
macro_rules! cuda_only_op {
    ($op:ty, $name:literal, $fwd:ident) => {
        impl candle_core::CustomOp3 for $op {
            fn name(&self) -> &'static str {
                $name
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
                cuda_fwd::$fwd(self, q, q_l, k, k_l, v, v_l)
            }
        }
    };
}

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};

/// Dense attention `softmax(Q Kᵀ · softmax_scale) V` as a candle op, with candle-flash-attn's
/// fields: `alibi_slopes` f32 `(num_heads_q)` or `(batch, num_heads_q)` on q's device (None:
/// no bias; with slopes the portable prefill kernel runs, [`flash_attn_alibi`]); the window
/// sizes `(None, Some(0))` causal, `(None, None)` no mask; `softcap` None or 0 off.
pub struct FlashAttn {
    pub softmax_scale: f32,
    pub alibi_slopes: Option<Tensor>,
    pub window_size_left: Option<usize>,
    pub window_size_right: Option<usize>,
    pub softcap: Option<f32>,
}

cuda_only_op!(FlashAttn, "flashmoe-flash-attn", forward);

/// Packed variable-length attention (`flash_attn_varlen*`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct FlashAttnVarlen {
    softmax_scale: f32,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    seqlens_q: Tensor,
    seqlens_k: Tensor,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: Option<f32>,
}

cuda_only_op!(FlashAttnVarlen, "flashmoe-flash-attn-varlen", varlen);

/// Packed queries against a paged K/V cache (`flash_attn_varlen_paged_windowed`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct FlashAttnPaged {
    softmax_scale: f32,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    seqlens_q: Tensor,
    seqlens_k: Tensor,
    block_table: Tensor,
    page_block_size: usize,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: Option<f32>,
}

cuda_only_op!(FlashAttnPaged, "flashmoe-flash-attn-paged", paged);

/// Flash attention: `softmax(Q Kᵀ · softmax_scale) V`, causal (bottom-right) or not.
///
/// * `q` - (batch, seq_len_q, num_heads_q, head_size)
/// * `k`, `v` - (batch, seq_len_kv, num_heads_kv, head_size), num_heads_kv dividing num_heads_q;
///   v may have a head size of its own (crate docs)
///
/// Returns (batch, seq_len_q, num_heads_q, head_size of v).
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_windowed(
        q,
        k,
        v,
        softmax_scale,
        None,
        if causal { Some(0) } else { None },
    )
}

/// Flash attention with candle-flash-attn's window arguments, around each query row's
/// bottom-right diagonal d = i + seq_len_kv - seq_len_q (row i sees keys
/// `d - window_size_left ..= d + window_size_right`; None is unbounded): `(None, Some(0))`
/// is causal, `(None, None)` and windows covering the whole sequence mask nothing (the
/// prefill plan on any GPU). Sliding windows (`(Some(4096), Some(0))` for Mistral) run on
/// the prefill plan's sm_90a kernel (Hopper, head dims 64 and 128); elsewhere on the decode
/// plan when the call is decode-shaped (seq_len_q <= 16, head dim 64/128/256); otherwise
/// they are an error naming the kernels' limits.
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
        alibi_slopes: None,
        window_size_left,
        window_size_right,
        softcap: None,
    };
    value_dim::with_value_head_dim("flash_attn", q, k, v, softmax_scale, |q, k, v| {
        q.apply_op3(k, v, op)
    })
}

/// Flash attention with ALiBi ([`flash_attn`] plus biases), FlashAttention's convention:
/// the logit of query i and key j gets `-alibi_slopes[h] · |i + seq_len_kv - seq_len_q - j|`
/// (after the softcap, for [`flash_attn_alibi_windowed_softcap`]).
///
/// * `alibi_slopes` - f32, `(num_heads_q)` or `(batch, num_heads_q)`, on q's device.
///
/// Runs on flashmoe's portable prefill kernel on every GPU (the sm_90a kernel has no ALiBi
/// yet), any number of query rows, head dims that are multiples of 8 up to 256.
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_alibi_windowed(
        q,
        k,
        v,
        alibi_slopes,
        softmax_scale,
        None,
        if causal { Some(0) } else { None },
    )
}

/// [`flash_attn_alibi`] with candle-flash-attn's window arguments ([`flash_attn_windowed`]):
/// every window, on the portable prefill kernel.
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let op = FlashAttn {
        softmax_scale,
        alibi_slopes: Some(alibi_slopes.clone()),
        window_size_left,
        window_size_right,
        softcap: None,
    };
    value_dim::with_value_head_dim("flash_attn_alibi", q, k, v, softmax_scale, |q, k, v| {
        q.apply_op3(k, v, op)
    })
}

/// Softcapped attention (`softcap · tanh(scores / softcap)` before the softmax; 0 is off)
/// with candle-flash-attn's windows ([`flash_attn_windowed`]). Without slopes, softcaps and
/// sliding windows run on the prefill plan's sm_90a kernel (Hopper, head dims 64 and 128),
/// and elsewhere when the call is decode-shaped (seq_len_q <= 16, head dim 64/128/256: the
/// decode plan). With slopes ([`flash_attn_alibi`]: the bias is added after the softcap),
/// the portable prefill kernel on every GPU.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let op = FlashAttn {
        softmax_scale,
        alibi_slopes: alibi_slopes.cloned(),
        window_size_left,
        window_size_right,
        softcap: Some(softcap),
    };
    value_dim::with_value_head_dim(
        "flash_attn_alibi_windowed_softcap",
        q,
        k,
        v,
        softmax_scale,
        |q, k, v| q.apply_op3(k, v, op),
    )
}

/// Variable-length (packed) attention, candle-flash-attn's `flash_attn_varlen`.
///
/// * `q` - (total_q, num_heads_q, head_size)
/// * `k`, `v` - (total_kv, num_heads_kv, head_size)
/// * `seqlens_q`, `seqlens_k` - u32 cumulative lengths, `batch_size + 1` elements
///   (`0, len_1, len_1 + len_2, ..`), on the GPU; read by the kernel as int32 (values must
///   stay below 2^31) and not checked on the host (no sync).
/// * `max_seqlen_q`, `max_seqlen_k` - the longest sequences (size the launch and resolve
///   windows).
///
/// Causal is bottom-right per sequence (query i of lengths (sq, sk) sees keys
/// j <= i + sk - sq), as in FlashAttention 2. Returns (total_q, num_heads_q, head_size).
/// Runs on flashmoe's sm_90a varlen kernel: head dims 64 and 128.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_varlen_windowed(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        if causal { Some(0) } else { None },
    )
}

/// [`flash_attn_varlen`] with candle-flash-attn's window arguments, around each query
/// row's bottom-right diagonal per sequence (as [`flash_attn_windowed`]); sides at least
/// `max_seqlen_q/k` long are unbounded. Sliding windows run on the sm_90a varlen kernel
/// like every varlen call (head dims 64 and 128).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let op = FlashAttnVarlen {
        softmax_scale,
        max_seqlen_q,
        max_seqlen_k,
        seqlens_q: seqlens_q.clone(),
        seqlens_k: seqlens_k.clone(),
        window_size_left,
        window_size_right,
        softcap: None,
    };
    value_dim::with_value_head_dim("flash_attn_varlen", q, k, v, softmax_scale, |q, k, v| {
        q.apply_op3(k, v, op)
    })
}

/// Packed queries against a paged K/V cache, candle-flash-attn's
/// `flash_attn_varlen_paged_windowed`.
///
/// * `q` - (total_q, num_heads_q, head_size)
/// * `k`, `v` - (num_blocks, page_block_size, num_heads_kv, head_size)
/// * `seqlens_q`, `seqlens_k` - u32 cumulative lengths, `batch_size + 1` elements; sequence b
///   has `seqlens_k[b+1] - seqlens_k[b]` keys, key j in block `block_table[b][j / page]`.
/// * `block_table` - (batch_size, max_blocks), u32 or i32, last dim contiguous.
/// * `mm_prefix_ranges` - not supported (must be None).
/// * `window_size_left/right` - as candle-flash-attn (None or beyond `max_seqlen_k`:
///   unbounded; `(None, Some(0))` causal), around each row's bottom-right diagonal.
/// * `softcap` - None or 0 is off.
///
/// Runs on flashmoe's decode kernels: at most 16 query rows per sequence
/// (`max_seqlen_q <= 16`: decode and speculative steps), head dims 64/128/256, pages of a
/// multiple of 16 keys. Per-sequence key counts are computed from `seqlens_k` on candle's
/// stream (a subtraction, clamped to `max_seqlen_k`). Returns (total_q, num_heads_q,
/// head_size).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    if mm_prefix_ranges.is_some() {
        return Err(check::unsupported(
            "mm_prefix_ranges (flash_attn_varlen_paged_windowed)",
        ));
    }
    value_dim::check_paged_caches(k, v)?;
    let op = FlashAttnPaged {
        softmax_scale,
        max_seqlen_q,
        max_seqlen_k,
        seqlens_q: seqlens_q.clone(),
        seqlens_k: seqlens_k.clone(),
        block_table: block_table.clone(),
        page_block_size,
        window_size_left,
        window_size_right,
        softcap,
    };
    q.apply_op3(k, v, op)
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

/// Softcapped variable-length attention (`softcap · tanh(scores / softcap)` before the
/// softmax; 0 is off) with candle-flash-attn's windows: [`flash_attn_varlen_windowed`] with
/// a softcap, on the sm_90a varlen kernel (head dims 64 and 128). ALiBi slopes are an error.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    if alibi_slopes.is_some() {
        return Err(check::unsupported(
            "ALiBi with variable-length batches (flash_attn_varlen_alibi_windowed_softcap)",
        ));
    }
    let op = FlashAttnVarlen {
        softmax_scale,
        max_seqlen_q,
        max_seqlen_k,
        seqlens_q: seqlens_q.clone(),
        seqlens_k: seqlens_k.clone(),
        window_size_left,
        window_size_right,
        softcap: Some(softcap),
    };
    value_dim::with_value_head_dim(
        "flash_attn_varlen_alibi_windowed_softcap",
        q,
        k,
        v,
        softmax_scale,
        |q, k, v| q.apply_op3(k, v, op),
    )
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
        let q = t((1, 4, 2, 64));
        let packed = Tensor::zeros((4, 2, 64), DType::BF16, &Device::Cpu).unwrap();
        let s = Tensor::zeros(3, DType::U32, &Device::Cpu).unwrap();
        let table = Tensor::zeros((2, 1), DType::U32, &Device::Cpu).unwrap();
        let slopes = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let e =
            flash_attn_varlen_alibi(&packed, &packed, &packed, &slopes, &s, &s, 2, 2, 0.1, true)
                .unwrap_err();
        assert!(e.to_string().contains("ALiBi"), "{e}");
        let e = flash_attn_varlen_alibi_windowed_softcap(
            &packed,
            &packed,
            &packed,
            Some(&slopes),
            &s,
            &s,
            2,
            2,
            0.1,
            None,
            None,
            30.0,
        )
        .unwrap_err();
        assert!(e.to_string().contains("ALiBi"), "{e}");
        let e = flash_attn_varlen_paged_windowed(
            &packed,
            &q,
            &q,
            &s,
            &s,
            &table,
            Some(&table),
            2,
            4,
            0.1,
            None,
            Some(0),
            4,
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("mm_prefix_ranges"), "{e}");
    }

    #[test]
    fn cpu_tensors_are_refused() {
        let (q, k, v) = (t((1, 4, 2, 64)), t((1, 4, 2, 64)), t((1, 4, 2, 64)));
        let e = flash_attn(&q, &k, &v, 0.125, false).unwrap_err();
        assert!(e.to_string().contains("no cpu support"), "{e}");
        // The newly routed entry points too (their checks run in cuda_fwd; check.rs tests
        // them directly).
        let packed = Tensor::zeros((4, 2, 64), DType::BF16, &Device::Cpu).unwrap();
        let s = Tensor::zeros(3, DType::U32, &Device::Cpu).unwrap();
        let e = flash_attn_varlen(&packed, &packed, &packed, &s, &s, 2, 2, 0.1, true).unwrap_err();
        assert!(e.to_string().contains("no cpu support"), "{e}");
        let e = flash_attn_alibi_windowed_softcap(&q, &k, &v, None, 0.1, None, Some(0), 30.0)
            .unwrap_err();
        assert!(e.to_string().contains("no cpu support"), "{e}");
        let e = flash_attn_windowed(&q, &k, &v, 0.1, Some(2), Some(0)).unwrap_err();
        assert!(e.to_string().contains("no cpu support"), "{e}");
        // Dense ALiBi is an op now (checks in cuda_fwd: check::check_alibi_call).
        let slopes = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let e = flash_attn_alibi(&q, &k, &v, &slopes, 0.125, true).unwrap_err();
        assert!(e.to_string().contains("no cpu support"), "{e}");
        let e =
            flash_attn_alibi_windowed(&q, &k, &v, &slopes, 0.125, Some(2), Some(0)).unwrap_err();
        assert!(e.to_string().contains("no cpu support"), "{e}");
        let e = flash_attn_alibi_windowed_softcap(&q, &k, &v, Some(&slopes), 0.1, None, None, 30.0)
            .unwrap_err();
        assert!(e.to_string().contains("no cpu support"), "{e}");
        let e = flash_attn_varlen_alibi_windowed_softcap(
            &packed,
            &packed,
            &packed,
            None,
            &s,
            &s,
            2,
            2,
            0.1,
            Some(1),
            Some(0),
            30.0,
        )
        .unwrap_err();
        assert!(e.to_string().contains("no cpu support"), "{e}");
    }
}
