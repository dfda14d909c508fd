//! The MoE layer on the GPU: router, dropless permutation, grouped SwiGLU GEMMs, combine.
//! Kernel selection and the kernel ABI live in [`config`] (the contract at its top);
//! grouped-GEMM variants in [`gemm_config`]; the GPU fp32 reference in [`reference`].
//!
//! ```ignore
//! let mut r = MoeRunner::new(&dev, &problem, &inputs)?;   // upload, compile, validate
//! r.poison_outputs(&dev)?;
//! r.run(&dev)?;                                            // 7 (+2 shared) launches, no sync
//! let out = r.output(&dev)?;                               // [T, H] as f32
//! let routing = r.routing(&dev)?;                          // ids, weights, counts, losses
//! ```
//!
//! Shared expert: supported, as a one-expert group of all tokens through the same grouped
//! GEMM kernels (see the contract); its output is added by the combine with weight 1.
// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

pub mod config;
pub mod gemm_config;
pub mod gemm_sm90;
#[cfg(test)]
mod gpu_tests;
pub mod reference;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::{check_len, Device, DeviceTensor};
use crate::problem::MoeProblem;
use crate::reference::moe::MoeInputs;
use config::{MoeKernel, BACKEND};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtrMut, LaunchConfig, PushKernelArg};

/// CUDA grid limits (x, y).
const MAX_GRID_X: u64 = i32::MAX as u64;
const MAX_GRID_Y: u64 = 65_535;

/// Element counts of the MoE inputs of `p`, overflow checked (InvalidProblem).
fn elems(name: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| {
            Error::invalid(format!(
                "{name} of shape {dims:?} has too many elements for usize"
            ))
        })
}

/// Check `inputs` against `p`: every tensor's length (BufferSize naming it), and the
/// shared-expert weights present exactly when needed.
pub fn check_inputs(p: &MoeProblem, x: &MoeInputs) -> Result<()> {
    p.validate()?;
    let (t, h, i, e) = (p.tokens, p.hidden, p.intermediate, p.experts);
    check_len("x", elems("x", &[t, h])?, x.x.len())?;
    check_len("router", elems("router", &[h, e])?, x.router.len())?;
    check_len("w13", elems("w13", &[e, h, 2, i])?, x.w13.len())?;
    check_len("w2", elems("w2", &[e, i, h])?, x.w2.len())?;
    if p.shared_expert {
        let (Some(sw13), Some(sw2)) = (&x.shared_w13, &x.shared_w2) else {
            return Err(Error::invalid(format!(
                "{p}: shared_expert is set but the shared expert weights (shared_w13, shared_w2) are missing"
            )));
        };
        check_len("shared_w13", elems("shared_w13", &[h, 2, i])?, sw13.len())?;
        check_len("shared_w2", elems("shared_w2", &[i, h])?, sw2.len())?;
    }
    Ok(())
}

