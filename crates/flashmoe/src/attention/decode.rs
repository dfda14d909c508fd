//! Paged-KV decode attention: `Sq = 1..16` query rows per sequence (decode and speculative
//! decoding) against a paged K/V cache, with GQA packing, KV splits, sliding windows and
//! logit softcap. Kernels: `kernels/decode_paged.cu`.
//!
//! Shape of the API (as [`super::AttentionPlan`]): [`DecodePlan::new`] compiles once per
//! [`DecodeClass`]; [`DecodePlan::forward_raw`] / [`DecodePlan::append_kv_raw`] do O(1)
//! checks and enqueue on the caller's stream over the caller's memory with no allocation,
//! synchronisation, compile or environment access (CUDA-graph capturable);
//! [`DecodePlan::forward`] / [`DecodePlan::append_kv`] are the cudarc (candle storage)
//! wrappers.
//!
//! Layouts: q `[B, Sq, Hq, D]` (strided views allowed, strides multiples of 8 elements);
//! k/v caches `[num_blocks, page_size, Hkv, D]` (strides allowed on every dimension but the
//! last, multiples of 8); `block_table` int32 `[B, max_blocks]` (row stride allowed);
//! `seqused_k` int32 `[B]`; o `[B, Sq, Hq, D]` and lse f32 `[B, Hq, Sq]` (natural log),
//! contiguous. Key `j` of sequence `b` is row `j % page_size` of block
//! `block_table[b][j / page_size]`.
//!
//! Mixed batches (decode, speculative and chunked-prefill rows in one call, as
//! FlashAttention's `cu_seqlens_q`): with [`DecodeArgs::cu_seqlens_q`] = int32 `[B + 1]`
//! offsets, sequence `b` has the `Sq_b = cu[b+1] - cu[b]` rows `cu[b] .. cu[b+1]` (0 to
//! `max_q_per_seq` each) of a packed q `[total_q, Hq, D]` (strided rows allowed); o is
//! `[total_q, Hq, D]` and lse `[Hq, total_q]`, contiguous. The batch is the table's rows.
//! Through [`DecodePlan::forward_raw`] (the cudarc wrapper takes the uniform layout).
//!
//! Masking: query row `i` has the diagonal `seqused_k[b] - Sq_b + i` (causal bottom-right
//! per sequence; `Sq_b = Sq` without `cu_seqlens_q`) and sees the keys of
//! `window = (left, right)` around it (-1 = unbounded, as FlashAttention's `window_size`):
//! causal decode is `(-1, 0)`, full attention `(-1, -1)`. A row with no visible key gets
//! O = 0 and LSE = -inf.
//!
//! A contiguous cache `[B, Sk, Hkv, D]` is the special case of one page per sequence: a
//! class with `page_size: 0` (the page size is taken from the cache's shape per call),
//! `k_cache` viewed as `[B, Sk, Hkv, D]` and the identity table `[[0], [1], .., [B-1]]`
//! ([`identity_block_table`]).
//!
//! Order of a decode step with new tokens: [`DecodePlan::append_kv_raw`] writes the new rows
//! at positions `seqused_k[b] ..` (the lengths before the step); the caller then adds `Snew`
//! to `seqused_k` (a device-side add on the same stream, or an upload) and runs
//! [`DecodePlan::forward_raw`] with the new lengths.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::plan::Bshd;
use crate::dtype::DType;
use crate::error::{Error, Result};
pub use crate::gpu::raw::RawIndex;
use crate::gpu::raw::{self, param, Element, RawStream, RawTensor};
pub use crate::gpu::RawWorkspace;
use crate::gpu::{Device, Workspace};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
};
use std::ffi::c_void;
use std::sync::Arc;

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
const TICKET_BYTES: usize = MAX_SPLIT_GROUPS * 4;
/// A split gets at least this many keys (4 tiles): shorter splits spend more on their
/// prologue and partial write than on reading K/V.
pub const MIN_KEYS_PER_SPLIT: usize = 256;
/// Head dims with a kernel.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// What a decode plan is built for; batch, Sq (<= `max_q_per_seq`) and the cache come per
/// call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeClass {
    /// bf16 or f16 (q, caches, o).
    pub dtype: DType,
    /// 64, 128 or 256.
    pub head_dim: usize,
    pub heads_q: usize,
    /// Divides `heads_q`.
    pub heads_kv: usize,
    /// Keys per cache block: a multiple of 16; 0 = any (taken from the cache per call; a
    /// size that is not a multiple of 16 then needs a one-block table, the dense case).
    pub page_size: usize,
    /// Most query rows per sequence of a call, 1..=16.
    pub max_q_per_seq: usize,
    /// (left, right) around each row's diagonal; -1 = unbounded. (-1, 0) is causal.
    pub window: (i32, i32),
    /// Logit softcap (scores = softcap · tanh(scores / softcap)); 0 = off.
    pub softcap: f32,
    /// Multiplies q·k; None is 1/sqrt(head_dim).
    pub softmax_scale: Option<f32>,
}

impl DecodeClass {
    /// Causal decode of `max_q_per_seq` rows, no window or softcap.
    pub fn causal(
        dtype: DType,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
        page_size: usize,
        max_q_per_seq: usize,
    ) -> DecodeClass {
        DecodeClass {
            dtype,
            head_dim,
            heads_q,
            heads_kv,
            page_size,
            max_q_per_seq,
            window: (-1, 0),
            softcap: 0.0,
            softmax_scale: None,
        }
    }

