//! Host cost of the library's attention entry points, measured the way an engine calls
//! them: a plan built once, then calls on the engine's stream over its own buffers.
//!
//! ```text
//! cargo run --release --example api_overhead -- [OUT.json]
//! ```
//! For each shape (the issue's small prefill B=1 Hq=32 Hkv=8 S=128 D=128 causal, and a
//! decode-sized and a larger prefill call) it reports, over 20 batches of 200 calls:
//! - `plan_host_us`: host time per `AttentionPlan::forward_raw` call (enqueue only);
//! - `forward_host_us`: the same for the one-off `attention::forward` (a plan per call);
//! - `kernel_us`: the kernel's own time, from a CUDA graph of 200 launches (no launch gaps);
//! - `back_to_back_us`: wall time per call of 200 eager calls until the stream drains,
//!   and its ratio to `kernel_us`.
//!
//! Then the MoE layer (`"moe"` in the JSON): a Mixtral-like small shape (H 1024, I 3584,
//! E 8, k 2) and the seed003 shape (H 4096, I 11008, E 32, k 2), one `MoePlan` per shape
//! built for up to 2048 tokens, called at 16, 128, 512 and 2048 tokens: `plan_host_us` per
//! `MoePlan::forward_raw` call (enqueue of the whole layer), `kernel_us` per layer from a
//! graph of calls, `back_to_back_us` as above, over 10 batches of 50 calls. The experts'
//! weights are zeros (GEMM time does not depend on values); x and the router are random,
//! so the routing is a real one.
//!
//! Medians; the JSON holds every batch. No GPU: exits 2 with the reason.

use cudarc::driver::{sys, CudaStream, DevicePtr};
use flashmoe::attention::{self, AttentionArgs, AttentionClass, AttentionPlan};
use flashmoe::gpu::{Device, DeviceTensor, RawTensor};
use flashmoe::moe::{MoeArgs, MoeClass, MoePlan, RawU32, RoutingArgs};
use flashmoe::{DType, Scoring};
use std::sync::Arc;
use std::time::Instant;

const BATCHES: usize = 20;
const CALLS: usize = 200;
const MOE_BATCHES: usize = 10;
const MOE_CALLS: usize = 50;
const MOE_MAX_TOKENS: usize = 2048;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

