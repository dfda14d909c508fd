//! The decode suite's configs: the `decode` and `paged` presets, the check matrix and the
//! `[[decode]]` entry of a TOML config file (`crate::config` dispatches to these).

use super::DecodeProblem;
use crate::results::ProblemSpec;
use crate::toml_fields::{bf16, OneOrMany};
use flashmoe::DType;
use serde::Deserialize;

/// Page size of the decode preset's paged cache.
pub const DECODE_PAGE_SIZE: usize = 16;

/// The decode preset: issue 22's decode table (bf16, D = 128, causal, Sq = 1 but the last
/// row's 4, page 16), then issue 35's shape classes ([`class_rows`]) on a GPU; without one,
/// shapes of the same structure (the same GQA ratios, head dims and Sq, ragged last pages)
/// small enough for the CPU f64 reference.
pub(crate) fn decode_table(gpu: bool) -> Vec<ProblemSpec> {
    let issue22 = decode_rows(gpu)
        .iter()
        .map(|&(b, hq, hkv, sq, sk)| (b, hq, hkv, sq, sk, 128, DType::Bf16));
    issue22
        .chain(class_rows(gpu).iter().copied())
        .map(|(b, hq, hkv, sq, sk, d, dtype)| {
            ProblemSpec::Decode(DecodeProblem::new(
                b,
                hq,
                hkv,
                sq,
                sk,
                d,
                DECODE_PAGE_SIZE,
                dtype,
            ))
        })
        .collect()
}

/// (B, Hq, Hkv, Sq, Sk, D, dtype) of issue 35's decode classes, each where a shape class
/// differs from issue 22's table: one sequence of a long cache (the per-CTA prologue and
/// the split merge), very wide groups and MQA (16, 32 and 64 query heads on one KV head),
/// MHA, head dims 64 and 256, the largest batches, speculative and chunked rows (Sq 2, 8,
/// 16) and fp16.
fn class_rows(gpu: bool) -> &'static [(usize, usize, usize, usize, usize, usize, DType)] {
    use DType::{Bf16, F16};
    if gpu {
        &[
            (1, 32, 8, 1, 32768, 128, Bf16),
            (1, 32, 8, 1, 131072, 128, Bf16),
            (4, 32, 8, 1, 131072, 128, Bf16),
            (32, 32, 2, 1, 8192, 128, Bf16),
            (32, 32, 1, 1, 8192, 128, Bf16),
            (16, 64, 1, 1, 8192, 128, Bf16),
            (32, 32, 32, 1, 8192, 128, Bf16),
            (64, 32, 8, 1, 8192, 64, Bf16),
            (32, 16, 8, 1, 8192, 256, Bf16),
            (256, 32, 8, 1, 2048, 128, Bf16),
            (256, 32, 8, 1, 8192, 128, Bf16),
            (64, 32, 8, 2, 4096, 128, Bf16),
            (64, 32, 8, 8, 4096, 128, Bf16),
            (64, 32, 8, 16, 4096, 128, Bf16),
            (64, 32, 8, 1, 8192, 128, F16),
        ]
    } else {
        &[
            (1, 8, 2, 1, 2000, 128, Bf16),
            (4, 16, 1, 1, 300, 128, Bf16),
            (2, 32, 1, 1, 300, 128, Bf16),
            (4, 8, 8, 1, 300, 128, Bf16),
            (4, 8, 2, 1, 300, 64, Bf16),
            (2, 4, 2, 1, 300, 256, Bf16),
            (16, 8, 2, 1, 100, 128, Bf16),
            (4, 8, 2, 8, 300, 128, Bf16),
            (2, 8, 2, 16, 300, 128, Bf16),
            (4, 8, 2, 1, 300, 128, F16),
        ]
    }
}

/// The paged preset: each of issue 22's decode-table shapes at page 16, page 128 and one page of Sk keys
/// per sequence (the contiguous cache through the same kernel, the "dense" row: flashmoe
/// has no separate dense-cache decode path). Issue 22: pages cost at most 5% over dense.
pub(crate) fn paged_table(gpu: bool) -> Vec<ProblemSpec> {
    let mut v = Vec::new();
    for &(b, hq, hkv, sq, sk) in decode_rows(gpu) {
        // The CPU shapes' Sk need not be multiples of 16: round the "dense" page up.
        for page in [16, 128, sk.next_multiple_of(16)] {
            v.push(ProblemSpec::Decode(DecodeProblem::new(
                b,
                hq,
                hkv,
                sq,
                sk,
                128,
                page,
                DType::Bf16,
            )));
        }
    }
    v
}

