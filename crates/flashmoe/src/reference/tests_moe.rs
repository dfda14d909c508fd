//! Tests of the MoE reference: a hand-computed layer, tie-breaking, scoring functions,
//! renormalisation, shared expert, top_k = experts, losses, validation.

use super::moe::{moe_f64, route, MoeInputs};
use crate::error::Error;
use crate::inputs::{generate, TensorId};
use crate::{DType, MoeProblem, Scoring};

const E: f64 = std::f64::consts::E;

fn silu(z: f64) -> f64 {
    z / (1.0 + (-z).exp())
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

fn problem(t: usize, h: usize, i: usize, e: usize, k: usize, scoring: Scoring) -> MoeProblem {
    MoeProblem {
        tokens: t,
        hidden: h,
        intermediate: i,
        experts: e,
        top_k: k,
        scoring,
        renormalize: false,
        dtype: DType::F32,
        shared_expert: false,
    }
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: got {got:?}, want {want:?}"
        );
    }
}

/// 2 tokens, hidden 2, intermediate 1, 3 experts, top-2.
/// x0 = (1, 0), x1 = (0, 1). Router rows: h0 → (1, 0, 0), h1 → (0, 0, 2), so the logits
/// are t0: (1, 0, 0) (a tie between experts 1 and 2) and t1: (0, 0, 2) (a tie between 0
/// and 1).
/// Experts (W13 rows [gate, up] per hidden unit; W2 row):
///   e0: h0 [1, 2], h1 [3, -1]; W2 [1, -1]
///   e1: h0 [0.5, 1], h1 [0, 0]; W2 [2, 0]
///   e2: h0 [0, 0], h1 [1, 1];  W2 [0, 1]
fn tiny(scoring: Scoring, renormalize: bool) -> (MoeProblem, MoeInputs) {
    let p = MoeProblem {
        renormalize,
        ..problem(2, 2, 1, 3, 2, scoring)
    };
    let x = MoeInputs {
        x: vec![1.0, 0.0, 0.0, 1.0],
        router: vec![1.0, 0.0, 0.0, 0.0, 0.0, 2.0],
        w13: vec![
            1.0, 2.0, 3.0, -1.0, //
            0.5, 1.0, 0.0, 0.0, //
            0.0, 0.0, 1.0, 1.0,
        ],
        w2: vec![1.0, -1.0, 2.0, 0.0, 0.0, 1.0],
        shared_w13: None,
        shared_w2: None,
    };
    (p, x)
}

/// Expert outputs used by the tiny case: e0(x0), e1(x0), e2(x1), e0(x1).
fn tiny_expert_outputs() -> [[f64; 2]; 4] {
    let (s1, s05, s3) = (silu(1.0), silu(0.5), silu(3.0));
    [
        [2.0 * s1, -2.0 * s1], // e0(x0): gate 1, up 2
        [2.0 * s05, 0.0],      // e1(x0): gate 0.5, up 1
        [0.0, s1],             // e2(x1): gate 1, up 1
        [-s3, s3],             // e0(x1): gate 3, up -1
    ]
}

fn combine(w: &[f64]) -> Vec<f64> {
    let y = tiny_expert_outputs();
    vec![
        w[0] * y[0][0] + w[1] * y[1][0],
        w[0] * y[0][1] + w[1] * y[1][1],
        w[2] * y[2][0] + w[3] * y[3][0],
        w[2] * y[2][1] + w[3] * y[3][1],
    ]
}

