//! The `CustomOp3::cuda_fwd` bodies: from candle's CUDA storages and layouts to one
//! flashmoe launch on candle's own stream. Checks first (`check.rs`), then the cached plan
//! and workspace (`plans.rs`), the output and lse allocated through candle, and the launch
//! (`flashmoe_api.rs`). Outputs are new contiguous tensors of q's shape.
//! Index tensors go through `cuda_index.rs`.

use crate::check::{
    check_alibi_call, check_call, check_paged, check_varlen, Elem, PagedIndexes, PlanKey,
};
use crate::cuda_index::{int32_matrix, int32_view};
use crate::flashmoe_api::{self as api, DecodeIndexes, Dims, PackedIo, Plan};
use crate::{plans, FlashAttn, FlashAttnPaged, FlashAttnVarlen};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView};
use candle_core::{bail, CudaStorage, Layout, Result, Shape, Storage, Tensor};

fn dims(l: &Layout) -> Dims {
    let d = l.dims();
    let s = l.stride();
    let mut out = Dims {
        rank: d.len(),
        shape: [0; 4],
        strides: [0; 4],
    };
    out.shape[..d.len()].copy_from_slice(d);
    out.strides[..d.len()].copy_from_slice(s);
    out
}

/// The plan a checked call named, or an error if the cache holds another kind under it
/// (cannot happen: the key's variant selects the plan's).
fn mismatch() -> candle_core::Error {
    candle_core::Error::Msg("flashmoe-candle: plan cache returned another plan kind".into()).bt()
}

pub(crate) fn forward(
    op: &FlashAttn,
    q: &CudaStorage,
    q_l: &Layout,
    k: &CudaStorage,
    k_l: &Layout,
    v: &CudaStorage,
    v_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    if let Some(slopes) = &op.alibi_slopes {
        return alibi(op, slopes, q, q_l, k, k_l, v, v_l);
    }
    // The device routes windows and softcap (the sm_90a kernel or the decode kernels).
    let arch = plans::arch(&q.device().cuda_stream())?;
    let call = check_call(
        (q.dtype(), k.dtype(), v.dtype()),
        q_l,
        k_l,
        v_l,
        op.softmax_scale,
        (op.window_size_left, op.window_size_right),
        op.softcap,
        arch,
    )?;
    match call.plan.elem() {
        Elem::Bf16 => forward_t::<half::bf16>(&call, q, q_l, k, k_l, v, v_l),
        Elem::F16 => forward_t::<half::f16>(&call, q, q_l, k, k_l, v, v_l),
    }
}

fn forward_t<T: api::Element>(
    call: &crate::check::Call,
    q: &CudaStorage,
    q_l: &Layout,
    k: &CudaStorage,
    k_l: &Layout,
    v: &CudaStorage,
    v_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = q.device();
    let stream = dev.cuda_stream();
    let s = call.shape;

    let plan = plans::plan(&stream, &call.plan)?;

    let out_shape = q_l.shape().clone();
    let out_l = Layout::contiguous(&out_shape);
    // SAFETY: both kernels write every element of o (each (b, row, head) tile is stored).
    let mut out = unsafe { dev.alloc::<T>(out_shape.elem_count()) }?;
    let mut lse = dev.alloc_zeros::<f32>(s.batch * s.heads_q * s.seq_q)?;
    let q_v = q.as_cuda_slice::<T>()?.slice(q_l.start_offset()..);
    let k_v = k.as_cuda_slice::<T>()?.slice(k_l.start_offset()..);
    let v_v = v.as_cuda_slice::<T>()?.slice(v_l.start_offset()..);
    let need = api::workspace_bytes(&plan, s.batch, s.seq_k);

    match &*plan {
        // Views start at each layout's offset; the strides carry the rest.
        Plan::Dense(p) => plans::with_workspace(&stream, need, |ws| {
            let mut lse_view = lse.slice_mut(..);
            api::forward::<T>(
                p,
                &stream,
                (q_v, dims(q_l)),
                (k_v, dims(k_l)),
                (v_v, dims(v_l)),
                (out.slice_mut(..), dims(&out_l)),
                &mut lse_view,
                ws,
            )
        })?,
        // A dense cache is the decode kernel's one-page-per-sequence case: k (b, sk, hkv, d)
        // as b pages of sk keys, the identity block table, every sequence sk keys long.
        Plan::Decode(p) => {
            let table: Vec<i32> = (0..s.batch as i32).collect();
            let used = vec![s.seq_k as i32; s.batch];
            let table: CudaSlice<i32> = dev.clone_htod(table.as_slice())?;
            let used: CudaSlice<i32> = dev.clone_htod(used.as_slice())?;
            let idx = DecodeIndexes {
                block_table: (table.slice(..), s.batch, 1, 1),
                seqused_k: used.slice(..),
                cu_seqlens_q: None,
                max_seqlen_k: s.seq_k,
            };
            plans::with_workspace(&stream, need, |ws| {
                let io = PackedIo {
                    q: (q_v, dims(q_l)),
                    k: (k_v, dims(k_l)),
                    v: (v_v, dims(v_l)),
                    o: (out.slice_mut(..), dims(&out_l)),
                    lse: lse.slice_mut(..),
                };
                api::decode_forward::<T>(p, &stream, io, &idx, ws)
            })?
        }
        Plan::Varlen(_) => return Err(mismatch()),
    }

    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), out_shape))
}

