//! MoE plans: the whole MoE layer for one shape class, resolved once, then enqueued on the
//! caller's stream over the caller's weights, activations and workspace.
//!
//! [`MoePlan::new`] does the slow work once per [`MoeClass`]: for every token count
//! `1..=max_tokens` it resolves the kernels [`config::select`] and the sm_90 path choice
//! ([`gemm_sm90::select_path`], or the lab's explicit override in [`MoePlan::with_gemm_path`]) pick,
//! compiles or loads each distinct kernel once, and sets the shared-memory attributes. The
//! choices depend on the token count (router logits kernel, grouped-GEMM tile regime,
//! sm_90 or portable GEMMs), so the plan keeps them as a short table of token ranges
//! ([`MoePlan::token_ranges`]) and a call picks its row by a scan of that table.
//!
//! A call ([`MoePlan::forward_raw`]) does O(1) checks, encodes the sm_90 GEMMs' four TMA
//! tensor maps when that path runs (host-only driver calls: the maps hold the weights' and
//! the workspace's addresses), and enqueues 8 kernels (+1 gather on the sm_90 path, +2 for
//! a shared expert) on the stream it is given: no allocation, no synchronisation, no
//! compile, no file or environment access. It can be captured in a CUDA graph.
//!
//! # Layouts (row-major, contiguous, 16-bit elements of the class's dtype)
//! - `x [T, H]`, `out [T, H]`;
//! - `router [H, E]`;
//! - `w13 [E, H, 2I]`: for expert e, columns `[0, I)` are the gate projection and
//!   `[I, 2I)` the up projection (two blocks, not interleaved): `h = silu(x·gate) ⊙ (x·up)`;
//! - `w2 [E, I, H]`;
//! - shared expert (when the class has one): `shared_w13 [H, 2I]` (same gate | up split),
//!   `shared_w2 [I, H]`.
//!
//! These are the layouts every kernel path reads (the sm_90 path's TMA maps included), so
//! no repack is needed. A checkpoint stored PyTorch-style (`gate_proj.weight [I, H]`,
//! `up_proj.weight [I, H]`, `down_proj.weight [H, I]`) is transposed once at load time.
//! Routing outputs stay on the device ([`RoutingArgs`]): `topk_ids [T, k]` u32 (descending
//! score), `topk_w [T, k]` f32, `counts [E]` u32, `losses [2]` f32 = (aux, z), computed on
//! the device (block 0 of `moe_permute`; `moe_router_losses` in the router-only stage).
//!
//! # Alignment
//! 16-bit tensors start on 16-byte boundaries (the sm_90 path reads the weights through
//! TMA and the token gather copies 16-byte chunks; `hidden` and `intermediate` are
//! multiples of 32 for every class the plan accepts); f32 and u32 tensors are 4-byte
//! aligned. The workspace starts on a 256-byte boundary (any cudaMalloc result).
//!
//! # Workspace
//! Every intermediate lives in one caller-provided workspace of
//! [`MoePlan::workspace_bytes`]`(tokens)` bytes, carved into 256-byte aligned regions
//! ([`WorkspaceLayout`]). No kernel of the pipeline accumulates into memory or keeps state
//! between launches (no atomics, every intermediate element is written before it is
//! read), so the workspace needs no zeroing and a graph replay is correct as is. Launches
//! that may run at the same time (on different streams) need one workspace each.
//!
//! The plan also owns one small read-only device table, written once when it is built:
//! `[0, 1, …, max_tokens)` (the shared expert's token list) and the pairs `[0, T]` for
//! every T (the offsets of the one-group GEMMs: router logits and shared expert), so that
//! a call writes no host data to the device.
//!
//! Determinism: every reduction has a fixed order (contract in [`config`]); the same
//! inputs give bit-identical outputs on every call, stream and graph replay.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::config::{self, MoeKernel, BACKEND};
use super::gemm_config;
use super::gemm_sm90::{self, GemmPath};
use super::launch::{gemm_launch_config, pipeline_configs};
use crate::dtype::DType;
use crate::error::{Error, Result};
pub use crate::gpu::raw::RawU32;
use crate::gpu::raw::{self, param, Element, RawStream, RawTensor, RawWorkspace};
use crate::gpu::tensor_map::{self, TensorMap};
use crate::gpu::{Device, Workspace};
use crate::problem::{MoeProblem, Scoring};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
};
use std::ffi::c_void;
use std::sync::Arc;

/// What an enqueue runs: the whole layer, or the router stage alone (timed by the lab).
#[derive(Clone, Copy)]
enum Stages {
    Layer,
    Router,
}

/// Alignment of every workspace region and of the workspace base.
pub const WORKSPACE_ALIGN: usize = 256;

/// What a plan is built for: everything about an MoE layer call except the token count,
/// which each call takes from `x` (1..=max_tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeClass {
    /// Storage of x, weights and out: bf16 or f16 (fp32 accumulation).
    pub dtype: DType,
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    /// Renormalise the k selected weights to sum 1.
    pub renormalize: bool,
    /// A shared expert (intermediate size `intermediate`) added to every token, weight 1.
    pub shared_expert: bool,
    /// Largest token count of a call (sizes the tables; the workspace is per call).
    pub max_tokens: usize,
}

impl MoeClass {
    /// The problem of one call of this class.
    pub fn problem(&self, tokens: usize) -> MoeProblem {
        MoeProblem {
            tokens,
            hidden: self.hidden,
            intermediate: self.intermediate,
            experts: self.experts,
            top_k: self.top_k,
            scoring: self.scoring,
            renormalize: self.renormalize,
            dtype: self.dtype,
            shared_expert: self.shared_expert,
        }
    }

    /// The checks of a call that need no GPU, O(1): every tensor of `a` against the class
    /// (rank, shape, dtype, alignment, contiguity; the shared expert's weights exactly when
    /// the class has one) and 1..=max_tokens tokens. Returns the token count; errors name
    /// the tensor and the rule.
    pub fn check_args(&self, a: &MoeArgs) -> Result<usize> {
        self.check_args_for(a, self.experts)
    }

    /// [`MoeClass::check_args`] with `w13` / `w2` holding `weight_experts` experts (an
    /// expert-parallel rank holds only its own).
    pub(crate) fn check_args_for(&self, a: &MoeArgs, weight_experts: usize) -> Result<usize> {
        let c = self;
        let (h, i, e, k, dt) = (c.hidden, c.intermediate, c.experts, c.top_k, c.dtype);
        if a.x.rank != 2 {
            return Err(Error::invalid(format!(
                "x must be 2-D [tokens, hidden] but has shape {:?}",
                a.x.shape()
            )));
        }
        let t = a.x.shape[0];
        if t == 0 || t > c.max_tokens {
            return Err(Error::invalid(format!(
                "x has {t} tokens but this MoE class takes 1..={} (MoeClass::max_tokens)",
                c.max_tokens
            )));
        }
        a.x.expect_contiguous("x", dt, &[t, h], 16)?;
        a.router.expect_contiguous("router", dt, &[h, e], 16)?;
        a.w13
            .expect_contiguous("w13", dt, &[weight_experts, h, 2 * i], 16)?;
        a.w2.expect_contiguous("w2", dt, &[weight_experts, i, h], 16)?;
        match (c.shared_expert, &a.shared_w13, &a.shared_w2) {
            (true, Some(w13), Some(w2)) => {
                w13.expect_contiguous("shared_w13", dt, &[h, 2 * i], 16)?;
                w2.expect_contiguous("shared_w2", dt, &[i, h], 16)?;
            }
            (false, None, None) => {}
            (true, _, _) => {
                return Err(Error::invalid(
                    "shared_w13 and shared_w2 are required: the plan's class has a shared expert",
                ))
            }
            (false, _, _) => {
                return Err(Error::invalid(
                    "shared_w13 / shared_w2 given but the plan's class has no shared expert",
                ))
            }
        }
        a.out.expect_contiguous("out", dt, &[t, h], 16)?;
        a.routing.topk_ids.expect("topk_ids", t * k)?;
        a.routing
            .topk_w
            .expect_contiguous("topk_w", DType::F32, &[t, k], 4)?;
        a.routing.counts.expect("counts", e)?;
        a.routing
            .losses
            .expect_contiguous("losses", DType::F32, &[2], 4)?;
        Ok(t)
    }

