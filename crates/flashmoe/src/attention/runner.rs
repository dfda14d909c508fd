//! The lab's owners of attention buffers: [`AttentionRunner`] (a problem's inputs, outputs,
//! plan and workspace; `run()` is one launch) and the one-off [`forward`] /
//! [`reference_forward`] calls on [`DeviceTensor`]s, which build a plan and a workspace per
//! call (convenient, not fast). Behind the `lab` feature: engines use the plans.

use super::launch::launch_config;
use super::plan::{AttentionArgs, AttentionPlan};
use super::prefill::abi::KernelVariant;
use super::prefill::{abi, select, tiles};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::{check_len, Device, DeviceTensor, Workspace};
use crate::problem::AttentionProblem;
use cudarc::driver::LaunchConfig;

/// The lab's override of the sm_90a tile table for A/B timing of tiles without a rebuild
/// (format: [`tiles::parse_sm90_tile_override`]); benchmark manifests record it. Plans
/// never read the environment: the lab passes the override to the selection explicitly.
pub const SM90_TILE_ENV: &str = "FLASHMOE_SM90_TILE";

/// The tiles [`SM90_TILE_ENV`] sets (none when unset); a malformed value is an error, not
/// a silent fallback to the table.
pub fn sm90_tile_override() -> Result<Vec<tiles::Sm90Tile>> {
    match std::env::var(SM90_TILE_ENV) {
        Ok(spec) => tiles::parse_sm90_tile_override(&spec)
            .map_err(|e| Error::unsupported("flash-sm90", format!("{SM90_TILE_ENV}: {e}"))),
        Err(_) => Ok(Vec::new()),
    }
}

/// The lab's override of the backward's kernel path, for timing a path the selection does
/// not take by default ([`crate::attention::backward::default_kernel`]: the sm_90a kernels
/// at head dim 96 until measured, deterministic causal softcap at 64): `sm90` (the
/// class's production sm_90a tile in the plan's mode) or `portable`; benchmark manifests
/// record it. Plans never read the environment.
pub const BWD_KERNEL_ENV: &str = "FLASHMOE_BWD_KERNEL";

/// The backward kernels [`BWD_KERNEL_ENV`] asks for `class` in `mode` (None when unset: the
/// plan's own choice); see [`parse_bwd_kernel`].
pub fn bwd_kernel_override(
    class: &super::plan::AttentionClass,
    mode: super::backward::BwdMode,
) -> Result<Option<super::backward::BwdKernel>> {
    match std::env::var(BWD_KERNEL_ENV) {
        Ok(v) => parse_bwd_kernel(&v, class, mode).map(Some),
        Err(_) => Ok(None),
    }
}

/// A [`BWD_KERNEL_ENV`] value for `class` in `mode`: `portable`, or `sm90` (the class's
/// production sm_90a tile in `mode`); an unknown value, or `sm90` for a class the sm_90a
/// kernels do not serve, is an error, not a silent fallback.
pub fn parse_bwd_kernel(
    value: &str,
    class: &super::plan::AttentionClass,
    mode: super::backward::BwdMode,
) -> Result<super::backward::BwdKernel> {
    use super::backward::{sm90_serves, BwdKernel, Sm90BwdTile};
    match value {
        "portable" => Ok(BwdKernel::Portable),
        "sm90" => match Sm90BwdTile::for_class(class, mode) {
            Some(t) if sm90_serves(class) => Ok(BwdKernel::Sm90(t)),
            _ => Err(Error::unsupported(
                "attention backward",
                format!("{BWD_KERNEL_ENV}=sm90: the sm_90a kernels do not serve {class:?}"),
            )),
        },
        other => Err(Error::invalid(format!(
            "{BWD_KERNEL_ENV}={other}: expected sm90 or portable"
        ))),
    }
}

/// The kernel [`select::select`] picks for this device, with the lab's tile override.
pub fn select_for_lab(problem: &AttentionProblem, arch: u32) -> Result<KernelVariant> {
    select::select_with_tiles(problem, arch, &sm90_tile_override()?)
}

/// The sm_90a kernel for `problem` ([`select::select_sm90`]) with the lab's tile override.
pub fn select_sm90_for_lab(problem: &AttentionProblem) -> Result<KernelVariant> {
    select::select_sm90_with_tiles(problem, &sm90_tile_override()?)
}