struct Shape {
    name: &'static str,
    batch: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    sk: usize,
    d: usize,
    causal: bool,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1);
    let dev = Device::open(0)?;
    eprintln!("{}", dev.info());
    let shapes = [
        Shape {
            name: "small-prefill",
            batch: 1,
            hq: 32,
            hkv: 8,
            sq: 128,
            sk: 128,
            d: 128,
            causal: true,
        },
        Shape {
            name: "decode-step",
            batch: 8,
            hq: 32,
            hkv: 8,
            sq: 1,
            sk: 1024,
            d: 128,
            causal: true,
        },
        Shape {
            name: "prefill-2k",
            batch: 4,
            hq: 32,
            hkv: 8,
            sq: 2048,
            sk: 2048,
            d: 128,
            causal: true,
        },
    ];
    let stream = dev.stream().clone();
    let mut rows = Vec::new();
    for s in &shapes {
        let class = AttentionClass {
            dtype: DType::Bf16,
            head_dim: s.d,
            heads_q: s.hq,
            heads_kv: s.hkv,
            causal: s.causal,
            softmax_scale: None,
            window: flashmoe::problem::NO_WINDOW,
            softcap: 0.0,
        };
        let problem = class.problem(s.batch, s.sq, s.sk);
        let t0 = Instant::now();
        let plan = AttentionPlan::new(&dev, class)?;
        let plan_build_ms = t0.elapsed().as_secs_f64() * 1e3;
        let ws = plan.alloc_workspace(&stream)?;
        let vals = |n: usize, k: u32| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    ((i as u32).wrapping_mul(2_654_435_761) ^ k) as f32 / u32::MAX as f32 - 0.5
                })
                .collect()
        };
        let q = DeviceTensor::from_f32(&dev, DType::Bf16, &vals(problem.q_elems(), 1))?;
        let k = DeviceTensor::from_f32(&dev, DType::Bf16, &vals(problem.kv_elems(), 2))?;
        let v = DeviceTensor::from_f32(&dev, DType::Bf16, &vals(problem.kv_elems(), 3))?;
        let mut o = DeviceTensor::alloc(&dev, DType::Bf16, problem.q_elems())?;
        let mut lse = DeviceTensor::alloc(&dev, DType::F32, problem.lse_elems())?;
        let qs = [s.batch, s.sq, s.hq, s.d];
        let ks = [s.batch, s.sk, s.hkv, s.d];
        let args = AttentionArgs {
            q: q.raw(&dev, "q", &qs)?,
            k: k.raw(&dev, "k", &ks)?,
            v: v.raw(&dev, "v", &ks)?,
            o: o.raw(&dev, "o", &qs)?,
            lse: lse.raw(&dev, "lse", &[s.batch, s.hq, s.sq])?,
        };
        let cu = stream.cu_stream();
        let call = || unsafe { plan.forward_raw(cu, &args, ws.raw()) };
        for _ in 0..50 {
            call()?;
        }
        dev.synchronize()?;

        let Timings { host, b2b, kernel } = measure(&dev, &stream, call, BATCHES, CALLS)?;
        // The one-off entry point (plan + workspace per call).
        let mut once = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..20 {
                attention::forward(&dev, &problem, &q, &k, &v, &mut o, &mut lse)?;
            }
            once.push(t.elapsed().as_secs_f64() * 1e6 / 20.0);
            dev.synchronize()?;
        }
        let (h, bb, kk, oo) = (
            median(&mut host.clone()),
            median(&mut b2b.clone()),
            median(&mut kernel.clone()),
            median(&mut once.clone()),
        );
        eprintln!(
            "{:14} plan {:6.2} µs/call host | forward() {:7.1} µs | kernel {:7.2} µs | back-to-back {:7.2} µs ({:.2}x kernel) | plan build {:.0} ms",
            s.name, h, oo, kk, bb, bb / kk, plan_build_ms
        );
        rows.push(format!(
            concat!(
                "{{\"shape\":\"{}\",\"batch\":{},\"heads_q\":{},\"heads_kv\":{},\"seqlen_q\":{},\"seqlen_k\":{},",
                "\"head_dim\":{},\"causal\":{},\"dtype\":\"bf16\",\"kernel\":\"{}\",\"plan_build_ms\":{:.1},",
                "\"plan_host_us\":{:.3},\"forward_host_us\":{:.2},\"kernel_us\":{:.3},\"back_to_back_us\":{:.3},",
                "\"back_to_back_over_kernel\":{:.3},\"samples\":{{\"plan_host_us\":{:?},\"back_to_back_us\":{:?},",
                "\"kernel_us\":{:?},\"forward_host_us\":{:?}}}}}"
            ),
            s.name, s.batch, s.hq, s.hkv, s.sq, s.sk, s.d, s.causal, plan.variant().entry, plan_build_ms,
            h, oo, kk, bb, bb / kk, host, b2b, kernel, once
        ));
    }
    let floor = launch_floor_us(&dev, &stream)?;
    eprintln!("driver floor: {floor:.2} µs of host time per cuLaunchKernel of an empty kernel");
    let moe_rows = run_moe(&dev, &stream)?;
    let json = format!(
        "{{\"schema\":\"flashmoe-api-overhead/1\",\"device\":{:?},\"calls_per_batch\":{CALLS},\"batches\":{BATCHES},\"launch_floor_us\":{floor:.3},\"attention\":[{}],\"moe\":[{}]}}\n",
        dev.info().to_string(),
        rows.join(","),
        moe_rows.join(",")
    );
    match out {
        Some(p) => std::fs::write(&p, json)?,
        None => print!("{json}"),
    }
    Ok(())
}