    /// Check the class; errors name the field and the rule.
    pub fn validate(&self) -> Result<()> {
        if !matches!(self.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::invalid(format!(
                "decode dtype {} is not supported (bf16 or f16)",
                self.dtype
            )));
        }
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(Error::invalid(format!(
                "decode head_dim {} is not supported (one of {HEAD_DIMS:?})",
                self.head_dim
            )));
        }
        if self.heads_kv == 0 || self.heads_q == 0 || self.heads_q % self.heads_kv != 0 {
            return Err(Error::invalid(format!(
                "heads_q {} must be a positive multiple of heads_kv {}",
                self.heads_q, self.heads_kv
            )));
        }
        if self.heads_kv > 65_535 {
            return Err(Error::invalid(format!(
                "heads_kv {} exceeds the grid's y limit 65535",
                self.heads_kv
            )));
        }
        if self.page_size % 16 != 0 || self.page_size > i32::MAX as usize {
            return Err(Error::invalid(format!(
                "page_size {} must be a multiple of 16 (or 0: from the cache per call)",
                self.page_size
            )));
        }
        if self.max_q_per_seq == 0 || self.max_q_per_seq > MAX_Q_PER_SEQ {
            return Err(Error::invalid(format!(
                "max_q_per_seq {} must be in 1..={MAX_Q_PER_SEQ}",
                self.max_q_per_seq
            )));
        }
        crate::problem::check_window_softcap(self.window, self.softcap)?;
        if let Some(s) = self.softmax_scale {
            if !s.is_finite() || s <= 0.0 {
                return Err(Error::invalid(format!(
                    "softmax_scale {s} must be finite and > 0"
                )));
            }
        }
        Ok(())
    }

    /// The checks of [`DecodePlan::check`] that need no device: every shape, dtype, stride
    /// and alignment rule, with the call taken as unsplit (the split-count limits depend on
    /// the device's SM count and are checked by the plan).
    pub fn check_args(&self, a: &DecodeArgs) -> Result<DecodeShape> {
        check_call(self, &DecodeKernel::for_class(self), a, |_, _| 1)
    }

    /// Check an append call without a device (the checks of
    /// [`DecodePlan::append_kv_raw`]); returns (batch, Snew).
    pub fn check_append(&self, a: &AppendArgs) -> Result<(usize, usize)> {
        let c = self;
        if a.k_new.rank != 4 {
            return Err(Error::invalid(format!(
                "k_new must be 4-D (batch, s_new, heads_kv, head_dim) but has shape {:?}",
                a.k_new.shape()
            )));
        }
        let [b, sn, _, _] = a.k_new.shape;
        let shape = [b, sn, c.heads_kv, c.head_dim];
        a.k_new.expect("k_new", c.dtype, &shape, 16)?;
        a.v_new.expect("v_new", c.dtype, &shape, 16)?;
        check_strides_16b("k_new", &a.k_new)?;
        check_strides_16b("v_new", &a.v_new)?;
        if b == 0 || sn == 0 {
            return Err(Error::invalid(format!(
                "empty append: batch {b}, s_new {sn} (each must be >= 1)"
            )));
        }
        if b > 65_535 || sn > i32::MAX as usize {
            return Err(Error::unsupported(
                APPEND_ENTRY,
                format!("batch {b} (<= 65535) or s_new {sn} out of the grid's range"),
            ));
        }
        check_cache(c, &a.k_cache, &a.v_cache, &a.block_table, b)?;
        a.seqused_k.expect("seqused_k", b, Some(1))?;
        Ok((b, sn))
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }
    pub fn scale(&self) -> f32 {
        self.softmax_scale
            .unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// Keys visible to some query row of a sequence with `seqused` keys and `seqlen_q` rows
    /// (the union of the rows' windows): what a decode step must read.
    pub fn visible_keys(&self, seqused: usize, seqlen_q: usize) -> usize {
        let d0 = seqused as i64 - seqlen_q as i64;
        let lo = if self.window.0 < 0 {
            0
        } else {
            (d0 - self.window.0 as i64).max(0)
        };
        let hi = if self.window.1 < 0 {
            seqused as i64
        } else {
            (d0 + seqlen_q as i64 - 1 + self.window.1 as i64 + 1).clamp(0, seqused as i64)
        };
        (hi - lo).max(0) as usize
    }

    /// Bytes of K and V a decode step must read (the memory floor): visible keys × Hkv × D ×
    /// 2 (K and V) × element size, summed over the sequences. For GB/s reports.
    pub fn kv_bytes(&self, seqused: &[usize], seqlen_q: usize) -> u64 {
        let per_key = (self.heads_kv * self.head_dim * 2 * self.dtype.size_bytes()) as u64;
        seqused
            .iter()
            .map(|&n| self.visible_keys(n, seqlen_q) as u64 * per_key)
            .sum()
    }

    /// [`DecodeClass::kv_bytes`] plus q and o (read and written once) and lse.
    pub fn min_bytes(&self, seqused: &[usize], seqlen_q: usize) -> u64 {
        let b = seqused.len() as u64;
        let rows = b * seqlen_q as u64 * self.heads_q as u64;
        self.kv_bytes(seqused, seqlen_q)
            + rows * (2 * self.head_dim * self.dtype.size_bytes() + 4) as u64
    }

    /// FLOPs of a decode step (4 · Sq · Hq · visible keys · D per sequence; masked pairs not
    /// counted).
    pub fn flops(&self, seqused: &[usize], seqlen_q: usize) -> f64 {
        let mut pairs = 0u64;
        for &n in seqused {
            for i in 0..seqlen_q {
                let d = n as i64 - seqlen_q as i64 + i as i64;
                let lo = if self.window.0 < 0 {
                    0
                } else {
                    (d - self.window.0 as i64).max(0)
                };
                let hi = if self.window.1 < 0 {
                    n as i64
                } else {
                    (d + self.window.1 as i64 + 1).clamp(0, n as i64)
                };
                pairs += (hi - lo).max(0) as u64;
            }
        }
        4.0 * pairs as f64 * self.heads_q as f64 * self.head_dim as f64
    }
}

/// The identity block table `[[0], [1], .., [batch-1]]` of a contiguous cache (one page of
/// Sk keys per sequence): upload it once and pass it as `block_table`.
pub fn identity_block_table(batch: usize) -> Vec<i32> {
    (0..batch as i32).collect()
}

/// The tensors of one decode call, raw (shapes in the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeArgs {
    pub q: RawTensor,
    pub k_cache: RawTensor,
    pub v_cache: RawTensor,
    pub block_table: RawIndex,
    pub seqused_k: RawIndex,
    pub o: RawTensor,
    pub lse: RawTensor,
    /// An upper bound on `seqused_k` (as FlashAttention's `max_seqlen_k`): it picks the
    /// number of KV splits. None: the table's capacity, `max_blocks · page_size`.
    pub max_seqlen_k: Option<usize>,
    /// Mixed batches: int32 `[batch + 1]` row offsets of the sequences in a packed q
    /// `[total_q, Hq, D]` (module docs). None: every sequence has the Sq rows of
    /// `q [B, Sq, Hq, D]`.
    pub cu_seqlens_q: Option<RawIndex>,
}

