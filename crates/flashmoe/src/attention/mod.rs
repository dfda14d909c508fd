//! Attention forward on the GPU: kernel selection ([`config`]) and launch.
//!
//! The safe API validates everything a kernel would otherwise get wrong silently —
//! buffer lengths and dtypes against the problem, the device architecture against the
//! variant, shared-memory and grid limits — then launches per the contract at the top of
//! [`config`]. Launches are asynchronous on the device stream; download the outputs
//! (which waits) or call [`Device::synchronize`] to observe completion.
//!
//! - [`forward`]: one call, buffers owned by the caller.
//! - [`reference_forward`]: the simple fp32 GPU reference kernel (o in f32).
//! - [`AttentionRunner`]: owns the buffers and the resolved kernel; `run()` is a single
//!   launch with no per-call validation, for benchmarking loops.

pub mod config;
pub mod tma;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::{check_len, Device, DeviceData, DeviceTensor};
use crate::problem::AttentionProblem;
use config::{KernelAbi, KernelVariant};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchArgs, LaunchConfig, PushKernelArg};

/// Grid limits of CUDA (gridDim.x, gridDim.y, gridDim.z).
const MAX_GRID: (u64, u64, u64) = ((1 << 31) - 1, 65_535, 65_535);

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

/// Launch geometry for `problem` with `variant`, per the contract in [`config`]:
/// grid (ceil(Sq / block_m), Hq, B), block (block_threads, 1, 1), dynamic shared memory.
pub fn launch_config(problem: &AttentionProblem, variant: &KernelVariant) -> Result<LaunchConfig> {
    let backend = variant.entry;
    if variant.block_m == 0 || variant.block_threads == 0 {
        return Err(Error::unsupported(
            backend,
            "kernel variant has a zero block_m or block_threads",
        ));
    }
    let gx = (problem.seqlen_q as u64).div_ceil(variant.block_m as u64);
    let (gy, gz) = (problem.heads_q as u64, problem.batch as u64);
    for (what, value, limit) in [
        ("seqlen_q / block_m (grid x)", gx, MAX_GRID.0),
        ("heads_q (grid y)", gy, MAX_GRID.1),
        ("batch (grid z)", gz, MAX_GRID.2),
    ] {
        if value > limit {
            return Err(Error::unsupported(
                backend,
                format!("{what} = {value} exceeds the CUDA grid limit {limit}"),
            ));
        }
    }
    for (what, value) in [
        ("seqlen_q", problem.seqlen_q),
        ("seqlen_k", problem.seqlen_k),
        ("heads_q", problem.heads_q),
        ("heads_kv", problem.heads_kv),
    ] {
        if value > i32::MAX as usize {
            return Err(Error::unsupported(
                backend,
                format!("{what} = {value} does not fit the kernel's 32-bit int parameter"),
            ));
        }
    }
    Ok(LaunchConfig {
        grid_dim: (gx as u32, gy as u32, gz as u32),
        block_dim: (variant.block_threads, 1, 1),
        shared_mem_bytes: variant.shared_mem_bytes,
    })
}

/// The kernel's `softmax_scale_log2` parameter: scale · log2(e), so the kernel can use
/// exp2.
pub fn softmax_scale_log2(problem: &AttentionProblem) -> f32 {
    problem.scale() * std::f32::consts::LOG2_E
}

/// A kernel variant resolved for one problem on one device: function loaded, shared
/// memory limit raised, geometry computed. Launching it is one driver call.
pub struct AttentionLaunch {
    pub variant: KernelVariant,
    func: CudaFunction,
    cfg: LaunchConfig,
    seqlen_q: i32,
    seqlen_k: i32,
    heads_q: i32,
    heads_kv: i32,
    scale_log2: f32,
    batch: i32,
    dtype: DType,
    /// Tensor-map shapes for [`KernelAbi::TensorMaps`] kernels: Q, K and V (one shape), O.
    tma_params: Option<(
        tma::TensorMapParams,
        tma::TensorMapParams,
        tma::TensorMapParams,
    )>,
}

