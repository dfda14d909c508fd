//! [`AttentionBackwardPlan`]: the kernels of one shape class, resolved once; the raw
//! layer (pointers on the caller's stream) and the cudarc layer.

use super::abi::{
    BwdLaunch, BWD_DKDV_ENTRY, BWD_DQ_ENTRY, BWD_PREPROCESS_ENTRY, BWD_SM90_DKDV_ENTRY,
    BWD_SM90_DQ_CONVERT_ENTRY, BWD_SM90_DQ_ENTRY, BWD_SM90_DQ_ZERO_ENTRY, BWD_SM90_SOURCE,
    BWD_SOURCE, PREPROCESS_ROWS, SM90_DQ_TILE_ROWS,
};
use super::tiles::{
    bwd_defines, default_kernel, sm90_bwd_defines, sm90_serves, BwdKernel, BwdMode, BwdTile,
    Sm90BwdTile, Sm90Dq, BWD_HEAD_DIMS, BWD_SM90_HEAD_DIMS,
};
use crate::attention::plan::{AttentionClass, CallShape};
use crate::attention::prefill::abi::{LogitParams, MAX_GRID_YZ, MAX_SEQLEN};
use crate::attention::prefill::tma;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{launch, param, RawStream, RawTensor, RawWorkspace};
use crate::gpu::Device;
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use std::sync::Arc;

/// The tensors of one backward call, raw, all contiguous. q, o, d_o and dq: (batch,
/// seqlen_q, heads_q, head_dim); k, v, dk and dv: (batch, seqlen_k, heads_kv, head_dim),
/// in the class's dtype; lse: (batch, heads_q, seqlen_q) f32, the forward's natural-log
/// LSE (−inf for a row that sees no key). o and lse are what the forward wrote for these
/// q, k, v (the backward recomputes P from lse). dq, dk and dv are written entirely (every
/// element, zeros where no gradient flows) and must not overlap the inputs or each other.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackwardArgs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub o: RawTensor,
    pub d_o: RawTensor,
    pub lse: RawTensor,
    pub dq: RawTensor,
    pub dk: RawTensor,
    pub dv: RawTensor,
}

/// The backward kernels resolved for one shape class on one device.
pub struct AttentionBackwardPlan {
    class: AttentionClass,
    tile: BwdTile,
    kernel: BwdKernel,
    logits: LogitParams,
    scale: f32,
    preprocess: CudaFunction,
    dkdv: CudaFunction,
    /// The dQ kernel, or with a fused-dQ sm_90a tile the f32-to-dq conversion.
    dq: CudaFunction,
    /// Fused-dQ sm_90a tiles: zeroes the f32 dQ tiles and their semaphores.
    dq_zero: Option<CudaFunction>,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for AttentionBackwardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttentionBackwardPlan")
            .field("class", &self.class)
            .field("tile", &self.tile)
            .field("kernel", &self.kernel)
            .finish()
    }
}

/// Bytes of one f32 (batch, heads_q, seqlen_q) region of the workspace, 256-byte aligned.
fn region_bytes(batch: usize, heads_q: usize, seqlen_q: usize) -> usize {
    (batch * heads_q * seqlen_q * 4).div_ceil(256) * 256
}

impl AttentionBackwardPlan {
    /// Check that the backward serves `class` (bf16 or f16, a head dim of
    /// [`BWD_HEAD_DIMS`], a valid problem), compile or load its kernels for `dev` (compute
    /// capability 8.0 or newer) and set their shared-memory limits. On compute capability
    /// 9.0 the classes [`sm90_serves`] run the sm_90a kernels ([`default_kernel`]: but
    /// deterministic causal softcap at D = 64), the others the portable ones.
    /// `mode` picks between the fastest kernels and bit-identical gradients
    /// ([`BwdMode`]); off compute capability 9.0 both are the portable kernels.
    pub fn new(
        dev: &Device,
        class: AttentionClass,
        mode: BwdMode,
    ) -> Result<AttentionBackwardPlan> {
        Self::with_kernel(dev, class, Some(default_kernel(&class, mode, dev.arch())))
    }

