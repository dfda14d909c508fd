//! `compare`: A/A is not a regression, 10% slower is, 10% faster is an improvement,
//! configs and implementations present on one side only are listed.

use flashmoe::{AttentionProblem, DType};
use flashmoe_bench::compare::{compare_runs, CompareOptions};
use flashmoe_bench::report::fixtures::{config_from_samples, noisy_samples, run_with};
use flashmoe_bench::results::{ProblemSpec, RunResults};
use flashmoe_bench::stats::Verdict;

fn problem(seqlen: usize) -> ProblemSpec {
    ProblemSpec::Attention(AttentionProblem::new(2, 8, seqlen, 64, false, DType::F16))
}

/// A run with one config per `(seqlen, median_ms)`, each with implementations
/// `flashmoe` and `sdpa-flash` (the latter 1.3× slower), n = 100, 1% noise.
fn run(configs: &[(usize, f64)], seed: u64) -> RunResults {
    let cs = configs
        .iter()
        .enumerate()
        .map(|(k, &(seqlen, ms))| {
            let s = seed * 1000 + 10 * k as u64;
            config_from_samples(
                problem(seqlen),
                "flashmoe",
                vec![
                    ("flashmoe", "cpu", noisy_samples(ms, 0.01, 100, s)),
                    (
                        "sdpa-flash",
                        "cpu",
                        noisy_samples(ms * 1.3, 0.01, 100, s + 1),
                    ),
                ],
                None,
            )
        })
        .collect();
    run_with("attention", "flashmoe", cs, None)
}

fn opts() -> CompareOptions {
    CompareOptions {
        threshold: 0.02,
        alpha: 0.05,
        resamples: 2000,
        seed: 7,
    }
}

#[test]
fn default_options_match_the_spec() {
    let o = CompareOptions::default();
    assert_eq!(o.threshold, 0.02);
    assert_eq!(o.alpha, 0.05);
}

#[test]
fn a_a_comparison_is_not_a_regression() {
    // Independent draws of the same noise distribution, several seed pairs.
    for seed in 1..=5 {
        let old = run(&[(512, 1.0), (1024, 4.0)], seed);
        let new = run(&[(512, 1.0), (1024, 4.0)], seed + 100);
        let rep = compare_runs(&old, &new, &opts());
        assert_eq!(rep.changes.len(), 4);
        assert!(!rep.has_regression(), "{}", rep.render());
        assert_eq!(rep.regressions, 0);
        assert_eq!(rep.improvements, 0);
        for c in &rep.changes {
            assert_eq!(c.comparison.verdict, Verdict::Same, "{}", rep.render());
            assert!(c.change().abs() < 0.01, "{}", c.change());
        }
        assert!(rep.only_in_old.is_empty() && rep.only_in_new.is_empty());
        assert!(rep.skipped.is_empty() && rep.warnings.is_empty());
    }
}

#[test]
fn ten_percent_slower_is_a_regression() {
    let old = run(&[(512, 1.0), (1024, 4.0)], 1);
    let new = run(&[(512, 1.1), (1024, 4.0)], 2);
    let rep = compare_runs(&old, &new, &opts());
    assert!(rep.has_regression());
    assert_eq!(rep.regressions, 2, "{}", rep.render()); // both impls of config 512
    let c = rep
        .changes
        .iter()
        .find(|c| c.implementation == "flashmoe" && c.config_id == problem(512).id())
        .unwrap();
    assert_eq!(c.comparison.verdict, Verdict::Slower);
    assert!((c.change() - 0.10).abs() < 0.02, "{}", c.change());
    let (lo, hi) = c.change_ci();
    assert!(lo < c.change() && c.change() < hi && lo > 0.05, "{lo} {hi}");
    assert!(c.new_median_ms > c.old_median_ms);
    let text = rep.render();
    assert!(text.contains("SLOWER"), "{text}");
    assert!(text.contains("REGRESSION"), "{text}");
    // The unchanged config stays SAME.
    let same = rep
        .changes
        .iter()
        .filter(|c| c.config_id == problem(1024).id())
        .all(|c| c.comparison.verdict == Verdict::Same);
    assert!(same, "{text}");
}