    /// The class of `p` with room for `max_tokens` tokens per call.
    pub fn of_problem(p: &MoeProblem, max_tokens: usize) -> MoeClass {
        MoeClass {
            dtype: p.dtype,
            hidden: p.hidden,
            intermediate: p.intermediate,
            experts: p.experts,
            top_k: p.top_k,
            scoring: p.scoring,
            renormalize: p.renormalize,
            shared_expert: p.shared_expert,
            max_tokens,
        }
    }
}

/// Where the router's results go (device memory, nothing is copied to the host).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoutingArgs {
    /// [T, k] expert ids, descending score (ties: lower index).
    pub topk_ids: RawU32,
    /// [T, k] f32 combine weights.
    pub topk_w: RawTensor,
    /// [E] slots routed to each expert (sums to T·k).
    pub counts: RawU32,
    /// [2] f32: (aux load-balancing loss, router z-loss).
    pub losses: RawTensor,
}

/// The tensors of one call, raw (layouts in the module doc; all contiguous).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeArgs {
    /// [T, H]; T = shape[0] is the call's token count.
    pub x: RawTensor,
    /// [H, E]
    pub router: RawTensor,
    /// [E, H, 2I] (gate | up)
    pub w13: RawTensor,
    /// [E, I, H]
    pub w2: RawTensor,
    /// [H, 2I], exactly when the class has a shared expert.
    pub shared_w13: Option<RawTensor>,
    /// [I, H], exactly when the class has a shared expert.
    pub shared_w2: Option<RawTensor>,
    /// [T, H]
    pub out: RawTensor,
    pub routing: RoutingArgs,
}

/// Byte offsets of the intermediates in a call's workspace (each 256-byte aligned) and
/// its total size. T tokens, R = T·k routed rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceLayout {
    /// [T, E] f32 router logits.
    pub logits: usize,
    /// [T, E] f32 normalised scores (for the aux loss).
    pub probs: usize,
    /// [T] f32 logsumexp of the logits (for the z-loss).
    pub lse: usize,
    /// [E] f32 Σ_t probs.
    pub prob_sum: usize,
    /// [1] f32 Σ_t lse².
    pub lse_sq_sum: usize,
    /// [E + 1] u32 row offsets of the experts' groups.
    pub offsets: usize,
    /// [R] u32 token of each permuted row.
    pub row_token: usize,
    /// [R] u32 slot (t·k + s) of each permuted row.
    pub row_slot: usize,
    /// [R] u32 permuted row of each slot.
    pub slot_row: usize,
    /// [R, I] 16-bit SwiGLU activations.
    pub h: usize,
    /// [R, H] f32 expert outputs.
    pub y: usize,
    /// [R, H] 16-bit gathered tokens (sm_90 path only).
    pub x_perm: Option<usize>,
    /// [T, I] 16-bit and [T, H] f32 (shared expert only).
    pub shared_h: Option<usize>,
    pub shared_y: Option<usize>,
    pub bytes: usize,
}

fn too_big(what: &str) -> Error {
    Error::invalid(format!(
        "the MoE workspace for {what} exceeds the address space"
    ))
}

/// Appends regions to a workspace, 256-byte aligned, overflow checked.
struct Carver {
    end: usize,
}

impl Carver {
    fn take(&mut self, elems: usize, elem_bytes: usize) -> Result<usize> {
        let start = self
            .end
            .checked_next_multiple_of(WORKSPACE_ALIGN)
            .ok_or_else(|| too_big("this shape"))?;
        let bytes = elems
            .checked_mul(elem_bytes)
            .ok_or_else(|| too_big("this shape"))?;
        self.end = start
            .checked_add(bytes.max(1))
            .ok_or_else(|| too_big("this shape"))?;
        Ok(start)
    }
}

impl WorkspaceLayout {
    /// The layout of a call of `class` with `tokens` tokens (`sm90`: the sm_90 GEMM path
    /// runs, which needs the gathered tokens).
    pub fn new(class: &MoeClass, tokens: usize, sm90: bool) -> Result<WorkspaceLayout> {
        let (h, i, e, el) = (
            class.hidden,
            class.intermediate,
            class.experts,
            class.dtype.size_bytes(),
        );
        let rows = tokens
            .checked_mul(class.top_k)
            .ok_or_else(|| too_big("tokens × top_k"))?;
        let te = tokens.checked_mul(e).ok_or_else(|| too_big("T × E"))?;
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(|| too_big("this shape"));
        let mut c = Carver { end: 0 };
        let logits = c.take(te, 4)?;
        let probs = c.take(te, 4)?;
        let lse = c.take(tokens, 4)?;
        let prob_sum = c.take(e, 4)?;
        let lse_sq_sum = c.take(1, 4)?;
        let offsets = c.take(e + 1, 4)?;
        let row_token = c.take(rows, 4)?;
        let row_slot = c.take(rows, 4)?;
        let slot_row = c.take(rows, 4)?;
        let h_off = c.take(mul(rows, i)?, el)?;
        let y = c.take(mul(rows, h)?, 4)?;
        let x_perm = if sm90 {
            Some(c.take(mul(rows, h)?, el)?)
        } else {
            None
        };
        let (shared_h, shared_y) = if class.shared_expert {
            (
                Some(c.take(mul(tokens, i)?, el)?),
                Some(c.take(mul(tokens, h)?, 4)?),
            )
        } else {
            (None, None)
        };
        let bytes = c
            .end
            .checked_next_multiple_of(WORKSPACE_ALIGN)
            .ok_or_else(|| too_big("this shape"))?;
        Ok(WorkspaceLayout {
            logits,
            probs,
            lse,
            prob_sum,
            lse_sq_sum,
            offsets,
            row_token,
            row_slot,
            slot_row,
            h: h_off,
            y,
            x_perm,
            shared_h,
            shared_y,
            bytes,
        })
    }
}

/// The maximal token ranges `[first, last]` of `lo..=hi` on which `key` is constant, with
/// their keys, found by bisection: O(pieces · log(hi − lo)) evaluations. Correct when each
/// component of the key changes monotonically with the token count (never returns to a
/// value it left), which holds for every choice [`config::select`] and
/// [`gemm_sm90::select_path`] make (thresholds on tokens or rows per expert); a unit test
/// checks it against an exhaustive scan.
pub(crate) fn token_pieces<K: PartialEq>(
    lo: usize,
    hi: usize,
    mut key: impl FnMut(usize) -> Result<K>,
) -> Result<Vec<(usize, usize, K)>> {
    let mut out = Vec::new();
    let mut first = lo;
    let mut k_first = key(lo)?;
    loop {
        // Last token with the key of `first`: invariant key(a) == k_first != key(b).
        let k_hi = key(hi)?;
        let last = if k_hi == k_first {
            hi
        } else {
            let (mut a, mut b) = (first, hi);
            while b - a > 1 {
                let m = a + (b - a) / 2;
                if key(m)? == k_first {
                    a = m;
                } else {
                    b = m;
                }
            }
            a
        };
        out.push((first, last, k_first));
        if last == hi {
            return Ok(out);
        }
        first = last + 1;
        k_first = key(first)?;
    }
}

/// What [`MoePlan::enqueue_front`] resolved for a call.
pub(crate) struct Front {
    pub tokens: usize,
    pub ws: WorkspaceLayout,
    pub cfgs: [LaunchConfig; 7],
}

/// One range of token counts with the same kernels (indices into `MoePlan::loaded`).
#[derive(Debug, Clone)]
struct Bucket {
    first: usize,
    last: usize,
    logits: usize,
    gemm13: usize,
    gemm2: usize,
    /// (gemm13, gemm2) of the sm_90 path, or None: the portable kernels.
    sm90: Option<(usize, usize)>,
}

