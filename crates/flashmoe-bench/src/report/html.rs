//! The self-contained HTML report: inline CSS, inline SVG, no scripts, no external
//! resources. Every piece of text from the results is escaped.

use super::format::{self, fmt_bytes, fmt_sig, level_pct, row_view, DASH};
use super::markdown::machine_line;
use super::svg::{self, colour, esc, Frame, Scale, ScaleKind};
use crate::results::{ConfigResult, RunResults};
use crate::stats::Verdict;
use std::fmt::Write;

const CSS: &str = r#"
:root { --fg:#1d2330; --muted:#5b6478; --line:#d9dee8; --bg:#ffffff; --alt:#f5f7fb; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif;
       color: var(--fg); background: var(--bg); margin: 0 auto; padding: 24px; max-width: 1500px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 32px 0 10px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.sub { color: var(--muted); margin: 0 0 12px; }
.banner { background: #fff4e0; border: 1px solid #e6a23c; padding: 8px 12px; border-radius: 6px; }
.grid2 { display: flex; flex-wrap: wrap; gap: 24px; }
.grid2 > div { flex: 1 1 420px; min-width: 0; }
table { border-collapse: collapse; margin: 6px 0 12px; }
th, td { padding: 3px 9px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { background: var(--alt); font-weight: 600; }
table.kv th { width: 190px; background: none; color: var(--muted); font-weight: 500; }
table.results td.num, table.results th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.results tr.cfg th { background: #e8edf7; text-align: left; font-weight: 600; padding-top: 7px; }
table.results tr.cfg .meta { color: var(--muted); font-weight: 400; margin-left: 10px; }
.scroll { overflow-x: auto; }
code, .id { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; }
.cand { font-weight: 700; }
.pass { color: #1a7f37; } .fail { color: #c62828; font-weight: 600; }
.err { color: #9a3412; }
.v-FASTER { color: #1a7f37; font-weight: 700; } .v-SLOWER { color: #c62828; font-weight: 700; }
.v-SAME { color: #5b6478; font-weight: 600; } .v-UNCLEAR { color: #b26a00; font-weight: 600; }
.flag { color: #9a3412; font-size: 12px; }
.panels { display: flex; flex-wrap: wrap; gap: 16px; }
svg.plot { background: #fff; border: 1px solid var(--line); border-radius: 6px; max-width: 100%; height: auto; }
svg .frame { fill: none; stroke: #9aa3b5; }
svg .grid { stroke: #eceff5; }
svg .tick { stroke: #9aa3b5; }
svg .ticklabel { font-size: 11px; fill: #4a5263; }
svg .axislabel { font-size: 12px; fill: #1d2330; }
svg .title { font-size: 13px; font-weight: 600; fill: #1d2330; }
svg .legend { font-size: 12px; fill: #1d2330; }
svg .rowlabel { font-size: 11px; fill: #1d2330; }
svg .note { font-size: 11px; fill: #5b6478; }
svg .vlabel { font-size: 11px; fill: #1d2330; }
footer { color: var(--muted); margin-top: 32px; font-size: 12px; }
"#;

/// Implementation names in display order (candidate first, then first appearance);
/// their index gives the series colour in every plot.
fn impl_order(results: &RunResults) -> Vec<String> {
    let mut names = vec![results.candidate.clone()];
    for c in &results.configs {
        for i in &c.implementations {
            if !names.contains(&i.name) {
                names.push(i.name.clone());
            }
        }
    }
    names
}

fn impl_colour(order: &[String], name: &str) -> &'static str {
    colour(order.iter().position(|n| n == name).unwrap_or(order.len()))
}

fn kv_table(rows: &[(&str, String)]) -> String {
    let mut s = String::from("<table class=\"kv\">");
    for (k, v) in rows {
        let _ = write!(s, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(v));
    }
    s.push_str("</table>\n");
    s
}

/// The full HTML page.
pub fn to_html(results: &RunResults) -> String {
    let m = &results.manifest;
    let title = format!("flashmoe {} benchmark — {}", results.suite, results.source);
    let mut h = String::with_capacity(64 * 1024);
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{}</title>\n<style>{CSS}</style>\n</head>\n<body>\n",
        esc(&title)
    );
    let _ = writeln!(h, "<h1>{}</h1>", esc(&title));
    let _ = writeln!(
        h,
        "<p class=\"sub\">{} · {} UTC · commit <code>{}</code>{} · candidate <b>{}</b> · {} configs</p>",
        esc(&machine_line(results)),
        esc(&m.timestamp_utc),
        esc(&m.git_commit.chars().take(12).collect::<String>()),
        if m.git_dirty { " (dirty)" } else { "" },
        esc(&results.candidate),
        results.configs.len()
    );
    if results.interrupted {
        h.push_str(
            "<p class=\"banner\">Interrupted run: only the configs below were completed.</p>\n",
        );
    }

    // Environment, settings, ceilings.
    h.push_str("<h2>Environment</h2>\n<div class=\"grid2\"><div>\n<h3>Host</h3>\n");
    let mut host = vec![
        ("CPU", format!("{} ({} cores)", m.cpu_model, m.cpu_cores)),
        ("OS", m.os.clone()),
        ("Hostname", m.hostname.clone()),
        (
            "Commit",
            format!(
                "{}{}",
                m.git_commit,
                if m.git_dirty { " (dirty)" } else { "" }
            ),
        ),
        ("Binary built from", m.build_commit.clone()),
        ("Kernel overrides", m.kernel_overrides.join(" ")),
        ("Timestamp (UTC)", m.timestamp_utc.clone()),
        ("flashmoe", m.flashmoe_version.clone()),
        ("rustc", m.rustc.clone()),
        ("Command", m.command_line.clone()),
        (
            "Suite / source",
            format!("{} / {}", results.suite, results.source),
        ),
    ];
    if let Some(p) = &m.python {
        host.push((
            "Python baselines",
            format!(
                "Python {}, torch {}, CUDA {}, cuDNN {}, Triton {} ({})",
                p.python, p.torch, p.cuda, p.cudnn, p.triton, p.gpu_name
            ),
        ));
        if !p.packages.is_empty() {
            host.push(("Baseline packages", p.packages.join(", ")));
        }
        if !p.skipped.is_empty() {
            host.push(("Baselines not run", p.skipped.join("; ")));
        }
    }
    h.push_str(&kv_table(&host));
    h.push_str("</div><div>\n<h3>GPU</h3>\n");
    match &m.gpu {
        Some(g) => {
            let mut rows = vec![
                ("Name", g.name.clone()),
                ("Compute capability", g.compute_capability.clone()),
                ("SMs", g.sm_count.to_string()),
                ("Memory", fmt_bytes(g.memory_bytes as f64)),
                ("L2", fmt_bytes(g.l2_bytes as f64)),
                (
                    "Max clocks",
                    format!(
                        "SM {} MHz, memory {} MHz",
                        g.max_sm_clock_mhz, g.max_mem_clock_mhz
                    ),
                ),
                ("Driver", g.driver_version.clone()),
                ("NVRTC", g.nvrtc_version.clone()),
            ];
            for o in &g.clock_observations {
                rows.push(("Clock observation", o.clone()));
            }
            h.push_str(&kv_table(&rows));
        }
        None => h.push_str("<p>No GPU: CPU reference implementations only.</p>\n"),
    }
    h.push_str("</div></div>\n");

    let s = &results.settings;
    h.push_str("<div class=\"grid2\"><div>\n<h3>Measurement settings</h3>\n");
    h.push_str(&kv_table(&[
        ("Timer", s.timer.clone()),
        ("Cache policy", s.cache_policy.clone()),
        ("Warm-up", format!("{} ms", fmt_sig(s.warmup_ms, 4))),
        (
            "Samples",
            format!(
                "{}–{}, stop when the median's CI is within ±{}% or after {} ms",
                s.min_samples,
                s.max_samples,
                fmt_sig(s.target_rel_ci * 100.0, 3),
                fmt_sig(s.max_time_ms, 4)
            ),
        ),
        (
            "Statistics",
            format!(
                "{} CIs, {} bootstrap resamples, seed {}",
                level_pct(s.confidence),
                s.bootstrap_resamples,
                s.seed
            ),
        ),
        (
            "Verdict threshold",
            format!("{}%", fmt_sig(s.threshold * 100.0, 3)),
        ),
    ]));
    h.push_str("</div><div>\n<h3>Measured ceilings</h3>\n");
    match &results.ceilings {
        Some(c) => h.push_str(&kv_table(&[
            (
                "GEMM",
                format!("{} TFLOP/s ({})", fmt_sig(c.gemm_tflops, 4), c.gemm_desc),
            ),
            (
                "Device copy",
                format!("{} GB/s (read + write)", fmt_sig(c.copy_gbps, 4)),
            ),
            (
                "HBM peak",
                c.hbm_peak_gbps
                    .map(|p| format!("{} GB/s (spec: memory clock × bus width)", fmt_sig(p, 4)))
                    .unwrap_or_else(|| "not recorded".to_string()),
            ),
            (
                "Ridge point",
                format!(
                    "{} FLOP/byte",
                    fmt_sig(c.gemm_tflops * 1e3 / c.copy_gbps, 3)
                ),
            ),
        ])),
        None => h.push_str("<p>None measured in this run (no GPU).</p>\n"),
    }
    h.push_str("</div></div>\n");

    // Plots.
    let order = impl_order(results);
    h.push_str("<h2>Throughput</h2>\n<div class=\"panels\">\n");
    let tp = throughput_panels(results, &order);
    if tp.is_empty() {
        h.push_str("<p>No throughput was measured.</p>\n");
    }
    for p in tp {
        h.push_str(&p);
    }
    h.push_str("</div>\n");
    h.push_str(&format!(
        "<h2>Speedup of {} (median ratio, {} CI)</h2>\n",
        esc(&results.candidate),
        level_pct(format::speedup_level(results).unwrap_or(s.confidence))
    ));
    h.push_str(&speedup_chart(results, &order));
    if let Some(r) = roofline(results, &order) {
        h.push_str("<h2>Roofline</h2>\n");
        h.push_str(&r);
    }

    h.push_str("<h2>Results</h2>\n");
    h.push_str(&results_table(results));
    h.push_str("<h2>Speedup summary</h2>\n");
    h.push_str(&speedup_table(results));
    for t in crate::grades::grade_table(results)
        .into_iter()
        .chain(crate::grades::memory_tables(results))
    {
        h.push_str(&text_table(&t));
    }
    let _ = writeln!(
        h,
        "<footer>Generated by flashmoe {} from measurements made in this run. Times are \
         medians of n samples; outliers are reported, never dropped.</footer>\n</body>\n</html>",
        esc(&m.flashmoe_version)
    );
    h
}

fn results_table(results: &RunResults) -> String {
    let with_pct = format::has_pct_ceiling(results);
    let ci = level_pct(format::ci_level(results));
    let sp_ci = format::speedup_level(results)
        .map(level_pct)
        .unwrap_or_else(|| ci.clone());
    let mut header: Vec<(String, bool)> = vec![
        ("implementation".into(), false),
        ("median ms".into(), true),
        (format!("{ci} CI ms"), true),
        ("n".into(), true),
        ("outliers".into(), true),
        ("throughput".into(), true),
        ("GB/s".into(), true),
    ];
    if with_pct {
        header.push(("% GEMM ceiling".into(), true));
        header.push(("% copy ceiling".into(), true));
    }
    header.extend([
        ("rel-L2 / gate".into(), true),
        (format!("{} speedup [{sp_ci} CI]", results.candidate), true),
        ("verdict".into(), false),
        ("p".into(), true),
        ("notes".into(), false),
    ]);
    let ncol = header.len();
    let mut t = String::from("<div class=\"scroll\"><table class=\"results\">\n<thead><tr>");
    for (name, num) in &header {
        let _ = write!(
            t,
            "<th{}>{}</th>",
            if *num { " class=\"num\"" } else { "" },
            esc(name)
        );
    }
    t.push_str("</tr></thead>\n<tbody>\n");
    for c in &results.configs {
        let _ = writeln!(
            t,
            "<tr class=\"cfg\"><th colspan=\"{ncol}\">{}<span class=\"meta\"><span class=\"id\">{}</span> · {} GFLOP · {} minimum traffic</span></th></tr>",
            esc(&c.label),
            esc(&c.id),
            fmt_sig(c.flops / 1e9, 4),
            fmt_bytes(c.min_bytes)
        );
        if let Some(line) = format::moe_routing_line(c) {
            let _ = writeln!(
                t,
                "<tr><td>routing</td><td colspan=\"{}\">{}</td></tr>",
                ncol - 1,
                esc(&line)
            );
        }
        if let Some(e) = &c.error {
            let _ = writeln!(
                t,
                "<tr><td>{DASH}</td><td colspan=\"{}\" class=\"err\">{}</td></tr>",
                ncol - 1,
                esc(e)
            );
        }
        for imp in &c.implementations {
            let r = row_view(results, c, imp);
            let name = format!(
                "<td{}>{}{}</td>",
                if r.is_candidate {
                    " class=\"cand\""
                } else {
                    ""
                },
                esc(&r.impl_name),
                if r.is_best_baseline {
                    " <strong>(best baseline)</strong>".to_string()
                } else {
                    String::new()
                } + &if r.backend.is_empty() {
                    String::new()
                } else {
                    format!(" <span class=\"id\">({})</span>", esc(&r.backend))
                }
            );
            t.push_str("<tr>");
            t.push_str(&name);
            if let Some(e) = &r.error {
                let _ = write!(
                    t,
                    "<td colspan=\"{}\" class=\"err\">{}</td>",
                    ncol - 1,
                    esc(e)
                );
                t.push_str("</tr>\n");
                continue;
            }
            let num = |s: &str| format!("<td class=\"num\">{}</td>", esc(s));
            t.push_str(&num(&r.median));
            t.push_str(&num(&r.ci));
            t.push_str(&num(&r.n));
            t.push_str(&num(&r.outliers));
            t.push_str(&num(&r.throughput));
            t.push_str(&num(&r.gbps));
            if with_pct {
                t.push_str(&num(&r.pct_ceiling));
                t.push_str(&num(&r.pct_copy));
            }
            let acc_class = match r.accuracy_passed {
                Some(true) => "num pass",
                Some(false) => "num fail",
                None => "num",
            };
            let _ = write!(t, "<td class=\"{acc_class}\">{}</td>", esc(&r.accuracy));
            t.push_str(&num(&r.speedup));
            match r.verdict {
                Some(v) => {
                    let _ = write!(t, "<td class=\"v-{v}\">{v}</td>");
                }
                None => {
                    let _ = write!(t, "<td>{DASH}</td>");
                }
            }
            t.push_str(&num(&r.p_value));
            let _ = write!(
                t,
                "<td class=\"flag\">{}</td>",
                r.flags
                    .iter()
                    .chain(&r.details)
                    .map(|f| esc(f))
                    .collect::<Vec<_>>()
                    .join("<br>")
            );
            t.push_str("</tr>\n");
        }
    }
    t.push_str("</tbody></table></div>\n");
    t
}

/// A seed-003 table (grades, memory) as an HTML section.
fn text_table(t: &crate::grades::TextTable) -> String {
    let mut o = format!(
        "<h2>{}</h2>\n<div class=\"scroll\"><table class=\"results\"><thead><tr>",
        esc(&t.title)
    );
    for c in &t.header {
        let _ = write!(o, "<th>{}</th>", esc(c));
    }
    o.push_str("</tr></thead><tbody>\n");
    for r in &t.rows {
        o.push_str("<tr>");
        for c in r {
            let _ = write!(o, "<td>{}</td>", esc(c));
        }
        o.push_str("</tr>\n");
    }
    let _ = writeln!(o, "</tbody></table></div>\n<p>{}</p>", esc(&t.note));
    o
}

fn speedup_table(results: &RunResults) -> String {
    let pairs: Vec<_> = results
        .configs
        .iter()
        .flat_map(|c| c.comparisons.iter().map(move |p| (c, p)))
        .collect();
    if pairs.is_empty() {
        return "<p>No comparisons were made in this run.</p>\n".to_string();
    }
    let mut t = String::from(
        "<div class=\"scroll\"><table class=\"results\"><thead><tr><th>config</th>\
         <th>candidate vs baseline</th><th class=\"num\">speedup [CI]</th>\
         <th class=\"num\">p (Mann-Whitney)</th><th class=\"num\">Cliff's δ</th>\
         <th class=\"num\">Hodges-Lehmann shift ms</th><th>verdict</th></tr></thead><tbody>\n",
    );
    for (c, p) in &pairs {
        let cmp = &p.comparison;
        let _ = writeln!(
            t,
            "<tr><td>{}</td><td>{} vs {}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"v-{v}\">{v}</td></tr>",
            esc(&c.label),
            esc(&p.candidate),
            esc(&p.baseline),
            esc(&format::fmt_speedup(&cmp.speedup)),
            esc(&format::fmt_p(cmp.mann_whitney.p_value)),
            esc(&fmt_sig(cmp.cliffs_delta, 2)),
            esc(&format::fmt_ms(cmp.hodges_lehmann_ms)),
            v = cmp.verdict
        );
    }
    let count = |v: Verdict| {
        pairs
            .iter()
            .filter(|(_, p)| p.comparison.verdict == v)
            .count()
    };
    let _ = writeln!(
        t,
        "</tbody></table></div>\n<p>{} is <span class=\"v-FASTER\">FASTER</span> in {}, \
         <span class=\"v-SAME\">SAME</span> in {}, <span class=\"v-SLOWER\">SLOWER</span> in {} \
         and <span class=\"v-UNCLEAR\">UNCLEAR</span> in {} of {} comparisons.</p>",
        esc(&results.candidate),
        count(Verdict::Faster),
        count(Verdict::Same),
        count(Verdict::Slower),
        count(Verdict::Unclear),
        pairs.len()
    );
    t
}

/// Configs grouped by `ProblemSpec::panel()`, in order of first appearance.
fn panels(results: &RunResults) -> Vec<(String, Vec<&ConfigResult>)> {
    let mut out: Vec<(String, Vec<&ConfigResult>)> = Vec::new();
    for c in &results.configs {
        let key = c.problem.panel();
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(c),
            None => out.push((key, vec![c])),
        }
    }
    out
}

/// A plotted point: x, y, tooltip, and whether the implementation failed the accuracy
/// gate on that config (drawn hollow).
type Point = (f64, f64, String, bool);

fn failed_gate(i: &crate::results::ImplResult) -> bool {
    i.accuracy.as_ref().is_some_and(|a| !a.passed)
}

/// One SVG per panel: throughput vs the sweep value, one line per implementation.
fn throughput_panels(results: &RunResults, order: &[String]) -> Vec<String> {
    let (mult, unit) = format::run_flops_unit(results);
    let mut out = Vec::new();
    for (key, configs) in panels(results) {
        // Series: implementation → points (x, y, tooltip).
        let mut series: Vec<(String, Vec<Point>)> = Vec::new();
        for c in &configs {
            for i in &c.implementations {
                let Some(tf) = i.tflops.filter(|t| t.is_finite() && i.error.is_none()) else {
                    continue;
                };
                let tip = format!(
                    "{} — {}: {} ({} ms){}",
                    c.label,
                    i.name,
                    format::fmt_throughput(tf),
                    i.median_ms().map(format::fmt_ms).unwrap_or(DASH.into()),
                    if failed_gate(i) {
                        ", FAILED the accuracy gate"
                    } else {
                        ""
                    }
                );
                let pt = (c.problem.x_value(), tf * mult, tip, failed_gate(i));
                match series.iter_mut().find(|(n, _)| *n == i.name) {
                    Some((_, v)) => v.push(pt),
                    None => series.push((i.name.clone(), vec![pt])),
                }
            }
        }
        if series.is_empty() {
            continue;
        }
        series.sort_by_key(|(n, _)| order.iter().position(|o| o == n));
        let xs: Vec<f64> = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.0))
            .collect();
        let mut ys: Vec<f64> = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.1))
            .collect();
        let ceiling = results.ceilings.as_ref().map(|c| c.gemm_tflops * mult);
        if let Some(cv) = ceiling {
            ys.push(cv);
        }
        let legend_chars = 20;
        let f = Frame {
            width: 600.0,
            height: 340.0,
            left: 66.0,
            right: 170.0,
            top: 32.0,
            bottom: 48.0,
        };
        let x = Scale::fit(ScaleKind::Log2, &xs, &[], f.x0(), f.x1());
        let y = Scale::fit(ScaleKind::Linear, &ys, &[0.0], f.y0(), f.y1());
        let x_label = configs[0].problem.x_label();
        let mut s = svg::open(f.width, f.height, &format!("Throughput, {key}"));
        s.push_str(&svg::text(f.x0(), 20.0, &key, "start", "title"));
        s.push_str(&svg::axes(
            &f,
            &x,
            &y,
            &format!("{x_label} (log2 scale)"),
            unit,
        ));
        if let Some(cv) = ceiling {
            let py = y.map(cv);
            s.push_str(&svg::line(
                f.x0(),
                py,
                f.x1(),
                py,
                "stroke=\"#444\" stroke-dasharray=\"6 4\" stroke-width=\"1.2\"",
            ));
            s.push_str(&svg::text(
                f.x1() - 4.0,
                py - 5.0,
                &format!("GEMM ceiling {} {unit}", fmt_sig(cv, 3)),
                "end",
                "note",
            ));
        }
        let mut legend = Vec::new();
        let mut any_failed = false;
        for (name, pts) in &mut series {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let col = impl_colour(order, name);
            let px: Vec<(f64, f64)> = pts.iter().map(|p| (x.map(p.0), y.map(p.1))).collect();
            if px.len() > 1 {
                s.push_str(&svg::polyline(&px, col, ""));
            }
            for ((cx, cy), p) in px.iter().zip(pts.iter()) {
                if p.3 {
                    any_failed = true;
                    s.push_str(&svg::ring(*cx, *cy, 4.0, col, &p.2));
                } else {
                    s.push_str(&svg::circle(*cx, *cy, 3.5, col, &p.2));
                }
            }
            s.push('\n');
            legend.push((name.clone(), col));
        }
        s.push_str(&svg::legend(
            f.x1() + 14.0,
            f.y1() + 12.0,
            &legend,
            legend_chars,
        ));
        if any_failed {
            let ny = f.y1() + 12.0 + 18.0 * legend.len() as f64;
            s.push_str(&svg::ring(
                f.x1() + 20.0,
                ny - 4.0,
                4.0,
                "#5b6478",
                "hollow marker: failed the accuracy gate",
            ));
            s.push_str(&svg::text(
                f.x1() + 31.0,
                ny,
                "accuracy FAIL",
                "start",
                "note",
            ));
        }
        s.push_str(svg::close());
        out.push(s);
    }
    out
}

/// Horizontal bars of the candidate's speedup vs each other implementation, per config,
/// with CI whiskers and a reference line at 1.0.
fn speedup_chart(results: &RunResults, order: &[String]) -> String {
    struct Bar<'a> {
        config: &'a ConfigResult,
        baseline: &'a str,
        est: f64,
        lo: f64,
        hi: f64,
        verdict: Verdict,
    }
    let mut groups: Vec<(&ConfigResult, Vec<Bar>)> = Vec::new();
    for c in &results.configs {
        let bars: Vec<Bar> = c
            .comparisons
            .iter()
            .filter(|p| p.comparison.speedup.estimate.is_finite())
            .map(|p| Bar {
                config: c,
                baseline: &p.baseline,
                est: p.comparison.speedup.estimate,
                lo: p.comparison.speedup.low,
                hi: p.comparison.speedup.high,
                verdict: p.comparison.verdict,
            })
            .collect();
        if !bars.is_empty() {
            groups.push((c, bars));
        }
    }
    if groups.is_empty() {
        return "<p>No comparisons were made in this run.</p>\n".to_string();
    }
    let vals: Vec<f64> = groups
        .iter()
        .flat_map(|(_, b)| b.iter().flat_map(|b| [b.est, b.lo, b.hi]))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let (mn, mx) = vals
        .iter()
        .fold((1.0f64, 1.0f64), |(a, b), &v| (a.min(v), b.max(v)));
    let kind = if mx / mn > 4.0 {
        ScaleKind::Log10
    } else {
        ScaleKind::Linear
    };
    let baselines: Vec<&str> = {
        let mut v: Vec<&str> = Vec::new();
        for (_, bars) in &groups {
            for b in bars {
                if !v.contains(&b.baseline) {
                    v.push(b.baseline);
                }
            }
        }
        v.sort_by_key(|n| order.iter().position(|o| o == n));
        v
    };
    let max_label = groups
        .iter()
        .map(|(c, _)| c.label.chars().count())
        .max()
        .unwrap_or(10);
    let label_chars = max_label.clamp(12, 58);
    let (row_h, gap) = (16.0, 10.0);
    let legend_h = 18.0 * baselines.len() as f64 + 8.0;
    let n_rows: usize = groups.iter().map(|(_, b)| b.len()).sum();
    let plot_h = n_rows as f64 * row_h + groups.len() as f64 * gap;
    let f = Frame {
        width: label_chars as f64 * 6.9 + 24.0 + 480.0 + 150.0,
        height: 30.0 + legend_h + 22.0 + plot_h + 52.0,
        left: label_chars as f64 * 6.9 + 24.0,
        right: 150.0,
        top: 30.0 + legend_h + 22.0,
        bottom: 52.0,
    };
    let x = Scale::fit(kind, &vals, &[1.0], f.x0(), f.x1());
    let mut s = svg::open(
        f.width,
        f.height,
        &format!("Speedup of {} per config", results.candidate),
    );
    s.push_str(&svg::text(
        12.0,
        20.0,
        &format!(
            "Speedup of {} = median(other) / median({}); > 1: {} faster",
            results.candidate, results.candidate, results.candidate
        ),
        "start",
        "title",
    ));
    let legend: Vec<(String, &str)> = baselines
        .iter()
        .map(|b| (format!("vs {b}"), impl_colour(order, b)))
        .collect();
    s.push_str(&svg::legend(16.0, 30.0 + 16.0, &legend, 40));
    let _ = write!(
        s,
        "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" class=\"frame\"/>",
        f.x0(),
        f.y1(),
        f.x1() - f.x0(),
        f.y0() - f.y1()
    );
    for (v, label) in x.ticks() {
        let px = x.map(v);
        s.push_str(&svg::line(px, f.y1(), px, f.y0(), "class=\"grid\""));
        for (ya, yb, yt) in [
            (f.y0(), f.y0() + 5.0, f.y0() + 18.0),
            (f.y1() - 5.0, f.y1(), f.y1() - 8.0),
        ] {
            s.push_str(&svg::line(px, ya, px, yb, "class=\"tick\""));
            s.push_str(&svg::text(px, yt, &label, "middle", "ticklabel"));
        }
    }
    let one = x.map(1.0);
    s.push_str(&svg::line(
        one,
        f.y1(),
        one,
        f.y0(),
        "stroke=\"#1d2330\" stroke-width=\"1.5\" stroke-dasharray=\"4 3\"",
    ));
    s.push_str(&svg::text(
        (f.x0() + f.x1()) / 2.0,
        f.height - 10.0,
        &format!(
            "speedup (×){}",
            if kind == ScaleKind::Log10 {
                ", log scale"
            } else {
                ""
            }
        ),
        "middle",
        "axislabel",
    ));
    s.push('\n');
    let mut y = f.y1() + gap / 2.0;
    for (gi, (c, bars)) in groups.iter().enumerate() {
        let gh = bars.len() as f64 * row_h;
        if gi > 0 {
            s.push_str(&svg::line(
                4.0,
                y - gap / 2.0,
                f.x1(),
                y - gap / 2.0,
                "stroke=\"#e3e7ef\"",
            ));
        }
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" class=\"rowlabel\"><title>{}</title>{}</text>",
            f.x0() - 8.0,
            y + gh / 2.0 + 4.0,
            esc(&format!("{} ({})", c.label, c.id)),
            esc(&format::truncate(&c.label, label_chars))
        );
        for (bi, b) in bars.iter().enumerate() {
            let cy = y + bi as f64 * row_h + row_h / 2.0;
            let col = impl_colour(order, b.baseline);
            let (xa, xb) = (one.min(x.map(b.est)), one.max(x.map(b.est)));
            let tip = format!(
                "{}: {} vs {} = {} {}",
                b.config.label,
                results.candidate,
                b.baseline,
                format::fmt_speedup(&crate::stats::Interval {
                    estimate: b.est,
                    low: b.lo,
                    high: b.hi,
                    level: 0.0,
                }),
                b.verdict
            );
            let _ = write!(
                s,
                "<rect x=\"{xa:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{col}\" fill-opacity=\"0.85\"><title>{}</title></rect>",
                cy - row_h * 0.32,
                (xb - xa).max(1.0),
                row_h * 0.64,
                esc(&tip)
            );
            if b.lo.is_finite() && b.hi.is_finite() && b.lo > 0.0 {
                let (wl, wh) = (x.map(b.lo), x.map(b.hi));
                let st = "stroke=\"#1d2330\" stroke-width=\"1.2\"";
                s.push_str(&svg::line(wl, cy, wh, cy, st));
                s.push_str(&svg::line(wl, cy - 4.0, wl, cy + 4.0, st));
                s.push_str(&svg::line(wh, cy - 4.0, wh, cy + 4.0, st));
            }
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" class=\"vlabel\">{}× <tspan class=\"v-{v}\">{v}</tspan></text>",
                f.x1() + 8.0,
                cy + 4.0,
                esc(&fmt_sig(b.est, 3)),
                v = b.verdict
            );
        }
        y += gh + gap;
    }
    s.push_str(svg::close());
    s
}

/// Log-log roofline: arithmetic intensity (FLOP/byte of the minimum traffic) vs achieved
/// throughput, with the measured copy-bandwidth and GEMM ceilings. None without ceilings.
fn roofline(results: &RunResults, order: &[String]) -> Option<String> {
    let c = results.ceilings.as_ref()?;
    if !(c.gemm_tflops > 0.0 && c.copy_gbps > 0.0) {
        return None;
    }
    let (mult, unit) = format::run_flops_unit(results);
    let mut pts: Vec<(f64, f64, &str, String, bool)> = Vec::new();
    for cfg in &results.configs {
        if !(cfg.min_bytes > 0.0 && cfg.flops > 0.0) {
            continue;
        }
        let ai = cfg.flops / cfg.min_bytes;
        for i in &cfg.implementations {
            if let Some(tf) = i
                .tflops
                .filter(|t| *t > 0.0 && t.is_finite() && i.error.is_none())
            {
                pts.push((
                    ai,
                    tf * mult,
                    i.name.as_str(),
                    format!(
                        "{} — {}: {}, {} FLOP/byte{}",
                        cfg.label,
                        i.name,
                        format::fmt_throughput(tf),
                        fmt_sig(ai, 3),
                        if failed_gate(i) {
                            ", FAILED the accuracy gate"
                        } else {
                            ""
                        }
                    ),
                    failed_gate(i),
                ));
            }
        }
    }
    if pts.is_empty() {
        return None;
    }
    let peak = c.gemm_tflops * mult;
    let bw = c.copy_gbps * 1e9 / 1e12 * mult; // unit per FLOP/byte
    let ridge = peak / bw;
    let mut xs: Vec<f64> = pts.iter().map(|p| p.0).collect();
    xs.push(ridge);
    let mut ys: Vec<f64> = pts.iter().map(|p| p.1).collect();
    ys.push(peak);
    let f = Frame {
        width: 720.0,
        height: 420.0,
        left: 70.0,
        right: 190.0,
        top: 32.0,
        bottom: 48.0,
    };
    let x = Scale::fit(ScaleKind::Log10, &xs, &[], f.x0(), f.x1());
    let y = Scale::fit(ScaleKind::Log10, &ys, &[], f.y0(), f.y1());
    let mut s = svg::open(f.width, f.height, "Roofline");
    s.push_str(&svg::text(
        f.x0(),
        20.0,
        "Roofline (measured ceilings, minimum-traffic intensity)",
        "start",
        "title",
    ));
    s.push_str(&svg::axes(
        &f,
        &x,
        &y,
        "arithmetic intensity, FLOP/byte (log scale)",
        &format!("{unit} (log scale)"),
    ));
    // Memory roof: y = bw · ai, from where it enters the plot up to the ridge.
    let (xlo, xhi) = (x.d0, x.d1);
    let (ylo, _) = (y.d0, y.d1);
    let a0 = xlo.max(ylo / bw);
    let roof = "stroke=\"#1d2330\" stroke-width=\"2\"";
    if a0 < ridge {
        s.push_str(&svg::line(
            x.map(a0),
            y.map(bw * a0),
            x.map(ridge.min(xhi)),
            y.map(bw * ridge.min(xhi)),
            roof,
        ));
    }
    if ridge < xhi {
        s.push_str(&svg::line(
            x.map(ridge.max(xlo)),
            y.map(peak),
            x.map(xhi),
            y.map(peak),
            roof,
        ));
    }
    s.push_str(&svg::text(
        f.x1() - 4.0,
        y.map(peak) - 6.0,
        &format!("GEMM {} {unit} ({})", fmt_sig(peak, 3), c.gemm_desc),
        "end",
        "note",
    ));
    let lx = a0.max(xlo) * 1.3;
    if lx < ridge {
        s.push_str(&svg::text(
            x.map(lx) + 4.0,
            y.map(bw * lx) - 8.0,
            &format!("copy {} GB/s", fmt_sig(c.copy_gbps, 3)),
            "start",
            "note",
        ));
    }
    let mut legend: Vec<(String, &str)> = Vec::new();
    for (ai, v, name, tip, failed) in &pts {
        let col = impl_colour(order, name);
        if *failed {
            s.push_str(&svg::ring(x.map(*ai), y.map(*v), 4.0, col, tip));
        } else {
            s.push_str(&svg::circle(x.map(*ai), y.map(*v), 4.0, col, tip));
        }
        if !legend.iter().any(|(n, _)| n == name) {
            legend.push((name.to_string(), col));
        }
    }
    legend.sort_by_key(|(n, _)| order.iter().position(|o| o == n));
    s.push_str(&svg::legend(f.x1() + 14.0, f.y1() + 12.0, &legend, 22));
    s.push_str(svg::close());
    Some(s)
}
