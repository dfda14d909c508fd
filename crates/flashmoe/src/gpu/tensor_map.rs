//! TMA tensor maps (`CUtensorMap`) for the sm_90a kernels.
//!
//! A tensor map describes a 16-bit row-major tensor in global memory (its address,
//! extents and byte strides) and the box one `cp.async.bulk.tensor` copies into shared
//! memory. The kernels take it by value as a `const __grid_constant__` parameter
//! (`FmTensorMap` in `kernels/common/fm_sm90.cuh`), so it is encoded once per buffer on the host.
//! Every map here uses the 128-byte swizzle the wgmma descriptors expect and reads
//! out-of-bounds elements as zero.

#![allow(clippy::manual_is_multiple_of)] // rust-version 1.80: no is_multiple_of

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::device::Device;
use cudarc::driver::{sys, CudaSlice, DevicePtr, DeviceRepr};

/// An encoded `CUtensorMap`: 128 opaque bytes, 64-byte aligned as the driver requires.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TensorMap(sys::CUtensorMap);

// SAFETY: plain bytes with the layout and alignment of the kernel's FmTensorMap parameter.
unsafe impl DeviceRepr for TensorMap {}

impl std::fmt::Debug for TensorMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TensorMap(..)")
    }
}

/// What a tiled 16-bit tensor map covers: `dims[0]` is the contiguous dimension; element
/// (i0, i1, i2) lives at `i0 + i1·strides[0] + i2·strides[1]` elements from the base.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TiledLayout {
    pub dims: Vec<u64>,
    /// Element strides of dimensions 1.. (one fewer than `dims`).
    pub strides: Vec<u64>,
    /// Box extents (elements); `box_dims[0]` · 2 bytes must be 128 (the swizzle span).
    pub box_dims: Vec<u32>,
}

impl TiledLayout {
    /// The driver's constraints, checked here so that a violation names the tensor instead
    /// of surfacing as CUDA_ERROR_INVALID_VALUE.
    pub fn check(&self, name: &str) -> Result<()> {
        let bad = |why: String| Err(Error::unsupported("tensor map", format!("{name}: {why}")));
        let rank = self.dims.len();
        if !(1..=5).contains(&rank) || self.strides.len() + 1 != rank || self.box_dims.len() != rank
        {
            return bad(format!(
                "rank {rank} with {} strides and {} box extents",
                self.strides.len(),
                self.box_dims.len()
            ));
        }
        if self.box_dims[0] * 2 != 128 {
            return bad(format!(
                "inner box of {} elements is not the 128-byte swizzle span",
                self.box_dims[0]
            ));
        }
        for (i, (&d, &b)) in self.dims.iter().zip(&self.box_dims).enumerate() {
            if d == 0 || d > 1 << 32 {
                return bad(format!("extent {d} of dimension {i} is outside 1..=2^32"));
            }
            if b == 0 || b > 256 {
                return bad(format!(
                    "box extent {b} of dimension {i} is outside 1..=256"
                ));
            }
        }
        for (i, &s) in self.strides.iter().enumerate() {
            let bytes = s * 2;
            if bytes % 16 != 0 || bytes >= 1 << 40 {
                return bad(format!(
                    "stride of dimension {} ({bytes} bytes) must be a multiple of 16 below 2^40",
                    i + 1
                ));
            }
        }
        Ok(())
    }

    /// Elements the layout spans from its base (for the buffer-size check).
    pub fn span(&self) -> u64 {
        1 + (self.dims[0] - 1)
            + self
                .dims
                .iter()
                .skip(1)
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<u64>()
    }
}

/// Encode a tensor map over the 16-bit buffer `buf` (dtype f16 or bf16), checking that
/// the layout stays inside the buffer.
pub fn encode_tiled(
    dev: &Device,
    name: &str,
    buf: &CudaSlice<u16>,
    dtype: DType,
    layout: &TiledLayout,
) -> Result<TensorMap> {
    layout.check(name)?;
    if layout.span() > buf.len() as u64 {
        return Err(Error::unsupported(
            "tensor map",
            format!(
                "{name}: the layout spans {} elements but the buffer holds {}",
                layout.span(),
                buf.len()
            ),
        ));
    }
    let (ptr, _guard) = buf.device_ptr(dev.stream());
    encode_raw(name, ptr, dtype, layout)
}

