//! The attention suite's configs: the `quick`, `sweep`, `seed002`, `seed003` and `window`
//! presets, the check matrix and the `[[attention]]` entry of a TOML config file
//! (`crate::config` dispatches to these). The problem type is the library's
//! [`AttentionProblem`]; its CPU references are `flashmoe::reference`'s.

use crate::results::ProblemSpec;
use crate::toml_fields::{bf16, no, OneOrMany};
use anyhow::{bail, Context};
use flashmoe::{AttentionProblem, DType};
use serde::Deserialize;

/// The configs of attention preset `name` (one of `crate::config::ATTENTION_PRESETS`);
/// `gpu` selects GPU-sized shapes for `quick`, `sweep` and `window`.
pub(crate) fn preset_table(name: &str, gpu: bool) -> Vec<ProblemSpec> {
    use DType::*;
    let attn = |b, h, s, d, causal, dt| {
        ProblemSpec::Attention(AttentionProblem::new(b, h, s, d, causal, dt))
    };
    match (name, gpu) {
        ("quick", true) => vec![
            attn(16, 16, 1024, 128, false, Bf16),
            attn(4, 16, 4096, 128, false, Bf16),
            attn(4, 16, 4096, 128, true, Bf16),
            attn(8, 32, 2048, 64, false, Bf16),
            attn(8, 32, 2048, 64, true, Bf16),
        ],
        ("quick", false) => vec![
            attn(8, 4, 128, 64, false, Bf16),
            attn(4, 4, 256, 64, false, Bf16),
            attn(4, 4, 256, 64, true, Bf16),
            attn(2, 4, 512, 64, false, Bf16),
            attn(4, 2, 256, 128, false, F16),
        ],
        ("sweep", true) => token_sweep(
            16384,
            2048,
            &[64, 128],
            &[512, 1024, 2048, 4096, 8192, 16384],
            Bf16,
        ),
        ("sweep", false) => token_sweep(2048, 256, &[64, 128], &[128, 256, 512, 1024, 2048], Bf16),
        ("window", gpu) => window_table(gpu),
        ("seed002", _) => vec![
            attn(32, 8, 512, 64, false, F16),
            attn(32, 8, 512, 64, true, F16),
        ],
        ("seed003", _) => vec![
            attn(16, 16, 2048, 64, false, F16),
            attn(16, 16, 2048, 64, true, F16),
            attn(32, 32, 4096, 128, false, F16),
            attn(32, 32, 4096, 128, true, F16),
        ],
        (other, _) => unreachable!("attention preset {other} is listed but has no table"),
    }
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

/// Shapes for `flashmoe check --suite attention`: every feature on small sizes (all run
/// against the CPU f64 reference at the given `seqlens`). `quick` keeps one representative
/// per feature.
pub(crate) fn check_matrix(quick: bool, seqlens: &[(usize, usize)]) -> Vec<ProblemSpec> {
    let mut v = Vec::new();
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
    // Sliding windows and softcap at head dims 64 and 128 (both kernels serve them there):
    // GQA 4, both dtypes (quick: bf16, the first five cases).
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

pub(crate) fn expand_attention(
    e: &AttentionEntry,
    index: usize,
) -> anyhow::Result<Vec<ProblemSpec>> {
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
