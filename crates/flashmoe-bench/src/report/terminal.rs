//! The terminal summary table (comfy-table).

use super::format::{self, level_pct, row_view, truncate, DASH};
use crate::results::RunResults;
use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{Cell, CellAlignment, ColumnConstraint, ContentArrangement, Table, Width};

/// Widest layout used (wider content is wrapped); narrower when the terminal is.
const MAX_WIDTH: u16 = 160;

/// The results as a table: one row per config × implementation, followed by a legend.
pub fn terminal_table(results: &RunResults) -> String {
    let with_pct = format::has_pct_ceiling(results);
    let ci = level_pct(format::ci_level(results));
    let sp_ci = format::speedup_level(results)
        .map(level_pct)
        .unwrap_or_else(|| ci.clone());
    let mut header = vec![
        "config".to_string(),
        "impl".to_string(),
        "median ms".to_string(),
        format!("{ci} CI ms"),
        "n".to_string(),
        "outl.".to_string(),
        "throughput".to_string(),
        "GB/s".to_string(),
    ];
    if with_pct {
        header.push("% GEMM".to_string());
        header.push("% copy".to_string());
    }
    header.push("rel-L2 gate".to_string());
    header.push(format!(
        "speedup of {} [{sp_ci} CI]",
        truncate(&results.candidate, 24)
    ));
    header.push("verdict".to_string());

    let mut table = Table::new();
    // A detected terminal width (tty only) narrows the layout; otherwise MAX_WIDTH.
    let width = table.width().map_or(MAX_WIDTH, |w| w.clamp(80, MAX_WIDTH));
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_width(width)
        .set_header(header.clone());
    // Error messages go below the table, referenced by number, so rows stay one line.
    let mut notes: Vec<String> = Vec::new();
    let n_cols = header.len();

    for config in &results.configs {
        let mut first = true;
        let label_cell = |first: &mut bool| {
            if std::mem::replace(first, false) {
                config.label.clone()
            } else {
                String::new()
            }
        };
        if let Some(e) = &config.error {
            notes.push(format!("{}: {e}", config.id));
            let mut cells = vec![
                label_cell(&mut first),
                DASH.to_string(),
                format!("error ({})", notes.len()),
            ];
            cells.resize(n_cols, String::new());
            table.add_row(cells);
        }
        for imp in &config.implementations {
            let r = row_view(results, config, imp);
            let name = if r.is_candidate {
                format!("{} *", r.impl_name)
            } else if r.is_best_baseline {
                format!("{} †", r.impl_name)
            } else {
                r.impl_name.clone()
            };
            let right = |s: &str| Cell::new(s).set_alignment(CellAlignment::Right);
            let mut cells: Vec<Cell> = vec![Cell::new(label_cell(&mut first)), Cell::new(name)];
            if let Some(e) = &r.error {
                notes.push(format!("{} / {}: {e}", config.id, r.impl_name));
                let kind = if e.starts_with("n/a") { "n/a" } else { "error" };
                cells.push(right(&format!("{kind} ({})", notes.len())));
                while cells.len() < n_cols {
                    cells.push(Cell::new(DASH).set_alignment(CellAlignment::Right));
                }
                table.add_row(cells);
                continue;
            }
            cells.push(right(&r.median));
            cells.push(right(&r.ci));
            cells.push(right(&r.n));
            cells.push(right(&r.outliers));
            cells.push(right(&r.throughput));
            cells.push(right(&r.gbps));
            if with_pct {
                cells.push(right(&r.pct_ceiling));
                cells.push(right(&r.pct_copy));
            }
            cells.push(right(&r.accuracy));
            cells.push(right(&r.speedup));
            cells.push(Cell::new(
                r.verdict.map(|v| v.to_string()).unwrap_or(DASH.to_string()),
            ));
            table.add_row(cells);
        }
    }
    if let Some(col) = table.column_mut(0) {
        col.set_constraint(ColumnConstraint::UpperBoundary(Width::Fixed(19)));
    }
    // Keep "1.23× [1.20, 1.26]" on one line.
    if let Some(col) = table.column_mut(n_cols - 2) {
        col.set_constraint(ColumnConstraint::LowerBoundary(Width::Fixed(21)));
    }
    if let Some(col) = table.column_mut(1) {
        col.set_constraint(ColumnConstraint::UpperBoundary(Width::Fixed(22)));
    }

    let mut out = table.to_string();
    out.push('\n');
    out.push_str(&format!(
        "* candidate. Speedup = median(other) / median({}) with its {sp_ci} bootstrap CI: \
         > 1 means {} is faster; verdict threshold {}%.\n\
         † best baseline: the fastest other implementation that passed the correctness gate.\n",
        results.candidate,
        results.candidate,
        format::fmt_sig(results.settings.threshold * 100.0, 3)
    ));
    let flagged: Vec<String> = results
        .configs
        .iter()
        .flat_map(|c| {
            c.implementations.iter().flat_map(move |i| {
                i.flags
                    .iter()
                    .map(move |f| format!("{} / {}: {f}", c.id, i.name))
            })
        })
        .collect();
    if with_pct {
        out.push_str(
            "% GEMM = compute floor (FLOPs at the measured GEMM ceiling) / median; % copy = \
             memory floor (minimum bytes at the measured copy bandwidth) / median.\n",
        );
    }
    for c in &results.configs {
        if let Some(parts) = format::moe_routing_parts(c) {
            out.push_str(&format!("routing {}:\n", c.id));
            for p in parts {
                out.push_str(&format!("    {p}\n"));
            }
        }
    }
    for (i, n) in notes.iter().enumerate() {
        out.push_str(&format!("({}) {n}\n", i + 1));
    }
    for f in flagged {
        out.push_str(&format!("! {f}\n"));
    }
    if results.interrupted {
        out.push_str("Run interrupted: only the configs above were completed.\n");
    }
    if let Some(g) = crate::grades::grade_table(results) {
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED)
            .set_content_arrangement(ContentArrangement::Dynamic)
            .set_width(width)
            .set_header(g.header.clone());
        for r in &g.rows {
            t.add_row(r.clone());
        }
        out.push_str(&format!("\n{}:\n{t}\n{}\n", g.title, wrap(&g.note, width)));
    }
    out
}

/// `text` with its words wrapped at `width` columns.
fn wrap(text: &str, width: u16) -> String {
    let mut out = String::new();
    let mut col = 0;
    for w in text.split_whitespace() {
        let n = w.chars().count();
        if col > 0 && col + 1 + n > width as usize {
            out.push('\n');
            col = 0;
        } else if col > 0 {
            out.push(' ');
            col += 1;
        }
        out.push_str(w);
        col += n;
    }
    out
}
