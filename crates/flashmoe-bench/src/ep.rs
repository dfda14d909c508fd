//! One rank of the expert-parallel benchmark (`flashmoe bench moe --gpus N` starts N of
//! these, one process per GPU, and gathers their JSON): correctness of the
//! expert-parallel layer against the single-GPU layer on the same GPU and tokens, the
//! layer's time against the single-GPU layer's (weak scaling: every rank keeps
//! `tokens` tokens), and the all-to-all alone with its bandwidth.

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result as dr, sys, CudaSlice, DevicePtr};
use flashmoe::gpu::{Device, RawStream, RawTensor};
use flashmoe::inputs::{stream_key, TensorId};
use flashmoe::moe::ep::{Communicator, ExpertParallelMoe, ExpertPlacement, NcclId};
use flashmoe::moe::forward::plan::{MoeArgs, MoeClass, MoePlan, RawU32, RoutingArgs};
use flashmoe::{DType, Scoring};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Test knob: `RANK:exit` or `RANK:hang` makes that rank exit or stop responding just
/// before its first expert-parallel call, to show the others fail with an error in time.
pub const FAULT_ENV: &str = "FLASHMOE_EP_FAULT";

/// What a rank runs (the launcher passes the same to every rank but `rank`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpRankOptions {
    pub rank: usize,
    pub world: usize,
    /// Directory where rank 0 publishes the NCCL unique id.
    pub rendezvous: PathBuf,
    pub preset: String,
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    /// Tokens per rank, one config each.
    pub tokens: Vec<usize>,
    pub chunks: usize,
    pub seed: u64,
    /// Timed rounds (each: one single-GPU call, then one expert-parallel call).
    pub rounds: usize,
    pub timeout_s: f64,
    /// NCCL's maxCTAs (None: NCCL's default).
    #[serde(default)]
    pub comm_ctas: Option<u32>,
}

/// Correctness of one config on one rank: the expert-parallel layer against the
/// single-GPU layer (same GPU, same tokens and weights).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpCorrectness {
    pub out_elems: usize,
    /// Output elements whose bits differ.
    pub out_mismatched: usize,
    pub out_max_abs_diff: f64,
    pub out_finite: bool,
    /// Non-finite values in either output; mean |Δ|, max |Δ| / max(|ref|, 1e-3·max|ref|)
    /// and ‖Δ‖/‖ref‖ against the single-GPU output (0 when bit-identical).
    #[serde(default)]
    pub out_non_finite: usize,
    #[serde(default)]
    pub out_mean_abs_diff: f64,
    #[serde(default)]
    pub out_max_rel_diff: f64,
    #[serde(default)]
    pub out_rel_l2: f64,
    pub topk_ids_identical: bool,
    pub topk_w_identical: bool,
    pub counts_identical: bool,
    pub losses_identical: bool,
    pub aux_loss: f32,
    pub z_loss: f32,
}

