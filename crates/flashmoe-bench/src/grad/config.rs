//! The gradient family's configs: a forward suite's presets and config files wrapped in a
//! pass ([`wrap`]), and the gradient check matrix ([`check_matrix`]).

use super::{GradLayer, GradProblem, Pass, RouterShape};
use crate::config::Suite;
use crate::results::ProblemSpec;
use crate::varlen::VarlenProblem;
use flashmoe::problem::NO_WINDOW;
use flashmoe::{AttentionProblem, DType, MoeProblem, Scoring};

/// Whether a suite has a backward in the lab.
pub fn suite_has_backward(suite: Suite) -> bool {
    matches!(suite, Suite::Attention | Suite::Varlen | Suite::Moe)
}

fn no_backward(suite: Suite) -> anyhow::Error {
    anyhow::anyhow!(
        "--pass bwd / fwd+bwd: the {} suite has no backward (attention, varlen and moe do)",
        suite.name()
    )
}

/// The forward configs as gradient configs of `pass` (`Fwd` returns them unchanged).
pub fn wrap(
    suite: Suite,
    forward: Vec<ProblemSpec>,
    pass: Pass,
) -> anyhow::Result<Vec<ProblemSpec>> {
    if pass == Pass::Fwd {
        return Ok(forward);
    }
    if !suite_has_backward(suite) {
        return Err(no_backward(suite));
    }
    forward
        .into_iter()
        .map(|p| {
            let layer = match p {
                ProblemSpec::Attention(a) => GradLayer::Attention(a),
                ProblemSpec::Varlen(v) => GradLayer::Varlen(v),
                ProblemSpec::Moe(m) => GradLayer::Moe(m),
                other => anyhow::bail!("{} has no backward in the lab", other.label()),
            };
            Ok(ProblemSpec::Grad(GradProblem::new(pass, layer)))
        })
        .collect()
}

fn attention(
    hq: usize,
    hkv: usize,
    (sq, sk): (usize, usize),
    d: usize,
    causal: bool,
    dtype: DType,
) -> AttentionProblem {
    AttentionProblem {
        batch: 2,
        heads_q: hq,
        heads_kv: hkv,
        seqlen_q: sq,
        seqlen_k: sk,
        head_dim: d,
        causal,
        dtype,
        softmax_scale: None,
        window: NO_WINDOW,
        softcap: 0.0,
    }
}

/// The gradient check matrix of a suite, on sizes the f64 backward runs in well under a
/// second each (the same on a GPU: it checks the plans, not their speed):
///
/// - attention: the forward's shape classes — head dims 32 / 64 / 96 / 128 (quick: 64,
///   128), bf16 and f16, causal and not, MHA, GQA 4 and MQA, Sq = Sk, Sq < Sk and Sq > Sk
///   (causal: the first rows see no key), one row — then sliding windows (both sides, one
///   side, with causal), softcap, and a window with a softcap;
/// - varlen: ragged sequences with an empty one on each side, causal and not, GQA, a
///   window and a softcap;
/// - MoE: softmax top-2 renormalised (and with the aux and z losses trained), exact ties
///   (pairs of experts with equal router columns), one expert, top_k = experts, skewed
///   routing (one expert's router column scaled up), sigmoid without renormalisation,
///   a shared expert, f16.
pub fn check_matrix(suite: Suite, quick: bool, pass: Pass) -> anyhow::Result<Vec<ProblemSpec>> {
    let pass = if pass == Pass::Fwd { Pass::Bwd } else { pass };
    let layers: Vec<GradLayer> = match suite {
        Suite::Attention => attention_layers(quick),
        Suite::Varlen => varlen_layers(quick),
        Suite::Moe => return Ok(moe_problems(quick, pass)),
        _ => return Err(no_backward(suite)),
    };
    Ok(layers
        .into_iter()
        .map(|l| ProblemSpec::Grad(GradProblem::new(pass, l)))
        .collect())
}

/// (causal, window, softcap, (Sq, Sk)).
type WindowCase = (bool, (i32, i32), f32, (usize, usize));

