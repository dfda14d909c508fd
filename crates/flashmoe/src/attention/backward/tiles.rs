//! Kernel selection of the backward: the modes ([`BwdMode`]), the kernel paths
//! ([`BwdKernel`], [`Sm90Dq`]), the tiles of the portable and sm_90a kernels and the NVRTC
//! defines each tile compiles with.

use crate::attention::plan::AttentionClass;
use crate::attention::prefill::abi::Masking;
use crate::dtype::DType;

/// Head dims the backward kernels serve.
pub const BWD_HEAD_DIMS: [usize; 4] = [32, 64, 96, 128];
/// Head dims the sm_90a backward serves (96: held as 128 columns in shared memory, no
/// producer warpgroup, the fused dQ split 64 + 32; not a default until measured,
/// [`default_kernel`]).
pub const BWD_SM90_HEAD_DIMS: [usize; 3] = [64, 96, 128];

/// What a backward plan promises about its bits: FlashAttention's `deterministic` switch
/// (PyTorch's `torch.use_deterministic_algorithms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BwdMode {
    /// The fastest kernels for the class. On compute capability 9.0, where the sm_90a
    /// kernels serve the class, dq is summed with f32 reductions in the order they land,
    /// so two runs may differ in the last bits of dq (dk and dv are still bit-identical).
    Fast,
    /// Bit-identical gradients run to run, on every path.
    Deterministic,
}

/// Which kernels a backward plan runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BwdKernel {
    /// `flash_attn_bwd.cu` (mma.sync, sm_80 and newer): every class the backward serves.
    Portable,
    /// `flash_attn_bwd_sm90.cu` (wgmma, compute capability 9.0): head dims 64 and 128,
    /// bf16/f16, causal or not, sliding windows, softcap, Sq ≠ Sk, GQA.
    Sm90(Sm90BwdTile),
}

impl BwdKernel {
    /// Whether these are the sm_90a kernels.
    pub fn is_sm90(&self) -> bool {
        matches!(self, BwdKernel::Sm90(_))
    }
}

/// How the sm_90a backward makes dQ (the kernels' FM_DQ_MODE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sm90Dq {
    /// A second kernel (`flash_attn_bwd_sm90_dq`) recomputes S and dP for each query
    /// block: 7 products of the forward's size, bit-identical run to run.
    Kernel,
    /// The dK/dV kernel also computes dQ's part of its key block (dS·K) and adds it into an
    /// f32 workspace with reductions, in whatever order they land: 5 products, not
    /// bit-identical run to run (f32 addition is not associative).
    Atomic,
    /// As `Atomic`, but each 64-row dQ tile takes its key blocks' parts in increasing
    /// key-block order (a semaphore per tile): 5 products, bit-identical run to run.
    Ordered,
}

impl Sm90Dq {
    /// FM_DQ_MODE of the kernels.
    fn define(self) -> u32 {
        match self {
            Sm90Dq::Kernel => 0,
            Sm90Dq::Atomic => 1,
            Sm90Dq::Ordered => 2,
        }
    }
    /// Whether the dK/dV kernel makes dQ (the f32 workspace, no dQ kernel).
    pub fn fused(self) -> bool {
        self != Sm90Dq::Kernel
    }
    /// Whether two runs give the same bits.
    pub fn deterministic(self) -> bool {
        self != Sm90Dq::Atomic
    }
}

/// Tile of the sm_90a backward kernels (their FM_KV_BLOCK_M, FM_Q_BLOCK_N, FM_STAGES,
/// FM_DQ_MODE). Both kernels run two warpgroups of 64 stationary rows each: 128 keys per
/// dK/dV CTA, 128 query rows per dQ CTA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sm90BwdTile {
    pub head_dim: u32,
    /// Query rows per step of the dK/dV kernel (64 or 128).
    pub kv_block_m: u32,
    /// Keys per step of the dQ kernel (64 or 128).
    pub q_block_n: u32,
    /// Depth of the streamed-tile ring (2 or 3).
    pub stages: u32,
    /// How dQ is made; the fused modes need `kv_block_m` = 64, or 128 at head dim 64 with
    /// unordered reductions (`q_block_n` is then unused).
    pub dq: Sm90Dq,
    /// 0, or the loading warps (1 or 4) of a third warpgroup of the dK/dV kernel that only
    /// loads (FM_PRODUCER: Q, dO, K, V by TMA, lse2 and delta by the loading warps'
    /// cp.asyncs; the consumers at 240 registers): lab tiles (dense calls only) until one
    /// measures faster.
    pub producer_warps: u32,
}