fn grid_1d(kernel: &MoeKernel, blocks: u64, gy: u64) -> Result<LaunchConfig> {
    if kernel.block_threads == 0 {
        return Err(Error::unsupported(
            kernel.entry,
            "kernel variant has zero block_threads",
        ));
    }
    if blocks > MAX_GRID_X || gy > MAX_GRID_Y {
        return Err(Error::unsupported(
            kernel.entry,
            format!(
                "grid ({blocks}, {gy}) exceeds the CUDA grid limit ({MAX_GRID_X}, {MAX_GRID_Y})"
            ),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (blocks.max(1) as u32, gy.max(1) as u32, 1),
        block_dim: (kernel.block_threads, 1, 1),
        shared_mem_bytes: kernel.shared_mem_bytes,
    })
}

/// Launch geometry of a grouped GEMM over `rows` permuted rows of `experts` groups with
/// `n` output columns (contract step 5/6): grid.x = ceil(rows / block_m) + experts,
/// grid.y = n / block_n (n must be a multiple of block_n).
pub fn gemm_launch_config(
    k: &MoeKernel,
    rows: usize,
    experts: usize,
    n: usize,
) -> Result<LaunchConfig> {
    if k.block_m == 0 || k.block_n == 0 {
        return Err(Error::unsupported(
            k.entry,
            "kernel variant has a zero block_m or block_n",
        ));
    }
    if n % k.block_n as usize != 0 {
        return Err(Error::unsupported(
            k.entry,
            format!(
                "{n} output columns are not a multiple of the tile width {}",
                k.block_n
            ),
        ));
    }
    let gx = (rows as u64).div_ceil(k.block_m as u64) + experts as u64;
    grid_1d(k, gx, (n / k.block_n as usize) as u64)
}

/// Launch geometry of every kernel of [`config::select`] (same order) for `p`, per the
/// contract in [`config`].
pub fn launch_configs(p: &MoeProblem, kernels: &[MoeKernel]) -> Result<Vec<LaunchConfig>> {
    config::check_limits(p)?;
    if kernels.len() != 7 {
        return Err(Error::unsupported(
            BACKEND,
            format!("expected 7 pipeline kernels, got {}", kernels.len()),
        ));
    }
    let (t, e, k) = (p.tokens as u64, p.experts as u64, p.top_k as u64);
    let logits_kernel = &kernels[config::K_LOGITS];
    let logits_cfg = match logits_kernel.entry {
        gemm_config::GEMM2_ENTRY => gemm_launch_config(logits_kernel, p.tokens, 1, p.experts)?,
        config::LOGITS_SMALL_ENTRY => grid_1d(
            logits_kernel,
            (t * e).div_ceil(config::LOGITS_THREADS as u64),
            1,
        )?,
        _ => grid_1d(
            logits_kernel,
            t.div_ceil(config::tiled_logits_tokens_per_block(p.experts)),
            1,
        )?,
    };
    let topk_tokens = config::TOPK_THREADS as u64 / 32;
    let rows = (t * k) as usize;
    Ok(vec![
        logits_cfg,
        grid_1d(&kernels[config::K_TOPK], t.div_ceil(topk_tokens), 1)?,
        grid_1d(&kernels[config::K_STATS], e + 1, 1)?,
        grid_1d(&kernels[config::K_PERMUTE], e, 1)?,
        gemm_launch_config(&kernels[config::K_GEMM13], rows, p.experts, p.intermediate)?,
        gemm_launch_config(&kernels[config::K_GEMM2], rows, p.experts, p.hidden)?,
        grid_1d(&kernels[config::K_COMBINE], t, 1)?,
    ])
}

fn alloc_u32(dev: &Device, name: &str, len: usize) -> Result<CudaSlice<u32>> {
    dev.stream()
        .alloc_zeros::<u32>(len.max(1))
        .map_err(|e| Error::cuda(format!("allocating {name} ({len} × u32) on the GPU"), e))
}

fn upload_u32(dev: &Device, name: &str, v: &[u32]) -> Result<CudaSlice<u32>> {
    dev.stream().clone_htod(v).map_err(|e| {
        Error::cuda(
            format!("uploading {name} ({} × u32) to the GPU", v.len()),
            e,
        )
    })
}

fn download_u32(dev: &Device, name: &str, s: &CudaSlice<u32>, len: usize) -> Result<Vec<u32>> {
    let stream = dev.stream();
    let ctx = |e| Error::cuda(format!("downloading {name} ({len} × u32) from the GPU"), e);
    let mut v = stream.clone_dtoh(s).map_err(ctx)?;
    stream.synchronize().map_err(ctx)?;
    v.truncate(len);
    Ok(v)
}

/// Fill a u32 buffer with 0xFFFFFFFF (an id / row no kernel writes), ordered on the stream.
fn poison_u32(dev: &Device, s: &mut CudaSlice<u32>) -> Result<()> {
    let stream = dev.stream();
    let cu_stream = stream.cu_stream();
    let len = s.len();
    let (ptr, _rec) = s.device_ptr_mut(stream);
    // SAFETY: the pointer covers exactly `len` 32-bit elements.
    unsafe { cudarc::driver::sys::cuMemsetD32Async(ptr, u32::MAX, len, cu_stream).result() }
        .map_err(|e| Error::cuda("cuMemsetD32Async (poison)", e))
}

/// The router's decisions and statistics as computed on the GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuRouting {
    /// [T, k] expert ids, descending score.
    pub topk_ids: Vec<u32>,
    /// [T, k] combine weights.
    pub topk_w: Vec<f32>,
    /// [E] slots routed to each expert (sums to T·k).
    pub counts: Vec<u32>,
    pub aux_loss: f64,
    pub z_loss: f64,
}

impl GpuRouting {
    /// (max load, mean load, coefficient of variation) of the per-expert token counts.
    pub fn load_stats(&self) -> (u32, f64, f64) {
        load_stats(&self.counts)
    }
}

