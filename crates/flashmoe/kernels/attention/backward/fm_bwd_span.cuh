// flashmoe — the rows one attention-backward CTA works on: one sequence of a dense batch
// (batch, seq, heads, D) or of a packed varlen call (total, heads, D) with int32 offsets
// cu_seqlens_q / cu_seqlens_k [batch + 1]. Shared by flash_attn_bwd.cu and
// flash_attn_bwd_sm90.cu; needs i64 (fm_ptx.cuh).
#pragma once

// FM_VARLEN (default 0): the kernels' extra parameters (FM_CU_PARAMS, last in their lists)
// and the Span of sequence b (FM_SPAN: from the kernel's seqlen_q, seqlen_k, heads_q and,
// varlen, cu_seqlens_q / cu_seqlens_k).
#ifndef FM_VARLEN
#define FM_VARLEN 0
#endif
#if FM_VARLEN
#define FM_CU_PARAMS , const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k
#define FM_SPAN(b) varlen_span(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k)
#else
#define FM_CU_PARAMS
#define FM_SPAN(b) dense_span(b, seqlen_q, seqlen_k, heads_q)
#endif

// Query rows q0 .. q0 + sq of q / dO / dq, key rows k0 .. k0 + sk of k / v / dk / dv; the
// lse2 / delta index of (head h, row i) is l0 + h lh + i. The sm_90a kernels' fused dQ
// (dense only) keeps one f32 tile per 64 query rows: the sequence's tile of (head h, row
// block mb) is qt0 + h nt + mb.
struct Span {
    i64 q0, k0, l0, lh;
    int sq, sk;
    i64 qt0, nt;
};

// Dense: sequence `b` of a batch of equal lengths.
__device__ __forceinline__ Span dense_span(int b, int seqlen_q, int seqlen_k, int heads_q) {
    Span s;
    s.q0 = (i64)b * seqlen_q;
    s.k0 = (i64)b * seqlen_k;
    s.l0 = (i64)b * heads_q * seqlen_q;
    s.lh = seqlen_q;
    s.sq = seqlen_q;
    s.sk = seqlen_k;
    s.nt = (seqlen_q + 63) / 64;
    s.qt0 = (i64)b * heads_q * s.nt;
    return s;
}

// Varlen: sequence `b` from the offsets, clamped into [0, total] with end >= start. (No dQ
// tiles: the varlen kernels make dQ with their own dQ kernel.)
__device__ __forceinline__ Span varlen_span(const int* __restrict__ cu_q,
                                            const int* __restrict__ cu_k, int b, int total_q,
                                            int total_k) {
    const int q0 = min(max(cu_q[b], 0), total_q);
    const int q1 = min(max(cu_q[b + 1], q0), total_q);
    const int k0 = min(max(cu_k[b], 0), total_k);
    const int k1 = min(max(cu_k[b + 1], k0), total_k);
    Span s;
    s.q0 = q0;
    s.k0 = k0;
    s.l0 = q0;
    s.lh = total_q;
    s.sq = q1 - q0;
    s.sk = k1 - k0;
    s.qt0 = 0;
    s.nt = 0;
    return s;
}
