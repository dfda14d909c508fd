//! The MoE layer's backward (issue 34), portable path: [`MoeBackwardPlan`], built once per
//! [`MoeClass`] like [`MoePlan`](super::MoePlan), enqueued on the caller's stream over the
//! caller's memory. Kernels: `kernels/moe_backward.cu` (mma.sync grouped GEMMs, sm_80 and
//! newer, so Hopper runs it too; the sm_90a wgmma kernels are a later step). The stages
//! and their formulas are those of the f64 ground truth
//! `crate::reference::moe_backward` and of docs/design/moe.md ("Backward"):
//!
//! 1. gu = X_perm·W13 (the forward's gemm13 without SwiGLU, recomputed; f32);
//! 2. G = dOut_perm·W2ᵀ (f32), then per routed slot: dw = ⟨h, G⟩, dH = w·G, the SwiGLU
//!    backward dGU, and w⊙h (16-bit);
//! 3. dW2 = (w⊙H)ᵀ·dOut_perm per expert (K = that expert's rows);
//! 4. dX_perm = dGU·W13ᵀ (f32);
//! 5. dW13 = X_permᵀ·dGU per expert;
//! 6. router: dZ from dw, the aux loss and the z-loss (f32), d_router = xᵀ·dZ;
//! 7. shared expert (when the class has one): 1–5 as one group of all tokens, w = 1;
//! 8. un-permute: dx_t = ((Σ_s dX_perm\[row(t, s)\]) + dX_shared,t) + dZ_t·Rᵀ, slots
//!    ascending, a gather-sum per token (no atomics).
//!
//! # What the forward must keep (inputs of [`MoeBwdArgs`])
//! - x `[T, H]`, router `[H, E]`, w13 `[E, H, 2I]`, w2 `[E, I, H]` (+ shared_w13 `[H, 2I]`,
//!   shared_w2 `[I, H]`), all in the class's 16-bit dtype, the layouts of
//!   [`super::plan`];
//! - the routing outputs: topk_ids `[T·k]` u32, topk_w `[T, k]` f32, counts `[E]` u32;
//! - from the forward's workspace (regions of [`WorkspaceLayout`]): the router logits
//!   `[T, E]` f32, the expert offsets `[E + 1]` u32, row_token `[R]` u32 and slot_row
//!   `[R]` u32 (R = T·k). [`SavedRouting::from_forward_workspace`] names them; the
//!   forward's workspace must therefore not be reused between the forward and the backward
//!   (or these four regions copied out).
//!
//! Not kept: gu, h and y (gu is recomputed in stage 1, h from gu, and dw = ⟨y, dOut⟩ is
//! computed as ⟨h, dOut·W2ᵀ⟩).
//!
//! # Outputs
//! dx `[T, H]`, d_router `[H, E]`, dw13 `[E, H, 2I]`, dw2 `[E, I, H]` (+ d_shared_w13,
//! d_shared_w2), all in the class's 16-bit dtype (f32 accumulation, one rounding at the
//! store). Every element is written (experts with no rows get zero weight gradients): the
//! outputs need no zeroing. The f32 intermediates (gu, G, dX_perm, dw, dZ) stay in the
//! workspace.
//!
//! # Workspace
//! [`MoeBackwardPlan::workspace_bytes`]`(tokens)` bytes, 256-byte aligned regions
//! ([`BwdWorkspaceLayout`]); every region is written before it is read, so it needs no
//! zeroing and a graph replay is correct as is.
//!
//! # Determinism
//! Every sum has a fixed order: the GEMMs' k loops are sequential per output tile (the
//! weight-gradient GEMM walks all of an expert's rows in one block, no split-K), dw is a
//! fixed-shape tree per slot, the router and un-permute sums are sequential per thread.
//! The same inputs give bit-identical gradients on every call.
//!
//! A call does O(1) checks and enqueues 9 kernels (+6 for a shared expert): no
//! allocation, no synchronisation, no compile; it can be captured in a CUDA graph.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::plan::{MoeClass, WorkspaceLayout, WORKSPACE_ALIGN};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{self, param, RawStream, RawTensor, RawU32, RawWorkspace};
use crate::gpu::Device;
use crate::problem::Scoring;
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use std::ffi::c_void;
use std::sync::Arc;

/// The backward's kernel source.
pub const BWD_SOURCE: &str = "moe_backward.cu";

/// Its entries, in the order [`MoeBackwardPlan`] loads them.
pub const BWD_ENTRIES: [&str; 6] = [
    "moe_bwd_gemm_rows",
    "moe_bwd_gemm_wgrad",
    "moe_bwd_swiglu",
    "moe_bwd_router_dz",
    "moe_bwd_router_dw",
    "moe_bwd_unpermute",
];