#[test]
fn ten_percent_faster_is_an_improvement() {
    let old = run(&[(512, 1.0)], 3);
    let new = run(&[(512, 0.9)], 4);
    let rep = compare_runs(&old, &new, &opts());
    assert!(!rep.has_regression(), "{}", rep.render());
    assert_eq!(rep.improvements, 2);
    assert_eq!(rep.regressions, 0);
    for c in &rep.changes {
        assert_eq!(c.comparison.verdict, Verdict::Faster);
        assert!(c.comparison.speedup.estimate > 1.05);
        assert!(c.change() < -0.05);
    }
    assert!(rep.render().contains("FASTER"));
}

#[test]
fn configs_and_implementations_on_one_side_are_listed() {
    let old = run(&[(512, 1.0), (2048, 9.0)], 5);
    let mut new = run(&[(512, 1.0), (4096, 30.0)], 6);
    // An implementation missing from the new run, one without samples in the new run.
    new.configs[0]
        .implementations
        .retain(|i| i.name == "flashmoe");
    let mut na = old.configs[0].implementations[1].clone();
    na.name = "naive".into();
    let mut old = old;
    old.configs[0].implementations.push(na.clone());
    na.samples_ms.clear();
    na.summary = None;
    na.error = Some("n/a: head dim".into());
    new.configs[0].implementations.push(na);

    let rep = compare_runs(&old, &new, &opts());
    assert_eq!(rep.only_in_old, vec![problem(2048).id()]);
    assert_eq!(rep.only_in_new, vec![problem(4096).id()]);
    assert_eq!(rep.changes.len(), 1);
    assert_eq!(rep.changes[0].implementation, "flashmoe");
    assert_eq!(rep.skipped.len(), 2, "{:?}", rep.skipped);
    assert!(rep
        .skipped
        .iter()
        .any(|s| s.contains("sdpa-flash") && s.contains("only in the old")));
    assert!(rep
        .skipped
        .iter()
        .any(|s| s.contains("naive") && s.contains("n/a: head dim")));
    let text = rep.render();
    assert!(text.contains(&problem(2048).id()) && text.contains(&problem(4096).id()));
    assert!(text.contains("Configs only in the old run"));
    assert!(!rep.has_regression());
}

#[test]
fn different_machines_are_warned_about() {
    let old = run(&[(512, 1.0)], 7);
    let mut new = run(&[(512, 1.0)], 8);
    new.manifest.cpu_model = "Some other CPU".into();
    new.interrupted = true;
    let rep = compare_runs(&old, &new, &opts());
    assert_eq!(rep.warnings.len(), 2, "{:?}", rep.warnings);
    assert!(rep.render().contains("different machines"));
}

#[test]
fn empty_comparison_renders() {
    let old = run(&[(512, 1.0)], 9);
    let new = run(&[(1024, 1.0)], 10);
    let rep = compare_runs(&old, &new, &opts());
    assert!(rep.changes.is_empty());
    assert!(!rep.has_regression());
    assert!(rep.render().contains("No implementation was present"));
}

/// `run` with a calibration workload in every config, its samples at `cal_ms` (1% noise).
fn run_calibrated(configs: &[(usize, f64)], cal_ms: f64, seed: u64) -> RunResults {
    let mut r = run(configs, seed);
    for (k, c) in r.configs.iter_mut().enumerate() {
        c.calibration = Some(flashmoe_bench::results::CalibrationResult {
            workload: "fixed".into(),
            samples_ms: noisy_samples(cal_ms, 0.01, 100, seed * 7919 + k as u64),
            error: None,
        });
    }
    r
}

