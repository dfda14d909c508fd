// flashmoe — attention backward for Hopper (sm_90a): the dK/dV kernel on warpgroup MMAs
// (wgmma), with dQ made either by a second kernel (FM_DQ_MODE 0: no atomics, every gradient
// element accumulated by one CTA in a fixed order, so two runs give the same bits) or by
// the dK/dV kernel itself (FM_DQ_MODE 1, 2: dS·K per key block, added into an f32 workspace;
// see "Fused dQ" below).
//
// Compiled at run time by NVRTC for sm_90a only; specialised by defines (the table is
// crates/flashmoe/src/attention/backward.rs, `Sm90BwdTile`, which mirrors the constants and
// the shared-memory sizes below):
//   FM_HEAD_DIM     D: 64, 96 or 128 (rows are held as 64-column panels, one 128-byte
//                   swizzled row each, the layout wgmma's 128B-swizzle descriptors read; at
//                   D = 96 the second panel's last 32 columns are neither loaded nor read;
//                   no FM_PRODUCER there, and the fused dQ takes 64 query rows a step)
//   FM_DTYPE_BF16   0 = fp16, 1 = bf16 (accumulation is fp32)
//   FM_CAUSAL       1: bottom-right causal, row i sees keys j <= i + Sk - Sq + window_right
//                   (window_right = 0: plain causal)
//   FM_WINDOW       1: also hide keys j < i + Sk - Sq - window_left (implies FM_CAUSAL; the
//                   portable kernels' convention, window sides >= 0, 1 << 30 unbounded)
//   FM_KV_BLOCK_M   query rows per step of the dK/dV kernel (64 or 128: the wgmma N of its
//                   score-shaped products; with fused dQ 64, or 128 at D = 64)
//   FM_Q_BLOCK_N    keys per step of the dQ kernel (64 or 128)
//   FM_STAGES       depth of the streamed-tile ring of both kernels (2 or 3)
//   FM_DQ_MODE      0: dQ by flash_attn_bwd_sm90_dq; 1: fused, unordered reductions;
//                   2: fused, each dQ tile takes the key blocks in increasing order
//   FM_SOFTCAP      1: logits are c * tanh(scale * q.k / c) (c = softcap): P comes through
//                   tanh_acc as in flash_attn_bwd.cu, and dS takes the factor 1 - tanh^2:
//                   the dQ kernel folds it into the score where P is formed (the score
//                   then holds P (1 - tanh^2), all dS needs there); the dK/dV kernel, which
//                   also needs P for dV, recovers the tanh from P (lg2 P + lse2 =
//                   c log2 e tanh), one lg2 a score instead of a register a score
//   FM_VARLEN       1: packed variable-length sequences (the layouts of flash_attn_bwd.cu's
//                   FM_VARLEN: q, dO, dq (total_q, heads_q, D), k, v, dk, dv (total_k,
//                   heads_kv, D), lse2 / delta (heads_q, total_q)); every kernel below
//                   takes `const int* cu_seqlens_q, const int* cu_seqlens_k` last, its
//                   seqlen_q / seqlen_k are total_q / total_k, blockIdx.z (gridDim.z =
//                   batch) the sequence, and its row grid is sized by the longest sequence
//                   (CTAs past their sequence's end return at once). FM_DQ_MODE 0 only:
//                   the deterministic kernel pair, whose workspace (lse2, delta) does not
//                   depend on the batch.
//   FM_PRODUCER     1 or 4: the dK/dV kernel runs a third warpgroup that only loads, with
//                   that many of its warps (the others leave at once; lab tiles; dense
//                   only): Q and dO by TMA (one thread, tensor maps appended to the
//                   parameters, FM_TMAP_PARAMS: tm_q, tm_k, tm_v, tm_do over the (batch,
//                   seq, heads, D) tensors, boxes of 64 columns x the tile's rows), lse2 and
//                   delta by the loading warps' 4-byte cp.asyncs, K and V by TMA; it runs
//                   STAGES steps ahead of the two consumer warpgroups, which keep all the
//                   products and no copies, at 240 registers (setmaxnreg; the producer 24).
//                   Block 384.
// Windows with the ordered fused dQ are not served (a tile's contributors are then not a
// prefix of the key blocks).
//
// The preprocess is flash_attn_bwd.cu's (`flash_attn_bwd_preprocess`): the workspace holds
// lse2 = LSE·log2 e (+inf for a row that sees no key) and delta = rowsum(dO∘O), both
// (batch, heads_q, Sq) f32. The two kernels here read them.
//
// ABI (all tensors contiguous; q, dO, dq: (batch, Sq, heads_q, D); k, v, dk, dv: (batch,
// Sk, heads_kv, D); lse2, delta: (batch, heads_q, Sq) f32):
//   flash_attn_bwd_sm90_dkdv(q, k, v, dout, lse2, delta, u16* dk, u16* dv, int seqlen_q,
//        int seqlen_k, int heads_q, int heads_kv, float scale, float scale_log2,
//        float softcap_log2, float* dq_accum, int* dq_sem, (FM_DQ_MODE 1/2 only, else null)
//        int window_left, int window_right)
//     scale_log2 = scale * log2 e, or with FM_SOFTCAP scale / softcap (the tanh argument);
//     softcap_log2 = softcap * log2 e (unread without FM_SOFTCAP)
//     grid (ceil(Sk / 128), heads_kv, batch), or (heads_kv * batch, ceil(Sk / 128), 1) with
//     FM_DQ_MODE 2; block 256, dynamic smem KV_SMEM.
//   Fused dQ: dq_accum holds one f32 tile of 64 query rows x D per (batch, query head,
//   64-row block), in the order of the dK/dV kernel's accumulators (dq_part_offset), and
//   dq_sem one int per tile; flash_attn_bwd_sm90_dq_zero(dq_accum, n4, dq_sem, n_sem)
//   zeroes both before, flash_attn_bwd_sm90_dq_convert(dq_accum, dq, Sq, heads_q, scale)
//   (grid (ceil(Sq / 64), heads_q, batch), block 256) writes dq after.
//   flash_attn_bwd_sm90_dq(q, k, v, dout, lse2, delta, u16* dq, seqlen_q, seqlen_k,
//        heads_q, heads_kv, scale, scale_log2, softcap_log2, window_left, window_right)
//     grid (ceil(Sq / 128), heads_q, batch), block 256, dynamic smem Q_SMEM.
//
// Structure. Both kernels run two warpgroups; warpgroup w owns 64 rows of the stationary
// block (keys in dK/dV, queries in dQ), which are the M of every wgmma it issues, so that
// every product takes its 16-bit left operand either from shared memory (the stationary
// rows) or from registers (P and dS, re-packed from the fp32 accumulators), and no tile
// makes a round trip through shared memory:
//   dK/dV (per step: BM query rows of one query head of the GQA group)
//     S^T  = K Q^T      A = K (smem, K-major)   B = Q  (smem, K-major)
//     dP^T = V dO^T     A = V                   B = dO
//     P^T  = exp2(S^T·scale_log2 − lse2)        (masked)
//     dV  += P^T dO     A = P^T (registers)     B = dO (smem, MN-major)
//     dS^T = P^T ∘ (dP^T − delta)
//     dK  += dS^T Q     A = dS^T (registers)    B = Q  (smem, MN-major)
//   dQ (per step: BN keys)
//     S = Q K^T, dP = dO V^T (A from smem), P, dS = P ∘ (dP − delta)
//     dQ  += dS K       A = dS (registers)      B = K  (smem, MN-major)
// Seven products of the forward's size against the five of a design that adds dQ with
// atomics from the dK/dV kernel: the price of determinism, 5/7 of the tensor-core ceiling.
// The streamed tiles (Q, dO, lse2, delta; K, V) go through a ring of FM_STAGES buffers filled
// by cp.async from all threads, FM_STAGES - 1 steps ahead (issued under a step's last
// product, where they cost no tensor time), into the 128B-swizzled layout (chunk c of
// row r of a 64-column half at c ^ (r & 7)). There is no CTA barrier in the loop: each
// fill completes on its slot's `full` mbarrier (cp.async.mbarrier.arrive.noinc, one
// arrival per thread); a thread waits for `full`, fences the generic-proxy writes it now
// sees towards the async proxy (wgmma), and once its warpgroup's wgmmas reading the slot
// have completed, each of its warps arrives on the slot's `empty` barrier, which every
// thread waits for before it refills the slot. So the two warpgroups drift apart by up to
// FM_STAGES - 1 steps, and one's exponentials overlap the other's products. (A variant with
// a producer warp issuing all the cp.asyncs was slower than this: one warp's copies could
// not keep up.) Rows past the sequence ends are zero-filled and masked.

