//! The varlen suite's configs: the `varlen` preset, the check matrix (CPU and GPU shapes)
//! and the `[[varlen]]` entry of a TOML config file (`crate::config` dispatches to these).

use super::{random_lengths, VarlenProblem};
use crate::results::ProblemSpec;
use crate::toml_fields::{bf16, no, OneOrMany};
use anyhow::{bail, Context};
use flashmoe::DType;
use serde::Deserialize;

/// Seed of the varlen preset's lengths: issue 22's (`examples/varlen_probe.rs`).
pub const VARLEN_SEED: u64 = 22;

/// The varlen preset, per class (head dim × heads at model dim 2048 on a GPU, 256 or 512
/// without one; bf16):
///
/// 1. issue 22's target: 16 sequences of 100..=4000 tokens ([`random_lengths`] seed 22,
///    total 31 473), Sq = Sk, D = 128 H = 16 and D = 64 H = 32 (MHA), causal and not;
/// 2. the dense problem on the same total tokens: 16 sequences of S = total / 16
///    (rounded, 1967) through the same varlen call, where `flashmoe-sm90-dense` (the dense
///    kernel on `(16, S, H, D)`) runs too: the "≥ 0.95× dense TFLOP/s" reads off
///    rows 1 and 2;
/// 3. chunked prefill: 16 sequences each appending a chunk of 64..=1024 queries to a
///    cached context of 100..=4000 keys (Sk = context + chunk > Sq), causal, GQA 4
///    (Hq 16 / Hkv 4 at D = 128, 32 / 8 at D = 64);
/// 4. many short sequences: 64 of 1..=300 tokens, Sq = Sk, MHA, causal and not.
///
/// Without a GPU: the same four families on 6 sequences of 10..=200 tokens (chunks of
/// 8..=64 on contexts of 10..=200), 32 short ones of 1..=40, D = 128 H = 2 and D = 64 H = 4
/// (GQA 4: 4 / 1 and 8 / 2), small enough for the CPU f64 reference.
pub(crate) fn varlen_table(gpu: bool) -> Vec<ProblemSpec> {
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
pub(crate) fn varlen_check_matrix(quick: bool) -> Vec<ProblemSpec> {
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

pub(crate) fn expand_varlen(e: &VarlenEntry, index: usize) -> anyhow::Result<Vec<ProblemSpec>> {
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
