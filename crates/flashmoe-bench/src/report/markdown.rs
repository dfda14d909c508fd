//! Markdown report: manifest summary, settings, ceilings, one table per config, the
//! speedup summary and seed 003's grades and memory tables.

use super::format::{self, fmt_sig, level_pct, row_view, DASH};
use crate::results::RunResults;
use std::fmt::Write;

/// Escape text for a Markdown table cell or line: pipes, backslashes, HTML-significant
/// characters and newlines.
pub fn md_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '|' => out.push_str("\\|"),
            '\\' => out.push_str("\\\\"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '`' => out.push_str("\\`"),
            '*' => out.push_str("\\*"),
            '_' => out.push_str("\\_"),
            '[' => out.push_str("\\["),
            ']' => out.push_str("\\]"),
            '\n' | '\r' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

fn table_row(out: &mut String, cells: &[String]) {
    out.push('|');
    for c in cells {
        out.push(' ');
        out.push_str(c);
        out.push_str(" |");
    }
    out.push('\n');
}

/// A short description of the machine: the GPU when present, the CPU otherwise.
pub fn machine_line(results: &RunResults) -> String {
    let m = &results.manifest;
    match &m.gpu {
        Some(g) => format!(
            "{} (sm_{}, {} SMs, driver {})",
            g.name,
            g.compute_capability.replace('.', ""),
            g.sm_count,
            g.driver_version
        ),
        None => format!("CPU only: {} ({} cores)", m.cpu_model, m.cpu_cores),
    }
}

/// The Markdown text of the run.
pub fn to_markdown(results: &RunResults) -> String {
    let m = &results.manifest;
    let s = &results.settings;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# flashmoe {} benchmark: {}\n",
        md_escape(&results.suite),
        md_escape(&results.source)
    );
    if results.interrupted {
        o.push_str("> **Interrupted run**: only the configs below were completed.\n\n");
    }
    o.push_str("## Environment\n\n");
    let mut kv = |k: &str, v: String| {
        let _ = writeln!(o, "- **{k}**: {v}");
    };
    kv("Machine", md_escape(&machine_line(results)));
    if m.gpu.is_some() {
        kv(
            "CPU",
            md_escape(&format!("{} ({} cores)", m.cpu_model, m.cpu_cores)),
        );
    }
    kv("OS", md_escape(&m.os));
    kv(
        "Commit",
        format!(
            "{}{}",
            md_escape(&m.git_commit),
            if m.git_dirty { " (dirty)" } else { "" }
        ),
    );
    if !m.build_commit.is_empty() {
        kv("Binary built from", md_escape(&m.build_commit));
    }
    if !m.kernel_overrides.is_empty() {
        kv("Kernel overrides", md_escape(&m.kernel_overrides.join(" ")));
    }
    kv("Timestamp (UTC)", md_escape(&m.timestamp_utc));
    kv(
        "flashmoe / rustc",
        md_escape(&format!("{} / {}", m.flashmoe_version, m.rustc)),
    );
    if let Some(g) = &m.gpu {
        kv("NVRTC", md_escape(&g.nvrtc_version));
        for obs in &g.clock_observations {
            kv("Clocks", md_escape(obs));
        }
    }
    if let Some(p) = &m.python {
        kv(
            "Python baselines",
            md_escape(&format!(
                "Python {}, torch {}, CUDA {}, cuDNN {}, Triton {}",
                p.python, p.torch, p.cuda, p.cudnn, p.triton
            )),
        );
        if !p.packages.is_empty() {
            kv("Baseline packages", md_escape(&p.packages.join(", ")));
        }
        if !p.skipped.is_empty() {
            kv("Baselines not run", md_escape(&p.skipped.join("; ")));
        }
    }
    kv("Command", md_escape(&m.command_line));
    kv("Candidate", md_escape(&results.candidate));
    kv(
        "Sampling",
        md_escape(&format!(
            "warm-up {} ms; {}–{} samples, stop at ±{}% CI of the median or {} ms; timer {}; \
             cache policy {}",
            fmt_sig(s.warmup_ms, 4),
            s.min_samples,
            s.max_samples,
            fmt_sig(s.target_rel_ci * 100.0, 3),
            fmt_sig(s.max_time_ms, 4),
            s.timer,
            s.cache_policy
        )),
    );
    kv(
        "Statistics",
        md_escape(&format!(
            "{} confidence, {} bootstrap resamples, seed {}, practical threshold {}%",
            level_pct(s.confidence),
            s.bootstrap_resamples,
            s.seed,
            fmt_sig(s.threshold * 100.0, 3)
        )),
    );
    match &results.ceilings {
        Some(c) => kv(
            "Measured ceilings",
            md_escape(&format!(
                "GEMM {} TFLOP/s ({}), device copy {} GB/s{}",
                fmt_sig(c.gemm_tflops, 4),
                c.gemm_desc,
                fmt_sig(c.copy_gbps, 4),
                c.hbm_peak_gbps
                    .map(|p| format!(", HBM peak {} GB/s (spec)", fmt_sig(p, 4)))
                    .unwrap_or_default()
            )),
        ),
        None => kv("Measured ceilings", "none".to_string()),
    }
    o.push('\n');
    if let Some(t) = &m.topology {
        let _ = writeln!(
            o,
            "GPU topology (`nvidia-smi topo -m`):\n\n```\n{}\n```\n",
            t.trim_end()
        );
    }

    let with_pct = format::has_pct_ceiling(results);
    let ci = level_pct(format::ci_level(results));
    let sp_ci = format::speedup_level(results)
        .map(level_pct)
        .unwrap_or_else(|| ci.clone());
    let cand = md_escape(&results.candidate);
    let mut header: Vec<String> = vec![
        "implementation".into(),
        "median ms".into(),
        format!("{ci} CI ms"),
        "n".into(),
        "outliers".into(),
        "throughput".into(),
        "GB/s".into(),
    ];
    if with_pct {
        header.push("% GEMM ceiling (compute floor)".into());
        header.push("% copy ceiling (memory floor)".into());
    }
    header.extend([
        "rel-L2 / gate".into(),
        format!("{cand} speedup [{sp_ci} CI]"),
        "verdict".into(),
        "p".into(),
    ]);
    let align: Vec<String> = header
        .iter()
        .enumerate()
        .map(|(i, _)| if i == 0 { ":---".into() } else { "---:".into() })
        .collect();

    o.push_str("## Results\n\n");
    let _ = writeln!(
        o,
        "Times in ms (median of n samples). Speedup = median(other) / median({cand}): > 1 \
         means {cand} is faster. `*` marks the candidate.\n"
    );
    for c in &results.configs {
        let _ = writeln!(o, "### {}\n", md_escape(&c.label));
        let _ = writeln!(
            o,
            "`{}` — {} GFLOP, {} minimum traffic\n",
            c.id.replace('`', "'"),
            fmt_sig(c.flops / 1e9, 4),
            format::fmt_bytes(c.min_bytes)
        );
        if let Some(line) = format::moe_routing_line(c) {
            let _ = writeln!(o, "Routing: {}\n", md_escape(&line));
        }
        if let Some(e) = &c.error {
            let _ = writeln!(o, "**Error:** {}\n", md_escape(e));
        }
        if c.implementations.is_empty() {
            continue;
        }
        table_row(&mut o, &header);
        table_row(&mut o, &align);
        let mut notes = Vec::new();
        for imp in &c.implementations {
            let r = row_view(results, c, imp);
            let name = format!(
                "{}{}",
                md_escape(&r.impl_name),
                if r.is_candidate {
                    " \\*"
                } else if r.is_best_baseline {
                    " † (best baseline)"
                } else {
                    ""
                }
            );
            let mut cells = vec![name];
            if let Some(e) = &r.error {
                cells.push(md_escape(e));
                cells.resize(header.len(), DASH.to_string());
            } else {
                cells.extend([
                    r.median.clone(),
                    r.ci.clone(),
                    r.n.clone(),
                    r.outliers.clone(),
                    r.throughput.clone(),
                    r.gbps.clone(),
                ]);
                if with_pct {
                    cells.push(r.pct_ceiling.clone());
                    cells.push(r.pct_copy.clone());
                }
                cells.extend([
                    md_escape(&r.accuracy),
                    r.speedup.clone(),
                    r.verdict
                        .map(|v| format!("**{v}**"))
                        .unwrap_or(DASH.to_string()),
                    r.p_value.clone(),
                ]);
            }
            table_row(&mut o, &cells);
            for f in &r.flags {
                notes.push(format!("⚠ {}: {}", md_escape(&r.impl_name), md_escape(f)));
            }
            for d in &r.details {
                notes.push(format!("{}: {}", md_escape(&r.impl_name), md_escape(d)));
            }
        }
        o.push('\n');
        for n in notes {
            let _ = writeln!(o, "- {n}");
        }
        o.push('\n');
    }

    o.push_str("## Speedup summary\n\n");
    let pairs: Vec<_> = results
        .configs
        .iter()
        .flat_map(|c| c.comparisons.iter().map(move |p| (c, p)))
        .collect();
    if pairs.is_empty() {
        o.push_str("No comparisons were made in this run.\n");
    } else {
        table_row(
            &mut o,
            &[
                "config".into(),
                "candidate vs baseline".into(),
                format!("speedup [{sp_ci} CI]"),
                "p (Mann-Whitney)".into(),
                "Cliff's δ".into(),
                "verdict".into(),
            ],
        );
        table_row(
            &mut o,
            &[
                ":---".into(),
                ":---".into(),
                "---:".into(),
                "---:".into(),
                "---:".into(),
                ":---".into(),
            ],
        );
        for (c, p) in &pairs {
            table_row(
                &mut o,
                &[
                    md_escape(&c.label),
                    format!("{} vs {}", md_escape(&p.candidate), md_escape(&p.baseline)),
                    format::fmt_speedup(&p.comparison.speedup),
                    format::fmt_p(p.comparison.mann_whitney.p_value),
                    fmt_sig(p.comparison.cliffs_delta, 2),
                    format!("**{}**", p.comparison.verdict),
                ],
            );
        }
        o.push('\n');
        let count = |v: crate::stats::Verdict| {
            pairs
                .iter()
                .filter(|(_, p)| p.comparison.verdict == v)
                .count()
        };
        use crate::stats::Verdict::*;
        let _ = writeln!(
            o,
            "{cand} is FASTER in {}, SAME in {}, SLOWER in {} and UNCLEAR in {} of {} \
             comparisons.",
            count(Faster),
            count(Same),
            count(Slower),
            count(Unclear),
            pairs.len()
        );
    }
    for t in crate::grades::grade_table(results)
        .into_iter()
        .chain(crate::grades::memory_tables(results))
    {
        text_table(&mut o, &t);
    }
    o
}

/// A seed-003 table (grades, memory) as a Markdown section.
fn text_table(o: &mut String, t: &crate::grades::TextTable) {
    let _ = writeln!(o, "\n## {}\n", md_escape(&t.title));
    table_row(
        o,
        &t.header.iter().map(|h| md_escape(h)).collect::<Vec<_>>(),
    );
    table_row(o, &vec![":---".to_string(); t.header.len()]);
    for r in &t.rows {
        table_row(o, &r.iter().map(|c| md_escape(c)).collect::<Vec<_>>());
    }
    let _ = writeln!(o, "\n{}", md_escape(&t.note));
}
