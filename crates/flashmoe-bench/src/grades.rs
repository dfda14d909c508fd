//! Seed 003's gates: the candidate's % of reference and grade per config, and the memory
//! table (standard attention with its S×S matrix vs the O(N) flash algorithm at
//! S = 2048 / 4096 / 8192). Pure functions of a [`RunResults`]; every report (terminal,
//! Markdown, HTML) renders the same [`TextTable`]s.
//!
//! * The reference of a config is its strongest baseline
//!   ([`ConfigResult::best_baseline`]): the fastest implementation other than the candidate
//!   that passed the correctness gate, is not a ceiling-only measurement and is not an old
//!   build's (`bench --against`), named in the table.
//! * % of reference = reference median / candidate median × 100 (throughput ratio: above
//!   100 the candidate is faster).
//! * Grades at seed 003's boundaries: A > 80 %, B > 70 %, C > 60 %, D > 40 %; at or below
//!   40 % the grade is F ("below D").

use crate::results::{ConfigResult, ProblemSpec, RunResults};

/// A table of text cells, rendered by each report format.
#[derive(Debug, Clone, PartialEq)]
pub struct TextTable {
    pub title: String,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// Shown under the table: how the numbers were obtained.
    pub note: String,
}

/// Seed 003's grade of a % of reference: A > 80, B > 70, C > 60, D > 40, else F.
pub fn grade_letter(pct_of_reference: f64) -> &'static str {
    match pct_of_reference {
        p if p > 80.0 => "A",
        p if p > 70.0 => "B",
        p if p > 60.0 => "C",
        p if p > 40.0 => "D",
        p if p.is_nan() => "—",
        _ => "F",
    }
}

/// The candidate's standing on one config.
#[derive(Debug, Clone, PartialEq)]
pub struct Grade {
    pub reference: String,
    pub reference_ms: f64,
    pub candidate_ms: f64,
    pub pct_of_reference: f64,
    pub grade: &'static str,
}

/// The candidate's grade on `config`, when it and a reference both have a median.
pub fn grade_of(config: &ConfigResult, candidate: &str) -> Option<Grade> {
    let cand = config
        .implementations
        .iter()
        .find(|i| i.name == candidate && i.is_usable())?;
    let candidate_ms = cand.median_ms()?;
    let r = config.best_baseline(candidate)?;
    let reference_ms = r.median_ms()?;
    let pct = 100.0 * reference_ms / candidate_ms;
    Some(Grade {
        reference: r.name.clone(),
        reference_ms,
        candidate_ms,
        pct_of_reference: pct,
        grade: grade_letter(pct),
    })
}

/// The grade table: one row per config with a graded candidate; `None` when no config
/// could be graded (no baseline ran).
pub fn grade_table(results: &RunResults) -> Option<TextTable> {
    let rows: Vec<Vec<String>> = results
        .configs
        .iter()
        .filter_map(|c| {
            let g = grade_of(c, &results.candidate)?;
            Some(vec![
                c.label.clone(),
                g.reference.clone(),
                format!("{:.4}", g.reference_ms),
                format!("{:.4}", g.candidate_ms),
                format!("{:.1}%", g.pct_of_reference),
                g.grade.to_string(),
            ])
        })
        .collect();
    if rows.is_empty() {
        return None;
    }
    Some(TextTable {
        title: format!("Seed 003 grades of {}", results.candidate),
        header: vec![
            "config".into(),
            "reference (strongest baseline)".into(),
            "reference ms".into(),
            format!("{} ms", results.candidate),
            "% of reference".into(),
            "grade".into(),
        ],
        rows,
        note: "% of reference = reference median / candidate median (above 100% the \
               candidate is faster). Grades at seed 003's boundaries: A > 80%, B > 70%, \
               C > 60%, D > 40%, F at or below 40% (below D). The reference is the fastest \
               other implementation that passed the correctness gate on that config."
            .into(),
    })
}

/// Sequence lengths of seed 003's memory table.
pub const MEMORY_SEQLENS: [usize; 3] = [2048, 4096, 8192];

fn gb(bytes: f64) -> String {
    if bytes >= 1e9 {
        format!("{:.2} GB", bytes / 1e9)
    } else {
        format!("{:.1} MB", bytes / 1e6)
    }
}

