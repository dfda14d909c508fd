//! Paged-KV decode: the class, arguments and checks of a call (`check_attention_kvcache`,
//! the KV append's too) and the plan (`DecodePlan`).

use crate::common::device;
use crate::common::half_dtype;
use crate::common::same_dtype;
use crate::common::CHECK_OUT;
use crate::common::{attention_dtype, py_err, Desc};
use flashmoe::attention::decode::AppendArgs;
use flashmoe::attention::decode::DecodeArgs;
use flashmoe::attention::decode::DecodeClass;
use flashmoe::attention::decode::DecodePlan as DPlan;
use flashmoe::gpu;
use flashmoe::gpu::RawTensor;
use flashmoe::gpu::RawWorkspace;
use flashmoe::DType;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A decode class from the Python layer's parameters (page size taken from the cache per
/// call: it changes no kernel).
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_class(
    dtype: DType,
    head_dim: usize,
    heads_q: usize,
    heads_kv: usize,
    max_q_per_seq: usize,
    window: (i32, i32),
    softcap: f32,
    softmax_scale: Option<f32>,
) -> PyResult<DecodeClass> {
    let class = DecodeClass {
        dtype,
        head_dim,
        heads_q,
        heads_kv,
        page_size: 0,
        max_q_per_seq,
        window,
        softcap,
        softmax_scale,
    };
    class.validate().map_err(py_err)?;
    Ok(class)
}

/// The decode arguments of a call; o and lse at `o`/`lse` (contiguous, q's shape and
/// (B, Hq, Sq) or (Hq, total_q)). `seqused_k` is named `cache_seqlens` in errors.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_args(
    dtype: DType,
    q: &Desc,
    k_cache: &Desc,
    v_cache: &Desc,
    block_table: &Desc,
    seqused_k: &Desc,
    cu_seqlens_q: Option<&Desc>,
    (o, lse): (u64, u64),
) -> PyResult<DecodeArgs> {
    let rq = q.raw("q")?;
    let bt = block_table.index_matrix("block_table")?;
    let seqused = seqused_k.index_vector("cache_seqlens", Some(bt.rows))?;
    let cu = match cu_seqlens_q {
        Some(c) => Some(c.index_vector("cu_seqlens_q", Some(bt.rows + 1))?),
        None => None,
    };
    let lse_shape: &[usize] = match (cu.is_some(), rq.shape()) {
        (false, &[b, sq, hq, _]) => &[b, hq, sq],
        (true, &[t, hq, _]) => &[hq, t],
        (varlen, shape) => {
            return Err(PyValueError::new_err(format!(
                "q must be {} but has shape {shape:?}",
                if varlen {
                    "3-D (total_q, heads_q, head_dim) with cu_seqlens_q"
                } else {
                    "4-D (batch, seqlen_q, heads_q, head_dim)"
                }
            )))
        }
    };
    Ok(DecodeArgs {
        o: RawTensor::contiguous(o, dtype, rq.shape()).map_err(py_err)?,
        lse: RawTensor::contiguous(lse, DType::F32, lse_shape).map_err(py_err)?,
        q: rq,
        k_cache: k_cache.raw("k_cache")?,
        v_cache: v_cache.raw("v_cache")?,
        block_table: bt,
        seqused_k: seqused,
        max_seqlen_k: None,
        cu_seqlens_q: cu,
    })
}

/// The append arguments: new rows k, v (batch, s_new, heads_kv, head_dim) written at
/// `cache_seqlens[b]..` through the block table.
pub(crate) fn append_args(
    k: &Desc,
    v: &Desc,
    k_cache: &Desc,
    v_cache: &Desc,
    block_table: &Desc,
    cache_seqlens: &Desc,
) -> PyResult<AppendArgs> {
    let bt = block_table.index_matrix("block_table")?;
    if let Some(&b) = k.2.first() {
        if b != bt.rows {
            return Err(PyValueError::new_err(format!(
                "k holds new rows of {b} sequences but block_table has {} rows",
                bt.rows
            )));
        }
    }
    Ok(AppendArgs {
        k_new: k.raw("k")?,
        v_new: v.raw("v")?,
        k_cache: k_cache.raw("k_cache")?,
        v_cache: v_cache.raw("v_cache")?,
        seqused_k: cache_seqlens.index_vector("cache_seqlens", Some(bt.rows))?,
        block_table: bt,
    })
}