#[test]
fn hand_computed_tiny_moe_softmax() {
    let (e2, d0, d1) = (E * E, E + 2.0, E * E + 2.0);
    for renorm in [false, true] {
        let (p, x) = tiny(Scoring::Softmax, renorm);
        let r = moe_f64(&p, &x).unwrap();
        let rt = &r.routing;
        // t0 scores (e, 1, 1)/(e+2): expert 0, then 1 (tie with 2 → lower index).
        // t1 scores (1, 1, e²)/(e²+2): expert 2, then 0 (tie with 1 → lower index).
        assert_eq!(rt.topk_ids, vec![0, 1, 2, 0]);
        let w = if renorm {
            vec![
                E / (E + 1.0),
                1.0 / (E + 1.0),
                e2 / (e2 + 1.0),
                1.0 / (e2 + 1.0),
            ]
        } else {
            vec![E / d0, 1.0 / d0, e2 / d1, 1.0 / d1]
        };
        assert_close(&rt.topk_weights, &w, 1e-15, "weights");
        assert_eq!(rt.expert_counts, vec![2, 1, 1]);
        let pm = [
            (E / d0 + 1.0 / d1) / 2.0,
            (1.0 / d0 + 1.0 / d1) / 2.0,
            (1.0 / d0 + e2 / d1) / 2.0,
        ];
        let aux = 3.0 * (0.5 * pm[0] + 0.25 * pm[1] + 0.25 * pm[2]);
        assert_close(&[rt.aux_loss], &[aux], 1e-15, "aux");
        let z = (d0.ln().powi(2) + d1.ln().powi(2)) / 2.0;
        assert_close(&[rt.z_loss], &[z], 1e-15, "z");
        assert_close(&r.out, &combine(&w), 1e-14, "out");
        assert_eq!(&route(&p, &x).unwrap(), rt);
    }
}

#[test]
fn hand_computed_tiny_moe_sigmoid() {
    let (a, c) = (sigmoid(1.0), sigmoid(2.0));
    for renorm in [false, true] {
        let (p, x) = tiny(Scoring::Sigmoid, renorm);
        let r = moe_f64(&p, &x).unwrap();
        let rt = &r.routing;
        // t0 scores (σ1, ½, ½); t1 scores (½, ½, σ2).
        assert_eq!(rt.topk_ids, vec![0, 1, 2, 0]);
        let w = if renorm {
            vec![
                a / (a + 0.5),
                0.5 / (a + 0.5),
                c / (c + 0.5),
                0.5 / (c + 0.5),
            ]
        } else {
            vec![a, 0.5, c, 0.5]
        };
        assert_close(&rt.topk_weights, &w, 1e-15, "weights");
        assert_eq!(rt.expert_counts, vec![2, 1, 1]);
        // Aux loss uses the sigmoid scores normalised per token.
        let pm = [
            (a / (a + 1.0) + 0.5 / (c + 1.0)) / 2.0,
            (0.5 / (a + 1.0) + 0.5 / (c + 1.0)) / 2.0,
            (0.5 / (a + 1.0) + c / (c + 1.0)) / 2.0,
        ];
        let aux = 3.0 * (0.5 * pm[0] + 0.25 * pm[1] + 0.25 * pm[2]);
        assert_close(&[rt.aux_loss], &[aux], 1e-15, "aux");
        // z-loss is on the logits, independent of the scoring.
        let z = ((E + 2.0).ln().powi(2) + (E * E + 2.0).ln().powi(2)) / 2.0;
        assert_close(&[rt.z_loss], &[z], 1e-15, "z");
        assert_close(&r.out, &combine(&w), 1e-14, "out");
    }
}

#[test]
fn equal_logits_pick_lower_expert_indices() {
    for scoring in [Scoring::Softmax, Scoring::Sigmoid] {
        for renorm in [false, true] {
            let p = MoeProblem {
                renormalize: renorm,
                ..problem(3, 4, 2, 5, 3, scoring)
            };
            let mut x = MoeInputs::generate(&p, 1);
            x.router.iter_mut().for_each(|v| *v = 0.0);
            let r = route(&p, &x).unwrap();
            assert_eq!(r.topk_ids, [0, 1, 2].repeat(3), "{scoring:?}");
            assert_eq!(r.expert_counts, vec![3, 3, 3, 0, 0]);
            let w = match (renorm, scoring) {
                (true, _) => 1.0 / 3.0,
                (false, Scoring::Softmax) => 0.2,
                (false, Scoring::Sigmoid) => 0.5,
            };
            assert_close(&r.topk_weights, &[w; 9], 1e-15, "weights");
            // f = (⅓, ⅓, ⅓, 0, 0), P = ⅕ each → aux = 5·3·(⅓·⅕) = 1.
            assert_close(&[r.aux_loss], &[1.0], 1e-15, "aux");
            assert_close(&[r.z_loss], &[5f64.ln().powi(2)], 1e-15, "z");
        }
    }
}

