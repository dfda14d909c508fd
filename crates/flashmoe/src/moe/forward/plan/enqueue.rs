//! The raw layer of a call: O(1) checks, then the pipeline enqueued on the caller's stream
//! over the caller's pointers and workspace (router → losses → permute → grouped GEMMs
//! (+ shared expert) → combine), and the pieces the expert-parallel layer enqueues alone.

use super::class::MoeArgs;
use super::ranges::Bucket;
use super::resolve::MoePlan;
use super::workspace::{WorkspaceLayout, WORKSPACE_ALIGN};
use crate::error::{Error, Result};
use crate::gpu::raw::{self, param, RawStream, RawWorkspace};
use crate::gpu::tensor_map::{self, TensorMap};
use crate::moe::forward::abi::{self, BACKEND};
use crate::moe::forward::launch::gemm_launch_config;
use crate::moe::forward::select;
use crate::moe::gemm::sm90;
use crate::moe::gemm::tiles;
use cudarc::driver::{CudaFunction, LaunchConfig};
use std::ffi::c_void;

/// What an enqueue runs: the whole layer, or the router stage alone (timed by the lab).
#[derive(Clone, Copy)]
enum Stages {
    Layer,
    Router,
}

/// What [`MoePlan::enqueue_front`] resolved for a call.
pub(crate) struct Front {
    pub tokens: usize,
    pub ws: WorkspaceLayout,
    pub cfgs: [LaunchConfig; 7],
}

impl MoePlan {
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
        crate::gpu::device::bind_context(&self.ctx)?;
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
        crate::gpu::device::bind_context(&self.ctx)?;
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
            Some(funcs) => {
                self.enqueue_sm90_gemms(stream, funcs, (a, offsets, h, y, 0), weights, dims)
            }
            None => {
                let (k13, k2) = (&self.loaded[b.gemm13].0, &self.loaded[b.gemm2].0);
                let cfg13 = gemm_launch_config(k13, grid_rows, groups, c.intermediate)?;
                let cfg2 = gemm_launch_config(k2, grid_rows, groups, c.hidden)?;
                // Rows are already gathered: the token list is the identity.
                self.enqueue_portable(
                    stream,
                    (b.gemm13, b.gemm2),
                    (cfg13, cfg2),
                    (a, self.iota_addr, offsets, weights.0, weights.1, h, y, 0),
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
        if self.entry(b.logits) == tiles::GEMM2_ENTRY {
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
                cfgs[select::K_LOGITS],
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
                cfgs[select::K_LOGITS],
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
            abi::TOPK_ENTRY,
            self.func(self.topk),
            cfgs[select::K_TOPK],
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
            abi::STATS_ENTRY,
            self.func(self.stats),
            cfgs[select::K_STATS],
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
            block_dim: (abi::LOSSES_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        raw::launch(
            abi::LOSSES_ENTRY,
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
        let gate_up = a.gate_up.map_or(0, |g| g.ptr);

        self.enqueue_permute(stream, a, tokens, cfgs, base, ws)?;
        // 5-6. routed experts' grouped GEMMs
        match (b.sm90, ws.x_perm, self.gather) {
            (Some((g13, g2)), Some(x_perm), Some(gather)) => {
                self.enqueue_gather(stream, a.x.ptr, row_token, at(x_perm), rows, gather)?;
                self.enqueue_sm90_gemms(
                    stream,
                    (g13, g2),
                    (at(x_perm), offsets, h, y, gate_up),
                    (a.w13.ptr, a.w2.ptr),
                    (rows, rows, c.experts),
                )?
            }
            (None, _, _) => self.enqueue_portable(
                stream,
                (b.gemm13, b.gemm2),
                (cfgs[select::K_GEMM13], cfgs[select::K_GEMM2]),
                (
                    a.x.ptr, row_token, offsets, a.w13.ptr, a.w2.ptr, h, y, gate_up,
                ),
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
                        0,
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
            abi::PERMUTE_ENTRY,
            self.func(self.permute),
            cfgs[select::K_PERMUTE],
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
            abi::COMBINE_ENTRY,
            self.func(self.combine),
            cfgs[select::K_COMBINE],
            stream,
            &mut p,
        )
    }

    /// gemm13 then gemm2 of the portable kernels (contract steps 5 and 6). `ptrs`: x,
    /// row_token, offsets, w13, w2, h, y, gate_up (0: not written).
    unsafe fn enqueue_portable(
        &self,
        stream: RawStream,
        funcs: (usize, usize),
        cfgs: (LaunchConfig, LaunchConfig),
        ptrs: (u64, u64, u64, u64, u64, u64, u64, u64),
        dims: (i32, i32, i32),
    ) -> Result<()> {
        let (x, row_token, offsets, w13, w2, h, y, gate_up) = ptrs;
        let (hid, inter, experts) = dims;
        let mut p: [*mut c_void; 9] = [
            param(&x),
            param(&row_token),
            param(&offsets),
            param(&w13),
            param(&h),
            param(&gate_up),
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
            block_dim: (sm90::GATHER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        raw::launch(
            sm90::GATHER_ENTRY,
            self.func(gather),
            cfg_gather,
            stream,
            &mut p,
        )
    }

    /// The sm_90 gemm13 (into h) and gemm2 (into y) over contiguous rows, with tensor maps
    /// over this call's addresses. `funcs`: gemm13, gemm2; `bufs`: a (the gathered rows),
    /// offsets (`groups + 1` absolute row offsets), h, y, gate_up (0: not written), all
    /// indexed by the same rows;
    /// `weights`: w13 and w2 of the first group's expert; `dims`: the rows the A and h
    /// maps span, the rows the groups hold at most (the grid), the group count.
    pub(crate) unsafe fn enqueue_sm90_gemms(
        &self,
        stream: RawStream,
        funcs: (usize, usize),
        bufs: (u64, u64, u64, u64, u64),
        weights: (u64, u64),
        dims: (usize, usize, usize),
    ) -> Result<()> {
        let c = &self.class;
        let (a, offsets, h, y, gate_up) = bufs;
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
            sm90::row_tiles(grid_rows, groups, k13.block_m) as i32,
            sm90::row_tiles(grid_rows, groups, k2.block_m) as i32,
        ];
        let cfg13 = sm90::sm90_launch_config(k13, grid_rows, groups, c.intermediate)?;
        let cfg2 = sm90::sm90_launch_config(k2, grid_rows, groups, c.hidden)?;
        let mut p: [*mut c_void; 9] = [
            param(&maps[0]),
            param(&maps[1]),
            param(&offsets),
            param(&h),
            param(&gate_up),
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
}
