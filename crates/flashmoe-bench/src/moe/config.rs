//! The MoE suite's configs: the `quick`, `seed003`, `mixtral`, `qwen3-30b` and
//! `deepseek-v3` presets, the check matrix (CPU and GPU shapes) and the `[[moe]]` entry of
//! a TOML config file (`crate::config` dispatches to these). The problem type is the
//! library's [`MoeProblem`]; its CPU references are `flashmoe::reference::moe`'s.

use crate::results::ProblemSpec;
use crate::toml_fields::{bf16, OneOrMany};
use flashmoe::{DType, MoeProblem, Scoring};
use serde::Deserialize;

/// The configs of MoE preset `name` (one of `crate::config::MOE_PRESETS`); `gpu` selects
/// GPU-sized shapes for `quick`.
pub(crate) fn preset_table(name: &str, gpu: bool) -> Vec<ProblemSpec> {
    match (name, gpu) {
        ("quick", true) => moe(&[16, 2048], 4096, 11008, 32, 2, Scoring::Softmax),
        ("quick", false) => moe(&[16, 128, 512], 256, 512, 8, 2, Scoring::Softmax),
        ("seed003", _) => moe(
            &[16, 128, 2048, 16384, 32768],
            4096,
            11008,
            32,
            2,
            Scoring::Softmax,
        ),
        // Model shapes from decode to prefill; DeepSeek-V3 up to 8192 tokens (issue 5).
        ("mixtral", _) => moe(&[16, 128, 2048, 8192], 4096, 14336, 8, 2, Scoring::Softmax),
        ("qwen3-30b", _) => moe(&[16, 128, 2048, 8192], 2048, 768, 128, 8, Scoring::Softmax),
        ("deepseek-v3", _) => moe(&[16, 128, 2048, 8192], 7168, 2048, 256, 8, Scoring::Sigmoid),
        (other, _) => unreachable!("MoE preset {other} is listed but has no table"),
    }
}

fn moe(
    tokens: &[usize],
    hidden: usize,
    inter: usize,
    experts: usize,
    k: usize,
    scoring: Scoring,
) -> Vec<ProblemSpec> {
    tokens
        .iter()
        .map(|&t| {
            ProblemSpec::Moe(MoeProblem {
                tokens: t,
                hidden,
                intermediate: inter,
                experts,
                top_k: k,
                scoring,
                renormalize: true,
                dtype: DType::Bf16,
                shared_expert: false,
            })
        })
        .collect()
}

/// Shapes for `flashmoe check --suite moe` against the CPU f64 reference. `quick` keeps
/// fewer token counts.
pub(crate) fn check_matrix(quick: bool) -> Vec<ProblemSpec> {
    let mut v = Vec::new();
    // T·k < E at 1 and 7 tokens (k ≤ 2): some experts get no token.
    let tokens: &[usize] = if quick { &[7, 128] } else { &[1, 7, 128, 2048] };
    for &t in tokens {
        for k in [1usize, 2, 8] {
            for scoring in [Scoring::Softmax, Scoring::Sigmoid] {
                v.push(ProblemSpec::Moe(MoeProblem {
                    tokens: t,
                    hidden: 128,
                    intermediate: 96,
                    experts: 16,
                    top_k: k,
                    scoring,
                    renormalize: k > 1,
                    dtype: DType::Bf16,
                    shared_expert: t == 7,
                }));
            }
        }
    }
    v
}

/// MoE shapes the GPU check adds, above the CPU f64 reference's size (checked against the
/// GPU fp32 reference, which the small shapes validate against the CPU f64 reference):
/// model-like widths at 2048 tokens, 128 and 256 experts with top-8, sigmoid scoring
/// with a shared expert, and a seed003-like top-2 shape with 32 experts.
pub fn moe_gpu_check_shapes(quick: bool) -> Vec<ProblemSpec> {
    let p = |t, h, i, e, k, scoring, shared| {
        ProblemSpec::Moe(MoeProblem {
            tokens: t,
            hidden: h,
            intermediate: i,
            experts: e,
            top_k: k,
            scoring,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: shared,
        })
    };
    let mut v = vec![p(2048, 2048, 768, 128, 8, Scoring::Softmax, false)];
    if !quick {
        v.push(p(2048, 1024, 512, 256, 8, Scoring::Sigmoid, true));
        v.push(p(2048, 4096, 1408, 32, 2, Scoring::Softmax, false));
    }
    v
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeEntry {
    pub tokens: OneOrMany<usize>,
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    #[serde(default = "softmax")]
    pub scoring: String,
    #[serde(default = "yes")]
    pub renormalize: bool,
    #[serde(default = "bf16")]
    pub dtype: String,
    #[serde(default)]
    pub shared_expert: bool,
}

fn softmax() -> String {
    "softmax".into()
}
fn yes() -> bool {
    true
}

pub(crate) fn expand_moe(e: &MoeEntry, index: usize) -> anyhow::Result<Vec<ProblemSpec>> {
    let ctx = |what: &str| format!("[[moe]] entry {}: {what}", index + 1);
    let dtype: DType = e
        .dtype
        .parse()
        .map_err(|m: String| anyhow::anyhow!(ctx(&m)))?;
    let scoring: Scoring = e
        .scoring
        .parse()
        .map_err(|m: String| anyhow::anyhow!(ctx(&m)))?;
    e.tokens
        .values()
        .into_iter()
        .map(|tokens| {
            let p = MoeProblem {
                tokens,
                hidden: e.hidden,
                intermediate: e.intermediate,
                experts: e.experts,
                top_k: e.top_k,
                scoring,
                renormalize: e.renormalize,
                dtype,
                shared_expert: e.shared_expert,
            };
            p.validate()
                .map_err(|err| anyhow::anyhow!(ctx(&err.to_string())))?;
            Ok(ProblemSpec::Moe(p))
        })
        .collect()
}