impl Sm90BwdTile {
    /// The production tile of `head_dim`, or None where the sm_90a backward has none: the
    /// fastest of [`Sm90BwdTile::lab_tiles`] on the 16k-token sweep (H200,
    /// docs/design/attention-backward.md): 128 keys a dQ step at D=64 (64 at D=128, where
    /// 128 spills, and at D=96), a 3-slot ring (the ring's loads are issued under a step's last
    /// product, STAGES - 1 steps ahead: one step ahead leaves their latency exposed).
    pub fn for_head_dim(head_dim: usize) -> Option<Sm90BwdTile> {
        if !BWD_SM90_HEAD_DIMS.contains(&head_dim) {
            return None;
        }
        let (q_block_n, stages) = if head_dim == 64 { (128, 3) } else { (64, 3) };
        Some(Sm90BwdTile {
            head_dim: head_dim as u32,
            kv_block_m: 64,
            q_block_n,
            stages,
            dq: Sm90Dq::Kernel,
            producer_warps: 0,
        })
    }
    /// The production tile of `head_dim` for `mode`: [`Sm90BwdTile::for_head_dim`] when
    /// deterministic (the dQ kernel: 7 products, and faster than the ordered fused dQ on
    /// every sweep shape measured, docs/design/attention-backward.md); the fused dQ with
    /// unordered reductions (5 products, 3-slot ring) when fast, with 128 query rows a
    /// step at D=64 (v4/v5: the fastest tile on all 12 sweep shapes).
    pub fn for_mode(head_dim: usize, mode: BwdMode) -> Option<Sm90BwdTile> {
        let det = Sm90BwdTile::for_head_dim(head_dim)?;
        Some(match mode {
            BwdMode::Deterministic => det,
            BwdMode::Fast => Sm90BwdTile {
                kv_block_m: if head_dim == 64 { 128 } else { 64 },
                stages: 3,
                dq: Sm90Dq::Atomic,
                ..det
            },
        })
    }
    /// The production tile for `class` and `mode`: [`Sm90BwdTile::for_mode`]'s, with 64
    /// query rows a dK/dV step and 64 keys a dQ-kernel step where its 128 do not serve the
    /// class (softcap at D=64).
    pub fn for_class(class: &AttentionClass, mode: BwdMode) -> Option<Sm90BwdTile> {
        let t = Sm90BwdTile::for_mode(class.head_dim, mode)?;
        Some(if t.serves(class) {
            t
        } else {
            Sm90BwdTile {
                kv_block_m: 64,
                q_block_n: if t.dq == Sm90Dq::Kernel {
                    64
                } else {
                    t.q_block_n
                },
                ..t
            }
        })
    }
    /// The production tile of `head_dim` first, then the others the lab times beside it
    /// (those that spill registers are not listed: the kernel pair with 128 query rows a
    /// dK/dV step at D=64, with 128 keys a dQ step at D=128).
    pub fn lab_tiles(head_dim: usize) -> Vec<Sm90BwdTile> {
        let Some(prod) = Sm90BwdTile::for_head_dim(head_dim) else {
            return Vec::new();
        };
        let all: &[(u32, u32)] = if head_dim == 64 {
            &[(64, 2), (128, 2), (64, 3), (128, 3)]
        } else {
            &[(64, 2), (64, 3)]
        };
        let mut all: Vec<Sm90BwdTile> = all
            .iter()
            .map(|&(n, st)| Sm90BwdTile {
                q_block_n: n,
                stages: st,
                dq: Sm90Dq::Kernel,
                ..prod
            })
            .collect();
        // The fused-dQ modes (5 products), 2- and 3-slot rings; at D=64 also 128 query rows
        // a step with unordered reductions, both rings (the ordered kernel spills there).
        for dq in [Sm90Dq::Atomic, Sm90Dq::Ordered] {
            for stages in [2, 3] {
                all.push(Sm90BwdTile { stages, dq, ..prod });
            }
        }
        if head_dim == 64 {
            let fast = Sm90BwdTile::for_mode(head_dim, BwdMode::Fast).expect("head dim 64");
            all.extend([fast, Sm90BwdTile { stages: 2, ..fast }]);
        }
        // The producer warpgroup's builds of the deterministic production tile and of the
        // unordered fused dQ at 64 query rows a step, 3-slot ring (D = 128's fast production
        // tile; at D = 64 the 128-row one spills at the consumers' 240 registers), each
        // with 4 loading warps and with 1 (v6's outcome, docs/design/attention-backward.md).
        for producer_warps in [4, 1] {
            all.extend([
                Sm90BwdTile {
                    producer_warps,
                    ..prod
                },
                Sm90BwdTile {
                    producer_warps,
                    dq: Sm90Dq::Atomic,
                    kv_block_m: 64,
                    stages: 3,
                    ..prod
                },
            ]);
        }
        let mut out = vec![prod];
        out.extend(all.into_iter().filter(|t| *t != prod && t.is_valid()));
        out
    }
    /// Whether this tile serves `class`'s masking: the ordered fused dQ needs every dQ
    /// tile's key blocks to be a prefix, which a sliding window breaks; with a softcap, 128
    /// query rows a dK/dV step and 128 keys a dQ-kernel step spill registers (the tanh and
    /// the 1 - tanh^2 factor).
    pub fn serves(&self, class: &AttentionClass) -> bool {
        let m = Masking::of(&class.problem(1, 1, 1));
        let dq_kernel_128 = self.dq == Sm90Dq::Kernel && self.q_block_n == 128;
        (self.dq != Sm90Dq::Ordered || !m.window)
            && !(m.softcap && (self.kv_block_m == 128 || dq_kernel_128))
    }
    /// Whether the kernels accept this tile.
    pub fn is_valid(&self) -> bool {
        BWD_SM90_HEAD_DIMS.contains(&(self.head_dim as usize))
            && matches!(self.kv_block_m, 64 | 128)
            && matches!(self.q_block_n, 64 | 128)
            && matches!(self.stages, 2 | 3)
            && matches!(self.producer_warps, 0 | 1 | 4)
            // The producer's TMA boxes need whole 64-column panels.
            && (self.head_dim % 64 == 0 || !self.producer())
            && (!self.dq.fused()
                || self.kv_block_m == 64
                || (self.head_dim == 64 && self.dq == Sm90Dq::Atomic))
            && self.kv_smem_bytes() <= crate::attention::prefill::abi::MAX_SMEM_SM90
            && self.q_smem_bytes() <= crate::attention::prefill::abi::MAX_SMEM_SM90
    }
    /// Keys per dK/dV CTA.
    pub fn kv_block_n(&self) -> u32 {
        128
    }
    /// Whether the dK/dV kernel has a producer warpgroup.
    pub fn producer(&self) -> bool {
        self.producer_warps > 0
    }
    /// Threads of a dK/dV CTA: two consumer warpgroups, and the producer's.
    pub fn kv_threads(&self) -> u32 {
        if self.producer() {
            384
        } else {
            256
        }
    }
    /// Query rows per dQ CTA.
    pub fn q_block_m(&self) -> u32 {
        128
    }
    /// Bytes of a tile row in shared memory: whole 64-column panels (DP in the .cu).
    fn smem_row_bytes(&self) -> u32 {
        2 * self.head_dim.div_ceil(64) * 64
    }
    /// Dynamic shared memory of the dK/dV kernel (KV_SMEM in the .cu).
    pub fn kv_smem_bytes(&self) -> u32 {
        let row = self.smem_row_bytes();
        let tiles = 2 * self.kv_block_n() * row
            + self.stages * (2 * self.kv_block_m * row + 8 * self.kv_block_m);
        // Fused dQ: two dS^T tiles (keys x query rows, 16-bit) on a 1024-byte boundary.
        let ds = if self.dq.fused() {
            tiles.div_ceil(1024) * 1024 - tiles + 2 * (2 * self.kv_block_n() * self.kv_block_m)
        } else {
            0
        };
        1024 + tiles + ds + self.barrier_bytes()
    }
    /// The mbarriers: full and empty per ring slot, one for the stationary block.
    fn barrier_bytes(&self) -> u32 {
        8 * (2 * self.stages + 1)
    }
    /// Dynamic shared memory of the dQ kernel (Q_SMEM in the .cu).
    pub fn q_smem_bytes(&self) -> u32 {
        let row = self.smem_row_bytes();
        1024 + 2 * self.q_block_m() * row
            + self.stages * 2 * self.q_block_n * row
            + self.barrier_bytes()
    }
}

