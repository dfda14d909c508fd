//! One call's tensors ([`MlaArgs`]), its checked shape ([`MlaShape`]) and the O(1)
//! checks.

use super::abi::*;
use super::class::MlaDecodeClass;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{RawIndex, RawTensor};

/// The tensors of one MLA decode call, raw (shapes in the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaArgs {
    pub q: RawTensor,
    pub kv_cache: RawTensor,
    pub block_table: RawIndex,
    pub seqused_k: RawIndex,
    pub o: RawTensor,
    pub lse: RawTensor,
    /// An upper bound on `seqused_k` (picks the split count). None: the class's
    /// `max_seqlen_k`, capped at the table's capacity.
    pub max_seqlen_k: Option<usize>,
}

/// A checked call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaShape {
    pub batch: usize,
    pub seqlen_q: usize,
    pub num_blocks: usize,
    pub page_size: usize,
    pub max_blocks: usize,
    pub max_seqlen_k: usize,
    pub splits: usize,
    /// CTAs per (sequence, split): ceil(Hq · Sq / 64).
    pub m_blocks: usize,
}

/// Element strides 16-byte copies can take: multiples of 8 elements.
pub(super) fn check_strides_16b(name: &str, t: &RawTensor) -> Result<()> {
    for (i, &s) in t.strides()[..t.rank - 1].iter().enumerate() {
        if t.shape[i] > 1 && s % 8 != 0 {
            return Err(Error::invalid(format!(
                "{name}'s stride {s} (dimension {i}) is not a multiple of 8 elements (16-byte \
                 copies)"
            )));
        }
    }
    Ok(())
}

/// (offset of the LSE partials, total bytes) of `splits` splits over `rows` output rows.
pub(super) fn partial_bytes(splits: usize, rows: usize) -> (usize, usize) {
    if splits <= 1 {
        return (0, 0);
    }
    let o_bytes = (splits * rows * D_V * 4).div_ceil(256) * 256;
    (o_bytes, o_bytes + splits * rows * 4)
}

/// The O(1) checks of a call; `splits(batch, max_seqlen_k)` is the launch's split count.
pub(super) fn check_call(
    c: &MlaDecodeClass,
    a: &MlaArgs,
    splits: impl Fn(usize, usize) -> usize,
) -> Result<MlaShape> {
    let hq = c.heads_q;
    for (name, t) in [("q", &a.q), ("o", &a.o)] {
        if t.rank != 4 {
            return Err(Error::invalid(format!(
                "{name} must be 4-D (batch, seqlen_q, heads_q, head_dim) but has shape {:?}",
                t.shape()
            )));
        }
    }
    let [b, sq, _, _] = a.q.shape;
    a.q.expect("q", c.dtype, &[b, sq, hq, D_QK], 16)?;
    a.o.expect_contiguous("o", c.dtype, &[b, sq, hq, D_V], 16)?;
    a.lse
        .expect_contiguous("lse", DType::F32, &[b, sq, hq], 4)?;
    check_strides_16b("q", &a.q)?;
    if b == 0 || sq == 0 {
        return Err(Error::invalid(format!(
            "empty MLA decode call: batch {b}, seqlen_q {sq} (each must be >= 1)"
        )));
    }
    if sq > c.max_q_per_seq {
        return Err(Error::invalid(format!(
            "q has {sq} rows per sequence but the plan's class allows max_q_per_seq = {}",
            c.max_q_per_seq
        )));
    }
    if b > c.max_batch {
        return Err(Error::invalid(format!(
            "batch {b} exceeds the plan's class max_batch = {}",
            c.max_batch
        )));
    }
    let kv = &a.kv_cache;
    let (nb, ps) = match kv.rank {
        3 => {
            let [nb, ps, _, _] = kv.shape;
            kv.expect("kv_cache", c.dtype, &[nb, ps, D_QK], 16)?;
            (nb, ps)
        }
        4 => {
            let [nb, ps, _, _] = kv.shape;
            kv.expect("kv_cache", c.dtype, &[nb, ps, 1, D_QK], 16)?;
            (nb, ps)
        }
        _ => {
            return Err(Error::invalid(format!(
                "kv_cache must be [num_blocks, page_size, 576] or [num_blocks, page_size, 1, \
                 576] but has shape {:?}",
                kv.shape()
            )))
        }
    };
    check_strides_16b("kv_cache", kv)?;
    if nb == 0 {
        return Err(Error::invalid(
            "kv_cache has no blocks (num_blocks must be >= 1)",
        ));
    }
    if ps != c.page_size {
        return Err(Error::invalid(format!(
            "kv_cache pages hold {ps} keys but the plan's class has page_size {}",
            c.page_size
        )));
    }
    a.block_table.expect("block_table", b, None)?;
    a.seqused_k.expect("seqused_k", b, Some(1))?;
    let mb = a.block_table.cols;
    let capacity = mb.saturating_mul(ps);
    i32_of("max_blocks · page_size", capacity)?;
    i32_of("num_blocks", nb)?;
    let max_seqlen_k = a.max_seqlen_k.unwrap_or(c.max_seqlen_k.min(capacity));
    if max_seqlen_k > capacity || max_seqlen_k > c.max_seqlen_k {
        return Err(Error::invalid(format!(
            "max_seqlen_k {max_seqlen_k} exceeds the table's capacity {mb} blocks × {ps} keys \
             or the class's max_seqlen_k {}",
            c.max_seqlen_k
        )));
    }
    let splits = splits(b, max_seqlen_k);
    let m_blocks = c.m_blocks(sq);
    i32_of("grid x (splits · row blocks)", splits * m_blocks)?;
    Ok(MlaShape {
        batch: b,
        seqlen_q: sq,
        num_blocks: nb,
        page_size: ps,
        max_blocks: mb,
        max_seqlen_k,
        splits,
        m_blocks,
    })
}
