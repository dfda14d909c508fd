//! The prefill kernels' tile tables: the v1 (portable) kernel's [`TileConfig`] per head
//! dim and the sm_90a kernel's [`Sm90Tile`] (with the lab's override syntax); the constants
//! of the kernels' defines, per head dim.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::abi::*;
use crate::dtype::DType;

/// Tile configuration of one v1 flash variant: the compile-time constants of
/// `flash_attn_fwd.cu` (FM_BLOCK_M, FM_BLOCK_N, FM_WARPS, FM_STAGES, FM_Q_IN_REGS,
/// FM_MIN_BLOCKS, FM_SUB_N) for one head dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileConfig {
    pub head_dim: u32,
    /// Query rows per CTA.
    pub block_m: u32,
    /// Keys per K/V tile.
    pub block_n: u32,
    /// Warps per CTA; each owns block_m / warps query rows (16 or 32).
    pub warps: u32,
    /// Depth of the K/V shared-memory ring.
    pub stages: u32,
    /// Q A-fragments kept in registers (else re-read from shared memory per tile).
    pub q_in_regs: bool,
    /// CTAs per SM the compiler must allow (`__launch_bounds__` second argument).
    pub min_blocks: u32,
    /// Keys per compute step: a loaded tile of block_n keys is processed as
    /// block_n / sub_n sub-tiles, so S needs registers for sub_n keys only while barriers
    /// and load bookkeeping happen once per block_n keys.
    pub sub_n: u32,
}

impl TileConfig {
    /// Elements per shared-memory row: D rounded up to a power of two >= 64, so that each
    /// row is >= 128 bytes and the XOR swizzle (chunk c of row r at c ^ (r & 7)) is
    /// conflict-free. Same rule as `PITCH` in the .cu.
    pub const fn smem_pitch(&self) -> u32 {
        if self.head_dim <= 64 {
            64
        } else if self.head_dim <= 128 {
            128
        } else {
            256
        }
    }

    /// Dynamic shared memory of the kernel, THE formula (mirrored by `SMEM_BYTES` in
    /// flash_attn_fwd.cu, which static_asserts the same layout):
    /// `2 * PITCH * (BLOCK_M + 2 * STAGES * BLOCK_N)` bytes = a Q tile of BLOCK_M rows plus
    /// STAGES K tiles and STAGES V tiles of BLOCK_N rows, 16-bit elements.
    pub const fn shared_mem_bytes(&self) -> u32 {
        2 * self.smem_pitch() * (self.block_m + 2 * self.stages * self.block_n)
    }

    pub const fn threads(&self) -> u32 {
        self.warps * 32
    }

    pub const fn rows_per_warp(&self) -> u32 {
        self.block_m / self.warps
    }

    /// The constraints the .cu static_asserts, plus the shared-memory and register-file
    /// limits; Err names the violated rule.
    pub fn check(&self) -> std::result::Result<(), String> {
        let d = self.head_dim;
        if !v1_serves(d as usize) {
            return Err(format!("head dim {d} must be a multiple of 8 in 8..=256"));
        }
        if self.warps == 0 || self.block_m % self.warps != 0 {
            return Err(format!(
                "block_m {} not divisible by warps {}",
                self.block_m, self.warps
            ));
        }
        let rpw = self.rows_per_warp();
        if rpw != 16 && rpw != 32 {
            return Err(format!("rows per warp {rpw} must be 16 or 32"));
        }
        if self.block_n == 0 || self.block_n % 16 != 0 {
            return Err(format!(
                "block_n {} must be a positive multiple of 16",
                self.block_n
            ));
        }
        if self.sub_n == 0 || self.sub_n % 16 != 0 || self.block_n % self.sub_n != 0 {
            return Err(format!(
                "sub_n {} must be a multiple of 16 dividing block_n {}",
                self.sub_n, self.block_n
            ));
        }
        if !(2..=4).contains(&self.stages) {
            return Err(format!("stages {} must be 2..=4", self.stages));
        }
        if self.min_blocks == 0 {
            return Err("min_blocks must be >= 1".into());
        }
        let smem = self.shared_mem_bytes();
        if smem * self.min_blocks > 228 * 1024 || smem > MAX_SMEM_SM90 {
            return Err(format!(
                "{} CTA(s) x {smem} bytes of shared memory exceed the SM (228 KB, 227 KB per block)",
                self.min_blocks
            ));
        }
        // 64K 32-bit registers per SM, at most 255 per thread.
        if self.threads() * self.min_blocks * 255 > 65_536 + self.threads() * self.min_blocks {
            return Err(format!(
                "{} CTA(s) x {} threads cannot each have 255 registers",
                self.min_blocks,
                self.threads()
            ));
        }
        Ok(())
    }

