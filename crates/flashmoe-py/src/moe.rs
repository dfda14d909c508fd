//! The MoE layer's forward: the class, arguments and checks of a call (`check_moe`) and the
//! plan (`MoePlan`); its backward is `moe_bwd.rs`.

use crate::common::{device, half_dtype, py_err, same_dtype, Desc};
use flashmoe::gpu;
use flashmoe::gpu::RawTensor;
use flashmoe::gpu::RawWorkspace;
use flashmoe::moe::MoeArgs;
use flashmoe::moe::MoeClass;
use flashmoe::moe::MoePlan as MPlan;
use flashmoe::moe::RawU32;
use flashmoe::moe::RoutingArgs;
use flashmoe::DType;
use flashmoe::Scoring;
use pyo3::exceptions::PyTypeError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The MoE class of a call, from the shapes of x, the router and the weights.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_class(
    x: &Desc,
    router: &Desc,
    w2: &Desc,
    shared: bool,
    top_k: usize,
    scoring: &str,
    renormalize: bool,
    max_tokens: usize,
) -> PyResult<MoeClass> {
    let dtype = x.float("x")?;
    if dtype == DType::F32 {
        return Err(PyTypeError::new_err(
            "x has dtype f32; flashmoe's MoE takes bf16 or f16",
        ));
    }
    for (name, d) in [("router_w", router), ("w2", w2)] {
        if d.2.len() != 2 + usize::from(name == "w2") {
            return Err(PyValueError::new_err(format!(
                "{name} must be {} but has shape {:?}",
                if name == "w2" {
                    "3-D [experts, intermediate, hidden]"
                } else {
                    "2-D [hidden, experts]"
                },
                d.2
            )));
        }
    }
    if x.2.len() != 2 {
        return Err(PyValueError::new_err(format!(
            "x must be 2-D [tokens, hidden] but has shape {:?}",
            x.2
        )));
    }
    moe_plan_class(
        dtype,
        (x.2[1], w2.2[1], router.2[1], top_k),
        scoring,
        renormalize,
        shared,
        max_tokens,
    )
}

/// The outputs of an MoE call: out, topk_ids, topk_w, counts, losses.
pub(crate) type MoeOutputs = (RawTensor, RawU32, RawTensor, RawU32, RawTensor);

/// The raw arguments of an MoE call, checked against `class` (no GPU needed).
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_args(
    class: &MoeClass,
    x: &Desc,
    router: &Desc,
    w13: &Desc,
    w2: &Desc,
    shared: Option<(Desc, Desc)>,
    (out, topk_ids, topk_w, counts, losses): MoeOutputs,
    gate_up: Option<RawTensor>,
) -> PyResult<MoeArgs> {
    let dt = class.dtype;
    for (name, d) in [("x", x), ("router_w", router), ("w13", w13), ("w2", w2)] {
        same_dtype(name, d.float(name)?, dt, "x")?;
    }
    let (s13, s2) = match &shared {
        Some((a, b)) => {
            same_dtype("shared_w13", a.float("shared_w13")?, dt, "x")?;
            same_dtype("shared_w2", b.float("shared_w2")?, dt, "x")?;
            (Some(a.raw("shared_w13")?), Some(b.raw("shared_w2")?))
        }
        None => (None, None),
    };
    let args = MoeArgs {
        gate_up,
        x: x.raw("x")?,
        router: router.raw("router_w")?,
        w13: w13.raw("w13")?,
        w2: w2.raw("w2")?,
        shared_w13: s13,
        shared_w2: s2,
        out,
        routing: RoutingArgs {
            topk_ids,
            topk_w,
            counts,
            losses,
        },
    };
    class.check_args(&args).map_err(py_err)?;
    Ok(args)
}

/// Check an MoE call without a GPU: x [T, H], router_w [H, E], w13 [E, H, 2I], w2
/// [E, I, H], the shared expert's [H, 2I] and [I, H] (both or neither), and the outputs
/// out [T, H], topk_ids int32 [T, k], topk_w f32 [T, k], counts int32 [E], losses f32 [2].
/// Returns (tokens, hidden, intermediate, experts).
#[pyfunction]
#[pyo3(signature = (x, router_w, w13, w2, shared, out, topk_ids, topk_w, counts, losses, *, top_k, scoring="softmax", renormalize=true))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_moe(
    x: Desc,
    router_w: Desc,
    w13: Desc,
    w2: Desc,
    shared: Option<(Desc, Desc)>,
    out: Desc,
    topk_ids: Desc,
    topk_w: Desc,
    counts: Desc,
    losses: Desc,
    top_k: usize,
    scoring: &str,
    renormalize: bool,
) -> PyResult<(usize, usize, usize, usize)> {
    let tokens = x.2.first().copied().unwrap_or(0);
    let class = moe_class(
        &x,
        &router_w,
        &w2,
        shared.is_some(),
        top_k,
        scoring,
        renormalize,
        tokens.max(1),
    )?;
    let (t, k) = (tokens, class.top_k);
    same_dtype("out", out.float("out")?, class.dtype, "x")?;
    let outs = (
        out.raw("out")?,
        topk_ids.index("topk_ids", t * k)?,
        topk_w.raw("topk_w")?,
        counts.index("counts", class.experts)?,
        losses.raw("losses")?,
    );
    moe_args(&class, &x, &router_w, &w13, &w2, shared, outs, None)?;
    Ok((tokens, class.hidden, class.intermediate, class.experts))
}

