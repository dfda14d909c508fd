//! The only code that names flashmoe's attention plan API (`flashmoe::attention`), so an
//! API change touches this file alone. Callers: `plans.rs` (plan and workspace creation)
//! and `cuda_fwd.rs` (the launches).

use crate::check::PlanKey;
use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
};
use candle_core::Result;
use std::sync::Arc;

/// A tensor as the kernels see it: shape and element strides (rank 3 or 4; rank 3 leaves
/// the last entries unused).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub rank: usize,
    pub shape: [usize; 4],
    pub strides: [usize; 4],
}

fn wrap(what: &str, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("flashmoe {what}: {e}")).bt()
}

mod api {
    use super::*;
    use flashmoe::attention::decode::{DecodeArgs, DecodePlan, RawIndex};
    use flashmoe::attention::{AttentionPlan, Bshd, VarlenArgs, VarlenPlan};
    use flashmoe::gpu::raw::RawTensor;

    pub(crate) type Device = flashmoe::gpu::Device;
    pub(crate) type Workspace = flashmoe::attention::Workspace;

    /// The plans a call can run on.
    pub(crate) enum Plan {
        Dense(AttentionPlan),
        Varlen(VarlenPlan),
        Decode(DecodePlan),
    }

    /// Element types both candle and flashmoe move: half::bf16 and half::f16.
    pub(crate) trait Element:
        flashmoe::attention::Element
        + candle_core::cuda_backend::CudaDType
        + candle_core::cuda_backend::cudarc::driver::DeviceRepr
    {
    }
    impl<T> Element for T where
        T: flashmoe::attention::Element
            + candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr
    {
    }

    pub(crate) fn device(ctx: &Arc<CudaContext>) -> Result<Device> {
        Device::from_context(ctx.clone()).map_err(|e| wrap("device", e))
    }

    pub(crate) fn new_plan(dev: &Device, key: &PlanKey) -> Result<Plan> {
        match key {
            PlanKey::Dense(k) => AttentionPlan::new(dev, k.attention_class())
                .map(Plan::Dense)
                .map_err(|e| wrap("attention plan", e)),
            PlanKey::Alibi(k) => AttentionPlan::new_alibi(dev, k.attention_class())
                .map(Plan::Dense)
                .map_err(|e| wrap("attention plan (ALiBi)", e)),
            PlanKey::Varlen(k) => VarlenPlan::new(dev, k.attention_class())
                .map(Plan::Varlen)
                .map_err(|e| wrap("varlen plan", e)),
            PlanKey::Decode(k) => DecodePlan::new(dev, k.decode_class())
                .map(Plan::Decode)
                .map_err(|e| wrap("decode plan", e)),
        }
    }

    /// Workspace bytes of a call on `plan`; decode's depend on the batch and the longest
    /// key sequence.
    pub(crate) fn workspace_bytes(plan: &Plan, batch: usize, max_seqlen_k: usize) -> usize {
        match plan {
            Plan::Dense(p) => p.workspace_bytes(),
            Plan::Varlen(p) => p.workspace_bytes(),
            Plan::Decode(p) => p.workspace_bytes(batch, max_seqlen_k),
        }
    }

