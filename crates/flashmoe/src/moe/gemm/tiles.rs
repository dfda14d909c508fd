//! Tile selection for the grouped GEMMs of the MoE layer (`kernels/moe/forward/moe_grouped_gemm.cu`,
//! steps 5 and 6 of the contract in [`crate::moe::forward::abi`]).
//!
//! The shape of the work is the number of permuted rows per expert, about T·k / E. Few rows
//! (decode-like) make the GEMMs pure weight streaming: a small `block_m` covers all of an
//! expert's rows, so every weight tile is read from memory once, and narrow column tiles
//! give enough blocks for every SM to stream (deep cp.async rings keep 16-byte loads in
//! flight). Many rows make them compute-bound: `block_m` = 128 with 8 warps.
//!
//! The shared-memory formula lives in ONE place, [`GemmTile::shared_mem_bytes`], and
//! mirrors the comment at the top of the .cu (`SMEM_BYTES` there). tools/kernels/
//! moe_nvrtc_check.py keeps a copy of [`regime_tile`] (`MOE_TILES`), checked by a test here.
//!
//! `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::moe::kernel::MoeKernel;
use crate::problem::MoeProblem;

pub const GEMM_SOURCE: &str = "moe_grouped_gemm.cu";
pub const GEMM13_ENTRY: &str = "moe_gemm13";
pub const GEMM2_ENTRY: &str = "moe_gemm2";
/// k depth of one pipeline stage (fixed in the .cu).
pub const BK: u32 = 64;

/// Which of the two grouped GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gemm {
    /// gate+up with the SwiGLU epilogue: K = hidden, N = intermediate (two B tiles).
    G13,
    /// down projection: K = intermediate, N = hidden.
    G2,
}

impl Gemm {
    fn define(self) -> u32 {
        match self {
            Gemm::G13 => 13,
            Gemm::G2 => 2,
        }
    }
    fn entry(self) -> &'static str {
        match self {
            Gemm::G13 => GEMM13_ENTRY,
            Gemm::G2 => GEMM2_ENTRY,
        }
    }
    /// B matrices (accumulator tiles) per block.
    fn nb(self) -> u32 {
        match self {
            Gemm::G13 => 2,
            Gemm::G2 => 1,
        }
    }
}

/// One tile configuration of the grouped GEMM kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmTile {
    pub gemm: Gemm,
    pub block_m: u32,
    /// Output columns per block (gemm13: per matrix, gate and up each).
    pub block_n: u32,
    pub warps_m: u32,
    pub warps_n: u32,
    pub stages: u32,
    pub min_blocks: u32,
}

impl GemmTile {
    pub const fn threads(&self) -> u32 {
        self.warps_m * self.warps_n * 32
    }

    /// Dynamic shared memory, the formula of the .cu:
    /// STAGES·(BM·128 + NB·64·max(BN,64)·2) + BM·8 + 256.
    pub fn shared_mem_bytes(&self) -> u32 {
        let a = self.block_m * BK * 2;
        let b = BK * self.block_n.max(64) * 2;
        self.stages * (a + self.gemm.nb() * b) + self.block_m * 8 + 256
    }

    /// The structural rules the .cu `static_assert`s.
    pub fn check(&self) -> std::result::Result<(), String> {
        let wtm = self.block_m / self.warps_m.max(1);
        let wtn = self.block_n / self.warps_n.max(1);
        if self.warps_m == 0 || wtm * self.warps_m != self.block_m || wtm % 16 != 0 {
            return Err(format!(
                "BM {} / WARPS_M {} must be a multiple of 16",
                self.block_m, self.warps_m
            ));
        }
        if self.warps_n == 0 || wtn * self.warps_n != self.block_n || wtn % 16 != 0 {
            return Err(format!(
                "BN {} / WARPS_N {} must be a multiple of 16",
                self.block_n, self.warps_n
            ));
        }
        if !(self.block_n == 32 || self.block_n % 64 == 0) {
            return Err(format!(
                "BN {} must be 32 or a multiple of 64",
                self.block_n
            ));
        }
        if !(2..=8).contains(&self.stages) {
            return Err(format!("STAGES {} must be 2..8", self.stages));
        }
        if self.warps_m * self.warps_n > 32 {
            return Err("at most 32 warps".into());
        }
        // 228 KiB of shared memory per SM, 1 KiB reserved per block.
        if self.min_blocks * (self.shared_mem_bytes() + 1024) > 228 * 1024 {
            return Err(format!(
                "{} blocks x {} B of shared memory do not fit an SM",
                self.min_blocks,
                self.shared_mem_bytes()
            ));
        }
        Ok(())
    }

