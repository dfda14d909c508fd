//! The Hopper path of the grouped GEMMs (`kernels/moe/forward/moe_gemm_sm90.cu`): TMA + mbarrier ring,
//! a producer warpgroup and two wgmma consumer warpgroups, for sm_90 devices and shapes
//! with enough rows per expert to be compute-relevant. Few rows per expert (decode-like
//! weight streaming) stay on the portable mma.sync kernels of [`super::tiles`],
//! which stream weights at ~92 % of the copy bandwidth already.
//!
//! The kernel reads its A operand through TMA, so the routed tokens are first gathered
//! into permuted order (`moe_gather_rows`, `x_perm`, T·k·hidden 16-bit elements of the
//! plan's workspace). [`crate::moe::forward::plan::MoePlan`] launches the path and encodes its tensor
//! maps per call ([`a_layout`] / [`b_layout`] describe them).
//! The shared-memory formula lives in ONE place, [`Sm90Tile::shared_mem_bytes`], and
//! mirrors `SMEM_BYTES` at the top of the .cu.
//!
//! The choice is automatic; [`MoePlan::with_gemm_path`](crate::moe::forward::plan::MoePlan::with_gemm_path)
//! takes an explicit override for A/B timing (the lab passes `FLASHMOE_MOE_GEMM`'s value):
//! `portable` forces the mma.sync kernels, `sm90` makes an unsupported shape an error
//! instead of a fallback, `sm90-bm64` / `sm90-bm128` also force the tile height.
#![allow(clippy::manual_is_multiple_of)]

use super::tiles::Gemm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::TiledLayout;
use crate::moe::kernel::{MoeKernel, BACKEND, PERMUTE_SOURCE};
use crate::problem::MoeProblem;
use cudarc::driver::LaunchConfig;

pub const SM90_SOURCE: &str = "moe_gemm_sm90.cu";
pub const SM90_GEMM13_ENTRY: &str = "moe_gemm13_sm90";
pub const SM90_GEMM2_ENTRY: &str = "moe_gemm2_sm90";
pub const GATHER_ENTRY: &str = "moe_gather_rows";
pub const WGRAD_SOURCE: &str = "moe_wgrad_sm90.cu";
pub const WGRAD_ENTRY: &str = "moe_wgrad_sm90";
/// The weight-gradient kernel's tile (BM × BN of dW).
pub const WGRAD_BLOCK_M: u32 = 128;
pub const WGRAD_BLOCK_N: u32 = 256;

/// The weight-gradient kernel's pipeline: ring depth and output buffers per consumer
/// warpgroup (`FM_STAGES`, `FM_OUT_BUFS` of `moe_wgrad_sm90.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WgradTile {
    pub stages: u32,
    /// 2: two tiles' dW stores in flight per warpgroup (fits beside a 2-slot ring only).
    pub out_bufs: u32,
}

/// The production weight-gradient pipeline, then the lab's other one: two output buffers
/// (docs/design/moe.md, "weight gradients' stores"; built, not yet timed).
pub const WGRAD_TILES: [WgradTile; 2] = [
    WgradTile {
        stages: 3,
        out_bufs: 1,
    },
    WgradTile {
        stages: 2,
        out_bufs: 2,
    },
];
/// The production one.
pub const WGRAD_TILE: WgradTile = WGRAD_TILES[0];
pub const GATHER_THREADS: u32 = 128;
/// Threads per block: one producer and two consumer warpgroups.
pub const SM90_THREADS: u32 = 384;
/// Mean rows per expert from which the wgmma path is used (below: weight streaming).
pub const SM90_MIN_ROWS_PER_EXPERT: f64 = 48.0;

/// One tile configuration of `moe_gemm_sm90.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sm90Tile {
    pub gemm: Gemm,
    /// Consumer warpgroups stacked along M (1 or 2); the other 2 / wg_m split N.
    pub wg_m: u32,
    pub stages: u32,
    /// Row tiles per raster group.
    pub group_m: u32,
    /// gemm2 only: B is `[E][N][K]` (K contiguous) instead of `[E][K][N]`: the backward's
    /// dOut·W2ᵀ and dGU·W13ᵀ read the weights as they lie (`FM_B_KMAJOR`).
    pub b_kmajor: bool,
}

