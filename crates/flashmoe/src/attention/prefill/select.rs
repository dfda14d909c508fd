//! Kernel selection of the prefill family: which variant ([`super::abi`]) and tile
//! ([`super::tiles`]) serve a problem on a device, the checks that refuse one, the launch
//! grid of the sm_90a kernel, and every variant (the compile-everything tests).

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::abi::*;
use super::tiles::*;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::AttentionProblem;

/// The v1 variant of a tile for a dtype and masking (no problem-size checks).
pub fn v1_variant_for(tile: &TileConfig, dtype: DType, causal: bool) -> Result<KernelVariant> {
    if dtype == DType::F32 {
        return Err(Error::unsupported(
            "flash-v1",
            "dtype f32 is not supported (the v1 kernel takes f16 or bf16 inputs)",
        ));
    }
    tile.check()
        .map_err(|e| Error::unsupported("flash-v1", format!("invalid tile {tile:?}: {e}")))?;
    let smem = tile.shared_mem_bytes();
    Ok(KernelVariant {
        source_file: FLASH_SOURCE,
        entry: FLASH_ENTRY,
        defines: tile.defines(dtype, causal),
        block_m: tile.block_m,
        block_threads: tile.threads(),
        shared_mem_bytes: smem,
        min_arch: if smem <= MAX_SMEM_SM80 { 80 } else { 90 },
        abi: KernelAbi::Pointers,
    })
}

/// The v1 variant of a tile with the masks only the ALiBi route uses on it: sliding
/// windows, softcap and ALiBi (`FM_WINDOW`, `FM_SOFTCAP`, `FM_ALIBI`; parameters appended
/// in that order, see the kernel's ABI note). No problem-size checks.
pub fn v1_masked_variant_for(
    tile: &TileConfig,
    dtype: DType,
    m: Masking,
    alibi: bool,
) -> Result<KernelVariant> {
    if m.window && !m.causal {
        return Err(Error::unsupported(
            "flash-v1",
            "a window variant needs the causal define (the window's right side)",
        ));
    }
    // ALiBi's bias and the softcap's tanh cost a few registers per score: the tile of head
    // dims 97..=128 (255 registers at two CTAs per SM) spills with 32 keys per compute step,
    // so those variants step 16.
    let mut tile = *tile;
    if (alibi || m.softcap) && tile.head_dim > 96 && tile.head_dim <= 128 {
        tile.sub_n = tile.sub_n.min(16);
    }
    let mut v = v1_variant_for(&tile, dtype, m.causal)?;
    v.defines = tile.defines_masked(dtype, m, alibi);
    Ok(v)
}

/// The v1 variant for an ALiBi problem ([`select_v1`]'s checks, then any masking: causal,
/// sliding window, softcap). ALiBi runs on the portable kernel on every GPU, Hopper
/// included: the sm_90a kernel has no ALiBi yet.
pub fn select_v1_alibi(problem: &AttentionProblem) -> Result<KernelVariant> {
    let tile = admit(
        "flash-v1",
        "the v1 kernel",
        problem,
        v1_tile(problem.head_dim),
        V1_HEAD_DIMS_TEXT,
    )?;
    v1_masked_variant_for(&tile, problem.dtype, Masking::of(problem), true)
}

/// The masked v1 variants the compile test builds: every table head dim (and 120, the
/// 128 tile's other residue) with causal ALiBi and with every mask at once (window,
/// softcap, ALiBi) in both dtypes, and every ALiBi masking at head dim 128.
pub fn v1_masked_compile_variants() -> Vec<KernelVariant> {
    let mut out = Vec::new();
    let full = Masking {
        causal: true,
        window: true,
        softcap: true,
    };
    for d in V1_HEAD_DIMS.iter().copied().chain([120]) {
        let tile = v1_tile(d).expect("v1 serves the dim");
        for dtype in [DType::F16, DType::Bf16] {
            for m in [Masking::causal(true), full] {
                out.push(v1_masked_variant_for(&tile, dtype, m, true).expect("valid tile"));
            }
        }
    }
    let tile = v1_tile(128).expect("table covers 128");
    for m in Masking::all() {
        if m != full && m != Masking::causal(true) {
            out.push(v1_masked_variant_for(&tile, DType::Bf16, m, true).expect("valid tile"));
        }
    }
    // Without ALiBi ([`select_v1`]'s windows and softcap): every table head dim and 120 with
    // every mask at once and with the softcap alone, both dtypes; every masking at 128.
    let softcap_only = Masking {
        causal: false,
        window: false,
        softcap: true,
    };
    for d in V1_HEAD_DIMS.iter().copied().chain([120]) {
        let tile = v1_tile(d).expect("v1 serves the dim");
        for dtype in [DType::F16, DType::Bf16] {
            for m in [full, softcap_only] {
                out.push(v1_masked_variant_for(&tile, dtype, m, false).expect("valid tile"));
            }
        }
    }
    for m in Masking::all() {
        if (m.window || m.softcap) && m != full && m != softcap_only {
            out.push(v1_masked_variant_for(&tile, DType::Bf16, m, false).expect("valid tile"));
        }
    }
    out
}

