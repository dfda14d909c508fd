//! Device buffers typed by [`DType`].

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::device::Device;
use crate::gpu::raw::RawTensor;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

/// Storage of a [`DeviceTensor`]: 16-bit elements (f16/bf16 bits) or f32.
#[derive(Debug)]
pub enum DeviceData {
    U16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// A flat device buffer of `len` elements of `dtype`. Shapes live in the problem
/// description; the buffer only knows its element count.
#[derive(Debug)]
pub struct DeviceTensor {
    dtype: DType,
    len: usize,
    data: DeviceData,
}

/// The poison bit pattern for 16-bit types: 0xFFFF is a NaN in both f16 and bf16.
pub const POISON_U16: u16 = 0xFFFF;
/// The poison bit pattern for f32: 0xFFFFFFFF is a NaN.
pub const POISON_U32: u32 = 0xFFFF_FFFF;

/// Check that `actual` elements match `expected`, naming the buffer otherwise.
pub fn check_len(name: &str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::BufferSize {
            name: name.to_string(),
            expected,
            actual,
        });
    }
    Ok(())
}

impl DeviceTensor {
    /// Allocate `len` elements of `dtype`, poisoned (every element NaN) so that an
    /// element a kernel fails to write is detected.
    pub fn alloc(dev: &Device, dtype: DType, len: usize) -> Result<DeviceTensor> {
        let stream = dev.stream();
        let ctx = |e| Error::cuda(format!("allocating {len} × {dtype} on the GPU"), e);
        // SAFETY: the memory is poisoned right below before anyone can read it.
        let data = match dtype {
            DType::F16 | DType::Bf16 => {
                DeviceData::U16(unsafe { stream.alloc::<u16>(len) }.map_err(ctx)?)
            }
            DType::F32 => DeviceData::F32(unsafe { stream.alloc::<f32>(len) }.map_err(ctx)?),
        };
        let mut t = DeviceTensor { dtype, len, data };
        t.poison(dev)?;
        Ok(t)
    }

