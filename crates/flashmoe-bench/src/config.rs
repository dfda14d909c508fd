//! Which configs a run measures: named presets and TOML config files.
//!
//! GPU presets use the shapes of the issues (16k tokens / model dim 2048 sweep, the
//! seed configurations, the MoE model shapes). On a machine without a GPU the `quick` and
//! `sweep` presets use scaled-down shapes of the same structure so the whole pipeline runs
//! in seconds; the seed and model presets keep their real shapes.

use crate::results::ProblemSpec;
use anyhow::{bail, Context};
use serde::Deserialize;
use std::path::Path;

use crate::attention::config::expand_attention;
pub use crate::attention::config::{
    AttentionEntry, CPU_CHECK_SEQLENS, CPU_CHECK_SEQLENS_QUICK, GPU_CHECK_SEQLENS,
    GPU_CHECK_SEQLENS_QUICK, WINDOW_CHECK_CASES,
};
use crate::decode::config::{decode_check_matrix, decode_table, expand_decode, paged_table};
pub use crate::decode::config::{DecodeEntry, DECODE_PAGE_SIZE};
use crate::moe::config::expand_moe;
pub use crate::moe::config::{moe_gpu_check_shapes, MoeEntry};
use crate::varlen::config::{expand_varlen, varlen_check_matrix, varlen_table};
pub use crate::varlen::config::{
    varlen_gpu_check_shapes, RandomLengths, VarlenEntry, VARLEN_CHECK_SEQLENS, VARLEN_SEED,
    VARLEN_WINDOW_CHECK_CASES,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    Attention,
    Moe,
    /// Paged-KV decode attention (one decode step per config).
    Decode,
    /// Packed prefill over sequences of unequal lengths (one varlen call per config).
    Varlen,
    /// DeepSeek MLA decode over a paged latent cache (`crate::mla`).
    Mla,
}

impl Suite {
    pub fn name(self) -> &'static str {
        match self {
            Suite::Attention => "attention",
            Suite::Moe => "moe",
            Suite::Decode => "decode",
            Suite::Varlen => "varlen",
            Suite::Mla => "mla",
        }
    }

    /// The presets of the suite (for `--preset`).
    pub fn presets(self) -> &'static [&'static str] {
        match self {
            Suite::Attention => ATTENTION_PRESETS,
            Suite::Moe => MOE_PRESETS,
            Suite::Decode => DECODE_PRESETS,
            Suite::Varlen => VARLEN_PRESETS,
            Suite::Mla => MLA_PRESETS,
        }
    }

    /// The preset `bench` runs when neither `--preset` nor `--config` is given.
    pub fn default_preset(self) -> &'static str {
        match self {
            Suite::Attention | Suite::Moe => "quick",
            Suite::Decode => "decode",
            Suite::Varlen => "varlen",
            Suite::Mla => "mla",
        }
    }
}

pub const ATTENTION_PRESETS: &[&str] = &["quick", "sweep", "seed002", "seed003", "window"];
pub const MOE_PRESETS: &[&str] = &["quick", "seed003", "mixtral", "qwen3-30b", "deepseek-v3"];
pub const DECODE_PRESETS: &[&str] = &["decode", "paged"];
pub const VARLEN_PRESETS: &[&str] = &["varlen"];
pub const MLA_PRESETS: &[&str] = &["mla"];

/// The configs of a named preset. `gpu` selects GPU-sized shapes for `quick`/`sweep`.
pub fn preset(suite: Suite, name: &str, gpu: bool) -> anyhow::Result<Vec<ProblemSpec>> {
    Ok(match (suite, name, gpu) {
        (Suite::Attention, name, gpu) if ATTENTION_PRESETS.contains(&name) => {
            crate::attention::config::preset_table(name, gpu)
        }
        (Suite::Moe, name, gpu) if MOE_PRESETS.contains(&name) => {
            crate::moe::config::preset_table(name, gpu)
        }
        (Suite::Decode, "decode", gpu) => decode_table(gpu),
        (Suite::Decode, "paged", gpu) => paged_table(gpu),
        (Suite::Varlen, "varlen", gpu) => varlen_table(gpu),
        (Suite::Mla, "mla", gpu) => crate::mla::config::preset_table(gpu),
        (suite, other, _) => bail!(
            "unknown {} preset '{other}': choose one of {}",
            suite.name(),
            suite.presets().join(", ")
        ),
    })
}

