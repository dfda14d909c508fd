//! The expert-parallel MoE layer: one rank's share of a layer whose experts are split over
//! the ranks of an NCCL communicator (one process per GPU).

use super::comm::{Communicator, Transfer};
use super::exchange::{chunk_experts, Exchange};
use super::placement::ExpertPlacement;
use crate::error::{Error, Result};
use crate::gpu::raw::{RawEvent, RawStream, RawWorkspace};
use crate::gpu::Device;
use crate::moe::forward::abi::BACKEND;
use crate::moe::forward::plan::{MoeArgs, MoeClass, MoePlan};
use cudarc::driver::{result as dr, sys, CudaContext};
use std::sync::Arc;

/// Device memory owned by the layer (freed on drop).
struct DeviceAlloc {
    ptr: u64,
    bytes: usize,
}

impl DeviceAlloc {
    fn new(bytes: usize, what: &str) -> Result<DeviceAlloc> {
        // SAFETY: the caller bound the layer's context; freed once in Drop.
        let ptr = unsafe { dr::malloc_sync(bytes.max(256)) }
            .map_err(|e| Error::cuda(format!("cuMemAlloc of {bytes} bytes ({what})"), e))?;
        Ok(DeviceAlloc { ptr, bytes })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync, freed once; the layer's work finished (every
        // call ends in a host wait or the stream owner synchronises before dropping).
        let _ = unsafe { dr::free_sync(self.ptr) };
    }
}

/// Page-locked host memory of `len` u32 (the count and offset exchange).
struct PinnedU32 {
    ptr: *mut u32,
    len: usize,
}

impl PinnedU32 {
    fn new(len: usize) -> Result<PinnedU32> {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; freed once in Drop.
        unsafe { sys::cuMemAllocHost_v2(&mut p, 4 * len.max(1)) }
            .result()
            .map_err(|e| Error::cuda("cuMemAllocHost (expert-parallel counts)", e))?;
        Ok(PinnedU32 {
            ptr: p as *mut u32,
            len,
        })
    }
    fn as_slice(&self) -> &[u32] {
        // SAFETY: len u32 of live pinned memory, written only by completed copies.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn as_mut_slice(&mut self) -> &mut [u32] {
        // SAFETY: as above, and no copy reading it is in flight (see forward_raw).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedU32 {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAllocHost, freed once.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr as *mut std::ffi::c_void) };
    }
}

fn event(timing: bool) -> Result<RawEvent> {
    let flags = if timing {
        sys::CUevent_flags::CU_EVENT_DEFAULT
    } else {
        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
    };
    dr::event::create(flags).map_err(|e| Error::cuda("cuEventCreate", e))
}

unsafe fn record(ev: RawEvent, stream: RawStream) -> Result<()> {
    dr::event::record(ev, stream).map_err(|e| Error::cuda("cuEventRecord", e))
}

unsafe fn wait_on(stream: RawStream, ev: RawEvent) -> Result<()> {
    dr::stream::wait_event(stream, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        .map_err(|e| Error::cuda("cuStreamWaitEvent", e))
}

/// The token count a block of `rows` rows over `groups` experts selects its kernels by in
/// the expert plan (class top_k 1 over `local` experts): the block's rows per expert, so
/// the tile choice follows the single-GPU layer's at the same load.
fn select(rows: usize, groups: usize, local: usize) -> usize {
    (rows * local / groups.max(1)).max(1)
}

/// Measured all-to-all of one call's schedule, alone (no GEMMs running).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExchangeTiming {
    /// Dispatch (tokens to the experts' ranks) and return (expert outputs back), ms.
    pub dispatch_ms: f64,
    pub return_ms: f64,
    /// Bytes this rank sent to other ranks in each direction.
    pub dispatch_bytes: usize,
    pub return_bytes: usize,
}

