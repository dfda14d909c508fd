//! One config from problem to result: inputs → reference → correctness gate for every
//! implementation → interleaved measurement of those that passed → statistics.

use super::calibration::Calibration;
use super::{Implementation, Outputs, Prepared, ReferenceOutputs, ReferenceProvider, SuiteInputs};
use crate::measure::{measure_interleaved_until, ResolveRule, Sampled, StopReason};
use crate::results::{
    AccuracyResult, CalibrationResult, Ceilings, ConfigResult, ImplResult, MeasureSettings,
    PairResult, ProblemSpec, RoutingSummary, SamplingRecord, CEILING_ONLY_FLAG, OLD_PREFIX,
};
use crate::stats::{self, VerdictOptions};
use flashmoe::accuracy;
use flashmoe::inputs::checksum;
use flashmoe::reference::moe::{compare_routing, ROUTING_TIE_REL};
use flashmoe::DType;
use std::sync::atomic::AtomicBool;

/// Everything needed to run configs: implementations, the reference, the sampling policy.
pub struct Pipeline<'a> {
    pub implementations: Vec<&'a dyn Implementation>,
    pub reference: &'a dyn ReferenceProvider,
    /// Name of the implementation whose speedups are reported.
    pub candidate: String,
    pub settings: MeasureSettings,
    pub ceilings: Option<Ceilings>,
    /// Fixed workload timed in every round next to the implementations (recorded in the
    /// results for `compare`'s ENV-DRIFT verdict); `None` measures none.
    pub calibration: Option<&'a dyn Calibration>,
}

fn dtype_of(problem: &ProblemSpec) -> DType {
    problem.workload().dtype()
}

/// Checksum over every input tensor, as `dtype`-encoded bytes.
pub fn inputs_checksum(inputs: &SuiteInputs, dtype: DType) -> String {
    fold_checksums(&input_parts(inputs, dtype))
}

/// The per-tensor checksums [`inputs_checksum`] folds, in the worker's order.
fn input_parts(inputs: &SuiteInputs, dtype: DType) -> Vec<u64> {
    match inputs {
        SuiteInputs::Attention(x) => vec![
            checksum(&x.q, dtype),
            checksum(&x.k, dtype),
            checksum(&x.v, dtype),
        ],
        SuiteInputs::Moe(x) => {
            let mut v = vec![
                checksum(&x.x, dtype),
                checksum(&x.router, dtype),
                checksum(&x.w13, dtype),
                checksum(&x.w2, dtype),
            ];
            if let (Some(a), Some(b)) = (&x.shared_w13, &x.shared_w2) {
                v.push(checksum(a, dtype));
                v.push(checksum(b, dtype));
            }
            v
        }
        // The forward's tensors, then d_out (`flashmoe_inputs.grad_specs`).
        SuiteInputs::Grad(g) => {
            let mut v = input_parts(&g.forward, dtype);
            v.push(checksum(&g.d_out, dtype));
            v
        }
    }
}

/// The per-tensor checksums folded into one (FNV-1a over the 64-bit parts).
fn fold_checksums(parts: &[u64]) -> String {
    let folded = parts.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, p| {
        (h ^ p).wrapping_mul(0x0000_0100_0000_01B3)
    });
    format!("{folded:016x}")
}

/// [`inputs_checksum`] of inputs made by `SuiteInputs::generate(problem, seed)` (the
/// precondition: every caller passes the inputs it generated with these arguments).
///
/// MoE weights (router, w13, w2, shared expert) depend on (seed, hidden, intermediate,
/// experts, dtype) and not on the token count, so a preset's configs share them; FNV over
/// tens of GB of them takes tens of seconds, so their checksums are computed once per
/// process and reused. The activations are always checksummed afresh.
pub fn generated_inputs_checksum(problem: &ProblemSpec, seed: u64, inputs: &SuiteInputs) -> String {
    fold_checksums(&generated_input_parts(problem, seed, inputs))
}

