//! Helpers shared by the crate's GPU test modules (`*gpu_tests.rs`).

use crate::error::Error;
use crate::gpu::Device;

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

/// A fresh seed per call (printed, so a failure can be replayed by hand).
pub(crate) fn fresh_seed(tag: &str) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("{tag}: seed {t}");
    t
}