/// The analytic memory table for an attention shape (batch, heads, head dim, element
/// bytes) at [`MEMORY_SEQLENS`]: standard attention holds Q, K, V, O and one S×S score
/// matrix in the element type; the flash algorithm holds Q, K, V, O and the f32 LSE.
pub fn analytic_memory_table(batch: usize, heads: usize, head_dim: usize, elt: usize) -> TextTable {
    let rows = MEMORY_SEQLENS
        .iter()
        .map(|&s| {
            let (b, h, d, s) = (batch as f64, heads as f64, head_dim as f64, s as f64);
            let io = 4.0 * b * h * s * d * elt as f64;
            let scores = b * h * s * s * elt as f64;
            let lse = b * h * s * 4.0;
            vec![
                format!("{}", s as usize),
                gb(io),
                gb(scores),
                gb(io + scores),
                gb(io + lse),
                format!("{:.1}×", (io + scores) / (io + lse)),
            ]
        })
        .collect();
    TextTable {
        title: format!(
            "Memory, analytic (seed 003): B={batch} H={heads} D={head_dim}, {elt}-byte elements"
        ),
        header: vec![
            "S".into(),
            "Q, K, V, O".into(),
            "S×S matrix".into(),
            "standard attention".into(),
            "flash attention (O(N): + LSE)".into(),
            "reduction".into(),
        ],
        rows,
        note: "Computed, not measured: standard attention = Q, K, V, O + one S×S score \
               matrix in the element type; flash attention = Q, K, V, O + the f32 \
               log-sum-exp per row. Measured peak extra bytes per implementation (GPU runs) \
               are in the next table when the run has configs at these lengths."
            .into(),
    }
}

/// The measured memory table: for each attention config whose Sk is one of
/// [`MEMORY_SEQLENS`], each implementation's measured peak extra bytes (GPU: the
/// allocator's peak beyond inputs and outputs for the Python baselines, the workspace for
/// ours) beside the bytes of the materialised S×S matrix. `None` when nothing at those
/// lengths reported memory (e.g. a CPU run).
pub fn measured_memory_table(results: &RunResults) -> Option<TextTable> {
    let configs: Vec<&ConfigResult> = results
        .configs
        .iter()
        .filter(|c| match &c.problem {
            ProblemSpec::Attention(p) => MEMORY_SEQLENS.contains(&p.seqlen_k),
            _ => false,
        })
        .filter(|c| {
            c.implementations
                .iter()
                .any(|i| i.peak_extra_bytes.is_some())
        })
        .collect();
    if configs.is_empty() {
        return None;
    }
    let mut names: Vec<String> = Vec::new();
    for c in &configs {
        for i in &c.implementations {
            if i.peak_extra_bytes.is_some() && !names.contains(&i.name) {
                names.push(i.name.clone());
            }
        }
    }
    let rows = configs
        .iter()
        .map(|c| {
            let ProblemSpec::Attention(p) = &c.problem else {
                unreachable!("filtered to attention configs")
            };
            let scores =
                (p.batch * p.heads_q * p.seqlen_q * p.seqlen_k * p.dtype.size_bytes()) as f64;
            let mut row = vec![c.label.clone(), gb(scores)];
            for n in &names {
                row.push(
                    c.implementations
                        .iter()
                        .find(|i| &i.name == n)
                        .and_then(|i| i.peak_extra_bytes)
                        .map(|b| gb(b as f64))
                        .unwrap_or_else(|| "—".into()),
                );
            }
            row
        })
        .collect();
    let mut header = vec![
        "config".to_string(),
        "S×S matrix (materialised)".to_string(),
    ];
    header.extend(names.iter().map(|n| format!("{n} peak extra")));
    Some(TextTable {
        title: "Memory, measured: peak extra device bytes at S = 2048 / 4096 / 8192".into(),
        header,
        rows,
        note: "Peak extra bytes beyond inputs and outputs, measured during the correctness \
               run: PyTorch baselines by torch.cuda.max_memory_allocated deltas, our kernels \
               by their workspace. — = not reported."
            .into(),
    })
}