#ifndef FM_HEAD_DIM
#error "FM_HEAD_DIM must be defined"
#endif
#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#ifndef FM_CAUSAL
#define FM_CAUSAL 0
#endif
#ifndef FM_WINDOW
#define FM_WINDOW 0
#endif
#ifndef FM_KV_BLOCK_M
#define FM_KV_BLOCK_M 64
#endif
#ifndef FM_Q_BLOCK_N
#define FM_Q_BLOCK_N 64
#endif
#ifndef FM_STAGES
#define FM_STAGES 2
#endif
#ifndef FM_DQ_MODE
#define FM_DQ_MODE 0
#endif
#ifndef FM_SOFTCAP
#define FM_SOFTCAP 0
#endif
#ifndef FM_PRODUCER
#define FM_PRODUCER 0
#endif
#if FM_PRODUCER
#define FM_TMAP_PARAMS                                                                         \
    , const __grid_constant__ FmTensorMap tm_q, const __grid_constant__ FmTensorMap tm_k,    \
        const __grid_constant__ FmTensorMap tm_v, const __grid_constant__ FmTensorMap tm_do
#else
#define FM_TMAP_PARAMS
#endif
#include "fm_sm90.cuh"
#include "fm_bwd_span.cuh"  // Span: one sequence's rows, dense or varlen

namespace fmb90 {

constexpr int D = FM_HEAD_DIM;
constexpr bool CAUSAL = FM_CAUSAL != 0;
constexpr bool WINDOW = FM_WINDOW != 0;
static_assert(!WINDOW || CAUSAL, "FM_WINDOW implies FM_CAUSAL");
constexpr bool SOFTCAP = FM_SOFTCAP != 0;
constexpr int CPR = D / 8;    // 16-byte chunks per row
constexpr int DP = (D + 63) / 64 * 64;  // a row's columns in shared memory (whole panels)
constexpr int CPRS = DP / 8;            // its 16-byte slots
constexpr int NWG = 2;        // warpgroups; each owns 64 stationary rows
constexpr int THREADS = 128 * NWG;  // the consumer warpgroups (all of the dQ kernel's)
// FM_PRODUCER: the dK/dV kernel's loading warpgroup (index NWG) and its register split: the
// launch gives 65536 / 384 = 168 a thread; 24 + 2 x 240 over 128 threads is all of it.
constexpr bool PRODUCER = FM_PRODUCER != 0;
static_assert(FM_PRODUCER == 0 || FM_PRODUCER == 1 || FM_PRODUCER == 4, "FM_PRODUCER: 0, 1 or 4 loading warps");
constexpr int LOAD_THREADS = 32 * FM_PRODUCER;  // the producer's threads that load
constexpr int KV_THREADS = THREADS + (PRODUCER ? 128 : 0);
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = 240;
static_assert(!PRODUCER || 128 * (PRODUCER_REGS + NWG * CONSUMER_REGS) <= (65536 / KV_THREADS) / 8 * 8 * KV_THREADS,
              "register split");
static_assert(!(PRODUCER && FM_VARLEN), "the producer's tensor maps are dense (batch, seq, heads, D)");
constexpr int STAGES = FM_STAGES;

constexpr int BN_KV = 64 * NWG;       // keys per dK/dV CTA
constexpr int BM_KV = FM_KV_BLOCK_M;  // query rows per dK/dV step
constexpr int BM_Q = 64 * NWG;        // query rows per dQ CTA
constexpr int BN_Q = FM_Q_BLOCK_N;    // keys per dQ step

static_assert(D == 64 || D == 96 || D == 128, "head dim 64, 96 or 128");
// The producer's TMA boxes are whole panels: D a multiple of 64.
static_assert(D % 64 == 0 || FM_PRODUCER == 0, "D = 96: no producer warpgroup");
static_assert(BM_KV == 64 || BM_KV == 128, "FM_KV_BLOCK_M must be 64 or 128");
static_assert(BN_Q == 64 || BN_Q == 128, "FM_Q_BLOCK_N must be 64 or 128");
static_assert(STAGES == 2 || STAGES == 3, "FM_STAGES must be 2 or 3");

// How dQ is made (FM_DQ_MODE): 0 = by flash_attn_bwd_sm90_dq (7 products); 1 = by the dK/dV
// kernel, added with f32 reductions into the dq_accum workspace in whatever order they
// land (5 products); 2 = the same, in a fixed order (each dQ tile takes the key blocks'
// contributions in increasing key-block order through a per-tile semaphore: bit-identical).
constexpr int DQ_MODE = FM_DQ_MODE;
constexpr bool FUSED_DQ = DQ_MODE != 0;
constexpr bool ORDERED_DQ = DQ_MODE == 2;
static_assert(DQ_MODE >= 0 && DQ_MODE <= 2, "FM_DQ_MODE must be 0, 1 or 2");
static_assert(!(WINDOW && DQ_MODE == 2), "windows with the ordered fused dQ are not served");
static_assert(!(FM_VARLEN && FUSED_DQ), "varlen runs the dQ kernel (FM_DQ_MODE 0)");
static_assert(!FUSED_DQ || BM_KV == 64 || D == 64,
              "the fused dQ product takes 128 query rows a step only at D = 64");
// Fused dQ: the step's dQ = dS (BM_KV queries x 128 keys) . K (128 keys x D), in tiles of
// DQ_TM = 64 rows x D f32. With 64 query rows a step, warpgroup w makes columns
// [w D/2, (w + 1) D/2) of the one tile from both warpgroups' dS; with 128, warpgroup w
// makes the whole tile of rows [64 w, 64 w + 64). DQ_N columns, DQ_R accumulators a thread.
constexpr int DQ_TM = 64;
// (D = 96: 48 columns a warpgroup, 64 query rows a step only.)
static_assert(!FUSED_DQ || D % 64 == 0 || BM_KV == 64, "D = 96: the fused dQ takes 64 query rows a step");
constexpr int DQ_N = BM_KV == 64 ? D / 2 : D;
constexpr int DQ_R = DQ_N / 2;
constexpr int DQ_TILE = DQ_TM * D;

// Shared-memory layouts (offsets from a 1024-byte aligned base; tiles on swizzle atoms).
constexpr int tile_bytes(int rows) { return rows * DP * 2; }
// dK/dV: [K][V][Q x STAGES][dO x STAGES][lse2 x STAGES][delta x STAGES]
constexpr int KV_OFF_V = tile_bytes(BN_KV);
constexpr int KV_OFF_Q = 2 * tile_bytes(BN_KV);
constexpr int KV_OFF_O = KV_OFF_Q + STAGES * tile_bytes(BM_KV);
constexpr int KV_OFF_L = KV_OFF_O + STAGES * tile_bytes(BM_KV);
constexpr int KV_OFF_D = KV_OFF_L + STAGES * BM_KV * 4;
// Fused dQ: dS^T of the step (128 keys x 64 queries, 16-bit), double-buffered by step parity.
constexpr int DS_BYTES = BN_KV * BM_KV * 2;
constexpr int KV_OFF_DS = (KV_OFF_D + STAGES * BM_KV * 4 + 1023) / 1024 * 1024;
constexpr int KV_OFF_BAR = FUSED_DQ ? KV_OFF_DS + 2 * DS_BYTES : KV_OFF_D + STAGES * BM_KV * 4;
constexpr int NBAR = 2 * STAGES + 1;  // full[STAGES], empty[STAGES], the stationary block
constexpr int KV_SMEM = 1024 + KV_OFF_BAR + 8 * NBAR;
// dQ: [Q][dO][K x STAGES][V x STAGES]
constexpr int Q_OFF_O = tile_bytes(BM_Q);
constexpr int Q_OFF_K = 2 * tile_bytes(BM_Q);
constexpr int Q_OFF_V = Q_OFF_K + STAGES * tile_bytes(BN_Q);
constexpr int Q_OFF_BAR = Q_OFF_V + STAGES * tile_bytes(BN_Q);
constexpr int Q_SMEM = 1024 + Q_OFF_BAR + 8 * NBAR;
static_assert(KV_SMEM <= 227 * 1024 && Q_SMEM <= 227 * 1024, "shared memory");

// This thread's warpgroup, broadcast from lane 0 so that the compiler knows it is the same
// across the warp: the stationary tiles' addresses and the wgmma descriptors built from them
// then live in uniform registers (computed per thread, each descriptor went through
// vector arithmetic and R2UR before its wgmma).
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0); }

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

