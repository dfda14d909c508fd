//! Variable-length (packed) attention backward: [`VarlenBackwardPlan`], the portable
//! deterministic kernels of [`super`] compiled with `FM_VARLEN`.
//!
//! Layouts are the varlen forward's ([`crate::attention::varlen`], FlashAttention's
//! `flash_attn_varlen_func`): q, o, d_o and dq `(total_q, heads_q, head_dim)`; k, v, dk
//! and dv `(total_k, heads_kv, head_dim)`; lse `(heads_q, total_q)` f32, natural log;
//! int32 `cu_seqlens_q` / `cu_seqlens_k` `[batch + 1]` on the device. Masks are per
//! sequence: causal bottom-right (query i of a sequence of lengths (sq, sk) sees keys
//! j ≤ i + sk − sq), sliding windows around that diagonal, softcap, GQA/MQA.
//!
//! Three launches, as the dense plan: the preprocess over all `total_q` rows (the dense
//! kernel: its batch-1 indexing is the packed layout), then the dK/dV and dQ kernels with
//! one grid z index per sequence and grid x sized by `max_seqlen_k` / `max_seqlen_q`; CTAs
//! past their sequence's end return at once. The offsets stay on the device and the
//! kernels clamp them into the tensors, so malformed offsets (or a sequence longer than
//! the max given) give wrong gradients, never out-of-bounds accesses. Deterministic (no
//! atomics), graph-capturable (no allocation, no synchronisation).
//!
//! Unlike the varlen forward (sm_90a, head dims 64 and 128), this runs on compute
//! capability 8.0 and newer at every head dim of [`BWD_HEAD_DIMS`]. On compute capability
//! 9.0, at head dims 64 and 128 (but causal softcap at D = 64, [`default_kernel`]),
//! [`VarlenBackwardPlan::new`] runs the sm_90a kernel pair instead (`flash_attn_bwd_sm90.cu` with `FM_VARLEN`, the deterministic production tile,
//! `Sm90Dq::Kernel`: deterministic as well, the same workspace); `with_kernel` picks
//! either.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::abi::{
    BwdLaunch, BWD_DKDV_ENTRY, BWD_DQ_ENTRY, BWD_PREPROCESS_ENTRY, BWD_SM90_DKDV_ENTRY,
    BWD_SM90_DQ_ENTRY, BWD_SM90_SOURCE, BWD_SOURCE, PREPROCESS_ROWS,
};
use super::tiles::{
    bwd_defines, default_kernel, sm90_bwd_defines, sm90_serves, BwdKernel, BwdMode, BwdTile,
    Sm90BwdTile, Sm90Dq, BWD_HEAD_DIMS, BWD_SM90_HEAD_DIMS,
};
use crate::attention::plan::AttentionClass;
use crate::attention::prefill::abi::{LogitParams, MAX_GRID_YZ, MAX_SEQLEN};
use crate::attention::varlen::VarlenShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{launch, param, RawIndex, RawStream, RawTensor, RawWorkspace};
use crate::gpu::Device;
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use std::sync::Arc;

const BACKEND: &str = "varlen attention backward";

/// The NVRTC defines of the varlen backward module: the dense module's plus `FM_VARLEN`.
pub fn varlen_bwd_defines(class: &AttentionClass, tile: &BwdTile) -> Vec<(String, String)> {
    let mut d = bwd_defines(class, tile);
    d.push(("FM_VARLEN".into(), "1".into()));
    d
}

/// The NVRTC defines of the varlen sm_90a backward module: the dense sm_90a module's plus
/// `FM_VARLEN` (a `Sm90Dq::Kernel` tile: the kernels refuse the fused dQ with varlen).
pub fn varlen_sm90_bwd_defines(
    class: &AttentionClass,
    tile: &Sm90BwdTile,
) -> Vec<(String, String)> {
    let mut d = sm90_bwd_defines(class, tile);
    d.push(("FM_VARLEN".into(), "1".into()));
    d
}