/// Check a paged-KV-cache attention call without a GPU. q (batch, seqlen_q, heads_q,
/// head_dim), or (total_q, heads_q, head_dim) with int32 cu_seqlens_q [batch + 1]; k_cache,
/// v_cache (num_blocks, page_size, heads_kv, head_dim); int32 block_table (batch,
/// max_blocks) and cache_seqlens [batch]; new rows k, v (batch, s_new, heads_kv, head_dim)
/// to append (both or neither). The class: `max_q_per_seq` (1..=16), `window` (left,
/// right), `softcap`. Returns the shapes of o (q's) and lse ((batch, heads_q, seqlen_q) or
/// (heads_q, total_q)).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_table, cache_seqlens, k=None, v=None, cu_seqlens_q=None, *, max_q_per_seq, window=(-1, 0), softcap=0.0, softmax_scale=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_attention_kvcache(
    q: Desc,
    k_cache: Desc,
    v_cache: Desc,
    block_table: Desc,
    cache_seqlens: Desc,
    k: Option<Desc>,
    v: Option<Desc>,
    cu_seqlens_q: Option<Desc>,
    max_q_per_seq: usize,
    window: (i32, i32),
    softcap: f32,
    softmax_scale: Option<f32>,
) -> PyResult<(Vec<usize>, Vec<usize>)> {
    let dtype = attention_dtype(&q, &[("k_cache", &k_cache), ("v_cache", &v_cache)])?;
    let (hq, d) = match q.2.as_slice() {
        [.., h, d] if q.2.len() >= 3 => (*h, *d),
        shape => {
            return Err(PyValueError::new_err(format!(
                "q must be (batch, seqlen_q, heads_q, head_dim) or (total_q, heads_q, head_dim) \
                 but has shape {shape:?}"
            )))
        }
    };
    let hkv = match k_cache.2.as_slice() {
        [_, _, h, _] => *h,
        shape => {
            return Err(PyValueError::new_err(format!(
                "k_cache must be 4-D (num_blocks, page_size, heads_kv, head_dim) but has shape \
                 {shape:?}"
            )))
        }
    };
    let class = decode_class(
        dtype,
        d,
        hq,
        hkv,
        max_q_per_seq,
        window,
        softcap,
        softmax_scale,
    )?;
    match (&k, &v) {
        (Some(k), Some(v)) => {
            same_dtype("k", k.float("k")?, dtype, "q")?;
            same_dtype("v", v.float("v")?, dtype, "q")?;
            let a = append_args(k, v, &k_cache, &v_cache, &block_table, &cache_seqlens)?;
            class.check_append(&a).map_err(py_err)?;
        }
        (None, None) => {}
        _ => {
            return Err(PyValueError::new_err(
                "k and v are appended together: give both or neither",
            ))
        }
    }
    let a = decode_args(
        dtype,
        &q,
        &k_cache,
        &v_cache,
        &block_table,
        &cache_seqlens,
        cu_seqlens_q.as_ref(),
        (CHECK_OUT, CHECK_OUT),
    )?;
    class.check_args(&a).map_err(py_err)?;
    Ok((a.o.shape().to_vec(), a.lse.shape().to_vec()))
}

/// A paged-KV decode plan: one class (dtype, head dim, head counts, rows per sequence,
/// window, softcap, scale) on one device; the page size comes from the cache per call.
#[pyclass(frozen, module = "flashmoe._core")]
pub(crate) struct DecodePlan {
    plan: DPlan,
}

