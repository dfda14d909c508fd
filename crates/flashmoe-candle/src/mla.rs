//! DeepSeek MLA paged decode for candle: [`mla_decode`] over flashmoe's `MlaDecodePlan`
//! (`flashmoe::attention::mla`). This file is the MLA family's whole adapter — checks, op,
//! plan and workspace caches, launch — so the attention modules stay as they are.
//!
//! Plans are cached per (GPU ordinal, [`MlaKey`]): dtype, query heads, page size, query rows
//! per sequence and the scale; one plan serves every batch and cache length (its class
//! bounds are the kernel's). Workspaces (the split-KV partials, any contents, nothing
//! survives a call) are cached per CUDA stream, apart from the attention plans' zeroed ones,
//! and grown to the largest call seen.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

/// Width of q and of a latent cache row (512 latent + 64 rotary) and of the output.
pub const MLA_D_QK: usize = 576;
pub const MLA_D_V: usize = 512;
/// Most query rows per sequence (decode and speculative steps).
pub const MLA_MAX_Q_PER_SEQ: usize = 16;

/// What selects an MLA plan (besides the GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct MlaKey {
    pub bf16: bool,
    pub heads_q: usize,
    pub page_size: usize,
    pub seqlen_q: usize,
    /// `softmax_scale.to_bits()` (the scale is part of the plan's class).
    pub scale_bits: u32,
}

/// A checked call: its plan key and shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MlaCall {
    pub key: MlaKey,
    pub batch: usize,
    /// The split bound: the caller's, else the table's capacity.
    pub max_seqlen_k: usize,
}

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("mla_decode: {msg}")).bt()
}

/// candle's shape/dtype checks of a call, GPU-free; the plan checks strides and alignment
/// again before the launch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_mla(
    dtypes: (DType, DType),
    q: &Shape,
    kv_cache: &Shape,
    block_table: (DType, &Shape),
    seqlens_k: (DType, &Shape),
    softmax_scale: f32,
    max_seqlen_k: Option<usize>,
) -> Result<MlaCall> {
    let bf16 = match dtypes {
        (DType::BF16, DType::BF16) => true,
        (DType::F16, DType::F16) => false,
        (a, b) => {
            return Err(err(format!(
                "q and kv_cache must both be bf16 or both f16 (got {a:?} and {b:?})"
            )))
        }
    };
    let &[b, sq, hq, dq] = q.dims() else {
        return Err(err(format!(
            "q must be (batch, seq_q, heads_q, 576), got {:?}",
            q.dims()
        )));
    };
    if dq != MLA_D_QK {
        return Err(err(format!(
            "q's head dim is {dq}: MLA decode takes the 576-wide weight-absorbed query \
             (512 latent + 64 rotary)"
        )));
    }
    if b == 0 || sq == 0 || hq == 0 || sq > MLA_MAX_Q_PER_SEQ {
        return Err(err(format!(
            "batch {b} and heads_q {hq} must be >= 1 and seq_q {sq} in 1..={MLA_MAX_Q_PER_SEQ}"
        )));
    }
    let (nb, ps) = match kv_cache.dims() {
        &[nb, ps, MLA_D_QK] | &[nb, ps, 1, MLA_D_QK] => (nb, ps),
        d => {
            return Err(err(format!(
                "kv_cache must be (num_blocks, page_block_size, 576) or (num_blocks, \
                 page_block_size, 1, 576), got {d:?}"
            )))
        }
    };
    if nb == 0 || ps == 0 || ps % 16 != 0 {
        return Err(err(format!(
            "kv_cache has {nb} blocks of {ps} keys: needs >= 1 block and a page size that \
             is a positive multiple of 16"
        )));
    }
    let (bt_dt, bt) = block_table;
    let &[bt_rows, mb] = bt.dims() else {
        return Err(err(format!(
            "block_table must be (batch, max_blocks), got {:?}",
            bt.dims()
        )));
    };
    let (sk_dt, sk) = seqlens_k;
    for (name, dt) in [("block_table", bt_dt), ("seqlens_k", sk_dt)] {
        if !matches!(dt, DType::U32 | DType::I32) {
            return Err(err(format!("{name} must be u32 or i32, got {dt:?}")));
        }
    }
    if bt_rows != b || mb == 0 || sk.dims() != [b] {
        return Err(err(format!(
            "block_table {:?} must be (batch = {b}, max_blocks >= 1) and seqlens_k {:?} \
             (batch)",
            bt.dims(),
            sk.dims()
        )));
    }
    if !softmax_scale.is_finite() || softmax_scale <= 0.0 {
        return Err(err(format!(
            "softmax_scale {softmax_scale} must be finite and > 0"
        )));
    }
    let capacity = mb * ps;
    let max_seqlen_k = max_seqlen_k.unwrap_or(capacity);
    if max_seqlen_k == 0 || max_seqlen_k > capacity {
        return Err(err(format!(
            "max_seqlen_k {max_seqlen_k} must be in 1..= the table's capacity {mb} blocks × \
             {ps} keys"
        )));
    }
    Ok(MlaCall {
        key: MlaKey {
            bf16,
            heads_q: hq,
            page_size: ps,
            seqlen_q: sq,
            scale_bits: softmax_scale.to_bits(),
        },
        batch: b,
        max_seqlen_k,
    })
}