/// Shapes a GPU check adds (the kernels' tile edges and many blocks in both loops; the
/// reference slices the large ones, `reference.rs`): long and ragged lengths, Sq ≠ Sk both
/// ways, GQA; a packed batch of long ragged sequences; a model-like MoE at 2048 tokens.
pub fn gpu_check_shapes(suite: Suite, quick: bool, pass: Pass) -> Vec<ProblemSpec> {
    use DType::{Bf16, F16};
    let pass = if pass == Pass::Fwd { Pass::Bwd } else { pass };
    let mut layers = Vec::new();
    match suite {
        Suite::Attention => {
            layers.push(GradLayer::Attention(attention(
                8,
                2,
                (1000, 1000),
                128,
                true,
                Bf16,
            )));
            layers.push(GradLayer::Attention(attention(
                4,
                4,
                (4097, 4097),
                64,
                false,
                F16,
            )));
            if !quick {
                layers.push(GradLayer::Attention(attention(
                    8,
                    8,
                    (1000, 4097),
                    128,
                    true,
                    Bf16,
                )));
                layers.push(GradLayer::Attention(attention(
                    4,
                    1,
                    (4097, 1000),
                    64,
                    true,
                    Bf16,
                )));
            }
        }
        Suite::Varlen => {
            let mut p = VarlenProblem::new(&[], 8, 2, 128, true, Bf16);
            p.seqlens = vec![(1000, 1000), (0, 7), (2049, 2049), (333, 1500), (1, 1)];
            layers.push(GradLayer::Varlen(p));
        }
        Suite::Moe => {
            layers.push(GradLayer::Moe(MoeProblem {
                tokens: 2048,
                hidden: 1024,
                intermediate: 512,
                experts: 64,
                top_k: 8,
                scoring: Scoring::Softmax,
                renormalize: true,
                dtype: Bf16,
                shared_expert: !quick,
            }));
        }
        _ => {}
    }
    layers
        .into_iter()
        .map(|l| ProblemSpec::Grad(GradProblem::new(pass, l)))
        .collect()
}

fn attention_layers(quick: bool) -> Vec<GradLayer> {
    use DType::{Bf16, F16};
    let mut v = Vec::new();
    let dims: &[usize] = if quick {
        &[64, 128]
    } else {
        &[32, 64, 96, 128]
    };
    let lens: &[(usize, usize)] = if quick {
        &[(33, 33), (20, 70)]
    } else {
        &[(1, 1), (33, 33), (20, 70), (70, 20)]
    };
    let heads: &[(usize, usize)] = if quick {
        &[(4, 4), (4, 1)]
    } else {
        &[(4, 4), (4, 1), (8, 2)]
    };
    for (n, &d) in dims.iter().enumerate() {
        // The dtypes alternate over head dims (both meet every shape class).
        let dtype = if n % 2 == 0 { Bf16 } else { F16 };
        for causal in [false, true] {
            for &(hq, hkv) in heads {
                for &l in lens {
                    v.push(GradLayer::Attention(attention(
                        hq, hkv, l, d, causal, dtype,
                    )));
                }
            }
        }
    }
    let cases: &[WindowCase] = &[
        (false, (16, 4), 0.0, (60, 60)),
        (true, (20, -1), 0.0, (40, 70)),
        (false, (-1, 8), 0.0, (70, 40)),
        (false, NO_WINDOW, 5.0, (50, 50)),
        (true, NO_WINDOW, 2.0, (30, 60)),
        (false, (12, 0), 3.0, (64, 64)),
    ];
    let cases = if quick { &cases[..4] } else { cases };
    for (n, &(causal, window, softcap, l)) in cases.iter().enumerate() {
        let mut p = attention(4, 2, l, if n % 2 == 0 { 64 } else { 128 }, causal, Bf16);
        if n % 3 == 2 {
            p.dtype = F16;
        }
        p.window = window;
        p.softcap = softcap;
        v.push(GradLayer::Attention(p));
    }
    v
}

fn varlen_layers(quick: bool) -> Vec<GradLayer> {
    let mk = |seqlens: &[(usize, usize)], hq, hkv, d, causal, dtype| {
        let mut p = VarlenProblem::new(&[], hq, hkv, d, causal, dtype);
        p.seqlens = seqlens.to_vec();
        p
    };
    let ragged = [(17, 17), (0, 5), (40, 40), (3, 0), (64, 64), (1, 1)];
    let cross = [(10, 30), (25, 9), (33, 33)];
    let mut v = vec![
        mk(&ragged, 4, 4, 64, true, DType::Bf16),
        mk(&cross, 4, 1, 128, false, DType::F16),
    ];
    if !quick {
        v.push(mk(&ragged, 8, 2, 64, false, DType::Bf16));
        v.push(mk(&cross, 4, 2, 128, true, DType::Bf16));
    }
    let mut w = mk(&ragged, 4, 2, 64, false, DType::Bf16);
    w.window = (8, 2);
    v.push(w);
    let mut c = mk(&cross, 4, 2, 64, true, DType::Bf16);
    c.softcap = 4.0;
    v.push(c);
    v.into_iter().map(GradLayer::Varlen).collect()
}