/// The tensors of one append: new rows `[B, Snew, Hkv, D]` written at positions
/// `seqused_k[b] .. seqused_k[b] + Snew` of each sequence's pages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AppendArgs {
    pub k_new: RawTensor,
    pub v_new: RawTensor,
    pub k_cache: RawTensor,
    pub v_cache: RawTensor,
    pub block_table: RawIndex,
    pub seqused_k: RawIndex,
}

/// A checked call: its batch, query rows, cache geometry and launch split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: usize,
    /// Rows per sequence the grid covers: Sq, or with `cu_seqlens_q` min(max_q_per_seq,
    /// total_q).
    pub seqlen_q: usize,
    /// Query tokens of the call: B · Sq, or total_q with `cu_seqlens_q`.
    pub total_q: usize,
    pub varlen: bool,
    pub num_blocks: usize,
    pub page_size: usize,
    pub max_blocks: usize,
    pub max_seqlen_k: usize,
    pub splits: usize,
    /// CTAs per (sequence, KV head, split): ceil(G · Sq / (16 · MT)).
    pub m_blocks: usize,
}

/// The kernel build of a class: its defines and launch geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeKernel {
    pub head_dim: usize,
    pub bf16: bool,
    /// m16 tiles of packed rows per CTA (BM = 16 · mt).
    pub mt: usize,
    pub stages: usize,
    pub softcap: bool,
}

impl DecodeKernel {
    /// The build for `class`: BM covers G · max_q_per_seq rows up to 32 (D <= 128; D = 256
    /// keeps BM = 16 for registers), stages fill ~96-128 KiB of K/V ring (2 CTAs per SM on
    /// H100 at D = 128, 3 at D = 64).
    pub fn for_class(c: &DecodeClass) -> DecodeKernel {
        let rows = c.group() * c.max_q_per_seq;
        let mt = if rows <= 16 || c.head_dim > 128 { 1 } else { 2 };
        let stages = match c.head_dim {
            64 => 4,
            128 => 3,
            _ => 2,
        };
        DecodeKernel {
            head_dim: c.head_dim,
            bf16: c.dtype == DType::Bf16,
            mt,
            stages,
            softcap: c.softcap > 0.0,
        }
    }
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
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }
}

/// Every kernel build a class can select (for the NVRTC compile test).
pub fn all_decode_kernels() -> Vec<DecodeKernel> {
    let mut v = Vec::new();
    for d in HEAD_DIMS {
        for bf16 in [true, false] {
            for softcap in [false, true] {
                for max_rows in [1, 32] {
                    let c = DecodeClass {
                        softcap: if softcap { 30.0 } else { 0.0 },
                        dtype: if bf16 { DType::Bf16 } else { DType::F16 },
                        ..DecodeClass::causal(DType::Bf16, d, max_rows, 1, 16, 1)
                    };
                    let k = DecodeKernel::for_class(&c);
                    if !v.contains(&k) {
                        v.push(k);
                    }
                }
            }
        }
    }
    v
}

/// The FlashAttention-2 split heuristic with a tighter bar and whole tiles: with `ctas`
/// CTAs of work per split, `slots` CTAs resident per wave and `tiles` K/V tiles of
/// [`BLOCK_N`] keys per sequence, no split when the grid already fills 80% of a wave;
/// otherwise the smallest split count whose wave efficiency (work / (waves · slots)) is
/// within 95% of the best one, among the counts of at least [`MIN_KEYS_PER_SPLIT`] keys a
/// split that the kernel actually runs (s splits of ceil(tiles / s) tiles leave
/// ceil(tiles / ceil(tiles / s)) of them non-empty). FA2 takes 85% and ignores the tiles;
/// with the merge fused into the last split an extra split costs only its partial O, so
/// filling the wave wins: B=1 Hkv=8 Sk=8192 gets 32 splits of 4 tiles, not 28 (26 of them
/// non-empty, up to 5 tiles each).
pub fn split_heuristic(ctas: usize, slots: usize, tiles: usize) -> usize {
    let max_splits = tiles
        .div_ceil(MIN_KEYS_PER_SPLIT / BLOCK_N)
        .clamp(1, MAX_SPLITS);
    if ctas == 0 || slots == 0 || ctas * 5 >= slots * 4 {
        return 1;
    }
    let runs = |s: usize| tiles.max(1).div_ceil(tiles.max(1).div_ceil(s)) == s;
    let eff = |s: usize| {
        let work = ctas * s;
        work as f64 / (work.div_ceil(slots) * slots) as f64
    };
    let best = (1..=max_splits)
        .filter(|&s| runs(s))
        .map(eff)
        .fold(0.0, f64::max);
    (1..=max_splits)
        .find(|&s| runs(s) && eff(s) >= 0.95 * best)
        .unwrap_or(1)
}

/// Kernel parameters of `decode_paged_fwd` (the .cu's `DecodeParams`, 232 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DecodeParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    block_table: u64,
    seqused_k: u64,
    o_part: u64,
    lse_part: u64,
    tickets: u64,
    cu_seqlens_q: u64,
    q_sb: i64,
    q_ss: i64,
    q_sh: i64,
    k_sblk: i64,
    k_srow: i64,
    k_sh: i64,
    v_sblk: i64,
    v_srow: i64,
    v_sh: i64,
    bt_stride: i64,
    batch: i32,
    seqlen_q: i32,
    heads_q: i32,
    heads_kv: i32,
    group: i32,
    page_size: i32,
    max_blocks: i32,
    splits: i32,
    m_blocks: i32,
    window_left: i32,
    window_right: i32,
    scale_log2: f32,
    softcap_log2: f32,
    num_blocks: i32,
    total_q: i32,
}

