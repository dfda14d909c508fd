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
use flashmoe::moe::plan::{MoeArgs, MoeClass, MoePlan, RawU32, RoutingArgs};
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
    let mut max_abs = 0f64;
    let mut finite = true;
    for (&x, &y) in oa.iter().zip(&ob) {
        finite &= f(x).is_finite() && f(y).is_finite();
        if x != y {
            mismatched += 1;
            max_abs = max_abs.max((f(x) as f64 - f(y) as f64).abs());
        }
    }
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
        out_finite: finite,
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

/// The gathered run: every rank's result, the machine and the per-config summary.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpReport {
    pub manifest: crate::manifest::Manifest,
    /// `nvidia-smi topo -m` as printed (or why it could not run).
    pub topology: String,
    pub world: usize,
    pub preset: String,
    pub ranks: Vec<EpRankResult>,
    /// Ranks that failed (exit status, error), in rank order.
    pub failures: Vec<String>,
    pub summary: Vec<EpSummary>,
}

/// One config over all ranks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpSummary {
    pub tokens_per_gpu: usize,
    /// Mean over ranks of each rank's median single-GPU time, ms.
    pub single_ms: f64,
    /// Slowest rank's median expert-parallel time, ms (the layer is done when it is).
    pub ep_ms: f64,
    /// Weak scaling: (world · T / ep_ms) / (world · T / single_ms) = single_ms / ep_ms.
    pub efficiency: f64,
    /// Slowest rank's median dispatch / return alone, ms, and the bus bandwidth: bytes a
    /// rank sends to the other ranks per second (nccl-tests' busbw for an all-to-all).
    pub dispatch_ms: f64,
    pub return_ms: f64,
    pub dispatch_busbw_gbs: f64,
    pub return_busbw_gbs: f64,
    pub rows_sent: usize,
    pub rows_received: usize,
    /// Every rank's output, routing and losses bit-identical to the single-GPU layer.
    pub correct: bool,
}

impl EpReport {
    pub fn new(
        manifest: crate::manifest::Manifest,
        topology: String,
        world: usize,
        preset: &str,
        ranks: Vec<EpRankResult>,
        failures: Vec<String>,
    ) -> EpReport {
        use crate::stats::{mean, median};
        let mut summary = Vec::new();
        if let Some(first) = ranks.first() {
            for (ci, c) in first.configs.iter().enumerate() {
                let per: Vec<&EpConfigResult> =
                    ranks.iter().filter_map(|r| r.configs.get(ci)).collect();
                if per.len() != ranks.len() {
                    continue;
                }
                let max_of = |f: &dyn Fn(&EpConfigResult) -> f64| {
                    per.iter().map(|c| f(c)).fold(0f64, f64::max)
                };
                let single_ms = mean(&per.iter().map(|c| median(&c.single_ms)).collect::<Vec<_>>());
                let ep_ms = max_of(&|c| median(&c.ep_ms));
                let dispatch_ms = max_of(&|c| median(&c.dispatch_ms));
                let return_ms = max_of(&|c| median(&c.return_ms));
                let bw = |bytes: usize, ms: f64| {
                    if ms > 0.0 {
                        bytes as f64 / ms / 1e6
                    } else {
                        0.0
                    }
                };
                let dbytes = per.iter().map(|c| c.dispatch_bytes).max().unwrap_or(0);
                let rbytes = per.iter().map(|c| c.return_bytes).max().unwrap_or(0);
                summary.push(EpSummary {
                    tokens_per_gpu: c.tokens,
                    single_ms,
                    ep_ms,
                    efficiency: if ep_ms > 0.0 { single_ms / ep_ms } else { 0.0 },
                    dispatch_ms,
                    return_ms,
                    dispatch_busbw_gbs: bw(dbytes, dispatch_ms),
                    return_busbw_gbs: bw(rbytes, return_ms),
                    rows_sent: c.rows_sent,
                    rows_received: c.rows_received,
                    correct: per.iter().all(|c| c.correctness.passed()),
                });
            }
        }
        EpReport {
            manifest,
            topology,
            world,
            preset: preset.to_string(),
            ranks,
            failures,
            summary,
        }
    }

