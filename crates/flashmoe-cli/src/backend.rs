//! Where the work runs: the GPU when one is usable, otherwise the CPU implementations.
//! Decides the implementations, the reference, the timer settings and the manifest.

use flashmoe_bench::config::Suite;
use flashmoe_bench::manifest::Manifest;
use flashmoe_bench::results::{Ceilings, MeasureSettings};
use flashmoe_bench::runner::cpu::{CpuImplementation, CpuReference};
use flashmoe_bench::runner::{Implementation, ReferenceProvider};

/// The implementations and policies for one run.
pub struct Lab {
    pub on_gpu: bool,
    pub implementations: Vec<Box<dyn Implementation>>,
    pub reference: Box<dyn ReferenceProvider>,
    pub default_candidate: String,
    pub settings: MeasureSettings,
    pub ceilings: Option<Ceilings>,
    pub manifest: Manifest,
}

/// Host manifest plus the GPU fields when a GPU is visible.
pub fn manifest_with_gpu() -> Manifest {
    Manifest::collect()
}

fn cpu_settings(seed: u64) -> MeasureSettings {
    MeasureSettings {
        warmup_ms: 150.0,
        target_rel_ci: 0.01,
        min_samples: 10,
        max_samples: 200,
        max_time_ms: 4_000.0,
        seed,
        cache_policy: "none (CPU: inputs stay in host memory)".into(),
        timer: "host monotonic clock".into(),
        ..MeasureSettings::default()
    }
}

/// The CPU lab: the f64 reference and the tiled f32 algorithm.
pub fn cpu_lab(suite: Suite, seed: u64) -> Lab {
    let implementations: Vec<Box<dyn Implementation>> = match suite {
        Suite::Attention => vec![
            Box::new(CpuImplementation::reference()),
            Box::new(CpuImplementation::tiled()),
        ],
        Suite::Moe => vec![
            Box::new(CpuImplementation::reference()),
            Box::new(CpuImplementation::grouped()),
        ],
    };
    let default_candidate = match suite {
        Suite::Attention => "cpu-tiled",
        Suite::Moe => "cpu-grouped",
    };
    Lab {
        on_gpu: false,
        implementations,
        reference: Box::new(CpuReference),
        default_candidate: default_candidate.into(),
        settings: cpu_settings(seed),
        ceilings: None,
        manifest: Manifest::collect(),
    }
}

/// Pick the lab: the GPU unless `force_cpu` or none is usable (then one line says why).
pub fn select(suite: Suite, force_cpu: bool, seed: u64) -> Lab {
    if force_cpu {
        eprintln!("CPU mode (--cpu): running the CPU implementations.");
    } else {
        eprintln!(
            "No GPU support in this build path yet: running the CPU implementations (reference vs tiled)."
        );
    }
    cpu_lab(suite, seed)
}
