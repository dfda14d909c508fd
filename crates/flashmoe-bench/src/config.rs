//! Which configs a run measures: named presets and TOML config files.
//!
//! GPU presets use the shapes of the issues (16k tokens / model dim 2048 sweep, the
//! seed configurations, the MoE model shapes). On a machine without a GPU the `quick` and
//! `sweep` presets use scaled-down shapes of the same structure so the whole pipeline runs
//! in seconds; the seed and model presets keep their real shapes.

use crate::results::ProblemSpec;
use anyhow::{bail, Context};
use flashmoe::{AttentionProblem, DType, MoeProblem, Scoring};
use serde::Deserialize;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    Attention,
    Moe,
}

impl Suite {
    pub fn name(self) -> &'static str {
        match self {
            Suite::Attention => "attention",
            Suite::Moe => "moe",
        }
    }
}

pub const ATTENTION_PRESETS: &[&str] = &["quick", "sweep", "seed002", "seed003"];
pub const MOE_PRESETS: &[&str] = &["quick", "seed003", "mixtral", "qwen3-30b", "deepseek-v3"];

/// The FlashAttention benchmark sweep: a fixed token budget and model dim, so batch and
/// heads shrink as sequence length and head dim grow.
fn token_sweep(
    tokens: usize,
    model_dim: usize,
    head_dims: &[usize],
    seqlens: &[usize],
    dtype: DType,
) -> Vec<ProblemSpec> {
    let mut v = Vec::new();
    for &d in head_dims {
        for causal in [false, true] {
            for &s in seqlens {
                let b = (tokens / s).max(1);
                v.push(ProblemSpec::Attention(AttentionProblem::new(
                    b,
                    model_dim / d,
                    s,
                    d,
                    causal,
                    dtype,
                )));
            }
        }
    }
    v
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

/// The configs of a named preset. `gpu` selects GPU-sized shapes for `quick`/`sweep`.
pub fn preset(suite: Suite, name: &str, gpu: bool) -> anyhow::Result<Vec<ProblemSpec>> {
    use DType::*;
    let attn = |b, h, s, d, causal, dt| {
        ProblemSpec::Attention(AttentionProblem::new(b, h, s, d, causal, dt))
    };
    Ok(match (suite, name, gpu) {
        (Suite::Attention, "quick", true) => vec![
            attn(16, 16, 1024, 128, false, Bf16),
            attn(4, 16, 4096, 128, false, Bf16),
            attn(4, 16, 4096, 128, true, Bf16),
            attn(8, 32, 2048, 64, false, Bf16),
            attn(8, 32, 2048, 64, true, Bf16),
        ],
        (Suite::Attention, "quick", false) => vec![
            attn(8, 4, 128, 64, false, Bf16),
            attn(4, 4, 256, 64, false, Bf16),
            attn(4, 4, 256, 64, true, Bf16),
            attn(2, 4, 512, 64, false, Bf16),
            attn(4, 2, 256, 128, false, F16),
        ],
        (Suite::Attention, "sweep", true) => token_sweep(
            16384,
            2048,
            &[64, 128],
            &[512, 1024, 2048, 4096, 8192, 16384],
            Bf16,
        ),
        (Suite::Attention, "sweep", false) => {
            token_sweep(2048, 256, &[64, 128], &[128, 256, 512, 1024, 2048], Bf16)
        }
        (Suite::Attention, "seed002", _) => vec![
            attn(32, 8, 512, 64, false, F16),
            attn(32, 8, 512, 64, true, F16),
        ],
        (Suite::Attention, "seed003", _) => vec![
            attn(16, 16, 2048, 64, false, F16),
            attn(16, 16, 2048, 64, true, F16),
            attn(32, 32, 4096, 128, false, F16),
            attn(32, 32, 4096, 128, true, F16),
        ],
        (Suite::Moe, "quick", true) => moe(&[16, 2048], 4096, 11008, 32, 2, Scoring::Softmax),
        (Suite::Moe, "quick", false) => moe(&[16, 128, 512], 256, 512, 8, 2, Scoring::Softmax),
        (Suite::Moe, "seed003", _) => moe(
            &[16, 128, 2048, 16384, 32768],
            4096,
            11008,
            32,
            2,
            Scoring::Softmax,
        ),
        // Model shapes from decode to prefill; DeepSeek-V3 up to 8192 tokens (issue 5).
        (Suite::Moe, "mixtral", _) => {
            moe(&[16, 128, 2048, 8192], 4096, 14336, 8, 2, Scoring::Softmax)
        }
        (Suite::Moe, "qwen3-30b", _) => {
            moe(&[16, 128, 2048, 8192], 2048, 768, 128, 8, Scoring::Softmax)
        }
        (Suite::Moe, "deepseek-v3", _) => {
            moe(&[16, 128, 2048, 8192], 7168, 2048, 256, 8, Scoring::Sigmoid)
        }
        (suite, other, _) => {
            let names = match suite {
                Suite::Attention => ATTENTION_PRESETS,
                Suite::Moe => MOE_PRESETS,
            };
            bail!(
                "unknown {} preset '{other}': choose one of {}",
                suite.name(),
                names.join(", ")
            )
        }
    })
}

/// Shapes for `flashmoe check`: every feature on small sizes (all run against the CPU f64
/// reference). `quick` keeps one representative per feature.
pub fn check_matrix(suite: Suite, quick: bool, seqlens: &[(usize, usize)]) -> Vec<ProblemSpec> {
    let mut v = Vec::new();
    match suite {
        Suite::Attention => {
            let dtypes = [DType::Bf16, DType::F16];
            let dims: &[usize] = if quick {
                &[64, 128]
            } else {
                &[32, 64, 96, 128, 256]
            };
            let gqa: &[usize] = if quick { &[1, 4] } else { &[1, 4, 8] };
            for &dtype in &dtypes {
                for &d in dims {
                    for causal in [false, true] {
                        for &g in gqa {
                            for &(sq, sk) in seqlens {
                                v.push(ProblemSpec::Attention(AttentionProblem {
                                    batch: 1,
                                    heads_q: 8,
                                    heads_kv: 8 / g,
                                    seqlen_q: sq,
                                    seqlen_k: sk,
                                    head_dim: d,
                                    causal,
                                    dtype,
                                    softmax_scale: None,
                                }));
                            }
                        }
                    }
                }
            }
        }
        Suite::Moe => {
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

/// Sequence-length pairs the CPU check covers: tiny, ragged, and Sq ≠ Sk both ways.
pub const CPU_CHECK_SEQLENS: &[(usize, usize)] =
    &[(1, 1), (17, 17), (128, 128), (100, 37), (37, 100)];
/// The GPU check adds long and ragged lengths (checked against the GPU fp32 reference
/// where the CPU f64 reference would be too slow).
pub const GPU_CHECK_SEQLENS: &[(usize, usize)] = &[
    (1, 1),
    (17, 17),
    (128, 128),
    (1000, 1000),
    (4097, 4097),
    (1, 4097),
    (1000, 4097),
    (4097, 1000),
];
pub const GPU_CHECK_SEQLENS_QUICK: &[(usize, usize)] = &[
    (17, 17),
    (1000, 1000),
    (128, 1000),
    (1000, 128),
    (4097, 4097),
];
pub const CPU_CHECK_SEQLENS_QUICK: &[(usize, usize)] = &[(17, 17), (100, 37), (37, 100)];

// ---- TOML config files ----

/// A config file: a list of attention and/or MoE problems.
///
/// ```toml
/// [[attention]]
/// batch = 4
/// heads = 16          # or heads_q / heads_kv for GQA
/// seqlen = 4096       # or seqlen_q / seqlen_k
/// head_dim = 128
/// causal = [false, true]   # a bool or a list: one config per value
/// dtype = "bf16"
///
/// [[moe]]
/// tokens = [16, 2048]
/// hidden = 4096
/// intermediate = 11008
/// experts = 32
/// top_k = 2
/// ```
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    #[serde(default)]
    pub attention: Vec<AttentionEntry>,
    #[serde(default)]
    pub moe: Vec<MoeEntry>,
}

/// A value or a list of values (each value gives one config).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    fn values(&self) -> Vec<T> {
        match self {
            OneOrMany::One(v) => vec![v.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionEntry {
    pub batch: OneOrMany<usize>,
    pub heads: Option<usize>,
    pub heads_q: Option<usize>,
    pub heads_kv: Option<usize>,
    pub seqlen: Option<OneOrMany<usize>>,
    pub seqlen_q: Option<usize>,
    pub seqlen_k: Option<usize>,
    pub head_dim: OneOrMany<usize>,
    #[serde(default = "no")]
    pub causal: OneOrMany<bool>,
    #[serde(default = "bf16")]
    pub dtype: String,
    pub softmax_scale: Option<f32>,
}

fn no() -> OneOrMany<bool> {
    OneOrMany::One(false)
}
fn bf16() -> String {
    "bf16".into()
}
fn softmax() -> String {
    "softmax".into()
}
fn yes() -> bool {
    true
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

fn expand_attention(e: &AttentionEntry, index: usize) -> anyhow::Result<Vec<ProblemSpec>> {
    let ctx = |what: &str| format!("[[attention]] entry {}: {what}", index + 1);
    let dtype: DType = e
        .dtype
        .parse()
        .map_err(|m: String| anyhow::anyhow!(ctx(&m)))?;
    let heads_q = e
        .heads_q
        .or(e.heads)
        .with_context(|| ctx("needs `heads` or `heads_q`"))?;
    let heads_kv = e.heads_kv.unwrap_or(heads_q);
    let seqlens: Vec<(usize, usize)> = match (&e.seqlen, e.seqlen_q, e.seqlen_k) {
        (Some(s), None, None) => s.values().into_iter().map(|s| (s, s)).collect(),
        (None, Some(q), Some(k)) => vec![(q, k)],
        _ => bail!(ctx(
            "give either `seqlen` or both `seqlen_q` and `seqlen_k`"
        )),
    };
    let mut v = Vec::new();
    for batch in e.batch.values() {
        for d in e.head_dim.values() {
            for causal in e.causal.values() {
                for &(sq, sk) in &seqlens {
                    let p = AttentionProblem {
                        batch,
                        heads_q,
                        heads_kv,
                        seqlen_q: sq,
                        seqlen_k: sk,
                        head_dim: d,
                        causal,
                        dtype,
                        softmax_scale: e.softmax_scale,
                    };
                    p.validate()
                        .map_err(|err| anyhow::anyhow!(ctx(&err.to_string())))?;
                    v.push(ProblemSpec::Attention(p));
                }
            }
        }
    }
    Ok(v)
}

fn expand_moe(e: &MoeEntry, index: usize) -> anyhow::Result<Vec<ProblemSpec>> {
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

/// Parse a config file's text into the configs of `suite`.
pub fn parse_config(text: &str, suite: Suite) -> anyhow::Result<Vec<ProblemSpec>> {
    let file: ConfigFile = toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let configs: Vec<ProblemSpec> = match suite {
        Suite::Attention => file
            .attention
            .iter()
            .enumerate()
            .map(|(i, e)| expand_attention(e, i))
            .collect::<anyhow::Result<Vec<_>>>()?
            .concat(),
        Suite::Moe => file
            .moe
            .iter()
            .enumerate()
            .map(|(i, e)| expand_moe(e, i))
            .collect::<anyhow::Result<Vec<_>>>()?
            .concat(),
    };
    if configs.is_empty() {
        bail!("no [[{}]] entries in the config file", suite.name());
    }
    Ok(configs)
}

pub fn load_config(path: &Path, suite: Suite) -> anyhow::Result<Vec<ProblemSpec>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    parse_config(&text, suite).with_context(|| format!("invalid config file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_sweep_matches_the_standard_sweep() {
        let v = preset(Suite::Attention, "sweep", true).unwrap();
        assert_eq!(v.len(), 24);
        for c in &v {
            let ProblemSpec::Attention(p) = c else {
                panic!()
            };
            assert_eq!(p.batch * p.seqlen_q, 16384);
            assert_eq!(p.heads_q * p.head_dim, 2048);
        }
    }

    #[test]
    fn unknown_preset_lists_the_choices() {
        let e = preset(Suite::Moe, "nope", false).unwrap_err().to_string();
        assert!(e.contains("nope") && e.contains("mixtral"), "{e}");
    }

    #[test]
    fn config_file_expands_lists_and_validates() {
        let text = r#"
[[attention]]
batch = 2
heads_q = 8
heads_kv = 2
seqlen = [128, 256]
head_dim = 64
causal = [false, true]
dtype = "f16"
"#;
        let v = parse_config(text, Suite::Attention).unwrap();
        assert_eq!(v.len(), 4);
        let bad = text.replace("heads_kv = 2", "heads_kv = 3");
        let e = format!("{:#}", parse_config(&bad, Suite::Attention).unwrap_err());
        assert!(e.contains("entry 1") && e.contains("heads_kv (3)"), "{e}");
        let typo = text.replace("head_dim", "headdim");
        assert!(parse_config(&typo, Suite::Attention).is_err());
        let dt = text.replace("f16", "int4");
        assert!(format!("{:#}", parse_config(&dt, Suite::Attention).unwrap_err()).contains("int4"));
        assert!(parse_config(text, Suite::Moe)
            .unwrap_err()
            .to_string()
            .contains("[[moe]]"));
    }

    #[test]
    fn moe_check_matrix_covers_the_issue() {
        let m: Vec<MoeProblem> = check_matrix(Suite::Moe, false, &[])
            .into_iter()
            .map(|c| match c {
                ProblemSpec::Moe(p) => p,
                _ => panic!("attention config in the MoE matrix"),
            })
            .collect();
        for t in [1, 7, 128, 2048] {
            for k in [1, 2, 8] {
                assert!(
                    m.iter().any(|p| p.tokens == t && p.top_k == k),
                    "t={t} k={k}"
                );
            }
        }
        // Fewer routed slots than experts: at least one expert gets no token.
        assert!(m.iter().any(|p| p.tokens * p.top_k < p.experts));
        assert!(m.iter().any(|p| p.shared_expert));
        assert!(m.iter().any(|p| p.scoring == Scoring::Sigmoid));
        // The GPU shapes are above the CPU reference's size (so they use the GPU one).
        for c in moe_gpu_check_shapes(false) {
            let ProblemSpec::Moe(p) = c else { panic!() };
            p.validate().unwrap();
            assert!(p.flops() > 5e9, "{p}");
        }
    }

    #[test]
    fn moe_model_presets_have_the_issue_shapes() {
        let shape = |name: &str| -> Vec<MoeProblem> {
            preset(Suite::Moe, name, true)
                .unwrap()
                .into_iter()
                .map(|c| match c {
                    ProblemSpec::Moe(p) => p,
                    _ => panic!(),
                })
                .collect()
        };
        let tokens = |v: &[MoeProblem]| v.iter().map(|p| p.tokens).collect::<Vec<_>>();
        let s = shape("seed003");
        assert_eq!(tokens(&s), [16, 128, 2048, 16384, 32768]);
        assert!(s
            .iter()
            .all(|p| (p.hidden, p.intermediate, p.experts, p.top_k) == (4096, 11008, 32, 2)));
        for (name, h, i, e, k, scoring) in [
            ("mixtral", 4096, 14336, 8, 2, Scoring::Softmax),
            ("qwen3-30b", 2048, 768, 128, 8, Scoring::Softmax),
            ("deepseek-v3", 7168, 2048, 256, 8, Scoring::Sigmoid),
        ] {
            let v = shape(name);
            assert!(!v.is_empty(), "{name}");
            for p in &v {
                assert_eq!(
                    (p.hidden, p.intermediate, p.experts, p.top_k, p.scoring),
                    (h, i, e, k, scoring),
                    "{name}"
                );
                assert!(p.tokens <= 8192, "{name}");
            }
            assert_eq!(v.last().unwrap().tokens, 8192, "{name}");
        }
    }

    #[test]
    fn every_moe_preset_and_check_shape_has_kernels() {
        // The grouped-GEMM tiles (gemm_config) and launch geometry support every shape
        // a preset or the check can ask for: no config is "n/a" for flashmoe-moe.
        let mut all = check_matrix(Suite::Moe, false, &[]);
        all.extend(moe_gpu_check_shapes(false));
        for name in MOE_PRESETS {
            all.extend(preset(Suite::Moe, name, true).unwrap());
        }
        for c in &all {
            let ProblemSpec::Moe(p) = c else { panic!() };
            let k = flashmoe::moe::config::select(p).unwrap_or_else(|e| panic!("{p}: {e}"));
            flashmoe::moe::launch_configs(p, &k).unwrap_or_else(|e| panic!("{p}: {e}"));
        }
    }

    #[test]
    fn moe_config_rejects_top_k_above_experts() {
        let text = "[[moe]]\ntokens = 4\nhidden = 8\nintermediate = 8\nexperts = 2\ntop_k = 3\n";
        let e = format!("{:#}", parse_config(text, Suite::Moe).unwrap_err());
        assert!(e.contains("top_k (3)"), "{e}");
    }
}
