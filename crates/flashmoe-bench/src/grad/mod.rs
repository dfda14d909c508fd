//! The lab's gradient family (issues 33 and 34): the backward pass of a layer the forward
//! suites already measure — dense attention, packed (varlen) attention, the MoE layer —
//! checked against the library's f64 backward references and timed as `--pass bwd`
//! (backward alone, over a retained forward) or `--pass fwd+bwd` (both).
//!
//! A [`GradProblem`] wraps the forward problem ([`GradLayer`]) with the pass. Its inputs
//! ([`GradInputs`]) are the forward's plus the upstream gradient `d_out` of the layer's
//! output (the generator's `DOut` / `MoeDOut` streams: the same bytes on every backend,
//! the Python worker included). The loss whose gradients are checked is
//! `L = <d_out, out>` (MoE: `+ d_aux · aux + d_z · z_loss`).
//!
//! Outputs are named gradient tensors ([`GradTensor`]): dq, dk, dv (attention, varlen);
//! dx, d_router, dw13, dw2 and the shared expert's d_shared_w13, d_shared_w2 (MoE). Each
//! is gated on its own ([`gate`]) with `flashmoe::accuracy::check_gradient`: the global
//! relative L2 of the forward's tolerance and a per-row bound; a NaN never passes.
//!
//! FLOPs: attention backward = 2.5 × the forward's (FlashAttention's convention: five
//! GEMMs to the forward's two), fwd+bwd = 3.5 ×; MoE backward = 2 × the forward's GEMM
//! FLOPs (each GEMM has a data-gradient and a weight-gradient GEMM), fwd+bwd = 3 ×.
//!
//! Files: `config.rs` (presets wrapped in a pass, the check matrix), `cpu.rs` (the f64
//! reference as an implementation, the f32 CPU backwards under test), `attention_f32.rs`
//! and `moe_f32.rs` (those f32 algorithms), `gpu.rs` (plan-backed GPU implementations over
//! `AttentionBackwardPlan`, `VarlenBackwardPlan` and `MoeBackwardPlan`).

pub mod attention_f32;
pub mod config;
pub mod cpu;
pub mod gpu;
pub mod moe_f32;
pub mod moe_sampled;
pub mod reference;
pub mod sampled;

pub mod problem;
pub use problem::{GradLayer, GradProblem, Pass, RouterShape};
pub use reference::GradReference;

use crate::results::{AccuracyResult, ProblemSpec};
use crate::suite_io::SuiteInputs;
pub use crate::suite_io::{GradInputs, GradTensor, RefTensor};
use flashmoe::accuracy;
use flashmoe::inputs::{generate, TensorId};
use flashmoe::reference::attention_backward::attention_backward_f64;
use flashmoe::reference::moe_backward::moe_backward_f64;
use flashmoe::DType;
use std::fmt;

// The problem types live in `problem.rs` (below the results model, which names them);
// their methods that build results types live here.
impl GradLayer {
    /// The forward problem as the forward suites know it.
    pub fn forward(&self) -> ProblemSpec {
        match self {
            GradLayer::Attention(p) => ProblemSpec::Attention(p.clone()),
            GradLayer::Varlen(p) => ProblemSpec::Varlen(p.clone()),
            GradLayer::Moe(p) => ProblemSpec::Moe(p.clone()),
        }
    }
}

/// Name, elements and row length (the per-row gate's) of one gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorShape {
    pub name: &'static str,
    pub len: usize,
    pub row_len: usize,
}

impl GradProblem {
    pub fn new(pass: Pass, layer: GradLayer) -> GradProblem {
        GradProblem {
            pass,
            layer,
            d_aux: 0.0,
            d_z: 0.0,
            router: RouterShape::Random,
        }
    }

    pub fn dtype(&self) -> DType {
        match &self.layer {
            GradLayer::Attention(p) => p.dtype,
            GradLayer::Varlen(p) => p.dtype,
            GradLayer::Moe(p) => p.dtype,
        }
    }

    /// Whether the MoE loss terms take part (a baseline without the losses cannot run it).
    pub fn trains_losses(&self) -> bool {
        self.d_aux != 0.0 || self.d_z != 0.0
    }

