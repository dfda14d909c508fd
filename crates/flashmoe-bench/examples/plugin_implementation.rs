//! An out-of-tree implementation in the lab (docs/plugins.md): a crate implements
//! [`flashmoe_bench::Implementation`] for its own kernel and hands it to the same pipeline
//! `flashmoe bench` uses, so it goes through the correctness gate against the f64
//! reference, the interleaved timing with the calibration, the statistics and the reports.
//!
//! The "kernel" here is a deliberately plain attention on the CPU (one query row at a time,
//! scores materialised per row), compared with the lab's tiled CPU algorithm:
//!
//! ```text
//! cargo run --release -p flashmoe-bench --example plugin_implementation -- [OUT_DIR]
//! ```

use flashmoe::reference::attention::AttentionInputs;
use flashmoe::AttentionProblem;
use flashmoe_bench::config::{self, Suite};
use flashmoe_bench::manifest::Manifest;
use flashmoe_bench::results::{MeasureSettings, ProblemSpec, RunResults, SCHEMA_VERSION};
use flashmoe_bench::runner::calibration::CpuCalibration;
use flashmoe_bench::runner::cpu::{CpuImplementation, CpuReference};
use flashmoe_bench::runner::pipeline::Pipeline;
use flashmoe_bench::{report, Implementation, Outputs, Prepared, Sampled, SuiteInputs};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

/// The user's implementation: a name, what it supports, and how to prepare it.
struct RowAttention;

impl Implementation for RowAttention {
    fn name(&self) -> &str {
        "my-row-attention"
    }
    fn backend(&self) -> &str {
        "cpu"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        match problem {
            ProblemSpec::Attention(_) => Ok(()),
            _ => Err("attention only".into()),
        }
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Attention(p), SuiteInputs::Attention(x)) = (problem, inputs) else {
            anyhow::bail!("not an attention problem");
        };
        Ok(Box::new(RowPrepared { p: p.clone(), x }))
    }
}

/// Bound to one config: the inputs are the lab's (same generator, checksummed).
struct RowPrepared<'a> {
    p: AttentionProblem,
    x: &'a AttentionInputs,
}

/// O [B, Sq, Hq, D] and LSE [B, Hq, Sq], f32, with bottom-right causal masking.
fn row_attention(p: &AttentionProblem, x: &AttentionInputs) -> (Vec<f32>, Vec<f32>) {
    let (b, hq, hkv, sq, sk, d) = (
        p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim,
    );
    let scale = p.scale();
    let mut o = vec![0f32; b * sq * hq * d];
    let mut lse = vec![0f32; b * hq * sq];
    let mut s = vec![0f32; sk];
    for bi in 0..b {
        for h in 0..hq {
            let hk = h / (hq / hkv);
            for i in 0..sq {
                let q = &x.q[((bi * sq + i) * hq + h) * d..][..d];
                let last = if p.causal { i + sk - sq } else { sk - 1 };
                let mut m = f32::NEG_INFINITY;
                for (j, sj) in s.iter_mut().enumerate().take(last + 1) {
                    let k = &x.k[((bi * sk + j) * hkv + hk) * d..][..d];
                    *sj = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                    m = m.max(*sj);
                }
                let mut l = 0f32;
                let out = &mut o[((bi * sq + i) * hq + h) * d..][..d];
                for (j, &sj) in s.iter().enumerate().take(last + 1) {
                    let w = (sj - m).exp();
                    l += w;
                    let v = &x.v[((bi * sk + j) * hkv + hk) * d..][..d];
                    out.iter_mut().zip(v).for_each(|(o, v)| *o += w * v);
                }
                out.iter_mut().for_each(|o| *o /= l);
                lse[(bi * hq + h) * sq + i] = m + l.ln();
            }
        }
    }
    (o, lse)
}

impl Sampled for RowPrepared<'_> {
    /// One timed call, host clock (a GPU implementation would use CUDA events).
    fn sample(&mut self) -> anyhow::Result<f64> {
        let t0 = Instant::now();
        let out = row_attention(&self.p, self.x);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(out);
        Ok(ms)
    }
}

impl Prepared for RowPrepared<'_> {
    fn run_for_check(&mut self) -> anyhow::Result<Outputs> {
        let (o, lse) = row_attention(&self.p, self.x);
        Ok(Outputs::Attention { o, lse })
    }
}

fn main() -> anyhow::Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "out-plugin".into());
    let mine = RowAttention;
    let tiled = CpuImplementation::tiled();
    let calibration = CpuCalibration::default();
    let settings = MeasureSettings {
        max_time_ms: 1_500.0,
        cache_policy: "none (CPU)".into(),
        timer: "host monotonic clock".into(),
        ..MeasureSettings::default()
    };
    // Registering the implementation = listing it with the built-in ones.
    let pipeline = Pipeline {
        implementations: vec![&mine, &tiled],
        reference: &CpuReference,
        candidate: mine.name().into(),
        settings: settings.clone(),
        ceilings: None,
        calibration: Some(&calibration),
    };
    let mut results = RunResults {
        schema_version: SCHEMA_VERSION,
        suite: "attention".into(),
        source: "example plugin_implementation (preset quick, CPU)".into(),
        manifest: Manifest::collect(),
        settings,
        ceilings: None,
        candidate: mine.name().into(),
        configs: Vec::new(),
        interrupted: false,
    };
    let cancel = AtomicBool::new(false);
    for problem in config::preset(Suite::Attention, "quick", false)? {
        if let Some(r) = pipeline.run_config(&problem, &cancel, |_| {}) {
            results.configs.push(r);
        }
    }
    println!("{}", report::terminal_table(&results));
    for path in report::write_all(&results, std::path::Path::new(&out))? {
        println!("wrote {}", path.display());
    }
    let passed = results
        .configs
        .iter()
        .flat_map(|c| &c.implementations)
        .filter(|i| i.name == mine.name())
        .all(|i| i.accuracy.as_ref().is_some_and(|a| a.passed));
    anyhow::ensure!(passed, "{} failed the correctness gate", mine.name());
    Ok(())
}