impl Sm90Tile {
    fn nb(&self) -> u32 {
        match self.gemm {
            Gemm::G13 => 2,
            Gemm::G2 => 1,
        }
    }
    /// Columns per consumer warpgroup per matrix (128 fp32 accumulators per thread).
    fn cols_per_warpgroup(&self) -> u32 {
        match self.gemm {
            Gemm::G13 => 128,
            Gemm::G2 => 256,
        }
    }
    pub fn block_m(&self) -> u32 {
        64 * self.wg_m
    }
    /// Output columns per block (gemm13: per matrix).
    pub fn block_n(&self) -> u32 {
        self.cols_per_warpgroup() * (2 / self.wg_m)
    }
    /// STAGES·(BM·128 + NB·BN·128) + 1024 (alignment) + 16·STAGES (mbarriers) + 256.
    pub fn shared_mem_bytes(&self) -> u32 {
        let stage = self.block_m() * 128 + self.nb() * self.block_n() * 128;
        self.stages * stage + 1024 + 16 * self.stages + 256
    }
    pub fn entry(&self) -> &'static str {
        match self.gemm {
            Gemm::G13 => SM90_GEMM13_ENTRY,
            Gemm::G2 => SM90_GEMM2_ENTRY,
        }
    }
    pub fn kernel(&self, dtype: DType) -> MoeKernel {
        let kv = |k: &str, v: u32| (k.to_string(), v.to_string());
        MoeKernel {
            source_file: SM90_SOURCE,
            entry: self.entry(),
            defines: vec![
                kv(
                    "FM_GEMM",
                    match self.gemm {
                        Gemm::G13 => 13,
                        Gemm::G2 => 2,
                    },
                ),
                kv("FM_DTYPE_BF16", (dtype == DType::Bf16) as u32),
                kv("FM_WG_M", self.wg_m),
                kv("FM_STAGES", self.stages),
                kv("FM_GROUP_M", self.group_m),
                kv("FM_B_KMAJOR", self.b_kmajor as u32),
            ],
            block_m: self.block_m(),
            block_n: self.block_n(),
            block_threads: SM90_THREADS,
            shared_mem_bytes: self.shared_mem_bytes(),
            min_arch: 90,
        }
    }
}

/// Rows per tile of the sm_90 GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileHeight {
    /// 64 rows, twice the columns (3 stages). Only when forced (`sm90-bm64`): every expert
    /// with more than 64 rows streams its weights through L2 once per row tile.
    Bm64,
    /// 128 rows (4 stages): the automatic choice at every size the sm_90 path serves.
    /// Measured at seed003 2048 tokens (128 rows per expert, H100, ncu): the 64-row tile
    /// read 7.94 GB from DRAM for 5.77 GB of gate/up weights and ran the L2 at 100 %;
    /// the 128-row tile took the layer from 4.86 to 4.06 ms.
    Bm128,
}

/// The tile of a GEMM at a tile height.
pub fn sm90_tile(gemm: Gemm, height: TileHeight) -> Sm90Tile {
    let big = height == TileHeight::Bm128;
    Sm90Tile {
        gemm,
        wg_m: if big { 2 } else { 1 },
        stages: if big { 4 } else { 3 },
        group_m: 8,
        b_kmajor: false,
    }
}

/// The backward's row GEMMs (gu recompute: `b_kmajor` false; G and dX_perm: true): gemm2,
/// f32 out, 128-row tiles.
pub fn sm90_bwd_tile(b_kmajor: bool) -> Sm90Tile {
    Sm90Tile {
        b_kmajor,
        ..sm90_tile(Gemm::G2, TileHeight::Bm128)
    }
}

/// Every selectable variant (compile-everything test).
pub fn all_sm90_variants() -> Vec<MoeKernel> {
    let mut v = Vec::new();
    for g in [Gemm::G13, Gemm::G2] {
        for height in [TileHeight::Bm64, TileHeight::Bm128] {
            for dt in [DType::F16, DType::Bf16] {
                v.push(sm90_tile(g, height).kernel(dt));
            }
        }
    }
    for dt in [DType::F16, DType::Bf16] {
        v.push(sm90_bwd_tile(true).kernel(dt));
        for t in WGRAD_TILES {
            v.push(wgrad_kernel(dt, t));
        }
    }
    v
}