    /// The gradients the problem produces, in a fixed order.
    pub fn tensors(&self) -> Vec<TensorShape> {
        let t = |name, len, row_len| TensorShape { name, len, row_len };
        match &self.layer {
            GradLayer::Attention(p) => vec![
                t("dq", p.q_elems(), p.head_dim),
                t("dk", p.kv_elems(), p.head_dim),
                t("dv", p.kv_elems(), p.head_dim),
            ],
            GradLayer::Varlen(p) => {
                let d = p.head_dim;
                vec![
                    t("dq", p.total_q() * p.heads_q * d, d),
                    t("dk", p.total_k() * p.heads_kv * d, d),
                    t("dv", p.total_k() * p.heads_kv * d, d),
                ]
            }
            GradLayer::Moe(p) => {
                let (h, i, e) = (p.hidden, p.intermediate, p.experts);
                let mut v = vec![
                    t("dx", p.tokens * h, h),
                    t("d_router", h * e, e),
                    t("dw13", e * h * 2 * i, 2 * i),
                    t("dw2", e * i * h, h),
                ];
                if p.shared_expert {
                    v.push(t("d_shared_w13", h * 2 * i, 2 * i));
                    v.push(t("d_shared_w2", i * h, h));
                }
                v
            }
        }
    }

    /// Elements of the upstream gradient (the layer output's).
    pub fn d_out_len(&self) -> usize {
        match &self.layer {
            GradLayer::Attention(p) => p.q_elems(),
            GradLayer::Varlen(p) => p.total_q() * p.heads_q * p.head_dim,
            GradLayer::Moe(p) => p.tokens * p.hidden,
        }
    }

    pub fn validate(&self) -> flashmoe::Result<()> {
        let invalid = |m: String| Err(flashmoe::Error::invalid(m));
        if self.pass == Pass::Fwd {
            return invalid("a gradient config needs pass bwd or fwd+bwd".into());
        }
        if !(self.d_aux.is_finite() && self.d_z.is_finite()) {
            return invalid(format!(
                "d_aux {} and d_z {} must be finite",
                self.d_aux, self.d_z
            ));
        }
        if (self.trains_losses() || self.router != RouterShape::Random)
            && !matches!(self.layer, GradLayer::Moe(_))
        {
            return invalid("d_aux / d_z / router are MoE settings".into());
        }
        self.layer.forward().workload().validate()
    }

    /// FLOPs of the backward alone (module docs).
    pub fn backward_flops(&self) -> f64 {
        let fwd = self.layer.forward().workload().flops();
        match &self.layer {
            GradLayer::Attention(_) | GradLayer::Varlen(_) => 2.5 * fwd,
            GradLayer::Moe(_) => 2.0 * fwd,
        }
    }

    /// FLOPs of the timed call (module docs).
    pub fn flops(&self) -> f64 {
        let forward = if self.pass.includes_forward() {
            self.layer.forward().workload().flops()
        } else {
            0.0
        };
        self.backward_flops() + forward
    }

    /// Bytes the backward must move at least: the forward's inputs and output and d_out
    /// read once, every gradient written once (16-bit elements; attention also reads its
    /// f32 LSE).
    pub fn min_bytes(&self) -> f64 {
        let e = self.dtype().size_bytes() as f64;
        let grads: usize = self.tensors().iter().map(|t| t.len).sum();
        let lse = match &self.layer {
            GradLayer::Attention(p) => p.lse_elems() * 4,
            GradLayer::Varlen(p) => p.total_q() * p.heads_q * 4,
            GradLayer::Moe(_) => 0,
        };
        // Inputs = the gradients' shapes; the output and d_out = d_out's shape, twice.
        (grads + 2 * self.d_out_len()) as f64 * e + lse as f64
    }

    pub fn id(&self) -> String {
        let mut s = format!(
            "{}_{}",
            self.layer.forward().id(),
            match self.pass {
                Pass::Fwd => "fwd",
                Pass::Bwd => "bwd",
                Pass::FwdBwd => "fwdbwd",
            }
        );
        if self.trains_losses() {
            s += &format!("_aux{}_z{}", self.d_aux, self.d_z);
        }
        if self.router != RouterShape::Random {
            s += &format!("_router-{:?}", self.router).to_lowercase();
        }
        s
    }
}