/// `decode_append_kv`'s parameters (168 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AppendParams {
    k_new: u64,
    v_new: u64,
    k_cache: u64,
    v_cache: u64,
    block_table: u64,
    seqused_k: u64,
    kn_sb: i64,
    kn_ss: i64,
    kn_sh: i64,
    vn_sb: i64,
    vn_ss: i64,
    vn_sh: i64,
    k_sblk: i64,
    k_srow: i64,
    k_sh: i64,
    v_sblk: i64,
    v_srow: i64,
    v_sh: i64,
    bt_stride: i64,
    heads_kv: i32,
    page_size: i32,
    max_blocks: i32,
    num_blocks: i32,
}

const _: () = assert!(std::mem::size_of::<DecodeParams>() == 232);
const _: () = assert!(std::mem::size_of::<AppendParams>() == 168);

/// Paged decode kernels resolved for one class on one device.
pub struct DecodePlan {
    class: DecodeClass,
    kernel: DecodeKernel,
    fwd: CudaFunction,
    append: CudaFunction,
    ctx: Arc<CudaContext>,
    sm_count: u32,
    /// Decode CTAs resident per SM (occupancy of the compiled kernel).
    ctas_per_sm: u32,
    splits_override: Option<usize>,
}

impl std::fmt::Debug for DecodePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodePlan")
            .field("class", &self.class)
            .field("kernel", &self.kernel)
            .field("ctas_per_sm", &self.ctas_per_sm)
            .field("splits_override", &self.splits_override)
            .finish()
    }
}

fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::unsupported(
            DECODE_ENTRY,
            format!("{what} = {v} does not fit the kernel's 32-bit int"),
        )
    })
}

/// Element strides that 16-byte copies can take: multiples of 8 elements.
fn check_strides_16b(name: &str, t: &RawTensor) -> Result<()> {
    for (i, &s) in t.strides()[..t.rank - 1].iter().enumerate() {
        if t.shape[i] > 1 && s % 8 != 0 {
            return Err(Error::invalid(format!(
                "{name}'s stride {s} (dimension {i}) is not a multiple of 8 elements (16-byte \
                 copies)"
            )));
        }
    }
    Ok(())
}

/// Check the cache tensors and the table against the class; returns (num_blocks,
/// page_size, max_blocks).
fn check_cache(
    c: &DecodeClass,
    k: &RawTensor,
    v: &RawTensor,
    bt: &RawIndex,
    batch: usize,
) -> Result<(usize, usize, usize)> {
    if k.rank != 4 {
        return Err(Error::invalid(format!(
            "k_cache must be 4-D (num_blocks, page_size, heads_kv, head_dim) but has shape {:?}",
            k.shape()
        )));
    }
    let [nb, ps, _, _] = k.shape;
    let shape = [nb, ps, c.heads_kv, c.head_dim];
    k.expect("k_cache", c.dtype, &shape, 16)?;
    v.expect("v_cache", c.dtype, &shape, 16)?;
    check_strides_16b("k_cache", k)?;
    check_strides_16b("v_cache", v)?;
    bt.expect("block_table", batch, None)?;
    let mb = bt.cols;
    if c.page_size != 0 && ps != c.page_size {
        return Err(Error::invalid(format!(
            "k_cache pages hold {ps} keys but the plan's class has page_size {}",
            c.page_size
        )));
    }
    if ps == 0 || nb == 0 {
        return Err(Error::invalid(format!(
            "k_cache has shape {:?}: num_blocks and page_size must be >= 1",
            k.shape()
        )));
    }
    if ps % 16 != 0 && mb != 1 {
        return Err(Error::invalid(format!(
            "page_size {ps} is not a multiple of 16: only a one-block table (a dense cache) \
             may use it, but block_table has {mb} columns"
        )));
    }
    i32_of("max_blocks · page_size", mb.saturating_mul(ps))?;
    i32_of("num_blocks", nb)?;
    Ok((nb, ps, mb))
}

/// The O(1) checks of a decode call for class `c` built as `kernel`, with `splits(batch,
/// max_seqlen_k)` the launch's KV split count.
fn check_call(
    c: &DecodeClass,
    kernel: &DecodeKernel,
    a: &DecodeArgs,
    splits: impl Fn(usize, usize) -> usize,
) -> Result<DecodeShape> {
    let (hq, d) = (c.heads_q, c.head_dim);
    let (b, sq, total_q) = match &a.cu_seqlens_q {
        None => {
            for (name, t) in [("q", &a.q), ("o", &a.o)] {
                if t.rank != 4 {
                    return Err(Error::invalid(format!(
                        "{name} must be 4-D (batch, seqlen_q, heads_q, head_dim) but has \
                         shape {:?}",
                        t.shape()
                    )));
                }
            }
            let [b, sq, _, _] = a.q.shape;
            a.q.expect("q", c.dtype, &[b, sq, hq, d], 16)?;
            a.o.expect_contiguous("o", c.dtype, &[b, sq, hq, d], 16)?;
            a.lse
                .expect_contiguous("lse", DType::F32, &[b, hq, sq], 4)?;
            if b == 0 || sq == 0 {
                return Err(Error::invalid(format!(
                    "empty decode call: batch {b}, seqlen_q {sq} (each must be >= 1)"
                )));
            }
            if sq > c.max_q_per_seq {
                return Err(Error::invalid(format!(
                    "q has {sq} rows per sequence but the plan's class allows \
                     max_q_per_seq = {}",
                    c.max_q_per_seq
                )));
            }
            (b, sq, b * sq)
        }
        Some(cu) => {
            for (name, t) in [("q", &a.q), ("o", &a.o)] {
                if t.rank != 3 {
                    return Err(Error::invalid(format!(
                        "with cu_seqlens_q, {name} must be 3-D (total_q, heads_q, \
                         head_dim) but has shape {:?}",
                        t.shape()
                    )));
                }
            }
            let t = a.q.shape[0];
            a.q.expect("q", c.dtype, &[t, hq, d], 16)?;
            a.o.expect_contiguous("o", c.dtype, &[t, hq, d], 16)?;
            a.lse.expect_contiguous("lse", DType::F32, &[hq, t], 4)?;
            let b = a.block_table.rows;
            cu.expect("cu_seqlens_q", b + 1, Some(1))?;
            if b == 0 || t == 0 {
                return Err(Error::invalid(format!(
                    "empty decode call: batch {b}, total_q {t} (each must be >= 1)"
                )));
            }
            // The workspace and the grid are sized for max_q_per_seq rows a sequence.
            if t > b * c.max_q_per_seq {
                return Err(Error::invalid(format!(
                    "q holds {t} rows but {b} sequences of at most max_q_per_seq = {} \
                     rows hold at most {}",
                    c.max_q_per_seq,
                    b * c.max_q_per_seq
                )));
            }
            (b, t.min(c.max_q_per_seq), t)
        }
    };
    check_strides_16b("q", &a.q)?;
    if b > 65_535 {
        return Err(Error::unsupported(
            DECODE_ENTRY,
            format!("batch {b} exceeds the grid's z limit 65535"),
        ));
    }
    let (nb, ps, mb) = check_cache(c, &a.k_cache, &a.v_cache, &a.block_table, b)?;
    a.seqused_k.expect("seqused_k", b, Some(1))?;
    let capacity = mb * ps;
    let max_seqlen_k = a.max_seqlen_k.unwrap_or(capacity);
    if max_seqlen_k > capacity {
        return Err(Error::invalid(format!(
            "max_seqlen_k {max_seqlen_k} exceeds the table's capacity {mb} blocks × {ps} keys"
        )));
    }
    let splits = splits(b, max_seqlen_k);
    let m_blocks = (c.group() * sq).div_ceil(kernel.block_m());
    i32_of("grid x (splits · row blocks)", splits * m_blocks)?;
    i32_of("total_q · heads_q · splits", total_q * hq * splits)?;
    if splits > 1 && b * c.heads_kv * m_blocks > MAX_SPLIT_GROUPS {
        return Err(Error::unsupported(
            DECODE_ENTRY,
            format!(
                "{splits} KV splits over {} (sequence, KV head, row block) groups: a split \
                 call serves at most {MAX_SPLIT_GROUPS} (use fewer splits or a smaller batch)",
                b * c.heads_kv * m_blocks
            ),
        ));
    }
    Ok(DecodeShape {
        batch: b,
        seqlen_q: sq,
        total_q,
        varlen: a.cu_seqlens_q.is_some(),
        num_blocks: nb,
        page_size: ps,
        max_blocks: mb,
        max_seqlen_k,
        splits,
        m_blocks,
    })
}

