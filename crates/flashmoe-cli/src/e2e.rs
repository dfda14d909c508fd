//! `flashmoe bench e2e`: end-to-end decoder models in PyTorch. `python/flashmoe_e2e.py`
//! builds the models and runs every implementation's gate and timing (`--train`'s training
//! steps in `python/flashmoe_e2e_train.py`), writing its raw samples to
//! OUT/e2e-samples.json; this module starts it, then turns the samples into the lab's
//! results (`flashmoe_bench::e2e`: the pipeline's statistics, results.json / .csv / .md and
//! report.html, readable by `flashmoe report` and `flashmoe compare`). `--from-samples`
//! does the second half alone, without PyTorch.

use crate::backend;
use crate::BenchArgs;
use anyhow::{bail, Context};
use flashmoe_bench::e2e::{self, SamplesFile};
use flashmoe_bench::manifest::Manifest;
use flashmoe_bench::report;
use flashmoe_bench::runner::python::locate_python_script;
use std::path::Path;
use std::process::{Command, ExitCode};

/// The host manifest `bench e2e` records beside the samples before the script runs.
const MANIFEST_FILE: &str = "manifest.json";

pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    if args.config.is_some() {
        bail!("bench e2e takes --preset (seed003, moe, all, smoke), not --config");
    }
    if args.no_baselines {
        bail!(
            "bench e2e always runs PyTorch (the models are PyTorch modules): drop --no-baselines"
        );
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create output directory {}", args.out.display()))?;
    if let Some(samples) = &args.from_samples {
        return convert(samples, &args.out, args.candidate.as_deref());
    }
    let script =
        locate_python_script("flashmoe_e2e.py", "FLASHMOE_E2E").map_err(anyhow::Error::msg)?;
    let manifest = backend::manifest_with_gpu();
    std::fs::write(
        args.out.join(MANIFEST_FILE),
        serde_json::to_string_pretty(&manifest)?,
    )
    .with_context(|| format!("cannot write to {}", args.out.display()))?;
    let samples = args.out.join(e2e::SAMPLES_FILE);
    // A stale file from an earlier run must not be reported as this one.
    let _ = std::fs::remove_file(&samples);

    let mut cmd = Command::new(&args.python);
    cmd.arg(&script)
        .arg("--preset")
        .arg(args.preset.as_deref().unwrap_or("seed003"))
        .arg("--out")
        .arg(&args.out)
        .arg("--seed")
        .arg(args.seed.to_string());
    if !args.implementations.is_empty() {
        cmd.arg("--impl").arg(args.implementations.join(","));
    }
    if let Some(t) = args.max_time {
        cmd.arg("--max-time").arg(t.to_string());
    }
    if args.cpu {
        cmd.arg("--cpu");
    }
    if args.train {
        cmd.arg("--train");
    }
    if let Some(n) = args.steps {
        cmd.arg("--steps").arg(n.to_string());
    }
    if let Some(lr) = args.lr {
        cmd.arg("--lr").arg(lr.to_string());
    }
    let status = cmd.status().with_context(|| {
        format!(
            "cannot start {} {} (bench e2e needs python3 with PyTorch)",
            args.python.display(),
            script.display()
        )
    })?;
    match status.code() {
        // 0: every gate passed; 1: one failed or errored (the samples say which).
        Some(0 | 1) => {}
        // 2: usage (argparse); anything else: the script died.
        Some(c) if !samples.exists() => return Ok(ExitCode::from(u8::try_from(c).unwrap_or(2))),
        None if !samples.exists() => bail!("{} was killed by a signal", script.display()),
        _ => eprintln!(
            "{} stopped early ({status}): reporting the configs it finished",
            script.display()
        ),
    }
    let code = convert(&samples, &args.out, args.candidate.as_deref())?;
    Ok(if status.success() {
        code
    } else {
        ExitCode::from(1)
    })
}

/// The samples file → the lab's reports in `out`; exit 1 when an implementation failed
/// its gate or errored.
fn convert(samples: &Path, out: &Path, candidate: Option<&str>) -> anyhow::Result<ExitCode> {
    let file = SamplesFile::read(samples)?;
    let recorded = samples
        .parent()
        .map(|d| d.join(MANIFEST_FILE))
        .and_then(|p| std::fs::read_to_string(p).ok());
    let manifest = match recorded {
        Some(text) => serde_json::from_str::<Manifest>(&text)
            .with_context(|| format!("the {MANIFEST_FILE} beside {}", samples.display()))?,
        None => Manifest::collect(),
    };
    let results = e2e::to_run_results(&file, manifest, candidate)?;
    print!("{}", report::terminal_table(&results));
    for p in report::write_all(&results, out)? {
        println!("wrote {}", p.display());
    }
    Ok(if file.any_failed() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
