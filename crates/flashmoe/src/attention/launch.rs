//! Launch helpers shared by the attention plans: the grid of the portable kernels, the
//! kernels' log2-unit softmax scale, one launch with the window / softcap parameters
//! appended (the ABI in [`super::prefill::abi`]), and the split-KV plans' device part
//! (`SplitDevice`: their main kernel's load, occupancy and split count).

use super::prefill::abi;
use super::prefill::abi::KernelVariant;
use crate::error::{Error, Result};
use crate::gpu::Device;
use crate::problem::AttentionProblem;
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use std::sync::Arc;

/// Grid limits of CUDA (gridDim.x, gridDim.y, gridDim.z).
const MAX_GRID: (u64, u64, u64) = ((1 << 31) - 1, 65_535, 65_535);

/// Launch geometry for `problem` with `variant`, per the contract in [`abi`]:
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

/// One launch of an attention kernel ([`crate::gpu::raw::launch`]): the `base` parameters,
/// then those of the variant's window and softcap (`FM_WINDOW`: window_left, window_right;
/// `FM_SOFTCAP`: softcap_log2; see the kernels' ABI notes). No allocation.
///
/// # Safety
/// As [`crate::gpu::raw::launch`]: `base` matches the kernel's parameter list up to its
/// window / softcap parameters and points at live values.
pub(crate) unsafe fn launch_with_logits(
    entry: &str,
    func: &cudarc::driver::CudaFunction,
    cfg: cudarc::driver::LaunchConfig,
    stream: crate::gpu::raw::RawStream,
    base: &[*mut std::ffi::c_void],
    m: abi::Masking,
    lp: &abi::LogitParams,
) -> Result<()> {
    launch_with_logits_tail(entry, func, cfg, stream, base, m, lp, &[])
}

/// [`launch_with_logits`] with `tail` appended after the window / softcap parameters (the
/// portable kernel's ALiBi slopes and batch stride, `FM_ALIBI`).
///
/// # Safety
/// As [`launch_with_logits`]; `tail` matches the kernel's parameters after them.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_with_logits_tail(
    entry: &str,
    func: &cudarc::driver::CudaFunction,
    cfg: cudarc::driver::LaunchConfig,
    stream: crate::gpu::raw::RawStream,
    base: &[*mut std::ffi::c_void],
    m: abi::Masking,
    lp: &abi::LogitParams,
    tail: &[*mut std::ffi::c_void],
) -> Result<()> {
    use crate::gpu::raw::param;
    const MAX_PARAMS: usize = 24;
    let mut params = [std::ptr::null_mut(); MAX_PARAMS];
    let mut n = base.len();
    if n + 3 + tail.len() > MAX_PARAMS {
        return Err(Error::unsupported(entry, "too many kernel parameters"));
    }
    params[..n].copy_from_slice(base);
    if m.window {
        params[n] = param(&lp.window_left);
        params[n + 1] = param(&lp.window_right);
        n += 2;
    }
    if m.softcap {
        params[n] = param(&lp.softcap_log2);
        n += 1;
    }
    params[n..n + tail.len()].copy_from_slice(tail);
    n += tail.len();
    crate::gpu::raw::launch(entry, func, cfg, stream, &mut params[..n])
}

/// What a split-KV plan (decode, MLA decode) holds of its device besides its kernels: the
/// context its launches bind (and callers' streams must belong to), and the inputs of its
/// split count: SMs, the main kernel's CTAs per SM, the caller's override.
#[derive(Clone, Debug)]
pub(crate) struct SplitDevice {
    pub(crate) ctx: Arc<CudaContext>,
    sm_count: u32,
    /// Main-kernel CTAs one SM holds at once (the compiled kernel's occupancy, at least 1).
    pub(crate) ctas_per_sm: u32,
    splits_override: Option<usize>,
}

impl SplitDevice {
    /// Load the main kernel of a split-KV plan, after the sm_80 check (`needs` names what
    /// the kernel uses of it): `entry` of `source` built with `defs`, allowed `smem` bytes of
    /// dynamic shared memory, and its occupancy at `threads` threads a CTA.
    pub(crate) fn load_main(
        dev: &Device,
        needs: &str,
        source: &str,
        entry: &str,
        defs: &[(String, String)],
        smem: u32,
        threads: u32,
    ) -> Result<(CudaFunction, SplitDevice)> {
        if dev.arch() < 80 {
            return Err(Error::unsupported(
                entry,
                format!(
                    "needs sm_80 or newer ({needs}), {} is sm_{}",
                    dev.info().name,
                    dev.arch()
                ),
            ));
        }
        let func = dev.load_kernel(source, entry, defs)?;
        dev.set_dynamic_shared_memory(entry, &func, smem)?;
        let ctas_per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
            .map_err(|e| Error::cuda("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?
            .max(1);
        let split = SplitDevice {
            ctx: dev.context().clone(),
            sm_count: dev.info().sm_count,
            ctas_per_sm,
            splits_override: None,
        };
        Ok((func, split))
    }

    /// Force the split count (clamped to 1..=`max`); None restores the heuristic.
    pub(crate) fn set_override(&mut self, splits: Option<usize>, max: usize) {
        self.splits_override = splits.map(|s| s.clamp(1, max));
    }

    /// The override, else `heuristic` of the CTA slots (SMs × CTAs per SM).
    pub(crate) fn splits(&self, heuristic: impl FnOnce(usize) -> usize) -> usize {
        self.splits_override
            .unwrap_or_else(|| heuristic((self.sm_count * self.ctas_per_sm) as usize))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dtype::DType;

    /// A GQA causal problem with Sq != Sk (also the runner's tests' fixture).
    pub(crate) fn problem() -> AttentionProblem {
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
            window: crate::problem::NO_WINDOW,
            softcap: 0.0,
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
            abi: abi::KernelAbi::Pointers,
        }
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
