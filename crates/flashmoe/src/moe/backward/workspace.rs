//! What the backward reads from the forward ([`SavedRouting`]), its call arguments
//! ([`MoeBwdArgs`]) and its workspace regions ([`BwdWorkspaceLayout`]).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{RawTensor, RawU32, RawWorkspace};
use crate::moe::forward::plan::{MoeClass, WorkspaceLayout, WORKSPACE_ALIGN};

/// The routing tensors the forward leaves in its workspace (module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SavedRouting {
    /// [T, E] f32 router logits.
    pub logits: RawTensor,
    /// [E + 1] u32 row offsets of the experts' groups.
    pub offsets: RawU32,
    /// \[R\] u32 token of each permuted row.
    pub row_token: RawU32,
    /// \[R\] u32 permuted row of each slot t·k + s.
    pub slot_row: RawU32,
}

impl SavedRouting {
    /// The regions of a forward call's workspace `ws` laid out as `layout`
    /// ([`crate::moe::MoePlan::workspace_layout`]`(tokens)`), for `tokens` tokens of `class`.
    pub fn from_forward_workspace(
        class: &MoeClass,
        tokens: usize,
        layout: &WorkspaceLayout,
        ws: RawWorkspace,
    ) -> Result<SavedRouting> {
        ws.check(layout.bytes, WORKSPACE_ALIGN as u64, "MoePlan")?;
        let rows = tokens * class.top_k;
        let at = |off: usize| ws.ptr + off as u64;
        Ok(SavedRouting {
            logits: RawTensor::contiguous(at(layout.logits), DType::F32, &[tokens, class.experts])?,
            offsets: RawU32 {
                ptr: at(layout.offsets),
                len: class.experts + 1,
            },
            row_token: RawU32 {
                ptr: at(layout.row_token),
                len: rows,
            },
            slot_row: RawU32 {
                ptr: at(layout.slot_row),
                len: rows,
            },
        })
    }
}

/// The tensors of one backward call (layouts in the module doc; all contiguous).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeBwdArgs {
    /// \[T, H\]: the forward's input; T = shape\[0\].
    pub x: RawTensor,
    pub router: RawTensor,
    pub w13: RawTensor,
    pub w2: RawTensor,
    pub shared_w13: Option<RawTensor>,
    pub shared_w2: Option<RawTensor>,
    /// \[T·k\] u32 ids, \[T, k\] f32 weights, \[E\] u32 counts: the forward's routing outputs.
    pub topk_ids: RawU32,
    pub topk_w: RawTensor,
    pub counts: RawU32,
    pub saved: SavedRouting,
    /// [T·k, 2I] 16-bit, optional: the routed rows' gate/up pre-activations the forward
    /// wrote (`MoeArgs::gate_up` of the same call); the backward then skips recomputing
    /// them (one grouped GEMM of 2·T·k·H·2I FLOPs and its [T·k, 2I] f32 workspace).
    pub saved_gate_up: Option<RawTensor>,
    /// [T, H] upstream gradient of the output.
    pub d_out: RawTensor,
    /// \[2\] f32 upstream gradients of (aux loss, z-loss); None: both 0.
    pub d_losses: Option<RawTensor>,
    /// Outputs.
    pub dx: RawTensor,
    pub d_router: RawTensor,
    pub dw13: RawTensor,
    pub dw2: RawTensor,
    pub d_shared_w13: Option<RawTensor>,
    pub d_shared_w2: Option<RawTensor>,
}

