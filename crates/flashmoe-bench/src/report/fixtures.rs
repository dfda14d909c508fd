//! Realistic, deterministic [`RunResults`] for tests of reports, `compare` and the CLI.
//!
//! Samples are synthetic (seeded Gaussian noise around plausible times); summaries and
//! comparisons are computed with [`crate::stats`] exactly as a run would. The numbers
//! are plausible, not measured: never print them as results.

use crate::manifest::{GpuManifest, Manifest, PythonManifest};
use crate::results::{
    AccuracyResult, Ceilings, ConfigResult, ImplResult, MeasureSettings, PairResult, ProblemSpec,
    RunResults, SCHEMA_VERSION,
};
use crate::stats::{self, Comparison, Summary, VerdictOptions};
use flashmoe::{AttentionProblem, DType, MoeProblem, Scoring};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `n` samples around `median_ms` with Gaussian relative noise of `rel_noise`
/// (0.01 = 1%), deterministic in `seed`. Values are clamped to stay positive.
pub fn noisy_samples(median_ms: f64, rel_noise: f64, n: usize, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            // Box-Muller.
            let u1: f64 = rng.gen::<f64>().max(1e-12);
            let u2: f64 = rng.gen();
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            (median_ms * (1.0 + rel_noise * z)).max(median_ms * 1e-3)
        })
        .collect()
}

/// Summary as the runner computes it (95%, 2000 resamples, fixed seed).
pub fn summary_of(samples: &[f64]) -> Summary {
    stats::summarize(samples, 0.95, 2000, 0x5eed)
}

/// Comparison of `candidate` against `baseline` with the default verdict options and
/// the given practical threshold.
pub fn comparison_of(baseline: &[f64], candidate: &[f64], threshold: f64) -> Comparison {
    let opts = VerdictOptions {
        threshold,
        ..VerdictOptions::default()
    };
    stats::compare_samples(baseline, candidate, &opts)
}

/// The problem's FLOPs and minimum bytes (MoE: every expert touched).
pub fn flops_bytes(p: &ProblemSpec) -> (f64, f64) {
    match p {
        ProblemSpec::Attention(a) => (a.flops(), a.min_bytes()),
        ProblemSpec::Moe(m) => (m.flops(), m.min_bytes(m.experts)),
        ProblemSpec::Decode(d) => (d.flops(), d.kv_bytes()),
        ProblemSpec::Varlen(v) => (v.flops(), v.min_bytes()),
        ProblemSpec::Mla(m) => (m.flops(), m.kv_bytes()),
        ProblemSpec::E2e(e) => (e.forward_flops(), 0.0),
        ProblemSpec::Grad(g) => (g.flops(), g.min_bytes()),
    }
}

/// An implementation result with summary and metrics derived from `samples`.
pub fn impl_from_samples(
    name: &str,
    backend: &str,
    samples: Vec<f64>,
    flops: f64,
    min_bytes: f64,
    ceilings: Option<&Ceilings>,
) -> ImplResult {
    let summary = (!samples.is_empty()).then(|| summary_of(&samples));
    let median = summary.as_ref().map(|s| s.median);
    let tflops = median.map(|m| flops / (m * 1e-3) / 1e12);
    ImplResult {
        name: name.to_string(),
        backend: backend.to_string(),
        samples_ms: samples,
        summary,
        tflops,
        gbps: median.map(|m| min_bytes / (m * 1e-3) / 1e9),
        pct_of_gemm_ceiling: ceilings.and_then(|c| tflops.map(|t| 100.0 * t / c.gemm_tflops)),
        pct_of_copy_ceiling: ceilings
            .and_then(|c| median.map(|m| 100.0 * min_bytes / (m * 1e-3) / 1e9 / c.copy_gbps)),
        router_ms: None,
        peak_extra_bytes: Some(1 << 20),
        accuracy: Some(AccuracyResult {
            max_abs: 1.5e-3,
            mean_abs: 2.0e-4,
            max_rel: 4.0e-3,
            rel_l2: 2.1e-3,
            non_finite: 0,
            tolerance_rel_l2: 1e-2,
            max_row_rel_l2: Some(4.2e-3),
            worst_row: Some(17),
            tolerance_row_rel_l2: Some(2e-2),
            passed: true,
            reference: "cpu-f64".to_string(),
            note: None,
        }),
        input_checksum: Some("sha256:0123abcd".to_string()),
        error: None,
        flags: Vec::new(),
        loss_curve: None,
        metrics: Default::default(),
    }
}

