//! Attention backward: dq, dk and dv of `o = softmax(scale · q kᵀ [mask, softcap]) v`, on
//! the portable mma.sync kernels (`kernels/flash_attn_bwd.cu`, sm_80 and newer) or, on
//! compute capability 9.0 for the classes [`sm90_serves`], the wgmma kernels of
//! `kernels/flash_attn_bwd_sm90.cu`, in the plan's [`BwdMode`]: deterministic, or fast
//! (dQ added with f32 reductions inside the dK/dV kernel, see [`Sm90Dq`]).
//!
//! [`AttentionBackwardPlan::new`] does the slow work once per [`AttentionClass`] (dtype,
//! head dim, head counts, causal, scale, window, softcap): NVRTC compile or disk cache of
//! one module with the three kernels, module load, shared-memory attributes. A call
//! ([`AttentionBackwardPlan::backward_raw`]) does O(1) checks and enqueues three launches
//! (four in the fast sm_90a mode: preprocess, zero the dQ tiles, dK/dV with dQ, convert)
//! on the caller's stream: no allocation, no synchronisation, no compile, so it can be
//! captured in a CUDA graph.
//!
//! 1. `flash_attn_bwd_preprocess`: `Delta = rowsum(dO ∘ O)` and the LSE in log2 units,
//!    into the workspace ([`AttentionBackwardPlan::workspace_bytes`], written before it is
//!    read: nothing to zero).
//! 2. `flash_attn_bwd_dkdv`: one CTA per (batch, kv head, key block); loops over the query
//!    heads of its GQA group and their query blocks, recomputing `P = exp(S − LSE)`;
//!    writes dk and dv once.
//! 3. `flash_attn_bwd_dq`: one CTA per (batch, query head, query block); loops over key
//!    blocks; writes dq once.
//!
//! In [`BwdMode::Deterministic`] there are no atomics: every gradient element is
//! accumulated in a fixed order by one CTA, so two runs give bit-identical gradients. Masks
//! are the forward's: causal bottom-right (row i
//! sees keys j ≤ i + Sk − Sq), sliding windows around that diagonal, Sq ≠ Sk; a row that
//! sees no key (LSE = −inf) gets zero gradients.
//!
//! FLOPs: 2.5 × the forward's ([`backward_flops`]).

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::config::{LogitParams, Masking, MAX_GRID_YZ, MAX_SEQLEN};
use super::plan::{AttentionClass, CallShape};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{launch, param, RawStream, RawTensor, RawWorkspace};
use crate::gpu::Device;
use crate::problem::AttentionProblem;
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use std::sync::Arc;

/// Source file of the three backward kernels.
pub const BWD_SOURCE: &str = "flash_attn_bwd.cu";
pub const BWD_PREPROCESS_ENTRY: &str = "flash_attn_bwd_preprocess";
pub const BWD_DKDV_ENTRY: &str = "flash_attn_bwd_dkdv";
pub const BWD_DQ_ENTRY: &str = "flash_attn_bwd_dq";
/// Head dims the backward kernels serve.
pub const BWD_HEAD_DIMS: [usize; 4] = [32, 64, 96, 128];
/// Rows per block of the preprocess kernel (one warp each).
const PREPROCESS_ROWS: u32 = 4;
/// Source of the Hopper (sm_90a, wgmma) dK/dV and dQ kernels; the preprocess stays
/// [`BWD_PREPROCESS_ENTRY`] of [`BWD_SOURCE`].
pub const BWD_SM90_SOURCE: &str = "flash_attn_bwd_sm90.cu";
pub const BWD_SM90_DKDV_ENTRY: &str = "flash_attn_bwd_sm90_dkdv";
pub const BWD_SM90_DQ_ENTRY: &str = "flash_attn_bwd_sm90_dq";
/// The fused-dQ modes' workspace kernels: zero the f32 dQ tiles and their semaphores before
/// the dK/dV kernel, convert the tiles into dq after it.
pub const BWD_SM90_DQ_ZERO_ENTRY: &str = "flash_attn_bwd_sm90_dq_zero";
pub const BWD_SM90_DQ_CONVERT_ENTRY: &str = "flash_attn_bwd_sm90_dq_convert";
/// Query rows of one f32 dQ tile of the fused modes (the dK/dV kernel's step).
const SM90_DQ_TILE_ROWS: usize = 64;
/// Head dims the sm_90a backward serves.
pub const BWD_SM90_HEAD_DIMS: [usize; 2] = [64, 128];

/// What a backward plan promises about its bits: FlashAttention's `deterministic` switch
/// (PyTorch's `torch.use_deterministic_algorithms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BwdMode {
    /// The fastest kernels for the class. On compute capability 9.0, where the sm_90a
    /// kernels serve the class, dq is summed with f32 reductions in the order they land,
    /// so two runs may differ in the last bits of dq (dk and dv are still bit-identical).
    Fast,
    /// Bit-identical gradients run to run, on every path.
    Deterministic,
}

/// Which kernels a backward plan runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BwdKernel {
    /// `flash_attn_bwd.cu` (mma.sync, sm_80 and newer): every class the backward serves.
    Portable,
    /// `flash_attn_bwd_sm90.cu` (wgmma, compute capability 9.0): head dims 64 and 128,
    /// bf16/f16, causal or not, sliding windows, Sq ≠ Sk, GQA; no softcap.
    Sm90(Sm90BwdTile),
}

