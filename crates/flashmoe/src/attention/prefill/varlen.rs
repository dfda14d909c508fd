//! Variable-length (packed) prefill on the sm_90a kernel: [`VarlenPlan`].
//!
//! A batch of sequences of unequal lengths is packed without padding, FlashAttention's
//! `flash_attn_varlen_func` layout: q and o `(total_q, heads_q, head_dim)`, k and v
//! `(total_k, heads_kv, head_dim)`, and int32 `cu_seqlens_q` / `cu_seqlens_k` `[batch + 1]`
//! in device memory (sequence b is rows `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` of q and
//! `cu_seqlens_k[b] .. cu_seqlens_k[b + 1]` of k and v). lse is `(heads_q, total_q)` f32,
//! natural log (FlashAttention's varlen convention). Causal is bottom-right per sequence:
//! query i of a sequence of lengths (sq, sk) sees keys j <= i + sk - sq. A sequence may be
//! empty (sq = 0: nothing to do; sk = 0: its rows get O = 0 and LSE = -inf).
//!
//! One launch: the kernel's persistent CTAs draw work tiles (sequence, query block, head)
//! from a dispenser, so no FLOPs go to padding and unequal sequences balance. The offsets
//! stay on the device (nothing waits for the host): `max_seqlen_q` only sizes the grid,
//! and the kernel clamps every offset into the tensors, so malformed offsets give wrong
//! numbers, never out-of-bounds accesses. The kernel is `flash_attn_fwd_sm90.cu` compiled
//! with `FM_VARLEN` (see its ABI note); the portable kernel has no varlen path, so the plan
//! needs compute capability 9.0 and head dim 64 or 128.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::abi::{KernelAbi, KernelVariant, LogitParams, Masking};
use super::{abi, select, tiles};

use super::plan::AttentionClass;
use super::tma;
use crate::attention::launch::launch_with_logits;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{param, Element, RawIndex, RawStream, RawTensor, RawWorkspace};
use crate::gpu::{Device, Workspace};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
};
use std::sync::Arc;

/// The tensors of one varlen call, raw (layouts in the module docs). q, k and v may be
/// strided views with the innermost dimension contiguous and the other strides multiples
/// of 8 elements (e.g. views into a packed `(total, heads_q + 2 heads_kv, head_dim)` QKV);
/// o and lse are contiguous.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VarlenArgs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub o: RawTensor,
    pub lse: RawTensor,
    /// int32 `[batch + 1]` ([`RawIndex::vector`]), non-decreasing, from 0 to at most total_q.
    pub cu_seqlens_q: RawIndex,
    /// int32 `[batch + 1]`, non-decreasing, from 0 to at most total_k.
    pub cu_seqlens_k: RawIndex,
    /// The longest query sequence (>= 1): sizes the grid only.
    pub max_seqlen_q: usize,
    /// The longest key sequence (informational, checked against total_k).
    pub max_seqlen_k: usize,
}

/// Batch size and packed row counts of a checked varlen call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VarlenShape {
    pub batch: usize,
    pub total_q: usize,
    pub total_k: usize,
}

/// The varlen sm_90a kernel resolved for a shape class on one device.
pub struct VarlenPlan {
    class: AttentionClass,
    variant: KernelVariant,
    func: CudaFunction,
    ctx: Arc<CudaContext>,
    sm_count: u32,
    masking: Masking,
    logits: LogitParams,
}

impl std::fmt::Debug for VarlenPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VarlenPlan")
            .field("class", &self.class)
            .field("defines", &self.variant.defines)
            .finish()
    }
}

/// The varlen kernel variant of a class (no device needed: the compile test uses it).
pub fn varlen_variant(class: &AttentionClass) -> Result<KernelVariant> {
    let problem = class.problem(1, 1, 1);
    problem.validate()?;
    let tile = tiles::sm90_tile(class.head_dim).ok_or_else(|| {
        Error::unsupported(
            "flash-sm90-varlen",
            format!(
                "head dim {} (varlen prefill runs on the sm_90a kernel: head dims {:?})",
                class.head_dim,
                tiles::SM90_HEAD_DIMS
            ),
        )
    })?;
    select::sm90_variant_for(&tile.for_varlen(), class.dtype, abi::Masking::of(&problem))
}

/// Work tiles a launch may have at most: no sequence has more query blocks than the
/// longest, and the blocks of all sequences are at most total_q / block_m plus one ragged
/// block each.
fn max_work_tiles(
    c: &AttentionClass,
    variant: &KernelVariant,
    s: &VarlenShape,
    max_seqlen_q: usize,
) -> u64 {
    let bm = variant.block_m as u64;
    let per_seq = (max_seqlen_q as u64).div_ceil(bm);
    let blocks = (s.batch as u64 * per_seq).min(s.total_q as u64 / bm + s.batch as u64);
    blocks * c.heads_q as u64
}