/// A dense call with ALiBi slopes: the portable prefill kernel on every GPU (the plan of
/// [`PlanKey::Alibi`]).
#[allow(clippy::too_many_arguments)]
fn alibi(
    op: &FlashAttn,
    alibi_slopes: &Tensor,
    q: &CudaStorage,
    q_l: &Layout,
    k: &CudaStorage,
    k_l: &Layout,
    v: &CudaStorage,
    v_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    use candle_core::backend::BackendDevice;
    let (st, sl) = alibi_slopes.storage_and_layout();
    let call = check_alibi_call(
        (q.dtype(), k.dtype(), v.dtype()),
        q_l,
        k_l,
        v_l,
        (alibi_slopes.dtype(), sl),
        op.softmax_scale,
        (op.window_size_left, op.window_size_right),
        op.softcap,
    )?;
    let Storage::Cuda(sc) = &*st else {
        bail!("flash-attn: alibi_slopes must be a cuda tensor")
    };
    if !sc.device().same_device(q.device()) {
        bail!("flash-attn: alibi_slopes must be on q's device")
    }
    let Some((start, end)) = sl.contiguous_offsets() else {
        bail!("flash-attn: alibi_slopes has to be contiguous")
    };
    let slopes = (sc.as_cuda_slice::<f32>()?.slice(start..end), sl.dims());
    match call.plan.elem() {
        Elem::Bf16 => alibi_t::<half::bf16>(&call, q, q_l, k, k_l, v, v_l, slopes),
        Elem::F16 => alibi_t::<half::f16>(&call, q, q_l, k, k_l, v, v_l, slopes),
    }
}

#[allow(clippy::too_many_arguments)]
fn alibi_t<T: api::Element>(
    call: &crate::check::Call,
    q: &CudaStorage,
    q_l: &Layout,
    k: &CudaStorage,
    k_l: &Layout,
    v: &CudaStorage,
    v_l: &Layout,
    slopes: (CudaView<'_, f32>, &[usize]),
) -> Result<(CudaStorage, Shape)> {
    let dev = q.device();
    let stream = dev.cuda_stream();
    let s = call.shape;
    let plan = plans::plan(&stream, &call.plan)?;
    let Plan::Dense(p) = &*plan else {
        return Err(mismatch());
    };
    let out_shape = q_l.shape().clone();
    let out_l = Layout::contiguous(&out_shape);
    // SAFETY: the kernel writes every element of o (each (b, row, head) tile is stored).
    let mut out = unsafe { dev.alloc::<T>(out_shape.elem_count()) }?;
    let mut lse = dev.alloc_zeros::<f32>(s.batch * s.heads_q * s.seq_q)?;
    let q_v = q.as_cuda_slice::<T>()?.slice(q_l.start_offset()..);
    let k_v = k.as_cuda_slice::<T>()?.slice(k_l.start_offset()..);
    let v_v = v.as_cuda_slice::<T>()?.slice(v_l.start_offset()..);
    let need = api::workspace_bytes(&plan, s.batch, s.seq_k);
    plans::with_workspace(&stream, need, |ws| {
        let mut lse_view = lse.slice_mut(..);
        api::forward_alibi::<T>(
            p,
            &stream,
            (q_v, dims(q_l)),
            (k_v, dims(k_l)),
            (v_v, dims(v_l)),
            (out.slice_mut(..), dims(&out_l)),
            &mut lse_view,
            slopes,
            ws,
        )
    })?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), out_shape))
}

