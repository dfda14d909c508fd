// flashmoe — attention backward, portable path (sm_80 and newer, mma.sync). Deterministic:
// every gradient element is written once by one CTA, accumulated in a fixed order (no
// atomics), so two runs give the same bits.
//
// Compiled at run time by NVRTC; self-contained (our own headers only). One source, three
// entry points (one module per define set), specialised by preprocessor defines (the table
// of variants is crates/flashmoe/src/attention/backward.rs, which must agree with the
// constants below):
//
//   FM_HEAD_DIM     head dim D: a multiple of 16, at most 128 (served: 32 64 96 128)
//   FM_DTYPE_BF16   0 = fp16, 1 = bf16 (q, k, v, o, dO, dq, dk, dv; accumulation is fp32)
//   FM_CAUSAL       1: keys right of the (shifted) bottom-right diagonal are hidden: row i
//                   sees keys j <= i + (Sk - Sq) + window_right (window_right = 0: causal)
//   FM_WINDOW       1: also hide keys j < i + (Sk - Sq) - window_left (implies FM_CAUSAL)
//   FM_SOFTCAP      1: logits are c * tanh(scale * q.k / c) (c = softcap)
//   FM_KV_WARPS     warps of the dK/dV kernel; its key block is 16 * FM_KV_WARPS keys
//   FM_KV_BLOCK_M   query rows per step of the dK/dV kernel (multiple of 16)
//   FM_Q_WARPS      warps of the dQ kernel; its query block is 16 * FM_Q_WARPS rows
//   FM_Q_BLOCK_N    keys per step of the dQ kernel (multiple of 16)
//   FM_VARLEN       1: packed variable-length sequences (FlashAttention's varlen layout,
//                   see "Varlen" below); 0: dense (batch, seq, heads, D)
//
// Math (FlashAttention-2 backward; s = q.k, P = exp(logit(s) - LSE) recomputed from the
// forward's LSE, Delta_i = sum_d dO_id O_id):
//   dV_j  = sum_i P_ij dO_i
//   dP_ij = dO_i . V_j
//   dS_ij = P_ij (dP_ij - Delta_i) [* (1 - tanh^2) with a softcap]
//   dK_j  = scale * sum_i dS_ij Q_i,   dQ_i = scale * sum_j dS_ij K_j
// dS is rounded to 16 bit for its GEMMs (like P in the forward); the scale is applied to
// the fp32 accumulators at the end.
//
// ABI (all tensors contiguous; q, o, dO, dq: (batch, Sq, heads_q, D); k, v, dk, dv:
// (batch, Sk, heads_kv, D); lse, lse2, delta: (batch, heads_q, Sq) f32):
//   flash_attn_bwd_preprocess(const u16* o, const u16* dout, const float* lse,
//        float* lse2, float* delta, int seqlen_q, int heads_q)
//     grid (ceil(Sq / 4), heads_q, batch), block 128 (one warp per row).
//     delta = rowsum(dO * O); lse2 = lse * log2(e), +inf where lse = -inf (a row that sees
//     no key: every P of it is then exp2(-inf) = 0).
//   flash_attn_bwd_dkdv(q, k, v, dout, lse2, delta, u16* dk, u16* dv, seqlen_q, seqlen_k,
//        heads_q, heads_kv, float scale, float scale_log2, float softcap_log2,
//        int window_left, int window_right)
//     grid (ceil(Sk / (16 * FM_KV_WARPS)), heads_kv, batch), block 32 * FM_KV_WARPS.
//     One CTA per key block: K and V stay in shared memory, the query heads of the GQA
//     group and their query blocks stream through (Q, dO, lse2, delta double-buffered).
//   flash_attn_bwd_dq(q, k, v, dout, lse2, delta, u16* dq, seqlen_q, seqlen_k, heads_q,
//        heads_kv, scale, scale_log2, softcap_log2, window_left, window_right)
//     grid (ceil(Sq / (16 * FM_Q_WARPS)), heads_q, batch), block 32 * FM_Q_WARPS.
//     One CTA per query block: Q and dO stay, K and V blocks stream (double-buffered).
//   scale_log2 = scale * log2(e), or with a softcap scale / softcap (the tanh argument);
//   softcap_log2 = softcap * log2(e); window sides >= 0 (1 << 30 = unbounded).
//
// Varlen (FM_VARLEN = 1): q, o, dO, dq are (total_q, heads_q, D), k, v, dk, dv (total_k,
// heads_kv, D), lse, lse2, delta (heads_q, total_q); the dK/dV and dQ kernels take two more
// parameters, `const int* cu_seqlens_q, const int* cu_seqlens_k` ([batch + 1] each, on the
// device), and their seqlen_q / seqlen_k parameters are total_q / total_k. blockIdx.z is
// the sequence; grid.x covers the longest sequence and the CTAs past their own sequence's
// end return at once. Causal and windows are bottom-right per sequence. Offsets are
// clamped into [0, total] (end >= start), so malformed offsets give wrong numbers, never
// out-of-bounds accesses. The preprocess kernel is the dense one run with batch = 1 and
// seqlen_q = total_q: its (1, total_q, heads_q, D) / (1, heads_q, total_q) indexing is the
// varlen layout.
//
// Shared memory (dynamic; mirrored by backward.rs):
//   PITCH = 64 if D <= 64 else 128 (elements per smem row, XOR swizzle of 16-byte chunks:
//   chunk c of row r at c ^ (r & 7), as in flash_attn_fwd.cu)
//   dK/dV: 2 * PITCH * (2 * BN_KV + 4 * BM_KV) + 16 * BM_KV bytes:
//          [K: BN_KV rows][V: BN_KV rows][Q: 2 x BM_KV][dO: 2 x BM_KV][lse2: 2 x BM_KV f32]
//          [delta: 2 x BM_KV f32]
//   dQ:    2 * PITCH * (2 * BM_Q + 4 * BN_Q) bytes: [Q][dO][K: 2 x BN_Q][V: 2 x BN_Q]
//
// Fragments: warp w owns 16 rows (keys in dK/dV, queries in dQ). The score-shaped
// products (S^T = K Q^T and dP^T = V dO^T; S = Q K^T and dP = dO V^T) take the warp's rows
// as the A operand (ldmatrix) and the streamed tile as B (ldmatrix, k-major); their fp32 C
// fragments are packed to 16 bit as the A operand of the gradient GEMMs, whose B operand
// (dO, Q; K) is read with ldmatrix.trans. Every row and column is masked from exact
// integer bounds, so partial tiles at the sequence ends and Sq != Sk need no special path.