fn moe_problems(quick: bool, pass: Pass) -> Vec<ProblemSpec> {
    let mk = |t, e, k, scoring, renormalize, shared, dtype| MoeProblem {
        tokens: t,
        hidden: 64,
        intermediate: 48,
        experts: e,
        top_k: k,
        scoring,
        renormalize,
        dtype,
        shared_expert: shared,
    };
    use DType::{Bf16, F16};
    use Scoring::{Sigmoid, Softmax};
    let grad = |m: MoeProblem, d_aux: f64, d_z: f64, router: RouterShape| {
        let mut g = GradProblem::new(pass, GradLayer::Moe(m));
        g.d_aux = d_aux;
        g.d_z = d_z;
        g.router = router;
        ProblemSpec::Grad(g)
    };
    let mut v = vec![
        grad(
            mk(96, 8, 2, Softmax, true, false, Bf16),
            0.0,
            0.0,
            RouterShape::Random,
        ),
        grad(
            mk(96, 8, 2, Softmax, true, false, Bf16),
            0.5,
            0.1,
            RouterShape::Random,
        ),
        grad(
            mk(64, 8, 2, Softmax, true, false, Bf16),
            0.0,
            0.0,
            RouterShape::Tied,
        ),
        grad(
            mk(40, 1, 1, Softmax, true, false, Bf16),
            0.0,
            0.0,
            RouterShape::Random,
        ),
        grad(
            mk(40, 6, 6, Softmax, false, false, Bf16),
            0.2,
            0.0,
            RouterShape::Random,
        ),
        grad(
            mk(96, 8, 2, Softmax, true, false, Bf16),
            0.0,
            0.0,
            RouterShape::Skewed,
        ),
        grad(
            mk(64, 8, 3, Sigmoid, false, true, Bf16),
            0.5,
            0.1,
            RouterShape::Random,
        ),
    ];
    if !quick {
        v.push(grad(
            mk(80, 16, 4, Softmax, true, true, F16),
            0.0,
            0.0,
            RouterShape::Random,
        ));
        v.push(grad(
            mk(64, 8, 2, Sigmoid, true, false, F16),
            0.3,
            0.2,
            RouterShape::Tied,
        ));
        v.push(grad(
            mk(17, 4, 2, Softmax, true, true, Bf16),
            0.0,
            0.0,
            RouterShape::Skewed,
        ));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_matrices_are_valid_and_distinct() {
        for suite in [Suite::Attention, Suite::Varlen, Suite::Moe] {
            for quick in [true, false] {
                let m = check_matrix(suite, quick, Pass::Bwd).unwrap();
                assert!(!m.is_empty());
                let mut ids: Vec<String> = m.iter().map(|p| p.id()).collect();
                for p in &m {
                    p.workload().validate().unwrap();
                }
                ids.sort();
                ids.dedup();
                assert_eq!(ids.len(), m.len(), "{suite:?} quick={quick}: duplicate ids");
            }
        }
        assert!(check_matrix(Suite::Decode, true, Pass::Bwd).is_err());
        for suite in [Suite::Attention, Suite::Varlen, Suite::Moe] {
            for p in gpu_check_shapes(suite, false, Pass::Bwd) {
                p.workload().validate().unwrap();
            }
        }
    }

    #[test]
    fn wrap_keeps_the_forward_and_refuses_families_without_backward() {
        let fwd = crate::config::preset(Suite::Attention, "quick", false).unwrap();
        assert_eq!(wrap(Suite::Attention, fwd.clone(), Pass::Fwd).unwrap(), fwd);
        let bwd = wrap(Suite::Attention, fwd.clone(), Pass::Bwd).unwrap();
        assert_eq!(bwd.len(), fwd.len());
        assert!(matches!(&bwd[0], ProblemSpec::Grad(g) if g.pass == Pass::Bwd));
        let e = wrap(Suite::Mla, Vec::new(), Pass::Bwd).unwrap_err();
        assert!(e.to_string().contains("no backward"), "{e}");
    }
}