/// How the sm_90a backward makes dQ (the kernels' FM_DQ_MODE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sm90Dq {
    /// A second kernel (`flash_attn_bwd_sm90_dq`) recomputes S and dP for each query
    /// block: 7 products of the forward's size, bit-identical run to run.
    Kernel,
    /// The dK/dV kernel also computes dQ's part of its key block (dS·K) and adds it into an
    /// f32 workspace with reductions, in whatever order they land: 5 products, not
    /// bit-identical run to run (f32 addition is not associative).
    Atomic,
    /// As `Atomic`, but each 64-row dQ tile takes its key blocks' parts in increasing
    /// key-block order (a semaphore per tile): 5 products, bit-identical run to run.
    Ordered,
}

impl Sm90Dq {
    /// FM_DQ_MODE of the kernels.
    fn define(self) -> u32 {
        match self {
            Sm90Dq::Kernel => 0,
            Sm90Dq::Atomic => 1,
            Sm90Dq::Ordered => 2,
        }
    }
    /// Whether the dK/dV kernel makes dQ (the f32 workspace, no dQ kernel).
    pub fn fused(self) -> bool {
        self != Sm90Dq::Kernel
    }
    /// Whether two runs give the same bits.
    pub fn deterministic(self) -> bool {
        self != Sm90Dq::Atomic
    }
}

/// Tile of the sm_90a backward kernels (their FM_KV_BLOCK_M, FM_Q_BLOCK_N, FM_STAGES,
/// FM_DQ_MODE). Both kernels run two warpgroups of 64 stationary rows each: 128 keys per
/// dK/dV CTA, 128 query rows per dQ CTA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sm90BwdTile {
    pub head_dim: u32,
    /// Query rows per step of the dK/dV kernel (64 or 128).
    pub kv_block_m: u32,
    /// Keys per step of the dQ kernel (64 or 128).
    pub q_block_n: u32,
    /// Depth of the streamed-tile ring (2 or 3).
    pub stages: u32,
    /// How dQ is made; the fused modes need `kv_block_m` = 64, or 128 at head dim 64 with
    /// unordered reductions (`q_block_n` is then unused).
    pub dq: Sm90Dq,
}

impl Sm90BwdTile {
    /// The production tile of `head_dim`, or None where the sm_90a backward has none: the
    /// fastest of [`Sm90BwdTile::lab_tiles`] on the 16k-token sweep (H200,
    /// docs/design/attention-backward.md): 128 keys a dQ step at D=64 (64 at D=128, where
    /// 128 spills), a 3-slot ring (the ring's loads are issued under a step's last
    /// product, STAGES - 1 steps ahead: one step ahead leaves their latency exposed).
    pub fn for_head_dim(head_dim: usize) -> Option<Sm90BwdTile> {
        if !BWD_SM90_HEAD_DIMS.contains(&head_dim) {
            return None;
        }
        let (q_block_n, stages) = if head_dim == 64 { (128, 3) } else { (64, 3) };
        Some(Sm90BwdTile {
            head_dim: head_dim as u32,
            kv_block_m: 64,
            q_block_n,
            stages,
            dq: Sm90Dq::Kernel,
        })
    }
    /// The production tile of `head_dim` for `mode`: [`Sm90BwdTile::for_head_dim`] when
    /// deterministic (the dQ kernel: 7 products, and faster than the ordered fused dQ on
    /// every sweep shape measured, docs/design/attention-backward.md); the fused dQ with
    /// unordered reductions (5 products, 3-slot ring) when fast, with 128 query rows a
    /// step at D=64 (v4/v5: the fastest tile on all 12 sweep shapes).
    pub fn for_mode(head_dim: usize, mode: BwdMode) -> Option<Sm90BwdTile> {
        let det = Sm90BwdTile::for_head_dim(head_dim)?;
        Some(match mode {
            BwdMode::Deterministic => det,
            BwdMode::Fast => Sm90BwdTile {
                kv_block_m: if head_dim == 64 { 128 } else { 64 },
                stages: 3,
                dq: Sm90Dq::Atomic,
                ..det
            },
        })
    }
    /// The production tile of `head_dim` first, then the others the lab times beside it
    /// (those that spill registers are not listed: the kernel pair with 128 query rows a
    /// dK/dV step at D=64, with 128 keys a dQ step at D=128).
    pub fn lab_tiles(head_dim: usize) -> Vec<Sm90BwdTile> {
        let Some(prod) = Sm90BwdTile::for_head_dim(head_dim) else {
            return Vec::new();
        };
        let all: &[(u32, u32)] = if head_dim == 64 {
            &[(64, 2), (128, 2), (64, 3), (128, 3)]
        } else {
            &[(64, 2), (64, 3)]
        };
        let mut all: Vec<Sm90BwdTile> = all
            .iter()
            .map(|&(n, st)| Sm90BwdTile {
                q_block_n: n,
                stages: st,
                dq: Sm90Dq::Kernel,
                ..prod
            })
            .collect();
        // The fused-dQ modes (5 products), 2- and 3-slot rings; at D=64 also 128 query rows
        // a step with unordered reductions, both rings (the ordered kernel spills there).
        for dq in [Sm90Dq::Atomic, Sm90Dq::Ordered] {
            for stages in [2, 3] {
                all.push(Sm90BwdTile { stages, dq, ..prod });
            }
        }
        if head_dim == 64 {
            let fast = Sm90BwdTile::for_mode(head_dim, BwdMode::Fast).expect("head dim 64");
            all.extend([fast, Sm90BwdTile { stages: 2, ..fast }]);
        }
        let mut out = vec![prod];
        out.extend(all.into_iter().filter(|t| *t != prod && t.is_valid()));
        out
    }
    /// Whether this tile serves `class`'s masking: the ordered fused dQ needs every dQ
    /// tile's key blocks to be a prefix, which a sliding window breaks.
    pub fn serves(&self, class: &AttentionClass) -> bool {
        self.dq != Sm90Dq::Ordered || !Masking::of(&class.problem(1, 1, 1)).window
    }
    /// Whether the kernels accept this tile.
    pub fn is_valid(&self) -> bool {
        BWD_SM90_HEAD_DIMS.contains(&(self.head_dim as usize))
            && matches!(self.kv_block_m, 64 | 128)
            && matches!(self.q_block_n, 64 | 128)
            && matches!(self.stages, 2 | 3)
            && (!self.dq.fused()
                || self.kv_block_m == 64
                || (self.head_dim == 64 && self.dq == Sm90Dq::Atomic))
            && self.kv_smem_bytes() <= super::config::MAX_SMEM_SM90
            && self.q_smem_bytes() <= super::config::MAX_SMEM_SM90
    }
    /// Keys per dK/dV CTA.
    pub fn kv_block_n(&self) -> u32 {
        128
    }
    /// Query rows per dQ CTA.
    pub fn q_block_m(&self) -> u32 {
        128
    }
    /// Dynamic shared memory of the dK/dV kernel (KV_SMEM in the .cu).
    pub fn kv_smem_bytes(&self) -> u32 {
        let row = 2 * self.head_dim;
        let tiles = 2 * self.kv_block_n() * row
            + self.stages * (2 * self.kv_block_m * row + 8 * self.kv_block_m);
        // Fused dQ: two dS^T tiles (keys x query rows, 16-bit) on a 1024-byte boundary.
        let ds = if self.dq.fused() {
            tiles.div_ceil(1024) * 1024 - tiles + 2 * (2 * self.kv_block_n() * self.kv_block_m)
        } else {
            0
        };
        1024 + tiles + ds + self.barrier_bytes()
    }
    /// The mbarriers: full and empty per ring slot, one for the stationary block.
    fn barrier_bytes(&self) -> u32 {
        8 * (2 * self.stages + 1)
    }
    /// Dynamic shared memory of the dQ kernel (Q_SMEM in the .cu).
    pub fn q_smem_bytes(&self) -> u32 {
        let row = 2 * self.head_dim;
        1024 + 2 * self.q_block_m() * row
            + self.stages * 2 * self.q_block_n * row
            + self.barrier_bytes()
    }
}

