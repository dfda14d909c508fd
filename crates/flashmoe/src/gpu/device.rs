//! Opening a GPU and reading its properties.

use crate::error::{Error, Result};
use crate::gpu::cache::{default_cache_dir, KernelCache};
use crate::gpu::{kernels, libs, nvrtc};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{result as dr, CudaContext, CudaFunction, CudaStream, DriverError};
use serde::{Deserialize, Serialize};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// Properties of one GPU, as reported by the driver (for the environment manifest and
/// for choosing kernels). Clocks are the maximum clocks the driver reports, not the
/// clocks during a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub sm_count: u32,
    /// Compute capability (major, minor), e.g. (9, 0) for H100.
    pub compute_capability: (u32, u32),
    pub max_sm_clock_mhz: u32,
    pub memory_clock_mhz: u32,
    pub memory_bus_width_bits: u32,
    pub total_memory_bytes: u64,
    pub l2_cache_bytes: u64,
    /// Largest shared memory one block can opt in to (cuFuncSetAttribute), bytes.
    pub max_shared_memory_per_block_optin: u64,
    /// CUDA version the driver supports, e.g. "13.0".
    pub driver_version: String,
    /// NVRTC version, e.g. "13.0"; None when libnvrtc was not found.
    pub nvrtc_version: Option<String>,
    /// The `-arch` flashmoe compiles kernels for on this device ("sm_90a", "sm_80"),
    /// None when NVRTC was not found.
    pub compile_arch: Option<String>,
}

impl DeviceInfo {
    /// Compute capability × 10 (90 for H100, 80 for A100).
    pub fn arch(&self) -> u32 {
        self.compute_capability.0 * 10 + self.compute_capability.1
    }

    /// Theoretical DRAM bandwidth from memory clock and bus width, GB/s (DDR: ×2).
    /// For context only; the copy ceiling is the measured figure to use.
    pub fn theoretical_bandwidth_gbs(&self) -> f64 {
        2.0 * self.memory_clock_mhz as f64 * 1e6 * self.memory_bus_width_bits as f64 / 8.0 / 1e9
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {}: {} (sm_{}{}, {} SMs, {:.1} GiB, L2 {} MiB, max clock {} MHz), driver CUDA {}, NVRTC {}",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.sm_count,
            self.total_memory_bytes as f64 / (1u64 << 30) as f64,
            self.l2_cache_bytes >> 20,
            self.max_sm_clock_mhz,
            self.driver_version,
            self.nvrtc_version.as_deref().unwrap_or("not found")
        )
    }
}

/// Format a CUDA version integer (cuDriverGetVersion: 1000·major + 10·minor) as "13.0".
pub fn format_cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Run a driver call that may make cudarc load libcuda (which panics when a symbol is
/// missing), turning a panic into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, DriverError>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::cuda(what, e)),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic while loading the CUDA driver library".into());
            Err(Error::NoGpu(format!(
                "the CUDA driver library could not be used ({what}): {msg}"
            )))
        }
    }
}

/// Check that a CUDA driver is installed and initialises; returns the driver's CUDA
/// version. Errors are [`Error::NoGpu`] with one clear reason.
pub fn driver_version() -> Result<String> {
    if !libs::driver_library_present() {
        return Err(Error::NoGpu(
            "the NVIDIA driver library libcuda.so.1 was not found: no NVIDIA driver is \
             installed on this machine (or it is not on the library search path)"
                .into(),
        ));
    }
    let init = guarded("cuInit", dr::init);
    match init {
        Ok(()) => {}
        Err(Error::Cuda { message, .. }) => {
            return Err(Error::NoGpu(init_failure_reason(&message)));
        }
        Err(e) => return Err(e),
    }
    let mut v: i32 = 0;
    guarded("cuDriverGetVersion", || unsafe {
        cudarc::driver::sys::cuDriverGetVersion(&mut v).result()
    })?;
    Ok(format_cuda_version(v))
}