    /// NVRTC defines for this tile, dtype and masking.
    pub fn defines(&self, dtype: DType, causal: bool) -> Vec<(String, String)> {
        self.defines_masked(dtype, Masking::causal(causal), false)
    }

    /// NVRTC defines for this tile, dtype, masking (windows and softcap included) and ALiBi
    /// (`FM_ALIBI`, only where set, so the plain variants keep their define lists).
    pub fn defines_masked(&self, dtype: DType, m: Masking, alibi: bool) -> Vec<(String, String)> {
        let kv = |k: &str, v: u32| (k.to_string(), v.to_string());
        let mut d = problem_defines(self.head_dim, dtype, m);
        if alibi {
            d.push(kv("FM_ALIBI", 1));
        }
        d.extend([
            kv("FM_BLOCK_M", self.block_m),
            kv("FM_BLOCK_N", self.block_n),
            kv("FM_WARPS", self.warps),
            kv("FM_STAGES", self.stages),
            kv("FM_Q_IN_REGS", self.q_in_regs as u32),
            kv("FM_MIN_BLOCKS", self.min_blocks),
            kv("FM_SUB_N", self.sub_n),
        ]);
        d
    }
}

/// The v1 tile table: one configuration per table head dim ([`V1_HEAD_DIMS`]). Chosen for
/// zero register spills under NVRTC 13.0 (checked by tools/kernels/nvrtc_check.py, which
/// keeps a copy of this table in `V1_TILES`; the test `python_tile_table_matches` keeps the
/// two equal) and reasoned about in docs/design/attention-prefill-sm90.md (the portable
/// kernel). Any other multiple of 8 up to 256 takes the tile of the next larger table head
/// dim: its shared-memory pitch, fragments and registers are at most that tile's (the
/// kernel computes over the head dim rounded up to 16), so the tile stays valid and
/// spill-free (the compile test builds a spread of such head dims).
pub fn v1_tile(head_dim: usize) -> Option<TileConfig> {
    if !v1_serves(head_dim) {
        return None;
    }
    let table = V1_HEAD_DIMS.iter().copied().find(|&t| t >= head_dim)?;
    v1_table_tile(table).map(|t| TileConfig {
        head_dim: head_dim as u32,
        ..t
    })
}

fn v1_table_tile(head_dim: usize) -> Option<TileConfig> {
    let t = |head_dim, block_m, block_n, warps, stages, q_in_regs, min_blocks, sub_n| TileConfig {
        head_dim,
        block_m,
        block_n,
        warps,
        stages,
        q_in_regs,
        min_blocks,
        sub_n,
    };
    //                 D   BM   BN  W  ST  Q regs MIN SUB
    Some(match head_dim {
        32 => t(32, 128, 128, 4, 2, true, 2, 64),
        64 => t(64, 128, 128, 4, 2, true, 2, 64),
        96 => t(96, 128, 64, 4, 2, false, 2, 32),
        128 => t(128, 128, 64, 4, 2, false, 2, 32),
        256 => t(256, 128, 64, 8, 2, false, 1, 64),
        _ => return None,
    })
}
/// Head dims the sm_90a kernel serves; others fall back to v1 on Hopper.
pub const SM90_HEAD_DIMS: [usize; 2] = [64, 128];
/// Head dims the sm_90a kernel builds: [`SM90_HEAD_DIMS`], 96 (two 64-column panels, the
/// second half zero fill) and 256 (O staged in Q's rows), which the table does not route
/// to it until measured; the lab reaches them through a tile override
/// ([`parse_sm90_tile_override`], [`sm90_lab_tile`]).
pub const SM90_KERNEL_HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];
/// Grids above this many CTAs do not split tiles over key ranges (`SPLIT_MAX_CTAS` in
/// kernels/attention/prefill/fm90_config.cuh): the workspace holds one boundary record per slot up to it.
pub const SM90_SPLIT_MAX_CTAS: usize = 132;

