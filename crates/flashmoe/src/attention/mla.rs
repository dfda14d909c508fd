//! DeepSeek-V2/V3 Multi-head Latent Attention (MLA) paged decode: `Sq = 1..` query rows per
//! sequence (decode and speculative decoding) of `Hq` weight-absorbed query heads against a
//! paged cache of one latent KV head. Kernels: `kernels/mla_decode.cu`.
//!
//! Shape of the API (as [`super::decode`]): [`MlaDecodePlan::new`] compiles once per
//! [`MlaDecodeClass`]; [`MlaDecodePlan::forward_raw`] does O(1) checks and enqueues on the
//! caller's stream over the caller's memory with no allocation, synchronisation, compile or
//! environment access (CUDA-graph capturable: one or two launches, a fixed workspace);
//! [`MlaDecodePlan::forward`] is the cudarc wrapper.
//!
//! Layouts: q `[B, Sq, Hq, 576]` (strided views allowed, strides multiples of 8 elements);
//! the cache `[num_blocks, page_size, 576]` or `[num_blocks, page_size, 1, 576]` (block and
//! row strides allowed, multiples of 8): per token the 512-wide latent `c` then the 64-wide
//! rotary `k_pe`; the key is the whole row, the value its first 512 columns. `block_table`
//! int32 `[B, max_blocks]` (row stride allowed), `seqused_k` int32 `[B]`; o `[B, Sq, Hq, 512]`
//! and lse f32 `[B, Sq, Hq]` (natural log), contiguous. Key `j` of sequence `b` is row
//! `j % page_size` of block `block_table[b][j / page_size]`.
//!
//! Masking: causal, bottom-right: query row `i` sees keys `j <= seqused_k[b] - Sq + i`. A row
//! with no visible key gets O = 0 and LSE = -inf. Scores are `softmax_scale · q·k` (DeepSeek:
//! `1/sqrt(192)` times its yarn factor, so the scale is the class's, not derived from 576).
//!
//! Workspace (splits > 1): per split an f32 O `[B·Sq·Hq, 512]` and an f32 LSE `[B·Sq·Hq]`;
//! the forward kernel writes them and a second launch merges them in split order (the bits
//! do not depend on which CTA finishes first). Nothing in it needs zeroing and nothing
//! survives a call; [`MlaDecodePlan::workspace_bytes`] bounds every call of the class.

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

/// What an MLA decode plan is built for; batch, Sq and the cache come per call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaDecodeClass {
    /// bf16 or f16 (q, cache, o).
    pub dtype: DType,
    /// Query heads (DeepSeek-V3: 128; any >= 1).
    pub heads_q: usize,
    /// Width of q and of a cache row: 576.
    pub head_dim_qk: usize,
    /// Width of the value (the row's first columns) and of o: 512.
    pub head_dim_v: usize,
    /// Keys per cache block: a positive multiple of 16 (DeepSeek: 64).
    pub page_size: usize,
    /// Most query rows per sequence of a call (1 decode, 2..4 speculative), <= 16.
    pub max_q_per_seq: usize,
    /// Most sequences of a call (sizes the workspace).
    pub max_batch: usize,
    /// Most keys of a sequence (sizes the workspace; also the default of a call's bound).
    pub max_seqlen_k: usize,
    /// Multiplies q·k (finite, > 0).
    pub softmax_scale: f32,
}

impl MlaDecodeClass {
    /// DeepSeek-V3's decode: 128 heads, 576/512, page 64, scale 1/sqrt(192).
    pub fn deepseek_v3(
        dtype: DType,
        max_q_per_seq: usize,
        max_batch: usize,
        max_seqlen_k: usize,
    ) -> MlaDecodeClass {
        MlaDecodeClass {
            dtype,
            heads_q: 128,
            head_dim_qk: D_QK,
            head_dim_v: D_V,
            page_size: 64,
            max_q_per_seq,
            max_batch,
            max_seqlen_k,
            softmax_scale: 1.0 / (192f32).sqrt(),
        }
    }