impl crate::workload::Workload for GradProblem {
    fn id(&self) -> String {
        GradProblem::id(self)
    }
    fn label(&self) -> String {
        self.to_string()
    }
    fn x_value(&self) -> f64 {
        self.layer.forward().x_value()
    }
    fn x_label(&self) -> &'static str {
        self.layer.forward().x_label()
    }
    /// The forward's panel and the pass: a backward sweep is one panel of its own.
    fn panel(&self) -> String {
        format!("{} {}", self.layer.forward().panel(), self.pass)
    }
    fn dtype(&self) -> DType {
        GradProblem::dtype(self)
    }
    fn flops(&self) -> f64 {
        GradProblem::flops(self)
    }
    fn validate(&self) -> flashmoe::Result<()> {
        GradProblem::validate(self)
    }
    /// The first gradient's (dq: the head dim; MoE dx: the hidden dim); the gradient gate
    /// takes every tensor's own (`crate::grad::gate`).
    fn gate_row_len(&self) -> usize {
        self.tensors().first().map_or(0, |t| t.row_len)
    }
}

impl fmt::Display for GradProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]", self.layer.forward().label(), self.pass)?;
        if self.trains_losses() {
            write!(f, " d_aux {} d_z {}", self.d_aux, self.d_z)?;
        }
        if self.router != RouterShape::Random {
            write!(f, " router {:?}", self.router)?;
        }
        Ok(())
    }
}

impl GradInputs {
    /// The upstream gradient for `p`, beside the forward's inputs (`forward`, generated by
    /// the caller from `p.layer.forward()` with the same seed; the MoE router is reshaped
    /// by `p.router` here).
    pub fn generate(p: &GradProblem, mut forward: SuiteInputs, seed: u64) -> GradInputs {
        let id = match p.layer {
            GradLayer::Moe(_) => TensorId::MoeDOut,
            GradLayer::Attention(_) | GradLayer::Varlen(_) => TensorId::DOut,
        };
        if let (SuiteInputs::Moe(x), GradLayer::Moe(m)) = (&mut forward, &p.layer) {
            p.router.apply(&mut x.router, m.experts, m.dtype);
        }
        GradInputs {
            forward,
            d_out: generate(seed, id, p.d_out_len(), 1.0, p.dtype()),
        }
    }
}

/// Host bytes of the inputs, the f64 reference gradients and a few f32 copies, given the
/// forward problem's (`forward_bytes`).
pub fn host_bytes_needed(p: &GradProblem, forward_bytes: u64) -> u64 {
    let grads: usize = p.tensors().iter().map(|t| t.len).sum();
    forward_bytes + (p.d_out_len() * 4 + grads * 20) as u64
}

/// The f64 reference gradients, in [`GradProblem::tensors`] order.
pub fn reference_f64(p: &GradProblem, x: &GradInputs) -> anyhow::Result<Vec<RefTensor>> {
    let named = |names: &[TensorShape], values: Vec<Vec<f64>>| {
        names
            .iter()
            .zip(values)
            .map(|(t, values)| RefTensor {
                name: t.name.to_string(),
                values,
                select: None,
            })
            .collect()
    };
    let shapes = p.tensors();
    Ok(match &p.layer {
        GradLayer::Attention(a) => {
            let g = attention_backward_f64(a, x.attention()?, &x.d_out)?;
            named(&shapes, vec![g.dq, g.dk, g.dv])
        }
        GradLayer::Varlen(v) => {
            let g =
                attention_f32::varlen_per_sequence(v, x.attention()?, &x.d_out, |_, s, xs, d| {
                    let g = attention_backward_f64(s, xs, d)?;
                    Ok([g.dq, g.dk, g.dv])
                })?;
            named(&shapes, g.into())
        }
        GradLayer::Moe(m) => {
            let g = moe_backward_f64(m, x.moe()?, &x.d_out, p.d_aux, p.d_z)?;
            let mut v = vec![g.dx, g.d_router, g.dw13, g.dw2];
            if let (Some(a), Some(b)) = (g.d_shared_w13, g.d_shared_w2) {
                v.push(a);
                v.push(b);
            }
            named(&shapes, v)
        }
    })
}