// P of a visible raw score s = q.k against its row's lse2 (log2 units): the forward's logit,
// softcapped through tanh_acc with FM_SOFTCAP; `dt` gets the softcap's factor on dS,
// 1 - tanh^2 (1 without FM_SOFTCAP).
__device__ __forceinline__ float prob(float s, float scale_log2, float softcap_log2, float lse2, float& dt) {
    if (SOFTCAP) {
        const float t = tanh_acc(s * scale_log2);
        dt = fmaf(-t, t, 1.f);
        return ex2(softcap_log2 * t - lse2);
    }
    dt = 1.f;
    return ex2(s * scale_log2 - lse2);
}

// dK/dV kernel's dS of one score: P (dP - delta), times 1 - tanh^2 with FM_SOFTCAP, the tanh
// recovered from P as (lg2 P + lse2) / softcap_log2 (inv_cap = 1 / softcap_log2): keeping
// it (or P (1 - tanh^2) beside P's dV fragments) spills the D = 128 causal builds. P = 0
// (masked, or underflowed) gives 0 without reading lg2 0 = -inf.
__device__ __forceinline__ float dscore(float p, float dp, float delta, float lse2, float inv_cap) {
    float ds = p * (dp - delta);
    if (SOFTCAP) {
        const float t = (lg2(p) + lse2) * inv_cap;
        ds = p > 0.f ? ds * (1.f - t * t) : 0.f;
    }
    return ds;
}

__device__ __forceinline__ i64 clamp64(i64 x, i64 lo, i64 hi) {
    return x < lo ? lo : (x > hi ? hi : x);
}

// Byte offset of 16-byte chunk `ch` (0 .. DP/8) of row r in a swizzled tile of ROWS rows.
template <int ROWS>
__device__ __forceinline__ u32 toff(int r, int ch) {
    return (u32)((ch >> 3) * ROWS * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

// Rows [row0, row0 + ROWS) x D of the matrix at g + base (row stride `stride` elements)
// into the swizzled tile at dst; rows >= nrows are zero-filled (no read). Thread t copies
// slot t % CPRS of rows t / CPRS + i * (THREADS / CPRS): one 64-bit address per thread and
// a uniform stride between its copies (at D = 96 the threads of slots past D copy nothing).
template <int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const u16* __restrict__ g, i64 base, i64 stride,
                                          int row0, int nrows, int tid) {
    constexpr int TOTAL = ROWS * CPRS;
    constexpr int RSTEP = THREADS / CPRS;
    static_assert(TOTAL % THREADS == 0 && THREADS % CPRS == 0, "whole rounds");
    const int r0 = tid / CPRS, ch = tid % CPRS;
    if (CPR != CPRS && ch >= CPR) return;
    const u16* p = g + base + (i64)(row0 + r0) * stride + ch * 8;
#pragma unroll
    for (int it = 0; it < TOTAL / THREADS; ++it) {
        const int r = r0 + it * RSTEP;
        const bool ok = row0 + r < nrows;
        cp_async16(dst + toff<ROWS>(r, ch), ok ? p + (i64)it * RSTEP * stride : g, ok);
    }
}

// 4-byte global->shared async copy; pred false writes 4 zero bytes (no global read).
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool pred) {
    const int n = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}

// The barrier completes when this thread's earlier cp.asyncs have landed (the arrival is
// not counted ahead: the barriers are initialised with one arrival per thread).
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Ring barriers at `bar`: full[s], empty[s], then the stationary block's.
struct Ring {
    u32 bar;
    __device__ u32 full(int s) const { return bar + 8 * s; }
    __device__ u32 empty(int s) const { return bar + 8 * (STAGES + s); }
    __device__ u32 fixed() const { return bar + 8 * 2 * STAGES; }
    // `fillers`: the arrivals that complete a fill (every thread's cp.asyncs; with the dK/dV
    // kernel's producer, its 128 threads' cp.asyncs of lse2 and delta and its thread 0's
    // arrival with the TMA bytes of Q and dO); `fixed_fillers` the same for K and V (the
    // producer: one TMA arrival).
    __device__ void init(u32 fillers, u32 fixed_fillers) const {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), fillers);
            // One arrival per thread: every thread's reads of the slot (the lse2/delta rows
            // it read with ordinary loads) happen before its own arrival, which is what
            // compute-sanitizer's racecheck follows (an arrival by one lane per warp after
            // __syncwarp orders them too, but racecheck reports it as a hazard).
            mbar_init(empty(s), THREADS);
        }
        mbar_init(fixed(), fixed_fillers);
        mbar_init_fence();
    }
    // Before refilling slot s for its use number `use` (0, 1, ..): the previous use's wgmmas
    // are complete in every warp.
    __device__ void wait_empty(int s, int use) const {
        if (use > 0) mbar_wait(empty(s), (use - 1) & 1);
    }
};