impl DecodePlan {
    /// Validate `class`, compile (or load from the disk cache) its kernels for `dev`, set
    /// the shared-memory limit and read the occupancy the split heuristic uses.
    pub fn new(dev: &Device, class: DecodeClass) -> Result<DecodePlan> {
        class.validate()?;
        if dev.arch() < 80 {
            return Err(Error::unsupported(
                DECODE_ENTRY,
                format!(
                    "needs sm_80 or newer (mma.sync bf16, cp.async), {} is sm_{}",
                    dev.info().name,
                    dev.arch()
                ),
            ));
        }
        let kernel = DecodeKernel::for_class(&class);
        let defs = kernel.defines();
        let fwd = dev.load_kernel(DECODE_SOURCE, DECODE_ENTRY, &defs)?;
        let append = dev.load_kernel(DECODE_SOURCE, APPEND_ENTRY, &defs)?;
        let smem = kernel.shared_mem_bytes();
        dev.set_dynamic_shared_memory(DECODE_ENTRY, &fwd, smem)?;
        let ctas_per_sm = fwd
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem as usize, None)
            .map_err(|e| Error::cuda("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?
            .max(1);
        Ok(DecodePlan {
            class,
            kernel,
            fwd,
            append,
            ctx: dev.context().clone(),
            sm_count: dev.info().sm_count,
            ctas_per_sm,
            splits_override: None,
        })
    }

    /// Force the number of KV splits (clamped to 1..=[`MAX_SPLITS`]); None restores the
    /// heuristic. The workspace size follows ([`DecodePlan::workspace_bytes`]).
    pub fn with_splits(mut self, splits: Option<usize>) -> DecodePlan {
        self.splits_override = splits.map(|s| s.clamp(1, MAX_SPLITS));
        self
    }

    pub fn class(&self) -> &DecodeClass {
        &self.class
    }
    pub fn kernel(&self) -> &DecodeKernel {
        &self.kernel
    }
    /// Decode CTAs resident per SM on this device.
    pub fn ctas_per_sm(&self) -> u32 {
        self.ctas_per_sm
    }

    /// KV splits of a call with `batch` sequences of at most `max_seqlen_k` keys: the
    /// override, else [`split_heuristic`] over B · Hkv · row blocks (at `max_q_per_seq`)
    /// CTAs, SMs × occupancy slots, and at most one split per [`MIN_KEYS_PER_SPLIT`] keys.
    /// Independent of the call's Sq, so [`DecodePlan::workspace_bytes`] bounds every call.
    pub fn splits(&self, batch: usize, max_seqlen_k: usize) -> usize {
        if let Some(s) = self.splits_override {
            return s;
        }
        let m_blocks =
            (self.class.group() * self.class.max_q_per_seq).div_ceil(self.kernel.block_m());
        let ctas = batch * self.class.heads_kv * m_blocks;
        let slots = (self.sm_count * self.ctas_per_sm) as usize;
        split_heuristic(ctas, slots, max_seqlen_k.div_ceil(BLOCK_N))
    }

    /// Workspace bytes of a call (0 when it runs unsplit): the split merge's tickets, then
    /// per split f32 O and LSE of every (query token, head) at `max_q_per_seq` rows per
    /// sequence. Zeroed once ([`DecodePlan::alloc_workspace`]); every launch leaves the
    /// tickets zeroed.
    pub fn workspace_bytes(&self, batch: usize, max_seqlen_k: usize) -> usize {
        Self::partial_bytes(
            &self.class,
            self.splits(batch, max_seqlen_k),
            batch * self.class.max_q_per_seq,
        )
        .2
    }

    /// (offset of the O partials, offset of the LSE partials, total bytes) for `splits`
    /// splits of `tokens` query tokens; the tickets sit at offset 0.
    fn partial_bytes(c: &DecodeClass, splits: usize, tokens: usize) -> (usize, usize, usize) {
        if splits <= 1 {
            return (0, 0, 0);
        }
        let rows = splits * tokens * c.heads_q;
        let o_bytes = (rows * c.head_dim * 4).div_ceil(256) * 256;
        (
            TICKET_BYTES,
            TICKET_BYTES + o_bytes,
            TICKET_BYTES + o_bytes + rows * 4,
        )
    }

    /// A workspace for calls of up to `batch` sequences of `max_seqlen_k` keys on `stream`
    /// (allocates: do it once).
    pub fn alloc_workspace(
        &self,
        stream: &Arc<CudaStream>,
        batch: usize,
        max_seqlen_k: usize,
    ) -> Result<Workspace> {
        Workspace::zeroed(stream, self.workspace_bytes(batch, max_seqlen_k))
    }

    /// Check a call against the class and the kernel's rules, O(1); errors name the tensor
    /// and the rule.
    pub fn check(&self, a: &DecodeArgs) -> Result<DecodeShape> {
        check_call(&self.class, &self.kernel, a, |b, n| self.splits(b, n))
    }

    /// Enqueue decode attention on `stream` (one launch): o and lse of every query row
    /// (module docs). It reads/writes only the caller's memory and `workspace`.
    ///
    /// # Safety
    /// The contract of [`crate::gpu::raw`]: every address in `a` is live device memory of
    /// this plan's context covering its tensor's span; `seqused_k[b] <= max_seqlen_k` (the
    /// kernel clamps to the table's capacity and never reads a block id outside
    /// `[0, num_blocks)`); the table's entries for the keys in use are valid block ids;
    /// `cu_seqlens_q` starts at 0 and is non-decreasing with steps of at most
    /// `max_q_per_seq` (the kernel clamps each sequence to `[0, total_q]` and to that many
    /// rows, so other values leave rows of o unwritten but never access memory out of
    /// range); `workspace` covers [`DecodePlan::workspace_bytes`], was zeroed once (as
    /// [`DecodePlan::alloc_workspace`] does; every launch leaves it so) and is not used by a
    /// launch that may run at the same time; `stream` belongs to the context.
    pub unsafe fn forward_raw(
        &self,
        stream: RawStream,
        a: &DecodeArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let s = self.check(a)?;
        let c = &self.class;
        let (o_off, lse_off, need) = Self::partial_bytes(c, s.splits, s.total_q);
        workspace.check(need, 16, "DecodePlan")?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let scale = c.scale();
        let (scale_log2, softcap_log2) = if c.softcap > 0.0 {
            (scale / c.softcap, c.softcap * std::f32::consts::LOG2_E)
        } else {
            (scale * std::f32::consts::LOG2_E, 0.0)
        };
        let (q, k, v) = (&a.q, &a.k_cache, &a.v_cache);
        let st = |t: &RawTensor, i: usize| t.strides[i] as i64;
        let p = DecodeParams {
            q: q.ptr,
            k: k.ptr,
            v: v.ptr,
            o: a.o.ptr,
            lse: a.lse.ptr,
            block_table: a.block_table.ptr,
            seqused_k: a.seqused_k.ptr,
            o_part: if need > 0 {
                workspace.ptr + o_off as u64
            } else {
                0
            },
            lse_part: if need > 0 {
                workspace.ptr + lse_off as u64
            } else {
                0
            },
            tickets: if need > 0 { workspace.ptr } else { 0 },
            cu_seqlens_q: a.cu_seqlens_q.map_or(0, |cu| cu.ptr),
            // Packed q [total_q, Hq, D]: no batch stride, rows counted from cu_seqlens_q[b].
            q_sb: if s.varlen { 0 } else { st(q, 0) },
            q_ss: st(q, if s.varlen { 0 } else { 1 }),
            q_sh: st(q, if s.varlen { 1 } else { 2 }),
            k_sblk: st(k, 0),
            k_srow: st(k, 1),
            k_sh: st(k, 2),
            v_sblk: st(v, 0),
            v_srow: st(v, 1),
            v_sh: st(v, 2),
            bt_stride: a.block_table.row_stride as i64,
            batch: s.batch as i32,
            seqlen_q: s.seqlen_q as i32,
            heads_q: c.heads_q as i32,
            heads_kv: c.heads_kv as i32,
            group: c.group() as i32,
            page_size: s.page_size as i32,
            max_blocks: s.max_blocks as i32,
            splits: s.splits as i32,
            m_blocks: s.m_blocks as i32,
            window_left: c.window.0,
            window_right: c.window.1,
            scale_log2,
            softcap_log2,
            num_blocks: s.num_blocks as i32,
            total_q: s.total_q as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (
                (s.splits * s.m_blocks) as u32,
                c.heads_kv as u32,
                s.batch as u32,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: self.kernel.shared_mem_bytes(),
        };
        let mut params: [*mut c_void; 1] = [param(&p)];
        raw::launch(DECODE_ENTRY, &self.fwd, cfg, stream, &mut params)
    }

    /// Check an append call; returns (batch, Snew).
    pub fn check_append(&self, a: &AppendArgs) -> Result<(usize, usize)> {
        self.class.check_append(a)
    }

    /// Enqueue the append of `k_new`/`v_new` into the caches at positions
    /// `seqused_k[b] .. + Snew` (the lengths before this step; advance `seqused_k` after).
    ///
    /// # Safety
    /// As [`DecodePlan::forward_raw`]; positions past the table's capacity or on block ids
    /// outside `[0, num_blocks)` are skipped, so the caller makes sure the pages exist.
    pub unsafe fn append_kv_raw(&self, stream: RawStream, a: &AppendArgs) -> Result<()> {
        let (b, sn) = self.check_append(a)?;
        let (_, ps, mb) = (a.k_cache.shape[0], a.k_cache.shape[1], a.block_table.cols);
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let st = |t: &RawTensor, i: usize| t.strides[i] as i64;
        let (kn, vn, k, v) = (&a.k_new, &a.v_new, &a.k_cache, &a.v_cache);
        let p = AppendParams {
            k_new: kn.ptr,
            v_new: vn.ptr,
            k_cache: k.ptr,
            v_cache: v.ptr,
            block_table: a.block_table.ptr,
            seqused_k: a.seqused_k.ptr,
            kn_sb: st(kn, 0),
            kn_ss: st(kn, 1),
            kn_sh: st(kn, 2),
            vn_sb: st(vn, 0),
            vn_ss: st(vn, 1),
            vn_sh: st(vn, 2),
            k_sblk: st(k, 0),
            k_srow: st(k, 1),
            k_sh: st(k, 2),
            v_sblk: st(v, 0),
            v_srow: st(v, 1),
            v_sh: st(v, 2),
            bt_stride: a.block_table.row_stride as i64,
            heads_kv: self.class.heads_kv as i32,
            page_size: ps as i32,
            max_blocks: mb as i32,
            num_blocks: k.shape[0] as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (sn as u32, b as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut params: [*mut c_void; 1] = [param(&p)];
        raw::launch(APPEND_ENTRY, &self.append, cfg, stream, &mut params)
    }

    fn check_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::invalid(
                "the stream belongs to another CUDA context than the plan (build the plan \
                 from the stream's context: Device::from_context)",
            ));
        }
        Ok(())
    }

    /// [`DecodePlan::forward_raw`] over cudarc buffers on a cudarc stream: lengths checked
    /// against the views' spans, the stream against the plan's context and the workspace's
    /// stream; cudarc's stream-order tracking is kept. `block_table` is `[B, max_blocks]`
    /// row-major.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T, Q, K, V, O>(
        &self,
        stream: &Arc<CudaStream>,
        q: Bshd<&Q>,
        k_cache: Bshd<&K>,
        v_cache: Bshd<&V>,
        block_table: &CudaSlice<i32>,
        seqused_k: &CudaSlice<i32>,
        o: Bshd<&mut O>,
        lse: &mut CudaSlice<f32>,
        max_seqlen_k: Option<usize>,
        workspace: &mut Workspace,
    ) -> Result<()>
    where
        T: Element,
        Q: DevicePtr<T>,
        K: DevicePtr<T>,
        V: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        self.check_stream(stream)?;
        let b = q.shape[0];
        let (hq, sq) = (self.class.heads_q, q.shape[1]);
        if b == 0 || block_table.len() % b != 0 {
            return Err(Error::invalid(format!(
                "block_table holds {} int32 values: not [batch = {b}, max_blocks]",
                block_table.len()
            )));
        }
        let mb = block_table.len() / b;
        let (qp, _gq) = q.buf.device_ptr(stream);
        let (kp, _gk) = k_cache.buf.device_ptr(stream);
        let (vp, _gv) = v_cache.buf.device_ptr(stream);
        let (btp, _gb) = block_table.device_ptr(stream);
        let (sup, _gs) = seqused_k.device_ptr(stream);
        let (o_len, lse_len) = (o.buf.len(), lse.len());
        let (op, _go) = o.buf.device_ptr_mut(stream);
        let (lp, _gl) = lse.device_ptr_mut(stream);
        let args = DecodeArgs {
            q: RawTensor::new(qp, T::DTYPE, &q.shape, &q.strides)?,
            k_cache: RawTensor::new(kp, T::DTYPE, &k_cache.shape, &k_cache.strides)?,
            v_cache: RawTensor::new(vp, T::DTYPE, &v_cache.shape, &v_cache.strides)?,
            block_table: RawIndex::matrix(btp, b, mb),
            seqused_k: RawIndex::vector(sup, seqused_k.len()),
            o: RawTensor::new(op, T::DTYPE, &o.shape, &o.strides)?,
            lse: RawTensor::contiguous(lp, DType::F32, &[b, hq, sq])?,
            max_seqlen_k,
            cu_seqlens_q: None,
        };
        let shape = self.check(&args)?;
        for (name, span, len) in [
            ("q", args.q.span_elems(), q.buf.len()),
            ("k_cache", args.k_cache.span_elems(), k_cache.buf.len()),
            ("v_cache", args.v_cache.span_elems(), v_cache.buf.len()),
            ("o", args.o.span_elems(), o_len),
            ("lse", args.lse.span_elems(), lse_len),
        ] {
            if span > len as u64 {
                return Err(Error::invalid(format!(
                    "{name}'s view spans {span} elements but its buffer holds {len}"
                )));
            }
        }
        let need = Self::partial_bytes(&self.class, shape.splits, shape.total_q).2;
        workspace.check_for(stream, need, "DecodePlan")?;
        let raw_ws = workspace.raw();
        // SAFETY: every buffer is a live cudarc allocation of the plan's context covering
        // its view's span (checked above); the guards keep cudarc's stream order until after
        // the launches; the workspace is bound to this stream (launches in order).
        unsafe { self.forward_raw(stream.cu_stream(), &args, raw_ws) }
    }

    /// [`DecodePlan::append_kv_raw`] over cudarc buffers (see [`DecodePlan::forward`]).
    #[allow(clippy::too_many_arguments)]
    pub fn append_kv<T, KN, VN, K, V>(
        &self,
        stream: &Arc<CudaStream>,
        k_new: Bshd<&KN>,
        v_new: Bshd<&VN>,
        k_cache: Bshd<&mut K>,
        v_cache: Bshd<&mut V>,
        block_table: &CudaSlice<i32>,
        seqused_k: &CudaSlice<i32>,
    ) -> Result<()>
    where
        T: Element,
        KN: DevicePtr<T>,
        VN: DevicePtr<T>,
        K: DevicePtrMut<T>,
        V: DevicePtrMut<T>,
    {
        self.check_stream(stream)?;
        let b = k_new.shape[0];
        if b == 0 || block_table.len() % b != 0 {
            return Err(Error::invalid(format!(
                "block_table holds {} int32 values: not [batch = {b}, max_blocks]",
                block_table.len()
            )));
        }
        let mb = block_table.len() / b;
        let (kc_len, vc_len) = (k_cache.buf.len(), v_cache.buf.len());
        let (knp, _g1) = k_new.buf.device_ptr(stream);
        let (vnp, _g2) = v_new.buf.device_ptr(stream);
        let (kp, _g3) = k_cache.buf.device_ptr_mut(stream);
        let (vp, _g4) = v_cache.buf.device_ptr_mut(stream);
        let (btp, _g5) = block_table.device_ptr(stream);
        let (sup, _g6) = seqused_k.device_ptr(stream);
        let args = AppendArgs {
            k_new: RawTensor::new(knp, T::DTYPE, &k_new.shape, &k_new.strides)?,
            v_new: RawTensor::new(vnp, T::DTYPE, &v_new.shape, &v_new.strides)?,
            k_cache: RawTensor::new(kp, T::DTYPE, &k_cache.shape, &k_cache.strides)?,
            v_cache: RawTensor::new(vp, T::DTYPE, &v_cache.shape, &v_cache.strides)?,
            block_table: RawIndex::matrix(btp, b, mb),
            seqused_k: RawIndex::vector(sup, seqused_k.len()),
        };
        self.check_append(&args)?;
        for (name, span, len) in [
            ("k_new", args.k_new.span_elems(), k_new.buf.len()),
            ("v_new", args.v_new.span_elems(), v_new.buf.len()),
            ("k_cache", args.k_cache.span_elems(), kc_len),
            ("v_cache", args.v_cache.span_elems(), vc_len),
        ] {
            if span > len as u64 {
                return Err(Error::invalid(format!(
                    "{name}'s view spans {span} elements but its buffer holds {len}"
                )));
            }
        }
        // SAFETY: as in `forward`.
        unsafe { self.append_kv_raw(stream.cu_stream(), &args) }
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<DecodePlan>();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_validation_names_the_rule() {
        let ok = DecodeClass::causal(DType::Bf16, 128, 32, 8, 16, 4);
        ok.validate().unwrap();
        let e = DecodeClass { heads_q: 30, ..ok }.validate().unwrap_err();
        assert!(e.to_string().contains("multiple of heads_kv"), "{e}");
        let e = DecodeClass {
            page_size: 24,
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("page_size 24"), "{e}");
        let e = DecodeClass {
            max_q_per_seq: 17,
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("max_q_per_seq 17"), "{e}");
        let e = DecodeClass { head_dim: 96, ..ok }.validate().unwrap_err();
        assert!(e.to_string().contains("head_dim 96"), "{e}");
        let e = DecodeClass {
            window: (-2, 0),
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
        let e = DecodeClass {
            softcap: -1.0,
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("softcap"), "{e}");
        let e = DecodeClass {
            dtype: DType::F32,
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("f32"), "{e}");
        DecodeClass { page_size: 0, ..ok }.validate().unwrap();
    }

    #[test]
    fn kernel_selection_and_smem() {
        let c = DecodeClass::causal(DType::Bf16, 128, 32, 8, 16, 1);
        let k = DecodeKernel::for_class(&c);
        assert_eq!((k.mt, k.stages), (1, 3));
        // 2·128·(16 + 2·3·64) = 102400
        assert_eq!(k.shared_mem_bytes(), 102_400);
        let k = DecodeKernel::for_class(&DecodeClass {
            max_q_per_seq: 5,
            ..c
        });
        assert_eq!(k.mt, 2);
        let k = DecodeKernel::for_class(&DecodeClass {
            head_dim: 256,
            max_q_per_seq: 16,
            ..c
        });
        assert_eq!((k.mt, k.stages), (1, 2));
        assert!(k.shared_mem_bytes() <= 163 * 1024);
        let all = all_decode_kernels();
        assert_eq!(all.len(), 2 * 2 * 2 + 2 * 2 * 2 + 2 * 2);
        for k in &all {
            assert!(k.shared_mem_bytes() as usize <= 163 * 1024, "{k:?}");
        }
    }

    #[test]
    fn split_heuristic_fills_waves() {
        // Full grid: no split.
        assert_eq!(split_heuristic(512, 264, 128), 1);
        assert_eq!(split_heuristic(220, 264, 128), 1);
        // B=1, Hkv=8 at Sk=8192 (128 tiles): 32 splits of 4 tiles, 97% of a wave.
        assert_eq!(split_heuristic(8, 264, 128), 32);
        // B=8, Hkv=8 at Sk=4096: 4 splits of 16 tiles.
        assert_eq!(split_heuristic(64, 264, 64), 4);
        // B=16, Hkv=8: 128 CTAs → 2 splits fill 97% of a wave.
        assert_eq!(split_heuristic(128, 264, 512), 2);
        // Short sequences cap the splits (4 tiles a split at least).
        assert_eq!(split_heuristic(8, 264, 4), 1);
        assert!(split_heuristic(8, 264, 16) <= 4);
        // Every answer is a count the kernel runs (no empty trailing splits).
        for tiles in 1..300 {
            for ctas in [1, 3, 8, 40, 100] {
                let s = split_heuristic(ctas, 264, tiles);
                assert_eq!(
                    tiles.div_ceil(tiles.div_ceil(s)),
                    s,
                    "tiles {tiles} ctas {ctas}"
                );
            }
        }
    }

    #[test]
    fn byte_and_flop_models() {
        let c = DecodeClass::causal(DType::Bf16, 128, 32, 8, 16, 1);
        // Sk = 8192, one sequence: 8192 · 8 · 128 · 2 · 2 = 32 MiB.
        assert_eq!(c.kv_bytes(&[8192], 1), 32 << 20);
        assert_eq!(c.flops(&[8192], 1), 4.0 * 8192.0 * 32.0 * 128.0);
        // Window of 100 left: 101 keys per row; Sq = 4 reads 104 keys.
        let w = DecodeClass {
            window: (100, 0),
            ..c
        };
        assert_eq!(w.visible_keys(1000, 1), 101);
        assert_eq!(w.visible_keys(1000, 4), 104);
        assert_eq!(w.visible_keys(50, 4), 50);
        // seqused < Sq with causal: the first rows see nothing.
        assert_eq!(c.visible_keys(2, 4), 2);
        assert_eq!(c.flops(&[2], 4), 4.0 * (1.0 + 2.0) * 32.0 * 128.0);
    }

    #[test]
    fn raw_index_checks() {
        let t = RawIndex::matrix(4096, 3, 5);
        t.expect("block_table", 3, None).unwrap();
        assert_eq!(t.span_elems(), 15);
        let e = t.expect("block_table", 4, None).unwrap_err();
        assert!(e.to_string().contains("block_table is int32 [3, 5]"), "{e}");
        let v = RawIndex::vector(4098, 3);
        let e = v.expect("seqused_k", 3, Some(1)).unwrap_err();
        assert!(e.to_string().contains("4-byte aligned"), "{e}");
        assert_eq!(identity_block_table(3), vec![0, 1, 2]);
    }
}