    /// Check the class; errors name the field and the rule.
    pub fn validate(&self) -> Result<()> {
        if !matches!(self.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::invalid(format!(
                "MLA decode dtype {} is not supported (bf16 or f16)",
                self.dtype
            )));
        }
        if self.head_dim_qk != D_QK || self.head_dim_v != D_V {
            return Err(Error::invalid(format!(
                "MLA decode head dims {}/{} have no kernel (only {D_QK}/{D_V}: latent 512 + \
                 rotary 64)",
                self.head_dim_qk, self.head_dim_v
            )));
        }
        if self.heads_q == 0 || self.heads_q > 65_536 {
            return Err(Error::invalid(format!(
                "heads_q {} must be in 1..=65536",
                self.heads_q
            )));
        }
        if self.page_size == 0 || self.page_size % 16 != 0 || self.page_size > 1 << 20 {
            return Err(Error::invalid(format!(
                "page_size {} must be a positive multiple of 16 (at most 2^20)",
                self.page_size
            )));
        }
        if self.max_q_per_seq == 0 || self.max_q_per_seq > MAX_Q_PER_SEQ {
            return Err(Error::invalid(format!(
                "max_q_per_seq {} must be in 1..={MAX_Q_PER_SEQ}",
                self.max_q_per_seq
            )));
        }
        if self.max_batch == 0 || self.max_batch > 65_535 {
            return Err(Error::invalid(format!(
                "max_batch {} must be in 1..=65535 (the grid's y limit)",
                self.max_batch
            )));
        }
        if self.max_seqlen_k == 0 || self.max_seqlen_k > i32::MAX as usize {
            return Err(Error::invalid(format!(
                "max_seqlen_k {} must be in 1..=2^31-1",
                self.max_seqlen_k
            )));
        }
        // Output rows (token, head) are 32-bit in the kernels.
        let rows = self.max_batch * self.max_q_per_seq * self.heads_q;
        if rows > i32::MAX as usize {
            return Err(Error::invalid(format!(
                "max_batch {} × max_q_per_seq {} × heads_q {} = {rows} output rows exceeds 2^31-1",
                self.max_batch, self.max_q_per_seq, self.heads_q
            )));
        }
        if !self.softmax_scale.is_finite() || self.softmax_scale <= 0.0 {
            return Err(Error::invalid(format!(
                "softmax_scale {} must be finite and > 0",
                self.softmax_scale
            )));
        }
        Ok(())
    }

    /// CTAs per (sequence, split) at `sq` rows: ceil(Hq · Sq / 64).
    pub fn m_blocks(&self, sq: usize) -> usize {
        (self.heads_q * sq).div_ceil(BLOCK_M)
    }

    /// Keys visible to some row of a sequence of `seqused` keys (causal: all of them).
    pub fn visible_keys(&self, seqused: usize) -> usize {
        seqused
    }

    /// Cache bytes a decode step must read (each visible row of 576 once): the memory floor.
    pub fn kv_bytes(&self, seqused: &[usize]) -> u64 {
        let row = (D_QK * self.dtype.size_bytes()) as u64;
        seqused.iter().map(|&n| n as u64 * row).sum()
    }

    /// FLOPs of a decode step: per (row, visible key) 2·576 (q·k) + 2·512 (p·v).
    pub fn flops(&self, seqused: &[usize], seqlen_q: usize) -> f64 {
        let mut pairs = 0u64;
        for &n in seqused {
            for i in 0..seqlen_q {
                let hi = n as i64 - seqlen_q as i64 + i as i64 + 1;
                pairs += hi.clamp(0, n as i64) as u64;
            }
        }
        pairs as f64 * self.heads_q as f64 * 2.0 * (D_QK + D_V) as f64
    }
}

/// The tensors of one MLA decode call, raw (shapes in the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaArgs {
    pub q: RawTensor,
    pub kv_cache: RawTensor,
    pub block_table: RawIndex,
    pub seqused_k: RawIndex,
    pub o: RawTensor,
    pub lse: RawTensor,
    /// An upper bound on `seqused_k` (picks the split count). None: the class's
    /// `max_seqlen_k`, capped at the table's capacity.
    pub max_seqlen_k: Option<usize>,
}

/// A checked call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaShape {
    pub batch: usize,
    pub seqlen_q: usize,
    pub num_blocks: usize,
    pub page_size: usize,
    pub max_blocks: usize,
    pub max_seqlen_k: usize,
    pub splits: usize,
    /// CTAs per (sequence, split): ceil(Hq · Sq / 64).
    pub m_blocks: usize,
}

/// The kernel build: dtype, keys per tile, ring depth and the MMA path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlaKernel {
    pub bf16: bool,
    /// Keys per K/V tile: 64 where the device gives 216 KiB of shared memory a block
    /// (sm_90), else 32 (sm_80's 163 KiB).
    pub block_n: usize,
    pub stages: usize,
    /// Both GEMMs on warpgroup MMAs (sm_90a builds only; needs `block_n` 64).
    pub wgmma: bool,
}