#ifndef FM_HEAD_DIM
#error "FM_HEAD_DIM must be defined"
#endif
#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#include "fm_ptx.cuh"  // u32/u16/i64, cp.async, ldmatrix, mma.sync, pack2, ex2, tanh_acc
#include "fm_bwd_span.cuh"  // Span: one sequence's rows, dense or varlen
#ifndef FM_CAUSAL
#define FM_CAUSAL 0
#endif
#ifndef FM_WINDOW
#define FM_WINDOW 0
#endif
#ifndef FM_SOFTCAP
#define FM_SOFTCAP 0
#endif
#ifndef FM_KV_WARPS
#define FM_KV_WARPS 4
#endif
#ifndef FM_KV_BLOCK_M
#define FM_KV_BLOCK_M 64
#endif
#ifndef FM_Q_WARPS
#define FM_Q_WARPS 4
#endif
#ifndef FM_Q_BLOCK_N
#define FM_Q_BLOCK_N 64
#endif

namespace fmb {

constexpr int D = FM_HEAD_DIM;
constexpr bool CAUSAL = FM_CAUSAL != 0;
constexpr bool WINDOW = FM_WINDOW != 0;
constexpr bool SOFTCAP = FM_SOFTCAP != 0;
constexpr int PITCH = D <= 64 ? 64 : 128;
constexpr int PITCH_B = PITCH * 2;  // bytes per smem row
constexpr int CPR = D / 8;          // 16-byte chunks per row (global)
constexpr int DT = D / 8;           // n8 tiles over D
constexpr int KD = D / 16;          // k16 steps over D

constexpr int KV_WARPS = FM_KV_WARPS;
constexpr int KV_THREADS = 32 * KV_WARPS;
constexpr int BN_KV = 16 * KV_WARPS;  // keys per dK/dV CTA
constexpr int BM_KV = FM_KV_BLOCK_M;  // query rows per step
constexpr int NT_KV = BM_KV / 8;
constexpr int KN_KV = BM_KV / 16;

constexpr int Q_WARPS = FM_Q_WARPS;
constexpr int Q_THREADS = 32 * Q_WARPS;
constexpr int BM_Q = 16 * Q_WARPS;   // query rows per dQ CTA
constexpr int BN_Q = FM_Q_BLOCK_N;   // keys per step
constexpr int NT_Q = BN_Q / 8;
constexpr int KN_Q = BN_Q / 16;

static_assert(D % 16 == 0 && D >= 16 && D <= 128, "head dim must be a multiple of 16, <= 128");
static_assert(BM_KV % 16 == 0 && BM_KV >= 16, "FM_KV_BLOCK_M must be a multiple of 16");
static_assert(BN_Q % 16 == 0 && BN_Q >= 16, "FM_Q_BLOCK_N must be a multiple of 16");

constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// One 16-bit storage value (low half of `bits`) to fp32.
__device__ __forceinline__ float to_f32(u32 bits) {
#if FM_DTYPE_BF16
    return __uint_as_float(bits << 16);
#else
    float f;
    asm("{ .reg .b16 h; cvt.u16.u32 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(bits));
    return f;
#endif
}

__device__ __forceinline__ void ld_global_nc_v4(const void* p, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "l"(p));
}

// 4-byte global->shared async copy; pred false writes 4 zero bytes (no global read).
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool pred) {
    const int n = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}

