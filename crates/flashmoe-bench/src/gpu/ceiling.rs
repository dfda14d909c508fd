//! Measured hardware ceilings: what this GPU actually reaches, in this session, on the
//! two operations every kernel is compared against — a large bf16 GEMM (compute) and a
//! device-to-device copy (memory bandwidth). "% of ceiling" figures divide by these.

use super::timing::time_back_to_back;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use flashmoe::gpu::ensure_cublas;
use flashmoe::gpu::Device;
use flashmoe::{Error, Result};
use serde::{Deserialize, Serialize};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// One measured ceiling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CeilingMeasurement {
    /// What was measured, e.g. "cuBLAS bf16 GEMM 8192x8192x8192, fp32 accumulate".
    pub description: String,
    /// TFLOP/s for the GEMM, GB/s (read + write) for the copy, from the median time.
    pub value: f64,
    pub unit: String,
    pub median_ms: f64,
    /// Every timed sample, in order, ms.
    pub samples_ms: Vec<f64>,
}

/// Median of a non-empty slice.
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Deterministic pseudo-random bf16 bits uniform in [-1, 1) (xorshift64*): GEMM power
/// draw, and so clocks, depend on the data; zeros would overstate the ceiling.
pub fn random_bf16_bits(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D);
            let u = (r >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            half::bf16::from_f32(2.0 * u - 1.0).to_bits()
        })
        .collect()
}

const GEMM_N: usize = 8192;
const WARMUP: usize = 3;
const SAMPLES: usize = 10;

/// cuBLAS bf16 GEMM 8192³ (fp32 accumulation, bf16 output) on random data; median of 10
/// back-to-back timed runs after 3 warm-ups. TFLOP/s.
pub fn measure_gemm_ceiling(dev: &Device) -> Result<f64> {
    measure_gemm_ceiling_detailed(dev).map(|m| m.value)
}

/// [`measure_gemm_ceiling`] with the samples.
pub fn measure_gemm_ceiling_detailed(dev: &Device) -> Result<CeilingMeasurement> {
    ensure_cublas()?;
    let stream = dev.stream();
    let n = GEMM_N;
    let upload = |seed| {
        stream
            .clone_htod(&random_bf16_bits(n * n, seed))
            .map_err(|e| Error::cuda("uploading GEMM operands (8192x8192 bf16)", e))
    };
    let a = upload(1)?;
    let b = upload(2)?;
    // SAFETY: C is fully written by the GEMM (beta = 0).
    let mut c = unsafe { stream.alloc::<u16>(n * n) }
        .map_err(|e| Error::cuda("allocating the GEMM output", e))?;

    let blas = match catch_unwind(AssertUnwindSafe(|| {
        cudarc::cublas::CudaBlas::new(stream.clone())
    })) {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return Err(Error::cuda("cublasCreate", e)),
        Err(_) => {
            return Err(Error::cuda(
                "cuBLAS",
                "libcublas could not be loaded (missing library or symbol)",
            ))
        }
    };
    let alpha = 1.0f32;
    let beta = 0.0f32;
    let mut gemm = || -> Result<()> {
        let (pa, _ra) = a.device_ptr(stream);
        let (pb, _rb) = b.device_ptr(stream);
        let (pc, _rc) = c.device_ptr_mut(stream);
        // SAFETY: column-major n×n operands of n*n elements each; lda = ldb = ldc = n.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                n as i32,
                n as i32,
                &alpha as *const f32 as *const _,
                pa as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                n as i32,
                pb as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                n as i32,
                &beta as *const f32 as *const _,
                pc as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                n as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::cuda("cublasGemmEx (bf16 8192^3)", e))
    };
    for _ in 0..WARMUP {
        gemm()?;
    }
    dev.synchronize()?;
    let samples = time_back_to_back(dev, SAMPLES, &mut gemm)?;
    let med = median(&samples);
    let flops = 2.0 * (n as f64).powi(3);
    Ok(CeilingMeasurement {
        description: format!(
            "cuBLAS bf16 GEMM {n}x{n}x{n}, fp32 accumulate, random data, median of {SAMPLES} back-to-back runs"
        ),
        value: flops / (med * 1e-3) / 1e12,
        unit: "TFLOP/s".into(),
        median_ms: med,
        samples_ms: samples,
    })
}

const COPY_BYTES: usize = 1 << 30;

/// Device-to-device copy of 1 GiB (cuMemcpyDtoDAsync); GB/s counting bytes read plus
/// bytes written; median of 10 back-to-back timed runs after 3 warm-ups.
pub fn measure_copy_ceiling(dev: &Device) -> Result<f64> {
    measure_copy_ceiling_detailed(dev).map(|m| m.value)
}

/// [`measure_copy_ceiling`] with the samples.
pub fn measure_copy_ceiling_detailed(dev: &Device) -> Result<CeilingMeasurement> {
    let stream = dev.stream();
    let bytes = COPY_BYTES;
    let alloc = || {
        // SAFETY: the source is filled right below; the destination is only written.
        unsafe { stream.alloc::<u8>(bytes) }
            .map_err(|e| Error::cuda("allocating 1 GiB for the copy ceiling", e))
    };
    let mut src = alloc()?;
    let mut dst = alloc()?;
    {
        let (p, _r) = src.device_ptr_mut(stream);
        // SAFETY: fills exactly the buffer.
        unsafe { cudarc::driver::result::memset_d8_async(p, 0x5A, bytes, stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuMemsetD8Async", e))?;
    }
    let mut copy = || -> Result<()> {
        let (ps, _rs) = src.device_ptr(stream);
        let (pd, _rd) = dst.device_ptr_mut(stream);
        // SAFETY: both buffers hold `bytes` bytes.
        unsafe { cudarc::driver::result::memcpy_dtod_async(pd, ps, bytes, stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuMemcpyDtoDAsync (1 GiB)", e))
    };
    for _ in 0..WARMUP {
        copy()?;
    }
    dev.synchronize()?;
    let samples = time_back_to_back(dev, SAMPLES, &mut copy)?;
    let med = median(&samples);
    Ok(CeilingMeasurement {
        description: format!(
            "device-to-device copy of {} MiB (read + write bytes counted), median of {SAMPLES} back-to-back runs",
            bytes >> 20
        ),
        value: 2.0 * bytes as f64 / (med * 1e-3) / 1e9,
        unit: "GB/s".into(),
        median_ms: med,
        samples_ms: samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_works() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn random_bf16_is_in_range_and_not_constant() {
        let v = random_bf16_bits(10_000, 7);
        let f: Vec<f32> = v
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        assert!(f.iter().all(|x| (-1.0..=1.0).contains(x)));
        let mean = f.iter().sum::<f32>() / f.len() as f32;
        assert!(mean.abs() < 0.05, "{mean}");
        let zeros = f.iter().filter(|&&x| x == 0.0).count();
        assert!(zeros < 100);
        assert_eq!(v, random_bf16_bits(10_000, 7));
        assert_ne!(v, random_bf16_bits(10_000, 8));
    }
}