// This thread's reads of slot s are done and its warpgroup's wgmmas reading it completed.
__device__ __forceinline__ void release(const Ring& ring, int s) { mbar_arrive(ring.empty(s)); }

// acc (64 x N) = A (64 rows x D at sA, K-major, tile of AROWS rows) * B^T (N rows x D at sB,
// K-major, tile of N rows): the score-shaped products. Issued, not committed.
template <int AROWS, int N>
__device__ __forceinline__ void issue_abt(float (&acc)[N / 2], u32 sA, u32 sB) {
    const u64 da = smem_desc_sw128(sA, 16, 1024);
    const u64 db = smem_desc_sw128(sB, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u32 inner = (kk & 3) * 32;
        wgmma_ss<0, 0>(acc, desc_add(da, (kk >> 2) * AROWS * 128 + inner),
                       desc_add(db, (kk >> 2) * N * 128 + inner), kk > 0 ? 1 : 0);
    }
}

// acc (64 x D) += A (64 x K, register fragments) * B (K rows x D at sB, MN-major).
template <int K>
__device__ __forceinline__ void issue_pb(float (&acc)[D / 2], const u32 (&a)[K / 16][4], u32 sB) {
    const u64 db = smem_desc_sw128(sB, K * 128, 1024);  // LBO: the next 64 columns of D
    if constexpr (D % 64 == 0) {
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) wgmma_rs<1>(acc, a[kk], desc_add(db, kk * 16 * 128), 1);
    } else {
        // D = 96: columns [0, 64) from the first panel (N = 64) and [64, 96) from the second
        // (N = 32, the panel's first half, as the fused dQ reads K at D = 64); an N = 96
        // accumulator's fragments are the N = 64 one's followed by the N = 32 one's.
        float(&lo)[32] = *reinterpret_cast<float(*)[32]>(&acc[0]);
        float(&hi)[16] = *reinterpret_cast<float(*)[16]>(&acc[32]);
        const u64 dh = smem_desc_sw128(sB + K * 128, K * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) {
            wgmma_rs<1>(lo, a[kk], desc_add(db, kk * 16 * 128), 1);
            wgmma_rs<1>(hi, a[kk], desc_add(dh, kk * 16 * 128), 1);
        }
    }
}

// fp32 accumulator (64 x N) to 16-bit A fragments: k16 step kk = 8-column blocks 2kk, 2kk+1.
template <int N>
__device__ __forceinline__ void pack_a(const float (&acc)[N / 2], u32 (&a)[N / 16][4]) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) a[j >> 1][(j & 1) * 2 + h] = pack2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
}

// Fused dQ. This warpgroup's dS^T rows (16-bit A fragments of its 64 keys x 64 queries)
// into the step's dS^T tile at sDS (128 key rows, the 64 queries one 128-byte swizzled row
// each): the MN-major A operand of dQ = dS K. Conflict-free: the 8 rows a warp writes per
// fragment register land in 8 different 16-byte chunks.
__device__ __forceinline__ void store_ds(const u32 (&a)[BM_KV / 16][4], u32 sDS, int cw, int warp, int lane) {
#pragma unroll
    for (int j = 0; j < BM_KV / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = cw * 64 + warp * 16 + (lane >> 2) + 8 * h;
            st_shared_u32(sDS + toff<BN_KV>(r, j) + 4 * (lane & 3), a[j >> 1][(j & 1) * 2 + h]);
        }
}

// acc (64 queries x DQ_N columns of dQ from column `col0`) = dS (64 queries from `q0` x 128
// keys, the MN-major tile at sDS) . K (128 keys x D at sK, MN-major). Issued, not committed.
// (A template so that only the branch of its accumulator's size is instantiated.)
template <int R>
__device__ __forceinline__ void issue_dq(float (&acc)[R], u32 sDS, u32 sK, int q0, int col0) {
    const u64 da = smem_desc_sw128(sDS + (q0 / 64) * BN_KV * 128, 0, 1024);
    // D = 128: a whole 64-column half of K; D = 64: 32 columns into the one half (+64 B
    // inside each swizzled row, which the hardware's address swizzle keeps consistent).
    const u64 db = smem_desc_sw128(sK + (col0 / 64) * BN_KV * 128 + (col0 % 64) * 2, 0, 1024);
    if constexpr (R % 16 == 0) {
#pragma unroll
        for (int kk = 0; kk < BN_KV / 16; ++kk)
            wgmma_ss<1, 1>(acc, desc_add(da, kk * 16 * 128), desc_add(db, kk * 16 * 128), kk > 0 ? 1 : 0);
    } else {
        // D = 96: 48 columns from column 48 w straddle a panel for warpgroup 1, so each
        // warpgroup issues three N = 16 products (16 columns, 32 bytes, inside one panel),
        // the same code for both (an N = 48 accumulator's fragments are the three N = 16
        // ones' in order).
        static_assert(R == 24, "three N = 16 blocks");
#pragma unroll
        for (int b = 0; b < 3; ++b) {
            const int c = col0 + 16 * b;
            const u64 dbb = smem_desc_sw128(sK + (c / 64) * BN_KV * 128 + (c % 64) * 2, 0, 1024);
            float(&part)[8] = *reinterpret_cast<float(*)[8]>(&acc[8 * b]);
#pragma unroll
            for (int kk = 0; kk < BN_KV / 16; ++kk)
                wgmma_ss<1, 1>(part, desc_add(da, kk * 16 * 128), desc_add(dbb, kk * 16 * 128), kk > 0 ? 1 : 0);
        }
        (void)db;
    }
}

// The dq_accum workspace: one f32 tile of 64 query rows x D per (batch, query head, 64-row
// block), in two halves of D/2 columns; half h holds float4 j (columns h D/2 + 8 j +
// 2 (t & 3) + {0, 1} of rows 16 (t / 32) + (t & 31) / 4 + {0, 8}) of thread t (0..127) at
// float offset h DQ_TILE/2 + (j 128 + t) 4: the layout of a 64-row step's accumulators,
// where warpgroup h holds half h, so that each warpgroup's part is contiguous and a warp's
// float4s cover 512 contiguous bytes. A 128-row step's warpgroup holds all D columns of its
// tile: its float4 j is float4 j % DQ_JH of half j / DQ_JH.
constexpr int DQ_JH = D / 16;  // float4s of a half per thread
__device__ __forceinline__ int dq_part_offset(int j, int t) {
    return (j / DQ_JH) * (DQ_TILE / 2) + ((j % DQ_JH) * 128 + t) * 4;
}

// Add this thread's DQ_R accumulators into its warpgroup's part at g (dq_part_offset).
__device__ __forceinline__ void red_tile(const float (&acc)[DQ_R], float* __restrict__ g, int tid) {
#pragma unroll
    for (int j = 0; j < DQ_R / 4; ++j) {
        float* p = g + dq_part_offset(j, tid & 127);
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(acc[4 * j]),
                     "f"(acc[4 * j + 1]), "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3])
                     : "memory");
    }
}