/// Check buffer lengths against the problem: q/o (B·Sq·Hq·D), k/v (B·Sk·Hkv·D), lse
/// (B·Hq·Sq). Errors name the first buffer that does not match.
pub fn check_buffer_lengths(
    problem: &AttentionProblem,
    q: usize,
    k: usize,
    v: usize,
    o: usize,
    lse: usize,
) -> Result<()> {
    check_len("q", problem.q_elems(), q)?;
    check_len("k", problem.kv_elems(), k)?;
    check_len("v", problem.kv_elems(), v)?;
    check_len("o", problem.q_elems(), o)?;
    check_len("lse", problem.lse_elems(), lse)
}

/// Check buffer element types: inputs in the problem's dtype, `o` in `o_dtype`, lse f32.
pub fn check_buffer_dtypes(
    problem: &AttentionProblem,
    q: DType,
    k: DType,
    v: DType,
    o: DType,
    o_dtype: DType,
    lse: DType,
) -> Result<()> {
    for (name, got, want) in [
        ("q", q, problem.dtype),
        ("k", k, problem.dtype),
        ("v", v, problem.dtype),
        ("o", o, o_dtype),
        ("lse", lse, DType::F32),
    ] {
        if got != want {
            return Err(Error::invalid(format!(
                "buffer {name} holds {got} elements but {want} is required for {problem}"
            )));
        }
    }
    Ok(())
}

/// The raw tensors of `problem` over lab buffers (contiguous layouts).
fn lab_args(
    dev: &Device,
    problem: &AttentionProblem,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    o: &DeviceTensor,
    lse: &DeviceTensor,
) -> Result<AttentionArgs> {
    let p = problem;
    let qs = [p.batch, p.seqlen_q, p.heads_q, p.head_dim];
    let ks = [p.batch, p.seqlen_k, p.heads_kv, p.head_dim];
    Ok(AttentionArgs {
        q: q.raw(dev, "q", &qs)?,
        k: k.raw(dev, "k", &ks)?,
        v: v.raw(dev, "v", &ks)?,
        o: o.raw(dev, "o", &qs)?,
        lse: lse.raw(dev, "lse", &[p.batch, p.heads_q, p.seqlen_q])?,
    })
}

/// Problem and buffer checks shared by [`forward`] and [`reference_forward`], done
/// before a kernel is chosen so a wrong buffer is reported as such.
fn check_call(
    problem: &AttentionProblem,
    o_dtype: DType,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    o: &DeviceTensor,
    lse: &DeviceTensor,
) -> Result<()> {
    problem.validate()?;
    check_buffer_lengths(problem, q.len(), k.len(), v.len(), o.len(), lse.len())?;
    check_buffer_dtypes(
        problem,
        q.dtype(),
        k.dtype(),
        v.dtype(),
        o.dtype(),
        o_dtype,
        lse.dtype(),
    )
}

/// Build a plan for `variant` and a workspace, and enqueue one call on the device stream.
#[allow(clippy::too_many_arguments)]
fn run_once(
    dev: &Device,
    problem: &AttentionProblem,
    variant: KernelVariant,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    o: &mut DeviceTensor,
    lse: &mut DeviceTensor,
) -> Result<()> {
    let plan = AttentionPlan::with_variant(dev, problem.into(), variant)?;
    let ws = plan.alloc_workspace(dev.stream())?;
    let args = lab_args(dev, problem, q, k, v, o, lse)?;
    // SAFETY: lab buffers of this device, sized for the problem (checked), ordered on its
    // one stream; the workspace is fresh and zeroed, and outlives the launch because the
    // memory is freed in stream order.
    unsafe { plan.forward_raw(dev.stream().cu_stream(), &args, ws.raw()) }
}

/// Attention forward with the kernel [`select::select`] picks for this device (the sm_90a
/// kernel on Hopper where it applies, else v1):
/// `o = softmax(scale · q kᵀ [+ causal mask]) v` and the natural-log `lse` per query row.
/// q/k/v/o in the problem's dtype (f16 or bf16), lse in f32, layouts as in
/// [`AttentionProblem`]. Asynchronous: the outputs are ready after the stream syncs.
/// Builds a plan per call: engines keep an [`AttentionPlan`] instead.
pub fn forward(
    dev: &Device,
    problem: &AttentionProblem,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    o: &mut DeviceTensor,
    lse: &mut DeviceTensor,
) -> Result<()> {
    check_call(problem, problem.dtype, q, k, v, o, lse)?;
    let variant = select_for_lab(problem, dev.arch())?;
    run_once(dev, problem, variant, q, k, v, o, lse)
}

