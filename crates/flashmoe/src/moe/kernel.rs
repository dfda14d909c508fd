//! The record every MoE kernel is described by ([`MoeKernel`]: source, entry, defines,
//! tile and launch shape) and the names shared by the selection modules. A leaf module:
//! [`super::forward::select`], [`super::gemm::tiles`] and [`super::gemm::sm90`] all build on it, and
//! it imports none of them.

/// Backend name used in errors.
pub const BACKEND: &str = "flashmoe-moe";

/// The permutation kernels' source (also home of the sm_90 path's row gather).
pub const PERMUTE_SOURCE: &str = "moe_permute.cu";

/// One compiled kernel and how to launch it (same shape as the attention variants).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeKernel {
    pub source_file: &'static str,
    pub entry: &'static str,
    pub defines: Vec<(String, String)>,
    /// Rows per block for the grouped GEMMs (1 for the other kernels).
    pub block_m: u32,
    /// Output columns per block for the grouped GEMMs.
    pub block_n: u32,
    pub block_threads: u32,
    pub shared_mem_bytes: u32,
    pub min_arch: u32,
}