/// The driver's element type of a 16-bit tensor.
pub(crate) fn map_data_type(name: &str, dtype: DType) -> Result<sys::CUtensorMapDataType> {
    match dtype {
        DType::F16 => Ok(sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
        DType::Bf16 => Ok(sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
        DType::F32 => Err(Error::unsupported(
            "tensor map",
            format!("{name}: only 16-bit tensors are mapped"),
        )),
    }
}

/// Encode a tensor map over the device address `ptr`, which the caller keeps alive (and
/// large enough for `layout`) while the map is used.
pub fn encode_raw(name: &str, ptr: u64, dtype: DType, layout: &TiledLayout) -> Result<TensorMap> {
    layout.check(name)?;
    if ptr % 16 != 0 {
        return Err(Error::invalid(format!(
            "{name}: device address {ptr:#x} is not 16-byte aligned (TMA requires it)"
        )));
    }
    let data_type = map_data_type(name, dtype)?;
    encode_checked(
        name,
        ptr,
        data_type,
        &layout.dims,
        &layout.strides,
        &layout.box_dims,
    )
}

/// Encode over `ptr` with dims, element strides and box already checked (rank <= 5):
/// no allocation, one driver call (the plans' hot path).
pub(crate) fn encode_checked(
    name: &str,
    ptr: u64,
    data_type: sys::CUtensorMapDataType,
    dims: &[u64],
    strides: &[u64],
    box_dims: &[u32],
) -> Result<TensorMap> {
    let mut strides_bytes = [0u64; 4];
    for (b, s) in strides_bytes.iter_mut().zip(strides) {
        *b = s * 2;
    }
    let elem_strides = [1u32; 5];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every array has `rank` (strides: rank-1) entries, checked above; the map is
    // written by the driver; `ptr` is a device allocation the caller keeps alive.
    let rc = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            dims.len() as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides_bytes.as_ptr(),
            box_dims.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::cuda(
            format!("cuTensorMapEncodeTiled({name}, dims {dims:?}, strides {strides:?}, box {box_dims:?}, {data_type:?})"),
            format!("{rc:?}"),
        ));
    }
    // SAFETY: initialised by the successful call above.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> TiledLayout {
        TiledLayout {
            dims: vec![4096, 300],
            strides: vec![4096],
            box_dims: vec![64, 128],
        }
    }

    #[test]
    fn tensor_map_is_128_bytes_64_aligned() {
        assert_eq!(std::mem::size_of::<TensorMap>(), 128);
        // cudarc's CUtensorMap may carry a stricter alignment; the driver needs >= 64.
        assert!(std::mem::align_of::<TensorMap>() >= 64);
    }

    #[test]
    fn valid_layout_and_span() {
        layout().check("x").unwrap();
        assert_eq!(layout().span(), 4096 * 300);
        let w = TiledLayout {
            dims: vec![256, 64, 3],
            strides: vec![256, 256 * 64],
            box_dims: vec![64, 64, 1],
        };
        w.check("w").unwrap();
        assert_eq!(w.span(), 256 * 64 * 3);
    }

    #[test]
    fn violations_name_the_tensor_and_rule() {
        let mut l = layout();
        l.strides = vec![4100];
        let e = l.check("x_perm").unwrap_err().to_string();
        assert!(e.contains("x_perm") && e.contains("multiple of 16"), "{e}");
        let mut l = layout();
        l.box_dims = vec![32, 128];
        assert!(l.check("a").unwrap_err().to_string().contains("128-byte"));
        let mut l = layout();
        l.box_dims = vec![64, 512];
        assert!(l.check("a").unwrap_err().to_string().contains("1..=256"));
        let mut l = layout();
        l.dims = vec![4096];
        assert!(l.check("a").unwrap_err().to_string().contains("rank"));
    }
}