fn init_failure_reason(message: &str) -> String {
    let hint = if message.contains("CUDA_ERROR_NO_DEVICE") {
        "the NVIDIA driver is installed but reports no CUDA device (check nvidia-smi and \
         CUDA_VISIBLE_DEVICES)"
    } else if message.contains("INSUFFICIENT_DRIVER") {
        "the NVIDIA driver is too old for CUDA 13 (update the driver)"
    } else if message.contains("SYSTEM_DRIVER_MISMATCH") {
        "the NVIDIA kernel module and user-space driver versions differ (reboot or \
         reinstall the driver)"
    } else {
        "the CUDA driver failed to initialise"
    };
    format!("{hint}: cuInit returned {message}")
}

/// Number of CUDA devices (error [`Error::NoGpu`] when there is no driver).
pub fn device_count() -> Result<usize> {
    driver_version()?;
    let n = guarded("cuDeviceGetCount", dr::device::get_count)?;
    Ok(n.max(0) as usize)
}

/// Properties of device 0, or [`Error::NoGpu`] with a readable reason.
pub fn probe() -> Result<DeviceInfo> {
    Device::open(0).map(|d| d.info().clone())
}

/// An opened GPU: a context, the one stream flashmoe works on, the device properties and
/// the kernel cache.
///
/// All work is ordered on [`Device::stream`]; cudarc's per-buffer event tracking is
/// turned off (flashmoe uses one stream), so a launch is exactly one driver call.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    cache: KernelCache,
    sync_launches: bool,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

impl Device {
    /// Open device `ordinal`. Errors: [`Error::NoGpu`] (no driver, no device, ordinal out
    /// of range), [`Error::Cuda`] (the driver failed).
    pub fn open(ordinal: usize) -> Result<Device> {
        let driver = driver_version()?;
        let count = guarded("cuDeviceGetCount", dr::device::get_count)?.max(0) as usize;
        if count == 0 {
            return Err(Error::NoGpu(
                "the NVIDIA driver reports no CUDA device (check nvidia-smi and \
                 CUDA_VISIBLE_DEVICES)"
                    .into(),
            ));
        }
        if ordinal >= count {
            return Err(Error::NoGpu(format!(
                "GPU {ordinal} requested but only {count} CUDA device(s) are visible \
                 (ordinals 0..{})",
                count - 1
            )));
        }
        let ctx = guarded(&format!("creating a context on GPU {ordinal}"), || {
            CudaContext::new(ordinal)
        })?;
        // SAFETY: the lab orders all its work on one stream; no buffer is shared
        // across streams, so cudarc's cross-stream event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| Error::cuda("cuStreamCreate", e))?;
        Self::with_context(ctx, stream, driver)
    }

    /// Use a context the caller already holds (candle's `CudaDevice::cuda_stream().context()`,
    /// or `CudaContext::new(ordinal)`, which retains the device's primary context, the one
    /// PyTorch and the runtime API use). Creates no context and no stream and leaves the
    /// context's settings (event tracking) alone: [`Device::stream`] is the context's
    /// legacy default stream, and plans enqueue on the stream each call names.
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Device> {
        let driver = driver_version()?;
        let stream = ctx.default_stream();
        Self::with_context(ctx, stream, driver)
    }

