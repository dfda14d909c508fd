//! The expert-parallel schedule run for every rank on the CPU (f32, the GPU algorithm's
//! reference [`crate::reference::moe_grouped`]): routing and permutation per rank, the
//! counts "all-gathered", each rank's [`Exchange`], the chunked dispatch, the expert MLPs
//! on each received block, the return and the combine. Used by the unit tests to prove
//! the decomposition reproduces the single-GPU layer on every rank's tokens.

use super::exchange::{chunk_experts, Exchange};
use super::placement::ExpertPlacement;
use crate::error::{Error, Result};
use crate::problem::MoeProblem;
use crate::reference::moe::{route, MoeInputs, Routing};
use crate::reference::moe_grouped::{expert_mlp, permute};

/// Outputs (`[tokens_r, hidden]` f32) and routing of every rank. `inputs[r]` holds rank
/// r's tokens (`x`) and the full weights (the same on every rank); `p` gives the layer's
/// dimensions (its token count is ignored: each rank's comes from its `x`).
pub fn simulate_cpu(
    p: &MoeProblem,
    inputs: &[MoeInputs],
    placement: &ExpertPlacement,
    chunks: usize,
) -> Result<Vec<(Vec<f32>, Routing)>> {
    let world = placement.world();
    let probs = rank_problems(p, inputs, placement)?;
    let (h, i, e, k) = (p.hidden, p.intermediate, p.experts, p.top_k);
    // 1. route, permute and gather on every rank.
    let mut routing = Vec::new();
    let mut perms = Vec::new();
    let mut x_perm: Vec<Vec<f32>> = Vec::new();
    let mut all_counts = Vec::with_capacity(world * e);
    for (pr, x) in probs.iter().zip(inputs) {
        let rt = route(pr, x)?;
        let perm = permute(pr, &rt);
        let mut g = Vec::with_capacity(perm.rows.len() * h);
        for &(t, _) in &perm.rows {
            g.extend_from_slice(&x.x[t as usize * h..(t as usize + 1) * h]);
        }
        all_counts.extend(rt.expert_counts.iter().map(|&c| c as u32));
        routing.push(rt);
        perms.push(perm);
        x_perm.push(g);
    }
    // 2. every rank's schedule from the same counts.
    let cap = (world - 1) * inputs.iter().map(|x| x.x.len() / h * k).max().unwrap_or(0);
    let xs: Vec<Exchange> = (0..world)
        .map(|r| Exchange::new(placement, r, &all_counts, chunks, cap))
        .collect::<Result<_>>()?;
    let mut x_recv: Vec<Vec<f32>> = xs.iter().map(|x| vec![f32::NAN; x.recv_rows * h]).collect();
    let mut y: Vec<Vec<f32>> = xs.iter().map(|x| vec![f32::NAN; x.rows * h]).collect();
    let mut y_recv: Vec<Vec<f32>> = xs.iter().map(|x| vec![f32::NAN; x.recv_rows * h]).collect();
    let mlp = |rows: &[f32], m: usize, expert: usize| {
        let w13 = &inputs[0].w13[expert * h * 2 * i..(expert + 1) * h * 2 * i];
        let w2 = &inputs[0].w2[expert * i * h..(expert + 1) * i * h];
        expert_mlp(rows, w13, w2, m, h, i)
    };
    // 3. own rows for own experts.
    for r in 0..world {
        let mut pre = vec![0usize];
        for &c in &all_counts[r * e..(r + 1) * e] {
            pre.push(pre.last().unwrap() + c as usize);
        }
        for ex in placement.range(r) {
            let (a, b) = (pre[ex], pre[ex + 1]);
            if b > a {
                let out = mlp(&x_perm[r][a * h..b * h], b - a, ex);
                y[r][a * h..b * h].copy_from_slice(&out);
            }
        }
    }
    // 4. per chunk: dispatch, the received blocks' MLPs, return.
    for c in 0..chunks {
        dispatch(&xs, c, h, &x_perm, &mut x_recv)?;
        for d in 0..world {
            let local = placement.local(d);
            for s in (0..world).filter(|&s| s != d) {
                let offs = &xs[d].recv_offsets[s * (local + 1)..(s + 1) * (local + 1)];
                for j in chunk_experts(local, chunks, c) {
                    let (a, b) = (offs[j] as usize, offs[j + 1] as usize);
                    if b > a {
                        let out = mlp(&x_recv[d][a * h..b * h], b - a, placement.first(d) + j);
                        y_recv[d][a * h..b * h].copy_from_slice(&out);
                    }
                }
            }
        }
        send_back(&xs, c, h, &y_recv, &mut y);
    }
    // 5. combine in token order, as the single-GPU layer.
    let mut out = Vec::with_capacity(world);
    for r in 0..world {
        let t = probs[r].tokens;
        let mut o = vec![0f32; t * h];
        for tok in 0..t {
            let dst = &mut o[tok * h..(tok + 1) * h];
            for s in 0..k {
                let slot = tok * k + s;
                let row = perms[r].row_of_slot[slot];
                let w = routing[r].topk_weights[slot] as f32;
                for (dv, &v) in dst.iter_mut().zip(&y[r][row * h..(row + 1) * h]) {
                    *dv += w * v;
                }
            }
        }
        out.push((o, routing[r].clone()));
    }
    Ok(out)
}