    /// [`AttentionBackwardPlan::new`] with the kernels chosen by the caller (`None`: the
    /// selection of `new` in [`BwdMode::Deterministic`]): the tests check both paths, the
    /// lab times tiles. An sm_90a choice on another device, for a class it does not serve,
    /// or with an invalid tile is an error.
    pub fn with_kernel(
        dev: &Device,
        class: AttentionClass,
        kernel: Option<BwdKernel>,
    ) -> Result<AttentionBackwardPlan> {
        let problem = class.problem(1, 1, 1);
        problem.validate()?;
        let backend = "attention backward";
        if !matches!(class.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::unsupported(
                backend,
                format!("dtype {} (bf16 and f16 only)", class.dtype),
            ));
        }
        let tile = BwdTile::for_head_dim(class.head_dim).ok_or_else(|| {
            Error::unsupported(
                backend,
                format!("head dim {} (served: {:?})", class.head_dim, BWD_HEAD_DIMS),
            )
        })?;
        if class.heads_q > MAX_GRID_YZ {
            return Err(Error::unsupported(
                backend,
                format!(
                    "heads_q = {} exceeds the grid limit {MAX_GRID_YZ}",
                    class.heads_q
                ),
            ));
        }
        if dev.arch() < 80 {
            return Err(Error::unsupported(
                backend,
                format!(
                    "needs compute capability 8.0 or newer (mma.sync bf16), but {} is {}.{}",
                    dev.info().name,
                    dev.info().compute_capability.0,
                    dev.info().compute_capability.1
                ),
            ));
        }
        let kernel = match kernel {
            Some(k) => k,
            None => default_kernel(&class, BwdMode::Deterministic, dev.arch()),
        };
        let defines = bwd_defines(&class, &tile);
        let preprocess = dev.load_kernel(BWD_SOURCE, BWD_PREPROCESS_ENTRY, &defines)?;
        let (dkdv, dq, dq_zero) = match kernel {
            BwdKernel::Portable => {
                let dkdv = dev.load_kernel(BWD_SOURCE, BWD_DKDV_ENTRY, &defines)?;
                let dq = dev.load_kernel(BWD_SOURCE, BWD_DQ_ENTRY, &defines)?;
                dev.set_dynamic_shared_memory(BWD_DKDV_ENTRY, &dkdv, tile.kv_smem_bytes())?;
                dev.set_dynamic_shared_memory(BWD_DQ_ENTRY, &dq, tile.q_smem_bytes())?;
                (dkdv, dq, None)
            }
            BwdKernel::Sm90(t) => {
                if dev.arch() != 90 {
                    return Err(Error::unsupported(
                        backend,
                        format!(
                            "the sm_90a kernels need compute capability 9.0, but {} is {}.{}",
                            dev.info().name,
                            dev.info().compute_capability.0,
                            dev.info().compute_capability.1
                        ),
                    ));
                }
                if !sm90_serves(&class) {
                    return Err(Error::unsupported(
                        backend,
                        format!(
                            "the sm_90a kernels serve head dims {BWD_SM90_HEAD_DIMS:?} in bf16 or \
                             f16; not {class:?}"
                        ),
                    ));
                }
                if !t.is_valid() || t.head_dim as usize != class.head_dim {
                    return Err(Error::invalid(format!(
                        "sm_90a backward tile {t:?} is not valid for head dim {}",
                        class.head_dim
                    )));
                }
                if !t.serves(&class) {
                    return Err(Error::unsupported(
                        backend,
                        format!(
                            "sm_90a backward tile {t:?} does not serve {class:?}: the ordered \
                             fused dQ does not serve sliding windows (a dQ tile's key blocks are \
                             then not a prefix), and softcap needs 64 query rows a dK/dV step \
                             and 64 keys a dQ-kernel step (Sm90BwdTile::serves, for_class)"
                        ),
                    ));
                }
                let defs = sm90_bwd_defines(&class, &t);
                let dkdv = dev.load_kernel(BWD_SM90_SOURCE, BWD_SM90_DKDV_ENTRY, &defs)?;
                dev.set_dynamic_shared_memory(BWD_SM90_DKDV_ENTRY, &dkdv, t.kv_smem_bytes())?;
                if t.dq.fused() {
                    let convert =
                        dev.load_kernel(BWD_SM90_SOURCE, BWD_SM90_DQ_CONVERT_ENTRY, &defs)?;
                    let zero = dev.load_kernel(BWD_SM90_SOURCE, BWD_SM90_DQ_ZERO_ENTRY, &defs)?;
                    (dkdv, convert, Some(zero))
                } else {
                    let dq = dev.load_kernel(BWD_SM90_SOURCE, BWD_SM90_DQ_ENTRY, &defs)?;
                    dev.set_dynamic_shared_memory(BWD_SM90_DQ_ENTRY, &dq, t.q_smem_bytes())?;
                    (dkdv, dq, None)
                }
            }
        };
        Ok(AttentionBackwardPlan {
            class,
            tile,
            kernel,
            logits: LogitParams::of(&problem),
            scale: problem.scale(),
            preprocess,
            dkdv,
            dq,
            dq_zero,
            ctx: dev.context().clone(),
        })
    }

    pub fn class(&self) -> &AttentionClass {
        &self.class
    }
    pub fn tile(&self) -> &BwdTile {
        &self.tile
    }
    /// The kernels this plan runs.
    pub fn kernel(&self) -> BwdKernel {
        self.kernel
    }
    /// Whether two calls on the same inputs give the same bits.
    pub fn deterministic(&self) -> bool {
        match self.kernel {
            BwdKernel::Portable => true,
            BwdKernel::Sm90(t) => t.dq.deterministic(),
        }
    }

    /// Bytes of the workspace a call of `batch` sequences of `seqlen_q` queries needs: the
    /// f32 Delta and log2-LSE of every query row (2 × batch · heads_q · seqlen_q · 4,
    /// rounded up to 256 bytes each), and with a fused-dQ sm_90a tile the f32 dQ of every
    /// query row (seqlen_q rounded up to 64: batch · heads_q · rows · head_dim · 4) and one
    /// semaphore per 64-row tile. Any contents: every launch writes it before reading.
    /// Launches that may run at the same time need one each.
    pub fn workspace_bytes(&self, batch: usize, seqlen_q: usize) -> usize {
        let rows = 2 * region_bytes(batch, self.class.heads_q, seqlen_q);
        match self.kernel {
            BwdKernel::Sm90(t) if t.dq.fused() => {
                let (accum, sems) = self.dq_accum_bytes(batch, seqlen_q);
                rows + accum + sems
            }
            _ => rows,
        }
    }

    /// Fused dQ: bytes of the f32 dQ tiles and of their semaphores (256-byte multiples).
    fn dq_accum_bytes(&self, batch: usize, seqlen_q: usize) -> (usize, usize) {
        let tiles = batch * self.class.heads_q * seqlen_q.div_ceil(SM90_DQ_TILE_ROWS);
        let accum = tiles * SM90_DQ_TILE_ROWS * self.class.head_dim * 4;
        (accum.div_ceil(256) * 256, (tiles * 4).div_ceil(256) * 256)
    }

    /// Check a call's tensors against the class and the kernels' rules, O(1); returns the
    /// batch size and sequence lengths. Errors name the tensor and the rule.
    pub fn check(&self, a: &BackwardArgs) -> Result<CallShape> {
        let shape = self.class.check_inputs(&a.q, &a.k, &a.v)?;
        let CallShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
        } = shape;
        let c = &self.class;
        let (hq, hkv, d, dt) = (c.heads_q, c.heads_kv, c.head_dim, c.dtype);
        for (name, t) in [("q", &a.q), ("k", &a.k), ("v", &a.v)] {
            if !t.is_contiguous() {
                return Err(Error::unsupported(
                    "attention backward",
                    format!(
                        "{name} is a strided view (strides {:?}); the backward takes contiguous \
                         tensors",
                        t.strides()
                    ),
                ));
            }
        }
        for (name, t, shape) in [
            ("o", &a.o, [b, sq, hq, d]),
            ("d_o", &a.d_o, [b, sq, hq, d]),
            ("dq", &a.dq, [b, sq, hq, d]),
            ("dk", &a.dk, [b, sk, hkv, d]),
            ("dv", &a.dv, [b, sk, hkv, d]),
        ] {
            if t.rank != 4 {
                return Err(Error::invalid(format!(
                    "{name} must be 4-D (batch, seq, heads, head_dim) but has shape {:?}",
                    t.shape()
                )));
            }
            t.expect_contiguous(name, dt, &shape, 16)?;
        }
        a.lse
            .expect_contiguous("lse", DType::F32, &[b, hq, sq], 4)?;
        for (what, value) in [("seqlen_q", sq), ("seqlen_k", sk)] {
            if value > MAX_SEQLEN {
                return Err(Error::unsupported(
                    "attention backward",
                    format!("{what} = {value} exceeds {MAX_SEQLEN}"),
                ));
            }
        }
        if b > MAX_GRID_YZ {
            return Err(Error::unsupported(
                "attention backward",
                format!("batch = {b} exceeds the grid limit {MAX_GRID_YZ}"),
            ));
        }
        for (name, t) in [("dq", &a.dq), ("dk", &a.dk), ("dv", &a.dv)] {
            for (iname, i) in [
                ("q", &a.q),
                ("k", &a.k),
                ("v", &a.v),
                ("o", &a.o),
                ("d_o", &a.d_o),
            ] {
                if t.ptr == i.ptr {
                    return Err(Error::invalid(format!(
                        "{name} and {iname} are the same buffer; gradients need their own"
                    )));
                }
            }
        }
        Ok(shape)
    }

    /// Enqueue the backward pass on `stream`: dq, dk and dv of the forward that produced
    /// `a.o` and `a.lse` from `a.q`, `a.k`, `a.v`, given `a.d_o`. Asynchronous; O(1) checks
    /// ([`AttentionBackwardPlan::check`]), no allocation; three launches.
    ///
    /// # Safety
    /// The contract of [`crate::gpu::raw`]: every address in `a` and `workspace .. workspace
    /// + workspace_bytes(batch, seqlen_q)` is live device memory of this plan's context
    ///   covering its tensor's span, the workspace is not used by a launch that may run at
    ///   the same time, and `stream` belongs to the context. The workspace is checked for
    ///   size and alignment.
    pub unsafe fn backward_raw(
        &self,
        stream: RawStream,
        a: &BackwardArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let shape = self.check(a)?;
        let (b, sq, sk) = (shape.batch, shape.seqlen_q, shape.seqlen_k);
        let hq = self.class.heads_q;
        workspace.check(self.workspace_bytes(b, sq), 16, "AttentionBackwardPlan")?;
        crate::gpu::device::bind_context(&self.ctx)?;
        let lse2 = workspace.ptr;
        let delta = workspace.ptr + region_bytes(b, hq, sq) as u64;
        let (sq_i, sk_i, hq_i, hkv_i) =
            (sq as i32, sk as i32, hq as i32, self.class.heads_kv as i32);
        let (o, d_o, lse) = (a.o.ptr, a.d_o.ptr, a.lse.ptr);
        let pre = LaunchConfig {
            grid_dim: ((sq as u32).div_ceil(PREPROCESS_ROWS), hq as u32, b as u32),
            block_dim: (32 * PREPROCESS_ROWS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut params = [
            param(&o),
            param(&d_o),
            param(&lse),
            param(&lse2),
            param(&delta),
            param(&sq_i),
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
            seqlen_q: sq_i,
            seqlen_k: sk_i,
            heads_q: hq_i,
            heads_kv: hkv_i,
            scale: self.scale,
            logits: self.logits,
            cu_seqlens: None,
        };
        if let BwdKernel::Sm90(t) = self.kernel {
            return self.launch_sm90(&t, stream, &args, a, (b, sq, sk));
        }
        let t = &self.tile;
        let kv = LaunchConfig {
            grid_dim: (
                (sk as u32).div_ceil(t.kv_block_n()),
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
            grid_dim: ((sq as u32).div_ceil(t.q_block_m()), hq as u32, b as u32),
            block_dim: (32 * t.q_warps, 1, 1),
            shared_mem_bytes: t.q_smem_bytes(),
        };
        args.launch(BWD_DQ_ENTRY, &self.dq, qc, stream, &[a.dq.ptr])
    }
}

impl AttentionBackwardPlan {
    /// The dK/dV and dQ launches of the sm_90a kernels (after the preprocess).
    ///
    /// # Safety
    /// As [`AttentionBackwardPlan::backward_raw`], whose checks `a` has passed.
    unsafe fn launch_sm90(
        &self,
        t: &Sm90BwdTile,
        stream: RawStream,
        args: &BwdLaunch,
        a: &BackwardArgs,
        (b, sq, sk): (usize, usize, usize),
    ) -> Result<()> {
        let (dk, dv, dq) = (a.dk.ptr, a.dv.ptr, a.dq.ptr);
        // Fused dQ: the f32 tiles and their semaphores follow lse2 and delta.
        let (dq_accum, dq_sem) = if t.dq.fused() {
            let accum = args.delta + region_bytes(b, self.class.heads_q, sq) as u64;
            let (accum_bytes, sem_bytes) = self.dq_accum_bytes(b, sq);
            let sem = accum + accum_bytes as u64;
            let zero = self
                .dq_zero
                .as_ref()
                .expect("fused tiles load the zero kernel");
            let n4 = (accum_bytes / 16) as i64;
            let n_sem = (sem_bytes / 4) as i32;
            let zc = LaunchConfig {
                grid_dim: (((n4 as u64).div_ceil(256).min(4096)) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut params = [param(&accum), param(&n4), param(&sem), param(&n_sem)];
            launch(BWD_SM90_DQ_ZERO_ENTRY, zero, zc, stream, &mut params)?;
            (accum, sem)
        } else {
            (0u64, 0u64)
        };
        let kblocks = (sk as u32).div_ceil(t.kv_block_n());
        let hkv = self.class.heads_kv as u32;
        // Ordered dQ: key blocks slowest (the kernel's comment says why).
        let grid_dim = if t.dq == Sm90Dq::Ordered {
            (hkv * b as u32, kblocks, 1)
        } else {
            (kblocks, hkv, b as u32)
        };
        let kv = LaunchConfig {
            grid_dim,
            block_dim: (t.kv_threads(), 1, 1),
            shared_mem_bytes: t.kv_smem_bytes(),
        };
        // The producer build loads by TMA: boxes of 64 columns x a step's query rows (Q,
        // dO) or the CTA's keys (K, V).
        let maps = if t.producer() {
            let dt = self.class.dtype;
            let (rows_q, rows_k) = (t.kv_block_m, t.kv_block_n());
            let pq = tma::bshd_strided_params("q", a.q.shape, a.q.strides, rows_q)?;
            let pk = tma::bshd_strided_params("k", a.k.shape, a.k.strides, rows_k)?;
            let pv = tma::bshd_strided_params("v", a.v.shape, a.v.strides, rows_k)?;
            let po = tma::bshd_strided_params("d_o", a.d_o.shape, a.d_o.strides, rows_q)?;
            Some([
                tma::encode("q", &pq, dt, a.q.ptr)?,
                tma::encode("k", &pk, dt, a.k.ptr)?,
                tma::encode("v", &pv, dt, a.v.ptr)?,
                tma::encode("d_o", &po, dt, a.d_o.ptr)?,
            ])
        } else {
            None
        };
        args.launch_sm90_dkdv(
            &self.dkdv,
            kv,
            stream,
            (dk, dv),
            (dq_accum, dq_sem),
            maps.as_ref(),
        )?;
        if t.dq.fused() {
            let cc = LaunchConfig {
                grid_dim: (
                    sq.div_ceil(SM90_DQ_TILE_ROWS) as u32,
                    self.class.heads_q as u32,
                    b as u32,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut params = [
                param(&dq_accum),
                param(&dq),
                param(&args.seqlen_q),
                param(&args.heads_q),
                param(&self.scale),
            ];
            return launch(BWD_SM90_DQ_CONVERT_ENTRY, &self.dq, cc, stream, &mut params);
        }
        let qc = LaunchConfig {
            grid_dim: (
                (sq as u32).div_ceil(t.q_block_m()),
                self.class.heads_q as u32,
                b as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: t.q_smem_bytes(),
        };
        args.launch(BWD_SM90_DQ_ENTRY, &self.dq, qc, stream, &[dq])
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<AttentionBackwardPlan>();
}
