//! The raw layer: the caller's stream and device memory, with no framework types.
//!
//! Plans ([`crate::attention::AttentionPlan`], [`crate::moe::MoePlan`]) enqueue their
//! kernels on a [`RawStream`] the caller owns (a cudarc stream's `cu_stream()`, candle's
//! device stream, PyTorch's `torch.cuda.current_stream().cuda_stream`, or the legacy
//! ([`LEGACY_STREAM`]) and per-thread ([`PER_THREAD_STREAM`]) default streams), reading and
//! writing device addresses the caller owns, described by [`RawTensor`]: address, element
//! type, shape and element strides; [`RawIndex`] (int32 index matrices: block tables,
//! sequence lengths) and [`RawU32`] (expert ids, counts) are the integer views, and
//! [`Element`] the 16-bit element types of the typed (cudarc) layers. Nothing here
//! allocates, synchronises or creates a context or stream.
//!
//! Contract of every raw entry point (checked where that is cheap):
//! - addresses are device allocations of the plan's context (the device's primary
//!   context, shared with the runtime API, candle and PyTorch), live until the enqueued
//!   work completes, and not written by other work while it runs;
//! - 16-bit tensors read by the tensor-copy engine (TMA) start on 16-byte boundaries and
//!   have strides that are multiples of 8 elements (16 bytes); f32 tensors are 4-byte
//!   aligned; the innermost dimension is contiguous (stride 1);
//! - the stream belongs to the plan's context.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use crate::dtype::DType;
use crate::error::{Error, Result};
use cudarc::driver::{result as dr, sys, CudaFunction, DriverError, LaunchConfig};
use std::ffi::c_void;

/// A CUDA stream handle as the driver API knows it (`CUstream`); null is the legacy
/// default stream.
pub type RawStream = sys::CUstream;

/// A CUDA event handle (`CUevent`).
pub type RawEvent = sys::CUevent;

/// `CU_STREAM_LEGACY`: the legacy default stream (synchronises with other blocking streams).
pub const LEGACY_STREAM: RawStream = 0x1 as RawStream;
/// `CU_STREAM_PER_THREAD`: the calling thread's default stream.
pub const PER_THREAD_STREAM: RawStream = 0x2 as RawStream;

/// Largest rank a [`RawTensor`] describes.
pub const MAX_RANK: usize = 4;

/// A borrowed, strided device tensor: `shape[i]` elements along dimension `i`, element
/// `(i0, .., in)` at `ptr + size_of(dtype) · Σ i_k · strides[k]`. Dimensions past `rank`
/// are 1 with stride 0. Plain data: it borrows nothing, so the caller keeps the memory
/// alive (see the module contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawTensor {
    pub ptr: u64,
    pub dtype: DType,
    pub rank: usize,
    pub shape: [usize; MAX_RANK],
    /// Element strides (not bytes).
    pub strides: [usize; MAX_RANK],
}

impl RawTensor {
    /// A strided tensor. Errors when the rank exceeds [`MAX_RANK`] or `shape` and
    /// `strides` differ in length.
    pub fn new(ptr: u64, dtype: DType, shape: &[usize], strides: &[usize]) -> Result<RawTensor> {
        if shape.len() > MAX_RANK || shape.len() != strides.len() {
            return Err(Error::invalid(format!(
                "a raw tensor takes up to {MAX_RANK} dimensions with one stride each, got shape \
                 {shape:?} and strides {strides:?}"
            )));
        }
        let mut t = RawTensor {
            ptr,
            dtype,
            rank: shape.len(),
            shape: [1; MAX_RANK],
            strides: [0; MAX_RANK],
        };
        t.shape[..shape.len()].copy_from_slice(shape);
        t.strides[..strides.len()].copy_from_slice(strides);
        Ok(t)
    }

    /// A contiguous (row-major) tensor of `shape`.
    pub fn contiguous(ptr: u64, dtype: DType, shape: &[usize]) -> Result<RawTensor> {
        let mut strides = [0usize; MAX_RANK];
        let mut s = 1usize;
        for i in (0..shape.len().min(MAX_RANK)).rev() {
            strides[i] = s;
            s = s.saturating_mul(shape[i]);
        }
        Self::new(ptr, dtype, shape, &strides[..shape.len().min(MAX_RANK)])
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape[..self.rank]
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides[..self.rank]
    }
    pub fn elems(&self) -> usize {
        self.shape().iter().product()
    }

