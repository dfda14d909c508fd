// flashmoe — FlashAttention forward for Hopper (sm_90a): TMA loads into an mbarrier-guarded
// shared-memory ring, warpgroup MMAs (wgmma) with fp32 accumulators, warp specialisation.
//
// Compiled at run time by NVRTC for sm_90a only; specialised by defines (the table of
// variants lives in crates/flashmoe/src/attention/config.rs, `sm90_tile`):
//
//   FM_HEAD_DIM    D: 64 or 128 (a multiple of 64: K/Q/V rows are loaded as 64-column halves,
//                  each a 128-byte swizzled row)
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (storage of Q, K, V, O; accumulation is fp32)
//   FM_CAUSAL      0/1, bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q
//   FM_BLOCK_N     keys per K/V tile (64..256, multiple of 64: the wgmma N of S = Q K^T)
//   FM_STAGES      depth of the K/V ring (2..4)
//   FM_CONSUMERS   consumer warpgroups (2); each owns 64 query rows, BLOCK_M = 64 * CONSUMERS
//   FM_PIPE        1: S of tile i+1 is issued before the softmax of tile i+1 while P V of
//                  tile i runs (intra-warpgroup overlap); 0: serial S, softmax, P V
//   FM_PINGPONG    1 (with FM_PIPE): the consumer warpgroups take turns issuing their GEMMs
//                  (named barriers, round robin), so one's softmax overlaps the others' GEMMs
//   FM_POLY_EXP    0..8: that many eighths of the exponentials are computed with an FMA
//                  polynomial instead of MUFU ex2 (relieves the MUFU unit, 16/clk/SM)
//   FM_LAZY_RESCALE 1: a row's reference max moves only when the row max passes it by more
//                  than RESCALE_SLACK, and a warp skips the O rescale when none of its rows
//                  moved (after the first key tiles, almost every tile)
//   FM_Q_REGS      1: each consumer reads its Q rows into registers once per work tile
//                  (ldmatrix) and S = Q K^T takes A from registers (wgmma RS): a third less
//                  shared-memory traffic per QK^T, and Q is released at the tile's start
//   FM_TRACE       1: development timeline (examples/sm90_trace.rs): clock64 stamps at the
//                  phase boundaries of each warpgroup's work tiles into fm90_trace. Never
//                  set by the production table.
//
// ABI (extern "C" flash_attn_fwd_sm90):
//   (const __grid_constant__ FmTensorMap tm_q, tm_k, tm_v, tm_o, u16* o, float* lse,
//    int seqlen_q, int seqlen_k, int heads_q, int heads_kv, float softmax_scale_log2,
//    int batch, unsigned char* workspace)
//   tm_q: 4-D tensor map over q (batch, seqlen_q, heads_q, D) — dims innermost first
//         (D, heads_q, seqlen_q, batch), box (64, 1, BLOCK_M, 1), 128B swizzle, zero fill;
//   tm_k, tm_v: the same over k / v (D, heads_kv, seqlen_k, batch), box (64, 1, BLOCK_N, 1);
//   tm_o: the same over o (D, heads_q, seqlen_q, batch), box (64, 1, 16, 1): with
//         O_TMA_STORE each consumer warp stores its 16 rows with TMA (rows past Sq are not
//         written); otherwise unused, and o is written with plain stores.
//   o: (batch, seqlen_q, heads_q, D) 16-bit; lse: (batch, heads_q, seqlen_q) f32, natural log.
//   Grid (G, 1, 1), G = the number of work tiles or fewer (persistent: one CTA per SM).
//   Work tile of rank r = (query block, head, batch) = (r % nb, r / nb % Hq, r / (nb * Hq))
//   with nb = ceil(Sq / BLOCK_M); causal: query blocks last to first (heaviest first), and
//   from nb >= 6 in groups of heads, each block of all the group's heads before the next
//   (decode_tile). Causal query blocks are aligned to the last query row
//   (rounded up to a multiple of 16, Sq16): block b covers rows [Sq16 - (b+1) BLOCK_M,
//   Sq16 - b BLOCK_M). So a ragged Sq makes the first block short (rows that see the fewest
//   keys) instead of the last one (rows that see every key tile, with idle warpgroups).
//   The first block starts below row 0: Q rows < 0 are TMA-filled with zeros, warpgroups
//   with no row >= 0 pass (pass_tile), and warps with no row >= 0 store nothing. The
//   rounding to 16 keeps every warp's 16 rows on one side of row 0: a TMA store whose box
//   starts at a negative row raised an illegal instruction (run 46).
//   Ranks are handed out by a dispenser in the workspace (one atomicAdd per tile): a CTA
//   takes the next rank when it starts a tile, so CTAs that drew cheap (causal) tiles take
//   more of them. The last CTA to find no work left resets the dispenser. D >= 128
//   non-causal with >= 32 key tiles per work tile: the last G + R tiles are cut over key
//   ranges into G slots, one rank each, whose parts merge through records in the workspace
//   (SPLIT, make_schedule). workspace: WS_BYTES of global memory, zero before the launch
//   and left zero by it; launches that may overlap (other streams) need their own.
//   Block 128 * (CONSUMERS + 1) threads.
//   Rows with no visible key: O = 0, LSE = -inf. Same contract as flash_attn_fwd.cu (v1).
//
// Roles: warpgroup 0 is the producer (one thread issues every TMA load; the warpgroup gives
// its registers away with setmaxnreg.dec); warpgroups 1..CONSUMERS each own 64 query rows:
//   S = Q K^T     wgmma SS (Q and K K-major from swizzled smem), N = BLOCK_N
//   softmax       online, fp32, log2 domain (scale*log2e folded into one FFMA before ex2)
//   O += P V      wgmma RS: P packed to 16 bit in registers (the accumulator layout of two
//                 8-column blocks is the A-fragment layout of one k16 step), V MN-major
// Barriers per ring slot: k_full, v_full (TMA bytes landed; V separately so S can start
// first) and k_empty, v_empty (one arrival per consumer warp once its wgmmas reading that
// half of the slot are complete). K/V tiles are visited last to first so the masked tiles come first.
// Per work tile: q_full (the posted tile is readable and Q landed; a tile that sees no key
// loads no Q) and q_empty (one arrival per consumer thread after its last S = Q K^T: Q and
// the posted tile may be replaced).
//
// Shared memory (dynamic, one formula mirrored by Sm90Tile::shared_mem_bytes in config.rs):
//   bytes = 1024 + 2 * D * (BLOCK_M + 2 * STAGES * BLOCK_N) + BLOCK_M * (2 * D + PAD)
//           + 8 * (2 + 4 * STAGES) + 64,   PAD = 0 with O_TMA_STORE (D >= 128), else 16
//   (1024: slack to align the base to the 128B-swizzle atom; Q, K ring, V ring, the O
//   staging rows of the epilogue, barriers, the two work-tile records the producer posts.)

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
#ifndef FM_PIPE
#define FM_PIPE 1
#endif
#ifndef FM_PINGPONG
#define FM_PINGPONG 0
#endif
#ifndef FM_POLY_EXP
#define FM_POLY_EXP 0
#endif
#ifndef FM_LAZY_RESCALE
#define FM_LAZY_RESCALE 0
#endif
#ifndef FM_Q_REGS
#define FM_Q_REGS 0
#endif
#ifndef FM_TRACE
#define FM_TRACE 0
#endif
#include "fm_sm90.cuh"

#if FM_TRACE
// The timeline of FM_TRACE (layout in namespace fm90 below); unmangled, so the host can
// find it by name (cuModuleGetGlobal).
extern "C" {
__device__ long long fm90_trace[132 * (FM_CONSUMERS + 1) * 32 * 12];
}
#endif