/// Whether the sm_90a backward serves `class` (on a compute capability 9.0 device).
pub fn sm90_serves(class: &AttentionClass) -> bool {
    let m = Masking::of(&class.problem(1, 1, 1));
    BWD_SM90_HEAD_DIMS.contains(&class.head_dim)
        && matches!(class.dtype, DType::Bf16 | DType::F16)
        && !m.softcap
}

/// The NVRTC defines of the sm_90a backward module for `class` with `tile`.
pub fn sm90_bwd_defines(class: &AttentionClass, tile: &Sm90BwdTile) -> Vec<(String, String)> {
    let m = Masking::of(&class.problem(1, 1, 1));
    let b = |x: bool| if x { "1" } else { "0" }.to_string();
    vec![
        ("FM_HEAD_DIM".into(), tile.head_dim.to_string()),
        ("FM_DTYPE_BF16".into(), b(class.dtype == DType::Bf16)),
        ("FM_CAUSAL".into(), b(m.causal)),
        ("FM_WINDOW".into(), b(m.window)),
        ("FM_KV_BLOCK_M".into(), tile.kv_block_m.to_string()),
        ("FM_Q_BLOCK_N".into(), tile.q_block_n.to_string()),
        ("FM_STAGES".into(), tile.stages.to_string()),
        ("FM_DQ_MODE".into(), tile.dq.define().to_string()),
    ]
}

/// One class per compiled sm_90a variant (head dim × dtype × causal): the compile test's list.
pub fn all_sm90_bwd_classes() -> Vec<AttentionClass> {
    all_bwd_classes().into_iter().filter(sm90_serves).collect()
}

/// Tile configuration of the backward kernels for one head dim: the compile-time constants
/// of `flash_attn_bwd.cu` (FM_KV_WARPS, FM_KV_BLOCK_M, FM_Q_WARPS, FM_Q_BLOCK_N).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BwdTile {
    pub head_dim: u32,
    /// Warps of the dK/dV kernel; its key block is 16 per warp.
    pub kv_warps: u32,
    /// Query rows per step of the dK/dV kernel.
    pub kv_block_m: u32,
    /// Warps of the dQ kernel; its query block is 16 per warp.
    pub q_warps: u32,
    /// Keys per step of the dQ kernel.
    pub q_block_n: u32,
}

impl BwdTile {
    /// The tile of `head_dim`, or None where the backward has no kernel.
    pub fn for_head_dim(head_dim: usize) -> Option<BwdTile> {
        if !BWD_HEAD_DIMS.contains(&head_dim) {
            return None;
        }
        Some(BwdTile {
            head_dim: head_dim as u32,
            kv_warps: 4,
            // The dK/dV accumulators take 2·D/8·4 registers a thread: above D = 64, 32
            // query rows a step keep the score fragments within 255 registers.
            kv_block_m: if head_dim <= 64 { 64 } else { 32 },
            q_warps: 4,
            q_block_n: if head_dim <= 64 { 64 } else { 32 },
        })
    }
    /// Elements per shared-memory row (the kernel's PITCH).
    pub fn pitch(&self) -> u32 {
        if self.head_dim <= 64 {
            64
        } else {
            128
        }
    }
    /// Keys per dK/dV CTA.
    pub fn kv_block_n(&self) -> u32 {
        16 * self.kv_warps
    }
    /// Query rows per dQ CTA.
    pub fn q_block_m(&self) -> u32 {
        16 * self.q_warps
    }
    /// Dynamic shared memory of the dK/dV kernel (KV_SMEM in the .cu).
    pub fn kv_smem_bytes(&self) -> u32 {
        2 * self.pitch() * (2 * self.kv_block_n() + 4 * self.kv_block_m) + 16 * self.kv_block_m
    }
    /// Dynamic shared memory of the dQ kernel (Q_SMEM in the .cu).
    pub fn q_smem_bytes(&self) -> u32 {
        2 * self.pitch() * (2 * self.q_block_m() + 4 * self.q_block_n)
    }
}