    /// Whether the strides are the row-major strides of the shape (size-1 dimensions may
    /// carry any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut want = 1usize;
        for i in (0..self.rank).rev() {
            if self.shape[i] != 1 && self.strides[i] != want {
                return false;
            }
            want = want.saturating_mul(self.shape[i]);
        }
        true
    }

    /// The cudarc layers' check that this view of `name` fits the buffer of `buffer_len`
    /// elements it was made from.
    pub(crate) fn check_within(&self, name: &str, buffer_len: usize) -> Result<()> {
        if self.span_elems() > buffer_len as u64 {
            return Err(Error::invalid(format!(
                "{name}'s view {:?} with strides {:?} spans {} elements but its buffer holds \
                 {buffer_len}",
                self.shape(),
                self.strides(),
                self.span_elems()
            )));
        }
        Ok(())
    }

    /// Elements from the base to one past the last element (0 for an empty tensor).
    pub fn span_elems(&self) -> u64 {
        if self.shape().contains(&0) {
            return 0;
        }
        1 + self
            .shape()
            .iter()
            .zip(self.strides())
            .map(|(&d, &s)| (d as u64 - 1) * s as u64)
            .sum::<u64>()
    }

    /// Check that this tensor is `name` of element type `dtype` with `shape`, a non-null
    /// address aligned to `align` bytes, and a contiguous innermost dimension. Errors name
    /// the tensor and the rule.
    pub fn expect(&self, name: &str, dtype: DType, shape: &[usize], align: u64) -> Result<()> {
        if self.dtype != dtype {
            return Err(Error::invalid(format!(
                "{name} holds {} elements but {dtype} is required",
                self.dtype
            )));
        }
        if self.shape() != shape {
            return Err(Error::invalid(format!(
                "{name} has shape {:?} but {shape:?} is required",
                self.shape()
            )));
        }
        if self.ptr == 0 {
            return Err(Error::invalid(format!("{name} is a null device pointer")));
        }
        if self.ptr % align != 0 {
            return Err(Error::invalid(format!(
                "{name} at {:#x} is not {align}-byte aligned",
                self.ptr
            )));
        }
        if self.rank > 0 && self.shape[self.rank - 1] > 1 && self.strides[self.rank - 1] != 1 {
            return Err(Error::invalid(format!(
                "{name}'s innermost dimension has stride {} but must be contiguous (1)",
                self.strides[self.rank - 1]
            )));
        }
        Ok(())
    }

    /// [`RawTensor::expect`] plus contiguity.
    pub fn expect_contiguous(
        &self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        align: u64,
    ) -> Result<()> {
        self.expect(name, dtype, shape, align)?;
        if !self.is_contiguous() {
            return Err(Error::invalid(format!(
                "{name} must be contiguous (row-major {shape:?}) but has strides {:?}",
                self.strides()
            )));
        }
        Ok(())
    }
}

/// A workspace as the raw layer sees it: a device address and its size in bytes (any
/// allocation of the plan's context; 256-byte aligned from cuMemAlloc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawWorkspace {
    pub ptr: u64,
    pub bytes: usize,
}

impl RawWorkspace {
    /// Error unless this holds `needed` bytes at a non-null address aligned to `align`
    /// (nothing is required when `needed` is 0).
    pub fn check(&self, needed: usize, align: u64, plan: &str) -> Result<()> {
        if needed == 0 {
            return Ok(());
        }
        if self.ptr == 0 || self.ptr % align != 0 || self.bytes < needed {
            return Err(Error::invalid(format!(
                "workspace of {} bytes at {:#x}: the {plan} needs {needed} bytes at a non-null \
                 {align}-byte aligned address ({plan}::workspace_bytes)",
                self.bytes, self.ptr
            )));
        }
        Ok(())
    }
}

