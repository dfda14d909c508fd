//! The MLA suite's configs: the `mla` preset, the check matrix and the `[[mla]]` entry of
//! a TOML config file (`crate::config` dispatches to these).

use super::{MlaProblem, MLA_PAGE_SIZE};
use crate::results::ProblemSpec;
use crate::toml_fields::OneOrMany;
use flashmoe::DType;
use serde::Deserialize;

/// The `mla` preset (issue 35), DeepSeek-V3 shapes (one latent head, 576/512, page 64,
/// bf16) on a GPU:
/// - memory-bound decode: B = 128 × cache 4k / 8k / 16k / 32k, Sq = 1, Hq = 128;
/// - small batches of long caches: B = 1, 2, 4, 8, 16 × 32k, Sq = 1 (split-KV);
/// - compute-bound speculative rows: Sq = 2 and 4 at B = 64 and 128, cache 4k;
/// - a TP-8 shard (Hq = 16): B = 128 × 8k at Sq = 1 and 4.
///
/// Without a GPU: the same families on shapes the CPU f64 reference runs in seconds
/// (B ≤ 8, caches ≤ 1k, Hq 16 besides one Hq = 128 row).
pub fn preset_table(gpu: bool) -> Vec<ProblemSpec> {
    let rows: &[(usize, usize, usize, usize)] = if gpu {
        // (B, Hq, Sq, Sk)
        &[
            (128, 128, 1, 4096),
            (128, 128, 1, 8192),
            (128, 128, 1, 16384),
            (128, 128, 1, 32768),
            (1, 128, 1, 32768),
            (2, 128, 1, 32768),
            (4, 128, 1, 32768),
            (8, 128, 1, 32768),
            (16, 128, 1, 32768),
            (64, 128, 2, 4096),
            (128, 128, 2, 4096),
            (64, 128, 4, 4096),
            (128, 128, 4, 4096),
            (128, 16, 1, 8192),
            (128, 16, 4, 8192),
        ]
    } else {
        &[
            (8, 16, 1, 256),
            (8, 16, 1, 1000),
            (1, 16, 1, 1024),
            (2, 128, 1, 512),
            (4, 16, 2, 256),
            (4, 16, 4, 256),
        ]
    };
    rows.iter()
        .map(|&(b, hq, sq, sk)| {
            ProblemSpec::Mla(MlaProblem::new(b, hq, sq, sk, MLA_PAGE_SIZE, DType::Bf16))
        })
        .collect()
}

/// The MLA check matrix, every config against the library's f64 reference on a shuffled
/// block table: 4 sequences of ragged lengths (Sq — the shortest a row allows —, page ± 1,
/// a prime) over Hq 16 / 128 × Sq 1..4 × pages 64 / 16 × bf16 / f16; one config with a
/// non-default scale; a long ragged pair (4099 and 1000 keys) the heuristic splits many
/// ways (Hq 128 Sq 1; the full matrix adds Hq 16 Sq 4 f16). `quick` keeps one of each
/// kind.
pub fn check_matrix(quick: bool) -> Vec<ProblemSpec> {
    let mk = |hq: usize, sq: usize, page: usize, dtype: DType, lens: &[usize]| {
        let mut p = MlaProblem::new(lens.len(), hq, sq, *lens.iter().max().unwrap(), page, dtype);
        p.seqlens_k = lens.to_vec();
        p
    };
    let ragged = |sq: usize, page: usize| [sq, page - 1, page + 1, 389];
    let mut v = Vec::new();
    let cases: Vec<(usize, usize, usize, DType)> = if quick {
        vec![
            (128, 1, 64, DType::Bf16),
            (16, 4, 64, DType::F16),
            (128, 2, 16, DType::Bf16),
        ]
    } else {
        let mut c = Vec::new();
        for dtype in [DType::Bf16, DType::F16] {
            for hq in [16, 128] {
                for sq in 1..=4 {
                    for page in [64, 16] {
                        c.push((hq, sq, page, dtype));
                    }
                }
            }
        }
        c
    };
    for (hq, sq, page, dtype) in cases {
        v.push(mk(hq, sq, page, dtype, &ragged(sq, page)));
    }
    let mut scaled = mk(128, 3, 64, DType::Bf16, &ragged(3, 64));
    scaled.softmax_scale = 0.135;
    v.push(scaled);
    v.push(mk(128, 1, 64, DType::Bf16, &[4099, 1000]));
    if !quick {
        v.push(mk(16, 4, 64, DType::F16, &[4099, 1000]));
    }
    v.into_iter().map(ProblemSpec::Mla).collect()
}