// Ordered fused dQ: an increment of the tile semaphore at p that releases this thread's
// (and, after a __syncwarp, its warp's) earlier writes to whoever acquires the new value.
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// This thread's part of a 64 x D accumulator (rows row0 + 16 warp + lane/4 + 8h) times
// `mul`, as 16-bit pairs into rows < nrows of the matrix at g + base.
__device__ __forceinline__ void store_acc(const float (&acc)[D / 2], float mul, u16* __restrict__ g, i64 base,
                                          i64 stride, int row0, int nrows, int warp, int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + warp * 16 + (lane >> 2) + 8 * h;
        if (r >= nrows) continue;
        u16* p = g + base + (i64)r * stride + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<u32*>(p + 8 * j) = pack2(acc[4 * j + 2 * h] * mul, acc[4 * j + 2 * h + 1] * mul);
    }
}

}  // namespace fmb90

// ----------------------------------------------------------------------------------------
// dK, dV: one CTA per (128-key block, kv head, batch); warpgroup w owns keys 64w .. 64w+63.
// ----------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(fmb90::KV_THREADS, 1)
    flash_attn_bwd_sm90_dkdv(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                             const u16* __restrict__ dout, const float* __restrict__ lse2,
                             const float* __restrict__ delta, u16* __restrict__ dk, u16* __restrict__ dv,
                             int seqlen_q, int seqlen_k, int heads_q, int heads_kv, float scale,
                             float scale_log2, float softcap_log2, float* __restrict__ dq_accum,
                             int* __restrict__ dq_sem, int window_left, int window_right FM_CU_PARAMS
                                 FM_TMAP_PARAMS) {
    using namespace fmb90;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const int tid = threadIdx.x, cw = warpgroup_index(), warp = (tid >> 5) & 3, lane = tid & 31;
    // Ordered dQ: the grid is (heads_kv * batch, key blocks, 1), key blocks slowest, so a
    // tile's contributors are dispatched in the order they add (a CTA waits only on CTAs
    // dispatched before it: no deadlock) and one wave holds key blocks of many heads (a key
    // block rarely waits for the one before it). Otherwise (key blocks, heads_kv, batch).
#if FM_DQ_MODE == 2
    const int kblock = blockIdx.y, kvh = blockIdx.x % heads_kv, batch = blockIdx.x / heads_kv;
#else
    const int kblock = blockIdx.x, kvh = blockIdx.y, batch = blockIdx.z;
#endif
    const int n0 = kblock * BN_KV;
    const Span sp = FM_SPAN(batch);
    // From here on seqlen_q / seqlen_k are this sequence's lengths.
    seqlen_q = sp.sq;
    seqlen_k = sp.sk;
    if (n0 >= seqlen_k) return;  // varlen: past this sequence's keys (the whole CTA)
    const int group = heads_q / heads_kv;
    const i64 q_stride = (i64)heads_q * D, kv_stride = (i64)heads_kv * D;
    const i64 kv_off = (sp.k0 * heads_kv + kvh) * D;
    const i64 diag = (i64)seqlen_k - seqlen_q;
    const float inv_cap = SOFTCAP ? 1.f / softcap_log2 : 0.f;

    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    unsigned char* gen = smem_raw + (base - smem_addr(smem_raw));
    const u32 sK = base, sV = base + KV_OFF_V;
    const float* fL = reinterpret_cast<const float*>(gen + KV_OFF_L);
    const float* fD = reinterpret_cast<const float*>(gen + KV_OFF_D);
    const Ring ring{base + KV_OFF_BAR};
    if (tid == 0) ring.init(PRODUCER ? LOAD_THREADS + 1 : THREADS, PRODUCER ? 1 : THREADS);
    __syncthreads();

    // Queries that may see a key of this block: [i_lo, i_hi).
    i64 i_lo = 0, i_hi = seqlen_q;
    if (CAUSAL) i_lo = clamp64((i64)n0 - diag - window_right, 0, seqlen_q);
    if (WINDOW) {
        const i64 n_last = (i64)min(n0 + BN_KV, seqlen_k) - 1;
        i_hi = clamp64(n_last - diag + window_left + 1, 0, seqlen_q);
    }
    const int mb_lo = (int)(i_lo / BM_KV);
    const int n_mb = i_lo < i_hi ? (int)((i_hi + BM_KV - 1) / BM_KV) - mb_lo : 0;
    const int steps = n_mb * group;

    // This thread's two key rows, the first query each sees (qlo; Sq: none) and, with a
    // window, the last (qhi).
    int qlo[2], qhi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 j = (i64)n0 + cw * 64 + warp * 16 + (lane >> 2) + 8 * h;
        i64 lo = 0, hi = (i64)seqlen_q - 1;
        if (CAUSAL) lo = clamp64(j - diag - window_right, 0, seqlen_q);
        if (WINDOW) hi = clamp64(j - diag + window_left, -1, (i64)seqlen_q - 1);
        if (j >= seqlen_k) lo = seqlen_q;
        qlo[h] = (int)lo;
        qhi[h] = (int)hi;
    }
    (void)qhi;

    // A step's query head and query block. Steps go through the query blocks of each head
    // of the GQA group in turn; positions advance by one step without integer divisions
    // (step / n_mb and step % n_mb cost ~3 % of the warps' stall samples at D = 128).
    struct StepPos {
        int h, mb;
    };
    auto advance = [&](StepPos& p) {
        if (++p.mb == mb_lo + n_mb) {
            p.mb = mb_lo;
            ++p.h;
        }
    };
    auto load_step = [&](const StepPos& p, int buf) {
        const int m0 = p.mb * BM_KV;
        const i64 q_off = (sp.q0 * heads_q + p.h) * D;
        load_tile<BM_KV>(base + KV_OFF_Q + buf * tile_bytes(BM_KV), q, q_off, q_stride, m0, seqlen_q, tid);
        load_tile<BM_KV>(base + KV_OFF_O + buf * tile_bytes(BM_KV), dout, q_off, q_stride, m0, seqlen_q, tid);
        // lse2 rows by threads [0, BM_KV), delta rows by [BM_KV, 2 BM_KV).
        static_assert(2 * BM_KV <= THREADS, "one lse2/delta element a thread");
        if (tid < 2 * BM_KV) {
            const i64 l_off = sp.l0 + (i64)p.h * sp.lh;
            const int r = tid % BM_KV;
            const bool ok = m0 + r < seqlen_q;
            const float* src = (tid < BM_KV ? lse2 : delta) + (ok ? l_off + m0 + r : 0);
            cp_async4(base + (tid < BM_KV ? KV_OFF_L : KV_OFF_D) + (buf * BM_KV + r) * 4, src, ok);
        }
    };