namespace fm90 {

constexpr int D = FM_HEAD_DIM;
constexpr int BN = FM_BLOCK_N;
constexpr int STAGES = FM_STAGES;
constexpr int NCW = FM_CONSUMERS;
constexpr int BM = 64 * NCW;
constexpr int THREADS = 128 * (NCW + 1);
constexpr bool CAUSAL = FM_CAUSAL != 0;
// Causal work tiles taller than a key tile: some warpgroups cannot see the first key tiles
// visited, and pass them (consume()).
constexpr bool SKIP_MASKED = CAUSAL && FM_PIPE && BM > FM_BLOCK_N;
// The V wait of the pipelined loop takes a data dependency on the softmax (zero_after):
// without it, ptxas hoists the wait, and the P.V wait behind it, above the softmax in these
// variants (sm90_sass.py event order: "W1 b3 *2 W0 e10 b e56" instead of "e66 b W0"). The
// others keep (almost) all exponentials before the wait on their own, and measured 1-2 %
// faster so (run 42). (Run 61 again: the non-causal variants with the dependency measured
// 1-4 % slower than without, though without it ptxas put the D=64 wait above the softmax.)
constexpr bool ORDER_V_WAIT = SKIP_MASKED;

constexpr int DH = D / 64;             // 64-column halves of a row (one 128-byte swizzle row each)
constexpr int HALF_Q = BM * 128;       // bytes of one half of the Q tile
constexpr int HALF_KV = BN * 128;      // bytes of one half of a K or V tile
constexpr int Q_BYTES = DH * HALF_Q;
constexpr int KV_BYTES = DH * HALF_KV;
constexpr int OFF_K = Q_BYTES;
constexpr int OFF_V = OFF_K + STAGES * KV_BYTES;
// The epilogue stages each consumer warp's 16 rows of O in shared memory, then either one
// TMA store per 64 columns writes them (O_TMA_STORE), or the warp copies them out as
// whole 16-byte chunks of contiguous rows. Measured on the H100 (runs 46-50): the TMA
// store gains 1-2 % at D=128 S <= 1024; at D=64 ptxas then schedules the steady-state
// loop differently, and the build measured 1-3 % slower at S = 8192 (run 50).
constexpr bool O_TMA_STORE = D >= 128;
// TMA: DH boxes of 16 rows x 128 bytes in the 128B swizzle (which also keeps the 8 rows a
// fragment store touches in different banks), 1024-byte aligned as the swizzle atom
// requires. Plain: rows padded by 16 bytes, for the same bank spread.
constexpr int STAGE_PITCH = 2 * D + (O_TMA_STORE ? 0 : 16);
constexpr int STAGE_WARP_BYTES = 16 * STAGE_PITCH;
constexpr int OFF_STAGE = OFF_V + STAGES * KV_BYTES;
constexpr int OFF_BAR = OFF_STAGE + BM * STAGE_PITCH;
constexpr int NBAR = 2 + 4 * STAGES;
// The work tiles the producer posts (32 bytes each), two records used in turn: tile i in
// record i % 2 (the next tile is written while the consumers still read the current one).
constexpr int OFF_TILE = OFF_BAR + 8 * NBAR;
__device__ __forceinline__ u32 tile_record(u32 base, int i) { return base + OFF_TILE + (i & 1) * 32; }
constexpr int SMEM_BYTES =
    1024 + 2 * D * (BM + 2 * STAGES * BN) + BM * STAGE_PITCH + 8 * (2 + 4 * STAGES) + 64;
// Register split (setmaxnreg): the producer gives registers back to the CTA's pool and the
// consumers take them from it, so the split must fit in what the launch allocated: the
// __launch_bounds__ cap (65536 / THREADS, rounded down to a multiple of 8) per thread.
// setmaxnreg.inc waits until the pool has the registers: a split above the allocation
// hangs every consumer (a 32-register producer did at D=128, run 38: 4096 + 61440 > 64512).
constexpr int LAUNCH_REGS = (65536 / THREADS) / 8 * 8;
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = NCW == 2 ? 240 : 160;

static_assert(D % 64 == 0 && D >= 64 && D <= 256, "head dim must be 64, 128, 192 or 256");
static_assert(BN % 64 == 0 && BN >= 64 && BN <= 256, "BLOCK_N must be 64, 128, 192 or 256");
static_assert(STAGES >= 2 && STAGES <= 4, "STAGES must be 2..4");
static_assert(NCW == 2 || NCW == 3, "2 or 3 consumer warpgroups");
static_assert(!FM_PINGPONG || FM_PIPE, "ping-pong needs FM_PIPE");
static_assert(FM_POLY_EXP >= 0 && FM_POLY_EXP <= 8, "FM_POLY_EXP is a count of eighths");
static_assert(SMEM_BYTES == 1024 + OFF_TILE + 64, "smem formula");
static_assert(OFF_TILE % 16 == 0, "the posted work tile is two 16-byte shared stores");
static_assert(!O_TMA_STORE || (OFF_STAGE % 1024 == 0 && STAGE_WARP_BYTES % 1024 == 0),
              "staging boxes on swizzle atoms");
static_assert(128 * (PRODUCER_REGS + NCW * CONSUMER_REGS) <= LAUNCH_REGS * THREADS, "register split");

// ---- development timeline (FM_TRACE) ----
// Thread 0 of each warpgroup stamps clock64 (the SM's cycle counter, shared by the CTA's
// warpgroups) at the phase boundaries of its first TRACE_TILES work tiles, in the first
// TRACE_CTAS CTAs. Layout [cta][warpgroup][tile][event]; events below (consumer / producer).
// examples/sm90_trace.rs reads the array back and reports the phase durations.
enum TraceEvent {
    TR_POSTED = 0,     // consumer: q_full passed (tile readable); producer: tile posted
    TR_K0 = 1,         // consumer: first computed K landed; producer: first K issued
    TR_S0 = 2,         // first S complete; producer: Q issued
    TR_SOFTMAX0 = 3,   // its softmax done
    TR_V0 = 4,         // its V landed; producer: the first V issued
    TR_K1 = 5,         // the second computed K landed (first loop iteration); producer: issued
    TR_LOOP_END = 6,   // last loop iteration done (the final P V not yet issued); producer:
                       // the tile's last V issued
    TR_LAST_PV = 7,    // final P V complete; producer: the next tile decoded
    TR_EPILOGUE = 8,   // O and LSE stores issued (end of the tile)
    TR_N_TILES = 9,    // value: key tiles of the work tile
    TR_N_VIS = 10,     // value: key tiles this warpgroup computes (-1: passed the tile)
    TR_Q_EMPTY = 11,   // producer: q_empty wait starts (before the next post)
};
#if FM_TRACE
constexpr int TRACE_CTAS = 132;
constexpr int TRACE_TILES = 32;
constexpr int TRACE_EVENTS = 12;
static_assert(sizeof(fm90_trace) == 8 * TRACE_CTAS * (NCW + 1) * TRACE_TILES * TRACE_EVENTS, "trace layout");
#endif
__device__ __forceinline__ void trace_value(int tile, int ev, long long value) {
#if FM_TRACE
    if ((threadIdx.x & 127) == 0 && blockIdx.x < TRACE_CTAS && tile < TRACE_TILES)
        fm90_trace[((blockIdx.x * (NCW + 1) + threadIdx.x / 128) * TRACE_TILES + tile) * TRACE_EVENTS + ev] =
            value;
#endif
}
__device__ __forceinline__ void trace(int tile, int ev) {
#if FM_TRACE
    trace_value(tile, ev, clock64());
#endif
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float lg2(float x) {
    float r;
    asm("lg2.approx.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// 2^x on the FMA pipe: x = j + f with j = round(x) (the 1.5*2^23 trick: j lands in the low
// mantissa bits), 2^f on [-0.5, 0.5] by a degree-4 polynomial (rel. error < 6e-6, far below
// the 16-bit rounding of P), then j added to the exponent bits. x is clamped at -125, so
// -inf gives 2^-125 instead of 0: negligible next to any visible key, and a row that sees
// no key at all is recognised by its max staying -inf (the epilogue writes O = 0 there).
__device__ __forceinline__ float exp2_poly(float x) {
    x = fmaxf(x, -125.f);  // keeps the exponent add below from wrapping (j >= -125)
    const float t = x + 12582912.f;  // 1.5 * 2^23
    const float f = x - (t - 12582912.f);
    // Least-squares fit of 2^f in relative error (max 5.3e-6 on [-0.5, 0.5]).
    float p = 9.5541109e-3f;
    p = fmaf(p, f, 5.5870376e-2f);
    p = fmaf(p, f, 2.4024696e-1f);
    p = fmaf(p, f, 6.9312803e-1f);
    p = fmaf(p, f, 9.9999944e-1f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

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

// Rank dispenser of the work tiles, the first two ints of the launch's workspace (see
// WS_BYTES): [0] the next rank, [1] CTAs that drew a rank past the end. Zero before the
// launch; the last CTA to finish puts it back to zero.
__device__ __forceinline__ int draw_rank(int* disp) { return atomicAdd(&disp[0], 1); }

// Called once per CTA, after its last draw (a rank past the end). The fences order this
// CTA's draws before its arrival, and every arrival before the reset.
__device__ __forceinline__ void leave_dispenser(int* disp) {
    __threadfence();
    if (atomicAdd(&disp[1], 1) == (int)gridDim.x - 1) {
        __threadfence();
        disp[0] = 0;
        disp[1] = 0;
    }
}

// One work tile as the producer posts it in shared memory: the first query row, the query
// head, the batch, the number of key tiles it visits, key tiles kt_end - n_tiles .. kt_end
// - 1 (last to first; kt_end = n_tiles unless split), and split: -1, or the part of a tile
// split over two key ranges (see SPLIT below): 2 * boundary + part. head = -1: no work left.
struct WorkTile {
    int m0, head, batch, n_tiles;
    int kt_end, split, pad0, pad1;
};

// ---- split of the launch's last tiles over key ranges (non-causal) ----
// Equal work tiles on G persistent CTAs leave the last wave partly empty: 2048 tiles of the
// D=128 sweep shapes on 132 SMs are 15.5 waves, and 64 CTAs sit idle for the 16th (3.3 % of
// the SM time in the run 54 timeline). So the last G + R tiles (R = total mod G) are not
// dealt out whole: their key-tile iterations, in a row, are cut into G contiguous ranges
// (slots), one per rank after the whole tiles, like stream-K GEMMs. A range is at least one
// tile long, so a tile is cut at most once, into a part that starts it (part 0: the highest
// keys, visited first) and one that ends it (part 1). Each part's warps meet at the tile's
// boundary record: the first to finish publishes its unnormalised O, m and l there; the
// second merges them into its own and writes O and LSE (merge_split). Neither part ever
// waits for one that has not started, so any order of the ranks completes.
// Measured (runs 61-64, H100, 6 alternated rounds in run 64): +1-4 % at D=128 S >= 4096,
// but -1.4 % at S = 1024 (each slot pays 2-3 tile starts and a merge, against a 16th wave
// of 8 key tiles) and -3 % at D=64 S <= 1024, where ptxas also scheduled the steady-state
// loop worse (10 exponentials after the P V wait). So only D >= 128 splits, and only tiles
// of at least SPLIT_MIN_KV_TILES key tiles. FM_SPLIT=0 builds without it (A/B). Run 78
// cut from 8 key tiles again, after the producer schedule: S=1024 -3 %, S=2048 -0.5 %; a
// cut segment costs about 1.9 iterations besides its keys (a whole tile 0.74), the merge's
// round trip through L2. FM_SPLIT_MIN_KV_TILES overrides the threshold (A/B).
#ifndef FM_SPLIT
#define FM_SPLIT 1
#endif
constexpr bool SPLIT = FM_SPLIT && !CAUSAL && D >= 128;
#ifndef FM_SPLIT_MIN_KV_TILES
#define FM_SPLIT_MIN_KV_TILES 32
#endif
constexpr int SPLIT_MIN_KV_TILES = FM_SPLIT_MIN_KV_TILES;
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

// The work-tile order of a launch, fixed by the problem and the grid (producer only).
struct Schedule {
    int total, n_mb, heads_q, seqlen_q, seqlen_k, diag;
    int n_whole;   // ranks [0, n_whole) are whole tiles (rank = tile)
    int n_ranks;   // ranks [n_whole, n_ranks) are the slots of the split tiles (SPLIT)
    int kv_tiles;  // key tiles of every (non-causal) work tile
    int sk_iters;  // key-tile iterations of the tiles [n_whole, total), cut into the slots
};

// Split only where the idle part of the last wave is worth more than the two extra tile
// starts and the merge each slot costs: (G - R) idle CTAs x L key tiles >= 2 G iterations,
// and L >= SPLIT_MIN_KV_TILES (see above).
__device__ __forceinline__ Schedule make_schedule(int n_mb, int heads_q, int batch, int seqlen_q,
                                                  int seqlen_k) {
    Schedule sc;
    sc.total = n_mb * heads_q * batch;
    sc.n_mb = n_mb;
    sc.heads_q = heads_q;
    sc.seqlen_q = seqlen_q;
    sc.seqlen_k = seqlen_k;
    sc.diag = seqlen_k - seqlen_q;
    sc.kv_tiles = (seqlen_k + BN - 1) / BN;
    sc.n_whole = sc.n_ranks = sc.total;
    sc.sk_iters = 0;
    const int g = (int)gridDim.x, waves = sc.total / g, rest = sc.total % g;
    if (SPLIT && g <= SPLIT_MAX_CTAS && waves >= 2 && rest != 0 && sc.kv_tiles >= SPLIT_MIN_KV_TILES &&
        (long long)(g - rest) * sc.kv_tiles >= 2ll * g) {
        sc.n_whole = (waves - 1) * g;
        sc.n_ranks = sc.n_whole + g;
        sc.sk_iters = (sc.total - sc.n_whole) * sc.kv_tiles;
    }
    return sc;
}

// Causal work tiles differ in cost (a query block visits as many key tiles as its last row
// sees), and the dispenser hands them out in rank order, so the launch ends well balanced
// only if it ends on light tiles. With every head's blocks in turn (heaviest first), the
// last heads' heaviest tiles start late: 5.4-7.9 % of the SM time sat idle after the CTAs'
// last tiles at S <= 1024 (run 54 timeline). Ranks therefore go through groups of heads
// holding CAUSAL_GROUP_WAVES waves of tiles: inside a group, the heaviest query block of
// every head first, then the next (longest first). The partial group goes first, so the
// last one is full. Run 56 (H100): idle tail 2.6-4.3 %, +2-5 % at S >= 2048, but -3 % /
// -6 % at S = 512 (D=128 / 64): there the launch is near the copy ceiling, and grouping
// runs every head's light, memory-heavy tiles at the same time (slower key-tile steps).
// So the groups apply from CAUSAL_GROUP_MIN_BLOCKS query blocks per head (S = 1024 at
// both head dims: +5 % at D=64 and +1 % at D=128 against the same kernel with 10, run 59),
// and while a group's K and V (upper bound, no GQA sharing) stay within
// CAUSAL_GROUP_MAX_KV_BYTES of L2.
constexpr int CAUSAL_GROUP_WAVES = 2;
constexpr int CAUSAL_GROUP_MIN_BLOCKS = 6;
constexpr long long CAUSAL_GROUP_MAX_KV_BYTES = 32ll << 20;  // run 56 measured up to 25 MB (D=128 S=16384)
// Below CAUSAL_GROUP_MIN_BLOCKS, only the launch's last group (CAUSAL_GROUP_WAVES waves of
// tiles) is ordered longest first: the light tiles run together once, at the end. Run 76
// (H100, S = 512 causal, 6 alternated rounds): idle tail 6.8 -> 3.2 % (D=128) and 5.5 ->
// 2.3 % (D=64), +2.2 % (D=128 bf16), +1.9 % (fp16), +2.5 % (D=64); key-tile steps unchanged.
// FM_CAUSAL_TAIL_GROUP=0 builds without it (A/B).
#ifndef FM_CAUSAL_TAIL_GROUP
#define FM_CAUSAL_TAIL_GROUP 1
#endif
constexpr bool CAUSAL_TAIL_GROUP = FM_CAUSAL_TAIL_GROUP;

__device__ __forceinline__ WorkTile decode_tile(int rank, int total, int n_mb, int heads_q,
                                                int seqlen_q, int seqlen_k, int diag) {
    if (rank >= total) return WorkTile{0, -1, 0, 0, 0, -1, 0, 0};
    int mb, bh;  // query block; batch * heads_q + head
    if (CAUSAL && n_mb >= CAUSAL_GROUP_MIN_BLOCKS) {
        const int n_bh = total / n_mb;
        int g_heads = (CAUSAL_GROUP_WAVES * (int)gridDim.x + n_mb - 1) / n_mb;
        if ((long long)g_heads * seqlen_k * (4 * D) > CAUSAL_GROUP_MAX_KV_BYTES) g_heads = 1;
        const int first = n_bh % g_heads;  // heads of the partial group (0: none)
        int r = rank, in_group = first, bh0 = 0;
        if (rank >= first * n_mb) {
            r = rank - first * n_mb;
            const int g = r / (g_heads * n_mb);
            r -= g * g_heads * n_mb;
            in_group = g_heads;
            bh0 = first + g * g_heads;
        }
        mb = r / in_group;
        bh = bh0 + (r - mb * in_group);
    } else {
        // Each head's blocks in turn. (Its own branch, with fewer divisions: run 57
        // measured the group arithmetic at 1-3.5 % on short causal tiles, while the
        // decode still sat between the wait for Q's release and the next post.)
        mb = rank % n_mb;
        bh = rank / n_mb;
        if (CAUSAL && CAUSAL_TAIL_GROUP) {
            // Only the last CAUSAL_GROUP_WAVES waves of tiles go longest first, so the
            // launch ends on light tiles without running light tiles together before
            // (and only while that group's K and V fit the same L2 budget).
            const int n_bh = total / n_mb;
            const int t_heads = min(n_bh, (CAUSAL_GROUP_WAVES * (int)gridDim.x + n_mb - 1) / n_mb);
            const int r = rank - (n_bh - t_heads) * n_mb;
            if (r >= 0 && (long long)t_heads * seqlen_k * (4 * D) <= CAUSAL_GROUP_MAX_KV_BYTES) {
                mb = r / t_heads;
                bh = n_bh - t_heads + (r - mb * t_heads);
            }
        }
    }
    // Causal: aligned to the last row rounded up to 16 (see the ABI note); the first
    // block may start below row 0.
    const int m0 = CAUSAL ? ((seqlen_q + 15) & ~15) - (mb + 1) * BM : mb * BM;
    const int n_end = CAUSAL ? max(0, min(seqlen_k, m0 + BM + diag)) : seqlen_k;
    const int n_tiles = (n_end + BN - 1) / BN;
    return WorkTile{m0, bh % heads_q, bh / heads_q, n_tiles, n_tiles, -1, 0, 0};
}

// The producer's position in its slot of split tiles: key-tile iterations [pos, end) of
// the tiles [n_whole, total), in a row. Empty (pos == end) outside a slot.
struct SlotCursor {
    int pos = 0, end = 0, slot = 0;
};

// The next segment of the cursor's slot: the rest of the tile at pos, up to the slot's end.
__device__ __forceinline__ WorkTile next_segment(const Schedule& sc, SlotCursor& cur) {
    const int L = sc.kv_tiles;
    const int t = sc.n_whole + cur.pos / L;
    const int i0 = cur.pos % L;                    // first iteration of the tile in this segment
    const int i1 = min(L, i0 + (cur.end - cur.pos));  // one past its last
    cur.pos += i1 - i0;
    WorkTile w = decode_tile(t, sc.total, sc.n_mb, sc.heads_q, sc.seqlen_q, sc.seqlen_k, sc.diag);
    w.n_tiles = i1 - i0;
    w.kt_end = L - i0;  // iterations visit key tiles last to first
    // Cut at a slot boundary: the part that ends the tile opens this slot (boundary = slot),
    // the part that starts it closes this slot (boundary = slot + 1).
    if (i0 > 0) w.split = 2 * cur.slot + 1;
    else if (i1 < L) w.split = 2 * (cur.slot + 1);
    return w;
}

// The work of a drawn rank: a whole tile, the first segment of a slot, or none.
__device__ __forceinline__ WorkTile decode_rank(int rank, const Schedule& sc, SlotCursor& cur) {
    if (!SPLIT || rank < sc.n_whole || rank >= sc.n_ranks) {
        if (rank >= sc.n_ranks) rank = sc.total;  // past the slots: no work left
        return decode_tile(rank, sc.total, sc.n_mb, sc.heads_q, sc.seqlen_q, sc.seqlen_k, sc.diag);
    }
    const int g = (int)gridDim.x;
    cur.slot = rank - sc.n_whole;
    // floor(slot * sk_iters / g) without 64-bit products (a 64-bit division is a call,
    // around which ptxas spilled the producer's registers): sk_iters = q g + r.
    const int q = sc.sk_iters / g, r = sc.sk_iters - q * g;
    cur.pos = cur.slot * q + cur.slot * r / g;
    cur.end = (cur.slot + 1) * q + (cur.slot + 1) * r / g;
    return next_segment(sc, cur);
}

__device__ __forceinline__ void post_tile(u32 slot, const WorkTile& w) {
    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot), "r"(w.m0), "r"(w.head),
                 "r"(w.batch), "r"(w.n_tiles)
                 : "memory");
    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot + 16), "r"(w.kt_end), "r"(w.split),
                 "r"(w.pad0), "r"(w.pad1)
                 : "memory");
}
__device__ __forceinline__ WorkTile read_tile(u32 slot) {
    WorkTile w;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w.m0), "=r"(w.head), "=r"(w.batch), "=r"(w.n_tiles)
                 : "r"(slot)
                 : "memory");
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w.kt_end), "=r"(w.split), "=r"(w.pad0), "=r"(w.pad1)
                 : "r"(slot + 16)
                 : "memory");
    return w;
}

