//! MoE tests that need a GPU (they print "skipped: no GPU" elsewhere). On the GPU machine:
//! `cargo test -p flashmoe --release -- gpu_tests --nocapture --test-threads=1`.
//!
//! The whole pipeline against the CPU f64 reference `moe_f64` on small shapes: routing
//! identical (ids and per-expert counts), weights close, aux and z losses within 1e-4
//! relative, output relative L2 ≤ 1.6e-2 (bf16) — tokens 1, 7, 128; top_k 1, 2, 8;
//! softmax and sigmoid; an expert that gets no token; a shared expert; fp16.

use super::*;
use crate::accuracy::error_metrics;
use crate::dtype::DType;
use crate::error::Error;
use crate::gpu::test_support::with_gpu;
use crate::gpu::Device;
use crate::moe::gemm::tiles;
use crate::moe::reference;
use crate::moe::runner::*;
use crate::problem::MoeProblem;
use crate::problem::Scoring;
use crate::reference::moe::moe_f64;
use crate::reference::moe::MoeInputs;

const EXPERTS: usize = 16;
/// Expert whose router column is a copy of `TIED_LOW`'s: with equal logits the lower index
/// wins, so with top_k = 1 this expert never gets a token.
const TIED_HIGH: usize = 11;
const TIED_LOW: usize = 4;

fn problem(tokens: usize, top_k: usize, scoring: Scoring, dtype: DType) -> MoeProblem {
    MoeProblem {
        tokens,
        hidden: 256,
        intermediate: 256,
        experts: EXPERTS,
        top_k,
        scoring,
        renormalize: true,
        dtype,
        shared_expert: false,
    }
}