/// A config from raw samples per implementation; the candidate (if present) is compared
/// against every other implementation that has samples.
pub fn config_from_samples(
    problem: ProblemSpec,
    candidate: &str,
    impls: Vec<(&str, &str, Vec<f64>)>,
    ceilings: Option<&Ceilings>,
) -> ConfigResult {
    let (flops, min_bytes) = flops_bytes(&problem);
    let implementations: Vec<ImplResult> = impls
        .into_iter()
        .map(|(name, backend, s)| impl_from_samples(name, backend, s, flops, min_bytes, ceilings))
        .collect();
    let mut comparisons = Vec::new();
    if let Some(c) = implementations
        .iter()
        .find(|i| i.name == candidate && i.is_usable())
    {
        for b in implementations
            .iter()
            .filter(|i| i.name != candidate && i.is_usable())
        {
            comparisons.push(PairResult {
                candidate: c.name.clone(),
                baseline: b.name.clone(),
                comparison: comparison_of(&b.samples_ms, &c.samples_ms, 0.02),
            });
        }
    }
    ConfigResult {
        id: problem.id(),
        label: problem.label(),
        problem,
        flops,
        min_bytes,
        implementations,
        comparisons,
        error: None,
        routing: None,
        calibration: None,
        sampling: None,
    }
}

/// Fixed measurement settings.
pub fn settings(cpu: bool) -> MeasureSettings {
    MeasureSettings {
        warmup_ms: 200.0,
        target_rel_ci: 0.01,
        min_samples: 10,
        max_samples: 1000,
        max_time_ms: 5000.0,
        confidence: 0.95,
        bootstrap_resamples: 2000,
        seed: 0x5eed,
        threshold: 0.02,
        cache_policy: if cpu {
            "none (cpu)".to_string()
        } else {
            "l2-flush 100 MB".to_string()
        },
        timer: if cpu {
            "std::time::Instant".to_string()
        } else {
            "cuda events".to_string()
        },
        against_max_time_ms: None,
    }
}

/// A fixed manifest, with GPU and Python sections when `gpu`.
pub fn manifest(gpu: bool) -> Manifest {
    Manifest {
        flashmoe_version: "0.1.0".to_string(),
        timestamp_utc: "2025-01-02T03:04:05Z".to_string(),
        hostname: "fixture-host".to_string(),
        os: "Ubuntu 24.04 LTS (kernel 6.8.0)".to_string(),
        cpu_model: "AMD EPYC 9654 96-Core Processor".to_string(),
        cpu_cores: 16,
        rustc: "rustc 1.95.0".to_string(),
        git_commit: "0123456789abcdef0123456789abcdef01234567".to_string(),
        git_dirty: false,
        build_commit: "0123456789abcdef0123456789abcdef01234567".to_string(),
        command_line: "flashmoe bench --preset sweep".to_string(),
        kernel_overrides: Vec::new(),
        gpu: gpu.then(|| GpuManifest {
            name: "NVIDIA H100 80GB HBM3".to_string(),
            compute_capability: "9.0".to_string(),
            sm_count: 132,
            memory_bytes: 85_520_809_984,
            l2_bytes: 52_428_800,
            max_sm_clock_mhz: 1980,
            max_mem_clock_mhz: 2619,
            driver_version: "570.86.15".to_string(),
            nvrtc_version: "12.8".to_string(),
            clock_observations: vec!["sm clock 1980 MHz, no throttle reasons".to_string()],
        }),
        python: gpu.then(|| PythonManifest {
            python: "3.12.3".to_string(),
            torch: "2.6.0+cu126".to_string(),
            cuda: "12.6".to_string(),
            cudnn: "90501".to_string(),
            triton: "3.2.0".to_string(),
            gpu_name: "NVIDIA H100 80GB HBM3".to_string(),
            packages: vec!["flash-attn-4 4.0.0b36".to_string()],
            skipped: vec!["fa3: flash_attn_interface not importable".to_string()],
        }),
        topology: None,
    }
}