/// A token range of a plan and the kernels its calls run (for reports and tests).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRange {
    pub first: usize,
    pub last: usize,
    /// The router-logits kernel's entry.
    pub logits: &'static str,
    /// Report line of the grouped-GEMM path (as [`MoePlan::gemm_path`] at `first`).
    pub gemm_path: String,
}

/// The MoE layer resolved for a shape class on one device.
pub struct MoePlan {
    class: MoeClass,
    min_tokens: usize,
    ctx: Arc<CudaContext>,
    /// Compute capability and the path override the plan was built with (to word the
    /// portable path's reason in reports).
    arch: u32,
    path: Option<String>,
    /// Every distinct kernel of the plan, loaded once.
    loaded: Vec<(MoeKernel, CudaFunction)>,
    topk: usize,
    stats: usize,
    losses: usize,
    permute: usize,
    combine: usize,
    gather: Option<usize>,
    buckets: Vec<Bucket>,
    /// `[0, max_tokens)` then the pairs `[0, T]` for T = 1..=max_tokens (module doc).
    _tables: CudaSlice<u32>,
    iota_addr: u64,
    pairs_addr: u64,
}

impl std::fmt::Debug for MoePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoePlan")
            .field("class", &self.class)
            .field("token_ranges", &self.token_ranges())
            .finish()
    }
}

fn load(dev: &Device, loaded: &mut Vec<(MoeKernel, CudaFunction)>, k: &MoeKernel) -> Result<usize> {
    if let Some(i) = loaded.iter().position(|(l, _)| l == k) {
        return Ok(i);
    }
    if dev.arch() < k.min_arch {
        return Err(Error::unsupported(
            k.entry,
            format!(
                "needs compute capability {}.{} or newer but {} is {}.{}",
                k.min_arch / 10,
                k.min_arch % 10,
                dev.info().name,
                dev.info().compute_capability.0,
                dev.info().compute_capability.1
            ),
        ));
    }
    let f = dev.load_kernel(k.source_file, k.entry, &k.defines)?;
    dev.set_dynamic_shared_memory(k.entry, &f, k.shared_mem_bytes)?;
    loaded.push((k.clone(), f));
    Ok(loaded.len() - 1)
}

/// What a token count selects: the seven pipeline kernels and the sm_90 (gemm13, gemm2)
/// kernels when that path runs (None: the portable ones). The portable path's reason is
/// left out: it quotes the rows per expert, which change with every token count.
type Selection = (Vec<MoeKernel>, Option<(MoeKernel, MoeKernel)>);

fn selection(class: &MoeClass, tokens: usize, arch: u32, path: Option<&str>) -> Result<Selection> {
    let p = class.problem(tokens);
    let kernels = config::select(&p)?;
    let sm90 = match gemm_sm90::select_path(&p, arch, path)? {
        GemmPath::Sm90(k13, k2) => Some((k13, k2)),
        GemmPath::Portable(_) => None,
    };
    Ok((kernels, sm90))
}

/// The token ranges of `class` over `min_tokens..=max_tokens` and their selections, for
/// compute capability `arch` (pure: no device).
pub(crate) fn plan_selections(
    class: &MoeClass,
    min_tokens: usize,
    arch: u32,
    path: Option<&str>,
) -> Result<Vec<(usize, usize, Selection)>> {
    class.problem(1).validate()?;
    if min_tokens == 0 || min_tokens > class.max_tokens {
        return Err(Error::invalid(format!(
            "an MoE plan needs 1 <= min_tokens ({min_tokens}) <= max_tokens ({})",
            class.max_tokens
        )));
    }
    // Limits at the largest call first: a clear error before any bisection.
    config::check_limits(&class.problem(class.max_tokens))?;
    token_pieces(min_tokens, class.max_tokens, |t| {
        selection(class, t, arch, path)
    })
}

impl MoePlan {
    /// Resolve, compile and load every kernel `class` needs on `dev` for 1..=max_tokens
    /// tokens, the grouped-GEMM path chosen per token range ([`gemm_sm90::select_path`]).
    pub fn new(dev: &Device, class: MoeClass) -> Result<MoePlan> {
        Self::with_gemm_path(dev, class, 1, None)
    }

    /// Like [`MoePlan::new`] for calls of `min_tokens..=max_tokens` tokens only (fewer
    /// kernels to compile; the lab's fixed-shape runner uses one token count), with the
    /// path override given explicitly ("auto", "portable", "sm90", "sm90-bm64",
    /// "sm90-bm128"; None is auto).
    pub fn with_gemm_path(
        dev: &Device,
        class: MoeClass,
        min_tokens: usize,
        path: Option<&str>,
    ) -> Result<MoePlan> {
        let pieces = plan_selections(&class, min_tokens, dev.arch(), path)?;
        let mut loaded = Vec::new();
        let first = &pieces[0].2 .0;
        let topk = load(dev, &mut loaded, &first[config::K_TOPK])?;
        let stats = load(dev, &mut loaded, &first[config::K_STATS])?;
        let losses = load(dev, &mut loaded, &config::losses_kernel())?;
        let permute = load(dev, &mut loaded, &first[config::K_PERMUTE])?;
        let combine = load(dev, &mut loaded, &first[config::K_COMBINE])?;
        let mut gather = None;
        let mut buckets = Vec::with_capacity(pieces.len());
        for (first_t, last_t, (kernels, path)) in &pieces {
            for (i, fixed) in [
                (config::K_TOPK, topk),
                (config::K_STATS, stats),
                (config::K_PERMUTE, permute),
                (config::K_COMBINE, combine),
            ] {
                // These depend on the class only; a change would be a selection bug.
                if kernels[i] != loaded[fixed].0 {
                    return Err(Error::unsupported(
                        BACKEND,
                        format!("{} changes with the token count", kernels[i].entry),
                    ));
                }
            }
            let rows = last_t * class.top_k;
            let sm90 = match path {
                Some((k13, k2)) => {
                    // The tensor maps' shapes at the largest call of the range (every
                    // other call has fewer rows, within the same limits).
                    gemm_sm90::a_layout(rows, class.hidden, k13.block_m).check("x_perm")?;
                    gemm_sm90::b_layout(class.experts, class.hidden, 2 * class.intermediate)
                        .check("w13")?;
                    gemm_sm90::a_layout(rows, class.intermediate, k2.block_m).check("h")?;
                    gemm_sm90::b_layout(class.experts, class.intermediate, class.hidden)
                        .check("w2")?;
                    gather = Some(load(dev, &mut loaded, &gemm_sm90::gather_kernel())?);
                    Some((load(dev, &mut loaded, k13)?, load(dev, &mut loaded, k2)?))
                }
                None => None,
            };
            buckets.push(Bucket {
                first: *first_t,
                last: *last_t,
                logits: load(dev, &mut loaded, &kernels[config::K_LOGITS])?,
                gemm13: load(dev, &mut loaded, &kernels[config::K_GEMM13])?,
                gemm2: load(dev, &mut loaded, &kernels[config::K_GEMM2])?,
                sm90,
            });
            // Every range's workspace and launch geometry must be computable.
            WorkspaceLayout::new(&class, *last_t, sm90.is_some())?;
        }
        let n = class.max_tokens;
        if n > u32::MAX as usize / 2 {
            return Err(Error::unsupported(
                BACKEND,
                format!("max_tokens = {n} does not fit the kernels' 32-bit row indices"),
            ));
        }
        let mut table: Vec<u32> = (0..n as u32).collect();
        table.reserve(2 * n);
        for t in 1..=n as u32 {
            table.extend([0, t]);
        }
        let stream = dev.stream();
        let tables = stream.clone_htod(&table).map_err(|e| {
            Error::cuda(
                format!(
                    "uploading the MoE plan's token tables ({} × u32)",
                    table.len()
                ),
                e,
            )
        })?;
        // Plan-time only: the tables must be on the device before any stream reads them.
        stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize (MoE plan tables)", e))?;
        let base = tables.device_ptr(stream).0;
        Ok(MoePlan {
            class,
            min_tokens,
            ctx: dev.context().clone(),
            arch: dev.arch(),
            path: path.map(str::to_string),
            loaded,
            topk,
            stats,
            losses,
            permute,
            combine,
            gather,
            buckets,
            _tables: tables,
            iota_addr: base,
            pairs_addr: base + 4 * n as u64,
        })
    }