/// GEMM tile of the kernels (GB_BM, GB_BN in the source), their block size and dynamic
/// shared memory: GB_SMEM_BYTES (rows GEMM: 3 stages of two 128 × 64 16-bit tiles) and
/// WG_SMEM_BYTES (weight-gradient GEMM: 4 stages of two 32 × 128 tiles).
const TILE: u32 = 128;
const GEMM_THREADS: u32 = 256;
const ROWS_SMEM_BYTES: u32 = 3 * 2 * 128 * 64 * 2;
const WGRAD_SMEM_BYTES: u32 = 4 * 2 * 128 * 32 * 2;
const SWIGLU_THREADS: u32 = 128;
const ELEM_THREADS: u32 = 256;
const PLAN: &str = "MoeBackwardPlan";

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

/// The routing tensors the forward leaves in its workspace (module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SavedRouting {
    /// [T, E] f32 router logits.
    pub logits: RawTensor,
    /// [E + 1] u32 row offsets of the experts' groups.
    pub offsets: RawU32,
    /// \[R\] u32 token of each permuted row.
    pub row_token: RawU32,
    /// \[R\] u32 permuted row of each slot t·k + s.
    pub slot_row: RawU32,
}

impl SavedRouting {
    /// The regions of a forward call's workspace `ws` laid out as `layout`
    /// ([`super::MoePlan::workspace_layout`]`(tokens)`), for `tokens` tokens of `class`.
    pub fn from_forward_workspace(
        class: &MoeClass,
        tokens: usize,
        layout: &WorkspaceLayout,
        ws: RawWorkspace,
    ) -> Result<SavedRouting> {
        ws.check(layout.bytes, WORKSPACE_ALIGN as u64, "MoePlan")?;
        let rows = tokens * class.top_k;
        let at = |off: usize| ws.ptr + off as u64;
        Ok(SavedRouting {
            logits: RawTensor::contiguous(at(layout.logits), DType::F32, &[tokens, class.experts])?,
            offsets: RawU32 {
                ptr: at(layout.offsets),
                len: class.experts + 1,
            },
            row_token: RawU32 {
                ptr: at(layout.row_token),
                len: rows,
            },
            slot_row: RawU32 {
                ptr: at(layout.slot_row),
                len: rows,
            },
        })
    }
}

/// The tensors of one backward call (layouts in the module doc; all contiguous).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeBwdArgs {
    /// \[T, H\]: the forward's input; T = shape\[0\].
    pub x: RawTensor,
    pub router: RawTensor,
    pub w13: RawTensor,
    pub w2: RawTensor,
    pub shared_w13: Option<RawTensor>,
    pub shared_w2: Option<RawTensor>,
    /// \[T·k\] u32 ids, \[T, k\] f32 weights, \[E\] u32 counts: the forward's routing outputs.
    pub topk_ids: RawU32,
    pub topk_w: RawTensor,
    pub counts: RawU32,
    pub saved: SavedRouting,
    /// [T, H] upstream gradient of the output.
    pub d_out: RawTensor,
    /// \[2\] f32 upstream gradients of (aux loss, z-loss); None: both 0.
    pub d_losses: Option<RawTensor>,
    /// Outputs.
    pub dx: RawTensor,
    pub d_router: RawTensor,
    pub dw13: RawTensor,
    pub dw2: RawTensor,
    pub d_shared_w13: Option<RawTensor>,
    pub d_shared_w2: Option<RawTensor>,
}

/// Byte offsets of the backward's intermediates (each 256-byte aligned) and its size.
/// R = T·k routed rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BwdWorkspaceLayout {
    /// [R, 2I] f32 recomputed gate/up pre-activations.
    pub gu: usize,
    /// [R, I] f32 G = dOut_perm·W2ᵀ.
    pub g: usize,
    /// [R, 2I] 16-bit dGU.
    pub dgu: usize,
    /// [R, I] 16-bit w⊙h.
    pub wh: usize,
    /// [R, H] f32 dX_perm.
    pub dx_perm: usize,
    /// \[R\] f32 dL/d(routing weight), slot order.
    pub dw: usize,
    /// [T, E] f32 dL/d(logits).
    pub dz: usize,
    /// Shared expert: [T, 2I] f32 gu, [T, I] f32 G, [T, 2I] 16-bit dGU, [T, I] 16-bit h,
    /// [T, H] f32 dX.
    pub shared: Option<[usize; 5]>,
    pub bytes: usize,
}

fn too_big() -> Error {
    Error::invalid("the MoE backward workspace for this shape exceeds the address space")
}

struct Carver(usize);