    /// Every rank finished and every config was correct on every rank.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
            && self.ranks.iter().all(|r| r.error.is_none())
            && !self.summary.is_empty()
            && self.summary.iter().all(|s| s.correct)
    }

    pub fn markdown(&self) -> String {
        let mut m = String::new();
        let o = self.ranks.first().map(|r| &r.options);
        m.push_str(&format!(
            "# Expert-parallel MoE: {} GPUs, preset {}\n\n",
            self.world, self.preset
        ));
        if let Some(o) = o {
            m.push_str(&format!(
                "bf16, hidden {}, intermediate {}, {} experts, top-{}, {:?} scoring; experts split evenly; {} chunk(s); NCCL maxCTAs {}; {} timed rounds per config.\n\n",
                o.hidden, o.intermediate, o.experts, o.top_k, o.scoring, o.chunks,
                o.comm_ctas.map_or("default".to_string(), |n| n.to_string()), o.rounds
            ));
        }
        if let Some(r) = self.ranks.first() {
            m.push_str(&format!(
                "Device: {} · NCCL {} · flashmoe {} ({})\n\n",
                r.device,
                r.nccl.as_deref().unwrap_or("absent"),
                self.manifest.flashmoe_version,
                self.manifest.build_commit
            ));
        }
        m.push_str("Weak scaling: every GPU keeps `T` tokens. `single` is one GPU running the whole layer (all experts) on its T tokens; `EP` is the expert-parallel layer (slowest rank); efficiency = single / EP (1.0 = twice the throughput on two GPUs). Dispatch and return are the all-to-all alone, bus bandwidth = bytes a rank sends to the others per second. Correct = every rank's output, routing and losses bit-identical to the single-GPU layer on its tokens.\n\n");
        m.push_str("| T / GPU | single ms | EP ms | efficiency | dispatch ms | dispatch GB/s | return ms | return GB/s | rows sent / received (rank 0) | correct |\n");
        m.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--:|\n");
        for s in &self.summary {
            m.push_str(&format!(
                "| {} | {:.3} | {:.3} | {:.1}% | {:.3} | {:.0} | {:.3} | {:.0} | {} / {} | {} |\n",
                s.tokens_per_gpu,
                s.single_ms,
                s.ep_ms,
                100.0 * s.efficiency,
                s.dispatch_ms,
                s.dispatch_busbw_gbs,
                s.return_ms,
                s.return_busbw_gbs,
                s.rows_sent,
                s.rows_received,
                if s.correct { "yes" } else { "**NO**" }
            ));
        }
        for r in &self.ranks {
            for c in &r.configs {
                let k = &c.correctness;
                m.push_str(&format!(
                    "\nrank {} T={}: {} of {} output elements differ (max |Δ| {:.3e}), ids {}, weights {}, counts {}, losses {} (aux {:.6}, z {:.6})",
                    r.rank, c.tokens, k.out_mismatched, k.out_elems, k.out_max_abs_diff,
                    same(k.topk_ids_identical), same(k.topk_w_identical), same(k.counts_identical),
                    same(k.losses_identical), k.aux_loss, k.z_loss
                ));
            }
            if let Some(e) = &r.error {
                m.push_str(&format!("\n\nrank {} failed: {e}", r.rank));
            }
        }
        for f in &self.failures {
            m.push_str(&format!("\n\nfailure: {f}"));
        }
        m.push_str(&format!(
            "\n\n## Topology (`nvidia-smi topo -m`)\n\n```\n{}\n```\n",
            self.topology.trim_end()
        ));
        m
    }

    /// A self-contained HTML page of the Markdown (pre-formatted: no renderer needed).
    pub fn html(&self) -> String {
        let esc = self
            .markdown()
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;");
        format!(
            "<!doctype html><meta charset=\"utf-8\"><title>flashmoe expert-parallel MoE</title>\n<pre style=\"font: 13px/1.4 monospace\">\n{esc}\n</pre>\n"
        )
    }
}

fn same(b: bool) -> &'static str {
    if b {
        "identical"
    } else {
        "DIFFER"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(r: usize, single: f64, ep: f64, ok: bool) -> EpRankResult {
        EpRankResult {
            rank: r,
            world: 2,
            device: "GPU".into(),
            nccl: Some("2.27.7".into()),
            options: EpRankOptions {
                rank: r,
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
            },
            configs: vec![EpConfigResult {
                tokens: 4096,
                correctness: EpCorrectness {
                    out_elems: 10,
                    out_mismatched: if ok { 0 } else { 3 },
                    out_max_abs_diff: 0.0,
                    out_finite: true,
                    topk_ids_identical: true,
                    topk_w_identical: true,
                    counts_identical: true,
                    losses_identical: true,
                    aux_loss: 1.0,
                    z_loss: 2.0,
                },
                rows_kept: 10,
                rows_sent: 10,
                rows_received: 12,
                single_ms: vec![single, single, single],
                ep_ms: vec![ep, ep, ep],
                dispatch_ms: vec![1.0],
                return_ms: vec![2.0],
                dispatch_bytes: 1_000_000_000,
                return_bytes: 2_000_000_000,
            }],
            error: None,
        }
    }

    #[test]
    fn summary_takes_the_slowest_rank_and_flags_incorrect_ranks() {
        let rep = EpReport::new(
            Default::default(),
            "GPU0 X".into(),
            2,
            "deepseek-v3",
            vec![rank(0, 10.0, 11.0, true), rank(1, 12.0, 12.5, true)],
            vec![],
        );
        let s = &rep.summary[0];
        assert_eq!((s.single_ms, s.ep_ms), (11.0, 12.5));
        assert!((s.efficiency - 0.88).abs() < 1e-12);
        assert!((s.dispatch_busbw_gbs - 1000.0).abs() < 1e-9);
        assert!(rep.passed());
        assert!(rep
            .markdown()
            .contains("| 4096 | 11.000 | 12.500 | 88.0% |"));
        let bad = EpReport::new(
            Default::default(),
            String::new(),
            2,
            "x",
            vec![rank(0, 1.0, 1.0, true), rank(1, 1.0, 1.0, false)],
            vec![],
        );
        assert!(!bad.passed() && bad.markdown().contains("**NO**"));
        let failed = EpReport::new(
            Default::default(),
            String::new(),
            2,
            "x",
            vec![rank(0, 1.0, 1.0, true)],
            vec!["rank 1 exited with status 17".into()],
        );
        assert!(!failed.passed());
    }
}
