//! What the implementations of one config exchange with the pipeline: the inputs generated
//! once per config ([`SuiteInputs`], a gradient config's [`GradInputs`] among them), an
//! implementation's outputs ([`Outputs`], named gradients [`GradTensor`]) and the
//! high-precision reference's ([`ReferenceOutputs`], [`RefTensor`]). Plain data below the
//! runners and the families: it imports neither (their generation and checks live there:
//! `SuiteInputs::generate` in `runner`, `GradInputs::generate` in `grad`).

use flashmoe::reference::attention::{AttentionInputs, AttentionOutput};
use flashmoe::reference::moe::{MoeInputs, MoeOutput};

/// Inputs of one config, generated once and shared by every implementation. A decode
/// problem's inputs are those of its dense attention problem
/// ([`crate::decode::DecodeProblem::dense`]): implementations on a paged cache build it
/// from them. A varlen problem's are the packed tensors q `(total_q, Hq, D)`, k and v
/// `(total_k, Hkv, D)` ([`crate::varlen::VarlenProblem::packed`]). An MLA
/// problem's are q and the dense latent cache, `v` empty ([`crate::mla::generate_inputs`]).
pub enum SuiteInputs {
    Attention(AttentionInputs),
    Moe(MoeInputs),
    /// A gradient config's: the forward's inputs and the upstream gradient.
    Grad(Box<GradInputs>),
}

/// A gradient config's inputs: the forward's and the upstream gradient of its output
/// (attention and varlen: o's layout; MoE: (tokens, hidden)), rounded to the dtype.
pub struct GradInputs {
    pub forward: SuiteInputs,
    pub d_out: Vec<f32>,
}

impl GradInputs {
    pub fn attention(&self) -> anyhow::Result<&AttentionInputs> {
        match &self.forward {
            SuiteInputs::Attention(x) => Ok(x),
            _ => anyhow::bail!("gradient inputs: attention inputs expected"),
        }
    }

    pub fn moe(&self) -> anyhow::Result<&MoeInputs> {
        match &self.forward {
            SuiteInputs::Moe(x) => Ok(x),
            _ => anyhow::bail!("gradient inputs: MoE inputs expected"),
        }
    }
}

/// What an implementation computed, as f32 on the host, for the correctness gate.
pub enum Outputs {
    Attention {
        o: Vec<f32>,
        lse: Vec<f32>,
    },
    Moe {
        out: Vec<f32>,
        topk_ids: Option<Vec<u32>>,
        /// (aux loss, z-loss) when the implementation computes them.
        losses: Option<(f64, f64)>,
    },
    /// Named gradients (`crate::grad`).
    Gradients(Vec<GradTensor>),
}

/// The high-precision reference a config is checked against.
pub enum ReferenceOutputs {
    Attention(AttentionOutput<f64>),
    Moe(MoeOutput),
    /// The f64 gradients (`crate::grad::reference_f64`).
    Gradients(Vec<RefTensor>),
}

/// One gradient an implementation computed, f32 on the host, in its input's layout.
#[derive(Debug, Clone, PartialEq)]
pub struct GradTensor {
    pub name: String,
    pub values: Vec<f32>,
}

/// One gradient of the f64 reference: the whole tensor, or (`select`) the listed element
/// ranges of it, concatenated ([`crate::grad::GradReference`] above its size budget).
#[derive(Debug, Clone, PartialEq)]
pub struct RefTensor {
    pub name: String,
    pub values: Vec<f64>,
    /// `(offset, len)` ranges of the full tensor that `values` holds, in order; `None`:
    /// all of it.
    pub select: Option<Vec<(usize, usize)>>,
}

/// The reference's values as an implementation's output (f32): what `cpu-reference`
/// reports, and an exact answer in tests.
impl From<&RefTensor> for GradTensor {
    fn from(t: &RefTensor) -> GradTensor {
        GradTensor {
            name: t.name.clone(),
            values: t.values.iter().map(|&v| v as f32).collect(),
        }
    }
}

impl RefTensor {
    /// The elements of an implementation's full tensor that this reference covers.
    pub fn pick<'a>(&self, full: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
        match &self.select {
            None => std::borrow::Cow::Borrowed(full),
            Some(ranges) => std::borrow::Cow::Owned(
                ranges
                    .iter()
                    .flat_map(|&(at, n)| full.get(at..at + n).unwrap_or(&[]).iter().copied())
                    .collect(),
            ),
        }
    }
}
