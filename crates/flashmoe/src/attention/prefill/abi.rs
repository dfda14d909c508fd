//! The prefill kernels' ABI: every compiled variant's record ([`KernelVariant`]), the masking
//! and logit parameters, the sources and entries, the launch limits.
//!
//!
//! CONTRACT between the CUDA sources in `kernels/` and the launcher in `attention/mod.rs`
//! (keep both sides in agreement):
//!
//! `kernels/attention/prefill/flash_attn_fwd.cu`, entry `flash_attn_fwd` (extern "C"), compiled with the
//! defines of [`KernelVariant::defines`]; parameters in this order:
//! `(const u16* q, const u16* k, const u16* v, u16* o, float* lse,
//!   int seqlen_q, int seqlen_k, int heads_q, int heads_kv, float softmax_scale_log2
//!   [, int window_left, int window_right] [, float softcap_log2]
//!   [, const float* alibi_slopes, int alibi_batch_stride], FmStrides strides)`
//! where q/o are (batch, seqlen_q, heads_q, head_dim) and k/v (batch, seqlen_k, heads_kv,
//! head_dim), 16-bit elements (fp16 or bf16 per the define), with the element strides
//! (batch, seq, head) of each in `strides` (twelve i64 by value, multiples of 8; the
//! last dimension contiguous); lse is (batch, heads_q, seqlen_q) f32 contiguous, natural
//! log; softmax_scale_log2 = scale·log2(e). The bracketed parameters exist with
//! FM_WINDOW, FM_SOFTCAP and FM_ALIBI (the ALiBi route, [`select_v1_alibi`](super::select::select_v1_alibi)). The
//! reference kernel below takes the list up to the softcap (no ALiBi, no strides:
//! contiguous tensors).
//! Grid: (ceil(seqlen_q / block_m), heads_q, batch); block: (block_threads, 1, 1);
//! dynamic shared memory: shared_mem_bytes. Causal masking is bottom-right aligned
//! (query i sees keys j <= i + seqlen_k − seqlen_q). A query row with no visible key
//! writes O = 0 and LSE = −inf.
//! (Added by the kernel: q, k, v and o must be 16-byte aligned — the kernel moves 16-byte
//! chunks with cp.async and st.global.v4; buffers from cuMemAlloc are 256-byte aligned.
//! Dynamic shared memory above 48 KB needs CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
//! set to shared_mem_bytes before the launch.)
//!
//! `kernels/attention/prefill/flash_attn_fwd_sm90.cu`, entry `flash_attn_fwd_sm90` (Hopper, sm_90a only):
//! same layouts, masking and outputs, but q, k, v and o are passed as four TMA tensor maps
//! by value (see [`super::tma`]; o's box is 16 rows, one consumer warp's TMA store),
//! followed by o's address (`u16* o`, for the head dims whose epilogue stores O itself),
//! and an `int batch` follows `softmax_scale_log2`; the grid is
//! 1-D over work tiles ([`sm90_grid_x`](super::select::sm90_grid_x)) and the block is 128·(consumers + 1) threads with
//! block_m = 64·consumers ([`KernelAbi::TensorMaps`]). [`select`](super::select::select) picks it on compute
//! capability 9.0 for the head dims in [`SM90_HEAD_DIMS`](super::tiles::SM90_HEAD_DIMS), v1 everywhere else.
//!
//! `kernels/reference/attention_reference.cu`, entry `attention_reference` (extern "C"): the simple
//! fp32-accumulation GPU reference used by `check` for shapes too large for the CPU,
//! same parameter list but o is f32 (`float* o`), same layouts and masking.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use crate::dtype::DType;
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
    /// How the kernel takes Q/K/V: raw pointers (v1, reference) or TMA tensor maps
    /// (sm_90a kernel, which also runs only on compute capability 9.0 exactly).
    pub abi: KernelAbi,
}

