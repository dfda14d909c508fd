//! Kernel selection: the builds a device can run ([`MlaKernel`]) and the KV-split
//! heuristic.

use super::abi::*;
use crate::dtype::DType;

/// The kernel build: dtype, keys per tile, ring depth and the MMA path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlaKernel {
    pub bf16: bool,
    /// Keys per K/V tile: 64 where the device gives 216 KiB of shared memory a block
    /// (sm_90), else 32 (sm_80's 163 KiB).
    pub block_n: usize,
    pub stages: usize,
    /// Both GEMMs on warpgroup MMAs (sm_90a builds only; needs `block_n` 64).
    pub wgmma: bool,
}

impl MlaKernel {
    /// The build for `dtype` on a device allowing `smem_optin` bytes of shared memory a
    /// block, compiled for sm_90a or not: wgmma with 64-key tiles on sm_90a when they fit,
    /// else mma.sync with the widest tile whose 2-stage ring fits (the static part is
    /// < 1 KiB).
    pub fn for_device(dtype: DType, smem_optin: u64, sm90a: bool) -> MlaKernel {
        let k64 = MlaKernel {
            bf16: dtype == DType::Bf16,
            block_n: 64,
            stages: 2,
            wgmma: sm90a,
        };
        if k64.shared_mem_bytes() as u64 + 1024 <= smem_optin {
            return k64;
        }
        let k64 = MlaKernel {
            wgmma: false,
            ..k64
        };
        if k64.shared_mem_bytes() as u64 + 1024 <= smem_optin {
            k64
        } else {
            MlaKernel { block_n: 32, ..k64 }
        }
    }
    /// Dynamic shared memory: 1152 · (64 + STAGES · BN) for Q and the K ring, plus the
    /// warp pairs' exchange of P (8 warps × BN/2 keys × 16 rows, bf16) and of row statistics
    /// (8 × 16 f32), plus 1024 for the wgmma build's alignment (the .cu's formula).
    pub fn shared_mem_bytes(&self) -> u32 {
        let warps = THREADS as usize / 32;
        (D_QK * 2 * (BLOCK_M + self.stages * self.block_n)
            + warps * self.block_n * 16
            + warps * 64
            + if self.wgmma { 1024 } else { 0 }) as u32
    }
    pub fn defines(&self) -> Vec<(String, String)> {
        [
            ("FM_DTYPE_BF16", self.bf16 as usize),
            ("FM_BN", self.block_n),
            ("FM_STAGES", self.stages),
            ("FM_WGMMA", self.wgmma as usize),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }
}

/// Every kernel build a device can select (for the NVRTC compile test).
pub fn all_mla_kernels() -> Vec<MlaKernel> {
    let mut v = Vec::new();
    for dt in [DType::Bf16, DType::F16] {
        for (optin, sm90a) in [(163 * 1024, false), (227 * 1024, false), (227 * 1024, true)] {
            let k = MlaKernel::for_device(dt, optin, sm90a);
            if !v.contains(&k) {
                v.push(k);
            }
        }
    }
    v
}

/// KV splits for `ctas` CTAs of work per split, `slots` CTAs resident per wave and `tiles`
/// 64-key tiles per sequence: none when the grid fills 80% of a wave; else the smallest count
/// within 95% of the best wave efficiency among counts the kernel runs without empty
/// trailing splits (s splits of ceil(tiles / s) tiles), at most one per
/// [`MIN_KEYS_PER_SPLIT`] keys and [`MAX_SPLITS`].
pub fn mla_split_heuristic(ctas: usize, slots: usize, tiles: usize) -> usize {
    let tiles = tiles.max(1);
    let max_splits = tiles.div_ceil(MIN_KEYS_PER_SPLIT / 64).clamp(1, MAX_SPLITS);
    if ctas == 0 || slots == 0 || ctas * 5 >= slots * 4 {
        return 1;
    }
    let runs = |s: usize| tiles.div_ceil(tiles.div_ceil(s)) == s;
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
