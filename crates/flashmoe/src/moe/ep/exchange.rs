//! The all-to-all schedule of one expert-parallel call, computed on the host from the
//! exchanged per-expert counts (pure: no device, unit-tested on the CPU).
//!
//! Every rank sorts its routed rows by expert (`x_perm`, the single-GPU layer's
//! permutation), so the rows a rank sends to peer `d` (the experts `d` owns) are one
//! contiguous range of `x_perm`. A rank receives the blocks of its peers into `x_recv`,
//! source after source (its own block stays in `x_perm`), each block again sorted by
//! expert. The experts of a rank are split into `chunks` contiguous runs; chunk `c` of
//! every block is sent, computed and returned as a unit so that communication overlaps
//! the GEMMs. All ranks compute the same schedule from the same counts, so sends and
//! receives pair up (zero-row transfers are skipped on both sides).

use super::placement::ExpertPlacement;
use crate::error::{Error, Result};
use std::ops::Range;

/// Local expert indices `[a, b)` of chunk `c` of a rank that owns `local` experts.
pub fn chunk_experts(local: usize, chunks: usize, c: usize) -> Range<usize> {
    (c * local / chunks)..((c + 1) * local / chunks)
}

/// The schedule of one call on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    pub rank: usize,
    pub chunks: usize,
    /// Rows this rank routed (its `x_perm` length).
    pub rows: usize,
    /// This rank's rows for its own experts (in `x_perm`).
    pub local_rows: Range<usize>,
    /// `[local + 1]` row offsets of this rank's own experts in `x_perm` (absolute).
    pub own_offsets: Vec<usize>,
    /// `send[c][d]`: rows of `x_perm` sent to rank `d` in chunk `c` (empty for d = rank);
    /// the expert outputs of the same rows come back from `d` into `y` at the same rows.
    pub send: Vec<Vec<Range<usize>>>,
    /// `recv[c][s]`: rows of `x_recv` received from rank `s` in chunk `c` (empty for
    /// s = rank); their expert outputs go back to `s` from `y_recv` at the same rows.
    pub recv: Vec<Vec<Range<usize>>>,
    /// `[world][local + 1]` row offsets of each source's block in `x_recv`, per local
    /// expert (absolute rows; the own rank's entries are zero and unused): the grouped
    /// GEMMs' group offsets.
    pub recv_offsets: Vec<u32>,
    /// Rows of `x_recv` in use.
    pub recv_rows: usize,
}

impl Exchange {
    /// The schedule of `rank` from `all_counts` (`[world][experts]`: rows each rank routed
    /// to each expert, as gathered from every rank), checking that this rank receives at
    /// most `recv_capacity` rows (a peer with more tokens than the layer was built for, or
    /// corrupt counts, is an error here rather than an overflow on the device).
    pub fn new(
        placement: &ExpertPlacement,
        rank: usize,
        all_counts: &[u32],
        chunks: usize,
        recv_capacity: usize,
    ) -> Result<Exchange> {
        let (world, experts) = (placement.world(), placement.experts());
        if rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} is outside the world of {world}"
            )));
        }
        if all_counts.len() != world * experts {
            return Err(Error::invalid(format!(
                "{} exchanged counts, expected world × experts = {world} × {experts}",
                all_counts.len()
            )));
        }
        if chunks == 0 {
            return Err(Error::invalid("an expert-parallel call needs chunks >= 1"));
        }
        let counts = |s: usize| &all_counts[s * experts..(s + 1) * experts];
        // Prefix sums of this rank's counts: the expert offsets of its x_perm.
        let mut pre = vec![0usize; experts + 1];
        for (e, &n) in counts(rank).iter().enumerate() {
            pre[e + 1] = pre[e] + n as usize;
        }
        let mine = placement.range(rank);
        let local = mine.len();
        // Blocks of x_recv: every peer's rows for this rank's experts, source order.
        let mut recv_offsets = vec![0u32; world * (local + 1)];
        let mut base = 0usize;
        for s in (0..world).filter(|&s| s != rank) {
            let o = &mut recv_offsets[s * (local + 1)..(s + 1) * (local + 1)];
            o[0] = u32::try_from(base).map_err(|_| too_many(base))?;
            for (j, e) in mine.clone().enumerate() {
                base += counts(s)[e] as usize;
                if base > recv_capacity {
                    return Err(Error::invalid(format!(
                        "rank {rank} would receive more than its {recv_capacity} rows from its \
                         peers (rank {s} routed {} rows to expert {e}): a peer called with \
                         more tokens than the layer was built for, or corrupt counts",
                        counts(s)[e]
                    )));
                }
                o[j + 1] = u32::try_from(base).map_err(|_| too_many(base))?;
            }
        }
        let at = |s: usize, j: usize| recv_offsets[s * (local + 1) + j] as usize;
        let mut send = Vec::with_capacity(chunks);
        let mut recv = Vec::with_capacity(chunks);
        for c in 0..chunks {
            let mut sc = vec![0..0; world];
            let mut rc = vec![0..0; world];
            for p in (0..world).filter(|&p| p != rank) {
                let theirs = chunk_experts(placement.local(p), chunks, c);
                let f = placement.first(p);
                sc[p] = pre[f + theirs.start]..pre[f + theirs.end];
                let ours = chunk_experts(local, chunks, c);
                rc[p] = at(p, ours.start)..at(p, ours.end);
            }
            send.push(sc);
            recv.push(rc);
        }
        Ok(Exchange {
            rank,
            chunks,
            rows: pre[experts],
            local_rows: pre[mine.start]..pre[mine.end],
            own_offsets: pre[mine.start..=mine.end].to_vec(),
            send,
            recv,
            recv_offsets,
            recv_rows: base,
        })
    }

    /// The schedule of a world of one rank: every row stays.
    pub fn single_rank(rows: usize, local: usize) -> Exchange {
        Exchange {
            rank: 0,
            chunks: 1,
            rows,
            local_rows: 0..rows,
            own_offsets: vec![0; local + 1],
            send: vec![vec![0..0]],
            recv: vec![vec![0..0]],
            recv_offsets: vec![0; local + 1],
            recv_rows: 0,
        }
    }

    /// Rows this rank sends to its peers (= expert outputs it receives back).
    pub fn rows_sent(&self) -> usize {
        self.send.iter().flatten().map(|r| r.len()).sum()
    }
    /// Rows this rank receives from its peers (= expert outputs it sends back).
    pub fn rows_received(&self) -> usize {
        self.recv.iter().flatten().map(|r| r.len()).sum()
    }
}