/// One rank of an expert-parallel MoE layer.
///
/// Every rank holds the router (all experts' columns) and the weights of its own experts;
/// each rank routes its own tokens. A call ([`ExpertParallelMoe::forward_raw`]):
/// 1. router → scoring + top-k → statistics and losses → permutation by expert → token
///    gather (`x_perm`), on the caller's stream: the single-GPU layer's kernels;
/// 2. the per-expert counts of every rank are gathered (NCCL all-gather) and copied to
///    the host: **the one host synchronisation of the call** — NCCL's point-to-point
///    transfers take their sizes from the host, and every later size is known from it;
/// 3. meanwhile the rank's own rows for its own experts run their grouped GEMMs;
/// 4. the rows for the other ranks' experts go out and the peers' rows for this rank's
///    experts come in (grouped `ncclSend` / `ncclRecv`), in `chunks` expert chunks on a
///    communication stream; each chunk's GEMMs start when it arrived and its outputs (f32,
///    as the single-GPU layer keeps them) go back as soon as they are computed;
/// 5. the weighted combine in token order, on the caller's stream, once every output is
///    back.
///
/// Output, routing and losses are those of the single-GPU layer ([`MoePlan`]) on this
/// rank's tokens: the same kernels compute every row, and each row's reduction order does
/// not depend on which other rows share its GEMM, so they are bit-identical. With world
/// size 1 there is no communicator and steps 2 and 4 are skipped: the same code path.
///
/// The layer owns its scratch memory (the plan's workspace at `max_tokens`, receive
/// buffers for the worst case of every peer routing all its rows here) and a
/// communication stream. A call returns after enqueueing; the caller's stream orders the
/// work. Calls on one layer must not overlap (`&mut self`); every rank must make the same
/// sequence of calls.
pub struct ExpertParallelMoe {
    class: MoeClass,
    placement: ExpertPlacement,
    rank: usize,
    chunks: usize,
    route: MoePlan,
    experts: MoePlan,
    comm: Option<Communicator>,
    ctx: Arc<CudaContext>,
    workspace: DeviceAlloc,
    x_recv: DeviceAlloc,
    h_recv: DeviceAlloc,
    y_recv: DeviceAlloc,
    recv_capacity: usize,
    all_counts: DeviceAlloc,
    recv_offsets: DeviceAlloc,
    host_counts: PinnedU32,
    host_offsets: PinnedU32,
    comm_stream: RawStream,
    ev_routed: RawEvent,
    ev_gathered: RawEvent,
    ev_counts: RawEvent,
    ev_disp: Vec<RawEvent>,
    ev_gemm: Vec<RawEvent>,
    ev_ret: Vec<RawEvent>,
    ev_t: [RawEvent; 3],
    last: Option<Exchange>,
}

impl std::fmt::Debug for ExpertParallelMoe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ExpertParallelMoe(rank {} of {}, experts {:?} of {}, {} chunk(s))",
            self.rank,
            self.placement.world(),
            self.placement.range(self.rank),
            self.class.experts,
            self.chunks
        )
    }
}

// SAFETY: the raw handles (stream, events, pinned memory) belong to the layer and are used
// only through &mut self / &self methods, one call at a time.
unsafe impl Send for ExpertParallelMoe {}