/// Shapes for `flashmoe check`: every feature on small sizes (all run against the CPU f64
/// reference). `quick` keeps one representative per feature.
pub fn check_matrix(suite: Suite, quick: bool, seqlens: &[(usize, usize)]) -> Vec<ProblemSpec> {
    let mut v = Vec::new();
    match suite {
        Suite::Attention => v.extend(crate::attention::config::check_matrix(quick, seqlens)),
        Suite::Moe => v.extend(crate::moe::config::check_matrix(quick)),
        Suite::Decode => v.extend(decode_check_matrix(quick)),
        Suite::Varlen => v.extend(varlen_check_matrix(quick)),
        Suite::Mla => v.extend(crate::mla::config::check_matrix(quick)),
    }
    v
}

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
///
/// [[varlen]]
/// seqlens = [985, 2886, 17]   # or seqlens_q / seqlens_k, or random = { count, min, max, seed }
/// heads = 16                  # or heads_q / heads_kv
/// head_dim = [64, 128]
/// causal = [false, true]
/// ```
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    #[serde(default)]
    pub attention: Vec<AttentionEntry>,
    #[serde(default)]
    pub moe: Vec<MoeEntry>,
    #[serde(default)]
    pub decode: Vec<DecodeEntry>,
    #[serde(default)]
    pub varlen: Vec<VarlenEntry>,
    #[serde(default)]
    pub mla: Vec<crate::mla::config::MlaEntry>,
}

