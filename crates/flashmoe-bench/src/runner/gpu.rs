//! The copy calibration and the GPU fp32 reference (attention and MoE), on the GPU session
//! every native implementation shares (`session.rs`, re-exported here), timed with CUDA
//! events. Before each start event an L2 flush (a memset of 2× L2) is queued, so the
//! caches are cold and the GPU is already busy when the start event is recorded: host
//! launch latency is never counted as kernel time.

use super::cpu::CpuReference;
use super::plan_backed::{AttentionOut, PlanBacked, PlanCall};
pub use super::session::GpuSession;
use super::{Outputs, Prepared, ReferenceOutputs, ReferenceProvider, SuiteInputs};
use crate::measure::Sampled;
use crate::results::ProblemSpec;
use anyhow::Context;
use flashmoe::attention;
use flashmoe::gpu::{Device, DeviceTensor};
use flashmoe::reference::attention::AttentionOutput;
use flashmoe::DType;
use std::rc::Rc;

/// Bytes of the GPU calibration copy.
const CALIBRATION_COPY_BYTES: usize = 256 << 20;

/// The GPU calibration: a device-to-device copy of 256 MiB, timed like every kernel (L2
/// flush, then CUDA events). A fixed bandwidth-bound workload: clocks, thermals or a
/// neighbour on the GPU move it as they move the implementations.
pub struct GpuCopyCalibration {
    pub session: Rc<GpuSession>,
}

impl super::calibration::Calibration for GpuCopyCalibration {
    fn workload(&self) -> String {
        format!(
            "device-to-device copy of {} MiB (L2 flush + CUDA events)",
            CALIBRATION_COPY_BYTES >> 20
        )
    }
    fn prepare(&self) -> anyhow::Result<Box<dyn Sampled + '_>> {
        let stream = self.session.device.stream();
        let alloc = || {
            // SAFETY: the source is filled right below; the destination is only written.
            unsafe { stream.alloc::<u8>(CALIBRATION_COPY_BYTES) }
                .map_err(|e| flashmoe::Error::cuda("allocating the calibration copy buffers", e))
        };
        let mut src = alloc()?;
        let dst = alloc()?;
        {
            use cudarc::driver::DevicePtrMut;
            let (p, _r) = src.device_ptr_mut(stream);
            // SAFETY: fills exactly the buffer.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    p,
                    0x5A,
                    CALIBRATION_COPY_BYTES,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| flashmoe::Error::cuda("cuMemsetD8Async (calibration source)", e))?;
        }
        Ok(Box::new(GpuCopyRun {
            session: &self.session,
            src,
            dst,
        }))
    }
}

struct GpuCopyRun<'a> {
    session: &'a GpuSession,
    src: cudarc::driver::CudaSlice<u8>,
    dst: cudarc::driver::CudaSlice<u8>,
}

impl Sampled for GpuCopyRun<'_> {
    fn sample(&mut self) -> anyhow::Result<f64> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let stream = self.session.device.stream();
        let (src, dst) = (&self.src, &mut self.dst);
        self.session.timed(|| {
            let (ps, _rs) = src.device_ptr(stream);
            let (pd, _rd) = dst.device_ptr_mut(stream);
            // SAFETY: both buffers hold CALIBRATION_COPY_BYTES bytes.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    pd,
                    ps,
                    CALIBRATION_COPY_BYTES,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| flashmoe::Error::cuda("cuMemcpyDtoDAsync (calibration)", e))
        })
    }
}

/// Buffers for the GPU reference kernel (O in f32).
pub(crate) struct ReferenceCall {
    problem: flashmoe::AttentionProblem,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    out: AttentionOut,
}

impl ReferenceCall {
    pub(crate) fn new(
        dev: &Device,
        p: &flashmoe::AttentionProblem,
        x: &flashmoe::reference::attention::AttentionInputs,
    ) -> anyhow::Result<ReferenceCall> {
        Ok(ReferenceCall {
            problem: p.clone(),
            q: DeviceTensor::from_f32(dev, p.dtype, &x.q)?,
            k: DeviceTensor::from_f32(dev, p.dtype, &x.k)?,
            v: DeviceTensor::from_f32(dev, p.dtype, &x.v)?,
            out: AttentionOut {
                o: DeviceTensor::alloc(dev, DType::F32, p.q_elems())?,
                lse: DeviceTensor::alloc(dev, DType::F32, p.lse_elems())?,
            },
        })
    }

    /// One checked run's (o, lse) in f64: the reference outputs of a config.
    fn reference(
        session: &Rc<GpuSession>,
        p: &flashmoe::AttentionProblem,
        x: &flashmoe::reference::attention::AttentionInputs,
    ) -> anyhow::Result<AttentionOutput<f64>> {
        let call = ReferenceCall::new(&session.device, p, x)?;
        let Outputs::Attention { o, lse } = PlanBacked::new(session, call).run_for_check()? else {
            unreachable!("the attention reference returns attention outputs")
        };
        Ok(AttentionOutput {
            o: o.into_iter().map(f64::from).collect(),
            lse: lse.into_iter().map(f64::from).collect(),
        })
    }
}

