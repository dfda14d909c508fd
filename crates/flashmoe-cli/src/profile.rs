//! `flashmoe profile`: Nsight Compute over chosen configs and implementations.
//!
//! For each (config, implementation) the command runs `ncu --profile-from-start off` over
//! this same binary's hidden `profile-target` subcommand, which prepares the one
//! implementation, warms it up, and runs one call inside cudaProfilerStart/Stop (our
//! kernels: here; a Python baseline: inside the worker, which ncu follows as a child
//! process). The report's raw page is read back into `profile.json` and `profile.md`.

use crate::backend;
use crate::{ProfileArgs, ProfileTargetArgs};
use anyhow::{anyhow, bail, Context};
use flashmoe_bench::config::{self, Suite};
use flashmoe_bench::gpu::profiler_range;
use flashmoe_bench::profile::{
    self, diagnose_ncu_failure, locate_ncu, ProfileResults, ProfileRow, PROFILE_SCHEMA_VERSION,
};
use flashmoe_bench::results::ProblemSpec;
use flashmoe_bench::runner::{python, SuiteInputs};
use std::path::Path;
use std::process::{Command, ExitCode};

/// Unprofiled calls before the profiled one (our kernels; the worker's prepare already
/// runs a Python baseline five times).
const WARMUP_CALLS: usize = 3;

fn is_python_baseline(name: &str) -> bool {
    python::ATTENTION_BASELINES
        .iter()
        .chain(python::MOE_BASELINES)
        .chain(python::DECODE_BASELINES)
        .chain(python::VARLEN_BASELINES)
        .chain(python::MLA_BASELINES)
        .any(|n| *n == name)
}

