//! GPU measurement for the lab: CUDA-event timing with the L2 flush ([`timing`]) and the
//! measured hardware ceilings ([`ceiling`]). Bench-only: the library's plans never time.

pub mod ceiling;
pub mod timing;

pub use ceiling::{
    measure_copy_ceiling, measure_copy_ceiling_detailed, measure_gemm_ceiling,
    measure_gemm_ceiling_detailed, CeilingMeasurement,
};
pub use timing::{time_back_to_back, EventTimer, L2Flusher};

/// Runs `f` inside cuProfilerStart/cuProfilerStop on the current context: the range that
/// `ncu --profile-from-start off` profiles (`flashmoe profile`). Stop runs even if `f` fails.
pub fn profiler_range<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    // SAFETY: plain driver calls without arguments; the caller's context is current.
    unsafe { cudarc::driver::sys::cuProfilerStart() }
        .result()
        .map_err(|e| anyhow::anyhow!("cuProfilerStart failed: {e}"))?;
    let r = f();
    let stop = unsafe { cudarc::driver::sys::cuProfilerStop() }.result();
    let v = r?;
    stop.map_err(|e| anyhow::anyhow!("cuProfilerStop failed: {e}"))?;
    Ok(v)
}

/// Tests that need a GPU; each prints "skipped: no GPU" and passes without one.
#[cfg(test)]
mod gpu_tests {
    use super::*;
    use flashmoe::gpu::Device;
    use flashmoe::Error;

    fn with_gpu(name: &str, f: impl FnOnce(&Device)) {
        match Device::open(0) {
            Ok(dev) => f(&dev),
            Err(Error::NoGpu(reason)) => eprintln!("{name}: skipped: no GPU ({reason})"),
            Err(e) => panic!("{name}: opening GPU 0 failed: {e}"),
        }
    }

    #[test]
    fn timer_and_flusher() {
        with_gpu("timing", |dev| {
            let mut fl = L2Flusher::new(dev).unwrap();
            assert!(fl.size_bytes() as u64 >= 2 * dev.info().l2_cache_bytes);
            let timer = EventTimer::new(dev).unwrap();
            let ms = timer.time(|| fl.flush()).unwrap();
            assert!(ms > 0.0 && ms < 1000.0, "{ms}");
            let samples = time_back_to_back(dev, 5, || fl.flush()).unwrap();
            assert_eq!(samples.len(), 5);
            assert!(samples.iter().all(|&s| s > 0.0));
            // Flush bandwidth, for the log: 2×L2 bytes written per flush.
            let gbs = fl.size_bytes() as f64 / (ceiling::median(&samples) * 1e-3) / 1e9;
            eprintln!("L2 flush: {:?} ms ({gbs:.0} GB/s)", samples);
        });
    }

    #[test]
    fn measured_ceilings_are_plausible() {
        with_gpu("ceilings", |dev| {
            let g = measure_gemm_ceiling_detailed(dev).unwrap();
            let c = measure_copy_ceiling_detailed(dev).unwrap();
            eprintln!(
                "{}: {:.1} {} {:?}",
                g.description, g.value, g.unit, g.samples_ms
            );
            eprintln!(
                "{}: {:.1} {} {:?}",
                c.description, c.value, c.unit, c.samples_ms
            );
            assert!(g.value > 10.0 && g.value < 5000.0, "{}", g.value);
            assert!(c.value > 50.0 && c.value < 20000.0, "{}", c.value);
        });
    }
}
