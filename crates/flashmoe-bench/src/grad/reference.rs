//! The gradient family's reference provider: the library's f64 backward on the host, for
//! the CPU and the GPU lab alike (there is no GPU backward reference kernel).
//!
//! Dense attention above [`GradReference::max_flops`] backward FLOPs is checked on a slice
//! whose f64 backward fits the budget: batch 0 and its first KV heads (with their query
//! heads), at least one — the batches and KV-head groups of attention are independent, so
//! the slice's gradients are exactly the full problem's there. Its name says so
//! ("cpu-f64 (batch 0, KV heads 0..n of H)"). When even one KV head's backward is over the
//! budget (long sequences), [`SAMPLED_ROWS`] rows of dq (per query head of the group), dk
//! and dv of batch 0's first KV head are computed exactly in f64 instead
//! ([`super::sampled`]; named "cpu-f64 (sampled ...)"). MoE configs are checked whole up
//! to [`GradReference::max_whole_flops`], above it on sampled tokens' dx and two experts'
//! dw13 / dw2 ([`super::moe_sampled`]); varlen configs whole up to that budget, above it
//! on sampled rows of a few sequences ([`super::sampled::varlen_sampled_f64`]).

use super::{reference_f64, GradInputs, GradLayer, RefTensor};
use crate::results::ProblemSpec;
use crate::runner::{ReferenceOutputs, ReferenceProvider, SuiteInputs};
use anyhow::Context;
use flashmoe::reference::attention::AttentionInputs;
use flashmoe::reference::attention_backward::attention_backward_f64;
use flashmoe::AttentionProblem;

/// The f64 backward reference (module docs).
pub struct GradReference {
    /// Backward FLOPs (the problem's convention) above which dense attention is checked
    /// on a slice.
    pub max_flops: f64,
    /// Backward FLOPs above which a varlen or MoE config (which cannot be sliced like
    /// dense attention) is checked on samples.
    pub max_whole_flops: f64,
}

impl Default for GradReference {
    /// 5e10 FLOPs: a few seconds of the f64 backward on a many-core host; whole configs up
    /// to 1e12 (minutes).
    fn default() -> GradReference {
        GradReference {
            max_flops: 5e10,
            max_whole_flops: 1e12,
        }
    }
}

/// Rows of dq (per query head), dk and dv the sampled reference computes.
pub const SAMPLED_ROWS: usize = 128;

/// How a dense attention config is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AttentionPlan {
    Whole,
    /// Batch 0, KV heads 0..n.
    Slice(usize),
    /// [`SAMPLED_ROWS`] rows of batch 0's KV head 0 ([`super::sampled`]).
    Sampled,
}

/// The whole problem when it fits the budget, else the KV heads of batch 0 that do (at
/// least one), else sampled rows.
fn attention_plan(p: &AttentionProblem, backward_flops: f64, max_flops: f64) -> AttentionPlan {
    if backward_flops <= max_flops {
        return AttentionPlan::Whole;
    }
    let per_head = backward_flops / (p.batch * p.heads_kv) as f64;
    match (max_flops / per_head) as usize {
        0 => AttentionPlan::Sampled,
        n => AttentionPlan::Slice(n.min(p.heads_kv)),
    }
}

/// The sliced problem and inputs: batch 0, KV heads 0..n.
fn slice(
    p: &AttentionProblem,
    x: &AttentionInputs,
    n: usize,
) -> (AttentionProblem, AttentionInputs) {
    let g = p.group_size();
    let (d, sq, sk) = (p.head_dim, p.seqlen_q, p.seqlen_k);
    let sub = AttentionProblem {
        batch: 1,
        heads_q: n * g,
        heads_kv: n,
        ..p.clone()
    };
    let rows = |v: &[f32], seq: usize, heads: usize, keep: usize| -> Vec<f32> {
        (0..seq)
            .flat_map(|i| v[i * heads * d..(i * heads + keep) * d].iter().copied())
            .collect()
    };
    let xs = AttentionInputs {
        q: rows(&x.q, sq, p.heads_q, n * g),
        k: rows(&x.k, sk, p.heads_kv, n),
        v: rows(&x.v, sk, p.heads_kv, n),
    };
    (sub, xs)
}

/// The element ranges of the full tensors the slice covers: per row of batch 0, its first
/// `keep` heads.
fn ranges(seq: usize, heads: usize, keep: usize, d: usize) -> Vec<(usize, usize)> {
    (0..seq).map(|i| (i * heads * d, keep * d)).collect()
}

impl GradReference {
    /// Whether a varlen config is over the whole-config budget (checked on samples).
    fn varlen_sampled(&self, problem: &ProblemSpec) -> bool {
        matches!(problem, ProblemSpec::Grad(g)
            if matches!(g.layer, GradLayer::Varlen(_)) && g.backward_flops() > self.max_whole_flops)
    }

