//! GPU timing with CUDA events, and the L2 flush that runs before each timed sample.
//!
//! The measuring pattern (see DESIGN.md, "Timing lessons"):
//! ```ignore
//! flusher.flush()?;                  // GPU busy writing 2×L2 bytes...
//! let ms = timer.time(&dev, || run())?; // ...so the start event is recorded while busy
//! ```
//! Because the flush is still running when the start event is enqueued, the event fires
//! when the GPU reaches it, right before the kernel: the host's launch latency is not
//! counted as kernel time.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtrMut};
use flashmoe::gpu::Device;
use flashmoe::{Error, Result};
use std::sync::Arc;

/// A pair of timing events on the device stream.
pub struct EventTimer {
    start: CudaEvent,
    end: CudaEvent,
    stream: Arc<CudaStream>,
}

impl EventTimer {
    pub fn new(dev: &Device) -> Result<EventTimer> {
        let mk = || {
            dev.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| Error::cuda("cuEventCreate", e))
        };
        Ok(EventTimer {
            start: mk()?,
            end: mk()?,
            stream: dev.stream().clone(),
        })
    }

    /// Record the start event on the stream.
    pub fn start(&self) -> Result<()> {
        self.start
            .record(&self.stream)
            .map_err(|e| Error::cuda("cuEventRecord (start)", e))
    }

    /// Record the end event, wait for it, and return the elapsed GPU time in ms.
    pub fn stop(&self) -> Result<f64> {
        self.end
            .record(&self.stream)
            .map_err(|e| Error::cuda("cuEventRecord (end)", e))?;
        self.end.synchronize().map_err(|e| {
            Error::cuda(
                "cuEventSynchronize (a kernel in the timed region failed)",
                e,
            )
        })?;
        let ms = self
            .start
            .elapsed_ms(&self.end)
            .map_err(|e| Error::cuda("cuEventElapsedTime", e))?;
        Ok(ms as f64)
    }

    /// Time the GPU work `work` enqueues on the device stream: start event, `work()`,
    /// end event, wait. Returns milliseconds.
    pub fn time(&self, work: impl FnOnce() -> Result<()>) -> Result<f64> {
        self.start()?;
        let r = work();
        let ms = self.stop();
        r?;
        ms
    }
}

/// Evicts the L2 cache by writing a buffer of twice its size (cuMemsetD8Async), so each
/// timed sample starts cold, as a real model's layer would.
pub struct L2Flusher {
    buffer: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    value: u8,
}

impl L2Flusher {
    pub fn new(dev: &Device) -> Result<L2Flusher> {
        let bytes = (2 * dev.info().l2_cache_bytes as usize).max(8 << 20);
        // SAFETY: the buffer is only ever written (memset), never read.
        let buffer = unsafe { dev.stream().alloc::<u8>(bytes) }
            .map_err(|e| Error::cuda(format!("allocating the {bytes}-byte L2 flush buffer"), e))?;
        Ok(L2Flusher {
            buffer,
            stream: dev.stream().clone(),
            value: 0,
        })
    }

    pub fn size_bytes(&self) -> usize {
        self.buffer.len()
    }

    /// Enqueue the flush on the device stream (does not wait).
    pub fn flush(&mut self) -> Result<()> {
        self.value ^= 1;
        let n = self.buffer.len();
        let cu_stream = self.stream.cu_stream();
        let (ptr, _rec) = self.buffer.device_ptr_mut(&self.stream);
        // SAFETY: writes exactly the buffer's bytes.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, self.value, n, cu_stream) }
            .map_err(|e| Error::cuda("cuMemsetD8Async (L2 flush)", e))
    }
}

/// Enqueue `op` `1 + n` times back-to-back with a timing event between consecutive runs,
/// wait once, and return the `n` per-run times in ms. The first run is untimed and only
/// keeps the GPU busy, so every start event is reached by the GPU while it is working:
/// neither the host's launch latency nor a synchronisation gap is counted. Suited to
/// operations long enough (≥ tens of µs) that the host keeps ahead of the GPU.
pub fn time_back_to_back(
    dev: &Device,
    n: usize,
    mut op: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    let events = (0..=n)
        .map(|_| {
            dev.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| Error::cuda("cuEventCreate", e))
        })
        .collect::<Result<Vec<_>>>()?;
    let stream = dev.stream();
    op()?;
    for (i, ev) in events.iter().enumerate() {
        ev.record(stream)
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        if i < n {
            op()?;
        }
    }
    events[n]
        .synchronize()
        .map_err(|e| Error::cuda("cuEventSynchronize (a timed operation failed)", e))?;
    events
        .windows(2)
        .map(|w| {
            w[0].elapsed_ms(&w[1])
                .map(|ms| ms as f64)
                .map_err(|e| Error::cuda("cuEventElapsedTime", e))
        })
        .collect()
}
