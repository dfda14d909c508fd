//! `flashmoe._core.pad_value_head_dim` / `pad_head_dims`: the router's rule for a value head
//! dim other than the query/key one ([`flashmoe::attention::route::pad_value_head_dim`]) and
//! for head dims the kernels do not serve as they are, so that the torch layer pads and
//! scales exactly as flashmoe-candle does.

use crate::common::py_err;
use flashmoe::attention::route;
use pyo3::prelude::*;

/// `(head_dim, pad_qk, pad_v, softmax_scale)` of a call with query/key head dim
/// `head_dim_qk`, value head dim `head_dim_v` and the caller's `softmax_scale` (None:
/// 1/sqrt(head_dim_qk)): the kernels run at `head_dim`, q and k get `pad_qk` zero columns,
/// v gets `pad_v` (and o loses them), and the padded call passes `softmax_scale` (None: the
/// plan's default, which is then the call's). A head dim that is not a multiple of 8 up to
/// 256 raises `NotImplementedError`, a non-finite scale `ValueError`.
#[pyfunction]
#[pyo3(signature = (head_dim_qk, head_dim_v, softmax_scale=None))]
fn pad_value_head_dim(
    head_dim_qk: usize,
    head_dim_v: usize,
    softmax_scale: Option<f32>,
) -> PyResult<(usize, usize, usize, Option<f32>)> {
    let p = route::pad_value_head_dim(head_dim_qk, head_dim_v, softmax_scale).map_err(py_err)?;
    Ok((p.head_dim, p.pad_qk(), p.pad_v(), p.softmax_scale))
}

/// `(head_dim, pad_qk, pad_v, softmax_scale)` as [`pad_value_head_dim`] for any head dims
/// up to 256 ([`flashmoe::attention::route::pad_head_dims`]): the larger rounded up to a
/// multiple of 8, then to the next head dim of `target`'s kernels: "forward" (any multiple of
/// 8), "backward" (32, 64, 96, 128) or "varlen" (64, 128). A head dim outside 1..=256, or
/// above the target's largest, raises `NotImplementedError`; another target `ValueError`.
#[pyfunction]
#[pyo3(signature = (head_dim_qk, head_dim_v, softmax_scale=None, target="forward"))]
fn pad_head_dims(
    head_dim_qk: usize,
    head_dim_v: usize,
    softmax_scale: Option<f32>,
    target: &str,
) -> PyResult<(usize, usize, usize, Option<f32>)> {
    let target = match target {
        "forward" => route::PadTarget::Forward,
        "backward" => route::PadTarget::Backward,
        "varlen" => route::PadTarget::Varlen,
        other => {
            let msg =
                format!("pad_head_dims: target must be forward, backward or varlen, not {other:?}");
            return Err(pyo3::exceptions::PyValueError::new_err(msg));
        }
    };
    let p = route::pad_head_dims(head_dim_qk, head_dim_v, softmax_scale, target).map_err(py_err)?;
    Ok((p.head_dim, p.pad_qk(), p.pad_v(), p.softmax_scale))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(pad_value_head_dim, m)?)?;
    m.add_function(wrap_pyfunction!(pad_head_dims, m)?)
}
