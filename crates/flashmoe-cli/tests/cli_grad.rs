//! `--pass bwd|fwd+bwd` as a user runs it on the CPU: the gradient check (one row per
//! gradient against the f64 backward) and the backward bench end to end.

use flashmoe_bench::grad::{GradLayer, Pass};
use flashmoe_bench::report;
use flashmoe_bench::results::ProblemSpec;
use std::process::{Command, Output};

fn flashmoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashmoe"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("the binary runs")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

#[test]
fn cpu_gradient_check_and_backward_bench_run_end_to_end() {
    // The check: attention and MoE (the default suites), every gradient a row.
    let o = flashmoe(&["check", "--cpu", "--pass", "bwd", "--quick", "--seed", "5"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    let last = out.lines().last().unwrap_or_default();
    assert!(last.ends_with(" 0 failed, 0 skipped"), "{last}");
    for row in [
        "[bwd] dq ",
        "[bwd] dk ",
        "[bwd] dv ",
        "[bwd] dx ",
        "[bwd] d_router ",
        "[bwd] dw13 ",
        "[bwd] dw2 ",
        " d_shared_w13 ",
        "router Tied dx ",
        "router Skewed dx ",
    ] {
        assert!(out.contains(row), "no '{row}' row in:\n{out}");
    }
    assert!(out.contains("cpu-tiled") && out.contains("cpu-grouped"));

    // fwd+bwd checks both matrices (varlen: the forward's rows, then the gradients').
    let o = flashmoe(&[
        "check", "--cpu", "--pass", "fwd+bwd", "--suite", "varlen", "--quick", "--seed", "6",
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert!(
        out.contains("[fwd+bwd] dk ") && out.contains("cpu-tiled"),
        "{out}"
    );
    assert!(out
        .lines()
        .any(|l| l.contains("varlen") && !l.contains("[fwd+bwd]")));

    // The bench: attention backward and MoE fwd+bwd from config files, every report.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tiny.toml");
    std::fs::write(
        &cfg,
        "[[attention]]\nbatch = 1\nheads_q = 4\nheads_kv = 2\nseqlen = 48\n\
         head_dim = 32\ncausal = [false, true]\ndtype = \"bf16\"\n\
         [[moe]]\ntokens = 24\nhidden = 32\nintermediate = 16\nexperts = 4\ntop_k = 2\n",
    )
    .unwrap();
    for (suite, pass, factor, candidate) in [
        ("attention", "bwd", 2.5, "cpu-tiled"),
        ("moe", "fwd+bwd", 3.0, "cpu-grouped"),
    ] {
        let out_dir = dir.path().join(suite);
        let o = flashmoe(&[
            "bench",
            suite,
            "--cpu",
            "--pass",
            pass,
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out_dir.to_str().unwrap(),
            "--max-time",
            "0.1",
        ]);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(0), "{out}{err}");
        for f in ["results.json", "results.csv", "results.md", "report.html"] {
            assert!(out_dir.join(f).metadata().unwrap().len() > 100, "{f}");
        }
        let r = report::read_json(&out_dir.join("results.json")).unwrap();
        assert_eq!(r.candidate, candidate);
        assert!(!r.configs.is_empty());
        for c in &r.configs {
            let ProblemSpec::Grad(g) = &c.problem else {
                panic!("{}: not a gradient config", c.id)
            };
            assert_eq!(g.pass.to_string(), pass);
            let fwd = g.layer.forward().workload().flops();
            assert_eq!(c.flops, factor * fwd, "{}", c.id);
            assert!(
                matches!(
                    (&g.layer, suite),
                    (GradLayer::Attention(_), "attention") | (GradLayer::Moe(_), "moe")
                ),
                "{}",
                c.id
            );
            assert_eq!(c.comparisons.len(), 1, "{}: candidate vs reference", c.id);
            for imp in &c.implementations {
                let acc = imp.accuracy.as_ref().expect("gated");
                assert!(
                    acc.passed && acc.reference == "cpu-f64",
                    "{}: {acc:?}",
                    imp.name
                );
                assert!(imp.samples_ms.len() >= 2, "{} / {}", c.id, imp.name);
            }
        }
        assert!(g_pass_matches(&r, pass));
    }

    // A family without a backward, and a bad pass: one clear error line each.
    for (args, needle) in [
        (
            vec!["bench", "mla", "--cpu", "--pass", "bwd"],
            "no backward",
        ),
        (
            vec!["check", "--cpu", "--pass", "sideways"],
            "fwd, bwd or fwd+bwd",
        ),
        (vec!["bench", "e2e", "--pass", "bwd"], "kernel suites"),
        (
            vec!["bench", "moe", "--gpus", "2", "--pass", "fwd+bwd"],
            "kernel suites",
        ),
    ] {
        let o = flashmoe(&args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

fn g_pass_matches(r: &flashmoe_bench::results::RunResults, pass: &str) -> bool {
    let want: Pass = pass.parse().unwrap();
    r.configs
        .iter()
        .all(|c| matches!(&c.problem, ProblemSpec::Grad(g) if g.pass == want))
}
