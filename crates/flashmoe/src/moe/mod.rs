//! The MoE layer on the GPU: router, dropless permutation, grouped SwiGLU GEMMs, combine.
//! Kernel selection and the kernel ABI live in [`config`] (the contract at its top);
//! grouped-GEMM variants in [`gemm_config`] and [`gemm_sm90`]; the GPU fp32 reference in
//! [`reference`].
//!
//! Two ways in:
//! - [`MoePlan`] ([`plan`]): the engine API. Built once per [`MoeClass`], then called on
//!   the caller's stream over the caller's device weights, activations and workspace
//!   (raw pointers or cudarc buffers); no allocation, sync or compile per call, CUDA-graph
//!   safe, routing results and losses left on the device.
//! - [`MoeRunner`]: the lab's owner of one problem's buffers (weights uploaded once from
//!   host f32), a thin wrapper over a plan:
//!
//! ```ignore
//! let mut r = MoeRunner::new(&dev, &problem, &inputs)?;   // upload, compile, validate
//! r.poison_outputs(&dev)?;
//! r.run(&dev)?;                                            // 8 (+1 sm_90, +2 shared) launches
//! let out = r.output(&dev)?;                               // [T, H] as f32
//! let routing = r.routing(&dev)?;                          // ids, weights, counts, losses
//! ```
//!
//! Shared expert: supported, as a one-expert group of all tokens through the same grouped
//! GEMM kernels (see the contract); its output is added by the combine with weight 1.
// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

pub mod config;
pub mod ep;
pub mod gemm_config;
pub mod gemm_sm90;
#[cfg(test)]
mod gpu_tests;
pub mod plan;
#[cfg(test)]
mod plan_gpu_tests;
pub mod reference;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::{check_len, Device, DeviceTensor};
use crate::problem::MoeProblem;
use crate::reference::moe::MoeInputs;
use config::{MoeKernel, BACKEND};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
pub use plan::{
    MoeArgs, MoeClass, MoePlan, MoeRouting, MoeWeights, RawU32, RoutingArgs, TokenRange,
    WorkspaceLayout,
};

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
    if kernels.len() != 7 {
        config::check_limits(p)?;
        return Err(Error::unsupported(
            BACKEND,
            format!("expected 7 pipeline kernels, got {}", kernels.len()),
        ));
    }
    let k: [&MoeKernel; 7] = std::array::from_fn(|i| &kernels[i]);
    Ok(pipeline_configs(p, k)?.to_vec())
}

/// [`launch_configs`] without allocation (the plans' hot path).
pub(crate) fn pipeline_configs(
    p: &MoeProblem,
    kernels: [&MoeKernel; 7],
) -> Result<[LaunchConfig; 7]> {
    config::check_limits(p)?;
    let (t, e, k) = (p.tokens as u64, p.experts as u64, p.top_k as u64);
    let logits_kernel = kernels[config::K_LOGITS];
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
    Ok([
        logits_cfg,
        grid_1d(kernels[config::K_TOPK], t.div_ceil(topk_tokens), 1)?,
        grid_1d(kernels[config::K_STATS], e + 1, 1)?,
        grid_1d(kernels[config::K_PERMUTE], e, 1)?,
        gemm_launch_config(kernels[config::K_GEMM13], rows, p.experts, p.intermediate)?,
        gemm_launch_config(kernels[config::K_GEMM2], rows, p.experts, p.hidden)?,
        grid_1d(kernels[config::K_COMBINE], t, 1)?,
    ])
}