// Byte offset of 16-byte chunk `ch` of row `r` inside a swizzled tile.
__device__ __forceinline__ u32 swz(int r, int ch) {
    return (u32)(r * PITCH_B + ((ch ^ (r & 7)) << 4));
}

// Rows [row0, row0 + ROWS) x D of the (seq, D) matrix at g + base (row stride `stride`
// elements) into the swizzled tile at dst; rows >= nrows are zero-filled (no read).
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_rows(u32 dst, const u16* __restrict__ g, i64 base,
                                          i64 stride, int row0, int nrows, int tid) {
    constexpr int TOTAL = ROWS * CPR;
#pragma unroll
    for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
        const int c = tid + it * THREADS;
        if (TOTAL % THREADS == 0 || c < TOTAL) {
            const int r = c / CPR;
            const int ch = c % CPR;
            const int gr = row0 + r;
            const bool ok = gr < nrows;
            const i64 off = ok ? base + (i64)gr * stride + ch * 8 : 0;
            cp_async16(dst + swz(r, ch), g + off, ok);
        }
    }
}

// acc (16 x 8*NT) += A (the 16 rows at sA) * B^T (B: the 8*NT rows at sB), over D.
// A through the lane bases lb, B through kb (see flash_attn_fwd.cu for their derivation).
template <int NT>
__device__ __forceinline__ void gemm_abt(float (&acc)[NT][4], u32 sA, u32 sB,
                                         const u32 (&lb)[4], const u32 (&kb)[4]) {
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
        u32 a[4];
        ldsm_x4(sA + lb[kk & 3] + (kk >> 2) * 128, a[0], a[1], a[2], a[3]);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 b0, b1, b2, b3;
            ldsm_x4(sB + kb[kk & 3] + (kk >> 2) * 128 + np * 16 * PITCH_B, b0, b1, b2, b3);
            mma16816(acc[2 * np], a, b0, b1);
            mma16816(acc[2 * np + 1], a, b2, b3);
        }
    }
}

