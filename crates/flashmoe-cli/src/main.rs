//! `flashmoe`: benchmark and check attention / MoE kernels against the best alternatives.

mod backend;
mod bench;
mod check;
mod e2e;
mod ep;
mod profile;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use flashmoe_bench::config::Suite;
use flashmoe_bench::grad::Pass;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "flashmoe",
    version,
    about = "FlashAttention and MoE kernels, benchmarked honestly"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure implementations side by side and write a report.
    Bench(BenchArgs),
    /// Check every implementation against the high-precision reference.
    Check(CheckArgs),
    /// Compare two result files; exit 1 on a significant regression, 3 on ENV-DRIFT.
    Compare(CompareArgs),
    /// Profile implementations on chosen configs with Nsight Compute (ncu).
    Profile(ProfileArgs),
    /// One profiled call (run by `profile` under ncu).
    #[command(hide = true)]
    ProfileTarget(ProfileTargetArgs),
    /// Re-render a results file's Markdown and HTML reports next to it (NAME.md, NAME.html).
    Report {
        /// A results.json written by `bench`.
        results: PathBuf,
    },
    /// Print the environment manifest.
    Env {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// One rank of `bench moe --gpus N` (started by it).
    #[command(hide = true)]
    EpRank {
        /// The rank's options as JSON.
        #[arg(long)]
        options: String,
        /// Where to write the rank's result (JSON).
        #[arg(long)]
        out: PathBuf,
    },
    /// Serve this build's implementations over the worker protocol on stdin/stdout (what
    /// `bench --against THIS_BINARY` drives).
    #[command(hide = true)]
    Serve {
        #[arg(long, value_enum)]
        suite: SuiteArg,
        /// Serve the CPU implementations even when a GPU is present.
        #[arg(long)]
        cpu: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum SuiteArg {
    Attention,
    Moe,
    /// Paged-KV decode attention.
    Decode,
    /// Packed (varlen) prefill over sequences of unequal lengths.
    Varlen,
    /// DeepSeek MLA decode over a paged latent cache.
    Mla,
    /// End-to-end decoder models in PyTorch (`python/flashmoe_e2e.py`; bench only).
    E2e,
}

impl SuiteArg {
    /// The lab suite measured by the Rust pipeline; `e2e` runs in the Python script instead.
    pub(crate) fn lab_suite(self) -> anyhow::Result<Suite> {
        match self {
            SuiteArg::Attention => Ok(Suite::Attention),
            SuiteArg::Moe => Ok(Suite::Moe),
            SuiteArg::Decode => Ok(Suite::Decode),
            SuiteArg::Varlen => Ok(Suite::Varlen),
            SuiteArg::Mla => Ok(Suite::Mla),
            SuiteArg::E2e => anyhow::bail!(
                "e2e has no check suite: `bench e2e` gates every model's logits against an fp32 forward"
            ),
        }
    }
}

#[derive(Args)]
pub struct BenchArgs {
    /// What to benchmark.
    #[arg(value_enum)]
    suite: SuiteArg,
    /// Named set of configs: attention quick|sweep|seed002|seed003|window; moe quick|seed003|mixtral|qwen3-30b|deepseek-v3; decode decode|paged; varlen varlen; e2e seed003|moe|all|smoke. Default: quick (attention, moe), decode (decode), varlen (varlen).
    #[arg(long, conflicts_with = "config")]
    preset: Option<String>,
    /// TOML file listing the configs (see README).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Comma-separated implementation names to run (default: all available); a name
    /// py:MODULE:FUNCTION adds a Python plug-in (docs/plugins.md).
    #[arg(long = "impl", value_delimiter = ',')]
    implementations: Vec<String>,
    /// Implementation whose speedup against the others is reported.
    #[arg(long)]
    candidate: Option<String>,
    /// Output directory for results.json/.csv/.md and report.html.
    #[arg(long, default_value = "out")]
    out: PathBuf,
    /// Seed of the input generator and the bootstrap.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Target relative half-width of the median's 95% CI (e.g. 1% or 0.01).
    #[arg(long, value_parser = parse_fraction)]
    target_ci: Option<f64>,
    /// Sampling time cap per config, seconds.
    #[arg(long)]
    max_time: Option<f64>,
    /// Practical threshold for verdicts (e.g. 2% or 0.02).
    #[arg(long, value_parser = parse_fraction, default_value = "2%")]
    threshold: f64,
    /// Run the CPU implementations even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    /// Python interpreter with PyTorch for the baselines (GPU runs).
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// Skip the PyTorch baselines.
    #[arg(long)]
    no_baselines: bool,
    /// An old flashmoe binary: its implementations run interleaved with this build's in
    /// the same run (named old:NAME), and the run exits 1 when any implementation is
    /// significantly slower than its old self (the recommended CI gate).
    #[arg(long, value_name = "OLD_BINARY")]
    against: Option<PathBuf>,
    /// With --against: sampling of a config goes on past --max-time until the CI of every
    /// implementation's change against its old self resolves the ±threshold band (entirely
    /// beyond it or entirely inside it), up to this many seconds per config (default: 4×
    /// the sampling time cap).
    #[arg(long, value_name = "SECONDS", requires = "against")]
    against_max_time: Option<f64>,
    /// Expert parallelism (moe only): the MoE layer across N GPUs of this host, one rank
    /// process per GPU over NCCL; writes the reports of suite `ep` (implementations
    /// single-gpu, expert-parallel, all-to-all) and each rank's rank-N.json into --out
    /// (default preset deepseek-v3).
    #[arg(long, value_name = "N")]
    gpus: Option<usize>,
    /// Tokens per GPU for --gpus (comma-separated; one config each).
    #[arg(long, value_delimiter = ',', default_values_t = [4096usize, 8192, 16384])]
    tokens: Vec<usize>,
    /// Expert chunks per rank for --gpus: each chunk's transfers overlap the GEMMs of others
    /// (2 measured best at DeepSeek-V3 shapes on 2×H100: 88–93% weak-scaling efficiency,
    /// against 79–86% with 1 chunk; BENCHMARKS.md).
    #[arg(long, default_value_t = 2)]
    chunks: usize,
    /// Timed rounds per config for --gpus (after 2 warm-up rounds).
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Seconds a rank waits for its peers before it aborts with an error (--gpus).
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Cap on the thread blocks NCCL's kernels use (NCCL maxCTAs) for --gpus.
    #[arg(long)]
    comm_ctas: Option<u32>,
    /// Which pass to measure (attention, varlen, moe): fwd (the layer), bwd (its backward
    /// alone over a retained forward; FLOPs 2.5 × the forward's for attention, 2 × for
    /// MoE) or fwd+bwd (both; 3.5 × / 3 ×).
    #[arg(long, default_value = "fwd", value_parser = parse_pass)]
    pass: Pass,
    /// e2e only: time training steps (forward, backward, AdamW) and check that every
    /// implementation's loss curve follows the reference's, instead of the inference forward.
    #[arg(long)]
    train: bool,
    /// Steps per implementation for `bench e2e --train` (the length of the loss curve).
    #[arg(long, value_name = "N", requires = "train")]
    steps: Option<usize>,
    /// AdamW's peak learning rate for `bench e2e --train` (default: the script's, 3e-4).
    #[arg(long, value_name = "LR", requires = "train", value_parser = parse_learning_rate)]
    lr: Option<f64>,
    /// e2e only: write the reports of a samples file python/flashmoe_e2e.py wrote
    /// (OUT/e2e-samples.json) instead of running the models; needs no PyTorch.
    #[arg(long, value_name = "FILE")]
    from_samples: Option<PathBuf>,
}

#[derive(Args)]
pub struct CheckArgs {
    /// Which suite to check (default: attention and moe; decode and varlen on request).
    #[arg(long, value_enum)]
    suite: Option<SuiteArg>,
    /// A smaller matrix (one representative per feature).
    #[arg(long)]
    quick: bool,
    /// Seed for the inputs (default: fresh each run, printed so a failure can be replayed).
    #[arg(long)]
    seed: Option<u64>,
    /// Check the CPU implementations even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    /// fwd (the layers' outputs), bwd (their gradients: dq, dk, dv / MoE dx and the
    /// weight gradients, against the f64 backward) or fwd+bwd (both matrices).
    #[arg(long, default_value = "fwd", value_parser = parse_pass)]
    pass: Pass,
}

/// "fwd" | "bwd" | "fwd+bwd".
fn parse_pass(s: &str) -> Result<Pass, String> {
    s.parse()
}

fn parse_learning_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(lr) if lr.is_finite() && lr > 0.0 => Ok(lr),
        _ => Err(format!(
            "'{s}' is not a learning rate: a finite number above 0, e.g. 3e-4"
        )),
    }
}