#[test]
fn routing_invariants_on_random_inputs() {
    for (scoring, renorm) in [
        (Scoring::Softmax, true),
        (Scoring::Softmax, false),
        (Scoring::Sigmoid, true),
        (Scoring::Sigmoid, false),
    ] {
        let p = MoeProblem {
            renormalize: renorm,
            ..problem(37, 24, 8, 8, 2, scoring)
        };
        let x = MoeInputs::generate(&p, 9);
        let r = route(&p, &x).unwrap();
        assert_eq!(r.topk_ids.len(), 37 * 2);
        assert_eq!(r.expert_counts.iter().sum::<usize>(), 37 * 2);
        for (ids, w) in r.topk_ids.chunks(2).zip(r.topk_weights.chunks(2)) {
            assert!(ids[0] != ids[1] && ids.iter().all(|&i| i < 8));
            assert!(w[0] >= w[1] && w[1] > 0.0, "{w:?}");
            let s: f64 = w.iter().sum();
            if renorm {
                assert!((s - 1.0).abs() < 1e-15);
            } else {
                assert!(s < 1.0 || scoring == Scoring::Sigmoid);
            }
        }
        for (e, &c) in r.expert_counts.iter().enumerate() {
            assert_eq!(c, r.topk_ids.iter().filter(|&&i| i as usize == e).count());
        }
        assert!(r.aux_loss > 0.0 && r.z_loss > 0.0);
        // Deterministic, and moe_f64 routes the same way.
        let m = moe_f64(&p, &x).unwrap();
        assert_eq!(m.routing, r);
        assert_eq!(moe_f64(&p, &x).unwrap(), m);
        assert!(m.out.iter().all(|v| v.is_finite()) && m.out.iter().any(|&v| v != 0.0));
    }
}

#[test]
fn shared_expert_adds_its_output_with_weight_one() {
    let p = MoeProblem {
        shared_expert: true,
        renormalize: true,
        ..problem(9, 16, 12, 4, 2, Scoring::Softmax)
    };
    let x = MoeInputs::generate(&p, 3);
    let with = moe_f64(&p, &x).unwrap();
    let plain_p = MoeProblem {
        shared_expert: false,
        ..p.clone()
    };
    // Without the flag the shared weights are ignored.
    let without = moe_f64(&plain_p, &x).unwrap();
    // The shared expert alone: one expert, top-1, renormalised → weight exactly 1.
    let one = MoeProblem {
        experts: 1,
        top_k: 1,
        ..plain_p.clone()
    };
    let xs = MoeInputs {
        x: x.x.clone(),
        router: vec![0.0; 16],
        w13: x.shared_w13.clone().unwrap(),
        w2: x.shared_w2.clone().unwrap(),
        shared_w13: None,
        shared_w2: None,
    };
    let shared = moe_f64(&one, &xs).unwrap();
    assert!(shared.routing.topk_weights.iter().all(|&w| w == 1.0));
    let sum: Vec<f64> = without
        .out
        .iter()
        .zip(&shared.out)
        .map(|(a, b)| a + b)
        .collect();
    assert_close(&with.out, &sum, 1e-13, "shared");
    assert_eq!(with.routing, without.routing);
    assert!(shared.out.iter().any(|&v| v.abs() > 1e-3));
}

