//! [`DecodePlan`]: the kernels of a class resolved on one device, the split count and
//! workspace of a call, and the forward's two layers: [`DecodePlan::forward_raw`] (pointers,
//! strides and a `CUstream`) and [`DecodePlan::forward`] (cudarc buffers).

use super::abi::{
    DecodeKernel, DecodeParams, APPEND_ENTRY, BLOCK_N, DECODE_ENTRY, DECODE_SOURCE, MAX_SPLITS,
    THREADS, TICKET_BYTES,
};
use super::args::{check_call, DecodeArgs, DecodeShape};
use super::class::DecodeClass;
use super::select::split_heuristic;
use crate::attention::launch::SplitDevice;
use crate::attention::plan::Bshd;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{self, param, Element, RawIndex, RawStream, RawTensor};
use crate::gpu::{Device, RawWorkspace, Workspace};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use std::ffi::c_void;
use std::sync::Arc;

/// Paged decode kernels resolved for one class on one device.
pub struct DecodePlan {
    pub(super) class: DecodeClass,
    pub(super) kernel: DecodeKernel,
    pub(super) fwd: CudaFunction,
    pub(super) append: CudaFunction,
    pub(super) split: SplitDevice,
}

impl std::fmt::Debug for DecodePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodePlan")
            .field("class", &self.class)
            .field("kernel", &self.kernel)
            .field("split", &self.split)
            .finish()
    }
}

impl DecodePlan {
    /// Validate `class`, compile (or load from the disk cache) its kernels for `dev`, set
    /// the shared-memory limit and read the occupancy the split heuristic uses.
    pub fn new(dev: &Device, class: DecodeClass) -> Result<DecodePlan> {
        Self::build(dev, class, false)
    }

    /// [`DecodePlan::new`] with ALiBi biases (FlashAttention's convention, as
    /// `AttentionPlan::new_alibi`): the logit of query row i and key j gets
    /// `-slope · |d_i - j|` (d_i the row's diagonal, module docs) after the softcap. Calls
    /// go through [`DecodePlan::forward_raw_alibi`] with the slopes.
    pub fn new_alibi(dev: &Device, class: DecodeClass) -> Result<DecodePlan> {
        Self::build(dev, class, true)
    }

    fn build(dev: &Device, class: DecodeClass, alibi: bool) -> Result<DecodePlan> {
        class.validate()?;
        let kernel = DecodeKernel {
            alibi,
            ..DecodeKernel::for_class(&class)
        };
        let defs = kernel.defines();
        let (fwd, split) = SplitDevice::load_main(
            dev,
            "mma.sync bf16, cp.async",
            DECODE_SOURCE,
            DECODE_ENTRY,
            &defs,
            kernel.shared_mem_bytes(),
            THREADS,
        )?;
        let append = dev.load_kernel(DECODE_SOURCE, APPEND_ENTRY, &defs)?;
        Ok(DecodePlan {
            class,
            kernel,
            fwd,
            append,
            split,
        })
    }

    /// Force the number of KV splits (clamped to 1..=[`MAX_SPLITS`]); None restores the
    /// heuristic. The workspace size follows ([`DecodePlan::workspace_bytes`]).
    pub fn with_splits(mut self, splits: Option<usize>) -> DecodePlan {
        self.split.set_override(splits, MAX_SPLITS);
        self
    }

    pub fn class(&self) -> &DecodeClass {
        &self.class
    }
    pub fn kernel(&self) -> &DecodeKernel {
        &self.kernel
    }
    /// Whether the plan adds ALiBi biases ([`DecodePlan::new_alibi`]).
    pub fn is_alibi(&self) -> bool {
        self.kernel.alibi
    }