impl std::fmt::Debug for AttentionLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttentionLaunch")
            .field("variant", &self.variant)
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl AttentionLaunch {
    /// Resolve `variant` for `problem` on `dev`: checks the architecture, compiles (or
    /// takes from the cache) and loads the kernel, raises its shared-memory limit.
    pub fn prepare(
        dev: &Device,
        problem: &AttentionProblem,
        variant: KernelVariant,
    ) -> Result<AttentionLaunch> {
        problem.validate()?;
        if let Err(why) = variant.runs_on(dev.arch()) {
            return Err(Error::unsupported(
                variant.entry,
                format!(
                    "{why}, but {} is {}.{}",
                    dev.info().name,
                    dev.info().compute_capability.0,
                    dev.info().compute_capability.1
                ),
            ));
        }
        let tma_params = match variant.abi {
            KernelAbi::Pointers => None,
            KernelAbi::TensorMaps { block_n, .. } => Some((
                tma::bshd_tile_params(
                    problem.batch,
                    problem.seqlen_q,
                    problem.heads_q,
                    problem.head_dim,
                    variant.block_m,
                )?,
                tma::bshd_tile_params(
                    problem.batch,
                    problem.seqlen_k,
                    problem.heads_kv,
                    problem.head_dim,
                    block_n,
                )?,
                tma::bshd_tile_params(
                    problem.batch,
                    problem.seqlen_q,
                    problem.heads_q,
                    problem.head_dim,
                    tma::O_STORE_BOX_ROWS,
                )?,
            )),
        };
        let mut cfg = launch_config(problem, &variant)?;
        if let KernelAbi::TensorMaps { persistent, .. } = variant.abi {
            // 1-D grid over work tiles (config::sm90_grid_x).
            cfg.grid_dim = (
                config::sm90_grid_x(problem, variant.block_m, persistent, dev.info().sm_count),
                1,
                1,
            );
        }
        let func = dev.load_kernel(variant.source_file, variant.entry, &variant.defines)?;
        dev.set_dynamic_shared_memory(variant.entry, &func, variant.shared_mem_bytes)?;
        Ok(AttentionLaunch {
            func,
            cfg,
            seqlen_q: problem.seqlen_q as i32,
            seqlen_k: problem.seqlen_k as i32,
            heads_q: problem.heads_q as i32,
            heads_kv: problem.heads_kv as i32,
            scale_log2: softmax_scale_log2(problem),
            batch: problem.batch as i32,
            dtype: problem.dtype,
            tma_params,
            variant,
        })
    }

    pub fn launch_config(&self) -> LaunchConfig {
        self.cfg
    }

    /// Enqueue the kernel. Buffers must already be validated for the problem this
    /// launch was prepared for (lengths and storage types).
    fn launch(
        &self,
        dev: &Device,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &mut DeviceTensor,
        lse: &mut DeviceTensor,
    ) -> Result<()> {
        let name = self.variant.entry;
        let (q, k, v) = (q.as_u16("q")?, k.as_u16("k")?, v.as_u16("v")?);
        let lse = lse.as_f32_mut("lse")?;
        let stream = dev.stream();
        // SAFETY (both launches): the argument list follows the contract in config.rs;
        // buffer lengths and element types were checked against the problem, and the grid
        // covers it.
        let r = match &self.tma_params {
            None => {
                let mut b = stream.launch_builder(&self.func);
                b.arg(q).arg(k).arg(v);
                match o.data_mut() {
                    DeviceData::U16(s) => b.arg(s),
                    DeviceData::F32(s) => b.arg(s),
                };
                self.push_common_args(&mut b, lse);
                unsafe { b.launch(self.cfg) }
            }
            Some((pq, pkv, po)) => {
                use cudarc::driver::{DevicePtr, DevicePtrMut};
                // Tensor maps hold the buffer addresses, so they are encoded per launch
                // (host work only, a few microseconds; the GPU is busy with earlier work
                // meanwhile). The guards record the buffers' use by the stream: they live
                // until after the launch, and O's marks a write.
                let (aq, _gq) = q.device_ptr(stream);
                let (ak, _gk) = k.device_ptr(stream);
                let (av, _gv) = v.device_ptr(stream);
                let (ao, _go) = o.as_u16_mut("o")?.device_ptr_mut(stream);
                let maps = [
                    tma::encode("q", pq, self.dtype, aq)?,
                    tma::encode("k", pkv, self.dtype, ak)?,
                    tma::encode("v", pkv, self.dtype, av)?,
                    tma::encode("o", po, self.dtype, ao)?,
                ];
                let mut b = stream.launch_builder(&self.func);
                // O by map (the TMA-store epilogue) and by address (the plain one).
                b.arg(&maps[0])
                    .arg(&maps[1])
                    .arg(&maps[2])
                    .arg(&maps[3])
                    .arg(&ao);
                self.push_common_args(&mut b, lse);
                b.arg(&self.batch);
                unsafe { b.launch(self.cfg) }
            }
        };
        dev.check_launch(name, r)
    }

    /// The parameters after o that every attention kernel takes (config.rs contract).
    fn push_common_args<'a>(&'a self, b: &mut LaunchArgs<'a>, lse: &'a mut CudaSlice<f32>) {
        b.arg(lse)
            .arg(&self.seqlen_q)
            .arg(&self.seqlen_k)
            .arg(&self.heads_q)
            .arg(&self.heads_kv)
            .arg(&self.scale_log2);
    }
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

/// Attention forward with the kernel [`config::select`] picks for this device (the sm_90a
/// kernel on Hopper where it applies, else v1):
/// `o = softmax(scale · q kᵀ [+ causal mask]) v` and the natural-log `lse` per query row.
/// q/k/v/o in the problem's dtype (f16 or bf16), lse in f32, layouts as in
/// [`AttentionProblem`]. Asynchronous: the outputs are ready after the stream syncs.
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
    let variant = config::select(problem, dev.arch())?;
    AttentionLaunch::prepare(dev, problem, variant)?.launch(dev, q, k, v, o, lse)
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
    let variant = config::select_reference(problem)?;
    AttentionLaunch::prepare(dev, problem, variant)?.launch(dev, q, k, v, o, lse)
}