/// The NVRTC defines of the backward module for `class` with `tile`.
pub fn bwd_defines(class: &AttentionClass, tile: &BwdTile) -> Vec<(String, String)> {
    let m = Masking::of(&class.problem(1, 1, 1));
    let b = |x: bool| if x { "1" } else { "0" }.to_string();
    vec![
        ("FM_HEAD_DIM".into(), tile.head_dim.to_string()),
        ("FM_DTYPE_BF16".into(), b(class.dtype == DType::Bf16)),
        ("FM_CAUSAL".into(), b(m.causal)),
        ("FM_WINDOW".into(), b(m.window)),
        ("FM_SOFTCAP".into(), b(m.softcap)),
        ("FM_KV_WARPS".into(), tile.kv_warps.to_string()),
        ("FM_KV_BLOCK_M".into(), tile.kv_block_m.to_string()),
        ("FM_Q_WARPS".into(), tile.q_warps.to_string()),
        ("FM_Q_BLOCK_N".into(), tile.q_block_n.to_string()),
    ]
}

/// One class per compiled variant (head dim × dtype × masking): the compile tests' list.
pub fn all_bwd_classes() -> Vec<AttentionClass> {
    let mut out = Vec::new();
    for &d in &BWD_HEAD_DIMS {
        for dtype in [DType::Bf16, DType::F16] {
            for (causal, window, softcap) in [
                (false, crate::problem::NO_WINDOW, 0.0),
                (true, crate::problem::NO_WINDOW, 0.0),
                (true, (16, -1), 0.0),
                (false, crate::problem::NO_WINDOW, 30.0),
                (true, crate::problem::NO_WINDOW, 30.0),
                (true, (16, -1), 30.0),
            ] {
                out.push(AttentionClass {
                    dtype,
                    head_dim: d,
                    heads_q: 1,
                    heads_kv: 1,
                    causal,
                    softmax_scale: None,
                    window,
                    softcap,
                });
            }
        }
    }
    out
}

/// FLOPs of one backward call, FlashAttention's convention: 2.5 × the forward's
/// 4·B·Hq·(unmasked pairs)·D (five GEMMs to the forward's two).
pub fn backward_flops(p: &AttentionProblem) -> f64 {
    2.5 * p.flops()
}

/// The tensors of one backward call, raw, all contiguous. q, o, d_o and dq: (batch,
/// seqlen_q, heads_q, head_dim); k, v, dk and dv: (batch, seqlen_k, heads_kv, head_dim),
/// in the class's dtype; lse: (batch, heads_q, seqlen_q) f32, the forward's natural-log
/// LSE (−inf for a row that sees no key). o and lse are what the forward wrote for these
/// q, k, v (the backward recomputes P from lse). dq, dk and dv are written entirely (every
/// element, zeros where no gradient flows) and must not overlap the inputs or each other.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackwardArgs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub o: RawTensor,
    pub d_o: RawTensor,
    pub lse: RawTensor,
    pub dq: RawTensor,
    pub dk: RawTensor,
    pub dv: RawTensor,
}

/// The backward kernels resolved for one shape class on one device.
pub struct AttentionBackwardPlan {
    class: AttentionClass,
    tile: BwdTile,
    kernel: BwdKernel,
    logits: LogitParams,
    scale: f32,
    preprocess: CudaFunction,
    dkdv: CudaFunction,
    /// The dQ kernel, or with a fused-dQ sm_90a tile the f32-to-dq conversion.
    dq: CudaFunction,
    /// Fused-dQ sm_90a tiles: zeroes the f32 dQ tiles and their semaphores.
    dq_zero: Option<CudaFunction>,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for AttentionBackwardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttentionBackwardPlan")
            .field("class", &self.class)
            .field("tile", &self.tile)
            .field("kernel", &self.kernel)
            .finish()
    }
}

/// Bytes of one f32 (batch, heads_q, seqlen_q) region of the workspace, 256-byte aligned.
fn region_bytes(batch: usize, heads_q: usize, seqlen_q: usize) -> usize {
    (batch * heads_q * seqlen_q * 4).div_ceil(256) * 256
}

impl AttentionBackwardPlan {
    /// Check that the backward serves `class` (bf16 or f16, a head dim of
    /// [`BWD_HEAD_DIMS`], a valid problem), compile or load its kernels for `dev` (compute
    /// capability 8.0 or newer) and set their shared-memory limits. On compute capability
    /// 9.0 the classes [`sm90_serves`] run the sm_90a kernels, the others the portable ones.
    /// `mode` picks between the fastest kernels and bit-identical gradients
    /// ([`BwdMode`]); off compute capability 9.0 both are the portable kernels.
    pub fn new(
        dev: &Device,
        class: AttentionClass,
        mode: BwdMode,
    ) -> Result<AttentionBackwardPlan> {
        let kernel = if dev.arch() == 90 && sm90_serves(&class) {
            Sm90BwdTile::for_mode(class.head_dim, mode).map(BwdKernel::Sm90)
        } else {
            None
        };
        Self::with_kernel(dev, class, Some(kernel.unwrap_or(BwdKernel::Portable)))
    }