    pub fn class(&self) -> &MoeClass {
        &self.class
    }
    /// Smallest token count a call may have (1 unless built with a narrower range).
    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }

    /// The token ranges and what each runs.
    pub fn token_ranges(&self) -> Vec<TokenRange> {
        self.buckets
            .iter()
            .map(|b| TokenRange {
                first: b.first,
                last: b.last,
                logits: self.loaded[b.logits].0.entry,
                gemm_path: self.describe_path(b, b.first),
            })
            .collect()
    }

    fn bucket(&self, tokens: usize) -> Result<&Bucket> {
        self.buckets
            .iter()
            .find(|b| b.first <= tokens && tokens <= b.last)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "{tokens} tokens: this MoE plan takes {}..={} tokens per call \
                     (MoeClass::max_tokens)",
                    self.min_tokens, self.class.max_tokens
                ))
            })
    }

    /// Report line of a range's GEMM path; the portable path's reason is worded for
    /// `tokens` (it quotes the rows per expert).
    fn describe_path(&self, b: &Bucket, tokens: usize) -> String {
        let k = |i: usize| &self.loaded[i].0;
        match b.sm90 {
            Some((g13, g2)) => format!(
                "grouped GEMMs: {} (BM {} BN {}) + {} (BM {} BN {}), wgmma/TMA",
                k(g13).entry,
                k(g13).block_m,
                k(g13).block_n,
                k(g2).entry,
                k(g2).block_m,
                k(g2).block_n
            ),
            None => {
                let why = match gemm_sm90::select_path(
                    &self.class.problem(tokens),
                    self.arch,
                    self.path.as_deref(),
                ) {
                    Ok(GemmPath::Portable(why)) => why,
                    Ok(GemmPath::Sm90(..)) => String::new(),
                    Err(e) => e.to_string(),
                };
                format!(
                    "grouped GEMMs: {} (BM {} BN {}) + {} (BM {} BN {}), mma.sync ({why})",
                    k(b.gemm13).entry,
                    k(b.gemm13).block_m,
                    k(b.gemm13).block_n,
                    k(b.gemm2).entry,
                    k(b.gemm2).block_m,
                    k(b.gemm2).block_n,
                )
            }
        }
    }

    /// Which grouped-GEMM kernels a call of `tokens` tokens runs for the routed experts,
    /// for reports: the sm_90 entries, or the portable ones with the reason the sm_90 path
    /// was not taken.
    pub fn gemm_path(&self, tokens: usize) -> Result<String> {
        Ok(self.describe_path(self.bucket(tokens)?, tokens))
    }

    /// The seven kernels of [`config::select`]'s pipeline order that a call of `tokens`
    /// tokens runs (the routed experts' GEMMs may be the sm_90 ones instead: see
    /// [`MoePlan::gemm_path`]; the shared expert always runs these portable GEMMs).
    pub fn kernels(&self, tokens: usize) -> Result<Vec<MoeKernel>> {
        let b = self.bucket(tokens)?;
        Ok([
            b.logits,
            self.topk,
            self.stats,
            self.permute,
            b.gemm13,
            b.gemm2,
            self.combine,
        ]
        .iter()
        .map(|&i| self.loaded[i].0.clone())
        .collect())
    }

    /// Launch geometry of [`MoePlan::kernels`] for `tokens` tokens.
    pub fn launch_configs(&self, tokens: usize) -> Result<[LaunchConfig; 7]> {
        let b = self.bucket(tokens)?;
        self.configs(b, tokens)
    }

    fn configs(&self, b: &Bucket, tokens: usize) -> Result<[LaunchConfig; 7]> {
        let k = |i: usize| &self.loaded[i].0;
        pipeline_configs(
            &self.class.problem(tokens),
            [
                k(b.logits),
                k(self.topk),
                k(self.stats),
                k(self.permute),
                k(b.gemm13),
                k(b.gemm2),
                k(self.combine),
            ],
        )
    }

    /// The workspace regions of a call of `tokens` tokens.
    pub fn workspace_layout(&self, tokens: usize) -> Result<WorkspaceLayout> {
        let b = self.bucket(tokens)?;
        WorkspaceLayout::new(&self.class, tokens, b.sm90.is_some())
    }

    /// Bytes of the workspace a call of `tokens` tokens needs.
    pub fn workspace_bytes(&self, tokens: usize) -> Result<usize> {
        Ok(self.workspace_layout(tokens)?.bytes)
    }

    /// Bytes of a workspace that serves every call of the plan.
    pub fn max_workspace_bytes(&self) -> usize {
        self.buckets
            .iter()
            .filter_map(|b| WorkspaceLayout::new(&self.class, b.last, b.sm90.is_some()).ok())
            .map(|l| l.bytes)
            .max()
            .unwrap_or(0)
    }

    /// Device bytes of the plan's own token tables.
    pub fn table_bytes(&self) -> usize {
        12 * self.class.max_tokens
    }

    /// A workspace for every call of this plan on `stream` (allocates: do it once).
    pub fn alloc_workspace(&self, stream: &Arc<CudaStream>) -> Result<Workspace> {
        Workspace::zeroed(stream, self.max_workspace_bytes())
    }

    /// Routing output buffers for calls of up to `max_tokens` tokens on `stream`
    /// (allocates: do it once).
    pub fn alloc_routing(&self, stream: &Arc<CudaStream>) -> Result<MoeRouting> {
        MoeRouting::new(stream, &self.class)
    }

    /// Check a call's tensors against the class ([`MoeClass::check_args`]) and the plan's
    /// token range, O(1); returns the token count. Errors name the tensor and the rule.
    pub fn check(&self, a: &MoeArgs) -> Result<usize> {
        self.check_for(a, self.class.experts)
    }

    fn check_for(&self, a: &MoeArgs, weight_experts: usize) -> Result<usize> {
        let t = self.class.check_args_for(a, weight_experts)?;
        if t < self.min_tokens {
            return Err(Error::invalid(format!(
                "x has {t} tokens but this MoE plan takes {}..={} (MoeClass::max_tokens)",
                self.min_tokens, self.class.max_tokens
            )));
        }
        Ok(t)
    }

    fn func(&self, i: usize) -> &CudaFunction {
        &self.loaded[i].1
    }
    fn entry(&self, i: usize) -> &'static str {
        self.loaded[i].0.entry
    }

    /// Enqueue the whole layer on `stream`: router (logits, scoring + top-k, statistics,
    /// losses) → permutation → grouped SwiGLU GEMMs (+ shared expert) → combine.
    /// Asynchronous; O(1) checks ([`MoePlan::check`]), no allocation.
    ///
    /// # Safety
    /// The contract of [`crate::gpu::raw`]: every address in `a` and the workspace's
    /// bytes are live device memory of this plan's context covering
    /// its tensor, the workspace is not used by a launch that may run at the same time,
    /// the outputs do not overlap the inputs or each other, and `stream` belongs to the
    /// plan's context.
    pub unsafe fn forward_raw(
        &self,
        stream: RawStream,
        a: &MoeArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        self.enqueue(stream, a, workspace, Stages::Layer)
    }

    /// Enqueue the router stage alone (logits, scoring + top-k, statistics, losses: the
    /// routing outputs of `a` are written, the rest of the layer is not), to time its
    /// share of the layer. Same checks and contract as [`MoePlan::forward_raw`].
    ///
    /// # Safety
    /// As [`MoePlan::forward_raw`].
    pub unsafe fn router_raw(
        &self,
        stream: RawStream,
        a: &MoeArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        self.enqueue(stream, a, workspace, Stages::Router)
    }

    /// The checks shared by both entry points, then the stages.
    unsafe fn enqueue(
        &self,
        stream: RawStream,
        a: &MoeArgs,
        workspace: RawWorkspace,
        stages: Stages,
    ) -> Result<()> {
        let t = self.check(a)?;
        let b = self.bucket(t)?;
        let ws = WorkspaceLayout::new(&self.class, t, b.sm90.is_some())?;
        workspace.check(ws.bytes, WORKSPACE_ALIGN as u64, "MoePlan")?;
        let cfgs = self.configs(b, t)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        self.enqueue_router(stream, a, t, b, &cfgs, workspace.ptr, &ws)?;
        match stages {
            // The layer finishes the losses in the permutation (no launch of their own).
            Stages::Layer => self.enqueue_experts(stream, a, t, b, &cfgs, workspace.ptr, &ws),
            Stages::Router => self.enqueue_losses(stream, a, t, workspace.ptr, &ws),
        }
    }

    /// The front half of the layer for the expert-parallel layer ([`super::ep`]): checks
    /// (with `w13` / `w2` holding `weight_experts` experts), router, losses, permutation
    /// and the token gather into `x_perm`; `routed` is recorded once the router's counts
    /// are written (before the permutation), so their exchange overlaps the gather. Needs
    /// the sm_90 path at this token count (the layer builds this plan with it forced).
    /// Returns what the rest of the call needs.
    pub(crate) unsafe fn enqueue_front(
        &self,
        stream: RawStream,
        a: &MoeArgs,
        weight_experts: usize,
        workspace: RawWorkspace,
        routed: Option<crate::gpu::raw::RawEvent>,
    ) -> Result<Front> {
        let t = self.check_for(a, weight_experts)?;
        let b = self.bucket(t)?;
        let ws = WorkspaceLayout::new(&self.class, t, b.sm90.is_some())?;
        workspace.check(ws.bytes, WORKSPACE_ALIGN as u64, "MoePlan")?;
        let (Some(x_perm), Some(gather)) = (ws.x_perm, self.gather) else {
            return Err(Error::unsupported(
                BACKEND,
                format!("{t} tokens: the expert-parallel layer needs the sm_90 token gather"),
            ));
        };
        let cfgs = self.configs(b, t)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let base = workspace.ptr;
        self.enqueue_router(stream, a, t, b, &cfgs, base, &ws)?;
        if let Some(ev) = routed {
            cudarc::driver::result::event::record(ev, stream)
                .map_err(|e| Error::cuda("cuEventRecord", e))?;
        }
        self.enqueue_permute(stream, a, t, &cfgs, base, &ws)?;
        let rows = t * self.class.top_k;
        let row_token = base + ws.row_token as u64;
        self.enqueue_gather(
            stream,
            a.x.ptr,
            row_token,
            base + x_perm as u64,
            rows,
            gather,
        )?;
        Ok(Front {
            tokens: t,
            ws,
            cfgs,
        })
    }

    /// Grouped SwiGLU GEMMs over rows already gathered contiguously (the expert-parallel
    /// layer's blocks), on this plan's kernels for `select_rows` rows (its class has
    /// top_k 1, so tokens are rows). `bufs`: a, offsets (`groups + 1` absolute rows), h, y;
    /// `weights`: w13, w2 at the first group's expert; `dims`: rows the a / h maps span,
    /// rows the groups hold at most (the grid), groups.
    pub(crate) unsafe fn enqueue_row_gemms(
        &self,
        stream: RawStream,
        bufs: (u64, u64, u64, u64),
        weights: (u64, u64),
        dims: (usize, usize, usize),
        select_rows: usize,
    ) -> Result<()> {
        let c = &self.class;
        let b = self.bucket(select_rows.clamp(self.min_tokens, c.max_tokens))?;
        let (a, offsets, h, y) = bufs;
        let (map_rows, grid_rows, groups) = dims;
        if map_rows > c.max_tokens {
            return Err(Error::invalid(format!(
                "{map_rows} rows exceed the {} this expert GEMM plan was built for",
                c.max_tokens
            )));
        }
        match b.sm90 {
            Some(funcs) => self.enqueue_sm90_gemms(stream, funcs, bufs, weights, dims),
            None => {
                let (k13, k2) = (&self.loaded[b.gemm13].0, &self.loaded[b.gemm2].0);
                let cfg13 = gemm_launch_config(k13, grid_rows, groups, c.intermediate)?;
                let cfg2 = gemm_launch_config(k2, grid_rows, groups, c.hidden)?;
                // Rows are already gathered: the token list is the identity.
                self.enqueue_portable(
                    stream,
                    (b.gemm13, b.gemm2),
                    (cfg13, cfg2),
                    (a, self.iota_addr, offsets, weights.0, weights.1, h, y),
                    (c.hidden as i32, c.intermediate as i32, groups as i32),
                )
            }
        }
    }

    /// The one-group offsets `[0, tokens]` in the plan's table.
    fn one_group_offsets(&self, tokens: usize) -> u64 {
        self.pairs_addr + 8 * (tokens as u64 - 1)
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_router(
        &self,
        stream: RawStream,
        a: &MoeArgs,
        tokens: usize,
        b: &Bucket,
        cfgs: &[LaunchConfig; 7],
        base: u64,
        ws: &WorkspaceLayout,
    ) -> Result<()> {
        let c = &self.class;
        let (t, hid, e, k) = (
            tokens as i32,
            c.hidden as i32,
            c.experts as i32,
            c.top_k as i32,
        );
        let at = |off: usize| base + off as u64;
        let (x, router) = (a.x.ptr, a.router.ptr);
        let (logits, probs, lse) = (at(ws.logits), at(ws.probs), at(ws.lse));
        let (prob_sum, lse_sq) = (at(ws.prob_sum), at(ws.lse_sq_sum));
        let r = &a.routing;
        let (ids, topk_w, counts) = (r.topk_ids.ptr, r.topk_w.ptr, r.counts.ptr);

        // 1. logits
        if self.entry(b.logits) == gemm_config::GEMM2_ENTRY {
            // One-group moe_gemm2: (A = x, offsets [0, T], B = router, y = logits, N = E,
            // K = H, 1 group).
            let offs = self.one_group_offsets(tokens);
            let one = 1i32;
            let mut p: [*mut c_void; 7] = [
                param(&x),
                param(&offs),
                param(&router),
                param(&logits),
                param(&e),
                param(&hid),
                param(&one),
            ];
            raw::launch(
                "moe_gemm2 (router logits)",
                self.func(b.logits),
                cfgs[config::K_LOGITS],
                stream,
                &mut p,
            )?;
        } else {
            let mut p: [*mut c_void; 6] = [
                param(&x),
                param(&router),
                param(&logits),
                param(&t),
                param(&hid),
                param(&e),
            ];
            raw::launch(
                self.entry(b.logits),
                self.func(b.logits),
                cfgs[config::K_LOGITS],
                stream,
                &mut p,
            )?;
        }
        // 2. scoring + top-k
        let mut p: [*mut c_void; 8] = [
            param(&logits),
            param(&ids),
            param(&topk_w),
            param(&probs),
            param(&lse),
            param(&t),
            param(&e),
            param(&k),
        ];
        raw::launch(
            config::TOPK_ENTRY,
            self.func(self.topk),
            cfgs[config::K_TOPK],
            stream,
            &mut p,
        )?;
        // 3. per-expert statistics
        let mut p: [*mut c_void; 9] = [
            param(&ids),
            param(&probs),
            param(&lse),
            param(&counts),
            param(&prob_sum),
            param(&lse_sq),
            param(&t),
            param(&e),
            param(&k),
        ];
        raw::launch(
            config::STATS_ENTRY,
            self.func(self.stats),
            cfgs[config::K_STATS],
            stream,
            &mut p,
        )?;
        Ok(())
    }

    /// 3b alone (the router-only stage; the full layer finishes the losses in
    /// `moe_permute`'s block 0).
    unsafe fn enqueue_losses(
        &self,
        stream: RawStream,
        a: &MoeArgs,
        tokens: usize,
        base: u64,
        ws: &WorkspaceLayout,
    ) -> Result<()> {
        let c = &self.class;
        let (t, e, k) = (tokens as i32, c.experts as i32, c.top_k as i32);
        let (counts, losses) = (a.routing.counts.ptr, a.routing.losses.ptr);
        let (prob_sum, lse_sq) = (base + ws.prob_sum as u64, base + ws.lse_sq_sum as u64);
        let mut p: [*mut c_void; 7] = [
            param(&counts),
            param(&prob_sum),
            param(&lse_sq),
            param(&losses),
            param(&t),
            param(&e),
            param(&k),
        ];
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (config::LOSSES_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        raw::launch(
            config::LOSSES_ENTRY,
            self.func(self.losses),
            one_block,
            stream,
            &mut p,
        )
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_experts(
        &self,
        stream: RawStream,
        a: &MoeArgs,
        tokens: usize,
        b: &Bucket,
        cfgs: &[LaunchConfig; 7],
        base: u64,
        ws: &WorkspaceLayout,
    ) -> Result<()> {
        let c = &self.class;
        let (hid, inter, e) = (c.hidden as i32, c.intermediate as i32, c.experts as i32);
        let rows = tokens * c.top_k;
        let at = |off: usize| base + off as u64;
        let (offsets, row_token, slot_row) = (at(ws.offsets), at(ws.row_token), at(ws.slot_row));
        let (h, y) = (at(ws.h), at(ws.y));

        self.enqueue_permute(stream, a, tokens, cfgs, base, ws)?;
        // 5-6. routed experts' grouped GEMMs
        match (b.sm90, ws.x_perm, self.gather) {
            (Some((g13, g2)), Some(x_perm), Some(gather)) => {
                self.enqueue_gather(stream, a.x.ptr, row_token, at(x_perm), rows, gather)?;
                self.enqueue_sm90_gemms(
                    stream,
                    (g13, g2),
                    (at(x_perm), offsets, h, y),
                    (a.w13.ptr, a.w2.ptr),
                    (rows, rows, c.experts),
                )?
            }
            (None, _, _) => self.enqueue_portable(
                stream,
                (b.gemm13, b.gemm2),
                (cfgs[config::K_GEMM13], cfgs[config::K_GEMM2]),
                (a.x.ptr, row_token, offsets, a.w13.ptr, a.w2.ptr, h, y),
                (hid, inter, e),
            )?,
            _ => {
                return Err(Error::unsupported(
                    BACKEND,
                    "the sm_90 path is selected but its gather kernel or buffer is missing",
                ))
            }
        }
        // 5-6'. shared expert: one group of all tokens through the same portable kernels.
        let shared_y = match (&a.shared_w13, &a.shared_w2, ws.shared_h, ws.shared_y) {
            (Some(w13), Some(w2), Some(sh), Some(sy)) => {
                let k13 = &self.loaded[b.gemm13].0;
                let k2 = &self.loaded[b.gemm2].0;
                let cfg13 = gemm_launch_config(k13, tokens, 1, c.intermediate)?;
                let cfg2 = gemm_launch_config(k2, tokens, 1, c.hidden)?;
                self.enqueue_portable(
                    stream,
                    (b.gemm13, b.gemm2),
                    (cfg13, cfg2),
                    (
                        a.x.ptr,
                        self.iota_addr,
                        self.one_group_offsets(tokens),
                        w13.ptr,
                        w2.ptr,
                        at(sh),
                        at(sy),
                    ),
                    (hid, inter, 1),
                )?;
                at(sy)
            }
            // Not read (FM_SHARED=0), but a valid pointer.
            _ => y,
        };
        // 7. combine
        self.enqueue_combine(stream, a, tokens, cfgs, (y, slot_row, shared_y))
    }

    /// Step 4: the permutation by expert (block 0 also finishes the losses, 3b).
    pub(crate) unsafe fn enqueue_permute(
        &self,
        stream: RawStream,
        a: &MoeArgs,
        tokens: usize,
        cfgs: &[LaunchConfig; 7],
        base: u64,
        ws: &WorkspaceLayout,
    ) -> Result<()> {
        let c = &self.class;
        let (t, e, k) = (tokens as i32, c.experts as i32, c.top_k as i32);
        let at = |off: usize| base + off as u64;
        let r = &a.routing;
        let (ids, counts, losses) = (r.topk_ids.ptr, r.counts.ptr, r.losses.ptr);
        let (prob_sum, lse_sq) = (at(ws.prob_sum), at(ws.lse_sq_sum));
        let (offsets, row_token, row_slot, slot_row) = (
            at(ws.offsets),
            at(ws.row_token),
            at(ws.row_slot),
            at(ws.slot_row),
        );
        let mut p: [*mut c_void; 12] = [
            param(&ids),
            param(&counts),
            param(&offsets),
            param(&row_token),
            param(&row_slot),
            param(&slot_row),
            param(&prob_sum),
            param(&lse_sq),
            param(&losses),
            param(&t),
            param(&e),
            param(&k),
        ];
        raw::launch(
            config::PERMUTE_ENTRY,
            self.func(self.permute),
            cfgs[config::K_PERMUTE],
            stream,
            &mut p,
        )
    }

    /// Step 7: out[t] = Σ_s topk_w[t, s] · y[slot_row[t·k + s]] (+ shared_y[t]), token
    /// order. `bufs`: y (the routed rows' outputs in the permuted order), slot_row,
    /// shared_y (read only when the class has a shared expert).
    pub(crate) unsafe fn enqueue_combine(
        &self,
        stream: RawStream,
        a: &MoeArgs,
        tokens: usize,
        cfgs: &[LaunchConfig; 7],
        bufs: (u64, u64, u64),
    ) -> Result<()> {
        let c = &self.class;
        let (t, hid, k) = (tokens as i32, c.hidden as i32, c.top_k as i32);
        let (y, slot_row, shared_y) = bufs;
        let (topk_w, out) = (a.routing.topk_w.ptr, a.out.ptr);
        let mut p: [*mut c_void; 8] = [
            param(&y),
            param(&slot_row),
            param(&topk_w),
            param(&shared_y),
            param(&out),
            param(&t),
            param(&hid),
            param(&k),
        ];
        raw::launch(
            config::COMBINE_ENTRY,
            self.func(self.combine),
            cfgs[config::K_COMBINE],
            stream,
            &mut p,
        )
    }

    /// gemm13 then gemm2 of the portable kernels (contract steps 5 and 6). `ptrs`: x,
    /// row_token, offsets, w13, w2, h, y.
    unsafe fn enqueue_portable(
        &self,
        stream: RawStream,
        funcs: (usize, usize),
        cfgs: (LaunchConfig, LaunchConfig),
        ptrs: (u64, u64, u64, u64, u64, u64, u64),
        dims: (i32, i32, i32),
    ) -> Result<()> {
        let (x, row_token, offsets, w13, w2, h, y) = ptrs;
        let (hid, inter, experts) = dims;
        let mut p: [*mut c_void; 8] = [
            param(&x),
            param(&row_token),
            param(&offsets),
            param(&w13),
            param(&h),
            param(&hid),
            param(&inter),
            param(&experts),
        ];
        raw::launch(
            self.entry(funcs.0),
            self.func(funcs.0),
            cfgs.0,
            stream,
            &mut p,
        )?;
        let mut p: [*mut c_void; 7] = [
            param(&h),
            param(&offsets),
            param(&w2),
            param(&y),
            param(&hid),
            param(&inter),
            param(&experts),
        ];
        raw::launch(
            self.entry(funcs.1),
            self.func(funcs.1),
            cfgs.1,
            stream,
            &mut p,
        )
    }

    /// The sm_90 path's token gather: `x_perm[r] = x[row_token[r]]` for `rows` rows.
    pub(crate) unsafe fn enqueue_gather(
        &self,
        stream: RawStream,
        x: u64,
        row_token: u64,
        x_perm: u64,
        rows: usize,
        gather: usize,
    ) -> Result<()> {
        let hid = self.class.hidden as i32;
        let mut p: [*mut c_void; 4] = [param(&x), param(&row_token), param(&x_perm), param(&hid)];
        let cfg_gather = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (gemm_sm90::GATHER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        raw::launch(
            gemm_sm90::GATHER_ENTRY,
            self.func(gather),
            cfg_gather,
            stream,
            &mut p,
        )
    }

    /// The sm_90 gemm13 (into h) and gemm2 (into y) over contiguous rows, with tensor maps
    /// over this call's addresses. `funcs`: gemm13, gemm2; `bufs`: a (the gathered rows),
    /// offsets (`groups + 1` absolute row offsets), h, y, all indexed by the same rows;
    /// `weights`: w13 and w2 of the first group's expert; `dims`: the rows the A and h
    /// maps span, the rows the groups hold at most (the grid), the group count.
    pub(crate) unsafe fn enqueue_sm90_gemms(
        &self,
        stream: RawStream,
        funcs: (usize, usize),
        bufs: (u64, u64, u64, u64),
        weights: (u64, u64),
        dims: (usize, usize, usize),
    ) -> Result<()> {
        let c = &self.class;
        let (a, offsets, h, y) = bufs;
        let (w13, w2) = weights;
        let (map_rows, grid_rows, groups) = dims;
        let (g13, g2) = funcs;
        let (k13, k2) = (&self.loaded[g13].0, &self.loaded[g2].0);
        let (hid, inter, e) = (c.hidden as i32, c.intermediate as i32, groups as i32);
        // Shapes checked at plan time (a_layout / b_layout .check); only rows vary.
        let dt = tensor_map::map_data_type("w13", c.dtype)?;
        let (hh, ii, ee, r) = (
            c.hidden as u64,
            c.intermediate as u64,
            groups as u64,
            map_rows as u64,
        );
        let maps: [TensorMap; 4] = [
            tensor_map::encode_checked("x_perm", a, dt, &[hh, r], &[hh], &[64, k13.block_m])?,
            tensor_map::encode_checked(
                "w13",
                w13,
                dt,
                &[2 * ii, hh, ee],
                &[2 * ii, hh * 2 * ii],
                &[64, 64, 1],
            )?,
            tensor_map::encode_checked("h", h, dt, &[ii, r], &[ii], &[64, k2.block_m])?,
            tensor_map::encode_checked("w2", w2, dt, &[hh, ii, ee], &[hh, ii * hh], &[64, 64, 1])?,
        ];
        let tiles = [
            gemm_sm90::row_tiles(grid_rows, groups, k13.block_m) as i32,
            gemm_sm90::row_tiles(grid_rows, groups, k2.block_m) as i32,
        ];
        let cfg13 = gemm_sm90::sm90_launch_config(k13, grid_rows, groups, c.intermediate)?;
        let cfg2 = gemm_sm90::sm90_launch_config(k2, grid_rows, groups, c.hidden)?;
        let mut p: [*mut c_void; 8] = [
            param(&maps[0]),
            param(&maps[1]),
            param(&offsets),
            param(&h),
            param(&hid),
            param(&inter),
            param(&e),
            param(&tiles[0]),
        ];
        raw::launch(k13.entry, self.func(g13), cfg13, stream, &mut p)?;
        let mut p: [*mut c_void; 8] = [
            param(&maps[2]),
            param(&maps[3]),
            param(&offsets),
            param(&y),
            param(&hid),
            param(&inter),
            param(&e),
            param(&tiles[1]),
        ];
        raw::launch(k2.entry, self.func(g2), cfg2, stream, &mut p)
    }

    /// [`MoePlan::forward_raw`] over cudarc buffers on a cudarc stream (candle's storage
    /// and stream): `x` holds `tokens` rows (its first `tokens · hidden` elements are read),
    /// `out` receives as many; each buffer's length is checked, the stream against the
    /// plan's context, and cudarc's stream-order tracking is kept.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T, X, W, O>(
        &self,
        stream: &Arc<CudaStream>,
        x: &X,
        tokens: usize,
        weights: &MoeWeights<'_, W>,
        out: &mut O,
        routing: &mut MoeRouting,
        workspace: &mut Workspace,
    ) -> Result<()>
    where
        T: Element,
        X: DevicePtr<T>,
        W: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::invalid(
                "the stream belongs to another CUDA context than the plan (build the plan \
                 from the stream's context: Device::from_context)",
            ));
        }
        workspace.check_for(stream, 0, "MoePlan")?;
        let c = &self.class;
        let (h, i, e, k) = (c.hidden, c.intermediate, c.experts, c.top_k);
        if tokens == 0 || tokens > c.max_tokens {
            return Err(Error::invalid(format!(
                "{tokens} tokens: this MoE plan takes {}..={} (MoeClass::max_tokens)",
                self.min_tokens, c.max_tokens
            )));
        }
        let need = |name: &str, want: usize, have: usize| -> Result<()> {
            if have < want {
                return Err(Error::BufferSize {
                    name: name.to_string(),
                    expected: want,
                    actual: have,
                });
            }
            Ok(())
        };
        need("x", tokens * h, x.len())?;
        need("out", tokens * h, out.len())?;
        need("router", h * e, weights.router.len())?;
        need("w13", e * h * 2 * i, weights.w13.len())?;
        need("w2", e * i * h, weights.w2.len())?;
        if let Some((s13, s2)) = weights.shared {
            need("shared_w13", h * 2 * i, s13.len())?;
            need("shared_w2", i * h, s2.len())?;
        }
        need("topk_ids", tokens * k, routing.topk_ids.len())?;
        need("topk_w", tokens * k, routing.topk_w.len())?;
        need("counts", e, routing.counts.len())?;
        need("losses", 2, routing.losses.len())?;
        let dt = T::DTYPE;
        let (xp, _gx) = x.device_ptr(stream);
        let (rp, _gr) = weights.router.device_ptr(stream);
        let (w13p, _g13) = weights.w13.device_ptr(stream);
        let (w2p, _g2) = weights.w2.device_ptr(stream);
        let shared = weights
            .shared
            .map(|(s13, s2)| (s13.device_ptr(stream), s2.device_ptr(stream)));
        let (op, _go) = out.device_ptr_mut(stream);
        let (idp, _gi) = routing.topk_ids.device_ptr_mut(stream);
        let (twp, _gw) = routing.topk_w.device_ptr_mut(stream);
        let (cp, _gc) = routing.counts.device_ptr_mut(stream);
        let (lp, _gl) = routing.losses.device_ptr_mut(stream);
        let ws = workspace.raw();
        let (shared_w13, shared_w2) = match &shared {
            Some(((p13, _), (p2, _))) => (
                Some(RawTensor::contiguous(*p13, dt, &[h, 2 * i])?),
                Some(RawTensor::contiguous(*p2, dt, &[i, h])?),
            ),
            None => (None, None),
        };
        let args = MoeArgs {
            x: RawTensor::contiguous(xp, dt, &[tokens, h])?,
            router: RawTensor::contiguous(rp, dt, &[h, e])?,
            w13: RawTensor::contiguous(w13p, dt, &[e, h, 2 * i])?,
            w2: RawTensor::contiguous(w2p, dt, &[e, i, h])?,
            shared_w13,
            shared_w2,
            out: RawTensor::contiguous(op, dt, &[tokens, h])?,
            routing: RoutingArgs {
                topk_ids: RawU32 {
                    ptr: idp,
                    len: tokens * k,
                },
                topk_w: RawTensor::contiguous(twp, DType::F32, &[tokens, k])?,
                counts: RawU32 { ptr: cp, len: e },
                losses: RawTensor::contiguous(lp, DType::F32, &[2])?,
            },
        };
        // SAFETY: every buffer is a live cudarc allocation of the plan's context (checked
        // above) at least as long as its tensor; the guards keep cudarc's stream order
        // until after the launches; the workspace is bound to this stream.
        unsafe { self.forward_raw(stream.cu_stream(), &args, ws) }
    }
}