fn inputs(p: &MoeProblem) -> MoeInputs {
    let mut x = MoeInputs::generate(p, 42);
    for h in 0..p.hidden {
        x.router[h * p.experts + TIED_HIGH] = x.router[h * p.experts + TIED_LOW];
    }
    x
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// Run the pipeline once and compare everything with the CPU reference.
fn check_case(dev: &Device, p: &MoeProblem) {
    check_case_path(dev, p, None)
}

#[allow(clippy::needless_range_loop)]
fn check_case_path(dev: &Device, p: &MoeProblem, path: Option<&str>) {
    let x = inputs(p);
    let reference = moe_f64(p, &x).unwrap();
    let mut r = MoeRunner::with_gemm_path(dev, p, &x, path).unwrap_or_else(|e| panic!("{p}: {e}"));
    eprintln!("  {p}: {}", r.gemm_path());
    r.poison_outputs(dev).unwrap();
    r.run(dev).unwrap();
    dev.synchronize().unwrap_or_else(|e| panic!("{p}: {e}"));
    let g = r.gpu_routing(dev).unwrap();
    if let Some(m) = routing_mismatch(&g.topk_ids, &reference.routing.topk_ids, p.top_k) {
        panic!("{p}: {m}");
    }
    let want_counts: Vec<u32> = reference
        .routing
        .expert_counts
        .iter()
        .map(|&c| c as u32)
        .collect();
    assert_eq!(g.counts, want_counts, "{p}: per-expert counts");
    if p.top_k == 1 {
        assert_eq!(g.counts[TIED_HIGH], 0, "{p}: tied expert must get no token");
    }
    for (i, (&w, &rw)) in g
        .topk_w
        .iter()
        .zip(&reference.routing.topk_weights)
        .enumerate()
    {
        assert!(
            (w as f64 - rw).abs() <= 1e-5 + 1e-4 * rw.abs(),
            "{p}: weight {i}: {w} vs {rw}"
        );
    }
    assert!(
        rel(g.aux_loss, reference.routing.aux_loss) <= 1e-4,
        "{p}: aux {} vs {}",
        g.aux_loss,
        reference.routing.aux_loss
    );
    assert!(
        rel(g.z_loss, reference.routing.z_loss) <= 1e-4,
        "{p}: z {} vs {}",
        g.z_loss,
        reference.routing.z_loss
    );

    // Permutation: offsets = scan of counts; rows grouped by expert in token order;
    // slot_row the inverse of row_slot.
    let (offsets, row_token, row_slot, slot_row) = r.permutation(dev).unwrap();
    let mut acc = 0u32;
    for e in 0..p.experts {
        assert_eq!(offsets[e], acc, "{p}: offsets[{e}]");
        acc += g.counts[e];
        for row in offsets[e]..offsets[e] + g.counts[e] {
            let s = row_slot[row as usize] as usize;
            assert_eq!(g.topk_ids[s], e as u32, "{p}: row {row}");
            assert_eq!(row_token[row as usize] as usize, s / p.top_k);
            assert_eq!(slot_row[s], row);
            if row > offsets[e] {
                assert!(
                    row_token[row as usize - 1] < row_token[row as usize],
                    "{p}: stable"
                );
            }
        }
    }
    assert_eq!(offsets[p.experts] as usize, p.tokens * p.top_k);

    let out = r.output(dev).unwrap();
    assert!(out.iter().all(|v| v.is_finite()), "{p}: non-finite output");
    let m = error_metrics(&out, &reference.out);
    let tol = if p.dtype == DType::Bf16 { 1.6e-2 } else { 4e-3 };
    eprintln!(
        "  {p}: rel_l2 {:.2e} max_abs {:.2e} aux {:.6} z {:.6} counts {:?}",
        m.rel_l2, m.max_abs, g.aux_loss, g.z_loss, g.counts
    );
    assert!(m.rel_l2 <= tol, "{p}: rel_l2 {} > {tol}", m.rel_l2);

    // Deterministic: a second run is bit-identical.
    r.poison_outputs(dev).unwrap();
    r.run(dev).unwrap();
    assert_eq!(r.output(dev).unwrap(), out, "{p}: second run differs");
}

#[test]
fn moe_matches_cpu_reference_matrix() {
    with_gpu("moe_matrix", |dev| {
        for scoring in [Scoring::Softmax, Scoring::Sigmoid] {
            for tokens in [1, 7, 128] {
                for top_k in [1, 2, 8] {
                    check_case(dev, &problem(tokens, top_k, scoring, DType::Bf16));
                }
            }
        }
    });
}

#[test]
fn router_gemm_matches_cpu_reference_at_ragged_token_counts() {
    // 32 experts: the router logits take the tensor-core GEMM (select::select), whose
    // 16-row tiles are ragged at 7 and 100 tokens; experts TIED_LOW and TIED_HIGH have
    // equal router columns, so the tie-break is exercised through the GEMM too.
    with_gpu("moe_router_gemm", |dev| {
        for scoring in [Scoring::Softmax, Scoring::Sigmoid] {
            for tokens in [7, 100] {
                let p = MoeProblem {
                    experts: 32,
                    ..problem(tokens, 2, scoring, DType::Bf16)
                };
                let k = select::select(&p).unwrap();
                assert_eq!(k[select::K_LOGITS].entry, tiles::GEMM2_ENTRY, "{p}");
                check_case(dev, &p);
            }
        }
    });
}

#[test]
fn moe_fp16_no_renorm_and_shared_expert() {
    with_gpu("moe_variants", |dev| {
        let mut p = problem(7, 2, Scoring::Softmax, DType::F16);
        check_case(dev, &p);
        p.renormalize = false;
        p.scoring = Scoring::Sigmoid;
        check_case(dev, &p);
        let s = MoeProblem {
            shared_expert: true,
            dtype: DType::Bf16,
            ..problem(128, 2, Scoring::Softmax, DType::Bf16)
        };
        check_case(dev, &s);
    });
}

#[test]
fn moe_bad_input_is_a_clear_error() {
    with_gpu("moe_errors", |dev| {
        let p = problem(7, 2, Scoring::Softmax, DType::Bf16);
        let mut x = inputs(&p);
        x.w13.truncate(10);
        match MoeRunner::new(dev, &p, &x) {
            Err(Error::BufferSize { name, .. }) => assert_eq!(name, "w13"),
            other => panic!("{other:?}"),
        }
        let big = MoeProblem {
            experts: 300,
            ..p.clone()
        };
        let e = MoeRunner::new(dev, &big, &MoeInputs::generate(&big, 1)).unwrap_err();
        assert!(e.to_string().contains("experts = 300"), "{e}");
        let zero = MoeProblem { tokens: 0, ..p };
        assert!(matches!(
            MoeRunner::new(dev, &zero, &inputs(&zero)),
            Err(Error::InvalidProblem(_))
        ));
    });
}

/// The sm_90 (wgmma/TMA) grouped GEMMs forced onto small shapes: 64-row tiles (64 rows per
/// expert) and 128-row tiles (256 rows per expert), ragged row tiles, an empty expert,
/// fp16 and bf16. Skipped on devices other than compute capability 9.0.
#[test]
fn moe_sm90_gemms_match_cpu_reference() {
    with_gpu("moe_sm90", |dev| {
        if dev.arch() != 90 {
            eprintln!(
                "moe_sm90: skipped: compute capability {} is not 9.0",
                dev.arch()
            );
            return;
        }
        let shape = |tokens, top_k, dtype| MoeProblem {
            hidden: 512,
            intermediate: 256,
            ..problem(tokens, top_k, Scoring::Softmax, dtype)
        };
        for (tokens, top_k) in [(7, 1), (128, 8), (100, 8), (512, 8)] {
            check_case_path(dev, &shape(tokens, top_k, DType::Bf16), Some("sm90"));
        }
        check_case_path(dev, &shape(512, 8, DType::F16), Some("sm90"));
        check_case_path(dev, &shape(128, 8, DType::F16), Some("sm90"));
    });
}

/// The GPU fp32 reference against the CPU f64 reference: routing identical (ids,
/// counts), weights and losses close, output relative L2 at fp32 level (not bf16).
fn check_gpu_reference(dev: &Device, p: &MoeProblem) {
    let x = inputs(p);
    let want = moe_f64(p, &x).unwrap();
    let got = reference::moe_reference_gpu(dev, p, &x).unwrap_or_else(|e| panic!("{p}: {e}"));
    if let Some(m) = routing_mismatch(&got.routing.topk_ids, &want.routing.topk_ids, p.top_k) {
        panic!("{p}: GPU reference {m}");
    }
    assert_eq!(got.routing.expert_counts, want.routing.expert_counts, "{p}");
    for (a, b) in got
        .routing
        .topk_weights
        .iter()
        .zip(&want.routing.topk_weights)
    {
        assert!((a - b).abs() <= 1e-6, "{p}: weight {a} vs {b}");
    }
    assert!(
        rel(got.routing.aux_loss, want.routing.aux_loss) <= 1e-5,
        "{p}"
    );
    assert!(rel(got.routing.z_loss, want.routing.z_loss) <= 1e-5, "{p}");
    let out: Vec<f32> = got.out.iter().map(|&v| v as f32).collect();
    assert!(out.iter().all(|v| v.is_finite()), "{p}: non-finite");
    let m = error_metrics(&out, &want.out);
    eprintln!(
        "  gpu-reference {p}: rel_l2 {:.2e} max_abs {:.2e}",
        m.rel_l2, m.max_abs
    );
    assert!(m.rel_l2 <= 1e-5, "{p}: GPU reference rel_l2 {}", m.rel_l2);
}

#[test]
fn gpu_reference_matches_cpu_f64() {
    with_gpu("moe_gpu_reference", |dev| {
        for scoring in [Scoring::Softmax, Scoring::Sigmoid] {
            for (tokens, top_k) in [(1, 8), (7, 1), (128, 2), (300, 8)] {
                check_gpu_reference(dev, &problem(tokens, top_k, scoring, DType::Bf16));
            }
        }
        // Ragged shapes (not multiples of the 64-wide tiles), fp16, shared expert.
        let odd = MoeProblem {
            hidden: 72,
            intermediate: 40,
            shared_expert: true,
            dtype: DType::F16,
            renormalize: false,
            ..problem(67, 2, Scoring::Softmax, DType::F16)
        };
        check_gpu_reference(dev, &odd);
    });
}

#[test]
fn fast_path_matches_gpu_reference_on_a_larger_shape() {
    // Above the CPU reference's size: the fast path against the GPU reference, the way
    // `flashmoe check` and the bench gate large shapes.
    with_gpu("moe_vs_gpu_reference", |dev| {
        let p = MoeProblem {
            tokens: 2048,
            hidden: 1024,
            intermediate: 512,
            experts: 64,
            top_k: 8,
            ..problem(1, 1, Scoring::Sigmoid, DType::Bf16)
        };
        let x = MoeInputs::generate(&p, 7);
        let want = reference::moe_reference_gpu(dev, &p, &x).unwrap();
        let mut r = MoeRunner::new(dev, &p, &x).unwrap();
        r.poison_outputs(dev).unwrap();
        r.run(dev).unwrap();
        let g = r.gpu_routing(dev).unwrap();
        if let Some(m) = routing_mismatch(&g.topk_ids, &want.routing.topk_ids, p.top_k) {
            panic!("{p}: {m}");
        }
        assert!(rel(g.aux_loss, want.routing.aux_loss) <= 1e-4, "{p}");
        assert!(rel(g.z_loss, want.routing.z_loss) <= 1e-4, "{p}");
        let out = r.output(dev).unwrap();
        let m = error_metrics(&out, &want.out);
        eprintln!("  {p}: rel_l2 {:.2e} vs the GPU reference", m.rel_l2);
        assert!(m.non_finite == 0 && m.rel_l2 <= 1.6e-2, "{p}: {m:?}");
    });
}

#[test]
fn nan_in_the_input_reaches_the_output() {
    // A NaN in x must not be hidden (e.g. by a max that drops it): the token's output is
    // NaN, so the correctness gate reports it; the other tokens stay finite.
    with_gpu("moe_nan_input", |dev| {
        let p = problem(7, 2, Scoring::Softmax, DType::Bf16);
        let mut x = inputs(&p);
        x.x[3 * p.hidden + 5] = f32::NAN;
        let mut r = MoeRunner::new(dev, &p, &x).unwrap();
        r.poison_outputs(dev).unwrap();
        r.run(dev).unwrap();
        let out = r.output(dev).unwrap();
        for (t, row) in out.chunks(p.hidden).enumerate() {
            let nan = row.iter().any(|v| v.is_nan());
            assert_eq!(nan, t == 3, "token {t}: NaN {nan}");
        }
        let g = r.gpu_routing(dev).unwrap();
        assert!(g.topk_ids.iter().all(|&id| (id as usize) < p.experts));
    });
}