// acc (16 x D) += A (16 x 16*KN, packed fragments) * B (B: the 16*KN rows x D at sB,
// read transposed).
template <int KN>
__device__ __forceinline__ void gemm_pb(float (&acc)[DT][4], const u32 (&pa)[KN][4], u32 sB,
                                        const u32 (&lb)[4]) {
#pragma unroll
    for (int kk = 0; kk < KN; ++kk) {
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(sB + lb[dp & 3] + (dp >> 2) * 128 + kk * 16 * PITCH_B, b0, b1, b2, b3);
            mma16816(acc[2 * dp], pa[kk], b0, b1);
            mma16816(acc[2 * dp + 1], pa[kk], b2, b3);
        }
    }
}

__device__ __forceinline__ void lane_bases(int lane, u32 (&lb)[4], u32 (&kb)[4]) {
    const int li = lane >> 3, lr = lane & 7;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        lb[j] = ((li & 1) * 8 + lr) * PITCH_B + (((2 * j) ^ (lr ^ (li >> 1))) << 4);
        kb[j] = ((li >> 1) * 8 + lr) * PITCH_B + (((2 * j) ^ (lr ^ (li & 1))) << 4);
    }
}

// Logit of a raw score s = q.k in the log2 domain, and (softcap) the tanh it came through.
__device__ __forceinline__ float logit2(float s, float scale_log2, float softcap_log2,
                                        float& t) {
    if (SOFTCAP) {
        t = tanh_acc(s * scale_log2);
        return softcap_log2 * t;
    }
    t = 0.f;
    return s * scale_log2;
}

// The 16 rows of this warp's accumulator (16 x D, fp32) as 16-bit values into its own rows
// of the swizzled tile at sW, then 16-byte stores of the rows < nrows to g + base.
__device__ __forceinline__ void store_rows(const float (&acc)[DT][4], float mul, u32 sW,
                                           u16* __restrict__ g, i64 base, i64 stride,
                                           int row0, int nrows, int lane) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = (lane >> 2) + h * 8;
            st_shared_u32(sW + swz(r, dt) + (lane & 3) * 4,
                          pack2(acc[dt][2 * h] * mul, acc[dt][2 * h + 1] * mul));
        }
    __syncwarp();
    constexpr int CH = 16 * CPR;
#pragma unroll
    for (int it = 0; it < (CH + 31) / 32; ++it) {
        const int c = lane + it * 32;
        if (CH % 32 == 0 || c < CH) {
            const int r = c / CPR;
            const int ch = c % CPR;
            const int grow = row0 + r;
            u32 a, b, cc, d;
            ld_shared_v4(sW + swz(r, ch), a, b, cc, d);
            if (grow < nrows) st_global_v4(g + base + (i64)grow * stride + ch * 8, a, b, cc, d);
        }
    }
}

__device__ __forceinline__ i64 clamp64(i64 x, i64 lo, i64 hi) {
    return x < lo ? lo : (x > hi ? hi : x);
}

}  // namespace fmb

// ----------------------------------------------------------------------------------------
// Preprocess: delta = rowsum(dO * O), lse2 = lse * log2 e (+inf for -inf).
// ----------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(128)
    flash_attn_bwd_preprocess(const u16* __restrict__ o, const u16* __restrict__ dout,
                              const float* __restrict__ lse, float* __restrict__ lse2,
                              float* __restrict__ delta, int seqlen_q, int heads_q) {
    using namespace fmb;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * 4 + warp;
    const int head = blockIdx.y, batch = blockIdx.z;
    if (row >= seqlen_q) return;
    const i64 off = (((i64)batch * seqlen_q + row) * heads_q + head) * D;
    float acc = 0.f;
    for (int c = lane; c < CPR; c += 32) {
        u32 x[4], y[4];
        ld_global_nc_v4(o + off + c * 8, x[0], x[1], x[2], x[3]);
        ld_global_nc_v4(dout + off + c * 8, y[0], y[1], y[2], y[3]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc = fmaf(to_f32(x[e] & 0xffffu), to_f32(y[e] & 0xffffu), acc);
            acc = fmaf(to_f32(x[e] >> 16), to_f32(y[e] >> 16), acc);
        }
    }
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane == 0) {
        const i64 idx = ((i64)batch * heads_q + head) * seqlen_q + row;
        const float l = lse[idx];
        delta[idx] = acc;
        lse2[idx] = l == neg_inf() ? pos_inf() : l * LOG2E;
    }
}

