//! Calibration workloads: a fixed piece of work timed in every round of a config, next to
//! the implementations and with the same timer, so that `compare` of two separate runs can
//! divide out how much the machine itself moved between them (ENV-DRIFT, see
//! `crate::compare`). The workload never changes with the code under test: its name is
//! recorded, and two runs are corrected only when their names match.
//!
//! CPU: the tiled f32 attention algorithm on one fixed small problem (same threads, caches
//! and SIMD units as the CPU implementations, so it feels the same contention). The GPU
//! calibration (a fixed device copy) lives with the GPU runner.

use crate::measure::Sampled;
use flashmoe::reference::attention::AttentionInputs;
use flashmoe::reference::attention_tiled;
use flashmoe::{AttentionProblem, DType};
use std::time::Instant;

/// A fixed reference workload.
pub trait Calibration {
    /// What is measured, recorded in the results.
    fn workload(&self) -> String;
    /// Ready to be timed (buffers allocated, inputs generated).
    fn prepare(&self) -> anyhow::Result<Box<dyn Sampled + '_>>;
}

/// Seed of the calibration's inputs (fixed: the workload must not depend on the run).
const CALIBRATION_SEED: u64 = 0xca11b;

/// The CPU calibration: [`attention_tiled`](attention_tiled::attention_tiled) on
/// B = 2, H = 4, S = 256, D = 64, f32, non-causal (a few ms on one core).
pub struct CpuCalibration {
    problem: AttentionProblem,
}

impl Default for CpuCalibration {
    fn default() -> Self {
        CpuCalibration {
            problem: AttentionProblem::new(2, 4, 256, 64, false, DType::F32),
        }
    }
}

impl Calibration for CpuCalibration {
    fn workload(&self) -> String {
        format!("cpu-tiled attention {} (host clock)", self.problem)
    }
    fn prepare(&self) -> anyhow::Result<Box<dyn Sampled + '_>> {
        Ok(Box::new(CpuCalibrationRun {
            problem: &self.problem,
            inputs: AttentionInputs::generate(&self.problem, CALIBRATION_SEED),
        }))
    }
}

struct CpuCalibrationRun<'a> {
    problem: &'a AttentionProblem,
    inputs: AttentionInputs,
}

impl Sampled for CpuCalibrationRun<'_> {
    fn sample(&mut self) -> anyhow::Result<f64> {
        let t0 = Instant::now();
        let out = attention_tiled::attention_tiled(
            self.problem,
            &self.inputs,
            attention_tiled::DEFAULT_BLOCK_M,
            attention_tiled::DEFAULT_BLOCK_N,
        )?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(out);
        Ok(ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_calibration_times_a_fixed_workload() {
        let c = CpuCalibration::default();
        assert!(
            c.workload().contains("cpu-tiled attention"),
            "{}",
            c.workload()
        );
        let mut run = c.prepare().unwrap();
        let a = run.sample().unwrap();
        let b = run.sample().unwrap();
        assert!(a > 0.0 && b > 0.0 && a.is_finite() && b.is_finite());
    }
}