/// Head dims outside the tile table that the compile test builds (every v1 tile class, both
/// residues of 16, the extremes).
pub const V1_EXTRA_COMPILE_HEAD_DIMS: [usize; 10] = [8, 40, 56, 80, 104, 120, 136, 160, 192, 248];

/// The v1 variants of [`V1_EXTRA_COMPILE_HEAD_DIMS`]: causal and not, both dtypes.
pub fn v1_extra_head_dim_variants() -> Vec<KernelVariant> {
    let mut out = Vec::new();
    for &d in V1_EXTRA_COMPILE_HEAD_DIMS.iter() {
        let tile = v1_tile(d).expect("v1 serves every multiple of 8");
        for dtype in [DType::F16, DType::Bf16] {
            for causal in [false, true] {
                out.push(v1_variant_for(&tile, dtype, causal).expect("valid tile"));
            }
        }
    }
    out
}

/// Launch limits shared by both kernels: grid.y/z and int sequence lengths.
fn check_launch_limits(backend: &str, p: &AttentionProblem) -> Result<()> {
    if p.heads_q > MAX_GRID_YZ {
        return Err(Error::unsupported(
            backend,
            format!("heads_q {} exceeds the grid limit {MAX_GRID_YZ}", p.heads_q),
        ));
    }
    if p.batch > MAX_GRID_YZ {
        return Err(Error::unsupported(
            backend,
            format!("batch {} exceeds the grid limit {MAX_GRID_YZ}", p.batch),
        ));
    }
    for (name, v) in [("seqlen_q", p.seqlen_q), ("seqlen_k", p.seqlen_k)] {
        if v > MAX_SEQLEN {
            return Err(Error::unsupported(
                backend,
                format!("{name} {v} exceeds the kernel limit {MAX_SEQLEN}"),
            ));
        }
    }
    Ok(())
}

/// What every flash kernel requires before its tile is used: a valid problem, a 16-bit
/// dtype, a tile for the head dim (`tile`, None when there is none) and the launch limits.
fn admit<T>(
    backend: &str,
    kernel: &str,
    problem: &AttentionProblem,
    tile: Option<T>,
    head_dims: &str,
) -> Result<T> {
    problem.validate()?;
    if problem.dtype == DType::F32 {
        return Err(Error::unsupported(
            backend,
            format!("dtype f32 is not supported ({kernel} takes f16 or bf16 inputs)"),
        ));
    }
    let tile = tile.ok_or_else(|| {
        Error::unsupported(
            backend,
            format!(
                "head dim {} is not supported (supported head dims: {head_dims})",
                problem.head_dim,
            ),
        )
    })?;
    check_launch_limits(backend, problem)?;
    Ok(tile)
}

/// The v1 (mma.sync, sm_80+) kernel variant for a problem, or `Error::Unsupported`
/// naming the head dim / dtype that is not served.
pub fn select_v1(problem: &AttentionProblem) -> Result<KernelVariant> {
    let tile = admit(
        "flash-v1",
        "the v1 kernel",
        problem,
        v1_tile(problem.head_dim),
        V1_HEAD_DIMS_TEXT,
    )?;
    let m = Masking::of(problem);
    if m.window || m.softcap {
        return v1_masked_variant_for(&tile, problem.dtype, m, false);
    }
    v1_variant_for(&tile, problem.dtype, m.causal)
}

/// Every v1 variant that can be selected (for the compile-everything test).
pub fn all_v1_variants() -> Vec<KernelVariant> {
    let mut out = Vec::new();
    for &d in V1_HEAD_DIMS.iter() {
        let tile = v1_tile(d).expect("table covers V1_HEAD_DIMS");
        for dtype in [DType::F16, DType::Bf16] {
            for causal in [false, true] {
                out.push(v1_variant_for(&tile, dtype, causal).expect("table tiles are valid"));
            }
        }
    }
    out
}

/// The tile for a problem: the override's when it names this head dim, else the table's
/// ([`sm90_tile`]).
fn sm90_tile_in_use(problem: &AttentionProblem, tiles: &[Sm90Tile]) -> Option<Sm90Tile> {
    tiles
        .iter()
        .find(|t| t.head_dim as usize == problem.head_dim)
        .copied()
        .or_else(|| sm90_tile(problem.head_dim))
}

/// The sm_90a variant of a tile for a dtype and masking (no problem-size checks).
pub fn sm90_variant_for(tile: &Sm90Tile, dtype: DType, m: Masking) -> Result<KernelVariant> {
    if dtype == DType::F32 {
        return Err(Error::unsupported(
            "flash-sm90",
            "dtype f32 is not supported (the sm_90a kernel takes f16 or bf16 inputs)",
        ));
    }
    tile.check()
        .map_err(|e| Error::unsupported("flash-sm90", format!("invalid tile {tile:?}: {e}")))?;
    Ok(KernelVariant {
        source_file: SM90_SOURCE,
        entry: SM90_ENTRY,
        defines: tile.defines(dtype, m),
        block_m: tile.block_m(),
        block_threads: tile.threads(),
        shared_mem_bytes: tile.shared_mem_bytes(),
        min_arch: 90,
        abi: KernelAbi::TensorMaps {
            block_n: tile.block_n,
            persistent: tile.persistent,
            workspace_bytes: tile.workspace_bytes(m),
        },
    })
}