/// A `[[mla]]` entry: one config per (batch, seqlen_q, seqlen_k) value.
///
/// ```toml
/// [[mla]]
/// batch = [1, 128]
/// heads_q = 128        # default 128 (16: a TP-8 shard)
/// seqlen_q = [1, 4]    # default 1
/// seqlen_k = 8192
/// page_size = 64       # default 64
/// dtype = "bf16"
/// softmax_scale = 0.1352   # default 1/sqrt(192)
/// ```
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaEntry {
    pub batch: OneOrMany<usize>,
    #[serde(default = "hq128")]
    pub heads_q: usize,
    #[serde(default = "sq1")]
    pub seqlen_q: OneOrMany<usize>,
    pub seqlen_k: OneOrMany<usize>,
    #[serde(default = "page64")]
    pub page_size: usize,
    #[serde(default = "bf16")]
    pub dtype: String,
    pub softmax_scale: Option<f32>,
}

fn hq128() -> usize {
    128
}
fn sq1() -> OneOrMany<usize> {
    OneOrMany::One(1)
}
fn page64() -> usize {
    MLA_PAGE_SIZE
}
fn bf16() -> String {
    "bf16".into()
}

/// The configs of entry `index` (0-based), each validated; errors name the entry.
pub fn expand_entry(e: &MlaEntry, index: usize) -> anyhow::Result<Vec<ProblemSpec>> {
    let ctx = |what: &str| format!("[[mla]] entry {}: {what}", index + 1);
    let dtype: DType = e
        .dtype
        .parse()
        .map_err(|m: String| anyhow::anyhow!(ctx(&m)))?;
    let mut v = Vec::new();
    for batch in e.batch.values() {
        for sq in e.seqlen_q.values() {
            for sk in e.seqlen_k.values() {
                let mut p = MlaProblem::new(batch, e.heads_q, sq, sk, e.page_size, dtype);
                if let Some(s) = e.softmax_scale {
                    p.softmax_scale = s;
                }
                p.validate()
                    .map_err(|err| anyhow::anyhow!(ctx(&err.to_string())))?;
                v.push(ProblemSpec::Mla(p));
            }
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{check_matrix as suite_matrix, parse_config, preset, Suite};

    fn mla(c: &ProblemSpec) -> &MlaProblem {
        match c {
            ProblemSpec::Mla(p) => p,
            _ => panic!("non-MLA config"),
        }
    }

    #[test]
    fn preset_has_the_issue_shapes() {
        let g = preset(Suite::Mla, "mla", true).unwrap();
        let ps: Vec<&MlaProblem> = g.iter().map(mla).collect();
        for p in &ps {
            p.validate().unwrap();
            assert_eq!((p.page_size, p.dtype), (64, DType::Bf16));
        }
        let has = |b, hq, sq, sk| {
            ps.iter()
                .any(|p| (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k) == (b, hq, sq, sk))
        };
        for sk in [4096, 8192, 16384, 32768] {
            assert!(has(128, 128, 1, sk), "B=128 Sk={sk}");
        }
        for b in [1, 2, 4, 8, 16] {
            assert!(has(b, 128, 1, 32768), "B={b} 32k");
        }
        for (b, sq) in [(64, 2), (128, 2), (64, 4), (128, 4)] {
            assert!(has(b, 128, sq, 4096), "B={b} Sq={sq}");
        }
        assert!(ps.iter().any(|p| p.heads_q == 16));
        // The CPU preset: same structure, small enough for the f64 reference.
        for c in preset(Suite::Mla, "mla", false).unwrap() {
            let p = mla(&c);
            p.validate().unwrap();
            assert!(p.flops() < 2e9, "{p}");
        }
        assert_eq!(Suite::Mla.default_preset(), "mla");
        assert!(preset(Suite::Mla, "decode", true)
            .unwrap_err()
            .to_string()
            .contains("unknown mla preset"));
    }

    #[test]
    fn check_matrix_covers_the_issue() {
        for quick in [true, false] {
            let m = suite_matrix(Suite::Mla, quick, &[]);
            let ps: Vec<&MlaProblem> = m.iter().map(mla).collect();
            let mut ids = std::collections::HashSet::new();
            for p in &ps {
                p.validate().unwrap();
                assert!(ids.insert(p.id()), "duplicate {}", p.id());
                // The f64 reference runs every config in well under a few seconds.
                assert!(p.flops() < 3e9, "{p}");
            }
            let has = |f: &dyn Fn(&MlaProblem) -> bool| ps.iter().any(|p| f(p));
            for sq in [1, 4] {
                assert!(has(&|p| p.seqlen_q == sq), "Sq {sq}");
            }
            for hq in [16, 128] {
                assert!(has(&|p| p.heads_q == hq), "Hq {hq}");
            }
            for dt in [DType::Bf16, DType::F16] {
                assert!(has(&|p| p.dtype == dt), "{dt}");
            }
            assert!(has(&|p| p.seqlens_k.contains(&p.seqlen_q)), "Sq keys");
            assert!(has(&|p| p.seqlens_k.contains(&65)), "page + 1");
            assert!(has(&|p| p.page_size == 16));
            assert!(has(&|p| p.seqlen_k > 4096), "split many ways");
            assert!(has(&|p| p.softmax_scale != crate::mla::deepseek_scale()));
            if quick {
                assert!(m.len() <= 6, "quick stays small: {}", m.len());
            } else {
                for sq in 1..=4 {
                    for hq in [16, 128] {
                        for dt in [DType::Bf16, DType::F16] {
                            assert!(has(&|p| (p.seqlen_q, p.heads_q, p.dtype) == (sq, hq, dt)));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn config_file_expands_and_validates() {
        let text = r#"
[[mla]]
batch = [1, 128]
seqlen_q = [1, 4]
seqlen_k = 8192

[[mla]]
batch = 4
heads_q = 16
seqlen_k = [100, 200]
page_size = 16
dtype = "f16"
softmax_scale = 0.25
"#;
        let v = parse_config(text, Suite::Mla).unwrap();
        assert_eq!(v.len(), 6);
        let p = mla(&v[3]);
        assert_eq!(
            (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k),
            (128, 128, 4, 8192)
        );
        assert_eq!((p.page_size, p.dtype), (64, DType::Bf16));
        let p = mla(&v[5]);
        assert_eq!(
            (p.heads_q, p.seqlen_k, p.page_size, p.dtype, p.softmax_scale),
            (16, 200, 16, DType::F16, 0.25)
        );
        let err = |t: &str| format!("{:#}", parse_config(t, Suite::Mla).unwrap_err());
        let e = err(&text.replace("page_size = 16", "page_size = 20"));
        assert!(
            e.contains("[[mla]] entry 2") && e.contains("page_size 20"),
            "{e}"
        );
        let e = err(&text.replace("seqlen_q = [1, 4]", "seqlen_q = 17"));
        assert!(e.contains("entry 1") && e.contains("seqlen_q 17"), "{e}");
        let e = err(&text.replace("dtype = \"f16\"", "dtype = \"f32\""));
        assert!(e.contains("entry 2") && e.contains("f32"), "{e}");
        assert!(err("[[mla]]\nbatch = 1\nseqlen_k = 64\nhead_dim = 576\n").contains("head_dim"));
        assert!(parse_config(text, Suite::Decode).is_err());
    }
}
