// flashmoe sm_90a attention — compile-time configuration and memory layouts.
//
// Holds: the defines a variant is specialised by (defaults, checks), the constants derived
// from them (tile sizes, register split), the shared-memory layout (Q, the K/V ring, the O
// staging rows, the mbarriers and their addresses, the two work-tile records), the ring's
// per-slot parities (SlotPhases) and the global-memory workspace layout (WS_*). Everything
// the roles agree on, nothing that runs. Included first by every fm90_*.cuh and by
// flash_attn_fwd_sm90.cu; the host mirrors SMEM_BYTES and WS_BYTES in config.rs (Sm90Tile).
#pragma once

// Defines (the table of variants is config.rs `sm90_tile`; FLASHMOE_SM90_TILE overrides it
// for A/B timing of the values the table varies per head dim):
//   FM_HEAD_DIM    D: 64, 96, 128 or 256 (K/Q/V rows are loaded as 64-column panels, each a
//                  128-byte swizzled row; at D = 96 the second panel's last 32 columns are
//                  the tensor maps' zero fill, read by no product; at D = 256 each warp
//                  stages its O rows where its Q rows were: STAGE_IN_Q)
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (storage of Q, K, V, O; accumulation is fp32)
//   FM_CAUSAL      0/1, bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q
//   FM_BLOCK_N     keys per K/V tile (64..256, multiple of 64: the wgmma N of S = Q K^T)
//   FM_STAGES      depth of the K/V ring (2..4)
//   FM_CONSUMERS   consumer warpgroups (2 or 3); each owns 64 query rows, BLOCK_M = 64 * CONSUMERS
//   FM_PINGPONG    1: the consumer warpgroups take turns issuing their GEMMs (named
//                  barriers, round robin), so one's softmax overlaps the others' GEMMs
//   FM_Q_REGS      1: each consumer reads its Q rows into registers once per work tile
//                  (ldmatrix) and S = Q K^T takes A from registers (wgmma RS): a third less
//                  shared-memory traffic per QK^T, and Q is released at the tile's start
//   FM_VARLEN      1: packed variable-length batches (cu_seqlens; see the ABI note in
//                  flash_attn_fwd_sm90.cu): per-sequence lengths, offsets and causal diagonal
//                  travel in the posted work tile; O is stored without TMA (a box would
//                  write the next sequence's rows) and the last wave is not split.
//   FM_WINDOW      1: a sliding window (see the ABI note in flash_attn_fwd_sm90.cu): two int
//                  parameters window_left, window_right; row i sees keys from
//                  i + seqlen_k - seqlen_q - left to that + left + right. Needs FM_CAUSAL
//                  (the upper diagonal, shifted by right; an unbounded right side is a
//                  right of seqlen_q). Work tiles visit only the key tiles their rows can
//                  see, and the lowest ones are masked too; the work-tile record carries
//                  kt_end (varlen: the sequence's key rows start at the first visited tile)
//                  and the last wave is not split.
//   FM_SOFTCAP     1: logit softcap, one float parameter softcap_log2 (= softcap * log2 e):
//                  scores become softcap_log2 * tanh(q.k * softmax_scale_log2), the kernel's
//                  scale parameter being scale / softcap (tanh.approx.f32, as FlashAttention-3).
//   FM_TRACE       1: development timeline (fm90_trace.cuh, examples/sm90_trace.rs). Never
//                  set by the production table.
// Always on (their switches were retired once every production tile used them; git
// history keeps the other side): the intra-warpgroup software pipeline (FM_PIPE), the lazy
// O rescale (FM_LAZY_RESCALE), MUFU ex2 for every exponential (FM_POLY_EXP=0), the split of
// the last wave (FM_SPLIT, FM_SPLIT_MIN_KV_TILES) and the causal tail group
// (FM_CAUSAL_TAIL_GROUP). A stale -D of one of them is an error, not a silent no-op.
#if defined(FM_PIPE) || defined(FM_LAZY_RESCALE) || defined(FM_POLY_EXP) || defined(FM_SPLIT) || \
    defined(FM_SPLIT_MIN_KV_TILES) || defined(FM_CAUSAL_TAIL_GROUP)
#error "retired sm_90a switch defined (see fm90_config.cuh): the kernel no longer reads it"
#endif
#ifndef FM_HEAD_DIM
#error "FM_HEAD_DIM must be defined"
#endif
#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#ifndef FM_CAUSAL
#define FM_CAUSAL 0
#endif
#ifndef FM_BLOCK_N
#define FM_BLOCK_N 128
#endif
#ifndef FM_STAGES
#define FM_STAGES 2
#endif
#ifndef FM_CONSUMERS
#define FM_CONSUMERS 2
#endif
#ifndef FM_PINGPONG
#define FM_PINGPONG 0
#endif
#ifndef FM_Q_REGS
#define FM_Q_REGS 0
#endif
#ifndef FM_VARLEN
#define FM_VARLEN 0
#endif
#ifndef FM_WINDOW
#define FM_WINDOW 0
#endif
#ifndef FM_SOFTCAP
#define FM_SOFTCAP 0
#endif
#ifndef FM_TRACE
#define FM_TRACE 0
#endif
#include "fm_sm90.cuh"