/// The weights of a layer as cudarc buffers (`CudaSlice<bf16>`, `CudaView<bf16>`, ...),
/// in the layouts of the module doc. `shared`: (shared_w13, shared_w2) when the class has
/// a shared expert.
#[derive(Debug)]
pub struct MoeWeights<'a, W> {
    pub router: &'a W,
    pub w13: &'a W,
    pub w2: &'a W,
    pub shared: Option<(&'a W, &'a W)>,
}

/// Device buffers for the routing outputs of calls up to a class's `max_tokens`.
#[derive(Debug)]
pub struct MoeRouting {
    /// [max_tokens · k] u32; a call of T tokens writes the first T·k.
    pub topk_ids: CudaSlice<u32>,
    /// [max_tokens · k] f32
    pub topk_w: CudaSlice<f32>,
    /// [E] u32
    pub counts: CudaSlice<u32>,
    /// [2] f32: (aux, z)
    pub losses: CudaSlice<f32>,
}

impl MoeRouting {
    /// Zeroed buffers for `class` on `stream` (allocates).
    pub fn new(stream: &Arc<CudaStream>, class: &MoeClass) -> Result<MoeRouting> {
        let slots = class
            .max_tokens
            .checked_mul(class.top_k)
            .ok_or_else(|| too_big("max_tokens × top_k"))?;
        let ctx = |what: &str, e| Error::cuda(format!("allocating {what} on the GPU"), e);
        Ok(MoeRouting {
            topk_ids: stream
                .alloc_zeros::<u32>(slots)
                .map_err(|e| ctx("topk_ids", e))?,
            topk_w: stream
                .alloc_zeros::<f32>(slots)
                .map_err(|e| ctx("topk_w", e))?,
            counts: stream
                .alloc_zeros::<u32>(class.experts)
                .map_err(|e| ctx("counts", e))?,
            losses: stream.alloc_zeros::<f32>(2).map_err(|e| ctx("losses", e))?,
        })
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<MoePlan>();
    f::<Workspace>();
    f::<MoeRouting>();
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn class(max_tokens: usize) -> MoeClass {
        MoeClass {
            dtype: DType::Bf16,
            hidden: 4096,
            intermediate: 14336,
            experts: 8,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            shared_expert: false,
            max_tokens,
        }
    }

    /// The bisection finds exactly the ranges an exhaustive scan finds, for the model
    /// shapes of the presets (E = 8, 32, 64, 128, 256; with and without E % 32 == 0),
    /// on sm_90 and sm_80, auto and forced paths.
    #[test]
    fn token_ranges_match_an_exhaustive_scan() {
        let shapes = [
            (4096, 14336, 8, 2),
            (4096, 11008, 32, 2),
            (2048, 768, 128, 8),
            (7168, 2048, 256, 8),
            (1024, 512, 64, 8),
            (256, 256, 48, 4),
        ];
        for (h, i, e, k) in shapes {
            let c = MoeClass {
                hidden: h,
                intermediate: i,
                experts: e,
                top_k: k,
                ..class(2200)
            };
            for (arch, path) in [
                (90, None),
                (80, None),
                (90, Some("sm90")),
                (90, Some("portable")),
            ] {
                let Ok(pieces) = plan_selections(&c, 1, arch, path) else {
                    continue;
                };
                let mut t = 1;
                for (first, last, sel) in &pieces {
                    assert_eq!(*first, t, "{c:?}");
                    for tok in *first..=*last {
                        assert_eq!(
                            &selection(&c, tok, arch, path).unwrap(),
                            sel,
                            "{c:?} arch {arch} {path:?} tokens {tok}"
                        );
                    }
                    t = last + 1;
                }
                assert_eq!(t, 2201);
                assert!(pieces.len() < 16, "{}", pieces.len());
            }
        }
    }

    #[test]
    fn pieces_of_a_step_function() {
        let p = token_pieces(1, 100, |t| Ok(t / 30)).unwrap();
        let ranges: Vec<(usize, usize, usize)> = p;
        assert_eq!(
            ranges,
            vec![(1, 29, 0), (30, 59, 1), (60, 89, 2), (90, 100, 3)]
        );
        assert_eq!(token_pieces(5, 5, |_| Ok(1)).unwrap(), vec![(5, 5, 1)]);
        assert!(token_pieces(1, 9, |t| if t > 4 {
            Err(Error::invalid("x"))
        } else {
            Ok(0)
        })
        .is_err());
    }

    #[test]
    fn plan_selection_errors_are_clear() {
        let e = plan_selections(&class(0), 1, 90, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_tokens (0)"), "{e}");
        let e = plan_selections(
            &MoeClass {
                experts: 300,
                ..class(16)
            },
            1,
            90,
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("experts = 300"), "{e}");
        let e = plan_selections(&class(16), 1, 80, Some("sm90"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("sm90"), "{e}");
        let e = plan_selections(&class(16), 1, 90, Some("fast"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("auto, portable, sm90"), "{e}");
    }

    #[test]
    fn workspace_regions_are_aligned_disjoint_and_monotone() {
        for shared in [false, true] {
            for sm90 in [false, true] {
                let c = MoeClass {
                    shared_expert: shared,
                    ..class(4096)
                };
                let mut last = 0;
                for t in [1, 7, 100, 2048, 4096] {
                    let l = WorkspaceLayout::new(&c, t, sm90).unwrap();
                    let r = t * c.top_k;
                    let mut regions = vec![
                        (l.logits, t * 8 * 4),
                        (l.probs, t * 8 * 4),
                        (l.lse, t * 4),
                        (l.prob_sum, 8 * 4),
                        (l.lse_sq_sum, 4),
                        (l.offsets, 9 * 4),
                        (l.row_token, r * 4),
                        (l.row_slot, r * 4),
                        (l.slot_row, r * 4),
                        (l.h, r * c.intermediate * 2),
                        (l.y, r * c.hidden * 4),
                    ];
                    assert_eq!(l.x_perm.is_some(), sm90);
                    if let Some(o) = l.x_perm {
                        regions.push((o, r * c.hidden * 2));
                    }
                    assert_eq!(l.shared_h.is_some(), shared);
                    if let (Some(a), Some(b)) = (l.shared_h, l.shared_y) {
                        regions.push((a, t * c.intermediate * 2));
                        regions.push((b, t * c.hidden * 4));
                    }
                    for w in regions.windows(2) {
                        assert!(w[0].0 + w[0].1 <= w[1].0, "{t}: overlap {w:?}");
                    }
                    for (o, _) in &regions {
                        assert_eq!(o % WORKSPACE_ALIGN, 0);
                    }
                    let (o, n) = regions.last().unwrap();
                    assert!(o + n <= l.bytes && l.bytes % WORKSPACE_ALIGN == 0);
                    assert!(l.bytes > last);
                    last = l.bytes;
                }
            }
        }
        let huge = MoeClass {
            hidden: usize::MAX / 4,
            ..class(16)
        };
        assert!(WorkspaceLayout::new(&huge, 16, false).is_err());
    }

    #[test]
    fn raw_u32_checks_name_the_array() {
        let ok = RawU32 { ptr: 256, len: 6 };
        ok.expect("topk_ids", 6).unwrap();
        let e = ok.expect("topk_ids", 8).unwrap_err().to_string();
        assert!(e.contains("topk_ids has 6"), "{e}");
        let e = RawU32 { ptr: 0, len: 6 }
            .expect("counts", 6)
            .unwrap_err()
            .to_string();
        assert!(e.contains("counts is a null"), "{e}");
        let e = RawU32 { ptr: 258, len: 6 }
            .expect("counts", 6)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4-byte aligned"), "{e}");
    }

    #[test]
    fn class_round_trips_a_problem() {
        let c = class(64);
        let p = c.problem(17);
        assert_eq!(p.tokens, 17);
        assert_eq!(MoeClass::of_problem(&p, 64), c);
    }
}
