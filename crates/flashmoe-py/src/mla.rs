//! `flashmoe._core.MlaDecodePlan`: DeepSeek MLA paged decode
//! ([`flashmoe::attention::mla`]) for the torch op `flashmoe.mla_decode`
//! (`flashmoe/_mla.py`). Same conventions as the other plans of `_core`: descriptors in,
//! addresses of outputs the torch layer allocated, the caller's stream, no allocation.

use crate::common::{device, half_dtype, py_err, same_dtype, Desc};
use flashmoe::attention::mla::{MlaArgs, MlaDecodeClass, MlaDecodePlan as Plan, D_QK, D_V};
use flashmoe::gpu::{self, RawTensor, RawWorkspace};
use flashmoe::DType;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// An MLA decode plan: one class (dtype, query heads, page size, rows per sequence, softmax
/// scale) on one device, serving any batch (<= 65535) and cache length.
#[pyclass(frozen, module = "flashmoe._core")]
pub(crate) struct MlaDecodePlan {
    plan: Plan,
}

#[pymethods]
impl MlaDecodePlan {
    #[new]
    #[pyo3(signature = (device, dtype, heads_q, page_size, max_q_per_seq, softmax_scale))]
    fn new(
        device: usize,
        dtype: &str,
        heads_q: usize,
        page_size: usize,
        max_q_per_seq: usize,
        softmax_scale: f32,
    ) -> PyResult<Self> {
        let class = MlaDecodeClass {
            dtype: half_dtype(dtype, "an MLA decode plan")?,
            heads_q,
            head_dim_qk: D_QK,
            head_dim_v: D_V,
            page_size,
            max_q_per_seq,
            max_batch: 65_535,
            max_seqlen_k: i32::MAX as usize,
            softmax_scale,
        };
        class.validate().map_err(py_err)?;
        let dev = self::device(device)?;
        Ok(MlaDecodePlan {
            plan: Plan::new(&dev, class).map_err(py_err)?,
        })
    }

    /// Bytes of the workspace of a call of `batch` sequences whose table holds
    /// `max_seqlen_k` keys (0: the call runs unsplit). Any contents; nothing survives a call.
    fn workspace_bytes(&self, batch: usize, max_seqlen_k: usize) -> usize {
        self.plan.call_workspace_bytes(batch, max_seqlen_k)
    }

    /// Enqueue MLA decode on `stream`: q (B, Sq, Hq, 576), kv_cache (num_blocks, page_size,
    /// [1,] 576), int32 block_table (B, max_blocks) and seqused_k (B) are descriptors; `o`
    /// (B, Sq, Hq, 512) and `lse` f32 (B, Sq, Hq) addresses of contiguous outputs; the
    /// workspace covers `workspace_bytes(B, max_seqlen_k)`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, q, kv_cache, block_table, seqused_k, o, lse, workspace, workspace_bytes, max_seqlen_k))]
    fn forward(
        &self,
        stream: usize,
        q: Desc,
        kv_cache: Desc,
        block_table: Desc,
        seqused_k: Desc,
        o: u64,
        lse: u64,
        workspace: u64,
        workspace_bytes: usize,
        max_seqlen_k: usize,
    ) -> PyResult<()> {
        let dt = self.plan.class().dtype;
        for (name, d) in [("q", &q), ("kv_cache", &kv_cache)] {
            same_dtype(name, d.float(name)?, dt, "the plan")?;
        }
        let rq = q.raw("q")?;
        let &[b, sq, hq, _] = rq.shape() else {
            return Err(PyValueError::new_err(format!(
                "q must be 4-D (batch, seqlen_q, heads_q, 576) but has shape {:?}",
                rq.shape()
            )));
        };
        let bt = block_table.index_matrix("block_table")?;
        let args = MlaArgs {
            q: rq,
            kv_cache: kv_cache.raw("kv_cache")?,
            seqused_k: seqused_k.index_vector("cache_seqlens", Some(bt.rows))?,
            block_table: bt,
            o: RawTensor::contiguous(o, dt, &[b, sq, hq, D_V]).map_err(py_err)?,
            lse: RawTensor::contiguous(lse, DType::F32, &[b, sq, hq]).map_err(py_err)?,
            max_seqlen_k: Some(max_seqlen_k),
        };
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: the torch layer passes live tensors of the plan's device (descriptors from
        // the tensors themselves, outputs it allocated with these shapes, a workspace of
        // `workspace_bytes`), the current stream of that device, and cache_seqlens within
        // the table's capacity (the kernel clamps to it and to [0, num_blocks)).
        unsafe {
            self.plan
                .forward_raw(stream as gpu::RawStream, &args, ws)
                .map_err(py_err)
        }
    }
}

/// Add the MLA classes to `_core`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MlaDecodePlan>()
}