/// Gate each gradient of the reference against the output of the same name with
/// `accuracy::check_gradient` (row lengths from [`GradProblem::tensors`]): one result per
/// reference gradient, in its order; a missing or mis-sized output fails with the reason.
pub fn gate_each(
    p: &GradProblem,
    outputs: &[GradTensor],
    reference: &[RefTensor],
    reference_name: &str,
) -> Vec<(String, AccuracyResult)> {
    let dtype = p.dtype();
    let shapes = p.tensors();
    let failed = |why: String| AccuracyResult {
        max_abs: f64::NAN,
        mean_abs: f64::NAN,
        max_rel: f64::NAN,
        rel_l2: f64::NAN,
        non_finite: 0,
        tolerance_rel_l2: accuracy::gradient_tolerance(dtype).rel_l2,
        max_row_rel_l2: None,
        worst_row: None,
        tolerance_row_rel_l2: None,
        passed: false,
        reference: reference_name.to_string(),
        note: Some(why),
    };
    reference
        .iter()
        .map(|r| {
            let shape = shapes.iter().find(|s| s.name == r.name);
            let row_len = shape.map_or(0, |s| s.row_len);
            let Some(out) = outputs.iter().find(|o| o.name == r.name) else {
                return (r.name.clone(), failed(format!("{}: not produced", r.name)));
            };
            if let (Some(_), Some(full)) = (&r.select, shape) {
                if out.values.len() != full.len {
                    return (
                        r.name.clone(),
                        failed(format!(
                            "{}: {} values, expected {}",
                            r.name,
                            out.values.len(),
                            full.len
                        )),
                    );
                }
            }
            let c = accuracy::check_gradient(&r.pick(&out.values), &r.values, dtype, row_len);
            let note = c.reason.as_ref().map(|why| format!("{}: {why}", r.name));
            let res = AccuracyResult::from_check(&c, reference_name, note);
            (r.name.clone(), res)
        })
        .collect()
}