/// The checks of [`VarlenPlan::check`] without a device (the class's kernel variant is
/// resolved from the class alone): a varlen call's shapes, dtypes, strides, alignment and
/// sizes, O(1).
pub fn check_args(class: &AttentionClass, a: &VarlenArgs) -> Result<VarlenShape> {
    check_call(class, &varlen_variant(class)?, a)
}

fn check_call(c: &AttentionClass, variant: &KernelVariant, a: &VarlenArgs) -> Result<VarlenShape> {
    check_maps(c, variant, a).map(|(shape, _)| shape)
}

/// The checks and the TMA parameters of q, k and v (whose stride rules they enforce).
fn check_maps(
    c: &AttentionClass,
    variant: &KernelVariant,
    a: &VarlenArgs,
) -> Result<(VarlenShape, [tma::TensorMapParams; 3])> {
    let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
    for (name, t) in [("q", &a.q), ("k", &a.k), ("v", &a.v), ("o", &a.o)] {
        if t.rank != 3 {
            return Err(Error::invalid(format!(
                "{name} must be 3-D (total_tokens, heads, head_dim) for a varlen call but \
                 has shape {:?}",
                t.shape()
            )));
        }
    }
    let (tq, tk) = (a.q.shape[0], a.k.shape[0]);
    let io = c.dtype;
    a.q.expect("q", io, &[tq, hq, d], 16)?;
    a.k.expect("k", io, &[tk, hkv, d], 16)?;
    a.v.expect("v", io, &[tk, hkv, d], 16)?;
    a.o.expect_contiguous("o", io, &[tq, hq, d], 16)?;
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
    let batch = rows - 1;
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
    for (what, value) in [("total_q", tq), ("total_k", tk), ("batch + 1", rows)] {
        if value > abi::MAX_SEQLEN {
            return Err(Error::unsupported(
                "flash-sm90-varlen",
                format!("{what} = {value} exceeds {}", abi::MAX_SEQLEN),
            ));
        }
    }
    let shape = VarlenShape {
        batch,
        total_q: tq,
        total_k: tk,
    };
    let tiles = max_work_tiles(c, variant, &shape, a.max_seqlen_q);
    if 2 * tiles > i32::MAX as u64 {
        return Err(Error::unsupported(
            "flash-sm90-varlen",
            format!("up to {tiles} work tiles exceed the kernel's int work-tile counter"),
        ));
    }
    let KernelAbi::TensorMaps { block_n, .. } = variant.abi else {
        return Err(Error::unsupported(
            "flash-sm90-varlen",
            "the varlen kernel takes tensor maps",
        ));
    };
    // Packed (total, heads, head_dim) as a 4-D (1, total, heads, head_dim) map: the kernel's
    // batch coordinate is 0 and its row coordinate is the packed row.
    let as4 = |name: &str, t: &RawTensor, rows: u32| {
        let [n, h, d] = [t.shape[0], t.shape[1], t.shape[2]];
        let [s0, s1, s2] = [t.strides[0], t.strides[1], t.strides[2]];
        tma::bshd_strided_params(name, [1, n, h, d], [n * s0, s0, s1, s2], rows)
    };
    let maps = [
        as4("q", &a.q, variant.block_m)?,
        as4("k", &a.k, block_n)?,
        as4("v", &a.v, block_n)?,
    ];
    Ok((shape, maps))
}

impl VarlenPlan {
    /// Compile or load the varlen kernel for `class`. Errors on devices other than compute
    /// capability 9.0 (the portable kernel has no varlen path) and on head dims other than
    /// 64 and 128.
    pub fn new(dev: &Device, class: AttentionClass) -> Result<VarlenPlan> {
        let variant = varlen_variant(&class)?;
        if let Err(why) = variant.runs_on(dev.arch()) {
            let (major, minor) = dev.info().compute_capability;
            return Err(Error::unsupported(
                "flash-sm90-varlen",
                format!(
                    "varlen prefill needs the sm_90a kernel: it {why}, but {} is {major}.{minor}",
                    dev.info().name
                ),
            ));
        }
        let func = dev.load_kernel(variant.source_file, variant.entry, &variant.defines)?;
        dev.set_dynamic_shared_memory(variant.entry, &func, variant.shared_mem_bytes)?;
        Ok(VarlenPlan {
            masking: Masking::of(&class.problem(1, 1, 1)),
            logits: LogitParams::of(&class.problem(1, 1, 1)),
            class,
            variant,
            func,
            ctx: dev.context().clone(),
            sm_count: dev.info().sm_count,
        })
    }

