//! `bench e2e` without PyTorch: samples files recorded by `python/flashmoe_e2e.py` on the
//! CPU (`bench e2e --cpu --preset smoke --impl eager,sdpa-math`, with and without
//! `--train --steps 8`) go through `--from-samples` into the lab's reports, which
//! `flashmoe report` re-renders and `flashmoe compare` reads like any suite's.

use flashmoe_bench::report;
use flashmoe_bench::results::{ProblemSpec, RunResults};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn flashmoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashmoe"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("the binary runs")
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `--from-samples FILE --out DIR`: the exit code and the run read back.
fn convert(samples: &Path, out: &Path) -> RunResults {
    let o = flashmoe(&[
        "bench",
        "e2e",
        "--from-samples",
        samples.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    for f in ["results.json", "results.csv", "results.md", "report.html"] {
        assert!(out.join(f).exists(), "{f} not written: {}", text(&o));
    }
    report::read_json(&out.join("results.json")).unwrap()
}

#[test]
fn recorded_inference_samples_become_a_results_file_report_and_compare_read() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("e2e");
    let r = convert(&data("e2e-samples-cpu-smoke.json"), &out);
    assert_eq!((r.suite.as_str(), r.source.as_str()), ("e2e", "smoke"));
    assert_eq!(r.configs.len(), 2);
    for c in &r.configs {
        assert!(matches!(c.problem, ProblemSpec::E2e(_)), "{}", c.id);
        for name in ["eager", "sdpa-math"] {
            let i = c.implementations.iter().find(|i| i.name == name).unwrap();
            // The raw samples, summarised by the lab's statistics; the gate as accuracy.
            let s = i.summary.as_ref().expect("a summary");
            assert_eq!(s.n, i.samples_ms.len());
            assert!(s.median_ci.low <= s.median && s.median <= s.median_ci.high);
            let a = i.accuracy.as_ref().expect("the logits gate");
            assert!(a.passed && a.reference.contains("fp32"), "{a:?}");
            assert!(i.metrics["tokens_per_s"] > 0.0);
        }
        // The candidate (the first implementation: no flashmoe ran on the CPU) against
        // the other one.
        assert_eq!(c.comparisons.len(), 1, "{}", c.id);
    }
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(
        md.contains("tok/s") && md.contains("gate: logits rel L2"),
        "{md}"
    );

    // `flashmoe report` re-renders it; `flashmoe compare` of a run with itself passes.
    let json = out.join("results.json");
    let o = flashmoe(&["report", json.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = flashmoe(&["compare", json.to_str().unwrap(), json.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains("no significant regression"),
        "{}",
        text(&o)
    );

    // --candidate picks the speedups' reference; an absent one is a clear error.
    let o = flashmoe(&[
        "bench",
        "e2e",
        "--from-samples",
        data("e2e-samples-cpu-smoke.json").to_str().unwrap(),
        "--candidate",
        "flashmoe",
        "--out",
        dir.path().join("x").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--candidate flashmoe"), "{}", text(&o));
}

#[test]
fn recorded_training_samples_keep_their_loss_curves() {
    let dir = tempfile::tempdir().unwrap();
    let r = convert(&data("e2e-train-samples-cpu-smoke.json"), dir.path());
    assert_eq!(r.suite, "e2e-train");
    for c in &r.configs {
        assert!(c.id.ends_with("_train"), "{}", c.id);
        for i in &c.implementations {
            let curve = i.loss_curve.as_ref().expect("a loss curve");
            assert_eq!(curve.len(), 8);
            assert_eq!(i.metrics["final_loss"], *curve.last().unwrap());
            assert!(i.accuracy.as_ref().unwrap().passed);
        }
    }
}

#[test]
fn a_foreign_samples_file_is_a_clean_error() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("old.json");
    std::fs::write(&f, "{\"schema\": \"flashmoe-e2e/1\", \"configs\": []}").unwrap();
    let o = flashmoe(&[
        "bench",
        "e2e",
        "--from-samples",
        f.to_str().unwrap(),
        "--out",
        dir.path().join("o").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("flashmoe-e2e-samples/1"), "{}", text(&o));
    assert!(!text(&o).contains("panicked"));
}