/// The backward's weight-gradient kernel (`moe_wgrad_sm90.cu`): dW\[e\] = A_eᵀ·B_e over
/// the expert's rows, persistent over E · ceil(M / 128) · ceil(N / 256) tiles, with the
/// pipeline `tile`. Shared memory: STAGES · (128 + 256) · 128 B (the ring) + OUT_BUFS ·
/// 128 · 256 · 2 B (the 16-bit tiles staged for the TMA stores) + 1024 (alignment) + 16 ·
/// STAGES (mbarriers), the .cu's SMEM_BYTES.
pub fn wgrad_kernel(dtype: DType, tile: WgradTile) -> MoeKernel {
    let kv = |k: &str, v: u32| (k.to_string(), v.to_string());
    MoeKernel {
        source_file: WGRAD_SOURCE,
        entry: WGRAD_ENTRY,
        defines: vec![
            kv("FM_DTYPE_BF16", (dtype == DType::Bf16) as u32),
            kv("FM_STAGES", tile.stages),
            kv("FM_OUT_BUFS", tile.out_bufs),
        ],
        block_m: WGRAD_BLOCK_M,
        block_n: WGRAD_BLOCK_N,
        block_threads: SM90_THREADS,
        shared_mem_bytes: tile.stages * (WGRAD_BLOCK_M + WGRAD_BLOCK_N) * 128
            + tile.out_bufs * WGRAD_BLOCK_M * WGRAD_BLOCK_N * 2
            + 1024
            + 16 * tile.stages,
        min_arch: 90,
    }
}

/// Tiles of a weight-gradient launch: E · ceil(m / BM) · ceil(n / BN).
pub fn wgrad_tiles(experts: usize, m: usize, n: usize) -> u64 {
    experts as u64
        * m.div_ceil(WGRAD_BLOCK_M as usize) as u64
        * n.div_ceil(WGRAD_BLOCK_N as usize) as u64
}

/// Tensor-map layout of a weight gradient's operand: `[rows][cols]` 16-bit row-major,
/// box {64 cols, 64 rows} (the rows are the reduction).
pub fn wgrad_operand_layout(rows: usize, cols: usize) -> TiledLayout {
    TiledLayout {
        dims: vec![cols as u64, rows as u64],
        strides: vec![cols as u64],
        box_dims: vec![64, 64],
    }
}

/// Which grouped-GEMM path a problem takes on a device of compute capability `arch`.
#[derive(Debug, Clone, PartialEq)]
pub enum GemmPath {
    /// mma.sync kernels (any sm_80+ device); the reason the sm_90 path was not taken.
    Portable(String),
    /// (gemm13, gemm2) sm_90a kernels.
    Sm90(MoeKernel, MoeKernel),
}

/// The path for `p` on compute capability `arch`, or the one `override_` forces (see the
/// module's notes; None, "" and "auto" choose automatically).
pub fn select_path(p: &MoeProblem, arch: u32, override_: Option<&str>) -> Result<GemmPath> {
    // sm90-bm64 / sm90-bm128 also force the tile height (for A/B timing of the tiles).
    let (forced, height) = match override_ {
        None | Some("") | Some("auto") => (false, TileHeight::Bm128),
        Some("portable") => {
            return Ok(GemmPath::Portable(
                "the gemm path override is portable".into(),
            ))
        }
        Some("sm90") | Some("sm90-bm128") => (true, TileHeight::Bm128),
        Some("sm90-bm64") => (true, TileHeight::Bm64),
        Some(other) => {
            return Err(Error::unsupported(
                BACKEND,
                format!(
                    "gemm path override '{other}': choose auto, portable, sm90, sm90-bm64 or sm90-bm128"
                ),
            ))
        }
    };
    let rows_per_expert = (p.tokens * p.top_k) as f64 / p.experts.max(1) as f64;
    let t13 = sm90_tile(Gemm::G13, height);
    let t2 = sm90_tile(Gemm::G2, height);
    let why_not = if arch != 90 {
        Some(format!(
            "compute capability {}.{} is not 9.0",
            arch / 10,
            arch % 10
        ))
    } else if p.dtype == DType::F32 {
        Some("f32 is not a 16-bit type".to_string())
    } else if !forced && rows_per_expert < SM90_MIN_ROWS_PER_EXPERT {
        Some(format!(
            "{rows_per_expert:.1} rows per expert: weight streaming, the portable kernels' regime"
        ))
    } else if p.hidden % 8 != 0 || p.intermediate % 8 != 0 {
        Some("hidden and intermediate must be multiples of 8 (16-byte TMA strides)".into())
    } else if p.intermediate % t13.block_n() as usize != 0 {
        Some(format!(
            "intermediate ({}) is not a multiple of the tile width {}",
            p.intermediate,
            t13.block_n()
        ))
    } else if p.hidden % t2.block_n() as usize != 0 {
        Some(format!(
            "hidden ({}) is not a multiple of the tile width {}",
            p.hidden,
            t2.block_n()
        ))
    } else {
        None
    };
    match why_not {
        None => Ok(GemmPath::Sm90(t13.kernel(p.dtype), t2.kernel(p.dtype))),
        Some(why) if forced => Err(Error::unsupported(
            SM90_SOURCE,
            format!("the gemm path override forces sm90 but {why}"),
        )),
        Some(why) => Ok(GemmPath::Portable(why)),
    }
}

