//! Paged-KV decode attention: `Sq = 1..16` query rows per sequence (decode and speculative
//! decoding) against a paged K/V cache, with GQA packing, KV splits, sliding windows and
//! logit softcap. Kernels: `kernels/attention/decode/decode_paged.cu`.
//!
//! Shape of the API (as [`super::AttentionPlan`]): [`DecodePlan::new`] compiles once per
//! [`DecodeClass`]; [`DecodePlan::forward_raw`] / [`DecodePlan::append_kv_raw`] do O(1)
//! checks and enqueue on the caller's stream over the caller's memory with no allocation,
//! synchronisation, compile or environment access (CUDA-graph capturable);
//! [`DecodePlan::forward`] / [`DecodePlan::append_kv`] are the cudarc (candle storage)
//! wrappers.
//!
//! Layouts: q `[B, Sq, Hq, D]` (strided views allowed, strides multiples of 8 elements);
//! k/v caches `[num_blocks, page_size, Hkv, D]` (strides allowed on every dimension but the
//! last, multiples of 8); `block_table` int32 `[B, max_blocks]` (row stride allowed);
//! `seqused_k` int32 `[B]`; o `[B, Sq, Hq, D]` and lse f32 `[B, Hq, Sq]` (natural log),
//! contiguous. Key `j` of sequence `b` is row `j % page_size` of block
//! `block_table[b][j / page_size]`.
//!
//! Mixed batches (decode, speculative and chunked-prefill rows in one call, as
//! FlashAttention's `cu_seqlens_q`): with [`DecodeArgs::cu_seqlens_q`] = int32 `[B + 1]`
//! offsets, sequence `b` has the `Sq_b = cu[b+1] - cu[b]` rows `cu[b] .. cu[b+1]` (0 to
//! `max_q_per_seq` each) of a packed q `[total_q, Hq, D]` (strided rows allowed); o is
//! `[total_q, Hq, D]` and lse `[Hq, total_q]`, contiguous. The batch is the table's rows.
//! Through [`DecodePlan::forward_raw`] (the cudarc wrapper takes the uniform layout).
//!
//! Masking: query row `i` has the diagonal `seqused_k[b] - Sq_b + i` (causal bottom-right
//! per sequence; `Sq_b = Sq` without `cu_seqlens_q`) and sees the keys of
//! `window = (left, right)` around it (-1 = unbounded, as FlashAttention's `window_size`):
//! causal decode is `(-1, 0)`, full attention `(-1, -1)`. A row with no visible key gets
//! O = 0 and LSE = -inf.
//!
//! ALiBi ([`DecodePlan::new_alibi`], [`DecodePlan::forward_raw_alibi`]): FlashAttention's
//! bias `-slope · |d_i - j|` on the logit of row i and key j, after the softcap; slopes f32
//! `[Hq]` or `[B, Hq]` (the table's rows with `cu_seqlens_q`).
//!
//! A contiguous cache `[B, Sk, Hkv, D]` is the special case of one page per sequence: a
//! class with `page_size: 0` (the page size is taken from the cache's shape per call),
//! `k_cache` viewed as `[B, Sk, Hkv, D]` and the identity table `[[0], [1], .., [B-1]]`
//! ([`identity_block_table`]).
//!
//! Order of a decode step with new tokens: [`DecodePlan::append_kv_raw`] writes the new rows
//! at positions `seqused_k[b] ..` (the lengths before the step); the caller then adds `Snew`
//! to `seqused_k` (a device-side add on the same stream, or an upload) and runs
//! [`DecodePlan::forward_raw`] with the new lengths.
//!
//! One file per responsibility, arrows only downward (each file imports only the ones
//! above it):
//! - `abi.rs`: the kernel ABI of `kernels/attention/decode/decode_paged.cu` (entry names, launch
//!   constants and limits, the defines of a build, the parameter blocks of both entries);
//! - `class.rs`: [`DecodeClass`] (validation, the byte and FLOP models);
//! - `select.rs`: the kernel build of a class (tile rows, stages), the variant table
//!   ([`all_decode_kernels`]) and the KV split count ([`split_heuristic`]);
//! - `args.rs`: a call's tensors ([`DecodeArgs`]) and its O(1) checks ([`DecodeShape`]);
//! - `plan.rs`: [`DecodePlan`]: build, splits and workspace, the forward's raw layer
//!   ([`DecodePlan::forward_raw`]) and cudarc layer ([`DecodePlan::forward`]);
//! - `append.rs`: the KV append ([`AppendArgs`], [`DecodePlan::append_kv_raw`],
//!   [`DecodePlan::append_kv`]);
//! - `gpu_tests.rs` (lab): the GPU tests against the f64 reference.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

mod abi;
mod append;
mod args;
mod class;
#[cfg(all(test, feature = "lab"))]
mod gpu_tests;
mod plan;
mod select;

pub use crate::gpu::raw::RawIndex;
pub use crate::gpu::RawWorkspace;
pub use abi::{
    DecodeKernel, APPEND_ENTRY, BLOCK_N, DECODE_ENTRY, DECODE_SOURCE, HEAD_DIMS, MAX_Q_PER_SEQ,
    MAX_SPLITS, MAX_SPLIT_GROUPS, MIN_KEYS_PER_SPLIT, THREADS,
};
pub use append::AppendArgs;
pub use args::{identity_block_table, DecodeArgs, DecodeShape};
pub use class::DecodeClass;
pub use plan::DecodePlan;
pub use select::{all_decode_kernels, split_heuristic};