impl Carver {
    fn take(&mut self, elems: usize, elem_bytes: usize) -> Result<usize> {
        let start = self
            .0
            .checked_next_multiple_of(WORKSPACE_ALIGN)
            .ok_or_else(too_big)?;
        let bytes = elems.checked_mul(elem_bytes).ok_or_else(too_big)?;
        self.0 = start.checked_add(bytes.max(1)).ok_or_else(too_big)?;
        Ok(start)
    }
}

impl BwdWorkspaceLayout {
    /// The layout of a backward call of `class` with `tokens` tokens.
    pub fn new(class: &MoeClass, tokens: usize) -> Result<BwdWorkspaceLayout> {
        let (h, i, e) = (class.hidden, class.intermediate, class.experts);
        let el = class.dtype.size_bytes();
        let rows = tokens.checked_mul(class.top_k).ok_or_else(too_big)?;
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(too_big);
        let mut c = Carver(0);
        let gu = c.take(mul(rows, 2 * i)?, 4)?;
        let g = c.take(mul(rows, i)?, 4)?;
        let dgu = c.take(mul(rows, 2 * i)?, el)?;
        let wh = c.take(mul(rows, i)?, el)?;
        let dx_perm = c.take(mul(rows, h)?, 4)?;
        let dw = c.take(rows, 4)?;
        let dz = c.take(mul(tokens, e)?, 4)?;
        let shared = if class.shared_expert {
            Some([
                c.take(mul(tokens, 2 * i)?, 4)?,
                c.take(mul(tokens, i)?, 4)?,
                c.take(mul(tokens, 2 * i)?, el)?,
                c.take(mul(tokens, i)?, el)?,
                c.take(mul(tokens, h)?, 4)?,
            ])
        } else {
            None
        };
        let bytes =
            c.0.checked_next_multiple_of(WORKSPACE_ALIGN)
                .ok_or_else(too_big)?;
        Ok(BwdWorkspaceLayout {
            gu,
            g,
            dgu,
            wh,
            dx_perm,
            dw,
            dz,
            shared,
            bytes,
        })
    }
}

/// The MoE layer backward resolved for a shape class on one device.
pub struct MoeBackwardPlan {
    class: MoeClass,
    ctx: Arc<CudaContext>,
    /// [`BWD_ENTRIES`], in order.
    funcs: Vec<CudaFunction>,
}

impl std::fmt::Debug for MoeBackwardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeBackwardPlan")
            .field("class", &self.class)
            .finish()
    }
}

/// Parameters of one grouped GEMM over rows (kernel `moe_bwd_gemm_rows`).
struct RowsGemm {
    a: u64,
    a_rs: i32,
    a_gather: i32,
    b: u64,
    b_gs: i64,
    b_ks: i32,
    b_ns: i32,
    c: u64,
    ldc: i32,
    row_token: u64,
    offsets: u64,
    groups: i32,
    total_rows: i32,
    n_cols: i32,
    k_dim: i32,
}

/// Parameters of one weight-gradient grouped GEMM (kernel `moe_bwd_gemm_wgrad`).
struct WgradGemm {
    a: u64,
    a_rs: i32,
    a_gather: i32,
    b: u64,
    b_rs: i32,
    b_gather: i32,
    c: u64,
    m_dim: i32,
    n_cols: i32,
    row_token: u64,
    offsets: u64,
    total_rows: i32,
    groups: u32,
}

fn ceil(a: usize, b: u32) -> u32 {
    a.div_ceil(b as usize) as u32
}

fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::invalid(format!(
            "the MoE backward's {what} ({v}) exceeds the kernels' 32-bit index range"
        ))
    })
}

impl MoeBackwardPlan {
    /// Compile (or load from the cache) the backward kernels for `class`. Errors for a
    /// class the kernels do not take: f32 storage, hidden or intermediate not a multiple
    /// of 32, no experts, top_k outside 1..=experts, a device older than sm_80.
    pub fn new(dev: &Device, class: MoeClass) -> Result<MoeBackwardPlan> {
        Self::check_class(&class)?;
        if dev.arch() < 80 {
            return Err(Error::unsupported(
                PLAN,
                format!(
                    "needs compute capability 8.0 or newer (mma.sync bf16) but {} is {}.{}",
                    dev.info().name,
                    dev.info().compute_capability.0,
                    dev.info().compute_capability.1
                ),
            ));
        }
        let defs = bwd_defines(class.dtype)?;
        let funcs = BWD_ENTRIES
            .iter()
            .map(|e| dev.load_kernel(BWD_SOURCE, e, &defs))
            .collect::<Result<Vec<_>>>()?;
        for (f, bytes) in [(0, ROWS_SMEM_BYTES), (1, WGRAD_SMEM_BYTES)] {
            dev.set_dynamic_shared_memory(BWD_ENTRIES[f], &funcs[f], bytes)?;
        }
        Ok(MoeBackwardPlan {
            class,
            ctx: dev.context().clone(),
            funcs,
        })
    }