fn alloc_u32(dev: &Device, name: &str, len: usize) -> Result<CudaSlice<u32>> {
    dev.stream()
        .alloc_zeros::<u32>(len.max(1))
        .map_err(|e| Error::cuda(format!("allocating {name} ({len} × u32) on the GPU"), e))
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
    /// Finished on the host in f64 from the GPU's per-expert sums (the lab's check).
    pub aux_loss: f64,
    pub z_loss: f64,
    /// (aux, z) as the device finished them (`moe_router_losses`, f32), what a
    /// [`MoePlan`] call leaves in its `losses` output.
    pub device_losses: [f32; 2],
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

/// Owns the device buffers of one MoE problem (weights uploaded once) and runs the layer
/// through a [`MoePlan`] built for exactly its token count: the lab's runner.
pub struct MoeRunner {
    problem: MoeProblem,
    plan: MoePlan,
    kernels: Vec<MoeKernel>,
    cfgs: Vec<LaunchConfig>,
    /// x, router, w13, w2 and the shared expert's weights: owned so that the addresses in
    /// `args` stay valid, never read from the host.
    _inputs: Vec<DeviceTensor>,
    out: DeviceTensor,
    topk_ids: CudaSlice<u32>,
    topk_w: DeviceTensor,
    counts: CudaSlice<u32>,
    losses: DeviceTensor,
    workspace: CudaSlice<u8>,
    layout: WorkspaceLayout,
    /// The call over the buffers above (their addresses are stable while `self` lives).
    args: MoeArgs,
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

fn addr_u32(dev: &Device, s: &CudaSlice<u32>) -> u64 {
    s.device_ptr(dev.stream()).0
}

impl MoeRunner {
    /// Validate `problem` and `inputs`, build the plan (select and compile the kernels
    /// for this device), upload the inputs (rounded to the problem's dtype) once and
    /// allocate the outputs and the workspace. The grouped-GEMM path follows
    /// `FLASHMOE_MOE_GEMM` (see [`gemm_sm90`]).
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
        let p = problem;
        let t = p.tokens;
        let plan = MoePlan::with_gemm_path(dev, MoeClass::of_problem(p, t), t, path)?;
        let kernels = plan.kernels(t)?;
        let cfgs = plan.launch_configs(t)?.to_vec();
        let layout = plan.workspace_layout(t)?;
        let dt = p.dtype;
        let (h, i, e, k) = (p.hidden, p.intermediate, p.experts, p.top_k);
        let rows = t * k;
        let shared = match (p.shared_expert, &inputs.shared_w13, &inputs.shared_w2) {
            (true, Some(sw13), Some(sw2)) => Some((
                DeviceTensor::from_f32(dev, dt, sw13)?,
                DeviceTensor::from_f32(dev, dt, sw2)?,
            )),
            _ => None,
        };
        let x = DeviceTensor::from_f32(dev, dt, &inputs.x)?;
        let router = DeviceTensor::from_f32(dev, dt, &inputs.router)?;
        let w13 = DeviceTensor::from_f32(dev, dt, &inputs.w13)?;
        let w2 = DeviceTensor::from_f32(dev, dt, &inputs.w2)?;
        let out = DeviceTensor::alloc(dev, dt, elems("out", &[t, h])?)?;
        let topk_ids = alloc_u32(dev, "topk_ids", rows)?;
        let topk_w = DeviceTensor::alloc(dev, DType::F32, rows)?;
        let counts = alloc_u32(dev, "counts", e)?;
        let losses = DeviceTensor::alloc(dev, DType::F32, 2)?;
        // SAFETY: no kernel reads a workspace element before writing it (plan.rs), and
        // poison_outputs fills it before every checked run.
        let workspace = unsafe { dev.stream().alloc::<u8>(layout.bytes) }.map_err(|e| {
            Error::cuda(
                format!("allocating the MoE workspace ({} bytes)", layout.bytes),
                e,
            )
        })?;
        let args = MoeArgs {
            x: x.raw(dev, "x", &[t, h])?,
            router: router.raw(dev, "router", &[h, e])?,
            w13: w13.raw(dev, "w13", &[e, h, 2 * i])?,
            w2: w2.raw(dev, "w2", &[e, i, h])?,
            shared_w13: match &shared {
                Some((s13, _)) => Some(s13.raw(dev, "shared_w13", &[h, 2 * i])?),
                None => None,
            },
            shared_w2: match &shared {
                Some((_, s2)) => Some(s2.raw(dev, "shared_w2", &[i, h])?),
                None => None,
            },
            out: out.raw(dev, "out", &[t, h])?,
            routing: RoutingArgs {
                topk_ids: RawU32 {
                    ptr: addr_u32(dev, &topk_ids),
                    len: rows,
                },
                topk_w: topk_w.raw(dev, "topk_w", &[t, k])?,
                counts: RawU32 {
                    ptr: addr_u32(dev, &counts),
                    len: e,
                },
                losses: losses.raw(dev, "losses", &[2])?,
            },
        };
        // Everything the plan checks per call, checked once here.
        plan.check(&args)?;
        Ok(MoeRunner {
            problem: p.clone(),
            plan,
            kernels,
            cfgs,
            _inputs: [x, router, w13, w2]
                .into_iter()
                .chain(shared.into_iter().flat_map(|(a, b)| [a, b]))
                .collect(),
            out,
            topk_ids,
            topk_w,
            counts,
            losses,
            workspace,
            layout,
            args,
        })
    }

    pub fn problem(&self) -> &MoeProblem {
        &self.problem
    }
    /// The plan the runner calls.
    pub fn plan(&self) -> &MoePlan {
        &self.plan
    }
    /// The raw call over the runner's buffers.
    pub fn args(&self) -> &MoeArgs {
        &self.args
    }
    /// The kernels in pipeline order (see [`config::select`]).
    pub fn kernels(&self) -> &[MoeKernel] {
        &self.kernels
    }
    pub fn launch_configs(&self) -> &[LaunchConfig] {
        &self.cfgs
    }

    /// Device bytes beyond inputs and `out`: the plan's workspace, the routing outputs
    /// and the plan's token tables.
    pub fn workspace_bytes(&self) -> u64 {
        let p = &self.problem;
        let routing = 4 * (2 * p.tokens * p.top_k + p.experts + 2);
        (self.layout.bytes + routing + self.plan.table_bytes()) as u64
    }

    /// Which grouped-GEMM kernels the routed experts use, for reports: the sm_90 entries,
    /// or the portable ones with the reason the sm_90 path was not taken.
    pub fn gemm_path(&self) -> String {
        self.plan
            .gemm_path(self.problem.tokens)
            .unwrap_or_else(|e| e.to_string())
    }

    fn workspace_raw(&self, dev: &Device) -> crate::gpu::RawWorkspace {
        crate::gpu::RawWorkspace {
            ptr: self.workspace.device_ptr(dev.stream()).0,
            bytes: self.layout.bytes,
        }
    }

    /// Enqueue the router alone (contract steps 1–3b: logits, scoring + top-k, per-expert
    /// statistics, losses): timed separately to report the router's share of the layer.
    pub fn run_router(&mut self, dev: &Device) -> Result<()> {
        let ws = self.workspace_raw(dev);
        // SAFETY: every address in `args` and the workspace is a live buffer of `self`
        // (allocated on the device's context, sized by the plan for this token count);
        // all work is ordered on the device's one stream.
        unsafe {
            self.plan
                .router_raw(dev.stream().cu_stream(), &self.args, ws)
        }?;
        dev.debug_sync("the MoE router")
    }

    /// Enqueue the whole forward pipeline on the device stream (no sync).
    pub fn run(&mut self, dev: &Device) -> Result<()> {
        let ws = self.workspace_raw(dev);
        // SAFETY: as in run_router.
        unsafe {
            self.plan
                .forward_raw(dev.stream().cu_stream(), &self.args, ws)
        }?;
        dev.debug_sync("the MoE layer")
    }

    /// Fill the output, the routing outputs and the whole workspace with NaN /
    /// 0xFFFFFFFF so that an element a kernel fails to write is detected.
    pub fn poison_outputs(&mut self, dev: &Device) -> Result<()> {
        for t in [&mut self.out, &mut self.topk_w, &mut self.losses] {
            t.poison(dev)?;
        }
        for s in [&mut self.topk_ids, &mut self.counts] {
            poison_u32(dev, s)?;
        }
        let stream = dev.stream();
        let cu_stream = stream.cu_stream();
        let len = self.workspace.len();
        let (ptr, _rec) = self.workspace.device_ptr_mut(stream);
        // SAFETY: the pointer covers exactly `len` bytes; 0xFF bytes are NaN in f32 and
        // 16-bit floats and 0xFFFFFFFF in u32.
        unsafe { cudarc::driver::sys::cuMemsetD8Async(ptr, 0xFF, len, cu_stream).result() }
            .map_err(|e| Error::cuda("cuMemsetD8Async (poison the MoE workspace)", e))
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

    /// `n` u32 values at byte `offset` of the workspace (waits for the stream).
    fn download_ws(&self, dev: &Device, name: &str, offset: usize, n: usize) -> Result<Vec<u32>> {
        let stream = dev.stream();
        let ctx = |e| {
            Error::cuda(
                format!("downloading {name} ({n} × 4 bytes) from the GPU"),
                e,
            )
        };
        let view = self.workspace.slice(offset..offset + 4 * n);
        let bytes = stream.clone_dtoh(&view).map_err(ctx)?;
        stream.synchronize().map_err(ctx)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// [`MoeRunner::routing`] as a struct, with the losses the device finished too.
    pub fn gpu_routing(&self, dev: &Device) -> Result<GpuRouting> {
        let p = &self.problem;
        let rows = p.tokens * p.top_k;
        let topk_ids = download_u32(dev, "topk_ids", &self.topk_ids, rows)?;
        let counts = download_u32(dev, "counts", &self.counts, p.experts)?;
        let topk_w = self.topk_w.to_f32(dev)?;
        let l = &self.layout;
        let prob_sum: Vec<f32> = self
            .download_ws(dev, "prob_sum", l.prob_sum, p.experts)?
            .into_iter()
            .map(f32::from_bits)
            .collect();
        let lse_sq =
            f32::from_bits(self.download_ws(dev, "lse_sq_sum", l.lse_sq_sum, 1)?[0]) as f64;
        let device = self.losses.to_f32(dev)?;
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
            device_losses: [device[0], device[1]],
        })
    }

    /// Download the permutation (offsets [E+1], row_token, row_slot, slot_row), for tests.
    pub fn permutation(&self, dev: &Device) -> Result<Permutation> {
        let (rows, e) = (
            self.problem.tokens * self.problem.top_k,
            self.problem.experts,
        );
        let l = &self.layout;
        Ok((
            self.download_ws(dev, "offsets", l.offsets, e + 1)?,
            self.download_ws(dev, "row_token", l.row_token, rows)?,
            self.download_ws(dev, "row_slot", l.row_slot, rows)?,
            self.download_ws(dev, "slot_row", l.slot_row, rows)?,
        ))
    }
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
