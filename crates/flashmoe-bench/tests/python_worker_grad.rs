//! The gradient baselines (`python/flashmoe_grad.py`) through the real worker in its CPU
//! development mode and the lab's pipeline: each gated against the f64 backward. Needs a
//! Python with torch: set FLASHMOE_TEST_TORCH_PYTHON (skipped otherwise).

use flashmoe::{AttentionProblem, DType, MoeProblem, Scoring};
use flashmoe_bench::config::Suite;
use flashmoe_bench::grad::{GradLayer, GradProblem, GradReference, Pass};
use flashmoe_bench::results::{MeasureSettings, ProblemSpec};
use flashmoe_bench::runner::pipeline::Pipeline;
use flashmoe_bench::runner::python::{baselines_with, WorkerOptions};
use flashmoe_bench::runner::Implementation;
use std::sync::atomic::AtomicBool;

#[test]
fn gradient_baselines_on_the_cpu_worker_pass_the_gradient_gate() {
    let Ok(py) = std::env::var("FLASHMOE_TEST_TORCH_PYTHON") else {
        eprintln!(
            "SKIPPED: set FLASHMOE_TEST_TORCH_PYTHON to a Python with torch to run this test"
        );
        return;
    };
    let settings = MeasureSettings {
        warmup_ms: 0.0,
        min_samples: 3,
        max_samples: 5,
        max_time_ms: 2000.0,
        ..MeasureSettings::default()
    };
    let mut gqa = AttentionProblem::new(2, 4, 48, 64, true, DType::Bf16);
    gqa.heads_kv = 2;
    let mut cross = AttentionProblem::new(1, 2, 40, 64, true, DType::F16);
    cross.seqlen_k = 70;
    let moe = |shared| MoeProblem {
        tokens: 48,
        hidden: 64,
        intermediate: 32,
        experts: 6,
        top_k: 2,
        scoring: Scoring::Softmax,
        renormalize: true,
        dtype: DType::Bf16,
        shared_expert: shared,
    };
    let sigmoid = MoeProblem {
        scoring: Scoring::Sigmoid,
        renormalize: false,
        ..moe(false)
    };
    let mut windowed = AttentionProblem::new(1, 4, 50, 32, false, DType::Bf16);
    windowed.heads_kv = 1;
    windowed.window = (12, 3);
    windowed.softcap = 4.0;
    let cases = [
        (Suite::Attention, GradLayer::Attention(windowed), Pass::Bwd),
        (Suite::Attention, GradLayer::Attention(gqa), Pass::Bwd),
        (Suite::Attention, GradLayer::Attention(cross), Pass::FwdBwd),
        (Suite::Moe, GradLayer::Moe(moe(true)), Pass::Bwd),
        (Suite::Moe, GradLayer::Moe(sigmoid), Pass::FwdBwd),
    ];
    for (suite, layer, pass) in cases {
        let problem = ProblemSpec::Grad(GradProblem::new(pass, layer));
        let mut opts = WorkerOptions::new(&py);
        opts.device = Some("cpu".into());
        let (impls, _) = baselines_with(suite, opts, settings.seed).unwrap();
        let refs: Vec<&dyn Implementation> = impls.iter().map(|b| b.as_ref()).collect();
        let reference = GradReference::default();
        let pipeline = Pipeline {
            implementations: refs,
            reference: &reference,
            candidate: impls[0].name().to_string(),
            settings: settings.clone(),
            ceilings: None,
            calibration: None,
        };
        let res = pipeline
            .run_config(&problem, &AtomicBool::new(false), |_| {})
            .unwrap();
        for row in &res.implementations {
            eprintln!(
                "{} / {}: samples {} error={:?} acc={:?}",
                problem.label(),
                row.name,
                row.samples_ms.len(),
                row.error,
                row.accuracy.as_ref().map(|a| (a.passed, a.note.clone()))
            );
        }
        // SDPA's CPU flash backend and the two MoE autograd paths run on the CPU; cuDNN, the
        // efficient kernel and FlexAttention's backward are CUDA-only.
        let must_pass: &[&str] = match suite {
            Suite::Attention => &["sdpa-flash"],
            _ => &["moe-naive-loop", "moe-grouped-mm"],
        };
        // Windows and softcap: flex only, and torch has no FlexAttention backward on the
        // CPU: every baseline says why it did not run.
        if matches!(&problem, ProblemSpec::Grad(g)
            if matches!(&g.layer, GradLayer::Attention(a) if a.softcap > 0.0))
        {
            for row in &res.implementations {
                let e = row.error.as_deref().unwrap_or_default();
                assert!(
                    e.starts_with("n/a: ") || !row.is_usable(),
                    "{}: {e}",
                    row.name
                );
            }
            let flex = res.implementations.iter().find(|r| r.name == "flex");
            assert!(flex.is_some_and(|r| r.error.as_deref().unwrap_or("").contains("CPU")));
        }
        let windowed = matches!(&problem, ProblemSpec::Grad(g)
            if matches!(&g.layer, GradLayer::Attention(a) if a.softcap > 0.0));
        for name in must_pass.iter().filter(|_| !windowed) {
            let row = res
                .implementations
                .iter()
                .find(|r| r.name == *name)
                .unwrap();
            assert!(row.is_usable(), "{}: {name}: {row:?}", problem.label());
        }
    }
}