/// Chunk `c`'s dispatch: every rank s's rows for rank d (`send[c][d]` of `from[s]`) into
/// d's received rows (`recv[c][s]` of `to[d]`), `h` values a row.
pub(super) fn dispatch<T: Copy>(
    xs: &[Exchange],
    c: usize,
    h: usize,
    from: &[Vec<T>],
    to: &mut [Vec<T>],
) -> Result<()> {
    for s in 0..xs.len() {
        for d in (0..xs.len()).filter(|&d| d != s) {
            let (src, dst) = (&xs[s].send[c][d], &xs[d].recv[c][s]);
            if src.len() != dst.len() {
                return Err(Error::invalid("the ranks' schedules disagree"));
            }
            to[d][dst.start * h..dst.end * h].copy_from_slice(&from[s][src.start * h..src.end * h]);
        }
    }
    Ok(())
}

/// Chunk `c`'s return, the reverse of [`dispatch`]: rank d's received rows from s
/// (`recv[c][s]` of `from[d]`) back into s's rows (`send[c][d]` of `to[s]`).
pub(super) fn send_back<T: Copy>(
    xs: &[Exchange],
    c: usize,
    h: usize,
    from: &[Vec<T>],
    to: &mut [Vec<T>],
) {
    for d in 0..xs.len() {
        for s in (0..xs.len()).filter(|&s| s != d) {
            let (src, dst) = (&xs[d].recv[c][s], &xs[s].send[c][d]);
            to[s][dst.start * h..dst.end * h].copy_from_slice(&from[d][src.start * h..src.end * h]);
        }
    }
}

/// Each rank's layer problem (`p` with the rank's token count), after checking that there
/// is one rank's inputs per rank of `placement` and no shared expert.
pub(super) fn rank_problems(
    p: &MoeProblem,
    inputs: &[MoeInputs],
    placement: &ExpertPlacement,
) -> Result<Vec<MoeProblem>> {
    let world = placement.world();
    if inputs.len() != world {
        return Err(Error::invalid(format!(
            "{} ranks' inputs for a world of {world}",
            inputs.len()
        )));
    }
    if p.shared_expert {
        return Err(Error::invalid(
            "the expert-parallel layer has no shared expert",
        ));
    }
    Ok(inputs
        .iter()
        .map(|x| MoeProblem {
            tokens: x.x.len() / p.hidden,
            ..*p
        })
        .collect())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::reference::moe_grouped::moe_grouped;
    use crate::{DType, Scoring};

    /// The simulations' layer (hidden 32, intermediate 24); tokens come per rank.
    pub(in crate::moe::ep) fn problem(
        experts: usize,
        top_k: usize,
        scoring: Scoring,
    ) -> MoeProblem {
        MoeProblem {
            tokens: 0,
            hidden: 32,
            intermediate: 24,
            experts,
            top_k,
            scoring,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        }
    }

    /// Each rank's tokens: its own x (seed per rank), the shared weights.
    pub(in crate::moe::ep) fn rank_inputs(
        p: &MoeProblem,
        tokens: &[usize],
        seed: u64,
    ) -> Vec<MoeInputs> {
        let full = MoeInputs::generate(&MoeProblem { tokens: 1, ..*p }, seed);
        tokens
            .iter()
            .enumerate()
            .map(|(r, &t)| {
                let mine =
                    MoeInputs::generate(&MoeProblem { tokens: t, ..*p }, seed + 1 + r as u64);
                MoeInputs {
                    x: mine.x,
                    ..full.clone()
                }
            })
            .collect()
    }

    /// The decomposition reproduces the single-GPU layer bit for bit on every rank, for
    /// even and uneven placements, any chunk count and unequal token counts per rank
    /// (world size 1 included: the same path with nothing exchanged).
    #[test]
    fn expert_parallel_schedule_matches_the_single_gpu_layer() {
        // (experts, top_k, scoring, tokens per rank, expert → rank map, chunks)
        type Case<'a> = (
            usize,
            usize,
            Scoring,
            &'a [usize],
            Option<&'a [usize]>,
            usize,
        );
        let cases: &[Case] = &[
            (8, 2, Scoring::Softmax, &[40], None, 1),
            (8, 2, Scoring::Softmax, &[40, 23], None, 1),
            (8, 2, Scoring::Softmax, &[40, 23], None, 3),
            (
                16,
                4,
                Scoring::Sigmoid,
                &[17, 50, 1],
                Some(&[0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2]),
                2,
            ),
            (12, 3, Scoring::Softmax, &[9, 9, 9, 9], None, 3),
            // 10 experts over 3 ranks: the automatic uneven split (4, 3, 3).
            (10, 2, Scoring::Softmax, &[21, 8, 30], None, 2),
        ];
        for &(experts, k, scoring, tokens, map, chunks) in cases {
            let p = problem(experts, k, scoring);
            let world = tokens.len();
            let placement = match map {
                Some(m) => ExpertPlacement::from_map(m, world).unwrap(),
                None => ExpertPlacement::even(experts, world).unwrap(),
            };
            let inputs = rank_inputs(&p, tokens, 7 + experts as u64);
            let got = simulate_cpu(&p, &inputs, &placement, chunks).unwrap();
            for (r, ((out, rt), x)) in got.iter().zip(&inputs).enumerate() {
                let pr = MoeProblem {
                    tokens: tokens[r],
                    ..p
                };
                let (want, want_rt) = moe_grouped(&pr, x).unwrap();
                assert!(
                    out.iter().all(|v| v.is_finite()),
                    "rank {r}: non-finite output"
                );
                assert_eq!(rt, &want_rt, "rank {r}: routing differs");
                let same = out
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "rank {r} of {world} (E={experts}, chunks={chunks}): output differs"
                );
            }
        }
    }
}