struct MoeShape {
    name: &'static str,
    hidden: usize,
    intermediate: usize,
    experts: usize,
    top_k: usize,
}

/// The MoE section: host time per `MoePlan::forward_raw`, kernel time from a graph.
fn run_moe(
    dev: &Device,
    stream: &Arc<CudaStream>,
) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let shapes = [
        MoeShape {
            name: "mixtral-small",
            hidden: 1024,
            intermediate: 3584,
            experts: 8,
            top_k: 2,
        },
        MoeShape {
            name: "seed003",
            hidden: 4096,
            intermediate: 11008,
            experts: 32,
            top_k: 2,
        },
    ];
    let mut rows = Vec::new();
    for s in &shapes {
        let (h, i, e, k) = (s.hidden, s.intermediate, s.experts, s.top_k);
        let class = MoeClass {
            dtype: DType::Bf16,
            hidden: h,
            intermediate: i,
            experts: e,
            top_k: k,
            scoring: Scoring::Softmax,
            renormalize: true,
            shared_expert: false,
            max_tokens: MOE_MAX_TOKENS,
        };
        let t0 = Instant::now();
        let plan = MoePlan::new(dev, class)?;
        let plan_build_ms = t0.elapsed().as_secs_f64() * 1e3;
        let ws = plan.alloc_workspace(stream)?;
        let routing = plan.alloc_routing(stream)?;
        let vals = |n: usize, seed: u32| -> Vec<f32> {
            (0..n)
                .map(|j| {
                    ((j as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5
                })
                .collect()
        };
        let x = DeviceTensor::from_f32(dev, DType::Bf16, &vals(MOE_MAX_TOKENS * h, 7))?;
        let router = DeviceTensor::from_f32(dev, DType::Bf16, &vals(h * e, 11))?;
        let w13 = stream.alloc_zeros::<u16>(e * h * 2 * i)?;
        let w2 = stream.alloc_zeros::<u16>(e * i * h)?;
        let out = DeviceTensor::alloc(dev, DType::Bf16, MOE_MAX_TOKENS * h)?;
        let ptr = |t: &DeviceTensor, name: &str, n: usize| -> Result<u64, flashmoe::Error> {
            Ok(t.raw(dev, name, &[n])?.ptr)
        };
        let (xp, rp, op) = (
            ptr(&x, "x", MOE_MAX_TOKENS * h)?,
            ptr(&router, "router", h * e)?,
            ptr(&out, "out", MOE_MAX_TOKENS * h)?,
        );
        let bf = |p: u64, shape: &[usize]| RawTensor::contiguous(p, DType::Bf16, shape);
        let f32t = |p: u64, shape: &[usize]| RawTensor::contiguous(p, DType::F32, shape);
        for tokens in [16, 128, 512, 2048] {
            let args = MoeArgs {
                gate_up: None,
                x: bf(xp, &[tokens, h])?,
                router: bf(rp, &[h, e])?,
                w13: bf(w13.device_ptr(stream).0, &[e, h, 2 * i])?,
                w2: bf(w2.device_ptr(stream).0, &[e, i, h])?,
                shared_w13: None,
                shared_w2: None,
                out: bf(op, &[tokens, h])?,
                routing: RoutingArgs {
                    topk_ids: RawU32 {
                        ptr: routing.topk_ids.device_ptr(stream).0,
                        len: tokens * k,
                    },
                    topk_w: f32t(routing.topk_w.device_ptr(stream).0, &[tokens, k])?,
                    counts: RawU32 {
                        ptr: routing.counts.device_ptr(stream).0,
                        len: e,
                    },
                    losses: f32t(routing.losses.device_ptr(stream).0, &[2])?,
                },
            };
            let cu = stream.cu_stream();
            let call = || unsafe { plan.forward_raw(cu, &args, ws.raw()) };
            for _ in 0..10 {
                call()?;
            }
            dev.synchronize()?;
            let Timings { host, b2b, kernel } = measure(dev, stream, call, MOE_BATCHES, MOE_CALLS)?;
            let (hh, bb, kk) = (
                median(&mut host.clone()),
                median(&mut b2b.clone()),
                median(&mut kernel.clone()),
            );
            let path = plan.gemm_path(tokens)?;
            eprintln!(
                "moe {:14} T={:5} plan {:6.2} µs/call host | kernel {:9.2} µs | back-to-back {:9.2} µs ({:.2}x kernel) | plan build {:.0} ms | {path}",
                s.name, tokens, hh, kk, bb, bb / kk, plan_build_ms
            );
            rows.push(format!(
                concat!(
                    "{{\"shape\":\"{}\",\"hidden\":{},\"intermediate\":{},\"experts\":{},\"top_k\":{},",
                    "\"tokens\":{},\"max_tokens\":{},\"dtype\":\"bf16\",\"gemm_path\":{:?},\"plan_build_ms\":{:.1},",
                    "\"plan_host_us\":{:.3},\"kernel_us\":{:.3},\"back_to_back_us\":{:.3},",
                    "\"back_to_back_over_kernel\":{:.3},\"samples\":{{\"plan_host_us\":{:?},",
                    "\"back_to_back_us\":{:?},\"kernel_us\":{:?}}}}}"
                ),
                s.name, h, i, e, k, tokens, MOE_MAX_TOKENS, path, plan_build_ms, hh, kk, bb,
                bb / kk, host, b2b, kernel
            ));
        }
    }
    Ok(rows)
}

/// Host time of one `cuLaunchKernel` of an empty kernel through the same raw launch path
/// (median over batches of 200): the driver's floor, which a call of n launches pays n times.
fn launch_floor_us(
    dev: &Device,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) -> Result<f64, Box<dyn std::error::Error>> {
    let f = dev.load_kernel_source(
        "api_overhead_empty.cu",
        "extern \"C\" __global__ void empty_kernel(int x) {}",
        "empty_kernel",
        &[],
    )?;
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let x = 0i32;
    let launch = || -> Result<(), Box<dyn std::error::Error>> {
        let mut p = [flashmoe::gpu::raw::param(&x)];
        unsafe { flashmoe::gpu::raw::launch("empty_kernel", &f, cfg, stream.cu_stream(), &mut p) }?;
        Ok(())
    };
    for _ in 0..100 {
        launch()?;
    }
    dev.synchronize()?;
    let mut per = Vec::new();
    for _ in 0..BATCHES {
        let t = Instant::now();
        for _ in 0..CALLS {
            launch()?;
        }
        per.push(t.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
        dev.synchronize()?;
    }
    Ok(median(&mut per))
}

/// Per-call samples (µs) of one entry point, one per batch of `calls` calls.
struct Timings {
    /// Host time to enqueue a call.
    host: Vec<f64>,
    /// Wall time per call of back-to-back calls until the stream drains.
    b2b: Vec<f64>,
    /// The launches' own GPU time: a CUDA graph of `calls` calls, replayed.
    kernel: Vec<f64>,
}

fn measure(
    dev: &Device,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    call: impl Fn() -> flashmoe::Result<()>,
    batches: usize,
    calls: usize,
) -> Result<Timings, Box<dyn std::error::Error>> {
    let per_call = |t: Instant| t.elapsed().as_secs_f64() * 1e6 / calls as f64;
    let (mut host, mut b2b, mut kernel) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..batches {
        let t = Instant::now();
        for _ in 0..calls {
            call()?;
        }
        host.push(per_call(t));
        dev.synchronize()?;
        b2b.push(per_call(t));
    }
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    for _ in 0..calls {
        call()?;
    }
    let graph = stream
        .end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        )?
        .ok_or("empty graph")?;
    graph.launch()?;
    dev.synchronize()?;
    for _ in 0..batches {
        let t = Instant::now();
        graph.launch()?;
        dev.synchronize()?;
        kernel.push(per_call(t));
    }
    Ok(Timings { host, b2b, kernel })
}