impl ExpertParallelMoe {
    /// Build rank `comm.rank()`'s share of the layer `class` (all `class.experts` experts,
    /// `class.max_tokens` tokens per rank and call) split by `placement`, sending each
    /// call's rows in `chunks` expert chunks (1 = no overlap of the transfers with the
    /// GEMMs). `comm` is None exactly when the world has one rank. The layer needs the
    /// sm_90 token gather (compute capability 9.0, 16-bit, the sm_90 tiles' shapes); a
    /// shared expert is not supported yet.
    pub fn new(
        dev: &Device,
        class: MoeClass,
        placement: ExpertPlacement,
        comm: Option<Communicator>,
        chunks: usize,
    ) -> Result<ExpertParallelMoe> {
        let (world, rank) = match &comm {
            Some(c) => (c.world(), c.rank()),
            None => (1, 0),
        };
        if placement.world() != world {
            return Err(Error::invalid(format!(
                "the expert placement is for {} ranks but the communicator has {world}",
                placement.world()
            )));
        }
        if world > 1 && comm.is_none() {
            return Err(Error::invalid(
                "a world of several ranks needs a communicator",
            ));
        }
        if placement.experts() != class.experts {
            return Err(Error::invalid(format!(
                "the expert placement covers {} experts but the class has {}",
                placement.experts(),
                class.experts
            )));
        }
        if class.shared_expert {
            return Err(Error::unsupported(
                BACKEND,
                "the expert-parallel layer has no shared expert yet: run the shared expert \
                 as a dense MLP beside it",
            ));
        }
        if chunks == 0 || chunks > placement.max_local() {
            return Err(Error::invalid(format!(
                "chunks = {chunks}: split each rank's experts into 1..={} chunks",
                placement.max_local()
            )));
        }
        crate::gpu::device::bind_context(dev.context())?;
        let route = MoePlan::with_gemm_path(dev, class, 1, Some("sm90"))?;
        let local = placement.local(rank);
        let own_rows = class.max_tokens * class.top_k;
        let recv_capacity = (world - 1) * own_rows;
        let expert_class = MoeClass {
            experts: local,
            top_k: 1,
            renormalize: false,
            max_tokens: own_rows.max(recv_capacity),
            ..class
        };
        let experts = MoePlan::new(dev, expert_class)?;
        let el = class.dtype.size_bytes();
        let (h, i) = (class.hidden, class.intermediate);
        let ws_bytes = route.max_workspace_bytes();
        let events = |n: usize| (0..n).map(|_| event(false)).collect::<Result<Vec<_>>>();
        let comm_stream = dr::stream::create(dr::stream::StreamKind::NonBlocking)
            .map_err(|e| Error::cuda("cuStreamCreate (expert-parallel communication)", e))?;
        Ok(ExpertParallelMoe {
            workspace: DeviceAlloc::new(ws_bytes, "MoE workspace")?,
            x_recv: DeviceAlloc::new(recv_capacity * h * el, "received tokens")?,
            h_recv: DeviceAlloc::new(recv_capacity * i * el, "received activations")?,
            y_recv: DeviceAlloc::new(recv_capacity * h * 4, "received rows' outputs")?,
            recv_capacity,
            all_counts: DeviceAlloc::new(4 * world * class.experts, "exchanged counts")?,
            recv_offsets: DeviceAlloc::new(4 * world * (local + 1), "receive offsets")?,
            host_counts: PinnedU32::new(world * class.experts)?,
            host_offsets: PinnedU32::new(world * (local + 1))?,
            comm_stream,
            ev_routed: event(false)?,
            ev_gathered: event(false)?,
            ev_counts: event(false)?,
            ev_disp: events(chunks)?,
            ev_gemm: events(chunks)?,
            ev_ret: events(chunks)?,
            ev_t: [event(true)?, event(true)?, event(true)?],
            last: None,
            class,
            placement,
            rank,
            chunks,
            route,
            experts,
            comm,
            ctx: dev.context().clone(),
        })
    }

    pub fn class(&self) -> &MoeClass {
        &self.class
    }
    pub fn placement(&self) -> &ExpertPlacement {
        &self.placement
    }
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The last call's schedule (rows kept, sent and received), once a call ran.
    pub fn last_exchange(&self) -> Option<&Exchange> {
        self.last.as_ref()
    }