#[test]
fn a_machine_slowdown_seen_by_the_calibration_is_env_drift_not_a_regression() {
    use flashmoe_bench::compare::{EXIT_ENV_DRIFT, EXIT_OK, EXIT_REGRESSION};
    use flashmoe_bench::stats::CrossRunVerdict;
    // Everything, calibration included, 20% slower in the new run: the machine moved.
    let old = run_calibrated(&[(512, 1.0), (1024, 4.0)], 2.0, 1);
    let new = run_calibrated(&[(512, 1.2), (1024, 4.8)], 2.4, 2);
    let rep = compare_runs(&old, &new, &opts());
    assert_eq!(rep.calibrated_configs, 2);
    let ours: Vec<_> = rep
        .changes
        .iter()
        .filter(|c| c.implementation == "flashmoe")
        .collect();
    for c in &ours {
        assert_eq!(c.comparison.verdict, Verdict::Slower, "raw change is 20%");
        let k = c.calibrated.unwrap();
        assert_eq!(k.corrected_verdict, Verdict::Same, "{}", rep.render());
        assert_eq!(c.verdict, CrossRunVerdict::EnvDrift);
    }
    assert!(!rep.has_regression());
    assert_eq!(rep.regressions, 0);
    assert_eq!(rep.env_drifts, 4);
    assert_eq!(rep.exit_code(), EXIT_ENV_DRIFT);
    assert!(rep.render().contains("ENV-DRIFT"), "{}", rep.render());

    // A real 10% slowdown (of both implementations of the first config) on a steady
    // machine: a regression, raw and corrected agree.
    let new = run_calibrated(&[(512, 1.1), (1024, 4.0)], 2.0, 3);
    let rep = compare_runs(&old, &new, &opts());
    let c = &rep.changes[0];
    assert_eq!(c.verdict, CrossRunVerdict::Slower, "{}", rep.render());
    assert_eq!(rep.regressions, 2);
    assert_eq!(rep.exit_code(), EXIT_REGRESSION);

    // A 10% slowdown on a machine that got 20% slower: still a regression (raw 32%,
    // corrected 10%).
    let new = run_calibrated(&[(512, 1.32), (1024, 4.8)], 2.4, 4);
    let rep = compare_runs(&old, &new, &opts());
    assert_eq!(
        rep.changes[0].verdict,
        CrossRunVerdict::Slower,
        "{}",
        rep.render()
    );
    assert_eq!(rep.exit_code(), EXIT_REGRESSION);

    // Only the calibration moved: ENV-DRIFT too (the candidate cannot be blamed or cleared).
    let new = run_calibrated(&[(512, 1.0), (1024, 4.0)], 2.4, 5);
    let rep = compare_runs(&old, &new, &opts());
    assert!(rep
        .changes
        .iter()
        .all(|c| c.verdict == CrossRunVerdict::EnvDrift));
    assert_eq!(rep.exit_code(), EXIT_ENV_DRIFT);

    // A/A with calibration: nothing to report.
    let new = run_calibrated(&[(512, 1.0), (1024, 4.0)], 2.0, 6);
    let rep = compare_runs(&old, &new, &opts());
    assert!(rep
        .changes
        .iter()
        .all(|c| c.verdict == CrossRunVerdict::Same));
    assert_eq!(rep.exit_code(), EXIT_OK);
}

#[test]
fn files_without_calibration_compare_on_the_raw_change_with_a_warning() {
    use flashmoe_bench::stats::CrossRunVerdict;
    let old = run(&[(512, 1.0)], 1);
    let new = run_calibrated(&[(512, 1.2)], 2.4, 2);
    let rep = compare_runs(&old, &new, &opts());
    assert_eq!(rep.calibrated_configs, 0);
    assert!(rep.changes.iter().all(|c| c.calibrated.is_none()));
    assert_eq!(rep.changes[0].verdict, CrossRunVerdict::Slower);
    assert_eq!(rep.exit_code(), 1);
    assert!(
        rep.warnings.iter().any(|w| w.contains("only the new run")),
        "{:?}",
        rep.warnings
    );
    // Different workloads are not compared either.
    let mut other = run_calibrated(&[(512, 1.0)], 2.0, 3);
    other.configs[0].calibration.as_mut().unwrap().workload = "another".into();
    let rep = compare_runs(&other, &new, &opts());
    assert_eq!(rep.calibrated_configs, 0);
    assert!(rep
        .warnings
        .iter()
        .any(|w| w.contains("different calibration")));
}