// The producer: one thread. It draws the ranks, decodes and posts each work tile, and
// loads Q and every K and V tile the consumers compute. The next tile is decoded and
// written to the other work-tile record during the current tile (once its loads fill the
// ring, where the producer waits for slots anyway), and its first K is loaded
// right after the current tile's last V, ahead of the wait for Q's release: run 69's
// timeline showed the producer thread taking about 3800 cycles from a tile's last V to
// the next tile's first K (decode 1240, post to Q issued 1260, ...; no barrier wait was
// long). Run 70: that K is now issued 2170 cycles before the last P V (710 after it
// before); D=128 +1-2 % against cuDNN in the run-73 sweep (docs/perf-notes.md §7.21).
struct Producer {
    const FmTensorMap *tq, *tk, *tv;
    u32 base;   // the aligned shared memory (Q, the ring, the barriers, the work-tile records)
    int group;  // query heads per KV head
    Schedule sc;
    SlotCursor cur;
    int rank = 0;            // the last rank drawn (decoded when the cursor's slot is empty)
    bool k0_loaded = false;  // the posted tile's first K is already loaded (into slot 0)
    SlotPhases ring;

    __device__ __forceinline__ Bars bar() const { return Bars{base + OFF_BAR}; }
    __device__ __forceinline__ u32 record(int i) const { return tile_record(base, i); }
    // The work after the current tile (the rest of the cursor's slot, or the drawn rank),
    // written to record i.
    __device__ __forceinline__ void post_next(int i) {
        post_tile(record(i), cur.pos != cur.end ? next_segment(sc, cur) : decode_rank(rank, sc, cur));
    }
    // K (or V) of key tile n0 into ring slot s: once every consumer warp released the
    // slot's previous contents (that use's parity). K and V are released separately: K as
    // soon as S is computed, V after P V, so the next K load starts early.
    __device__ __forceinline__ void load_kv(bool is_v, int s, int round, int kv_head, int n0, int batch) {
        const u32 full = is_v ? bar().v_full(s) : bar().k_full(s);
        if (ring.reused(s, round)) mbar_wait(is_v ? bar().v_empty(s) : bar().k_empty(s), ring.parity(s, round) ^ 1u);
        mbar_arrive_expect_tx(full, KV_BYTES);
        const u32 dst = base + (is_v ? OFF_V : OFF_K) + s * KV_BYTES;
#pragma unroll
        for (int h = 0; h < DH; ++h) tma_load_4d(dst + h * HALF_KV, is_v ? tv : tk, full, h * 64, kv_head, n0, batch);
    }
    // Work tile i, w (posted; its Q slot released by the consumers): Q, then K and V of
    // every key tile it visits, posting tile i + 1 on the way; then that tile's first K.
    __device__ __forceinline__ void produce(const WorkTile& w, int i) {
        const int kv_head = w.head / group;
        mbar_arrive_expect_tx(bar().q_full(), Q_BYTES);
#pragma unroll
        for (int h = 0; h < DH; ++h) tma_load_4d(base + h * HALF_Q, tq, bar().q_full(), h * 64, w.head, w.m0, w.batch);
        trace(i, TR_S0);
        int s = 0, round = 0;
        for (int it = 0; it < w.n_tiles; ++it) {
            const int n0 = (w.kt_end - 1 - it) * BN;
            if (it > 0 || !k0_loaded) load_kv(false, s, round, kv_head, n0, w.batch);
            if (it == 0 && !k0_loaded) trace(i, TR_K0);
            if (it == 1) trace(i, TR_K1);
            load_kv(true, s, round, kv_head, n0, w.batch);
            if (it == 0) trace(i, TR_V0);
            if (it == min(STAGES - 1, w.n_tiles - 1)) {  // the ring is full: slack until a slot frees
                post_next(i + 1);
                trace(i, TR_LAST_PV);
            }
            if (++s == STAGES) {
                s = 0;
                ++round;
            }
        }
        trace(i, TR_LOOP_END);
        ring.advance(w.n_tiles);
        const WorkTile next = read_tile(record(i + 1));
        k0_loaded = next.head >= 0 && next.n_tiles > 0;
        if (k0_loaded) {
            load_kv(false, 0, 0, next.head / group, (next.kt_end - 1) * BN, next.batch);
            trace(i + 1, TR_K0);
        }
    }
};