/// Parameter convention of a kernel (the first three parameters; the rest is common).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelAbi {
    /// `(const u16* q, const u16* k, const u16* v, ...)`.
    Pointers,
    /// `(FmTensorMap tm_q, tm_k, tm_v, ..., float scale_log2, int batch)`, tensor maps by
    /// value (see [`super::tma`]) with q/k boxes of `block_m` / `block_n` rows, and a 1-D
    /// grid over work tiles ([`sm90_grid_x`](super::select::sm90_grid_x); `persistent`: at most one CTA per SM).
    /// Compiled for sm_90a: runs on compute capability 9.0 only. Its last parameter is a
    /// zeroed global-memory workspace of `workspace_bytes` ([`Sm90Tile::workspace_bytes`](super::tiles::Sm90Tile::workspace_bytes)).
    TensorMaps {
        block_n: u32,
        persistent: bool,
        workspace_bytes: usize,
    },
}

/// What a kernel variant is compiled to hide and transform in the scores: `FM_CAUSAL` (an
/// upper diagonal), `FM_WINDOW` (a sliding window's parameters) and `FM_SOFTCAP`. The values
/// (window sizes, softcap) are launch parameters ([`LogitParams`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Masking {
    /// Keys right of the (shifted) diagonal are hidden: `causal`, a bounded right side, or
    /// any window (whose unbounded right side is a shift past the last key).
    pub causal: bool,
    /// A window edge other than the causal diagonal: a bounded left side or right > 0.
    /// Implies `causal`.
    pub window: bool,
    pub softcap: bool,
}

impl Masking {
    /// Plain causal or full attention.
    pub const fn causal(causal: bool) -> Masking {
        Masking {
            causal,
            window: false,
            softcap: false,
        }
    }
    /// The variant a problem needs.
    pub fn of(p: &AttentionProblem) -> Masking {
        let window = p.has_window();
        Masking {
            causal: p.effective_window().1 >= 0 || window,
            window,
            softcap: p.softcap > 0.0,
        }
    }
    /// Every valid combination (for the compile tests).
    pub fn all() -> [Masking; 6] {
        let m = |causal, window, softcap| Masking {
            causal,
            window,
            softcap,
        };
        [
            m(false, false, false),
            m(true, false, false),
            m(true, true, false),
            m(false, false, true),
            m(true, false, true),
            m(true, true, true),
        ]
    }
}

/// The scalar launch parameters of the scores' transforms, shared by the sm_90a and the
/// reference kernels (their ABI notes): `scale_log2` is the kernel's softmax-scale
/// parameter (scale · log2 e, or with a softcap scale / softcap, the tanh's argument
/// factor), `softcap_log2` = softcap · log2 e, and the window's sides as the kernels take
/// them: >= 0, [`WINDOW_UNBOUNDED`] for an unbounded side.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitParams {
    pub scale_log2: f32,
    pub softcap_log2: f32,
    pub window_left: i32,
    pub window_right: i32,
}

/// A window side of at least the sequence's length is unbounded; the kernels clamp the
/// sides to the lengths, so this stands for "unbounded" at any length.
pub const WINDOW_UNBOUNDED: i32 = 1 << 30;

impl LogitParams {
    pub fn of(p: &AttentionProblem) -> LogitParams {
        let scale = p.scale();
        let (scale_log2, softcap_log2) = if p.softcap > 0.0 {
            (scale / p.softcap, p.softcap * std::f32::consts::LOG2_E)
        } else {
            (scale * std::f32::consts::LOG2_E, 0.0)
        };
        let side = |w: i32| {
            if w < 0 {
                WINDOW_UNBOUNDED
            } else {
                w.min(WINDOW_UNBOUNDED)
            }
        };
        let (left, right) = p.effective_window();
        LogitParams {
            scale_log2,
            softcap_log2,
            window_left: side(left),
            window_right: side(right),
        }
    }
}

/// File and entry point of the v1 (portable, mma.sync) flash kernel.
pub const FLASH_SOURCE: &str = "flash_attn_fwd.cu";
pub const FLASH_ENTRY: &str = "flash_attn_fwd";
/// File and entry point of the fp32 GPU reference kernel (embedded with the `lab` feature
/// only: `kernels/reference/`).
#[cfg(feature = "lab")]
pub const REFERENCE_SOURCE: &str = "attention_reference.cu";
pub const REFERENCE_ENTRY: &str = "attention_reference";

/// Head dims of the v1 kernel's tile table (one tuned configuration each, see [`v1_tile`](super::tiles::v1_tile)).
/// The kernel serves every multiple of 8 up to 256 ([`v1_serves`]): other head dims take
/// the tile of the next table entry.
pub const V1_HEAD_DIMS: [usize; 5] = [32, 64, 96, 128, 256];
/// Largest head dim of the v1 kernel.
pub const V1_MAX_HEAD_DIM: usize = 256;
/// The head dims of the v1 kernel, in words (error messages).
pub const V1_HEAD_DIMS_TEXT: &str = "multiples of 8 up to 256";