/// (B, Hq, Hkv, Sq, Sk) of issue 22's decode table (see [`decode_table`]).
fn decode_rows(gpu: bool) -> &'static [(usize, usize, usize, usize, usize)] {
    if gpu {
        &[
            (1, 32, 8, 1, 8192),
            (8, 32, 8, 1, 4096),
            (64, 32, 8, 1, 8192),
            (128, 32, 8, 1, 2048),
            (16, 64, 8, 1, 32768),
            (32, 32, 32, 1, 4096),
            (64, 32, 8, 4, 4096),
        ]
    } else {
        &[
            (1, 8, 2, 1, 1024),
            (2, 8, 2, 1, 512),
            (4, 8, 2, 1, 1000),
            (8, 8, 2, 1, 256),
            (2, 16, 2, 1, 1024),
            (4, 8, 8, 1, 500),
            (4, 8, 2, 4, 500),
        ]
    }
}

/// The decode check matrix (issues 22 and 35): every config against the f64 paged reference
/// on a shuffled block table. Plain steps over GQA ratios 1/2/4/7/8/16 × Sq 1/4/16 × pages
/// 16/48/128/256 × bf16/f16 with ragged cache lengths (1 or Sq, page ± 1, primes); head
/// dims 64 and 256 and groups of 32 and 64 query heads on one KV head; windows
/// touching both ends of the keys (left past key 0, right past the last key, both), with
/// and without softcap; mixed batches (cu_seqlens_q: 0..16 rows a sequence); and one long
/// ragged batch that the heuristic splits many ways. `quick` keeps one of each kind.
pub(crate) fn decode_check_matrix(quick: bool) -> Vec<ProblemSpec> {
    let mut v = Vec::new();
    let mk = |b: usize,
              hq: usize,
              hkv: usize,
              sq: usize,
              page: usize,
              dtype: DType,
              lens_k: &[usize]| {
        let mut p = DecodeProblem::new(
            b,
            hq,
            hkv,
            sq,
            *lens_k.iter().max().unwrap(),
            128,
            page,
            dtype,
        );
        p.seqlens_k = lens_k.to_vec();
        p
    };
    // Ragged keys of 4 sequences: one key (or Sq: rows never exceed keys), page ± 1, a prime.
    let ragged = |sq: usize, page: usize| [sq.max(1), (page - 1).max(sq), page + 1, 389];
    // (Hq, Hkv): GQA ratios 1, 2, 4, 7, 8, 16.
    let gqa: &[(usize, usize)] = if quick {
        &[(8, 2), (14, 2)]
    } else {
        &[(8, 8), (8, 4), (8, 2), (14, 2), (8, 1), (16, 1)]
    };
    let sqs: &[usize] = if quick { &[1, 16] } else { &[1, 4, 16] };
    let pages: &[usize] = if quick { &[16] } else { &[16, 48, 128, 256] };
    let dtypes: &[DType] = if quick {
        &[DType::Bf16]
    } else {
        &[DType::Bf16, DType::F16]
    };
    for &dtype in dtypes {
        for &(hq, hkv) in gqa {
            for &sq in sqs {
                for &page in pages {
                    v.push(mk(4, hq, hkv, sq, page, dtype, &ragged(sq, page)));
                }
            }
        }
    }
    // Head dims 64 and 256 (issue 35's classes besides 128), and groups of 32 and 64
    // query heads on one KV head (MQA).
    let classes: &[(usize, usize, usize)] = if quick {
        &[(32, 1, 256)]
    } else {
        &[
            (8, 2, 64),
            (8, 2, 256),
            (16, 1, 256),
            (32, 1, 128),
            (64, 1, 64),
        ]
    };
    for &(hq, hkv, d) in classes {
        for &sq in if quick {
            &[1usize][..]
        } else {
            &[1usize, 4][..]
        } {
            let mut p = mk(4, hq, hkv, sq, 16, DType::Bf16, &ragged(sq, 16));
            p.head_dim = d;
            v.push(p);
        }
    }
    // Windows (left, right) touching key 0 and the last key, softcap 0 / 2 / 30.
    let windows: &[(i32, i32)] = if quick {
        &[(7, 0), (300, 3)]
    } else {
        &[
            (0, 0),
            (7, 0),
            (31, 2),
            (-1, 5),
            (300, 3),
            (64, 64),
            (-1, -1),
        ]
    };
    let softcaps: &[f32] = if quick {
        &[0.0, 30.0]
    } else {
        &[0.0, 2.0, 30.0]
    };
    for &window in windows {
        for &softcap in softcaps {
            for &sq in if quick {
                &[4usize][..]
            } else {
                &[1usize, 4, 16][..]
            } {
                let mut p = mk(4, 16, 4, sq, 16, DType::Bf16, &ragged(sq, 16));
                p.window = window;
                p.softcap = softcap;
                v.push(p);
            }
        }
    }
    // Mixed batches: decode (1 row), speculative (4-7) and chunked (16) rows, an empty one.
    let mixed: &[(&[usize], &[usize], usize, usize)] = &[
        // (rows per sequence, keys per sequence, Hq, Hkv)
        (&[1, 16, 4, 1, 7], &[1, 300, 17, 389, 64], 32, 8),
        (&[16, 0, 3, 1], &[16, 15, 257, 100], 14, 2),
        (&[2, 16, 1, 9], &[400, 16, 1, 47], 16, 1),
    ];
    for (i, &(lens_q, lens_k, hq, hkv)) in mixed.iter().enumerate() {
        if quick && i > 0 {
            break;
        }
        for &page in if quick {
            &[16usize][..]
        } else {
            &[16usize, 128][..]
        } {
            for (window, softcap) in [((-1, 0), 0.0), ((20, 0), 30.0)] {
                if quick && softcap > 0.0 {
                    continue;
                }
                let sq = *lens_q.iter().max().unwrap();
                let mut p = mk(lens_q.len(), hq, hkv, sq, page, DType::Bf16, lens_k);
                p.seqlens_q = lens_q.to_vec();
                p.window = window;
                p.softcap = softcap;
                v.push(p);
            }
        }
    }
    // A long batch the heuristic splits many ways (the fused split merge): uniform (the
    // plain step, which the tiled CPU algorithm also runs) and ragged.
    let mut plain = mk(2, 32, 8, 1, 16, DType::Bf16, &[4099, 4099]);
    plain.seqlens_k.clear();
    v.push(plain);
    for sq in if quick {
        &[1usize][..]
    } else {
        &[1usize, 4][..]
    } {
        v.push(mk(2, 32, 8, *sq, 16, DType::Bf16, &[4099, 1000]));
    }
    v.into_iter().map(ProblemSpec::Decode).collect()
}