/// The tensors of one varlen backward call, raw (layouts in the module docs), all
/// contiguous. o and lse are what the varlen forward wrote for these q, k, v and offsets.
/// dq, dk and dv must not overlap the inputs or each other; every row inside a sequence is
/// written (zeros where no gradient flows: a query row that sees no key, a key no query
/// sees); rows outside every sequence (`cu_seqlens_q[batch] < total_q`) are not written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VarlenBackwardArgs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub o: RawTensor,
    pub d_o: RawTensor,
    pub lse: RawTensor,
    pub dq: RawTensor,
    pub dk: RawTensor,
    pub dv: RawTensor,
    /// int32 `[batch + 1]`, non-decreasing, from 0 to at most total_q.
    pub cu_seqlens_q: RawIndex,
    /// int32 `[batch + 1]`, non-decreasing, from 0 to at most total_k.
    pub cu_seqlens_k: RawIndex,
    /// The longest query sequence (>= 1): sizes the dQ grid.
    pub max_seqlen_q: usize,
    /// The longest key sequence (>= 1): sizes the dK/dV grid.
    pub max_seqlen_k: usize,
}

/// The checks of [`VarlenBackwardPlan::check`] without a device: shapes, dtypes,
/// contiguity, alignment, sizes and aliasing of a varlen backward call, O(1) (the offsets
/// live on the device and are not read).
pub fn check_varlen_backward(c: &AttentionClass, a: &VarlenBackwardArgs) -> Result<VarlenShape> {
    let (hq, hkv, d, dt) = (c.heads_q, c.heads_kv, c.head_dim, c.dtype);
    let named = [
        ("q", &a.q),
        ("k", &a.k),
        ("v", &a.v),
        ("o", &a.o),
        ("d_o", &a.d_o),
        ("dq", &a.dq),
        ("dk", &a.dk),
        ("dv", &a.dv),
    ];
    for (name, t) in named {
        if t.rank != 3 {
            return Err(Error::invalid(format!(
                "{name} must be 3-D (total_tokens, heads, head_dim) for a varlen call but has \
                 shape {:?}",
                t.shape()
            )));
        }
    }
    let (tq, tk) = (a.q.shape[0], a.k.shape[0]);
    for (name, t) in named {
        let shape = if matches!(name, "k" | "v" | "dk" | "dv") {
            [tk, hkv, d]
        } else {
            [tq, hq, d]
        };
        t.expect_contiguous(name, dt, &shape, 16)?;
    }
    a.lse.expect_contiguous("lse", DType::F32, &[hq, tq], 4)?;
    if tq == 0 || tk == 0 {
        return Err(Error::invalid(format!(
            "empty varlen call: total_q {tq}, total_k {tk} (each must be >= 1)"
        )));
    }
    let rows = a.cu_seqlens_q.rows;
    if rows < 2 {
        return Err(Error::invalid(format!(
            "cu_seqlens_q has {rows} elements but batch + 1 >= 2 are required"
        )));
    }
    a.cu_seqlens_q.expect_vector("cu_seqlens_q", rows)?;
    a.cu_seqlens_k.expect_vector("cu_seqlens_k", rows)?;
    for (what, value, total) in [
        ("max_seqlen_q", a.max_seqlen_q, tq),
        ("max_seqlen_k", a.max_seqlen_k, tk),
    ] {
        if value == 0 || value > total {
            return Err(Error::invalid(format!(
                "{what} = {value} must be in 1..={total} (the packed row count)"
            )));
        }
    }
    for (what, value) in [("total_q", tq), ("total_k", tk)] {
        if value > MAX_SEQLEN {
            return Err(Error::unsupported(
                BACKEND,
                format!("{what} = {value} exceeds {MAX_SEQLEN}"),
            ));
        }
    }
    let batch = rows - 1;
    if batch > MAX_GRID_YZ {
        return Err(Error::unsupported(
            BACKEND,
            format!("batch = {batch} exceeds the grid limit {MAX_GRID_YZ}"),
        ));
    }
    for (name, t) in [("dq", &a.dq), ("dk", &a.dk), ("dv", &a.dv)] {
        for (iname, i) in named {
            if iname != name && t.ptr == i.ptr {
                return Err(Error::invalid(format!(
                    "{name} and {iname} are the same buffer; gradients need their own"
                )));
            }
        }
    }
    Ok(VarlenShape {
        batch,
        total_q: tq,
        total_k: tk,
    })
}