    /// Enqueue this rank's share of the layer on `stream`. `a` is the single-GPU layer's
    /// argument set ([`MoeArgs`]) for this rank's tokens, except that `w13` / `w2` hold
    /// this rank's experts only (`[local, H, 2I]`, `[local, I, H]`, the experts
    /// `placement.range(rank)` in order). Blocks the host once, until the counts of every
    /// rank arrived (at most the communicator's timeout, then an error and the
    /// communicator is aborted); returns once everything is enqueued.
    ///
    /// # Safety
    /// The contract of [`MoePlan::forward_raw`] for `a` (the layer's own scratch memory
    /// replaces the workspace) and `stream`.
    pub unsafe fn forward_raw(&mut self, stream: RawStream, a: &MoeArgs) -> Result<()> {
        crate::gpu::device::bind_context(&self.ctx)?;
        if self.comm.as_ref().is_some_and(|c| c.is_aborted()) {
            return Err(Error::invalid(
                "the communicator was aborted after an earlier error: build a new layer",
            ));
        }
        if a.gate_up.is_some() {
            return Err(Error::unsupported(
                BACKEND,
                "gate_up (the saved gate/up pre-activations): the expert-parallel layer has \
                 no backward; pass None",
            ));
        }
        let c = self.class;
        let (r, local) = (self.rank, self.placement.local(self.rank));
        let ws_raw = RawWorkspace {
            ptr: self.workspace.ptr,
            bytes: self.workspace.bytes,
        };
        // The counts are exchanged as soon as the router wrote them (the permutation and
        // the token gather run meanwhile).
        let routed = self.comm.as_ref().map(|_| self.ev_routed);
        let front = self.route.enqueue_front(stream, a, local, ws_raw, routed)?;
        let base = self.workspace.ptr;
        let at = |off: usize| base + off as u64;
        let ws = &front.ws;
        let x_perm = at(ws.x_perm.expect("enqueue_front checked the gather buffer"));
        let (h, y, offsets) = (at(ws.h), at(ws.y), at(ws.offsets));
        let rows = front.tokens * c.top_k;
        let (hid, el) = (c.hidden, c.dtype.size_bytes());
        let (w13, w2) = (a.w13.ptr, a.w2.ptr);
        let w13_expert = (hid * 2 * c.intermediate * el) as u64;
        let w2_expert = (c.intermediate * hid * el) as u64;

        if let Some(comm) = &self.comm {
            wait_on(self.comm_stream, self.ev_routed)?;
            comm.all_gather_u32(
                a.routing.counts.ptr,
                self.all_counts.ptr,
                c.experts,
                self.comm_stream,
            )?;
            dr::memcpy_dtoh_async(
                std::slice::from_raw_parts_mut(self.host_counts.ptr, self.host_counts.len),
                self.all_counts.ptr,
                self.comm_stream,
            )
            .map_err(|e| Error::cuda("cuMemcpyDtoHAsync (expert counts)", e))?;
            record(self.ev_counts, self.comm_stream)?;
        }
        // The own rows for the own experts run in place (x_perm → h → y at their rows),
        // weights at the expert's slice: local experts `part`, `grid` = their rows (none:
        // nothing to enqueue).
        let (experts, first_expert) = (&self.experts, self.placement.first(r));
        let own = |part: std::ops::Range<usize>, grid: usize| -> Result<()> {
            if grid == 0 {
                return Ok(());
            }
            experts.enqueue_row_gemms(
                stream,
                (
                    x_perm,
                    offsets + 4 * (first_expert + part.start) as u64,
                    h,
                    y,
                ),
                (
                    w13 + part.start as u64 * w13_expert,
                    w2 + part.start as u64 * w2_expert,
                ),
                (rows, grid, part.len()),
                select(grid, part.len(), local),
            )
        };
        let x = if let Some(comm) = self.comm.as_mut() {
            comm.wait(self.ev_counts, "the expert counts of every rank")?;
            // Bad counts leave the peers waiting for transfers that will not come: abort,
            // so every rank gets an error rather than only this one.
            let x = Exchange::new(
                &self.placement,
                r,
                self.host_counts.as_slice(),
                self.chunks,
                self.recv_capacity,
            )
            .inspect_err(|_| comm.abort())?;
            self.host_offsets
                .as_mut_slice()
                .copy_from_slice(&x.recv_offsets);
            dr::memcpy_htod_async(
                self.recv_offsets.ptr,
                self.host_offsets.as_slice(),
                self.comm_stream,
            )
            .map_err(|e| Error::cuda("cuMemcpyHtoDAsync (receive offsets)", e))?;
            let comm = self.comm.as_ref().expect("checked");
            // 4a. dispatch, chunk by chunk, once the gather wrote x_perm.
            record(self.ev_gathered, stream)?;
            wait_on(self.comm_stream, self.ev_gathered)?;
            for ch in 0..self.chunks {
                let (sends, recvs) = self.transfers(&x, ch, x_perm, self.x_recv.ptr, hid * el);
                comm.send_recv(&sends, &recvs, self.comm_stream)?;
                record(self.ev_disp[ch], self.comm_stream)?;
            }
            // 3. The GEMMs in the order that hides the transfers: the own rows of the
            // first expert chunk (while chunk 0 arrives), every received chunk as it
            // arrives, then the rest of the own rows (while the last outputs go back).
            let first = chunk_experts(local, self.chunks, 0);
            let rest = first.end..local;
            let rows_of =
                |p: &std::ops::Range<usize>| x.own_offsets[p.end] - x.own_offsets[p.start];
            own(first.clone(), rows_of(&first))?;
            // 4b. each chunk's GEMMs as it arrives.
            for ch in 0..self.chunks {
                wait_on(stream, self.ev_disp[ch])?;
                let e = chunk_experts(local, self.chunks, ch);
                for s in (0..self.placement.world()).filter(|&s| s != r) {
                    let n = x.recv[ch][s].len();
                    if n == 0 {
                        continue;
                    }
                    let offs = self.recv_offsets.ptr + 4 * (s * (local + 1) + e.start) as u64;
                    self.experts.enqueue_row_gemms(
                        stream,
                        (self.x_recv.ptr, offs, self.h_recv.ptr, self.y_recv.ptr),
                        (
                            w13 + e.start as u64 * w13_expert,
                            w2 + e.start as u64 * w2_expert,
                        ),
                        (x.recv_rows, n, e.len()),
                        select(n, e.len(), local),
                    )?;
                }
                record(self.ev_gemm[ch], stream)?;
            }
            own(rest.clone(), rows_of(&rest))?;
            // 4c. the outputs back, chunk by chunk: y_recv rows to their source, this
            // rank's rows from their experts' ranks into y.
            for ch in 0..self.chunks {
                wait_on(self.comm_stream, self.ev_gemm[ch])?;
                let (recvs, sends) = self.transfers(&x, ch, y, self.y_recv.ptr, hid * 4);
                comm.send_recv(&sends, &recvs, self.comm_stream)?;
                record(self.ev_ret[ch], self.comm_stream)?;
            }
            wait_on(stream, self.ev_ret[self.chunks - 1])?;
            x
        } else {
            // One rank: every row is its own.
            own(0..local, rows)?;
            Exchange::single_rank(rows, local)
        };
        // 5. combine in token order (no shared expert: y is passed as its unread pointer).
        self.route.enqueue_combine(
            stream,
            a,
            front.tokens,
            &front.cfgs,
            (y, at(ws.slot_row), y),
        )?;
        self.last = Some(x);
        Ok(())
    }