struct MlaDecodeOp {
    block_table: Tensor,
    seqlens_k: Tensor,
    softmax_scale: f32,
    max_seqlen_k: Option<usize>,
}

impl candle_core::CustomOp2 for MlaDecodeOp {
    fn name(&self) -> &'static str {
        "flashmoe-mla-decode"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("no cpu support for mla_decode")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        kv: &candle_core::CudaStorage,
        kv_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        gpu::forward(self, q, q_l, kv, kv_l)
    }
}

/// DeepSeek-V2/V3 MLA decode over a paged latent cache (weight-absorbed: every query head
/// attends to one latent KV head whose key is the whole 576-wide row and whose value is its
/// first 512 columns).
///
/// # Arguments
///
/// * `q` - (batch, seq_q, heads_q, 576), bf16 or f16, seq_q in 1..=16 (decode and
///   speculative rows), any strides that are multiples of 8 elements with a contiguous last
///   dim.
/// * `kv_cache` - (num_blocks, page_block_size, 576) or (num_blocks, page_block_size, 1, 576)
///   of q's dtype: per token the 512-wide latent then the 64-wide rotary part; the page size
///   a multiple of 16 (DeepSeek: 64); block and row strides multiples of 8 elements.
/// * `block_table` - (batch, max_blocks) u32 or i32 with a contiguous last dim: key `j` of
///   sequence `b` is row `j % page_block_size` of block `block_table[b][j / page_block_size]`.
/// * `seqlens_k` - (batch) u32 or i32, contiguous: cached keys per sequence (lengths, not
///   cumulative offsets; FlashMLA's `cache_seqlens`), each <= `max_seqlen_k`.
/// * `softmax_scale` - multiplies q·k (DeepSeek: 1/sqrt(192) times its yarn factor).
/// * `max_seqlen_k` - an upper bound on `seqlens_k` (picks the KV split count); None: the
///   table's capacity, max_blocks × page_block_size. The kernel clamps lengths to the
///   table's capacity and block ids to the cache, so a wrong bound never reads out of
///   bounds; keys past a too-small bound are not guaranteed to be attended.
///
/// Masking is causal, bottom-right: query row `i` sees keys `j <= seqlens_k[b] - seq_q + i`;
/// a row with no visible key is 0. Returns (batch, seq_q, heads_q, 512), contiguous.
pub fn mla_decode(
    q: &Tensor,
    kv_cache: &Tensor,
    block_table: &Tensor,
    seqlens_k: &Tensor,
    softmax_scale: f32,
    max_seqlen_k: Option<usize>,
) -> Result<Tensor> {
    // The GPU-free checks first, so a bad call fails the same way with or without a GPU.
    check_mla(
        (q.dtype(), kv_cache.dtype()),
        q.shape(),
        kv_cache.shape(),
        (block_table.dtype(), block_table.shape()),
        (seqlens_k.dtype(), seqlens_k.shape()),
        softmax_scale,
        max_seqlen_k,
    )?;
    let op = MlaDecodeOp {
        block_table: block_table.clone(),
        seqlens_k: seqlens_k.clone(),
        softmax_scale,
        max_seqlen_k,
    };
    q.apply_op2_no_bwd(kv_cache, &op)
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::{check_mla, MlaCall, MlaDecodeOp, MlaKey, MLA_D_QK, MLA_D_V};
    use crate::cuda_index::{int32_matrix, int32_view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
    use candle_core::{CudaStorage, Layout, Result, Shape};
    use flashmoe::attention::cache::{PlanCache, StreamCache};
    use flashmoe::attention::mla::{MlaArgs, MlaDecodeClass, MlaDecodePlan, RawIndex};
    use flashmoe::gpu::raw::RawTensor;
    use flashmoe::gpu::Workspace;
    use std::sync::{Arc, OnceLock};

    fn wrap(what: &str, e: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::Msg(format!("flashmoe {what}: {e}")).bt()
    }

    static PLANS: OnceLock<PlanCache<(usize, MlaKey), MlaDecodePlan>> = OnceLock::new();
    /// Per `CUstream` handle: the split partials need no zeroing and hold nothing between
    /// calls, so they are kept apart from the attention plans' zeroed workspaces.
    static WORKSPACES: OnceLock<StreamCache<Workspace>> = OnceLock::new();

    fn plan(stream: &Arc<CudaStream>, key: MlaKey) -> Result<Arc<MlaDecodePlan>> {
        let ordinal = stream.context().ordinal();
        let plans = PLANS.get_or_init(PlanCache::new);
        if let Some(p) = plans.get(&(ordinal, key)) {
            return Ok(p);
        }
        let dev = crate::plans::device(stream)?;
        let class = MlaDecodeClass {
            dtype: if key.bf16 {
                flashmoe::DType::Bf16
            } else {
                flashmoe::DType::F16
            },
            heads_q: key.heads_q,
            head_dim_qk: MLA_D_QK,
            head_dim_v: MLA_D_V,
            page_size: key.page_size,
            max_q_per_seq: key.seqlen_q,
            // The kernel's bounds: one plan serves every batch and cache length.
            max_batch: 65_535,
            max_seqlen_k: i32::MAX as usize,
            softmax_scale: f32::from_bits(key.scale_bits),
        };
        plans.get_or_try_make((ordinal, key), || {
            MlaDecodePlan::new(&dev, class).map_err(|e| wrap("MLA decode plan", e))
        })
    }

    /// Drop the cached MLA plans and workspaces (`crate::clear_caches` calls it; the
    /// devices are `plans.rs`'s).
    pub fn clear() {
        if let Some(c) = PLANS.get() {
            c.clear();
        }
        if let Some(c) = WORKSPACES.get() {
            c.clear();
        }
    }

    fn raw(
        name: &str,
        ptr: u64,
        dt: flashmoe::DType,
        l: &Layout,
        buf_len: usize,
    ) -> Result<RawTensor> {
        let t = RawTensor::new(ptr, dt, l.dims(), l.stride()).map_err(|e| wrap(name, e))?;
        if t.span_elems() > buf_len as u64 {
            return Err(wrap(
                name,
                format!(
                    "view spans {} elements but its buffer holds {buf_len}",
                    t.span_elems()
                ),
            ));
        }
        Ok(t)
    }

    pub(super) fn forward(
        op: &MlaDecodeOp,
        q: &CudaStorage,
        q_l: &Layout,
        kv: &CudaStorage,
        kv_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (bt_st, bt_l) = op.block_table.storage_and_layout();
        let (sk_st, sk_l) = op.seqlens_k.storage_and_layout();
        let call: MlaCall = check_mla(
            (q.dtype(), kv.dtype()),
            q_l.shape(),
            kv_l.shape(),
            (op.block_table.dtype(), bt_l.shape()),
            (op.seqlens_k.dtype(), sk_l.shape()),
            op.softmax_scale,
            op.max_seqlen_k,
        )?;
        let (bt, rows, cols, row_stride) = int32_matrix("block_table", &bt_st, bt_l)?;
        let seqused = int32_view("seqlens_k", &sk_st, sk_l)?;
        let dev = q.device();
        let stream = dev.cuda_stream();
        let plan = plan(&stream, call.key)?;
        let (b, sq, hq) = (call.batch, call.key.seqlen_q, call.key.heads_q);
        let need = plan.call_workspace_bytes(b, call.max_seqlen_k);
        macro_rules! run {
            ($t:ty, $dt:expr) => {{
                let out_shape = Shape::from((b, sq, hq, MLA_D_V));
                let mut out = dev.alloc_zeros::<$t>(out_shape.elem_count())?;
                let mut lse = dev.alloc_zeros::<f32>(b * sq * hq)?;
                let qv = q.as_cuda_slice::<$t>()?.slice(q_l.start_offset()..);
                let kvv = kv.as_cuda_slice::<$t>()?.slice(kv_l.start_offset()..);
                WORKSPACES.get_or_init(StreamCache::new).with(
                    stream.cu_stream() as usize,
                    need,
                    |n| Workspace::zeroed(&stream, n).map_err(|e| wrap("workspace", e)),
                    |ws: &mut Workspace| -> Result<()> {
                        let (qp, _gq) = qv.device_ptr(&stream);
                        let (kp, _gk) = kvv.device_ptr(&stream);
                        let (btp, _gb) = bt.device_ptr(&stream);
                        let (sup, _gs) = seqused.device_ptr(&stream);
                        let (op_, _go) = out.device_ptr_mut(&stream);
                        let (lp, _gl) = lse.device_ptr_mut(&stream);
                        let index = RawIndex {
                            ptr: btp,
                            rows,
                            cols,
                            row_stride,
                        };
                        if index.span_elems() > bt.len() as u64 || seqused.len() < b {
                            return Err(wrap(
                                "mla_decode",
                                "block_table or seqlens_k view exceeds its buffer",
                            ));
                        }
                        let args = MlaArgs {
                            q: raw("q", qp, $dt, q_l, qv.len())?,
                            kv_cache: raw("kv_cache", kp, $dt, kv_l, kvv.len())?,
                            block_table: index,
                            seqused_k: RawIndex::vector(sup, b),
                            o: RawTensor::contiguous(op_, $dt, &[b, sq, hq, MLA_D_V])
                                .map_err(|e| wrap("o", e))?,
                            lse: RawTensor::contiguous(lp, flashmoe::DType::F32, &[b, sq, hq])
                                .map_err(|e| wrap("lse", e))?,
                            max_seqlen_k: Some(call.max_seqlen_k),
                        };
                        // SAFETY: every address is a live allocation of candle's device (the
                        // stream's context) covering its view (checked above; o and lse
                        // allocated here with these shapes); the guards keep cudarc's
                        // stream order until the launches are enqueued; max_seqlen_k is
                        // within the table's capacity and the kernel clamps lengths to it
                        // and block ids to [0, num_blocks); the workspace covers
                        // `call_workspace_bytes` and the cache's lock keeps its uses on
                        // this stream in order.
                        unsafe {
                            plan.forward_raw(stream.cu_stream(), &args, ws.raw())
                                .map_err(|e| wrap("MLA decode", e))
                        }
                    },
                )?;
                drop(lse);
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let storage = if call.key.bf16 {
            run!(half::bf16, flashmoe::DType::Bf16)
        } else {
            run!(half::f16, flashmoe::DType::F16)
        };
        Ok((storage, Shape::from((b, sq, hq, MLA_D_V))))
    }
}

#[cfg(feature = "cuda")]
pub(crate) use gpu::clear as clear_caches;

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(d: &[usize]) -> Shape {
        Shape::from(d.to_vec())
    }

    fn call(q: &[usize], kv: &[usize], bt: &[usize], sk: &[usize]) -> Result<MlaCall> {
        check_mla(
            (DType::BF16, DType::BF16),
            &shape(q),
            &shape(kv),
            (DType::I32, &shape(bt)),
            (DType::U32, &shape(sk)),
            0.07,
            None,
        )
    }

    #[test]
    fn checks_name_the_rule() {
        let c = call(&[2, 3, 128, 576], &[10, 64, 576], &[2, 4], &[2]).unwrap();
        assert_eq!((c.batch, c.max_seqlen_k, c.key.seqlen_q), (2, 256, 3));
        call(&[2, 1, 16, 576], &[10, 64, 1, 576], &[2, 4], &[2]).unwrap();
        let e = |r: Result<MlaCall>| r.unwrap_err().to_string();
        assert!(e(call(&[2, 1, 128, 512], &[10, 64, 576], &[2, 4], &[2])).contains("576-wide"));
        assert!(e(call(&[2, 17, 128, 576], &[10, 64, 576], &[2, 4], &[2])).contains("seq_q 17"));
        assert!(e(call(&[2, 1, 128, 576], &[10, 24, 576], &[2, 4], &[2])).contains("24 keys"));
        assert!(e(call(&[2, 1, 128, 576], &[10, 64, 512], &[2, 4], &[2])).contains("kv_cache"));
        assert!(e(call(&[2, 1, 128, 576], &[10, 64, 576], &[3, 4], &[2])).contains("batch = 2"));
        assert!(e(call(&[2, 1, 128, 576], &[10, 64, 576], &[2, 4], &[3])).contains("seqlens_k"));
        let mixed = check_mla(
            (DType::BF16, DType::F16),
            &shape(&[1, 1, 1, 576]),
            &shape(&[1, 16, 576]),
            (DType::I32, &shape(&[1, 1])),
            (DType::I32, &shape(&[1])),
            1.0,
            None,
        );
        assert!(e(mixed).contains("must both be bf16 or both f16"));
        let f32_table = check_mla(
            (DType::F16, DType::F16),
            &shape(&[1, 1, 1, 576]),
            &shape(&[1, 16, 576]),
            (DType::F32, &shape(&[1, 1])),
            (DType::I32, &shape(&[1])),
            1.0,
            None,
        );
        assert!(e(f32_table).contains("block_table must be u32 or i32"));
        let over = check_mla(
            (DType::F16, DType::F16),
            &shape(&[1, 1, 1, 576]),
            &shape(&[1, 16, 576]),
            (DType::I32, &shape(&[1, 1])),
            (DType::I32, &shape(&[1])),
            1.0,
            Some(17),
        );
        assert!(e(over).contains("capacity 1 blocks × 16 keys"));
        let nan = check_mla(
            (DType::F16, DType::F16),
            &shape(&[1, 1, 1, 576]),
            &shape(&[1, 16, 576]),
            (DType::I32, &shape(&[1, 1])),
            (DType::I32, &shape(&[1])),
            f32::NAN,
            None,
        );
        assert!(e(nan).contains("softmax_scale"));
    }
}