/// Tile configuration of one sm_90a variant: the compile-time constants of
/// `flash_attn_fwd_sm90.cu` (FM_BLOCK_N, FM_STAGES, FM_CONSUMERS, FM_PINGPONG, FM_Q_REGS;
/// listed in `kernels/attention/prefill/fm90_config.cuh`) for one head dim. The software pipeline, the lazy
/// O rescale and MUFU ex2 are always on in the kernel (every tile used them; their
/// switches were retired).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sm90Tile {
    pub head_dim: u32,
    /// Keys per K/V tile (the wgmma N of S = Q Kᵀ).
    pub block_n: u32,
    /// Depth of the K/V ring.
    pub stages: u32,
    /// Consumer warpgroups, 64 query rows each (plus one producer warpgroup).
    pub consumers: u32,
    /// The consumer warpgroups take turns issuing GEMMs (named barriers, round robin),
    /// so one's softmax overlaps the others' GEMMs.
    pub pingpong: bool,
    /// Q in registers: each consumer reads its Q rows once per work tile and S = QKᵀ takes
    /// A from registers (wgmma RS). Two consumers only (three have 160 registers each).
    pub q_regs: bool,
    /// Persistent grid: at most one CTA per SM, each taking work tiles from the kernel's
    /// rank dispenser (one atomic per tile), so the next tile's loads overlap this tile's
    /// last GEMMs and epilogue. Dynamic, so causal tiles of unequal cost balance too (a
    /// static round robin made persistent causal 8 % slower at D=128 and 31 % at D=64;
    /// on the H100; docs/design/attention-prefill-sm90.md). False: one CTA per work tile.
    pub persistent: bool,
    /// Packed variable-length batches (`FM_VARLEN`, [`super::varlen`]): O stored without
    /// TMA, no split of the last wave. The table's tiles are dense; [`Sm90Tile::for_varlen`]
    /// makes the varlen one.
    pub varlen: bool,
}

