//! Native GPU MoE layer ("flashmoe-moe"): router, permutation, grouped SwiGLU GEMMs and
//! combine (`flashmoe::moe::MoeRunner`), timed with CUDA events after an L2 flush like
//! the attention kernels (see `gpu.rs`).

use crate::measure::Sampled;
use crate::results::ProblemSpec;
use crate::runner::gpu::GpuSession;
use crate::runner::plan_backed::{PlanBacked, PlanCall};
use crate::runner::{Implementation, Outputs, Prepared, SuiteInputs};
use anyhow::Context;
use flashmoe::gpu::Device;
use flashmoe::moe::forward::select;
use flashmoe::moe::MoeRunner;
use std::rc::Rc;

pub struct GpuMoe {
    pub session: Rc<GpuSession>,
}

impl Implementation for GpuMoe {
    fn name(&self) -> &str {
        "flashmoe-moe"
    }
    fn backend(&self) -> &str {
        "cuda"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        let ProblemSpec::Moe(p) = problem else {
            return Err("MoE layer".into());
        };
        let kernels = select::select(p).map_err(|e| e.to_string())?;
        let arch = self.session.device.arch();
        if let Some(k) = kernels.iter().find(|k| arch < k.min_arch) {
            return Err(format!(
                "{} needs sm_{} or newer, this GPU is sm_{arch}",
                k.entry, k.min_arch
            ));
        }
        Ok(())
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Moe(p), SuiteInputs::Moe(x)) = (problem, inputs) else {
            anyhow::bail!("GPU MoE given a non-MoE config");
        };
        let runner = MoeRunner::new(&self.session.device, p, x)
            .with_context(|| format!("preparing the MoE pipeline for {p}"))?;
        let call = MoeCall {
            runner,
            router_ms: None,
        };
        Ok(Box::new(PlanBacked::new(&self.session, call)))
    }
}

struct MoeCall {
    runner: MoeRunner,
    router_ms: Option<f64>,
}

/// Samples of the router stage alone (L2 flushed before each, like the layer's samples).
const ROUTER_SAMPLES: usize = 15;

impl PlanCall for MoeCall {
    fn launch(&mut self, dev: &Device) -> flashmoe::Result<()> {
        self.runner.run(dev)
    }
    fn poison(&mut self, dev: &Device) -> flashmoe::Result<()> {
        self.runner.poison_outputs(dev)
    }
    fn outputs(&mut self, dev: &Device) -> anyhow::Result<Outputs> {
        // Load statistics and losses are reported per config from the reference routing,
        // which the gate requires this one to match (ids, and losses within 1e-4).
        let routing = self.runner.gpu_routing(dev)?;
        Ok(Outputs::Moe {
            out: self.runner.output(dev)?,
            losses: Some((routing.aux_loss, routing.z_loss)),
            topk_ids: Some(routing.topk_ids),
        })
    }
    /// The median time of the router stage (logits, scoring + top-k, statistics) alone,
    /// after the outputs are read: the router's runs overwrite only its own buffers.
    fn after_check(&mut self, session: &GpuSession) -> anyhow::Result<()> {
        let dev = &session.device;
        let mut v = Vec::with_capacity(ROUTER_SAMPLES);
        for _ in 0..ROUTER_SAMPLES {
            let runner = &mut self.runner;
            v.push(session.timed(|| runner.run_router(dev))?);
        }
        self.router_ms = Some(crate::stats::median(&v));
        Ok(())
    }
    fn peak_extra_bytes(&self) -> Option<u64> {
        Some(self.runner.workspace_bytes())
    }
    fn router_ms(&self) -> Option<f64> {
        self.router_ms
    }
    /// Which grouped-GEMM path (sm_90 wgmma/TMA or portable mma.sync, and why) ran.
    fn notes(&self) -> Vec<String> {
        vec![self.runner.gemm_path()]
    }
}

/// The GPU fp32 MoE reference as an implementation under test (`flashmoe check` only):
/// on shapes within the CPU reference's size it is checked against the CPU f64
/// reference, which validates it for the large shapes where it is the reference.
pub struct GpuMoeReference {
    pub session: Rc<GpuSession>,
}

impl Implementation for GpuMoeReference {
    fn name(&self) -> &str {
        "gpu-reference"
    }
    fn backend(&self) -> &str {
        "cuda"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        let ProblemSpec::Moe(p) = problem else {
            return Err("MoE layer".into());
        };
        flashmoe::moe::reference::reference_defines(p.dtype)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Moe(p), SuiteInputs::Moe(x)) = (problem, inputs) else {
            anyhow::bail!("GPU MoE reference given a non-MoE config");
        };
        Ok(Box::new(ReferencePrepared {
            problem: p.clone(),
            inputs: x,
            session: self.session.clone(),
        }))
    }
}

struct ReferencePrepared<'a> {
    problem: flashmoe::MoeProblem,
    inputs: &'a flashmoe::reference::moe::MoeInputs,
    session: Rc<GpuSession>,
}

impl Sampled for ReferencePrepared<'_> {
    fn sample(&mut self) -> anyhow::Result<f64> {
        // Checked, never benchmarked: it uploads its weights on every call.
        anyhow::bail!("the GPU MoE reference is a correctness tool and is not timed")
    }
}

impl Prepared for ReferencePrepared<'_> {
    fn run_for_check(&mut self) -> anyhow::Result<Outputs> {
        let r = flashmoe::moe::reference::moe_reference_gpu(
            &self.session.device,
            &self.problem,
            self.inputs,
        )
        .context("GPU fp32 MoE reference")?;
        Ok(Outputs::Moe {
            out: r.out.iter().map(|&v| v as f32).collect(),
            losses: Some((r.routing.aux_loss, r.routing.z_loss)),
            topk_ids: Some(r.routing.topk_ids),
        })
    }
}
