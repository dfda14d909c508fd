//! Helpers shared by the crate's GPU test modules (`*gpu_tests.rs`).

use crate::error::Error;
use crate::gpu::Device;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Run `f` on GPU 0, or print "skipped: no GPU" and pass where there is none.
pub(crate) fn with_gpu(name: &str, f: impl FnOnce(&Device)) {
    match Device::open(0) {
        Ok(dev) => {
            eprintln!("{name}: {}", dev.info());
            f(&dev)
        }
        Err(Error::NoGpu(reason)) => eprintln!("{name}: skipped: no GPU ({reason})"),
        Err(e) => panic!("{name}: opening GPU 0 failed: {e}"),
    }
}

/// A fresh seed per call, or `FLASHMOE_TEST_SEED`'s (printed, so a failure can be replayed).
pub(crate) fn fresh_seed(tag: &str) -> u64 {
    // FLASHMOE_TEST_SEED replays a failure's seed (printed below and in its message).
    let t = match std::env::var("FLASHMOE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(s) => s,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    };
    eprintln!("{tag}: seed {t}");
    t
}

/// The device address of a buffer, for the raw layer's tensors.
pub(crate) fn addr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    s.device_ptr(stream).0
}

/// splitmix64 stream of uniform values in [-1, 1) (seeded from [`fresh_seed`]).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(crate) fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}