impl PlanCall for ReferenceCall {
    fn launch(&mut self, dev: &Device) -> flashmoe::Result<()> {
        let AttentionOut { o, lse } = &mut self.out;
        attention::reference_forward(dev, &self.problem, &self.q, &self.k, &self.v, o, lse)
    }
    fn poison(&mut self, dev: &Device) -> flashmoe::Result<()> {
        self.out.poison(dev)
    }
    fn outputs(&mut self, dev: &Device) -> anyhow::Result<Outputs> {
        self.out.download(dev)
    }
    fn peak_extra_bytes(&self) -> Option<u64> {
        None
    }
}

/// CPU f64 for problems small enough, the GPU fp32 reference kernels (attention:
/// `attention_reference.cu`; MoE: `moe_reference.cu`, each validated against the CPU f64
/// reference by `flashmoe check` and the GPU unit tests) above that.
pub struct GpuReferenceProvider {
    pub session: Rc<GpuSession>,
    /// Largest problem (model FLOPs) checked against the CPU f64 reference.
    pub cpu_max_flops: f64,
}

impl GpuReferenceProvider {
    fn use_cpu(&self, problem: &ProblemSpec) -> bool {
        // The GPU reference of decode is dense attention: only the plain causal step.
        let cpu_only = matches!(problem, ProblemSpec::Decode(p) if !p.is_plain());
        cpu_only || problem.workload().flops() <= self.cpu_max_flops
    }
}

/// Name of the reference of MLA configs above the CPU f64 reference's size: no GPU
/// reference kernel has MLA's 576/512 head dims, so the key-blocked f64 computation on the
/// host (`crate::mla::blocked_f64`, checked equal to the library reference by its tests).
pub const MLA_LARGE_REFERENCE: &str = "cpu-f64-blocked";

impl ReferenceProvider for GpuReferenceProvider {
    fn name(&self, problem: &ProblemSpec) -> String {
        if matches!(problem, ProblemSpec::Mla(_)) && !self.use_cpu(problem) {
            MLA_LARGE_REFERENCE.into()
        } else if self.use_cpu(problem) {
            CpuReference.name(problem)
        } else {
            "gpu-fp32".into()
        }
    }
    fn serves_as(&self, problem: &ProblemSpec) -> Option<&str> {
        let gpu = !self.use_cpu(problem) && !matches!(problem, ProblemSpec::Mla(_));
        gpu.then_some("gpu-reference")
    }
    fn compute(
        &self,
        problem: &ProblemSpec,
        inputs: &SuiteInputs,
    ) -> anyhow::Result<ReferenceOutputs> {
        if self.use_cpu(problem) {
            return CpuReference.compute(problem, inputs);
        }
        if let (ProblemSpec::Mla(p), SuiteInputs::Attention(x)) = (problem, inputs) {
            let r = crate::mla::blocked_f64(p, x).context("key-blocked f64 MLA reference")?;
            return Ok(ReferenceOutputs::Attention(r));
        }
        if let (ProblemSpec::Moe(p), SuiteInputs::Moe(x)) = (problem, inputs) {
            let r = flashmoe::moe::reference::moe_reference_gpu(&self.session.device, p, x)
                .context("GPU fp32 MoE reference")?;
            return Ok(ReferenceOutputs::Moe(r));
        }
        // Varlen: the fp32 reference kernel on each sequence alone (window and softcap
        // included), scattered into the packed layout.
        if let (ProblemSpec::Varlen(p), SuiteInputs::Attention(x)) = (problem, inputs) {
            let r = crate::varlen::per_sequence(p, x, |seq, xs| {
                ReferenceCall::reference(&self.session, seq, xs)
            })
            .context("GPU fp32 varlen reference (per sequence)")?;
            return Ok(ReferenceOutputs::Attention(r));
        }
        // Decode: the fp32 reference on the dense cache (the same K/V, bottom-right causal).
        let dense;
        let (p, x) = match (problem, inputs) {
            (ProblemSpec::Attention(p), SuiteInputs::Attention(x)) => (p, x),
            (ProblemSpec::Decode(d), SuiteInputs::Attention(x)) => {
                dense = flashmoe::AttentionProblem {
                    causal: true,
                    ..d.dense()
                };
                (&dense, x)
            }
            _ => anyhow::bail!("no GPU reference for this config"),
        };
        let r = ReferenceCall::reference(&self.session, p, x).context("GPU fp32 reference")?;
        Ok(ReferenceOutputs::Attention(r))
    }
}
