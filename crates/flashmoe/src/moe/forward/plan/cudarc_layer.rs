//! The cudarc layer: [`MoePlan::forward`] over cudarc buffers on a cudarc stream (candle's
//! storage and stream), the workspace and routing allocations, the weights as cudarc
//! buffers ([`MoeWeights`]) and the routing output buffers ([`MoeRouting`]).

use super::class::{MoeArgs, MoeClass, RoutingArgs};
use super::resolve::MoePlan;
use super::workspace::too_big;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{Element, RawTensor, RawU32};
use crate::gpu::Workspace;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

impl MoePlan {
    /// A workspace for every call of this plan on `stream` (allocates: do it once).
    pub fn alloc_workspace(&self, stream: &Arc<CudaStream>) -> Result<Workspace> {
        Workspace::zeroed(stream, self.max_workspace_bytes())
    }

    /// Routing output buffers for calls of up to `max_tokens` tokens on `stream`
    /// (allocates: do it once).
    pub fn alloc_routing(&self, stream: &Arc<CudaStream>) -> Result<MoeRouting> {
        MoeRouting::new(stream, &self.class)
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
        crate::gpu::device::check_stream_context(stream, &self.ctx)?;
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
            gate_up: None,
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
    /// \[E\] u32
    pub counts: CudaSlice<u32>,
    /// \[2\] f32: (aux, z)
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
