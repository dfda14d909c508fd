//! A decode call's tensors ([`DecodeArgs`]) and its O(1) checks, which give the checked
//! shape of the launch ([`DecodeShape`]).

use super::abi::{DecodeKernel, DECODE_ENTRY, MAX_SPLIT_GROUPS};
use super::class::DecodeClass;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{RawIndex, RawTensor};

/// The identity block table `[[0], [1], .., [batch-1]]` of a contiguous cache (one page of
/// Sk keys per sequence): upload it once and pass it as `block_table`.
pub fn identity_block_table(batch: usize) -> Vec<i32> {
    (0..batch as i32).collect()
}

/// The tensors of one decode call, raw (shapes in the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeArgs {
    pub q: RawTensor,
    pub k_cache: RawTensor,
    pub v_cache: RawTensor,
    pub block_table: RawIndex,
    pub seqused_k: RawIndex,
    pub o: RawTensor,
    pub lse: RawTensor,
    /// An upper bound on `seqused_k` (as FlashAttention's `max_seqlen_k`): it picks the
    /// number of KV splits. None: the table's capacity, `max_blocks · page_size`.
    pub max_seqlen_k: Option<usize>,
    /// Mixed batches: int32 `[batch + 1]` row offsets of the sequences in a packed q
    /// `[total_q, Hq, D]` (module docs). None: every sequence has the Sq rows of
    /// `q [B, Sq, Hq, D]`.
    pub cu_seqlens_q: Option<RawIndex>,
}

/// A checked call: its batch, query rows, cache geometry and launch split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: usize,
    /// Rows per sequence the grid covers: Sq, or with `cu_seqlens_q` min(max_q_per_seq,
    /// total_q).
    pub seqlen_q: usize,
    /// Query tokens of the call: B · Sq, or total_q with `cu_seqlens_q`.
    pub total_q: usize,
    pub varlen: bool,
    pub num_blocks: usize,
    pub page_size: usize,
    pub max_blocks: usize,
    pub max_seqlen_k: usize,
    pub splits: usize,
    /// CTAs per (sequence, KV head, split): ceil(G · Sq / (16 · MT)).
    pub m_blocks: usize,
}

impl DecodeClass {
    /// The checks of [`DecodePlan::check`](super::DecodePlan::check) that need no device:
    /// every shape, dtype, stride and alignment rule, with the call taken as unsplit (the
    /// split-count limits depend on the device's SM count and are checked by the plan).
    pub fn check_args(&self, a: &DecodeArgs) -> Result<DecodeShape> {
        check_call(self, &DecodeKernel::for_class(self), a, |_, _| 1)
    }
}

pub(super) fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::unsupported(
            DECODE_ENTRY,
            format!("{what} = {v} does not fit the kernel's 32-bit int"),
        )
    })
}

/// Element strides that 16-byte copies can take: multiples of 8 elements.
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

/// Check the cache tensors and the table against the class; returns (num_blocks,
/// page_size, max_blocks).
pub(super) fn check_cache(
    c: &DecodeClass,
    k: &RawTensor,
    v: &RawTensor,
    bt: &RawIndex,
    batch: usize,
) -> Result<(usize, usize, usize)> {
    if k.rank != 4 {
        return Err(Error::invalid(format!(
            "k_cache must be 4-D (num_blocks, page_size, heads_kv, head_dim) but has shape {:?}",
            k.shape()
        )));
    }
    let [nb, ps, _, _] = k.shape;
    let shape = [nb, ps, c.heads_kv, c.head_dim];
    k.expect("k_cache", c.dtype, &shape, 16)?;
    v.expect("v_cache", c.dtype, &shape, 16)?;
    check_strides_16b("k_cache", k)?;
    check_strides_16b("v_cache", v)?;
    bt.expect("block_table", batch, None)?;
    let mb = bt.cols;
    if c.page_size != 0 && ps != c.page_size {
        return Err(Error::invalid(format!(
            "k_cache pages hold {ps} keys but the plan's class has page_size {}",
            c.page_size
        )));
    }
    if ps == 0 || nb == 0 {
        return Err(Error::invalid(format!(
            "k_cache has shape {:?}: num_blocks and page_size must be >= 1",
            k.shape()
        )));
    }
    if ps % 16 != 0 && mb != 1 {
        return Err(Error::invalid(format!(
            "page_size {ps} is not a multiple of 16: only a one-block table (a dense cache) \
             may use it, but block_table has {mb} columns"
        )));
    }
    i32_of("max_blocks · page_size", mb.saturating_mul(ps))?;
    i32_of("num_blocks", nb)?;
    Ok((nb, ps, mb))
}