    pub fn defines(&self, dtype: DType) -> Vec<(String, String)> {
        let kv = |k: &str, v: u32| (k.to_string(), v.to_string());
        vec![
            kv("FM_GEMM", self.gemm.define()),
            kv("FM_DTYPE_BF16", (dtype == DType::Bf16) as u32),
            kv("FM_BM", self.block_m),
            kv("FM_BN", self.block_n),
            kv("FM_WARPS_M", self.warps_m),
            kv("FM_WARPS_N", self.warps_n),
            kv("FM_STAGES", self.stages),
            kv("FM_MIN_BLOCKS", self.min_blocks),
        ]
    }

    pub fn kernel(&self, dtype: DType) -> MoeKernel {
        MoeKernel {
            source_file: GEMM_SOURCE,
            entry: self.gemm.entry(),
            defines: self.defines(dtype),
            block_m: self.block_m,
            block_n: self.block_n,
            block_threads: self.threads(),
            shared_mem_bytes: self.shared_mem_bytes(),
            // every tile fits sm_80's 163 KiB per block (checked by a test)
            min_arch: 80,
        }
    }

    /// The same tile with a narrower column tile (for N not a multiple of block_n):
    /// the warp grid loses columns of warps first.
    fn with_block_n(&self, bn: u32) -> GemmTile {
        let mut t = *self;
        t.block_n = bn;
        t.warps_n = self.warps_n.min(bn / 16).max(1);
        t
    }
}

/// Shape regimes, chosen by the mean rows per expert m̄ = T·k / E.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Regime {
    /// m̄ ≤ 12: decode-like, weight streaming (BM 16).
    Decode,
    /// m̄ ≤ 40 (BM 32).
    Small,
    /// m̄ ≤ 96 (BM 64).
    Medium,
    /// compute-bound (BM 128, 8 warps).
    Large,
}

pub const ALL_REGIMES: [Regime; 4] = [Regime::Decode, Regime::Small, Regime::Medium, Regime::Large];

impl Regime {
    pub fn for_problem(p: &MoeProblem) -> Regime {
        let rows = (p.tokens * p.top_k) as f64 / p.experts.max(1) as f64;
        if rows <= 12.0 {
            Regime::Decode
        } else if rows <= 40.0 {
            Regime::Small
        } else if rows <= 96.0 {
            Regime::Medium
        } else {
            Regime::Large
        }
    }
}

/// The preferred tile of each (regime, GEMM), at the widest block_n. Mirrored by
/// `MOE_TILES` in tools/kernels/moe_nvrtc_check.py.
pub fn regime_tile(r: Regime, g: Gemm) -> GemmTile {
    let t = |block_m, block_n, warps_m, warps_n, stages, min_blocks| GemmTile {
        gemm: g,
        block_m,
        block_n,
        warps_m,
        warps_n,
        stages,
        min_blocks,
    };
    //                          BM   BN  WM WN ST MIN
    match (r, g) {
        (Regime::Decode, Gemm::G13) => t(16, 64, 1, 4, 6, 2),
        (Regime::Decode, Gemm::G2) => t(16, 64, 1, 4, 6, 3),
        (Regime::Small, Gemm::G13) => t(32, 64, 2, 2, 5, 2),
        (Regime::Small, Gemm::G2) => t(32, 64, 1, 4, 6, 3),
        (Regime::Medium, Gemm::G13) => t(64, 64, 2, 2, 4, 2),
        (Regime::Medium, Gemm::G2) => t(64, 128, 2, 2, 4, 2),
        (Regime::Large, Gemm::G13) => t(128, 64, 2, 4, 3, 2),
        (Regime::Large, Gemm::G2) => t(128, 128, 2, 4, 3, 2),
    }
}

/// The tile used for a GEMM whose output has `n` columns: the regime's tile with the
/// widest block_n in {preferred, 64, 32} that divides n.
pub fn tile_for(r: Regime, g: Gemm, n: usize) -> Option<GemmTile> {
    let base = regime_tile(r, g);
    [base.block_n, 64, 32]
        .into_iter()
        .filter(|&bn| bn <= base.block_n)
        .find(|&bn| n % bn as usize == 0)
        .map(|bn| base.with_block_n(bn))
}

/// Blocks below which a router-logits tile gives way to a shorter one (about one per SM
/// of an H100).
pub const ROUTER_MIN_BLOCKS: u64 = 128;

/// The tile of `moe_gemm2` that computes the router logits [T, E] f32 = x [T, H] ·
/// router [H, E] as a one-group GEMM on tensor cores (contract step 1), or None when E is
/// not a multiple of 32 (the narrowest column tile): then the CUDA-core logits kernels
/// run. The tallest tile that still launches [`ROUTER_MIN_BLOCKS`] blocks; below that,
/// 16-row tiles 32 columns wide, so that few tokens still spread the router weights over
/// several blocks.
pub fn router_logits_tile(tokens: usize, experts: usize) -> Option<GemmTile> {
    if experts == 0 || experts % 32 != 0 {
        return None;
    }
    let blocks = |t: &GemmTile| {
        (tokens as u64).div_ceil(t.block_m as u64) * (experts as u64 / t.block_n as u64)
    };
    [Regime::Large, Regime::Medium, Regime::Small, Regime::Decode]
        .into_iter()
        .filter_map(|r| tile_for(r, Gemm::G2, experts))
        .find(|t| blocks(t) >= ROUTER_MIN_BLOCKS)
        .or_else(|| Some(regime_tile(Regime::Decode, Gemm::G2).with_block_n(32)))
}