namespace fm90 {

constexpr int D = FM_HEAD_DIM;
constexpr int BN = FM_BLOCK_N;
constexpr int STAGES = FM_STAGES;
constexpr int NCW = FM_CONSUMERS;
constexpr int BM = 64 * NCW;
constexpr int THREADS = 128 * (NCW + 1);
constexpr bool CAUSAL = FM_CAUSAL != 0;
constexpr bool VARLEN = FM_VARLEN != 0;
constexpr bool WINDOW = FM_WINDOW != 0;
constexpr bool SOFTCAP = FM_SOFTCAP != 0;

constexpr int DH = (D + 63) / 64;      // 64-column panels of a row (one 128-byte swizzle row each)
constexpr int HALF_Q = BM * 128;       // bytes of one half of the Q tile
constexpr int HALF_KV = BN * 128;      // bytes of one half of a K or V tile
constexpr int Q_BYTES = DH * HALF_Q;
constexpr int KV_BYTES = DH * HALF_KV;
constexpr int OFF_K = Q_BYTES;
constexpr int OFF_V = OFF_K + STAGES * KV_BYTES;
// The epilogue stages each consumer warp's 16 rows of O in shared memory, then either one
// TMA store per 64 columns writes them (O_TMA_STORE), or the warp copies them out as
// whole 16-byte chunks of contiguous rows. Measured on the H100 (builds alternated in one call): the TMA
// store gains 1-2 % at D=128 S <= 1024; at D=64 ptxas then schedules the steady-state
// loop differently, and the build measured 1-3 % slower at S = 8192.
// Varlen: a 16-row box clipped only at the packed tensor's end would write the next
// sequence's first rows, so those variants store O with plain (row-checked) stores.
constexpr bool O_TMA_STORE = D >= 128 && !VARLEN;
// TMA: DH boxes of 16 rows x 128 bytes in the 128B swizzle (which also keeps the 8 rows a
// fragment store touches in different banks), 1024-byte aligned as the swizzle atom
// requires. Plain: rows padded by 16 bytes, for the same bank spread.
constexpr int STAGE_PITCH = 2 * D + (O_TMA_STORE ? 0 : 16);
constexpr int STAGE_WARP_BYTES = 16 * STAGE_PITCH;
// D = 256: Q (64 KB at BM = 128) and a 2-slot ring of 64-key K/V tiles (128 KB) leave no
// room for 64 KB of staged O. Each warp stages its 16 rows of O in its own 16 Q rows (the
// same 128-byte panels, so the TMA store boxes are the Q tile's rows), which its
// warpgroup no longer reads once its last S is done; Q is then released only after the
// O stores have read them (consume()), so the next work tile's Q load waits for them.
constexpr bool STAGE_IN_Q = D > 128;
constexpr int OFF_STAGE = OFF_V + STAGES * KV_BYTES;
constexpr int OFF_BAR = OFF_STAGE + (STAGE_IN_Q ? 0 : BM * STAGE_PITCH);
constexpr int NBAR = 2 + 4 * STAGES;
// The work tiles the producer posts (32 bytes each), two records used in turn: tile i in
// record i % 2 (the next tile is written while the consumers still read the current one).
constexpr int OFF_TILE = OFF_BAR + 8 * NBAR;
__device__ __forceinline__ u32 tile_record(u32 base, int i) { return base + OFF_TILE + (i & 1) * 32; }
constexpr int SMEM_BYTES = 1024 + 128 * DH * (BM + 2 * STAGES * BN) + (STAGE_IN_Q ? 0 : BM * STAGE_PITCH) +
                           8 * (2 + 4 * STAGES) + 64;
static_assert(!STAGE_IN_Q || (O_TMA_STORE && !FM_Q_REGS), "O staged in Q: TMA stores, Q read from shared memory");
// Register split (setmaxnreg): the producer gives registers back to the CTA's pool and the
// consumers take them from it, so the split must fit in what the launch allocated: the
// __launch_bounds__ cap (65536 / THREADS, rounded down to a multiple of 8) per thread.
// setmaxnreg.inc waits until the pool has the registers: a split above the allocation
// hangs every consumer (a 32-register producer did at D=128: 4096 + 61440 > 64512).
constexpr int LAUNCH_REGS = (65536 / THREADS) / 8 * 8;
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = NCW == 2 ? 240 : 160;

static_assert((D % 64 == 0 || D == 96) && D >= 64 && D <= 256, "head dim must be 64, 96, 128, 192 or 256");
static_assert(BN % 64 == 0 && BN >= 64 && BN <= 256, "BLOCK_N must be 64, 128, 192 or 256");
static_assert(STAGES >= 2 && STAGES <= 4, "STAGES must be 2..4");
static_assert(NCW == 2 || NCW == 3, "2 or 3 consumer warpgroups");
static_assert(!WINDOW || CAUSAL, "FM_WINDOW runs on the causal path (an unbounded right side is a shift)");
static_assert(SMEM_BYTES == 1024 + OFF_TILE + 64, "smem formula");
static_assert(OFF_TILE % 16 == 0, "the posted work tile is two 16-byte shared stores");
static_assert(!O_TMA_STORE || (OFF_STAGE % 1024 == 0 && STAGE_WARP_BYTES % 1024 == 0),
              "staging boxes on swizzle atoms");
static_assert(128 * (PRODUCER_REGS + NCW * CONSUMER_REGS) <= LAUNCH_REGS * THREADS, "register split");

// ---- shared-memory barriers and the K/V ring ----
struct Bars {
    u32 base;
    __device__ u32 q_full() const { return base; }
    __device__ u32 q_empty() const { return base + 8 * (1 + 4 * STAGES); }
    __device__ u32 k_full(int s) const { return base + 8 * (1 + s); }
    __device__ u32 v_full(int s) const { return base + 8 * (1 + STAGES + s); }
    __device__ u32 k_empty(int s) const { return base + 8 * (1 + 2 * STAGES + s); }
    __device__ u32 v_empty(int s) const { return base + 8 * (1 + 3 * STAGES + s); }
};

// Per-slot state of the K/V ring, carried across work tiles (persistent grid). Every work
// tile starts at slot 0, so inside a tile the slot sequence 0, 1, .. is known from the
// loop counter alone (and stays on the uniform datapath); what carries over is, per slot,
// the parity of its uses so far and whether it was used at all.
struct SlotPhases {
    u32 par = 0;   // bit s: number of earlier uses of slot s, mod 2
    u32 used = 0;  // bit s: slot s was used by an earlier work tile
    // After a work tile of n key tiles: slot s was used ceil((n - s) / STAGES) times.
    __device__ void advance(int n) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            const int cnt = n > s ? (n - s + STAGES - 1) / STAGES : 0;
            par ^= (u32)(cnt & 1) << s;
            if (cnt > 0) used |= 1u << s;
        }
    }
    // Parity of the use of slot s in round `round` (= it / STAGES) of this tile.
    __device__ u32 parity(int s, int round) const { return ((par >> s) ^ (u32)round) & 1u; }
    // Whether the use of slot s in round `round` follows an earlier one.
    __device__ bool reused(int s, int round) const { return round > 0 || ((used >> s) & 1u); }
};