// ---- consumer building blocks (one warpgroup, 64 query rows) ----

// S = Q K^T for ring slot s: issued, not waited for.
__device__ __forceinline__ void issue_qk(float (&sacc)[BN / 2], u64 dq, u64 dk, int s) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u32 inner = (kk & 3) * 32;  // k16 step inside the 128-byte row
        wgmma_ss<0, 0>(sacc, desc_add(dq, (kk >> 2) * HALF_Q + inner),
                       desc_add(dk, s * KV_BYTES + (kk >> 2) * HALF_KV + inner), kk > 0 ? 1 : 0);
    }
}

// The same with Q from registers (FM_Q_REGS): qa[kk] is the A fragment of k16 step kk.
__device__ __forceinline__ void issue_qk_rs(float (&sacc)[BN / 2], const u32 (&qa)[D / 16][4], u64 dk,
                                            int s) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_rs<0>(sacc, qa[kk], desc_add(dk, s * KV_BYTES + (kk >> 2) * HALF_KV + (kk & 3) * 32),
                    kk > 0 ? 1 : 0);
}

// This warp's 16 query rows of Q as wgmma A fragments, read from the 128B-swizzled Q tile
// (chunk c of row r sits at chunk c ^ (r & 7)). ldmatrix x4: lanes 8m..8m+7 address the
// rows of matrix m = (rows +8 if m is odd, k +8 if m >= 2), the fragment order of pack_p.
__device__ __forceinline__ void load_q_frags(u32 (&qa)[D / 16][4], u32 sQ, int cw, int warp, int lane) {
    const int m = lane >> 3;
    const int r = cw * 64 + warp * 16 + (lane & 7) + 8 * (m & 1);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int chunk = (kk & 3) * 2 + (m >> 1);
        const u32 addr = sQ + (kk >> 2) * HALF_Q + r * 128 + ((chunk ^ (r & 7)) << 4);
        ldsm_x4(addr, qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]);
    }
}

