// flashmoe — the router losses, finished on the device (included by moe_router.cu for the
// router-only stage, moe_router_losses, and by moe_permute.cu, whose block 0 finishes them
// in the full layer so that the pipeline pays no launch for them).
//   losses[0] = aux = E · Σ_e (counts[e] / (T·k)) · (prob_sum[e] / T)
//   losses[1] = z   = lse_sq_sum[0] / T
// Called by every thread of one block of FM_LOSS_THREADS threads: thread e takes expert
// e's term in f64, a fixed shared-memory tree sums them (the same order on every run and
// in both callers, so the bits match), and the two results are stored as f32.
#pragma once

#define FM_LOSS_THREADS 256  // = FM_MAX_EXPERTS: one thread per expert slot

__device__ __forceinline__ void finish_router_losses(const unsigned int* __restrict__ counts,
                                                     const float* __restrict__ prob_sum,
                                                     const float* __restrict__ lse_sq_sum,
                                                     float* __restrict__ losses, int tokens,
                                                     int experts, int top_k) {
    __shared__ double sd[FM_LOSS_THREADS];
    const int tid = threadIdx.x;
    const double t = (double)tokens;
    double term = 0.0;
    if (tid < experts) term = ((double)counts[tid] / (t * (double)top_k)) * ((double)prob_sum[tid] / t);
    sd[tid] = term;
    __syncthreads();
    for (int w = FM_LOSS_THREADS / 2; w > 0; w >>= 1) {
        if (tid < w) sd[tid] += sd[tid + w];
        __syncthreads();
    }
    if (tid == 0) {
        losses[0] = (float)((double)experts * sd[0]);
        losses[1] = (float)((double)lse_sq_sum[0] / t);
    }
}