/// Enqueue `func` on `stream` with the kernel parameters `params` (one pointer to each
/// argument's value, in the kernel's order). One driver call; `what` names the kernel in
/// the error.
///
/// # Safety
/// `params` must match the kernel's parameter list in number, order and types, and every
/// address among them must satisfy the kernel's contract for `cfg`'s grid.
pub unsafe fn launch(
    what: &str,
    func: &CudaFunction,
    cfg: LaunchConfig,
    stream: RawStream,
    params: &mut [*mut c_void],
) -> Result<()> {
    dr::launch_kernel(
        func.cu_function(),
        cfg.grid_dim,
        cfg.block_dim,
        cfg.shared_mem_bytes,
        stream,
        params,
    )
    .map_err(|e: DriverError| Error::cuda(format!("launch of kernel {what}"), e))
}

/// Enqueue a memset of `bytes` zero bytes at `ptr` on `stream` (`cuMemsetD8Async`).
///
/// # Safety
/// `ptr .. ptr + bytes` is device memory of the stream's context that no other work uses
/// meanwhile.
pub unsafe fn zero_async(ptr: u64, bytes: usize, stream: RawStream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    sys::cuMemsetD8Async(ptr, 0, bytes, stream)
        .result()
        .map_err(|e| Error::cuda(format!("cuMemsetD8Async({bytes} bytes at {ptr:#x})"), e))
}

/// A kernel parameter's address as the driver's parameter array wants it.
pub fn param<T>(value: &T) -> *mut c_void {
    value as *const T as *mut c_void
}

/// A borrowed int32 device matrix (`rows × cols`, row stride in elements; a vector is one
/// row... or `rows` rows of one column, see [`RawIndex::vector`]). Kept apart from
/// [`RawTensor`] so that [`DType`] stays the floating-point storage types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawIndex {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
}

impl RawIndex {
    /// A contiguous `[rows, cols]` matrix (a block table).
    pub fn matrix(ptr: u64, rows: usize, cols: usize) -> RawIndex {
        RawIndex {
            ptr,
            rows,
            cols,
            row_stride: cols,
        }
    }
    /// A block table of `batch` rows over a contiguous buffer of `len` int32 values (the
    /// cudarc layers': `[batch, max_blocks]` row-major); an error when `len` is not a
    /// multiple of `batch`.
    pub(crate) fn block_table(ptr: u64, len: usize, batch: usize) -> Result<RawIndex> {
        if batch == 0 || len % batch != 0 {
            return Err(Error::invalid(format!(
                "block_table holds {len} int32 values: not [batch = {batch}, max_blocks]"
            )));
        }
        Ok(RawIndex::matrix(ptr, batch, len / batch))
    }
    /// A vector of `n` elements (seqused_k).
    pub fn vector(ptr: u64, n: usize) -> RawIndex {
        RawIndex {
            ptr,
            rows: n,
            cols: 1,
            row_stride: 1,
        }
    }
    /// Elements from the base to one past the last.
    pub fn span_elems(&self) -> u64 {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows as u64 - 1) * self.row_stride as u64 + self.cols as u64
        }
    }
    /// Check that this is `name`, `rows` × `cols` (any cols >= 1 when None), at a non-null
    /// 4-byte aligned address with a row stride of at least its columns.
    pub(crate) fn expect(&self, name: &str, rows: usize, cols: Option<usize>) -> Result<()> {
        if self.rows != rows || cols.is_some_and(|c| c != self.cols) || self.cols == 0 {
            return Err(Error::invalid(format!(
                "{name} is int32 [{}, {}] but [{rows}, {}] is required",
                self.rows,
                self.cols,
                cols.map_or("max_blocks >= 1".to_string(), |c| c.to_string())
            )));
        }
        if self.ptr == 0 || self.ptr % 4 != 0 {
            return Err(Error::invalid(format!(
                "{name} at {:#x} must be a non-null 4-byte aligned device address",
                self.ptr
            )));
        }
        if self.rows > 1 && self.row_stride < self.cols {
            return Err(Error::invalid(format!(
                "{name}'s row stride {} is below its {} columns",
                self.row_stride, self.cols
            )));
        }
        Ok(())
    }
    /// A contiguous vector of `n` elements (varlen's cu_seqlens).
    pub(crate) fn expect_vector(&self, name: &str, n: usize) -> Result<()> {
        self.expect(name, n, Some(1))?;
        if n > 1 && self.row_stride != 1 {
            return Err(Error::invalid(format!(
                "{name} must be contiguous (element stride 1) but has stride {}",
                self.row_stride
            )));
        }
        Ok(())
    }
}