    /// Check the ALiBi slopes of a call of `batch` sequences (the table's rows): present
    /// exactly when the plan is an ALiBi one, f32, shape `[heads_q]` (one slope per head for
    /// the whole batch) or `[batch, heads_q]`, contiguous heads, 4-byte aligned. Returns the
    /// kernel's batch stride (0 for one vector).
    pub fn check_alibi(&self, slopes: Option<&RawTensor>, batch: usize) -> Result<i64> {
        let hq = self.class.heads_q;
        let s = match (self.kernel.alibi, slopes) {
            (false, None) => return Ok(0),
            (false, Some(_)) => {
                return Err(Error::invalid(
                    "ALiBi slopes were passed to a decode plan built without ALiBi (build it \
                     with DecodePlan::new_alibi)",
                ))
            }
            (true, None) => {
                return Err(Error::invalid(
                    "this decode plan adds ALiBi biases (DecodePlan::new_alibi): pass the \
                     slopes (forward_raw_alibi)",
                ))
            }
            (true, Some(s)) => s,
        };
        match s.rank {
            1 => {
                s.expect("alibi_slopes", DType::F32, &[hq], 4)?;
                Ok(0)
            }
            2 => {
                s.expect("alibi_slopes", DType::F32, &[batch, hq], 4)?;
                Ok(if batch == 1 { 0 } else { s.strides[0] as i64 })
            }
            _ => Err(Error::invalid(format!(
                "alibi_slopes must have shape [heads_q] = [{hq}] or [batch, heads_q] = \
                 [{batch}, {hq}] (f32) but has shape {:?}",
                s.shape()
            ))),
        }
    }
    /// Decode CTAs resident per SM on this device.
    pub fn ctas_per_sm(&self) -> u32 {
        self.split.ctas_per_sm
    }

    /// KV splits of a call with `batch` sequences of at most `max_seqlen_k` keys: the
    /// override, else [`split_heuristic`] over B · Hkv · row blocks (at `max_q_per_seq`)
    /// CTAs, SMs × occupancy slots, and at most one split per
    /// [`MIN_KEYS_PER_SPLIT`](super::MIN_KEYS_PER_SPLIT) keys.
    /// Independent of the call's Sq, so [`DecodePlan::workspace_bytes`] bounds every call.
    pub fn splits(&self, batch: usize, max_seqlen_k: usize) -> usize {
        let m_blocks =
            (self.class.group() * self.class.max_q_per_seq).div_ceil(self.kernel.block_m());
        let ctas = batch * self.class.heads_kv * m_blocks;
        self.split
            .splits(|slots| split_heuristic(ctas, slots, max_seqlen_k.div_ceil(BLOCK_N)))
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
        self.forward_raw_alibi(stream, a, None, workspace)
    }

    /// [`DecodePlan::forward_raw`] with the ALiBi slopes of a [`DecodePlan::new_alibi`]
    /// plan (None on a plain plan): f32 `[heads_q]` or `[batch, heads_q]`
    /// ([`DecodePlan::check_alibi`]).
    ///
    /// # Safety
    /// As [`DecodePlan::forward_raw`]; `alibi`'s address is live device memory of the
    /// plan's context covering its span.
    pub unsafe fn forward_raw_alibi(
        &self,
        stream: RawStream,
        a: &DecodeArgs,
        alibi: Option<&RawTensor>,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let s = self.check(a)?;
        let alibi_bstride = self.check_alibi(alibi, s.batch)?;
        let c = &self.class;
        let (o_off, lse_off, need) = Self::partial_bytes(c, s.splits, s.total_q);
        workspace.check(need, 16, "DecodePlan")?;
        crate::gpu::device::bind_context(&self.split.ctx)?;
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
            alibi: alibi.map_or(0, |t| t.ptr),
            alibi_bstride,
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

    pub(super) fn check_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
        crate::gpu::device::check_stream_context(stream, &self.split.ctx)?;
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
            block_table: RawIndex::block_table(btp, block_table.len(), b)?,
            seqused_k: RawIndex::vector(sup, seqused_k.len()),
            o: RawTensor::new(op, T::DTYPE, &o.shape, &o.strides)?,
            lse: RawTensor::contiguous(lp, DType::F32, &[b, hq, sq])?,
            max_seqlen_k,
            cu_seqlens_q: None,
        };
        let shape = self.check(&args)?;
        for (name, t, len) in [
            ("q", &args.q, q.buf.len()),
            ("k_cache", &args.k_cache, k_cache.buf.len()),
            ("v_cache", &args.v_cache, v_cache.buf.len()),
            ("o", &args.o, o_len),
            ("lse", &args.lse, lse_len),
        ] {
            t.check_within(name, len)?;
        }
        let need = Self::partial_bytes(&self.class, shape.splits, shape.total_q).2;
        workspace.check_for(stream, need, "DecodePlan")?;
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
    f::<DecodePlan>();
}
