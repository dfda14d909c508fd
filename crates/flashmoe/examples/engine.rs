//! A small decoder forward, run the way a Rust inference engine would run flashmoe: its
//! own context and stream, its own weights and activations in device memory, plans built
//! once, then every layer enqueued on that stream with no synchronisation until the end.
//!
//! ```text
//! cargo run --release --example engine -- [--layers 4] [--batch 4] [--seq 512] [--json OUT]
//! ```
//! Each layer: RMSNorm → QKV projection (cuBLAS) → attention (flashmoe, q/k/v read as
//! strided views of the packed QKV activations, GQA) → output projection (cuBLAS, the
//! residual added by beta = 1) → RMSNorm → MoE (flashmoe: router, top-2 of 8 experts,
//! SwiGLU experts, weighted combine) → residual add. No RoPE and random weights: the
//! point is the call pattern and its cost, not a trained model.
//!
//! It prints the host time of each library call (median over the forwards), the eager
//! forward's wall time, and the same forward captured once as a CUDA graph and replayed,
//! whose output must equal the eager output bit for bit.

use cudarc::cublas::{sys as cublas_sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use flashmoe::attention::{AttentionArgs, AttentionClass, AttentionPlan};
use flashmoe::gpu::{Device, RawTensor};
use flashmoe::DType;
use half::bf16;
use std::sync::Arc;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// RMSNorm over rows of `cols` bf16 values: y = x / sqrt(mean(x²) + eps) · g. One block
/// per row; self-contained (NVRTC has no CUDA headers): bf16 by bit operations.
const RMSNORM_SRC: &str = r#"
__device__ __forceinline__ float bf(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ unsigned short tobf(float f) {
    unsigned u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (unsigned short)(u >> 16);
}
extern "C" __global__ void rmsnorm(const unsigned short* __restrict__ x, const unsigned short* __restrict__ g,
                                   unsigned short* __restrict__ y, int cols, float eps) {
    const unsigned short* xr = x + (long long)blockIdx.x * cols;
    unsigned short* yr = y + (long long)blockIdx.x * cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) { float v = bf(xr[c]); ss += v * v; }
    __shared__ float red[32];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (threadIdx.x == 0) red[0] = t;
    }
    __syncthreads();
    const float inv = rsqrtf(red[0] / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = tobf(bf(xr[c]) * inv * bf(g[c]));
}
extern "C" __global__ void add_into(unsigned short* __restrict__ x, const unsigned short* __restrict__ y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = tobf(bf(x[i]) + bf(y[i]));
}
"#;

struct Args {
    layers: usize,
    batch: usize,
    seq: usize,
    json: Option<String>,
}

fn parse_args() -> Res<Args> {
    let mut a = Args {
        layers: 4,
        batch: 4,
        seq: 512,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--layers" => a.layers = val()?.parse()?,
            "--batch" => a.batch = val()?.parse()?,
            "--seq" => a.seq = val()?.parse()?,
            "--json" => a.json = Some(val()?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(a)
}

/// Model shape: hidden 2048, 16 query heads and 4 KV heads of 128, 8 experts of 1408, top-2.
const HIDDEN: usize = 2048;
const HEADS_Q: usize = 16;
const HEADS_KV: usize = 4;
const HEAD_DIM: usize = 128;

fn random_bf16(stream: &Arc<CudaStream>, n: usize, scale: f32, seed: u64) -> Res<CudaSlice<bf16>> {
    let mut s = seed;
    let v: Vec<bf16> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        })
        .collect();
    Ok(stream.clone_htod(&v)?)
}

/// Row-major `c[m, n] = a[m, k] · b[k, n] + beta · c` (cuBLAS is column-major: computes
/// cᵀ = bᵀ aᵀ).
fn matmul(
    blas: &CudaBlas,
    a: &CudaSlice<bf16>,
    b: &CudaSlice<bf16>,
    c: &mut CudaSlice<bf16>,
    (m, n, k): (usize, usize, usize),
    beta: f32,
) -> Res<()> {
    let cfg = GemmConfig {
        transa: cublas_sys::cublasOperation_t::CUBLAS_OP_N,
        transb: cublas_sys::cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: bf16::ONE,
        lda: n as i32,
        ldb: k as i32,
        beta: bf16::from_f32(beta),
        ldc: n as i32,
    };
    // SAFETY: a is m×k, b is k×n, c is m×n, allocated below with those sizes.
    unsafe { blas.gemm(cfg, b, a, c) }?;
    Ok(())
}

struct Layer {
    norm1: CudaSlice<bf16>,
    w_qkv: CudaSlice<bf16>,
    w_o: CudaSlice<bf16>,
    norm2: CudaSlice<bf16>,
    moe: moe_layer::MoeWeightsT,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

fn run() -> Res<()> {
    let a = parse_args()?;
    let tokens = a.batch * a.seq;
    // The engine's own context and stream; flashmoe borrows both.
    let ctx = CudaContext::new(0)?;
    // SAFETY: this engine orders all its work on one stream, so cudarc's cross-stream
    // event tracking is not needed (and its waits on events recorded before a capture
    // would break the CUDA-graph capture below).
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let dev = Device::from_context(ctx.clone())?;
    println!("{}", dev.info());
    let blas = CudaBlas::new(stream.clone())?;
    let norm_fn = dev.load_kernel_source("engine_rmsnorm.cu", RMSNORM_SRC, "rmsnorm", &[])?;
    let add_fn = dev.load_kernel_source("engine_rmsnorm.cu", RMSNORM_SRC, "add_into", &[])?;

    // Plans: once per shape class, before the first forward.
    let t0 = Instant::now();
    let class = AttentionClass {
        dtype: DType::Bf16,
        head_dim: HEAD_DIM,
        heads_q: HEADS_Q,
        heads_kv: HEADS_KV,
        causal: true,
        softmax_scale: None,
        window: flashmoe::problem::NO_WINDOW,
        softcap: 0.0,
    };
    let attn = AttentionPlan::new(&dev, class)?;
    let attn_ws = attn.alloc_workspace(&stream)?;
    let moe = moe_layer::MoeLayer::new(&dev, &stream, tokens)?;
    println!(
        "plans built in {:.1} ms (attention: {}, workspace {} B; MoE: {})",
        t0.elapsed().as_secs_f64() * 1e3,
        attn.variant().entry,
        attn.workspace_bytes(),
        moe.describe()
    );

    // Weights (random, scaled by 1/sqrt(fan-in)) and activations.
    let qkv_w = (HEADS_Q + 2 * HEADS_KV) * HEAD_DIM;
    let mut layers = Vec::new();
    for l in 0..a.layers {
        let seed = 1000 * l as u64 + 7;
        layers.push(Layer {
            norm1: random_bf16(&stream, HIDDEN, 1.0, seed)?,
            w_qkv: random_bf16(
                &stream,
                HIDDEN * qkv_w,
                1.0 / (HIDDEN as f32).sqrt(),
                seed + 1,
            )?,
            w_o: random_bf16(
                &stream,
                HEADS_Q * HEAD_DIM * HIDDEN,
                1.0 / ((HEADS_Q * HEAD_DIM) as f32).sqrt(),
                seed + 2,
            )?,
            norm2: random_bf16(&stream, HIDDEN, 1.0, seed + 3)?,
            moe: moe_layer::MoeWeightsT::random(&stream, seed + 4)?,
        });
    }
    let x0 = random_bf16(&stream, tokens * HIDDEN, 1.0, 99)?;
    let mut x = stream.alloc_zeros::<bf16>(tokens * HIDDEN)?;
    let mut h = stream.alloc_zeros::<bf16>(tokens * HIDDEN)?;
    let mut qkv = stream.alloc_zeros::<bf16>(tokens * qkv_w)?;
    let o = stream.alloc_zeros::<bf16>(tokens * HEADS_Q * HEAD_DIM)?;
    let lse = stream.alloc_zeros::<f32>(tokens * HEADS_Q)?;
    let mut m = stream.alloc_zeros::<bf16>(tokens * HIDDEN)?;

    // Raw views for the attention plan: q, k, v inside the packed qkv rows.
    let (b, s, d) = (a.batch, a.seq, HEAD_DIM);
    let base = qkv.device_ptr(&stream).0;
    let row = [s * qkv_w, qkv_w, d, 1];
    let view = |off: usize, heads: usize| {
        RawTensor::new(base + 2 * off as u64, DType::Bf16, &[b, s, heads, d], &row)
    };
    let attn_args = AttentionArgs {
        q: view(0, HEADS_Q)?,
        k: view(HEADS_Q * d, HEADS_KV)?,
        v: view((HEADS_Q + HEADS_KV) * d, HEADS_KV)?,
        o: RawTensor::contiguous(o.device_ptr(&stream).0, DType::Bf16, &[b, s, HEADS_Q, d])?,
        lse: RawTensor::contiguous(lse.device_ptr(&stream).0, DType::F32, &[b, HEADS_Q, s])?,
    };

    let rows_cfg = LaunchConfig {
        grid_dim: (tokens as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let n_elems = (tokens * HIDDEN) as i64;
    let add_cfg = LaunchConfig {
        grid_dim: (((tokens * HIDDEN) as u32).div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (hidden_i, eps) = (HIDDEN as i32, 1e-6f32);
    // Host time per library call kind, accumulated over a forward.
    let mut host = [0f64; 2]; // attention, moe
    let mut forward = |host: &mut [f64; 2], x: &mut CudaSlice<bf16>| -> Res<()> {
        stream.memcpy_dtod(&x0, x)?;
        for ly in &layers {
            let mut lb = stream.launch_builder(&norm_fn);
            lb.arg(&*x)
                .arg(&ly.norm1)
                .arg(&mut h)
                .arg(&hidden_i)
                .arg(&eps);
            unsafe { lb.launch(rows_cfg) }?;
            matmul(&blas, &h, &ly.w_qkv, &mut qkv, (tokens, qkv_w, HIDDEN), 0.0)?;
            let t = Instant::now();
            // SAFETY: the views lie inside qkv / o / lse, alive for the whole run; the
            // workspace is the plan's, used on this stream only.
            unsafe { attn.forward_raw(stream.cu_stream(), &attn_args, attn_ws.raw()) }?;
            host[0] += t.elapsed().as_secs_f64();
            matmul(
                &blas,
                &o,
                &ly.w_o,
                x,
                (tokens, HIDDEN, HEADS_Q * HEAD_DIM),
                1.0,
            )?;
            let mut lb = stream.launch_builder(&norm_fn);
            lb.arg(&*x)
                .arg(&ly.norm2)
                .arg(&mut h)
                .arg(&hidden_i)
                .arg(&eps);
            unsafe { lb.launch(rows_cfg) }?;
            let t = Instant::now();
            moe.forward(&stream, &ly.moe, &h, &mut m)?;
            host[1] += t.elapsed().as_secs_f64();
            let mut lb = stream.launch_builder(&add_fn);
            lb.arg(&mut *x).arg(&m).arg(&n_elems);
            unsafe { lb.launch(add_cfg) }?;
        }
        Ok(())
    };

    // Warm-up, then timed eager forwards.
    forward(&mut host, &mut x)?;
    stream.synchronize()?;
    let iters = 20;
    let (mut attn_us, mut moe_us, mut wall_ms) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..iters {
        let mut hcost = [0f64; 2];
        let t = Instant::now();
        forward(&mut hcost, &mut x)?;
        stream.synchronize()?;
        wall_ms.push(t.elapsed().as_secs_f64() * 1e3);
        attn_us.push(hcost[0] * 1e6 / a.layers as f64);
        moe_us.push(hcost[1] * 1e6 / a.layers as f64);
    }
    let eager: Vec<bf16> = stream.clone_dtoh(&x)?;
    if eager.iter().any(|v| !v.to_f32().is_finite()) {
        return Err("the forward produced NaN or inf".into());
    }

    // The same forward as one CUDA graph.
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    forward(&mut host, &mut x)?;
    let graph = stream
        .end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        )?
        .ok_or("empty graph")?;
    let mut graph_ms = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        graph.launch()?;
        stream.synchronize()?;
        graph_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let replayed: Vec<bf16> = stream.clone_dtoh(&x)?;
    let same = replayed
        .iter()
        .zip(&eager)
        .all(|(p, q)| p.to_bits() == q.to_bits());
    if !same {
        return Err("graph replay differs from the eager forward".into());
    }

    let med = |v: &mut Vec<f64>| {
        v.sort_by(|p, q| p.partial_cmp(q).unwrap());
        v[v.len() / 2]
    };
    let (ha, hm, w, g) = (
        med(&mut attn_us),
        med(&mut moe_us),
        med(&mut wall_ms),
        med(&mut graph_ms),
    );
    println!(
        "decoder: {} layers, batch {} x seq {} ({tokens} tokens), hidden {HIDDEN}, heads {HEADS_Q}/{HEADS_KV} x {HEAD_DIM}, MoE {}",
        a.layers,
        a.batch,
        a.seq,
        moe.describe()
    );
    println!("host time per call: attention {ha:.2} µs, MoE layer {hm:.2} µs (median of {iters} forwards)");
    println!("forward: eager {w:.3} ms, CUDA graph replay {g:.3} ms; graph output bit-identical to eager");
    if let Some(p) = a.json {
        std::fs::write(
            &p,
            format!(
                "{{\"schema\":\"flashmoe-engine-example/1\",\"device\":{:?},\"layers\":{},\"batch\":{},\"seq\":{},\"hidden\":{HIDDEN},\"heads_q\":{HEADS_Q},\"heads_kv\":{HEADS_KV},\"head_dim\":{HEAD_DIM},\"moe\":{:?},\"attention_host_us\":{ha:.3},\"moe_host_us\":{hm:.3},\"eager_ms\":{w:.4},\"graph_ms\":{g:.4},\"graph_bit_identical\":{same}}}\n",
                dev.info().to_string(),
                a.layers,
                a.batch,
                a.seq,
                moe.describe()
            ),
        )?;
    }
    Ok(())
}

/// The MoE part of the layer: weights in the engine's device memory, one plan for the
/// class, a workspace and routing outputs allocated once.
mod moe_layer {
    use super::{random_bf16, Res, HIDDEN};
    use cudarc::driver::{CudaSlice, CudaStream};
    use flashmoe::gpu::Device;
    use flashmoe::gpu::Workspace;
    use flashmoe::moe::{MoeClass, MoePlan, MoeRouting, MoeWeights};
    use flashmoe::{DType, Scoring};
    use half::bf16;
    use std::cell::RefCell;
    use std::sync::Arc;

    pub const EXPERTS: usize = 8;
    pub const INTERMEDIATE: usize = 1408;
    pub const TOP_K: usize = 2;

    /// router [H, E], w13 [E, H, 2I] (gate | up), w2 [E, I, H].
    pub struct MoeWeightsOwned {
        router: CudaSlice<bf16>,
        w13: CudaSlice<bf16>,
        w2: CudaSlice<bf16>,
    }
    pub type MoeWeightsT = MoeWeightsOwned;

    impl MoeWeightsOwned {
        pub fn random(stream: &Arc<CudaStream>, seed: u64) -> Res<Self> {
            let (h, i, e) = (HIDDEN, INTERMEDIATE, EXPERTS);
            Ok(MoeWeightsOwned {
                router: random_bf16(stream, h * e, 1.0 / (h as f32).sqrt(), seed)?,
                w13: random_bf16(stream, e * h * 2 * i, 1.0 / (h as f32).sqrt(), seed + 1)?,
                w2: random_bf16(stream, e * i * h, 1.0 / (i as f32).sqrt(), seed + 2)?,
            })
        }
    }

    pub struct MoeLayer {
        plan: MoePlan,
        tokens: usize,
        routing: RefCell<MoeRouting>,
        workspace: RefCell<Workspace>,
    }

    impl MoeLayer {
        pub fn new(dev: &Device, stream: &Arc<CudaStream>, tokens: usize) -> Res<Self> {
            let class = MoeClass {
                dtype: DType::Bf16,
                hidden: HIDDEN,
                intermediate: INTERMEDIATE,
                experts: EXPERTS,
                top_k: TOP_K,
                scoring: Scoring::Softmax,
                renormalize: true,
                shared_expert: false,
                max_tokens: tokens,
            };
            let plan = MoePlan::new(dev, class)?;
            let routing = RefCell::new(plan.alloc_routing(stream)?);
            let workspace = RefCell::new(plan.alloc_workspace(stream)?);
            Ok(MoeLayer {
                plan,
                tokens,
                routing,
                workspace,
            })
        }

        pub fn describe(&self) -> String {
            format!(
                "{EXPERTS} experts x {INTERMEDIATE}, top-{TOP_K}; {}",
                self.plan.gemm_path(self.tokens).unwrap_or_default()
            )
        }

        /// out = MoE(x): router, permutation, grouped SwiGLU GEMMs, combine.
        pub fn forward(
            &self,
            stream: &Arc<CudaStream>,
            w: &MoeWeightsOwned,
            x: &CudaSlice<bf16>,
            out: &mut CudaSlice<bf16>,
        ) -> Res<()> {
            let weights = MoeWeights {
                router: &w.router,
                w13: &w.w13,
                w2: &w.w2,
                shared: None,
            };
            self.plan.forward(
                stream,
                x,
                self.tokens,
                &weights,
                out,
                &mut self.routing.borrow_mut(),
                &mut self.workspace.borrow_mut(),
            )?;
            Ok(())
        }
    }
}
