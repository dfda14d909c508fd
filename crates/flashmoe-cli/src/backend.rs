//! Where the work runs: the GPU when one is usable, otherwise the CPU implementations.
//! Decides the implementations, the reference, the timer settings and the manifest.

use flashmoe::gpu::DeviceInfo;
use flashmoe_bench::attention::gpu::{GpuAttention, GpuAttentionKernel};
use flashmoe_bench::config::Suite;
use flashmoe_bench::decode::gpu::GpuDecode;
use flashmoe_bench::grad::cpu::GradCpu;
use flashmoe_bench::grad::gpu::GpuGrad;
use flashmoe_bench::grad::GradReference;
use flashmoe_bench::manifest::{GpuManifest, Manifest};
use flashmoe_bench::mla::gpu::GpuMla;
use flashmoe_bench::moe::gpu::{GpuMoe, GpuMoeReference};
use flashmoe_bench::results::{Ceilings, MeasureSettings};
use flashmoe_bench::runner::calibration::{Calibration, CpuCalibration};
use flashmoe_bench::runner::cpu::{CpuImplementation, CpuReference};
use flashmoe_bench::runner::gpu::{GpuCopyCalibration, GpuReferenceProvider, GpuSession};
use flashmoe_bench::runner::python::{self, WorkerOptions};
use flashmoe_bench::runner::{Implementation, ReferenceProvider};
use flashmoe_bench::varlen::gpu::{GpuVarlen, GpuVarlenDense};
use std::path::Path;
use std::rc::Rc;

/// Problems (attention or MoE) up to this many model FLOPs are checked against the CPU
/// f64 reference; larger ones against the GPU fp32 reference kernels.
const CPU_REFERENCE_MAX_FLOPS: f64 = 5e9;

/// The implementations and policies for one run.
pub struct Lab {
    pub session: Option<Rc<GpuSession>>,
    pub implementations: Vec<Box<dyn Implementation>>,
    pub reference: Box<dyn ReferenceProvider>,
    pub default_candidate: String,
    pub settings: MeasureSettings,
    pub manifest: Manifest,
    /// The fixed workload timed next to the implementations (for `compare`'s ENV-DRIFT).
    pub calibration: Box<dyn Calibration>,
}

impl Lab {
    pub fn on_gpu(&self) -> bool {
        self.session.is_some()
    }
}

/// One observation of clocks, temperature, power and throttle reasons (nvidia-smi), if
/// the tool is there.
pub fn clock_observation(when: &str) -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active",
            "--format=csv,noheader",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()?
        .trim()
        .to_string();
    Some(format!(
        "{when}: sm clock, mem clock, temp, power, throttle reasons = {line}"
    ))
}

fn gpu_manifest(info: &DeviceInfo) -> GpuManifest {
    GpuManifest {
        name: info.name.clone(),
        compute_capability: format!(
            "{}.{}",
            info.compute_capability.0, info.compute_capability.1
        ),
        sm_count: info.sm_count,
        memory_bytes: info.total_memory_bytes,
        l2_bytes: info.l2_cache_bytes,
        max_sm_clock_mhz: info.max_sm_clock_mhz,
        max_mem_clock_mhz: info.memory_clock_mhz,
        driver_version: info.driver_version.clone(),
        nvrtc_version: info
            .nvrtc_version
            .clone()
            .unwrap_or_else(|| "not found".into()),
        clock_observations: clock_observation("start").into_iter().collect(),
    }
}

