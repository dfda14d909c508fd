//! The `flashmoe` binary as a user runs it: exit codes, one-line errors, files written.

use flashmoe_bench::report::{self, fixtures};
use std::path::Path;
use std::process::{Command, Output};

fn flashmoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashmoe"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// Bad input: exit 2, exactly one `error:` line that mentions `needle`, no panic.
fn assert_clean_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "stderr: {err}");
    assert!(
        lines[0].contains(needle),
        "expected '{needle}' in: {}",
        lines[0]
    );
    assert!(!err.contains("panicked"), "stderr: {err}");
}

#[test]
fn compare_exits_0_for_a_a_and_1_for_a_real_slowdown() {
    let dir = tempfile::tempdir().unwrap();
    let run = fixtures::gpu_attention_run();
    let a = dir.path().join("a.json");
    std::fs::write(&a, report::to_json(&run).unwrap()).unwrap();
    // A/A: the same code measured twice (independent noise, same distribution).
    let mut again = run.clone();
    for (ci, c) in again.configs.iter_mut().enumerate() {
        for (ii, imp) in c.implementations.iter_mut().enumerate() {
            if let Some(s) = &imp.summary {
                let n = imp.samples_ms.len().max(50);
                let seed = 1000 + (ci * 10 + ii) as u64;
                imp.samples_ms = fixtures::noisy_samples(s.median, 0.01, n, seed);
            }
        }
    }
    let b = dir.path().join("b.json");
    std::fs::write(&b, report::to_json(&again).unwrap()).unwrap();
    let o = flashmoe(&["compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));

    // Every sample 10% slower: a regression.
    let mut slow = again.clone();
    for c in &mut slow.configs {
        for imp in &mut c.implementations {
            imp.samples_ms.iter_mut().for_each(|t| *t *= 1.10);
        }
    }
    let s = dir.path().join("slow.json");
    std::fs::write(&s, report::to_json(&slow).unwrap()).unwrap();
    let o = flashmoe(&["compare", a.to_str().unwrap(), s.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("SLOWER") && out.contains("REGRESSION"),
        "{out}"
    );
}

#[test]
fn bad_input_gives_one_clear_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out = out.to_str().unwrap();
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench"];
        args.extend_from_slice(extra);
        flashmoe(&args)
    };
    assert_clean_error(
        &bench(&["attention", "--cpu", "--preset", "nope", "--out", out]),
        "nope",
    );
    assert_clean_error(
        &bench(&[
            "attention",
            "--cpu",
            "--config",
            "/no/such/file.toml",
            "--out",
            out,
        ]),
        "/no/such/file.toml",
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[attention]]\nbatch = 1\nheads_q = 6\nheads_kv = 4\nseqlen = 8\nhead_dim = 16\n",
    )
    .unwrap();
    let bad = bad.to_str().unwrap();
    assert_clean_error(
        &bench(&["attention", "--cpu", "--config", bad, "--out", out]),
        "heads_kv (4)",
    );
    let moe = dir.path().join("moe.toml");
    std::fs::write(
        &moe,
        "[[moe]]\ntokens = 4\nhidden = 8\nintermediate = 8\nexperts = 2\ntop_k = 3\n",
    )
    .unwrap();
    let moe = moe.to_str().unwrap();
    assert_clean_error(
        &bench(&["moe", "--cpu", "--config", moe, "--out", out]),
        "top_k (3)",
    );
    // An output directory that cannot be created (its parent is a regular file).
    let file = dir.path().join("plain-file");
    std::fs::write(&file, "x").unwrap();
    let unwritable = file.join("sub");
    assert_clean_error(
        &bench(&["attention", "--cpu", "--out", unwritable.to_str().unwrap()]),
        "plain-file",
    );
    assert_clean_error(
        &bench(&["attention", "--cpu", "--impl", "warp-drive", "--out", out]),
        "warp-drive",
    );
    // e2e runs in Python and has no Rust check suite or config files.
    assert_clean_error(
        &flashmoe(&["check", "--suite", "e2e"]),
        "e2e has no check suite",
    );
    assert_clean_error(
        &bench(&["e2e", "--cpu", "--config", bad, "--out", out]),
        "--preset",
    );
    let not_results = dir.path().join("x.json");
    std::fs::write(&not_results, "{\"hello\": 1}").unwrap();
    let nr = not_results.to_str().unwrap();
    assert_clean_error(&flashmoe(&["compare", nr, nr]), "x.json");
    assert!(
        !Path::new(out).join("results.json").exists(),
        "nothing measured, nothing written"
    );
}