fn too_many(rows: usize) -> Error {
    Error::invalid(format!(
        "{rows} received rows do not fit 32-bit row offsets"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks, four experts each side: the ranges by hand.
    #[test]
    fn two_rank_schedule_by_hand() {
        let p = ExpertPlacement::even(4, 2).unwrap();
        // rank 0 routed [3, 1, 2, 4] rows to experts 0..4, rank 1 [5, 0, 1, 6].
        let counts = [3, 1, 2, 4, 5, 0, 1, 6];
        let x0 = Exchange::new(&p, 0, &counts, 1, 100).unwrap();
        assert_eq!(x0.rows, 10);
        assert_eq!(x0.local_rows, 0..4);
        assert_eq!(x0.send, vec![vec![0..0, 4..10]]);
        assert_eq!(x0.recv, vec![vec![0..0, 0..5]]);
        assert_eq!(x0.recv_offsets, vec![0, 0, 0, 0, 5, 5]);
        let x1 = Exchange::new(&p, 1, &counts, 2, 100).unwrap();
        assert_eq!(x1.local_rows, 5..12);
        assert_eq!(x1.own_offsets, vec![5, 6, 12]);
        // chunk 0: rank 0's expert 0 / our expert 2; chunk 1: expert 1 / expert 3.
        assert_eq!(x1.send, vec![vec![0..5, 0..0], vec![5..5, 0..0]]);
        assert_eq!(x1.recv, vec![vec![0..2, 0..0], vec![2..6, 0..0]]);
        assert_eq!((x1.rows_sent(), x1.rows_received()), (5, 6));
        // What rank 0 sends rank 1 in each chunk is what rank 1 receives from rank 0.
        for c in 0..2 {
            let x0c = Exchange::new(&p, 0, &counts, 2, 100).unwrap();
            assert_eq!(x0c.send[c][1].len(), x1.recv[c][0].len());
            assert_eq!(x1.send[c][0].len(), x0c.recv[c][1].len());
        }
    }

    #[test]
    fn sends_and_receives_pair_up_on_every_chunk() {
        let map = [0, 0, 0, 1, 1, 2, 2, 2, 2];
        let p = ExpertPlacement::from_map(&map, 3).unwrap();
        let counts: Vec<u32> = (0..27).map(|i| ((i * 7919) % 13) as u32).collect();
        for chunks in [1, 2, 3, 5] {
            let xs: Vec<Exchange> = (0..3)
                .map(|r| Exchange::new(&p, r, &counts, chunks, 1000).unwrap())
                .collect();
            for c in 0..chunks {
                for s in 0..3 {
                    for d in 0..3 {
                        if s != d {
                            assert_eq!(xs[s].send[c][d].len(), xs[d].recv[c][s].len());
                        }
                    }
                }
            }
            for x in &xs {
                // local + sent rows cover x_perm exactly once.
                let mut covered = vec![0u8; x.rows];
                for r in x
                    .local_rows
                    .clone()
                    .chain(x.send.iter().flatten().cloned().flatten())
                {
                    covered[r] += 1;
                }
                assert!(covered.iter().all(|&n| n == 1));
                assert_eq!(x.rows_received(), x.recv_rows);
            }
        }
    }

    #[test]
    fn bad_counts_are_errors() {
        let p = ExpertPlacement::even(4, 2).unwrap();
        let e = Exchange::new(&p, 0, &[1, 2, 3], 1, 100)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected world × experts"), "{e}");
        let e = Exchange::new(&p, 0, &[0, 0, 0, 0, 60, 60, 0, 0], 1, 100)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than its 100 rows"), "{e}");
        assert!(Exchange::new(&p, 2, &[0; 8], 1, 100).is_err());
        assert!(Exchange::new(&p, 0, &[0; 8], 0, 100).is_err());
    }
}
