//! The attention family's native GPU implementations: the v1 (mma.sync) and sm_90a
//! kernels through the lab's AttentionRunner, and the fp32 reference kernel, each
//! plan-backed (L2 flush + event timing, poisoned outputs).

use crate::results::ProblemSpec;
use crate::runner::gpu::{GpuSession, ReferenceCall};
use crate::runner::plan_backed::{PlanBacked, PlanCall};
use crate::runner::{Implementation, Outputs, Prepared, SuiteInputs};
use anyhow::Context;
use flashmoe::attention::prefill::select;
use flashmoe::attention::AttentionRunner;
use flashmoe::gpu::Device;
use std::rc::Rc;

/// Which GPU attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuAttentionKernel {
    /// The v1 FlashAttention-2 kernel (mma.sync, sm_80+).
    V1,
    /// The Hopper kernel (wgmma, TMA, warp specialisation; sm_90a, compute capability 9.0).
    Sm90,
    /// The simple fp32-accumulation reference kernel.
    Reference,
}

pub struct GpuAttention {
    pub kernel: GpuAttentionKernel,
    pub session: Rc<GpuSession>,
}

impl Implementation for GpuAttention {
    fn name(&self) -> &str {
        match self.kernel {
            GpuAttentionKernel::V1 => "flashmoe-v1",
            GpuAttentionKernel::Sm90 => "flashmoe-sm90",
            GpuAttentionKernel::Reference => "gpu-reference",
        }
    }
    fn backend(&self) -> &str {
        "cuda"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        let ProblemSpec::Attention(p) = problem else {
            return Err("attention kernel".into());
        };
        let variant = match self.kernel {
            GpuAttentionKernel::V1 => select::select_v1(p),
            GpuAttentionKernel::Sm90 => flashmoe::attention::runner::select_sm90_for_lab(p),
            GpuAttentionKernel::Reference => select::select_reference(p),
        }
        .map_err(|e| e.to_string())?;
        let arch = self.session.device.arch();
        variant
            .runs_on(arch)
            .map_err(|why| format!("{why} (this GPU is sm_{arch})"))
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Attention(p), SuiteInputs::Attention(x)) = (problem, inputs) else {
            anyhow::bail!("GPU attention given a non-attention config");
        };
        let dev = &self.session.device;
        let (variant, what) = match self.kernel {
            GpuAttentionKernel::V1 => (select::select_v1(p)?, "the v1 kernel"),
            GpuAttentionKernel::Sm90 => (
                flashmoe::attention::runner::select_sm90_for_lab(p)?,
                "the sm_90a kernel",
            ),
            GpuAttentionKernel::Reference => {
                let call = ReferenceCall::new(dev, p, x)?;
                return Ok(Box::new(PlanBacked::new(&self.session, call)));
            }
        };
        let runner = AttentionRunner::with_variant(dev, p, &x.q, &x.k, &x.v, variant)
            .with_context(|| format!("preparing {what}"))?;
        Ok(Box::new(PlanBacked::new(
            &self.session,
            RunnerCall { runner },
        )))
    }
}

/// A flash kernel (v1 or sm_90a) with its buffers (also the varlen suite's dense row).
pub(crate) struct RunnerCall {
    pub(crate) runner: AttentionRunner,
}

impl PlanCall for RunnerCall {
    fn launch(&mut self, dev: &Device) -> flashmoe::Result<()> {
        self.runner.run(dev)
    }
    fn poison(&mut self, dev: &Device) -> flashmoe::Result<()> {
        self.runner.poison_outputs(dev)
    }
    fn outputs(&mut self, dev: &Device) -> anyhow::Result<Outputs> {
        Ok(Outputs::Attention {
            o: self.runner.output(dev)?,
            lse: self.runner.lse(dev)?,
        })
    }
    fn peak_extra_bytes(&self) -> Option<u64> {
        // The kernel allocates nothing beyond its inputs, O and LSE.
        Some(0)
    }
}