impl EpCorrectness {
    pub fn passed(&self) -> bool {
        self.out_finite
            && self.out_mismatched == 0
            && self.topk_ids_identical
            && self.topk_w_identical
            && self.counts_identical
            && self.losses_identical
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpConfigResult {
    pub tokens: usize,
    pub correctness: EpCorrectness,
    /// Rows this rank kept, sent and received in the checked call.
    pub rows_kept: usize,
    pub rows_sent: usize,
    pub rows_received: usize,
    /// Per-round times, ms (CUDA events on the rank's stream around one call).
    pub single_ms: Vec<f64>,
    pub ep_ms: Vec<f64>,
    /// The all-to-all alone (5 repetitions): dispatch and return times, ms, and the bytes
    /// this rank sent to other ranks in each direction.
    pub dispatch_ms: Vec<f64>,
    pub return_ms: Vec<f64>,
    pub dispatch_bytes: usize,
    pub return_bytes: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpRankResult {
    pub rank: usize,
    pub world: usize,
    pub device: String,
    pub nccl: Option<String>,
    pub options: EpRankOptions,
    pub configs: Vec<EpConfigResult>,
    pub error: Option<String>,
}

const FILL_SRC: &str = r#"
typedef unsigned long long u64;
__device__ __forceinline__ u64 mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// bf16 of uniform(seed, tensor, i) * scale, as flashmoe::inputs::generate (round to nearest even).
extern "C" __global__ void ep_fill_bf16(unsigned short* out, u64 n, u64 key, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 bits = mix(key + i * 0x9E3779B97F4A7C15ull);
        const float u = (float)(bits >> 40) * (1.0f / 16777216.0f);
        const float v = (2.0f * u - 1.0f) * scale;
        const unsigned int b = __float_as_uint(v);
        out[i] = (unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    }
}
"#;

struct Timer {
    a: sys::CUevent,
    b: sys::CUevent,
}

impl Timer {
    fn new() -> Result<Timer> {
        Ok(Timer {
            a: dr::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)?,
            b: dr::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)?,
        })
    }
    fn start(&self, s: RawStream) -> Result<()> {
        unsafe { dr::event::record(self.a, s) }?;
        Ok(())
    }
    fn stop(&self, s: RawStream) -> Result<()> {
        unsafe { dr::event::record(self.b, s) }?;
        Ok(())
    }
    /// Elapsed ms once the stop event completed (the caller waited for it).
    fn ms(&self) -> Result<f64> {
        unsafe { dr::event::synchronize(self.b) }?;
        Ok(unsafe { dr::event::elapsed(self.a, self.b) }? as f64)
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        unsafe {
            let _ = dr::event::destroy(self.a);
            let _ = dr::event::destroy(self.b);
        }
    }
}

/// One call's outputs (u16 out, routing) on the device.
struct Outputs {
    out: CudaSlice<u16>,
    ids: CudaSlice<u32>,
    topk_w: CudaSlice<f32>,
    counts: CudaSlice<u32>,
    losses: CudaSlice<f32>,
}

impl Outputs {
    fn new(dev: &Device, t: usize, h: usize, k: usize, e: usize) -> Result<Outputs> {
        let s = dev.stream();
        Ok(Outputs {
            out: s.alloc_zeros(t * h)?,
            ids: s.alloc_zeros(t * k)?,
            topk_w: s.alloc_zeros(t * k)?,
            counts: s.alloc_zeros(e)?,
            losses: s.alloc_zeros(2)?,
        })
    }
    /// 0xFF bytes everywhere: NaN outputs, impossible expert ids.
    fn poison(&self, dev: &Device) -> Result<()> {
        let s = dev.stream();
        for (p, bytes) in [
            (addr(&self.out, dev), self.out.len() * 2),
            (addr(&self.ids, dev), self.ids.len() * 4),
            (addr(&self.topk_w, dev), self.topk_w.len() * 4),
            (addr(&self.counts, dev), self.counts.len() * 4),
            (addr(&self.losses, dev), 8),
        ] {
            unsafe { sys::cuMemsetD8Async(p, 0xFF, bytes, s.cu_stream()) }.result()?;
        }
        Ok(())
    }
}

fn addr<T>(s: &CudaSlice<T>, dev: &Device) -> u64 {
    s.device_ptr(dev.stream()).0
}

/// Run one rank; the result (or the error, as `error`) is returned for the caller to write.
pub fn run_rank(opts: &EpRankOptions) -> EpRankResult {
    let mut res = EpRankResult {
        rank: opts.rank,
        world: opts.world,
        device: String::new(),
        nccl: flashmoe::moe::ep::nccl_version().ok(),
        options: opts.clone(),
        configs: Vec::new(),
        error: None,
    };
    if let Err(e) = run_rank_inner(opts, &mut res) {
        res.error = Some(format!("rank {} of {}: {e:#}", opts.rank, opts.world));
    }
    res
}

fn rendezvous(opts: &EpRankOptions, timeout: Duration) -> Result<NcclId> {
    let file = opts.rendezvous.join("nccl-id");
    if opts.rank == 0 {
        let id = Communicator::new_id()?;
        let tmp = opts.rendezvous.join(".nccl-id.tmp");
        std::fs::write(&tmp, id.to_hex())?;
        std::fs::rename(&tmp, &file)?;
        return Ok(id);
    }
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(&file) {
            return Ok(NcclId::from_hex(&s)?);
        }
        if start.elapsed() > timeout {
            bail!(
                "rank 0 did not publish the NCCL id in {} within {:.0} s",
                file.display(),
                timeout.as_secs_f64()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn fault_here(rank: usize) -> Option<String> {
    let v = std::env::var(FAULT_ENV).ok()?;
    let (r, what) = v.split_once(':')?;
    (r.parse::<usize>().ok()? == rank).then(|| what.to_string())
}

fn run_rank_inner(opts: &EpRankOptions, res: &mut EpRankResult) -> Result<()> {
    let dev = Device::open(opts.rank).with_context(|| format!("opening GPU {}", opts.rank))?;
    res.device = dev.info().name.clone();
    let timeout = Duration::from_secs_f64(opts.timeout_s);
    let comm = if opts.world > 1 {
        let id = rendezvous(opts, timeout)?;
        Some(Communicator::init(
            &dev,
            &id,
            opts.rank,
            opts.world,
            timeout,
            opts.comm_ctas,
        )?)
    } else {
        None
    };
    let (h, i, e, k) = (opts.hidden, opts.intermediate, opts.experts, opts.top_k);
    let max_t = *opts
        .tokens
        .iter()
        .max()
        .ok_or_else(|| anyhow!("no token counts"))?;
    let class = MoeClass {
        dtype: DType::Bf16,
        hidden: h,
        intermediate: i,
        experts: e,
        top_k: k,
        scoring: opts.scoring,
        renormalize: true,
        shared_expert: false,
        max_tokens: max_t,
    };
    let placement = ExpertPlacement::even(e, opts.world)?;
    let single = MoePlan::new(&dev, class)?;
    let mut ep = ExpertParallelMoe::new(&dev, class, placement.clone(), comm, opts.chunks)?;

    // Inputs on the device: the weights identical on every rank, the tokens per rank.
    let s = dev.stream();
    let fill = dev.load_kernel_source("ep_fill.cu", FILL_SRC, "ep_fill_bf16", &[])?;
    let gen = |n: usize, tensor: TensorId, seed: u64, scale: f32| -> Result<CudaSlice<u16>> {
        let buf: CudaSlice<u16> = s.alloc_zeros(n)?;
        let (p, key) = (addr(&buf, &dev), stream_key(seed, tensor));
        let n64 = n as u64;
        let mut params: [*mut std::ffi::c_void; 4] = [
            flashmoe::gpu::raw::param(&p),
            flashmoe::gpu::raw::param(&n64),
            flashmoe::gpu::raw::param(&key),
            flashmoe::gpu::raw::param(&scale),
        ];
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (132 * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe {
            flashmoe::gpu::raw::launch("ep_fill_bf16", &fill, cfg, s.cu_stream(), &mut params)
        }?;
        Ok(buf)
    };
    let (sh, si) = (1.0 / (h as f32).sqrt(), 1.0 / (i as f32).sqrt());
    let router = gen(h * e, TensorId::MoeRouter, opts.seed, sh)?;
    let w13 = gen(e * h * 2 * i, TensorId::MoeW13, opts.seed, sh)?;
    let w2 = gen(e * i * h, TensorId::MoeW2, opts.seed, si)?;
    let x_all = gen(
        max_t * h,
        TensorId::MoeX,
        opts.seed + 1 + opts.rank as u64,
        1.0,
    )?;
    let mine = placement.range(opts.rank);
    let el = 2u64;
    let w13_mine = addr(&w13, &dev) + (mine.start * h * 2 * i) as u64 * el;
    let w2_mine = addr(&w2, &dev) + (mine.start * i * h) as u64 * el;
    let ws_single: CudaSlice<u8> = s.alloc_zeros(single.max_workspace_bytes().max(256))?;
    let o_single = Outputs::new(&dev, max_t, h, k, e)?;
    let o_ep = Outputs::new(&dev, max_t, h, k, e)?;
    dev.synchronize()?;
    let stream = s.cu_stream();
    let args = |t: usize, o: &Outputs, w13p: u64, w2p: u64, we: usize| -> Result<MoeArgs> {
        Ok(MoeArgs {
            gate_up: None,
            x: RawTensor::contiguous(addr(&x_all, &dev), DType::Bf16, &[t, h])?,
            router: RawTensor::contiguous(addr(&router, &dev), DType::Bf16, &[h, e])?,
            w13: RawTensor::contiguous(w13p, DType::Bf16, &[we, h, 2 * i])?,
            w2: RawTensor::contiguous(w2p, DType::Bf16, &[we, i, h])?,
            shared_w13: None,
            shared_w2: None,
            out: RawTensor::contiguous(addr(&o.out, &dev), DType::Bf16, &[t, h])?,
            routing: RoutingArgs {
                topk_ids: RawU32 {
                    ptr: addr(&o.ids, &dev),
                    len: t * k,
                },
                topk_w: RawTensor::contiguous(addr(&o.topk_w, &dev), DType::F32, &[t, k])?,
                counts: RawU32 {
                    ptr: addr(&o.counts, &dev),
                    len: e,
                },
                losses: RawTensor::contiguous(addr(&o.losses, &dev), DType::F32, &[2])?,
            },
        })
    };
    let ws_raw = flashmoe::gpu::RawWorkspace {
        ptr: addr(&ws_single, &dev),
        bytes: single.max_workspace_bytes(),
    };
    let fault = fault_here(opts.rank);
    let timer = Timer::new()?;
    for &t in &opts.tokens {
        let a_single = args(t, &o_single, addr(&w13, &dev), addr(&w2, &dev), e)?;
        let a_ep = args(t, &o_ep, w13_mine, w2_mine, mine.len())?;
        // Correctness: both layers on poisoned outputs, then every output compared.
        o_single.poison(&dev)?;
        o_ep.poison(&dev)?;
        unsafe { single.forward_raw(stream, &a_single, ws_raw) }?;
        match fault.as_deref() {
            Some("exit") => {
                eprintln!(
                    "rank {}: {FAULT_ENV}: exiting before the first expert-parallel call",
                    opts.rank
                );
                std::process::exit(17);
            }
            Some("hang") => {
                eprintln!(
                    "rank {}: {FAULT_ENV}: hanging before the first expert-parallel call",
                    opts.rank
                );
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            _ => {}
        }
        ep.barrier()?;
        unsafe { ep.forward_raw(stream, &a_ep) }?;
        unsafe { ep.wait_stream(stream) }?;
        let correctness = compare(&dev, &o_single, &o_ep, t, h, k)?;
        let x = ep.last_exchange().expect("a call ran").clone();
        // Timing: interleaved rounds after two warm-up rounds.
        let (mut single_ms, mut ep_ms) = (Vec::new(), Vec::new());
        for round in 0..opts.rounds + 2 {
            timer.start(stream)?;
            unsafe { single.forward_raw(stream, &a_single, ws_raw) }?;
            timer.stop(stream)?;
            let ms_single = timer.ms()?;
            ep.barrier()?;
            timer.start(stream)?;
            unsafe { ep.forward_raw(stream, &a_ep) }?;
            timer.stop(stream)?;
            unsafe { ep.wait_stream(stream) }?;
            let ms_ep = timer.ms()?;
            if round >= 2 {
                single_ms.push(ms_single);
                ep_ms.push(ms_ep);
            }
        }
        let (mut dispatch_ms, mut return_ms) = (Vec::new(), Vec::new());
        let (mut db, mut rb) = (0, 0);
        for _ in 0..5 {
            ep.barrier()?;
            let tm = ep.time_exchange()?;
            dispatch_ms.push(tm.dispatch_ms);
            return_ms.push(tm.return_ms);
            (db, rb) = (tm.dispatch_bytes, tm.return_bytes);
        }
        eprintln!(
            "rank {} T={t}: correct={} single {:.3} ms, expert-parallel {:.3} ms (medians)",
            opts.rank,
            correctness.passed(),
            crate::stats::median(&single_ms),
            crate::stats::median(&ep_ms)
        );
        res.configs.push(EpConfigResult {
            tokens: t,
            correctness,
            rows_kept: x.local_rows.len(),
            rows_sent: x.rows_sent(),
            rows_received: x.rows_received(),
            single_ms,
            ep_ms,
            dispatch_ms,
            return_ms,
            dispatch_bytes: db,
            return_bytes: rb,
        });
    }
    Ok(())
}

fn compare(
    dev: &Device,
    a: &Outputs,
    b: &Outputs,
    t: usize,
    h: usize,
    k: usize,
) -> Result<EpCorrectness> {
    let s: &Arc<cudarc::driver::CudaStream> = dev.stream();
    let oa: Vec<u16> = s.clone_dtoh(&a.out.slice(0..t * h))?;
    let ob: Vec<u16> = s.clone_dtoh(&b.out.slice(0..t * h))?;
    let f = |v: u16| half::bf16::from_bits(v).to_f32();
    let mut mismatched = 0;
    let (mut max_abs, mut sum_abs, mut d2, mut r2, mut ref_max) = (0f64, 0f64, 0f64, 0f64, 0f64);
    let mut non_finite = 0;
    for (&x, &y) in oa.iter().zip(&ob) {
        let (r, o) = (f(x) as f64, f(y) as f64);
        if !(r.is_finite() && o.is_finite()) {
            non_finite += 1;
            continue;
        }
        ref_max = ref_max.max(r.abs());
        r2 += r * r;
        if x != y {
            mismatched += 1;
            let d = (o - r).abs();
            max_abs = max_abs.max(d);
            sum_abs += d;
            d2 += d * d;
        }
    }
    let floor = 1e-3 * ref_max;
    let max_rel = oa
        .iter()
        .zip(&ob)
        .filter(|(x, y)| x != y)
        .map(|(&x, &y)| {
            let (r, o) = (f(x) as f64, f(y) as f64);
            (o - r).abs() / r.abs().max(floor).max(f64::MIN_POSITIVE)
        })
        .filter(|v| v.is_finite())
        .fold(0f64, f64::max);
    let eq_u32 = |x: &CudaSlice<u32>, y: &CudaSlice<u32>, n: usize| -> Result<bool> {
        Ok(s.clone_dtoh(&x.slice(0..n))? == s.clone_dtoh(&y.slice(0..n))?)
    };
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let wa = bits(s.clone_dtoh(&a.topk_w.slice(0..t * k))?);
    let wb = bits(s.clone_dtoh(&b.topk_w.slice(0..t * k))?);
    let la: Vec<f32> = s.clone_dtoh(&a.losses)?;
    let lb: Vec<f32> = s.clone_dtoh(&b.losses)?;
    Ok(EpCorrectness {
        out_elems: t * h,
        out_mismatched: mismatched,
        out_max_abs_diff: max_abs,
        out_finite: non_finite == 0,
        out_non_finite: non_finite,
        out_mean_abs_diff: sum_abs / (t * h).max(1) as f64,
        out_max_rel_diff: max_rel,
        out_rel_l2: if r2 > 0.0 { (d2 / r2).sqrt() } else { 0.0 },
        topk_ids_identical: eq_u32(&a.ids, &b.ids, t * k)?,
        topk_w_identical: wa == wb,
        counts_identical: eq_u32(&a.counts, &b.counts, a.counts.len())?,
        losses_identical: bits(la.clone()) == bits(lb) && la.iter().all(|v| v.is_finite()),
        aux_loss: la[0],
        z_loss: la[1],
    })
}

/// Write a rank's result as JSON (the launcher reads it).
pub fn write_rank_result(path: &Path, r: &EpRankResult) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(r)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// How a gathered run ended (the launcher's exit code: 0, 1, 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpOutcome {
    /// Every rank finished and every config was correct on every rank.
    Correct,
    /// Every rank finished, and some rank's output differed from the single-GPU layer.
    Incorrect,
    /// A rank failed, or a config is missing from some rank.
    RankFailed,
}

/// The outcome of `ranks` (the results the launcher could read) for `tokens` configs.
pub fn outcome(
    world: usize,
    tokens: &[usize],
    ranks: &[EpRankResult],
    failures: &[String],
) -> EpOutcome {
    let complete = failures.is_empty()
        && ranks.len() == world
        && ranks.iter().all(|r| r.error.is_none())
        && !tokens.is_empty()
        && tokens.iter().all(|&t| {
            ranks
                .iter()
                .all(|r| r.configs.iter().any(|c| c.tokens == t))
        });
    if !complete {
        EpOutcome::RankFailed
    } else if ranks
        .iter()
        .flat_map(|r| &r.configs)
        .all(|c| c.correctness.passed())
    {
        EpOutcome::Correct
    } else {
        EpOutcome::Incorrect
    }
}

/// Implementation names of an expert-parallel run.
pub const SINGLE_GPU: &str = "single-gpu";
pub const EXPERT_PARALLEL: &str = "expert-parallel";
pub const ALL_TO_ALL: &str = "all-to-all";

fn identical(b: bool) -> &'static str {
    if b {
        "identical"
    } else {
        "DIFFER"
    }
}

/// Round `r`'s value over the ranks: `f` of their samples (rounds all ranks have).
fn per_round(
    per: &[&EpConfigResult],
    f: impl Fn(&EpConfigResult, usize) -> f64,
    fold: fn(&[f64]) -> f64,
) -> Vec<f64> {
    let n = per
        .iter()
        .map(|c| c.ep_ms.len().min(c.single_ms.len()))
        .min()
        .unwrap_or(0);
    (0..n)
        .map(|r| fold(&per.iter().map(|c| f(c, r)).collect::<Vec<_>>()))
        .collect()
}

fn max_of(xs: &[f64]) -> f64 {
    xs.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

/// The gathered ranks as the lab's results (suite `ep`, candidate `expert-parallel`).
///
/// One config per token count (per GPU): the MoE problem one rank runs. Its rows:
/// `single-gpu` (every rank runs the whole layer on its tokens; a round's sample is the
/// ranks' mean), `expert-parallel` (a round's sample is its slowest rank's: the layer is
/// done when every rank is; the accuracy is the ranks' bit-for-bit check against the
/// single-GPU layer) and `all-to-all` (the exchange alone, dispatch then return, a
/// ceiling-only row with the bus bandwidths as metrics). The candidate's speedup against
/// `single-gpu` is the weak-scaling efficiency.
pub fn to_run_results(
    manifest: crate::manifest::Manifest,
    options: &EpRankOptions,
    ranks: &[EpRankResult],
    failures: &[String],
) -> crate::results::RunResults {
    use crate::recorded::{finish_config, RecordedConfig};
    use crate::results::{
        AccuracyResult, ImplResult, MeasureSettings, ProblemSpec, RunResults, CEILING_ONLY_FLAG,
        SCHEMA_VERSION,
    };
    let world = options.world;
    let settings = MeasureSettings {
        warmup_ms: 0.0,
        target_rel_ci: 0.0,
        min_samples: options.rounds,
        max_samples: options.rounds,
        max_time_ms: 0.0,
        confidence: 0.95,
        bootstrap_resamples: 2000,
        seed: options.seed,
        threshold: 0.02,
        cache_policy: "none: 2 untimed warm-up rounds; a barrier before every \
                       expert-parallel call"
            .into(),
        timer: "cuda events on each rank's stream; a round's expert-parallel sample is its \
                slowest rank's, its single-GPU sample the ranks' mean"
            .into(),
        against_max_time_ms: None,
    };
    let mut run_problems = Vec::new();
    for &t in &options.tokens {
        let p = flashmoe::MoeProblem {
            tokens: t,
            hidden: options.hidden,
            intermediate: options.intermediate,
            experts: options.experts,
            top_k: options.top_k,
            scoring: options.scoring,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        };
        let per: Vec<&EpConfigResult> = ranks
            .iter()
            .filter_map(|r| r.configs.iter().find(|c| c.tokens == t))
            .collect();
        let mut missing: Vec<String> = ranks
            .iter()
            .filter(|r| !r.configs.iter().any(|c| c.tokens == t))
            .map(|r| match &r.error {
                Some(e) => e.clone(),
                None => format!("rank {} did not measure T={t}", r.rank),
            })
            .collect();
        missing.extend(failures.iter().cloned());
        let error = (per.len() < world).then(|| {
            format!(
                "{} of {world} ranks measured T={t}: {}",
                per.len(),
                if missing.is_empty() {
                    "no rank result".to_string()
                } else {
                    missing.join("; ")
                }
            )
        });
        let backend = "cuda";
        let mut single = ImplResult::new(SINGLE_GPU, backend);
        let mut ep = ImplResult::new(EXPERT_PARALLEL, backend);
        let mut a2a = ImplResult::new(ALL_TO_ALL, backend);
        if per.is_empty() {
            for row in [&mut single, &mut ep, &mut a2a] {
                row.error = Some("not measured: no rank reported this config".into());
            }
        } else {
            single.samples_ms = per_round(&per, |c, r| c.single_ms[r], crate::stats::mean);
            if let Some(e) = &error {
                ep.error = Some(e.clone());
                a2a.error = Some(e.clone());
            } else {
                ep.samples_ms = per_round(&per, |c, r| c.ep_ms[r], max_of);
                let reps = per
                    .iter()
                    .map(|c| c.dispatch_ms.len().min(c.return_ms.len()))
                    .min()
                    .unwrap_or(0);
                a2a.samples_ms = (0..reps)
                    .map(|r| {
                        max_of(
                            &per.iter()
                                .map(|c| c.dispatch_ms[r] + c.return_ms[r])
                                .collect::<Vec<_>>(),
                        )
                    })
                    .collect();
            }
            let passed = per.iter().all(|c| c.correctness.passed());
            let note = per
                .iter()
                .zip(
                    ranks
                        .iter()
                        .filter(|r| r.configs.iter().any(|c| c.tokens == t)),
                )
                .map(|(c, r)| {
                    let k = &c.correctness;
                    format!(
                        "rank {}: {} of {} output elements differ (max |Δ| {:.3e}), ids {}, \
                         weights {}, counts {}, losses {} (aux {:.6}, z {:.6})",
                        r.rank,
                        k.out_mismatched,
                        k.out_elems,
                        k.out_max_abs_diff,
                        identical(k.topk_ids_identical),
                        identical(k.topk_w_identical),
                        identical(k.counts_identical),
                        identical(k.losses_identical),
                        k.aux_loss,
                        k.z_loss
                    )
                })
                .collect::<Vec<_>>()
                .join("; ");
            let worst = |f: fn(&EpCorrectness) -> f64| {
                per.iter().map(|c| f(&c.correctness)).fold(0f64, f64::max)
            };
            ep.accuracy = Some(AccuracyResult {
                max_abs: worst(|k| k.out_max_abs_diff),
                mean_abs: crate::stats::mean(
                    &per.iter()
                        .map(|c| c.correctness.out_mean_abs_diff)
                        .collect::<Vec<_>>(),
                ),
                max_rel: worst(|k| k.out_max_rel_diff),
                rel_l2: worst(|k| k.out_rel_l2),
                non_finite: per.iter().map(|c| c.correctness.out_non_finite).sum(),
                tolerance_rel_l2: 0.0,
                max_row_rel_l2: None,
                worst_row: None,
                tolerance_row_rel_l2: None,
                passed,
                reference: "single-gpu layer on the same GPU and tokens (bit-identical)".into(),
                note: Some(note),
            });
            let maxu = |f: fn(&EpConfigResult) -> usize| {
                per.iter().map(|c| f(c)).max().unwrap_or(0) as f64
            };
            ep.metrics.insert("world".into(), world as f64);
            ep.metrics.insert("chunks".into(), options.chunks as f64);
            ep.metrics.insert("rows_sent".into(), maxu(|c| c.rows_sent));
            ep.metrics
                .insert("rows_received".into(), maxu(|c| c.rows_received));
            let med_max = |f: fn(&EpConfigResult) -> &Vec<f64>| {
                per.iter()
                    .map(|c| crate::stats::median(f(c)))
                    .fold(0f64, f64::max)
            };
            let (dms, rms) = (med_max(|c| &c.dispatch_ms), med_max(|c| &c.return_ms));
            let (db, rb) = (maxu(|c| c.dispatch_bytes), maxu(|c| c.return_bytes));
            let bw = |bytes: f64, ms: f64| if ms > 0.0 { bytes / ms / 1e6 } else { 0.0 };
            a2a.flags.push(format!(
                "{CEILING_ONLY_FLAG}: the exchange alone (dispatch, then return), no GEMMs"
            ));
            for (k, v) in [
                ("dispatch_ms", dms),
                ("return_ms", rms),
                ("dispatch_bytes", db),
                ("return_bytes", rb),
                ("dispatch_busbw_gbs", bw(db, dms)),
                ("return_busbw_gbs", bw(rb, rms)),
            ] {
                a2a.metrics.insert(k.into(), v);
            }
        }
        let problem = ProblemSpec::Moe(p.clone());
        let mut config = finish_config(
            RecordedConfig {
                id: Some(format!("{}_ep{world}gpu", p.id())),
                label: Some(format!("{p} per GPU, {world} GPUs")),
                problem,
                min_bytes: p.min_bytes(p.experts.min(p.tokens * p.top_k)),
                implementations: vec![single, ep, a2a],
                error,
                sampling: None,
            },
            EXPERT_PARALLEL,
            &settings,
        );
        // The layer's FLOPs and bytes over the exchange's time mean nothing: its bus
        // bandwidths are in the metrics.
        if let Some(a) = config
            .implementations
            .iter_mut()
            .find(|i| i.name == ALL_TO_ALL)
        {
            a.tflops = None;
            a.gbps = None;
        }
        run_problems.push(config);
    }
    RunResults {
        schema_version: SCHEMA_VERSION,
        suite: "ep".into(),
        source: options.preset.clone(),
        manifest,
        settings,
        ceilings: None,
        candidate: EXPERT_PARALLEL.into(),
        configs: run_problems,
        interrupted: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::ProblemSpec;

    fn options() -> EpRankOptions {
        EpRankOptions {
            rank: 0,
            world: 2,
            rendezvous: PathBuf::from("/tmp"),
            preset: "deepseek-v3".into(),
            hidden: 7168,
            intermediate: 2048,
            experts: 256,
            top_k: 8,
            scoring: Scoring::Sigmoid,
            tokens: vec![4096],
            chunks: 4,
            seed: 1,
            rounds: 3,
            timeout_s: 60.0,
            comm_ctas: None,
        }
    }

    fn rank(r: usize, single: [f64; 3], ep: [f64; 3], ok: bool) -> EpRankResult {
        EpRankResult {
            rank: r,
            world: 2,
            device: "GPU".into(),
            nccl: Some("2.27.7".into()),
            options: EpRankOptions {
                rank: r,
                ..options()
            },
            configs: vec![EpConfigResult {
                tokens: 4096,
                correctness: EpCorrectness {
                    out_elems: 10,
                    out_mismatched: if ok { 0 } else { 3 },
                    out_max_abs_diff: if ok { 0.0 } else { 0.5 },
                    out_finite: true,
                    out_non_finite: 0,
                    out_mean_abs_diff: 0.0,
                    out_max_rel_diff: 0.0,
                    out_rel_l2: if ok { 0.0 } else { 0.1 },
                    topk_ids_identical: true,
                    topk_w_identical: true,
                    counts_identical: true,
                    losses_identical: true,
                    aux_loss: 1.0,
                    z_loss: 2.0,
                },
                rows_kept: 10,
                rows_sent: 10 + r,
                rows_received: 12,
                single_ms: single.to_vec(),
                ep_ms: ep.to_vec(),
                dispatch_ms: vec![1.0, 1.0],
                return_ms: vec![2.0, 2.0 + r as f64],
                dispatch_bytes: 1_000_000_000,
                return_bytes: 2_000_000_000,
            }],
            error: None,
        }
    }

    #[test]
    fn rank_samples_become_one_config_with_the_slowest_rank_per_round() {
        let ranks = vec![
            rank(0, [10.0, 10.0, 10.0], [11.0, 13.0, 11.0], true),
            rank(1, [12.0, 12.0, 12.0], [12.5, 12.0, 12.5], true),
        ];
        let r = to_run_results(Default::default(), &options(), &ranks, &[]);
        assert_eq!(
            (r.suite.as_str(), r.candidate.as_str()),
            ("ep", EXPERT_PARALLEL)
        );
        let c = &r.configs[0];
        assert!(
            c.id.ends_with("_ep2gpu") && c.label.contains("2 GPUs"),
            "{}",
            c.id
        );
        assert!(matches!(c.problem, ProblemSpec::Moe(ref p) if p.tokens == 4096));
        let row = |n: &str| c.implementations.iter().find(|i| i.name == n).unwrap();
        assert_eq!(row(SINGLE_GPU).samples_ms, vec![11.0, 11.0, 11.0]);
        assert_eq!(row(EXPERT_PARALLEL).samples_ms, vec![12.5, 13.0, 12.5]);
        assert_eq!(row(ALL_TO_ALL).samples_ms, vec![3.0, 4.0]);
        let acc = row(EXPERT_PARALLEL).accuracy.clone().unwrap();
        assert!(acc.passed && acc.tolerance_rel_l2 == 0.0);
        assert!(acc
            .note
            .unwrap()
            .contains("rank 1: 0 of 10 output elements differ"));
        let a2a = row(ALL_TO_ALL);
        assert!(a2a.is_ceiling_only() && a2a.tflops.is_none() && a2a.gbps.is_none());
        // Slowest rank's median dispatch 1 ms for 1 GB: 1000 GB/s.
        assert!((a2a.metrics["dispatch_busbw_gbs"] - 1000.0).abs() < 1e-9);
        assert_eq!(row(EXPERT_PARALLEL).metrics["rows_sent"], 11.0);
        // Speedup of the candidate against the single GPU = weak-scaling efficiency.
        let p = c
            .comparisons
            .iter()
            .find(|p| p.baseline == SINGLE_GPU)
            .unwrap();
        assert!((p.comparison.speedup.estimate - 11.0 / 12.5).abs() < 1e-12);
        assert_eq!(outcome(2, &[4096], &ranks, &[]), EpOutcome::Correct);
        // Every report renders it, and it reads back.
        let md = crate::report::to_markdown(&r);
        assert!(md.contains("dispatch busbw 1000 GB/s"), "{md}");
        assert!(md.contains("world 2,") || md.contains("world 2\n"), "{md}");
        let back = crate::report::parse_json(&crate::report::to_json(&r).unwrap()).unwrap();
        assert_eq!(back.configs[0].implementations.len(), 3);
    }

    #[test]
    fn incorrect_or_missing_ranks_are_gate_failures_and_errors() {
        let bad = vec![
            rank(0, [1.0; 3], [1.0; 3], true),
            rank(1, [1.0; 3], [1.0; 3], false),
        ];
        let r = to_run_results(Default::default(), &options(), &bad, &[]);
        let ep = &r.configs[0].implementations[1];
        let acc = ep.accuracy.as_ref().unwrap();
        assert!(!acc.passed && acc.max_abs == 0.5 && acc.rel_l2 == 0.1);
        assert!(!ep.is_usable());
        assert!(r.configs[0].comparisons.is_empty());
        assert_eq!(outcome(2, &[4096], &bad, &[]), EpOutcome::Incorrect);

        let failures = vec!["rank 1 exited with status 17".to_string()];
        let one = vec![rank(0, [1.0; 3], [1.0; 3], true)];
        let r = to_run_results(Default::default(), &options(), &one, &failures);
        let c = &r.configs[0];
        assert!(
            c.error.as_deref().unwrap().contains("1 of 2 ranks"),
            "{:?}",
            c.error
        );
        assert!(c.implementations[1]
            .error
            .as_deref()
            .unwrap()
            .contains("status 17"));
        assert_eq!(outcome(2, &[4096], &one, &failures), EpOutcome::RankFailed);
        let none = to_run_results(Default::default(), &options(), &[], &failures);
        assert!(none.configs[0].implementations[0].error.is_some());
    }
}
