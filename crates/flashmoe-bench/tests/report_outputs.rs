//! Reports: files written, JSON round trip and versioning, escaping, CSV/Markdown shape.

use flashmoe_bench::report::{self, fixtures};
use flashmoe_bench::results::RunResults;
use std::path::Path;

fn json(r: &RunResults) -> String {
    serde_json::to_string_pretty(r).unwrap()
}

#[test]
fn write_all_creates_the_four_files() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("nested/out");
    let run = fixtures::gpu_attention_run();
    let paths = report::write_all(&run, &out).unwrap();
    let names: Vec<String> = paths
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["results.json", "results.csv", "results.md", "report.html"]
    );
    for p in &paths {
        assert!(p.starts_with(&out));
        let meta = std::fs::metadata(p).unwrap();
        assert!(meta.len() > 100, "{} is too small", p.display());
    }
    // Only the four files: no temp files left behind.
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 4);
    // Calling again (after each config) replaces the files.
    report::write_all(&run, &out).unwrap();
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 4);
}

#[test]
fn json_round_trips() {
    for run in [fixtures::gpu_attention_run(), fixtures::cpu_moe_run()] {
        let dir = tempfile::tempdir().unwrap();
        report::write_all(&run, dir.path()).unwrap();
        let back = report::read_json(&dir.path().join("results.json")).unwrap();
        let (a, b) = (json(&back), json(&run));
        if let Some((x, y)) = a.lines().zip(b.lines()).find(|(x, y)| x != y) {
            panic!("round trip differs: read back {x:?}, written {y:?}");
        }
        assert_eq!(a, b);
        // Raw samples are kept.
        assert_eq!(
            back.configs[0].implementations[0].samples_ms,
            run.configs[0].implementations[0].samples_ms
        );
    }
}

#[test]
fn read_json_rejects_wrong_version_and_foreign_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut v = serde_json::to_value(fixtures::cpu_moe_run()).unwrap();
    v["schema_version"] = 2.into();
    let p = dir.path().join("v2.json");
    std::fs::write(&p, v.to_string()).unwrap();
    let e = format!("{:#}", report::read_json(&p).unwrap_err());
    assert!(e.contains("schema_version 2"), "{e}");
    assert!(e.contains("version 1"), "{e}");
    assert!(e.contains("v2.json"), "{e}");

    let q = dir.path().join("package.json");
    std::fs::write(&q, r#"{"name": "left-pad", "version": "1.0.0"}"#).unwrap();
    let e = report::read_json(&q).unwrap_err().to_string();
    assert!(e.contains("not a flashmoe results file"), "{e}");
    assert!(e.contains("package.json"), "{e}");

    let missing = dir.path().join("missing.json");
    let e = report::read_json(&missing).unwrap_err().to_string();
    assert!(e.contains("missing.json"), "{e}");

    // Right version, broken content: a clear error, not a panic.
    let mut v = serde_json::to_value(fixtures::cpu_moe_run()).unwrap();
    v["configs"][0]["flops"] = "many".into();
    let b = dir.path().join("broken.json");
    std::fs::write(&b, v.to_string()).unwrap();
    let e = report::read_json(&b).unwrap_err().to_string();
    assert!(
        e.contains("broken.json") && e.contains("schema version 1"),
        "{e}"
    );
}

#[test]
fn unwritable_output_dir_is_an_error_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain-file");
    std::fs::write(&file, "x").unwrap();
    let run = fixtures::cpu_moe_run();
    for bad in [file.join("out"), file.clone()] {
        let e = report::write_all(&run, &bad).unwrap_err().to_string();
        assert!(e.contains(&bad.display().to_string()), "{e}");
    }
}