/// Whether the v1 kernel serves head dim `d`: a multiple of 8 in 8..=256 (the MMAs run over
/// d rounded up to 16, see flash_attn_fwd.cu).
pub const fn v1_serves(d: usize) -> bool {
    d >= 8 && d % 8 == 0 && d <= V1_MAX_HEAD_DIM
}
/// The reference kernel serves every head dim from 1 to this.
#[cfg(feature = "lab")]
pub const REFERENCE_MAX_HEAD_DIM: usize = 256;
/// Rows per block of the reference kernel (one warp per query row; 1 keeps the key loop
/// block-uniform, see the .cu).
#[cfg(feature = "lab")]
pub const REFERENCE_BLOCK_M: u32 = 1;
/// Largest dynamic shared memory a block may opt into on sm_80 (A100: 163 KB) is smaller
/// than on sm_90 (227 KB = 232448 bytes); every v1 variant must fit the sm_90 limit, and
/// [`KernelVariant::min_arch`] is raised to 90 for a variant that does not fit sm_80's.
pub const MAX_SMEM_SM90: u32 = 227 * 1024;
pub const MAX_SMEM_SM80: u32 = 163 * 1024;
/// CUDA limit on grid.y (heads_q) and grid.z (batch).
pub const MAX_GRID_YZ: usize = 65_535;
/// Sequence lengths are passed to the kernels as `int`; keep a margin for `m0 + BLOCK_M`.
pub const MAX_SEQLEN: usize = (i32::MAX as usize) - 1024;

/// File and entry point of the Hopper (sm_90a: wgmma, TMA, warp specialisation) kernel.
pub const SM90_SOURCE: &str = "flash_attn_fwd_sm90.cu";
pub const SM90_ENTRY: &str = "flash_attn_fwd_sm90";
impl KernelVariant {
    /// Whether the variant can run on a device of architecture `arch`; Err says why not.
    pub fn runs_on(&self, arch: u32) -> std::result::Result<(), String> {
        if arch < self.min_arch {
            return Err(format!(
                "needs compute capability {}.{} or newer",
                self.min_arch / 10,
                self.min_arch % 10
            ));
        }
        if matches!(self.abi, KernelAbi::TensorMaps { .. }) && arch != 90 {
            return Err("is compiled for sm_90a and runs on compute capability 9.0 only".into());
        }
        Ok(())
    }
}
impl KernelVariant {
    /// Value of a define, if present.
    pub fn define(&self, name: &str) -> Option<&str> {
        self.defines
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// NVRTC options `-DNAME=VALUE` for the defines.
    pub fn define_options(&self) -> Vec<String> {
        self.defines
            .iter()
            .map(|(k, v)| format!("-D{k}={v}"))
            .collect()
    }

    /// Grid for a problem: (ceil(seqlen_q / block_m), heads_q, batch).
    pub fn grid(&self, problem: &AttentionProblem) -> (u32, u32, u32) {
        (
            problem.seqlen_q.div_ceil(self.block_m as usize) as u32,
            problem.heads_q as u32,
            problem.batch as u32,
        )
    }
}

/// The defines every attention kernel (v1, sm_90a, reference) takes from the problem:
/// head dim, storage type and masking (FM_WINDOW and FM_SOFTCAP only where set, so the
/// plain variants keep their define lists); each kernel appends its tile's.
pub(crate) fn problem_defines(head_dim: u32, dtype: DType, m: Masking) -> Vec<(String, String)> {
    let mut d = vec![
        ("FM_HEAD_DIM".to_string(), head_dim.to_string()),
        (
            "FM_DTYPE_BF16".to_string(),
            ((dtype == DType::Bf16) as u32).to_string(),
        ),
        ("FM_CAUSAL".to_string(), (m.causal as u32).to_string()),
    ];
    if m.window {
        d.push(("FM_WINDOW".to_string(), "1".to_string()));
    }
    if m.softcap {
        d.push(("FM_SOFTCAP".to_string(), "1".to_string()));
    }
    d
}