// ----------------------------------------------------------------------------------------
// dK, dV: one CTA per (key block, kv head, batch).
// ----------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(fmb::KV_THREADS, 1)
    flash_attn_bwd_dkdv(const u16* __restrict__ q, const u16* __restrict__ k,
                        const u16* __restrict__ v, const u16* __restrict__ dout,
                        const float* __restrict__ lse2, const float* __restrict__ delta,
                        u16* __restrict__ dk, u16* __restrict__ dv, int seqlen_q,
                        int seqlen_k, int heads_q, int heads_kv, float scale,
                        float scale_log2, float softcap_log2, int window_left,
                        int window_right FM_CU_PARAMS) {
    using namespace fmb;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n0 = blockIdx.x * BN_KV;
    const int kvh = blockIdx.y, batch = blockIdx.z;
    const Span sp = FM_SPAN(batch);
    // From here on seqlen_q / seqlen_k are this sequence's lengths.
    seqlen_q = sp.sq;
    seqlen_k = sp.sk;
    if (n0 >= seqlen_k) return;  // varlen: past this sequence's keys (whole CTA)
    const int group = heads_q / heads_kv;
    const i64 q_stride = (i64)heads_q * D, kv_stride = (i64)heads_kv * D;
    const i64 kv_off = (sp.k0 * heads_kv + kvh) * D;
    const i64 diag = (i64)seqlen_k - seqlen_q;  // row i's diagonal key: i + diag

    const u32 sK = smem_addr(smem_raw);
    const u32 sV = sK + BN_KV * PITCH_B;
    const u32 sQ0 = sV + BN_KV * PITCH_B;           // 2 buffers
    const u32 sO0 = sQ0 + 2 * BM_KV * PITCH_B;      // dO, 2 buffers
    const u32 sL0 = sO0 + 2 * BM_KV * PITCH_B;      // lse2, 2 x BM_KV f32
    const u32 sD0 = sL0 + 2 * BM_KV * 4;            // delta
    const float* fL = reinterpret_cast<const float*>(smem_raw + (sL0 - sK));
    const float* fD = reinterpret_cast<const float*>(smem_raw + (sD0 - sK));

    // Queries that may see a key of this block: [i_lo, i_hi).
    const i64 n_last = (i64)min(n0 + BN_KV, seqlen_k) - 1;
    i64 i_lo = 0, i_hi = seqlen_q;
    if (CAUSAL) i_lo = clamp64((i64)n0 - diag - window_right, 0, seqlen_q);
    if (WINDOW) i_hi = clamp64(n_last - diag + window_left + 1, 0, seqlen_q);
    const int mb_lo = (int)(i_lo / BM_KV);
    const int n_mb = i_hi > i_lo ? (int)((i_hi + BM_KV - 1) / BM_KV) - mb_lo : 0;
    const int steps = n_mb * group;

    // The visible queries of this thread's two key rows: qlo <= i <= qhi.
    int qlo[2], qhi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 j = (i64)n0 + warp * 16 + (lane >> 2) + h * 8;
        i64 lo = 0, hi = (i64)seqlen_q - 1;
        if (CAUSAL) lo = clamp64(j - diag - window_right, 0, seqlen_q);
        if (WINDOW) hi = clamp64(j - diag + window_left, -1, (i64)seqlen_q - 1);
        if (j >= seqlen_k) { lo = seqlen_q; hi = -1; }
        qlo[h] = (int)lo;
        qhi[h] = (int)hi;
    }

    auto load_step = [&](int step, int buf) {
        const int h = kvh * group + step / n_mb;
        const int m0 = (mb_lo + step % n_mb) * BM_KV;
        const i64 q_off = (sp.q0 * heads_q + h) * D;
        load_rows<BM_KV, KV_THREADS>(sQ0 + buf * BM_KV * PITCH_B, q, q_off, q_stride, m0,
                                     seqlen_q, tid);
        load_rows<BM_KV, KV_THREADS>(sO0 + buf * BM_KV * PITCH_B, dout, q_off, q_stride, m0,
                                     seqlen_q, tid);
        const i64 l_off = sp.l0 + (i64)h * sp.lh;
        for (int c = tid; c < 2 * BM_KV; c += KV_THREADS) {
            const int r = c % BM_KV;
            const bool ok = m0 + r < seqlen_q;
            const float* src = (c < BM_KV ? lse2 : delta) + (ok ? l_off + m0 + r : 0);
            cp_async4((c < BM_KV ? sL0 : sD0) + (buf * BM_KV + r) * 4, src, ok);
        }
    };

    load_rows<BN_KV, KV_THREADS>(sK, k, kv_off, kv_stride, n0, seqlen_k, tid);
    load_rows<BN_KV, KV_THREADS>(sV, v, kv_off, kv_stride, n0, seqlen_k, tid);
    cp_async_commit();
    if (steps > 0) load_step(0, 0);
    cp_async_commit();

    u32 lb[4], kb[4];
    lane_bases(lane, lb, kb);
    const u32 sKw = sK + warp * 16 * PITCH_B, sVw = sV + warp * 16 * PITCH_B;

    float dk_acc[DT][4], dv_acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[dt][e] = dv_acc[dt][e] = 0.f;

    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        cp_async_wait<0>();  // this step's tiles (and K/V) have landed (this thread's part)
        __syncthreads();     // ... everyone's; the other buffer (step - 1) is free
        if (step + 1 < steps) load_step(step + 1, buf ^ 1);
        cp_async_commit();

        const int m0 = (mb_lo + step % n_mb) * BM_KV;
        const u32 sQ = sQ0 + buf * BM_KV * PITCH_B, sO = sO0 + buf * BM_KV * PITCH_B;
        const float* L = fL + buf * BM_KV;
        const float* Dl = fD + buf * BM_KV;
        const bool need_mask =
            CAUSAL || WINDOW || m0 + BM_KV > seqlen_q || n0 + BN_KV > seqlen_k;

        // S^T = K Q^T (rows: this warp's 16 keys; columns: BM_KV queries)
        float st[NT_KV][4];
