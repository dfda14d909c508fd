//! DeepSeek-V2/V3 Multi-head Latent Attention (MLA) paged decode: `Sq = 1..` query rows per
//! sequence (decode and speculative decoding) of `Hq` weight-absorbed query heads against a
//! paged cache of one latent KV head. Kernels: `kernels/attention/mla/mla_decode.cu`.
//!
//! Shape of the API (as [`super::decode`]): [`MlaDecodePlan::new`] compiles once per
//! [`MlaDecodeClass`]; [`MlaDecodePlan::forward_raw`] does O(1) checks and enqueues on the
//! caller's stream over the caller's memory with no allocation, synchronisation, compile or
//! environment access (CUDA-graph capturable: one or two launches, a fixed workspace);
//! [`MlaDecodePlan::forward`] is the cudarc wrapper.
//!
//! Layouts: q `[B, Sq, Hq, 576]` (strided views allowed, strides multiples of 8 elements);
//! the cache `[num_blocks, page_size, 576]` or `[num_blocks, page_size, 1, 576]` (block and
//! row strides allowed, multiples of 8): per token the 512-wide latent `c` then the 64-wide
//! rotary `k_pe`; the key is the whole row, the value its first 512 columns. `block_table`
//! int32 `[B, max_blocks]` (row stride allowed), `seqused_k` int32 `[B]`; o `[B, Sq, Hq, 512]`
//! and lse f32 `[B, Sq, Hq]` (natural log), contiguous. Key `j` of sequence `b` is row
//! `j % page_size` of block `block_table[b][j / page_size]`.
//!
//! Masking: causal, bottom-right: query row `i` sees keys `j <= seqused_k[b] - Sq + i`. A row
//! with no visible key gets O = 0 and LSE = -inf. Scores are `softmax_scale · q·k` (DeepSeek:
//! `1/sqrt(192)` times its yarn factor, so the scale is the class's, not derived from 576).
//!
//! Workspace (splits > 1): per split an f32 O `[B·Sq·Hq, 512]` and an f32 LSE `[B·Sq·Hq]`;
//! the forward kernel writes them and a second launch merges them in split order (the bits
//! do not depend on which CTA finishes first). Nothing in it needs zeroing and nothing
//! survives a call; [`MlaDecodePlan::workspace_bytes`] bounds every call of the class.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

mod abi;
mod args;
mod class;
#[cfg(all(test, feature = "lab"))]
mod gpu_tests;
mod plan;
mod select;

pub use crate::gpu::raw::RawIndex;
pub use crate::gpu::RawWorkspace;
pub use abi::{
    BLOCK_M, COMBINE_ENTRY, COMBINE_THREADS, D_QK, D_V, MAX_Q_PER_SEQ, MAX_SPLITS,
    MIN_KEYS_PER_SPLIT, MLA_ENTRY, MLA_SOURCE, THREADS,
};
pub use args::{MlaArgs, MlaShape};
pub use class::MlaDecodeClass;
pub use plan::MlaDecodePlan;
pub use select::{all_mla_kernels, mla_split_heuristic, MlaKernel};

#[cfg(test)]
mod tests {
    use super::args::check_call;
    use super::*;
    use crate::dtype::DType;
    use crate::gpu::raw::RawTensor;

    fn args(b: usize, sq: usize, hq: usize, nb: usize, ps: usize, mb: usize) -> MlaArgs {
        let t = |p: u64, dt: DType, sh: &[usize]| RawTensor::contiguous(p, dt, sh).unwrap();
        MlaArgs {
            q: t(1 << 20, DType::Bf16, &[b, sq, hq, D_QK]),
            kv_cache: t(1 << 30, DType::Bf16, &[nb, ps, 1, D_QK]),
            block_table: RawIndex::matrix(4096, b, mb),
            seqused_k: RawIndex::vector(8192, b),
            o: t(1 << 24, DType::Bf16, &[b, sq, hq, D_V]),
            lse: t(1 << 26, DType::F32, &[b, sq, hq]),
            max_seqlen_k: None,
        }
    }