/// (gemm13, gemm2) for the problem, or `Error::Unsupported` naming the constraint.
pub fn gemm_kernels(p: &MoeProblem) -> Result<(MoeKernel, MoeKernel)> {
    p.validate()?;
    let unsupported = |why: String| Error::unsupported("flashmoe-moe-gemm", why);
    if p.dtype == DType::F32 {
        return Err(unsupported(
            "the grouped GEMMs store x, weights and h in fp16 or bf16, not f32".into(),
        ));
    }
    for (name, v) in [("hidden", p.hidden), ("intermediate", p.intermediate)] {
        if v % 32 != 0 {
            return Err(unsupported(format!(
                "{name} ({v}) must be a multiple of 32 (the grouped GEMM's narrowest column tile)"
            )));
        }
    }
    let rows = p.tokens as u64 * p.top_k as u64;
    if rows + p.experts as u64 >= u32::MAX as u64 {
        return Err(unsupported(format!(
            "tokens·top_k ({rows}) must fit 32-bit row indices"
        )));
    }
    let r = Regime::for_problem(p);
    let t13 = tile_for(r, Gemm::G13, p.intermediate).expect("multiple of 32");
    let t2 = tile_for(r, Gemm::G2, p.hidden).expect("multiple of 32");
    Ok((t13.kernel(p.dtype), t2.kernel(p.dtype)))
}

/// Launch grid of a grouped GEMM kernel (contract step 5/6): (ceil(T·k / BM) + E, N / BN).
pub fn gemm_grid(p: &MoeProblem, k: &MoeKernel) -> (u32, u32) {
    let rows = (p.tokens * p.top_k) as u32;
    let n = if k.entry == GEMM13_ENTRY {
        p.intermediate
    } else {
        p.hidden
    } as u32;
    (rows.div_ceil(k.block_m) + p.experts as u32, n / k.block_n)
}

/// Every tile that `gemm_kernels` can select (all regimes, GEMMs, block_n fallbacks).
pub fn all_gemm_tiles() -> Vec<GemmTile> {
    let mut v = Vec::new();
    for r in ALL_REGIMES {
        for g in [Gemm::G13, Gemm::G2] {
            let base = regime_tile(r, g);
            for bn in [base.block_n, 64, 32] {
                if bn <= base.block_n {
                    let t = base.with_block_n(bn);
                    if !v.contains(&t) {
                        v.push(t);
                    }
                }
            }
        }
    }
    v
}