impl Sm90Tile {
    pub const fn block_m(&self) -> u32 {
        64 * self.consumers
    }
    pub const fn threads(&self) -> u32 {
        128 * (self.consumers + 1)
    }
    /// Dynamic shared memory, THE formula (mirrored by `SMEM_BYTES` in
    /// kernels/attention/prefill/fm90_config.cuh): 1024 bytes of alignment slack, Q, the K and V rings, the
    /// epilogue's O staging rows (row pitch 2·D + 16 bytes), 2 + 4·STAGES mbarriers of 8
    /// bytes, and the two 32-byte work-tile records the producer posts in turn.
    /// Bytes of padding per staged O row: 0 where the kernel stores O with TMA (head dim
    /// >= 128, `O_TMA_STORE` in fm90_config.cuh), 16 where warps copy their rows out themselves.
    pub const fn o_staging_pad(&self) -> u32 {
        if self.head_dim >= 128 && !self.varlen {
            0
        } else {
            16
        }
    }
    /// Bytes of a Q, K or V row in shared memory: whole 128-byte panels (`DH` in
    /// fm90_config.cuh).
    pub const fn smem_row_bytes(&self) -> u32 {
        128 * self.head_dim.div_ceil(64)
    }
    /// Whether each warp stages its O rows in its own Q rows (`STAGE_IN_Q` in
    /// fm90_config.cuh: head dims above 128, where a staging area does not fit).
    pub const fn stages_o_in_q(&self) -> bool {
        self.head_dim > 128
    }
    pub const fn shared_mem_bytes(&self) -> u32 {
        let staging = if self.stages_o_in_q() {
            0
        } else {
            self.block_m() * (2 * self.head_dim + self.o_staging_pad())
        };
        1024 + self.smem_row_bytes() * (self.block_m() + 2 * self.stages * self.block_n)
            + staging
            + 8 * (2 + 4 * self.stages)
            + 64
    }
    /// Whether the kernel splits the launch's last tiles over key ranges (`SPLIT` in
    /// fm90_config.cuh): non-causal, no window, head dim 128 (at 256 the merge's registers
    /// spill), not varlen.
    pub const fn splits(&self, m: Masking) -> bool {
        !m.causal && !m.window && self.head_dim == 128 && !self.varlen
    }
    /// The same tile for packed variable-length batches.
    pub const fn for_varlen(self) -> Sm90Tile {
        Sm90Tile {
            varlen: true,
            ..self
        }
    }
    /// Bytes of the launch workspace, THE formula (mirrored by `WS_BYTES` in
    /// kernels/attention/prefill/fm90_config.cuh): 256 for the rank dispenser; with the split, per boundary
    /// record (132 slots × consumers × 4 warps) a ticket and a flag (8 bytes, the block
    /// rounded up to 256) and the first part's O, m and l (D / 8 + 1 float4s per lane).
    pub const fn workspace_bytes(&self, m: Masking) -> usize {
        let base = 256;
        if !self.splits(m) {
            return base;
        }
        let records = SM90_SPLIT_MAX_CTAS * self.consumers as usize * 4;
        let sync = (records * 8).div_ceil(256) * 256;
        let parts = records * (self.head_dim as usize / 8 + 1) * 32 * 16;
        base + sync + parts
    }
    /// The constraints the .cu static_asserts plus the shared-memory limit.
    pub fn check(&self) -> std::result::Result<(), String> {
        let d = self.head_dim;
        if d == 0 || (d % 64 != 0 && d != 96) || d > 256 {
            return Err(format!("head dim {d} must be 64, 96, 128, 192 or 256"));
        }
        if self.block_n == 0 || self.block_n % 64 != 0 || self.block_n > 256 {
            return Err(format!(
                "block_n {} must be 64, 128, 192 or 256",
                self.block_n
            ));
        }
        if !(2..=4).contains(&self.stages) {
            return Err(format!("stages {} must be 2..=4", self.stages));
        }
        if !(2..=3).contains(&self.consumers) {
            return Err(format!("consumers {} must be 2 or 3", self.consumers));
        }
        if self.stages_o_in_q() && (self.q_regs || self.varlen) {
            return Err(format!(
                "head dim {d} stages O in Q's rows: Q read from shared memory (qregs=0), \
                 dense calls only (the TMA store)"
            ));
        }
        if self.q_regs && self.consumers != 2 {
            return Err("q_regs needs 2 consumers (3 spill at 160 registers per thread)".into());
        }
        if self.shared_mem_bytes() > MAX_SMEM_SM90 {
            return Err(format!(
                "{} bytes of shared memory exceed the 227 KB per block",
                self.shared_mem_bytes()
            ));
        }
        Ok(())
    }
    pub fn defines(&self, dtype: DType, m: Masking) -> Vec<(String, String)> {
        let kv = |k: &str, v: u32| (k.to_string(), v.to_string());
        let mut d = problem_defines(self.head_dim, dtype, m);
        d.extend([
            kv("FM_BLOCK_N", self.block_n),
            kv("FM_STAGES", self.stages),
            kv("FM_CONSUMERS", self.consumers),
            kv("FM_PINGPONG", self.pingpong as u32),
            kv("FM_Q_REGS", self.q_regs as u32),
        ]);
        if self.varlen {
            d.push(kv("FM_VARLEN", 1));
        }
        d
    }
}

