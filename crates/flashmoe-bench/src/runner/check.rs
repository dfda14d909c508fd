//! `flashmoe check`: every implementation against the reference over a shape matrix.

use super::pipeline::gate;
use super::{Implementation, Outputs, ReferenceOutputs, ReferenceProvider, SuiteInputs};
use crate::results::{AccuracyResult, ProblemSpec};
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};

/// One implementation on one shape.
#[derive(Debug, Clone)]
pub struct CheckRow {
    pub config: String,
    pub implementation: String,
    pub accuracy: Option<AccuracyResult>,
    /// Set when it could not run (the check fails) or does not apply ("n/a: ...", skipped).
    pub error: Option<String>,
}

impl CheckRow {
    pub fn is_skip(&self) -> bool {
        self.error.as_deref().is_some_and(|e| e.starts_with("n/a"))
    }
    pub fn passed(&self) -> bool {
        self.is_skip() || (self.error.is_none() && self.accuracy.as_ref().is_some_and(|a| a.passed))
    }
}

/// Check every implementation on every problem with inputs drawn from `seed`.
/// `on_case` is called after each problem (progress).
pub fn run_checks(
    problems: &[ProblemSpec],
    implementations: &[&dyn Implementation],
    reference: &dyn ReferenceProvider,
    seed: u64,
    mut on_case: impl FnMut(&[CheckRow]),
) -> Vec<CheckRow> {
    let mut rows = Vec::new();
    for (case, problem) in problems.iter().enumerate() {
        let first = rows.len();
        let config = problem.label();
        let row = |name: &str, accuracy, error| CheckRow {
            config: config.clone(),
            implementation: name.to_string(),
            accuracy,
            error,
        };
        let valid = problem
            .workload()
            .validate()
            .map_err(|e| e.to_string())
            .and_then(|()| super::check_host_memory(problem));
        if let Err(e) = valid {
            rows.push(row("(problem)", None, Some(e)));
            on_case(&rows[first..]);
            continue;
        }
        // Fresh inputs per case, reproducible from (seed, case).
        let inputs = SuiteInputs::generate(problem, seed.wrapping_add(case as u64));
        let ref_name = reference.name(problem);
        let reference_provider_is =
            |name: &str, p: &ProblemSpec| reference.serves_as(p) == Some(name);
        let reference = match reference.compute(problem, &inputs) {
            Ok(r) => r,
            Err(e) => {
                rows.push(row("(reference)", None, Some(format!("{e:#}"))));
                on_case(&rows[first..]);
                continue;
            }
        };
        for imp in implementations {
            if reference_provider_is(imp.name(), problem) {
                rows.push(row(
                    imp.name(),
                    None,
                    Some(format!("n/a: is the reference ({ref_name}) for this shape")),
                ));
                continue;
            }
            if let Err(why) = imp.supports(problem) {
                rows.push(row(imp.name(), None, Some(format!("n/a: {why}"))));
                continue;
            }
            let outputs = imp
                .prepare(problem, &inputs)
                .and_then(|mut p| p.run_for_check());
            // Gradients: one row per gradient (dq, dk, dv; MoE dx, d_router, ...).
            if let (
                ProblemSpec::Grad(p),
                Ok(Outputs::Gradients(out)),
                ReferenceOutputs::Gradients(r),
            ) = (problem, &outputs, &reference)
            {
                for (name, acc) in crate::grad::gate_each(p, out, r, &ref_name) {
                    rows.push(CheckRow {
                        config: format!("{config} {name}"),
                        implementation: imp.name().to_string(),
                        accuracy: Some(acc),
                        error: None,
                    });
                }
                continue;
            }
            rows.push(match outputs {
                Ok(out) => row(
                    imp.name(),
                    Some(gate(problem, &out, &reference, &ref_name)),
                    None,
                ),
                Err(e) => row(imp.name(), None, Some(format!("{e:#}"))),
            });
        }
        on_case(&rows[first..]);
    }
    rows
}

/// Render the rows as a table, failures first in attention.
pub fn render(rows: &[CheckRow]) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "config",
        "implementation",
        "rel-L2",
        "worst row rel-L2",
        "max abs",
        "max rel",
        "tol rel-L2",
        "result",
    ]);
    for r in rows {
        let (l2, row, ma, mr, tol) = match &r.accuracy {
            Some(a) => (
                format!("{:.2e}", a.rel_l2),
                match (a.max_row_rel_l2, a.worst_row) {
                    (Some(e), Some(i)) => format!("{e:.2e} (row {i})"),
                    (Some(e), None) => format!("{e:.2e}"),
                    _ => String::new(),
                },
                format!("{:.2e}", a.max_abs),
                format!("{:.2e}", a.max_rel),
                format!("{:.1e}", a.tolerance_rel_l2),
            ),
            None => Default::default(),
        };
        let result = if r.is_skip() {
            r.error.clone().unwrap_or_default()
        } else if let Some(e) = &r.error {
            format!("FAIL: {e}")
        } else if r.passed() {
            "PASS".to_string()
        } else {
            let note = r
                .accuracy
                .as_ref()
                .and_then(|a| a.note.clone())
                .unwrap_or_default();
            format!("FAIL {note}")
        };
        t.add_row(vec![
            r.config.clone(),
            r.implementation.clone(),
            l2,
            row,
            ma,
            mr,
            tol,
            result,
        ]);
    }
    t.to_string()
}
