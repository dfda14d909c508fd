//! What every family's binding shares: the library's errors as Python exceptions, the
//! tensor descriptor tuple ([`Desc`]) and its checks, the dtype helpers, and one
//! [`Device`] per ordinal over the primary context PyTorch uses.

use flashmoe::attention::decode::RawIndex;
use flashmoe::gpu;
use flashmoe::gpu::Device;
use flashmoe::gpu::RawTensor;
use flashmoe::moe::RawU32;
use flashmoe::DType;
use flashmoe::Error;
use pyo3::exceptions::PyNotImplementedError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::exceptions::PyTypeError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::OnceLock;

/// The library's error as the Python exception its kind calls for.
pub(crate) fn py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidProblem(_) | Error::BufferSize { .. } => PyValueError::new_err(msg),
        Error::Unsupported { .. } => PyNotImplementedError::new_err(msg),
        Error::NoGpu(_) | Error::Cuda { .. } | Error::Compile { .. } | Error::Io { .. } => {
            PyRuntimeError::new_err(msg)
        }
    }
}

/// A tensor as the torch layer describes it: `(data_ptr, dtype, shape, strides)`.
#[derive(FromPyObject)]
pub(crate) struct Desc(
    pub(crate) u64,
    pub(crate) String,
    pub(crate) Vec<usize>,
    pub(crate) Vec<usize>,
);

/// Element type of a descriptor; `i32` is kept apart (routing ids and counts).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    Float(DType),
    I32,
}

pub(crate) fn elem(name: &str, dtype: &str) -> PyResult<Elem> {
    match dtype {
        "bf16" => Ok(Elem::Float(DType::Bf16)),
        "f16" => Ok(Elem::Float(DType::F16)),
        "f32" => Ok(Elem::Float(DType::F32)),
        "i32" => Ok(Elem::I32),
        other => Err(PyTypeError::new_err(format!(
            "{name} has dtype {other}; flashmoe takes bf16 or f16 tensors"
        ))),
    }
}

impl Desc {
    /// The raw tensor of a floating-point descriptor, with `name` in its errors.
    pub(crate) fn raw(&self, name: &str) -> PyResult<RawTensor> {
        self.layout(name, self.float(name)?)
    }

    /// The descriptor's address, shape and strides as a tensor of `dtype`. A size-1
    /// dimension's stride is meaningless (PyTorch may report any value), so it is replaced
    /// by the row-major one: the kernels' stride rules then see only strides that address
    /// memory.
    pub(crate) fn layout(&self, name: &str, dtype: DType) -> PyResult<RawTensor> {
        let (shape, mut strides) = (&self.2, self.3.clone());
        if shape.len() != strides.len() {
            return Err(PyValueError::new_err(format!(
                "{name}: shape {shape:?} and strides {strides:?} differ in length"
            )));
        }
        for i in (0..shape.len()).rev() {
            if shape[i] == 1 {
                strides[i] = if i + 1 < shape.len() {
                    shape[i + 1] * strides[i + 1]
                } else {
                    1
                };
            }
        }
        RawTensor::new(self.0, dtype, shape, &strides).map_err(|e| {
            PyValueError::new_err(format!(
                "{name}: {}",
                e.to_string().trim_start_matches("invalid problem: ")
            ))
        })
    }

    /// The float element type, or a `TypeError` naming the tensor.
    pub(crate) fn float(&self, name: &str) -> PyResult<DType> {
        match elem(name, &self.1)? {
            Elem::Float(d) => Ok(d),
            Elem::I32 => Err(PyTypeError::new_err(format!(
                "{name} has dtype int32; a floating-point tensor is required"
            ))),
        }
    }

    /// An int32 descriptor's strides, or a `TypeError` naming the tensor.
    pub(crate) fn int32(&self, name: &str) -> PyResult<()> {
        if elem(name, &self.1)? != Elem::I32 {
            return Err(PyTypeError::new_err(format!(
                "{name} has dtype {} but int32 is required",
                self.1
            )));
        }
        Ok(())
    }

    /// A contiguous int32 vector (cu_seqlens, cache_seqlens), optionally of `len` elements.
    pub(crate) fn index_vector(&self, name: &str, len: Option<usize>) -> PyResult<RawIndex> {
        self.int32(name)?;
        let (shape, strides) = (&self.2, &self.3);
        let ok_len = len.is_none_or(|n| shape.first() == Some(&n));
        if shape.len() != 1 || strides.len() != 1 || !ok_len || (shape[0] > 1 && strides[0] != 1) {
            return Err(PyValueError::new_err(format!(
                "{name} must be a contiguous 1-D int32 tensor{} but has shape {shape:?} and \
                 strides {strides:?}",
                len.map_or(String::new(), |n| format!(" of {n} elements"))
            )));
        }
        Ok(RawIndex::vector(self.0, shape[0]))
    }