/// Every grouped-GEMM variant that can be selected, fp16 and bf16 (compile-everything test).
pub fn all_gemm_variants() -> Vec<MoeKernel> {
    let mut v = Vec::new();
    for t in all_gemm_tiles() {
        for dt in [DType::F16, DType::Bf16] {
            v.push(t.kernel(dt));
        }
    }
    v
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::problem::Scoring;

    /// A bf16 softmax problem (tokens, hidden, intermediate, experts, top_k).
    pub(crate) fn prob(t: usize, h: usize, i: usize, e: usize, k: usize) -> MoeProblem {
        MoeProblem {
            tokens: t,
            hidden: h,
            intermediate: i,
            experts: e,
            top_k: k,
            scoring: Scoring::Softmax,
            renormalize: false,
            dtype: DType::Bf16,
            shared_expert: false,
        }
    }

    #[test]
    fn every_tile_is_valid_and_fits_sm80() {
        let tiles = all_gemm_tiles();
        assert!(tiles.len() >= 8);
        for t in tiles {
            t.check().unwrap_or_else(|e| panic!("{t:?}: {e}"));
            assert!(t.shared_mem_bytes() <= 163 * 1024, "{t:?}");
            // 64K registers per SM: min_blocks·threads·regs must allow >= 64 regs/thread
            assert!(t.min_blocks * t.threads() * 64 <= 65_536, "{t:?}");
        }
    }

    #[test]
    fn shared_memory_formula() {
        let t = regime_tile(Regime::Large, Gemm::G13);
        // 3 stages x (A 128x64 + 2 x B 64x64) x 2 B + rowoff 128x8 + 256
        assert_eq!(t.shared_mem_bytes(), 3 * (16384 + 2 * 8192) + 1024 + 256);
        let t = regime_tile(Regime::Large, Gemm::G2);
        assert_eq!(t.shared_mem_bytes(), 3 * (16384 + 16384) + 1024 + 256);
        // BN 32 rows are padded to 64 elements
        let t = tile_for(Regime::Decode, Gemm::G13, 96).unwrap();
        assert_eq!(t.block_n, 32);
        assert_eq!(t.shared_mem_bytes(), 6 * (2048 + 2 * 8192) + 128 + 256);
    }

    #[test]
    fn regimes_by_rows_per_expert() {
        assert_eq!(
            Regime::for_problem(&prob(16, 4096, 11008, 32, 2)),
            Regime::Decode
        );
        assert_eq!(
            Regime::for_problem(&prob(128, 4096, 11008, 32, 2)),
            Regime::Decode
        );
        assert_eq!(
            Regime::for_problem(&prob(512, 4096, 11008, 32, 2)),
            Regime::Small
        );
        assert_eq!(
            Regime::for_problem(&prob(1024, 4096, 11008, 32, 2)),
            Regime::Medium
        );
        assert_eq!(
            Regime::for_problem(&prob(2048, 4096, 11008, 32, 2)),
            Regime::Large
        );
        assert_eq!(
            Regime::for_problem(&prob(32768, 4096, 11008, 32, 2)),
            Regime::Large
        );
    }

    #[test]
    fn presets_and_check_shape_are_supported() {
        for p in [
            prob(16, 4096, 11008, 32, 2),
            prob(2048, 4096, 11008, 32, 2),
            prob(32768, 4096, 11008, 32, 2),
            prob(1024, 4096, 14336, 8, 2),
            prob(8192, 2048, 768, 128, 8),
            prob(8192, 7168, 2048, 256, 8),
            prob(7, 128, 96, 4, 2),
            prob(1, 128, 96, 4, 1),
        ] {
            let (k13, k2) = gemm_kernels(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
            assert_eq!(k13.entry, GEMM13_ENTRY);
            assert_eq!(k2.entry, GEMM2_ENTRY);
            assert_eq!(p.intermediate % k13.block_n as usize, 0);
            assert_eq!(p.hidden % k2.block_n as usize, 0);
            assert!(all_gemm_variants().contains(&k13) && all_gemm_variants().contains(&k2));
            let (gx, gy) = gemm_grid(&p, &k13);
            assert!(gx as usize >= p.experts && gy >= 1);
        }
        let (k13, _) = gemm_kernels(&prob(7, 128, 96, 4, 2)).unwrap();
        assert_eq!(k13.block_n, 32);
    }

    #[test]
    fn bad_shapes_are_unsupported_with_the_constraint_named() {
        let e = gemm_kernels(&prob(16, 4096, 100, 32, 2))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("intermediate (100) must be a multiple of 32"),
            "{e}"
        );
        let e = gemm_kernels(&prob(16, 4100, 128, 32, 2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden (4100)"), "{e}");
        let mut p = prob(16, 128, 96, 4, 2);
        p.dtype = DType::F32;
        assert!(gemm_kernels(&p).unwrap_err().to_string().contains("f32"));
    }

    #[test]
    fn defines_name_the_tile() {
        let k = regime_tile(Regime::Large, Gemm::G2).kernel(DType::F16);
        let d: std::collections::HashMap<_, _> = k.defines.iter().cloned().collect();
        assert_eq!(d["FM_GEMM"], "2");
        assert_eq!(d["FM_DTYPE_BF16"], "0");
        assert_eq!(d["FM_BM"], "128");
        assert_eq!(d["FM_BN"], "128");
        assert_eq!(k.block_threads, 256);
    }

    #[test]
    fn python_tile_table_matches() {
        // tools/kernels/moe_nvrtc_check.py: `("regime", gemm): (BM, BN, WM, WN, ST, MIN),`
        let py = include_str!("../../../../../tools/kernels/moe_nvrtc_check.py");
        let start = py
            .find("MOE_TILES = {")
            .expect("MOE_TILES in moe_nvrtc_check.py");
        let table = &py[start..start + py[start..].find('}').unwrap()];
        let mut seen = 0;
        for r in ALL_REGIMES {
            for g in [Gemm::G13, Gemm::G2] {
                let t = regime_tile(r, g);
                let key = format!("(\"{}\", {}):", format!("{r:?}").to_lowercase(), g.define());
                let line = table
                    .lines()
                    .find(|l| l.contains(&key))
                    .unwrap_or_else(|| panic!("{key} missing in MOE_TILES"));
                let want = format!(
                    "({}, {}, {}, {}, {}, {})",
                    t.block_m, t.block_n, t.warps_m, t.warps_n, t.stages, t.min_blocks
                );
                assert!(line.contains(&want), "{line} != {want}");
                seen += 1;
            }
        }
        assert_eq!(seen, 8);
    }
}
