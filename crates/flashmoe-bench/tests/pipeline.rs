//! The per-config pipeline on the CPU: the correctness gate, timing of the implementations
//! that pass, speedups, and errors recorded per implementation.

use flashmoe::{AttentionProblem, DType};
use flashmoe_bench::measure::Sampled;
use flashmoe_bench::results::{MeasureSettings, ProblemSpec};
use flashmoe_bench::runner::calibration::CpuCalibration;
use flashmoe_bench::runner::cpu::{CpuImplementation, CpuReference};
use flashmoe_bench::runner::pipeline::Pipeline;
use flashmoe_bench::runner::{Implementation, Outputs, Prepared, SuiteInputs};
use std::sync::atomic::AtomicBool;

/// An implementation that returns the right shape but wrong values (scaled output).
struct Broken;
struct BrokenPrepared<'a>(&'a SuiteInputs, ProblemSpec);

impl Implementation for Broken {
    fn name(&self) -> &str {
        "broken"
    }
    fn backend(&self) -> &str {
        "cpu"
    }
    fn supports(&self, _: &ProblemSpec) -> Result<(), String> {
        Ok(())
    }
    fn prepare<'a>(
        &'a self,
        p: &ProblemSpec,
        x: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        Ok(Box::new(BrokenPrepared(x, p.clone())))
    }
}
impl Sampled for BrokenPrepared<'_> {
    fn sample(&mut self) -> anyhow::Result<f64> {
        Ok(1.0)
    }
}
impl Prepared for BrokenPrepared<'_> {
    fn run_for_check(&mut self) -> anyhow::Result<Outputs> {
        let (ProblemSpec::Attention(p), SuiteInputs::Attention(x)) = (&self.1, self.0) else {
            unreachable!()
        };
        let r = flashmoe::reference::attention_f64(p, x)?;
        Ok(Outputs::Attention {
            o: r.o.iter().map(|&v| 1.1 * v as f32).collect(),
            lse: r.lse.iter().map(|&v| v as f32).collect(),
        })
    }
}

/// An implementation that does not support anything.
struct Unsupported;
impl Implementation for Unsupported {
    fn name(&self) -> &str {
        "picky"
    }
    fn backend(&self) -> &str {
        "cpu"
    }
    fn supports(&self, _: &ProblemSpec) -> Result<(), String> {
        Err("head dim 64 not served".into())
    }
    fn prepare<'a>(
        &'a self,
        _: &ProblemSpec,
        _: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        unreachable!("never prepared when unsupported")
    }
}

fn settings() -> MeasureSettings {
    MeasureSettings {
        warmup_ms: 0.0,
        min_samples: 5,
        max_samples: 12,
        max_time_ms: 2_000.0,
        bootstrap_resamples: 200,
        ..MeasureSettings::default()
    }
}

#[test]
fn gate_times_only_correct_implementations_and_compares_the_candidate() {
    let reference = CpuImplementation::reference();
    let tiled = CpuImplementation::tiled();
    let pipeline = Pipeline {
        implementations: vec![&reference, &tiled, &Broken, &Unsupported],
        reference: &CpuReference,
        candidate: "cpu-tiled".into(),
        settings: settings(),
        ceilings: None,
        calibration: Some(&CpuCalibration::default()),
    };
    let p = ProblemSpec::Attention(AttentionProblem::new(1, 2, 33, 32, true, DType::Bf16));
    let r = pipeline
        .run_config(&p, &AtomicBool::new(false), |_| {})
        .unwrap();
    let get = |n: &str| r.implementations.iter().find(|i| i.name == n).unwrap();

    let t = get("cpu-tiled");
    assert!(t.accuracy.as_ref().unwrap().passed);
    assert!(t.samples_ms.len() >= 5);
    assert!(t.summary.is_some() && t.tflops.unwrap() > 0.0);
    assert_eq!(t.input_checksum, get("cpu-reference").input_checksum);

    let b = get("broken");
    let acc = b.accuracy.as_ref().unwrap();
    assert!(!acc.passed && acc.rel_l2 > 0.05, "{acc:?}");
    assert!(b.samples_ms.is_empty(), "a failed gate must not be timed");
    assert!(b.error.as_deref().unwrap().contains("correctness gate"));

    assert!(get("picky")
        .error
        .as_deref()
        .unwrap()
        .starts_with("n/a: head dim 64"));

    // The broken and unsupported implementations can never be the best baseline.
    assert_eq!(r.best_baseline("cpu-tiled").unwrap().name, "cpu-reference");

    // Only the one usable baseline is compared with the candidate.
    assert_eq!(r.comparisons.len(), 1);
    assert_eq!(r.comparisons[0].baseline, "cpu-reference");
    assert!(r.comparisons[0].comparison.speedup.estimate > 0.0);

    // The calibration ran in every round next to the timed implementations.
    let cal = r.calibration.as_ref().expect("calibration recorded");
    assert!(cal.error.is_none(), "{cal:?}");
    assert_eq!(cal.samples_ms.len(), t.samples_ms.len());
    assert!(cal.samples_ms.iter().all(|&x| x > 0.0 && x.is_finite()));
    assert!(cal.workload.starts_with("cpu-tiled attention"));
}

