//! `flashmoe check`: correctness of every implementation over the shape matrix.

use crate::backend;
use crate::CheckArgs;
use flashmoe_bench::config::{self, Suite};
use flashmoe_bench::grad::{self, Pass};
use flashmoe_bench::runner::check::{render, run_checks, CheckRow};
use flashmoe_bench::runner::Implementation;
use std::process::ExitCode;

pub fn run(args: &CheckArgs) -> anyhow::Result<ExitCode> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let suites: Vec<Suite> = match args.suite {
        Some(s) => vec![s.lab_suite()?],
        None => vec![Suite::Attention, Suite::Moe],
    };
    println!("check seed {seed} (replay with --seed {seed})");
    let mut all: Vec<CheckRow> = Vec::new();
    for suite in suites {
        if args.pass != Pass::Fwd {
            all.extend(check_gradients(suite, args, seed)?);
            if args.pass == Pass::Bwd {
                continue;
            }
        }
        let lab = backend::select(suite, args.cpu, seed, true, None);
        // The reference itself is not "checked" against itself.
        let under_test: Vec<&dyn Implementation> = lab
            .implementations
            .iter()
            .filter(|i| i.name() != "cpu-reference")
            .map(|b| b.as_ref())
            .collect();
        if under_test.is_empty() {
            println!(
                "{}: no implementation besides the reference on this machine; nothing to check",
                suite.name()
            );
            continue;
        }
        let seqlens = match (lab.on_gpu(), args.quick) {
            (true, true) => config::GPU_CHECK_SEQLENS_QUICK,
            (true, false) => config::GPU_CHECK_SEQLENS,
            (false, true) => config::CPU_CHECK_SEQLENS_QUICK,
            (false, false) => config::CPU_CHECK_SEQLENS,
        };
        let mut problems = config::check_matrix(suite, args.quick, seqlens);
        if suite == Suite::Moe && lab.on_gpu() {
            problems.extend(config::moe_gpu_check_shapes(args.quick));
        }
        if suite == Suite::Varlen && lab.on_gpu() {
            problems.extend(config::varlen_gpu_check_shapes(args.quick));
        }
        let rows = run_checks(
            &problems,
            &under_test,
            lab.reference.as_ref(),
            seed,
            print_failures,
        );
        all.extend(rows);
    }
    println!("{}", render(&all));
    if args.pass != Pass::Fwd {
        println!(
            "gradient configs: one row per gradient against the f64 backward (rel-L2 within \
             the forward's tolerance, every row within {}x it)",
            flashmoe::accuracy::GRADIENT_ROW_FACTOR
        );
    }
    let failed = all.iter().filter(|r| !r.passed()).count();
    let skipped = all.iter().filter(|r| r.is_skip()).count();
    let passed = all.len() - failed - skipped;
    println!("{passed} passed, {failed} failed, {skipped} skipped");
    Ok(if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The gradient check of one suite: its gradient matrix (`grad::config::check_matrix`)
/// against the f64 backward, every implementation of the gradient lab but the reference.
fn check_gradients(suite: Suite, args: &CheckArgs, seed: u64) -> anyhow::Result<Vec<CheckRow>> {
    let mut problems = grad::config::check_matrix(suite, args.quick, args.pass)?;
    let lab = backend::select_grad(suite, args.cpu, seed, None);
    if lab.on_gpu() {
        problems.extend(grad::config::gpu_check_shapes(suite, args.quick, args.pass));
    }
    let under_test: Vec<&dyn Implementation> = lab
        .implementations
        .iter()
        .filter(|i| i.name() != "cpu-reference")
        .map(|b| b.as_ref())
        .collect();
    Ok(run_checks(
        &problems,
        &under_test,
        lab.reference.as_ref(),
        seed,
        print_failures,
    ))
}

/// One stderr line per failed row of a finished case (progress while the matrix runs).
fn print_failures(case: &[CheckRow]) {
    for r in case.iter().filter(|r| !r.passed()) {
        eprintln!(
            "FAIL {} / {}: {:?}",
            r.config,
            r.implementation,
            r.error
                .clone()
                .or_else(|| r.accuracy.as_ref().and_then(|a| a.note.clone()))
        );
    }
}