/// Whether the sm_90a backward serves `class` (on a compute capability 9.0 device).
pub fn sm90_serves(class: &AttentionClass) -> bool {
    BWD_SM90_HEAD_DIMS.contains(&class.head_dim) && matches!(class.dtype, DType::Bf16 | DType::F16)
}

/// The kernels a plan picks for `class` in `mode` on a device of compute capability `arch`
/// ([`AttentionBackwardPlan::new`](super::AttentionBackwardPlan::new); the varlen plan in
/// [`BwdMode::Deterministic`]): on 9.0 the sm_90a pair with [`Sm90BwdTile::for_class`]'s
/// tile for the classes [`sm90_serves`], except deterministic softcap at D = 64 with a
/// causal mask and (until measured) D = 96; the portable kernels otherwise. That exception is measured (H200, B=4
/// H=32 S=4096, session 31, the dQ kernel folding 1 - tanh^2 into the score): the pair
/// 5.79 ms against the portable kernels' 4.08 causal, while non-causal it is the faster
/// (8.01 vs 9.04 ms), and at D = 128 in both (4.73 vs 7.69, 3.46 vs 3.76 ms causal).
/// Softcap costs the pair 4 MUFU operations a score in each kernel
/// (docs/design/attention-backward.md, "Softcap").
pub fn default_kernel(class: &AttentionClass, mode: BwdMode, arch: u32) -> BwdKernel {
    match Sm90BwdTile::for_class(class, mode) {
        Some(t) if arch == 90 && sm90_serves(class) && !portable_by_default(class, mode) => {
            BwdKernel::Sm90(t)
        }
        _ => BwdKernel::Portable,
    }
}