#[pymethods]
impl DecodePlan {
    #[new]
    #[pyo3(signature = (device, dtype, head_dim, heads_q, heads_kv, max_q_per_seq, window, softcap, softmax_scale=None, alibi=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        dtype: &str,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
        max_q_per_seq: usize,
        window: (i32, i32),
        softcap: f32,
        softmax_scale: Option<f32>,
        alibi: bool,
    ) -> PyResult<Self> {
        let class = decode_class(
            half_dtype(dtype, "a decode plan")?,
            head_dim,
            heads_q,
            heads_kv,
            max_q_per_seq,
            window,
            softcap,
            softmax_scale,
        )?;
        let dev = self::device(device)?;
        let plan = if alibi {
            DPlan::new_alibi(&dev, class)
        } else {
            DPlan::new(&dev, class)
        };
        Ok(DecodePlan {
            plan: plan.map_err(py_err)?,
        })
    }

    /// Bytes of the zeroed workspace of a call of `batch` sequences with a table of
    /// `max_seqlen_k` keys' capacity (0: the call runs unsplit).
    fn workspace_bytes(&self, batch: usize, max_seqlen_k: usize) -> usize {
        self.plan.workspace_bytes(batch, max_seqlen_k)
    }

    /// Enqueue decode attention on `stream`: q, the caches, block_table, seqused_k (keys in
    /// use per sequence) and cu_seqlens_q (None: q is (B, Sq, Hq, D)) are descriptors; `o`
    /// (q's shape) and `lse` f32 ((B, Hq, Sq) or (Hq, total_q)) addresses of contiguous
    /// outputs; the workspace is the stream's own, zeroed, of `workspace_bytes(batch,
    /// max_blocks · page_size)`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, q, k_cache, v_cache, block_table, seqused_k, cu_seqlens_q, o, lse, workspace, workspace_bytes, alibi_slopes=None))]
    fn forward(
        &self,
        stream: usize,
        q: Desc,
        k_cache: Desc,
        v_cache: Desc,
        block_table: Desc,
        seqused_k: Desc,
        cu_seqlens_q: Option<Desc>,
        o: u64,
        lse: u64,
        workspace: u64,
        workspace_bytes: usize,
        alibi_slopes: Option<Desc>,
    ) -> PyResult<()> {
        let dt = self.plan.class().dtype;
        for (name, d) in [("q", &q), ("k_cache", &k_cache), ("v_cache", &v_cache)] {
            same_dtype(name, d.float(name)?, dt, "the plan")?;
        }
        let args = decode_args(
            dt,
            &q,
            &k_cache,
            &v_cache,
            &block_table,
            &seqused_k,
            cu_seqlens_q.as_ref(),
            (o, lse),
        )?;
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: as in AttentionPlan::forward; block_table, seqused_k and cu_seqlens_q are
        // int32 tensors of the same device; the caller keeps seqused_k within the table's
        // capacity (the kernel clamps to it and to [0, num_blocks)); alibi_slopes likewise
        // (f32 on the device, checked against the plan).
        let slopes = alibi_slopes.map(|d| d.raw("alibi_slopes")).transpose()?;
        unsafe {
            self.plan
                .forward_raw_alibi(stream as gpu::RawStream, &args, slopes.as_ref(), ws)
                .map_err(py_err)
        }
    }

    /// Enqueue the append of k, v (batch, s_new, heads_kv, head_dim) into the caches at
    /// positions `cache_seqlens[b] ..` (the lengths before the append) on `stream`.
    #[allow(clippy::too_many_arguments)]
    fn append_kv(
        &self,
        stream: usize,
        k: Desc,
        v: Desc,
        k_cache: Desc,
        v_cache: Desc,
        block_table: Desc,
        cache_seqlens: Desc,
    ) -> PyResult<()> {
        let a = append_args(&k, &v, &k_cache, &v_cache, &block_table, &cache_seqlens)?;
        // SAFETY: as in `forward`; positions past the table's capacity or on block ids out
        // of range are skipped by the kernel.
        unsafe {
            self.plan
                .append_kv_raw(stream as gpu::RawStream, &a)
                .map_err(py_err)
        }
    }
}