#if FM_PRODUCER
    if (cw == NWG) {
        // The producer: K and V once, then every step's tiles as soon as its slot is free
        // (STAGES steps ahead of the consumers); nothing else.
        setmaxnreg_dec<PRODUCER_REGS>();
        // The loading threads: [0, LOAD_THREADS) of the warpgroup (pt's range known to the
        // compiler, which folds the row arithmetic below); the other warps leave.
        if ((tid & 127) >= LOAD_THREADS) return;
        const int pt = tid & (LOAD_THREADS - 1);
        if (pt == 0) {
            mbar_arrive_expect_tx(ring.fixed(), 2 * tile_bytes(BN_KV));
#pragma unroll
            for (int half = 0; half < D / 64; ++half) {
                tma_load_4d(sK + half * BN_KV * 128, &tm_k, ring.fixed(), half * 64, kvh, n0, batch);
                tma_load_4d(sV + half * BN_KV * 128, &tm_v, ring.fixed(), half * 64, kvh, n0, batch);
            }
        }
        // Each step's [lse2 rows | delta rows] (2 BM_KV elements): this thread's are pt,
        // pt + LOAD_THREADS, ...; one base pointer per array, the rows as offsets from
        // them (the producer has 24 registers).
        constexpr int PER = 2 * BM_KV / LOAD_THREADS;
        static_assert(PER * LOAD_THREADS == 2 * BM_KV, "whole rows per loading thread");
        const float* const lse_row = lse2 + sp.l0;
        const float* const delta_row = delta + sp.l0;
        StepPos pos{kvh * group, mb_lo};
        int slot = 0, use = 0;
        for (int step = 0; step < steps; ++step) {
            ring.wait_empty(slot, use);
            const int m0 = pos.mb * BM_KV;
            if (pt == 0) {
                const u32 full = ring.full(slot);
                mbar_arrive_expect_tx(full, 2 * tile_bytes(BM_KV));
                const u32 sQ = base + KV_OFF_Q + slot * tile_bytes(BM_KV);
                const u32 sO = base + KV_OFF_O + slot * tile_bytes(BM_KV);
#pragma unroll
                for (int half = 0; half < D / 64; ++half) {
                    tma_load_4d(sQ + half * BM_KV * 128, &tm_q, full, half * 64, pos.h, m0, batch);
                    tma_load_4d(sO + half * BM_KV * 128, &tm_do, full, half * 64, pos.h, m0, batch);
                }
            }
            const i64 l_step = (i64)pos.h * sp.lh + m0;
#pragma unroll
            for (int e = 0; e < PER; ++e) {
                const int i = pt + LOAD_THREADS * e;  // of [lse2 rows | delta rows]
                const bool is_lse = i < BM_KV;
                const int r = is_lse ? i : i - BM_KV;
                const bool ok = m0 + r < seqlen_q;
                const float* src = (is_lse ? lse_row : delta_row) + l_step + r;
                const u32 dst = base + (is_lse ? KV_OFF_L : KV_OFF_D) + (slot * BM_KV + r) * 4;
                cp_async4(dst, ok ? src : lse2, ok);
            }
            cp_async_arrive(ring.full(slot));
            advance(pos);
            if (++slot == STAGES) {
                slot = 0;
                ++use;
            }
        }
        cp_async_wait<0>();
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();
#else
    load_tile<BN_KV>(sK, k, kv_off, kv_stride, n0, seqlen_k, tid);
    load_tile<BN_KV>(sV, v, kv_off, kv_stride, n0, seqlen_k, tid);
    cp_async_arrive(ring.fixed());
    // The ring runs STAGES - 1 steps ahead: steps 0 .. STAGES - 2 now, step s + STAGES - 1
    // during step s (under its last product).
    StepPos ahead{kvh * group, mb_lo};
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < steps) {
            load_step(ahead, s);
            cp_async_arrive(ring.full(s));
            advance(ahead);
        }