    /// Whether a MoE config is over the whole-config budget (checked on samples).
    fn moe_sampled(&self, problem: &ProblemSpec) -> bool {
        matches!(problem, ProblemSpec::Grad(g)
            if matches!(g.layer, GradLayer::Moe(_)) && g.backward_flops() > self.max_whole_flops)
    }

    fn plan_of(&self, problem: &ProblemSpec) -> Option<(AttentionProblem, AttentionPlan)> {
        let ProblemSpec::Grad(g) = problem else {
            return None;
        };
        let GradLayer::Attention(a) = &g.layer else {
            return None;
        };
        Some((
            a.clone(),
            attention_plan(a, g.backward_flops(), self.max_flops),
        ))
    }
}

impl ReferenceProvider for GradReference {
    fn name(&self, problem: &ProblemSpec) -> String {
        match self.plan_of(problem) {
            Some((a, AttentionPlan::Slice(n))) => format!(
                "cpu-f64 (batch 0, KV heads 0..{n} of {} x {})",
                a.heads_kv, a.batch
            ),
            Some((_, AttentionPlan::Sampled)) => format!(
                "cpu-f64 (sampled: {SAMPLED_ROWS} rows of dq per head, dk, dv; batch 0, KV head 0)"
            ),
            _ if self.varlen_sampled(problem) => format!(
                "cpu-f64 (sampled: {} sequences x {SAMPLED_ROWS} rows of dq per head, dk, dv; KV head 0)",
                super::sampled::SAMPLED_SEQUENCES
            ),
            _ if self.moe_sampled(problem) => format!(
                "cpu-f64 (sampled: {} tokens' dx, 2 experts' dw13 and dw2)",
                super::moe_sampled::SAMPLED_TOKENS
            ),
            _ => "cpu-f64".into(),
        }
    }
    fn compute(
        &self,
        problem: &ProblemSpec,
        inputs: &SuiteInputs,
    ) -> anyhow::Result<ReferenceOutputs> {
        let (ProblemSpec::Grad(g), SuiteInputs::Grad(x)) = (problem, inputs) else {
            anyhow::bail!("the gradient reference given a config without gradient inputs");
        };
        let tensors = match self.plan_of(problem) {
            Some((a, AttentionPlan::Slice(n))) => sliced(&a, x, n)?,
            Some((a, AttentionPlan::Sampled)) => {
                super::sampled::sampled_f64(&a, x.attention()?, &x.d_out, SAMPLED_ROWS)
                    .context("CPU f64 backward (sampled rows)")?
            }
            _ if self.varlen_sampled(problem) => {
                let GradLayer::Varlen(v) = &g.layer else {
                    unreachable!("varlen_sampled checked the layer")
                };
                super::sampled::varlen_sampled_f64(v, x.attention()?, &x.d_out, SAMPLED_ROWS)
                    .context("CPU f64 varlen backward (sampled)")?
            }
            _ if self.moe_sampled(problem) => {
                let GradLayer::Moe(m) = &g.layer else {
                    unreachable!("moe_sampled checked the layer")
                };
                super::moe_sampled::moe_sampled_f64(
                    m,
                    x.moe()?,
                    &x.d_out,
                    g.d_aux,
                    g.d_z,
                    super::moe_sampled::SAMPLED_TOKENS,
                )
                .context("CPU f64 MoE backward (sampled)")?
            }
            _ => reference_f64(g, x).context("CPU f64 backward reference")?,
        };
        Ok(ReferenceOutputs::Gradients(tensors))
    }
}