/// `moe_gather_rows` (x_perm\[r\] = x[row_token\[r\]]): grid T·k, 128 threads.
pub fn gather_kernel() -> MoeKernel {
    MoeKernel {
        source_file: PERMUTE_SOURCE,
        entry: GATHER_ENTRY,
        defines: vec![],
        block_m: 1,
        block_n: 1,
        block_threads: GATHER_THREADS,
        shared_mem_bytes: 0,
        min_arch: 80,
    }
}

/// Row tiles of a launch: ceil(rows / BM) + E, an upper bound on Σ_e ceil(n_e / BM).
pub fn row_tiles(rows: usize, experts: usize, block_m: u32) -> u64 {
    (rows as u64).div_ceil(block_m as u64) + experts as u64
}

/// Launch geometry of an sm_90 GEMM: 1-D grid of row_tiles · ceil(n / BN) blocks (the
/// kernel stores no column past `n`; the forward's selection keeps `n` a multiple of BN).
pub fn sm90_launch_config(
    k: &MoeKernel,
    rows: usize,
    experts: usize,
    n: usize,
) -> Result<LaunchConfig> {
    if k.block_n == 0 || n == 0 || n % 8 != 0 {
        return Err(Error::unsupported(
            k.entry,
            format!("{n} output columns: the kernels store pairs of a row of a multiple of 8"),
        ));
    }
    let blocks = row_tiles(rows, experts, k.block_m) * n.div_ceil(k.block_n as usize) as u64;
    if blocks > i32::MAX as u64 {
        return Err(Error::unsupported(
            k.entry,
            format!("{blocks} blocks exceed the CUDA grid limit"),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (k.block_threads, 1, 1),
        shared_mem_bytes: k.shared_mem_bytes,
    })
}

/// Tensor-map layouts: A = \[rows\]\[k\] 16-bit row-major, box {64, BM}; B = \[E\]\[k\]\[n_total\],
/// box {64, 64, 1}.
pub fn a_layout(rows: usize, k: usize, block_m: u32) -> TiledLayout {
    TiledLayout {
        dims: vec![k as u64, rows as u64],
        strides: vec![k as u64],
        box_dims: vec![64, block_m],
    }
}
pub fn b_layout(experts: usize, k: usize, n_total: usize) -> TiledLayout {
    TiledLayout {
        dims: vec![n_total as u64, k as u64, experts as u64],
        strides: vec![n_total as u64, (k * n_total) as u64],
        box_dims: vec![64, 64, 1],
    }
}
/// B = \[E\]\[n\]\[k\] (K contiguous, [`Sm90Tile::b_kmajor`]), box {64 k, 64 n, 1}.
pub fn b_kmajor_layout(experts: usize, n: usize, k: usize) -> TiledLayout {
    TiledLayout {
        dims: vec![k as u64, n as u64, experts as u64],
        strides: vec![k as u64, (n * k) as u64],
        box_dims: vec![64, 64, 1],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::gemm::tiles::tests::prob;

    #[test]
    fn shared_memory_formula_and_limits() {
        let t = sm90_tile(Gemm::G13, TileHeight::Bm128);
        assert_eq!((t.block_m(), t.block_n(), t.stages), (128, 128, 4));
        // 4 x (A 128 rows x 128 B + 2 matrices x 128 cols x 64 k x 2 B) + 1024 + 64 + 256
        assert_eq!(
            t.shared_mem_bytes(),
            4 * (16384 + 2 * 16384) + 1024 + 64 + 256
        );
        let t = sm90_tile(Gemm::G2, TileHeight::Bm64);
        assert_eq!((t.block_m(), t.block_n(), t.stages), (64, 512, 3));
        // 3 x (A 2 boxes + B 4 boxes of 64 x 128 B) + the 128 x 256 tile + 1024 + 48
        assert_eq!(
            wgrad_kernel(DType::Bf16, WGRAD_TILE).shared_mem_bytes,
            3 * 6 * 8192 + 65536 + 1024 + 48
        );
        // Two output buffers per warpgroup beside a 2-slot ring: 227 KB less 1.9 KB.
        let two = WgradTile {
            stages: 2,
            out_bufs: 2,
        };
        assert!(WGRAD_TILES.contains(&two));
        assert_eq!(
            wgrad_kernel(DType::Bf16, two).shared_mem_bytes,
            2 * 6 * 8192 + 2 * 65536 + 1024 + 32
        );
        assert_eq!(wgrad_tiles(32, 4096, 22016), 32 * 32 * 86);
        wgrad_operand_layout(65536, 22016).check("dGU").unwrap();
        for k in all_sm90_variants() {
            assert!(k.shared_mem_bytes <= 227 * 1024, "{k:?}");
            assert_eq!(k.min_arch, 90);
        }
    }

    #[test]
    fn path_selection() {
        let seed = |t| prob(t, 4096, 11008, 32, 2);
        assert!(matches!(
            select_path(&seed(16), 90, None).unwrap(),
            GemmPath::Portable(_)
        ));
        for t in [2048, 32768] {
            match select_path(&seed(t), 90, None).unwrap() {
                GemmPath::Sm90(a, b) => {
                    assert_eq!((a.block_m, a.block_n), (128, 128));
                    assert_eq!((b.block_m, b.block_n), (128, 256));
                }
                other => panic!("{other:?}"),
            }
        }
        // the model presets at 2048 tokens take the sm_90 path
        for p in [
            prob(2048, 4096, 14336, 8, 2),
            prob(2048, 2048, 768, 128, 8),
            prob(2048, 7168, 2048, 256, 8),
        ] {
            assert!(
                matches!(select_path(&p, 90, None).unwrap(), GemmPath::Sm90(..)),
                "{p:?}"
            );
        }
        // other archs, odd widths, overrides
        let why = |p: &MoeProblem, arch, o| match select_path(p, arch, o).unwrap() {
            GemmPath::Portable(w) => w,
            other => panic!("{other:?}"),
        };
        assert!(why(&seed(2048), 80, None).contains("8.0"));
        assert!(why(&prob(2048, 4096, 11000, 32, 2), 90, None).contains("intermediate (11000)"));
        assert!(why(&seed(2048), 90, Some("portable")).contains("portable"));
        let e = select_path(&seed(16), 80, Some("sm90"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("sm90") && e.contains("8.0"), "{e}");
        let e = select_path(&seed(16), 90, Some("fast"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("auto, portable, sm90"), "{e}");
        // forced tile heights
        for (o, bm) in [("sm90-bm64", 64), ("sm90-bm128", 128), ("sm90", 128)] {
            match select_path(&seed(2048), 90, Some(o)).unwrap() {
                GemmPath::Sm90(a, b) => assert_eq!((a.block_m, b.block_m), (bm, bm), "{o}"),
                other => panic!("{other:?}"),
            }
        }
        // forcing takes small shapes to the sm_90 kernels too (used by the GPU tests)
        assert!(matches!(
            select_path(&prob(7, 512, 256, 4, 2), 90, Some("sm90")).unwrap(),
            GemmPath::Sm90(..)
        ));
    }

    #[test]
    fn launch_geometry() {
        let k = sm90_tile(Gemm::G13, TileHeight::Bm128).kernel(DType::Bf16);
        let c = sm90_launch_config(&k, 65536, 32, 11008).unwrap();
        assert_eq!(
            c.grid_dim,
            (((65536 / 128 + 32) * (11008 / 128)) as u32, 1, 1)
        );
        assert_eq!(c.block_dim, (384, 1, 1));
        // a partial last column tile: ceil(n / BN) tiles
        let c = sm90_launch_config(&k, 100, 4, 136).unwrap();
        assert_eq!(c.grid_dim.0, (1 + 4) * 2);
        let e = sm90_launch_config(&k, 100, 4, 100).unwrap_err().to_string();
        assert!(e.contains("multiple of 8"), "{e}");
    }

    #[test]
    fn layouts_satisfy_the_tma_rules() {
        a_layout(4096, 4096, 128).check("x_perm").unwrap();
        b_layout(256, 7168, 4096).check("w13").unwrap();
        b_kmajor_layout(32, 11008, 4096).check("w2").unwrap();
        assert_eq!(b_kmajor_layout(3, 64, 256).span(), 3 * 64 * 256);
        assert_eq!(b_layout(3, 64, 256).span(), 3 * 64 * 256);
    }
}