impl MlaKernel {
    /// The build for `dtype` on a device allowing `smem_optin` bytes of shared memory a
    /// block, compiled for sm_90a or not: wgmma with 64-key tiles on sm_90a when they fit,
    /// else mma.sync with the widest tile whose 2-stage ring fits (the static part is
    /// < 1 KiB).
    pub fn for_device(dtype: DType, smem_optin: u64, sm90a: bool) -> MlaKernel {
        let k64 = MlaKernel {
            bf16: dtype == DType::Bf16,
            block_n: 64,
            stages: 2,
            wgmma: sm90a,
        };
        if k64.shared_mem_bytes() as u64 + 1024 <= smem_optin {
            return k64;
        }
        let k64 = MlaKernel {
            wgmma: false,
            ..k64
        };
        if k64.shared_mem_bytes() as u64 + 1024 <= smem_optin {
            k64
        } else {
            MlaKernel { block_n: 32, ..k64 }
        }
    }
    /// Dynamic shared memory: 1152 · (64 + STAGES · BN) for Q and the K ring, plus the
    /// warp pairs' exchange of P (8 warps × BN/2 keys × 16 rows, bf16) and of row statistics
    /// (8 × 16 f32), plus 1024 for the wgmma build's alignment (the .cu's formula).
    pub fn shared_mem_bytes(&self) -> u32 {
        let warps = THREADS as usize / 32;
        (D_QK * 2 * (BLOCK_M + self.stages * self.block_n)
            + warps * self.block_n * 16
            + warps * 64
            + if self.wgmma { 1024 } else { 0 }) as u32
    }
    pub fn defines(&self) -> Vec<(String, String)> {
        [
            ("FM_DTYPE_BF16", self.bf16 as usize),
            ("FM_BN", self.block_n),
            ("FM_STAGES", self.stages),
            ("FM_WGMMA", self.wgmma as usize),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }
}

/// Every kernel build a device can select (for the NVRTC compile test).
pub fn all_mla_kernels() -> Vec<MlaKernel> {
    let mut v = Vec::new();
    for dt in [DType::Bf16, DType::F16] {
        for (optin, sm90a) in [(163 * 1024, false), (227 * 1024, false), (227 * 1024, true)] {
            let k = MlaKernel::for_device(dt, optin, sm90a);
            if !v.contains(&k) {
                v.push(k);
            }
        }
    }
    v
}

/// KV splits for `ctas` CTAs of work per split, `slots` CTAs resident per wave and `tiles`
/// 64-key tiles per sequence: none when the grid fills 80% of a wave; else the smallest count
/// within 95% of the best wave efficiency among counts the kernel runs without empty
/// trailing splits (s splits of ceil(tiles / s) tiles), at most one per
/// [`MIN_KEYS_PER_SPLIT`] keys and [`MAX_SPLITS`].
pub fn mla_split_heuristic(ctas: usize, slots: usize, tiles: usize) -> usize {
    let tiles = tiles.max(1);
    let max_splits = tiles.div_ceil(MIN_KEYS_PER_SPLIT / 64).clamp(1, MAX_SPLITS);
    if ctas == 0 || slots == 0 || ctas * 5 >= slots * 4 {
        return 1;
    }
    let runs = |s: usize| tiles.div_ceil(tiles.div_ceil(s)) == s;
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

/// `mla_decode_fwd`'s parameters (the .cu's `MlaParams`, 152 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MlaParams {
    q: u64,
    kv: u64,
    o: u64,
    lse: u64,
    block_table: u64,
    seqused_k: u64,
    o_part: u64,
    lse_part: u64,
    q_sb: i64,
    q_ss: i64,
    q_sh: i64,
    kv_sblk: i64,
    kv_srow: i64,
    bt_stride: i64,
    batch: i32,
    seqlen_q: i32,
    heads_q: i32,
    page_size: i32,
    max_blocks: i32,
    num_blocks: i32,
    splits: i32,
    m_blocks: i32,
    scale_log2: f32,
    pad: i32,
}

/// `mla_decode_combine`'s parameters (40 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct CombineParams {
    o_part: u64,
    lse_part: u64,
    o: u64,
    lse: u64,
    rows: i32,
    splits: i32,
}

