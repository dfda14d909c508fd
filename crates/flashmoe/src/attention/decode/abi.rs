//! The kernel ABI of `kernels/attention/decode/decode_paged.cu`: its entries, launch constants and limits,
//! the defines of one build ([`DecodeKernel`]) and the parameter blocks of the two entries
//! (byte for byte the .cu's structs). Which build a class gets is in `select.rs`.

/// Kernel source of the two entries.
pub const DECODE_SOURCE: &str = "decode_paged.cu";
pub const DECODE_ENTRY: &str = "decode_paged_fwd";
pub const APPEND_ENTRY: &str = "decode_append_kv";

/// Threads per CTA of the decode kernel (4 warps) and keys per K/V tile (16 per warp).
pub const THREADS: u32 = 128;
pub const BLOCK_N: usize = 64;
/// Most query rows per sequence a class may declare.
pub const MAX_Q_PER_SEQ: usize = 16;
/// Most KV splits (bounds the workspace and the merge's loop).
pub const MAX_SPLITS: usize = 128;
/// Most (sequence, KV head, row block) groups of a split call: one arrival ticket each, at
/// the start of the workspace (a fixed place, so every call finds the tickets the last one
/// left zeroed).
pub const MAX_SPLIT_GROUPS: usize = 16_384;
pub(super) const TICKET_BYTES: usize = MAX_SPLIT_GROUPS * 4;
/// A split gets at least this many keys (4 tiles): shorter splits spend more on their
/// prologue and partial write than on reading K/V.
pub const MIN_KEYS_PER_SPLIT: usize = 256;
/// Head dims with a kernel.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The kernel build of a class: its defines and launch geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeKernel {
    pub head_dim: usize,
    pub bf16: bool,
    /// m16 tiles of packed rows per CTA (BM = 16 · mt).
    pub mt: usize,
    pub stages: usize,
    pub softcap: bool,
    /// ALiBi biases (`FM_ALIBI`): plans built by `DecodePlan::new_alibi`.
    pub alibi: bool,
}

impl DecodeKernel {
    pub fn block_m(&self) -> usize {
        16 * self.mt
    }
    /// Dynamic shared memory: 2 · PITCH · (BM + 2 · STAGES · BN) (the .cu's formula).
    pub fn shared_mem_bytes(&self) -> u32 {
        let pitch = match self.head_dim {
            d if d <= 64 => 64,
            d if d <= 128 => 128,
            _ => 256,
        };
        (2 * pitch * (self.block_m() + 2 * self.stages * BLOCK_N)) as u32
    }
    pub fn defines(&self) -> Vec<(String, String)> {
        [
            ("FM_HEAD_DIM", self.head_dim),
            ("FM_DTYPE_BF16", self.bf16 as usize),
            ("FM_MT", self.mt),
            ("FM_STAGES", self.stages),
            ("FM_SOFTCAP", self.softcap as usize),
            ("FM_ALIBI", self.alibi as usize),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }
}

/// Kernel parameters of `decode_paged_fwd` (the .cu's `DecodeParams`, 248 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct DecodeParams {
    pub(super) q: u64,
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) o: u64,
    pub(super) lse: u64,
    pub(super) block_table: u64,
    pub(super) seqused_k: u64,
    pub(super) o_part: u64,
    pub(super) lse_part: u64,
    pub(super) tickets: u64,
    pub(super) cu_seqlens_q: u64,
    pub(super) q_sb: i64,
    pub(super) q_ss: i64,
    pub(super) q_sh: i64,
    pub(super) k_sblk: i64,
    pub(super) k_srow: i64,
    pub(super) k_sh: i64,
    pub(super) v_sblk: i64,
    pub(super) v_srow: i64,
    pub(super) v_sh: i64,
    pub(super) bt_stride: i64,
    pub(super) batch: i32,
    pub(super) seqlen_q: i32,
    pub(super) heads_q: i32,
    pub(super) heads_kv: i32,
    pub(super) group: i32,
    pub(super) page_size: i32,
    pub(super) max_blocks: i32,
    pub(super) splits: i32,
    pub(super) m_blocks: i32,
    pub(super) window_left: i32,
    pub(super) window_right: i32,
    pub(super) scale_log2: f32,
    pub(super) softcap_log2: f32,
    pub(super) num_blocks: i32,
    pub(super) total_q: i32,
    /// ALiBi slopes (f32) or 0.
    pub(super) alibi: u64,
    /// Elements between two sequences' slopes (0: one vector for the batch).
    pub(super) alibi_bstride: i64,
}

/// `decode_append_kv`'s parameters (168 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct AppendParams {
    pub(super) k_new: u64,
    pub(super) v_new: u64,
    pub(super) k_cache: u64,
    pub(super) v_cache: u64,
    pub(super) block_table: u64,
    pub(super) seqused_k: u64,
    pub(super) kn_sb: i64,
    pub(super) kn_ss: i64,
    pub(super) kn_sh: i64,
    pub(super) vn_sb: i64,
    pub(super) vn_ss: i64,
    pub(super) vn_sh: i64,
    pub(super) k_sblk: i64,
    pub(super) k_srow: i64,
    pub(super) k_sh: i64,
    pub(super) v_sblk: i64,
    pub(super) v_srow: i64,
    pub(super) v_sh: i64,
    pub(super) bt_stride: i64,
    pub(super) heads_kv: i32,
    pub(super) page_size: i32,
    pub(super) max_blocks: i32,
    pub(super) num_blocks: i32,
}

const _: () = assert!(std::mem::size_of::<DecodeParams>() == 248);
const _: () = assert!(std::mem::size_of::<AppendParams>() == 168);
