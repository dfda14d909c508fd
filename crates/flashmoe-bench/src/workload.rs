//! What the lab's framework needs from each workload family's problem type, once: its
//! identity and label, where it sits on a plot, its element type, model FLOPs, validation
//! and the row length of the per-row correctness gate. [`crate::results::ProblemSpec`]
//! names the family; everything generic goes through [`ProblemSpec::workload`], so a new
//! family implements this trait instead of adding an arm to every match.

use crate::decode::DecodeProblem;
use crate::mla::MlaProblem;
use crate::results::ProblemSpec;
use crate::varlen::VarlenProblem;
use flashmoe::{AttentionProblem, DType, MoeProblem};

/// One family's problem, as the framework sees it.
pub trait Workload {
    /// Stable id (results files, `compare`).
    fn id(&self) -> String;
    /// Human-readable description.
    fn label(&self) -> String;
    /// The sweep axis of plots.
    fn x_value(&self) -> f64;
    fn x_label(&self) -> &'static str;
    /// Plot series key: configs sharing it form one panel.
    fn panel(&self) -> String;
    /// The element type of the inputs (checksums, tolerances).
    fn dtype(&self) -> DType;
    /// Model FLOPs.
    fn flops(&self) -> f64;
    fn validate(&self) -> flashmoe::Result<()>;
    /// Elements per output row of the per-row gate (`flashmoe::accuracy::check_rows`).
    fn gate_row_len(&self) -> usize;
}

fn causal_word(causal: bool) -> &'static str {
    if causal {
        "causal"
    } else {
        "non-causal"
    }
}

impl Workload for AttentionProblem {
    fn id(&self) -> String {
        AttentionProblem::id(self)
    }
    fn label(&self) -> String {
        self.to_string()
    }
    fn x_value(&self) -> f64 {
        self.seqlen_k as f64
    }
    fn x_label(&self) -> &'static str {
        "sequence length"
    }
    fn panel(&self) -> String {
        format!(
            "D={} {} {}",
            self.head_dim,
            causal_word(self.causal),
            self.dtype
        )
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn flops(&self) -> f64 {
        AttentionProblem::flops(self)
    }
    fn validate(&self) -> flashmoe::Result<()> {
        AttentionProblem::validate(self)
    }
    /// One query row of one head.
    fn gate_row_len(&self) -> usize {
        self.head_dim
    }
}

impl Workload for MoeProblem {
    fn id(&self) -> String {
        MoeProblem::id(self)
    }
    fn label(&self) -> String {
        self.to_string()
    }
    fn x_value(&self) -> f64 {
        self.tokens as f64
    }
    fn x_label(&self) -> &'static str {
        "tokens"
    }
    fn panel(&self) -> String {
        format!(
            "H={} I={} E={} k={} {}",
            self.hidden, self.intermediate, self.experts, self.top_k, self.dtype
        )
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn flops(&self) -> f64 {
        MoeProblem::flops(self)
    }
    fn validate(&self) -> flashmoe::Result<()> {
        MoeProblem::validate(self)
    }
    /// One token.
    fn gate_row_len(&self) -> usize {
        self.hidden
    }
}

impl Workload for DecodeProblem {
    fn id(&self) -> String {
        DecodeProblem::id(self)
    }
    fn label(&self) -> String {
        self.to_string()
    }
    fn x_value(&self) -> f64 {
        self.seqlen_k as f64
    }
    fn x_label(&self) -> &'static str {
        "cached keys per sequence"
    }
    fn panel(&self) -> String {
        format!(
            "decode D={} Sq={} Hq/Hkv={} page={} {}",
            self.head_dim,
            self.seqlen_q,
            self.heads_q / self.heads_kv.max(1),
            self.page_size,
            self.dtype
        )
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn flops(&self) -> f64 {
        DecodeProblem::flops(self)
    }
    fn validate(&self) -> flashmoe::Result<()> {
        DecodeProblem::validate(self)
    }
    fn gate_row_len(&self) -> usize {
        self.head_dim
    }
}

impl Workload for VarlenProblem {
    fn id(&self) -> String {
        VarlenProblem::id(self)
    }
    fn label(&self) -> String {
        self.to_string()
    }
    fn x_value(&self) -> f64 {
        self.total_q() as f64
    }
    fn x_label(&self) -> &'static str {
        "query tokens (packed)"
    }
    /// One panel per shape family (sequence count) and class: the neighbours of a config
    /// along the token axis are configs of the same kind of batch.
    fn panel(&self) -> String {
        format!(
            "varlen D={} Hq/Hkv={} {} {} {} seqs{}",
            self.head_dim,
            self.heads_q / self.heads_kv.max(1),
            causal_word(self.causal),
            self.dtype,
            self.batch(),
            if self.is_self_attention() {
                ""
            } else {
                " (Sk != Sq)"
            }
        )
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn flops(&self) -> f64 {
        VarlenProblem::flops(self)
    }
    fn validate(&self) -> flashmoe::Result<()> {
        VarlenProblem::validate(self)
    }
    fn gate_row_len(&self) -> usize {
        self.head_dim
    }
}

impl Workload for MlaProblem {
    fn id(&self) -> String {
        MlaProblem::id(self)
    }
    fn label(&self) -> String {
        self.to_string()
    }
    fn x_value(&self) -> f64 {
        self.seqlen_k as f64
    }
    fn x_label(&self) -> &'static str {
        "cached keys per sequence"
    }
    fn panel(&self) -> String {
        format!(
            "MLA Hq={} Sq={} page={} {}",
            self.heads_q, self.seqlen_q, self.page_size, self.dtype
        )
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn flops(&self) -> f64 {
        MlaProblem::flops(self)
    }
    fn validate(&self) -> flashmoe::Result<()> {
        MlaProblem::validate(self)
    }
    /// One query row of one head: the 512-wide value.
    fn gate_row_len(&self) -> usize {
        flashmoe::attention::mla::D_V
    }
}

impl ProblemSpec {
    /// The family's problem behind the framework's one interface.
    pub fn workload(&self) -> &dyn Workload {
        match self {
            ProblemSpec::Attention(p) => p,
            ProblemSpec::Moe(p) => p,
            ProblemSpec::Decode(p) => p,
            ProblemSpec::Varlen(p) => p,
            ProblemSpec::Mla(p) => p,
            ProblemSpec::Grad(p) => p,
            ProblemSpec::E2e(p) => p,
        }
    }
}
