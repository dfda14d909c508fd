//! `flashmoe._core.VarlenBackwardPlan`: the varlen attention backward
//! ([`flashmoe::attention::backward::varlen`]) for the torch op
//! `flashmoe.attention_varlen_backward` (`flashmoe/_torch.py`). Same conventions as the
//! other plans of `_core`: descriptors in, outputs the torch layer allocated, the caller's
//! stream, no allocation.

use crate::attention::Logits;
use crate::common::{py_err, Desc};
use flashmoe::attention::backward::varlen::{VarlenBackwardArgs, VarlenBackwardPlan as Plan};
use flashmoe::gpu::{self, RawWorkspace};
use pyo3::prelude::*;

/// A varlen attention backward plan: dq, dk and dv of one class (dtype, head dim, head
/// counts, causal, scale, window, softcap) over packed sequences, on the portable
/// deterministic kernels (head dims 32, 64, 96, 128; compute capability 8.0 or newer).
#[pyclass(frozen, module = "flashmoe._core")]
pub(crate) struct VarlenBackwardPlan {
    plan: Plan,
}

#[pymethods]
impl VarlenBackwardPlan {
    /// The class as for `VarlenPlan`; a head dim or dtype the backward does not serve raises
    /// `NotImplementedError`.
    #[new]
    #[pyo3(signature = (device, dtype, head_dim, heads_q, heads_kv, causal, softmax_scale=None, window=(-1, -1), softcap=0.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        dtype: &str,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
        causal: bool,
        softmax_scale: Option<f32>,
        window: (i32, i32),
        softcap: f32,
    ) -> PyResult<Self> {
        let logits = Logits {
            causal,
            softmax_scale,
            window,
            softcap,
        };
        let class = crate::attention::plan_class(
            "a varlen attention backward plan",
            dtype,
            head_dim,
            heads_q,
            heads_kv,
            logits,
        )?;
        let dev = crate::common::device(device)?;
        Ok(VarlenBackwardPlan {
            plan: Plan::new(&dev, class).map_err(py_err)?,
        })
    }

    /// Bytes of the workspace a call of `total_q` packed query rows needs (any contents:
    /// the launch writes it before reading).
    fn workspace_bytes(&self, total_q: usize) -> usize {
        self.plan.workspace_bytes(total_q)
    }

    /// Enqueue one varlen backward on `stream` (a `CUstream` value). Descriptors of
    /// contiguous tensors: q, o, d_o, dq (total_q, heads_q, head_dim); k, v, dk, dv
    /// (total_k, heads_kv, head_dim); lse f32 (heads_q, total_q) from the forward; int32
    /// cu_seqlens_q / cu_seqlens_k [batch + 1]. Rows of dq, dk, dv inside a sequence are
    /// written; rows outside every sequence are not.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        stream: usize,
        q: Desc,
        k: Desc,
        v: Desc,
        o: Desc,
        d_o: Desc,
        lse: Desc,
        dq: Desc,
        dk: Desc,
        dv: Desc,
        cu_seqlens_q: Desc,
        cu_seqlens_k: Desc,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        workspace: u64,
        workspace_bytes: usize,
    ) -> PyResult<()> {
        let args = VarlenBackwardArgs {
            q: q.raw("q")?,
            k: k.raw("k")?,
            v: v.raw("v")?,
            o: o.raw("o")?,
            d_o: d_o.raw("d_o")?,
            lse: lse.raw("lse")?,
            dq: dq.raw("dq")?,
            dk: dk.raw("dk")?,
            dv: dv.raw("dv")?,
            cu_seqlens_q: cu_seqlens_q.index_vector("cu_seqlens_q", None)?,
            cu_seqlens_k: cu_seqlens_k.index_vector("cu_seqlens_k", None)?,
            max_seqlen_q,
            max_seqlen_k,
        };
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: the torch layer passes live tensors of the device this plan was built on,
        // allocated by PyTorch on the primary context and kept alive by the caching
        // allocator's stream semantics until the stream has run the launches; dq, dk, dv
        // and the workspace are fresh allocations of the shapes the plan checks; the offsets
        // are int32 device tensors of the same device (the kernels clamp them).
        unsafe {
            self.plan
                .backward_raw(stream as gpu::RawStream, &args, ws)
                .map_err(py_err)
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<VarlenBackwardPlan>()
}
