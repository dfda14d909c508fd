//! `flashmoe._core.MoeBackwardPlan`: the MoE layer's backward
//! ([`flashmoe::moe::backward`]) for the torch op `flashmoe::moe_backward`
//! (`flashmoe/_moe_autograd.py`). Same conventions as the other plans of `_core`:
//! descriptors in, addresses of outputs the torch layer allocated, the caller's stream, no
//! allocation.
//!
//! The forward's routing tensors (logits, offsets, row tables) live in the first bytes of
//! the forward's workspace ([`WorkspaceLayout`]: they are carved before every other
//! region, for both GEMM paths); the torch layer keeps that prefix
//! ([`MoeBackwardPlan::saved_bytes`]) as a uint8 tensor and hands its address here.

use crate::common::{half_dtype, py_err, same_dtype, Desc};
use crate::moe::moe_plan_class;
use flashmoe::gpu::{self, RawTensor, RawWorkspace};
use flashmoe::moe::backward::{MoeBackwardPlan as Plan, MoeBwdArgs, SavedRouting};
use flashmoe::moe::{RawU32, WorkspaceLayout};
use flashmoe::DType;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The MoE backward for one class (dims, dtype, top-k, scoring, shared expert) and calls
/// of 1..=max_tokens tokens on one device.
#[pyclass(frozen, module = "flashmoe._core")]
pub(crate) struct MoeBackwardPlan {
    plan: Plan,
}

impl MoeBackwardPlan {
    /// The forward workspace's routing prefix: its layout for `tokens` and its length.
    fn saved_layout(&self, tokens: usize) -> PyResult<(WorkspaceLayout, usize)> {
        let c = self.plan.class();
        let l = WorkspaceLayout::new(c, tokens, false).map_err(py_err)?;
        let end = tokens
            .checked_mul(c.top_k)
            .and_then(|r| r.checked_mul(4))
            .and_then(|b| b.checked_add(l.slot_row))
            .ok_or_else(|| PyValueError::new_err("tokens × top_k overflows"))?;
        Ok((l, end))
    }
}