#[test]
fn html_is_self_contained_and_escaped() {
    let mut run = fixtures::gpu_attention_run();
    run.configs[0].label = "evil <script>alert(1)</script> & co".to_string();
    run.configs[1].implementations[1].name = "\"quoted\" <impl>".to_string();
    run.configs[1].comparisons[0].baseline = "\"quoted\" <impl>".to_string();
    run.manifest.command_line = "flashmoe bench --out '<b>'".to_string();
    let html = report::to_html(&run);
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(html.contains("<svg"));
    assert!(html.ends_with("</html>\n"));
    assert!(!html.contains("<script"), "unescaped script tag");
    assert!(html.contains("evil &lt;script&gt;alert(1)&lt;/script&gt; &amp; co"));
    assert!(html.contains("&quot;quoted&quot; &lt;impl&gt;"));
    assert!(html.contains("--out &#39;&lt;b&gt;&#39;"));
    assert!(!html.contains("'<b>'"));
    for bad in [
        "src=\"http",
        "href=\"http",
        "http://",
        "https://",
        "url(",
        "@import",
    ] {
        assert!(!html.contains(bad), "external reference {bad}");
    }
    // Three kinds of plots: throughput panels, speedup bars, roofline.
    assert!(html.contains("Throughput, D=128 non-causal bf16"));
    assert!(html.contains("Speedup of flashmoe per config"));
    assert!(html.contains("Roofline"));
    // Manifest, settings and ceilings are on the page.
    assert!(html.contains("NVIDIA H100 80GB HBM3"));
    assert!(html.contains("l2-flush 100 MB"));
    assert!(html.contains("cuBLAS bf16 8192^3"));
    assert!(html.contains("n/a: out of memory"));
}

#[test]
fn html_renders_one_and_fifty_configs() {
    let mut one = fixtures::gpu_attention_run();
    one.configs.truncate(1);
    let h1 = report::to_html(&one);
    assert!(h1.contains("<svg") && !h1.contains("NaN") && !h1.contains("\"inf"));
    let fifty = fixtures::large_sweep_run(50);
    let h50 = report::to_html(&fifty);
    assert!(!h50.contains("NaN") && !h50.contains("\"inf"));
    assert_eq!(h50.matches("<tr class=\"cfg\">").count(), 50);
    // Two panels (head dim 64 and 128).
    assert_eq!(h50.matches("<title>Throughput, ").count(), 2);
    // CPU run: GFLOP/s axis, no roofline.
    let cpu = report::to_html(&fixtures::cpu_moe_run());
    assert!(cpu.contains("GFLOP/s"));
    assert!(!cpu.contains("<title>Roofline"));
    // The implementation that failed the accuracy gate is drawn hollow, with a key.
    assert!(cpu.contains("FAILED the accuracy gate"));
    assert!(cpu.contains(">accuracy FAIL<"));
}

#[test]
fn csv_has_one_row_per_config_and_implementation() {
    let run = fixtures::gpu_attention_run();
    let text = report::to_csv(&run).unwrap();
    let mut rdr = csv::Reader::from_reader(text.as_bytes());
    let headers = rdr.headers().unwrap().clone();
    for col in [
        "config_id",
        "implementation",
        "median_ms",
        "median_ci_low_ms",
        "tflops",
        "gbps",
        "acc_rel_l2",
        "speedup_vs_candidate",
        "verdict",
    ] {
        assert!(headers.iter().any(|h| h == col), "missing column {col}");
    }
    let rows: Vec<csv::StringRecord> = rdr.records().map(|r| r.unwrap()).collect();
    let expected: usize = run.configs.iter().map(|c| c.implementations.len()).sum();
    assert_eq!(rows.len(), expected);
    let col = |name: &str| headers.iter().position(|h| h == name).unwrap();
    for r in &rows {
        assert_eq!(r.len(), headers.len());
    }
    // The candidate has no speedup; a baseline has one and a verdict.
    let cand = rows
        .iter()
        .find(|r| &r[col("implementation")] == "flashmoe")
        .unwrap();
    assert_eq!(&cand[col("speedup_vs_candidate")], "");
    let base = rows
        .iter()
        .find(|r| &r[col("implementation")] == "sdpa-flash")
        .unwrap();
    assert!(base[col("speedup_vs_candidate")].parse::<f64>().unwrap() > 1.0);
    assert!(!base[col("verdict")].is_empty());
    let na = rows
        .iter()
        .find(|r| r[col("error")].starts_with("n/a"))
        .expect("n/a row kept");
    assert_eq!(&na[col("median_ms")], "");
    // Written file equals the in-memory text.
    let dir = tempfile::tempdir().unwrap();
    report::write_all(&run, dir.path()).unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("results.csv")).unwrap(),
        text
    );
}

