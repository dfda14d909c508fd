//! The backward's launch sequence ([`backward_steps`]): what `backward_raw` enqueues and
//! what the CPU model of the kernels (model_tests.rs) interprets.

use super::abi::*;
use super::workspace::{router_chunks, BwdWorkspaceLayout, MoeBwdArgs};
use crate::error::{Error, Result};
use crate::moe::forward::plan::MoeClass;
use crate::problem::Scoring;

/// The backward's launches in stream order for a checked call of `t` tokens, workspace at
/// `base` laid out as `ws`, each handed to `f`. `sm90`: the routed GEMMs (gu, G, dX_perm
/// and the weight gradients dW2, dW13) on the sm_90a kernels over gathered x_perm /
/// dOut_perm (`ws.perm`); otherwise every GEMM on the portable kernels. The shared
/// expert's GEMMs are portable either way.
pub(super) fn backward_steps(
    c: &MoeClass,
    t: usize,
    a: &MoeBwdArgs,
    ws: &BwdWorkspaceLayout,
    base: u64,
    sm90: bool,
    f: &mut dyn FnMut(Step) -> Result<()>,
) -> Result<()> {
    let (h, i, e, k) = (c.hidden, c.intermediate, c.experts, c.top_k);
    let r = t * k;
    let at = |off: usize| base + off as u64;
    let (hi, ii, ei, ti, ri) = (h as i32, i as i32, e as i32, t as i32, r as i32);
    let (ids, offs, rtok, srow) = (
        a.topk_ids.ptr,
        a.saved.offsets.ptr,
        a.saved.row_token.ptr,
        a.saved.slot_row.ptr,
    );

    let perm = match (sm90, ws.perm) {
        (false, _) => None,
        (true, Some(p)) => Some(p.map(at)),
        (true, None) => {
            return Err(Error::invalid(
                "the sm_90a GEMMs need the workspace's x_perm / dOut_perm regions",
            ))
        }
    };
    // The sm_90a GEMMs read dense permuted rows; the portable ones gather through row_token.
    let (x_rows, dout_rows) = match perm {
        Some([xp, dp]) => {
            for (src, dst) in [(a.x.ptr, xp), (a.d_out.ptr, dp)] {
                f(Step::Gather {
                    src,
                    row_token: rtok,
                    dst,
                    rows: r,
                    cols: h,
                })?;
            }
            (xp, dp)
        }
        None => (a.x.ptr, a.d_out.ptr),
    };
    let rows_sm90 = |a_: u64, b: u64, b_kmajor: bool, c_: u64, n: usize, k_: usize| {
        Step::Sm90Rows(Sm90Rows {
            a: a_,
            b,
            b_kmajor,
            c: c_,
            offsets: offs,
            rows: r,
            experts: e,
            n,
            k: k_,
        })
    };
    // 1. gu = X_perm·W13 (B [K=H][N=2I]), unless the forward kept it.
    let saved_gu = a.saved_gate_up.map(|g| g.ptr);
    match (saved_gu, perm.is_some()) {
        (Some(_), _) => {}
        (None, true) => f(rows_sm90(x_rows, a.w13.ptr, false, at(ws.gu), 2 * i, h))?,
        (None, false) => f(Step::Rows(RowsGemm {
            a: a.x.ptr,
            a_rs: hi,
            a_gather: 1,
            b: a.w13.ptr,
            b_gs: (h * 2 * i) as i64,
            b_ks: 2 * ii,
            b_ns: 1,
            c: at(ws.gu),
            ldc: 2 * ii,
            row_token: rtok,
            offsets: offs,
            groups: ei,
            total_rows: ri,
            n_cols: 2 * ii,
            k_dim: hi,
        }))?,
    }
    // 2. G = dOut_perm·W2ᵀ (W2 [I][H] read as [N=I][K=H]), then the slot epilogue.
    if perm.is_some() {
        f(rows_sm90(dout_rows, a.w2.ptr, true, at(ws.g), i, h))?;
    } else {
        f(Step::Rows(RowsGemm {
            a: a.d_out.ptr,
            a_rs: hi,
            a_gather: 1,
            b: a.w2.ptr,
            b_gs: (i * h) as i64,
            b_ks: 1,
            b_ns: hi,
            c: at(ws.g),
            ldc: ii,
            row_token: rtok,
            offsets: offs,
            groups: ei,
            total_rows: ri,
            n_cols: ii,
            k_dim: hi,
        }))?;
    }
    f(Step::Swiglu {
        slots: r,
        ptrs: [
            saved_gu.unwrap_or(at(ws.gu)),
            at(ws.g),
            srow,
            a.topk_w.ptr,
            at(ws.dgu),
            at(ws.wh),
            at(ws.dw),
        ],
        inter: ii,
        saved_gu: saved_gu.is_some(),
    })?;
    let wgrad_sm90 = |a_: u64, b: u64, dw: u64, m: usize, n: usize| {
        Step::Sm90Wgrad(Sm90Wgrad {
            a: a_,
            b,
            dw,
            offsets: offs,
            rows: r,
            experts: e,
            m,
            n,
        })
    };
    // 3. dW2 = (w⊙H)ᵀ·dOut_perm.
    if perm.is_some() {
        f(wgrad_sm90(at(ws.wh), dout_rows, a.dw2.ptr, i, h))?;
    } else {
        f(Step::Wgrad(WgradGemm {
            a: at(ws.wh),
            a_rs: ii,
            a_gather: 0,
            b: a.d_out.ptr,
            b_rs: hi,
            b_gather: 1,
            c: a.dw2.ptr,
            m_dim: ii,
            n_cols: hi,
            row_token: rtok,
            offsets: offs,
            total_rows: ri,
            groups: e as u32,
        }))?;
    }
    // 4. dX_perm = dGU·W13ᵀ (W13 [H][2I] read as [N=H][K=2I]).
    if perm.is_some() {
        f(rows_sm90(
            at(ws.dgu),
            a.w13.ptr,
            true,
            at(ws.dx_perm),
            h,
            2 * i,
        ))?;
    } else {
        f(Step::Rows(RowsGemm {
            a: at(ws.dgu),
            a_rs: 2 * ii,
            a_gather: 0,
            b: a.w13.ptr,
            b_gs: (h * 2 * i) as i64,
            b_ks: 1,
            b_ns: 2 * ii,
            c: at(ws.dx_perm),
            ldc: hi,
            row_token: rtok,
            offsets: offs,
            groups: ei,
            total_rows: ri,
            n_cols: hi,
            k_dim: 2 * ii,
        }))?;
    }
    // 5. dW13 = X_permᵀ·dGU.
    if perm.is_some() {
        f(wgrad_sm90(x_rows, at(ws.dgu), a.dw13.ptr, h, 2 * i))?;
    } else {
        f(Step::Wgrad(WgradGemm {
            a: a.x.ptr,
            a_rs: hi,
            a_gather: 1,
            b: at(ws.dgu),
            b_rs: 2 * ii,
            b_gather: 0,
            c: a.dw13.ptr,
            m_dim: hi,
            n_cols: 2 * ii,
            row_token: rtok,
            offsets: offs,
            total_rows: ri,
            groups: e as u32,
        }))?;
    }
    // 6. Router: dZ, then d_router = xᵀ·dZ.
    {
        let logits = a.saved.logits.ptr;
        let (tw, dw, cnt) = (a.topk_w.ptr, at(ws.dw), a.counts.ptr);
        let dl = a.d_losses.map_or(0u64, |d| d.ptr);
        let dz = at(ws.dz);
        let (ki, sig, rn) = (
            k as i32,
            i32::from(c.scoring == Scoring::Sigmoid),
            i32::from(c.renormalize),
        );
        f(Step::RouterDz(
            [logits, ids, tw, dw, cnt, dl, dz],
            [ti, ei, ki, sig, rn],
        ))?;
        let chunks = router_chunks(t);
        let part = at(ws.dr_part);
        let chunk = t.div_ceil(chunks) as i32;
        let chunks = chunks as i32;
        f(Step::RouterDw(
            [a.x.ptr, dz, part],
            [ti, hi, ei, chunk, chunks],
        ))?;
        f(Step::RouterDwSum([part, a.d_router.ptr], [chunks, hi * ei]))?;
    }
    // 7. Shared expert: one group of all tokens, w = 1, no dw.
    let dx_shared = if let (Some(sh), Some(sw13), Some(sw2), Some(dsw13), Some(dsw2)) = (
        ws.shared,
        a.shared_w13,
        a.shared_w2,
        a.d_shared_w13,
        a.d_shared_w2,
    ) {
        let [s_gu, s_g, s_dgu, s_h, s_dx] = sh.map(at);
        let one = |a_: u64, a_rs, b: u64, b_ks, b_ns, c: u64, ldc, n_cols, k_dim| RowsGemm {
            a: a_,
            a_rs,
            a_gather: 0,
            b,
            b_gs: 0,
            b_ks,
            b_ns,
            c,
            ldc,
            row_token: 0,
            offsets: 0,
            groups: 1,
            total_rows: ti,
            n_cols,
            k_dim,
        };
        f(Step::Rows(one(
            a.x.ptr,
            hi,
            sw13.ptr,
            2 * ii,
            1,
            s_gu,
            2 * ii,
            2 * ii,
            hi,
        )))?;
        f(Step::Rows(one(
            a.d_out.ptr,
            hi,
            sw2.ptr,
            1,
            hi,
            s_g,
            ii,
            ii,
            hi,
        )))?;
        f(Step::Swiglu {
            slots: t,
            ptrs: [s_gu, s_g, 0, 0, s_dgu, s_h, 0],
            inter: ii,
            saved_gu: false,
        })?;
        let wg = |a_: u64, a_rs, b: u64, b_rs, c: u64, m_dim, n_cols| WgradGemm {
            a: a_,
            a_rs,
            a_gather: 0,
            b,
            b_rs,
            b_gather: 0,
            c,
            m_dim,
            n_cols,
            row_token: 0,
            offsets: 0,
            total_rows: ti,
            groups: 1,
        };
        f(Step::Wgrad(wg(s_h, ii, a.d_out.ptr, hi, dsw2.ptr, ii, hi)))?;
        f(Step::Rows(one(
            s_dgu,
            2 * ii,
            sw13.ptr,
            1,
            2 * ii,
            s_dx,
            hi,
            hi,
            2 * ii,
        )))?;
        f(Step::Wgrad(wg(
            a.x.ptr,
            hi,
            s_dgu,
            2 * ii,
            dsw13.ptr,
            hi,
            2 * ii,
        )))?;
        s_dx
    } else {
        0
    };
    // 8. Un-permute + shared + router.
    let (dxp, dz, rw, dx, ki) = (at(ws.dx_perm), at(ws.dz), a.router.ptr, a.dx.ptr, k as i32);
    f(Step::Unpermute(
        [dxp, srow, dx_shared, dz, rw, dx],
        [ti, hi, ei, ki],
    ))
}