#pragma unroll
        for (int nt = 0; nt < NT_KV; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[nt][e] = 0.f;
        gemm_abt<NT_KV>(st, sKw, sQ, lb, kb);

        // P^T (fp32, kept for dS) and its 16-bit A fragments; st becomes 1 - tanh^2.
        float p[NT_KV][4];
        u32 pa[KN_KV][4];
#pragma unroll
        for (int nt = 0; nt < NT_KV; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = nt * 8 + 2 * (lane & 3) + e;
                    float t;
                    const float x = logit2(st[nt][2 * h + e], scale_log2, softcap_log2, t);
                    const int i = m0 + col;
                    const bool vis = !need_mask || (i >= qlo[h] && i <= qhi[h]);
                    p[nt][2 * h + e] = vis ? ex2(x - L[col]) : 0.f;
                    st[nt][2 * h + e] = fmaf(-t, t, 1.f);
                }
                pa[nt >> 1][(nt & 1) * 2 + h] = pack2(p[nt][2 * h], p[nt][2 * h + 1]);
            }

        // dV += P^T dO
        gemm_pb<KN_KV>(dv_acc, pa, sO, lb);

        // dP^T = V dO^T
        float dpt[NT_KV][4];
#pragma unroll
        for (int nt = 0; nt < NT_KV; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dpt[nt][e] = 0.f;
        gemm_abt<NT_KV>(dpt, sVw, sO, lb, kb);

        // dS^T = P^T (dP^T - delta) [* (1 - tanh^2)]
#pragma unroll
        for (int nt = 0; nt < NT_KV; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float ds[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = nt * 8 + 2 * (lane & 3) + e;
                    float x = p[nt][2 * h + e] * (dpt[nt][2 * h + e] - Dl[col]);
                    if (SOFTCAP) x *= st[nt][2 * h + e];
                    ds[e] = x;
                }
                pa[nt >> 1][(nt & 1) * 2 + h] = pack2(ds[0], ds[1]);
            }

        // dK += dS^T Q
        gemm_pb<KN_KV>(dk_acc, pa, sQ, lb);
    }

    cp_async_wait<0>();
    __syncthreads();  // every warp is done with K and V (the staging rows below)
    store_rows(dk_acc, scale, sKw, dk, kv_off, kv_stride, n0 + warp * 16, seqlen_k, lane);
    store_rows(dv_acc, 1.f, sVw, dv, kv_off, kv_stride, n0 + warp * 16, seqlen_k, lane);
}