    fn with_context(
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        driver: String,
    ) -> Result<Device> {
        let ordinal = ctx.ordinal();

        let attr = |a: Attr| -> Result<u32> {
            ctx.attribute(a)
                .map(|v| v.max(0) as u32)
                .map_err(|e| Error::cuda(format!("cuDeviceGetAttribute({a:?})"), e))
        };
        let name = ctx.name().map_err(|e| Error::cuda("cuDeviceGetName", e))?;
        let cc = (
            attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let nv = nvrtc::nvrtc().ok();
        let compile_arch = match nv {
            Some(nv) => Some(nvrtc::compile_arch_for(cc.0, cc.1, &nv.supported_archs)?),
            None => None,
        };
        let info = DeviceInfo {
            ordinal,
            name: name.trim().to_string(),
            sm_count: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            compute_capability: cc,
            max_sm_clock_mhz: attr(Attr::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)? / 1000,
            memory_clock_mhz: attr(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)? / 1000,
            memory_bus_width_bits: attr(Attr::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?,
            total_memory_bytes: ctx
                .total_mem()
                .map_err(|e| Error::cuda("cuDeviceTotalMem", e))?
                as u64,
            l2_cache_bytes: attr(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u64,
            max_shared_memory_per_block_optin: attr(
                Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as u64,
            driver_version: driver,
            nvrtc_version: nv.map(|n| n.version_string()),
            compile_arch,
        };
        let cache =
            KernelCache::for_context(ctx.clone(), Some(default_cache_dir().join("kernels")));
        let sync_launches = std::env::var("FLASHMOE_SYNC_LAUNCHES")
            .map(|v| !v.is_empty() && v != "0")
            .unwrap_or(false);
        Ok(Device {
            ctx,
            stream,
            info,
            cache,
            sync_launches,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }
    /// Compute capability × 10.
    pub fn arch(&self) -> u32 {
        self.info.arch()
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream every flashmoe operation on this device is ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn kernel_cache(&self) -> &KernelCache {
        &self.cache
    }

    /// The `-arch` kernels are compiled for ("sm_90a" on H100), or an error when
    /// libnvrtc is missing.
    pub fn compile_arch(&self) -> Result<&str> {
        match &self.info.compile_arch {
            Some(a) => Ok(a),
            None => nvrtc::nvrtc().and_then(|_| {
                Err(Error::cuda(
                    "NVRTC",
                    "libnvrtc was found after the device was opened; reopen the device",
                ))
            }),
        }
    }

    /// Load `entry` from an embedded kernel source (see [`kernels::source`]), compiled
    /// for this device with `defines` (cached on disk and in memory).
    pub fn load_kernel(
        &self,
        source_name: &str,
        entry: &str,
        defines: &[(String, String)],
    ) -> Result<CudaFunction> {
        let text = kernels::source(source_name)?;
        self.load_kernel_source(source_name, text, entry, defines)
    }

    /// Like [`Device::load_kernel`] for source text that is not embedded.
    pub fn load_kernel_source(
        &self,
        source_name: &str,
        source_text: &str,
        entry: &str,
        defines: &[(String, String)],
    ) -> Result<CudaFunction> {
        let arch = self.compile_arch()?.to_string();
        self.cache
            .load(source_name, source_text, entry, defines, &arch)
    }

    /// Wait for all work on the stream; an asynchronous kernel fault surfaces here.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))
    }

    /// Call after a kernel launch: maps a launch error to [`Error::Cuda`] naming the
    /// kernel and, when `FLASHMOE_SYNC_LAUNCHES=1`, synchronises so a fault inside the
    /// kernel is reported against it too (slower; for debugging).
    pub fn check_launch<T>(
        &self,
        kernel: &str,
        launched: std::result::Result<T, DriverError>,
    ) -> Result<()> {
        launched.map_err(|e| Error::cuda(format!("launch of kernel {kernel}"), e))?;
        self.debug_sync(kernel)
    }

    /// With `FLASHMOE_SYNC_LAUNCHES=1` (read when the device was opened), synchronise the
    /// device stream so a fault inside `kernel` is reported against it; else nothing.
    pub fn debug_sync(&self, kernel: &str) -> Result<()> {
        if self.sync_launches {
            self.stream
                .synchronize()
                .map_err(|e| Error::cuda(format!("kernel {kernel} (during execution)"), e))?;
        }
        Ok(())
    }

    /// Raise a kernel's dynamic shared-memory limit to `bytes` when above the 48 KiB
    /// default; errors when the device cannot provide it.
    pub fn set_dynamic_shared_memory(
        &self,
        kernel: &str,
        func: &CudaFunction,
        bytes: u32,
    ) -> Result<()> {
        if bytes as u64 > self.info.max_shared_memory_per_block_optin {
            return Err(Error::unsupported(
                kernel,
                format!(
                    "needs {bytes} bytes of shared memory per block but {} allows at most {}",
                    self.info.name, self.info.max_shared_memory_per_block_optin
                ),
            ));
        }
        if bytes > 48 * 1024 {
            // SAFETY: the function handle is alive (held by `func`).
            unsafe {
                dr::function::set_function_attribute(
                    func.cu_function(),
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            }
            .map_err(|e| {
                Error::cuda(
                    format!("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={bytes}) for {kernel}"),
                    e,
                )
            })?;
        }
        Ok(())
    }

    /// Compile, load and run a tiny built-in kernel and check its result: proves NVRTC,
    /// module loading, launch and copies work on this device.
    pub fn selftest(&self) -> Result<()> {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        let n: i32 = 1000;
        let f = self.load_kernel_source(
            "selftest.cu",
            kernels::SELFTEST_SOURCE,
            kernels::SELFTEST_ENTRY,
            &[],
        )?;
        let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let y0: Vec<f32> = (0..n).map(|i| 1.0 - i as f32).collect();
        let dx = self
            .stream
            .clone_htod(&x)
            .map_err(|e| Error::cuda("cuMemcpyHtoD", e))?;
        let mut dy = self
            .stream
            .clone_htod(&y0)
            .map_err(|e| Error::cuda("cuMemcpyHtoD", e))?;
        let a = 2.0f32;
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut dy).arg(&dx).arg(&a).arg(&n);
        // SAFETY: argument list matches SELFTEST_SOURCE; grid covers n with bounds check.
        let r = unsafe { b.launch(cfg) };
        self.check_launch(kernels::SELFTEST_ENTRY, r)?;
        let y = self
            .stream
            .clone_dtoh(&dy)
            .map_err(|e| Error::cuda("cuMemcpyDtoH", e))?;
        self.synchronize()?;
        for i in 0..n as usize {
            let want = a * x[i] + y0[i];
            if y[i] != want {
                return Err(Error::cuda(
                    "selftest",
                    format!("y[{i}] = {} but expected {want}", y[i]),
                ));
            }
        }
        Ok(())
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<Device>();
}

/// The raw-layer plan calls' first step: make `ctx`, the plan's CUDA context, current on
/// this thread (the caller's stream and every launch belong to it).
pub(crate) fn bind_context(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(|e| Error::cuda("cuCtxSetCurrent", e))
}

/// The cudarc-level plan calls' first check: `stream` belongs to `ctx`, the CUDA context the
/// plan was built in (a kernel of one context cannot be launched on another's stream).
pub(crate) fn check_stream_context(stream: &CudaStream, ctx: &CudaContext) -> Result<()> {
    if stream.context().cu_ctx() != ctx.cu_ctx() {
        return Err(Error::invalid(
            "the stream belongs to another CUDA context than the plan (build the plan \
             from the stream's context: Device::from_context)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_formatting() {
        assert_eq!(format_cuda_version(13000), "13.0");
        assert_eq!(format_cuda_version(12080), "12.8");
        assert_eq!(format_cuda_version(11040), "11.4");
    }

    #[test]
    fn init_failure_reasons_are_readable() {
        let m = init_failure_reason(
            "DriverError(CUDA_ERROR_NO_DEVICE, \"no CUDA-capable device is detected\")",
        );
        assert!(m.contains("reports no CUDA device"), "{m}");
        let m = init_failure_reason("DriverError(CUDA_ERROR_INSUFFICIENT_DRIVER, \"...\")");
        assert!(m.contains("too old"), "{m}");
    }

    #[test]
    fn theoretical_bandwidth() {
        let info = DeviceInfo {
            ordinal: 0,
            name: "H100".into(),
            sm_count: 132,
            compute_capability: (9, 0),
            max_sm_clock_mhz: 1980,
            memory_clock_mhz: 2619,
            memory_bus_width_bits: 5120,
            total_memory_bytes: 80 << 30,
            l2_cache_bytes: 50 << 20,
            max_shared_memory_per_block_optin: 227 * 1024,
            driver_version: "13.0".into(),
            nvrtc_version: Some("13.0".into()),
            compile_arch: Some("sm_90a".into()),
        };
        assert_eq!(info.arch(), 90);
        let bw = info.theoretical_bandwidth_gbs();
        assert!((bw - 3352.0).abs() < 1.0, "{bw}");
        assert!(info.to_string().contains("sm_90"));
    }
}