    /// An int32 matrix with contiguous rows (a block table); any row stride.
    pub(crate) fn index_matrix(&self, name: &str) -> PyResult<RawIndex> {
        self.int32(name)?;
        let (shape, strides) = (&self.2, &self.3);
        if shape.len() != 2 || strides.len() != 2 || (shape[1] > 1 && strides[1] != 1) {
            return Err(PyValueError::new_err(format!(
                "{name} must be a 2-D int32 tensor (batch, max_blocks) with contiguous rows but \
                 has shape {shape:?} and strides {strides:?}"
            )));
        }
        let row_stride = if shape[0] > 1 { strides[0] } else { shape[1] };
        Ok(RawIndex {
            ptr: self.0,
            rows: shape[0],
            cols: shape[1],
            row_stride,
        })
    }

    /// The tensor as a contiguous u32/i32 array of `len` elements (routing outputs).
    pub(crate) fn index(&self, name: &str, len: usize) -> PyResult<RawU32> {
        if elem(name, &self.1)? != Elem::I32 {
            return Err(PyTypeError::new_err(format!(
                "{name} has dtype {} but int32 is required",
                self.1
            )));
        }
        // f32 stands in for the 4-byte integers: only the layout is checked here.
        let t = self.layout(name, DType::F32)?;
        if !t.is_contiguous() || t.elems() != len {
            return Err(PyValueError::new_err(format!(
                "{name} must be a contiguous array of {len} elements but has shape {:?} and \
                 strides {:?}",
                t.shape(),
                t.strides()
            )));
        }
        Ok(RawU32 { ptr: t.ptr, len })
    }
}

/// `TypeError` unless `got` is the dtype `want` (of the tensor named `of`).
pub(crate) fn same_dtype(name: &str, got: DType, want: DType, of: &str) -> PyResult<()> {
    if got != want {
        return Err(PyTypeError::new_err(format!(
            "{name} holds {got} elements but {want} ({of}'s dtype) is required"
        )));
    }
    Ok(())
}

/// A placeholder output address for the device-free checks (aligned, never dereferenced).
pub(crate) const CHECK_OUT: u64 = 1 << 20;

/// The float dtype of q (bf16 or f16) and the same dtype for every other named tensor.
pub(crate) fn attention_dtype(q: &Desc, others: &[(&str, &Desc)]) -> PyResult<DType> {
    let dtype = q.float("q")?;
    if dtype == DType::F32 {
        return Err(PyTypeError::new_err(
            "q has dtype f32; flashmoe's attention takes bf16 or f16",
        ));
    }
    for (name, d) in others {
        same_dtype(name, d.float(name)?, dtype, "q")?;
    }
    Ok(dtype)
}

/// A plan's element type from its name: bf16 or f16, else a `TypeError` naming `what`.
pub(crate) fn half_dtype(dtype: &str, what: &str) -> PyResult<DType> {
    match elem("dtype", dtype)? {
        Elem::Float(d) if d != DType::F32 => Ok(d),
        _ => Err(PyTypeError::new_err(format!(
            "dtype {dtype}: {what} takes bf16 or f16"
        ))),
    }
}

/// One `Device` per ordinal over the device's primary context (the one PyTorch uses),
/// shared by every plan of that device (its kernel cache loads each module once).
pub(crate) fn device(ordinal: usize) -> PyResult<Arc<Device>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Device>>>> = OnceLock::new();
    let mut map = DEVICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let count = gpu::device_count().map_err(py_err)?;
    if ordinal >= count {
        return Err(PyRuntimeError::new_err(format!(
            "no GPU available: CUDA device {ordinal} requested but {count} are visible"
        )));
    }
    // The driver loaded above, so retaining the primary context cannot hit cudarc's
    // missing-library panic.
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| {
        PyRuntimeError::new_err(format!(
            "CUDA error retaining the primary context of device {ordinal}: {e}"
        ))
    })?;
    let dev = Arc::new(Device::from_context(ctx).map_err(py_err)?);
    map.insert(ordinal, dev.clone());
    Ok(dev)
}

/// Number of visible CUDA devices; `RuntimeError` naming the reason when there is no
/// usable driver.
#[pyfunction]
pub(crate) fn device_count() -> PyResult<usize> {
    gpu::device_count().map_err(py_err)
}

/// Name and compute capability of device `ordinal` (opens the primary context).
#[pyfunction]
pub(crate) fn device_name(ordinal: usize) -> PyResult<(String, (u32, u32))> {
    let d = device(ordinal)?;
    Ok((d.info().name.clone(), d.info().compute_capability))
}