/// The classes the sm_90a pair serves but the portable kernels keep by default: the one it
/// serves more slowly (measured, [`default_kernel`]: deterministic softcap at D = 64,
/// causal) and D = 96 (built session 31, not yet run on a GPU).
fn portable_by_default(class: &AttentionClass, mode: BwdMode) -> bool {
    let slower = mode == BwdMode::Deterministic
        && class.softcap != 0.0
        && class.head_dim == 64
        && class.causal;
    slower || class.head_dim == 96
}

/// The NVRTC defines of the sm_90a backward module for `class` with `tile`.
pub fn sm90_bwd_defines(class: &AttentionClass, tile: &Sm90BwdTile) -> Vec<(String, String)> {
    let m = Masking::of(&class.problem(1, 1, 1));
    let b = |x: bool| if x { "1" } else { "0" }.to_string();
    vec![
        ("FM_HEAD_DIM".into(), tile.head_dim.to_string()),
        ("FM_DTYPE_BF16".into(), b(class.dtype == DType::Bf16)),
        ("FM_CAUSAL".into(), b(m.causal)),
        ("FM_WINDOW".into(), b(m.window)),
        ("FM_KV_BLOCK_M".into(), tile.kv_block_m.to_string()),
        ("FM_Q_BLOCK_N".into(), tile.q_block_n.to_string()),
        ("FM_STAGES".into(), tile.stages.to_string()),
        ("FM_DQ_MODE".into(), tile.dq.define().to_string()),
        ("FM_SOFTCAP".into(), b(m.softcap)),
        ("FM_PRODUCER".into(), tile.producer_warps.to_string()),
    ]
}

/// One class per compiled sm_90a variant (head dim × dtype × causal): the compile test's list.
pub fn all_sm90_bwd_classes() -> Vec<AttentionClass> {
    all_bwd_classes().into_iter().filter(sm90_serves).collect()
}

