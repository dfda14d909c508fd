//! `flashmoe bench moe --gpus N`: start one rank process per GPU (`flashmoe ep-rank`,
//! hidden), watch them, gather their samples into the lab's results (suite `ep`,
//! `flashmoe_bench::ep::to_run_results`) and write the standard reports.
//!
//! Every rank gets NVLink multicast switched off (NCCL_NVLS_ENABLE=0,
//! TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1: it can take a shared
//! host's GPUs out of service) and a library directory with a `libnccl.so` link first on
//! LD_LIBRARY_PATH (cudarc opens NCCL by that name; Python's NCCL wheel has only
//! `libnccl.so.2`). When a rank fails, the others get their own timeout to report their
//! error, then the launcher stops them; every rank's status is in the report.

use crate::BenchArgs;
use anyhow::{bail, Context, Result};
use flashmoe_bench::config::{self, Suite};
use flashmoe_bench::ep::{EpOutcome, EpRankOptions, EpRankResult};
use flashmoe_bench::report;
use flashmoe_bench::results::ProblemSpec;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

/// Environment every rank gets (KINDS.md: NVLink multicast must stay off).
pub const NO_MULTICAST: [(&str, &str); 3] = [
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
];

pub fn run(args: &BenchArgs, world: usize) -> Result<ExitCode> {
    if !matches!(args.suite, crate::SuiteArg::Moe) {
        bail!("--gpus runs the expert-parallel MoE layer: use `flashmoe bench moe --gpus N`");
    }
    if world == 0 {
        bail!("--gpus needs at least 1 GPU");
    }
    let preset = args.preset.clone().unwrap_or_else(|| "deepseek-v3".into());
    let specs = config::preset(Suite::Moe, &preset, true)?;
    let Some(ProblemSpec::Moe(p)) = specs.first() else {
        bail!("preset {preset} has no MoE shape");
    };
    let have = flashmoe::gpu::device_count().unwrap_or(0);
    if have < world {
        bail!("--gpus {world}: this machine has {have} GPU(s)");
    }
    if args.tokens.is_empty() || args.tokens.contains(&0) {
        bail!("--tokens needs positive token counts per GPU");
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let scratch = std::env::temp_dir().join(format!("flashmoe-ep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let (rdv, libdir) = (scratch.join("rendezvous"), scratch.join("lib"));
    std::fs::create_dir_all(&rdv)?;
    std::fs::create_dir_all(&libdir)?;
    let mut ld_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    if world > 1 {
        match flashmoe::moe::ep::find_nccl_library() {
            Some(lib) => {
                std::os::unix::fs::symlink(&lib, libdir.join("libnccl.so"))?;
                eprintln!("NCCL: {}", lib.display());
                ld_path = format!("{}:{ld_path}", libdir.display());
            }
            None => eprintln!(
                "NCCL: no libnccl found (set FLASHMOE_NCCL_LIB); the ranks will report it"
            ),
        }
    }
    let base = EpRankOptions {
        rank: 0,
        world,
        rendezvous: rdv.clone(),
        preset: preset.clone(),
        hidden: p.hidden,
        intermediate: p.intermediate,
        experts: p.experts,
        top_k: p.top_k,
        scoring: p.scoring,
        tokens: args.tokens.clone(),
        chunks: args.chunks,
        seed: args.seed,
        rounds: args.rounds,
        timeout_s: args.timeout,
        comm_ctas: args.comm_ctas,
    };
    let exe = std::env::current_exe()?;
    let mut children: Vec<(usize, Child)> = Vec::new();
    for rank in 0..world {
        let opts = EpRankOptions {
            rank,
            ..base.clone()
        };
        let mut cmd = Command::new(&exe);
        cmd.arg("ep-rank")
            .arg("--options")
            .arg(serde_json::to_string(&opts)?)
            .arg("--out")
            .arg(rank_file(&args.out, rank))
            .env("LD_LIBRARY_PATH", &ld_path);
        for (k, v) in NO_MULTICAST {
            cmd.env(k, v);
        }
        let _ = std::fs::remove_file(rank_file(&args.out, rank));
        children.push((
            rank,
            cmd.spawn()
                .with_context(|| format!("starting rank {rank}"))?,
        ));
    }
    let failures = supervise(&mut children, Duration::from_secs_f64(args.timeout + 15.0));
    let mut ranks: Vec<EpRankResult> = Vec::new();
    let mut failures = failures;
    for rank in 0..world {
        match std::fs::read_to_string(rank_file(&args.out, rank))
            .ok()
            .and_then(|s| serde_json::from_str::<EpRankResult>(&s).ok())
        {
            Some(r) => {
                if let Some(e) = &r.error {
                    eprintln!("{e}");
                }
                ranks.push(r)
            }
            None => failures.push(format!("rank {rank} wrote no result")),
        }
    }
    let topology = Command::new("nvidia-smi")
        .args(["topo", "-m"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_else(|e| format!("nvidia-smi topo -m failed: {e}"));
    let mut manifest = crate::backend::manifest_with_gpu();
    manifest.topology = Some(topology);
    for f in &failures {
        eprintln!("{f}");
    }
    let results = flashmoe_bench::ep::to_run_results(manifest, &base, &ranks, &failures);
    let _ = std::fs::remove_dir_all(&scratch);
    print!("{}", report::terminal_table(&results));
    for p in report::write_all(&results, &args.out)? {
        println!("wrote {}", p.display());
    }
    Ok(
        match flashmoe_bench::ep::outcome(world, &args.tokens, &ranks, &failures) {
            EpOutcome::Correct => ExitCode::SUCCESS,
            EpOutcome::Incorrect => ExitCode::from(1),
            EpOutcome::RankFailed => ExitCode::from(2),
        },
    )
}

fn rank_file(out: &Path, rank: usize) -> PathBuf {
    out.join(format!("rank-{rank}.json"))
}

/// Wait for every rank; once one fails, give the rest `grace` to finish (their own
/// timeouts turn a dead peer into their error), then stop them. Returns the failures.
fn supervise(children: &mut [(usize, Child)], grace: Duration) -> Vec<String> {
    let mut failures = Vec::new();
    let mut done = vec![false; children.len()];
    let mut deadline: Option<Instant> = None;
    while done.iter().any(|d| !d) {
        for (i, (rank, child)) in children.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(st)) => {
                    done[i] = true;
                    if !st.success() {
                        failures.push(format!("rank {rank} exited with {st}"));
                        deadline.get_or_insert(Instant::now() + grace);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    done[i] = true;
                    failures.push(format!("rank {rank}: cannot wait for it: {e}"));
                }
            }
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            for (i, (rank, child)) in children.iter_mut().enumerate() {
                if !done[i] {
                    let _ = child.kill();
                    let _ = child.wait();
                    done[i] = true;
                    failures.push(format!(
                        "rank {rank} was still running {:.0} s after a peer failed: stopped",
                        grace.as_secs_f64()
                    ));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    failures
}

/// The hidden `ep-rank` subcommand: one rank, its result written as JSON.
pub fn rank(options: &str, out: &Path) -> Result<ExitCode> {
    let opts: EpRankOptions = serde_json::from_str(options).context("parsing --options")?;
    let res = flashmoe_bench::ep::run_rank(&opts);
    flashmoe_bench::ep::write_rank_result(out, &res)?;
    Ok(if res.error.is_some() {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}
