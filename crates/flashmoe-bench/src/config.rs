//! Which configs a run measures: named presets and TOML config files.
//!
//! GPU presets use the shapes of the issues (16k tokens / model dim 2048 sweep, the
//! seed configurations, the MoE model shapes). On a machine without a GPU the `quick` and
//! `sweep` presets use scaled-down shapes of the same structure so the whole pipeline runs
//! in seconds; the seed and model presets keep their real shapes.

use crate::decode::DecodeProblem;
use crate::results::ProblemSpec;
use crate::varlen::{random_lengths, VarlenProblem};
use anyhow::{bail, Context};
use flashmoe::{AttentionProblem, DType, MoeProblem, Scoring};
use serde::Deserialize;
use std::path::Path;

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

/// Page size of the decode preset's paged cache.
pub const DECODE_PAGE_SIZE: usize = 16;

/// The decode preset: issue 22's decode table (bf16, D = 128, causal, Sq = 1 but the last
/// row's 4, page 16) on a GPU; without one, shapes of the same structure (the same GQA
/// ratios, one Sq = 4 row, ragged last pages) small enough for the CPU f64 reference.
fn decode_table(gpu: bool) -> Vec<ProblemSpec> {
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
fn paged_table(gpu: bool) -> Vec<ProblemSpec> {
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

/// Seed of the varlen preset's lengths: issue 22's (`examples/varlen_probe.rs`).
pub const VARLEN_SEED: u64 = 22;

/// The varlen preset, per class (head dim × heads at model dim 2048 on a GPU, 256 or 512
/// without one; bf16):
///
/// 1. issue 22's target: 16 sequences of 100..=4000 tokens ([`random_lengths`] seed 22,
///    total 31 473), Sq = Sk, D = 128 H = 16 and D = 64 H = 32 (MHA), causal and not;
/// 2. the dense problem on the same total tokens: 16 sequences of S = total / 16
///    (rounded, 1967) through the same varlen call, where `flashmoe-sm90-dense` (the dense
///    kernel on `(16, S, H, D)`) runs too: the issue's "≥ 0.95× dense TFLOP/s" reads off
///    rows 1 and 2;
/// 3. chunked prefill: 16 sequences each appending a chunk of 64..=1024 queries to a
///    cached context of 100..=4000 keys (Sk = context + chunk > Sq), causal, GQA 4
///    (Hq 16 / Hkv 4 at D = 128, 32 / 8 at D = 64);
/// 4. many short sequences: 64 of 1..=300 tokens, Sq = Sk, MHA, causal and not.
///
/// Without a GPU: the same four families on 6 sequences of 10..=200 tokens (chunks of
/// 8..=64 on contexts of 10..=200), 32 short ones of 1..=40, D = 128 H = 2 and D = 64 H = 4
/// (GQA 4: 4 / 1 and 8 / 2), small enough for the CPU f64 reference.
fn varlen_table(gpu: bool) -> Vec<ProblemSpec> {
    struct Family {
        n: usize,
        lens: (usize, usize),
        chunk: (usize, usize),
        short_n: usize,
        short: (usize, usize),
        mha: [(usize, usize); 2],
        gqa: [(usize, usize, usize); 2],
    }
    let f = if gpu {
        Family {
            n: 16,
            lens: (100, 4000),
            chunk: (64, 1024),
            short_n: 64,
            short: (1, 300),
            mha: [(128, 16), (64, 32)],
            gqa: [(128, 16, 4), (64, 32, 8)],
        }
    } else {
        Family {
            n: 6,
            lens: (10, 200),
            chunk: (8, 64),
            short_n: 32,
            short: (1, 40),
            mha: [(128, 2), (64, 4)],
            gqa: [(128, 4, 1), (64, 8, 2)],
        }
    };
    let target = random_lengths(VARLEN_SEED, f.n, f.lens.0, f.lens.1);
    let total: usize = target.iter().sum();
    let dense = vec![(total + f.n / 2) / f.n; f.n];
    let short = random_lengths(VARLEN_SEED + 3, f.short_n, f.short.0, f.short.1);
    let mut v = Vec::new();
    let both_masks = |v: &mut Vec<ProblemSpec>, lens: &[usize]| {
        for &(d, h) in &f.mha {
            for causal in [false, true] {
                v.push(ProblemSpec::Varlen(VarlenProblem::new(
                    lens,
                    h,
                    h,
                    d,
                    causal,
                    DType::Bf16,
                )));
            }
        }
    };
    both_masks(&mut v, &target);
    both_masks(&mut v, &dense);
    let context = random_lengths(VARLEN_SEED + 1, f.n, f.lens.0, f.lens.1);
    let chunk = random_lengths(VARLEN_SEED + 2, f.n, f.chunk.0, f.chunk.1);
    for &(d, hq, hkv) in &f.gqa {
        let mut p = VarlenProblem::new(&[], hq, hkv, d, true, DType::Bf16);
        p.seqlens = chunk
            .iter()
            .zip(&context)
            .map(|(&q, &c)| (q, c + q))
            .collect();
        v.push(ProblemSpec::Varlen(p));
    }
    both_masks(&mut v, &short);
    v
}

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

/// The `window` preset: sliding windows and softcap beside plain attention of the same
/// visible length (issue 22's cost target). Per head dim, GQA 32/8:
/// - plain non-causal Sq = S, Sk = W + 1 (every row sees W + 1 keys) and a causal window of
///   W to the left at Sq = Sk = S (rows see up to W + 1 keys);
/// - the same window with softcap 50;
/// - non-causal and causal, plain and with softcap 50, on one shape.
///
/// GPU: S = 16384, W = 4095, softcap shapes B = 4, S = 4096. CPU: S = 1024, W = 255,
/// B = 1, S = 512, 4 / 2 heads.
fn window_table(gpu: bool) -> Vec<ProblemSpec> {
    let (s, w, b2, s2, hq, hkv) = if gpu {
        (16384, 4095, 4, 4096, 32, 8)
    } else {
        (1024, 255, 1, 512, 4, 2)
    };
    let p = |b, sq, sk, d, causal, window, softcap| {
        ProblemSpec::Attention(AttentionProblem {
            batch: b,
            heads_q: hq,
            heads_kv: hkv,
            seqlen_q: sq,
            seqlen_k: sk,
            head_dim: d,
            causal,
            dtype: DType::Bf16,
            softmax_scale: None,
            window,
            softcap,
        })
    };
    let none = flashmoe::problem::NO_WINDOW;
    let win = (w as i32, -1);
    let mut v = Vec::new();
    for d in [128, 64] {
        v.extend([
            p(1, s, w + 1, d, false, none, 0.0),
            p(1, s, s, d, true, win, 0.0),
            p(1, s, s, d, true, win, 50.0),
            p(b2, s2, s2, d, false, none, 0.0),
            p(b2, s2, s2, d, false, none, 50.0),
            p(b2, s2, s2, d, true, none, 0.0),
            p(b2, s2, s2, d, true, none, 50.0),
        ]);
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
        (Suite::Attention, "window", gpu) => window_table(gpu),
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

/// (causal, window, softcap) of the check's window cases: windows narrower than a key tile
/// and wider than a work tile, one-sided either way, right > 0, softcap alone and with a
/// window. Window sides touch both ends of the short lengths.
pub const WINDOW_CHECK_CASES: [(bool, (i32, i32), f32); 8] = [
    (true, (256, -1), 0.0),
    (false, (64, 64), 0.0),
    (true, (-1, -1), 30.0),
    (false, (-1, 37), 0.0),
    (true, (100, 0), 50.0),
    (true, (0, -1), 0.0),
    (false, (200, -1), 0.0),
    (false, (-1, -1), 5.0),
];

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
                                    window: flashmoe::problem::NO_WINDOW,
                                    softcap: 0.0,
                                }));
                            }
                        }
                    }
                }
            }
            // Sliding windows and softcap, at the sm_90a kernel's head dims (the v1 kernel
            // skips them): GQA 4, both dtypes (quick: bf16, the first five cases).
            let cases = if quick {
                &WINDOW_CHECK_CASES[..5]
            } else {
                &WINDOW_CHECK_CASES[..]
            };
            for &dtype in if quick { &dtypes[..1] } else { &dtypes[..] } {
                for d in [64, 128] {
                    for &(causal, window, softcap) in cases {
                        for &(sq, sk) in seqlens {
                            v.push(ProblemSpec::Attention(AttentionProblem {
                                batch: 1,
                                heads_q: 8,
                                heads_kv: 2,
                                seqlen_q: sq,
                                seqlen_k: sk,
                                head_dim: d,
                                causal,
                                dtype,
                                softmax_scale: None,
                                window,
                                softcap,
                            }));
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
        Suite::Decode => v.extend(decode_check_matrix(quick)),
        Suite::Varlen => v.extend(varlen_check_matrix(quick)),
        Suite::Mla => v.extend(crate::mla::config::check_matrix(quick)),
    }
    v
}

/// The decode check matrix (issue 22): every config against the f64 paged reference on a
/// shuffled block table. Plain steps over GQA ratios 1/2/4/7/8/16 × Sq 1/4/16 × pages
/// 16/48/128/256 × bf16/f16 with ragged cache lengths (1 or Sq, page ± 1, primes); windows
/// touching both ends of the keys (left past key 0, right past the last key, both), with
/// and without softcap; mixed batches (cu_seqlens_q: 0..16 rows a sequence); and one long
/// ragged batch that the heuristic splits many ways. `quick` keeps one of each kind.
fn decode_check_matrix(quick: bool) -> Vec<ProblemSpec> {
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
/// keys) and one off either side, 1, primes, empty sequences on either side (0 queries
/// with keys, queries with no key, and none), Sk > Sq (chunked prefill) and Sk < Sq
/// (causal: the first rows see no key), and an empty last sequence (the end of the
/// offsets). Σ Sq·Sk ≈ 181k pairs.
pub const VARLEN_CHECK_SEQLENS: &[(usize, usize)] = &[
    (65, 65),
    (1, 1),
    (63, 63),
    (0, 0),
    (64, 64),
    (127, 127),
    (128, 128),
    (129, 129),
    (37, 300),
    (0, 17),
    (193, 193),
    (5, 0),
    (100, 40),
    (257, 257),
    (1, 211),
    (31, 31),
    (0, 0),
];

/// (causal, window, softcap) of the varlen check's window and softcap cases (quick: the
/// first two): a causal sliding window, a softcap alone, a two-sided window, a right-only
/// window, the diagonal alone, a window with a softcap.
pub const VARLEN_WINDOW_CHECK_CASES: [(bool, (i32, i32), f32); 6] = [
    (true, (100, -1), 0.0),
    (false, (-1, -1), 30.0),
    (false, (64, 64), 0.0),
    (false, (-1, 37), 0.0),
    (true, (0, -1), 0.0),
    (true, (64, -1), 50.0),
];

/// The varlen check matrix (issue 22), every config against the CPU f64 reference
/// sequence by sequence: the ragged batch of [`VARLEN_CHECK_SEQLENS`] over bf16/f16 × head
/// dims 64/128 × causal or not × GQA 1/4 (Hq 8); the window and softcap cases on both head
/// dims (GQA 4, bf16); 48 short sequences of 1..=100 with an explicit softmax scale; and a
/// batch whose only tokens are one sequence between empty ones. `quick` keeps bf16 D=128
/// causal GQA 4 and f16 D=64 non-causal MHA on the ragged batch, a window and a softcap
/// case, and the two special batches.
fn varlen_check_matrix(quick: bool) -> Vec<ProblemSpec> {
    let mk = |lens: &[(usize, usize)], hkv: usize, d: usize, causal: bool, dtype: DType| {
        let mut p = VarlenProblem::new(&[], 8, hkv, d, causal, dtype);
        p.seqlens = lens.to_vec();
        p
    };
    let mut v = Vec::new();
    if quick {
        v.push(mk(VARLEN_CHECK_SEQLENS, 2, 128, true, DType::Bf16));
        v.push(mk(VARLEN_CHECK_SEQLENS, 8, 64, false, DType::F16));
    } else {
        for dtype in [DType::Bf16, DType::F16] {
            for d in [64, 128] {
                for causal in [false, true] {
                    for hkv in [8, 2] {
                        v.push(mk(VARLEN_CHECK_SEQLENS, hkv, d, causal, dtype));
                    }
                }
            }
        }
    }
    let cases = if quick {
        &VARLEN_WINDOW_CHECK_CASES[..2]
    } else {
        &VARLEN_WINDOW_CHECK_CASES[..]
    };
    for (i, &(causal, window, softcap)) in cases.iter().enumerate() {
        let dims: &[usize] = match (quick, i) {
            (true, 0) => &[128],
            (true, _) => &[64],
            (false, _) => &[64, 128],
        };
        for &d in dims {
            let mut p = mk(VARLEN_CHECK_SEQLENS, 2, d, causal, DType::Bf16);
            p.window = window;
            p.softcap = softcap;
            v.push(p);
        }
    }
    // Many short sequences (several per work tile of rows), an explicit scale.
    let short: Vec<(usize, usize)> = random_lengths(7, 48, 1, 100)
        .into_iter()
        .map(|l| (l, l))
        .collect();
    let mut p = mk(&short, 2, 128, true, DType::Bf16);
    p.softmax_scale = Some(0.07);
    v.push(p);
    if !quick {
        let mut p = mk(&short, 8, 64, false, DType::F16);
        p.softmax_scale = Some(0.07);
        v.push(p);
    }
    // One sequence between empty ones (leading and trailing offsets repeat).
    v.push(mk(
        &[(0, 0), (0, 5), (300, 300), (0, 0)],
        2,
        64,
        true,
        DType::Bf16,
    ));
    v.into_iter().map(ProblemSpec::Varlen).collect()
}

/// Varlen shapes the GPU check adds, above the CPU f64 reference's size (checked against
/// the GPU fp32 reference kernel sequence by sequence): 12 sequences of 500..=3000 tokens
/// (several waves of work tiles), causal, GQA 4, bf16; the full check adds a chunked
/// prefill batch (f16, D = 64) and a long sliding window with a softcap.
pub fn varlen_gpu_check_shapes(quick: bool) -> Vec<ProblemSpec> {
    let mut v = vec![VarlenProblem::new(
        &random_lengths(31, 12, 500, 3000),
        16,
        4,
        128,
        true,
        DType::Bf16,
    )];
    if !quick {
        let context = random_lengths(32, 8, 500, 3000);
        let chunk = random_lengths(33, 8, 100, 1000);
        let mut p = VarlenProblem::new(&[], 32, 8, 64, true, DType::F16);
        p.seqlens = chunk
            .iter()
            .zip(&context)
            .map(|(&q, &c)| (q, c + q))
            .collect();
        v.push(p);
        let mut w = VarlenProblem::new(
            &random_lengths(34, 8, 1000, 4000),
            16,
            4,
            128,
            true,
            DType::Bf16,
        );
        w.window = (1024, -1);
        w.softcap = 30.0;
        v.push(w);
    }
    v.into_iter().map(ProblemSpec::Varlen).collect()
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

/// A value or a list of values (each value gives one config).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    pub(crate) fn values(&self) -> Vec<T> {
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
    /// Sliding window `[left, right]` (-1: unbounded; AttentionProblem::window).
    pub window: Option<(i32, i32)>,
    /// Logit softcap (0 or absent: off).
    pub softcap: Option<f32>,
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

fn expand_decode(e: &DecodeEntry, index: usize) -> anyhow::Result<Vec<ProblemSpec>> {
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

/// A `[[varlen]]` entry: one config per (head_dim, causal) value, all on the same
/// sequence lengths, given as `seqlens` (Sq = Sk), as `seqlens_q` and `seqlens_k` (lists
/// of equal length), or drawn by `random` ([`random_lengths`], Sq = Sk).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VarlenEntry {
    pub seqlens: Option<Vec<usize>>,
    pub seqlens_q: Option<Vec<usize>>,
    pub seqlens_k: Option<Vec<usize>>,
    pub random: Option<RandomLengths>,
    pub heads: Option<usize>,
    pub heads_q: Option<usize>,
    pub heads_kv: Option<usize>,
    pub head_dim: OneOrMany<usize>,
    #[serde(default = "no")]
    pub causal: OneOrMany<bool>,
    #[serde(default = "bf16")]
    pub dtype: String,
    pub softmax_scale: Option<f32>,
    /// Sliding window `[left, right]` (-1: unbounded).
    pub window: Option<(i32, i32)>,
    /// Logit softcap (0 or absent: off).
    pub softcap: Option<f32>,
}

/// `count` lengths uniform in `min..=max` ([`random_lengths`] with `seed`, default
/// [`VARLEN_SEED`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomLengths {
    pub count: usize,
    pub min: usize,
    pub max: usize,
    #[serde(default = "varlen_seed")]
    pub seed: u64,
}

fn varlen_seed() -> u64 {
    VARLEN_SEED
}

fn expand_varlen(e: &VarlenEntry, index: usize) -> anyhow::Result<Vec<ProblemSpec>> {
    let ctx = |what: &str| format!("[[varlen]] entry {}: {what}", index + 1);
    let dtype: DType = e
        .dtype
        .parse()
        .map_err(|m: String| anyhow::anyhow!(ctx(&m)))?;
    let heads_q = e
        .heads_q
        .or(e.heads)
        .with_context(|| ctx("needs `heads` or `heads_q`"))?;
    let heads_kv = e.heads_kv.unwrap_or(heads_q);
    let seqlens: Vec<(usize, usize)> = match (&e.seqlens, &e.seqlens_q, &e.seqlens_k, &e.random) {
        (Some(s), None, None, None) => s.iter().map(|&l| (l, l)).collect(),
        (None, Some(q), Some(k), None) => {
            if q.len() != k.len() {
                bail!(ctx(&format!(
                    "seqlens_q has {} lengths but seqlens_k has {} (one of each per sequence)",
                    q.len(),
                    k.len()
                )));
            }
            q.iter().copied().zip(k.iter().copied()).collect()
        }
        (None, None, None, Some(r)) => {
            if r.min > r.max {
                bail!(ctx(&format!(
                    "random lengths: min {} is above max {}",
                    r.min, r.max
                )));
            }
            random_lengths(r.seed, r.count, r.min, r.max)
                .into_iter()
                .map(|l| (l, l))
                .collect()
        }
        _ => bail!(ctx(
            "give exactly one of `seqlens`, `seqlens_q` with `seqlens_k`, or `random`"
        )),
    };
    let mut v = Vec::new();
    for d in e.head_dim.values() {
        for causal in e.causal.values() {
            let p = VarlenProblem {
                seqlens: seqlens.clone(),
                heads_q,
                heads_kv,
                head_dim: d,
                causal,
                dtype,
                softmax_scale: e.softmax_scale,
                window: e.window.unwrap_or(flashmoe::problem::NO_WINDOW),
                softcap: e.softcap.unwrap_or(0.0),
            };
            p.validate()
                .map_err(|err| anyhow::anyhow!(ctx(&err.to_string())))?;
            v.push(ProblemSpec::Varlen(p));
        }
    }
    Ok(v)
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
                        window: e.window.unwrap_or(flashmoe::problem::NO_WINDOW),
                        softcap: e.softcap.unwrap_or(0.0),
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

    fn decode_rows(gpu: bool) -> Vec<DecodeProblem> {
        preset(Suite::Decode, "decode", gpu)
            .unwrap()
            .into_iter()
            .map(|c| match c {
                ProblemSpec::Decode(p) => p,
                _ => panic!("non-decode config in the decode preset"),
            })
            .collect()
    }

    #[test]
    fn decode_preset_is_the_issue_table() {
        let rows: Vec<_> = decode_rows(true)
            .iter()
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
            let v = decode_rows(gpu);
            assert_eq!(v.len(), 7);
            for p in &v {
                p.validate().unwrap();
                // Every GPU and CPU shape has a decode kernel (the class is valid).
                p.class().validate().unwrap();
                assert_eq!((p.head_dim, p.page_size, p.dtype), (128, 16, DType::Bf16));
            }
            // The same structure: GQA ratios, the MHA row and the Sq = 4 row.
            let ratios: Vec<_> = v.iter().map(|p| p.heads_q / p.heads_kv).collect();
            assert_eq!(ratios, [4, 4, 4, 4, 8, 1, 4], "gpu={gpu}");
            let sq: Vec<_> = v.iter().map(|p| p.seqlen_q).collect();
            assert_eq!(sq, [1, 1, 1, 1, 1, 1, 4], "gpu={gpu}");
        }
        // The CPU shapes stay small (the f64 reference runs them) and one has a ragged
        // last page.
        let cpu = decode_rows(false);
        assert!(cpu.iter().all(|p| p.flops() < 5e7));
        assert!(cpu.iter().any(|p| p.seqlen_k % p.page_size != 0));
        assert!(preset(Suite::Decode, "quick", false)
            .unwrap_err()
            .to_string()
            .contains("decode"));
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

    #[test]
    fn paged_preset_is_the_decode_table_at_three_page_sizes() {
        for gpu in [true, false] {
            let decode = decode_rows(gpu);
            let paged: Vec<DecodeProblem> = preset(Suite::Decode, "paged", gpu)
                .unwrap()
                .into_iter()
                .map(|c| match c {
                    ProblemSpec::Decode(p) => p,
                    _ => panic!("non-decode config in the paged preset"),
                })
                .collect();
            assert_eq!(paged.len(), 3 * decode.len());
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