/// Host manifest plus the GPU fields when a GPU is visible.
pub fn manifest_with_gpu() -> Manifest {
    let mut m = Manifest::collect();
    if let Ok(info) = flashmoe::gpu::probe() {
        m.gpu = Some(gpu_manifest(&info));
    }
    m
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

fn gpu_settings(seed: u64, flush_bytes: usize) -> MeasureSettings {
    MeasureSettings {
        warmup_ms: 100.0,
        target_rel_ci: 0.01,
        min_samples: 20,
        max_samples: 1000,
        max_time_ms: 3_000.0,
        seed,
        cache_policy: format!(
            "L2 flush: memset of {:.0} MB queued before every start event",
            flush_bytes as f64 / 1e6
        ),
        timer: "CUDA events (GPU busy with the flush when the start event is recorded)".into(),
        ..MeasureSettings::default()
    }
}

/// The CPU lab: the f64 reference and the tiled f32 algorithm (attention) or the grouped
/// f32 algorithm (MoE); decode: the paged f64 reference and the tiled algorithm on the
/// dense cache; varlen: both attention algorithms sequence by sequence; MLA: the library's
/// f64 reference and the key-blocked f64 computation (in the tiled slot).
pub fn cpu_lab(suite: Suite, seed: u64) -> Lab {
    let implementations: Vec<Box<dyn Implementation>> = match suite {
        Suite::Attention | Suite::Decode | Suite::Varlen | Suite::Mla => vec![
            Box::new(CpuImplementation::reference()),
            Box::new(CpuImplementation::tiled()),
        ],
        Suite::Moe => vec![
            Box::new(CpuImplementation::reference()),
            Box::new(CpuImplementation::grouped()),
        ],
    };
    let default_candidate = match suite {
        Suite::Attention | Suite::Decode | Suite::Varlen | Suite::Mla => "cpu-tiled",
        Suite::Moe => "cpu-grouped",
    };
    Lab {
        session: None,
        implementations,
        reference: Box::new(CpuReference),
        default_candidate: default_candidate.into(),
        settings: cpu_settings(seed),
        manifest: Manifest::collect(),
        calibration: Box::new(CpuCalibration::default()),
    }
}

/// Add the Python baselines (PyTorch SDPA backends, FlexAttention, naive...) to a GPU lab,
/// or say in one line why there are none.
fn add_baselines(lab: &mut Lab, suite: Suite, python: &Path, seed: u64) {
    let Some(session) = &lab.session else { return };
    let mut options = WorkerOptions::new(python);
    options.flush_bytes = Some(session.flush_bytes() as u64);
    match python::baselines_with(suite, options, seed) {
        Ok((implementations, manifest)) => {
            eprintln!(
                "baselines: torch {} (CUDA {}, cuDNN {}, Triton {}) via {}",
                manifest.torch,
                manifest.cuda,
                manifest.cudnn,
                manifest.triton,
                python.display()
            );
            if !manifest.packages.is_empty() {
                eprintln!("baseline packages: {}", manifest.packages.join(", "));
            }
            for why in &manifest.skipped {
                eprintln!("baseline not run: {why}");
            }
            lab.implementations.extend(implementations);
            lab.manifest.python = Some(manifest);
        }
        Err(why) => eprintln!("no PyTorch baselines: {why} (our own results are still reported)"),
    }
}

fn gpu_lab(suite: Suite, seed: u64, session: Rc<GpuSession>, for_check: bool) -> Lab {
    let mut implementations: Vec<Box<dyn Implementation>> = Vec::new();
    // On Hopper the sm_90a kernel is the candidate; v1 stays in the lab as the portable
    // path (and as the fallback for shapes the sm_90a kernel does not serve).
    let hopper = session.device.arch() == 90;
    if hopper {
        implementations.push(Box::new(GpuAttention {
            kernel: GpuAttentionKernel::Sm90,
            session: session.clone(),
        }));
    }
    implementations.push(Box::new(GpuAttention {
        kernel: GpuAttentionKernel::V1,
        session: session.clone(),
    }));
    if for_check {
        implementations.push(Box::new(GpuAttention {
            kernel: GpuAttentionKernel::Reference,
            session: session.clone(),
        }));
    }
    let mut manifest = Manifest::collect();
    manifest.gpu = Some(gpu_manifest(session.device.info()));
    let _ = suite;
    Lab {
        implementations,
        reference: Box::new(GpuReferenceProvider {
            session: session.clone(),
            cpu_max_flops: CPU_REFERENCE_MAX_FLOPS,
        }),
        default_candidate: if hopper {
            "flashmoe-sm90"
        } else {
            "flashmoe-v1"
        }
        .into(),
        settings: gpu_settings(seed, session.flush_bytes()),
        manifest,
        calibration: Box::new(GpuCopyCalibration {
            session: session.clone(),
        }),
        session: Some(session),
    }
}

/// Pick the lab: the GPU unless `force_cpu` or none is usable (then one line says why).
/// `python`: the interpreter for the baseline worker (bench on a GPU only); `None` skips
/// the baselines.
pub fn select(
    suite: Suite,
    force_cpu: bool,
    seed: u64,
    for_check: bool,
    python: Option<&Path>,
) -> Lab {
    if force_cpu {
        eprintln!("CPU mode (--cpu): running the CPU implementations.");
        return cpu_lab(suite, seed);
    }
    match GpuSession::open(0) {
        Ok(session) if suite == Suite::Moe => {
            let mut lab = gpu_lab(suite, seed, session.clone(), for_check);
            lab.implementations = vec![Box::new(GpuMoe {
                session: session.clone(),
            })];
            if for_check {
                lab.implementations
                    .push(Box::new(GpuMoeReference { session }));
            }
            lab.default_candidate = "flashmoe-moe".into();
            if let Some(python) = python {
                add_baselines(&mut lab, suite, python, seed);
            }
            lab
        }
        Ok(session) if suite == Suite::Decode => {
            let mut lab = gpu_lab(suite, seed, session.clone(), for_check);
            lab.implementations = vec![Box::new(GpuDecode { session })];
            lab.default_candidate = "flashmoe-decode".into();
            if let Some(python) = python {
                add_baselines(&mut lab, suite, python, seed);
            }
            lab
        }
        Ok(session) if suite == Suite::Mla => {
            let mut lab = gpu_lab(suite, seed, session.clone(), for_check);
            lab.implementations = vec![Box::new(GpuMla { session })];
            lab.default_candidate = "flashmoe-mla".into();
            if let Some(python) = python {
                add_baselines(&mut lab, suite, python, seed);
            }
            lab
        }
        // Varlen: the varlen plan (the candidate) and the dense kernel on the uniform
        // configs (the same tokens as a dense batch).
        Ok(session) if suite == Suite::Varlen => {
            let mut lab = gpu_lab(suite, seed, session.clone(), for_check);
            lab.implementations = vec![
                Box::new(GpuVarlen {
                    session: session.clone(),
                }),
                Box::new(GpuVarlenDense { session }),
            ];
            lab.default_candidate = "flashmoe-sm90".into();
            if let Some(python) = python {
                add_baselines(&mut lab, suite, python, seed);
            }
            lab
        }
        Ok(session) => {
            let info = session.device.info();
            eprintln!(
                "GPU: {} (sm_{}, {} SMs, driver CUDA {}, NVRTC {})",
                info.name,
                info.arch(),
                info.sm_count,
                info.driver_version,
                info.nvrtc_version.as_deref().unwrap_or("not found")
            );
            let mut lab = gpu_lab(suite, seed, session, for_check);
            if let Some(python) = python {
                add_baselines(&mut lab, suite, python, seed);
            }
            lab
        }
        Err(e) => {
            eprintln!("{e}: running the CPU implementations (reference vs tiled) instead.");
            cpu_lab(suite, seed)
        }
    }
}

/// Measure the GEMM and copy ceilings on the session's GPU (start of a bench run).
pub fn measure_ceilings(session: &GpuSession) -> anyhow::Result<Ceilings> {
    let gemm = flashmoe_bench::gpu::measure_gemm_ceiling_detailed(&session.device)?;
    let copy = flashmoe_bench::gpu::measure_copy_ceiling_detailed(&session.device)?;
    Ok(Ceilings {
        gemm_tflops: gemm.value,
        gemm_desc: gemm.description,
        copy_gbps: copy.value,
        hbm_peak_gbps: Some(session.device.info().theoretical_bandwidth_gbs()).filter(|&p| p > 0.0),
    })
}

/// The gradient lab of `--pass bwd|fwd+bwd` (`flashmoe_bench::grad`): on the CPU the f64
/// backward (the reference) and the f32 backward under test (`cpu-tiled` for attention and
/// varlen, `cpu-grouped` for MoE); on a GPU the plan-backed `flashmoe-grad` (for dense
/// attention also `flashmoe-grad-det`, the deterministic mode) and, given a
/// Python, the baselines that have a backward. The reference is the f64 backward on the
/// host ([`GradReference`]).
pub fn select_grad(suite: Suite, force_cpu: bool, seed: u64, python: Option<&Path>) -> Lab {
    let session = if force_cpu {
        eprintln!("CPU mode (--cpu): running the CPU backward implementations.");
        None
    } else {
        match GpuSession::open(0) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("{e}: running the CPU backward implementations instead.");
                None
            }
        }
    };
    let reference: Box<dyn ReferenceProvider> = Box::new(GradReference::default());
    match session {
        None => {
            let mut lab = cpu_lab(suite, seed);
            let under_test = if suite == Suite::Moe {
                GradCpu::grouped()
            } else {
                GradCpu::tiled()
            };
            lab.default_candidate = under_test.name().to_string();
            lab.implementations = vec![Box::new(GradCpu::reference()), Box::new(under_test)];
            lab.reference = reference;
            lab
        }
        Some(session) => {
            let mut lab = gpu_lab(suite, seed, session.clone(), false);
            lab.implementations = vec![Box::new(GpuGrad::fast(session.clone()))];
            if suite == Suite::Attention {
                lab.implementations
                    .push(Box::new(GpuGrad::deterministic(session)));
            }
            lab.default_candidate = "flashmoe-grad".into();
            lab.reference = reference;
            if let Some(python) = python {
                add_baselines(&mut lab, suite, python, seed);
            }
            lab
        }
    }
}