const _: () = assert!(std::mem::size_of::<MlaParams>() == 152);
const _: () = assert!(std::mem::size_of::<CombineParams>() == 40);

fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::unsupported(
            MLA_ENTRY,
            format!("{what} = {v} does not fit the kernel's 32-bit int"),
        )
    })
}

/// Element strides 16-byte copies can take: multiples of 8 elements.
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

/// (offset of the LSE partials, total bytes) of `splits` splits over `rows` output rows.
fn partial_bytes(splits: usize, rows: usize) -> (usize, usize) {
    if splits <= 1 {
        return (0, 0);
    }
    let o_bytes = (splits * rows * D_V * 4).div_ceil(256) * 256;
    (o_bytes, o_bytes + splits * rows * 4)
}

/// The O(1) checks of a call; `splits(batch, max_seqlen_k)` is the launch's split count.
fn check_call(
    c: &MlaDecodeClass,
    a: &MlaArgs,
    splits: impl Fn(usize, usize) -> usize,
) -> Result<MlaShape> {
    let hq = c.heads_q;
    for (name, t) in [("q", &a.q), ("o", &a.o)] {
        if t.rank != 4 {
            return Err(Error::invalid(format!(
                "{name} must be 4-D (batch, seqlen_q, heads_q, head_dim) but has shape {:?}",
                t.shape()
            )));
        }
    }
    let [b, sq, _, _] = a.q.shape;
    a.q.expect("q", c.dtype, &[b, sq, hq, D_QK], 16)?;
    a.o.expect_contiguous("o", c.dtype, &[b, sq, hq, D_V], 16)?;
    a.lse
        .expect_contiguous("lse", DType::F32, &[b, sq, hq], 4)?;
    check_strides_16b("q", &a.q)?;
    if b == 0 || sq == 0 {
        return Err(Error::invalid(format!(
            "empty MLA decode call: batch {b}, seqlen_q {sq} (each must be >= 1)"
        )));
    }
    if sq > c.max_q_per_seq {
        return Err(Error::invalid(format!(
            "q has {sq} rows per sequence but the plan's class allows max_q_per_seq = {}",
            c.max_q_per_seq
        )));
    }
    if b > c.max_batch {
        return Err(Error::invalid(format!(
            "batch {b} exceeds the plan's class max_batch = {}",
            c.max_batch
        )));
    }
    let kv = &a.kv_cache;
    let (nb, ps) = match kv.rank {
        3 => {
            let [nb, ps, _, _] = kv.shape;
            kv.expect("kv_cache", c.dtype, &[nb, ps, D_QK], 16)?;
            (nb, ps)
        }
        4 => {
            let [nb, ps, _, _] = kv.shape;
            kv.expect("kv_cache", c.dtype, &[nb, ps, 1, D_QK], 16)?;
            (nb, ps)
        }
        _ => {
            return Err(Error::invalid(format!(
                "kv_cache must be [num_blocks, page_size, 576] or [num_blocks, page_size, 1, \
                 576] but has shape {:?}",
                kv.shape()
            )))
        }
    };
    check_strides_16b("kv_cache", kv)?;
    if nb == 0 {
        return Err(Error::invalid(
            "kv_cache has no blocks (num_blocks must be >= 1)",
        ));
    }
    if ps != c.page_size {
        return Err(Error::invalid(format!(
            "kv_cache pages hold {ps} keys but the plan's class has page_size {}",
            c.page_size
        )));
    }
    a.block_table.expect("block_table", b, None)?;
    a.seqused_k.expect("seqused_k", b, Some(1))?;
    let mb = a.block_table.cols;
    let capacity = mb.saturating_mul(ps);
    i32_of("max_blocks · page_size", capacity)?;
    i32_of("num_blocks", nb)?;
    let max_seqlen_k = a.max_seqlen_k.unwrap_or(c.max_seqlen_k.min(capacity));
    if max_seqlen_k > capacity || max_seqlen_k > c.max_seqlen_k {
        return Err(Error::invalid(format!(
            "max_seqlen_k {max_seqlen_k} exceeds the table's capacity {mb} blocks × {ps} keys \
             or the class's max_seqlen_k {}",
            c.max_seqlen_k
        )));
    }
    let splits = splits(b, max_seqlen_k);
    let m_blocks = c.m_blocks(sq);
    i32_of("grid x (splits · row blocks)", splits * m_blocks)?;
    Ok(MlaShape {
        batch: b,
        seqlen_q: sq,
        num_blocks: nb,
        page_size: ps,
        max_blocks: mb,
        max_seqlen_k,
        splits,
        m_blocks,
    })
}