#[test]
fn an_invalid_config_is_recorded_not_fatal() {
    let tiled = CpuImplementation::tiled();
    let pipeline = Pipeline {
        implementations: vec![&tiled],
        reference: &CpuReference,
        candidate: "cpu-tiled".into(),
        settings: settings(),
        ceilings: None,
        calibration: None,
    };
    let mut bad = AttentionProblem::new(1, 6, 16, 32, false, DType::F16);
    bad.heads_kv = 4;
    let r = pipeline
        .run_config(
            &ProblemSpec::Attention(bad),
            &AtomicBool::new(false),
            |_| {},
        )
        .unwrap();
    assert!(r.error.as_deref().unwrap().contains("heads_q (6)"));
    assert!(r.implementations.is_empty());
}

#[test]
fn a_throughput_collapse_between_neighbours_is_flagged() {
    use flashmoe_bench::report::fixtures;
    use flashmoe_bench::runner::pipeline::flag_implausible_drops;
    let mut run = fixtures::large_sweep_run(8);
    // Pick one implementation in the middle of a panel and make it 50x slower.
    let panel = run.configs[0].problem.panel();
    let mut same: Vec<usize> = (0..run.configs.len())
        .filter(|&i| run.configs[i].problem.panel() == panel)
        .collect();
    same.sort_by(|&a, &b| {
        run.configs[a]
            .problem
            .x_value()
            .total_cmp(&run.configs[b].problem.x_value())
    });
    assert!(same.len() >= 3, "fixture panel too small");
    let victim = same[same.len() / 2];
    let name = run.configs[victim].implementations[0].name.clone();
    let tf = run.configs[victim].implementations[0].tflops.unwrap();
    run.configs[victim].implementations[0].tflops = Some(tf / 50.0);
    flag_implausible_drops(&mut run);
    flag_implausible_drops(&mut run); // idempotent
    let flagged: Vec<(usize, String)> = run
        .configs
        .iter()
        .enumerate()
        .flat_map(|(ci, c)| {
            c.implementations
                .iter()
                .filter(|i| {
                    i.flags
                        .iter()
                        .any(|f| f.contains("far below its neighbouring"))
                })
                .map(move |i| (ci, i.name.clone()))
        })
        .collect();
    assert_eq!(flagged, vec![(victim, name)]);
    let f = &run.configs[victim].implementations[0].flags;
    assert_eq!(f.iter().filter(|f| f.contains("far below")).count(), 1);
}

#[test]
fn moe_configs_record_the_reference_routing_load() {
    // The load statistics come from the reference routing: counts sum to T·k, and the
    // derived max/mean and CV agree with the counts.
    let grouped = CpuImplementation::grouped();
    let pipeline = Pipeline {
        implementations: vec![&grouped],
        reference: &CpuReference,
        candidate: "cpu-grouped".into(),
        settings: settings(),
        ceilings: None,
        calibration: None,
    };
    let p = flashmoe::MoeProblem {
        tokens: 3,
        hidden: 32,
        intermediate: 16,
        experts: 8,
        top_k: 2,
        scoring: flashmoe::Scoring::Softmax,
        renormalize: true,
        dtype: DType::Bf16,
        shared_expert: false,
    };
    let r = pipeline
        .run_config(&ProblemSpec::Moe(p), &AtomicBool::new(false), |_| {})
        .unwrap();
    let s = r.routing.expect("MoE configs carry the routing summary");
    assert_eq!(s.tokens_per_expert.len(), 8);
    assert_eq!(s.tokens_per_expert.iter().sum::<usize>(), 6);
    // 6 assignments over 8 experts: at least 2 experts are empty.
    assert!(s.empty_experts >= 2, "{s:?}");
    assert_eq!(s.max_load, *s.tokens_per_expert.iter().max().unwrap());
    assert!((s.mean_load - 0.75).abs() < 1e-12);
    assert!((s.max_over_mean - s.max_load as f64 / 0.75).abs() < 1e-12);
    assert!(s.cv > 0.0 && s.aux_loss > 0.0 && s.z_loss > 0.0);
    assert!(r.implementations[0].accuracy.as_ref().unwrap().passed);
}