// S = Q K^T for ring slot s, Q from shared memory or from registers (FM_Q_REGS).
__device__ __forceinline__ void issue_s(float (&sacc)[BN / 2], const u32 (&qa)[D / 16][4], u64 dq,
                                        u64 dk, int s) {
    if (FM_Q_REGS) issue_qk_rs(sacc, qa, dk, s);
    else issue_qk(sacc, dq, dk, s);
}

// O += P V for ring slot s: issued, not waited for.
__device__ __forceinline__ void issue_pv(float (&oacc)[D / 2], const u32 (&pa)[BN / 16][4], u64 dv,
                                         int s) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_rs<1>(oacc, pa[kk], desc_add(dv, s * KV_BYTES + kk * 16 * 128), 1);
}

// Ragged key tail and causal diagonal: scores of keys a row must not see become -inf.
__device__ __forceinline__ void mask_tile(float (&sacc)[BN / 2], int n0, int row0, int lane,
                                          int seqlen_k, int diag) {
    const int col0 = n0 + 2 * (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int limit = seqlen_k;
        if (CAUSAL) limit = min(limit, row0 + 8 * h + diag + 1);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c)
                if (col0 + j * 8 + c >= limit) sacc[4 * j + 2 * h + c] = neg_inf();
    }
}

// Lazy rescale: P = exp2(S*scale - m) with m up to RESCALE_SLACK below the true row max,
// so P <= 2^8 (exact in 16 bit, far from overflow in the fp32 O and l). O and l are relative
// to the same m, so O / l and the LSE m + log2(l) are unchanged.
constexpr float RESCALE_SLACK = 8.f;

// Online softmax step (log2 domain): sacc becomes P = exp2(S*scale - m) in place, m and the
// per-thread partial l are updated, alpha = the factor O must be rescaled by. Returns
// whether O needs the rescale: always, or with FM_LAZY_RESCALE, whether some row of the
// warp moved its m (a warp-uniform answer, so the skip is a uniform branch).
__device__ __forceinline__ bool softmax_tile(float (&sacc)[BN / 2], float (&m_i)[2], float (&l_i)[2],
                                             float (&alpha)[2], float scale_log2) {
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = neg_inf();
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
            mx = fmaxf(mx, fmaxf(sacc[4 * j + 2 * h], sacc[4 * j + 2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(m_i[h], mx * scale_log2);
        // Lazy: keep m unless the row max passed it by more than the slack (m = -inf: any
        // visible key moves it). alpha is then exactly 1 for the rows that kept m.
        if (FM_LAZY_RESCALE && !(m_new > m_i[h] + RESCALE_SLACK)) m_new = m_i[h];
        // Safe max: a row that has seen no key keeps m = -inf; subtract 0 instead.
        const float m_use = (m_new == neg_inf()) ? 0.f : m_new;
        const bool row_moved = m_new != m_i[h];
        alpha[h] = (FM_LAZY_RESCALE && !row_moved) ? 1.f : ex2(m_i[h] - m_use);
        moved = moved || row_moved;
        m_i[h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float x = fmaf(sacc[4 * j + 2 * h + c], scale_log2, -m_use);
                // FM_POLY_EXP eighths of the elements go to the FMA pipe (compile-time split).
                const float p = ((2 * j + c) % 8 < FM_POLY_EXP) ? exp2_poly(x) : ex2(x);
                sacc[4 * j + 2 * h + c] = p;
                sum += p;
            }
        l_i[h] = l_i[h] * alpha[h] + sum;  // per-thread partial; quad-reduced at the end
    }
    return !FM_LAZY_RESCALE || __any_sync(0xffffffffu, moved);
}

// P to 16 bit in the wgmma A-fragment layout: k16 step kk = 8-column blocks 2kk, 2kk+1;
// registers (row g, k 0-7), (row g+8, k 0-7), (row g, k 8-15), (row g+8, k 8-15).
__device__ __forceinline__ void pack_p(const float (&sacc)[BN / 2], u32 (&pa)[BN / 16][4]) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            pa[j >> 1][(j & 1) * 2 + h] = pack2(sacc[4 * j + 2 * h], sacc[4 * j + 2 * h + 1]);
}

// need: softmax_tile's answer (false only with FM_LAZY_RESCALE, when alpha is 1 for the warp).
__device__ __forceinline__ void rescale_o(float (&oacc)[D / 2], const float (&alpha)[2], bool need) {
    if (!need) return;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            oacc[4 * j + 2 * h] *= alpha[h];
            oacc[4 * j + 2 * h + 1] *= alpha[h];
        }
}