    pub fn class(&self) -> &AttentionClass {
        &self.class
    }
    pub fn variant(&self) -> &KernelVariant {
        &self.variant
    }

    /// Bytes of the zeroed workspace each launch needs (the rank dispenser).
    pub fn workspace_bytes(&self) -> usize {
        match self.variant.abi {
            KernelAbi::TensorMaps {
                workspace_bytes, ..
            } => workspace_bytes,
            KernelAbi::Pointers => 0,
        }
    }

    /// A zeroed workspace for this plan on `stream` (allocates: do it once).
    pub fn alloc_workspace(&self, stream: &Arc<CudaStream>) -> Result<Workspace> {
        Workspace::zeroed(stream, self.workspace_bytes())
    }

    /// Check a call's tensors against the class and the kernel's rules, O(1) (the offsets
    /// live on the device and are not read); returns the batch size and row counts.
    pub fn check(&self, a: &VarlenArgs) -> Result<VarlenShape> {
        check_call(&self.class, &self.variant, a)
    }

    /// Enqueue the varlen forward on `stream`. Asynchronous; O(1) checks
    /// ([`VarlenPlan::check`]), no allocation, no synchronisation (graph-capturable).
    ///
    /// # Safety
    /// The contract of [`crate::gpu::raw`]: every address in `a` and the workspace is live
    /// device memory of this plan's context covering its span, the workspace is zeroed (as
    /// every launch leaves it) and not used by a launch that may run at the same time, and
    /// `stream` belongs to the context.
    pub unsafe fn forward_raw(
        &self,
        stream: RawStream,
        a: &VarlenArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let (shape, [pq, pk, pv]) = check_maps(&self.class, &self.variant, a)?;
        workspace.check(self.workspace_bytes(), 16, "VarlenPlan")?;
        crate::gpu::device::bind_context(&self.ctx)?;
        let dt = self.class.dtype;
        let mq = tma::encode("q", &pq, dt, a.q.ptr)?;
        let maps = [
            mq,
            tma::encode("k", &pk, dt, a.k.ptr)?,
            tma::encode("v", &pv, dt, a.v.ptr)?,
            mq, // tm_o: not read by the varlen kernel (O goes out with plain stores)
        ];
        let tiles = max_work_tiles(&self.class, &self.variant, &shape, a.max_seqlen_q);
        let cfg = LaunchConfig {
            grid_dim: (tiles.clamp(1, self.sm_count.max(1) as u64) as u32, 1, 1),
            block_dim: (self.variant.block_threads, 1, 1),
            shared_mem_bytes: self.variant.shared_mem_bytes,
        };
        let (tq, tk, hq, hkv, b) = (
            shape.total_q as i32,
            shape.total_k as i32,
            self.class.heads_q as i32,
            self.class.heads_kv as i32,
            shape.batch as i32,
        );
        let (o, lse, ws) = (a.o.ptr, a.lse.ptr, workspace.ptr);
        let (cu_q, cu_k) = (a.cu_seqlens_q.ptr, a.cu_seqlens_k.ptr);
        let params = [
            param(&maps[0]),
            param(&maps[1]),
            param(&maps[2]),
            param(&maps[3]),
            param(&o),
            param(&lse),
            param(&tq),
            param(&tk),
            param(&hq),
            param(&hkv),
            param(&self.logits.scale_log2),
            param(&b),
            param(&ws),
            param(&cu_q),
            param(&cu_k),
        ];
        launch_with_logits(
            self.variant.entry,
            &self.func,
            cfg,
            stream,
            &params,
            self.masking,
            &self.logits,
        )
    }

