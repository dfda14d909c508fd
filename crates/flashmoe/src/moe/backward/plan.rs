//! [`MoeBackwardPlan`]: the backward's kernels for one class, the O(1) checks and the
//! enqueue of [`super::steps::backward_steps`]'s launches.

use super::abi::*;
use super::sm90::{RowsPath, Sm90RowKernels};
use super::steps::backward_steps;
use super::workspace::too_big;
use super::workspace::{BwdWorkspaceLayout, MoeBwdArgs};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{self, param, RawStream, RawTensor, RawWorkspace};
use crate::gpu::Device;
use crate::moe::forward::plan::{MoeClass, WORKSPACE_ALIGN};
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use std::ffi::c_void;
use std::sync::Arc;

/// The MoE layer backward resolved for a shape class on one device.
pub struct MoeBackwardPlan {
    class: MoeClass,
    ctx: Arc<CudaContext>,
    /// [`BWD_ENTRIES`], in order.
    funcs: Vec<CudaFunction>,
    /// The sm_90a GEMMs, when the path and the device give them (`super::sm90`).
    sm90: Option<Sm90RowKernels>,
}

impl std::fmt::Debug for MoeBackwardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeBackwardPlan")
            .field("class", &self.class)
            .finish()
    }
}

impl MoeBackwardPlan {
    /// Compile (or load from the cache) the backward kernels for `class`. Errors for a
    /// class the kernels do not take: f32 storage, hidden or intermediate not a multiple
    /// of 32, no experts, top_k outside 1..=experts, a device older than sm_80. On an
    /// sm_90 device the routed GEMMs of calls with enough rows per expert run on the
    /// sm_90a kernels (`moe_gemm_sm90.cu`), the rest on the portable ones.
    pub fn new(dev: &Device, class: MoeClass) -> Result<MoeBackwardPlan> {
        Self::with_gemm_path(dev, class, None)
    }

    /// [`Self::new`] with the routed GEMMs' path given explicitly (the lab's A/B switch, the
    /// forward's strings): None / "auto", "portable" (every GEMM on the mma.sync
    /// kernels), "sm90" (the sm_90a GEMMs on every call; an error on other devices;
    /// "sm90-bm64" / "sm90-bm128" mean the same here).
    pub fn with_gemm_path(
        dev: &Device,
        class: MoeClass,
        path: Option<&str>,
    ) -> Result<MoeBackwardPlan> {
        Self::check_class(&class)?;
        let path = RowsPath::parse(path)?;
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
        let sm90 = Sm90RowKernels::for_path(dev, &class, path)?;
        Ok(MoeBackwardPlan {
            class,
            ctx: dev.context().clone(),
            funcs,
            sm90,
        })
    }

    /// The lab's A/B of the weight-gradient kernel's pipeline (sm_90a path only).
    #[cfg(all(test, feature = "lab"))]
    pub(crate) fn set_wgrad_tile(
        &mut self,
        dev: &Device,
        tile: crate::moe::gemm::sm90::WgradTile,
    ) -> Result<()> {
        match self.sm90.as_mut() {
            Some(k) => k.set_wgrad_tile(dev, tile),
            None => Err(Error::invalid("the plan has no sm_90a kernels")),
        }
    }