/// The seed 003 memory tables of a run: the analytic one for its first attention shape
/// (or seed 003's B=16 H=16 D=64 f16 when it has none), then the measured one if any.
pub fn memory_tables(results: &RunResults) -> Vec<TextTable> {
    let shape = results.configs.iter().find_map(|c| match &c.problem {
        ProblemSpec::Attention(p) => Some((p.batch, p.heads_q, p.head_dim, p.dtype.size_bytes())),
        _ => None,
    });
    if shape.is_none() && results.suite != "attention" {
        return Vec::new();
    }
    let (b, h, d, e) = shape.unwrap_or((16, 16, 64, 2));
    let mut v = vec![analytic_memory_table(b, h, d, e)];
    v.extend(measured_memory_table(results));
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::fixtures::{config_from_samples, noisy_samples, run_with};
    use flashmoe::{AttentionProblem, DType};

    #[test]
    fn grade_boundaries_follow_seed_003() {
        assert_eq!(grade_letter(120.0), "A");
        assert_eq!(grade_letter(80.01), "A");
        assert_eq!(grade_letter(80.0), "B");
        assert_eq!(grade_letter(70.5), "B");
        assert_eq!(grade_letter(70.0), "C");
        assert_eq!(grade_letter(60.0), "D");
        assert_eq!(grade_letter(40.01), "D");
        assert_eq!(grade_letter(40.0), "F");
        assert_eq!(grade_letter(3.0), "F");
        assert_eq!(grade_letter(f64::NAN), "—");
    }

    #[test]
    fn reference_is_the_fastest_other_usable_implementation() {
        let p = ProblemSpec::Attention(AttentionProblem::new(2, 4, 2048, 64, false, DType::F16));
        let c = config_from_samples(
            p,
            "mine",
            vec![
                ("mine", "cuda", noisy_samples(2.0, 0.001, 30, 1)),
                ("sdpa-flash", "python", noisy_samples(1.5, 0.001, 30, 2)),
                ("sdpa-math", "python", noisy_samples(9.0, 0.001, 30, 3)),
                ("old:mine", "old-build", noisy_samples(1.0, 0.001, 30, 4)),
            ],
            None,
        );
        let g = grade_of(&c, "mine").unwrap();
        assert_eq!(
            g.reference, "sdpa-flash",
            "old builds are never the reference"
        );
        assert!((g.pct_of_reference - 75.0).abs() < 0.5, "{g:?}");
        assert_eq!(g.grade, "B");
        let run = run_with("attention", "mine", vec![c], None);
        let t = grade_table(&run).unwrap();
        assert_eq!(t.rows[0][1], "sdpa-flash");
        assert_eq!(t.rows[0][5], "B");
        // A run with no baseline has no grade table.
        let p = ProblemSpec::Attention(AttentionProblem::new(2, 4, 256, 64, false, DType::F16));
        let alone = config_from_samples(
            p,
            "mine",
            vec![("mine", "cpu", noisy_samples(1.0, 0.01, 20, 5))],
            None,
        );
        assert!(grade_table(&run_with("attention", "mine", vec![alone], None)).is_none());
    }

    #[test]
    fn analytic_memory_matches_seed_003_standard_attention() {
        // Seed 003's standard-attention column (B=16, H=16, 2-byte scores): 2.1, 8.4 and
        // 33.6 GB at S = 2048, 4096, 8192 are the S×S matrices.
        let t = analytic_memory_table(16, 16, 64, 2);
        assert_eq!(t.rows.len(), 3);
        assert_eq!(t.rows[0][2], "2.15 GB");
        assert_eq!(t.rows[1][2], "8.59 GB");
        assert_eq!(t.rows[2][2], "34.36 GB");
        // Flash: Q, K, V, O (268 MB at 2048) + LSE (2 MB).
        assert_eq!(t.rows[0][1], "268.4 MB");
        assert_eq!(t.rows[0][4], "270.5 MB");
    }

    #[test]
    fn measured_memory_lists_configs_at_seed_lengths_only() {
        let mk = |s: usize, bytes: Option<u64>| {
            let p = ProblemSpec::Attention(AttentionProblem::new(1, 2, s, 64, false, DType::Bf16));
            let mut c = config_from_samples(
                p,
                "mine",
                vec![("mine", "cuda", noisy_samples(1.0, 0.01, 20, s as u64))],
                None,
            );
            c.implementations[0].peak_extra_bytes = bytes;
            c
        };
        let run = run_with(
            "attention",
            "mine",
            vec![mk(1024, Some(5)), mk(2048, Some(3_000_000)), mk(4096, None)],
            None,
        );
        let t = measured_memory_table(&run).unwrap();
        assert_eq!(t.rows.len(), 1);
        assert_eq!(t.rows[0][2], "3.0 MB");
        let tables = memory_tables(&run);
        assert_eq!(tables.len(), 2);
        assert!(tables[0].title.contains("B=1 H=2 D=64"));
    }
}