/// The O(1) checks of a decode call for class `c` built as `kernel`, with `splits(batch,
/// max_seqlen_k)` the launch's KV split count.
pub(super) fn check_call(
    c: &DecodeClass,
    kernel: &DecodeKernel,
    a: &DecodeArgs,
    splits: impl Fn(usize, usize) -> usize,
) -> Result<DecodeShape> {
    let (hq, d) = (c.heads_q, c.head_dim);
    let (b, sq, total_q) = match &a.cu_seqlens_q {
        None => {
            for (name, t) in [("q", &a.q), ("o", &a.o)] {
                if t.rank != 4 {
                    return Err(Error::invalid(format!(
                        "{name} must be 4-D (batch, seqlen_q, heads_q, head_dim) but has \
                         shape {:?}",
                        t.shape()
                    )));
                }
            }
            let [b, sq, _, _] = a.q.shape;
            a.q.expect("q", c.dtype, &[b, sq, hq, d], 16)?;
            a.o.expect_contiguous("o", c.dtype, &[b, sq, hq, d], 16)?;
            a.lse
                .expect_contiguous("lse", DType::F32, &[b, hq, sq], 4)?;
            if b == 0 || sq == 0 {
                return Err(Error::invalid(format!(
                    "empty decode call: batch {b}, seqlen_q {sq} (each must be >= 1)"
                )));
            }
            if sq > c.max_q_per_seq {
                return Err(Error::invalid(format!(
                    "q has {sq} rows per sequence but the plan's class allows \
                     max_q_per_seq = {}",
                    c.max_q_per_seq
                )));
            }
            (b, sq, b * sq)
        }
        Some(cu) => {
            for (name, t) in [("q", &a.q), ("o", &a.o)] {
                if t.rank != 3 {
                    return Err(Error::invalid(format!(
                        "with cu_seqlens_q, {name} must be 3-D (total_q, heads_q, \
                         head_dim) but has shape {:?}",
                        t.shape()
                    )));
                }
            }
            let t = a.q.shape[0];
            a.q.expect("q", c.dtype, &[t, hq, d], 16)?;
            a.o.expect_contiguous("o", c.dtype, &[t, hq, d], 16)?;
            a.lse.expect_contiguous("lse", DType::F32, &[hq, t], 4)?;
            let b = a.block_table.rows;
            cu.expect("cu_seqlens_q", b + 1, Some(1))?;
            if b == 0 || t == 0 {
                return Err(Error::invalid(format!(
                    "empty decode call: batch {b}, total_q {t} (each must be >= 1)"
                )));
            }
            // The workspace and the grid are sized for max_q_per_seq rows a sequence.
            if t > b * c.max_q_per_seq {
                return Err(Error::invalid(format!(
                    "q holds {t} rows but {b} sequences of at most max_q_per_seq = {} \
                     rows hold at most {}",
                    c.max_q_per_seq,
                    b * c.max_q_per_seq
                )));
            }
            (b, t.min(c.max_q_per_seq), t)
        }
    };
    check_strides_16b("q", &a.q)?;
    if b > 65_535 {
        return Err(Error::unsupported(
            DECODE_ENTRY,
            format!("batch {b} exceeds the grid's z limit 65535"),
        ));
    }
    let (nb, ps, mb) = check_cache(c, &a.k_cache, &a.v_cache, &a.block_table, b)?;
    a.seqused_k.expect("seqused_k", b, Some(1))?;
    let capacity = mb * ps;
    let max_seqlen_k = a.max_seqlen_k.unwrap_or(capacity);
    if max_seqlen_k > capacity {
        return Err(Error::invalid(format!(
            "max_seqlen_k {max_seqlen_k} exceeds the table's capacity {mb} blocks × {ps} keys"
        )));
    }
    let splits = splits(b, max_seqlen_k);
    let m_blocks = (c.group() * sq).div_ceil(kernel.block_m());
    i32_of("grid x (splits · row blocks)", splits * m_blocks)?;
    i32_of("total_q · heads_q · splits", total_q * hq * splits)?;
    if splits > 1 && b * c.heads_kv * m_blocks > MAX_SPLIT_GROUPS {
        return Err(Error::unsupported(
            DECODE_ENTRY,
            format!(
                "{splits} KV splits over {} (sequence, KV head, row block) groups: a split \
                 call serves at most {MAX_SPLIT_GROUPS} (use fewer splits or a smaller batch)",
                b * c.heads_kv * m_blocks
            ),
        ));
    }
    Ok(DecodeShape {
        batch: b,
        seqlen_q: sq,
        total_q,
        varlen: a.cu_seqlens_q.is_some(),
        num_blocks: nb,
        page_size: ps,
        max_blocks: mb,
        max_seqlen_k,
        splits,
        m_blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_index_checks() {
        let t = RawIndex::matrix(4096, 3, 5);
        t.expect("block_table", 3, None).unwrap();
        assert_eq!(t.span_elems(), 15);
        let e = t.expect("block_table", 4, None).unwrap_err();
        assert!(e.to_string().contains("block_table is int32 [3, 5]"), "{e}");
        let v = RawIndex::vector(4098, 3);
        let e = v.expect("seqused_k", 3, Some(1)).unwrap_err();
        assert!(e.to_string().contains("4-byte aligned"), "{e}");
        assert_eq!(identity_block_table(3), vec![0, 1, 2]);
    }
}
