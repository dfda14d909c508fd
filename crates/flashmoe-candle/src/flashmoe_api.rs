//! The only code that names flashmoe's attention plan API (`flashmoe::attention`), so an
//! API change touches this file alone. Callers: `plans.rs` (plan and workspace creation)
//! and `cuda_fwd.rs` (the launch).
//!
//! TEMPORARY: the API is being written in `crates/flashmoe`. With the `plan-api` feature
//! this module calls it as specified; without it (the default until the API lands) a stub
//! stands in whose `new_plan` returns a clear error, so the rest of the crate builds and
//! its tests run. When the API lands: drop the stub half and the feature.

use crate::check::{ClassKey, Elem};
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaStream, CudaView, CudaViewMut};
use candle_core::Result;
use std::sync::Arc;

/// A BSHD tensor as the kernels see it: shape and element strides.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "plan-api"), allow(dead_code))] // read only by the real API
pub(crate) struct Dims {
    pub shape: [usize; 4],
    pub strides: [usize; 4],
}

fn wrap(what: &str, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("flashmoe {what}: {e}")).bt()
}

#[cfg(feature = "plan-api")]
mod api {
    use super::*;
    use flashmoe::attention::{AttentionClass, AttentionPlan, View, ViewMut};

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
        stream: &CudaStream,
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
            View::new(&q, qd.shape, qd.strides),
            View::new(&k, kd.shape, kd.strides),
            View::new(&v, vd.shape, vd.strides),
            ViewMut::new(&mut o, od.shape, od.strides),
            lse,
            ws,
        )
        .map_err(|e| wrap("attention forward", e))
    }
}

#[cfg(not(feature = "plan-api"))]
mod api {
    //! Stand-in until `flashmoe::attention::AttentionPlan` exists (see the module docs).
    use super::*;

    pub(crate) struct Device;
    pub(crate) struct Plan;
    pub(crate) struct Workspace;

    pub(crate) trait Element:
        candle_core::cuda_backend::CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr
    {
    }
    impl<T> Element for T where
        T: candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr
    {
    }

    pub(crate) fn device(_ctx: &Arc<CudaContext>) -> Result<Device> {
        Ok(Device)
    }

    pub(crate) fn new_plan(_dev: &Device, key: &ClassKey) -> Result<Plan> {
        let _ = (key.elem == Elem::Bf16, key.softmax_scale());
        Err(wrap(
            "attention plan",
            "this build of flashmoe-candle does not call flashmoe yet: the plan API \
             (flashmoe::attention::AttentionPlan) has not landed; rebuild with the \
             `plan-api` feature once it has",
        ))
    }

    pub(crate) fn workspace_bytes(_plan: &Plan) -> usize {
        0
    }

    pub(crate) fn alloc_workspace(_plan: &Plan, _stream: &Arc<CudaStream>) -> Result<Workspace> {
        Ok(Workspace)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<T: Element>(
        _plan: &Plan,
        _stream: &CudaStream,
        _q: (CudaView<'_, T>, Dims),
        _k: (CudaView<'_, T>, Dims),
        _v: (CudaView<'_, T>, Dims),
        _o: (CudaViewMut<'_, T>, Dims),
        _lse: &mut CudaViewMut<'_, f32>,
        _ws: &mut Workspace,
    ) -> Result<()> {
        unreachable!("no plan can be made without the plan API")
    }
}

pub(crate) use api::*;
