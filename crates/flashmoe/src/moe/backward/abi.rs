//! The backward kernels' ABI: the source and its entries, the GEMM tile and block sizes, the
//! defines, and one launch's parameters per kernel ([`Step`]).

use crate::dtype::DType;
use crate::error::{Error, Result};
use cudarc::driver::LaunchConfig;

/// The backward's kernel source.
pub const BWD_SOURCE: &str = "moe_backward.cu";

/// Its entries, in the order [`MoeBackwardPlan`](super::MoeBackwardPlan) loads them.
pub const BWD_ENTRIES: [&str; 8] = [
    "moe_bwd_gemm_rows",
    "moe_bwd_gemm_wgrad",
    "moe_bwd_swiglu",
    "moe_bwd_router_dz",
    "moe_bwd_router_dw",
    "moe_bwd_unpermute",
    "moe_bwd_router_dw_sum",
    "moe_bwd_swiglu_saved",
];

/// GEMM tile of the kernels (GB_BM, GB_BN in the source), their block size and dynamic
/// shared memory: GB_SMEM_BYTES (rows GEMM: 3 stages of two 128 × 64 16-bit tiles) and
/// WG_SMEM_BYTES (weight-gradient GEMM: 4 stages of two 32 × 128 tiles).
pub(super) const TILE: u32 = 128;
pub(super) const GEMM_THREADS: u32 = 256;
pub(super) const ROWS_SMEM_BYTES: u32 = 3 * 2 * 128 * 64 * 2;
pub(super) const WGRAD_SMEM_BYTES: u32 = 4 * 2 * 128 * 32 * 2;
pub(super) const SWIGLU_THREADS: u32 = 128;
pub(super) const ELEM_THREADS: u32 = 256;
pub(super) const PLAN: &str = "MoeBackwardPlan";

/// The defines of the backward source for `dtype` (one compile per dtype).
pub fn bwd_defines(dtype: DType) -> Result<Vec<(String, String)>> {
    let bf16 = match dtype {
        DType::Bf16 => "1",
        DType::F16 => "0",
        DType::F32 => {
            return Err(Error::unsupported(
                PLAN,
                "the MoE backward takes bf16 or fp16 tensors, not f32",
            ))
        }
    };
    Ok(vec![("FM_DTYPE_BF16".to_string(), bf16.to_string())])
}

/// Parameters of one grouped GEMM over rows (kernel `moe_bwd_gemm_rows`).
pub(super) struct RowsGemm {
    pub(super) a: u64,
    pub(super) a_rs: i32,
    pub(super) a_gather: i32,
    pub(super) b: u64,
    pub(super) b_gs: i64,
    pub(super) b_ks: i32,
    pub(super) b_ns: i32,
    pub(super) c: u64,
    pub(super) ldc: i32,
    pub(super) row_token: u64,
    pub(super) offsets: u64,
    pub(super) groups: i32,
    pub(super) total_rows: i32,
    pub(super) n_cols: i32,
    pub(super) k_dim: i32,
}

/// Parameters of one weight-gradient grouped GEMM (kernel `moe_bwd_gemm_wgrad`).
pub(super) struct WgradGemm {
    pub(super) a: u64,
    pub(super) a_rs: i32,
    pub(super) a_gather: i32,
    pub(super) b: u64,
    pub(super) b_rs: i32,
    pub(super) b_gather: i32,
    pub(super) c: u64,
    pub(super) m_dim: i32,
    pub(super) n_cols: i32,
    pub(super) row_token: u64,
    pub(super) offsets: u64,
    pub(super) total_rows: i32,
    pub(super) groups: u32,
}