#[derive(Args)]
pub struct ProfileArgs {
    /// What to profile.
    #[arg(value_enum)]
    suite: SuiteArg,
    /// Named set of configs (as for bench).
    #[arg(long, conflicts_with = "config")]
    preset: Option<String>,
    /// TOML file listing the configs.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Keep only configs whose id contains one of these (comma-separated), e.g. d128_causal.
    #[arg(long, value_delimiter = ',')]
    select: Vec<String>,
    /// Comma-separated implementations to profile (ours and Python baselines).
    #[arg(long = "impl", value_delimiter = ',')]
    implementations: Vec<String>,
    /// Output directory for profile.json, profile.md and the ncu reports.
    #[arg(long, default_value = "out-profile")]
    out: PathBuf,
    /// Path of ncu (default: $FLASHMOE_NCU, ncu on PATH, /usr/local/cuda/bin/ncu).
    #[arg(long)]
    ncu: Option<PathBuf>,
    /// Seed of the input generator.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Python interpreter with PyTorch for the baselines.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
}

#[derive(Args)]
pub struct ProfileTargetArgs {
    /// The config as JSON (a ProblemSpec).
    #[arg(long)]
    problem: String,
    #[arg(long = "impl")]
    implementation: String,
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    #[arg(long, default_value = "python3")]
    python: PathBuf,
}