/// The per-tensor checksums [`generated_inputs_checksum`] folds.
fn generated_input_parts(problem: &ProblemSpec, seed: u64, inputs: &SuiteInputs) -> Vec<u64> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static WEIGHTS: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);
    // MLA has no value tensor: q and the latent cache only (`flashmoe_inputs.mla_specs`).
    if let (ProblemSpec::Mla(p), SuiteInputs::Attention(x)) = (problem, inputs) {
        return vec![checksum(&x.q, p.dtype), checksum(&x.k, p.dtype)];
    }
    // A gradient config: its forward's parts (MoE weights cached as there), then d_out.
    if let (ProblemSpec::Grad(p), SuiteInputs::Grad(x)) = (problem, inputs) {
        let mut parts = generated_input_parts(&p.layer.forward(), seed, &x.forward);
        parts.push(checksum(&x.d_out, p.dtype()));
        return parts;
    }
    let (ProblemSpec::Moe(p), SuiteInputs::Moe(x)) = (problem, inputs) else {
        return input_parts(inputs, dtype_of(problem));
    };
    let dtype = p.dtype;
    let weight = |name: &str, v: &[f32]| -> u64 {
        let key = format!(
            "{seed}|h{}|i{}|e{}|{dtype}|{name}|{}",
            p.hidden,
            p.intermediate,
            p.experts,
            v.len()
        );
        let cached = WEIGHTS
            .lock()
            .ok()
            .and_then(|m| m.as_ref().and_then(|m| m.get(&key).copied()));
        cached.unwrap_or_else(|| {
            let sum = checksum(v, dtype);
            if let Ok(mut m) = WEIGHTS.lock() {
                let m = m.get_or_insert_with(HashMap::new);
                if m.len() > 64 {
                    m.clear();
                }
                m.insert(key, sum);
            }
            sum
        })
    };
    let mut parts = vec![
        checksum(&x.x, dtype),
        weight("router", &x.router),
        weight("w13", &x.w13),
        weight("w2", &x.w2),
    ];
    if let (Some(a), Some(b)) = (&x.shared_w13, &x.shared_w2) {
        parts.push(weight("shared_w13", a));
        parts.push(weight("shared_w2", b));
    }
    parts
}

/// Relative tolerance of the MoE auxiliary losses against the reference (issue 5).
pub const LOSS_REL_TOL: f64 = 1e-4;

/// Elements per output row of the per-row gate (`flashmoe::accuracy::check_rows`): the
/// last dim of the output — the head dim for attention, decode and varlen (one query row
/// of one head), the hidden dim for MoE (one token).
pub fn gate_row_len(problem: &ProblemSpec) -> usize {
    problem.workload().gate_row_len()
}