/// A run wrapping `configs`.
pub fn run_with(
    suite: &str,
    candidate: &str,
    configs: Vec<ConfigResult>,
    ceilings: Option<Ceilings>,
) -> RunResults {
    let gpu = ceilings.is_some();
    RunResults {
        schema_version: SCHEMA_VERSION,
        suite: suite.to_string(),
        source: "fixture".to_string(),
        manifest: manifest(gpu),
        settings: settings(!gpu),
        ceilings,
        candidate: candidate.to_string(),
        configs,
        interrupted: false,
    }
}

/// Measured-looking H100 ceilings.
pub fn h100_ceilings() -> Ceilings {
    Ceilings {
        gemm_tflops: 720.0,
        gemm_desc: "cuBLAS bf16 8192^3".to_string(),
        copy_gbps: 2900.0,
        hbm_peak_gbps: Some(3352.3),
    }
}

/// A GPU attention sweep: 3 configs (two sequence lengths non-causal, one causal) ×
/// 3 implementations (candidate `flashmoe`, `sdpa-flash`, `naive-torch`), with ceilings,
/// one implementation that is n/a on one config and one flagged outlier-heavy sample set.
pub fn gpu_attention_run() -> RunResults {
    let ceilings = h100_ceilings();
    let specs = [(1024usize, false, 0u64), (4096, false, 1), (4096, true, 2)];
    let mut configs = Vec::new();
    for (seqlen, causal, k) in specs {
        let p = AttentionProblem::new(16384 / seqlen, 16, seqlen, 128, causal, DType::Bf16);
        let spec = ProblemSpec::Attention(p.clone());
        // Times from plausible throughputs: 520, 470, 40 TFLOP/s.
        let t = |tf: f64| p.flops() / (tf * 1e12) * 1e3;
        let mut fast = noisy_samples(t(520.0), 0.01, 60, 10 + k);
        fast[7] *= 1.4; // a severe outlier, reported not dropped
        let mut impls = vec![
            ("flashmoe", "cuda", fast),
            (
                "sdpa-flash",
                "python",
                noisy_samples(t(470.0), 0.012, 60, 20 + k),
            ),
        ];
        if !causal {
            impls.push((
                "naive-torch",
                "python",
                noisy_samples(t(40.0), 0.02, 30, 30 + k),
            ));
        }
        let mut c = config_from_samples(spec, "flashmoe", impls, Some(&ceilings));
        if causal {
            c.implementations.push(ImplResult {
                error: Some("n/a: out of memory materialising the 4096×4096 scores".to_string()),
                ..ImplResult::new("naive-torch", "python")
            });
        }
        configs.push(c);
    }
    run_with("attention", "flashmoe", configs, Some(ceilings))
}

/// A GPU varlen run on the first configs of the `varlen` preset: the ragged target
/// (issue 22's 16 sequences) and the dense problem on the same tokens, D=128, causal and
/// not, × `flashmoe-sm90` (candidate), `flashmoe-sm90-dense` (uniform configs only, n/a on
/// the ragged ones), `torch-varlen` and `sdpa-cudnn-loop` (O checked only).
pub fn gpu_varlen_run() -> RunResults {
    let ceilings = h100_ceilings();
    let presets = crate::config::preset(crate::config::Suite::Varlen, "varlen", true)
        .expect("the varlen preset");
    let mut configs = Vec::new();
    for (k, spec) in presets.into_iter().take(6).enumerate() {
        let ProblemSpec::Varlen(p) = &spec else {
            unreachable!("varlen preset")
        };
        if p.head_dim != 128 {
            continue;
        }
        let t = |tf: f64| p.flops() / (tf * 1e12) * 1e3;
        let k = k as u64;
        let mut impls = vec![
            (
                "flashmoe-sm90",
                "cuda",
                noisy_samples(t(640.0), 0.01, 60, 70 + k),
            ),
            (
                "torch-varlen",
                "python",
                noisy_samples(t(340.0), 0.01, 60, 80 + k),
            ),
            (
                "sdpa-cudnn-loop",
                "python",
                noisy_samples(t(510.0), 0.02, 60, 90 + k),
            ),
        ];
        if p.is_uniform() {
            impls.push((
                "flashmoe-sm90-dense",
                "cuda",
                noisy_samples(t(650.0), 0.01, 60, 100 + k),
            ));
        }
        let uniform = p.is_uniform();
        let mut c = config_from_samples(spec, "flashmoe-sm90", impls, Some(&ceilings));
        if let Some(loop_row) = c
            .implementations
            .iter_mut()
            .find(|i| i.name == "sdpa-cudnn-loop")
        {
            loop_row.accuracy.as_mut().unwrap().note =
                Some("LSE not provided by this implementation: O checked only".to_string());
        }
        if !uniform {
            c.implementations.push(ImplResult {
                error: Some(
                    "n/a: the dense kernel runs only batches whose sequences all have the same \
                     lengths"
                        .to_string(),
                ),
                ..ImplResult::new("flashmoe-sm90-dense", "cuda")
            });
        }
        configs.push(c);
    }
    run_with("varlen", "flashmoe-sm90", configs, Some(ceilings))
}