/// MLA decode kernels resolved for one class on one device.
pub struct MlaDecodePlan {
    class: MlaDecodeClass,
    kernel: MlaKernel,
    fwd: CudaFunction,
    combine: CudaFunction,
    ctx: Arc<CudaContext>,
    sm_count: u32,
    ctas_per_sm: u32,
    splits_override: Option<usize>,
}

impl std::fmt::Debug for MlaDecodePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlaDecodePlan")
            .field("class", &self.class)
            .field("kernel", &self.kernel)
            .field("ctas_per_sm", &self.ctas_per_sm)
            .field("splits_override", &self.splits_override)
            .finish()
    }
}

impl MlaDecodePlan {
    /// Validate `class`, compile (or load from the disk cache) its kernels for `dev`, set
    /// the shared-memory limit and read the occupancy the split heuristic uses.
    pub fn new(dev: &Device, class: MlaDecodeClass) -> Result<MlaDecodePlan> {
        let kernel = Self::kernels_for(dev, class.dtype)?[0].clone();
        Self::with_kernel(dev, class, kernel)
    }

    /// The builds `dev` can run for `dtype`, the one [`MlaDecodePlan::new`] selects first
    /// (on sm_90a: wgmma, then the portable mma.sync build, for tests and the lab).
    pub fn kernels_for(dev: &Device, dtype: DType) -> Result<Vec<MlaKernel>> {
        let optin = dev.info().max_shared_memory_per_block_optin;
        let sm90a = dev.arch() == 90 && dev.compile_arch()? == "sm_90a";
        let mut v = vec![MlaKernel::for_device(dtype, optin, sm90a)];
        let portable = MlaKernel::for_device(dtype, optin, false);
        if !v.contains(&portable) {
            v.push(portable);
        }
        Ok(v)
    }

