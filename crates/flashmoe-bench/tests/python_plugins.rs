//! `--impl py:MODULE:FUNCTION`: a Python callable hosted by python/flashmoe_plugins.py goes
//! through the same gate and timing as the built-in implementations. Needs python3 with
//! numpy (test.sh installs it); skipped with a note otherwise.

use flashmoe::{AttentionProblem, DType};
use flashmoe_bench::results::{MeasureSettings, ProblemSpec};
use flashmoe_bench::runner::cpu::{CpuImplementation, CpuReference};
use flashmoe_bench::runner::pipeline::Pipeline;
use flashmoe_bench::runner::python;
use std::path::Path;
use std::sync::atomic::AtomicBool;

fn have_numpy() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import numpy"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn example(func: &str) -> String {
    let file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../python/plugin_examples/numpy_attention.py")
        .canonicalize()
        .unwrap();
    format!("py:{}:{func}", file.display())
}

#[test]
fn a_python_plugin_is_gated_and_timed_like_any_implementation() {
    if !have_numpy() {
        eprintln!("skipped: python3 with numpy not available");
        return;
    }
    let specs = vec![example("attention"), example("wrong")];
    let plugins = python::plugins(&specs, Path::new("python3"), false, None, 0x5eed).unwrap();
    let tiled = CpuImplementation::tiled();
    let mut implementations: Vec<&dyn flashmoe_bench::Implementation> = vec![&tiled];
    implementations.extend(plugins.iter().map(|p| p.as_ref()));
    let pipeline = Pipeline {
        implementations,
        reference: &CpuReference,
        candidate: "cpu-tiled".into(),
        settings: MeasureSettings {
            warmup_ms: 0.0,
            min_samples: 5,
            max_samples: 10,
            max_time_ms: 2_000.0,
            bootstrap_resamples: 200,
            ..MeasureSettings::default()
        },
        ceilings: None,
        calibration: None,
    };
    // GQA and bottom-right causal: the plug-in sees the lab's layouts and semantics.
    let mut p = AttentionProblem::new(2, 4, 40, 32, true, DType::Bf16);
    p.heads_kv = 2;
    p.seqlen_q = 24;
    let r = pipeline
        .run_config(&ProblemSpec::Attention(p), &AtomicBool::new(false), |_| {})
        .unwrap();
    let get = |n: &str| r.implementations.iter().find(|i| i.name == n).unwrap();
    let good = get(&specs[0]);
    assert_eq!(good.backend, "python-plugin");
    let acc = good.accuracy.as_ref().expect("gated");
    assert!(acc.passed, "{acc:?} {:?}", good.error);
    assert!(good.samples_ms.len() >= 5 && good.samples_ms.iter().all(|&x| x > 0.0));
    assert_eq!(good.input_checksum, get("cpu-tiled").input_checksum);
    let bad = get(&specs[1]);
    assert!(!bad.accuracy.as_ref().unwrap().passed);
    assert!(bad.samples_ms.is_empty(), "a failed gate is never timed");

    // MoE problems are n/a for plug-ins; a malformed spec is a clear error.
    let moe = ProblemSpec::Moe(flashmoe::MoeProblem {
        tokens: 3,
        hidden: 32,
        intermediate: 16,
        experts: 8,
        top_k: 2,
        scoring: flashmoe::Scoring::Softmax,
        renormalize: true,
        dtype: DType::Bf16,
        shared_expert: false,
    });
    assert!(plugins[0].supports(&moe).is_err());
    let e = python::plugins(
        &["py:nofunction".into()],
        Path::new("python3"),
        false,
        None,
        1,
    )
    .err()
    .unwrap();
    assert!(e.contains("py:MODULE:FUNCTION"), "{e}");
}