/// Tile configuration of the backward kernels for one head dim: the compile-time constants
/// of `flash_attn_bwd.cu` (FM_KV_WARPS, FM_KV_BLOCK_M, FM_Q_WARPS, FM_Q_BLOCK_N).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BwdTile {
    pub head_dim: u32,
    /// Warps of the dK/dV kernel; its key block is 16 per warp.
    pub kv_warps: u32,
    /// Query rows per step of the dK/dV kernel.
    pub kv_block_m: u32,
    /// Warps of the dQ kernel; its query block is 16 per warp.
    pub q_warps: u32,
    /// Keys per step of the dQ kernel.
    pub q_block_n: u32,
}

impl BwdTile {
    /// The tile of `head_dim`, or None where the backward has no kernel.
    pub fn for_head_dim(head_dim: usize) -> Option<BwdTile> {
        if !BWD_HEAD_DIMS.contains(&head_dim) {
            return None;
        }
        Some(BwdTile {
            head_dim: head_dim as u32,
            kv_warps: 4,
            // The dK/dV accumulators take 2·D/8·4 registers a thread: above D = 64, 32
            // query rows a step keep the score fragments within 255 registers.
            kv_block_m: if head_dim <= 64 { 64 } else { 32 },
            q_warps: 4,
            q_block_n: if head_dim <= 64 { 64 } else { 32 },
        })
    }
    /// Elements per shared-memory row (the kernel's PITCH).
    pub fn pitch(&self) -> u32 {
        if self.head_dim <= 64 {
            64
        } else {
            128
        }
    }
    /// Keys per dK/dV CTA.
    pub fn kv_block_n(&self) -> u32 {
        16 * self.kv_warps
    }
    /// Query rows per dQ CTA.
    pub fn q_block_m(&self) -> u32 {
        16 * self.q_warps
    }
    /// Dynamic shared memory of the dK/dV kernel (KV_SMEM in the .cu).
    pub fn kv_smem_bytes(&self) -> u32 {
        2 * self.pitch() * (2 * self.kv_block_n() + 4 * self.kv_block_m) + 16 * self.kv_block_m
    }
    /// Dynamic shared memory of the dQ kernel (Q_SMEM in the .cu).
    pub fn q_smem_bytes(&self) -> u32 {
        2 * self.pitch() * (2 * self.q_block_m() + 4 * self.q_block_n)
    }
}

/// The NVRTC defines of the backward module for `class` with `tile`.
pub fn bwd_defines(class: &AttentionClass, tile: &BwdTile) -> Vec<(String, String)> {
    let m = Masking::of(&class.problem(1, 1, 1));
    let b = |x: bool| if x { "1" } else { "0" }.to_string();
    vec![
        ("FM_HEAD_DIM".into(), tile.head_dim.to_string()),
        ("FM_DTYPE_BF16".into(), b(class.dtype == DType::Bf16)),
        ("FM_CAUSAL".into(), b(m.causal)),
        ("FM_WINDOW".into(), b(m.window)),
        ("FM_SOFTCAP".into(), b(m.softcap)),
        ("FM_KV_WARPS".into(), tile.kv_warps.to_string()),
        ("FM_KV_BLOCK_M".into(), tile.kv_block_m.to_string()),
        ("FM_Q_WARPS".into(), tile.q_warps.to_string()),
        ("FM_Q_BLOCK_N".into(), tile.q_block_n.to_string()),
    ]
}

