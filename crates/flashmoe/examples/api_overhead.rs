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
//! Medians; the JSON holds every batch. No GPU: exits 2 with the reason.

use cudarc::driver::sys;
use flashmoe::attention::{self, AttentionArgs, AttentionClass, AttentionPlan};
use flashmoe::gpu::{Device, DeviceTensor};
use flashmoe::DType;
use std::time::Instant;

const BATCHES: usize = 20;
const CALLS: usize = 200;

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
        let call = || unsafe { plan.forward_raw(cu, &args, ws.addr()) };
        for _ in 0..50 {
            call()?;
        }
        dev.synchronize()?;

        // Host time per plan call (enqueue only), and back-to-back wall time per call.
        let (mut host, mut b2b) = (Vec::new(), Vec::new());
        for _ in 0..BATCHES {
            let t = Instant::now();
            for _ in 0..CALLS {
                call()?;
            }
            host.push(t.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
            dev.synchronize()?;
            b2b.push(t.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
        }
        // The kernel's own time: a graph of CALLS launches, replayed.
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        for _ in 0..CALLS {
            call()?;
        }
        let graph = stream
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )?
            .ok_or("empty graph")?;
        graph.launch()?;
        dev.synchronize()?;
        let mut kernel = Vec::new();
        for _ in 0..BATCHES {
            let t = Instant::now();
            graph.launch()?;
            dev.synchronize()?;
            kernel.push(t.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
        }
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
    let json = format!(
        "{{\"schema\":\"flashmoe-api-overhead/1\",\"device\":{:?},\"calls_per_batch\":{CALLS},\"batches\":{BATCHES},\"attention\":[{}]}}\n",
        dev.info().to_string(),
        rows.join(",")
    );
    match out {
        Some(p) => std::fs::write(&p, json)?,
        None => print!("{json}"),
    }
    Ok(())
}
