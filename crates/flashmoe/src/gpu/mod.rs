//! CUDA runtime: device, buffers, NVRTC kernel compilation and cache, timing, ceilings.
//!
//! Everything here loads the CUDA libraries at run time (cudarc dynamic loading): the
//! crate builds and its GPU-free parts run on machines without CUDA. A missing driver or
//! device is [`Error::NoGpu`](crate::Error::NoGpu), never a panic.
//!
//! - [`probe`], [`Device::open`], [`DeviceInfo`]: the GPU and its properties.
//! - [`nvrtc_compile`]: GPU-free compilation with NVRTC, with the ptxas resource report.
//! - [`KernelCache`]: NVRTC output cached on disk, modules cached in memory.
//! - [`DeviceTensor`]: dtype-aware device buffers with upload / download / poison.
//! - [`raw`]: the caller's streams and device memory ([`RawStream`], [`RawTensor`]).
//! - [`Workspace`]: the stream-bound device scratch every plan takes.
//! - [`TensorMap`]: TMA tensor maps for the sm_90a kernels.

pub mod buffer;
pub mod cache;
pub mod device;
#[cfg(all(test, feature = "lab"))]
mod gpu_tests;
pub mod kernels;
pub(crate) mod libs;
#[cfg(all(test, feature = "lab"))]
pub(crate) mod test_support;
pub use libs::ensure_cublas;
pub mod nvrtc;
pub mod raw;
pub mod tensor_map;
pub mod workspace;

pub use buffer::{check_len, DeviceData, DeviceTensor};
pub use cache::{cache_key, default_cache_dir, CachedKernel, KernelCache};
pub use device::{device_count, driver_version, probe, Device, DeviceInfo};
pub use nvrtc::{
    compile_arch_for, compile_options, init_nvrtc_from, nvrtc_compile, nvrtc_version,
    parse_ptxas_report, CompiledKernel, ImageKind, KernelResources,
};
pub use raw::{
    Element, RawIndex, RawStream, RawTensor, RawU32, RawWorkspace, LEGACY_STREAM, PER_THREAD_STREAM,
};
pub use tensor_map::{encode_tiled, TensorMap, TiledLayout};
pub use workspace::Workspace;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    /// This test machine (and any CI runner) has no NVIDIA driver: the probe must fail
    /// cleanly with NoGpu and a readable reason. On a GPU machine it must succeed.
    #[test]
    fn probe_reports_nogpu_or_a_device() {
        match probe() {
            Ok(info) => {
                assert!(info.sm_count > 0);
                assert!(!info.name.is_empty());
            }
            Err(Error::NoGpu(reason)) => {
                assert!(reason.len() > 20, "reason too short: {reason}");
                let msg = Error::NoGpu(reason.clone()).to_string();
                assert!(msg.starts_with("no GPU available: "), "{msg}");
                if !libs::driver_library_present() {
                    assert!(reason.contains("libcuda"), "{reason}");
                }
                eprintln!("probe: {msg}");
            }
            Err(e) => panic!("expected NoGpu or a device, got: {e}"),
        }
    }

    #[test]
    fn open_and_count_agree_with_probe() {
        match (probe(), device_count()) {
            (Ok(_), Ok(n)) => assert!(n >= 1),
            (Err(Error::NoGpu(_)), Err(Error::NoGpu(_))) => {}
            (Err(Error::NoGpu(_)), Ok(0)) => {}
            (p, c) => panic!("probe {p:?} vs device_count {c:?}"),
        }
        // Out-of-range ordinal is NoGpu too.
        assert!(matches!(Device::open(4096), Err(Error::NoGpu(_))));
    }
}