    /// [`VarlenPlan::forward_raw`] over contiguous cudarc buffers: q and o hold
    /// `total_q · heads_q · head_dim` elements, k and v `total_k · heads_kv · head_dim`,
    /// lse `heads_q · total_q`, the offsets `batch + 1` each; lengths and the stream's
    /// context are checked, cudarc's stream-order tracking is kept.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T, Q, K, V, O, L, CQ, CK>(
        &self,
        stream: &Arc<CudaStream>,
        q: &Q,
        k: &K,
        v: &V,
        o: &mut O,
        lse: &mut L,
        cu_seqlens_q: &CQ,
        cu_seqlens_k: &CK,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        workspace: &mut Workspace,
    ) -> Result<()>
    where
        T: Element,
        Q: DevicePtr<T>,
        K: DevicePtr<T>,
        V: DevicePtr<T>,
        O: DevicePtrMut<T>,
        L: DevicePtrMut<f32>,
        CQ: DevicePtr<i32>,
        CK: DevicePtr<i32>,
    {
        crate::gpu::device::check_stream_context(stream, &self.ctx)?;
        workspace.check_for(stream, self.workspace_bytes(), "VarlenPlan")?;
        let c = &self.class;
        let row_q = c.heads_q * c.head_dim;
        let row_k = c.heads_kv * c.head_dim;
        let rows = |name: &str, len: usize, row: usize| -> Result<usize> {
            if len % row != 0 {
                return Err(Error::invalid(format!(
                    "{name} holds {len} elements, not a multiple of heads x head_dim = {row}"
                )));
            }
            Ok(len / row)
        };
        let tq = rows("q", q.len(), row_q)?;
        let tk = rows("k", k.len(), row_k)?;
        for (name, len, want) in [
            ("v", v.len(), tk * row_k),
            ("o", o.len(), tq * row_q),
            ("lse", lse.len(), tq * c.heads_q),
            ("cu_seqlens_k", cu_seqlens_k.len(), cu_seqlens_q.len()),
        ] {
            if len != want {
                return Err(Error::invalid(format!(
                    "{name} holds {len} elements but {want} are required"
                )));
            }
        }
        let batch1 = cu_seqlens_q.len();
        let (qp, _gq) = q.device_ptr(stream);
        let (kp, _gk) = k.device_ptr(stream);
        let (vp, _gv) = v.device_ptr(stream);
        let (cqp, _gcq) = cu_seqlens_q.device_ptr(stream);
        let (ckp, _gck) = cu_seqlens_k.device_ptr(stream);
        let (op, _go) = o.device_ptr_mut(stream);
        let (lp, _gl) = lse.device_ptr_mut(stream);
        let args = VarlenArgs {
            q: RawTensor::contiguous(qp, T::DTYPE, &[tq, c.heads_q, c.head_dim])?,
            k: RawTensor::contiguous(kp, T::DTYPE, &[tk, c.heads_kv, c.head_dim])?,
            v: RawTensor::contiguous(vp, T::DTYPE, &[tk, c.heads_kv, c.head_dim])?,
            o: RawTensor::contiguous(op, T::DTYPE, &[tq, c.heads_q, c.head_dim])?,
            lse: RawTensor::contiguous(lp, DType::F32, &[c.heads_q, tq])?,
            cu_seqlens_q: RawIndex::vector(cqp, batch1),
            cu_seqlens_k: RawIndex::vector(ckp, batch1),
            max_seqlen_q,
            max_seqlen_k,
        };
        let ws = workspace.raw();
        // SAFETY: every buffer is a live cudarc allocation of the plan's context whose
        // length matches its tensor (checked above); the guards keep cudarc's stream order
        // until after the launch; the workspace is the plan's size, zeroed when allocated,
        // left zeroed by every launch, and bound to this stream.
        unsafe { self.forward_raw(stream.cu_stream(), &args, ws) }
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<VarlenPlan>();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(d: usize, causal: bool) -> AttentionClass {
        AttentionClass {
            dtype: DType::Bf16,
            head_dim: d,
            heads_q: 8,
            heads_kv: 2,
            causal,
            softmax_scale: None,
            window: crate::problem::NO_WINDOW,
            softcap: 0.0,
        }
    }

    #[test]
    fn varlen_variant_is_the_sm90_tile_with_fm_varlen() {
        for d in [64, 128] {
            for causal in [false, true] {
                let v = varlen_variant(&class(d, causal)).unwrap();
                assert_eq!(v.entry, abi::SM90_ENTRY);
                assert!(v
                    .defines
                    .contains(&("FM_VARLEN".to_string(), "1".to_string())));
                let tile = tiles::sm90_tile(d).unwrap().for_varlen();
                assert_eq!(v.shared_mem_bytes, tile.shared_mem_bytes());
                // No split of the last wave: the workspace is the dispenser alone.
                assert_eq!(
                    v.abi,
                    KernelAbi::TensorMaps {
                        block_n: tile.block_n,
                        persistent: true,
                        workspace_bytes: 256
                    }
                );
            }
        }
    }

    #[test]
    fn varlen_needs_an_sm90_head_dim() {
        let e = varlen_variant(&class(96, false)).unwrap_err().to_string();
        assert!(e.contains("head dim 96"), "{e}");
    }
}