pub(crate) fn varlen(
    op: &FlashAttnVarlen,
    q: &CudaStorage,
    q_l: &Layout,
    k: &CudaStorage,
    k_l: &Layout,
    v: &CudaStorage,
    v_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (sq_st, sq_l) = op.seqlens_q.storage_and_layout();
    let (sk_st, sk_l) = op.seqlens_k.storage_and_layout();
    let call = check_varlen(
        (q.dtype(), k.dtype(), v.dtype()),
        q_l,
        k_l,
        v_l,
        ((op.seqlens_q.dtype(), sq_l), (op.seqlens_k.dtype(), sk_l)),
        (op.max_seqlen_q, op.max_seqlen_k),
        op.softmax_scale,
        (op.window_size_left, op.window_size_right),
        op.softcap,
    )?;
    let cu_q = int32_view("seqlens_q", &sq_st, sq_l)?;
    let cu_k = int32_view("seqlens_k", &sk_st, sk_l)?;
    let dev = q.device();
    let stream = dev.cuda_stream();
    let plan = plans::plan(&stream, &call.plan)?;
    let Plan::Varlen(p) = &*plan else {
        return Err(mismatch());
    };
    let need = api::workspace_bytes(&plan, call.batch, op.max_seqlen_k);
    macro_rules! run {
        ($t:ty) => {{
            let out_shape = q_l.shape().clone();
            let out_l = Layout::contiguous(&out_shape);
            // Zeroed: rows no sequence covers (offsets that stop short of total_q) read 0.
            let mut out = dev.alloc_zeros::<$t>(out_shape.elem_count())?;
            let mut lse = dev.alloc_zeros::<f32>(call.heads_q * call.total_q)?;
            plans::with_workspace(&stream, need, |ws| {
                let io = PackedIo {
                    q: (
                        q.as_cuda_slice::<$t>()?.slice(q_l.start_offset()..),
                        dims(q_l),
                    ),
                    k: (
                        k.as_cuda_slice::<$t>()?.slice(k_l.start_offset()..),
                        dims(k_l),
                    ),
                    v: (
                        v.as_cuda_slice::<$t>()?.slice(v_l.start_offset()..),
                        dims(v_l),
                    ),
                    o: (out.slice_mut(..), dims(&out_l)),
                    lse: lse.slice_mut(..),
                };
                let max = (op.max_seqlen_q, op.max_seqlen_k);
                api::varlen_forward::<$t>(p, &stream, io, &cu_q, &cu_k, max, ws)
            })?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), out_shape))
        }};
    }
    match call.plan.elem() {
        Elem::Bf16 => run!(half::bf16),
        Elem::F16 => run!(half::f16),
    }
}

pub(crate) fn paged(
    op: &FlashAttnPaged,
    q: &CudaStorage,
    q_l: &Layout,
    k: &CudaStorage,
    k_l: &Layout,
    v: &CudaStorage,
    v_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let call = {
        let (_s, sq_l) = op.seqlens_q.storage_and_layout();
        let (_s, sk_l) = op.seqlens_k.storage_and_layout();
        let (_s, bt_l) = op.block_table.storage_and_layout();
        let idx = PagedIndexes {
            seqlens_q: (op.seqlens_q.dtype(), sq_l),
            seqlens_k: (op.seqlens_k.dtype(), sk_l),
            block_table: (op.block_table.dtype(), bt_l),
        };
        check_paged(
            (q.dtype(), k.dtype(), v.dtype()),
            q_l,
            k_l,
            v_l,
            &idx,
            (op.max_seqlen_q, op.max_seqlen_k),
            op.page_block_size,
            op.softmax_scale,
            (op.window_size_left, op.window_size_right),
            op.softcap,
        )?
    };
    // Per-sequence key counts from the cumulative seqlens_k, on candle's stream: the decode
    // kernel takes lengths. Clamped to max_seqlen_k (its contract), which also catches
    // decreasing offsets (they wrap to large u32 values).
    let b = call.batch;
    let cu_k = &op.seqlens_k;
    let seqused: Tensor = (cu_k.narrow(0, 1, b)? - cu_k.narrow(0, 0, b)?)?
        .minimum(call.max_seqlen_k.min(i32::MAX as usize) as u32)?
        .contiguous()?;
    let (sq_st, sq_l) = op.seqlens_q.storage_and_layout();
    let (bt_st, bt_l) = op.block_table.storage_and_layout();
    let (su_st, su_l) = seqused.storage_and_layout();
    let idx = DecodeIndexes {
        block_table: int32_matrix("block_table", &bt_st, bt_l)?,
        seqused_k: int32_view("seqused_k", &su_st, su_l)?,
        cu_seqlens_q: Some(int32_view("seqlens_q", &sq_st, sq_l)?),
        max_seqlen_k: call.max_seqlen_k,
    };
    let dev = q.device();
    let stream = dev.cuda_stream();
    let plan = plans::plan(&stream, &PlanKey::Decode(call.key))?;
    let Plan::Decode(p) = &*plan else {
        return Err(mismatch());
    };
    let need = api::workspace_bytes(&plan, b, call.max_seqlen_k);
    macro_rules! run {
        ($t:ty) => {{
            let out_shape = q_l.shape().clone();
            let out_l = Layout::contiguous(&out_shape);
            // Zeroed: rows past a sequence's max_seqlen_q-clamped count read 0.
            let mut out = dev.alloc_zeros::<$t>(out_shape.elem_count())?;
            let mut lse = dev.alloc_zeros::<f32>(call.heads_q * call.total_q)?;
            plans::with_workspace(&stream, need, |ws| {
                let io = PackedIo {
                    q: (
                        q.as_cuda_slice::<$t>()?.slice(q_l.start_offset()..),
                        dims(q_l),
                    ),
                    k: (
                        k.as_cuda_slice::<$t>()?.slice(k_l.start_offset()..),
                        dims(k_l),
                    ),
                    v: (
                        v.as_cuda_slice::<$t>()?.slice(v_l.start_offset()..),
                        dims(v_l),
                    ),
                    o: (out.slice_mut(..), dims(&out_l)),
                    lse: lse.slice_mut(..),
                };
                api::decode_forward::<$t>(p, &stream, io, &idx, ws)
            })?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), out_shape))
        }};
    }
    match call.key.elem {
        Elem::Bf16 => run!(half::bf16),
        Elem::F16 => run!(half::f16),
    }
}
