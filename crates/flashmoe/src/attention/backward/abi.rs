//! The backward kernels' ABI: their sources and entry points, and the argument list the
//! dK/dV and dQ kernels of both builds (portable and sm_90a) take ([`BwdLaunch`]), declared
//! once for the dense and varlen plans.

use crate::attention::prefill::abi::LogitParams;
use crate::error::Result;
use crate::gpu::raw::{launch, param, RawStream};
use crate::gpu::tensor_map::TensorMap;
use cudarc::driver::{CudaFunction, LaunchConfig};

/// Source file of the three backward kernels.
pub const BWD_SOURCE: &str = "flash_attn_bwd.cu";
pub const BWD_PREPROCESS_ENTRY: &str = "flash_attn_bwd_preprocess";
pub const BWD_DKDV_ENTRY: &str = "flash_attn_bwd_dkdv";
pub const BWD_DQ_ENTRY: &str = "flash_attn_bwd_dq";
/// Rows per block of the preprocess kernel (one warp each).
pub(super) const PREPROCESS_ROWS: u32 = 4;
/// Source of the Hopper (sm_90a, wgmma) dK/dV and dQ kernels; the preprocess stays
/// [`BWD_PREPROCESS_ENTRY`] of [`BWD_SOURCE`].
pub const BWD_SM90_SOURCE: &str = "flash_attn_bwd_sm90.cu";
pub const BWD_SM90_DKDV_ENTRY: &str = "flash_attn_bwd_sm90_dkdv";
pub const BWD_SM90_DQ_ENTRY: &str = "flash_attn_bwd_sm90_dq";
/// The fused-dQ modes' workspace kernels: zero the f32 dQ tiles and their semaphores before
/// the dK/dV kernel, convert the tiles into dq after it.
pub const BWD_SM90_DQ_ZERO_ENTRY: &str = "flash_attn_bwd_sm90_dq_zero";
pub const BWD_SM90_DQ_CONVERT_ENTRY: &str = "flash_attn_bwd_sm90_dq_convert";
/// Query rows of one f32 dQ tile of the fused modes (the dK/dV kernel's step).
pub(super) const SM90_DQ_TILE_ROWS: usize = 64;

/// The dK/dV and dQ kernels' ABI, `flash_attn_bwd.cu`'s and `flash_attn_bwd_sm90.cu`'s
/// alike: the arguments they take, in their order, declared once for the dense and the
/// varlen plans. The lists are the inputs, then the kernel's outputs (dk, dv or dq), then
/// the shapes, the logit parameters, the sm_90a dK/dV kernel's fused-dQ workspace (its
/// f32 tiles and semaphores), the window and, built with FM_VARLEN, the two offset arrays
/// (`FM_CU_PARAMS`) or, the sm_90a dK/dV kernel built with FM_PRODUCER, the tensor maps of
/// q, k, v and dO (`FM_TMAP_PARAMS`).
pub(super) struct BwdLaunch {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub d_o: u64,
    pub lse2: u64,
    pub delta: u64,
    /// Sq and Sk (dense) or total_q and total_k (varlen).
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub heads_q: i32,
    pub heads_kv: i32,
    pub scale: f32,
    pub logits: LogitParams,
    /// Varlen: cu_seqlens_q and cu_seqlens_k.
    pub cu_seqlens: Option<(u64, u64)>,
}

/// What only the sm_90a dK/dV kernel takes: the fused-dQ workspace (f32 tiles, semaphores)
/// and, built with FM_PRODUCER, the tensor maps of q, k, v and dO.
type Sm90DkdvExtras<'a> = ((u64, u64), Option<&'a [TensorMap; 4]>);

impl BwdLaunch {
    /// Enqueue `entry` (a portable kernel, or the sm_90a dQ kernel; `outputs` = [dk, dv]
    /// for a dK/dV kernel, [dq] for a dQ kernel) on `stream`.
    ///
    /// # Safety
    /// As [`launch`]: `func` is `entry` of a module built for this ABI (varlen exactly when
    /// `cu_seqlens` is set), every address is live device memory covering its span.
    pub unsafe fn launch(
        &self,
        entry: &str,
        func: &CudaFunction,
        cfg: LaunchConfig,
        stream: RawStream,
        outputs: &[u64],
    ) -> Result<()> {
        self.enqueue(entry, func, cfg, stream, outputs, None)
    }

    /// Enqueue the sm_90a dK/dV kernel ([`BWD_SM90_DKDV_ENTRY`]) writing dk and dv; `dq_ws`
    /// = the fused-dQ f32 tiles and their semaphores (zeros for the dQ-kernel tiles);
    /// `maps` = the producer build's tensor maps of q, k, v and dO (FM_TMAP_PARAMS).
    ///
    /// # Safety
    /// As [`BwdLaunch::launch`]; `maps` describe the tensors at `q`, `k`, `v` and `d_o`.
    pub unsafe fn launch_sm90_dkdv(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        stream: RawStream,
        (dk, dv): (u64, u64),
        dq_ws: (u64, u64),
        maps: Option<&[TensorMap; 4]>,
    ) -> Result<()> {
        self.enqueue(
            BWD_SM90_DKDV_ENTRY,
            func,
            cfg,
            stream,
            &[dk, dv],
            Some((dq_ws, maps)),
        )
    }

    unsafe fn enqueue(
        &self,
        entry: &str,
        func: &CudaFunction,
        cfg: LaunchConfig,
        stream: RawStream,
        outputs: &[u64],
        sm90_dkdv: Option<Sm90DkdvExtras>,
    ) -> Result<()> {
        let (dq_ws, maps) = match sm90_dkdv {
            Some((ws, maps)) => (Some(ws), maps),
            None => (None, None),
        };
        debug_assert!(matches!(outputs.len(), 1 | 2), "[dk, dv] or [dq]");
        let lp = &self.logits;
        // At most 6 inputs + 2 outputs + 7 scalars + 2 workspace + 2 window + 2 offsets + 4
        // tensor maps, on the stack (no allocation per call).
        let mut params = [std::ptr::null_mut(); 25];
        let mut n = 0;
        let mut push = |p| {
            params[n] = p;
            n += 1;
        };
        for p in [
            &self.q,
            &self.k,
            &self.v,
            &self.d_o,
            &self.lse2,
            &self.delta,
        ] {
            push(param(p));
        }
        for p in outputs {
            push(param(p));
        }
        for p in [
            &self.seqlen_q,
            &self.seqlen_k,
            &self.heads_q,
            &self.heads_kv,
        ] {
            push(param(p));
        }
        for p in [&self.scale, &lp.scale_log2, &lp.softcap_log2] {
            push(param(p));
        }
        if let Some((accum, sem)) = &dq_ws {
            push(param(accum));
            push(param(sem));
        }
        push(param(&lp.window_left));
        push(param(&lp.window_right));
        if let Some((cu_q, cu_k)) = &self.cu_seqlens {
            push(param(cu_q));
            push(param(cu_k));
        }
        for m in maps.into_iter().flatten() {
            push(param(m));
        }
        launch(entry, func, cfg, stream, &mut params[..n])
    }
}