/// An MoE plan: one MoE layer for one class (dims, dtype, top-k, scoring, shared
/// expert) and calls of 1..=max_tokens tokens on one device.
#[pyclass(frozen, module = "flashmoe._core")]
pub(crate) struct MoePlan {
    plan: MPlan,
}

/// The class of an MoE call or plan (forward or backward) from the binding's arguments:
/// `dims` = (hidden, intermediate, experts, top_k), `scoring` "softmax" or "sigmoid";
/// validated.
pub(crate) fn moe_plan_class(
    dtype: DType,
    (hidden, intermediate, experts, top_k): (usize, usize, usize, usize),
    scoring: &str,
    renormalize: bool,
    shared_expert: bool,
    max_tokens: usize,
) -> PyResult<MoeClass> {
    let scoring: Scoring = scoring
        .parse()
        .map_err(|e: String| PyValueError::new_err(format!("scoring: {e}")))?;
    let class = MoeClass {
        dtype,
        hidden,
        intermediate,
        experts,
        top_k,
        scoring,
        renormalize,
        shared_expert,
        max_tokens,
    };
    class.problem(1).validate().map_err(py_err)?;
    Ok(class)
}

#[pymethods]
impl MoePlan {
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
            half_dtype(dtype, "an MoE plan")?,
            (hidden, intermediate, experts, top_k),
            scoring,
            renormalize,
            shared_expert,
            max_tokens,
        )?;
        let dev = self::device(device)?;
        Ok(MoePlan {
            plan: MPlan::new(&dev, class).map_err(py_err)?,
        })
    }

    /// Largest token count of a call.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.plan.class().max_tokens
    }

    /// Bytes of the workspace a call of `tokens` tokens needs (nothing to zero).
    fn workspace_bytes(&self, tokens: usize) -> PyResult<usize> {
        self.plan.workspace_bytes(tokens).map_err(py_err)
    }

    /// Enqueue the layer on `stream`: router, permutation, grouped SwiGLU GEMMs (+ shared
    /// expert), combine, and the routing results. x, router_w, w13, w2 and `shared`
    /// (`(w13, w2)` or None) are descriptors; the outputs are the addresses of contiguous
    /// tensors the caller allocated: out [T, H] of x's dtype, topk_ids int32 [T, k],
    /// topk_w f32 [T, k], counts int32 [E], losses f32 [2] = (aux, z); `gate_up`: the
    /// address of a contiguous [T·k, 2I] tensor of x's dtype that also receives the routed
    /// rows' gate/up pre-activations for the backward, or 0.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, x, router_w, w13, w2, shared, out, topk_ids, topk_w, counts, losses, workspace, workspace_bytes, gate_up=0))]
    fn forward(
        &self,
        stream: usize,
        x: Desc,
        router_w: Desc,
        w13: Desc,
        w2: Desc,
        shared: Option<(Desc, Desc)>,
        out: u64,
        topk_ids: u64,
        topk_w: u64,
        counts: u64,
        losses: u64,
        workspace: u64,
        workspace_bytes: usize,
        gate_up: u64,
    ) -> PyResult<()> {
        let c = self.plan.class();
        let (t, h, k, e) = (
            x.2.first().copied().unwrap_or(0),
            c.hidden,
            c.top_k,
            c.experts,
        );
        let f32s = |ptr, shape: &[usize]| RawTensor::contiguous(ptr, DType::F32, shape);
        let outs = (
            RawTensor::contiguous(out, c.dtype, &[t, h]).map_err(py_err)?,
            RawU32 {
                ptr: topk_ids,
                len: t * k,
            },
            f32s(topk_w, &[t, k]).map_err(py_err)?,
            RawU32 {
                ptr: counts,
                len: e,
            },
            f32s(losses, &[2]).map_err(py_err)?,
        );
        let gate_up = match gate_up {
            0 => None,
            p => Some(
                RawTensor::contiguous(p, c.dtype, &[t * k, 2 * c.intermediate]).map_err(py_err)?,
            ),
        };
        let args = moe_args(c, &x, &router_w, &w13, &w2, shared, outs, gate_up)?;
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: as in AttentionPlan::forward; the outputs are fresh contiguous tensors of
        // the shapes above and the workspace a fresh allocation of this call from
        // PyTorch's caching allocator on this stream.
        unsafe {
            self.plan
                .forward_raw(stream as gpu::RawStream, &args, ws)
                .map_err(py_err)
        }
    }
}
