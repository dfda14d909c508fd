//! CPU implementations: the f64 ground truth and the tiled f32 FlashAttention algorithm
//! (attention), the f64 reference (MoE), the paged f64 reference and the tiled algorithm
//! on the dense cache (decode), both sequence by sequence in the packed layout (varlen);
//! MLA: the library's f64 reference per sequence and, in the tiled slot, the key-blocked
//! f64 computation on the dense latent (`crate::mla`).
//! Timed with the host clock.

use super::{Implementation, Outputs, Prepared, ReferenceOutputs, ReferenceProvider, SuiteInputs};
use crate::measure::Sampled;
use crate::results::ProblemSpec;
use crate::{decode, mla, varlen};
use anyhow::Context;
use flashmoe::reference::{attention, attention_tiled, moe, moe_grouped};
use std::time::Instant;

/// Which CPU algorithm an implementation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuAlgorithm {
    /// f64 accumulation, materialised softmax (attention) / f64 MoE reference.
    Reference,
    /// Tiled online softmax in f32, multi-threaded (attention only).
    Tiled,
    /// Dropless permutation + per-expert f32 GEMMs with SwiGLU (MoE only).
    Grouped,
}

pub struct CpuImplementation {
    pub algorithm: CpuAlgorithm,
}

impl CpuImplementation {
    pub fn reference() -> Self {
        CpuImplementation {
            algorithm: CpuAlgorithm::Reference,
        }
    }
    pub fn tiled() -> Self {
        CpuImplementation {
            algorithm: CpuAlgorithm::Tiled,
        }
    }
    pub fn grouped() -> Self {
        CpuImplementation {
            algorithm: CpuAlgorithm::Grouped,
        }
    }
}

/// Runs the algorithm once on the given problem and inputs.
fn run(
    algorithm: CpuAlgorithm,
    problem: &ProblemSpec,
    inputs: &SuiteInputs,
) -> anyhow::Result<Outputs> {
    Ok(match (problem, inputs, algorithm) {
        (ProblemSpec::Attention(p), SuiteInputs::Attention(x), CpuAlgorithm::Reference) => {
            let r = attention::attention_f64(p, x)?;
            Outputs::Attention {
                o: r.o.iter().map(|&v| v as f32).collect(),
                lse: r.lse.iter().map(|&v| v as f32).collect(),
            }
        }
        (ProblemSpec::Attention(p), SuiteInputs::Attention(x), CpuAlgorithm::Tiled) => {
            let r = attention_tiled::attention_tiled(
                p,
                x,
                attention_tiled::DEFAULT_BLOCK_M,
                attention_tiled::DEFAULT_BLOCK_N,
            )?;
            Outputs::Attention { o: r.o, lse: r.lse }
        }
        // Decode: the f64 reference walks the paged cache (built in the timed call: the CPU
        // lab times the pipeline, not a kernel); the tiled algorithm reads the dense cache.
        (ProblemSpec::Decode(p), SuiteInputs::Attention(x), CpuAlgorithm::Reference) => {
            let r = decode::reference_f64(p, x)?;
            Outputs::Attention {
                o: r.o.iter().map(|&v| v as f32).collect(),
                lse: r.lse.iter().map(|&v| v as f32).collect(),
            }
        }
        (ProblemSpec::Decode(p), SuiteInputs::Attention(x), CpuAlgorithm::Tiled) => {
            let mut dense = p.dense();
            dense.causal = true;
            let r = attention_tiled::attention_tiled(
                &dense,
                x,
                attention_tiled::DEFAULT_BLOCK_M,
                attention_tiled::DEFAULT_BLOCK_N,
            )?;
            Outputs::Attention { o: r.o, lse: r.lse }
        }
        // Varlen: each sequence alone (its slices of the packed inputs), scattered back into
        // the packed layout; empty sequences as the kernel writes them.
        (ProblemSpec::Varlen(p), SuiteInputs::Attention(x), CpuAlgorithm::Reference) => {
            let r = varlen::reference_f64(p, x)?;
            Outputs::Attention {
                o: r.o.iter().map(|&v| v as f32).collect(),
                lse: r.lse.iter().map(|&v| v as f32).collect(),
            }
        }
        (ProblemSpec::Varlen(p), SuiteInputs::Attention(x), CpuAlgorithm::Tiled) => {
            let r = varlen::per_sequence(p, x, |seq, inputs| {
                attention_tiled::attention_tiled(
                    seq,
                    inputs,
                    attention_tiled::DEFAULT_BLOCK_M,
                    attention_tiled::DEFAULT_BLOCK_N,
                )
            })?;
            Outputs::Attention { o: r.o, lse: r.lse }
        }
        (ProblemSpec::Mla(p), SuiteInputs::Attention(x), CpuAlgorithm::Reference) => {
            let r = mla::reference_f64(p, x)?;
            Outputs::Attention {
                o: r.o.iter().map(|&v| v as f32).collect(),
                lse: r.lse.iter().map(|&v| v as f32).collect(),
            }
        }
        (ProblemSpec::Mla(p), SuiteInputs::Attention(x), CpuAlgorithm::Tiled) => {
            let r = mla::blocked_f64(p, x)?;
            Outputs::Attention {
                o: r.o.iter().map(|&v| v as f32).collect(),
                lse: r.lse.iter().map(|&v| v as f32).collect(),
            }
        }
        (ProblemSpec::Moe(p), SuiteInputs::Moe(x), CpuAlgorithm::Reference) => {
            let r = moe::moe_f64(p, x)?;
            Outputs::Moe {
                out: r.out.iter().map(|&v| v as f32).collect(),
                losses: Some((r.routing.aux_loss, r.routing.z_loss)),
                topk_ids: Some(r.routing.topk_ids),
            }
        }
        (ProblemSpec::Moe(p), SuiteInputs::Moe(x), CpuAlgorithm::Grouped) => {
            let (out, routing) = moe_grouped::moe_grouped(p, x)?;
            Outputs::Moe {
                out,
                losses: Some((routing.aux_loss, routing.z_loss)),
                topk_ids: Some(routing.topk_ids),
            }
        }
        _ => anyhow::bail!("CPU {algorithm:?} does not implement {}", problem.label()),
    })
}