/// The GPU reference kernel (fp32 accumulation, simple and slow): same inputs as
/// [`forward`], `o` in f32.
pub fn reference_forward(
    dev: &Device,
    problem: &AttentionProblem,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    o: &mut DeviceTensor,
    lse: &mut DeviceTensor,
) -> Result<()> {
    check_call(problem, DType::F32, q, k, v, o, lse)?;
    let variant = select::select_reference(problem)?;
    run_once(dev, problem, variant, q, k, v, o, lse)
}

/// A plan with its workspace, for the runner.
struct PlannedKernel {
    plan: AttentionPlan,
    workspace: Workspace,
}

impl PlannedKernel {
    fn new(dev: &Device, problem: &AttentionProblem, variant: KernelVariant) -> Result<Self> {
        let plan = AttentionPlan::with_variant(dev, problem.into(), variant)?;
        let workspace = plan.alloc_workspace(dev.stream())?;
        Ok(PlannedKernel { plan, workspace })
    }

    fn launch(&self, dev: &Device, args: &AttentionArgs) -> Result<()> {
        // SAFETY: the runner's buffers (checked against the problem when they were made)
        // live as long as the runner; the workspace is this plan's, zeroed, and used on
        // the device's one stream only.
        let r = unsafe {
            self.plan
                .forward_raw(dev.stream().cu_stream(), args, self.workspace.raw())
        };
        r?;
        dev.debug_sync(self.plan.variant().entry)
    }
}

/// Owns the device buffers of one attention problem and its plan.
///
/// ```ignore
/// let mut r = AttentionRunner::new(&dev, &problem, &q, &k, &v)?;
/// r.poison_outputs(&dev)?;
/// r.run(&dev)?;
/// let o = r.output(&dev)?;
/// ```
pub struct AttentionRunner {
    problem: AttentionProblem,
    kernel: PlannedKernel,
    args: AttentionArgs,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    o: DeviceTensor,
    lse: DeviceTensor,
    reference: Option<(PlannedKernel, DeviceTensor, DeviceTensor)>,
}