// Always 0, but computed from x: a wait whose parity takes it cannot be scheduled before x
// is (ptxas reorders freely around a try-wait otherwise; see the V wait in consume()).
__device__ __forceinline__ u32 zero_after(float x) {
    u32 z;
    asm volatile("min.u32 %0, %1, 0;\n" : "=r"(z) : "r"(__float_as_uint(x)));
    return z;
}

// Ping-pong schedule between the consumer warpgroups: warpgroup cw waits for its turn
// (named barrier 1 + cw, 256 threads: its own 128 sync, the other's 128 arrive) before
// issuing GEMMs and hands the turn over right after issuing.
__device__ __forceinline__ void turn_wait(int cw) {
    if (FM_PINGPONG) named_bar_sync(1 + cw, 256);
}
__device__ __forceinline__ void turn_pass(int cw) {
    if (FM_PINGPONG) named_bar_arrive(1 + (cw + 1 == NCW ? 0 : cw + 1), 256);
}

// This warp's wgmmas reading the slot are complete: one arrival per consumer warp.
__device__ __forceinline__ void release(u32 bar, int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
}

// This thread is done with Q and with the posted work tile: one arrival per consumer
// thread, since the tile was read with ordinary loads by every thread (a warp-level
// arrival after __syncwarp orders them as well, but compute-sanitizer racecheck only
// credits a thread's own arrival: python/dev/racecheck_mbarrier_probe.cu).
__device__ __forceinline__ void release_q(const Bars& bar) { mbar_arrive(bar.q_empty()); }

// One key tile (ring slot s, round `round`) passed without computing: the slot is
// released as soon as it is full, and the warpgroup's ping-pong turn is passed on.
__device__ __forceinline__ void pass_key_tile(const Bars& bar, int cw, int lane, const SlotPhases& ring,
                                              int& s, int& round) {
    const u32 ph = ring.parity(s, round);
    mbar_wait(bar.k_full(s), ph);
    release(bar.k_empty(s), lane);
    turn_wait(cw);
    turn_pass(cw);
    mbar_wait(bar.v_full(s), ph);
    release(bar.v_empty(s), lane);
    if (++s == STAGES) {
        s = 0;
        ++round;
    }
}

// A consumer warpgroup whose 64 rows all lie outside [0, Sq) (in the ragged query block,
// e.g. S=512 with 192-row tiles: 2 x 192 + 128): it computes nothing, so
// the tensor cores serve the other warpgroups alone, but it keeps the protocol. It
// releases Q and each ring slot as soon as the slot is full (so its arrivals count for
// that use of the slot), and with ping-pong it passes on as many turns as consume() takes.
__device__ __forceinline__ void pass_tile(const Bars& bar, int cw, int n_tiles, int lane, SlotPhases& ring) {
    release_q(bar);
    int s = 0, round = 0;
    for (int it = 0; it < n_tiles; ++it) pass_key_tile(bar, cw, lane, ring, s, round);
    if (FM_PIPE && n_tiles > 0) {  // consume()'s last turn: the final P V
        turn_wait(cw);
        turn_pass(cw);
    }
    ring.advance(n_tiles);
}

// The meeting of a split tile's two parts at their boundary record, per consumer warp (16
// rows; both parts hold the same rows in the same warp of the same warpgroup). The warp
// takes a ticket: the first publishes its O (unnormalised), m and l (per-thread partial)
// and returns false; the second waits for that publication (the first is already storing
// it), merges it into its own registers and returns true (it writes O and LSE). The merge
// is symmetric (products, then one add), so the bits do not depend on which part came
// second; the second resets the record for the next launch.
__device__ __forceinline__ bool merge_split(float (&oacc)[D / 2], float (&m_i)[2], float (&l_i)[2],
                                            int boundary, int cw, int warp, int lane, unsigned char* ws) {
    const int rec = (boundary * NCW + cw) * 4 + warp;
    float4* part = reinterpret_cast<float4*>(ws + WS_PARTS) + (size_t)rec * PART_CHUNKS * 32 + lane;
    int* ticket = reinterpret_cast<int*>(ws + WS_SYNC) + 2 * rec;
    int* ready = ticket + 1;
    int first = 0;
    if (lane == 0) first = atomicAdd(ticket, 1) == 0;
    if (__shfl_sync(0xffffffffu, first, 0)) {
#pragma unroll
        for (int c = 0; c < D / 8; ++c)
            __stcg(part + 32 * c, make_float4(oacc[4 * c], oacc[4 * c + 1], oacc[4 * c + 2], oacc[4 * c + 3]));
        __stcg(part + 32 * (D / 8), make_float4(m_i[0], m_i[1], l_i[0], l_i[1]));
        __threadfence();
        __syncwarp();
        if (lane == 0) st_release_gpu(ready, 1);
        return false;
    }
    // Every lane's own acquire load must see the flag (the vote ends the loop for all).
    while (!__all_sync(0xffffffffu, ld_acquire_gpu(ready) != 0)) {
    }
    const float4 ml = __ldcg(part + 32 * (D / 8));
    const float m_o[2] = {ml.x, ml.y}, l_o[2] = {ml.z, ml.w};
    float a_self[2], a_other[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float m = fmaxf(m_i[h], m_o[h]);
        const float m_use = m == neg_inf() ? 0.f : m;
        a_self[h] = ex2(m_i[h] - m_use);
        a_other[h] = ex2(m_o[h] - m_use);
        l_i[h] = __fadd_rn(__fmul_rn(l_i[h], a_self[h]), __fmul_rn(l_o[h], a_other[h]));
        m_i[h] = m;
    }
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
        const float4 o = __ldcg(part + 32 * c);
        const float other[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int h = e >> 1;  // element 4c + 2h + col: row h
            oacc[4 * c + e] = __fadd_rn(__fmul_rn(oacc[4 * c + e], a_self[h]), __fmul_rn(other[e], a_other[h]));
        }
    }
    __syncwarp();  // every lane has seen `ready` before it is cleared
    if (lane == 0) {
        *ticket = 0;
        *ready = 0;
    }
    return true;
}

// The epilogue of a work tile: normalise, LSE; 16-bit O into this warp's staging rows (see
// O_TMA_STORE), then to global memory as whole rows. (From registers, each store
// instruction wrote 16 bytes into 8 rows: twice the ideal L2 sectors, ncu run 24.)
// Rows outside [0, Sq) are not stored; a warp's 16 rows start at a multiple of 16.
__device__ __forceinline__ void store_o(const float (&oacc)[D / 2], const float (&m_i)[2], const float (&l_i)[2],
                                        u32 sStage, int cw, int warp, int lane, int m0w, int row0, int seqlen_q,
                                        const FmTensorMap* tm_o, int head, int batch, u16* __restrict__ og,
                                        i64 q_stride, float* __restrict__ lseg) {
    constexpr float LN2 = 0.693147180559945309f;
    const u32 stg = sStage + (cw * 4 + warp) * STAGE_WARP_BYTES;
    if (O_TMA_STORE) {
        if (lane == 0) bulk_wait_read<0>();  // the previous tile's store has read the boxes
        __syncwarp();
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_i[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        // A row that saw no key keeps m = -inf (its l may hold 2^-125 terms of exp2_poly).
        const bool seen = m_i[h] != neg_inf() && l > 0.f;
        float inv = 0.f;
        if (seen) asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(l));
        const int row = row0 + 8 * h;
        if ((lane & 3) == 0 && row >= 0 && row < seqlen_q)
            lseg[row] = seen ? (m_i[h] + lg2(l)) * LN2 : neg_inf();
        const int r = (lane >> 2) + 8 * h;  // row in the warp's 16
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            // TMA box: 16-byte chunk c of a row's 128 bytes sits at chunk c ^ (r & 7).
            const u32 addr = O_TMA_STORE ? stg + (j >> 3) * 2048 + r * 128 + (((j & 7) ^ (r & 7)) << 4)
                                         : stg + r * STAGE_PITCH + 16 * j;
            st_shared_u32(addr + 4 * (lane & 3), pack2(oacc[4 * j + 2 * h] * inv, oacc[4 * j + 2 * h + 1] * inv));
        }
    }
    const int wrow0 = m0w + warp * 16;
    if (O_TMA_STORE) {
        fence_proxy_async_smem();  // the generic-proxy writes, before the TMA (async proxy) reads
        __syncwarp();
        if (lane == 0 && wrow0 >= 0 && wrow0 < seqlen_q) {
#pragma unroll
            for (int hh = 0; hh < DH; ++hh) tma_store_4d(tm_o, stg + hh * 2048, hh * 64, head, wrow0, batch);
            bulk_commit();
        }
    } else {
        __syncwarp();
        constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
#pragma unroll
        for (int c = lane; c < 16 * CHUNKS; c += 32) {
            const int r = c / CHUNKS, col = c % CHUNKS;
            u32 a, b, cc, d;
            ld_shared_v4(stg + r * STAGE_PITCH + col * 16, a, b, cc, d);
            if (wrow0 + r >= 0 && wrow0 + r < seqlen_q)
                st_global_v4(og + (i64)(wrow0 + r) * q_stride + col * 8, a, b, cc, d);
        }
        __syncwarp();  // the staging rows are read before the next tile's epilogue writes them
    }
}