fn sliced(a: &AttentionProblem, x: &GradInputs, n: usize) -> anyhow::Result<Vec<RefTensor>> {
    let (sub, xs) = slice(a, x.attention()?, n);
    let d = a.head_dim;
    let d_o: Vec<f32> = (0..a.seqlen_q)
        .flat_map(|i| {
            x.d_out[i * a.heads_q * d..(i * a.heads_q + n * a.group_size()) * d]
                .iter()
                .copied()
        })
        .collect();
    let r = attention_backward_f64(&sub, &xs, &d_o).context("CPU f64 backward (slice)")?;
    Ok(vec![
        RefTensor {
            name: "dq".into(),
            values: r.dq,
            select: Some(ranges(a.seqlen_q, a.heads_q, n * a.group_size(), d)),
        },
        RefTensor {
            name: "dk".into(),
            values: r.dk,
            select: Some(ranges(a.seqlen_k, a.heads_kv, n, d)),
        },
        RefTensor {
            name: "dv".into(),
            values: r.dv,
            select: Some(ranges(a.seqlen_k, a.heads_kv, n, d)),
        },
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grad::{GradProblem, GradTensor, Pass};
    use flashmoe::DType;

    /// The slice's gradients are the full problem's on batch 0's first KV heads, and the
    /// gate compares exactly those elements.
    #[test]
    fn slice_equals_the_full_reference_there() {
        let mut a = AttentionProblem::new(2, 6, 19, 32, true, DType::Bf16);
        a.heads_kv = 3;
        a.seqlen_k = 27;
        let g = GradProblem::new(Pass::Bwd, GradLayer::Attention(a.clone()));
        let x = GradInputs::generate(&g, SuiteInputs::generate(&g.layer.forward(), 11), 11);
        let full = reference_f64(&g, &x).unwrap();
        let spec = ProblemSpec::Grad(g.clone());
        let inputs = SuiteInputs::Grad(Box::new(x));
        let small = GradReference {
            max_flops: 2.5 * a.flops() / 6.0 * 2.0,
            max_whole_flops: 0.0,
        };
        assert_eq!(
            small.name(&spec),
            "cpu-f64 (batch 0, KV heads 0..2 of 3 x 2)"
        );
        let ReferenceOutputs::Gradients(sliced) = small.compute(&spec, &inputs).unwrap() else {
            panic!()
        };
        let exact: Vec<GradTensor> = full.iter().map(GradTensor::from).collect();
        for (s, f) in sliced.iter().zip(&full) {
            let full32: Vec<f32> = f.values.iter().map(|&v| v as f32).collect();
            let picked = s.pick(&full32);
            let want: Vec<f32> = s.values.iter().map(|&v| v as f32).collect();
            assert_eq!(picked.as_ref(), want.as_slice(), "{}", s.name);
        }
        let res = crate::grad::gate(&g, &exact, &sliced, "slice");
        assert!(res.passed, "{:?}", res.note);
        // A wrong value outside the slice is not seen; inside it is.
        let mut bad = exact.clone();
        let d = a.head_dim;
        bad[0].values[5 * d] += 10.0; // row 0, query head 5: outside (heads 0..4)
        assert!(crate::grad::gate(&g, &bad, &sliced, "slice").passed);
        bad[0].values[d] += 10.0; // row 0, query head 1: inside
        assert!(!crate::grad::gate(&g, &bad, &sliced, "slice").passed);
        assert_eq!(GradReference::default().name(&spec), "cpu-f64");
        // Below one KV head's cost: sampled rows, which the gate compares there.
        let tiny = GradReference {
            max_flops: 1.0,
            max_whole_flops: 0.0,
        };
        assert!(tiny.name(&spec).contains("sampled"), "{}", tiny.name(&spec));
        let ReferenceOutputs::Gradients(s) = tiny.compute(&spec, &inputs).unwrap() else {
            panic!()
        };
        assert!(crate::grad::gate(&g, &exact, &s, "sampled").passed);
    }

    /// MoE and varlen configs above the whole-config budget are checked on samples.
    #[test]
    fn unsliceable_configs_above_the_budget_are_sampled() {
        let m = flashmoe::MoeProblem {
            tokens: 8,
            hidden: 16,
            intermediate: 8,
            experts: 4,
            top_k: 2,
            scoring: flashmoe::Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        };
        let g = GradProblem::new(Pass::Bwd, GradLayer::Moe(m));
        let x = GradInputs::generate(&g, SuiteInputs::generate(&g.layer.forward(), 1), 1);
        let exact: Vec<GradTensor> = reference_f64(&g, &x)
            .unwrap()
            .iter()
            .map(GradTensor::from)
            .collect();
        let inputs = SuiteInputs::Grad(Box::new(x));
        let r = GradReference {
            max_flops: 0.0,
            max_whole_flops: 1.0,
        };
        let spec = ProblemSpec::Grad(g.clone());
        assert!(r.name(&spec).contains("sampled"), "{}", r.name(&spec));
        let ReferenceOutputs::Gradients(s) = r.compute(&spec, &inputs).unwrap() else {
            panic!()
        };
        assert_eq!(
            s.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            ["dx", "dw13", "dw2"]
        );
        assert!(crate::grad::gate(&g, &exact, &s, "sampled").passed);
        assert_eq!(GradReference::default().name(&spec), "cpu-f64");
        // Varlen above the budget: sampled sequences, which the gate compares there.
        let mut v = crate::varlen::VarlenProblem::new(&[], 2, 1, 32, true, DType::Bf16);
        v.seqlens = vec![(5, 5), (3, 7)];
        let gv = GradProblem::new(Pass::Bwd, GradLayer::Varlen(v));
        let xv = GradInputs::generate(&gv, SuiteInputs::generate(&gv.layer.forward(), 2), 2);
        let exact: Vec<GradTensor> = reference_f64(&gv, &xv)
            .unwrap()
            .iter()
            .map(GradTensor::from)
            .collect();
        let iv = SuiteInputs::Grad(Box::new(xv));
        let spec = ProblemSpec::Grad(gv.clone());
        assert!(r.name(&spec).contains("sequences"), "{}", r.name(&spec));
        let ReferenceOutputs::Gradients(s) = r.compute(&spec, &iv).unwrap() else {
            panic!()
        };
        assert!(crate::grad::gate(&gv, &exact, &s, "sampled").passed);
    }
}