    /// A zeroed workspace (every plan leaves its workspace zeroed after a launch, so one
    /// per stream serves them all in stream order).
    pub(crate) fn alloc_workspace(stream: &Arc<CudaStream>, bytes: usize) -> Result<Workspace> {
        Workspace::zeroed(stream, bytes).map_err(|e| wrap("workspace", e))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<T: Element>(
        plan: &AttentionPlan,
        stream: &Arc<CudaStream>,
        q: (CudaView<'_, T>, Dims),
        k: (CudaView<'_, T>, Dims),
        v: (CudaView<'_, T>, Dims),
        o: (CudaViewMut<'_, T>, Dims),
        lse: &mut CudaViewMut<'_, f32>,
        ws: &mut Workspace,
    ) -> Result<()> {
        let (q, qd) = q;
        let (k, kd) = k;
        let (v, vd) = v;
        let (mut o, od) = o;
        plan.forward(
            stream,
            Bshd::new(&q, qd.shape, qd.strides),
            Bshd::new(&k, kd.shape, kd.strides),
            Bshd::new(&v, vd.shape, vd.strides),
            Bshd::new(&mut o, od.shape, od.strides),
            lse,
            ws,
        )
        .map_err(|e| wrap("attention forward", e))
    }

    /// [`forward`] with ALiBi slopes: a contiguous f32 view of shape `slopes.1`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_alibi<T: Element>(
        plan: &AttentionPlan,
        stream: &Arc<CudaStream>,
        q: (CudaView<'_, T>, Dims),
        k: (CudaView<'_, T>, Dims),
        v: (CudaView<'_, T>, Dims),
        o: (CudaViewMut<'_, T>, Dims),
        lse: &mut CudaViewMut<'_, f32>,
        slopes: (CudaView<'_, f32>, &[usize]),
        ws: &mut Workspace,
    ) -> Result<()> {
        let (q, qd) = q;
        let (k, kd) = k;
        let (v, vd) = v;
        let (mut o, od) = o;
        plan.forward_alibi(
            stream,
            Bshd::new(&q, qd.shape, qd.strides),
            Bshd::new(&k, kd.shape, kd.strides),
            Bshd::new(&v, vd.shape, vd.strides),
            Bshd::new(&mut o, od.shape, od.strides),
            lse,
            (&slopes.0, slopes.1),
            ws,
        )
        .map_err(|e| wrap("attention forward (ALiBi)", e))
    }

    /// A raw tensor over `ptr` whose view must lie inside a buffer of `len` elements.
    fn raw<T: Element>(name: &str, ptr: u64, d: &Dims, len: usize) -> Result<RawTensor> {
        let t = RawTensor::new(ptr, T::DTYPE, &d.shape[..d.rank], &d.strides[..d.rank])
            .map_err(|e| wrap(name, e))?;
        if t.span_elems() > len as u64 {
            return Err(wrap(
                name,
                format!(
                    "view spans {} elements but its buffer holds {len}",
                    t.span_elems()
                ),
            ));
        }
        Ok(t)
    }

    fn index(
        name: &str,
        ptr: u64,
        rows: usize,
        cols: usize,
        stride: usize,
        len: usize,
    ) -> Result<RawIndex> {
        let i = RawIndex {
            ptr,
            rows,
            cols,
            row_stride: stride,
        };
        if i.span_elems() > len as u64 {
            return Err(wrap(
                name,
                format!(
                    "spans {} elements but its buffer holds {len}",
                    i.span_elems()
                ),
            ));
        }
        Ok(i)
    }

    /// The buffers of a varlen or paged launch. q, k, v (and o) carry their dims; the
    /// index tensors are int32 views (u32 reinterpreted: same bits below 2^31).
    pub(crate) struct PackedIo<'a, T> {
        pub q: (CudaView<'a, T>, Dims),
        pub k: (CudaView<'a, T>, Dims),
        pub v: (CudaView<'a, T>, Dims),
        pub o: (CudaViewMut<'a, T>, Dims),
        pub lse: CudaViewMut<'a, f32>,
    }

    /// `VarlenPlan` over candle's buffers; every view is checked against its buffer before
    /// the raw launch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn varlen_forward<T: Element>(
        plan: &VarlenPlan,
        stream: &Arc<CudaStream>,
        io: PackedIo<'_, T>,
        cu_seqlens_q: &CudaView<'_, i32>,
        cu_seqlens_k: &CudaView<'_, i32>,
        max_seqlen: (usize, usize),
        ws: &mut Workspace,
    ) -> Result<()> {
        let PackedIo {
            q,
            k,
            v,
            mut o,
            mut lse,
        } = io;
        ws.check_for(stream, plan.workspace_bytes(), "VarlenPlan")
            .map_err(|e| wrap("varlen forward", e))?;
        let (qp, _gq) = q.0.device_ptr(stream);
        let (kp, _gk) = k.0.device_ptr(stream);
        let (vp, _gv) = v.0.device_ptr(stream);
        let (cqp, _gcq) = cu_seqlens_q.device_ptr(stream);
        let (ckp, _gck) = cu_seqlens_k.device_ptr(stream);
        let (o_len, lse_len) = (o.0.len(), lse.len());
        let (op, _go) = o.0.device_ptr_mut(stream);
        let (lp, _gl) = lse.device_ptr_mut(stream);
        let hq = o.1.shape[1];
        let tq = o.1.shape[0];
        let lse_dims = Dims {
            rank: 2,
            shape: [hq, tq, 0, 0],
            strides: [tq, 1, 0, 0],
        };
        let args = VarlenArgs {
            q: raw::<T>("q", qp, &q.1, q.0.len())?,
            k: raw::<T>("k", kp, &k.1, k.0.len())?,
            v: raw::<T>("v", vp, &v.1, v.0.len())?,
            o: raw::<T>("o", op, &o.1, o_len)?,
            lse: raw_f32("lse", lp, &lse_dims, lse_len)?,
            cu_seqlens_q: index(
                "cu_seqlens_q",
                cqp,
                cu_seqlens_q.len(),
                1,
                1,
                cu_seqlens_q.len(),
            )?,
            cu_seqlens_k: index(
                "cu_seqlens_k",
                ckp,
                cu_seqlens_k.len(),
                1,
                1,
                cu_seqlens_k.len(),
            )?,
            max_seqlen_q: max_seqlen.0,
            max_seqlen_k: max_seqlen.1,
        };
        // SAFETY: every address is a live candle allocation of the plan's context (the
        // stream's) covering its view's span (checked above); the guards keep cudarc's stream
        // order until after the launch; the workspace is this stream's (launches in order).
        unsafe { plan.forward_raw(stream.cu_stream(), &args, ws.raw()) }
            .map_err(|e| wrap("varlen forward", e))
    }

    fn raw_f32(name: &str, ptr: u64, d: &Dims, len: usize) -> Result<RawTensor> {
        let t = RawTensor::new(
            ptr,
            flashmoe::DType::F32,
            &d.shape[..d.rank],
            &d.strides[..d.rank],
        )
        .map_err(|e| wrap(name, e))?;
        if t.span_elems() > len as u64 {
            return Err(wrap(
                name,
                format!("spans {} elements but holds {len}", t.span_elems()),
            ));
        }
        Ok(t)
    }

    /// The index tensors of a decode launch (int32 device views).
    pub(crate) struct DecodeIndexes<'a> {
        /// (view, rows, cols, row stride).
        pub block_table: (CudaView<'a, i32>, usize, usize, usize),
        /// `[batch]`, each at most `max_seqlen_k`.
        pub seqused_k: CudaView<'a, i32>,
        /// `[batch + 1]` offsets of a packed q, or None for q `[batch, sq, hq, d]`.
        pub cu_seqlens_q: Option<CudaView<'a, i32>>,
        pub max_seqlen_k: usize,
    }

    /// `DecodePlan` over candle's buffers (q packed `[total_q, hq, d]` with `cu_seqlens_q`,
    /// or `[b, sq, hq, d]`); every view is checked against its buffer before the raw launch.
    pub(crate) fn decode_forward<T: Element>(
        plan: &DecodePlan,
        stream: &Arc<CudaStream>,
        io: PackedIo<'_, T>,
        idx: &DecodeIndexes<'_>,
        ws: &mut Workspace,
    ) -> Result<()> {
        let PackedIo {
            q,
            k,
            v,
            mut o,
            mut lse,
        } = io;
        let (qp, _gq) = q.0.device_ptr(stream);
        let (kp, _gk) = k.0.device_ptr(stream);
        let (vp, _gv) = v.0.device_ptr(stream);
        let (bt, rows, cols, row_stride) = &idx.block_table;
        let (btp, _gb) = bt.device_ptr(stream);
        let (sup, _gs) = idx.seqused_k.device_ptr(stream);
        let cu = idx
            .cu_seqlens_q
            .as_ref()
            .map(|c| (c.device_ptr(stream), c.len()));
        let (o_len, lse_len) = (o.0.len(), lse.len());
        let (op, _go) = o.0.device_ptr_mut(stream);
        let (lp, _gl) = lse.device_ptr_mut(stream);
        let od = o.1;
        // lse: [hq, total_q] packed, [b, hq, sq] otherwise (contiguous).
        let lse_dims = if od.rank == 3 {
            Dims {
                rank: 2,
                shape: [od.shape[1], od.shape[0], 0, 0],
                strides: [od.shape[0], 1, 0, 0],
            }
        } else {
            let [b, sq, hq, _] = od.shape;
            Dims {
                rank: 3,
                shape: [b, hq, sq, 0],
                strides: [hq * sq, sq, 1, 0],
            }
        };
        let args = DecodeArgs {
            q: raw::<T>("q", qp, &q.1, q.0.len())?,
            k_cache: raw::<T>("k_cache", kp, &k.1, k.0.len())?,
            v_cache: raw::<T>("v_cache", vp, &v.1, v.0.len())?,
            block_table: index("block_table", btp, *rows, *cols, *row_stride, bt.len())?,
            seqused_k: index(
                "seqused_k",
                sup,
                idx.seqused_k.len(),
                1,
                1,
                idx.seqused_k.len(),
            )?,
            o: raw::<T>("o", op, &od, o_len)?,
            lse: raw_f32("lse", lp, &lse_dims, lse_len)?,
            max_seqlen_k: Some(idx.max_seqlen_k),
            cu_seqlens_q: match &cu {
                Some(((p, _), n)) => Some(index("cu_seqlens_q", *p, *n, 1, 1, *n)?),
                None => None,
            },
        };
        let shape = plan.check(&args).map_err(|e| wrap("decode forward", e))?;
        ws.check_for(
            stream,
            plan.workspace_bytes(shape.batch, shape.max_seqlen_k),
            "DecodePlan",
        )
        .map_err(|e| wrap("decode forward", e))?;
        // SAFETY: as in `varlen_forward`; seqused_k was clamped to max_seqlen_k on this
        // stream before (the kernel clamps block ids and query offsets itself).
        unsafe { plan.forward_raw(stream.cu_stream(), &args, ws.raw()) }
            .map_err(|e| wrap("decode forward", e))
    }
}

pub(crate) use api::*;