/// The sm_90a kernel variant for a problem, or `Error::Unsupported` naming why not (the
/// caller then uses v1: see [`select`]).
pub fn select_sm90(problem: &AttentionProblem) -> Result<KernelVariant> {
    select_sm90_with_tiles(problem, &[])
}

/// [`select_sm90`] with an override of the tile table (parsed by
/// [`parse_sm90_tile_override`]; the lab's A/B timing of tiles).
pub fn select_sm90_with_tiles(
    problem: &AttentionProblem,
    tiles: &[Sm90Tile],
) -> Result<KernelVariant> {
    let tile = admit(
        "flash-sm90",
        "the sm_90a kernel",
        problem,
        sm90_tile_in_use(problem, tiles),
        &format!("{SM90_HEAD_DIMS:?}"),
    )?;
    let tiles = sm90_work_tiles(problem, tile.block_m());
    // The kernel's int rank dispenser counts past the last tile by one draw per CTA (at
    // most one CTA per tile): tiles + grid must fit an int.
    if 2 * tiles > i32::MAX as u64 {
        return Err(Error::unsupported(
            "flash-sm90",
            format!("{tiles} work tiles exceed the kernel's int work-tile counter"),
        ));
    }
    // The tensor maps must be encodable (dims, strides); same check the launch does.
    super::tma::bshd_tile_params(
        problem.batch,
        problem.seqlen_q,
        problem.heads_q,
        problem.head_dim,
        tile.block_m(),
    )?;
    super::tma::bshd_tile_params(
        problem.batch,
        problem.seqlen_k,
        problem.heads_kv,
        problem.head_dim,
        tile.block_n,
    )?;
    sm90_variant_for(&tile, problem.dtype, Masking::of(problem))
}

/// Work tiles of the sm_90a kernel: (query block, head, batch) triples.
pub fn sm90_work_tiles(problem: &AttentionProblem, block_m: u32) -> u64 {
    (problem.seqlen_q as u64).div_ceil(block_m as u64)
        * problem.heads_q as u64
        * problem.batch as u64
}

/// grid.x of the sm_90a kernel: one CTA per work tile, or, persistent, at most one per SM
/// (the kernel strides over the tiles).
pub fn sm90_grid_x(
    problem: &AttentionProblem,
    block_m: u32,
    persistent: bool,
    sm_count: u32,
) -> u32 {
    let tiles = sm90_work_tiles(problem, block_m);
    let g = if persistent {
        tiles.min(sm_count.max(1) as u64)
    } else {
        tiles
    };
    g.min(i32::MAX as u64) as u32
}

/// The kernel a device of architecture `arch` (compute capability ×10) runs for a problem:
/// the sm_90a kernel on Hopper (9.0) when it serves the problem, else v1.
pub fn select(problem: &AttentionProblem, arch: u32) -> Result<KernelVariant> {
    select_with_tiles(problem, arch, &[])
}

/// [`select`] with an override of the sm_90a tile table (see [`select_sm90_with_tiles`]).
pub fn select_with_tiles(
    problem: &AttentionProblem,
    arch: u32,
    tiles: &[Sm90Tile],
) -> Result<KernelVariant> {
    if arch == 90 {
        if let Ok(v) = select_sm90_with_tiles(problem, tiles) {
            return Ok(v);
        }
    }
    select_v1(problem)
}

/// Every sm_90a variant that can be selected (for the compile-everything test).
pub fn all_sm90_variants() -> Vec<KernelVariant> {
    let mut out = Vec::new();
    for &d in SM90_HEAD_DIMS.iter() {
        for dtype in [DType::F16, DType::Bf16] {
            for m in Masking::all() {
                let tile = sm90_tile(d).expect("table covers the dims");
                out.push(sm90_variant_for(&tile, dtype, m).expect("table tiles are valid"));
            }
        }
    }
    out
}

/// The sm_90a variants of the lab's tiles at the head dims the table does not route yet
/// ([`sm90_lab_tile`]: D = 96), dense and varlen, for the compile-everything test.
pub fn sm90_lab_variants() -> Vec<KernelVariant> {
    let mut out = Vec::new();
    for &d in SM90_KERNEL_HEAD_DIMS.iter() {
        let Some(tile) = sm90_lab_tile(d) else {
            continue;
        };
        let varlen = tile.for_varlen();
        for t in std::iter::once(tile).chain(varlen.check().is_ok().then_some(varlen)) {
            for dtype in [DType::F16, DType::Bf16] {
                for m in Masking::all() {
                    out.push(sm90_variant_for(&t, dtype, m).expect("lab tiles are valid"));
                }
            }
        }
    }
    out
}

/// Every sm_90a varlen variant (the table's tiles with [`Sm90Tile::for_varlen`]), for the
/// compile-everything test.
pub fn all_sm90_varlen_variants() -> Vec<KernelVariant> {
    let mut out = Vec::new();
    for &d in SM90_HEAD_DIMS.iter() {
        for dtype in [DType::F16, DType::Bf16] {
            for m in Masking::all() {
                let tile = sm90_tile(d).expect("table covers the dims").for_varlen();
                out.push(sm90_variant_for(&tile, dtype, m).expect("table tiles are valid"));
            }
        }
    }
    out
}

