//! Which compiled kernel variant serves an attention problem, with its launch geometry.
//!
//! CONTRACT between the CUDA sources in `kernels/` and the launcher in `attention/mod.rs`
//! (keep both sides in agreement):
//!
//! `kernels/flash_attn_fwd.cu`, entry `flash_attn_fwd` (extern "C"), compiled with the
//! defines of [`KernelVariant::defines`]; parameters in this order:
//! `(const u16* q, const u16* k, const u16* v, u16* o, float* lse,
//!   int seqlen_q, int seqlen_k, int heads_q, int heads_kv, float softmax_scale_log2)`
//! where q/o are (batch, seqlen_q, heads_q, head_dim) and k/v (batch, seqlen_k, heads_kv,
//! head_dim), contiguous, 16-bit elements (fp16 or bf16 per the define); lse is
//! (batch, heads_q, seqlen_q) f32, natural log; softmax_scale_log2 = scale·log2(e).
//! Grid: (ceil(seqlen_q / block_m), heads_q, batch); block: (block_threads, 1, 1);
//! dynamic shared memory: shared_mem_bytes. Causal masking is bottom-right aligned
//! (query i sees keys j <= i + seqlen_k − seqlen_q). A query row with no visible key
//! writes O = 0 and LSE = −inf.
//!
//! `kernels/attention_reference.cu`, entry `attention_reference` (extern "C"): the simple
//! fp32-accumulation GPU reference used by `check` for shapes too large for the CPU,
//! same parameter list but o is f32 (`float* o`), same layouts and masking.

use crate::error::Result;
use crate::problem::AttentionProblem;

/// One compiled kernel and how to launch it.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelVariant {
    /// File name under `kernels/`, e.g. "flash_attn_fwd.cu".
    pub source_file: &'static str,
    /// extern "C" entry point.
    pub entry: &'static str,
    /// Preprocessor defines passed to NVRTC as `-DNAME=VALUE`.
    pub defines: Vec<(String, String)>,
    /// Query rows per thread block (grid.x = ceil(seqlen_q / block_m)).
    pub block_m: u32,
    pub block_threads: u32,
    pub shared_mem_bytes: u32,
    /// Oldest architecture (compute capability ×10) the variant runs on, e.g. 80.
    pub min_arch: u32,
}

/// The v1 (mma.sync, sm_80+) kernel variant for a problem, or `Error::Unsupported`
/// naming the head dim / dtype that is not served.
pub fn select_v1(_problem: &AttentionProblem) -> Result<KernelVariant> {
    Err(crate::error::Error::unsupported(
        "flash-v1",
        "kernel variants not defined yet",
    ))
}

/// Every v1 variant that can be selected (for the compile-everything test).
pub fn all_v1_variants() -> Vec<KernelVariant> {
    Vec::new()
}

/// The GPU reference kernel variant for a problem.
pub fn select_reference(_problem: &AttentionProblem) -> Result<KernelVariant> {
    Err(crate::error::Error::unsupported(
        "gpu-reference",
        "kernel variants not defined yet",
    ))
}

/// Every reference variant (for the compile test).
pub fn all_reference_variants() -> Vec<KernelVariant> {
    Vec::new()
}
