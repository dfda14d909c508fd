//! Which rank owns which experts.

use crate::error::{Error, Result};

/// The experts of an expert-parallel layer split over `world` ranks: rank `r` owns the
/// contiguous ids `first(r)..first(r + 1)`, ranks in ascending order.
///
/// Contiguity is what lets a rank send one contiguous block of its expert-sorted rows to
/// each peer and lets a peer run its experts as one grouped GEMM over its slice of the
/// weights; a map that is not of this shape is rejected up front (a permutation of the
/// expert ids is the caller's relabelling of the router's columns and weights).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPlacement {
    /// `first[r]` = first expert of rank r; `first[world]` = experts.
    first: Vec<usize>,
}

impl ExpertPlacement {
    /// The experts split as evenly as the counts allow: `experts / world` per rank, and
    /// one more for each of the first `experts % world` ranks (256 experts over 3 ranks:
    /// 86, 85, 85). Every rank needs an expert: `experts >= world`.
    pub fn even(experts: usize, world: usize) -> Result<ExpertPlacement> {
        if world == 0 {
            return Err(Error::invalid("expert parallelism needs world >= 1 rank"));
        }
        if experts < world {
            return Err(Error::invalid(format!(
                "{experts} experts cannot give each of {world} ranks an expert"
            )));
        }
        // Ranks 0 .. extra own per + 1 experts each, the rest per.
        let (per, extra) = (experts / world, experts % world);
        let big = extra * (per + 1);
        let map: Vec<usize> = (0..experts)
            .map(|e| {
                if e < big {
                    e / (per + 1)
                } else {
                    extra + (e - big) / per
                }
            })
            .collect();
        ExpertPlacement::from_map(&map, world)
    }

    /// From an expert → rank map (`map[e]` = rank of expert e). Every rank must own at
    /// least one expert and each rank's experts must be one contiguous run of ids, ranks
    /// ascending (`map` non-decreasing); errors name the first expert that breaks a rule.
    pub fn from_map(map: &[usize], world: usize) -> Result<ExpertPlacement> {
        if world == 0 {
            return Err(Error::invalid("expert parallelism needs world >= 1 rank"));
        }
        if map.is_empty() {
            return Err(Error::invalid("the expert-to-rank map is empty"));
        }
        if map.len() < world {
            return Err(Error::invalid(format!(
                "{} experts cannot give each of {world} ranks an expert",
                map.len()
            )));
        }
        let mut first = vec![0usize; world + 1];
        let mut prev = 0usize;
        for (e, &r) in map.iter().enumerate() {
            if r >= world {
                return Err(Error::invalid(format!(
                    "expert {e} is mapped to rank {r} but the world has {world} ranks (0..{world})"
                )));
            }
            if e == 0 && r != 0 {
                return Err(Error::invalid(format!(
                    "expert 0 is mapped to rank {r}: rank 0 owns no expert (every rank needs \
                     one, and ranks own ascending contiguous runs of ids)"
                )));
            }
            if r < prev {
                return Err(Error::invalid(format!(
                    "expert {e} is mapped to rank {r} after an expert of rank {prev}: each rank's \
                     experts must be one contiguous run of ids, ranks ascending"
                )));
            }
            if r > prev + 1 {
                return Err(Error::invalid(format!(
                    "rank {} owns no expert (expert {e} jumps from rank {prev} to {r})",
                    prev + 1
                )));
            }
            if r == prev + 1 {
                first[r] = e;
            }
            prev = r;
        }
        if prev != world - 1 {
            return Err(Error::invalid(format!(
                "rank {} owns no expert (the last expert is on rank {prev})",
                prev + 1
            )));
        }
        first[world] = map.len();
        Ok(ExpertPlacement { first })
    }

    pub fn world(&self) -> usize {
        self.first.len() - 1
    }
    pub fn experts(&self) -> usize {
        self.first[self.world()]
    }
    /// First expert id of `rank`.
    pub fn first(&self, rank: usize) -> usize {
        self.first[rank]
    }
    /// The expert ids `rank` owns.
    pub fn range(&self, rank: usize) -> std::ops::Range<usize> {
        self.first[rank]..self.first[rank + 1]
    }
    /// Number of experts `rank` owns.
    pub fn local(&self, rank: usize) -> usize {
        self.first[rank + 1] - self.first[rank]
    }
    /// Most experts any rank owns.
    pub fn max_local(&self) -> usize {
        (0..self.world()).map(|r| self.local(r)).max().unwrap_or(0)
    }
    /// The rank owning `expert`.
    pub fn rank_of(&self, expert: usize) -> usize {
        self.first[1..].partition_point(|&f| f <= expert)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_split_and_lookups() {
        let p = ExpertPlacement::even(256, 2).unwrap();
        assert_eq!(
            (p.world(), p.experts(), p.local(0), p.local(1)),
            (2, 256, 128, 128)
        );
        assert_eq!(p.range(1), 128..256);
        assert_eq!(
            (p.rank_of(0), p.rank_of(127), p.rank_of(128), p.rank_of(255)),
            (0, 0, 1, 1)
        );
        let one = ExpertPlacement::even(8, 1).unwrap();
        assert_eq!((one.range(0), one.rank_of(7)), (0..8, 0));
    }

    #[test]
    fn even_splits_what_does_not_divide() {
        // 256 experts over 3 ranks: 86, 85, 85 (the first ranks take the remainder).
        let p = ExpertPlacement::even(256, 3).unwrap();
        assert_eq!(
            (p.range(0), p.range(1), p.range(2)),
            (0..86, 86..171, 171..256)
        );
        assert_eq!(p.max_local(), 86);
        let q = ExpertPlacement::even(10, 4).unwrap();
        assert_eq!((0..4).map(|r| q.local(r)).collect::<Vec<_>>(), [3, 3, 2, 2]);
        let exact = ExpertPlacement::even(4, 4).unwrap();
        assert!((0..4).all(|r| exact.range(r) == (r..r + 1)));
    }

    #[test]
    fn uneven_contiguous_map_is_accepted() {
        let p = ExpertPlacement::from_map(&[0, 0, 0, 1, 2, 2], 3).unwrap();
        assert_eq!((p.range(0), p.range(1), p.range(2)), (0..3, 3..4, 4..6));
        assert_eq!(p.max_local(), 3);
        assert_eq!(
            (0..6).map(|e| p.rank_of(e)).collect::<Vec<_>>(),
            [0, 0, 0, 1, 2, 2]
        );
    }

    #[test]
    fn bad_maps_are_rejected_with_the_rule_named() {
        let err = |m: &[usize], w| ExpertPlacement::from_map(m, w).unwrap_err().to_string();
        assert!(
            err(&[0, 1, 0, 1], 2).contains("contiguous"),
            "{}",
            err(&[0, 1, 0, 1], 2)
        );
        assert!(err(&[0, 0, 2, 2], 3).contains("rank 1 owns no expert"));
        assert!(err(&[0, 0, 1, 1], 3).contains("rank 2 owns no expert"));
        assert!(err(&[1, 1, 0, 0], 2).contains("rank 0 owns no expert"));
        assert!(err(&[0, 5], 2).contains("world has 2 ranks"));
        assert!(err(&[0], 2).contains("cannot give each"));
        assert!(err(&[], 1).contains("empty"));
        assert!(err(&[0, 0], 0).contains("world >= 1"));
        let e = ExpertPlacement::even(3, 4).unwrap_err().to_string();
        assert!(e.contains("cannot give each of 4 ranks"), "{e}");
        assert!(ExpertPlacement::even(8, 0).is_err());
    }
}