/// The reference variant for a head dim, dtype and masking (no problem-size checks).
#[cfg(feature = "lab")]
pub fn reference_variant_for(head_dim: usize, dtype: DType, m: Masking) -> Result<KernelVariant> {
    if dtype == DType::F32 {
        return Err(Error::unsupported(
            "gpu-reference",
            "dtype f32 is not supported (the reference kernel takes f16 or bf16 inputs)",
        ));
    }
    if head_dim == 0 || head_dim > REFERENCE_MAX_HEAD_DIM {
        return Err(Error::unsupported(
            "gpu-reference",
            format!("head dim {head_dim} is not supported (1..={REFERENCE_MAX_HEAD_DIM})"),
        ));
    }
    Ok(KernelVariant {
        source_file: REFERENCE_SOURCE,
        entry: REFERENCE_ENTRY,
        defines: {
            let mut d = problem_defines(head_dim as u32, dtype, m);
            d.push(("FM_BLOCK_M".to_string(), REFERENCE_BLOCK_M.to_string()));
            d
        },
        block_m: REFERENCE_BLOCK_M,
        block_threads: REFERENCE_BLOCK_M * 32,
        shared_mem_bytes: 0,
        min_arch: 80,
        abi: KernelAbi::Pointers,
    })
}

/// The GPU reference kernel variant for a problem.
#[cfg(feature = "lab")]
pub fn select_reference(problem: &AttentionProblem) -> Result<KernelVariant> {
    problem.validate()?;
    check_launch_limits("gpu-reference", problem)?;
    reference_variant_for(problem.head_dim, problem.dtype, Masking::of(problem))
}

/// Head dims of [`all_reference_variants`]: every served v1 head dim plus odd ones
/// (the kernel is generic in D; these exercise partial lanes).
#[cfg(feature = "lab")]
pub const REFERENCE_TEST_HEAD_DIMS: [usize; 10] = [8, 32, 40, 64, 80, 96, 100, 128, 192, 256];

