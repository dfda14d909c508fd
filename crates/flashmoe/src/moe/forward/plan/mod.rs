//! MoE plans: the whole MoE layer for one shape class, resolved once, then enqueued on the
//! caller's stream over the caller's weights, activations and workspace.
//!
//! [`MoePlan::new`] does the slow work once per [`MoeClass`]: for every token count
//! `1..=max_tokens` it resolves the kernels [`select::select`](super::select::select) and
//! the sm_90 path choice ([`sm90::select_path`](crate::moe::gemm::sm90::select_path), or the
//! lab's explicit override in [`MoePlan::with_gemm_path`]) pick, compiles or loads each
//! distinct kernel once, and sets the shared-memory attributes. The choices depend on the
//! token count (router logits kernel, grouped-GEMM tile regime, sm_90 or portable GEMMs),
//! so the plan keeps them as a short table of token ranges ([`MoePlan::token_ranges`])
//! and a call picks its row by a scan of that table.
//!
//! A call ([`MoePlan::forward_raw`]) does O(1) checks, encodes the sm_90 GEMMs' four TMA
//! tensor maps when that path runs (host-only driver calls: the maps hold the weights' and
//! the workspace's addresses), and enqueues 8 kernels (+1 gather on the sm_90 path, +2 for
//! a shared expert) on the stream it is given: no allocation, no synchronisation, no
//! compile, no file or environment access. It can be captured in a CUDA graph.
//!
//! # Layouts (row-major, contiguous, 16-bit elements of the class's dtype)
//! - `x [T, H]`, `out [T, H]`;
//! - `router [H, E]`;
//! - `w13 [E, H, 2I]`: for expert e, columns `[0, I)` are the gate projection and
//!   `[I, 2I)` the up projection (two blocks, not interleaved): `h = silu(x·gate) ⊙ (x·up)`;
//! - `w2 [E, I, H]`;
//! - shared expert (when the class has one): `shared_w13 [H, 2I]` (same gate | up split),
//!   `shared_w2 [I, H]`.
//!
//! These are the layouts every kernel path reads (the sm_90 path's TMA maps included), so
//! no repack is needed. A checkpoint stored PyTorch-style (`gate_proj.weight [I, H]`,
//! `up_proj.weight [I, H]`, `down_proj.weight [H, I]`) is transposed once at load time.
//! Routing outputs stay on the device ([`RoutingArgs`]): `topk_ids [T, k]` u32 (descending
//! score), `topk_w [T, k]` f32, `counts [E]` u32, `losses [2]` f32 = (aux, z), computed on
//! the device (block 0 of `moe_permute`; `moe_router_losses` in the router-only stage).
//!
//! # Alignment
//! 16-bit tensors start on 16-byte boundaries (the sm_90 path reads the weights through
//! TMA and the token gather copies 16-byte chunks; `hidden` and `intermediate` are
//! multiples of 32 for every class the plan accepts); f32 and u32 tensors are 4-byte
//! aligned. The workspace starts on a 256-byte boundary (any cudaMalloc result).
//!
//! # Workspace
//! Every intermediate lives in one caller-provided workspace of
//! [`MoePlan::workspace_bytes`]`(tokens)` bytes, carved into 256-byte aligned regions
//! ([`WorkspaceLayout`]). No kernel of the pipeline accumulates into memory or keeps state
//! between launches (no atomics, every intermediate element is written before it is
//! read), so the workspace needs no zeroing and a graph replay is correct as is. Launches
//! that may run at the same time (on different streams) need one workspace each.
//!
//! The plan also owns one small read-only device table, written once when it is built:
//! `[0, 1, …, max_tokens)` (the shared expert's token list) and the pairs `[0, T]` for
//! every T (the offsets of the one-group GEMMs: router logits and shared expert), so that
//! a call writes no host data to the device.
//!
//! Determinism: every reduction has a fixed order (contract in [`abi`](crate::moe::forward::abi)); the same
//! inputs give bit-identical outputs on every call, stream and graph replay.

//!
//! # Files
//! One responsibility each, imports only downward (each file imports only the ones above
//! it):
//! - `class.rs`: [`MoeClass`], a call's raw tensors ([`MoeArgs`], [`RoutingArgs`]) and
//!   their O(1) checks;
//! - `workspace.rs`: [`WorkspaceLayout`], the carving of a call's workspace;
//! - `ranges.rs`: kernel resolution by token range (selection per token count, the ranges
//!   by bisection, loading each distinct kernel once; [`TokenRange`]);
//! - `resolve.rs`: [`MoePlan`]: its build ([`MoePlan::new`], [`MoePlan::with_gemm_path`])
//!   and what a call's size selects (kernels, launch geometry, workspace size, checks);
//! - `enqueue.rs`: the raw layer ([`MoePlan::forward_raw`], [`MoePlan::router_raw`]) and the
//!   pieces the expert-parallel layer enqueues alone;
//! - `cudarc_layer.rs`: [`MoePlan::forward`] over cudarc buffers, [`MoeWeights`],
//!   [`MoeRouting`].

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

mod class;
mod cudarc_layer;
mod enqueue;
mod ranges;
mod resolve;
mod workspace;

pub use crate::gpu::raw::RawU32;
pub use class::{MoeArgs, MoeClass, RoutingArgs};
pub use cudarc_layer::{MoeRouting, MoeWeights};
// Crate-internal helpers stay reachable at their `moe::plan::` paths for the
// expert-parallel layer and the backward, which build on them.
#[allow(unused_imports)]
pub(crate) use enqueue::Front;
pub use ranges::TokenRange;
#[allow(unused_imports)]
pub(crate) use ranges::{plan_selections, token_pieces};
pub use resolve::MoePlan;
pub use workspace::{WorkspaceLayout, WORKSPACE_ALIGN};