#[test]
fn cpu_bench_from_a_config_file_writes_every_report() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tiny.toml");
    std::fs::write(
        &cfg,
        "[[attention]]\nbatch = 1\nheads_q = 4\nheads_kv = 2\nseqlen = [32, 64]\n\
         head_dim = 32\ncausal = [false, true]\ndtype = \"f16\"\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let o = flashmoe(&[
        "bench",
        "attention",
        "--cpu",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-time",
        "0.3",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("cpu-tiled") && stdout.contains("GFLOP/s"),
        "{stdout}"
    );
    for f in ["results.json", "results.csv", "results.md", "report.html"] {
        assert!(out.join(f).metadata().unwrap().len() > 100, "{f}");
    }
    let r = report::read_json(&out.join("results.json")).unwrap();
    assert_eq!(r.configs.len(), 4);
    assert!(!r.manifest.git_commit.is_empty() && r.manifest.cpu_cores >= 1);
    for c in &r.configs {
        assert_eq!(c.comparisons.len(), 1, "tiled vs reference in {}", c.id);
        for imp in &c.implementations {
            assert!(
                imp.samples_ms.len() >= 2,
                "raw samples kept for {} / {}",
                c.id,
                imp.name
            );
            assert!(imp.accuracy.as_ref().is_none_or(|a| a.passed));
        }
    }
}