    /// Whether a call of `tokens` tokens runs its routed GEMMs on the sm_90a kernels.
    pub fn uses_sm90(&self, tokens: usize) -> bool {
        self.sm90
            .as_ref()
            .is_some_and(|k| k.serves(&self.class, tokens))
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

    /// The workspace regions of a call with `tokens` tokens that recomputes gate/up (with
    /// the sm_90a GEMMs' regions whenever the plan has those kernels, so the size is
    /// monotone in `tokens`).
    pub fn workspace_layout(&self, tokens: usize) -> Result<BwdWorkspaceLayout> {
        self.workspace_layout_for(tokens, false)
    }

    /// [`Self::workspace_layout`] of a call with (`gate_up_saved`) or without the
    /// forward's saved gate/up ([`MoeBwdArgs::saved_gate_up`]).
    pub fn workspace_layout_for(
        &self,
        tokens: usize,
        gate_up_saved: bool,
    ) -> Result<BwdWorkspaceLayout> {
        BwdWorkspaceLayout::new(&self.class, tokens, self.sm90.is_some(), gate_up_saved)
    }

    /// Workspace bytes of a call with `tokens` tokens that recomputes gate/up (monotone in
    /// `tokens`; enough for either kind of call).
    pub fn workspace_bytes(&self, tokens: usize) -> Result<usize> {
        Ok(self.workspace_layout(tokens)?.bytes)
    }

    /// Workspace bytes of a call with `tokens` tokens that reads the forward's saved
    /// gate/up: [`Self::workspace_bytes`] less the recomputed gate/up's
    /// `T·k · 2I · 4` bytes.
    pub fn workspace_bytes_with_saved_gate_up(&self, tokens: usize) -> Result<usize> {
        Ok(self.workspace_layout_for(tokens, true)?.bytes)
    }

    /// Bytes of the saved gate/up of `tokens` tokens (`T·k · 2I` 16-bit elements): what a
    /// caller that keeps them holds from the forward to the backward.
    pub fn saved_gate_up_bytes(&self, tokens: usize) -> Result<usize> {
        let c = &self.class;
        tokens
            .checked_mul(c.top_k)
            .and_then(|r| r.checked_mul(2 * c.intermediate))
            .and_then(|n| n.checked_mul(c.dtype.size_bytes()))
            .ok_or_else(too_big)
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
        if let Some(gu) = &a.saved_gate_up {
            b16("saved_gate_up", gu, &[r, 2 * i])?;
        }
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
        let ws = self.workspace_layout_for(t, a.saved_gate_up.is_some())?;
        workspace.check(ws.bytes, WORKSPACE_ALIGN as u64, PLAN)?;
        crate::gpu::device::bind_context(&self.ctx)?;
        let sm90 = self.uses_sm90(t);
        backward_steps(
            &self.class,
            t,
            a,
            &ws,
            workspace.ptr,
            sm90,
            &mut |step| unsafe { self.launch_step(stream, step) },
        )
    }

    /// [`Self::backward_raw`] with `after(i, kind)` called after the i-th launch is
    /// enqueued (`kind`: "gather", "rows", "rows_sm90", "wgrad", "wgrad_sm90", "swiglu",
    /// "router_dz", "router_dw", "router_dw_sum", "unpermute"): the lab's per-kernel timing
    /// records an event
    /// there.
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
        let ws = self.workspace_layout_for(t, a.saved_gate_up.is_some())?;
        workspace.check(ws.bytes, WORKSPACE_ALIGN as u64, PLAN)?;
        crate::gpu::device::bind_context(&self.ctx)?;
        let mut n = 0;
        let sm90 = self.uses_sm90(t);
        backward_steps(
            &self.class,
            t,
            a,
            &ws,
            workspace.ptr,
            sm90,
            &mut |step| unsafe {
                let kind = step.kind();
                self.launch_step(stream, step)?;
                after(n, kind)?;
                n += 1;
                Ok(())
            },
        )
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
        let sm90 = || {
            self.sm90.as_ref().ok_or_else(|| {
                Error::invalid("an sm_90a GEMM step in a plan without those kernels")
            })
        };
        match step {
            Step::Rows(g) => self.rows_gemm(stream, &g),
            Step::Gather {
                src,
                row_token,
                dst,
                rows,
                cols,
            } => sm90()?.gather(stream, (src, row_token, dst), rows, cols),
            Step::Sm90Rows(g) => sm90()?.rows(stream, &g),
            Step::Sm90Wgrad(g) => sm90()?.wgrad(stream, &g),
            Step::Wgrad(g) => self.wgrad_gemm(stream, &g),
            Step::Swiglu {
                slots,
                ptrs,
                inter,
                saved_gu,
            } => self.swiglu(stream, slots, ptrs, inter, saved_gu),
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
                // One warp per token.
                self.launch(3, elem_cfg(32 * v[0] as usize), stream, &mut a)
            }
            Step::RouterDw(p, v) => {
                let mut a: [*mut c_void; 7] = [
                    param(&p[0]),
                    param(&p[1]),
                    param(&p[2]),
                    param(&v[0]),
                    param(&v[1]),
                    param(&v[2]),
                    param(&v[3]),
                ];
                // RD_BM (64) columns x RD_BN (64) experts x one chunk of tokens per block.
                let cfg = LaunchConfig {
                    grid_dim: (
                        ceil(v[1] as usize, 64),
                        ceil(v[2] as usize, 64),
                        v[4] as u32,
                    ),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                self.launch(4, cfg, stream, &mut a)
            }
            Step::RouterDwSum(p, v) => {
                let mut a: [*mut c_void; 4] =
                    [param(&p[0]), param(&p[1]), param(&v[0]), param(&v[1])];
                self.launch(6, elem_cfg(v[1] as usize), stream, &mut a)
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
                // UP_TOK (64) tokens x UP_COLS (64) columns per block, UP_THREADS (128)
                // threads (moe_backward.cu).
                let cfg = LaunchConfig {
                    grid_dim: (ceil(v[0] as usize, 64), ceil(v[1] as usize, 64), 1),
                    block_dim: (128, 1, 1),
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
        saved_gu: bool,
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
        self.launch(if saved_gu { 7 } else { 2 }, cfg, stream, &mut p)
    }
}