#[test]
fn markdown_and_terminal_contain_every_config() {
    for run in [fixtures::gpu_attention_run(), fixtures::cpu_moe_run()] {
        let md = report::to_markdown(&run);
        let term = report::terminal_table(&run);
        assert!(md.contains(&run.manifest.git_commit));
        assert!(md.contains(&run.manifest.timestamp_utc));
        assert!(md.contains("## Speedup summary"));
        for c in &run.configs {
            assert!(md.contains(&format!("### {}", c.label)), "{}", c.label);
            assert!(md.contains(&c.id));
            for i in &c.implementations {
                assert!(term.contains(&i.name), "{}", i.name);
            }
        }
    }
    let md = report::to_markdown(&fixtures::gpu_attention_run());
    assert!(md.contains("NVIDIA H100 80GB HBM3"));
    assert!(md.contains("**FASTER**"));
}

#[test]
fn terminal_table_is_readable() {
    let run = fixtures::gpu_attention_run();
    let t = report::terminal_table(&run);
    let width = t.lines().map(|l| l.chars().count()).max().unwrap();
    assert!(width <= 160, "table is {width} columns wide:\n{t}");
    assert!(t.contains("TFLOP/s"));
    assert!(t.contains("PASS"));
    assert!(t.contains("FASTER"));
    assert!(t.contains("n/a: out of memory"));
    assert!(t.contains("% GEMM"));
    let cpu = report::terminal_table(&fixtures::cpu_moe_run());
    assert!(cpu.contains("GFLOP/s"));
    assert!(cpu.contains("FAIL"));
    assert!(!cpu.contains("% GEMM"));
    // MoE: load statistics, losses and the router's share of the layer.
    assert!(cpu.contains("tokens per expert min 0 / max 32"), "{cpu}");
    assert!(
        cpu.contains("CV 0.707") && cpu.contains("2 of 8 experts empty"),
        "{cpu}"
    );
    assert!(
        cpu.contains("cpu-fused router") && cpu.contains("% of its layer"),
        "{cpu}"
    );
    assert!(t.contains("% copy"));
    // The DRAM's specified bandwidth beside the measured copy ceiling, in every format.
    let gpu_md = report::to_markdown(&run);
    assert!(gpu_md.contains("HBM peak 3352 GB/s (spec)"), "{gpu_md}");
    assert!(gpu_md.contains("% of HBM peak)"), "{gpu_md}");
    assert!(report::to_html(&run).contains("memory clock × bus width"));
    let csv = report::to_csv(&run).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "pct_of_hbm_peak").unwrap();
    assert!(csv.lines().skip(1).any(|l| l
        .split(',')
        .nth(col)
        .is_some_and(|v| v.parse::<f64>().is_ok())));
    let md = report::to_markdown(&fixtures::cpu_moe_run());
    assert!(md.contains("Routing: tokens per expert"), "{md}");
    let width = cpu.lines().map(|l| l.chars().count()).max().unwrap();
    assert!(width <= 160, "{cpu}");
}

#[test]
fn interrupted_runs_are_marked() {
    let mut run = fixtures::cpu_moe_run();
    run.interrupted = true;
    assert!(report::to_markdown(&run).contains("Interrupted"));
    assert!(report::to_html(&run).contains("Interrupted"));
    assert!(report::terminal_table(&run).contains("interrupted"));
    let _ = Path::new("");
}