/// Compare an implementation's outputs with the reference: the global relative L2,
/// max abs and the per-row bound (`accuracy::check_rows`), LSE, MoE losses and routing.
pub fn gate(
    problem: &ProblemSpec,
    outputs: &Outputs,
    reference: &ReferenceOutputs,
    reference_name: &str,
) -> AccuracyResult {
    // Gradients: every named tensor with its own row length (`crate::grad::gate`).
    if let (ProblemSpec::Grad(p), Outputs::Gradients(out), ReferenceOutputs::Gradients(r)) =
        (problem, outputs, reference)
    {
        return crate::grad::gate(p, out, r, reference_name);
    }
    let dtype = dtype_of(problem);
    let row_len = gate_row_len(problem);
    match (outputs, reference) {
        (Outputs::Attention { o, lse }, ReferenceOutputs::Attention(r)) => {
            let co = accuracy::check_rows(o, &r.o, dtype, row_len);
            // An empty LSE means "not provided" (e.g. the public SDPA API returns none):
            // O is checked alone.
            let cl =
                (!lse.is_empty() || r.lse.is_empty()).then(|| accuracy::check_lse(lse, &r.lse));
            let mut res = AccuracyResult::from_check(&co, reference_name, None);
            let mut notes = vec![match &cl {
                Some(cl) => format!("lse max_abs {:.2e}", cl.metrics.max_abs),
                None => "LSE not provided by this implementation: O checked only".to_string(),
            }];
            if let Some(why) = &co.reason {
                notes.push(format!("O: {why}"));
            }
            if let Some(cl) = cl.filter(|cl| !cl.passed) {
                res.passed = false;
                notes.push(format!("LSE: {}", cl.reason.clone().unwrap_or_default()));
            }
            res.note = Some(notes.join("; "));
            res
        }
        (
            Outputs::Moe {
                out,
                topk_ids,
                losses,
            },
            ReferenceOutputs::Moe(r),
        ) => {
            let c = accuracy::check_rows(out, &r.out, dtype, row_len);
            let mut res = AccuracyResult::from_check(&c, reference_name, c.reason.clone());
            if let Some((aux, z)) = losses {
                for (name, got, want) in [
                    ("aux loss", *aux, r.routing.aux_loss),
                    ("z-loss", *z, r.routing.z_loss),
                ] {
                    let rel = (got - want).abs() / want.abs().max(1e-30);
                    // A NaN loss fails too (is_nan: NaN compares false).
                    if rel.is_nan() || rel > LOSS_REL_TOL {
                        res.passed = false;
                        let note = format!(
                            "{name} {got:.6e} vs reference {want:.6e} (relative error {rel:.1e} > {LOSS_REL_TOL:.0e})"
                        );
                        res.note = Some(match res.note.take() {
                            Some(n) => format!("{n}; {note}"),
                            None => note,
                        });
                    }
                }
            }
            if let Some(ids) = topk_ids {
                let experts = match problem {
                    ProblemSpec::Moe(p) => p.experts,
                    ProblemSpec::Attention(_)
                    | ProblemSpec::Decode(_)
                    | ProblemSpec::Varlen(_)
                    | ProblemSpec::Mla(_)
                    | ProblemSpec::Grad(_)
                    | ProblemSpec::E2e(_) => 0,
                };
                let c = compare_routing(ids, &r.routing, experts);
                let note = if c.mismatched > 0 {
                    res.passed = false;
                    Some(format!(
                        "routing differs from the reference in {} of {} top-k slots{}",
                        c.mismatched + c.near_ties,
                        c.slots,
                        if c.near_ties > 0 {
                            format!(" ({} of them near-ties)", c.near_ties)
                        } else {
                            String::new()
                        }
                    ))
                } else if c.near_ties > 0 {
                    Some(format!(
                        "routing: {} of {} top-k slots pick a near-tied expert (reference logits within {:.0e} of the token's max |logit|), accepted",
                        c.near_ties, c.slots, ROUTING_TIE_REL
                    ))
                } else {
                    None
                };
                if let Some(note) = note {
                    res.note = Some(match res.note.take() {
                        Some(n) => format!("{note}; {n}"),
                        None => note,
                    });
                }
            }
            res
        }
        _ => AccuracyResult {
            max_abs: f64::NAN,
            mean_abs: f64::NAN,
            max_rel: f64::NAN,
            rel_l2: f64::NAN,
            non_finite: 0,
            tolerance_rel_l2: 0.0,
            max_row_rel_l2: None,
            worst_row: None,
            tolerance_row_rel_l2: None,
            passed: false,
            reference: reference_name.to_string(),
            note: Some("output kind does not match the problem".into()),
        },
    }
}

