//! The gradient suite's problem types: which pass, which layer, the MoE loss gradients and
//! router shapes. Named by the results model (`results::ProblemSpec::Grad`), so this file
//! imports nothing of the lab above the family problem types; the methods that need more
//! are in `grad/mod.rs`.

use crate::varlen::VarlenProblem;
use flashmoe::{AttentionProblem, DType, MoeProblem};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Which pass of a layer a config measures. `Fwd` is the forward suites' own configs (no
/// gradient problem); `Bwd` and `FwdBwd` make [`GradProblem`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Pass {
    #[serde(rename = "fwd")]
    Fwd,
    #[serde(rename = "bwd")]
    Bwd,
    #[serde(rename = "fwd+bwd")]
    FwdBwd,
}

impl Pass {
    /// The command-line spelling: fwd, bwd, fwd+bwd.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Fwd => "fwd",
            Pass::Bwd => "bwd",
            Pass::FwdBwd => "fwd+bwd",
        }
    }
    /// Whether the timed call includes the forward.
    pub fn includes_forward(self) -> bool {
        self != Pass::Bwd
    }
}

impl std::str::FromStr for Pass {
    type Err = String;
    fn from_str(s: &str) -> Result<Pass, String> {
        match s {
            "fwd" => Ok(Pass::Fwd),
            "bwd" => Ok(Pass::Bwd),
            "fwd+bwd" | "fwdbwd" => Ok(Pass::FwdBwd),
            _ => Err(format!("unknown pass '{s}': expected fwd, bwd or fwd+bwd")),
        }
    }
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The layer whose gradients a [`GradProblem`] takes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum GradLayer {
    Attention(AttentionProblem),
    Varlen(VarlenProblem),
    Moe(MoeProblem),
}

/// One backward (or forward + backward) config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GradProblem {
    /// `Bwd` or `FwdBwd`.
    pub pass: Pass,
    pub layer: GradLayer,
    /// MoE: the upstream gradient of the auxiliary load-balancing loss (0: not trained).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub d_aux: f64,
    /// MoE: the upstream gradient of the z-loss (0: not trained).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub d_z: f64,
    /// MoE: how the generated router weight is shaped ([`RouterShape`]).
    #[serde(default, skip_serializing_if = "RouterShape::is_random")]
    pub router: RouterShape,
}

/// MoE check cases the generator alone does not produce: the router weight (hidden,
/// experts) as generated, or transformed after generation (every implementation gets the
/// transformed bytes; the Python baselines, which generate their own, do not run them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouterShape {
    #[default]
    Random,
    /// Expert 2c+1's column is a copy of expert 2c's: every token ties within each pair
    /// (the top-k takes the lower index first).
    Tied,
    /// Expert 0's column scaled by 4: most tokens pick it (a skewed load).
    Skewed,
}

impl RouterShape {
    fn is_random(&self) -> bool {
        *self == RouterShape::Random
    }

    /// Apply the shape to a generated router weight (hidden, experts).
    pub fn apply(self, router: &mut [f32], experts: usize, dtype: DType) {
        for row in router.chunks_exact_mut(experts) {
            match self {
                RouterShape::Random => {}
                RouterShape::Tied => {
                    for c in (0..experts.saturating_sub(1)).step_by(2) {
                        row[c + 1] = row[c];
                    }
                }
                RouterShape::Skewed => row[0] = dtype.round(4.0 * row[0]),
            }
        }
    }
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}
