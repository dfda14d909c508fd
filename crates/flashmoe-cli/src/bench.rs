//! `flashmoe bench`: configs → pipeline → results written after every config.

use crate::backend;
use crate::BenchArgs;
use anyhow::{bail, Context};
use flashmoe_bench::config::{self, Suite};
use flashmoe_bench::grad::{self, Pass};
use flashmoe_bench::report;
use flashmoe_bench::results::{RunResults, SCHEMA_VERSION};
use flashmoe_bench::runner::pipeline::{flag_implausible_drops, Pipeline};
use flashmoe_bench::runner::python;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Fail early, before any measurement, if results could not be written.
/// `--against` without `--against-max-time`: the resolve rule's cap is this many times the
/// sampling time cap (CPU quick: 4 s → 16 s per config at most; most configs resolve
/// sooner, docs/regression-gate.md).
const AGAINST_CAP_FACTOR: f64 = 4.0;

fn ensure_writable(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create output directory {}", dir.display()))?;
    let probe = dir.join(".flashmoe-write-test");
    std::fs::write(&probe, b"ok")
        .with_context(|| format!("output directory {} is not writable", dir.display()))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// Ctrl-C sets the flag; finished configs are kept and written.
fn install_interrupt_handler() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    // A second handler install (tests calling run twice) is harmless to ignore.
    let _ = ctrlc::set_handler(move || {
        if f.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: finishing up and keeping the configs already measured (Ctrl-C again to abort)");
    });
    flag
}

pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    if args.pass != Pass::Fwd && (matches!(args.suite, crate::SuiteArg::E2e) || args.gpus.is_some())
    {
        bail!(
            "--pass {} is for the kernel suites (attention, varlen, moe on one GPU); \
             `bench e2e --train` times whole training steps",
            args.pass
        );
    }
    if matches!(args.suite, crate::SuiteArg::E2e) {
        return crate::e2e::run(args);
    }
    if args.train {
        anyhow::bail!("--train is for `bench e2e --train` (training steps of the e2e models)");
    }
    if args.from_samples.is_some() {
        anyhow::bail!("--from-samples is for `bench e2e` (the e2e script's samples file)");
    }
    if let Some(gpus) = args.gpus {
        return crate::ep::run(args, gpus);
    }
    let suite: Suite = args.suite.lab_suite()?;
    if args.pass != Pass::Fwd && !grad::config::suite_has_backward(suite) {
        bail!(
            "--pass {}: the {} suite has no backward (attention, varlen and moe do)",
            args.pass,
            suite.name()
        );
    }
    let python = (!args.no_baselines).then_some(args.python.as_path());
    let lab = if args.pass == Pass::Fwd {
        backend::select(suite, args.cpu, args.seed, false, python)
    } else {
        backend::select_grad(suite, args.cpu, args.seed, python)
    };
    let (configs, source) = match (&args.preset, &args.config) {
        (_, Some(path)) => (
            config::load_config(path, suite)?,
            path.display().to_string(),
        ),
        (Some(name), None) => (
            config::preset(suite, name, lab.on_gpu())?,
            format!("preset:{name}"),
        ),
        (None, None) => (
            config::preset(suite, suite.default_preset(), lab.on_gpu())?,
            format!("preset:{}", suite.default_preset()),
        ),
    };
    if args.pass != Pass::Fwd && args.against.is_some() {
        bail!("--against compares forward passes only (serve runs the forward suites)");
    }
    // --pass bwd / fwd+bwd: the same configs as gradient configs (`crate::grad`).
    let configs = grad::config::wrap(suite, configs, args.pass)?;
    ensure_writable(&args.out)?;

    // Python plug-ins (--impl py:MODULE:FUNCTION), hosted next to the built-in ones.
    let plugin_specs: Vec<String> = args
        .implementations
        .iter()
        .filter(|w| w.starts_with(python::PLUGIN_PREFIX))
        .cloned()
        .collect();
    let plugins = if plugin_specs.is_empty() {
        Vec::new()
    } else {
        let flush = lab.session.as_ref().map(|s| s.flush_bytes() as u64);
        python::plugins(&plugin_specs, &args.python, lab.on_gpu(), flush, args.seed)
            .map_err(anyhow::Error::msg)?
    };
    // Implementations: all available, or those named by --impl (unknown names are errors).
    let available: Vec<&str> = lab
        .implementations
        .iter()
        .chain(plugins.iter())
        .map(|i| i.name())
        .collect();
    let skipped = lab
        .manifest
        .python
        .as_ref()
        .map(|p| p.skipped.as_slice())
        .unwrap_or_default();
    for want in &args.implementations {
        if let Some(why) = skipped.iter().find(|s| s.starts_with(&format!("{want}: "))) {
            bail!("baseline {why}: see docs/baselines.md for how to install it");
        }
        if !available.contains(&want.as_str()) {
            bail!(
                "unknown implementation '{want}': available here: {}",
                available.join(", ")
            );
        }
    }
    let implementations: Vec<_> = lab
        .implementations
        .iter()
        .chain(plugins.iter())
        .filter(|i| {
            args.implementations.is_empty() || args.implementations.iter().any(|w| w == i.name())
        })
        .map(|b| b.as_ref())
        .collect();
    // --against: this build's own implementations move to a child `serve` process too, so
    // both builds are timed the same way; baselines and plug-ins stay as they are.
    let this_build = match &args.against {
        Some(_) => python::this_build_served(suite, !lab.on_gpu(), args.seed)
            .map_err(anyhow::Error::msg)?,
        None => Vec::new(),
    };
    let implementations: Vec<_> = implementations
        .into_iter()
        .map(|i| {
            this_build
                .iter()
                .find(|s| s.name() == i.name())
                .map_or(i, |s| s.as_ref())
        })
        .collect();
    // --against: the old build's implementations (old:NAME) for those selected here.
    let old_build = match &args.against {
        Some(binary) => {
            let all = python::old_build(binary, suite, !lab.on_gpu(), args.seed)
                .map_err(anyhow::Error::msg)?;
            let kept: Vec<_> = all
                .into_iter()
                .filter(|o| {
                    let name = &o.name()[python::OLD_PREFIX.len()..];
                    implementations.iter().any(|i| i.name() == name)
                })
                .collect();
            eprintln!(
                "against {}: {} implementation(s) of the old build, timed in its own process",
                binary.display(),
                kept.len()
            );
            kept
        }
        None => Vec::new(),
    };
    let implementations: Vec<_> = implementations
        .into_iter()
        .chain(old_build.iter().map(|b| b.as_ref()))
        .collect();
    let candidate = args
        .candidate
        .clone()
        .unwrap_or_else(|| lab.default_candidate.clone());
    if !implementations.iter().any(|i| i.name() == candidate) {
        bail!(
            "candidate '{candidate}' is not among the implementations run ({})",
            implementations
                .iter()
                .map(|i| i.name())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    let mut settings = lab.settings.clone();
    settings.threshold = args.threshold;
    if let Some(t) = args.target_ci {
        settings.target_rel_ci = t;
    }
    if let Some(s) = args.max_time {
        if !(s > 0.0 && s.is_finite()) {
            bail!("--max-time must be a positive number of seconds, got {s}");
        }
        settings.max_time_ms = s * 1e3;
    }
    if args.against.is_some() {
        // Keep sampling until every (old:X, X) CI resolves the threshold band, up to this
        // cap (measure::ResolveRule).
        let cap_ms = match args.against_max_time {
            Some(s) if s > 0.0 && s.is_finite() => s * 1e3,
            Some(s) => bail!("--against-max-time must be a positive number of seconds, got {s}"),
            None => AGAINST_CAP_FACTOR * settings.max_time_ms,
        };
        settings.against_max_time_ms = Some(cap_ms.max(settings.max_time_ms));
    }

    let ceilings = match &lab.session {
        Some(session) => {
            eprintln!("measuring the bf16 GEMM and device-copy ceilings...");
            let c = backend::measure_ceilings(session)?;
            eprintln!(
                "ceilings: {:.0} TFLOP/s ({}), copy {:.0} GB/s",
                c.gemm_tflops, c.gemm_desc, c.copy_gbps
            );
            Some(c)
        }
        None => None,
    };
    let pipeline = Pipeline {
        implementations,
        reference: lab.reference.as_ref(),
        candidate: candidate.clone(),
        settings: settings.clone(),
        ceilings: ceilings.clone(),
        calibration: Some(lab.calibration.as_ref()),
    };
    let mut results = RunResults {
        schema_version: SCHEMA_VERSION,
        suite: suite.name().to_string(),
        source,
        manifest: lab.manifest.clone(),
        settings,
        ceilings,
        candidate,
        configs: Vec::new(),
        interrupted: false,
    };

    let cancel = install_interrupt_handler();
    let bar = ProgressBar::new(configs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} configs  {elapsed_precise}  {msg}")
            .expect("static template"),
    );
    for problem in &configs {
        bar.set_message(problem.label());
        let label = problem.label();
        let done = pipeline.run_config(problem, &cancel, |round| {
            bar.set_message(format!("{label}  round {round}"));
        });
        match done {
            Some(r) => results.configs.push(r),
            None => {
                results.interrupted = true;
                break;
            }
        }
        bar.inc(1);
        flag_implausible_drops(&mut results);
        // Written after every config so an interrupt or crash keeps what was measured.
        report::write_all(&results, &args.out)?;
    }
    bar.finish_and_clear();
    if let (Some(gpu), true) = (results.manifest.gpu.as_mut(), lab.on_gpu()) {
        gpu.clock_observations
            .extend(backend::clock_observation("end"));
    }
    let written = report::write_all(&results, &args.out)?;
    println!("{}", report::terminal_table(&results));
    for path in written {
        println!("wrote {}", path.display());
    }
    let mut code = ExitCode::SUCCESS;
    if args.against.is_some() {
        use flashmoe_bench::compare::{compare_against_old, CompareOptions};
        let report = compare_against_old(
            &results,
            // The verdict's CI with the resolve rule's seed and resamples (measure.rs), so
            // a config that stopped as resolved is reported as resolved.
            &CompareOptions {
                threshold: args.threshold,
                alpha: 1.0 - results.settings.confidence,
                resamples: results.settings.bootstrap_resamples,
                seed: results.settings.seed,
            },
        );
        println!("\nThis build against the old build (same run, interleaved):");
        println!("{}", report.render());
        let gate = crate::print_gate(&report, args.threshold);
        let mut v = serde_json::to_value(&report)?;
        v["exit_code"] = gate.into();
        let path = args.out.join("against.json");
        std::fs::write(&path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
        code = ExitCode::from(gate);
    }
    if results.interrupted {
        println!(
            "interrupted: {} of {} configs finished and kept",
            results.configs.len(),
            configs.len()
        );
        return Ok(ExitCode::from(130));
    }
    Ok(code)
}