/// The varlen backward kernels resolved for one shape class on one device.
pub struct VarlenBackwardPlan {
    class: AttentionClass,
    tile: BwdTile,
    kernel: BwdKernel,
    logits: LogitParams,
    scale: f32,
    preprocess: CudaFunction,
    dkdv: CudaFunction,
    dq: CudaFunction,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for VarlenBackwardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VarlenBackwardPlan")
            .field("class", &self.class)
            .field("tile", &self.tile)
            .field("kernel", &self.kernel)
            .finish()
    }
}

/// Bytes of one f32 (heads_q, total_q) region of the workspace, 256-byte aligned.
fn region_bytes(heads_q: usize, total_q: usize) -> usize {
    (heads_q * total_q * 4).div_ceil(256) * 256
}

impl VarlenBackwardPlan {
    /// Check that the backward serves `class` (bf16 or f16, a head dim of
    /// [`BWD_HEAD_DIMS`], a valid problem), compile or load its varlen kernels for `dev`
    /// (compute capability 8.0 or newer) and set their shared-memory limits: on compute
    /// capability 9.0 the sm_90a pair for the classes [`sm90_serves`] (tile
    /// [`Sm90BwdTile::for_class`] in [`BwdMode::Deterministic`]; [`default_kernel`]),
    /// otherwise the portable kernels.
    pub fn new(dev: &Device, class: AttentionClass) -> Result<VarlenBackwardPlan> {
        let kernel = default_kernel(&class, BwdMode::Deterministic, dev.arch());
        Self::with_kernel(dev, class, kernel)
    }

