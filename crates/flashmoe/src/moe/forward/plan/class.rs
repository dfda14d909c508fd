//! What a plan is built for ([`MoeClass`]) and the raw tensors of one call ([`MoeArgs`],
//! [`RoutingArgs`]), with the call's O(1) checks against the class.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{RawTensor, RawU32};
use crate::problem::{MoeProblem, Scoring};

/// What a plan is built for: everything about an MoE layer call except the token count,
/// which each call takes from `x` (1..=max_tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeClass {
    /// Storage of x, weights and out: bf16 or f16 (fp32 accumulation).
    pub dtype: DType,
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    /// Renormalise the k selected weights to sum 1.
    pub renormalize: bool,
    /// A shared expert (intermediate size `intermediate`) added to every token, weight 1.
    pub shared_expert: bool,
    /// Largest token count of a call (sizes the tables; the workspace is per call).
    pub max_tokens: usize,
}

impl MoeClass {
    /// The problem of one call of this class.
    pub fn problem(&self, tokens: usize) -> MoeProblem {
        MoeProblem {
            tokens,
            hidden: self.hidden,
            intermediate: self.intermediate,
            experts: self.experts,
            top_k: self.top_k,
            scoring: self.scoring,
            renormalize: self.renormalize,
            dtype: self.dtype,
            shared_expert: self.shared_expert,
        }
    }

    /// The checks of a call that need no GPU, O(1): every tensor of `a` against the class
    /// (rank, shape, dtype, alignment, contiguity; the shared expert's weights exactly when
    /// the class has one) and 1..=max_tokens tokens. Returns the token count; errors name
    /// the tensor and the rule.
    pub fn check_args(&self, a: &MoeArgs) -> Result<usize> {
        self.check_args_for(a, self.experts)
    }

    /// [`MoeClass::check_args`] with `w13` / `w2` holding `weight_experts` experts (an
    /// expert-parallel rank holds only its own).
    pub(crate) fn check_args_for(&self, a: &MoeArgs, weight_experts: usize) -> Result<usize> {
        let c = self;
        let (h, i, e, k, dt) = (c.hidden, c.intermediate, c.experts, c.top_k, c.dtype);
        if a.x.rank != 2 {
            return Err(Error::invalid(format!(
                "x must be 2-D [tokens, hidden] but has shape {:?}",
                a.x.shape()
            )));
        }
        let t = a.x.shape[0];
        if t == 0 || t > c.max_tokens {
            return Err(Error::invalid(format!(
                "x has {t} tokens but this MoE class takes 1..={} (MoeClass::max_tokens)",
                c.max_tokens
            )));
        }
        a.x.expect_contiguous("x", dt, &[t, h], 16)?;
        a.router.expect_contiguous("router", dt, &[h, e], 16)?;
        a.w13
            .expect_contiguous("w13", dt, &[weight_experts, h, 2 * i], 16)?;
        a.w2.expect_contiguous("w2", dt, &[weight_experts, i, h], 16)?;
        match (c.shared_expert, &a.shared_w13, &a.shared_w2) {
            (true, Some(w13), Some(w2)) => {
                w13.expect_contiguous("shared_w13", dt, &[h, 2 * i], 16)?;
                w2.expect_contiguous("shared_w2", dt, &[i, h], 16)?;
            }
            (false, None, None) => {}
            (true, _, _) => {
                return Err(Error::invalid(
                    "shared_w13 and shared_w2 are required: the plan's class has a shared expert",
                ))
            }
            (false, _, _) => {
                return Err(Error::invalid(
                    "shared_w13 / shared_w2 given but the plan's class has no shared expert",
                ))
            }
        }
        a.out.expect_contiguous("out", dt, &[t, h], 16)?;
        if let Some(gu) = &a.gate_up {
            gu.expect_contiguous("gate_up", dt, &[t * k, 2 * i], 16)?;
        }
        a.routing.topk_ids.expect("topk_ids", t * k)?;
        a.routing
            .topk_w
            .expect_contiguous("topk_w", DType::F32, &[t, k], 4)?;
        a.routing.counts.expect("counts", e)?;
        a.routing
            .losses
            .expect_contiguous("losses", DType::F32, &[2], 4)?;
        Ok(t)
    }

    /// The class of `p` with room for `max_tokens` tokens per call.
    pub fn of_problem(p: &MoeProblem, max_tokens: usize) -> MoeClass {
        MoeClass {
            dtype: p.dtype,
            hidden: p.hidden,
            intermediate: p.intermediate,
            experts: p.experts,
            top_k: p.top_k,
            scoring: p.scoring,
            renormalize: p.renormalize,
            shared_expert: p.shared_expert,
            max_tokens,
        }
    }
}

/// Where the router's results go (device memory, nothing is copied to the host).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoutingArgs {
    /// [T, k] expert ids, descending score (ties: lower index).
    pub topk_ids: RawU32,
    /// [T, k] f32 combine weights.
    pub topk_w: RawTensor,
    /// \[E\] slots routed to each expert (sums to T·k).
    pub counts: RawU32,
    /// \[2\] f32: (aux load-balancing loss, router z-loss).
    pub losses: RawTensor,
}

/// The tensors of one call, raw (layouts in the module doc; all contiguous).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeArgs {
    /// \[T, H\]; T = shape\[0\] is the call's token count.
    pub x: RawTensor,
    /// [H, E]
    pub router: RawTensor,
    /// [E, H, 2I] (gate | up)
    pub w13: RawTensor,
    /// [E, I, H]
    pub w2: RawTensor,
    /// [H, 2I], exactly when the class has a shared expert.
    pub shared_w13: Option<RawTensor>,
    /// [I, H], exactly when the class has a shared expert.
    pub shared_w2: Option<RawTensor>,
    /// [T, H]
    pub out: RawTensor,
    pub routing: RoutingArgs,
    /// [T·k, 2I] 16-bit, optional: the routed rows' gate/up pre-activations (gate | up),
    /// in the permuted row order of the routing the call writes, kept for the backward
    /// (`MoeBwdArgs::saved_gate_up`) so that it skips recomputing them. None: not written.
    pub gate_up: Option<RawTensor>,
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(crate) fn class(max_tokens: usize) -> MoeClass {
        MoeClass {
            dtype: DType::Bf16,
            hidden: 4096,
            intermediate: 14336,
            experts: 8,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            shared_expert: false,
            max_tokens,
        }
    }

    #[test]
    fn raw_u32_checks_name_the_array() {
        let ok = RawU32 { ptr: 256, len: 6 };
        ok.expect("topk_ids", 6).unwrap();
        let e = ok.expect("topk_ids", 8).unwrap_err().to_string();
        assert!(e.contains("topk_ids has 6"), "{e}");
        let e = RawU32 { ptr: 0, len: 6 }
            .expect("counts", 6)
            .unwrap_err()
            .to_string();
        assert!(e.contains("counts is a null"), "{e}");
        let e = RawU32 { ptr: 258, len: 6 }
            .expect("counts", 6)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4-byte aligned"), "{e}");
    }

    #[test]
    fn class_round_trips_a_problem() {
        let c = class(64);
        let p = c.problem(17);
        assert_eq!(p.tokens, 17);
        assert_eq!(MoeClass::of_problem(&p, 64), c);
    }
}