#[derive(Args)]
struct CompareArgs {
    old: PathBuf,
    new: PathBuf,
    /// Practical threshold (e.g. 2% or 0.02): smaller changes never count as regressions.
    #[arg(long, value_parser = parse_fraction, default_value = "2%")]
    threshold: f64,
    /// Also write the comparison (every change, its CIs and verdicts) as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// "2%" → 0.02, "0.02" → 0.02.
fn parse_fraction(s: &str) -> Result<f64, String> {
    let (num, scale) = match s.strip_suffix('%') {
        Some(n) => (n, 0.01),
        None => (s, 1.0),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number or percentage"))?;
    let v = v * scale;
    if !(0.0..1.0).contains(&v) {
        return Err(format!("'{s}' must be between 0% and 100%"));
    }
    Ok(v)
}

fn compare(args: &CompareArgs) -> anyhow::Result<ExitCode> {
    use flashmoe_bench::compare::{compare_runs, CompareOptions};
    let old = flashmoe_bench::report::read_json(&args.old)
        .with_context(|| format!("reading {}", args.old.display()))?;
    let new = flashmoe_bench::report::read_json(&args.new)
        .with_context(|| format!("reading {}", args.new.display()))?;
    let opts = CompareOptions {
        threshold: args.threshold,
        ..CompareOptions::default()
    };
    let report = compare_runs(&old, &new, &opts);
    println!("{}", report.render());
    if let Some(path) = &args.json {
        let mut v = serde_json::to_value(&report)?;
        v["exit_code"] = report.exit_code().into();
        std::fs::write(path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::from(print_gate(&report, args.threshold)))
}

/// The one-line outcome of a regression gate, and its exit code (documented in
/// docs/library.md and the README: 0 pass, 1 regression, 3 env-drift, 2 error).
pub(crate) fn print_gate(report: &flashmoe_bench::compare::CompareReport, threshold: f64) -> u8 {
    let code = report.exit_code();
    match code {
        flashmoe_bench::compare::EXIT_REGRESSION => println!(
            "REGRESSION: {} significant slowdown(s) beyond {:.1}% (exit {code})",
            report.regressions,
            threshold * 100.0
        ),
        flashmoe_bench::compare::EXIT_ENV_DRIFT if report.unresolved_slowdowns > 0 => println!(
            "UNRESOLVED: {} slowdown(s) beyond {:.1}% measured but not confirmed before the \
             sampling cap (the CI still touches the band): rerun, or raise --against-max-time \
             (exit {code})",
            report.unresolved_slowdowns,
            threshold * 100.0
        ),
        flashmoe_bench::compare::EXIT_ENV_DRIFT => println!(
            "ENV-DRIFT: {} change(s) the calibration attributes to the machine, no confirmed \
             regression beyond {:.1}% (exit {code})",
            report.env_drifts,
            threshold * 100.0
        ),
        _ => println!("no significant regression beyond {:.1}%", threshold * 100.0),
    }
    code
}

fn report(path: &std::path::Path) -> anyhow::Result<ExitCode> {
    use flashmoe_bench::report;
    let results = report::read_json(path).with_context(|| format!("reading {}", path.display()))?;
    for (ext, text) in [
        ("md", report::to_markdown(&results)),
        ("html", report::to_html(&results)),
    ] {
        let out = path.with_extension(ext);
        report::write_atomic(&out, text.as_bytes())?;
        println!("wrote {}", out.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn serve(suite: Suite, cpu: bool) -> anyhow::Result<ExitCode> {
    use flashmoe_bench::runner::serve::{serve, ServeInfo};
    let lab = backend::select(suite, cpu, 0, false, None);
    let info = ServeInfo {
        device: if lab.on_gpu() { "cuda" } else { "cpu" }.into(),
        timer: lab.settings.timer.clone(),
        gpu_name: lab.manifest.gpu.as_ref().map(|g| g.name.clone()),
    };
    serve(
        &lab.implementations,
        &info,
        std::io::stdin().lock(),
        std::io::stdout().lock(),
    )?;
    Ok(ExitCode::SUCCESS)
}

fn env(json: bool) -> anyhow::Result<ExitCode> {
    let manifest = backend::manifest_with_gpu();
    if json {
        println!("{}", serde_json::to_string_pretty(&manifest)?);
    } else {
        let v = serde_json::to_value(&manifest)?;
        for (k, val) in v.as_object().into_iter().flatten() {
            match val {
                serde_json::Value::Object(_) => println!("{k}: {val}"),
                serde_json::Value::String(s) => println!("{k}: {s}"),
                other => println!("{k}: {other}"),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Bench(args) => bench::run(args),
        Command::Check(args) => check::run(args),
        Command::Compare(args) => compare(args),
        Command::Profile(args) => profile::run(args),
        Command::ProfileTarget(args) => profile::target(args),
        Command::Env { json } => env(*json),
        Command::Report { results } => report(results),
        Command::Serve { suite, cpu } => suite.lab_suite().and_then(|s| serve(s, *cpu)),
        Command::EpRank { options, out } => ep::rank(options, out),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions() {
        assert_eq!(parse_fraction("2%").unwrap(), 0.02);
        assert_eq!(parse_fraction("0.05").unwrap(), 0.05);
        assert!(parse_fraction("abc").is_err());
        assert!(parse_fraction("150%").is_err());
    }

    fn bench_err(args: &[&str]) -> String {
        let cli = Cli::try_parse_from(args).unwrap();
        let Command::Bench(b) = &cli.command else {
            panic!("not a bench command")
        };
        format!("{:#}", bench::run(b).unwrap_err())
    }

    /// `--gpus` is the expert-parallel MoE launcher: other suites, zero GPUs, more GPUs
    /// than the machine has and bad token lists are errors before any rank starts.
    #[test]
    fn gpus_flag_errors_are_clear() {
        let e = bench_err(&["flashmoe", "bench", "attention", "--gpus", "2"]);
        assert!(e.contains("bench moe --gpus"), "{e}");
        let e = bench_err(&["flashmoe", "bench", "moe", "--gpus", "0"]);
        assert!(e.contains("at least 1 GPU"), "{e}");
        let e = bench_err(&["flashmoe", "bench", "moe", "--gpus", "64"]);
        assert!(e.contains("--gpus 64: this machine has"), "{e}");
        let cli = Cli::try_parse_from(["flashmoe", "bench", "moe", "--gpus", "2"]).unwrap();
        let Command::Bench(b) = &cli.command else {
            panic!()
        };
        assert_eq!((b.tokens.clone(), b.chunks), (vec![4096, 8192, 16384], 2));
    }

    /// `--train` belongs to the e2e suite: elsewhere it is an error, not ignored.
    #[test]
    fn train_flag_is_e2e_only() {
        let e = bench_err(&["flashmoe", "bench", "attention", "--train"]);
        assert!(e.contains("bench e2e --train"), "{e}");
        assert!(Cli::try_parse_from(["flashmoe", "bench", "e2e", "--steps", "5"]).is_err());
        assert!(Cli::try_parse_from(["flashmoe", "bench", "e2e", "--lr", "1e-4"]).is_err());
        assert!(Cli::try_parse_from(["flashmoe", "bench", "e2e", "--train", "--lr", "0"]).is_err());
        assert!(
            Cli::try_parse_from(["flashmoe", "bench", "e2e", "--train", "--lr", "1e-4"]).is_ok()
        );
    }
}