/// Byte offsets of the backward's intermediates (each 256-byte aligned) and its size.
/// R = T·k routed rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BwdWorkspaceLayout {
    /// [R, 2I] f32 recomputed gate/up pre-activations (a 1-byte placeholder, unused, in
    /// the layout of a call with the forward's saved gate/up).
    pub gu: usize,
    /// [R, I] f32 G = dOut_perm·W2ᵀ.
    pub g: usize,
    /// [R, 2I] 16-bit dGU.
    pub dgu: usize,
    /// [R, I] 16-bit w⊙h.
    pub wh: usize,
    /// [R, H] f32 dX_perm.
    pub dx_perm: usize,
    /// \[R\] f32 dL/d(routing weight), slot order.
    pub dw: usize,
    /// [T, E] f32 dL/d(logits).
    pub dz: usize,
    /// [chunks, H, E] f32 partial sums of d_router = xᵀ·dZ, one per chunk of tokens
    /// ([`router_chunks`]).
    pub dr_part: usize,
    /// Shared expert: [T, 2I] f32 gu, [T, I] f32 G, [T, 2I] 16-bit dGU, [T, I] 16-bit h,
    /// [T, H] f32 dX.
    pub shared: Option<[usize; 5]>,
    /// The sm_90a GEMMs' dense operands: [R, H] 16-bit x_perm and dOut_perm (rows
    /// gathered in permuted order); present when the plan has those kernels.
    pub perm: Option<[usize; 2]>,
    pub bytes: usize,
}

/// Chunks of tokens that d_router = xᵀ·dZ is split into (summed in order afterwards): one
/// per 512 tokens, at most 16, so that its H/64 · E/64 tiles times the chunks fill the GPU
/// (non-decreasing in `tokens`, so the workspace is monotone).
pub fn router_chunks(tokens: usize) -> usize {
    (tokens / 512).clamp(1, 16)
}

pub(super) fn too_big() -> Error {
    Error::invalid("the MoE backward workspace for this shape exceeds the address space")
}

pub(super) struct Carver(usize);

impl Carver {
    fn take(&mut self, elems: usize, elem_bytes: usize) -> Result<usize> {
        let start = self
            .0
            .checked_next_multiple_of(WORKSPACE_ALIGN)
            .ok_or_else(too_big)?;
        let bytes = elems.checked_mul(elem_bytes).ok_or_else(too_big)?;
        self.0 = start.checked_add(bytes.max(1)).ok_or_else(too_big)?;
        Ok(start)
    }
}

impl BwdWorkspaceLayout {
    /// The layout of a backward call of `class` with `tokens` tokens; `sm90`: with
    /// the regions of the sm_90a GEMMs ([`BwdWorkspaceLayout::perm`]); `gate_up_saved`:
    /// the call reads the forward's gate/up, so no region for recomputing them.
    pub fn new(
        class: &MoeClass,
        tokens: usize,
        sm90: bool,
        gate_up_saved: bool,
    ) -> Result<BwdWorkspaceLayout> {
        let (h, i, e) = (class.hidden, class.intermediate, class.experts);
        let el = class.dtype.size_bytes();
        let rows = tokens.checked_mul(class.top_k).ok_or_else(too_big)?;
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(too_big);
        let mut c = Carver(0);
        let gu = c.take(if gate_up_saved { 0 } else { mul(rows, 2 * i)? }, 4)?;
        let g = c.take(mul(rows, i)?, 4)?;
        let dgu = c.take(mul(rows, 2 * i)?, el)?;
        let wh = c.take(mul(rows, i)?, el)?;
        let dx_perm = c.take(mul(rows, h)?, 4)?;
        let dw = c.take(rows, 4)?;
        let dz = c.take(mul(tokens, e)?, 4)?;
        let dr_part = c.take(mul(router_chunks(tokens), mul(h, e)?)?, 4)?;
        let shared = if class.shared_expert {
            Some([
                c.take(mul(tokens, 2 * i)?, 4)?,
                c.take(mul(tokens, i)?, 4)?,
                c.take(mul(tokens, 2 * i)?, el)?,
                c.take(mul(tokens, i)?, el)?,
                c.take(mul(tokens, h)?, 4)?,
            ])
        } else {
            None
        };
        let perm = if sm90 {
            Some([c.take(mul(rows, h)?, el)?, c.take(mul(rows, h)?, el)?])
        } else {
            None
        };
        let bytes =
            c.0.checked_next_multiple_of(WORKSPACE_ALIGN)
                .ok_or_else(too_big)?;
        Ok(BwdWorkspaceLayout {
            gu,
            g,
            dgu,
            wh,
            dx_perm,
            dw,
            dz,
            dr_part,
            shared,
            perm,
            bytes,
        })
    }
}