// ---- global-memory workspace ----
// The split of the last wave over key ranges (fm90_scheduler.cuh) and the threshold it
// applies from. Measured (H100, 6 alternated rounds, paired): +1-4 % at
// D=128 S >= 4096, but -1.4 % at S = 1024 (each slot pays 2-3 tile starts and a merge,
// against a 16th wave of 8 key tiles) and -3 % at D=64 S <= 1024, where ptxas also
// scheduled the steady-state loop worse (10 exponentials after the P V wait). So only
// D >= 128 non-causal splits, and only tiles of at least SPLIT_MIN_KV_TILES key tiles. Cutting
// from 8 key tiles, re-measured after the producer schedule: S=1024 -3 %, S=2048 -0.5 %; a
// cut segment costs about 1.9 iterations besides its keys (a whole tile 0.74), the merge's
// round trip through L2.
// (Varlen: not split; the work-tile record carries the sequence instead of the split.
// Window: not split; work tiles of unequal key ranges.)
// (D = 256: the merge's registers spill beside 128 O accumulators a thread; not split.)
constexpr bool SPLIT = !CAUSAL && D == 128 && !VARLEN && !WINDOW;
constexpr int SPLIT_MIN_KV_TILES = 32;
// Boundary records in the workspace: one per slot, so the grid splits only up to this.
constexpr int SPLIT_MAX_CTAS = 132;
constexpr int PART_CHUNKS = D / 8 + 1;  // float4s per thread: O (D / 2 floats), then m[2], l[2]

// The launch's workspace (the kernel's last parameter; the host sizes it with the same
// formula, Sm90Tile::workspace_bytes in config.rs). No state lives in module globals, so
// launches of one module on different streams, each with its own workspace, are
// independent. Every byte is zero before a launch and zero again after it (the dispenser
// and the split tickets reset themselves), so one zeroed workspace serves any number of
// stream-ordered launches and CUDA-graph replays.
//   [0, 8)                 the rank dispenser (draw_rank)
//   [WS_SYNC, WS_PARTS)    SPLIT: per boundary record (boundary, consumer, warp) a ticket
//                          and a ready flag
//   [WS_PARTS, WS_BYTES)   SPLIT: per record [chunk][lane] float4s: the first part's O, m, l
constexpr int WS_SYNC = 256;
constexpr int WS_SYNC_BYTES = SPLIT ? SPLIT_MAX_CTAS * NCW * 4 * 2 * 4 : 0;
constexpr int WS_PARTS = WS_SYNC + (WS_SYNC_BYTES + 255) / 256 * 256;
constexpr int WS_BYTES = WS_PARTS + (SPLIT ? SPLIT_MAX_CTAS * NCW * 4 * PART_CHUNKS * 32 * 16 : 0);

}  // namespace fm90