    /// [`MlaDecodePlan::new`] with a given build (one of [`MlaDecodePlan::kernels_for`]).
    pub fn with_kernel(
        dev: &Device,
        class: MlaDecodeClass,
        kernel: MlaKernel,
    ) -> Result<MlaDecodePlan> {
        class.validate()?;
        if dev.arch() < 80 {
            return Err(Error::unsupported(
                MLA_ENTRY,
                format!(
                    "needs sm_80 or newer (mma.sync, cp.async), {} is sm_{}",
                    dev.info().name,
                    dev.arch()
                ),
            ));
        }
        if !Self::kernels_for(dev, class.dtype)?.contains(&kernel) {
            return Err(Error::unsupported(
                MLA_ENTRY,
                format!("build {kernel:?} does not run on {}", dev.info().name),
            ));
        }
        let defs = kernel.defines();
        let fwd = dev.load_kernel(MLA_SOURCE, MLA_ENTRY, &defs)?;
        let combine = dev.load_kernel(MLA_SOURCE, COMBINE_ENTRY, &defs)?;
        let smem = kernel.shared_mem_bytes();
        dev.set_dynamic_shared_memory(MLA_ENTRY, &fwd, smem)?;
        let ctas_per_sm = fwd
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem as usize, None)
            .map_err(|e| Error::cuda("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?
            .max(1);
        Ok(MlaDecodePlan {
            class,
            kernel,
            fwd,
            combine,
            ctx: dev.context().clone(),
            sm_count: dev.info().sm_count,
            ctas_per_sm,
            splits_override: None,
        })
    }

    /// Force the number of KV splits (clamped to 1..=[`MAX_SPLITS`]); None restores the
    /// heuristic. [`MlaDecodePlan::workspace_bytes`] follows.
    pub fn with_splits(mut self, splits: Option<usize>) -> MlaDecodePlan {
        self.splits_override = splits.map(|s| s.clamp(1, MAX_SPLITS));
        self
    }

    pub fn class(&self) -> &MlaDecodeClass {
        &self.class
    }
    pub fn kernel(&self) -> &MlaKernel {
        &self.kernel
    }

    /// KV splits of a call with `batch` sequences of at most `max_seqlen_k` keys: the
    /// override, else [`mla_split_heuristic`] over B · row blocks (at `max_q_per_seq`) CTAs.
    /// Independent of the call's Sq.
    pub fn splits(&self, batch: usize, max_seqlen_k: usize) -> usize {
        if let Some(s) = self.splits_override {
            return s;
        }
        let ctas = batch * self.class.m_blocks(self.class.max_q_per_seq);
        let slots = (self.sm_count * self.ctas_per_sm) as usize;
        mla_split_heuristic(ctas, slots, max_seqlen_k.div_ceil(64))
    }

    /// Workspace bytes of a call of `batch` sequences bounded by `max_seqlen_k` keys (0 when
    /// it runs unsplit).
    pub fn call_workspace_bytes(&self, batch: usize, max_seqlen_k: usize) -> usize {
        partial_bytes(
            self.splits(batch, max_seqlen_k),
            batch * self.class.max_q_per_seq * self.class.heads_q,
        )
        .1
    }

    /// Workspace bytes that serve every call of the class (batch <= `max_batch`, keys <=
    /// `max_seqlen_k`): the largest [`MlaDecodePlan::call_workspace_bytes`] (O(max_batch),
    /// once per plan).
    pub fn workspace_bytes(&self) -> usize {
        (1..=self.class.max_batch)
            .map(|b| self.call_workspace_bytes(b, self.class.max_seqlen_k))
            .max()
            .unwrap_or(0)
    }

    /// A workspace for every call of the class on `stream` (allocates: do it once).
    pub fn alloc_workspace(&self, stream: &Arc<CudaStream>) -> Result<Workspace> {
        Workspace::zeroed(stream, self.workspace_bytes())
    }

    /// Check a call against the class and the kernel's rules, O(1); errors name the tensor
    /// and the rule.
    pub fn check(&self, a: &MlaArgs) -> Result<MlaShape> {
        check_call(&self.class, a, |b, n| self.splits(b, n))
    }

    /// Enqueue MLA decode on `stream`: one launch, plus the split merge when the call is
    /// split. Reads and writes only the caller's memory and `workspace`.
    ///
    /// # Safety
    /// The contract of [`crate::gpu::raw`]: every address in `a` is live device memory of
    /// this plan's context covering its tensor's span; `seqused_k[b] <= max_seqlen_k` (the
    /// kernel clamps to the table's capacity and never reads a block id outside
    /// `[0, num_blocks)`); the table's entries for the keys in use are valid block ids;
    /// `workspace` covers [`MlaDecodePlan::call_workspace_bytes`] (any contents) and no
    /// launch that may run at the same time uses it; `stream` belongs to the context.
    pub unsafe fn forward_raw(
        &self,
        stream: RawStream,
        a: &MlaArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let s = self.check(a)?;
        let c = &self.class;
        let rows = s.batch * s.seqlen_q * c.heads_q;
        let (lse_off, need) = partial_bytes(s.splits, rows);
        workspace.check(need, 16, "MlaDecodePlan")?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let st = |t: &RawTensor, i: usize| t.strides[i] as i64;
        let split = need > 0;
        let (o_part, lse_part) = if split {
            (workspace.ptr, workspace.ptr + lse_off as u64)
        } else {
            (0, 0)
        };
        let p = MlaParams {
            q: a.q.ptr,
            kv: a.kv_cache.ptr,
            o: a.o.ptr,
            lse: a.lse.ptr,
            block_table: a.block_table.ptr,
            seqused_k: a.seqused_k.ptr,
            o_part,
            lse_part,
            q_sb: st(&a.q, 0),
            q_ss: st(&a.q, 1),
            q_sh: st(&a.q, 2),
            kv_sblk: st(&a.kv_cache, 0),
            kv_srow: st(&a.kv_cache, 1),
            bt_stride: a.block_table.row_stride as i64,
            batch: s.batch as i32,
            seqlen_q: s.seqlen_q as i32,
            heads_q: c.heads_q as i32,
            page_size: s.page_size as i32,
            max_blocks: s.max_blocks as i32,
            num_blocks: s.num_blocks as i32,
            splits: s.splits as i32,
            m_blocks: s.m_blocks as i32,
            scale_log2: c.softmax_scale * std::f32::consts::LOG2_E,
            pad: 0,
        };
        let cfg = LaunchConfig {
            grid_dim: ((s.splits * s.m_blocks) as u32, s.batch as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: self.kernel.shared_mem_bytes(),
        };
        let mut params: [*mut c_void; 1] = [param(&p)];
        raw::launch(MLA_ENTRY, &self.fwd, cfg, stream, &mut params)?;
        if split {
            let cp = CombineParams {
                o_part,
                lse_part,
                o: a.o.ptr,
                lse: a.lse.ptr,
                rows: i32_of("output rows", rows)?,
                splits: s.splits as i32,
            };
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (COMBINE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut params: [*mut c_void; 1] = [param(&cp)];
            raw::launch(COMBINE_ENTRY, &self.combine, cfg, stream, &mut params)?;
        }
        Ok(())
    }

    /// [`MlaDecodePlan::forward_raw`] over cudarc buffers on a cudarc stream: lengths checked
    /// against the views' spans, the stream against the plan's context and the workspace's
    /// stream. `kv_cache` is viewed `[num_blocks, page_size, 1, 576]`, `block_table`
    /// `[B, max_blocks]` row-major, lse `[B, Sq, Hq]`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T, Q, K, O>(
        &self,
        stream: &Arc<CudaStream>,
        q: Bshd<&Q>,
        kv_cache: Bshd<&K>,
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
        O: DevicePtrMut<T>,
    {
        crate::gpu::device::check_stream_context(stream, &self.ctx)?;
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
        let (kp, _gk) = kv_cache.buf.device_ptr(stream);
        let (btp, _gb) = block_table.device_ptr(stream);
        let (sup, _gs) = seqused_k.device_ptr(stream);
        let (o_len, lse_len) = (o.buf.len(), lse.len());
        let (op, _go) = o.buf.device_ptr_mut(stream);
        let (lp, _gl) = lse.device_ptr_mut(stream);
        let args = MlaArgs {
            q: RawTensor::new(qp, T::DTYPE, &q.shape, &q.strides)?,
            kv_cache: RawTensor::new(kp, T::DTYPE, &kv_cache.shape, &kv_cache.strides)?,
            block_table: RawIndex::matrix(btp, b, mb),
            seqused_k: RawIndex::vector(sup, seqused_k.len()),
            o: RawTensor::new(op, T::DTYPE, &o.shape, &o.strides)?,
            lse: RawTensor::contiguous(lp, DType::F32, &[b, sq, hq])?,
            max_seqlen_k,
        };
        let shape = self.check(&args)?;
        for (name, span, len) in [
            ("q", args.q.span_elems(), q.buf.len()),
            ("kv_cache", args.kv_cache.span_elems(), kv_cache.buf.len()),
            ("o", args.o.span_elems(), o_len),
            ("lse", args.lse.span_elems(), lse_len),
        ] {
            if span > len as u64 {
                return Err(Error::invalid(format!(
                    "{name}'s view spans {span} elements but its buffer holds {len}"
                )));
            }
        }
        let need = partial_bytes(shape.splits, b * sq * hq).1;
        workspace.check_for(stream, need, "MlaDecodePlan")?;
        let raw_ws = workspace.raw();
        // SAFETY: every buffer is a live cudarc allocation of the plan's context covering
        // its view's span (checked above); the guards keep cudarc's stream order until after
        // the launches; the workspace is bound to this stream (launches in order).
        unsafe { self.forward_raw(stream.cu_stream(), &args, raw_ws) }
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<MlaDecodePlan>();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(b: usize, sq: usize, hq: usize, nb: usize, ps: usize, mb: usize) -> MlaArgs {
        let t = |p: u64, dt: DType, sh: &[usize]| RawTensor::contiguous(p, dt, sh).unwrap();
        MlaArgs {
            q: t(1 << 20, DType::Bf16, &[b, sq, hq, D_QK]),
            kv_cache: t(1 << 30, DType::Bf16, &[nb, ps, 1, D_QK]),
            block_table: RawIndex::matrix(4096, b, mb),
            seqused_k: RawIndex::vector(8192, b),
            o: t(1 << 24, DType::Bf16, &[b, sq, hq, D_V]),
            lse: t(1 << 26, DType::F32, &[b, sq, hq]),
            max_seqlen_k: None,
        }
    }

    #[test]
    fn class_validation_and_call_checks_name_the_rule() {
        let c = MlaDecodeClass::deepseek_v3(DType::Bf16, 4, 16, 8192);
        c.validate().unwrap();
        let bad = |c: MlaDecodeClass, want: &str| {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(want), "expected '{want}' in: {e}");
        };
        bad(MlaDecodeClass { page_size: 24, ..c }, "page_size 24");
        bad(
            MlaDecodeClass {
                head_dim_qk: 192,
                ..c
            },
            "192/512",
        );
        bad(
            MlaDecodeClass {
                max_q_per_seq: 0,
                ..c
            },
            "max_q_per_seq 0",
        );
        bad(
            MlaDecodeClass {
                dtype: DType::F32,
                ..c
            },
            "f32",
        );
        bad(
            MlaDecodeClass {
                softmax_scale: f32::NAN,
                ..c
            },
            "softmax_scale",
        );
        bad(MlaDecodeClass { heads_q: 0, ..c }, "heads_q 0");

        let one = |_: usize, _: usize| 1;
        let a = args(2, 3, 128, 10, 64, 8);
        let s = check_call(&c, &a, one).unwrap();
        assert_eq!(
            (s.batch, s.seqlen_q, s.m_blocks, s.max_seqlen_k),
            (2, 3, 6, 512)
        );
        let e = |a: &MlaArgs| check_call(&c, a, one).unwrap_err().to_string();
        assert!(e(&args(2, 5, 128, 10, 64, 8)).contains("max_q_per_seq = 4"));
        assert!(e(&args(17, 1, 128, 10, 64, 8)).contains("max_batch = 16"));
        assert!(e(&args(2, 1, 64, 10, 64, 8)).contains("q has shape"));
        assert!(e(&args(2, 1, 128, 10, 32, 8)).contains("page_size 64"));
        let mut x = args(2, 1, 128, 10, 64, 8);
        x.max_seqlen_k = Some(513);
        assert!(e(&x).contains("capacity"));
        x = args(2, 1, 128, 10, 64, 8);
        x.kv_cache.dtype = DType::F16;
        assert!(e(&x).contains("kv_cache holds f16"));
        x = args(2, 1, 128, 10, 64, 8);
        x.block_table.rows = 3;
        assert!(e(&x).contains("block_table is int32 [3"));
        x = args(2, 1, 128, 10, 64, 8);
        x.o = RawTensor::contiguous(1 << 24, DType::Bf16, &[2, 1, 128, 576]).unwrap();
        assert!(e(&x).contains("o has shape"));
        x = args(2, 1, 128, 10, 64, 8);
        x.q.strides[2] = 580;
        assert!(e(&x).contains("not a multiple of 8"));
        // A 3-D cache is the same call.
        x = args(2, 1, 128, 10, 64, 8);
        x.kv_cache = RawTensor::contiguous(1 << 30, DType::Bf16, &[10, 64, D_QK]).unwrap();
        check_call(&c, &x, one).unwrap();
    }

    #[test]
    fn kernel_selection_smem_and_splits() {
        let k = MlaKernel::for_device(DType::Bf16, 227 * 1024, false);
        assert_eq!(
            (k.block_n, k.stages, k.wgmma, k.shared_mem_bytes()),
            (64, 2, false, 229_888)
        );
        let k = MlaKernel::for_device(DType::Bf16, 227 * 1024, true);
        assert_eq!(
            (k.block_n, k.wgmma, k.shared_mem_bytes()),
            (64, true, 230_912)
        );
        let k = MlaKernel::for_device(DType::F16, 163 * 1024, false);
        assert_eq!((k.block_n, k.shared_mem_bytes()), (32, 152_064));
        assert_eq!(all_mla_kernels().len(), 6);
        // B=128 Hq=128 Sq=1: 256 CTAs fill 132 SMs: no split.
        assert_eq!(mla_split_heuristic(256, 132, 64), 1);
        // B=1: 2 CTAs; 32k keys (512 tiles) split to fill the wave.
        let s = mla_split_heuristic(2, 132, 512);
        assert!((32..=MAX_SPLITS).contains(&s), "{s}");
        // Short caches cap the splits (4 tiles a split at least).
        assert_eq!(mla_split_heuristic(2, 132, 4), 1);
        for tiles in 1..200 {
            let s = mla_split_heuristic(3, 132, tiles);
            assert_eq!(tiles.div_ceil(tiles.div_ceil(s)), s, "tiles {tiles}");
        }
        let c = MlaDecodeClass::deepseek_v3(DType::Bf16, 1, 1, 4096);
        assert_eq!(c.kv_bytes(&[4096, 1]), 4097 * 576 * 2);
        assert_eq!(c.flops(&[10], 2), (9.0 + 10.0) * 128.0 * 2.0 * 1088.0);
    }
}