    /// [`VarlenBackwardPlan::new`] with the kernels chosen by the caller: `Portable`, or on
    /// compute capability 9.0 `Sm90` with a `Sm90Dq::Kernel` tile of the class's head dim
    /// (64 or 128; the fused-dQ tiles need a workspace that grows with the batch and are
    /// not served here).
    pub fn with_kernel(
        dev: &Device,
        class: AttentionClass,
        kernel: BwdKernel,
    ) -> Result<VarlenBackwardPlan> {
        let problem = class.problem(1, 1, 1);
        problem.validate()?;
        if !matches!(class.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::unsupported(
                BACKEND,
                format!("dtype {} (bf16 and f16 only)", class.dtype),
            ));
        }
        let tile = BwdTile::for_head_dim(class.head_dim).ok_or_else(|| {
            Error::unsupported(
                BACKEND,
                format!("head dim {} (served: {:?})", class.head_dim, BWD_HEAD_DIMS),
            )
        })?;
        if class.heads_q > MAX_GRID_YZ {
            return Err(Error::unsupported(
                BACKEND,
                format!(
                    "heads_q = {} exceeds the grid limit {MAX_GRID_YZ}",
                    class.heads_q
                ),
            ));
        }
        if dev.arch() < 80 {
            let (major, minor) = dev.info().compute_capability;
            return Err(Error::unsupported(
                BACKEND,
                format!(
                    "needs compute capability 8.0 or newer (mma.sync bf16), but {} is \
                     {major}.{minor}",
                    dev.info().name
                ),
            ));
        }
        // The preprocess kernel is the dense module's (same code under both defines).
        let preprocess = dev.load_kernel(
            BWD_SOURCE,
            BWD_PREPROCESS_ENTRY,
            &bwd_defines(&class, &tile),
        )?;
        // The dK/dV and dQ kernels of one module, with their shared-memory limits.
        let load_pair = |source: &str,
                         (dkdv_entry, dq_entry): (&str, &str),
                         defines: &[(String, String)],
                         (kv_smem, q_smem): (u32, u32)| {
            let dkdv = dev.load_kernel(source, dkdv_entry, defines)?;
            let dq = dev.load_kernel(source, dq_entry, defines)?;
            dev.set_dynamic_shared_memory(dkdv_entry, &dkdv, kv_smem)?;
            dev.set_dynamic_shared_memory(dq_entry, &dq, q_smem)?;
            Ok::<_, Error>((dkdv, dq))
        };
        let (dkdv, dq) = match kernel {
            BwdKernel::Portable => load_pair(
                BWD_SOURCE,
                (BWD_DKDV_ENTRY, BWD_DQ_ENTRY),
                &varlen_bwd_defines(&class, &tile),
                (tile.kv_smem_bytes(), tile.q_smem_bytes()),
            )?,
            BwdKernel::Sm90(t) => {
                check_sm90_varlen(dev, &class, &t)?;
                load_pair(
                    BWD_SM90_SOURCE,
                    (BWD_SM90_DKDV_ENTRY, BWD_SM90_DQ_ENTRY),
                    &varlen_sm90_bwd_defines(&class, &t),
                    (t.kv_smem_bytes(), t.q_smem_bytes()),
                )?
            }
        };
        Ok(VarlenBackwardPlan {
            class,
            tile,
            kernel,
            logits: LogitParams::of(&problem),
            scale: problem.scale(),
            preprocess,
            dkdv,
            dq,
            ctx: dev.context().clone(),
        })
    }

    pub fn class(&self) -> &AttentionClass {
        &self.class
    }
    /// The portable kernels' tile (what they would run with; see [`Self::kernel`]).
    pub fn tile(&self) -> &BwdTile {
        &self.tile
    }
    /// Which kernels the plan runs.
    pub fn kernel(&self) -> BwdKernel {
        self.kernel
    }

    /// Bytes of the workspace a call of `total_q` packed query rows needs: the f32 Delta
    /// and log2-LSE of every row (2 × heads_q · total_q · 4, each rounded up to 256
    /// bytes). Any contents: every launch writes it before reading. Launches that may run
    /// at the same time need one each.
    pub fn workspace_bytes(&self, total_q: usize) -> usize {
        2 * region_bytes(self.class.heads_q, total_q)
    }

    /// Check a call against the class and the kernels' rules, O(1)
    /// ([`check_varlen_backward`]).
    pub fn check(&self, a: &VarlenBackwardArgs) -> Result<VarlenShape> {
        check_varlen_backward(&self.class, a)
    }

    /// Enqueue the varlen backward on `stream`: dq, dk and dv of the varlen forward that
    /// produced `a.o` and `a.lse` from `a.q`, `a.k`, `a.v` and the offsets, given `a.d_o`.
    /// Asynchronous; O(1) checks, no allocation; three launches.
    ///
    /// # Safety
    /// The contract of [`crate::gpu::raw`]: every address in `a` and `workspace ..
    /// workspace + workspace_bytes(total_q)` is live device memory of this plan's context
    /// covering its tensor's span (the offsets `batch + 1` int32 each), the workspace is
    /// not used by a launch that may run at the same time, and `stream` belongs to the
    /// context. The workspace is checked for size and alignment.
    pub unsafe fn backward_raw(
        &self,
        stream: RawStream,
        a: &VarlenBackwardArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let shape = self.check(a)?;
        let (b, tq, tk) = (shape.batch, shape.total_q, shape.total_k);
        let hq = self.class.heads_q;
        workspace.check(self.workspace_bytes(tq), 16, "VarlenBackwardPlan")?;
        crate::gpu::device::bind_context(&self.ctx)?;
        let lse2 = workspace.ptr;
        let delta = workspace.ptr + region_bytes(hq, tq) as u64;
        let (tq_i, tk_i, hq_i, hkv_i) =
            (tq as i32, tk as i32, hq as i32, self.class.heads_kv as i32);
        let (o, d_o, lse) = (a.o.ptr, a.d_o.ptr, a.lse.ptr);
        // All packed rows as one (1, total_q, heads_q, D) batch.
        let pre = LaunchConfig {
            grid_dim: ((tq as u32).div_ceil(PREPROCESS_ROWS), hq as u32, 1),
            block_dim: (32 * PREPROCESS_ROWS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut params = [
            param(&o),
            param(&d_o),
            param(&lse),
            param(&lse2),
            param(&delta),
            param(&tq_i),
            param(&hq_i),
        ];
        launch(
            BWD_PREPROCESS_ENTRY,
            &self.preprocess,
            pre,
            stream,
            &mut params,
        )?;

        let args = BwdLaunch {
            q: a.q.ptr,
            k: a.k.ptr,
            v: a.v.ptr,
            d_o,
            lse2,
            delta,
            seqlen_q: tq_i,
            seqlen_k: tk_i,
            heads_q: hq_i,
            heads_kv: hkv_i,
            scale: self.scale,
            logits: self.logits,
            cu_seqlens: Some((a.cu_seqlens_q.ptr, a.cu_seqlens_k.ptr)),
        };
        if let BwdKernel::Sm90(t) = self.kernel {
            // The sm_90a pair: one grid z index per sequence, as the portable kernels.
            let kv = LaunchConfig {
                grid_dim: (
                    (a.max_seqlen_k as u32).div_ceil(t.kv_block_n()),
                    self.class.heads_kv as u32,
                    b as u32,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: t.kv_smem_bytes(),
            };
            let no_dq_ws = (0u64, 0u64);
            args.launch_sm90_dkdv(&self.dkdv, kv, stream, (a.dk.ptr, a.dv.ptr), no_dq_ws, None)?;
            let qc = LaunchConfig {
                grid_dim: (
                    (a.max_seqlen_q as u32).div_ceil(t.q_block_m()),
                    hq as u32,
                    b as u32,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: t.q_smem_bytes(),
            };
            return args.launch(BWD_SM90_DQ_ENTRY, &self.dq, qc, stream, &[a.dq.ptr]);
        }
        let t = &self.tile;
        let kv = LaunchConfig {
            grid_dim: (
                (a.max_seqlen_k as u32).div_ceil(t.kv_block_n()),
                self.class.heads_kv as u32,
                b as u32,
            ),
            block_dim: (32 * t.kv_warps, 1, 1),
            shared_mem_bytes: t.kv_smem_bytes(),
        };
        args.launch(
            BWD_DKDV_ENTRY,
            &self.dkdv,
            kv,
            stream,
            &[a.dk.ptr, a.dv.ptr],
        )?;

        let qc = LaunchConfig {
            grid_dim: (
                (a.max_seqlen_q as u32).div_ceil(t.q_block_m()),
                hq as u32,
                b as u32,
            ),
            block_dim: (32 * t.q_warps, 1, 1),
            shared_mem_bytes: t.q_smem_bytes(),
        };
        args.launch(BWD_DQ_ENTRY, &self.dq, qc, stream, &[a.dq.ptr])
    }
}

/// Whether the varlen sm_90a pair serves `class` with tile `t` on `dev`: compute capability
/// 9.0, a head dim of [`BWD_SM90_HEAD_DIMS`] matching the tile's, a valid `Sm90Dq::Kernel`
/// tile.
fn check_sm90_varlen(dev: &Device, class: &AttentionClass, t: &Sm90BwdTile) -> Result<()> {
    if dev.arch() != 90 {
        let (major, minor) = dev.info().compute_capability;
        return Err(Error::unsupported(
            BACKEND,
            format!(
                "the sm_90a kernels need compute capability 9.0, but {} is {major}.{minor}",
                dev.info().name
            ),
        ));
    }
    if !sm90_serves(class) {
        return Err(Error::unsupported(
            BACKEND,
            format!(
                "the sm_90a kernels serve head dims {BWD_SM90_HEAD_DIMS:?} in bf16 or f16; \
                 not {class:?}"
            ),
        ));
    }
    if !t.is_valid() || t.head_dim as usize != class.head_dim {
        return Err(Error::invalid(format!(
            "sm_90a backward tile {t:?} is not valid for head dim {}",
            class.head_dim
        )));
    }
    if !t.serves(class) {
        return Err(Error::unsupported(
            BACKEND,
            format!("sm_90a backward tile {t:?} does not serve {class:?} (Sm90BwdTile::serves)"),
        ));
    }
    if t.producer() {
        return Err(Error::unsupported(
            BACKEND,
            format!("sm_90a backward tile {t:?}: the producer build loads dense tensors only"),
        ));
    }
    if t.dq != Sm90Dq::Kernel {
        return Err(Error::unsupported(
            BACKEND,
            format!(
                "the varlen sm_90a backward runs the dQ kernel (Sm90Dq::Kernel); {:?} needs a \
                 workspace that grows with the batch, not served",
                t.dq
            ),
        ));
    }
    Ok(())
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<VarlenBackwardPlan>();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class() -> AttentionClass {
        AttentionClass {
            dtype: DType::Bf16,
            head_dim: 64,
            heads_q: 4,
            heads_kv: 2,
            causal: true,
            softmax_scale: None,
            window: crate::problem::NO_WINDOW,
            softcap: 0.0,
        }
    }

    fn args(tq: usize, tk: usize, batch: usize) -> VarlenBackwardArgs {
        let mut next = 0x1000u64;
        let mut t = |dt: DType, shape: &[usize]| {
            next += 0x100_0000;
            RawTensor::contiguous(next, dt, shape).unwrap()
        };
        let (q, kk) = ([tq, 4, 64], [tk, 2, 64]);
        VarlenBackwardArgs {
            q: t(DType::Bf16, &q),
            k: t(DType::Bf16, &kk),
            v: t(DType::Bf16, &kk),
            o: t(DType::Bf16, &q),
            d_o: t(DType::Bf16, &q),
            lse: t(DType::F32, &[4, tq]),
            dq: t(DType::Bf16, &q),
            dk: t(DType::Bf16, &kk),
            dv: t(DType::Bf16, &kk),
            cu_seqlens_q: RawIndex::vector(0x10, batch + 1),
            cu_seqlens_k: RawIndex::vector(0x20, batch + 1),
            max_seqlen_q: tq.min(7),
            max_seqlen_k: tk.min(7),
        }
    }

    #[test]
    fn varlen_defines_add_fm_varlen_only() {
        let c = class();
        let t = BwdTile::for_head_dim(64).unwrap();
        let dense = bwd_defines(&c, &t);
        let var = varlen_bwd_defines(&c, &t);
        assert_eq!(&var[..dense.len()], &dense[..]);
        assert_eq!(var.len(), dense.len() + 1);
        assert_eq!(var.last().unwrap(), &("FM_VARLEN".into(), "1".into()));
        // The sm_90a pair: the dense sm_90a module's defines plus FM_VARLEN, a dQ-kernel tile.
        let t90 = Sm90BwdTile::for_head_dim(64).unwrap();
        assert_eq!(t90.dq, Sm90Dq::Kernel);
        let dense = sm90_bwd_defines(&c, &t90);
        let var = varlen_sm90_bwd_defines(&c, &t90);
        assert_eq!(&var[..dense.len()], &dense[..]);
        assert_eq!(var.len(), dense.len() + 1);
        assert_eq!(var.last().unwrap(), &("FM_VARLEN".into(), "1".into()));
    }

    #[test]
    fn check_names_the_bad_tensor() {
        let c = class();
        let good = args(10, 12, 3);
        assert_eq!(
            check_varlen_backward(&c, &good).unwrap(),
            VarlenShape {
                batch: 3,
                total_q: 10,
                total_k: 12
            }
        );
        let err = |a: VarlenBackwardArgs| check_varlen_backward(&c, &a).unwrap_err().to_string();
        let mut a = good;
        a.dk.shape[0] = 11;
        assert!(err(a).contains("dk"), "{}", err(a));
        let mut a = good;
        a.d_o.dtype = DType::F16;
        assert!(err(a).contains("d_o"), "{}", err(a));
        let mut a = good;
        a.lse.shape[1] = 9;
        assert!(err(a).contains("lse"), "{}", err(a));
        let mut a = good;
        a.cu_seqlens_k = RawIndex::vector(0x20, 3);
        assert!(err(a).contains("cu_seqlens_k"), "{}", err(a));
        let mut a = good;
        a.cu_seqlens_q = RawIndex::vector(0x10, 1);
        assert!(err(a).contains("batch + 1"), "{}", err(a));
        let mut a = good;
        a.max_seqlen_q = 0;
        assert!(err(a).contains("max_seqlen_q"), "{}", err(a));
        let mut a = good;
        a.max_seqlen_k = 13;
        assert!(err(a).contains("max_seqlen_k"), "{}", err(a));
        let mut a = good;
        a.dv = a.v;
        assert!(err(a).contains("same buffer"), "{}", err(a));
        let mut a = good;
        a.q = RawTensor::new(a.q.ptr, DType::Bf16, &[10, 4, 64], &[512, 64, 1]).unwrap();
        assert!(err(a).contains("contiguous"), "{}", err(a));
        let mut a = good;
        a.q = RawTensor::contiguous(a.q.ptr, DType::Bf16, &[1, 10, 4, 64]).unwrap();
        assert!(err(a).contains("3-D"), "{}", err(a));
        let e = check_varlen_backward(&c, &args(0, 12, 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("empty"), "{e}");
    }
}