pub use crate::toml_fields::OneOrMany;

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
        Suite::Decode => file
            .decode
            .iter()
            .enumerate()
            .map(|(i, e)| expand_decode(e, i))
            .collect::<anyhow::Result<Vec<_>>>()?
            .concat(),
        Suite::Varlen => file
            .varlen
            .iter()
            .enumerate()
            .map(|(i, e)| expand_varlen(e, i))
            .collect::<anyhow::Result<Vec<_>>>()?
            .concat(),
        Suite::Mla => file
            .mla
            .iter()
            .enumerate()
            .map(|(i, e)| crate::mla::config::expand_entry(e, i))
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
    use crate::decode::DecodeProblem;
    use crate::varlen::{random_lengths, VarlenProblem};
    use flashmoe::{DType, MoeProblem, Scoring};

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
        // The grouped-GEMM tiles (moe::gemm::tiles) and launch geometry support every shape
        // a preset or the check can ask for: no config is "n/a" for flashmoe-moe.
        let mut all = check_matrix(Suite::Moe, false, &[]);
        all.extend(moe_gpu_check_shapes(false));
        for name in MOE_PRESETS {
            all.extend(preset(Suite::Moe, name, true).unwrap());
        }
        for c in &all {
            let ProblemSpec::Moe(p) = c else { panic!() };
            let k =
                flashmoe::moe::forward::select::select(p).unwrap_or_else(|e| panic!("{p}: {e}"));
            flashmoe::moe::launch_configs(p, &k).unwrap_or_else(|e| panic!("{p}: {e}"));
        }
    }

    #[test]
    fn decode_config_file_and_check_matrix() {
        let text = r#"
[[decode]]
batch = [1, 8]
heads_q = 32
heads_kv = 8
seqlen_k = 4096
page_size = [16, 128]
"#;
        let v = parse_config(text, Suite::Decode).unwrap();
        assert_eq!(v.len(), 4);
        let ProblemSpec::Decode(p) = &v[3] else {
            panic!()
        };
        assert_eq!(
            (p.batch, p.page_size, p.seqlen_q, p.head_dim),
            (8, 128, 1, 128)
        );
        let bad = text.replace("page_size = [16, 128]", "page_size = 20");
        let e = format!("{:#}", parse_config(&bad, Suite::Decode).unwrap_err());
        assert!(
            e.contains("[[decode]] entry 1") && e.contains("page_size 20"),
            "{e}"
        );
        assert!(parse_config(text, Suite::Attention).is_err());
        for quick in [true, false] {
            let m = check_matrix(Suite::Decode, quick, &[]);
            assert!(!m.is_empty());
            let mut ids = std::collections::HashSet::new();
            for c in &m {
                let ProblemSpec::Decode(p) = c else { panic!() };
                p.validate().unwrap();
                p.class().validate().unwrap();
                assert!(ids.insert(p.id()), "duplicate config {}", p.id());
            }
            let ps: Vec<&DecodeProblem> = m
                .iter()
                .map(|c| match c {
                    ProblemSpec::Decode(p) => p,
                    _ => unreachable!(),
                })
                .collect();
            // What issue 22 asks the matrix to cover (quick keeps one of each kind).
            let has = |f: &dyn Fn(&DecodeProblem) -> bool| ps.iter().any(|p| f(p));
            assert!(has(&|p| p.heads_q / p.heads_kv == 7) && has(&|p| p.seqlen_q == 16));
            assert!(has(
                &|p| p.seqlens_k.contains(&1) && p.seqlens_k.contains(&17)
            ));
            assert!(has(&|p| p.softcap > 0.0) && has(&|p| p.window.0 >= 0));
            assert!(has(&|p| p.window.1 > 0) && has(&|p| !p.seqlens_q.is_empty()));
            assert!(has(&|p| p.is_plain()));
            if !quick {
                for g in [1, 2, 4, 7, 8, 16] {
                    assert!(has(&|p| p.heads_q / p.heads_kv == g), "GQA {g}");
                }
                for page in [16, 48, 128, 256] {
                    assert!(has(&|p| p.page_size == page), "page {page}");
                }
                assert!(has(&|p| p.seqlens_q.contains(&0)));
                assert!(has(&|p| p.dtype == DType::F16));
            } else {
                assert!(m.len() <= 12, "quick stays small: {}", m.len());
            }
        }
    }

    fn varlen_rows(gpu: bool) -> Vec<VarlenProblem> {
        preset(Suite::Varlen, "varlen", gpu)
            .unwrap()
            .into_iter()
            .map(|c| match c {
                ProblemSpec::Varlen(p) => p,
                _ => panic!("non-varlen config in the varlen preset"),
            })
            .collect()
    }

    #[test]
    fn varlen_preset_is_the_issue_target_and_its_families() {
        for gpu in [true, false] {
            let v = varlen_rows(gpu);
            assert_eq!(v.len(), 14, "gpu={gpu}");
            let mut ids = std::collections::HashSet::new();
            for p in &v {
                p.validate().unwrap();
                // Every shape has a varlen kernel (head dim 64 or 128, bf16).
                flashmoe::attention::varlen::varlen_variant(&p.class()).unwrap();
                assert_eq!(p.dtype, DType::Bf16);
                assert!(ids.insert(p.id()), "duplicate {}", p.id());
            }
            let (n, lo, hi) = if gpu { (16, 100, 4000) } else { (6, 10, 200) };
            let target = random_lengths(VARLEN_SEED, n, lo, hi);
            // 1. the ragged target, both dims, both masks, MHA.
            for (i, p) in v[..4].iter().enumerate() {
                assert_eq!(
                    p.seqlens,
                    target.iter().map(|&l| (l, l)).collect::<Vec<_>>()
                );
                assert_eq!((p.head_dim, p.causal), ([128, 64][i / 2], i % 2 == 1));
                assert_eq!(p.heads_q, p.heads_kv);
            }
            // 2. the dense problem on the same tokens: uniform, the dense comparison runs.
            for (p, t) in v[4..8].iter().zip(&v[..4]) {
                assert!(p.is_uniform() && p.dense().is_some() && p.batch() == n);
                assert!(p.total_q().abs_diff(t.total_q()) < n, "{p}");
                assert_eq!(
                    (p.head_dim, p.heads_q, p.causal),
                    (t.head_dim, t.heads_q, t.causal)
                );
            }
            // 3. chunked prefill: every sequence has more keys than queries, causal, GQA 4.
            for p in &v[8..10] {
                assert!(p.causal && p.heads_q == 4 * p.heads_kv);
                assert!(p.seqlens.iter().all(|&(q, k)| k > q && q > 0));
            }
            // 4. many short sequences.
            let short = if gpu { (64, 300) } else { (32, 40) };
            for p in &v[10..] {
                assert_eq!(p.batch(), short.0);
                assert!(p
                    .seqlens
                    .iter()
                    .all(|&(q, k)| q == k && (1..=short.1).contains(&q)));
            }
            if gpu {
                // Issue 22's numbers: 31 473 tokens, dense B = 16 S = 1967, model dim 2048.
                assert_eq!(v[0].total_q(), 31473);
                assert_eq!(v[4].seqlens[0], (1967, 1967));
                assert!(v.iter().all(|p| p.heads_q * p.head_dim == 2048));
            } else {
                // Small enough for the CPU f64 reference.
                assert!(v.iter().all(|p| p.flops() < 2e8), "CPU shapes too large");
            }
        }
        let e = preset(Suite::Varlen, "quick", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown varlen preset 'quick'") && e.contains("varlen"),
            "{e}"
        );
        assert_eq!(Suite::Varlen.default_preset(), "varlen");
        for s in [
            Suite::Attention,
            Suite::Moe,
            Suite::Decode,
            Suite::Varlen,
            Suite::Mla,
        ] {
            assert!(s.presets().contains(&s.default_preset()), "{}", s.name());
            for name in s.presets() {
                assert!(!preset(s, name, false).unwrap().is_empty(), "{name}");
            }
        }
    }

    #[test]
    fn varlen_check_matrix_covers_the_issue() {
        for quick in [true, false] {
            let m: Vec<VarlenProblem> = check_matrix(Suite::Varlen, quick, &[])
                .into_iter()
                .map(|c| match c {
                    ProblemSpec::Varlen(p) => p,
                    _ => panic!("non-varlen config in the varlen matrix"),
                })
                .collect();
            let mut ids = std::collections::HashSet::new();
            for p in &m {
                p.validate().unwrap();
                flashmoe::attention::varlen::varlen_variant(&p.class()).unwrap();
                assert!(ids.insert(p.id()), "duplicate config {}", p.id());
                // Every config is checked against the CPU f64 reference (GPU check too).
                assert!(p.flops() <= 5e9, "{p}");
            }
            let has = |f: &dyn Fn(&VarlenProblem) -> bool| m.iter().any(f);
            let len = |l: usize| move |p: &VarlenProblem| p.seqlens.iter().any(|s| s.0 == l);
            for l in [0, 1, 63, 64, 65, 127, 128, 129, 31, 37, 193, 257] {
                assert!(has(&len(l)), "length {l}");
            }
            let seq =
                |f: fn(&(usize, usize)) -> bool| move |p: &VarlenProblem| p.seqlens.iter().any(f);
            assert!(has(&seq(|&(q, k)| k > q && q > 0)), "Sk > Sq");
            assert!(has(&seq(|&(q, k)| k < q && k > 0)), "Sk < Sq");
            assert!(has(&seq(|&(q, k)| q == 0 && k > 0)), "no queries, keys");
            assert!(has(&seq(|&(q, k)| q > 0 && k == 0)), "queries, no keys");
            assert!(has(
                &|p| p.causal && p.seqlens.iter().any(|&(q, k)| k < q && k > 0)
            ));
            assert!(has(&|p| p.window.0 >= 0) && has(&|p| p.softcap > 0.0));
            assert!(has(&|p| p.softmax_scale.is_some()));
            assert!(
                has(&|p| p.seqlens.first() == Some(&(0, 0))),
                "leading empty sequence"
            );
            assert!(has(&|p| p.batch() >= 40), "many sequences");
            for d in [64, 128] {
                assert!(has(&|p| p.head_dim == d), "D={d}");
            }
            for g in [1, 4] {
                assert!(has(&|p| p.heads_q / p.heads_kv == g), "GQA {g}");
            }
            for dt in [DType::Bf16, DType::F16] {
                assert!(has(&|p| p.dtype == dt), "{dt}");
            }
            for causal in [false, true] {
                assert!(has(&|p| p.causal == causal));
            }
            if quick {
                assert!(m.len() <= 8, "quick stays small: {}", m.len());
            } else {
                for dt in [DType::Bf16, DType::F16] {
                    for d in [64, 128] {
                        for causal in [false, true] {
                            for g in [1, 4] {
                                assert!(has(&|p| p.dtype == dt
                                    && p.head_dim == d
                                    && p.causal == causal
                                    && p.heads_q / p.heads_kv == g
                                    && p.window == flashmoe::problem::NO_WINDOW
                                    && p.seqlens == VARLEN_CHECK_SEQLENS));
                            }
                        }
                    }
                }
                for (causal, window, softcap) in VARLEN_WINDOW_CHECK_CASES {
                    for d in [64, 128] {
                        assert!(has(&|p| (p.causal, p.window, p.softcap, p.head_dim)
                            == (causal, window, softcap, d)));
                    }
                }
            }
        }
        // The GPU check's extra shapes are above the CPU reference's size (GPU fp32
        // reference, sequence by sequence) and have a kernel.
        for quick in [true, false] {
            let g = varlen_gpu_check_shapes(quick);
            assert_eq!(g.len(), if quick { 1 } else { 3 });
            for c in g {
                let ProblemSpec::Varlen(p) = c else { panic!() };
                p.validate().unwrap();
                flashmoe::attention::varlen::varlen_variant(&p.class()).unwrap();
                assert!(p.flops() > 5e9, "{p}");
            }
        }
    }

    #[test]
    fn varlen_config_file_expands_and_validates() {
        let text = r#"
[[varlen]]
seqlens = [100, 37, 0, 4000]
heads = 16
head_dim = [64, 128]
causal = [false, true]

[[varlen]]
seqlens_q = [16, 1, 300]
seqlens_k = [2000, 1, 300]
heads_q = 32
heads_kv = 8
head_dim = 128
causal = true
dtype = "f16"
window = [1024, -1]
softcap = 30.0

[[varlen]]
random = { count = 16, min = 100, max = 4000 }
heads = 16
head_dim = 128
"#;
        let v = parse_config(text, Suite::Varlen).unwrap();
        assert_eq!(v.len(), 6);
        let p = |i: usize| match &v[i] {
            ProblemSpec::Varlen(p) => p.clone(),
            _ => panic!(),
        };
        assert_eq!(p(0).seqlens, [(100, 100), (37, 37), (0, 0), (4000, 4000)]);
        assert_eq!((p(3).head_dim, p(3).causal), (128, true));
        let c = p(4);
        assert_eq!(c.seqlens, [(16, 2000), (1, 1), (300, 300)]);
        assert_eq!((c.heads_q, c.heads_kv, c.dtype), (32, 8, DType::F16));
        assert_eq!((c.window, c.softcap), ((1024, -1), 30.0));
        // `random` defaults to issue 22's seed: the preset's lengths.
        assert_eq!(p(5).seqlens, varlen_rows(true)[0].seqlens);
        let err = |t: &str| format!("{:#}", parse_config(t, Suite::Varlen).unwrap_err());
        let e = err(&text.replace("seqlens_k = [2000, 1, 300]", "seqlens_k = [2000, 1]"));
        assert!(
            e.contains("[[varlen]] entry 2") && e.contains("seqlens_q has 3"),
            "{e}"
        );
        let e = err(&text.replace("heads_kv = 8", "heads_kv = 5"));
        assert!(e.contains("entry 2") && e.contains("heads_kv (5)"), "{e}");
        let e = err(&text.replace("min = 100", "min = 5000"));
        assert!(
            e.contains("entry 3") && e.contains("min 5000 is above max 4000"),
            "{e}"
        );
        let e = err(&text.replace("seqlens = [100, 37, 0, 4000]", "seqlens = [0, 0]"));
        assert!(e.contains("entry 1") && e.contains("total_q = 0"), "{e}");
        let e = err("[[varlen]]\nheads = 2\nhead_dim = 64\n");
        assert!(e.contains("exactly one of `seqlens`"), "{e}");
        let e = err("[[varlen]]\nseqlens = [4]\nrandom = { count = 2, min = 1, max = 9 }\nheads = 2\nhead_dim = 64\n");
        assert!(e.contains("exactly one of `seqlens`"), "{e}");
        assert!(parse_config(text, Suite::Attention)
            .unwrap_err()
            .to_string()
            .contains("[[attention]]"));
        assert!(parse_config(
            &text.replace("head_dim = 128\ncausal", "headdim = 128\ncausal"),
            Suite::Varlen
        )
        .is_err());
    }

    #[test]
    fn moe_config_rejects_top_k_above_experts() {
        let text = "[[moe]]\ntokens = 4\nhidden = 8\nintermediate = 8\nexperts = 2\ntop_k = 3\n";
        let e = format!("{:#}", parse_config(text, Suite::Moe).unwrap_err());
        assert!(e.contains("top_k (3)"), "{e}");
    }
}