    /// The class checks (no device).
    pub fn check_class(c: &MoeClass) -> Result<()> {
        bwd_defines(c.dtype)?;
        if c.hidden == 0 || c.hidden % 32 != 0 || c.intermediate == 0 || c.intermediate % 32 != 0 {
            return Err(Error::invalid(format!(
                "the MoE backward needs hidden and intermediate positive multiples of 32 \
                 (got hidden {}, intermediate {})",
                c.hidden, c.intermediate
            )));
        }
        if c.experts == 0 || c.top_k == 0 || c.top_k > c.experts {
            return Err(Error::invalid(format!(
                "the MoE backward needs 1 <= top_k <= experts (got top_k {}, experts {})",
                c.top_k, c.experts
            )));
        }
        if c.max_tokens == 0 {
            return Err(Error::invalid("max_tokens must be at least 1"));
        }
        let rows = c.max_tokens.checked_mul(c.top_k).ok_or_else(too_big)?;
        i32_of("routed rows", rows)?;
        i32_of("hidden × experts", c.hidden.saturating_mul(c.experts))?;
        i32_of("tokens × hidden", c.max_tokens.saturating_mul(c.hidden))?;
        Ok(())
    }

    pub fn class(&self) -> &MoeClass {
        &self.class
    }

    pub fn workspace_layout(&self, tokens: usize) -> Result<BwdWorkspaceLayout> {
        BwdWorkspaceLayout::new(&self.class, tokens)
    }

    /// Workspace bytes of a call with `tokens` tokens (monotone in `tokens`).
    pub fn workspace_bytes(&self, tokens: usize) -> Result<usize> {
        Ok(self.workspace_layout(tokens)?.bytes)
    }

    /// The O(1) checks of a call (no GPU): every tensor's dtype, shape, alignment and
    /// contiguity, the shared tensors exactly when the class has one, 1..=max_tokens
    /// tokens. Returns the token count.
    pub fn check(&self, a: &MoeBwdArgs) -> Result<usize> {
        let c = &self.class;
        let (h, i, e, k, dt) = (c.hidden, c.intermediate, c.experts, c.top_k, c.dtype);
        if a.x.rank != 2 || a.x.shape[1] != h {
            return Err(Error::invalid(format!(
                "x must be [tokens, {h}] but has shape {:?}",
                a.x.shape()
            )));
        }
        let t = a.x.shape[0];
        if t == 0 || t > c.max_tokens {
            return Err(Error::invalid(format!(
                "x has {t} tokens but the plan takes 1..={}",
                c.max_tokens
            )));
        }
        let r = t * k;
        let b16 =
            |name: &str, x: &RawTensor, shape: &[usize]| x.expect_contiguous(name, dt, shape, 16);
        let f32t = |name: &str, x: &RawTensor, shape: &[usize]| {
            x.expect_contiguous(name, DType::F32, shape, 4)
        };
        b16("x", &a.x, &[t, h])?;
        b16("router", &a.router, &[h, e])?;
        b16("w13", &a.w13, &[e, h, 2 * i])?;
        b16("w2", &a.w2, &[e, i, h])?;
        b16("d_out", &a.d_out, &[t, h])?;
        b16("dx", &a.dx, &[t, h])?;
        b16("d_router", &a.d_router, &[h, e])?;
        b16("dw13", &a.dw13, &[e, h, 2 * i])?;
        b16("dw2", &a.dw2, &[e, i, h])?;
        a.topk_ids.expect("topk_ids", r)?;
        f32t("topk_w", &a.topk_w, &[t, k])?;
        a.counts.expect("counts", e)?;
        f32t("logits", &a.saved.logits, &[t, e])?;
        a.saved.offsets.expect("offsets", e + 1)?;
        a.saved.row_token.expect("row_token", r)?;
        a.saved.slot_row.expect("slot_row", r)?;
        if let Some(d) = &a.d_losses {
            f32t("d_losses", d, &[2])?;
        }
        let shared = [
            ("shared_w13", a.shared_w13, vec![h, 2 * i]),
            ("shared_w2", a.shared_w2, vec![i, h]),
            ("d_shared_w13", a.d_shared_w13, vec![h, 2 * i]),
            ("d_shared_w2", a.d_shared_w2, vec![i, h]),
        ];
        for (name, x, shape) in &shared {
            match (c.shared_expert, x) {
                (true, Some(x)) => b16(name, x, shape)?,
                (true, None) => {
                    return Err(Error::invalid(format!(
                        "{name} is missing: the class has a shared expert"
                    )))
                }
                (false, Some(_)) => {
                    return Err(Error::invalid(format!(
                        "{name} is given but the class has no shared expert"
                    )))
                }
                (false, None) => {}
            }
        }
        Ok(t)
    }

