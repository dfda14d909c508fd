//! `flashmoe bench e2e`: end-to-end decoder models in PyTorch, run by
//! `python/flashmoe_e2e.py` (the models, the implementations, the gate, the timing and the
//! report live there; `--train`'s training steps in `python/flashmoe_e2e_train.py`); this
//! module passes the options on and records the manifest.

use crate::backend;
use crate::BenchArgs;
use anyhow::{bail, Context};
use flashmoe_bench::runner::python::locate_python_script;
use std::process::{Command, ExitCode};

pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    if args.config.is_some() {
        bail!("bench e2e takes --preset (seed003, moe, all, smoke), not --config");
    }
    if args.no_baselines {
        bail!(
            "bench e2e always runs PyTorch (the models are PyTorch modules): drop --no-baselines"
        );
    }
    let script =
        locate_python_script("flashmoe_e2e.py", "FLASHMOE_E2E").map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create output directory {}", args.out.display()))?;
    let manifest = backend::manifest_with_gpu();
    std::fs::write(
        args.out.join("manifest.json"),
        serde_json::to_string_pretty(&manifest)?,
    )
    .with_context(|| format!("cannot write to {}", args.out.display()))?;

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
    let status = cmd.status().with_context(|| {
        format!(
            "cannot start {} {} (bench e2e needs python3 with PyTorch)",
            args.python.display(),
            script.display()
        )
    })?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        // 1: an implementation failed the gate or errored; 2: usage (argparse).
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(2)),
        None => bail!("{} was killed by a signal", script.display()),
    })
}