// ----------------------------------------------------------------------------------------
// dQ: one CTA per (query block, query head, batch).
// ----------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(fmb::Q_THREADS, 1)
    flash_attn_bwd_dq(const u16* __restrict__ q, const u16* __restrict__ k,
                      const u16* __restrict__ v, const u16* __restrict__ dout,
                      const float* __restrict__ lse2, const float* __restrict__ delta,
                      u16* __restrict__ dq, int seqlen_q, int seqlen_k, int heads_q,
                      int heads_kv, float scale, float scale_log2, float softcap_log2,
                      int window_left, int window_right FM_CU_PARAMS) {
    using namespace fmb;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int m0 = blockIdx.x * BM_Q;
    const int head = blockIdx.y, batch = blockIdx.z;
    const Span sp = FM_SPAN(batch);
    // From here on seqlen_q / seqlen_k are this sequence's lengths.
    seqlen_q = sp.sq;
    seqlen_k = sp.sk;
    if (m0 >= seqlen_q) return;  // varlen: past this sequence's queries (whole CTA)
    const int kvh = head / (heads_q / heads_kv);
    const i64 q_stride = (i64)heads_q * D, kv_stride = (i64)heads_kv * D;
    const i64 q_off = (sp.q0 * heads_q + head) * D;
    const i64 kv_off = (sp.k0 * heads_kv + kvh) * D;
    const i64 diag = (i64)seqlen_k - seqlen_q;

    const u32 sQ = smem_addr(smem_raw);
    const u32 sO = sQ + BM_Q * PITCH_B;
    const u32 sK0 = sO + BM_Q * PITCH_B;       // 2 buffers
    const u32 sV0 = sK0 + 2 * BN_Q * PITCH_B;  // 2 buffers

    // Keys some row of this block may see: [j_lo, j_hi).
    const i64 m_last = (i64)min(m0 + BM_Q, seqlen_q) - 1;
    i64 j_lo = 0, j_hi = seqlen_k;
    if (WINDOW) j_lo = clamp64((i64)m0 + diag - window_left, 0, seqlen_k);
    if (CAUSAL) j_hi = clamp64(m_last + diag + window_right + 1, 0, seqlen_k);
    const int nb_lo = (int)(j_lo / BN_Q);
    const int n_nb = j_hi > j_lo ? (int)((j_hi + BN_Q - 1) / BN_Q) - nb_lo : 0;

    // This thread's two query rows: lse2, delta and visible keys klo <= j <= khi.
    float lr2[2], dl[2];
    int klo[2], khi[2];
    const i64 l_off = sp.l0 + (i64)head * sp.lh;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = m0 + warp * 16 + (lane >> 2) + h * 8;
        i64 lo = 0, hi = (i64)seqlen_k - 1;
        if (WINDOW) lo = clamp64((i64)i + diag - window_left, 0, seqlen_k);
        if (CAUSAL) hi = clamp64((i64)i + diag + window_right, -1, (i64)seqlen_k - 1);
        if (i < seqlen_q) {
            lr2[h] = lse2[l_off + i];
            dl[h] = delta[l_off + i];
        } else {
            lr2[h] = pos_inf();
            dl[h] = 0.f;
            lo = seqlen_k;
            hi = -1;
        }
        klo[h] = (int)lo;
        khi[h] = (int)hi;
    }

    load_rows<BM_Q, Q_THREADS>(sQ, q, q_off, q_stride, m0, seqlen_q, tid);
    load_rows<BM_Q, Q_THREADS>(sO, dout, q_off, q_stride, m0, seqlen_q, tid);
    if (n_nb > 0) {
        load_rows<BN_Q, Q_THREADS>(sK0, k, kv_off, kv_stride, nb_lo * BN_Q, seqlen_k, tid);
        load_rows<BN_Q, Q_THREADS>(sV0, v, kv_off, kv_stride, nb_lo * BN_Q, seqlen_k, tid);
    }
    cp_async_commit();

    u32 lb[4], kb[4];
    lane_bases(lane, lb, kb);
    const u32 sQw = sQ + warp * 16 * PITCH_B, sOw = sO + warp * 16 * PITCH_B;

    float dq_acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq_acc[dt][e] = 0.f;

    for (int it = 0; it < n_nb; ++it) {
        const int buf = it & 1;
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_nb) {
            const int nx = (nb_lo + it + 1) * BN_Q;
            load_rows<BN_Q, Q_THREADS>(sK0 + (buf ^ 1) * BN_Q * PITCH_B, k, kv_off, kv_stride,
                                       nx, seqlen_k, tid);
            load_rows<BN_Q, Q_THREADS>(sV0 + (buf ^ 1) * BN_Q * PITCH_B, v, kv_off, kv_stride,
                                       nx, seqlen_k, tid);
        }
        cp_async_commit();

        const int n0 = (nb_lo + it) * BN_Q;
        const u32 sK = sK0 + buf * BN_Q * PITCH_B, sV = sV0 + buf * BN_Q * PITCH_B;
        const bool need_mask = CAUSAL || WINDOW || m0 + BM_Q > seqlen_q || n0 + BN_Q > seqlen_k;

        // S = Q K^T
        float s[NT_Q][4];