    /// Enqueue the backward on `stream`.
    ///
    /// # Safety
    /// Every address in `a` is device memory of the plan's context holding the tensor its
    /// descriptor states, `workspace` holds [`MoeBackwardPlan::workspace_bytes`]`(T)`
    /// bytes there, and all of it stays valid and untouched by other work until the
    /// enqueued work completes. The saved routing tensors are the ones the forward of the
    /// same x and weights wrote (the kernels index memory through them: offsets must be
    /// non-decreasing from 0 to T·k, row_token < T, slot_row a permutation of 0..T·k,
    /// topk_ids < E). The outputs overlap no input and no other output. `stream` is a
    /// stream of the plan's context (or null / the legacy stream).
    pub unsafe fn backward_raw(
        &self,
        stream: RawStream,
        a: &MoeBwdArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let t = self.check(a)?;
        let ws = self.workspace_layout(t)?;
        workspace.check(ws.bytes, WORKSPACE_ALIGN as u64, PLAN)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        backward_steps(&self.class, t, a, &ws, workspace.ptr, &mut |step| unsafe {
            self.launch_step(stream, step)
        })
    }

    /// [`Self::backward_raw`] with `after(i, kind)` called after the i-th launch is
    /// enqueued (`kind`: "rows", "wgrad", "swiglu", "router_dz", "router_dw",
    /// "unpermute"): the lab's per-kernel timing records an event there.
    ///
    /// # Safety
    /// As [`Self::backward_raw`].
    #[cfg(feature = "lab")]
    pub unsafe fn backward_raw_each(
        &self,
        stream: RawStream,
        a: &MoeBwdArgs,
        workspace: RawWorkspace,
        after: &mut dyn FnMut(usize, &'static str) -> Result<()>,
    ) -> Result<()> {
        let t = self.check(a)?;
        let ws = self.workspace_layout(t)?;
        workspace.check(ws.bytes, WORKSPACE_ALIGN as u64, PLAN)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let mut n = 0;
        backward_steps(&self.class, t, a, &ws, workspace.ptr, &mut |step| unsafe {
            let kind = step.kind();
            self.launch_step(stream, step)?;
            after(n, kind)?;
            n += 1;
            Ok(())
        })
    }

    unsafe fn launch(
        &self,
        f: usize,
        cfg: LaunchConfig,
        stream: RawStream,
        p: &mut [*mut c_void],
    ) -> Result<()> {
        raw::launch(BWD_ENTRIES[f], &self.funcs[f], cfg, stream, p)
    }

    unsafe fn launch_step(&self, stream: RawStream, step: Step) -> Result<()> {
        match step {
            Step::Rows(g) => self.rows_gemm(stream, &g),
            Step::Wgrad(g) => self.wgrad_gemm(stream, &g),
            Step::Swiglu { slots, ptrs, inter } => self.swiglu(stream, slots, ptrs, inter),
            Step::RouterDz(p, v) => {
                let mut a: [*mut c_void; 12] = [
                    param(&p[0]),
                    param(&p[1]),
                    param(&p[2]),
                    param(&p[3]),
                    param(&p[4]),
                    param(&p[5]),
                    param(&p[6]),
                    param(&v[0]),
                    param(&v[1]),
                    param(&v[2]),
                    param(&v[3]),
                    param(&v[4]),
                ];
                self.launch(3, elem_cfg(v[0] as usize), stream, &mut a)
            }
            Step::RouterDw(p, v) => {
                let mut a: [*mut c_void; 6] = [
                    param(&p[0]),
                    param(&p[1]),
                    param(&p[2]),
                    param(&v[0]),
                    param(&v[1]),
                    param(&v[2]),
                ];
                // RD_TILE (32) columns x 32 experts per block (moe_backward.cu).
                let cfg = LaunchConfig {
                    grid_dim: (ceil(v[1] as usize, 32), ceil(v[2] as usize, 32), 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                self.launch(4, cfg, stream, &mut a)
            }
            Step::Unpermute(p, v) => {
                let mut a: [*mut c_void; 10] = [
                    param(&p[0]),
                    param(&p[1]),
                    param(&p[2]),
                    param(&p[3]),
                    param(&p[4]),
                    param(&p[5]),
                    param(&v[0]),
                    param(&v[1]),
                    param(&v[2]),
                    param(&v[3]),
                ];
                // UP_THREADS columns x UP_TOK tokens per block (moe_backward.cu).
                let cfg = LaunchConfig {
                    grid_dim: (ceil(v[0] as usize, 16), ceil(v[1] as usize, 256), 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                self.launch(5, cfg, stream, &mut a)
            }
        }
    }

    unsafe fn rows_gemm(&self, stream: RawStream, g: &RowsGemm) -> Result<()> {
        let groups = g.groups.max(1) as u32;
        let tiles = ceil(g.total_rows as usize, TILE) + if g.offsets != 0 { groups } else { 0 };
        let cfg = LaunchConfig {
            grid_dim: (tiles.max(1), ceil(g.n_cols as usize, TILE), 1),
            block_dim: (GEMM_THREADS, 1, 1),
            shared_mem_bytes: ROWS_SMEM_BYTES,
        };
        let mut p: [*mut c_void; 15] = [
            param(&g.a),
            param(&g.a_rs),
            param(&g.a_gather),
            param(&g.b),
            param(&g.b_gs),
            param(&g.b_ks),
            param(&g.b_ns),
            param(&g.c),
            param(&g.ldc),
            param(&g.row_token),
            param(&g.offsets),
            param(&g.groups),
            param(&g.total_rows),
            param(&g.n_cols),
            param(&g.k_dim),
        ];
        self.launch(0, cfg, stream, &mut p)
    }

    unsafe fn wgrad_gemm(&self, stream: RawStream, g: &WgradGemm) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (
                ceil(g.m_dim as usize, TILE) * ceil(g.n_cols as usize, TILE),
                g.groups,
                1,
            ),
            block_dim: (GEMM_THREADS, 1, 1),
            shared_mem_bytes: WGRAD_SMEM_BYTES,
        };
        let mut p: [*mut c_void; 12] = [
            param(&g.a),
            param(&g.a_rs),
            param(&g.a_gather),
            param(&g.b),
            param(&g.b_rs),
            param(&g.b_gather),
            param(&g.c),
            param(&g.m_dim),
            param(&g.n_cols),
            param(&g.row_token),
            param(&g.offsets),
            param(&g.total_rows),
        ];
        self.launch(1, cfg, stream, &mut p)
    }

    /// `ptrs` = gu, G, slot_row (0: identity), topk_w (0: w = 1), dgu, wh, dw (0: none).
    unsafe fn swiglu(
        &self,
        stream: RawStream,
        slots: usize,
        ptrs: [u64; 7],
        inter: i32,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (slots as u32, 1, 1),
            block_dim: (SWIGLU_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut p: [*mut c_void; 8] = [
            param(&ptrs[0]),
            param(&ptrs[1]),
            param(&ptrs[2]),
            param(&ptrs[3]),
            param(&ptrs[4]),
            param(&ptrs[5]),
            param(&ptrs[6]),
            param(&inter),
        ];
        self.launch(2, cfg, stream, &mut p)
    }
}

/// One kernel launch of the backward and its parameters: [`MoeBackwardPlan::backward_raw`]
/// enqueues it; the CPU model of the kernels in the tests interprets it.
enum Step {
    Rows(RowsGemm),
    Wgrad(WgradGemm),
    /// `ptrs` = gu, G, slot_row (0: identity), topk_w (0: w = 1), dgu, wh, dw (0: none).
    Swiglu {
        slots: usize,
        ptrs: [u64; 7],
        inter: i32,
    },
    /// (logits, ids, topk_w, dw, counts, d_losses, dz), (tokens, experts, top_k, sigmoid,
    /// renormalize).
    RouterDz([u64; 7], [i32; 5]),
    /// (x, dz, d_router), (tokens, hidden, experts).
    RouterDw([u64; 3], [i32; 3]),
    /// (dx_perm, slot_row, dx_shared (0: none), dz, router, dx), (tokens, hidden, experts,
    /// top_k).
    Unpermute([u64; 6], [i32; 4]),
}

impl Step {
    #[cfg(feature = "lab")]
    fn kind(&self) -> &'static str {
        match self {
            Step::Rows(_) => "rows",
            Step::Wgrad(_) => "wgrad",
            Step::Swiglu { .. } => "swiglu",
            Step::RouterDz(..) => "router_dz",
            Step::RouterDw(..) => "router_dw",
            Step::Unpermute(..) => "unpermute",
        }
    }
}

/// The backward's launches in stream order for a checked call of `t` tokens, workspace at
/// `base` laid out as `ws`, each handed to `f`.
fn backward_steps(
    c: &MoeClass,
    t: usize,
    a: &MoeBwdArgs,
    ws: &BwdWorkspaceLayout,
    base: u64,
    f: &mut dyn FnMut(Step) -> Result<()>,
) -> Result<()> {
    let (h, i, e, k) = (c.hidden, c.intermediate, c.experts, c.top_k);
    let r = t * k;
    let at = |off: usize| base + off as u64;
    let (hi, ii, ei, ti, ri) = (h as i32, i as i32, e as i32, t as i32, r as i32);
    let (ids, offs, rtok, srow) = (
        a.topk_ids.ptr,
        a.saved.offsets.ptr,
        a.saved.row_token.ptr,
        a.saved.slot_row.ptr,
    );

    // 1. gu = X_perm·W13 (B [K=H][N=2I]).
    f(Step::Rows(RowsGemm {
        a: a.x.ptr,
        a_rs: hi,
        a_gather: 1,
        b: a.w13.ptr,
        b_gs: (h * 2 * i) as i64,
        b_ks: 2 * ii,
        b_ns: 1,
        c: at(ws.gu),
        ldc: 2 * ii,
        row_token: rtok,
        offsets: offs,
        groups: ei,
        total_rows: ri,
        n_cols: 2 * ii,
        k_dim: hi,
    }))?;
    // 2. G = dOut_perm·W2ᵀ (W2 [I][H] read as [N=I][K=H]), then the slot epilogue.
    f(Step::Rows(RowsGemm {
        a: a.d_out.ptr,
        a_rs: hi,
        a_gather: 1,
        b: a.w2.ptr,
        b_gs: (i * h) as i64,
        b_ks: 1,
        b_ns: hi,
        c: at(ws.g),
        ldc: ii,
        row_token: rtok,
        offsets: offs,
        groups: ei,
        total_rows: ri,
        n_cols: ii,
        k_dim: hi,
    }))?;
    f(Step::Swiglu {
        slots: r,
        ptrs: [
            at(ws.gu),
            at(ws.g),
            srow,
            a.topk_w.ptr,
            at(ws.dgu),
            at(ws.wh),
            at(ws.dw),
        ],
        inter: ii,
    })?;
    // 3. dW2 = (w⊙H)ᵀ·dOut_perm.
    f(Step::Wgrad(WgradGemm {
        a: at(ws.wh),
        a_rs: ii,
        a_gather: 0,
        b: a.d_out.ptr,
        b_rs: hi,
        b_gather: 1,
        c: a.dw2.ptr,
        m_dim: ii,
        n_cols: hi,
        row_token: rtok,
        offsets: offs,
        total_rows: ri,
        groups: e as u32,
    }))?;
    // 4. dX_perm = dGU·W13ᵀ (W13 [H][2I] read as [N=H][K=2I]).
    f(Step::Rows(RowsGemm {
        a: at(ws.dgu),
        a_rs: 2 * ii,
        a_gather: 0,
        b: a.w13.ptr,
        b_gs: (h * 2 * i) as i64,
        b_ks: 1,
        b_ns: 2 * ii,
        c: at(ws.dx_perm),
        ldc: hi,
        row_token: rtok,
        offsets: offs,
        groups: ei,
        total_rows: ri,
        n_cols: hi,
        k_dim: 2 * ii,
    }))?;
    // 5. dW13 = X_permᵀ·dGU.
    f(Step::Wgrad(WgradGemm {
        a: a.x.ptr,
        a_rs: hi,
        a_gather: 1,
        b: at(ws.dgu),
        b_rs: 2 * ii,
        b_gather: 0,
        c: a.dw13.ptr,
        m_dim: hi,
        n_cols: 2 * ii,
        row_token: rtok,
        offsets: offs,
        total_rows: ri,
        groups: e as u32,
    }))?;
    // 6. Router: dZ, then d_router = xᵀ·dZ.
    {
        let logits = a.saved.logits.ptr;
        let (tw, dw, cnt) = (a.topk_w.ptr, at(ws.dw), a.counts.ptr);
        let dl = a.d_losses.map_or(0u64, |d| d.ptr);
        let dz = at(ws.dz);
        let (ki, sig, rn) = (
            k as i32,
            i32::from(c.scoring == Scoring::Sigmoid),
            i32::from(c.renormalize),
        );
        f(Step::RouterDz(
            [logits, ids, tw, dw, cnt, dl, dz],
            [ti, ei, ki, sig, rn],
        ))?;
        f(Step::RouterDw([a.x.ptr, dz, a.d_router.ptr], [ti, hi, ei]))?;
    }
    // 7. Shared expert: one group of all tokens, w = 1, no dw.
    let dx_shared = if let (Some(sh), Some(sw13), Some(sw2), Some(dsw13), Some(dsw2)) = (
        ws.shared,
        a.shared_w13,
        a.shared_w2,
        a.d_shared_w13,
        a.d_shared_w2,
    ) {
        let [s_gu, s_g, s_dgu, s_h, s_dx] = sh.map(at);
        let one = |a_: u64, a_rs, b: u64, b_ks, b_ns, c: u64, ldc, n_cols, k_dim| RowsGemm {
            a: a_,
            a_rs,
            a_gather: 0,
            b,
            b_gs: 0,
            b_ks,
            b_ns,
            c,
            ldc,
            row_token: 0,
            offsets: 0,
            groups: 1,
            total_rows: ti,
            n_cols,
            k_dim,
        };
        f(Step::Rows(one(
            a.x.ptr,
            hi,
            sw13.ptr,
            2 * ii,
            1,
            s_gu,
            2 * ii,
            2 * ii,
            hi,
        )))?;
        f(Step::Rows(one(
            a.d_out.ptr,
            hi,
            sw2.ptr,
            1,
            hi,
            s_g,
            ii,
            ii,
            hi,
        )))?;
        f(Step::Swiglu {
            slots: t,
            ptrs: [s_gu, s_g, 0, 0, s_dgu, s_h, 0],
            inter: ii,
        })?;
        let wg = |a_: u64, a_rs, b: u64, b_rs, c: u64, m_dim, n_cols| WgradGemm {
            a: a_,
            a_rs,
            a_gather: 0,
            b,
            b_rs,
            b_gather: 0,
            c,
            m_dim,
            n_cols,
            row_token: 0,
            offsets: 0,
            total_rows: ti,
            groups: 1,
        };
        f(Step::Wgrad(wg(s_h, ii, a.d_out.ptr, hi, dsw2.ptr, ii, hi)))?;
        f(Step::Rows(one(
            s_dgu,
            2 * ii,
            sw13.ptr,
            1,
            2 * ii,
            s_dx,
            hi,
            hi,
            2 * ii,
        )))?;
        f(Step::Wgrad(wg(
            a.x.ptr,
            hi,
            s_dgu,
            2 * ii,
            dsw13.ptr,
            hi,
            2 * ii,
        )))?;
        s_dx
    } else {
        0
    };
    // 8. Un-permute + shared + router.
    let (dxp, dz, rw, dx, ki) = (at(ws.dx_perm), at(ws.dz), a.router.ptr, a.dx.ptr, k as i32);
    f(Step::Unpermute(
        [dxp, srow, dx_shared, dz, rw, dx],
        [ti, hi, ei, ki],
    ))
}

fn elem_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (ceil(n, ELEM_THREADS).max(1), 1, 1),
        block_dim: (ELEM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(all(test, feature = "lab"))]
#[path = "backward_model_tests.rs"]
mod model_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn class(shared: bool) -> MoeClass {
        MoeClass {
            dtype: DType::Bf16,
            hidden: 64,
            intermediate: 32,
            experts: 4,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            shared_expert: shared,
            max_tokens: 16,
        }
    }

    #[test]
    fn workspace_regions_are_aligned_disjoint_and_monotone() {
        for shared in [false, true] {
            let c = class(shared);
            let mut last = 0;
            for t in 1..=16 {
                let l = BwdWorkspaceLayout::new(&c, t).unwrap();
                let mut regions = vec![
                    (l.gu, t * 2 * 2 * 32 * 4),
                    (l.g, t * 2 * 32 * 4),
                    (l.dgu, t * 2 * 64 * 2),
                    (l.wh, t * 2 * 32 * 2),
                    (l.dx_perm, t * 2 * 64 * 4),
                    (l.dw, t * 2 * 4),
                    (l.dz, t * 4 * 4),
                ];
                if let Some(s) = l.shared {
                    regions.extend([
                        (s[0], t * 64 * 4),
                        (s[1], t * 32 * 4),
                        (s[2], t * 64 * 2),
                        (s[3], t * 32 * 2),
                        (s[4], t * 64 * 4),
                    ]);
                }
                assert_eq!(l.shared.is_some(), shared);
                for w in regions.windows(2) {
                    assert!(w[0].0 + w[0].1 <= w[1].0, "{t}: overlap");
                }
                for (o, _) in &regions {
                    assert_eq!(o % WORKSPACE_ALIGN, 0);
                }
                let (o, n) = regions[regions.len() - 1];
                assert!(o + n <= l.bytes && l.bytes % WORKSPACE_ALIGN == 0);
                assert!(l.bytes >= last);
                last = l.bytes;
            }
        }
    }

    #[test]
    fn bad_classes_are_rejected_with_the_reason() {
        let bad = [
            (
                MoeClass {
                    dtype: DType::F32,
                    ..class(false)
                },
                "f32",
            ),
            (
                MoeClass {
                    hidden: 48,
                    ..class(false)
                },
                "multiples of 32",
            ),
            (
                MoeClass {
                    top_k: 5,
                    ..class(false)
                },
                "top_k",
            ),
            (
                MoeClass {
                    max_tokens: 0,
                    ..class(false)
                },
                "max_tokens",
            ),
        ];
        for (c, what) in bad {
            let e = MoeBackwardPlan::check_class(&c).unwrap_err().to_string();
            assert!(e.contains(what), "{what}: {e}");
        }
        MoeBackwardPlan::check_class(&class(true)).unwrap();
    }
}