// Consumer warpgroup `cw`: 64 query rows [m0w, m0w + 64) of the work tile just posted
// (its q_full phase completed: Q landed, or no key is visible and Q was not loaded).
__device__ __forceinline__ void consume(u32 sQ, u32 sK, u32 sV, u32 sStage, const Bars& bar, int cw, int m0w,
                                        int n_tiles, int kt_end_posted, int split, int seqlen_q,
                                        int seqlen_k, int diag, float scale_log2, const FmTensorMap* tm_o, int head,
                                        int batch, u16* __restrict__ og, i64 q_stride, float* __restrict__ lseg,
                                        SlotPhases& ring, int tile_i, unsigned char* ws) {
    const int t = threadIdx.x & 127;
    const int warp = t >> 5;
    const int lane = t & 31;
    // No row of this warpgroup exists. (The vote tells ptxas the branch is warp-uniform;
    // a plain compare costs the loop its uniform datapath: R2UR 0 -> 32, 673 -> 765 SASS.)
    if (__all_sync(0xffffffffu, m0w >= seqlen_q || m0w + 64 <= 0)) {
        pass_tile(bar, cw, n_tiles, lane, ring);
        trace_value(tile_i, TR_N_VIS, -1);
        trace(tile_i, TR_EPILOGUE);
        return;
    }
    const int row0 = m0w + warp * 16 + (lane >> 2);  // this thread's rows: row0, row0 + 8
    // Key tiles visited: kt_end - 1 down to kt_end - n_tiles (all of them unless split).
    const int kt_end = SPLIT ? kt_end_posted : n_tiles;

    // Iterations [0, n_masked) are the tiles that need a mask: ragged key tail
    // (n0 + BN > Sk) or, when causal, a key beyond this warpgroup's first row's limit.
    int thr = seqlen_k - BN + 1;
    if (CAUSAL) thr = min(thr, m0w + diag - BN + 2);
    const int first_masked = thr <= 0 ? 0 : (thr + BN - 1) / BN;
    const int n_masked = max(0, kt_end - first_masked);
    // Causal: the first key tiles visited (the highest keys) can lie entirely past the
    // limit of this warpgroup's last row. With 192-row work tiles and 128-key tiles that is
    // one key tile for 1 or 2 of the 3 warpgroups of every work tile. The warpgroup passes
    // them (pass_key_tile) and starts computing at iteration `skip`. (The reduction keeps
    // skip, and with it the loop's slot arithmetic, on the uniform datapath.) Only where
    // BM > BN: with BM = BN it is 0 on square problems, and the variable start costs the
    // steady-state loop 20 instructions at D=128 (673 -> 693).
    int skip = 0;
    if (SKIP_MASKED) {
        const int lim = m0w + 63 + diag;  // the last row sees keys <= lim
        const int visible = lim < 0 ? 0 : min(n_tiles, lim / BN + 1);
        skip = __reduce_max_sync(0xffffffffu, n_tiles - visible);
    }
    const int n_vis = n_tiles - skip;  // key tiles this warpgroup computes
    trace_value(tile_i, TR_N_TILES, n_tiles);
    trace_value(tile_i, TR_N_VIS, n_vis);

    float oacc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) oacc[i] = 0.f;
    float m_i[2] = {neg_inf(), neg_inf()};
    float l_i[2] = {0.f, 0.f};
    float alpha[2];
    float sacc[BN / 2];
    u32 pa[BN / 16][4];

    const u64 dq = smem_desc_sw128(sQ + cw * 64 * 128, 16, 1024);
    const u64 dk = smem_desc_sw128(sK, 16, 1024);
    const u64 dv = smem_desc_sw128(sV, HALF_KV, 1024);  // MN-major: LBO = next 64 columns of D

    u32 qa[D / 16][4];  // Q fragments (FM_Q_REGS; unused and eliminated otherwise)
    if (FM_Q_REGS && n_vis > 0) load_q_frags(qa, sQ, cw, warp, lane);
    // Q and the posted tile are free: with FM_Q_REGS at once, else after the last S.
    const int q_last = FM_Q_REGS ? -1 : n_tiles - 1;
    if (n_vis == 0 || FM_Q_REGS) release_q(bar);  // (no key visible: Q is not read)
    if (n_tiles > 0) {
#if FM_PIPE
        int s = 0, round = 0;  // ring slot of iteration `it` and its round
        for (int it = 0; it < skip; ++it) pass_key_tile(bar, cw, lane, ring, s, round);
        if (n_vis == 0) {  // consume()'s last turn (the final P V), as pass_tile
            turn_wait(cw);
            turn_pass(cw);
        } else {
            // Software pipeline inside the warpgroup: the scores of tile i+1 are computed by
            // the tensor cores while this warpgroup runs the softmax of tile i+1 and P V of
            // tile i is in flight (FA3's intra-warpgroup overlap). Prologue: S of the first
            // computed key tile (iteration skip, in slot s).
            mbar_wait(bar.k_full(s), ring.parity(s, round));
            trace(tile_i, TR_K0);
            turn_wait(cw);
            wgmma_fence();
            issue_s(sacc, qa, dq, dk, s);
            wgmma_commit();
            turn_pass(cw);
            wgmma_wait<0>();
            reg_fence(sacc);
            trace(tile_i, TR_S0);
            release(bar.k_empty(s), lane);
            if (q_last == skip) release_q(bar);  // last S of this work tile
            if (skip < n_masked) mask_tile(sacc, (kt_end - 1 - skip) * BN, row0, lane, seqlen_k, diag);
            softmax_tile(sacc, m_i, l_i, alpha, scale_log2);
            trace(tile_i, TR_SOFTMAX0);
            mbar_wait(bar.v_full(s), ring.parity(s, round));  // V of that tile (see the loop)
            trace(tile_i, TR_V0);
            pack_p(sacc, pa);
            int ps = s;  // slot of the tile whose P is in pa (its V has landed)
            if (++s == STAGES) {
                s = 0;
                ++round;
            }
            for (int it = skip + 1; it < n_tiles; ++it) {
                const u32 ph = ring.parity(s, round);
                mbar_wait(bar.k_full(s), ph);
                if (FM_TRACE && it == skip + 1) trace(tile_i, TR_K1);
                reg_fence(oacc);
                turn_wait(cw);
                wgmma_fence();
                issue_s(sacc, qa, dq, dk, s);
                wgmma_commit();
                issue_pv(oacc, pa, dv, ps);
                wgmma_commit();
                turn_pass(cw);
                wgmma_wait<1>();  // S of tile it is ready; P V of tile it-1 may still run
                reg_fence(sacc);
                release(bar.k_empty(s), lane);
                if (it == q_last) release_q(bar);  // last S of this work tile
                if (it < n_masked) mask_tile(sacc, (kt_end - 1 - it) * BN, row0, lane, seqlen_k, diag);
                const bool need_rescale = softmax_tile(sacc, m_i, l_i, alpha, scale_log2);
                // V of tile it (needed by the next P V) is waited for here, between the
                // softmax and the wait for P V of tile it-1, for a second reason: ptxas
                // schedules a wgmma wait at the top of its basic block, so without the
                // try-wait's branch in between, the wait for P V would be hoisted above the
                // whole softmax and the softmax would no longer overlap P V (SASS before:
                // DEPBAR.LE gsb0, 0x0 ahead of every MUFU.EX2 of the loop; docs/perf-notes.md §7.13).
                // In some variants (ORDER_V_WAIT) ptxas moved the try-wait itself up into the
                // softmax: there its parity takes the softmax's sums through zero_after, which
                // keeps all 66 MUFU.EX2 before it.
                const u32 after_softmax = ORDER_V_WAIT ? zero_after(l_i[0]) ^ zero_after(l_i[1]) : 0u;
                mbar_wait(bar.v_full(s), ph ^ after_softmax);
                wgmma_wait<0>();
                reg_fence(oacc);
                reg_fence_u32(pa);  // pa stays live until the P V reading it has completed
                release(bar.v_empty(ps), lane);
                rescale_o(oacc, alpha, need_rescale);
                pack_p(sacc, pa);
                ps = s;
                if (++s == STAGES) {
                    s = 0;
                    ++round;
                }
            }
            trace(tile_i, TR_LOOP_END);
            reg_fence(oacc);  // V of the last tile was waited for after its softmax
            turn_wait(cw);
            wgmma_fence();
            issue_pv(oacc, pa, dv, ps);
            wgmma_commit();
            turn_pass(cw);
            wgmma_wait<0>();
            reg_fence(oacc);
            trace(tile_i, TR_LAST_PV);
            release(bar.v_empty(ps), lane);
        }
#else
        // Serial: S, softmax, P V per tile (the two consumer warpgroups still overlap each
        // other's softmax with their GEMMs, unsynchronised).
        int s = 0, round = 0;
        for (int it = 0; it < n_tiles; ++it) {
            const u32 ph = ring.parity(s, round);
            mbar_wait(bar.k_full(s), ph);
            wgmma_fence();
            issue_s(sacc, qa, dq, dk, s);
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(sacc);
            release(bar.k_empty(s), lane);
            if (it == q_last) release_q(bar);  // last S of this work tile
            if (it < n_masked) mask_tile(sacc, (kt_end - 1 - it) * BN, row0, lane, seqlen_k, diag);
            const bool need_rescale = softmax_tile(sacc, m_i, l_i, alpha, scale_log2);
            rescale_o(oacc, alpha, need_rescale);
            pack_p(sacc, pa);
            mbar_wait(bar.v_full(s), ph);
            reg_fence(oacc);
            wgmma_fence();
            issue_pv(oacc, pa, dv, s);
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(oacc);
            release(bar.v_empty(s), lane);
            if (++s == STAGES) {
                s = 0;
                ++round;
            }
        }
#endif
    }
    ring.advance(n_tiles);
    // A split tile: the first part to finish hands its O, m and l over and stores nothing.
    if (!SPLIT || split < 0 || merge_split(oacc, m_i, l_i, split >> 1, cw, warp, lane, ws))
        store_o(oacc, m_i, l_i, sStage, cw, warp, lane, m0w, row0, seqlen_q, tm_o, head, batch, og, q_stride, lseg);
    trace(tile_i, TR_EPILOGUE);
}

}  // namespace fm90

