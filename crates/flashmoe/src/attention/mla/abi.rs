//! The MLA decode kernels' ABI: the source and its entries, the widths and launch
//! constants, and the two kernels' parameter blocks (`MlaParams`, `CombineParams`).

use crate::error::{Error, Result};

/// Kernel source and its two entries.
pub const MLA_SOURCE: &str = "mla_decode.cu";
pub const MLA_ENTRY: &str = "mla_decode_fwd";
pub const COMBINE_ENTRY: &str = "mla_decode_combine";

/// Query/key width (latent 512 + rotary 64) and value/output width (the latent).
pub const D_QK: usize = 576;
pub const D_V: usize = 512;
/// Packed query rows (heads × Sq) per CTA and threads per CTA (8 warps).
pub const BLOCK_M: usize = 64;
pub const THREADS: u32 = 256;
/// Threads of the split merge (one CTA per output row, 4 columns a thread).
pub const COMBINE_THREADS: u32 = 128;
/// Most query rows per sequence a class may declare.
pub const MAX_Q_PER_SEQ: usize = 16;
/// Most KV splits (the merge's shared array; the .cu's MAX_SPLITS).
pub const MAX_SPLITS: usize = 64;
/// A split gets at least this many keys: shorter ones spend more on the prologue and the
/// partial write than on reading the cache.
pub const MIN_KEYS_PER_SPLIT: usize = 256;

/// `mla_decode_fwd`'s parameters (the .cu's `MlaParams`, 152 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct MlaParams {
    pub(super) q: u64,
    pub(super) kv: u64,
    pub(super) o: u64,
    pub(super) lse: u64,
    pub(super) block_table: u64,
    pub(super) seqused_k: u64,
    pub(super) o_part: u64,
    pub(super) lse_part: u64,
    pub(super) q_sb: i64,
    pub(super) q_ss: i64,
    pub(super) q_sh: i64,
    pub(super) kv_sblk: i64,
    pub(super) kv_srow: i64,
    pub(super) bt_stride: i64,
    pub(super) batch: i32,
    pub(super) seqlen_q: i32,
    pub(super) heads_q: i32,
    pub(super) page_size: i32,
    pub(super) max_blocks: i32,
    pub(super) num_blocks: i32,
    pub(super) splits: i32,
    pub(super) m_blocks: i32,
    pub(super) scale_log2: f32,
    pub(super) pad: i32,
}

/// `mla_decode_combine`'s parameters (40 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CombineParams {
    pub(super) o_part: u64,
    pub(super) lse_part: u64,
    pub(super) o: u64,
    pub(super) lse: u64,
    pub(super) rows: i32,
    pub(super) splits: i32,
}

const _: () = assert!(std::mem::size_of::<MlaParams>() == 152);
const _: () = assert!(std::mem::size_of::<CombineParams>() == 40);

pub(super) fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::unsupported(
            MLA_ENTRY,
            format!("{what} = {v} does not fit the kernel's 32-bit int"),
        )
    })
}
