//! The expert-parallel backward's schedule run for every rank on the CPU (f64, the stages
//! of [`crate::reference::moe_backward`]): the data flow a multi-GPU backward must have,
//! proved against the single-GPU backward before any kernel or NCCL call exists (issue 46,
//! item 1).
//!
//! Per rank, what the forward left: its routing and permutation, its x rows, and the
//! expert outputs y of its rows (returned to it by the forward's combine all-to-all). The
//! backward then:
//!
//! 1. **combine backward** on the source rank: dY = w·dOut per routed row and the routing
//!    weights' gradients dw = <y, dOut> (no traffic: y came back in the forward);
//! 2. **dispatch dY** along the forward's x schedule ([`Exchange`]: the same `send` /
//!    `recv` ranges, chunk by chunk), so every expert's owner holds dY beside the x rows it
//!    received in the forward;
//! 3. **expert backward on the owner**, one grouped problem per expert over all its rows,
//!    sources in rank order (the owner's own rows at its place in that order), with the
//!    activations recomputed from the x rows: dX rows and the expert's dW13, dW2, which
//!    stay on the owner;
//! 4. **return dX** along the forward's y schedule (reverse ranges), into the source's
//!    permuted rows;
//! 5. **router and un-permute backward** on the source rank, on its own tokens: dZ from dw
//!    and the losses, dR = xᵀ·dZ, dx = the scatter-add of its dX rows + dZ·Rᵀ.
//!
//! So each rank's dx and router gradient are the single-GPU backward's on that rank's
//! tokens exactly (every value comes from the same per-row formulas in the same order),
//! and each expert's weight gradients are the sum over all ranks' rows, accumulated in rank
//! order — the single-GPU backward on every rank's tokens concatenated, up to the grouping
//! of that one sum.

use super::exchange::{chunk_experts, Exchange};
use super::placement::ExpertPlacement;
use super::sim::{dispatch, rank_problems, send_back};
use crate::error::{Error, Result};
use crate::problem::MoeProblem;
use crate::reference::moe::MoeInputs;
use crate::reference::moe_backward::{
    combine_backward, expert_backward, expert_forward, forward_state, router_gemm_backward,
    router_logits_backward, unpermute_backward,
};

/// One rank's gradients from [`simulate_backward_cpu`].
#[derive(Debug, Clone, PartialEq)]
pub struct EpRankGradients {
    /// (tokens of this rank, H).
    pub dx: Vec<f64>,
    /// (H, E): this rank's tokens' contribution (a data-parallel all-reduce sums them).
    pub d_router: Vec<f64>,
    /// (local experts, H, 2I): this rank's experts, every rank's rows.
    pub dw13: Vec<f64>,
    /// (local experts, I, H).
    pub dw2: Vec<f64>,
}