extern "C" __global__ void __launch_bounds__(fm90::THREADS, 1)
    flash_attn_fwd_sm90(const __grid_constant__ FmTensorMap tm_q,
                        const __grid_constant__ FmTensorMap tm_k,
                        const __grid_constant__ FmTensorMap tm_v,
                        const __grid_constant__ FmTensorMap tm_o, u16* __restrict__ o,
                        float* __restrict__ lse, int seqlen_q, int seqlen_k, int heads_q,
                        int heads_kv, float softmax_scale_log2, int batch_size,
                        unsigned char* __restrict__ workspace) {
    using namespace fm90;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // 128B-swizzle atoms must start on 1024-byte boundaries (descriptor base offset 0).
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sQ = base, sK = base + OFF_K, sV = base + OFF_V;
    const Bars bar{base + OFF_BAR};

    if (threadIdx.x == 0) {
        mbar_init(bar.q_full(), 1);
        mbar_init(bar.q_empty(), NCW * 128);  // every consumer thread (release_q)
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar.k_full(s), 1);
            mbar_init(bar.v_full(s), 1);
            mbar_init(bar.k_empty(s), NCW * 4);
            mbar_init(bar.v_empty(s), NCW * 4);
        }
        mbar_init_fence();
    }
    __syncthreads();

    // Work tiles in rank order (see decode_tile): query block fastest, so that the CTAs
    // running together share K/V in L2; causal: each head's heaviest (last) query blocks
    // first. The producer draws the ranks and posts each tile to the consumers in one of two
    // shared-memory records (tile_record), published by the q_full barrier (its arrive
    // releases the post) and rewritten two tiles later, after q_empty (every consumer thread
    // has read it by then).
    const int n_mb = (seqlen_q + BM - 1) / BM;
    const int diag = seqlen_k - seqlen_q;  // row i sees keys j <= i + diag
    const int group = heads_q / heads_kv;
    const u32 tile_records = tile_record(base, 0);  // (hoisted: the consumers' address arithmetic)
    SlotPhases ring;

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            tma_prefetch_desc(&tm_q);
            tma_prefetch_desc(&tm_k);
            tma_prefetch_desc(&tm_v);
            if (O_TMA_STORE) tma_prefetch_desc(&tm_o);
            int* disp = reinterpret_cast<int*>(workspace);
            Producer p{&tm_q, &tm_k, &tm_v, base, group,
                       make_schedule(n_mb, heads_q, batch_size, seqlen_q, seqlen_k)};
            p.rank = draw_rank(disp);
            p.post_next(0);
            for (int i = 0;; ++i) {
                // Record i was written during tile i - 1, whose consumers had read record
                // i - 2 (the same one) before they released Q (q_empty of tile i - 2).
                trace(i, TR_Q_EMPTY);
                if (i > 0) mbar_wait(bar.q_empty(), (i - 1) & 1);
                const WorkTile w = read_tile(p.record(i));
                trace(i, TR_POSTED);
                trace_value(i, TR_N_TILES, w.n_tiles);
                if (w.head < 0) {
                    mbar_arrive(bar.q_full());  // the consumers read "no work left" and stop
                    leave_dispenser(disp);
                    break;
                }
                // The next tile's rank, drawn early to hide the atomic (none while the
                // slot of split tiles has segments left).
                if (p.cur.pos == p.cur.end) p.rank = draw_rank(disp);
                if (w.n_tiles == 0) {
                    p.post_next(i + 1);
                    p.k0_loaded = false;
                    mbar_arrive(bar.q_full());
                } else {
                    p.produce(w, i);
                }
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int cw = wg - 1;
        if (FM_PINGPONG && cw == NCW - 1) turn_pass(cw);  // warpgroup 0 issues first
        const i64 q_stride = (i64)heads_q * D;
        for (int i = 0;; ++i) {
            mbar_wait(bar.q_full(), i & 1);
            trace(i, TR_POSTED);
            const WorkTile w = read_tile(tile_records + (i & 1) * 32);  // tile_record(base, i)
            if (w.head < 0) break;
            u16* og = o + ((i64)w.batch * seqlen_q * heads_q + w.head) * D;
            float* lseg = lse + ((i64)w.batch * heads_q + w.head) * seqlen_q;
            consume(sQ, sK, sV, base + OFF_STAGE, bar, cw, w.m0 + cw * 64, w.n_tiles, w.kt_end, w.split, seqlen_q,
                    seqlen_k, diag, softmax_scale_log2, &tm_o, w.head, w.batch, og, q_stride, lseg, ring, i,
                    workspace);
        }
        // The shared memory the last O stores read must outlive them.
        if (O_TMA_STORE && (threadIdx.x & 31) == 0) bulk_wait<0>();
    }
}