#endif

    float dk_acc[D / 2], dv_acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk_acc[i] = dv_acc[i] = 0.f;
    const u32 sKw = sK + cw * 64 * 128, sVw = sV + cw * 64 * 128;
    // Fused dQ: the dS^T buffers and the number of 64-row dQ tiles a head has.
    // (An array indexed by step parity: it costs 8 bytes of stack where a computed address
    // costs registers, and the D = 128 kernel is at the 255-register limit.)
    const u32 sDS[2] = {base + KV_OFF_DS, base + KV_OFF_DS + DS_BYTES};

    mbar_wait(ring.fixed(), 0);
    int buf = 0, round = 0;
    StepPos at{kvh * group, mb_lo};
    for (int step = 0; step < steps; ++step) {
        // Step + STAGES - 1's tiles into the slot step - 1 used (which both warpgroups have
        // released: with fused dQ this warpgroup has passed this step's barrier, so the other
        // has finished step - 1). Called once this step's last product is issued, so the
        // copies' issue and address arithmetic run under it. (At the loop top the tensor
        // pipe idled under them: ~20 % of the stall samples, v4's profile; between the
        // scores' wgmmas and their wait, ptxas serialised the causal builds' wgmmas, C7511.)
        auto load_ahead = [&]() {
#if !FM_PRODUCER  // (the producer warpgroup loads)
            if (step + STAGES - 1 < steps) {
                const int lb = buf == 0 ? STAGES - 1 : buf - 1;
                ring.wait_empty(lb, (step + STAGES - 1) / STAGES);
                load_step(ahead, lb);
                cp_async_arrive(ring.full(lb));
                advance(ahead);
            }
#endif
        };
        mbar_wait(ring.full(buf), round & 1);
        fence_proxy_async_smem();  // the cp.async writes just seen, towards wgmma
        const int m0 = at.mb * BM_KV;
        const u32 sQ = base + KV_OFF_Q + buf * tile_bytes(BM_KV);
        const u32 sO = base + KV_OFF_O + buf * tile_bytes(BM_KV);
        const float* L = fL + buf * BM_KV;
        const float* Dl = fD + buf * BM_KV;
        const bool need_mask = CAUSAL || m0 + BM_KV > seqlen_q || n0 + BN_KV > seqlen_k;

        float st[BM_KV / 2], dpt[BM_KV / 2];
        wgmma_fence();
        issue_abt<BN_KV, BM_KV>(st, sKw, sQ);  // S^T = K Q^T
        wgmma_commit();
        issue_abt<BN_KV, BM_KV>(dpt, sVw, sO);  // dP^T = V dO^T
        wgmma_commit();
        wgmma_wait<1>();
        reg_fence(st);
        // P^T (kept in st for dS^T)
#pragma unroll
        for (int j = 0; j < BM_KV / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = 8 * j + 2 * (lane & 3) + c;
                    const bool vis = !need_mask || (m0 + col >= qlo[h] && m0 + col < seqlen_q &&
                                                     (!WINDOW || m0 + col <= qhi[h]));
                    float& x = st[4 * j + 2 * h + c];
                    float dt;  // (recovered from P in dscore: no register holds it here)
                    x = vis ? prob(x, scale_log2, softcap_log2, L[col], dt) : 0.f;
                }
        // dS^T = P^T (dP^T - delta) [* (1 - tanh^2)], into dpt
        auto make_ds = [&]() {
#pragma unroll
            for (int j = 0; j < BM_KV / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = 8 * j + 2 * (lane & 3) + (e & 1);
                    dpt[4 * j + e] = dscore(st[4 * j + e], dpt[4 * j + e], Dl[col], SOFTCAP ? L[col] : 0.f,
                                            inv_cap);
                }
        };
        // Fused dQ: this step's tile(s), and (ordered) this key block's turn on them. With
        // 128 query rows a step, warpgroup w's tile may lie past Sq (then it adds nothing).
        const i64 tile = sp.qt0 + at.h * sp.nt + m0 / DQ_TM + (BM_KV == 64 ? 0 : cw);
        const bool tile_live = BM_KV == 64 || m0 + cw * 64 < seqlen_q;
        auto wait_turn = [&]() {
            if constexpr (ORDERED_DQ) {
                // The tile's semaphore counts warp hand-offs: key blocks 0 .. kblock - 1
                // have added their parts once it reads HANDOFFS * kblock.
                constexpr int HANDOFFS = BM_KV == 64 ? NWG * 4 : 4;
                if ((BM_KV == 64 ? tid : (tid & 127)) == 0 && tile_live) {
                    while (ld_acquire_gpu(dq_sem + tile) != HANDOFFS * kblock) {
                    }
                }
                named_bar_sync(1, THREADS);  // this key block's turn on the tile(s)
            }
        };
        // This warpgroup's part of the tile: half cw of a 64-row step's tile, or the whole
        // tile of its 64 rows in a 128-row step.
        float* const dq_dst =
            FUSED_DQ ? dq_accum + (i64)tile * DQ_TILE + (BM_KV == 64 ? cw * (DQ_TILE / 2) : 0) : nullptr;
        auto add_dq = [&](const float (&dq_part)[DQ_R]) {
            if (tile_live) red_tile(dq_part, dq_dst, tid);
            if constexpr (ORDERED_DQ) {
                // Hand on: each warp's reductions, then one releasing increment per warp
                // (__syncwarp orders the other lanes' reductions before lane 0's release).
                __syncwarp();
                if (lane == 0 && tile_live) red_release_gpu_add(dq_sem + tile, 1);
            }
        };
        const int dq_q0 = BM_KV == 64 ? 0 : cw * 64, dq_col0 = BM_KV == 64 ? cw * DQ_N : 0;

        if constexpr (FUSED_DQ) {
            // P^T and dS^T both finished in fp32 before any product reads them (fewer live
            // registers than packing P^T under dV), then dV, (barrier) dQ, dK back to back,
            // with dQ's reductions under dK.
            wgmma_wait<0>();  // dP^T
            reg_fence(dpt);
            make_ds();
            u32 pa[BM_KV / 16][4], pb[BM_KV / 16][4];
            pack_a<BM_KV>(st, pa);   // P^T
            pack_a<BM_KV>(dpt, pb);  // dS^T
            store_ds(pb, sDS[step & 1], cw, warp, lane);
            fence_proxy_async_smem();  // the dS^T rows just written, towards wgmma
            wgmma_fence();
            issue_pb<BM_KV>(dv_acc, pa, sO);  // dV += P^T dO
            wgmma_commit();
            named_bar_sync(1, THREADS);  // both warpgroups' dS^T rows are in place
            wait_turn();
            float dq_part[DQ_R];
            wgmma_fence();
            issue_dq(dq_part, sDS[step & 1], sK, dq_q0, dq_col0);  // dQ = dS K
            wgmma_commit();
            issue_pb<BM_KV>(dk_acc, pb, sQ);  // dK += dS^T Q
            wgmma_commit();
            wgmma_wait<1>();  // dV and dQ done; dK may still run under the reductions
            reg_fence(dq_part);
            add_dq(dq_part);
            load_ahead();
            wgmma_wait<0>();
            reg_fence(dv_acc);
            reg_fence(dk_acc);
            reg_fence_u32(pa);
            reg_fence_u32(pb);
        } else {
            // The kernel pair's dK/dV: dV issued under dS^T.
            u32 pa[BM_KV / 16][4];
            pack_a<BM_KV>(st, pa);
            wgmma_fence();
            issue_pb<BM_KV>(dv_acc, pa, sO);  // dV += P^T dO
            wgmma_commit();
            wgmma_wait<1>();  // dP^T has landed (dV may still run)
            reg_fence(dpt);
            make_ds();
            wgmma_wait<0>();  // dV done: pa is free
            reg_fence(dv_acc);
            reg_fence_u32(pa);
            pack_a<BM_KV>(dpt, pa);
            wgmma_fence();
            issue_pb<BM_KV>(dk_acc, pa, sQ);  // dK += dS^T Q
            wgmma_commit();
            load_ahead();
            wgmma_wait<0>();
            reg_fence(dk_acc);
            reg_fence_u32(pa);
        }
        release(ring, buf);
        advance(at);
        if (++buf == STAGES) {
            buf = 0;
            ++round;
        }
    }
    cp_async_wait<0>();
    store_acc(dk_acc, scale, dk, kv_off, kv_stride, n0 + cw * 64, seqlen_k, warp, lane);
    store_acc(dv_acc, 1.f, dv, kv_off, kv_stride, n0 + cw * 64, seqlen_k, warp, lane);
}

#if FM_DQ_MODE == 0  // (the fused modes make dQ in the dK/dV kernel)
// ----------------------------------------------------------------------------------------
// dQ: one CTA per (128-row query block, query head, batch); warpgroup w owns rows 64w ...
// ----------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(fmb90::THREADS, 1)
    flash_attn_bwd_sm90_dq(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                           const u16* __restrict__ dout, const float* __restrict__ lse2,
                           const float* __restrict__ delta, u16* __restrict__ dq, int seqlen_q,
                           int seqlen_k, int heads_q, int heads_kv, float scale, float scale_log2,
                           float softcap_log2, int window_left, int window_right FM_CU_PARAMS) {
    using namespace fmb90;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const int tid = threadIdx.x, cw = warpgroup_index(), warp = (tid >> 5) & 3, lane = tid & 31;
    const int m0 = blockIdx.x * BM_Q;
    const int head = blockIdx.y, batch = blockIdx.z;
    const Span sp = FM_SPAN(batch);
    // From here on seqlen_q / seqlen_k are this sequence's lengths.
    seqlen_q = sp.sq;
    seqlen_k = sp.sk;
    if (m0 >= seqlen_q) return;  // varlen: past this sequence's queries (the whole CTA)
    const int kvh = head / (heads_q / heads_kv);
    const i64 q_stride = (i64)heads_q * D, kv_stride = (i64)heads_kv * D;
    const i64 q_off = (sp.q0 * heads_q + head) * D;
    const i64 kv_off = (sp.k0 * heads_kv + kvh) * D;
    const i64 diag = (i64)seqlen_k - seqlen_q;

    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sQ = base, sO = base + Q_OFF_O;
    const Ring ring{base + Q_OFF_BAR};
    if (tid == 0) ring.init(THREADS, THREADS);
    __syncthreads();

    // Keys some row of this block may see: [j_lo, j_hi), in key blocks nb_lo, nb_lo + 1, ..
    const i64 m_last = (i64)min(m0 + BM_Q, seqlen_q) - 1;
    i64 j_lo = 0, j_hi = seqlen_k;
    if (WINDOW) j_lo = clamp64((i64)m0 + diag - window_left, 0, seqlen_k);
    if (CAUSAL) j_hi = clamp64(m_last + diag + window_right + 1, 0, seqlen_k);
    const int nb_lo = (int)(j_lo / BN_Q);
    const int n_nb = j_lo < j_hi ? (int)((j_hi + BN_Q - 1) / BN_Q) - nb_lo : 0;

    float lr2[2], dl[2];
    int klo[2], khi[2];  // first and last visible key (khi -1: none)
    const i64 l_off = sp.l0 + (i64)head * sp.lh;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = m0 + cw * 64 + warp * 16 + (lane >> 2) + 8 * h;
        i64 lo = 0, hi = (i64)seqlen_k - 1;
        if (WINDOW) lo = clamp64((i64)i + diag - window_left, 0, seqlen_k);
        if (CAUSAL) hi = clamp64((i64)i + diag + window_right, -1, (i64)seqlen_k - 1);
        if (i < seqlen_q) {
            lr2[h] = lse2[l_off + i];
            dl[h] = delta[l_off + i];
        } else {
            lr2[h] = pos_inf();
            dl[h] = 0.f;
            hi = -1;
        }
        klo[h] = (int)lo;
        khi[h] = (int)hi;
    }
    (void)klo;

    auto load_kv = [&](int it, int b) {
        const int n0 = (nb_lo + it) * BN_Q;
        load_tile<BN_Q>(base + Q_OFF_K + b * tile_bytes(BN_Q), k, kv_off, kv_stride, n0, seqlen_k, tid);
        load_tile<BN_Q>(base + Q_OFF_V + b * tile_bytes(BN_Q), v, kv_off, kv_stride, n0, seqlen_k, tid);
    };
    load_tile<BM_Q>(sQ, q, q_off, q_stride, m0, seqlen_q, tid);
    load_tile<BM_Q>(sO, dout, q_off, q_stride, m0, seqlen_q, tid);
    cp_async_arrive(ring.fixed());
    // STAGES - 1 key blocks ahead, as in the dK/dV kernel.