/// A borrowed device array of u32 (expert ids, counts): address and element count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawU32 {
    pub ptr: u64,
    pub len: usize,
}

impl RawU32 {
    /// Check that this is `name` with exactly `len` elements at a non-null 4-byte aligned
    /// address.
    pub fn expect(&self, name: &str, len: usize) -> Result<()> {
        if self.len != len {
            return Err(Error::invalid(format!(
                "{name} has {} u32 elements but {len} are required",
                self.len
            )));
        }
        if self.ptr == 0 {
            return Err(Error::invalid(format!("{name} is a null device pointer")));
        }
        if self.ptr % 4 != 0 {
            return Err(Error::invalid(format!(
                "{name} at {:#x} is not 4-byte aligned",
                self.ptr
            )));
        }
        Ok(())
    }
}

/// A 16-bit element type the kernels take: `half::bf16` or `half::f16`.
pub trait Element: sealed::Sealed + Copy + 'static {
    const DTYPE: DType;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_and_span() {
        let t = RawTensor::contiguous(256, DType::Bf16, &[2, 3, 4, 8]).unwrap();
        assert_eq!(t.strides(), &[96, 32, 8, 1]);
        assert!(t.is_contiguous());
        assert_eq!(t.span_elems(), 2 * 3 * 4 * 8);
        assert_eq!(t.elems(), 192);
        // A q view into a packed qkv buffer (b, s, 3 * h, d): row stride 3·h·d.
        let q = RawTensor::new(256, DType::Bf16, &[2, 3, 4, 8], &[3 * 96, 96, 8, 1]).unwrap();
        assert!(!q.is_contiguous());
        assert_eq!(q.span_elems(), 1 + 288 + 2 * 96 + 3 * 8 + 7);
        // Size-1 dims may carry any stride.
        let t = RawTensor::new(256, DType::F32, &[1, 5], &[999, 1]).unwrap();
        assert!(t.is_contiguous());
    }

    #[test]
    fn expect_names_tensor_and_rule() {
        let t = RawTensor::contiguous(4096, DType::Bf16, &[1, 16, 2, 64]).unwrap();
        t.expect("q", DType::Bf16, &[1, 16, 2, 64], 16).unwrap();
        let e = t.expect("q", DType::F16, &[1, 16, 2, 64], 16).unwrap_err();
        assert!(e.to_string().contains("q holds bf16"), "{e}");
        let e = t.expect("k", DType::Bf16, &[1, 16, 4, 64], 16).unwrap_err();
        assert!(e.to_string().contains("k has shape"), "{e}");
        let mut n = t;
        n.ptr = 0;
        let e = n.expect("v", DType::Bf16, &[1, 16, 2, 64], 16).unwrap_err();
        assert!(e.to_string().contains("v is a null"), "{e}");
        n.ptr = 4098;
        let e = n.expect("v", DType::Bf16, &[1, 16, 2, 64], 16).unwrap_err();
        assert!(e.to_string().contains("16-byte aligned"), "{e}");
        let s = RawTensor::new(4096, DType::Bf16, &[1, 16, 2, 64], &[4096, 256, 128, 2]).unwrap();
        let e = s.expect("q", DType::Bf16, &[1, 16, 2, 64], 16).unwrap_err();
        assert!(e.to_string().contains("innermost"), "{e}");
        let p = RawTensor::new(4096, DType::Bf16, &[1, 16, 2, 64], &[4096, 256, 64, 1]).unwrap();
        p.expect("q", DType::Bf16, &[1, 16, 2, 64], 16).unwrap();
        let e = p
            .expect_contiguous("o", DType::Bf16, &[1, 16, 2, 64], 16)
            .unwrap_err();
        assert!(e.to_string().contains("o must be contiguous"), "{e}");
        assert!(RawTensor::new(0, DType::F32, &[1, 2, 3, 4, 5], &[0; 5]).is_err());
        assert!(RawTensor::new(0, DType::F32, &[1, 2], &[1]).is_err());
    }
}