/// [`gate_each`] folded into one result: the worst gradient's metrics (largest ratio of
/// rel-L2 or worst row to its tolerance; a NaN or non-finite output ranks worst), a note
/// with every gradient's rel-L2 and worst row and every failure; it passes only when every
/// gradient does (and the reference has some).
pub fn gate(
    p: &GradProblem,
    outputs: &[GradTensor],
    reference: &[RefTensor],
    reference_name: &str,
) -> AccuracyResult {
    let each = gate_each(p, outputs, reference, reference_name);
    let ratio = |a: &AccuracyResult| {
        let r = (a.rel_l2 / a.tolerance_rel_l2)
            .max(a.max_row_rel_l2.unwrap_or(0.0) / a.tolerance_row_rel_l2.unwrap_or(f64::INFINITY));
        if r.is_nan() || a.non_finite > 0 {
            f64::INFINITY
        } else {
            r
        }
    };
    let mut notes = Vec::new();
    let mut failures = Vec::new();
    let mut worst: Option<&AccuracyResult> = None;
    for (name, a) in &each {
        if a.rel_l2.is_finite() {
            notes.push(format!(
                "{name} rel-L2 {:.2e} worst row {:.2e}",
                a.rel_l2,
                a.max_row_rel_l2.unwrap_or(0.0)
            ));
        }
        if !a.passed {
            failures.push(a.note.clone().unwrap_or_else(|| format!("{name}: failed")));
        }
        if worst.is_none_or(|w| ratio(a) > ratio(w)) {
            worst = Some(a);
        }
    }
    if reference.is_empty() {
        failures.push("the reference has no gradients".into());
    }
    let mut res = worst.cloned().unwrap_or_else(|| AccuracyResult {
        max_abs: f64::NAN,
        mean_abs: f64::NAN,
        max_rel: f64::NAN,
        rel_l2: f64::NAN,
        non_finite: 0,
        tolerance_rel_l2: accuracy::gradient_tolerance(p.dtype()).rel_l2,
        max_row_rel_l2: None,
        worst_row: None,
        tolerance_row_rel_l2: None,
        passed: false,
        reference: reference_name.to_string(),
        note: None,
    });
    res.passed = failures.is_empty();
    notes.extend(failures);
    res.note = Some(notes.join("; "));
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashmoe::{AttentionProblem, MoeProblem};

    fn attention() -> GradProblem {
        let mut a = AttentionProblem::new(1, 4, 17, 32, true, DType::Bf16);
        a.heads_kv = 2;
        a.seqlen_k = 23;
        GradProblem::new(Pass::Bwd, GradLayer::Attention(a))
    }

    #[test]
    fn flops_follow_the_conventions() {
        let mut p = attention();
        let GradLayer::Attention(a) = &p.layer else {
            unreachable!()
        };
        let fwd = a.flops();
        assert_eq!(p.flops(), 2.5 * fwd);
        p.pass = Pass::FwdBwd;
        assert_eq!(p.flops(), 3.5 * fwd);
        let m = MoeProblem {
            tokens: 8,
            hidden: 16,
            intermediate: 8,
            experts: 4,
            top_k: 2,
            scoring: flashmoe::Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        };
        let mut g = GradProblem::new(Pass::Bwd, GradLayer::Moe(m.clone()));
        assert_eq!(g.flops(), 2.0 * m.flops());
        g.pass = Pass::FwdBwd;
        assert_eq!(g.flops(), 3.0 * m.flops());
    }

    #[test]
    fn serde_and_ids_round_trip() {
        let mut p = attention();
        p.pass = Pass::FwdBwd;
        let spec = ProblemSpec::Grad(p.clone());
        let json = serde_json::to_string(&spec).unwrap();
        assert!(json.contains("\"kind\":\"grad\"") && json.contains("\"pass\":\"fwd+bwd\""));
        assert!(json.contains("\"layer\":{\"kind\":\"attention\""), "{json}");
        let back: ProblemSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, spec);
        assert!(p.id().ends_with("_fwdbwd"), "{}", p.id());
        assert!(p.to_string().ends_with("[fwd+bwd]"), "{p}");
        assert!("sideways".parse::<Pass>().is_err());
        assert_eq!("fwd+bwd".parse::<Pass>().unwrap(), Pass::FwdBwd);
    }

    #[test]
    fn invalid_problems_are_named() {
        let mut p = attention();
        p.pass = Pass::Fwd;
        assert!(p.validate().unwrap_err().to_string().contains("bwd"));
        let mut p = attention();
        p.d_aux = 0.1;
        assert!(p.validate().unwrap_err().to_string().contains("MoE"));
        let mut p = attention();
        p.router = RouterShape::Tied;
        assert!(p.validate().is_err());
    }

    /// The gate: the reference passes against itself; a NaN, a missing gradient, a wrong
    /// row or a scaled tensor fail and are named.
    #[test]
    fn gate_fails_nan_missing_and_wrong_rows() {
        let p = attention();
        let x = GradInputs::generate(&p, SuiteInputs::generate(&p.layer.forward(), 3), 3);
        assert_eq!(x.d_out.len(), p.d_out_len());
        let r = reference_f64(&p, &x).unwrap();
        let exact: Vec<GradTensor> = r.iter().map(GradTensor::from).collect();
        let ok = gate(&p, &exact, &r, "cpu-f64");
        assert!(ok.passed, "{:?}", ok.note);
        let mut nan = exact.clone();
        nan[1].values[5] = f32::NAN;
        let g = gate(&p, &nan, &r, "cpu-f64");
        assert!(!g.passed && g.non_finite == 1, "{g:?}");
        assert!(g.note.unwrap().contains("dk: "));
        let g = gate(&p, &exact[..2], &r, "cpu-f64");
        assert!(!g.passed && g.note.unwrap().contains("dv: not produced"));
        // One wrong row of dq (64 rows of D = 32): the global rel-L2 may stay small, the
        // row bound does not.
        let mut row = exact.clone();
        for v in &mut row[0].values[32 * 20..32 * 21] {
            *v = -*v * 3.0;
        }
        let g = gate(&p, &row, &r, "cpu-f64");
        assert!(!g.passed && g.worst_row == Some(20), "{g:?}");
    }
}