    /// [`AttentionBackwardPlan::new`] with the kernels chosen by the caller (`None`: the
    /// selection of `new` in [`BwdMode::Deterministic`]): the tests check both paths, the
    /// lab times tiles. An sm_90a choice on another device, for a class it does not serve,
    /// or with an invalid tile is an error.
    pub fn with_kernel(
        dev: &Device,
        class: AttentionClass,
        kernel: Option<BwdKernel>,
    ) -> Result<AttentionBackwardPlan> {
        let problem = class.problem(1, 1, 1);
        problem.validate()?;
        let backend = "attention backward";
        if !matches!(class.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::unsupported(
                backend,
                format!("dtype {} (bf16 and f16 only)", class.dtype),
            ));
        }
        let tile = BwdTile::for_head_dim(class.head_dim).ok_or_else(|| {
            Error::unsupported(
                backend,
                format!("head dim {} (served: {:?})", class.head_dim, BWD_HEAD_DIMS),
            )
        })?;
        if class.heads_q > MAX_GRID_YZ {
            return Err(Error::unsupported(
                backend,
                format!(
                    "heads_q = {} exceeds the grid limit {MAX_GRID_YZ}",
                    class.heads_q
                ),
            ));
        }
        if dev.arch() < 80 {
            return Err(Error::unsupported(
                backend,
                format!(
                    "needs compute capability 8.0 or newer (mma.sync bf16), but {} is {}.{}",
                    dev.info().name,
                    dev.info().compute_capability.0,
                    dev.info().compute_capability.1
                ),
            ));
        }
        let kernel = match kernel {
            Some(k) => k,
            None if dev.arch() == 90 && sm90_serves(&class) => {
                BwdKernel::Sm90(Sm90BwdTile::for_head_dim(class.head_dim).unwrap())
            }
            None => BwdKernel::Portable,
        };
        let defines = bwd_defines(&class, &tile);
        let preprocess = dev.load_kernel(BWD_SOURCE, BWD_PREPROCESS_ENTRY, &defines)?;
        let (dkdv, dq, dq_zero) = match kernel {
            BwdKernel::Portable => {
                let dkdv = dev.load_kernel(BWD_SOURCE, BWD_DKDV_ENTRY, &defines)?;
                let dq = dev.load_kernel(BWD_SOURCE, BWD_DQ_ENTRY, &defines)?;
                dev.set_dynamic_shared_memory(BWD_DKDV_ENTRY, &dkdv, tile.kv_smem_bytes())?;
                dev.set_dynamic_shared_memory(BWD_DQ_ENTRY, &dq, tile.q_smem_bytes())?;
                (dkdv, dq, None)
            }
            BwdKernel::Sm90(t) => {
                if dev.arch() != 90 {
                    return Err(Error::unsupported(
                        backend,
                        format!(
                            "the sm_90a kernels need compute capability 9.0, but {} is {}.{}",
                            dev.info().name,
                            dev.info().compute_capability.0,
                            dev.info().compute_capability.1
                        ),
                    ));
                }
                if !sm90_serves(&class) {
                    return Err(Error::unsupported(
                        backend,
                        format!(
                            "the sm_90a kernels serve head dims {BWD_SM90_HEAD_DIMS:?}, no \
                             softcap; not {class:?}"
                        ),
                    ));
                }
                if !t.is_valid() || t.head_dim as usize != class.head_dim {
                    return Err(Error::invalid(format!(
                        "sm_90a backward tile {t:?} is not valid for head dim {}",
                        class.head_dim
                    )));
                }
                if !t.serves(&class) {
                    return Err(Error::unsupported(
                        backend,
                        "the ordered fused dQ does not serve sliding windows (a dQ tile's key \
                         blocks are then not a prefix); use Sm90Dq::Kernel",
                    ));
                }
                let defs = sm90_bwd_defines(&class, &t);
                let dkdv = dev.load_kernel(BWD_SM90_SOURCE, BWD_SM90_DKDV_ENTRY, &defs)?;
                dev.set_dynamic_shared_memory(BWD_SM90_DKDV_ENTRY, &dkdv, t.kv_smem_bytes())?;
                if t.dq.fused() {
                    let convert =
                        dev.load_kernel(BWD_SM90_SOURCE, BWD_SM90_DQ_CONVERT_ENTRY, &defs)?;
                    let zero = dev.load_kernel(BWD_SM90_SOURCE, BWD_SM90_DQ_ZERO_ENTRY, &defs)?;
                    (dkdv, convert, Some(zero))
                } else {
                    let dq = dev.load_kernel(BWD_SM90_SOURCE, BWD_SM90_DQ_ENTRY, &defs)?;
                    dev.set_dynamic_shared_memory(BWD_SM90_DQ_ENTRY, &dq, t.q_smem_bytes())?;
                    (dkdv, dq, None)
                }
            }
        };
        Ok(AttentionBackwardPlan {
            class,
            tile,
            kernel,
            logits: LogitParams::of(&problem),
            scale: problem.scale(),
            preprocess,
            dkdv,
            dq,
            dq_zero,
            ctx: dev.context().clone(),
        })
    }

    pub fn class(&self) -> &AttentionClass {
        &self.class
    }
    pub fn tile(&self) -> &BwdTile {
        &self.tile
    }
    /// The kernels this plan runs.
    pub fn kernel(&self) -> BwdKernel {
        self.kernel
    }
    /// Whether two calls on the same inputs give the same bits.
    pub fn deterministic(&self) -> bool {
        match self.kernel {
            BwdKernel::Portable => true,
            BwdKernel::Sm90(t) => t.dq.deterministic(),
        }
    }

    /// Bytes of the workspace a call of `batch` sequences of `seqlen_q` queries needs: the
    /// f32 Delta and log2-LSE of every query row (2 × batch · heads_q · seqlen_q · 4,
    /// rounded up to 256 bytes each), and with a fused-dQ sm_90a tile the f32 dQ of every
    /// query row (seqlen_q rounded up to 64: batch · heads_q · rows · head_dim · 4) and one
    /// semaphore per 64-row tile. Any contents: every launch writes it before reading.
    /// Launches that may run at the same time need one each.
    pub fn workspace_bytes(&self, batch: usize, seqlen_q: usize) -> usize {
        let rows = 2 * region_bytes(batch, self.class.heads_q, seqlen_q);
        match self.kernel {
            BwdKernel::Sm90(t) if t.dq.fused() => {
                let (accum, sems) = self.dq_accum_bytes(batch, seqlen_q);
                rows + accum + sems
            }
            _ => rows,
        }
    }

    /// Fused dQ: bytes of the f32 dQ tiles and of their semaphores (256-byte multiples).
    fn dq_accum_bytes(&self, batch: usize, seqlen_q: usize) -> (usize, usize) {
        let tiles = batch * self.class.heads_q * seqlen_q.div_ceil(SM90_DQ_TILE_ROWS);
        let accum = tiles * SM90_DQ_TILE_ROWS * self.class.head_dim * 4;
        (accum.div_ceil(256) * 256, (tiles * 4).div_ceil(256) * 256)
    }

    /// Check a call's tensors against the class and the kernels' rules, O(1); returns the
    /// batch size and sequence lengths. Errors name the tensor and the rule.
    pub fn check(&self, a: &BackwardArgs) -> Result<CallShape> {
        let shape = self.class.check_inputs(&a.q, &a.k, &a.v)?;
        let CallShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
        } = shape;
        let c = &self.class;
        let (hq, hkv, d, dt) = (c.heads_q, c.heads_kv, c.head_dim, c.dtype);
        for (name, t) in [("q", &a.q), ("k", &a.k), ("v", &a.v)] {
            if !t.is_contiguous() {
                return Err(Error::unsupported(
                    "attention backward",
                    format!(
                        "{name} is a strided view (strides {:?}); the backward takes contiguous \
                         tensors",
                        t.strides()
                    ),
                ));
            }
        }
        for (name, t, shape) in [
            ("o", &a.o, [b, sq, hq, d]),
            ("d_o", &a.d_o, [b, sq, hq, d]),
            ("dq", &a.dq, [b, sq, hq, d]),
            ("dk", &a.dk, [b, sk, hkv, d]),
            ("dv", &a.dv, [b, sk, hkv, d]),
        ] {
            if t.rank != 4 {
                return Err(Error::invalid(format!(
                    "{name} must be 4-D (batch, seq, heads, head_dim) but has shape {:?}",
                    t.shape()
                )));
            }
            t.expect_contiguous(name, dt, &shape, 16)?;
        }
        a.lse
            .expect_contiguous("lse", DType::F32, &[b, hq, sq], 4)?;
        for (what, value) in [("seqlen_q", sq), ("seqlen_k", sk)] {
            if value > MAX_SEQLEN {
                return Err(Error::unsupported(
                    "attention backward",
                    format!("{what} = {value} exceeds {MAX_SEQLEN}"),
                ));
            }
        }
        if b > MAX_GRID_YZ {
            return Err(Error::unsupported(
                "attention backward",
                format!("batch = {b} exceeds the grid limit {MAX_GRID_YZ}"),
            ));
        }
        for (name, t) in [("dq", &a.dq), ("dk", &a.dk), ("dv", &a.dv)] {
            for (iname, i) in [
                ("q", &a.q),
                ("k", &a.k),
                ("v", &a.v),
                ("o", &a.o),
                ("d_o", &a.d_o),
            ] {
                if t.ptr == i.ptr {
                    return Err(Error::invalid(format!(
                        "{name} and {iname} are the same buffer; gradients need their own"
                    )));
                }
            }
        }
        Ok(shape)
    }

    /// Enqueue the backward pass on `stream`: dq, dk and dv of the forward that produced
    /// `a.o` and `a.lse` from `a.q`, `a.k`, `a.v`, given `a.d_o`. Asynchronous; O(1) checks
    /// ([`AttentionBackwardPlan::check`]), no allocation; three launches.
    ///
    /// # Safety
    /// The contract of [`crate::gpu::raw`]: every address in `a` and `workspace .. workspace
    /// + workspace_bytes(batch, seqlen_q)` is live device memory of this plan's context
    ///   covering its tensor's span, the workspace is not used by a launch that may run at
    ///   the same time, and `stream` belongs to the context. The workspace is checked for
    ///   size and alignment.
    pub unsafe fn backward_raw(
        &self,
        stream: RawStream,
        a: &BackwardArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let shape = self.check(a)?;
        let (b, sq, sk) = (shape.batch, shape.seqlen_q, shape.seqlen_k);
        let hq = self.class.heads_q;
        workspace.check(self.workspace_bytes(b, sq), 16, "AttentionBackwardPlan")?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let lse2 = workspace.ptr;
        let delta = workspace.ptr + region_bytes(b, hq, sq) as u64;
        let (sq_i, sk_i, hq_i, hkv_i) =
            (sq as i32, sk as i32, hq as i32, self.class.heads_kv as i32);
        let (o, d_o, lse) = (a.o.ptr, a.d_o.ptr, a.lse.ptr);
        let pre = LaunchConfig {
            grid_dim: ((sq as u32).div_ceil(PREPROCESS_ROWS), hq as u32, b as u32),
            block_dim: (32 * PREPROCESS_ROWS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut params = [
            param(&o),
            param(&d_o),
            param(&lse),
            param(&lse2),
            param(&delta),
            param(&sq_i),
            param(&hq_i),
        ];
        launch(
            BWD_PREPROCESS_ENTRY,
            &self.preprocess,
            pre,
            stream,
            &mut params,
        )?;

        let lp = &self.logits;
        let (q, k, v) = (a.q.ptr, a.k.ptr, a.v.ptr);
        if let BwdKernel::Sm90(t) = self.kernel {
            return self.launch_sm90(&t, stream, a, (b, sq, sk), lse2, delta);
        }
        let t = &self.tile;
        let kv = LaunchConfig {
            grid_dim: (
                (sk as u32).div_ceil(t.kv_block_n()),
                self.class.heads_kv as u32,
                b as u32,
            ),
            block_dim: (32 * t.kv_warps, 1, 1),
            shared_mem_bytes: t.kv_smem_bytes(),
        };
        let args = PortableBwdLaunch {
            q,
            k,
            v,
            d_o,
            lse2,
            delta,
            seqlen_q: sq_i,
            seqlen_k: sk_i,
            heads_q: hq_i,
            heads_kv: hkv_i,
            scale: self.scale,
            logits: *lp,
            cu_seqlens: None,
        };
        args.launch(
            BWD_DKDV_ENTRY,
            &self.dkdv,
            kv,
            stream,
            &[a.dk.ptr, a.dv.ptr],
        )?;

        let qc = LaunchConfig {
            grid_dim: ((sq as u32).div_ceil(t.q_block_m()), hq as u32, b as u32),
            block_dim: (32 * t.q_warps, 1, 1),
            shared_mem_bytes: t.q_smem_bytes(),
        };
        args.launch(BWD_DQ_ENTRY, &self.dq, qc, stream, &[a.dq.ptr])
    }
}

/// The portable kernels' ABI (`flash_attn_bwd.cu`): the arguments the dK/dV and the dQ
/// kernel take, in their order, declared once for the dense and the varlen plans. The
/// kernels' lists are the inputs, then the kernel's outputs (dk, dv or dq), then the
/// shapes, the logit parameters and, built with FM_VARLEN, the two offset arrays
/// (`FM_CU_PARAMS`).
pub(super) struct PortableBwdLaunch {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub d_o: u64,
    pub lse2: u64,
    pub delta: u64,
    /// Sq and Sk (dense) or total_q and total_k (varlen).
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub heads_q: i32,
    pub heads_kv: i32,
    pub scale: f32,
    pub logits: LogitParams,
    /// Varlen: cu_seqlens_q and cu_seqlens_k.
    pub cu_seqlens: Option<(u64, u64)>,
}

impl PortableBwdLaunch {
    /// Enqueue `entry` (the dK/dV kernel with `outputs` = [dk, dv], the dQ kernel with
    /// [dq]) on `stream`.
    ///
    /// # Safety
    /// As [`launch`]: `func` is `entry` of a module built for this ABI (varlen exactly when
    /// `cu_seqlens` is set), every address is live device memory covering its span.
    pub unsafe fn launch(
        &self,
        entry: &str,
        func: &CudaFunction,
        cfg: LaunchConfig,
        stream: RawStream,
        outputs: &[u64],
    ) -> Result<()> {
        debug_assert!(matches!(outputs.len(), 1 | 2), "[dk, dv] or [dq]");
        let lp = &self.logits;
        // At most 6 inputs + 2 outputs + 9 scalars + 2 offsets, on the stack (no allocation
        // per call).
        let mut params = [std::ptr::null_mut(); 19];
        let mut n = 0;
        let mut push = |p| {
            params[n] = p;
            n += 1;
        };
        for p in [
            &self.q,
            &self.k,
            &self.v,
            &self.d_o,
            &self.lse2,
            &self.delta,
        ] {
            push(param(p));
        }
        for p in outputs {
            push(param(p));
        }
        for p in [
            &self.seqlen_q,
            &self.seqlen_k,
            &self.heads_q,
            &self.heads_kv,
        ] {
            push(param(p));
        }
        for p in [&self.scale, &lp.scale_log2, &lp.softcap_log2] {
            push(param(p));
        }
        push(param(&lp.window_left));
        push(param(&lp.window_right));
        if let Some((cu_q, cu_k)) = &self.cu_seqlens {
            push(param(cu_q));
            push(param(cu_k));
        }
        launch(entry, func, cfg, stream, &mut params[..n])
    }
}

impl AttentionBackwardPlan {
    /// The dK/dV and dQ launches of the sm_90a kernels (after the preprocess).
    ///
    /// # Safety
    /// As [`AttentionBackwardPlan::backward_raw`], whose checks `a` has passed.
    unsafe fn launch_sm90(
        &self,
        t: &Sm90BwdTile,
        stream: RawStream,
        a: &BackwardArgs,
        (b, sq, sk): (usize, usize, usize),
        lse2: u64,
        delta: u64,
    ) -> Result<()> {
        let (sq_i, sk_i) = (sq as i32, sk as i32);
        let (hq_i, hkv_i) = (self.class.heads_q as i32, self.class.heads_kv as i32);
        let (q, k, v, d_o) = (a.q.ptr, a.k.ptr, a.v.ptr, a.d_o.ptr);
        let (dk, dv, dq) = (a.dk.ptr, a.dv.ptr, a.dq.ptr);
        let scale_log2 = self.logits.scale_log2;
        // Fused dQ: the f32 tiles and their semaphores follow lse2 and delta.
        let (dq_accum, dq_sem) = if t.dq.fused() {
            let accum = delta + region_bytes(b, self.class.heads_q, sq) as u64;
            let (accum_bytes, sem_bytes) = self.dq_accum_bytes(b, sq);
            let sem = accum + accum_bytes as u64;
            let zero = self
                .dq_zero
                .as_ref()
                .expect("fused tiles load the zero kernel");
            let n4 = (accum_bytes / 16) as i64;
            let n_sem = (sem_bytes / 4) as i32;
            let zc = LaunchConfig {
                grid_dim: (((n4 as u64).div_ceil(256).min(4096)) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut params = [param(&accum), param(&n4), param(&sem), param(&n_sem)];
            launch(BWD_SM90_DQ_ZERO_ENTRY, zero, zc, stream, &mut params)?;
            (accum, sem)
        } else {
            (0u64, 0u64)
        };
        let kblocks = (sk as u32).div_ceil(t.kv_block_n());
        let hkv = self.class.heads_kv as u32;
        // Ordered dQ: key blocks slowest (the kernel's comment says why).
        let grid_dim = if t.dq == Sm90Dq::Ordered {
            (hkv * b as u32, kblocks, 1)
        } else {
            (kblocks, hkv, b as u32)
        };
        let kv = LaunchConfig {
            grid_dim,
            block_dim: (256, 1, 1),
            shared_mem_bytes: t.kv_smem_bytes(),
        };
        let mut params = [
            param(&q),
            param(&k),
            param(&v),
            param(&d_o),
            param(&lse2),
            param(&delta),
            param(&dk),
            param(&dv),
            param(&sq_i),
            param(&sk_i),
            param(&hq_i),
            param(&hkv_i),
            param(&self.scale),
            param(&scale_log2),
            param(&dq_accum),
            param(&dq_sem),
            param(&self.logits.window_left),
            param(&self.logits.window_right),
        ];
        launch(BWD_SM90_DKDV_ENTRY, &self.dkdv, kv, stream, &mut params)?;
        if t.dq.fused() {
            let cc = LaunchConfig {
                grid_dim: (
                    sq.div_ceil(SM90_DQ_TILE_ROWS) as u32,
                    self.class.heads_q as u32,
                    b as u32,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut params = [
                param(&dq_accum),
                param(&dq),
                param(&sq_i),
                param(&hq_i),
                param(&self.scale),
            ];
            return launch(BWD_SM90_DQ_CONVERT_ENTRY, &self.dq, cc, stream, &mut params);
        }
        let qc = LaunchConfig {
            grid_dim: (
                (sq as u32).div_ceil(t.q_block_m()),
                self.class.heads_q as u32,
                b as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: t.q_smem_bytes(),
        };
        let mut params = [
            param(&q),
            param(&k),
            param(&v),
            param(&d_o),
            param(&lse2),
            param(&delta),
            param(&dq),
            param(&sq_i),
            param(&sk_i),
            param(&hq_i),
            param(&hkv_i),
            param(&self.scale),
            param(&scale_log2),
            param(&self.logits.window_left),
            param(&self.logits.window_right),
        ];
        launch(BWD_SM90_DQ_ENTRY, &self.dq, qc, stream, &mut params)
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<AttentionBackwardPlan>();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_sm80_shared_memory() {
        for &d in &BWD_HEAD_DIMS {
            let t = BwdTile::for_head_dim(d).unwrap();
            assert!(
                t.kv_smem_bytes() <= super::super::config::MAX_SMEM_SM80,
                "{t:?}"
            );
            assert!(
                t.q_smem_bytes() <= super::super::config::MAX_SMEM_SM80,
                "{t:?}"
            );
            assert_eq!(t.kv_block_m % 16, 0);
            assert_eq!(t.q_block_n % 16, 0);
        }
        assert!(BwdTile::for_head_dim(256).is_none());
        assert!(BwdTile::for_head_dim(80).is_none());
    }

    #[test]
    fn defines_follow_the_masking() {
        let c = all_bwd_classes();
        assert_eq!(c.len(), BWD_HEAD_DIMS.len() * 2 * 6);
        let get = |d: &[(String, String)], k: &str| {
            d.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        let t = BwdTile::for_head_dim(64).unwrap();
        let mut w = c[0];
        w.window = (8, 4);
        w.causal = false;
        let d = bwd_defines(&w, &t);
        assert_eq!(get(&d, "FM_CAUSAL"), "1");
        assert_eq!(get(&d, "FM_WINDOW"), "1");
        assert_eq!(get(&d, "FM_SOFTCAP"), "0");
        let d = bwd_defines(&c[0], &t);
        assert_eq!(get(&d, "FM_CAUSAL"), "0");
        assert_eq!(get(&d, "FM_WINDOW"), "0");
        let mut p = AttentionProblem::new(1, 2, 100, 64, true, DType::Bf16);
        assert_eq!(backward_flops(&p), 2.5 * p.flops());
        p.causal = false;
        assert_eq!(backward_flops(&p), 2.5 * 4.0 * 2.0 * 100.0 * 100.0 * 64.0);
    }
}