/// Parameters of one sm_90a row GEMM (`moe_gemm2_sm90`, [`super::sm90`]): per expert e,
/// `c[r][j] = Σ_k a[r][k] · B_e[k][j]` for its rows `offsets[e]..offsets[e + 1]` of the
/// dense `a` (`rows` × `k`, 16-bit), f32 `c` (`rows` × `n`). B_e is `b + e·k·n`, laid out
/// `[k][n]`, or `[n][k]` when `b_kmajor`.
pub(super) struct Sm90Rows {
    pub(super) a: u64,
    pub(super) b: u64,
    pub(super) b_kmajor: bool,
    pub(super) c: u64,
    pub(super) offsets: u64,
    pub(super) rows: usize,
    pub(super) experts: usize,
    pub(super) n: usize,
    pub(super) k: usize,
}

/// Parameters of one sm_90a weight gradient (`moe_wgrad_sm90`, [`super::sm90`]): per
/// expert e, `dw[e][i][j] = Σ_r a[r][i] · b[r][j]` over its rows `offsets[e]..offsets[e + 1]`
/// of the dense 16-bit `a` (`rows` × `m`) and `b` (`rows` × `n`); dw `[E][m][n]` 16-bit.
pub(super) struct Sm90Wgrad {
    pub(super) a: u64,
    pub(super) b: u64,
    pub(super) dw: u64,
    pub(super) offsets: u64,
    pub(super) rows: usize,
    pub(super) experts: usize,
    pub(super) m: usize,
    pub(super) n: usize,
}

pub(super) fn ceil(a: usize, b: u32) -> u32 {
    a.div_ceil(b as usize) as u32
}

pub(super) fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::invalid(format!(
            "the MoE backward's {what} ({v}) exceeds the kernels' 32-bit index range"
        ))
    })
}

/// One kernel launch of the backward and its parameters: [`MoeBackwardPlan::backward_raw`]
/// enqueues it; the CPU model of the kernels in the tests interprets it.
pub(super) enum Step {
    Rows(RowsGemm),
    /// `dst[r] = src[row_token[r]]`, `rows` rows of `cols` 16-bit elements
    /// (`moe_gather_rows`, the sm_90a path's dense A operands).
    Gather {
        src: u64,
        row_token: u64,
        dst: u64,
        rows: usize,
        cols: usize,
    },
    Sm90Rows(Sm90Rows),
    Sm90Wgrad(Sm90Wgrad),
    Wgrad(WgradGemm),
    /// `ptrs` = gu, G, slot_row (0: identity), topk_w (0: w = 1), dgu, wh, dw (0: none);
    /// `saved_gu`: gu is the forward's 16-bit gate_up (`moe_bwd_swiglu_saved`), else the
    /// recomputed f32 one.
    Swiglu {
        slots: usize,
        ptrs: [u64; 7],
        inter: i32,
        saved_gu: bool,
    },
    /// (logits, ids, topk_w, dw, counts, d_losses, dz), (tokens, experts, top_k, sigmoid,
    /// renormalize).
    RouterDz([u64; 7], [i32; 5]),
    /// (x, dz, part), (tokens, hidden, experts, chunk tokens, chunks): d_router's partial
    /// sums per chunk of tokens.
    RouterDw([u64; 3], [i32; 5]),
    /// (part, d_router), (chunks, hidden · experts): the chunks summed in order.
    RouterDwSum([u64; 2], [i32; 2]),
    /// (dx_perm, slot_row, dx_shared (0: none), dz, router, dx), (tokens, hidden, experts,
    /// top_k).
    Unpermute([u64; 6], [i32; 4]),
}

impl Step {
    #[cfg(feature = "lab")]
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Step::Rows(_) => "rows",
            Step::Gather { .. } => "gather",
            Step::Sm90Rows(_) => "rows_sm90",
            Step::Sm90Wgrad(_) => "wgrad_sm90",
            Step::Wgrad(_) => "wgrad",
            Step::Swiglu { .. } => "swiglu",
            Step::RouterDz(..) => "router_dz",
            Step::RouterDw(..) => "router_dw",
            Step::RouterDwSum(..) => "router_dw_sum",
            Step::Unpermute(..) => "unpermute",
        }
    }
}

pub(super) fn elem_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (ceil(n, ELEM_THREADS).max(1), 1, 1),
        block_dim: (ELEM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}
