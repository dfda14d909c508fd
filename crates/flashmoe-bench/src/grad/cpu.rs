//! The gradient family's CPU implementations, timed with the host clock: `cpu-reference`
//! (the f64 backward references, which are also the check's ground truth) and the f32
//! algorithms under test — `cpu-tiled` (attention and varlen: FlashAttention-2's backward,
//! `attention_f32.rs`) and `cpu-grouped` (MoE: the grouped backward, `moe_f32.rs`).
//! `cpu-tiled` with `--pass bwd` runs its forward once in `prepare` and times the backward
//! over it; with `fwd+bwd` it times both. `cpu-grouped` recomputes what it needs of the
//! forward inside its backward (both passes time the same call); the reference times its
//! f64 backward.

use super::{attention_f32, moe_f32, reference_f64, GradLayer, GradProblem, GradTensor};
use crate::measure::Sampled;
use crate::results::ProblemSpec;
use crate::runner::{Implementation, Outputs, Prepared, SuiteInputs};
use std::time::Instant;

/// Which CPU backward an implementation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradCpuAlgorithm {
    /// The f64 references.
    Reference,
    /// f32 FlashAttention-2 backward (attention, varlen).
    Tiled,
    /// f32 grouped MoE backward.
    Grouped,
}

pub struct GradCpu {
    pub algorithm: GradCpuAlgorithm,
}

impl GradCpu {
    pub fn reference() -> GradCpu {
        GradCpu {
            algorithm: GradCpuAlgorithm::Reference,
        }
    }
    pub fn tiled() -> GradCpu {
        GradCpu {
            algorithm: GradCpuAlgorithm::Tiled,
        }
    }
    pub fn grouped() -> GradCpu {
        GradCpu {
            algorithm: GradCpuAlgorithm::Grouped,
        }
    }
}

fn named(p: &GradProblem, values: Vec<Vec<f32>>) -> Vec<GradTensor> {
    p.tensors()
        .iter()
        .zip(values)
        .map(|(t, values)| GradTensor {
            name: t.name.to_string(),
            values,
        })
        .collect()
}

/// One run: fresh output vectors every call (nothing stale can be read back). `saved`:
/// the forward `prepare` ran (`cpu-tiled`, pass bwd).
fn run(
    algorithm: GradCpuAlgorithm,
    p: &GradProblem,
    x: &super::GradInputs,
    saved: Option<&attention_f32::SavedForward>,
) -> anyhow::Result<Vec<GradTensor>> {
    Ok(match (algorithm, &p.layer) {
        (GradCpuAlgorithm::Tiled, GradLayer::Attention(a)) if saved.is_some() => {
            let f = saved.expect("checked");
            named(
                p,
                attention_f32::backward_from_forward(a, x.attention()?, &x.d_out, &f.o, &f.lse)?
                    .into(),
            )
        }
        (GradCpuAlgorithm::Tiled, GradLayer::Varlen(v)) if saved.is_some() => named(
            p,
            attention_f32::varlen_backward_from_forward(
                v,
                x.attention()?,
                &x.d_out,
                saved.expect("checked"),
            )?
            .into(),
        ),
        (GradCpuAlgorithm::Reference, _) => {
            reference_f64(p, x)?.iter().map(GradTensor::from).collect()
        }
        (GradCpuAlgorithm::Tiled, GradLayer::Attention(a)) => named(
            p,
            attention_f32::attention_backward_f32(a, x.attention()?, &x.d_out)?.into(),
        ),
        (GradCpuAlgorithm::Tiled, GradLayer::Varlen(v)) => named(
            p,
            attention_f32::varlen_backward_f32(v, x.attention()?, &x.d_out)?.into(),
        ),
        (GradCpuAlgorithm::Grouped, GradLayer::Moe(m)) => named(
            p,
            moe_f32::moe_backward_f32(m, x.moe()?, &x.d_out, p.d_aux, p.d_z)?,
        ),
        _ => anyhow::bail!("CPU {algorithm:?} backward does not run {p}"),
    })
}

impl Implementation for GradCpu {
    fn name(&self) -> &str {
        match self.algorithm {
            GradCpuAlgorithm::Reference => "cpu-reference",
            GradCpuAlgorithm::Tiled => "cpu-tiled",
            GradCpuAlgorithm::Grouped => "cpu-grouped",
        }
    }
    fn backend(&self) -> &str {
        "cpu"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        let ProblemSpec::Grad(p) = problem else {
            return Err("the CPU backward implementations run gradient configs".into());
        };
        match (self.algorithm, &p.layer) {
            (GradCpuAlgorithm::Reference, _)
            | (GradCpuAlgorithm::Tiled, GradLayer::Attention(_) | GradLayer::Varlen(_))
            | (GradCpuAlgorithm::Grouped, GradLayer::Moe(_)) => Ok(()),
            (GradCpuAlgorithm::Tiled, GradLayer::Moe(_)) => {
                Err("the tiled CPU backward is attention-only".into())
            }
            (GradCpuAlgorithm::Grouped, _) => Err("the grouped CPU backward is MoE-only".into()),
        }
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Grad(p), SuiteInputs::Grad(x)) = (problem, inputs) else {
            anyhow::bail!("a CPU backward given a config without gradient inputs");
        };
        let saved = match (self.algorithm, p.pass, &p.layer) {
            (GradCpuAlgorithm::Tiled, super::Pass::Bwd, GradLayer::Attention(a)) => {
                Some(attention_f32::forward_f32(a, x.attention()?)?)
            }
            (GradCpuAlgorithm::Tiled, super::Pass::Bwd, GradLayer::Varlen(v)) => {
                Some(attention_f32::varlen_forward_f32(v, x.attention()?)?)
            }
            _ => None,
        };
        Ok(Box::new(GradCpuPrepared {
            algorithm: self.algorithm,
            problem: p.clone(),
            inputs: x,
            saved,
        }))
    }
}

struct GradCpuPrepared<'a> {
    algorithm: GradCpuAlgorithm,
    problem: GradProblem,
    inputs: &'a super::GradInputs,
    saved: Option<attention_f32::SavedForward>,
}

impl Sampled for GradCpuPrepared<'_> {
    fn sample(&mut self) -> anyhow::Result<f64> {
        let t0 = Instant::now();
        let out = run(
            self.algorithm,
            &self.problem,
            self.inputs,
            self.saved.as_ref(),
        )?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(out); // freed outside the timed region
        Ok(ms)
    }
}

impl Prepared for GradCpuPrepared<'_> {
    fn run_for_check(&mut self) -> anyhow::Result<Outputs> {
        Ok(Outputs::Gradients(run(
            self.algorithm,
            &self.problem,
            self.inputs,
            self.saved.as_ref(),
        )?))
    }
    fn notes(&self) -> Vec<String> {
        match self.algorithm {
            GradCpuAlgorithm::Reference => vec!["f64 backward (the check's reference)".into()],
            _ => {
                vec!["f32 backward over an f32 forward whose output is rounded to the dtype".into()]
            }
        }
    }
}