/// (max, mean, coefficient of variation = std / mean) of per-expert counts.
pub fn load_stats(counts: &[u32]) -> (u32, f64, f64) {
    if counts.is_empty() {
        return (0, 0.0, 0.0);
    }
    let n = counts.len() as f64;
    let mean = counts.iter().map(|&c| c as f64).sum::<f64>() / n;
    let var = counts
        .iter()
        .map(|&c| (c as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    let cv = if mean > 0.0 { var.sqrt() / mean } else { 0.0 };
    (counts.iter().copied().max().unwrap_or(0), mean, cv)
}

/// A description of where GPU routing ids differ from the reference's (`None` when
/// identical): how many tokens differ and the first few, with both id lists. Strict on
/// purpose (the GPU tests use it on small shapes with exactly tied experts, to test the
/// tie-break); the bench/check gate uses `reference::moe::compare_routing`, which also
/// accepts near ties.
pub fn routing_mismatch(gpu: &[u32], reference: &[u32], top_k: usize) -> Option<String> {
    if gpu.len() != reference.len() {
        return Some(format!(
            "routing has {} ids on the GPU but {} in the reference",
            gpu.len(),
            reference.len()
        ));
    }
    let k = top_k.max(1);
    let bad: Vec<usize> = gpu
        .chunks(k)
        .zip(reference.chunks(k))
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(t, _)| t)
        .collect();
    if bad.is_empty() {
        return None;
    }
    let shown: Vec<String> = bad
        .iter()
        .take(4)
        .map(|&t| {
            format!(
                "token {t}: GPU {:?} vs reference {:?}",
                &gpu[t * k..(t + 1) * k],
                &reference[t * k..(t + 1) * k]
            )
        })
        .collect();
    Some(format!(
        "routing differs for {} of {} tokens ({}){}",
        bad.len(),
        gpu.len() / k,
        shown.join("; "),
        " — near-ties: the GPU ranks fp32 logits, the reference f64 scores"
    ))
}

/// (topk_ids, topk_w, counts, aux_loss, z_loss), see [`MoeRunner::routing`].
pub type RoutingTuple = (Vec<u32>, Vec<f32>, Vec<u32>, f64, f64);
/// (offsets, row_token, row_slot, slot_row), see [`MoeRunner::permutation`].
pub type Permutation = (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>);

/// Shared-expert buffers: a one-expert group of all tokens.
struct SharedExpert {
    w13: DeviceTensor,
    w2: DeviceTensor,
    row_token: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    h: DeviceTensor,
    y: DeviceTensor,
    cfg13: LaunchConfig,
    cfg2: LaunchConfig,
}

/// Owns the device buffers of one MoE problem and the resolved pipeline kernels.
pub struct MoeRunner {
    problem: MoeProblem,
    kernels: Vec<MoeKernel>,
    funcs: Vec<CudaFunction>,
    cfgs: Vec<LaunchConfig>,
    x: DeviceTensor,
    router: DeviceTensor,
    w13: DeviceTensor,
    w2: DeviceTensor,
    shared: Option<SharedExpert>,
    logits: DeviceTensor,
    /// [0, T]: the one-group offsets of the router-logits GEMM.
    router_offsets: CudaSlice<u32>,
    probs: DeviceTensor,
    lse: DeviceTensor,
    topk_ids: CudaSlice<u32>,
    topk_w: DeviceTensor,
    counts: CudaSlice<u32>,
    prob_sum: DeviceTensor,
    lse_sq_sum: DeviceTensor,
    offsets: CudaSlice<u32>,
    row_token: CudaSlice<u32>,
    row_slot: CudaSlice<u32>,
    slot_row: CudaSlice<u32>,
    h: DeviceTensor,
    y: DeviceTensor,
    out: DeviceTensor,
    /// The sm_90 grouped GEMMs for the routed experts, when selected.
    sm90: Option<gemm_sm90::Sm90Gemms>,
    /// Why the routed experts run on the portable kernels (None on the sm_90 path).
    portable_reason: Option<String>,
}

impl std::fmt::Debug for MoeRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeRunner")
            .field("problem", &self.problem)
            .field(
                "kernels",
                &self.kernels.iter().map(|k| k.entry).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl MoeRunner {
    /// Validate `problem` and `inputs`, select and compile the kernels for this device,
    /// upload the inputs (rounded to the problem's dtype) and allocate every buffer.
    /// The grouped-GEMM path follows `FLASHMOE_MOE_GEMM` (see [`gemm_sm90`]).
    pub fn new(dev: &Device, problem: &MoeProblem, inputs: &MoeInputs) -> Result<MoeRunner> {
        let env = std::env::var(gemm_sm90::PATH_ENV).ok();
        Self::with_gemm_path(dev, problem, inputs, env.as_deref())
    }

    /// Like [`MoeRunner::new`] with the path override given explicitly ("auto",
    /// "portable", "sm90").
    pub fn with_gemm_path(
        dev: &Device,
        problem: &MoeProblem,
        inputs: &MoeInputs,
        path: Option<&str>,
    ) -> Result<MoeRunner> {
        check_inputs(problem, inputs)?;
        let kernels = config::select(problem)?;
        let cfgs = launch_configs(problem, &kernels)?;
        let mut funcs = Vec::with_capacity(kernels.len());
        for k in &kernels {
            if dev.arch() < k.min_arch {
                return Err(Error::unsupported(
                    k.entry,
                    format!(
                        "needs compute capability {}.{} or newer but {} is {}.{}",
                        k.min_arch / 10,
                        k.min_arch % 10,
                        dev.info().name,
                        dev.info().compute_capability.0,
                        dev.info().compute_capability.1
                    ),
                ));
            }
            let f = dev.load_kernel(k.source_file, k.entry, &k.defines)?;
            dev.set_dynamic_shared_memory(k.entry, &f, k.shared_mem_bytes)?;
            funcs.push(f);
        }
        let p = problem;
        let dt = p.dtype;
        let (t, h, i, e, k) = (p.tokens, p.hidden, p.intermediate, p.experts, p.top_k);
        let rows = t * k;
        let shared = if p.shared_expert {
            let (Some(sw13), Some(sw2)) = (&inputs.shared_w13, &inputs.shared_w2) else {
                unreachable!("checked by check_inputs")
            };
            let ids: Vec<u32> = (0..t as u32).collect();
            Some(SharedExpert {
                w13: DeviceTensor::from_f32(dev, dt, sw13)?,
                w2: DeviceTensor::from_f32(dev, dt, sw2)?,
                row_token: upload_u32(dev, "shared row_token", &ids)?,
                offsets: upload_u32(dev, "shared offsets", &[0, t as u32])?,
                h: DeviceTensor::alloc(dev, dt, elems("shared h", &[t, i])?)?,
                y: DeviceTensor::alloc(dev, DType::F32, elems("shared y", &[t, h])?)?,
                cfg13: gemm_launch_config(&kernels[config::K_GEMM13], t, 1, i)?,
                cfg2: gemm_launch_config(&kernels[config::K_GEMM2], t, 1, h)?,
            })
        } else {
            None
        };
        let w13 = DeviceTensor::from_f32(dev, dt, &inputs.w13)?;
        let w2 = DeviceTensor::from_f32(dev, dt, &inputs.w2)?;
        let h_buf = DeviceTensor::alloc(dev, dt, elems("h", &[rows, i])?)?;
        let (sm90, portable_reason) = match gemm_sm90::select_path(p, dev.arch(), path)? {
            gemm_sm90::GemmPath::Sm90(k13, k2) => (
                Some(gemm_sm90::Sm90Gemms::new(
                    dev,
                    p,
                    (k13, k2),
                    &w13,
                    &w2,
                    &h_buf,
                )?),
                None,
            ),
            gemm_sm90::GemmPath::Portable(why) => (None, Some(why)),
        };
        Ok(MoeRunner {
            problem: p.clone(),
            x: DeviceTensor::from_f32(dev, dt, &inputs.x)?,
            router: DeviceTensor::from_f32(dev, dt, &inputs.router)?,
            w13,
            w2,
            shared,
            logits: DeviceTensor::alloc(dev, DType::F32, t * e)?,
            router_offsets: upload_u32(dev, "router offsets", &[0, t as u32])?,
            probs: DeviceTensor::alloc(dev, DType::F32, t * e)?,
            lse: DeviceTensor::alloc(dev, DType::F32, t)?,
            topk_ids: alloc_u32(dev, "topk_ids", rows)?,
            topk_w: DeviceTensor::alloc(dev, DType::F32, rows)?,
            counts: alloc_u32(dev, "counts", e)?,
            prob_sum: DeviceTensor::alloc(dev, DType::F32, e)?,
            lse_sq_sum: DeviceTensor::alloc(dev, DType::F32, 1)?,
            offsets: alloc_u32(dev, "offsets", e + 1)?,
            row_token: alloc_u32(dev, "row_token", rows)?,
            row_slot: alloc_u32(dev, "row_slot", rows)?,
            slot_row: alloc_u32(dev, "slot_row", rows)?,
            h: h_buf,
            y: DeviceTensor::alloc(dev, DType::F32, elems("y", &[rows, h])?)?,
            out: DeviceTensor::alloc(dev, dt, elems("out", &[t, h])?)?,
            sm90,
            portable_reason,
            kernels,
            funcs,
            cfgs,
        })
    }

    pub fn problem(&self) -> &MoeProblem {
        &self.problem
    }
    /// The kernels in pipeline order (see [`config::select`]).
    pub fn kernels(&self) -> &[MoeKernel] {
        &self.kernels
    }
    pub fn launch_configs(&self) -> &[LaunchConfig] {
        &self.cfgs
    }

    /// Device bytes of the intermediate buffers (everything but inputs and `out`).
    pub fn workspace_bytes(&self) -> u64 {
        let mut b = [
            &self.logits,
            &self.probs,
            &self.lse,
            &self.topk_w,
            &self.prob_sum,
            &self.lse_sq_sum,
            &self.h,
            &self.y,
        ]
        .iter()
        .map(|t| t.size_bytes() as u64)
        .sum::<u64>();
        b += 4
            * (self.topk_ids.len()
                + self.counts.len()
                + self.router_offsets.len()
                + self.offsets.len()
                + self.row_token.len()
                + self.row_slot.len()
                + self.slot_row.len()) as u64;
        if let Some(s) = &self.shared {
            b += (s.h.size_bytes() + s.y.size_bytes()) as u64 + 4 * (s.row_token.len() + 2) as u64;
        }
        if let Some(g) = &self.sm90 {
            b += g.workspace_bytes();
        }
        b
    }

    /// Which grouped-GEMM kernels the routed experts use, for reports: the sm_90 entries,
    /// or the portable ones with the reason the sm_90 path was not taken.
    pub fn gemm_path(&self) -> String {
        match (&self.sm90, &self.portable_reason) {
            (Some(g), _) => format!(
                "grouped GEMMs: {} (BM {} BN {}) + {} (BM {} BN {}), wgmma/TMA",
                g.kernels[1].entry,
                g.kernels[1].block_m,
                g.kernels[1].block_n,
                g.kernels[2].entry,
                g.kernels[2].block_m,
                g.kernels[2].block_n
            ),
            (None, why) => format!(
                "grouped GEMMs: {} (BM {} BN {}) + {} (BM {} BN {}), mma.sync ({})",
                self.kernels[config::K_GEMM13].entry,
                self.kernels[config::K_GEMM13].block_m,
                self.kernels[config::K_GEMM13].block_n,
                self.kernels[config::K_GEMM2].entry,
                self.kernels[config::K_GEMM2].block_m,
                self.kernels[config::K_GEMM2].block_n,
                why.as_deref().unwrap_or("")
            ),
        }
    }

    /// Enqueue the router alone (contract steps 1–3: logits, scoring + top-k, per-expert
    /// statistics): timed separately to report the router's share of the layer.
    pub fn run_router(&mut self, dev: &Device) -> Result<()> {
        let p = &self.problem;
        let (t, hid, e, k) = (
            p.tokens as i32,
            p.hidden as i32,
            p.experts as i32,
            p.top_k as i32,
        );
        let stream = dev.stream();
        let name = |i: usize| self.kernels[i].entry;

        // 1. logits
        {
            let mut b = stream.launch_builder(&self.funcs[config::K_LOGITS]);
            if self.kernels[config::K_LOGITS].entry == gemm_config::GEMM2_ENTRY {
                // One-group moe_gemm2: (A = x, offsets [0, T], B = router, y = logits,
                // N = E, K = H, 1 group).
                let one = 1i32;
                b.arg(self.x.as_u16("x")?)
                    .arg(&self.router_offsets)
                    .arg(self.router.as_u16("router")?)
                    .arg(self.logits.as_f32_mut("logits")?)
                    .arg(&e)
                    .arg(&hid)
                    .arg(&one);
                // SAFETY: moe_gemm2's contract (config.rs step 6) with one group of T rows.
                let r = unsafe { b.launch(self.cfgs[config::K_LOGITS]) };
                dev.check_launch("moe_gemm2 (router logits)", r)?;
            } else {
                b.arg(self.x.as_u16("x")?)
                    .arg(self.router.as_u16("router")?)
                    .arg(self.logits.as_f32_mut("logits")?)
                    .arg(&t)
                    .arg(&hid)
                    .arg(&e);
                // SAFETY: arguments follow the contract in config.rs; buffers sized for p.
                let r = unsafe { b.launch(self.cfgs[config::K_LOGITS]) };
                dev.check_launch(name(config::K_LOGITS), r)?;
            }
        }
        // 2. scoring + top-k
        {
            let mut b = stream.launch_builder(&self.funcs[config::K_TOPK]);
            b.arg(self.logits.as_f32("logits")?)
                .arg(&mut self.topk_ids)
                .arg(self.topk_w.as_f32_mut("topk_w")?)
                .arg(self.probs.as_f32_mut("probs")?)
                .arg(self.lse.as_f32_mut("lse")?)
                .arg(&t)
                .arg(&e)
                .arg(&k);
            // SAFETY: as above.
            let r = unsafe { b.launch(self.cfgs[config::K_TOPK]) };
            dev.check_launch(name(config::K_TOPK), r)?;
        }
        // 3. per-expert statistics
        {
            let mut b = stream.launch_builder(&self.funcs[config::K_STATS]);
            b.arg(&self.topk_ids)
                .arg(self.probs.as_f32("probs")?)
                .arg(self.lse.as_f32("lse")?)
                .arg(&mut self.counts)
                .arg(self.prob_sum.as_f32_mut("prob_sum")?)
                .arg(self.lse_sq_sum.as_f32_mut("lse_sq_sum")?)
                .arg(&t)
                .arg(&e)
                .arg(&k);
            // SAFETY: as above.
            let r = unsafe { b.launch(self.cfgs[config::K_STATS]) };
            dev.check_launch(name(config::K_STATS), r)?;
        }
        Ok(())
    }

    /// Enqueue the whole forward pipeline on the device stream (no sync, no validation).
    pub fn run(&mut self, dev: &Device) -> Result<()> {
        self.run_router(dev)?;
        let p = &self.problem;
        let (t, hid, inter, e, k) = (
            p.tokens as i32,
            p.hidden as i32,
            p.intermediate as i32,
            p.experts as i32,
            p.top_k as i32,
        );
        let stream = dev.stream();
        let name = |i: usize| self.kernels[i].entry;

        // 4. permutation
        {
            let mut b = stream.launch_builder(&self.funcs[config::K_PERMUTE]);
            b.arg(&self.topk_ids)
                .arg(&self.counts)
                .arg(&mut self.offsets)
                .arg(&mut self.row_token)
                .arg(&mut self.row_slot)
                .arg(&mut self.slot_row)
                .arg(&t)
                .arg(&e)
                .arg(&k);
            // SAFETY: as above.
            let r = unsafe { b.launch(self.cfgs[config::K_PERMUTE]) };
            dev.check_launch(name(config::K_PERMUTE), r)?;
        }
        // 5-6. grouped GEMMs (routed experts, then the shared expert as one group)
        if let Some(g) = &mut self.sm90 {
            g.launch(
                dev,
                &self.x,
                &self.row_token,
                &self.offsets,
                &mut self.h,
                &mut self.y,
                (hid, inter, e),
            )?;
        } else {
            launch_gemms(
                dev,
                &self.funcs,
                &self.kernels,
                (self.cfgs[config::K_GEMM13], self.cfgs[config::K_GEMM2]),
                &self.x,
                &self.row_token,
                &self.offsets,
                (&self.w13, &self.w2),
                &mut self.h,
                &mut self.y,
                (hid, inter, e),
            )?;
        }
        if let Some(s) = &mut self.shared {
            launch_gemms(
                dev,
                &self.funcs,
                &self.kernels,
                (s.cfg13, s.cfg2),
                &self.x,
                &s.row_token,
                &s.offsets,
                (&s.w13, &s.w2),
                &mut s.h,
                &mut s.y,
                (hid, inter, 1),
            )?;
        }
        // 7. combine
        {
            let shared_y = match &self.shared {
                Some(s) => s.y.as_f32("shared y")?,
                None => self.y.as_f32("y")?, // not read (FM_SHARED=0)
            };
            let mut b = stream.launch_builder(&self.funcs[config::K_COMBINE]);
            b.arg(self.y.as_f32("y")?)
                .arg(&self.slot_row)
                .arg(self.topk_w.as_f32("topk_w")?)
                .arg(shared_y)
                .arg(self.out.as_u16_mut("out")?)
                .arg(&t)
                .arg(&hid)
                .arg(&k);
            // SAFETY: as above.
            let r = unsafe { b.launch(self.cfgs[config::K_COMBINE]) };
            dev.check_launch(name(config::K_COMBINE), r)?;
        }
        Ok(())
    }

    /// Fill the output and every intermediate buffer with NaN / 0xFFFFFFFF so that an
    /// element a kernel fails to write is detected.
    pub fn poison_outputs(&mut self, dev: &Device) -> Result<()> {
        for t in [
            &mut self.out,
            &mut self.logits,
            &mut self.probs,
            &mut self.lse,
            &mut self.topk_w,
            &mut self.prob_sum,
            &mut self.lse_sq_sum,
            &mut self.h,
            &mut self.y,
        ] {
            t.poison(dev)?;
        }
        for s in [
            &mut self.topk_ids,
            &mut self.counts,
            &mut self.offsets,
            &mut self.row_token,
            &mut self.row_slot,
            &mut self.slot_row,
        ] {
            poison_u32(dev, s)?;
        }
        if let Some(s) = &mut self.shared {
            s.h.poison(dev)?;
            s.y.poison(dev)?;
        }
        Ok(())
    }

    /// Download the output [T, H] as f32 (waits for the stream).
    pub fn output(&self, dev: &Device) -> Result<Vec<f32>> {
        self.out.to_f32(dev)
    }

    /// Download the router's results: (topk_ids, topk_w, counts, aux_loss, z_loss)
    /// (waits for the stream). Losses are finished in f64 from the GPU's per-expert sums.
    pub fn routing(&self, dev: &Device) -> Result<RoutingTuple> {
        let r = self.gpu_routing(dev)?;
        Ok((r.topk_ids, r.topk_w, r.counts, r.aux_loss, r.z_loss))
    }

    /// [`MoeRunner::routing`] as a struct.
    pub fn gpu_routing(&self, dev: &Device) -> Result<GpuRouting> {
        let p = &self.problem;
        let rows = p.tokens * p.top_k;
        let topk_ids = download_u32(dev, "topk_ids", &self.topk_ids, rows)?;
        let counts = download_u32(dev, "counts", &self.counts, p.experts)?;
        let topk_w = self.topk_w.to_f32(dev)?;
        let prob_sum = self.prob_sum.to_f32(dev)?;
        let lse_sq = self.lse_sq_sum.to_f32(dev)?[0] as f64;
        let (t, e) = (p.tokens as f64, p.experts as f64);
        let aux_loss = e * counts
            .iter()
            .zip(&prob_sum)
            .map(|(&c, &ps)| (c as f64 / (t * p.top_k as f64)) * (ps as f64 / t))
            .sum::<f64>();
        Ok(GpuRouting {
            topk_ids,
            topk_w,
            counts,
            aux_loss,
            z_loss: lse_sq / t,
        })
    }

    /// Download the permutation (offsets [E+1], row_token, row_slot, slot_row), for tests.
    pub fn permutation(&self, dev: &Device) -> Result<Permutation> {
        let rows = self.problem.tokens * self.problem.top_k;
        Ok((
            download_u32(dev, "offsets", &self.offsets, self.problem.experts + 1)?,
            download_u32(dev, "row_token", &self.row_token, rows)?,
            download_u32(dev, "row_slot", &self.row_slot, rows)?,
            download_u32(dev, "slot_row", &self.slot_row, rows)?,
        ))
    }
}

/// Enqueue gemm13 then gemm2 for one group set (contract steps 5 and 6).
#[allow(clippy::too_many_arguments)]
fn launch_gemms(
    dev: &Device,
    funcs: &[CudaFunction],
    kernels: &[MoeKernel],
    cfgs: (LaunchConfig, LaunchConfig),
    x: &DeviceTensor,
    row_token: &CudaSlice<u32>,
    offsets: &CudaSlice<u32>,
    w: (&DeviceTensor, &DeviceTensor),
    h: &mut DeviceTensor,
    y: &mut DeviceTensor,
    dims: (i32, i32, i32),
) -> Result<()> {
    let stream = dev.stream();
    let (hid, inter, experts) = dims;
    {
        let mut b = stream.launch_builder(&funcs[config::K_GEMM13]);
        b.arg(x.as_u16("x")?)
            .arg(row_token)
            .arg(offsets)
            .arg(w.0.as_u16("w13")?)
            .arg(h.as_u16_mut("h")?)
            .arg(&hid)
            .arg(&inter)
            .arg(&experts);
        // SAFETY: arguments follow the contract in config.rs; buffers sized for the group.
        let r = unsafe { b.launch(cfgs.0) };
        dev.check_launch(kernels[config::K_GEMM13].entry, r)?;
    }
    let mut b = stream.launch_builder(&funcs[config::K_GEMM2]);
    b.arg(h.as_u16("h")?)
        .arg(offsets)
        .arg(w.1.as_u16("w2")?)
        .arg(y.as_f32_mut("y")?)
        .arg(&hid)
        .arg(&inter)
        .arg(&experts);
    // SAFETY: as above.
    let r = unsafe { b.launch(cfgs.1) };
    dev.check_launch(kernels[config::K_GEMM2].entry, r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Scoring;

    fn problem() -> MoeProblem {
        MoeProblem {
            tokens: 100,
            hidden: 256,
            intermediate: 128,
            experts: 40,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        }
    }

    fn gemm(entry: &'static str) -> MoeKernel {
        MoeKernel {
            source_file: "moe_grouped_gemm.cu",
            entry,
            defines: vec![],
            block_m: 64,
            block_n: 64,
            block_threads: 128,
            shared_mem_bytes: 64 * 1024,
            min_arch: 80,
        }
    }

    fn kernels(p: &MoeProblem) -> Vec<MoeKernel> {
        let mut v = config::non_gemm_variants(p.dtype, p.scoring, p.renormalize, false).unwrap();
        let c = v.pop().unwrap();
        v.extend([gemm(config::GEMM13_ENTRY), gemm(config::GEMM2_ENTRY), c]);
        v
    }

    #[test]
    fn launch_geometry_follows_the_contract() {
        let p = problem();
        let c = launch_configs(&p, &kernels(&p)).unwrap();
        // E = 40 → EPAD 64 → 4 token groups × 4 tokens = 16 tokens per block.
        assert_eq!(c[config::K_LOGITS].grid_dim, (7, 1, 1));
        assert_eq!(c[config::K_LOGITS].block_dim, (256, 1, 1));
        assert_eq!(c[config::K_TOPK].grid_dim, (25, 1, 1));
        assert_eq!(c[config::K_TOPK].block_dim, (128, 1, 1));
        assert_eq!(c[config::K_STATS].grid_dim, (41, 1, 1));
        assert_eq!(c[config::K_PERMUTE].grid_dim, (40, 1, 1));
        // 200 rows / 64 → 4, + 40 experts; N / 64.
        assert_eq!(c[config::K_GEMM13].grid_dim, (44, 2, 1));
        assert_eq!(c[config::K_GEMM2].grid_dim, (44, 4, 1));
        assert_eq!(c[config::K_GEMM2].shared_mem_bytes, 64 * 1024);
        assert_eq!(c[config::K_COMBINE].grid_dim, (100, 1, 1));
        // A 1-token problem with 256 experts: one token per thread group.
        let q = MoeProblem {
            tokens: 1,
            experts: 256,
            top_k: 8,
            ..p.clone()
        };
        let c = launch_configs(&q, &kernels(&q)).unwrap();
        assert_eq!(c[config::K_LOGITS].grid_dim, (1, 1, 1));
        assert_eq!(c[config::K_GEMM13].grid_dim, (257, 2, 1));
        // The few-token logits kernel: one thread per (token, expert).
        let mut ks = kernels(&q);
        ks[config::K_LOGITS].entry = config::LOGITS_SMALL_ENTRY;
        let q7 = MoeProblem { tokens: 7, ..q };
        let c = launch_configs(&q7, &ks).unwrap();
        assert_eq!(c[config::K_LOGITS].grid_dim, (7, 1, 1));
        assert_eq!(c[config::K_LOGITS].block_dim, (256, 1, 1));
    }

    #[test]
    fn gemm_geometry_agrees_with_gemm_config() {
        // Whatever grouped-GEMM variants gemm_config selects, the launcher's grid is the
        // one the GEMM side documents (skipped when gemm_config is the stub).
        for (t, h, i, e, k) in [
            (1, 256, 256, 16, 8),
            (7, 4096, 11008, 32, 2),
            (2048, 2048, 768, 128, 8),
        ] {
            let p = MoeProblem {
                tokens: t,
                hidden: h,
                intermediate: i,
                experts: e,
                top_k: k,
                ..problem()
            };
            let Ok(ks) = config::select(&p) else { continue };
            let c = launch_configs(&p, &ks).unwrap();
            for g in [config::K_GEMM13, config::K_GEMM2] {
                let (gx, gy) = gemm_config::gemm_grid(&p, &ks[g]);
                assert_eq!(c[g].grid_dim, (gx, gy, 1), "{p} {}", ks[g].entry);
                assert_eq!(c[g].block_dim.0, ks[g].block_threads);
            }
        }
    }

    #[test]
    fn gemm_tile_mismatch_is_unsupported() {
        let p = MoeProblem {
            intermediate: 100,
            ..problem()
        };
        let e = launch_configs(&p, &kernels(&p)).unwrap_err().to_string();
        assert!(
            e.contains("moe_gemm13") && e.contains("100 output columns"),
            "{e}"
        );
        let mut k = kernels(&problem());
        k[config::K_GEMM2].block_m = 0;
        assert!(launch_configs(&problem(), &k).is_err());
        assert!(launch_configs(&problem(), &k[..3]).is_err());
    }

    #[test]
    fn input_lengths_name_the_tensor() {
        let p = MoeProblem {
            tokens: 3,
            hidden: 8,
            intermediate: 4,
            experts: 4,
            ..problem()
        };
        let good = MoeInputs::generate(&p, 1);
        check_inputs(&p, &good).unwrap();
        for name in ["x", "router", "w13", "w2"] {
            let mut bad = good.clone();
            match name {
                "x" => bad.x.pop(),
                "router" => bad.router.pop(),
                "w13" => bad.w13.pop(),
                _ => bad.w2.pop(),
            };
            match check_inputs(&p, &bad) {
                Err(Error::BufferSize {
                    name: n,
                    expected,
                    actual,
                }) => {
                    assert_eq!(n, name);
                    assert_eq!(actual + 1, expected);
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        let s = MoeProblem {
            shared_expert: true,
            ..p.clone()
        };
        let e = check_inputs(&s, &good).unwrap_err().to_string();
        assert!(e.contains("shared expert weights"), "{e}");
        check_inputs(&s, &MoeInputs::generate(&s, 1)).unwrap();
        let z = MoeProblem { tokens: 0, ..p };
        assert!(matches!(
            check_inputs(&z, &good),
            Err(Error::InvalidProblem(_))
        ));
    }

    #[test]
    fn routing_mismatch_names_tokens() {
        assert_eq!(routing_mismatch(&[1, 2, 3, 4], &[1, 2, 3, 4], 2), None);
        let m = routing_mismatch(&[1, 2, 4, 3], &[1, 2, 3, 4], 2).unwrap();
        assert!(
            m.contains("1 of 2 tokens") && m.contains("token 1: GPU [4, 3] vs reference [3, 4]"),
            "{m}"
        );
        assert!(routing_mismatch(&[1], &[1, 2], 1)
            .unwrap()
            .contains("1 ids"));
    }

    #[test]
    fn load_stats_of_counts() {
        assert_eq!(load_stats(&[2, 2, 2, 2]), (2, 2.0, 0.0));
        let (max, mean, cv) = load_stats(&[4, 0, 0, 0]);
        assert_eq!((max, mean), (4, 1.0));
        assert!((cv - 3f64.sqrt()).abs() < 1e-12);
        assert_eq!(load_stats(&[]), (0, 0.0, 0.0));
    }
}