/// A `[[decode]]` entry: one config per (batch, seqlen_k, page_size) value.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeEntry {
    pub batch: OneOrMany<usize>,
    pub heads_q: usize,
    pub heads_kv: Option<usize>,
    #[serde(default = "one")]
    pub seqlen_q: usize,
    pub seqlen_k: OneOrMany<usize>,
    #[serde(default = "d128")]
    pub head_dim: usize,
    #[serde(default = "page16")]
    pub page_size: OneOrMany<usize>,
    #[serde(default = "bf16")]
    pub dtype: String,
}

fn one() -> usize {
    1
}
fn d128() -> usize {
    128
}
fn page16() -> OneOrMany<usize> {
    OneOrMany::One(DECODE_PAGE_SIZE)
}

pub(crate) fn expand_decode(e: &DecodeEntry, index: usize) -> anyhow::Result<Vec<ProblemSpec>> {
    let ctx = |what: &str| format!("[[decode]] entry {}: {what}", index + 1);
    let dtype: DType = e
        .dtype
        .parse()
        .map_err(|m: String| anyhow::anyhow!(ctx(&m)))?;
    let mut v = Vec::new();
    for batch in e.batch.values() {
        for sk in e.seqlen_k.values() {
            for page in e.page_size.values() {
                let p = DecodeProblem::new(
                    batch,
                    e.heads_q,
                    e.heads_kv.unwrap_or(e.heads_q),
                    e.seqlen_q,
                    sk,
                    e.head_dim,
                    page,
                    dtype,
                );
                p.validate()
                    .map_err(|err| anyhow::anyhow!(ctx(&err.to_string())))?;
                v.push(ProblemSpec::Decode(p));
            }
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(v: Vec<ProblemSpec>) -> Vec<DecodeProblem> {
        v.into_iter()
            .map(|c| match c {
                ProblemSpec::Decode(p) => p,
                _ => panic!("non-decode config in a decode preset"),
            })
            .collect()
    }

    #[test]
    fn decode_preset_is_the_issue_table_then_the_classes() {
        let rows: Vec<_> = problems(decode_table(true))
            .iter()
            .take(7)
            .map(|p| (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k))
            .collect();
        assert_eq!(
            rows,
            [
                (1, 32, 8, 1, 8192),
                (8, 32, 8, 1, 4096),
                (64, 32, 8, 1, 8192),
                (128, 32, 8, 1, 2048),
                (16, 64, 8, 1, 32768),
                (32, 32, 32, 1, 4096),
                (64, 32, 8, 4, 4096),
            ]
        );
        for gpu in [true, false] {
            let v = problems(decode_table(gpu));
            assert_eq!(v.len(), 7 + class_rows(gpu).len());
            for p in &v {
                p.validate().unwrap();
                // Every GPU and CPU shape has a decode kernel (the class is valid).
                p.class().validate().unwrap();
                assert_eq!(p.page_size, 16);
            }
            // Issue 22's rows: the same structure on both machines (GQA ratios, the MHA
            // row and the Sq = 4 row), D = 128, bf16.
            let (issue22, classes) = v.split_at(7);
            let ratios: Vec<_> = issue22.iter().map(|p| p.heads_q / p.heads_kv).collect();
            assert_eq!(ratios, [4, 4, 4, 4, 8, 1, 4], "gpu={gpu}");
            let sq: Vec<_> = issue22.iter().map(|p| p.seqlen_q).collect();
            assert_eq!(sq, [1, 1, 1, 1, 1, 1, 4], "gpu={gpu}");
            assert!(issue22
                .iter()
                .all(|p| (p.head_dim, p.dtype) == (128, DType::Bf16)));
            // Issue 35's classes, on both machines: one sequence of a long cache, groups of
            // 16 query heads or more on one KV head, MHA, head dims 64 and 256, Sq 8 and
            // 16, fp16.
            let has = |f: &dyn Fn(&DecodeProblem) -> bool| classes.iter().any(f);
            assert!(has(&|p| p.batch == 1 && p.seqlen_k >= 2000), "gpu={gpu}");
            assert!(has(&|p| p.heads_kv == 1 && p.heads_q >= 16));
            assert!(has(&|p| p.heads_q / p.heads_kv >= 32));
            assert!(has(&|p| p.heads_q == p.heads_kv));
            assert!(has(&|p| p.head_dim == 64) && has(&|p| p.head_dim == 256));
            assert!(has(&|p| p.seqlen_q == 8) && has(&|p| p.seqlen_q == 16));
            assert!(has(&|p| p.dtype == DType::F16));
        }
        let gpu = problems(decode_table(true));
        assert!(gpu.iter().any(|p| p.seqlen_k >= 131072));
        assert!(gpu.iter().any(|p| p.batch >= 256));
        // The CPU shapes stay small (the f64 reference runs them) and one has a ragged
        // last page.
        let cpu = problems(decode_table(false));
        assert!(cpu.iter().all(|p| p.flops() < 5e7));
        assert!(cpu.iter().any(|p| p.seqlen_k % p.page_size != 0));
        let e = crate::config::preset(crate::config::Suite::Decode, "quick", false);
        assert!(e.unwrap_err().to_string().contains("decode"));
    }

    #[test]
    fn check_matrix_has_every_head_dim_and_the_widest_groups() {
        for quick in [true, false] {
            let m = problems(decode_check_matrix(quick));
            for p in &m {
                p.validate().unwrap();
                p.class().validate().unwrap();
            }
            let dims: std::collections::BTreeSet<usize> = m.iter().map(|p| p.head_dim).collect();
            let want: &[usize] = if quick { &[128, 256] } else { &[64, 128, 256] };
            assert_eq!(dims.into_iter().collect::<Vec<_>>(), want);
            assert!(m.iter().any(|p| p.heads_kv == 1 && p.heads_q >= 32));
        }
    }

    #[test]
    fn paged_preset_is_the_issue_table_at_three_page_sizes() {
        for gpu in [true, false] {
            let decode = problems(decode_table(gpu));
            let paged = problems(paged_table(gpu));
            assert_eq!(paged.len(), 3 * 7);
            for (d, three) in decode.iter().zip(paged.chunks(3)) {
                let pages: Vec<usize> = three.iter().map(|p| p.page_size).collect();
                assert_eq!(pages, [16, 128, d.seqlen_k.next_multiple_of(16)]);
                for p in three {
                    p.validate().unwrap();
                    assert_eq!(
                        DecodeProblem {
                            page_size: 16,
                            ..p.clone()
                        },
                        *d
                    );
                }
            }
        }
    }
}
