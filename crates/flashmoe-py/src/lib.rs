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

// The crate's shared imports: the family modules below take them with `use super::*`.
use flashmoe::attention::backward::{AttentionBackwardPlan as BPlan, BackwardArgs, BwdMode};
use flashmoe::attention::decode::{
    AppendArgs, DecodeArgs, DecodeClass, DecodePlan as DPlan, RawIndex, MAX_Q_PER_SEQ,
};
use flashmoe::attention::prefill::{abi, tiles};
use flashmoe::attention::route::{self, AttnCall, AttnShape, Elem as HalfElem, Route, WindowSize};
use flashmoe::attention::varlen::{self, VarlenArgs, VarlenPlan as VPlan};
use flashmoe::attention::{AttentionArgs, AttentionClass, AttentionPlan as Plan};
use flashmoe::gpu::{self, Device, RawTensor, RawWorkspace};
use flashmoe::moe::{MoeArgs, MoeClass, MoePlan as MPlan, RawU32, RoutingArgs};
use flashmoe::{DType, Error, Scoring};
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

// One module per family (its calls' checks and its plan classes) over `common`.
mod attention;
mod common;
mod decode;
mod mla;
mod moe;
mod moe_bwd;
mod value_dim;
mod varlen_backward;
mod varlen_forward;

use attention::*;
use common::*;
use decode::*;
use moe::*;
use varlen_forward::*;

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
