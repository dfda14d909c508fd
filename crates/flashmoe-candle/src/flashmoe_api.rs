//! The only code that names flashmoe's attention plan API (`flashmoe::attention`), so an
//! API change touches this file alone. Callers: `plans.rs` (plan and workspace creation)
//! and `cuda_fwd.rs` (the launch).

use crate::check::{ClassKey, Elem};
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaStream, CudaView, CudaViewMut};
use candle_core::Result;
use std::sync::Arc;

/// A BSHD tensor as the kernels see it: shape and element strides.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub shape: [usize; 4],
    pub strides: [usize; 4],
}

fn wrap(what: &str, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("flashmoe {what}: {e}")).bt()
}

mod api {
    use super::*;
    use flashmoe::attention::{AttentionClass, AttentionPlan, Bshd};

    pub(crate) type Device = flashmoe::gpu::Device;
    pub(crate) type Plan = AttentionPlan;
    pub(crate) type Workspace = flashmoe::attention::Workspace;

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

    pub(crate) fn new_plan(dev: &Device, key: &ClassKey) -> Result<Plan> {
        let class = AttentionClass {
            dtype: match key.elem {
                Elem::Bf16 => flashmoe::DType::Bf16,
                Elem::F16 => flashmoe::DType::F16,
            },
            head_dim: key.head_dim,
            heads_q: key.heads_q,
            heads_kv: key.heads_kv,
            causal: key.causal,
            softmax_scale: Some(key.softmax_scale()),
        };
        AttentionPlan::new(dev, class).map_err(|e| wrap("attention plan", e))
    }

    pub(crate) fn workspace_bytes(plan: &Plan) -> usize {
        plan.workspace_bytes()
    }

    pub(crate) fn alloc_workspace(plan: &Plan, stream: &Arc<CudaStream>) -> Result<Workspace> {
        plan.alloc_workspace(stream)
            .map_err(|e| wrap("workspace", e))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<T: Element>(
        plan: &Plan,
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
}

pub(crate) use api::*;
