//! `flashmoe._core`: the Python binding of flashmoe's plan API (raw layer).
//!
//! It knows nothing of PyTorch: a tensor arrives as a descriptor tuple
//! `(data_ptr, dtype, shape, strides)` (dtype one of "bf16", "f16", "f32", "i32"; strides
//! in elements), a stream as the integer value of a `CUstream`, a workspace as an address
//! and a size. The torch layer (`flashmoe/_torch.py`) builds these from tensors and owns
//! every allocation; this module only checks and enqueues, so a call holds no memory and
//! never synchronises. The checks that need no GPU (`check_attention`, `check_moe`) are
//! the library's own ([`AttentionClass::check_inputs`], [`MoeClass::check_args`]).
//!
//! Errors: bad input raises `TypeError` (a dtype) or `ValueError` (anything else about a
//! tensor) naming the tensor and the rule; a shape class no kernel implements raises
//! `NotImplementedError`; no driver, no GPU or a CUDA failure raises `RuntimeError`.

use pyo3::prelude::*;

// One module per family (its calls' checks and its plan classes), each importing what it
// uses from `common` and the library; lib.rs only registers them.
mod attention;
mod common;
mod decode;
mod mla;
mod moe;
mod moe_bwd;
mod value_dim;
mod varlen_backward;
mod varlen_forward;

use attention::{check_attention, route_attention, AttentionBackwardPlan, AttentionPlan};
use common::{device_count, device_name};
use decode::{check_attention_kvcache, DecodePlan};
use flashmoe::attention::decode::MAX_Q_PER_SEQ;
use moe::{check_moe, MoePlan};
use varlen_forward::{check_attention_varlen, VarlenPlan};

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(check_attention, m)?)?;
    m.add_function(wrap_pyfunction!(route_attention, m)?)?;
    m.add_function(wrap_pyfunction!(check_moe, m)?)?;
    m.add_function(wrap_pyfunction!(check_attention_varlen, m)?)?;
    m.add_function(wrap_pyfunction!(check_attention_kvcache, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(device_name, m)?)?;
    m.add_class::<AttentionPlan>()?;
    m.add_class::<AttentionBackwardPlan>()?;
    m.add_class::<MoePlan>()?;
    m.add_class::<VarlenPlan>()?;
    m.add_class::<DecodePlan>()?;
    mla::register(m)?;
    moe_bwd::register(m)?;
    varlen_backward::register(m)?;
    value_dim::register(m)?;
    m.add("MAX_Q_PER_SEQ", MAX_Q_PER_SEQ)?;
    Ok(())
}
