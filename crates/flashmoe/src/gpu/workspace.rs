//! The device scratch every plan takes: one type for attention, decode and MoE plans.
//!
//! A [`Workspace`] is a zeroed device byte buffer owned by Rust code and bound to the
//! stream it was allocated on: launches on one stream are ordered, so they may share it;
//! launches that may overlap (other streams) need one each, and a plan's safe entry points
//! refuse a workspace of another stream. The raw entry points take a [`RawWorkspace`]
//! (address and size) from whatever allocator the caller uses.

use crate::error::{Error, Result};
use crate::gpu::raw::{RawStream, RawWorkspace};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// A zeroed device buffer for a plan's launches on one stream.
pub struct Workspace {
    /// At least one byte, so that the address is a real allocation (256-byte aligned).
    buf: CudaSlice<u8>,
    bytes: usize,
    stream: RawStream,
}

// SAFETY: `stream` is only compared, never used to enqueue work.
unsafe impl Send for Workspace {}
unsafe impl Sync for Workspace {}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Workspace({} bytes)", self.bytes)
    }
}

impl Workspace {
    /// `bytes` zeroed bytes on `stream` (allocates and memsets: do it once, not per call).
    pub fn zeroed(stream: &Arc<CudaStream>, bytes: usize) -> Result<Workspace> {
        let buf = stream.alloc_zeros::<u8>(bytes.max(1)).map_err(|e| {
            Error::cuda(
                format!("cuMemAlloc + memset of a {bytes}-byte workspace"),
                e,
            )
        })?;
        Ok(Workspace {
            buf,
            bytes,
            stream: stream.cu_stream(),
        })
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Address and size, for a plan's `forward_raw` on the stream it was allocated on.
    pub fn raw(&self) -> RawWorkspace {
        RawWorkspace {
            ptr: self.buf.device_ptr(self.buf.stream()).0,
            bytes: self.bytes,
        }
    }
    /// Error unless this workspace was allocated on `stream` and holds `needed` bytes.
    pub fn check_for(&self, stream: &CudaStream, needed: usize, plan: &str) -> Result<()> {
        if self.stream != stream.cu_stream() {
            return Err(Error::invalid(format!(
                "the workspace was allocated on another stream: launches on different streams \
                 may overlap and need a workspace each ({plan}::alloc_workspace)"
            )));
        }
        if self.bytes < needed {
            return Err(Error::invalid(format!(
                "workspace of {} bytes but the {plan} needs {needed} ({plan}::alloc_workspace)",
                self.bytes
            )));
        }
        Ok(())
    }
    /// The buffer itself (tests poison it or read intermediates).
    pub fn buffer(&self) -> &CudaSlice<u8> {
        &self.buf
    }
    pub fn buffer_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.buf
    }
}