#[test]
fn top_k_equal_to_experts_uses_every_expert() {
    let p = problem(11, 8, 4, 4, 4, Scoring::Softmax);
    let x = MoeInputs::generate(&p, 17);
    let r = moe_f64(&p, &x).unwrap();
    assert_eq!(r.routing.expert_counts, vec![11; 4]);
    for (ids, w) in r
        .routing
        .topk_ids
        .chunks(4)
        .zip(r.routing.topk_weights.chunks(4))
    {
        let mut sorted = ids.to_vec();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2, 3]);
        assert!(w.windows(2).all(|p| p[0] >= p[1]));
        assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-15);
    }
    // f_i = 1/E for every expert and Σ P_i = 1 → aux = 1 exactly (up to rounding).
    assert!(
        (r.routing.aux_loss - 1.0).abs() < 1e-14,
        "{}",
        r.routing.aux_loss
    );
    // Softmax weights already sum to 1: renormalising changes nothing.
    let rn = moe_f64(
        &MoeProblem {
            renormalize: true,
            ..p.clone()
        },
        &x,
    )
    .unwrap();
    assert_close(&rn.out, &r.out, 1e-14, "renorm with k = E");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let p = problem(4, 8, 4, 3, 2, Scoring::Softmax);
    let x = MoeInputs::generate(&p, 1);
    let mut bad = x.clone();
    bad.w13.pop();
    match moe_f64(&p, &bad).unwrap_err() {
        Error::BufferSize {
            name,
            expected,
            actual,
        } => assert_eq!(
            (name.as_str(), expected, actual),
            ("w13", 3 * 8 * 2 * 4, 191)
        ),
        e => panic!("unexpected {e}"),
    }
    assert!(route(&p, &bad).is_ok(), "routing needs only x and router");
    bad = x.clone();
    bad.router.push(0.0);
    assert!(route(&p, &bad).unwrap_err().to_string().contains("router"));
    bad = x.clone();
    bad.x.clear();
    assert!(moe_f64(&p, &bad).unwrap_err().to_string().contains("for x"));
    bad = x.clone();
    bad.w2.push(1.0);
    assert!(moe_f64(&p, &bad).unwrap_err().to_string().contains("w2"));
    let shared = MoeProblem {
        shared_expert: true,
        ..p.clone()
    };
    let e = moe_f64(&shared, &x).unwrap_err();
    assert!(matches!(e, Error::InvalidProblem(_)) && e.to_string().contains("shared"));
    let mut xs = MoeInputs::generate(&shared, 1);
    xs.shared_w2.as_mut().unwrap().pop();
    assert!(moe_f64(&shared, &xs)
        .unwrap_err()
        .to_string()
        .contains("shared_w2"));
    let k = MoeProblem {
        top_k: 4,
        ..p.clone()
    };
    assert!(matches!(route(&k, &x), Err(Error::InvalidProblem(_))));
    let huge = MoeProblem {
        hidden: usize::MAX / 2,
        ..p.clone()
    };
    assert!(matches!(moe_f64(&huge, &x), Err(Error::InvalidProblem(_))));
    assert!(MoeInputs::generate(&huge, 1).x.is_empty());
}

#[test]
fn generated_inputs_have_the_documented_shapes_and_scales() {
    let p = MoeProblem {
        shared_expert: true,
        dtype: DType::Bf16,
        ..problem(5, 64, 16, 4, 2, Scoring::Softmax)
    };
    let x = MoeInputs::generate(&p, 2);
    assert_eq!(x.x.len(), 5 * 64);
    assert_eq!(x.router.len(), 64 * 4);
    assert_eq!(x.w13.len(), 4 * 64 * 32);
    assert_eq!(x.w2.len(), 4 * 16 * 64);
    assert_eq!(x.shared_w13.as_ref().unwrap().len(), 64 * 32);
    assert_eq!(x.shared_w2.as_ref().unwrap().len(), 16 * 64);
    assert_eq!(x.x, generate(2, TensorId::MoeX, 5 * 64, 1.0, DType::Bf16));
    let bound = |v: &[f32], s: f32| v.iter().all(|&a| a.abs() <= s * 1.004);
    assert!(bound(&x.x, 1.0));
    assert!(bound(&x.router, 0.125) && bound(&x.w13, 0.125));
    assert!(bound(&x.w2, 0.25) && bound(x.shared_w2.as_ref().unwrap(), 0.25));
    assert!(x.router.iter().any(|&a| a.abs() > 0.1));
    assert!(x.w2.iter().any(|&a| a.abs() > 0.2));
    for t in [&x.x, &x.router, &x.w13, &x.w2] {
        assert!(t.iter().all(|&v| DType::Bf16.round(v) == v));
    }
    assert_ne!(x.shared_w13.as_ref().unwrap()[..], x.w13[..64 * 32]);
    let plain = MoeInputs::generate(
        &MoeProblem {
            shared_expert: false,
            ..p
        },
        2,
    );
    assert!(plain.shared_w13.is_none() && plain.shared_w2.is_none());
    assert_eq!(plain.w13, x.w13);
}

