//! The decode suite's configs: the `decode` and `paged` presets, the check matrix and the
//! `[[decode]]` entry of a TOML config file (`crate::config` dispatches to these).

use super::DecodeProblem;
use crate::config::{bf16, OneOrMany};
use crate::results::ProblemSpec;
use flashmoe::DType;
use serde::Deserialize;

/// Page size of the decode preset's paged cache.
pub const DECODE_PAGE_SIZE: usize = 16;

/// The decode preset: issue 22's decode table (bf16, D = 128, causal, Sq = 1 but the last
/// row's 4, page 16) on a GPU; without one, shapes of the same structure (the same GQA
/// ratios, one Sq = 4 row, ragged last pages) small enough for the CPU f64 reference.
pub(crate) fn decode_table(gpu: bool) -> Vec<ProblemSpec> {
    decode_rows(gpu)
        .iter()
        .map(|&(b, hq, hkv, sq, sk)| {
            ProblemSpec::Decode(DecodeProblem::new(
                b,
                hq,
                hkv,
                sq,
                sk,
                128,
                DECODE_PAGE_SIZE,
                DType::Bf16,
            ))
        })
        .collect()
}

/// The paged preset: each decode-preset shape at page 16, page 128 and one page of Sk keys
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

/// (B, Hq, Hkv, Sq, Sk) of the decode preset (see [`decode_table`]).
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

/// The decode check matrix (issue 22): every config against the f64 paged reference on a
/// shuffled block table. Plain steps over GQA ratios 1/2/4/7/8/16 × Sq 1/4/16 × pages
/// 16/48/128/256 × bf16/f16 with ragged cache lengths (1 or Sq, page ± 1, primes); windows
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

/// Sequences of the varlen check: the edges of the kernels' tiles (64, 128, 192 rows; 128
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