#pragma unroll
        for (int nt = 0; nt < NT_Q; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
        gemm_abt<NT_Q>(s, sQw, sK, lb, kb);

        float p[NT_Q][4];
#pragma unroll
        for (int nt = 0; nt < NT_Q; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = n0 + nt * 8 + 2 * (lane & 3) + e;
                    float t;
                    const float x = logit2(s[nt][2 * h + e], scale_log2, softcap_log2, t);
                    const bool vis = !need_mask || (j >= klo[h] && j <= khi[h]);
                    p[nt][2 * h + e] = vis ? ex2(x - lr2[h]) : 0.f;
                    s[nt][2 * h + e] = fmaf(-t, t, 1.f);
                }

        // dP = dO V^T
        float dp[NT_Q][4];
#pragma unroll
        for (int nt = 0; nt < NT_Q; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[nt][e] = 0.f;
        gemm_abt<NT_Q>(dp, sOw, sV, lb, kb);

        // dS = P (dP - delta) [* (1 - tanh^2)], packed as A fragments
        u32 pa[KN_Q][4];
#pragma unroll
        for (int nt = 0; nt < NT_Q; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float ds[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = p[nt][2 * h + e] * (dp[nt][2 * h + e] - dl[h]);
                    if (SOFTCAP) x *= s[nt][2 * h + e];
                    ds[e] = x;
                }
                pa[nt >> 1][(nt & 1) * 2 + h] = pack2(ds[0], ds[1]);
            }

        // dQ += dS K
        gemm_pb<KN_Q>(dq_acc, pa, sK, lb);
    }

    cp_async_wait<0>();
    __syncthreads();
    store_rows(dq_acc, scale, sQw, dq, q_off, q_stride, m0 + warp * 16, seqlen_q, lane);
}