impl AttentionRunner {
    /// Upload q, k, v (f32 values, rounded to the problem's dtype), allocate poisoned o
    /// and lse, and build the plan of the kernel [`select::select`] picks for this device.
    pub fn new(
        dev: &Device,
        problem: &AttentionProblem,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Result<AttentionRunner> {
        problem.validate()?;
        let variant = select_for_lab(problem, dev.arch())?;
        Self::with_variant(dev, problem, q, k, v, variant)
    }

    /// Like [`AttentionRunner::new`] with a given kernel variant (e.g.
    /// [`select::select_v1`] to run v1 on Hopper).
    pub fn with_variant(
        dev: &Device,
        problem: &AttentionProblem,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        variant: KernelVariant,
    ) -> Result<AttentionRunner> {
        problem.validate()?;
        check_len("q", problem.q_elems(), q.len())?;
        check_len("k", problem.kv_elems(), k.len())?;
        check_len("v", problem.kv_elems(), v.len())?;
        // The launch geometry must fit CUDA's limits (an error now, not at run()).
        launch_config(problem, &variant)?;
        let kernel = PlannedKernel::new(dev, problem, variant)?;
        let dt = problem.dtype;
        let q = DeviceTensor::from_f32(dev, dt, q)?;
        let k = DeviceTensor::from_f32(dev, dt, k)?;
        let v = DeviceTensor::from_f32(dev, dt, v)?;
        let o = DeviceTensor::alloc(dev, dt, problem.q_elems())?;
        let lse = DeviceTensor::alloc(dev, DType::F32, problem.lse_elems())?;
        let args = lab_args(dev, problem, &q, &k, &v, &o, &lse)?;
        kernel.plan.check(&args)?;
        Ok(AttentionRunner {
            problem: problem.clone(),
            kernel,
            args,
            q,
            k,
            v,
            o,
            lse,
            reference: None,
        })
    }

    pub fn problem(&self) -> &AttentionProblem {
        &self.problem
    }
    pub fn variant(&self) -> &KernelVariant {
        self.kernel.plan.variant()
    }
    pub fn plan(&self) -> &AttentionPlan {
        &self.kernel.plan
    }
    /// The launch geometry of the plan for this problem (the sm_90a kernel's grid is 1-D
    /// over work tiles).
    pub fn launch_config(&self) -> LaunchConfig {
        let v = self.variant();
        let mut cfg = launch_config(&self.problem, v).expect("checked in with_variant");
        if let abi::KernelAbi::TensorMaps { persistent, .. } = v.abi {
            cfg.grid_dim = (
                select::sm90_grid_x(
                    &self.problem,
                    v.block_m,
                    persistent,
                    self.kernel.plan.sm_count(),
                ),
                1,
                1,
            );
        }
        cfg
    }

    /// Enqueue one forward pass (one kernel launch, O(1) checks, no sync).
    pub fn run(&mut self, dev: &Device) -> Result<()> {
        self.kernel.launch(dev, &self.args)
    }

    /// Fill o and lse with NaN so unwritten elements are detected.
    pub fn poison_outputs(&mut self, dev: &Device) -> Result<()> {
        self.o.poison(dev)?;
        self.lse.poison(dev)
    }

    /// Download o as f32 (waits for the stream).
    pub fn output(&self, dev: &Device) -> Result<Vec<f32>> {
        self.o.to_f32(dev)
    }

    /// Download lse (waits for the stream).
    pub fn lse(&self, dev: &Device) -> Result<Vec<f32>> {
        self.lse.to_f32(dev)
    }

    /// Run the GPU reference kernel on the same inputs (buffers allocated on first use)
    /// and return its (o, lse) in f32.
    pub fn run_reference(&mut self, dev: &Device) -> Result<(Vec<f32>, Vec<f32>)> {
        if self.reference.is_none() {
            let variant = select::select_reference(&self.problem)?;
            let kernel = PlannedKernel::new(dev, &self.problem, variant)?;
            let o = DeviceTensor::alloc(dev, DType::F32, self.problem.q_elems())?;
            let lse = DeviceTensor::alloc(dev, DType::F32, self.problem.lse_elems())?;
            self.reference = Some((kernel, o, lse));
        }
        let (kernel, o, lse) = self.reference.as_mut().expect("set above");
        o.poison(dev)?;
        lse.poison(dev)?;
        let args = lab_args(dev, &self.problem, &self.q, &self.k, &self.v, o, lse)?;
        kernel.launch(dev, &args)?;
        Ok((o.to_f32(dev)?, lse.to_f32(dev)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::launch::tests::problem;

    #[test]
    fn buffer_lengths_name_the_wrong_buffer() {
        let p = problem();
        let (q, kv, lse) = (p.q_elems(), p.kv_elems(), p.lse_elems());
        assert_eq!(q, 2 * 100 * 8 * 64);
        assert_eq!(kv, 2 * 300 * 2 * 64);
        assert_eq!(lse, 2 * 8 * 100);
        check_buffer_lengths(&p, q, kv, kv, q, lse).unwrap();
        for (i, name) in ["q", "k", "v", "o", "lse"].iter().enumerate() {
            let mut lens = [q, kv, kv, q, lse];
            lens[i] += 1;
            match check_buffer_lengths(&p, lens[0], lens[1], lens[2], lens[3], lens[4]) {
                Err(Error::BufferSize {
                    name: n,
                    expected,
                    actual,
                }) => {
                    assert_eq!(&n, name);
                    assert_eq!(actual, expected + 1);
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn buffer_dtypes_are_checked() {
        let p = problem();
        let b = DType::Bf16;
        let f = DType::F32;
        check_buffer_dtypes(&p, b, b, b, b, b, f).unwrap();
        check_buffer_dtypes(&p, b, b, b, f, f, f).unwrap();
        let e = check_buffer_dtypes(&p, b, DType::F16, b, b, b, f).unwrap_err();
        assert!(e.to_string().contains("buffer k holds f16"), "{e}");
        let e = check_buffer_dtypes(&p, b, b, b, b, b, b).unwrap_err();
        assert!(e.to_string().contains("buffer lse"), "{e}");
    }
}