    /// Chunk `ch`'s transfers as (peer, address, bytes): rows of `mine` (x_perm / y,
    /// indexed by this rank's permuted rows) to or from the peers' experts, and rows of
    /// `theirs` (x_recv / y_recv) from or to the peers; `row_bytes` per row.
    fn transfers(
        &self,
        x: &Exchange,
        ch: usize,
        mine: u64,
        theirs: u64,
        row_bytes: usize,
    ) -> (Vec<Transfer>, Vec<Transfer>) {
        let peers = (0..self.placement.world()).filter(|&p| p != self.rank);
        let mine_t = peers
            .clone()
            .map(|p| {
                let rg = &x.send[ch][p];
                (
                    p,
                    mine + (rg.start * row_bytes) as u64,
                    rg.len() * row_bytes,
                )
            })
            .collect();
        let theirs_t = peers
            .map(|p| {
                let rg = &x.recv[ch][p];
                (
                    p,
                    theirs + (rg.start * row_bytes) as u64,
                    rg.len() * row_bytes,
                )
            })
            .collect();
        (mine_t, theirs_t)
    }

    /// Time the last call's all-to-all alone: its dispatch, then its return, with nothing
    /// else running (every rank must call it together, after the same call). Waits for
    /// completion (bounded by the communicator's timeout).
    pub fn time_exchange(&mut self) -> Result<ExchangeTiming> {
        let x = self
            .last
            .clone()
            .ok_or_else(|| Error::invalid("time_exchange needs a call first"))?;
        let el = self.class.dtype.size_bytes();
        let hid = self.class.hidden;
        let Some(comm) = self.comm.as_ref() else {
            return Ok(ExchangeTiming {
                dispatch_ms: 0.0,
                return_ms: 0.0,
                dispatch_bytes: 0,
                return_bytes: 0,
            });
        };
        let x_perm = self.workspace.ptr
            + self
                .route
                .workspace_layout(x.rows / self.class.top_k)?
                .x_perm
                .expect("sm_90 layout") as u64;
        let y =
            self.workspace.ptr + self.route.workspace_layout(x.rows / self.class.top_k)?.y as u64;
        let s = self.comm_stream;
        // SAFETY: the layer's own buffers, sized by the same schedule as the call.
        unsafe {
            record(self.ev_t[0], s)?;
            for ch in 0..self.chunks {
                let (sends, recvs) = self.transfers(&x, ch, x_perm, self.x_recv.ptr, hid * el);
                comm.send_recv(&sends, &recvs, s)?;
            }
            record(self.ev_t[1], s)?;
            for ch in 0..self.chunks {
                let (recvs, sends) = self.transfers(&x, ch, y, self.y_recv.ptr, hid * 4);
                comm.send_recv(&sends, &recvs, s)?;
            }
            record(self.ev_t[2], s)?;
        }
        let done = self.ev_t[2];
        self.comm
            .as_mut()
            .expect("checked")
            .wait(done, "the timed all-to-all")?;
        let ms = |a: RawEvent, b: RawEvent| -> Result<f64> {
            // SAFETY: both events recorded and complete.
            unsafe { dr::event::elapsed(a, b) }
                .map(|v| v as f64)
                .map_err(|e| Error::cuda("cuEventElapsedTime", e))
        };
        Ok(ExchangeTiming {
            dispatch_ms: ms(self.ev_t[0], self.ev_t[1])?,
            return_ms: ms(self.ev_t[1], self.ev_t[2])?,
            dispatch_bytes: x.rows_sent() * hid * el,
            return_bytes: x.rows_received() * hid * 4,
        })
    }

