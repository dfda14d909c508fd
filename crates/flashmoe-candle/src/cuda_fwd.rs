//! `FlashAttn::cuda_fwd`: from candle's CUDA storages and layouts to one flashmoe launch
//! on candle's own stream. Checks first (`check.rs`), then the cached plan and workspace
//! (`plans.rs`), the output and lse allocated through candle, and the launch
//! (`flashmoe_api.rs`). The output is a new contiguous (b, seq_q, heads_q, d) tensor.

use crate::check::{check_call, Call, Elem};
use crate::flashmoe_api::{self as api, Dims};
use crate::{plans, FlashAttn};
use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, Layout, Result, Shape};

pub(crate) fn forward(
    op: &FlashAttn,
    q: &CudaStorage,
    q_l: &Layout,
    k: &CudaStorage,
    k_l: &Layout,
    v: &CudaStorage,
    v_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let call = check_call(
        (q.dtype(), k.dtype(), v.dtype()),
        q_l,
        k_l,
        v_l,
        op.softmax_scale,
        (op.window_size_left, op.window_size_right),
    )?;
    match call.key.elem {
        Elem::Bf16 => forward_t::<half::bf16>(&call, q, q_l, k, k_l, v, v_l),
        Elem::F16 => forward_t::<half::f16>(&call, q, q_l, k, k_l, v, v_l),
    }
}

fn dims(l: &Layout) -> Dims {
    let d = l.dims();
    let s = l.stride();
    Dims {
        shape: [d[0], d[1], d[2], d[3]],
        strides: [s[0], s[1], s[2], s[3]],
    }
}

fn forward_t<T: api::Element>(
    call: &Call,
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

    let plan = plans::plan(&stream, &call.key)?;

    let out_shape = q_l.shape().clone();
    let out_l = Layout::contiguous(&out_shape);
    // SAFETY: the kernel writes every element of o (each (b, row, head) tile is stored).
    let mut out = unsafe { dev.alloc::<T>(out_shape.elem_count()) }?;
    let mut lse = dev.alloc_zeros::<f32>(s.batch * s.heads_q * s.seq_q)?;

    // Views start at each layout's offset; the strides carry the rest.
    plans::with_workspace(&stream, &plan, |ws| {
        let mut lse_view = lse.slice_mut(..);
        api::forward::<T>(
            &plan,
            &stream,
            (
                q.as_cuda_slice::<T>()?.slice(q_l.start_offset()..),
                dims(q_l),
            ),
            (
                k.as_cuda_slice::<T>()?.slice(k_l.start_offset()..),
                dims(k_l),
            ),
            (
                v.as_cuda_slice::<T>()?.slice(v_l.start_offset()..),
                dims(v_l),
            ),
            (out.slice_mut(..), dims(&out_l)),
            &mut lse_view,
            ws,
        )
    })?;

    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), out_shape))
}