#[test]
fn against_compares_each_implementation_with_its_old_self_in_the_same_run() {
    use flashmoe_bench::compare::compare_against_old;
    use flashmoe_bench::report::fixtures::config_from_samples;
    let c = config_from_samples(
        problem(512),
        "flashmoe",
        vec![
            ("flashmoe", "cpu", noisy_samples(1.1, 0.01, 100, 1)),
            (
                "old:flashmoe",
                "old-build",
                noisy_samples(1.0, 0.01, 100, 2),
            ),
            ("sdpa-flash", "cpu", noisy_samples(2.0, 0.01, 100, 3)),
            (
                "old:sdpa-flash",
                "old-build",
                noisy_samples(2.0, 0.01, 100, 4),
            ),
            ("new-only", "cpu", noisy_samples(2.0, 0.01, 100, 5)),
        ],
        None,
    );
    let r = run_with("attention", "flashmoe", vec![c], None);
    let rep = compare_against_old(&r, &opts());
    assert_eq!(rep.changes.len(), 2, "{}", rep.render());
    assert!(rep.changes[0].is_regression());
    assert_eq!(rep.changes[1].comparison.verdict, Verdict::Same);
    assert_eq!(rep.exit_code(), 1);
    assert!(rep.skipped.iter().any(|s| s.contains("new-only")));
    // Both CIs resolved the ±5% band: one beyond it, one inside it.
    assert!(rep.changes.iter().all(|c| c.resolved == Some(true)));
    assert_eq!(rep.unresolved, 0);
}

#[test]
fn against_says_when_the_cap_was_hit_before_the_ci_resolved() {
    use flashmoe_bench::compare::compare_against_old;
    use flashmoe_bench::measure::StopReason;
    use flashmoe_bench::report::fixtures::config_from_samples;
    use flashmoe_bench::results::SamplingRecord;
    // 5% slower with 10% noise and 30 samples a side: the CI straddles the band edge.
    let mut c = config_from_samples(
        problem(512),
        "flashmoe",
        vec![
            ("flashmoe", "cpu", noisy_samples(1.05, 0.1, 30, 1)),
            ("old:flashmoe", "old-build", noisy_samples(1.0, 0.1, 30, 2)),
        ],
        None,
    );
    c.sampling = Some(SamplingRecord {
        stop: StopReason::TimeCap,
        rounds: 30,
        sampling_ms: 16_000.0,
    });
    let r = run_with("attention", "flashmoe", vec![c], None);
    let rep = compare_against_old(&r, &opts());
    assert_eq!(rep.changes.len(), 1);
    let ch = &rep.changes[0];
    assert_eq!(ch.resolved, Some(false), "{}", rep.render());
    assert_eq!(ch.stop, Some(StopReason::TimeCap));
    assert_eq!(rep.unresolved, 1);
    let text = rep.render();
    assert!(text.contains("unresolved at the time cap"), "{text}");
    // Whatever its verdict, an unresolved change is never a confirmed regression: a
    // SLOWER one exits 3 (rerun), anything else passes.
    assert!(!ch.is_regression());
    assert_eq!(rep.regressions, 0);
    if ch.verdict == flashmoe_bench::stats::CrossRunVerdict::Slower {
        assert!(ch.is_unresolved_slowdown());
        assert_eq!((rep.unresolved_slowdowns, rep.exit_code()), (1, 3));
        assert!(text.contains("UNRESOLVED"), "{text}");
    } else {
        assert_eq!(rep.exit_code(), 0);
    }
    assert!(text.contains("1 change(s) unresolved"), "{text}");
    // The JSON carries both fields for --against rows.
    let v = serde_json::to_value(&rep).unwrap();
    assert_eq!(v["changes"][0]["resolved"], false);
    assert_eq!(v["changes"][0]["stop"], "time-cap");
}