#[test]
fn cpu_decode_preset_runs_the_paged_reference_and_writes_every_report() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = flashmoe(&[
        "bench",
        "decode",
        "--cpu",
        "--preset",
        "decode",
        "--out",
        out.to_str().unwrap(),
        "--max-time",
        "0.2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for f in ["results.json", "results.csv", "results.md", "report.html"] {
        assert!(out.join(f).metadata().unwrap().len() > 100, "{f}");
    }
    let r = report::read_json(&out.join("results.json")).unwrap();
    // Issue 22's 7 rows and issue 35's 10 shape classes (CPU sizes).
    assert_eq!((r.suite.as_str(), r.configs.len()), ("decode", 17));
    for c in &r.configs {
        let flashmoe_bench::results::ProblemSpec::Decode(p) = &c.problem else {
            panic!("{}: not a decode config", c.id)
        };
        // GB/s are of the K/V read once.
        assert_eq!(c.min_bytes, p.kv_bytes(), "{}", c.id);
        assert_eq!(
            c.comparisons.len(),
            1,
            "tiled vs paged reference in {}",
            c.id
        );
        for imp in &c.implementations {
            let acc = imp.accuracy.as_ref().unwrap();
            assert!(
                acc.passed && acc.reference == "cpu-f64",
                "{}: {acc:?}",
                imp.name
            );
            assert!(imp.gbps.is_some() && imp.samples_ms.len() >= 2);
        }
    }
    // The same run's configs compare cleanly with themselves.
    let json = out.join("results.json");
    let o = flashmoe(&["compare", json.to_str().unwrap(), json.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

/// `check --suite varlen --quick` on the CPU: the varlen check matrix (ragged batches with
/// empty sequences, Sk < Sq causal rows, window, softcap, both head dims, GQA 1/4, both
/// dtypes) against the per-sequence f64 reference, every row passing.
#[test]
fn cpu_varlen_quick_check_passes_end_to_end() {
    let o = flashmoe(&[
        "check", "--suite", "varlen", "--quick", "--cpu", "--seed", "7",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    let last = out.lines().last().unwrap_or_default();
    assert!(last.ends_with("passed, 0 failed, 0 skipped"), "{last}");
    let passed: usize = last.split_whitespace().next().unwrap().parse().unwrap();
    assert!(passed >= 6, "{out}");
    assert!(
        out.contains("varlen 17 seqs") && out.contains("cpu-tiled"),
        "{out}"
    );
    assert!(
        out.contains("window=(100,-1)") && out.contains("softcap=30"),
        "{out}"
    );
}

/// `check --suite mla --quick` and `bench mla` on the CPU: the MLA check matrix (ragged
/// lengths, Sq 1..4, Hq 16/128, bf16/f16, a long split batch) with the key-blocked f64
/// computation against the library's f64 reference, and the CPU preset through the whole
/// pipeline with the cache-byte model as the bytes.
#[test]
fn cpu_mla_check_and_bench_run_end_to_end() {
    use flashmoe_bench::results::ProblemSpec;
    let o = flashmoe(&["check", "--suite", "mla", "--quick", "--cpu", "--seed", "5"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    let last = out.lines().last().unwrap_or_default();
    assert!(last.ends_with("5 passed, 0 failed, 0 skipped"), "{last}");
    assert!(out.contains("MLA decode k4099,1000"), "{out}");
    let dir = tempfile::tempdir().unwrap();
    let o = flashmoe(&[
        "bench",
        "mla",
        "--cpu",
        "--out",
        dir.path().to_str().unwrap(),
        "--max-time",
        "0.05",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let r = report::read_json(&dir.path().join("results.json")).unwrap();
    assert_eq!((r.suite.as_str(), r.configs.len()), ("mla", 6));
    for c in &r.configs {
        let ProblemSpec::Mla(p) = &c.problem else {
            panic!("{}: not an MLA config", c.id)
        };
        assert_eq!(
            (c.flops, c.min_bytes),
            (p.flops(), p.kv_bytes()),
            "{}",
            c.id
        );
        for imp in &c.implementations {
            let acc = imp.accuracy.as_ref().unwrap();
            assert!(
                acc.passed && acc.reference == "cpu-f64",
                "{}: {acc:?}",
                imp.name
            );
        }
    }
}

/// `bench varlen --cpu`: the varlen preset (its CPU shapes) through the whole pipeline,
/// the default preset when none is named, `--config` with a `[[varlen]]` entry, and a bad
/// entry as one error line.
#[test]
fn cpu_varlen_bench_runs_the_preset_and_config_files() {
    use flashmoe_bench::results::ProblemSpec;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = flashmoe(&[
        "bench",
        "varlen",
        "--cpu",
        "--out",
        out.to_str().unwrap(),
        "--max-time",
        "0.1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for f in ["results.json", "results.csv", "results.md", "report.html"] {
        assert!(out.join(f).metadata().unwrap().len() > 100, "{f}");
    }
    let r = report::read_json(&out.join("results.json")).unwrap();
    assert_eq!(
        (r.suite.as_str(), r.source.as_str(), r.configs.len()),
        ("varlen", "preset:varlen", 14)
    );
    for c in &r.configs {
        let ProblemSpec::Varlen(p) = &c.problem else {
            panic!("{}: not a varlen config", c.id)
        };
        assert_eq!(
            (c.flops, c.min_bytes),
            (p.flops(), p.min_bytes()),
            "{}",
            c.id
        );
        assert_eq!(c.comparisons.len(), 1, "tiled vs reference in {}", c.id);
        for imp in &c.implementations {
            let acc = imp.accuracy.as_ref().unwrap();
            assert!(
                acc.passed && acc.reference == "cpu-f64",
                "{}: {acc:?}",
                imp.name
            );
            assert!(imp.tflops.is_some() && imp.samples_ms.len() >= 2);
        }
    }
    let cfg = dir.path().join("varlen.toml");
    std::fs::write(
        &cfg,
        "[[varlen]]\nseqlens_q = [5, 0, 40]\nseqlens_k = [90, 3, 40]\nheads_q = 4\n\
         heads_kv = 1\nhead_dim = 64\ncausal = true\nwindow = [16, -1]\n",
    )
    .unwrap();
    let out2 = dir.path().join("out2");
    let o = flashmoe(&[
        "bench",
        "varlen",
        "--cpu",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out2.to_str().unwrap(),
        "--max-time",
        "0.1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let r = report::read_json(&out2.join("results.json")).unwrap();
    assert_eq!(r.configs.len(), 1);
    let ProblemSpec::Varlen(p) = &r.configs[0].problem else {
        panic!()
    };
    assert_eq!((p.seqlens[0], p.window), ((5, 90), (16, -1)));
    std::fs::write(
        &cfg,
        "[[varlen]]\nseqlens_q = [5, 0]\nseqlens_k = [90]\nheads = 4\nhead_dim = 64\n",
    )
    .unwrap();
    assert_clean_error(
        &flashmoe(&[
            "bench",
            "varlen",
            "--cpu",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out2.to_str().unwrap(),
        ]),
        "seqlens_q has 2",
    );
}

#[test]
fn profile_without_a_usable_ncu_gives_one_clear_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out = out.to_str().unwrap();
    let missing = dir.path().join("no-ncu");
    assert_clean_error(
        &flashmoe(&[
            "profile",
            "attention",
            "--preset",
            "sweep",
            "--impl",
            "flashmoe-sm90",
            "--ncu",
            missing.to_str().unwrap(),
            "--out",
            out,
        ]),
        "ncu not found",
    );
    // An ncu that refuses the performance counters, as a non-root user sees it.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let fake = dir.path().join("ncu");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho '==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters on the target device 0.' >&2\nexit 1\n",
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_clean_error(
            &flashmoe(&[
                "profile",
                "attention",
                "--preset",
                "sweep",
                "--select",
                "sq4096_sk4096_d128_causal",
                "--impl",
                "flashmoe-sm90",
                "--ncu",
                fake.to_str().unwrap(),
                "--out",
                out,
            ]),
            "lacks permission",
        );
    }
}

/// `compare` exit codes with calibrated files: 3 when the calibration moved with the
/// candidate (ENV-DRIFT), 1 for a regression it confirms; `--json` writes the report.
#[test]
fn compare_exits_3_on_env_drift_and_writes_json() {
    use flashmoe_bench::results::CalibrationResult;
    let dir = tempfile::tempdir().unwrap();
    let base = fixtures::gpu_attention_run();
    let calibrated =
        |run: &flashmoe_bench::results::RunResults, factor: f64, cal: f64, seed: u64| {
            let mut r = run.clone();
            for (ci, c) in r.configs.iter_mut().enumerate() {
                for (ii, imp) in c.implementations.iter_mut().enumerate() {
                    if let Some(s) = &imp.summary {
                        let n = imp.samples_ms.len().max(50);
                        let sd = seed * 1000 + (ci * 10 + ii) as u64;
                        imp.samples_ms = fixtures::noisy_samples(s.median * factor, 0.01, n, sd);
                    }
                }
                c.calibration = Some(CalibrationResult {
                    workload: "device-to-device copy".into(),
                    samples_ms: fixtures::noisy_samples(cal, 0.01, 60, seed * 77 + ci as u64),
                    error: None,
                });
            }
            r
        };
    let write = |name: &str, r: &flashmoe_bench::results::RunResults| {
        let p = dir.path().join(name);
        std::fs::write(&p, report::to_json(r).unwrap()).unwrap();
        p.to_string_lossy().to_string()
    };
    let old = write("old.json", &calibrated(&base, 1.0, 1.0, 1));
    // The machine 20% slower, the code unchanged.
    let drift = write("drift.json", &calibrated(&base, 1.2, 1.2, 2));
    let json = dir.path().join("cmp.json");
    let o = flashmoe(&["compare", &old, &drift, "--json", json.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(3), "{out}{}", stderr(&o));
    assert!(out.contains("ENV-DRIFT"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["exit_code"], 3);
    assert!(v["env_drifts"].as_u64().unwrap() > 0);
    // The code 10% slower on a steady machine.
    let slow = write("slow.json", &calibrated(&base, 1.1, 1.0, 3));
    let o = flashmoe(&["compare", &old, &slow]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

/// `bench --against` with this very binary as the old build: both builds' implementations
/// are gated and timed in one run, and against.json holds the comparison.
#[test]
fn bench_against_an_old_binary_times_both_builds_in_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tiny.toml");
    std::fs::write(
        &cfg,
        "[[attention]]\nbatch = 1\nheads_q = 2\nheads_kv = 2\nseqlen = [48]\n\
         head_dim = 32\ncausal = [true]\ndtype = \"bf16\"\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let o = flashmoe(&[
        "bench",
        "attention",
        "--cpu",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-time",
        "0.3",
        "--against",
        env!("CARGO_BIN_EXE_flashmoe"),
    ]);
    // An A/A run on a busy machine (CI: 2 cores, the other tests running beside it) may see
    // noise as a change, machine drift or an unresolved slowdown: 0, 1 or 3, never 2 (error).
    assert!(
        matches!(o.status.code(), Some(0 | 1 | 3)),
        "exit {:?}\n{}{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        stderr(&o)
    );
    let r = report::read_json(&out.join("results.json")).unwrap();
    let names: Vec<&str> = r.configs[0]
        .implementations
        .iter()
        .map(|i| i.name.as_str())
        .collect();
    for n in [
        "cpu-tiled",
        "old:cpu-tiled",
        "cpu-reference",
        "old:cpu-reference",
    ] {
        assert!(names.contains(&n), "{names:?}");
    }
    let old = r.configs[0]
        .implementations
        .iter()
        .find(|i| i.name == "old:cpu-tiled")
        .unwrap();
    assert!(old.accuracy.as_ref().unwrap().passed && old.samples_ms.len() >= 2);
    assert_eq!(old.backend, "old-build");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("against.json")).unwrap()).unwrap();
    assert_eq!(v["changes"].as_array().unwrap().len(), 2);

    let o = flashmoe(&[
        "bench",
        "attention",
        "--cpu",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--against",
        "/no/such/flashmoe",
    ]);
    assert_clean_error(&o, "could not serve");
}

/// `report` re-renders a results file's Markdown and HTML next to it, with seed 003's
/// grades and memory tables.
#[test]
fn report_rerenders_markdown_and_html_next_to_the_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("sweep.json");
    std::fs::write(
        &json,
        report::to_json(&fixtures::gpu_attention_run()).unwrap(),
    )
    .unwrap();
    let o = flashmoe(&["report", json.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let md = std::fs::read_to_string(dir.path().join("sweep.md")).unwrap();
    let html = std::fs::read_to_string(dir.path().join("sweep.html")).unwrap();
    for text in [&md, &html] {
        assert!(text.contains("Seed 003 grades"), "grades missing");
        assert!(text.contains("Memory, analytic"), "memory table missing");
    }
    let o = flashmoe(&["report", dir.path().join("none.json").to_str().unwrap()]);
    assert_clean_error(&o, "none.json");
}