#[test]
fn moe_gate_checks_routing_losses_and_nan() {
    use flashmoe::reference::moe::{moe_f64, MoeInputs};
    use flashmoe_bench::runner::pipeline::gate;
    use flashmoe_bench::runner::ReferenceOutputs;
    let p = flashmoe::MoeProblem {
        tokens: 5,
        hidden: 32,
        intermediate: 16,
        experts: 4,
        top_k: 2,
        scoring: flashmoe::Scoring::Sigmoid,
        renormalize: true,
        dtype: DType::Bf16,
        shared_expert: false,
    };
    let spec = ProblemSpec::Moe(p.clone());
    let r = moe_f64(&p, &MoeInputs::generate(&p, 3)).unwrap();
    let good = || Outputs::Moe {
        out: r.out.iter().map(|&v| v as f32).collect(),
        topk_ids: Some(r.routing.topk_ids.clone()),
        losses: Some((r.routing.aux_loss, r.routing.z_loss)),
    };
    let reference = ReferenceOutputs::Moe(r.clone());
    assert!(gate(&spec, &good(), &reference, "cpu-f64").passed);

    // Aux loss off by 1e-3 relative: fails and says which loss.
    let Outputs::Moe { out, topk_ids, .. } = good() else {
        unreachable!()
    };
    let bad_aux = Outputs::Moe {
        out,
        topk_ids,
        losses: Some((r.routing.aux_loss * 1.001, r.routing.z_loss)),
    };
    let a = gate(&spec, &bad_aux, &reference, "cpu-f64");
    assert!(
        !a.passed && a.note.as_deref().unwrap().contains("aux loss"),
        "{a:?}"
    );

    // A NaN z-loss fails.
    let Outputs::Moe { out, topk_ids, .. } = good() else {
        unreachable!()
    };
    let nan_z = Outputs::Moe {
        out,
        topk_ids,
        losses: Some((r.routing.aux_loss, f64::NAN)),
    };
    assert!(!gate(&spec, &nan_z, &reference, "cpu-f64").passed);

    // A NaN in the output is reported, never passes.
    let Outputs::Moe {
        mut out,
        topk_ids,
        losses,
    } = good()
    else {
        unreachable!()
    };
    out[7] = f32::NAN;
    let a = gate(
        &spec,
        &Outputs::Moe {
            out,
            topk_ids,
            losses,
        },
        &reference,
        "cpu-f64",
    );
    assert!(!a.passed && a.non_finite == 1, "{a:?}");

    // Swapped ids of one token: routing mismatch named.
    let Outputs::Moe {
        out,
        mut topk_ids,
        losses,
    } = good()
    else {
        unreachable!()
    };
    topk_ids.as_mut().unwrap().swap(0, 1);
    let a = gate(
        &spec,
        &Outputs::Moe {
            out,
            topk_ids,
            losses,
        },
        &reference,
        "cpu-f64",
    );
    assert!(
        !a.passed && a.note.as_deref().unwrap().contains("routing differs"),
        "{a:?}"
    );
}

#[test]
fn cached_moe_checksums_equal_the_full_checksum() {
    // The weight checksums are reused across token counts (same seed and widths); the
    // folded checksum must equal a from-scratch one, and differ when the seed does.
    use flashmoe_bench::runner::pipeline::{generated_inputs_checksum, inputs_checksum};
    for (tokens, seed, shared) in [
        (4, 9, false),
        (11, 9, false),
        (11, 9, true),
        (11, 10, false),
    ] {
        let p = ProblemSpec::Moe(flashmoe::MoeProblem {
            tokens,
            hidden: 64,
            intermediate: 32,
            experts: 4,
            top_k: 2,
            scoring: flashmoe::Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: shared,
        });
        let x = SuiteInputs::generate(&p, seed);
        let full = inputs_checksum(&x, DType::Bf16);
        assert_eq!(
            generated_inputs_checksum(&p, seed, &x),
            full,
            "{tokens} {seed}"
        );
        assert_eq!(generated_inputs_checksum(&p, seed, &x), full, "second call");
    }
}

#[test]
fn moe_token_sweeps_flag_only_a_collapse_of_both_throughputs() {
    use flashmoe_bench::report::fixtures;
    use flashmoe_bench::runner::pipeline::flag_implausible_drops;
    let flagged = |run: &flashmoe_bench::results::RunResults| {
        run.configs[0].implementations[0]
            .flags
            .iter()
            .any(|f| f.contains("far below its neighbouring"))
    };
    // Memory-bound small-token config: 10× fewer FLOP/s, same GB/s — legitimate.
    let mut run = fixtures::cpu_moe_run();
    run.configs[0].implementations[0].tflops = Some(1.0);
    run.configs[0].implementations[0].gbps = Some(100.0);
    run.configs[1].implementations[0].tflops = Some(10.0);
    run.configs[1].implementations[0].gbps = Some(100.0);
    flag_implausible_drops(&mut run);
    assert!(!flagged(&run));
    // Both collapse: a silent fallback.
    run.configs[0].implementations[0].gbps = Some(10.0);
    flag_implausible_drops(&mut run);
    assert!(flagged(&run));
}