/// Straight per-token loops, no permutation or blocking.
fn naive_moe(p: &MoeProblem, x: &MoeInputs, ids: &[u32], weights: &[f64]) -> Vec<f64> {
    let (h, i, k) = (p.hidden, p.intermediate, p.top_k);
    let expert = |w13: &[f32], w2: &[f32], xt: &[f32]| -> Vec<f64> {
        let act: Vec<f64> = (0..i)
            .map(|j| {
                let g: f64 = (0..h)
                    .map(|c| xt[c] as f64 * w13[c * 2 * i + j] as f64)
                    .sum();
                let u: f64 = (0..h)
                    .map(|c| xt[c] as f64 * w13[c * 2 * i + i + j] as f64)
                    .sum();
                silu(g) * u
            })
            .collect();
        (0..h)
            .map(|o| (0..i).map(|j| act[j] * w2[j * h + o] as f64).sum())
            .collect()
    };
    let mut out = vec![0f64; p.tokens * h];
    for t in 0..p.tokens {
        let xt = &x.x[t * h..(t + 1) * h];
        for s in 0..k {
            let e = ids[t * k + s] as usize;
            let y = expert(
                &x.w13[e * h * 2 * i..(e + 1) * h * 2 * i],
                &x.w2[e * i * h..(e + 1) * i * h],
                xt,
            );
            for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(y) {
                *o += weights[t * k + s] * v;
            }
        }
        if p.shared_expert {
            let y = expert(
                x.shared_w13.as_ref().unwrap(),
                x.shared_w2.as_ref().unwrap(),
                xt,
            );
            for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(y) {
                *o += v;
            }
        }
    }
    out
}

#[test]
fn grouped_experts_match_a_naive_per_token_loop() {
    // 70 tokens over 3 experts, top-2: several blocks of 16 per expert, ragged tails.
    for shared in [false, true] {
        let p = MoeProblem {
            shared_expert: shared,
            renormalize: true,
            dtype: DType::Bf16,
            ..problem(70, 12, 10, 3, 2, Scoring::Sigmoid)
        };
        let x = MoeInputs::generate(&p, 12);
        let r = moe_f64(&p, &x).unwrap();
        assert!(r.routing.expert_counts.iter().all(|&c| c > 16));
        let want = naive_moe(&p, &x, &r.routing.topk_ids, &r.routing.topk_weights);
        assert_close(&r.out, &want, 1e-13, "grouped vs naive");
    }
}

#[test]
fn compare_routing_accepts_near_ties_only() {
    use super::moe::{compare_routing, Routing, ROUTING_TIE_REL};
    // 2 tokens, 4 experts, top-2. Token 0: experts 1 and 2 tie within 1e-6; token 1
    // has clear gaps.
    let routing = Routing {
        topk_ids: vec![3, 1, 0, 2],
        topk_weights: vec![0.5; 4],
        expert_counts: vec![1, 1, 1, 1],
        aux_loss: 0.0,
        z_loss: 0.0,
        logits: vec![-1.0, 1.0, 1.0 - 1e-6, 2.0, 3.0, -2.0, 1.0, 0.5],
    };
    let c = compare_routing(&[3, 1, 0, 2], &routing, 4);
    assert_eq!((c.slots, c.near_ties, c.mismatched), (4, 0, 0));
    // the near-tied expert instead of the reference's: accepted
    let c = compare_routing(&[3, 2, 0, 2], &routing, 4);
    assert_eq!((c.near_ties, c.mismatched), (1, 0));
    // a clear gap (token 1: expert 3 at 0.5 vs expert 2 at 1.0): a mismatch
    let c = compare_routing(&[3, 1, 0, 3], &routing, 4);
    assert_eq!((c.near_ties, c.mismatched), (0, 1));
    // an invalid id and a short list are mismatches
    let c = compare_routing(&[3, 9, 0], &routing, 4);
    assert_eq!((c.near_ties, c.mismatched), (0, 2));
    // the tolerance scales with the token's largest |logit| (3.0 for token 0)
    let mut wide = routing.clone();
    wide.logits[2] = 1.0 - 2.0 * ROUTING_TIE_REL * 3.0;
    let c = compare_routing(&[3, 2, 0, 2], &wide, 4);
    assert_eq!((c.near_ties, c.mismatched), (0, 1));
}

#[test]
fn reference_routing_keeps_its_logits() {
    let p = MoeProblem {
        tokens: 3,
        hidden: 16,
        intermediate: 8,
        experts: 4,
        top_k: 2,
        scoring: Scoring::Softmax,
        renormalize: true,
        dtype: DType::F32,
        shared_expert: false,
    };
    let x = MoeInputs::generate(&p, 7);
    let r = route(&p, &x).unwrap();
    assert_eq!(r.logits.len(), 12);
    // token 1, expert 2: x[1] . router[:, 2]
    let want: f64 = (0..16)
        .map(|h| x.x[16 + h] as f64 * x.router[h * 4 + 2] as f64)
        .sum();
    assert!((r.logits[6] - want).abs() < 1e-12);
}