fn min_bytes(problem: &ProblemSpec, reference: Option<&ReferenceOutputs>) -> f64 {
    match problem {
        ProblemSpec::Attention(p) => p.min_bytes(),
        // Decode reports GB/s of the K/V read (issue 22): the cache read once.
        ProblemSpec::Decode(p) => p.kv_bytes(),
        // Varlen: the packed tensors (the sum of the sequences' dense minimum bytes).
        ProblemSpec::Varlen(p) => p.min_bytes(),
        // MLA: the latent cache read once (GB/s of the cache, as decode).
        ProblemSpec::Mla(p) => p.kv_bytes(),
        // Never run here (validate refuses it); `bench e2e` records the weights' bytes.
        ProblemSpec::E2e(_) => 0.0,
        ProblemSpec::Grad(p) => p.min_bytes(),
        ProblemSpec::Moe(p) => {
            let touched = match reference {
                Some(ReferenceOutputs::Moe(r)) => {
                    r.routing.expert_counts.iter().filter(|&&c| c > 0).count()
                }
                _ => p.experts.min(p.tokens * p.top_k),
            };
            p.min_bytes(touched)
        }
    }
}

impl Pipeline<'_> {
    fn verdict_options(&self) -> VerdictOptions {
        VerdictOptions {
            threshold: self.settings.threshold,
            alpha: 1.0 - self.settings.confidence,
            resamples: self.settings.bootstrap_resamples,
            seed: self.settings.seed,
        }
    }

    /// Run one config. Returns `None` when cancelled before it finished.
    pub fn run_config(
        &self,
        problem: &ProblemSpec,
        cancel: &AtomicBool,
        on_round: impl FnMut(usize),
    ) -> Option<ConfigResult> {
        let mut result = ConfigResult {
            id: problem.id(),
            label: problem.label(),
            problem: problem.clone(),
            flops: problem.workload().flops(),
            min_bytes: min_bytes(problem, None),
            implementations: Vec::new(),
            comparisons: Vec::new(),
            error: None,
            routing: None,
            calibration: None,
            sampling: None,
        };
        let valid = problem.workload().validate();
        if let Err(e) = valid {
            result.error = Some(e.to_string());
            return Some(result);
        }
        if let Err(why) = super::check_host_memory(problem) {
            result.error = Some(why);
            return Some(result);
        }

        let inputs = SuiteInputs::generate(problem, self.settings.seed);
        let input_sum = generated_inputs_checksum(problem, self.settings.seed, &inputs);
        let ref_name = self.reference.name(problem);
        let reference = match self.reference.compute(problem, &inputs) {
            Ok(r) => Some(r),
            Err(e) => {
                result.error = Some(format!("reference failed, nothing could be checked: {e:#}"));
                None
            }
        };
        result.min_bytes = min_bytes(problem, reference.as_ref());
        if let Some(ReferenceOutputs::Moe(r)) = &reference {
            result.routing = Some(RoutingSummary::from_counts(
                &r.routing.expert_counts,
                r.routing.aux_loss,
                r.routing.z_loss,
            ));
        }

        // Prepare and gate each implementation; only those that pass are timed.
        let mut rows: Vec<ImplResult> = Vec::new();
        let mut timed: Vec<(usize, Box<dyn Prepared + '_>)> = Vec::new();
        for imp in &self.implementations {
            let mut row = ImplResult::new(imp.name(), imp.backend());
            if let Err(why) = imp.supports(problem) {
                row.error = Some(format!("n/a: {why}"));
                rows.push(row);
                continue;
            }
            row.input_checksum = Some(input_sum.clone());
            let prepared = imp.prepare(problem, &inputs).and_then(|mut p| {
                let out = p.run_for_check()?;
                Ok((p, out))
            });
            match (prepared, &reference) {
                (Err(e), _) => row.error = Some(format!("{e:#}")),
                (Ok(_), None) => row.error = Some("not run: no reference to check against".into()),
                (Ok((p, _)), Some(_)) if p.ceiling_only() => {
                    row.flags.push(format!(
                        "{CEILING_ONLY_FLAG}: its output is not the layer's, so it is timed but not checked"
                    ));
                    row.flags.extend(p.notes());
                    timed.push((rows.len(), p));
                }
                (Ok((p, out)), Some(r)) => {
                    row.flags.extend(p.notes());
                    let acc = gate(problem, &out, r, &ref_name);
                    let passed = acc.passed;
                    row.peak_extra_bytes = p.peak_extra_bytes();
                    row.router_ms = p.router_ms();
                    row.accuracy = Some(acc);
                    if passed {
                        timed.push((rows.len(), p));
                    } else {
                        row.error = Some("correctness gate failed: not timed".into());
                    }
                }
            }
            rows.push(row);
        }

        // The calibration is one more participant of every round, last in the handle list.
        let mut calibration = match (self.calibration, timed.is_empty()) {
            (Some(c), false) => Some((c.workload(), c.prepare())),
            _ => None,
        };
        // `bench --against`: every timed X with its timed old:X is a pair whose speedup CI
        // must resolve the threshold band before sampling stops (measure::ResolveRule).
        let resolve = self.settings.against_max_time_ms.map(|max_time_ms| {
            let name = |i: usize| rows[timed[i].0].name.as_str();
            let pairs = (0..timed.len())
                .filter_map(|new| {
                    let old_name = format!("{OLD_PREFIX}{}", name(new));
                    (0..timed.len())
                        .find(|&old| name(old) == old_name)
                        .map(|old| (old, new))
                })
                .collect();
            ResolveRule {
                pairs,
                threshold: self.settings.threshold,
                alpha: 1.0 - self.settings.confidence,
                max_time_ms,
            }
        });
        let mut measurement = {
            let mut handles: Vec<&mut dyn Sampled> = timed
                .iter_mut()
                .map(|(_, p)| p.as_mut() as &mut dyn Sampled)
                .collect();
            if let Some((_, Ok(c))) = calibration.as_mut() {
                handles.push(c.as_mut());
            }
            measure_interleaved_until(
                &mut handles,
                &self.settings,
                resolve.as_ref(),
                cancel,
                on_round,
            )
        };
        if measurement.stop == StopReason::Cancelled {
            return None;
        }
        result.sampling = Some(SamplingRecord {
            stop: measurement.stop,
            rounds: measurement.rounds,
            sampling_ms: measurement.sampling_ms,
        });
        if let Some((workload, prepared)) = calibration {
            result.calibration = Some(match prepared {
                Ok(_) => {
                    let set = measurement
                        .sets
                        .pop()
                        .expect("the calibration's sample set");
                    CalibrationResult {
                        workload,
                        samples_ms: set.samples_ms,
                        error: set.error,
                    }
                }
                Err(e) => CalibrationResult {
                    workload,
                    samples_ms: Vec::new(),
                    error: Some(format!("{e:#}")),
                },
            });
        }
        for ((row_index, _), set) in timed.iter().zip(measurement.sets) {
            let row = &mut rows[*row_index];
            row.error = set.error.or(row.error.take());
            row.samples_ms = set.samples_ms;
            if row.samples_ms.is_empty() {
                continue;
            }
            let s = stats::summarize(
                &row.samples_ms,
                self.settings.confidence,
                self.settings.bootstrap_resamples,
                self.settings.seed,
            );
            let secs = s.median * 1e-3;
            let tflops = result.flops / secs / 1e12;
            row.tflops = Some(tflops);
            row.gbps = Some(result.min_bytes / secs / 1e9);
            if let Some(c) = &self.ceilings {
                row.pct_of_gemm_ceiling = Some(100.0 * tflops / c.gemm_tflops);
                row.pct_of_copy_ceiling = Some(100.0 * result.min_bytes / secs / 1e9 / c.copy_gbps);
                if tflops > c.gemm_tflops * 1.02 {
                    row.flags.push(format!(
                        "implausible: {tflops:.0} TFLOP/s is above the measured GEMM ceiling {:.0}",
                        c.gemm_tflops
                    ));
                }
            }
            row.summary = Some(s);
        }

        // Speedup of the candidate against every other usable implementation.
        if let Some(cand) = rows
            .iter()
            .find(|r| r.name == self.candidate && r.is_usable())
        {
            let opts = self.verdict_options();
            for other in rows
                .iter()
                .filter(|r| r.name != self.candidate && r.is_usable())
            {
                result.comparisons.push(PairResult {
                    candidate: cand.name.clone(),
                    baseline: other.name.clone(),
                    comparison: stats::compare_samples(&other.samples_ms, &cand.samples_ms, &opts),
                });
            }
        }
        result.implementations = rows;
        Some(result)
    }
}