    #[test]
    fn class_validation_and_call_checks_name_the_rule() {
        let c = MlaDecodeClass::deepseek_v3(DType::Bf16, 4, 16, 8192);
        c.validate().unwrap();
        let bad = |c: MlaDecodeClass, want: &str| {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(want), "expected '{want}' in: {e}");
        };
        bad(MlaDecodeClass { page_size: 24, ..c }, "page_size 24");
        bad(
            MlaDecodeClass {
                head_dim_qk: 192,
                ..c
            },
            "192/512",
        );
        bad(
            MlaDecodeClass {
                max_q_per_seq: 0,
                ..c
            },
            "max_q_per_seq 0",
        );
        bad(
            MlaDecodeClass {
                dtype: DType::F32,
                ..c
            },
            "f32",
        );
        bad(
            MlaDecodeClass {
                softmax_scale: f32::NAN,
                ..c
            },
            "softmax_scale",
        );
        bad(MlaDecodeClass { heads_q: 0, ..c }, "heads_q 0");

        let one = |_: usize, _: usize| 1;
        let a = args(2, 3, 128, 10, 64, 8);
        let s = check_call(&c, &a, one).unwrap();
        assert_eq!(
            (s.batch, s.seqlen_q, s.m_blocks, s.max_seqlen_k),
            (2, 3, 6, 512)
        );
        let e = |a: &MlaArgs| check_call(&c, a, one).unwrap_err().to_string();
        assert!(e(&args(2, 5, 128, 10, 64, 8)).contains("max_q_per_seq = 4"));
        assert!(e(&args(17, 1, 128, 10, 64, 8)).contains("max_batch = 16"));
        assert!(e(&args(2, 1, 64, 10, 64, 8)).contains("q has shape"));
        assert!(e(&args(2, 1, 128, 10, 32, 8)).contains("page_size 64"));
        let mut x = args(2, 1, 128, 10, 64, 8);
        x.max_seqlen_k = Some(513);
        assert!(e(&x).contains("capacity"));
        x = args(2, 1, 128, 10, 64, 8);
        x.kv_cache.dtype = DType::F16;
        assert!(e(&x).contains("kv_cache holds f16"));
        x = args(2, 1, 128, 10, 64, 8);
        x.block_table.rows = 3;
        assert!(e(&x).contains("block_table is int32 [3"));
        x = args(2, 1, 128, 10, 64, 8);
        x.o = RawTensor::contiguous(1 << 24, DType::Bf16, &[2, 1, 128, 576]).unwrap();
        assert!(e(&x).contains("o has shape"));
        x = args(2, 1, 128, 10, 64, 8);
        x.q.strides[2] = 580;
        assert!(e(&x).contains("not a multiple of 8"));
        // A 3-D cache is the same call.
        x = args(2, 1, 128, 10, 64, 8);
        x.kv_cache = RawTensor::contiguous(1 << 30, DType::Bf16, &[10, 64, D_QK]).unwrap();
        check_call(&c, &x, one).unwrap();
    }

    #[test]
    fn kernel_selection_smem_and_splits() {
        let k = MlaKernel::for_device(DType::Bf16, 227 * 1024, false);
        assert_eq!(
            (k.block_n, k.stages, k.wgmma, k.shared_mem_bytes()),
            (64, 2, false, 229_888)
        );
        let k = MlaKernel::for_device(DType::Bf16, 227 * 1024, true);
        assert_eq!(
            (k.block_n, k.wgmma, k.shared_mem_bytes()),
            (64, true, 230_912)
        );
        let k = MlaKernel::for_device(DType::F16, 163 * 1024, false);
        assert_eq!((k.block_n, k.shared_mem_bytes()), (32, 152_064));
        assert_eq!(all_mla_kernels().len(), 6);
        // B=128 Hq=128 Sq=1: 256 CTAs fill 132 SMs: no split.
        assert_eq!(mla_split_heuristic(256, 132, 64), 1);
        // B=1: 2 CTAs; 32k keys (512 tiles) split to fill the wave.
        let s = mla_split_heuristic(2, 132, 512);
        assert!((32..=MAX_SPLITS).contains(&s), "{s}");
        // Short caches cap the splits (4 tiles a split at least).
        assert_eq!(mla_split_heuristic(2, 132, 4), 1);
        for tiles in 1..200 {
            let s = mla_split_heuristic(3, 132, tiles);
            assert_eq!(tiles.div_ceil(tiles.div_ceil(s)), s, "tiles {tiles}");
        }
        let c = MlaDecodeClass::deepseek_v3(DType::Bf16, 1, 1, 4096);
        assert_eq!(c.kv_bytes(&[4096, 1]), 4097 * 576 * 2);
        assert_eq!(c.flops(&[10], 2), (9.0 + 10.0) * 128.0 * 2.0 * 1088.0);
    }
}