/// Parse a tile override of the sm_90a tile table, for A/B timing of tiles without a
/// rebuild (the lab reads it from `FLASHMOE_SM90_TILE`):
/// `"D:BN,STAGES,CONSUMERS,PINGPONG[,qregs=0|1][;D:...]"`, e.g. `128:128,2,2,1` or
/// `64:128,2,2,0,qregs=1`: the values the table sets per head dim. `qregs` (Q in
/// registers) defaults to 0. Head dims it does not name keep the table's tile (see
/// [`select_with_tiles`](super::select::select_with_tiles)). Errors name the bad part.
pub fn parse_sm90_tile_override(spec: &str) -> std::result::Result<Vec<Sm90Tile>, String> {
    let mut tiles = Vec::new();
    for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = |why: &str| format!("sm_90a tile override entry '{entry}': {why}");
        let (d, rest) = entry
            .split_once(':')
            .ok_or_else(|| bad("expected D:BN,STAGES,CONSUMERS,PINGPONG"))?;
        let num = |x: &str| {
            x.trim()
                .parse::<u32>()
                .map_err(|_| bad(&format!("'{x}' is not a number")))
        };
        let fields: Vec<&str> = rest.split(',').map(str::trim).collect();
        if fields.iter().take(4).filter(|x| !x.contains('=')).count() != 4 {
            return Err(bad("expected 4 numbers after the head dim"));
        }
        let f: Vec<u32> = fields[..4]
            .iter()
            .map(|x| num(x))
            .collect::<std::result::Result<_, _>>()?;
        let flag = |v: u32, name: &str| match v {
            0 | 1 => Ok(v == 1),
            _ => Err(bad(&format!("{name} must be 0 or 1"))),
        };
        let mut tile = Sm90Tile {
            head_dim: num(d)?,
            block_n: f[0],
            stages: f[1],
            consumers: f[2],
            pingpong: flag(f[3], "PINGPONG")?,
            q_regs: false,
            persistent: true,
            varlen: false,
        };
        for opt in &fields[4..] {
            let (key, value) = opt
                .split_once('=')
                .ok_or_else(|| bad(&format!("'{opt}' is not key=value")))?;
            match key.trim() {
                "qregs" => tile.q_regs = flag(num(value)?, "qregs")?,
                other => return Err(bad(&format!("unknown key '{other}' (qregs)"))),
            }
        }
        if !SM90_KERNEL_HEAD_DIMS.contains(&(tile.head_dim as usize)) {
            return Err(bad(&format!(
                "head dim {} is not served by the sm_90a kernel ({SM90_KERNEL_HEAD_DIMS:?})",
                tile.head_dim
            )));
        }
        tile.check().map_err(|e| bad(&e))?;
        tiles.push(tile);
    }
    Ok(tiles)
}

/// The tile the lab runs the sm_90a kernel with at a head dim the table does not route to
/// it yet ([`SM90_KERNEL_HEAD_DIMS`]): at D = 96, D = 128's (the same shared memory; the
/// override `96:128,2,2,0,qregs=1`); at D = 256, 64-key tiles in a 2-slot ring, Q from
/// shared memory (`256:64,2,2,0`: Q 64 KB + the ring 128 KB, O staged in Q).
pub fn sm90_lab_tile(head_dim: usize) -> Option<Sm90Tile> {
    match head_dim {
        96 => sm90_tile(128).map(|t| Sm90Tile { head_dim: 96, ..t }),
        256 => Some(Sm90Tile {
            head_dim: 256,
            block_n: 64,
            stages: 2,
            consumers: 2,
            pingpong: false,
            q_regs: false,
            persistent: true,
            varlen: false,
        }),
        _ => None,
    }
}

/// The sm_90a tile table (docs/design/attention-prefill-sm90.md).
pub fn sm90_tile(head_dim: usize) -> Option<Sm90Tile> {
    let t = |head_dim, (block_n, stages, consumers), pingpong, persistent| Sm90Tile {
        head_dim,
        block_n,
        stages,
        consumers,
        pingpong,
        // Q in registers at D=128: +1.2 % geomean over the D=128 A/B shapes, ncu -2.6 % at
        // S=4096 (H100). D=64's three consumers have no registers for it.
        q_regs: head_dim == 128,
        persistent,
        varlen: false,
    };
    //                D    (BN, ST, CONS)  PINGPONG PERSISTENT
    Some(match head_dim {
        64 => t(64, (128, 3, 3), true, true),
        128 => t(128, (128, 2, 2), false, true),
        _ => return None,
    })
}