impl Implementation for CpuImplementation {
    fn name(&self) -> &str {
        match self.algorithm {
            CpuAlgorithm::Reference => "cpu-reference",
            CpuAlgorithm::Tiled => "cpu-tiled",
            CpuAlgorithm::Grouped => "cpu-grouped",
        }
    }
    fn backend(&self) -> &str {
        "cpu"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        match (problem, self.algorithm) {
            (ProblemSpec::Moe(_), CpuAlgorithm::Tiled) => {
                Err("the tiled CPU algorithm is attention-only".into())
            }
            (
                ProblemSpec::Attention(_)
                | ProblemSpec::Decode(_)
                | ProblemSpec::Varlen(_)
                | ProblemSpec::Mla(_),
                CpuAlgorithm::Grouped,
            ) => Err("the grouped CPU algorithm is MoE-only".into()),
            (ProblemSpec::Grad(_), _) => Err(
                "a forward implementation: gradient configs run on the backward ones \
                 (crate::grad::cpu)"
                    .into(),
            ),
            (ProblemSpec::Decode(p), CpuAlgorithm::Tiled) if !p.is_plain() => Err(
                "the tiled CPU algorithm runs the plain causal step (no window, softcap or \
                 ragged lengths)"
                    .into(),
            ),
            _ => Ok(()),
        }
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        Ok(Box::new(CpuPrepared {
            algorithm: self.algorithm,
            problem: problem.clone(),
            inputs,
            slowdown: crate::measure::test_slowdown(self.name())?,
        }))
    }
}

struct CpuPrepared<'a> {
    algorithm: CpuAlgorithm,
    problem: ProblemSpec,
    inputs: &'a SuiteInputs,
    /// Test-only injected slowdown ([`crate::measure::TEST_SLOWDOWN_ENV`]).
    slowdown: Option<f64>,
}

impl Sampled for CpuPrepared<'_> {
    fn sample(&mut self) -> anyhow::Result<f64> {
        let t0 = Instant::now();
        let out = run(self.algorithm, &self.problem, self.inputs)?;
        if let Some(f) = self.slowdown {
            crate::measure::spin_for(t0.elapsed().as_secs_f64() * f);
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(out); // freed outside the timed region
        Ok(ms)
    }
}

impl Prepared for CpuPrepared<'_> {
    fn notes(&self) -> Vec<String> {
        self.slowdown
            .map(|f| {
                format!(
                    "TEST KNOB: {} made this implementation {:.0}% slower",
                    crate::measure::TEST_SLOWDOWN_ENV,
                    f * 100.0
                )
            })
            .into_iter()
            .collect()
    }
    fn run_for_check(&mut self) -> anyhow::Result<Outputs> {
        // Each call allocates fresh outputs: nothing stale can be read back.
        run(self.algorithm, &self.problem, self.inputs)
    }
}

/// The CPU f64 reference.
pub struct CpuReference;

impl ReferenceProvider for CpuReference {
    fn name(&self, _problem: &ProblemSpec) -> String {
        "cpu-f64".into()
    }
    fn compute(
        &self,
        problem: &ProblemSpec,
        inputs: &SuiteInputs,
    ) -> anyhow::Result<ReferenceOutputs> {
        Ok(match (problem, inputs) {
            (ProblemSpec::Attention(p), SuiteInputs::Attention(x)) => ReferenceOutputs::Attention(
                attention::attention_f64(p, x).context("CPU f64 attention reference")?,
            ),
            (ProblemSpec::Moe(p), SuiteInputs::Moe(x)) => {
                ReferenceOutputs::Moe(moe::moe_f64(p, x).context("CPU f64 MoE reference")?)
            }
            (ProblemSpec::Decode(p), SuiteInputs::Attention(x)) => ReferenceOutputs::Attention(
                decode::reference_f64(p, x).context("CPU f64 paged decode reference")?,
            ),
            (ProblemSpec::Varlen(p), SuiteInputs::Attention(x)) => ReferenceOutputs::Attention(
                varlen::reference_f64(p, x).context("CPU f64 varlen reference (per sequence)")?,
            ),
            (ProblemSpec::Mla(p), SuiteInputs::Attention(x)) => ReferenceOutputs::Attention(
                mla::reference_f64(p, x).context("CPU f64 MLA reference (per sequence)")?,
            ),
            (ProblemSpec::Grad(p), SuiteInputs::Grad(x)) => ReferenceOutputs::Gradients(
                crate::grad::reference_f64(p, x).context("CPU f64 backward reference")?,
            ),
            _ => anyhow::bail!("inputs do not match the problem kind"),
        })
    }
}
