//! The opened GPU and the timing every native implementation shares: an L2 flush, then the
//! work between CUDA events. Below `gpu.rs` and `plan_backed.rs`, which both use it.

use crate::gpu::{EventTimer, L2Flusher};
use flashmoe::gpu::Device;
use std::cell::RefCell;
use std::rc::Rc;

/// The opened GPU with the timing primitives every GPU implementation shares.
pub struct GpuSession {
    pub device: Device,
    timer: EventTimer,
    flusher: RefCell<L2Flusher>,
}

impl GpuSession {
    pub fn open(ordinal: usize) -> flashmoe::Result<Rc<GpuSession>> {
        let device = Device::open(ordinal)?;
        let timer = EventTimer::new(&device)?;
        let flusher = RefCell::new(L2Flusher::new(&device)?);
        Ok(Rc::new(GpuSession {
            device,
            timer,
            flusher,
        }))
    }

    pub fn flush_bytes(&self) -> usize {
        self.flusher.borrow().size_bytes()
    }

    /// Flush L2, then time `work` between CUDA events.
    pub fn timed(&self, work: impl FnOnce() -> flashmoe::Result<()>) -> anyhow::Result<f64> {
        self.flusher.borrow_mut().flush()?;
        Ok(self.timer.time(work)?)
    }
}