#[pymethods]
impl MoeBackwardPlan {
    #[new]
    #[pyo3(signature = (device, dtype, hidden, intermediate, experts, top_k, scoring, renormalize, shared_expert, max_tokens))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        dtype: &str,
        hidden: usize,
        intermediate: usize,
        experts: usize,
        top_k: usize,
        scoring: &str,
        renormalize: bool,
        shared_expert: bool,
        max_tokens: usize,
    ) -> PyResult<Self> {
        let class = moe_plan_class(
            half_dtype(dtype, "an MoE backward plan")?,
            (hidden, intermediate, experts, top_k),
            scoring,
            renormalize,
            shared_expert,
            max_tokens,
        )?;
        let dev = crate::common::device(device)?;
        Ok(MoeBackwardPlan {
            plan: Plan::new(&dev, class).map_err(py_err)?,
        })
    }

    /// Largest token count of a call.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.plan.class().max_tokens
    }

    /// Bytes of the backward's workspace for `tokens` tokens (nothing to zero); with
    /// `gate_up_saved`, for a call that reads the forward's gate/up (smaller: no f32
    /// recompute region).
    #[pyo3(signature = (tokens, gate_up_saved=false))]
    fn workspace_bytes(&self, tokens: usize, gate_up_saved: bool) -> PyResult<usize> {
        if gate_up_saved {
            self.plan.workspace_bytes_with_saved_gate_up(tokens)
        } else {
            self.plan.workspace_bytes(tokens)
        }
        .map_err(py_err)
    }

    /// Bytes at the start of the forward's workspace that the backward reads (the routing
    /// regions): keep `ws[:saved_bytes(T)]` from the forward.
    fn saved_bytes(&self, tokens: usize) -> PyResult<usize> {
        Ok(self.saved_layout(tokens)?.1)
    }

    /// Enqueue the backward on `stream`. x, router_w, w13, w2, `shared` ((w13, w2) or
    /// None) and d_out are descriptors; topk_ids (int32 [T, k]), topk_w (f32 [T, k]),
    /// counts (int32 [E]) are the forward's routing outputs, `saved` the address of the
    /// kept forward-workspace prefix of `saved_bytes` bytes; d_losses the address of f32
    /// [2] (d_aux, d_z) or 0; the outputs are addresses of contiguous tensors the caller
    /// allocated: dx [T, H], d_router [H, E], dw13 [E, H, 2I], dw2 [E, I, H] and
    /// `d_shared` ((d_w13 [H, 2I], d_w2 [I, H]) or None), all of x's dtype; `gate_up`: the
    /// address of the forward's [T·k, 2I] gate/up (its `gate_up` output), or 0 to
    /// recompute them.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, x, router_w, w13, w2, shared, topk_ids, topk_w, counts, saved, saved_bytes, d_out, d_losses, dx, d_router, dw13, dw2, d_shared, workspace, workspace_bytes, gate_up=0))]
    fn backward(
        &self,
        stream: usize,
        x: Desc,
        router_w: Desc,
        w13: Desc,
        w2: Desc,
        shared: Option<(Desc, Desc)>,
        topk_ids: u64,
        topk_w: u64,
        counts: u64,
        saved: u64,
        saved_bytes: usize,
        d_out: Desc,
        d_losses: u64,
        dx: u64,
        d_router: u64,
        dw13: u64,
        dw2: u64,
        d_shared: Option<(u64, u64)>,
        workspace: u64,
        workspace_bytes: usize,
        gate_up: u64,
    ) -> PyResult<()> {
        let c = self.plan.class();
        let (t, h, i, e, k, dt) = (
            x.2.first().copied().unwrap_or(0),
            c.hidden,
            c.intermediate,
            c.experts,
            c.top_k,
            c.dtype,
        );
        for (name, d) in [
            ("x", &x),
            ("router_w", &router_w),
            ("w13", &w13),
            ("w2", &w2),
            ("d_out", &d_out),
        ] {
            same_dtype(name, d.float(name)?, dt, "the plan")?;
        }
        let (l, need) = self.saved_layout(t)?;
        if saved == 0 || saved_bytes < need {
            return Err(PyValueError::new_err(format!(
                "saved holds {saved_bytes} bytes but the forward's routing regions need {need}"
            )));
        }
        let at = |off: usize| saved + off as u64;
        let own = |ptr, shape: &[usize]| RawTensor::contiguous(ptr, dt, shape).map_err(py_err);
        let f32s = |ptr, shape: &[usize]| RawTensor::contiguous(ptr, DType::F32, shape);
        let (s13, s2) = match &shared {
            Some((a, b)) => (Some(a.raw("shared_w13")?), Some(b.raw("shared_w2")?)),
            None => (None, None),
        };
        let (ds13, ds2) = match d_shared {
            Some((a, b)) => (Some(own(a, &[h, 2 * i])?), Some(own(b, &[i, h])?)),
            None => (None, None),
        };
        let args = MoeBwdArgs {
            saved_gate_up: match gate_up {
                0 => None,
                p => Some(own(p, &[t * k, 2 * i])?),
            },
            x: x.raw("x")?,
            router: router_w.raw("router_w")?,
            w13: w13.raw("w13")?,
            w2: w2.raw("w2")?,
            shared_w13: s13,
            shared_w2: s2,
            topk_ids: RawU32 {
                ptr: topk_ids,
                len: t * k,
            },
            topk_w: f32s(topk_w, &[t, k]).map_err(py_err)?,
            counts: RawU32 {
                ptr: counts,
                len: e,
            },
            saved: SavedRouting {
                logits: f32s(at(l.logits), &[t, e]).map_err(py_err)?,
                offsets: RawU32 {
                    ptr: at(l.offsets),
                    len: e + 1,
                },
                row_token: RawU32 {
                    ptr: at(l.row_token),
                    len: t * k,
                },
                slot_row: RawU32 {
                    ptr: at(l.slot_row),
                    len: t * k,
                },
            },
            d_out: d_out.raw("d_out")?,
            d_losses: if d_losses == 0 {
                None
            } else {
                Some(f32s(d_losses, &[2]).map_err(py_err)?)
            },
            dx: own(dx, &[t, h])?,
            d_router: own(d_router, &[h, e])?,
            dw13: own(dw13, &[e, h, 2 * i])?,
            dw2: own(dw2, &[e, i, h])?,
            d_shared_w13: ds13,
            d_shared_w2: ds2,
        };
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: the inputs are live torch tensors checked against the class by
        // backward_raw; the routing tensors and the saved prefix come from the forward of
        // the same x and weights (the torch layer keeps them together in the autograd
        // context); the outputs and the workspace are fresh allocations of this call on
        // this stream.
        unsafe {
            self.plan
                .backward_raw(stream as gpu::RawStream, &args, ws)
                .map_err(py_err)
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MoeBackwardPlan>()
}