/// One class per compiled variant (head dim × dtype × masking): the compile tests' list.
pub fn all_bwd_classes() -> Vec<AttentionClass> {
    let mut out = Vec::new();
    for &d in &BWD_HEAD_DIMS {
        for dtype in [DType::Bf16, DType::F16] {
            for (causal, window, softcap) in [
                (false, crate::problem::NO_WINDOW, 0.0),
                (true, crate::problem::NO_WINDOW, 0.0),
                (true, (16, -1), 0.0),
                (false, crate::problem::NO_WINDOW, 30.0),
                (true, crate::problem::NO_WINDOW, 30.0),
                (true, (16, -1), 30.0),
            ] {
                out.push(AttentionClass {
                    dtype,
                    head_dim: d,
                    heads_q: 1,
                    heads_kv: 1,
                    causal,
                    softmax_scale: None,
                    window,
                    softcap,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_sm80_shared_memory() {
        for &d in &BWD_HEAD_DIMS {
            let t = BwdTile::for_head_dim(d).unwrap();
            assert!(
                t.kv_smem_bytes() <= crate::attention::prefill::abi::MAX_SMEM_SM80,
                "{t:?}"
            );
            assert!(
                t.q_smem_bytes() <= crate::attention::prefill::abi::MAX_SMEM_SM80,
                "{t:?}"
            );
            assert_eq!(t.kv_block_m % 16, 0);
            assert_eq!(t.q_block_n % 16, 0);
        }
        assert!(BwdTile::for_head_dim(256).is_none());
        assert!(BwdTile::for_head_dim(80).is_none());
    }

    #[test]
    fn defines_follow_the_masking() {
        let c = all_bwd_classes();
        assert_eq!(c.len(), BWD_HEAD_DIMS.len() * 2 * 6);
        let get = |d: &[(String, String)], k: &str| {
            d.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        let t = BwdTile::for_head_dim(64).unwrap();
        let mut w = c[0];
        w.window = (8, 4);
        w.causal = false;
        let d = bwd_defines(&w, &t);
        assert_eq!(get(&d, "FM_CAUSAL"), "1");
        assert_eq!(get(&d, "FM_WINDOW"), "1");
        assert_eq!(get(&d, "FM_SOFTCAP"), "0");
        let d = bwd_defines(&c[0], &t);
        assert_eq!(get(&d, "FM_CAUSAL"), "0");
        assert_eq!(get(&d, "FM_WINDOW"), "0");
    }

    /// A bf16 GQA class (4 query heads on 2) without a window.
    fn gqa_class(head_dim: usize, causal: bool, softcap: f32) -> AttentionClass {
        AttentionClass {
            dtype: DType::Bf16,
            head_dim,
            heads_q: 4,
            heads_kv: 2,
            causal,
            softmax_scale: None,
            window: crate::problem::NO_WINDOW,
            softcap,
        }
    }

    #[test]
    fn softcap_runs_on_sm90_tiles_that_fit() {
        let class = |d, softcap| gqa_class(d, true, softcap);
        for d in BWD_SM90_HEAD_DIMS {
            let (plain, capped) = (class(d, 0.0), class(d, 30.0));
            assert!(sm90_serves(&plain) && sm90_serves(&capped));
            for mode in [BwdMode::Fast, BwdMode::Deterministic] {
                // The plain class takes the mode's production tile; the softcapped one the
                // same tile with 64 query rows a dK/dV step and, for the dQ kernel, 64 keys
                // a step (128 spill with the tanh).
                let t = Sm90BwdTile::for_class(&plain, mode).unwrap();
                assert_eq!(t, Sm90BwdTile::for_mode(d, mode).unwrap());
                let tc = Sm90BwdTile::for_class(&capped, mode).unwrap();
                assert!(tc.serves(&capped) && tc.is_valid(), "{tc:?}");
                let q_block_n = if t.dq == Sm90Dq::Kernel {
                    64
                } else {
                    t.q_block_n
                };
                assert_eq!(
                    tc,
                    Sm90BwdTile {
                        kv_block_m: 64,
                        q_block_n,
                        ..t
                    }
                );
                let get = |defs: Vec<(String, String)>| {
                    defs.into_iter().find(|(n, _)| n == "FM_SOFTCAP").unwrap().1
                };
                assert_eq!(get(sm90_bwd_defines(&plain, &t)), "0");
                assert_eq!(get(sm90_bwd_defines(&capped, &tc)), "1");
            }
            // Every lab tile that serves a softcap class keeps 64 query rows a step (and
            // 64 keys a dQ-kernel step).
            for t in Sm90BwdTile::lab_tiles(d) {
                let small = t.kv_block_m == 64 && (t.dq != Sm90Dq::Kernel || t.q_block_n == 64);
                assert_eq!(t.serves(&capped), small, "{t:?}");
            }
        }
        assert!(sm90_serves(&class(96, 0.0)) && !sm90_serves(&class(32, 0.0)));
    }

    #[test]
    fn default_kernel_is_sm90_on_9_0_but_deterministic_causal_softcap_at_d64() {
        for mode in [BwdMode::Fast, BwdMode::Deterministic] {
            for d in [32, 64, 96, 128] {
                for causal in [false, true] {
                    for cap in [0.0, 30.0] {
                        let c = gqa_class(d, causal, cap);
                        assert_eq!(default_kernel(&c, mode, 80), BwdKernel::Portable);
                        let slower =
                            mode == BwdMode::Deterministic && cap != 0.0 && d == 64 && causal;
                        let want = sm90_serves(&c) && !slower && d != 96;
                        let got = default_kernel(&c, mode, 90);
                        assert_eq!(got.is_sm90(), want, "{c:?} {mode:?}");
                        if want {
                            assert_eq!(
                                got,
                                BwdKernel::Sm90(Sm90BwdTile::for_class(&c, mode).unwrap())
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_lab_has_a_producer_build_of_each_mode_for_dense_calls() {
        for d in [64, 128] {
            let class = gqa_class(d, true, 0.0);
            let prod = Sm90BwdTile::for_head_dim(d).unwrap();
            let lab = Sm90BwdTile::lab_tiles(d);
            let producers: Vec<_> = lab.iter().filter(|t| t.producer()).collect();
            assert_eq!(producers.len(), 4, "{producers:?}");
            for producer_warps in [1, 4] {
                assert!(producers.iter().any(|t| **t
                    == Sm90BwdTile {
                        producer_warps,
                        ..prod
                    }));
                assert!(producers.iter().any(|t| t.producer_warps == producer_warps
                    && t.dq == Sm90Dq::Atomic
                    && t.kv_block_m == 64
                    && t.stages == 3));
            }
            for t in producers {
                assert!(t.is_valid() && t.serves(&class), "{t:?}");
                assert_eq!(t.kv_threads(), 384);
                let defs = sm90_bwd_defines(&class, t);
                let warps = t.producer_warps.to_string();
                assert!(defs.contains(&("FM_PRODUCER".into(), warps)));
            }
            assert!(!Sm90BwdTile {
                producer_warps: 2,
                ..prod
            }
            .is_valid());
            // The production tiles do not load through a producer.
            assert_eq!(prod.kv_threads(), 256);
            assert!(sm90_bwd_defines(&class, &prod).contains(&("FM_PRODUCER".into(), "0".into())));
        }
    }

    #[test]
    fn head_dim_96_runs_on_whole_panels() {
        let d128 = Sm90BwdTile::for_head_dim(128).unwrap();
        let t = Sm90BwdTile::for_head_dim(96).unwrap();
        assert_eq!(
            t,
            Sm90BwdTile {
                head_dim: 96,
                ..d128
            }
        );
        // Rows are held as two 64-column panels, as at D = 128.
        assert_eq!(t.kv_smem_bytes(), d128.kv_smem_bytes());
        assert_eq!(t.q_smem_bytes(), d128.q_smem_bytes());
        assert_eq!(Sm90BwdTile::for_mode(96, BwdMode::Deterministic), Some(t));
        // Fast mode: the fused dQ with 64 query rows a step, as at D = 128.
        let fast = Sm90BwdTile::for_mode(96, BwdMode::Fast).unwrap();
        assert_eq!(
            fast,
            Sm90BwdTile {
                head_dim: 96,
                ..Sm90BwdTile::for_mode(128, BwdMode::Fast).unwrap()
            }
        );
        let lab = Sm90BwdTile::lab_tiles(96);
        assert!(lab.len() >= 4 && lab[0] == t, "{lab:?}");
        assert!(lab.iter().all(|t| !t.producer() && t.is_valid()), "{lab:?}");
        assert!(lab.iter().any(|t| t.dq == Sm90Dq::Ordered));
        assert!(!Sm90BwdTile {
            producer_warps: 1,
            ..t
        }
        .is_valid());
        let class = gqa_class(96, true, 0.0);
        assert!(sm90_serves(&class));
        assert_eq!(
            default_kernel(&class, BwdMode::Fast, 90),
            BwdKernel::Portable
        );
        let defs = sm90_bwd_defines(&class, &t);
        assert!(defs.contains(&("FM_HEAD_DIM".into(), "96".into())));
    }
}