    /// Wait (bounded by the timeout) until every rank reached this point: an all-gather
    /// of one word per rank on the communication stream (nothing with one rank). The lab
    /// calls it before a timed call so the time is the layer's, not the ranks' skew.
    pub fn barrier(&mut self) -> Result<()> {
        let Some(comm) = self.comm.as_ref() else {
            return Ok(());
        };
        let s = self.comm_stream;
        // SAFETY: in place in the layer's count buffer (world words of it), which no call
        // uses meanwhile (calls end with the count exchange done).
        unsafe {
            comm.all_gather_u32(
                self.all_counts.ptr + 4 * self.rank as u64,
                self.all_counts.ptr,
                1,
                s,
            )?;
            record(self.ev_counts, s)?;
        }
        let ev = self.ev_counts;
        self.comm.as_mut().expect("checked").wait(ev, "the barrier")
    }

    /// Wait (bounded by the communicator's timeout) until the work enqueued on `stream`
    /// so far completed: the lab's end-of-call synchronisation, which turns a dead or
    /// hung peer into an error on this rank.
    ///
    /// # Safety
    /// `stream` is a live stream of the layer's context.
    pub unsafe fn wait_stream(&mut self, stream: RawStream) -> Result<()> {
        let ev = self.ev_t[2];
        record(ev, stream)?;
        match self.comm.as_mut() {
            Some(c) => c.wait(ev, "the layer's call"),
            None => dr::event::synchronize(ev).map_err(|e| Error::cuda("cuEventSynchronize", e)),
        }
    }
}

impl Drop for ExpertParallelMoe {
    fn drop(&mut self) {
        // SAFETY: the layer's own stream and events, destroyed once; pending work on them
        // is finished by the synchronisation first (or aborted with the communicator).
        unsafe {
            if !self.comm.as_ref().is_some_and(|c| c.is_aborted()) {
                let _ = dr::stream::synchronize(self.comm_stream);
            }
            for ev in [self.ev_routed, self.ev_gathered, self.ev_counts]
                .into_iter()
                .chain(self.ev_disp.iter().copied())
                .chain(self.ev_gemm.iter().copied())
                .chain(self.ev_ret.iter().copied())
                .chain(self.ev_t.iter().copied())
            {
                let _ = dr::event::destroy(ev);
            }
            let _ = dr::stream::destroy(self.comm_stream);
        }
    }
}