/// The expert-parallel backward for every rank (module docs). `inputs[r]`: rank r's tokens
/// and the full weights (the same on every rank); `d_out[r]`: (tokens_r, H) upstream
/// gradient; `d_aux`, `d_z`: the losses' upstream scalars (each rank's losses over its own
/// tokens, as its forward computed them). `p` gives the dimensions (its token count is
/// ignored).
pub fn simulate_backward_cpu(
    p: &MoeProblem,
    inputs: &[MoeInputs],
    d_out: &[Vec<f32>],
    placement: &ExpertPlacement,
    chunks: usize,
    (d_aux, d_z): (f64, f64),
) -> Result<Vec<EpRankGradients>> {
    let world = placement.world();
    let probs = rank_problems(p, inputs, placement)?;
    if d_out.len() != world {
        return Err(Error::invalid(format!(
            "{} upstream gradients for a world of {world}",
            d_out.len()
        )));
    }
    let (h, i, e, k) = (p.hidden, p.intermediate, p.experts, p.top_k);
    for (r, (pr, g)) in probs.iter().zip(d_out).enumerate() {
        if g.len() != pr.tokens * h {
            return Err(Error::invalid(format!(
                "rank {r}: d_out has {} values, its {} tokens x {h} need {}",
                g.len(),
                pr.tokens,
                pr.tokens * h
            )));
        }
    }

    // What each rank kept from its forward: routing, permutation, x rows in permuted order
    // (as f32, the dispatch's payload) and y of its rows (f64 here).
    let states = probs
        .iter()
        .zip(inputs)
        .map(|(pr, x)| forward_state(pr, x))
        .collect::<Result<Vec<_>>>()?;
    let x_perm: Vec<Vec<f32>> = states
        .iter()
        .zip(inputs)
        .map(|(st, x)| {
            let mut g = Vec::with_capacity(st.perm.rows.len() * h);
            for &(t, _) in &st.perm.rows {
                g.extend_from_slice(&x.x[t as usize * h..(t as usize + 1) * h]);
            }
            g
        })
        .collect();
    let all_counts: Vec<u32> = states
        .iter()
        .flat_map(|st| st.router.routing.expert_counts.iter().map(|&c| c as u32))
        .collect();
    let cap = (world - 1) * probs.iter().map(|pr| pr.tokens * k).max().unwrap_or(0);
    let xs: Vec<Exchange> = (0..world)
        .map(|r| Exchange::new(placement, r, &all_counts, chunks, cap))
        .collect::<Result<_>>()?;

    // 1. combine backward on every source rank.
    let mut dy_perm = Vec::with_capacity(world);
    let mut d_weights = Vec::with_capacity(world);
    for ((pr, st), g) in probs.iter().zip(&states).zip(d_out) {
        let g: Vec<f64> = g.iter().map(|&v| v as f64).collect();
        let (dy, dw) = combine_backward(pr, &st.router.routing, &st.perm, &st.routed.y, &g);
        dy_perm.push(dy);
        d_weights.push(dw);
    }

    // The owner's buffers (NaN until written): the forward's received x rows and the
    // dispatched dY rows; the dX rows it returns. The sources' dX rows.
    let mut x_recv: Vec<Vec<f32>> = xs.iter().map(|x| vec![f32::NAN; x.recv_rows * h]).collect();
    let mut dy_recv: Vec<Vec<f64>> = xs.iter().map(|x| vec![f64::NAN; x.recv_rows * h]).collect();
    let mut dx_recv: Vec<Vec<f64>> = xs.iter().map(|x| vec![f64::NAN; x.recv_rows * h]).collect();
    let mut dx_perm: Vec<Vec<f64>> = xs.iter().map(|x| vec![f64::NAN; x.rows * h]).collect();
    let mut dw13: Vec<Vec<f64>> = (0..world)
        .map(|r| vec![0f64; placement.local(r) * h * 2 * i])
        .collect();
    let mut dw2: Vec<Vec<f64>> = (0..world)
        .map(|r| vec![0f64; placement.local(r) * i * h])
        .collect();
    // Row offsets of each source's experts in its own x_perm (from the gathered counts).
    let own_offsets = |r: usize| {
        let mut pre = vec![0usize];
        for &c in &all_counts[r * e..(r + 1) * e] {
            pre.push(pre.last().unwrap() + c as usize);
        }
        pre
    };

    for c in 0..chunks {
        // 2. dispatch: x (the forward's, kept by the owner) and dY, the same ranges.
        dispatch(&xs, c, h, &x_perm, &mut x_recv)?;
        dispatch(&xs, c, h, &dy_perm, &mut dy_recv)?;
        // 3. each owner's experts of this chunk: every source's rows in rank order.
        for d in 0..world {
            let local = placement.local(d);
            let own = own_offsets(d);
            for j in chunk_experts(local, chunks, c) {
                let ex = placement.first(d) + j;
                // (source, first row, rows) of each block, in rank order.
                let blocks: Vec<(usize, usize, usize)> = (0..world)
                    .map(|s| {
                        if s == d {
                            (s, own[ex], own[ex + 1] - own[ex])
                        } else {
                            let offs = &xs[d].recv_offsets[s * (local + 1)..(s + 1) * (local + 1)];
                            (s, offs[j] as usize, (offs[j + 1] - offs[j]) as usize)
                        }
                    })
                    .collect();
                let rows: usize = blocks.iter().map(|b| b.2).sum();
                if rows == 0 {
                    continue;
                }
                let mut xe = Vec::with_capacity(rows * h);
                let mut dye = Vec::with_capacity(rows * h);
                for &(s, a, n) in &blocks {
                    let (xsrc, dsrc) = if s == d {
                        (&x_perm[d], &dy_perm[d])
                    } else {
                        (&x_recv[d], &dy_recv[d])
                    };
                    xe.extend(xsrc[a * h..(a + n) * h].iter().map(|&v| v as f64));
                    dye.extend_from_slice(&dsrc[a * h..(a + n) * h]);
                }
                let w13 = &inputs[d].w13[ex * h * 2 * i..(ex + 1) * h * 2 * i];
                let w2 = &inputs[d].w2[ex * i * h..(ex + 1) * i * h];
                let act = expert_forward(&xe, w13, w2, h, i);
                let g = expert_backward(&xe, &act.gu, &act.h, &dye, w13, w2, h, i);
                dw13[d][j * h * 2 * i..(j + 1) * h * 2 * i].copy_from_slice(&g.dw13);
                dw2[d][j * i * h..(j + 1) * i * h].copy_from_slice(&g.dw2);
                let mut at = 0;
                for &(s, a, n) in &blocks {
                    let dst = if s == d {
                        &mut dx_perm[d]
                    } else {
                        &mut dx_recv[d]
                    };
                    dst[a * h..(a + n) * h].copy_from_slice(&g.dx[at * h..(at + n) * h]);
                    at += n;
                }
            }
        }
        // 4. return dX along the forward's y ranges.
        send_back(&xs, c, h, &dx_recv, &mut dx_perm);
    }

    // 5. router and un-permute backward on each source rank's own tokens.
    let mut out = Vec::with_capacity(world);
    for r in 0..world {
        let (pr, st, x) = (&probs[r], &states[r], &inputs[r]);
        let d_logits = router_logits_backward(pr, &st.router, &d_weights[r], d_aux, d_z);
        let (dx_router, d_router) = router_gemm_backward(pr, &x.x, &x.router, &d_logits);
        let dx = unpermute_backward(pr, &st.perm, &dx_perm[r], None, &dx_router);
        out.push(EpRankGradients {
            dx,
            d_router,
            dw13: std::mem::take(&mut dw13[r]),
            dw2: std::mem::take(&mut dw2[r]),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::moe_backward::moe_backward_f64;
    use crate::Scoring;

    use crate::moe::ep::sim::tests::problem;

    /// Each rank's tokens and the shared weights (the forward simulation's), and each
    /// rank's upstream gradient: another draw's x (finite, unit scale, independent).
    fn rank_inputs(p: &MoeProblem, tokens: &[usize], seed: u64) -> (Vec<MoeInputs>, Vec<Vec<f32>>) {
        let xs = crate::moe::ep::sim::tests::rank_inputs(p, tokens, seed);
        let gs = tokens
            .iter()
            .enumerate()
            .map(|(r, &t)| {
                MoeInputs::generate(&MoeProblem { tokens: t, ..*p }, seed + 100 + r as u64).x
            })
            .collect();
        (xs, gs)
    }

    fn max_rel(a: &[f64], b: &[f64]) -> f64 {
        let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-300);
        a.iter()
            .zip(b)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs() / scale))
    }

    /// Every rank's dx and router gradient equal the single-GPU backward's on its own
    /// tokens bit for bit; every expert's weight gradients equal the sum of the single-GPU
    /// backwards' over all ranks (to f64 rounding: one sum grouped differently); for even
    /// and uneven placements, chunk counts, unequal token counts, both scorings, with and
    /// without the losses (world size 1 included).
    #[test]
    fn expert_parallel_backward_matches_the_single_gpu_backward() {
        type Case<'a> = (
            usize,
            usize,
            Scoring,
            &'a [usize],
            Option<&'a [usize]>,
            usize,
            (f64, f64),
        );
        let cases: &[Case] = &[
            (8, 2, Scoring::Softmax, &[40], None, 1, (0.0, 0.0)),
            (8, 2, Scoring::Softmax, &[40, 23], None, 1, (0.0, 0.0)),
            (8, 2, Scoring::Softmax, &[40, 23], None, 3, (0.5, 0.1)),
            (
                16,
                4,
                Scoring::Sigmoid,
                &[17, 50, 1],
                Some(&[0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2]),
                2,
                (0.3, 0.0),
            ),
            (12, 3, Scoring::Softmax, &[9, 9, 9, 9], None, 3, (0.0, 0.2)),
            // 10 experts over 3 ranks: the automatic uneven split (4, 3, 3).
            (10, 2, Scoring::Sigmoid, &[21, 8, 30], None, 2, (0.1, 0.1)),
        ];
        for &(experts, k, scoring, tokens, map, chunks, losses) in cases {
            let p = problem(experts, k, scoring);
            let world = tokens.len();
            let placement = match map {
                Some(m) => ExpertPlacement::from_map(m, world).unwrap(),
                None => ExpertPlacement::even(experts, world).unwrap(),
            };
            let (inputs, d_out) = rank_inputs(&p, tokens, 11 + experts as u64);
            let got =
                simulate_backward_cpu(&p, &inputs, &d_out, &placement, chunks, losses).unwrap();
            let (h, i) = (p.hidden, p.intermediate);
            let mut want_dw13 = vec![0f64; experts * h * 2 * i];
            let mut want_dw2 = vec![0f64; experts * i * h];
            for r in 0..world {
                let pr = MoeProblem {
                    tokens: tokens[r],
                    ..p
                };
                let want =
                    moe_backward_f64(&pr, &inputs[r], &d_out[r], losses.0, losses.1).unwrap();
                let bits = |a: &[f64], b: &[f64]| {
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                };
                let what = format!("rank {r} of {world} (E={experts}, chunks={chunks})");
                assert!(
                    got[r].dx.iter().all(|v| v.is_finite()),
                    "{what}: non-finite dx"
                );
                assert!(bits(&got[r].dx, &want.dx), "{what}: dx differs");
                assert!(
                    bits(&got[r].d_router, &want.d_router),
                    "{what}: d_router differs"
                );
                for (o, v) in want_dw13.iter_mut().zip(&want.dw13) {
                    *o += v;
                }
                for (o, v) in want_dw2.iter_mut().zip(&want.dw2) {
                    *o += v;
                }
            }
            // Each owner's experts against the ranks' summed single-GPU weight gradients.
            for (d, g) in got.iter().enumerate() {
                let r = placement.range(d);
                let (w13, w2) = (
                    &want_dw13[r.start * h * 2 * i..r.end * h * 2 * i],
                    &want_dw2[r.start * i * h..r.end * i * h],
                );
                let what = format!("owner {d} of {world} (E={experts}, chunks={chunks})");
                assert!(
                    g.dw13.iter().chain(&g.dw2).all(|v| v.is_finite()),
                    "{what}: non-finite weight gradient"
                );
                assert!(max_rel(&g.dw13, w13) < 1e-12, "{what}: dw13 differs");
                assert!(max_rel(&g.dw2, w2) < 1e-12, "{what}: dw2 differs");
                assert!(
                    w13.iter().any(|&v| v != 0.0),
                    "{what}: the case trains nothing"
                );
            }
        }
    }

    #[test]
    fn mismatched_inputs_are_errors() {
        let p = problem(8, 2, Scoring::Softmax);
        let placement = ExpertPlacement::even(8, 2).unwrap();
        let (inputs, mut d_out) = rank_inputs(&p, &[5, 6], 3);
        assert!(
            simulate_backward_cpu(&p, &inputs[..1], &d_out, &placement, 1, (0.0, 0.0)).is_err()
        );
        d_out[1].pop();
        let e = simulate_backward_cpu(&p, &inputs, &d_out, &placement, 1, (0.0, 0.0)).unwrap_err();
        assert!(e.to_string().contains("rank 1: d_out"), "{e}");
    }
}