/// Every reference variant (for the compile test).
#[cfg(feature = "lab")]
pub fn all_reference_variants() -> Vec<KernelVariant> {
    let mut out = Vec::new();
    for &d in REFERENCE_TEST_HEAD_DIMS.iter() {
        for dtype in [DType::F16, DType::Bf16] {
            // Windows and softcap at the sm_90a kernel's head dims (the parameter code does
            // not depend on D); plain masking at every one.
            for m in Masking::all() {
                if (m.window || m.softcap) && !SM90_HEAD_DIMS.contains(&d) {
                    continue;
                }
                out.push(reference_variant_for(d, dtype, m).expect("valid reference"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def_u32(v: &KernelVariant, name: &str) -> u32 {
        v.define(name)
            .unwrap_or_else(|| panic!("{} lacks {name}", v.entry))
            .parse()
            .unwrap()
    }

    fn tile_of(v: &KernelVariant) -> TileConfig {
        TileConfig {
            head_dim: def_u32(v, "FM_HEAD_DIM"),
            block_m: def_u32(v, "FM_BLOCK_M"),
            block_n: def_u32(v, "FM_BLOCK_N"),
            warps: def_u32(v, "FM_WARPS"),
            stages: def_u32(v, "FM_STAGES"),
            q_in_regs: def_u32(v, "FM_Q_IN_REGS") != 0,
            min_blocks: def_u32(v, "FM_MIN_BLOCKS"),
            sub_n: def_u32(v, "FM_SUB_N"),
        }
    }

    #[test]
    fn v1_variants_are_consistent() {
        let all = all_v1_variants();
        assert_eq!(all.len(), V1_HEAD_DIMS.len() * 4);
        for v in &all {
            assert_eq!(v.source_file, FLASH_SOURCE);
            assert_eq!(v.entry, FLASH_ENTRY);
            let t = tile_of(v);
            t.check().unwrap();
            assert_eq!(v.block_m, t.block_m, "block_m define vs field");
            assert_eq!(v.block_threads, t.warps * 32, "threads vs warps");
            assert_eq!(v.shared_mem_bytes, t.shared_mem_bytes());
            assert!(v.shared_mem_bytes <= MAX_SMEM_SM90, "{v:?}");
            assert!(v.shared_mem_bytes * t.min_blocks <= 228 * 1024, "{v:?}");
            assert!(v.min_arch == 80 || v.min_arch == 90);
            assert!(def_u32(v, "FM_DTYPE_BF16") <= 1 && def_u32(v, "FM_CAUSAL") <= 1);
            assert_eq!(v.defines.len(), 10);
        }
        // dtype and causal flags reach the defines
        let p = AttentionProblem::new(1, 2, 10, 128, true, DType::Bf16);
        let v = select_v1(&p).unwrap();
        assert_eq!(v.define("FM_DTYPE_BF16"), Some("1"));
        assert_eq!(v.define("FM_CAUSAL"), Some("1"));
        let p = AttentionProblem::new(1, 2, 10, 64, false, DType::F16);
        let v = select_v1(&p).unwrap();
        assert_eq!(v.define("FM_DTYPE_BF16"), Some("0"));
        assert_eq!(v.define("FM_CAUSAL"), Some("0"));
        assert_eq!(v.define("FM_HEAD_DIM"), Some("64"));
    }

    #[test]
    fn smem_formula_known_values() {
        // D=128, 128x64, 2 stages: Q 128x128x2 = 32 KB, K+V 2x2x64x128x2 = 64 KB.
        let t = v1_tile(128).unwrap();
        assert_eq!(t.shared_mem_bytes(), 2 * 128 * (128 + 2 * 2 * 64));
        assert_eq!(t.shared_mem_bytes(), 96 * 1024);
        // D=96 and D=32 rows are padded to 128 and 64 elements.
        assert_eq!(v1_tile(96).unwrap().smem_pitch(), 128);
        assert_eq!(v1_tile(32).unwrap().smem_pitch(), 64);
        assert_eq!(
            v1_tile(256).unwrap().shared_mem_bytes(),
            2 * 256 * (128 + 2 * 2 * 64)
        );
    }

    /// Every multiple of 8 up to 256 has a tile: the next table head dim's, same pitch rule
    /// (D rounded up to 16 has the same power-of-two pitch as D), valid; others none.
    #[test]
    fn v1_serves_every_multiple_of_8() {
        for d in (8..=256).step_by(8) {
            let t = v1_tile(d).unwrap_or_else(|| panic!("D={d}"));
            t.check().unwrap();
            assert_eq!(t.head_dim as usize, d);
            let table = V1_HEAD_DIMS.iter().copied().find(|&x| x >= d).unwrap();
            let tt = v1_tile(table).unwrap();
            assert_eq!(
                (t.block_m, t.block_n, t.warps, t.sub_n),
                (tt.block_m, tt.block_n, tt.warps, tt.sub_n)
            );
            let dp = d.div_ceil(16) * 16;
            let pitch = if dp <= 64 {
                64
            } else if dp <= 128 {
                128
            } else {
                256
            };
            assert_eq!(t.smem_pitch(), pitch, "D={d}");
        }
        for d in [0, 4, 12, 84, 252, 264, 512] {
            assert!(v1_tile(d).is_none() && !v1_serves(d), "D={d}");
        }
        // ALiBi at the 128 tile steps 16 keys (registers); elsewhere the table's step.
        let m = Masking::causal(true);
        let v = v1_masked_variant_for(&v1_tile(120).unwrap(), DType::Bf16, m, true).unwrap();
        assert_eq!(v.define("FM_SUB_N"), Some("16"));
        assert_eq!(v.define("FM_ALIBI"), Some("1"));
        let v = v1_masked_variant_for(&v1_tile(64).unwrap(), DType::Bf16, m, true).unwrap();
        assert_eq!(v.define("FM_SUB_N"), Some("64"));
        let v = v1_variant_for(&v1_tile(128).unwrap(), DType::Bf16, true).unwrap();
        assert_eq!(
            (v.define("FM_SUB_N"), v.define("FM_ALIBI")),
            (Some("32"), None)
        );
    }

    #[test]
    fn cu_source_states_the_same_formula() {
        let src = include_str!("../../../kernels/attention/prefill/flash_attn_fwd.cu");
        assert!(src.contains("bytes = 2 * PITCH * (BLOCK_M + 2 * STAGES * BLOCK_N)"));
        assert!(src.contains("constexpr int SMEM_BYTES = 2 * PITCH * (BM + 2 * STAGES * BN);"));
        assert!(src.contains("constexpr int PITCH = DP <= 64 ? 64 : (DP <= 128 ? 128 : 256);"));
        assert!(src.contains("constexpr int DP = (D + 15) / 16 * 16;"));
        for name in [
            "FM_HEAD_DIM",
            "FM_DTYPE_BF16",
            "FM_CAUSAL",
            "FM_BLOCK_M",
            "FM_BLOCK_N",
            "FM_WARPS",
            "FM_STAGES",
            "FM_Q_IN_REGS",
            "FM_MIN_BLOCKS",
            "FM_SUB_N",
            "FM_WINDOW",
            "FM_SOFTCAP",
            "FM_ALIBI",
        ] {
            assert!(src.contains(name), "{name} not used by the .cu");
        }
        assert!(src.contains("flash_attn_fwd("));
        let r = include_str!("../../../kernels/reference/attention_reference.cu");
        assert!(r.contains("attention_reference("));
    }

    /// The unsigned numbers of a line of Python, in order (for the table mirrors).
    fn numbers(line: &str) -> Vec<u32> {
        line.split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect()
    }

    #[test]
    fn python_tile_table_matches() {
        // tools/kernels/nvrtc_check.py: `D: (BM, BN, WARPS, STAGES, Q_IN_REGS, MIN_BLOCKS, SUB_N),`
        let py = include_str!("../../../../../tools/kernels/nvrtc_check.py");
        let start = py.find("V1_TILES = {").expect("V1_TILES in nvrtc_check.py");
        let table = &py[start..start + py[start..].find('}').unwrap()];
        let mut seen = 0;
        for line in table.lines().skip(1) {
            let nums = numbers(line);
            if nums.len() != 8 {
                continue;
            }
            let t = v1_tile(nums[0] as usize).expect("python head dim served by tiles.rs");
            let want = TileConfig {
                head_dim: nums[0],
                block_m: nums[1],
                block_n: nums[2],
                warps: nums[3],
                stages: nums[4],
                q_in_regs: nums[5] != 0,
                min_blocks: nums[6],
                sub_n: nums[7],
            };
            assert_eq!(t, want, "python V1_TILES row for D={}", nums[0]);
            seen += 1;
        }
        assert_eq!(seen, V1_HEAD_DIMS.len());
    }

    #[test]
    fn python_sm90_tile_table_matches() {
        // tools/kernels/sm90_sass.py: `D: (BLOCK_N, STAGES, CONSUMERS, PINGPONG, Q_REGS)`.
        let py = include_str!("../../../../../tools/kernels/sm90_sass.py");
        let start = py
            .find("SM90_TILES = {")
            .expect("SM90_TILES in sm90_sass.py");
        let line = &py[start..start + py[start..].find('}').unwrap()];
        let nums = numbers(line);
        assert_eq!(nums.len(), 1 + 6 * SM90_HEAD_DIMS.len(), "{line}");
        for row in nums[1..].chunks(6) {
            // (nums[0] is the 90 of SM90_TILES.)
            let t = sm90_tile(row[0] as usize).expect("python head dim served by tiles.rs");
            let got = (
                t.block_n,
                t.stages,
                t.consumers,
                t.pingpong as u32,
                t.q_regs as u32,
            );
            assert_eq!(
                got,
                (row[1], row[2], row[3], row[4], row[5]),
                "python SM90_TILES row for D={}",
                row[0]
            );
        }
    }

    #[test]
    fn sm90_variants_are_consistent() {
        let all = all_sm90_variants();
        // 2 dtypes x 6 maskings per head dim.
        assert_eq!(all.len(), SM90_HEAD_DIMS.len() * 12);
        for v in &all {
            assert_eq!(v.source_file, SM90_SOURCE);
            assert_eq!(v.entry, SM90_ENTRY);
            let d: u32 = def_u32(v, "FM_HEAD_DIM");
            let t = sm90_tile(d as usize).unwrap();
            t.check().unwrap();
            assert_eq!(v.block_m, t.block_m());
            assert_eq!(v.block_threads, t.threads());
            assert_eq!(v.shared_mem_bytes, t.shared_mem_bytes());
            assert_eq!(def_u32(v, "FM_BLOCK_N"), t.block_n);
            assert_eq!(def_u32(v, "FM_STAGES"), t.stages);
            assert_eq!(def_u32(v, "FM_CONSUMERS"), t.consumers);
            assert_eq!(def_u32(v, "FM_PINGPONG"), t.pingpong as u32);
            assert_eq!(def_u32(v, "FM_Q_REGS"), t.q_regs as u32);
            assert_eq!(
                v.abi,
                KernelAbi::TensorMaps {
                    block_n: t.block_n,
                    persistent: t.persistent,
                    workspace_bytes: t.workspace_bytes(Masking {
                        causal: def_u32(v, "FM_CAUSAL") == 1,
                        window: v.define("FM_WINDOW") == Some("1"),
                        softcap: v.define("FM_SOFTCAP") == Some("1"),
                    }),
                }
            );
            assert!(v.runs_on(90).is_ok());
            assert!(v.runs_on(80).is_err() && v.runs_on(100).is_err());
        }
        // D=128: Q 32 KB + 2 stages x (K 32 KB + V 32 KB) + O staging 32 KB + slack,
        // barriers, the two work-tile records.
        let t = sm90_tile(128).unwrap();
        assert_eq!(
            t.shared_mem_bytes(),
            1024 + 32768 + 4 * 32768 + 128 * 256 + 8 * 10 + 64
        );
        assert_eq!((t.block_m(), t.threads()), (128, 384));
    }

    #[test]
    fn causal_d64_uses_the_table_tile_at_every_length() {
        // Short causal D=64 problems had a 2-consumer tile until the 3-consumer one
        // measured 6.5 % / 7.5 % faster at S = 512 / 1024 on the H100
        // (docs/design/attention-prefill-sm90.md).
        let p = AttentionProblem::new(2, 4, 1000, 64, true, DType::Bf16);
        assert_eq!(select_sm90(&p).unwrap().block_m, 192);
        let p = AttentionProblem::new(2, 4, 2048, 64, true, DType::Bf16);
        assert_eq!(select_sm90(&p).unwrap().block_m, 192);
    }

    #[test]
    fn head_dims_96_and_256_reach_the_sm90_kernel_only_through_the_lab_tiles() {
        let p = AttentionProblem::new(2, 8, 1000, 96, true, DType::Bf16);
        // The table routes D = 96 to v1 (not measured on the sm_90a kernel yet).
        assert_eq!(select(&p, 90).unwrap().entry, FLASH_ENTRY);
        let lab = sm90_lab_tile(96).unwrap();
        lab.check().unwrap();
        assert_eq!(lab.shared_mem_bytes(), {
            // Q, K and V rows as D = 128's, O staged at 2 * 96 + 16 bytes a row.
            let t = sm90_tile(128).unwrap();
            t.shared_mem_bytes() - t.block_m() * 2 * 128 + t.block_m() * (2 * 96 + 16)
        });
        let t = parse_sm90_tile_override("96:128,2,2,0,qregs=1;256:64,2,2,0").unwrap();
        let lab256 = sm90_lab_tile(256).unwrap();
        assert_eq!(t, vec![lab, lab256]);
        // D = 256 stages O in Q's rows: no staging area, Q from shared memory, dense only.
        assert!(lab256.stages_o_in_q() && !lab.stages_o_in_q());
        assert_eq!(
            lab256.shared_mem_bytes(),
            1024 + 512 * (128 + 2 * 2 * 64) + 8 * 10 + 64
        );
        assert!(parse_sm90_tile_override("256:64,2,2,0,qregs=1").is_err());
        assert!(lab256.for_varlen().check().is_err());
        assert!(!lab256.splits(Masking::of(&AttentionProblem::new(
            1,
            8,
            4096,
            256,
            false,
            DType::Bf16
        ))));
        let v = select_with_tiles(&p, 90, &t).unwrap();
        assert_eq!(v.entry, SM90_ENTRY);
        assert!(v
            .defines
            .contains(&("FM_HEAD_DIM".to_string(), "96".to_string())));
        assert!(parse_sm90_tile_override("80:128,2,2,0")
            .unwrap_err()
            .contains("head dim 80 is not served"));
    }

    #[test]
    fn sm90_tile_override_parses_and_names_bad_parts() {
        let t = parse_sm90_tile_override("128:64,2,2,0; 64:128,2,2,1").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!((t[0].head_dim, t[0].block_n, t[0].consumers), (128, 64, 2));
        assert!(t[1].pingpong && t[1].persistent && !t[0].q_regs);
        let t = parse_sm90_tile_override("128:128,2,2,0,qregs=1").unwrap();
        assert!(t[0].q_regs);
        assert!(parse_sm90_tile_override("").unwrap().is_empty());
        for (spec, needle) in [
            ("128", "expected D:BN"),
            ("128:192,2,2", "4 numbers"),
            ("128:x,2,2,0", "'x' is not a number"),
            ("128:128,2,2,2", "PINGPONG must be 0 or 1"),
            ("128:128,2,2,0,qregs", "'qregs' is not key=value"),
            ("128:128,2,2,0,qregs=2", "qregs must be 0 or 1"),
            // Retired switches (the kernel has no serial path, no eager rescale, no
            // polynomial exponential any more) are unknown keys, not silently ignored.
            ("128:128,2,2,0,lazy=0", "unknown key 'lazy'"),
            ("128:128,2,2,0,poly=2", "unknown key 'poly'"),
            // The old five-number form (with PIPE): the fifth is not key=value.
            ("128:128,2,2,1,0", "'0' is not key=value"),
            ("128:128,2,qregs=1", "4 numbers"),
            ("64:128,3,3,1,qregs=1", "q_regs needs 2 consumers"),
            ("128:100,2,2,0", "block_n 100"),
            ("128:256,4,2,0", "shared memory"),
            // With the O staging rows, D=128 has room for 2 stages of 128-key tiles only.
            ("128:192,2,2,0", "shared memory"),
            ("192:128,2,2,0", "head dim 192 is not served"),
        ] {
            let e = parse_sm90_tile_override(spec).unwrap_err();
            assert!(
                e.contains(needle) && e.contains("tile override"),
                "{spec}: {e}"
            );
        }
    }

    #[test]
    fn sm90_grid_covers_every_work_tile() {
        // Sq = 1000, BM = 128: 8 query blocks x 4 heads x 2 batches = 64 tiles.
        let p = AttentionProblem::new(2, 4, 1000, 128, false, DType::Bf16);
        assert_eq!(sm90_work_tiles(&p, 128), 64);
        assert_eq!(sm90_grid_x(&p, 128, false, 132), 64);
        assert_eq!(sm90_grid_x(&p, 128, true, 132), 64);
        assert_eq!(sm90_grid_x(&p, 128, true, 16), 16);
        // BM = 192 (D=64, 3 consumers): ceil(1000 / 192) = 6 blocks.
        assert_eq!(sm90_work_tiles(&p, 192), 6 * 4 * 2);
        assert_eq!(
            sm90_grid_x(&p, 192, true, 0),
            1,
            "a zero SM count still launches"
        );
    }

    #[test]
    fn sm90_source_states_the_same_formula() {
        // The layouts live in the kernel's configuration header, the entry in the .cu.
        let src = include_str!("../../../kernels/attention/prefill/fm90_config.cuh");
        assert!(src.contains(
            "constexpr int SMEM_BYTES = 1024 + 128 * DH * (BM + 2 * STAGES * BN) + (STAGE_IN_Q ? 0 : BM * STAGE_PITCH) +"
        ));
        assert!(src.contains("constexpr int BM = 64 * NCW;"));
        assert!(src.contains("constexpr int DH = (D + 63) / 64; "));
        assert!(src.contains("constexpr bool O_TMA_STORE = D >= 128 && !VARLEN;"));
        assert!(src.contains("constexpr int STAGE_PITCH = 2 * D + (O_TMA_STORE ? 0 : 16);"));
        assert!(src.contains("constexpr int THREADS = 128 * (NCW + 1);"));
        for name in [
            "FM_HEAD_DIM",
            "FM_DTYPE_BF16",
            "FM_CAUSAL",
            "FM_BLOCK_N",
            "FM_STAGES",
            "FM_CONSUMERS",
        ] {
            assert!(src.contains(name), "{name} not used by fm90_config.cuh");
        }
        let entry = include_str!("../../../kernels/attention/prefill/flash_attn_fwd_sm90.cu");
        assert!(entry.contains("flash_attn_fwd_sm90("));
    }

    #[test]
    fn hopper_selects_sm90_where_it_applies_and_v1_elsewhere() {
        for dtype in [DType::F16, DType::Bf16] {
            for causal in [false, true] {
                for d in [64, 128] {
                    let p = AttentionProblem::new(2, 4, 100, d, causal, dtype);
                    let v = select(&p, 90).unwrap();
                    assert_eq!(v.entry, SM90_ENTRY, "{p}");
                    // A100 / L40 / Blackwell: v1.
                    for arch in [80, 89, 100] {
                        assert_eq!(select(&p, arch).unwrap().entry, FLASH_ENTRY);
                    }
                }
                // Head dims the sm_90a kernel does not serve fall back to v1 on Hopper.
                for d in [32, 96, 256] {
                    let p = AttentionProblem::new(1, 2, 10, d, causal, dtype);
                    assert_eq!(select(&p, 90).unwrap().entry, FLASH_ENTRY, "{p}");
                }
            }
        }
        let p = AttentionProblem::new(1, 2, 10, 80, false, DType::Bf16);
        let e = select_sm90(&p).unwrap_err().to_string();
        assert!(e.contains("head dim 80") && e.contains("flash-sm90"), "{e}");
        assert_eq!(select(&p, 90).unwrap().entry, FLASH_ENTRY, "v1 serves D=80");
        let p = AttentionProblem::new(1, 2, 10, 84, false, DType::Bf16);
        assert!(select(&p, 90).is_err(), "neither kernel serves D=84");
        // GQA / MQA and Sq != Sk are served.
        let p = AttentionProblem {
            heads_kv: 1,
            seqlen_k: 77,
            ..AttentionProblem::new(1, 4, 33, 64, true, DType::Bf16)
        };
        assert_eq!(select(&p, 90).unwrap().entry, SM90_ENTRY);
    }

    #[test]
    fn select_errors_name_the_problem() {
        let mut p = AttentionProblem::new(1, 2, 16, 84, false, DType::Bf16);
        let e = select_v1(&p).unwrap_err().to_string();
        assert!(
            e.contains("head dim 84") && e.contains("flash-v1") && e.contains("multiples of 8"),
            "{e}"
        );
        p.head_dim = 264;
        let e = select_v1(&p).unwrap_err().to_string();
        assert!(e.contains("head dim 264"), "{e}");
        p.head_dim = 128;
        p.dtype = DType::F32;
        let e = select_v1(&p).unwrap_err().to_string();
        assert!(e.contains("f32"), "{e}");
        #[cfg(feature = "lab")]
        {
            let e = select_reference(&p).unwrap_err().to_string();
            assert!(e.contains("f32") && e.contains("gpu-reference"), "{e}");
            p.dtype = DType::F16;
            p.head_dim = 300;
            let e = select_reference(&p).unwrap_err().to_string();
            assert!(e.contains("head dim 300"), "{e}");
        }
        p.dtype = DType::F16;
        p.head_dim = 64;
        p.batch = 70_000;
        let e = select_v1(&p).unwrap_err().to_string();
        assert!(e.contains("batch 70000"), "{e}");
        p.batch = 1;
        p.heads_kv = 3;
        let e = select_v1(&p).unwrap_err().to_string();
        assert!(e.contains("heads_kv (3)"), "{e}");
    }

    #[test]
    fn selection_covers_served_dims() {
        for &d in V1_HEAD_DIMS.iter() {
            for dtype in [DType::F16, DType::Bf16] {
                let p = AttentionProblem::new(2, 4, 100, d, d % 64 == 0, dtype);
                let v = select_v1(&p).unwrap();
                assert!(all_v1_variants().contains(&v));
                assert_eq!(v.grid(&p), (1, 4, 2));
            }
        }
    }

    #[test]
    #[cfg(feature = "lab")]
    fn the_reference_serves_every_head_dim_to_256() {
        for d in 1..=256 {
            let p = AttentionProblem::new(1, 1, 5, d, false, DType::F16);
            let v = select_reference(&p).unwrap();
            assert_eq!(v.shared_mem_bytes, 0);
            assert_eq!(v.grid(&p), (5, 1, 1));
        }
        for v in all_reference_variants() {
            assert_eq!(v.block_threads, v.block_m * 32);
            assert_eq!(v.define("FM_BLOCK_M"), Some("1"));
        }
    }
}
