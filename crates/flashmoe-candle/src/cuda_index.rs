//! Index tensors (offsets, lengths, block tables) as the int32 views the kernels read.
//! candle-flash-attn's seqlens are u32 (and block tables u32 or i32). The u32 buffers are
//! reinterpreted in place (the same bits for values below 2^31; larger ones read as
//! negative, which the kernels clamp like any malformed offset: wrong numbers, never an
//! out-of-range access). Their contents are not checked on the host, as in
//! candle-flash-attn: that would need a device-to-host copy and a sync. Used by the
//! attention ops (`cuda_fwd.rs`) and MLA decode (`mla.rs`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaView;
use candle_core::{bail, Layout, Result, Storage};

/// A contiguous u32 or i32 index tensor on the GPU as an int32 view (u32 reinterpreted).
pub(crate) fn int32_view<'a>(name: &str, st: &'a Storage, l: &Layout) -> Result<CudaView<'a, i32>> {
    let Storage::Cuda(c) = st else {
        bail!("flash-attn: {name} must be a cuda tensor")
    };
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("flash-attn: {name} has to be contiguous")
    };
    match c.dtype() {
        candle_core::DType::I32 => Ok(c.as_cuda_slice::<i32>()?.slice(start..end)),
        candle_core::DType::U32 => {
            let v = c.as_cuda_slice::<u32>()?.slice(start..end);
            // SAFETY: u32 and i32 have the same size and every bit pattern is valid.
            unsafe { v.transmute::<i32>(end - start) }
                .ok_or_else(|| candle_core::Error::Msg(format!("flash-attn: {name}: view")).bt())
        }
        other => bail!("flash-attn: {name} must be u32 or i32 (got {other:?})"),
    }
}

/// A (rows, cols) index matrix with a contiguous last dim as an int32 view from its start
/// offset, with its row stride.
pub(crate) fn int32_matrix<'a>(
    name: &str,
    st: &'a Storage,
    l: &Layout,
) -> Result<(CudaView<'a, i32>, usize, usize, usize)> {
    let Storage::Cuda(c) = st else {
        bail!("flash-attn: {name} must be a cuda tensor")
    };
    let (rows, cols) = l.shape().dims2()?;
    let stride = l.stride()[0];
    let len = (rows - 1) * stride + cols;
    let start = l.start_offset();
    let view = match c.dtype() {
        candle_core::DType::I32 => c.as_cuda_slice::<i32>()?.slice(start..start + len),
        candle_core::DType::U32 => {
            let v = c.as_cuda_slice::<u32>()?.slice(start..start + len);
            // SAFETY: as in `int32_view`.
            unsafe { v.transmute::<i32>(len) }
                .ok_or_else(|| candle_core::Error::Msg(format!("flash-attn: {name}: view")).bt())?
        }
        other => bail!("flash-attn: {name} must be u32 or i32 (got {other:?})"),
    };
    Ok((view, rows, cols, stride))
}