#pragma unroll
    for (int it = 0; it < STAGES - 1; ++it)
        if (it < n_nb) {
            load_kv(it, it);
            cp_async_arrive(ring.full(it));
        }

    float dq_acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dq_acc[i] = 0.f;
    const u32 sQw = sQ + cw * 64 * 128, sOw = sO + cw * 64 * 128;

    mbar_wait(ring.fixed(), 0);
    int buf = 0, round = 0;
    for (int it = 0; it < n_nb; ++it) {
        mbar_wait(ring.full(buf), round & 1);
        fence_proxy_async_smem();
        const int n0 = (nb_lo + it) * BN_Q;
        const u32 sK = base + Q_OFF_K + buf * tile_bytes(BN_Q);
        const u32 sV = base + Q_OFF_V + buf * tile_bytes(BN_Q);
        const bool need_mask = CAUSAL || m0 + BM_Q > seqlen_q || n0 + BN_Q > seqlen_k;

        float s[BN_Q / 2], dp[BN_Q / 2];
        u32 pa[BN_Q / 16][4];
        wgmma_fence();
        issue_abt<BM_Q, BN_Q>(s, sQw, sK);  // S = Q K^T
        wgmma_commit();
        issue_abt<BM_Q, BN_Q>(dp, sOw, sV);  // dP = dO V^T
        wgmma_commit();
        wgmma_wait<1>();
        reg_fence(s);
#pragma unroll
        for (int j = 0; j < BN_Q / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int key = n0 + 8 * j + 2 * (lane & 3) + c;
                    const bool vis = !need_mask || (key <= khi[h] && key < seqlen_k && (!WINDOW || key >= klo[h]));
                    float& x = s[4 * j + 2 * h + c];
                    float dt = 1.f;  // masked: P = 0
                    x = vis ? prob(x, scale_log2, softcap_log2, lr2[h], dt) : 0.f;
                    if (SOFTCAP) x *= dt;  // P (1 - tanh^2): all dS needs here
                }
        wgmma_wait<0>();
        reg_fence(dp);
#pragma unroll
        for (int j = 0; j < BN_Q / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - dl[e >> 1]);
        pack_a<BN_Q>(dp, pa);
        wgmma_fence();
        issue_pb<BN_Q>(dq_acc, pa, sK);  // dQ += dS K
        wgmma_commit();
        // Key block it + STAGES - 1 into the slot it - 1 used, under the product.
        if (it + STAGES - 1 < n_nb) {
            const int lb = buf == 0 ? STAGES - 1 : buf - 1;
            ring.wait_empty(lb, (it + STAGES - 1) / STAGES);
            load_kv(it + STAGES - 1, lb);
            cp_async_arrive(ring.full(lb));
        }
        wgmma_wait<0>();
        reg_fence(dq_acc);
        reg_fence_u32(pa);
        release(ring, buf);
        if (++buf == STAGES) {
            buf = 0;
            ++round;
        }
    }
    cp_async_wait<0>();
    store_acc(dq_acc, scale, dq, q_off, q_stride, m0 + cw * 64, seqlen_q, warp, lane);
}
#endif  // FM_DQ_MODE == 0

#if !FM_VARLEN  // (varlen runs the dQ kernel)
// ----------------------------------------------------------------------------------------
// Fused dQ (FM_DQ_MODE 1 or 2): the workspace before and after the dK/dV kernel.
// ----------------------------------------------------------------------------------------
// Zero the dq_accum tiles (n4 float4s) and the n_sem tile semaphores. Grid-stride.
extern "C" __global__ void __launch_bounds__(256)
    flash_attn_bwd_sm90_dq_zero(float* __restrict__ dq_accum, long long n4, int* __restrict__ dq_sem, int n_sem) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride)
        *reinterpret_cast<float4*>(dq_accum + 4 * i) = make_float4(0.f, 0.f, 0.f, 0.f);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n_sem; i += stride) dq_sem[i] = 0;
}

// dq (batch, Sq, heads_q, D) = scale * the dq_accum tile of its 64 rows, read back in the
// order dq_part_offset gives. Grid (ceil(Sq / 64), heads_q, batch), block 256.
extern "C" __global__ void __launch_bounds__(fmb90::THREADS)
    flash_attn_bwd_sm90_dq_convert(const float* __restrict__ dq_accum, u16* __restrict__ dq, int seqlen_q,
                                   int heads_q, float scale) {
    using namespace fmb90;
    const int tid = threadIdx.x, cw = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int m0 = blockIdx.x * DQ_TM, head = blockIdx.y, batch = blockIdx.z;
    const Span sp = dense_span(batch, seqlen_q, 0, heads_q);
    const i64 tile = sp.qt0 + head * sp.nt + blockIdx.x;
    const float* g = dq_accum + tile * DQ_TILE + cw * (DQ_TILE / 2);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
        const float4 x = *reinterpret_cast<const float4*>(g + dq_part_offset(j, tid & 127));
        const int col = cw * (D / 2) + 8 * j + 2 * (lane & 3);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = m0 + warp * 16 + (lane >> 2) + 8 * h;
            if (r >= seqlen_q) continue;
            const float lo = h ? x.z : x.x, hi = h ? x.w : x.y;
            *reinterpret_cast<u32*>(dq + ((sp.q0 + r) * heads_q + head) * D + col) =
                pack2(lo * scale, hi * scale);
        }
    }
}
#endif  // !FM_VARLEN