/// A CPU MoE run (no ceilings, GFLOP/s throughputs): 2 configs × 2 implementations,
/// one of which fails the accuracy gate on the second config.
pub fn cpu_moe_run() -> RunResults {
    let mut configs = Vec::new();
    for (k, tokens) in [64usize, 256].into_iter().enumerate() {
        let p = MoeProblem {
            tokens,
            hidden: 256,
            intermediate: 512,
            experts: 8,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            dtype: DType::F32,
            shared_expert: false,
        };
        let t = |gf: f64| p.flops() / (gf * 1e9) * 1e3;
        let spec = ProblemSpec::Moe(p.clone());
        let mut c = config_from_samples(
            spec,
            "cpu-fused",
            vec![
                (
                    "cpu-fused",
                    "cpu",
                    noisy_samples(t(40.0), 0.02, 40, 40 + k as u64),
                ),
                (
                    "cpu-naive",
                    "cpu",
                    noisy_samples(t(12.0), 0.03, 40, 50 + k as u64),
                ),
            ],
            None,
        );
        // A skewed routing with one empty expert; the candidate timed its router.
        let counts = [
            tokens / 2,
            tokens / 4,
            tokens / 4,
            tokens / 2,
            tokens / 4,
            tokens / 4,
            0,
            0,
        ];
        c.routing = Some(crate::results::RoutingSummary::from_counts(
            &counts, 1.07, 0.52,
        ));
        c.implementations[0].router_ms = c.implementations[0].median_ms().map(|m| m * 0.05);
        if k == 1 {
            let naive = &mut c.implementations[1];
            let acc = naive.accuracy.as_mut().unwrap();
            acc.rel_l2 = 0.31;
            acc.passed = false;
            naive
                .flags
                .push("accuracy gate failed: not compared".to_string());
            c.comparisons.clear();
        }
        configs.push(c);
    }
    run_with("moe", "cpu-fused", configs, None)
}

/// `n` configs of a seqlen sweep over 2 panels (head dim 64/128) with 3 implementations;
/// for layout tests with many configs.
pub fn large_sweep_run(n: usize) -> RunResults {
    let ceilings = h100_ceilings();
    let configs = (0..n)
        .map(|i| {
            let seqlen = 256usize << (i % 7);
            let d = if (i / 7) % 2 == 0 { 64 } else { 128 };
            let p = AttentionProblem::new(2 + i / 14, 16, seqlen, d, false, DType::F16);
            let t = |tf: f64| p.flops() / (tf * 1e12) * 1e3;
            config_from_samples(
                ProblemSpec::Attention(p.clone()),
                "flashmoe",
                vec![
                    (
                        "flashmoe",
                        "cuda",
                        noisy_samples(t(400.0), 0.01, 20, 3 * i as u64),
                    ),
                    (
                        "sdpa-flash",
                        "python",
                        noisy_samples(t(380.0), 0.01, 20, 3 * i as u64 + 1),
                    ),
                    (
                        "sdpa-math",
                        "python",
                        noisy_samples(t(60.0), 0.01, 20, 3 * i as u64 + 2),
                    ),
                ],
                Some(&ceilings),
            )
        })
        .collect();
    run_with("attention", "flashmoe", configs, Some(ceilings))
}
