//! The MoE layer's backward (issues 34, 41): [`MoeBackwardPlan`], built once per
//! [`MoeClass`](crate::moe::MoeClass) like [`MoePlan`](crate::moe::MoePlan), enqueued on the caller's stream over the
//! caller's memory. Kernels: `kernels/moe/backward/moe_backward.cu` (mma.sync grouped GEMMs, sm_80 and
//! newer) and, on sm_90 for calls with enough rows per expert, the routed GEMMs on TMA +
//! wgmma (`sm90.rs`): stages 1, 2, 4 on the forward's `moe_gemm_sm90.cu`, the weight
//! gradients 3, 5 on `moe_wgrad_sm90.cu`, over gathered rows. The stages
//! and their formulas are those of the f64 ground truth
//! `crate::reference::moe_backward` and of docs/design/moe.md ("Backward"):
//!
//! 1. gu = X_perm·W13 (the forward's gemm13 without SwiGLU, recomputed; f32);
//! 2. G = dOut_perm·W2ᵀ (f32), then per routed slot: dw = ⟨h, G⟩, dH = w·G, the SwiGLU
//!    backward dGU, and w⊙h (16-bit);
//! 3. dW2 = (w⊙H)ᵀ·dOut_perm per expert (K = that expert's rows);
//! 4. dX_perm = dGU·W13ᵀ (f32);
//! 5. dW13 = X_permᵀ·dGU per expert;
//! 6. router: dZ from dw, the aux loss and the z-loss (f32), d_router = xᵀ·dZ (partial
//!    sums per chunk of tokens, then summed in order);
//! 7. shared expert (when the class has one): 1–5 as one group of all tokens, w = 1;
//! 8. un-permute: dx_t = ((Σ_s dX_perm\[row(t, s)\]) + dX_shared,t) + dZ_t·Rᵀ, slots
//!    ascending, a gather-sum per token (no atomics).
//!
//! # What the forward must keep (inputs of [`MoeBwdArgs`])
//! - x `[T, H]`, router `[H, E]`, w13 `[E, H, 2I]`, w2 `[E, I, H]` (+ shared_w13 `[H, 2I]`,
//!   shared_w2 `[I, H]`), all in the class's 16-bit dtype, the layouts of
//!   [`crate::moe::forward::plan`];
//! - the routing outputs: topk_ids `[T·k]` u32, topk_w `[T, k]` f32, counts `[E]` u32;
//! - from the forward's workspace (regions of [`WorkspaceLayout`](crate::moe::WorkspaceLayout)): the router logits
//!   `[T, E]` f32, the expert offsets `[E + 1]` u32, row_token `[R]` u32 and slot_row
//!   `[R]` u32 (R = T·k). [`SavedRouting::from_forward_workspace`] names them; the
//!   forward's workspace must therefore not be reused between the forward and the backward
//!   (or these four regions copied out).
//!
//! Not kept: gu, h and y (gu is recomputed in stage 1, h from gu, and dw = ⟨y, dOut⟩ is
//! computed as ⟨h, dOut·W2ᵀ⟩).
//!
//! # Outputs
//! dx `[T, H]`, d_router `[H, E]`, dw13 `[E, H, 2I]`, dw2 `[E, I, H]` (+ d_shared_w13,
//! d_shared_w2), all in the class's 16-bit dtype (f32 accumulation, one rounding at the
//! store). Every element is written (experts with no rows get zero weight gradients): the
//! outputs need no zeroing. The f32 intermediates (gu, G, dX_perm, dw, dZ) stay in the
//! workspace.
//!
//! # Workspace
//! [`MoeBackwardPlan::workspace_bytes`]`(tokens)` bytes, 256-byte aligned regions
//! ([`BwdWorkspaceLayout`]); every region is written before it is read, so it needs no
//! zeroing and a graph replay is correct as is.
//!
//! # Determinism
//! Every sum has a fixed order: the GEMMs' k loops are sequential per output tile (the
//! weight-gradient GEMM walks all of an expert's rows in one block, no split-K), dw is a
//! fixed-shape tree per slot, the router and un-permute sums are sequential per thread.
//! The same inputs give bit-identical gradients on every call.
//!
//! A call does O(1) checks and enqueues 10 kernels (12 on the sm_90a path: two
//! gathers; +6 for a shared expert, whose GEMMs stay portable): no
//! allocation, no synchronisation, no compile; it can be captured in a CUDA graph.

