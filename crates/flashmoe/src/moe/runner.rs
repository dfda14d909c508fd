//! The lab's owner of one MoE problem's buffers: [`MoeRunner`] (weights uploaded once from
//! host f32, a thin wrapper over a [`MoePlan`]), the routing it reads back ([`GpuRouting`])
//! and the input checks and comparisons the lab's tests use. Behind the `lab` feature:
//! engines call [`MoePlan`] directly.
//!
//! ```ignore
//! let mut r = MoeRunner::new(&dev, &problem, &inputs)?;   // upload, compile, validate
//! r.poison_outputs(&dev)?;
//! r.run(&dev)?;                                            // 8 (+1 sm_90, +2 shared) launches
//! let out = r.output(&dev)?;                               // [T, H] as f32
//! let routing = r.routing(&dev)?;                          // ids, weights, counts, losses
//! ```

use super::forward::plan::{MoeArgs, MoeClass, MoePlan, RawU32, RoutingArgs, WorkspaceLayout};
use super::kernel::MoeKernel;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::{check_len, Device, DeviceTensor, RawTensor};
use crate::problem::MoeProblem;
use crate::reference::moe::MoeInputs;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

/// The lab's override of the grouped-GEMM path for A/B timing (auto, portable, sm90,
/// sm90-bm64, sm90-bm128), passed to [`MoePlan::with_gemm_path`]; benchmark manifests
/// record it. Plans never read the environment.
pub const GEMM_PATH_ENV: &str = "FLASHMOE_MOE_GEMM";

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
    /// \[E\] slots routed to each expert (sums to T·k).
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
    /// [T·k, 2I]: the routed rows' gate/up, once [`MoeRunner::keep_gate_up`] asked for them.
    gate_up: Option<DeviceTensor>,
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
    /// [`GEMM_PATH_ENV`] when set (the lab's A/B switch; see [`super::gemm::sm90`]).
    pub fn new(dev: &Device, problem: &MoeProblem, inputs: &MoeInputs) -> Result<MoeRunner> {
        let env = std::env::var(GEMM_PATH_ENV).ok();
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
            gate_up: None,
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
            gate_up: None,
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
    /// The kernels in pipeline order (see [`select`](crate::moe::forward::select::select)).
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

    /// Make every later [`MoeRunner::run`] also write the routed rows' gate/up
    /// pre-activations ([`MoeArgs::gate_up`], allocated here once) for a backward that
    /// reads them (`MoeBwdArgs::saved_gate_up`); returns their tensor.
    pub fn keep_gate_up(&mut self, dev: &Device) -> Result<RawTensor> {
        let p = &self.problem;
        let shape = [p.tokens * p.top_k, 2 * p.intermediate];
        if self.gate_up.is_none() {
            self.gate_up = Some(DeviceTensor::alloc(dev, p.dtype, shape[0] * shape[1])?);
        }
        let t = self
            .gate_up
            .as_ref()
            .expect("allocated above")
            .raw(dev, "gate_up", &shape)?;
        self.args.gate_up = Some(t);
        Ok(t)
    }

    /// The routing regions the forward leaves in the workspace ([`super::backward::SavedRouting`]),
    /// for a [`super::backward::MoeBackwardPlan`] over the same call; they hold the
    /// forward's values after [`MoeRunner::run`] and until the next poison or run.
    pub fn saved_routing(&self, dev: &Device) -> Result<super::backward::SavedRouting> {
        super::backward::SavedRouting::from_forward_workspace(
            self.plan.class(),
            self.problem.tokens,
            &self.layout,
            self.workspace_raw(dev),
        )
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
        if let Some(g) = &mut self.gate_up {
            g.poison(dev)?;
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
    use crate::moe::forward::launch::tests::problem;

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