#[test]
fn empty_and_degenerate_runs_render_without_panicking() {
    let mut empty = fixtures::cpu_moe_run();
    empty.configs.clear();
    let dir = tempfile::tempdir().unwrap();
    report::write_all(&empty, dir.path()).unwrap();
    assert!(report::to_html(&empty).contains("No comparisons were made"));
    assert_eq!(report::to_csv(&empty).unwrap().lines().count(), 1);

    // Non-finite statistics (e.g. zero bootstrap resamples) and a failed config.
    let mut odd = fixtures::gpu_attention_run();
    let imp = &mut odd.configs[0].implementations[0];
    if let Some(s) = imp.summary.as_mut() {
        s.median_ci.low = f64::NAN;
        s.median_ci.high = f64::NAN;
    }
    imp.tflops = Some(f64::INFINITY);
    odd.configs[0].comparisons[0].comparison.speedup.low = f64::NAN;
    odd.configs[1].error = Some("invalid for every implementation".into());
    odd.configs[1].implementations.clear();
    odd.configs[1].comparisons.clear();
    let html = report::to_html(&odd);
    assert!(html.contains("invalid for every implementation"));
    assert!(!html.contains("=\"NaN") && !html.contains("=\"inf"));
    assert!(report::to_markdown(&odd).contains("invalid for every implementation"));
    assert!(report::terminal_table(&odd).contains("invalid for every implementation"));
    let csv = report::to_csv(&odd).unwrap();
    assert!(csv.contains("invalid for every implementation"));
    report::write_all(&odd, dir.path()).unwrap();
}

/// A varlen run (issue 22's preset shapes) renders in every format: the configs' labels
/// and ids, the dense comparison's n/a on ragged batches, one CSV row per implementation
/// with kind `varlen`, throughput panels per shape family, and a JSON round trip.
#[test]
fn varlen_run_renders_in_every_format() {
    use flashmoe_bench::results::ProblemSpec;
    let run = fixtures::gpu_varlen_run();
    assert_eq!(run.configs.len(), 4);
    let md = report::to_markdown(&run);
    let term = report::terminal_table(&run);
    let html = report::to_html(&run);
    for c in &run.configs {
        let ProblemSpec::Varlen(p) = &c.problem else {
            panic!("{}: not a varlen config", c.id)
        };
        assert!(c.id.starts_with("varlen_n16_t"), "{}", c.id);
        assert!(
            c.label.starts_with("varlen 16 seqs, tokens "),
            "{}",
            c.label
        );
        assert_eq!((c.flops, c.min_bytes), (p.flops(), p.min_bytes()));
        assert!(md.contains(&format!("### {}", c.label)), "{}", c.label);
        assert!(md.contains(&c.id));
        for i in &c.implementations {
            assert!(term.contains(&i.name), "{}", i.name);
        }
    }
    assert!(md.contains("n/a: the dense kernel runs only batches"));
    assert!(term.contains("TFLOP/s") && term.contains("FASTER"));
    assert!(html.contains("<title>Throughput, varlen D=128 Hq/Hkv=1 causal bf16 16 seqs"));
    assert!(!html.contains("NaN") && !html.contains("\"inf"));
    // CSV: one row per (config, implementation), problem kind varlen, x = packed tokens.
    let text = report::to_csv(&run).unwrap();
    let mut rdr = csv::Reader::from_reader(text.as_bytes());
    let headers = rdr.headers().unwrap().clone();
    let col = |name: &str| headers.iter().position(|h| h == name).unwrap();
    let rows: Vec<csv::StringRecord> = rdr.records().map(|r| r.unwrap()).collect();
    let expected: usize = run.configs.iter().map(|c| c.implementations.len()).sum();
    assert_eq!(rows.len(), expected);
    assert!(rows.iter().all(|r| &r[col("problem_kind")] == "varlen"));
    assert_eq!(&rows[0][col("x_value")], "31473");
    // JSON round trip keeps the sequence lengths.
    let dir = tempfile::tempdir().unwrap();
    report::write_all(&run, dir.path()).unwrap();
    let back = report::read_json(&dir.path().join("results.json")).unwrap();
    assert_eq!(back.configs[0].problem, run.configs[0].problem);
    assert_eq!(json(&back), json(&run));
}