    /// Allocate and upload `values` rounded to `dtype`.
    pub fn from_f32(dev: &Device, dtype: DType, values: &[f32]) -> Result<DeviceTensor> {
        let stream = dev.stream();
        let ctx = |e| {
            Error::cuda(
                format!("uploading {} × {dtype} to the GPU", values.len()),
                e,
            )
        };
        let data = match dtype {
            DType::F16 | DType::Bf16 => {
                DeviceData::U16(stream.clone_htod(&dtype.encode_u16(values)).map_err(ctx)?)
            }
            DType::F32 => DeviceData::F32(stream.clone_htod(values).map_err(ctx)?),
        };
        Ok(DeviceTensor {
            dtype,
            len: values.len(),
            data,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn size_bytes(&self) -> usize {
        self.len * self.dtype.size_bytes()
    }
    pub fn data(&self) -> &DeviceData {
        &self.data
    }
    pub fn data_mut(&mut self) -> &mut DeviceData {
        &mut self.data
    }

    /// This buffer as a contiguous [`RawTensor`] of `shape` (whose element count must be
    /// the buffer's length), for the plans' raw entry points. The address stays valid while
    /// the buffer lives; the lab's device orders all work on its one stream.
    pub fn raw(&self, dev: &Device, name: &str, shape: &[usize]) -> Result<RawTensor> {
        check_len(name, shape.iter().product(), self.len)?;
        let ptr = match &self.data {
            DeviceData::U16(s) => s.device_ptr(dev.stream()).0,
            DeviceData::F32(s) => s.device_ptr(dev.stream()).0,
        };
        RawTensor::contiguous(ptr, self.dtype, shape)
    }

    /// The 16-bit storage, or an error naming `name` when this is an f32 tensor.
    pub fn as_u16(&self, name: &str) -> Result<&CudaSlice<u16>> {
        match &self.data {
            DeviceData::U16(s) => Ok(s),
            DeviceData::F32(_) => Err(wrong_storage(name, self.dtype, "a 16-bit")),
        }
    }
    pub fn as_u16_mut(&mut self, name: &str) -> Result<&mut CudaSlice<u16>> {
        let dt = self.dtype;
        match &mut self.data {
            DeviceData::U16(s) => Ok(s),
            DeviceData::F32(_) => Err(wrong_storage(name, dt, "a 16-bit")),
        }
    }
    /// The f32 storage, or an error naming `name` when this is a 16-bit tensor.
    pub fn as_f32(&self, name: &str) -> Result<&CudaSlice<f32>> {
        match &self.data {
            DeviceData::F32(s) => Ok(s),
            DeviceData::U16(_) => Err(wrong_storage(name, self.dtype, "an f32")),
        }
    }
    pub fn as_f32_mut(&mut self, name: &str) -> Result<&mut CudaSlice<f32>> {
        let dt = self.dtype;
        match &mut self.data {
            DeviceData::F32(s) => Ok(s),
            DeviceData::U16(_) => Err(wrong_storage(name, dt, "an f32")),
        }
    }

    /// Overwrite the whole buffer with `values` (rounded to the dtype).
    pub fn upload(&mut self, dev: &Device, values: &[f32]) -> Result<()> {
        check_len("upload source", self.len, values.len())?;
        let stream = dev.stream();
        let dtype = self.dtype;
        let ctx = |e| {
            Error::cuda(
                format!("uploading {} × {dtype} to the GPU", values.len()),
                e,
            )
        };
        match &mut self.data {
            DeviceData::U16(s) => stream
                .memcpy_htod(&dtype.encode_u16(values), s)
                .map_err(ctx),
            DeviceData::F32(s) => stream.memcpy_htod(values, s).map_err(ctx),
        }
    }

    /// Copy the buffer back and decode it to f32 (waits for the stream).
    pub fn to_f32(&self, dev: &Device) -> Result<Vec<f32>> {
        let stream = dev.stream();
        let ctx = |e| {
            Error::cuda(
                format!("downloading {} × {} from the GPU", self.len, self.dtype),
                e,
            )
        };
        let out = match &self.data {
            DeviceData::U16(s) => {
                let bits = stream.clone_dtoh(s).map_err(ctx)?;
                stream.synchronize().map_err(ctx)?;
                self.dtype.decode_u16(&bits)
            }
            DeviceData::F32(s) => {
                let v = stream.clone_dtoh(s).map_err(ctx)?;
                stream.synchronize().map_err(ctx)?;
                v
            }
        };
        Ok(out)
    }

    /// Fill every element with NaN (0xFFFF for f16/bf16, 0xFFFFFFFF for f32), ordered on
    /// the device stream.
    pub fn poison(&mut self, dev: &Device) -> Result<()> {
        self.fill_bits(dev, POISON_U16, POISON_U32)
    }

    /// Fill every element with zero.
    pub fn zero(&mut self, dev: &Device) -> Result<()> {
        self.fill_bits(dev, 0, 0)
    }

    fn fill_bits(&mut self, dev: &Device, bits16: u16, bits32: u32) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let stream = dev.stream();
        let cu_stream = stream.cu_stream();
        let len = self.len;
        // SAFETY: the pointer covers exactly `len` elements of the element size written.
        let r = match &mut self.data {
            DeviceData::U16(s) => {
                let (ptr, _rec) = s.device_ptr_mut(stream);
                unsafe {
                    cudarc::driver::sys::cuMemsetD16Async(ptr, bits16, len, cu_stream).result()
                }
            }
            DeviceData::F32(s) => {
                let (ptr, _rec) = s.device_ptr_mut(stream);
                unsafe {
                    cudarc::driver::sys::cuMemsetD32Async(ptr, bits32, len, cu_stream).result()
                }
            }
        };
        r.map_err(|e| Error::cuda("cuMemsetAsync (fill)", e))
    }
}

fn wrong_storage(name: &str, dtype: DType, wanted: &str) -> Error {
    Error::invalid(format!(
        "buffer {name} holds {dtype} elements but {wanted} buffer is required here"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poison_patterns_are_nan() {
        assert!(half::f16::from_bits(POISON_U16).is_nan());
        assert!(half::bf16::from_bits(POISON_U16).is_nan());
        assert!(f32::from_bits(POISON_U32).is_nan());
        assert!(DType::F16.decode_u16(&[POISON_U16])[0].is_nan());
        assert!(DType::Bf16.decode_u16(&[POISON_U16])[0].is_nan());
    }

    #[test]
    fn length_check_names_the_buffer() {
        assert!(check_len("q", 8, 8).is_ok());
        match check_len("lse", 8, 7) {
            Err(Error::BufferSize {
                name,
                expected,
                actual,
            }) => {
                assert_eq!((name.as_str(), expected, actual), ("lse", 8, 7));
            }
            other => panic!("{other:?}"),
        }
    }
}