/// Owns the device buffers of one attention problem and the resolved kernel.
///
/// ```ignore
/// let mut r = AttentionRunner::new(&dev, &problem, &q, &k, &v)?;
/// r.poison_outputs(&dev)?;
/// r.run(&dev)?;
/// let o = r.output(&dev)?;
/// ```
pub struct AttentionRunner {
    problem: AttentionProblem,
    launch: AttentionLaunch,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    o: DeviceTensor,
    lse: DeviceTensor,
    reference: Option<(AttentionLaunch, DeviceTensor, DeviceTensor)>,
}

impl AttentionRunner {
    /// Upload q, k, v (f32 values, rounded to the problem's dtype), allocate poisoned o
    /// and lse, and resolve the kernel [`config::select`] picks for this device.
    pub fn new(
        dev: &Device,
        problem: &AttentionProblem,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Result<AttentionRunner> {
        problem.validate()?;
        let variant = config::select(problem, dev.arch())?;
        Self::with_variant(dev, problem, q, k, v, variant)
    }

    /// Like [`AttentionRunner::new`] with a given kernel variant (e.g.
    /// [`config::select_v1`] to run v1 on Hopper).
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
        let launch = AttentionLaunch::prepare(dev, problem, variant)?;
        let dt = problem.dtype;
        Ok(AttentionRunner {
            problem: problem.clone(),
            launch,
            q: DeviceTensor::from_f32(dev, dt, q)?,
            k: DeviceTensor::from_f32(dev, dt, k)?,
            v: DeviceTensor::from_f32(dev, dt, v)?,
            o: DeviceTensor::alloc(dev, dt, problem.q_elems())?,
            lse: DeviceTensor::alloc(dev, DType::F32, problem.lse_elems())?,
            reference: None,
        })
    }

    pub fn problem(&self) -> &AttentionProblem {
        &self.problem
    }
    pub fn variant(&self) -> &KernelVariant {
        &self.launch.variant
    }
    pub fn launch_config(&self) -> LaunchConfig {
        self.launch.launch_config()
    }

    /// Enqueue one forward pass (one kernel launch, no validation, no sync).
    pub fn run(&mut self, dev: &Device) -> Result<()> {
        self.launch
            .launch(dev, &self.q, &self.k, &self.v, &mut self.o, &mut self.lse)
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
            let variant = config::select_reference(&self.problem)?;
            let launch = AttentionLaunch::prepare(dev, &self.problem, variant)?;
            let o = DeviceTensor::alloc(dev, DType::F32, self.problem.q_elems())?;
            let lse = DeviceTensor::alloc(dev, DType::F32, self.problem.lse_elems())?;
            self.reference = Some((launch, o, lse));
        }
        let (launch, o, lse) = self.reference.as_mut().expect("set above");
        o.poison(dev)?;
        lse.poison(dev)?;
        launch.launch(dev, &self.q, &self.k, &self.v, o, lse)?;
        Ok((o.to_f32(dev)?, lse.to_f32(dev)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem() -> AttentionProblem {
        AttentionProblem {
            batch: 2,
            heads_q: 8,
            heads_kv: 2,
            seqlen_q: 100,
            seqlen_k: 300,
            head_dim: 64,
            causal: true,
            dtype: DType::Bf16,
            softmax_scale: None,
        }
    }

    fn variant() -> KernelVariant {
        KernelVariant {
            source_file: "flash_attn_fwd.cu",
            entry: "flash_attn_fwd",
            defines: vec![],
            block_m: 64,
            block_threads: 128,
            shared_mem_bytes: 64 * 1024,
            min_arch: 80,
            abi: config::KernelAbi::Pointers,
        }
    }

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

    #[test]
    fn launch_geometry_follows_the_contract() {
        let p = problem();
        let cfg = launch_config(&p, &variant()).unwrap();
        assert_eq!(cfg.grid_dim, (2, 8, 2)); // ceil(100 / 64), Hq, B
        assert_eq!(cfg.block_dim, (128, 1, 1));
        assert_eq!(cfg.shared_mem_bytes, 64 * 1024);

        let mut big = p.clone();
        big.batch = 70_000;
        let e = launch_config(&big, &variant()).unwrap_err();
        assert!(e.to_string().contains("batch (grid z)"), "{e}");
        let mut wide = p.clone();
        wide.heads_q = 70_000;
        wide.heads_kv = 70_000;
        assert!(launch_config(&wide, &variant()).is_err());
        let mut v = variant();
        v.block_m = 0;
        assert!(launch_config(&p, &v).is_err());
    }

    #[test]
    fn scale_is_passed_in_log2_units() {
        let p = problem();
        // D = 64: scale 1/8; exp(x·scale) = 2^(x·scale·log2 e).
        let s = softmax_scale_log2(&p);
        assert!((s - 0.125 / std::f32::consts::LN_2).abs() < 1e-6);
        let mut q = p.clone();
        q.softmax_scale = Some(0.5);
        assert!((softmax_scale_log2(&q) - 0.5 / std::f32::consts::LN_2).abs() < 1e-6);
    }
}