fn ncu_version(ncu: &Path) -> String {
    Command::new(ncu)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn gpu_name() -> String {
    Command::new("nvidia-smi")
        .args(["--query-gpu=name,driver_version", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

pub fn run(args: &ProfileArgs) -> anyhow::Result<ExitCode> {
    let suite: Suite = args.suite.lab_suite()?;
    // ncu first: a missing or unusable profiler is the most common failure.
    let ncu = locate_ncu(args.ncu.as_deref()).map_err(|e| anyhow!(e))?;
    let (configs, source) = match (&args.preset, &args.config) {
        (_, Some(path)) => (
            config::load_config(path, suite)?,
            path.display().to_string(),
        ),
        (Some(name), None) => (config::preset(suite, name, true)?, format!("preset:{name}")),
        (None, None) => bail!("name the configs: --preset NAME or --config FILE"),
    };
    let configs: Vec<ProblemSpec> = configs
        .into_iter()
        .filter(|p| {
            args.select.is_empty() || args.select.iter().any(|s| p.id().contains(s.as_str()))
        })
        .collect();
    if configs.is_empty() {
        bail!(
            "no config id contains any of {:?} (ids look like attn_b4_hq16_hkv16_sq4096_sk4096_d128_causal_bf16)",
            args.select
        );
    }
    if args.implementations.is_empty() {
        bail!("name the implementations to profile: --impl flashmoe-sm90,fa4,...");
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let reports = args.out.join("ncu");
    std::fs::create_dir_all(&reports)?;
    let exe = std::env::current_exe().context("locating this flashmoe binary")?;
    let mut results = ProfileResults {
        schema_version: PROFILE_SCHEMA_VERSION,
        suite: suite.name().to_string(),
        source,
        ncu: ncu.display().to_string(),
        ncu_version: ncu_version(&ncu),
        gpu: gpu_name(),
        command_line: std::env::args().collect::<Vec<_>>().join(" "),
        timestamp_utc: flashmoe_bench::manifest::Manifest::collect().timestamp_utc,
        rows: Vec::new(),
    };
    for problem in &configs {
        for name in &args.implementations {
            eprintln!("profiling {} / {name}", problem.label());
            let report = reports.join(format!("{}__{name}", problem.id()));
            let target = vec![
                exe.display().to_string(),
                "profile-target".into(),
                "--problem".into(),
                serde_json::to_string(problem)?,
                "--impl".into(),
                name.clone(),
                "--seed".into(),
                args.seed.to_string(),
                "--python".into(),
                args.python.display().to_string(),
            ];
            let out = Command::new(&ncu)
                .args(profile::ncu_args(&report, &target))
                .env("FLASHMOE_WORKER_PROFILE_RANGE", "1")
                .output()
                .with_context(|| format!("running {}", ncu.display()))?;
            let text = format!(
                "{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            std::fs::write(report.with_extension("log"), &text)?;
            let row = if !out.status.success() {
                let why = diagnose_ncu_failure(out.status.code(), &text);
                if why.contains("lacks permission") || why.contains("could not initialise") {
                    bail!(why); // the same for every config: stop here
                }
                Err(why)
            } else {
                read_report(&ncu, &report.with_extension("ncu-rep"))
            };
            let row = match row {
                Ok(kernels) => ProfileRow::from_kernels(
                    problem.id(),
                    problem.label(),
                    name.clone(),
                    problem.workload().flops(),
                    kernels,
                ),
                Err(e) => ProfileRow {
                    config_id: problem.id(),
                    label: problem.label(),
                    implementation: name.clone(),
                    error: Some(e),
                    ..Default::default()
                },
            };
            if let Some(e) = &row.error {
                eprintln!("  {name}: {e}");
            } else if let (Some(us), Some(m)) = (row.total_us, &row.main) {
                eprintln!(
                    "  {name}: {us:.1} µs, {} kernel(s), main {}",
                    row.kernels.len(),
                    m.name
                );
            }
            results.rows.push(row);
            write(&results, &args.out)?;
        }
    }
    print!("{}", profile::render_markdown(&results));
    println!(
        "wrote {} and {}",
        args.out.join("profile.json").display(),
        args.out.join("profile.md").display()
    );
    let failed = results.rows.iter().filter(|r| r.error.is_some()).count();
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        eprintln!("{failed} of {} profiles failed", results.rows.len());
        ExitCode::from(1)
    })
}

fn read_report(ncu: &Path, report: &Path) -> Result<Vec<profile::KernelRecord>, String> {
    let out = Command::new(ncu)
        .args(profile::ncu_import_args(report))
        .output()
        .map_err(|e| format!("ncu --import {}: {e}", report.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(diagnose_ncu_failure(
            out.status.code(),
            &format!("{text}\n{}", String::from_utf8_lossy(&out.stderr)),
        ));
    }
    profile::parse_raw_csv(&text)
}

fn write(r: &ProfileResults, dir: &Path) -> anyhow::Result<()> {
    std::fs::write(dir.join("profile.json"), serde_json::to_string_pretty(r)?)?;
    std::fs::write(dir.join("profile.md"), profile::render_markdown(r))?;
    Ok(())
}

/// The profiled process: one implementation, one config, one call in the profiler range.
pub fn target(args: &ProfileTargetArgs) -> anyhow::Result<ExitCode> {
    let problem: ProblemSpec =
        serde_json::from_str(&args.problem).context("--problem is not a config's JSON")?;
    let suite = match problem {
        ProblemSpec::Attention(_) => Suite::Attention,
        ProblemSpec::Moe(_) => Suite::Moe,
        ProblemSpec::Decode(_) => Suite::Decode,
        ProblemSpec::Varlen(_) => Suite::Varlen,
        ProblemSpec::Mla(_) => Suite::Mla,
        ProblemSpec::Grad(_) => bail!("flashmoe profile does not run gradient configs"),
        ProblemSpec::E2e(_) => bail!("flashmoe profile runs kernel configs, not e2e models"),
    };
    let baseline = is_python_baseline(&args.implementation);
    let python = baseline.then_some(args.python.as_path());
    let lab = backend::select(suite, false, args.seed, false, python);
    if !lab.on_gpu() {
        bail!("flashmoe profile needs a GPU");
    }
    let imp = lab
        .implementations
        .iter()
        .find(|i| i.name() == args.implementation)
        .ok_or_else(|| {
            anyhow!(
                "unknown or unavailable implementation '{}': available here: {}",
                args.implementation,
                lab.implementations
                    .iter()
                    .map(|i| i.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
    let inputs = SuiteInputs::generate(&problem, args.seed);
    let mut prepared = imp.prepare(&problem, &inputs)?;
    if baseline {
        // The worker wraps this call in its own profiler range (FLASHMOE_WORKER_PROFILE_RANGE).
        prepared.sample()?;
    } else {
        for _ in 0..WARMUP_CALLS {
            prepared.sample()?;
        }
        profiler_range(|| prepared.sample())?;
    }
    Ok(ExitCode::SUCCESS)
}