/// How far below its neighbours a throughput must fall to be called implausible.
pub const NEIGHBOUR_DROP: f64 = 3.0;

/// Flag every implementation whose TFLOP/s is more than [`NEIGHBOUR_DROP`]× below the
/// median of its neighbouring configs in the same plot panel (the configs just before and
/// after it along the sweep axis) — the signature of a silent fallback path, such as
/// FlexAttention after a recompile limit. Existing flags of this kind are replaced, so the
/// pass can run after every config.
///
/// MoE token sweeps go from memory-bound (a few tokens per expert: TFLOP/s grows with the
/// token count) to compute-bound (GB/s of the fixed weights falls with it), so one metric
/// alone drops legitimately between neighbours there: an MoE row is flagged only when its
/// TFLOP/s and its GB/s are both [`NEIGHBOUR_DROP`]× below its neighbours'.
pub fn flag_implausible_drops(results: &mut crate::results::RunResults) {
    use std::collections::BTreeMap;
    const TAG: &str = "implausible: far below its neighbouring configs";
    let mut panels: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, c) in results.configs.iter().enumerate() {
        panels.entry(c.problem.panel()).or_default().push(i);
    }
    let mut flags: Vec<(usize, String, String)> = Vec::new();
    for members in panels.values_mut() {
        members.sort_by(|&a, &b| {
            let (xa, xb) = (
                results.configs[a].problem.x_value(),
                results.configs[b].problem.x_value(),
            );
            xa.total_cmp(&xb)
        });
        for (pos, &ci) in members.iter().enumerate() {
            let is_moe = matches!(results.configs[ci].problem, ProblemSpec::Moe(_));
            for imp in &results.configs[ci].implementations {
                let Some(own) = imp.tflops else { continue };
                let neighbours = |metric: &dyn Fn(&ImplResult) -> Option<f64>| -> Vec<f64> {
                    [pos.checked_sub(1), Some(pos + 1)]
                        .into_iter()
                        .flatten()
                        .filter_map(|p| members.get(p))
                        .filter_map(|&n| {
                            results.configs[n]
                                .implementations
                                .iter()
                                .find(|o| o.name == imp.name)
                                .and_then(metric)
                        })
                        .collect()
                };
                let tf = neighbours(&|o| o.tflops);
                if tf.is_empty() {
                    continue;
                }
                let reference = stats::median(&tf);
                let mut collapsed = own * NEIGHBOUR_DROP < reference;
                if is_moe {
                    let gb = neighbours(&|o| o.gbps);
                    collapsed &= match imp.gbps {
                        Some(own_gb) if !gb.is_empty() => {
                            own_gb * NEIGHBOUR_DROP < stats::median(&gb)
                        }
                        _ => false,
                    };
                }
                if collapsed {
                    flags.push((
                        ci,
                        imp.name.clone(),
                        format!(
                            "{TAG} ({own:.3} vs {reference:.3} TFLOP/s): a silent fallback path?"
                        ),
                    ));
                }
            }
        }
    }
    for c in &mut results.configs {
        for imp in &mut c.implementations {
            imp.flags.retain(|f| !f.starts_with(TAG));
        }
    }
    for (ci, name, flag) in flags {
        if let Some(imp) = results.configs[ci]
            .implementations
            .iter_mut()
            .find(|i| i.name == name)
        {
            imp.flags.push(flag);
        }
    }
}
