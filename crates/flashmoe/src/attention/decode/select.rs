//! Selection: the kernel build (rows per CTA, pipeline stages) of a class, every build a
//! class can select, and the KV split count of a call.

use super::abi::{DecodeKernel, BLOCK_N, HEAD_DIMS, MAX_SPLITS, MIN_KEYS_PER_SPLIT};
use super::class::DecodeClass;
use crate::dtype::DType;

impl DecodeKernel {
    /// The build for `class`: BM covers G · max_q_per_seq rows up to 32 (D <= 128; D = 256
    /// keeps BM = 16 for registers), stages fill ~96-128 KiB of K/V ring (2 CTAs per SM on
    /// H100 at D = 128, 3 at D = 64).
    pub fn for_class(c: &DecodeClass) -> DecodeKernel {
        let rows = c.group() * c.max_q_per_seq;
        let mt = if rows <= 16 || c.head_dim > 128 { 1 } else { 2 };
        let stages = match c.head_dim {
            64 => 4,
            128 => 3,
            _ => 2,
        };
        DecodeKernel {
            head_dim: c.head_dim,
            bf16: c.dtype == DType::Bf16,
            mt,
            stages,
            softcap: c.softcap > 0.0,
            alibi: false,
        }
    }
}

/// Every kernel build a class can select (for the NVRTC compile test).
pub fn all_decode_kernels() -> Vec<DecodeKernel> {
    let mut v = Vec::new();
    for d in HEAD_DIMS {
        for bf16 in [true, false] {
            for softcap in [false, true] {
                for max_rows in [1, 32] {
                    let c = DecodeClass {
                        softcap: if softcap { 30.0 } else { 0.0 },
                        dtype: if bf16 { DType::Bf16 } else { DType::F16 },
                        ..DecodeClass::causal(DType::Bf16, d, max_rows, 1, 16, 1)
                    };
                    let k = DecodeKernel::for_class(&c);
                    for k in [k.clone(), DecodeKernel { alibi: true, ..k }] {
                        if !v.contains(&k) {
                            v.push(k);
                        }
                    }
                }
            }
        }
    }
    v
}

/// The FlashAttention-2 split heuristic with a tighter bar and whole tiles: with `ctas`
/// CTAs of work per split, `slots` CTAs resident per wave and `tiles` K/V tiles of
/// [`BLOCK_N`] keys per sequence, no split when the grid already fills 80% of a wave;
/// otherwise the smallest split count whose wave efficiency (work / (waves · slots)) is
/// within 95% of the best one, among the counts of at least [`MIN_KEYS_PER_SPLIT`] keys a
/// split that the kernel actually runs (s splits of ceil(tiles / s) tiles leave
/// ceil(tiles / ceil(tiles / s)) of them non-empty). FA2 takes 85% and ignores the tiles;
/// with the merge fused into the last split an extra split costs only its partial O, so
/// filling the wave wins: B=1 Hkv=8 Sk=8192 gets 32 splits of 4 tiles, not 28 (26 of them
/// non-empty, up to 5 tiles each).
pub fn split_heuristic(ctas: usize, slots: usize, tiles: usize) -> usize {
    let max_splits = tiles
        .div_ceil(MIN_KEYS_PER_SPLIT / BLOCK_N)
        .clamp(1, MAX_SPLITS);
    if ctas == 0 || slots == 0 || ctas * 5 >= slots * 4 {
        return 1;
    }
    let runs = |s: usize| tiles.max(1).div_ceil(tiles.max(1).div_ceil(s)) == s;
    let eff = |s: usize| {
        let work = ctas * s;
        work as f64 / (work.div_ceil(slots) * slots) as f64
    };
    let best = (1..=max_splits)
        .filter(|&s| runs(s))
        .map(eff)
        .fold(0.0, f64::max);
    (1..=max_splits)
        .find(|&s| runs(s) && eff(s) >= 0.95 * best)
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_selection_and_smem() {
        let c = DecodeClass::causal(DType::Bf16, 128, 32, 8, 16, 1);
        let k = DecodeKernel::for_class(&c);
        assert_eq!((k.mt, k.stages), (1, 3));
        // 2·128·(16 + 2·3·64) = 102400
        assert_eq!(k.shared_mem_bytes(), 102_400);
        let k = DecodeKernel::for_class(&DecodeClass {
            max_q_per_seq: 5,
            ..c
        });
        assert_eq!(k.mt, 2);
        let k = DecodeKernel::for_class(&DecodeClass {
            head_dim: 256,
            max_q_per_seq: 16,
            ..c
        });
        assert_eq!((k.mt, k.stages), (1, 2));
        assert!(k.shared_mem_bytes() <= 163 * 1024);
        let all = all_decode_kernels();
        // Each build with and without ALiBi.
        assert_eq!(all.len(), 2 * (2 * 2 * 2 + 2 * 2 * 2 + 2 * 2));
        for k in &all {
            assert!(k.shared_mem_bytes() as usize <= 163 * 1024, "{k:?}");
        }
    }

    #[test]
    fn split_heuristic_fills_waves() {
        // Full grid: no split.
        assert_eq!(split_heuristic(512, 264, 128), 1);
        assert_eq!(split_heuristic(220, 264, 128), 1);
        // B=1, Hkv=8 at Sk=8192 (128 tiles): 32 splits of 4 tiles, 97% of a wave.
        assert_eq!(split_heuristic(8, 264, 128), 32);
        // B=8, Hkv=8 at Sk=4096: 4 splits of 16 tiles.
        assert_eq!(split_heuristic(64, 264, 64), 4);
        // B=16, Hkv=8: 128 CTAs → 2 splits fill 97% of a wave.
        assert_eq!(split_heuristic(128, 264, 512), 2);
        // Short sequences cap the splits (4 tiles a split at least).
        assert_eq!(split_heuristic(8, 264, 4), 1);
        assert!(split_heuristic(8, 264, 16) <= 4);
        // Every answer is a count the kernel runs (no empty trailing splits).
        for tiles in 1..300 {
            for ctas in [1, 3, 8, 40, 100] {
                let s = split_heuristic(ctas, 264, tiles);
                assert_eq!(
                    tiles.div_ceil(tiles.div_ceil(s)),
                    s,
                    "tiles {tiles} ctas {ctas}"
                );
            }
        }
    }
}