//!
//! Files (one role each): `abi.rs` (source, entries, tiles, one launch's parameters),
//! `workspace.rs` (saved routing, call arguments, workspace regions), `steps.rs` (the
//! launch sequence), `sm90.rs` (the sm_90a GEMMs: path, kernels, launches),
//! `plan.rs` ([`MoeBackwardPlan`]), `model_tests.rs` (the CPU model of
//! the kernels driven by that sequence), `gpu_tests.rs` (lab feature).

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

mod abi;
#[cfg(all(test, feature = "lab"))]
mod gpu_tests;
#[cfg(all(test, feature = "lab"))]
mod model_tests;
mod plan;
mod sm90;
mod steps;
mod workspace;

pub use abi::{bwd_defines, BWD_ENTRIES, BWD_SOURCE};
pub use plan::MoeBackwardPlan;
pub use workspace::{router_chunks, BwdWorkspaceLayout, MoeBwdArgs, SavedRouting};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::moe::forward::plan::{MoeClass, WORKSPACE_ALIGN};
    use crate::problem::Scoring;

    fn class(shared: bool) -> MoeClass {
        MoeClass {
            dtype: DType::Bf16,
            hidden: 64,
            intermediate: 32,
            experts: 4,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            shared_expert: shared,
            max_tokens: 16,
        }
    }

    #[test]
    fn router_chunks_grow_with_tokens_to_16() {
        let c: Vec<usize> = [1, 511, 512, 1100, 2048, 8192, 8193, 1 << 20]
            .iter()
            .map(|&t| router_chunks(t))
            .collect();
        assert_eq!(c, [1, 1, 1, 2, 4, 16, 16, 16]);
    }

    #[test]
    fn workspace_regions_are_aligned_disjoint_and_monotone() {
        let modes = [(false, false), (true, false), (false, true), (true, true)];
        for ((shared, sm90), saved) in modes.into_iter().flat_map(|m| [(m, false), (m, true)]) {
            let c = class(shared);
            let mut last = 0;
            for t in 1..=16 {
                let l = BwdWorkspaceLayout::new(&c, t, sm90, saved).unwrap();
                let mut regions = vec![
                    (l.gu, if saved { 1 } else { t * 2 * 2 * 32 * 4 }),
                    (l.g, t * 2 * 32 * 4),
                    (l.dgu, t * 2 * 64 * 2),
                    (l.wh, t * 2 * 32 * 2),
                    (l.dx_perm, t * 2 * 64 * 4),
                    (l.dw, t * 2 * 4),
                    (l.dz, t * 4 * 4),
                    (l.dr_part, router_chunks(t) * 64 * 4 * 4),
                ];
                if let Some(s) = l.shared {
                    regions.extend([
                        (s[0], t * 64 * 4),
                        (s[1], t * 32 * 4),
                        (s[2], t * 64 * 2),
                        (s[3], t * 32 * 2),
                        (s[4], t * 64 * 4),
                    ]);
                }
                if let Some(p) = l.perm {
                    regions.extend([(p[0], t * 2 * 64 * 2), (p[1], t * 2 * 64 * 2)]);
                }
                assert_eq!(l.shared.is_some(), shared);
                assert_eq!(l.perm.is_some(), sm90);
                for w in regions.windows(2) {
                    assert!(w[0].0 + w[0].1 <= w[1].0, "{t}: overlap");
                }
                for (o, _) in &regions {
                    assert_eq!(o % WORKSPACE_ALIGN, 0);
                }
                let (o, n) = regions[regions.len() - 1];
                assert!(o + n <= l.bytes && l.bytes % WORKSPACE_ALIGN == 0);
                assert!(l.bytes >= last);
                last = l.bytes;
                if saved {
                    let recompute = BwdWorkspaceLayout::new(&c, t, sm90, false).unwrap();
                    assert!(l.bytes + t * 2 * 2 * 32 * 4 - WORKSPACE_ALIGN <= recompute.bytes);
                }
            }
        }
    }

    #[test]
    fn bad_classes_are_rejected_with_the_reason() {
        let bad = [
            (
                MoeClass {
                    dtype: DType::F32,
                    ..class(false)
                },
                "f32",
            ),
            (
                MoeClass {
                    hidden: 48,
                    ..class(false)
                },
                "multiples of 32",
            ),
            (
                MoeClass {
                    top_k: 5,
                    ..class(false)
                },
                "top_k",
            ),
            (
                MoeClass {
                    max_tokens: 0,
                    ..class(false)
                },
                "max_tokens",
            ),
        ];
        for (c, what) in bad {
            let e = MoeBackwardPlan::check_class(&c).unwrap_err().to_string();
            assert!(e.contains(what), "{what}: {e}");
        }
        MoeBackwardPlan::check_class(&class(true)).unwrap();
    }
}
