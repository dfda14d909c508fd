// flashmoe sm_90a attention — the FM_TRACE development timeline.
//
// Holds: the module global fm90_trace (FM_TRACE=1 builds only), the event list and the
// stamp helpers trace() / trace_value() that the producer and consumers call at their phase
// boundaries. With FM_TRACE=0 (production) the helpers are empty and fm90_trace does not
// exist. A tool, not an experiment: examples/sm90_trace.rs reads the array back and
// tools/probes/sm90_trace_report.py reports the phases. Included by fm90_producer.cuh,
// fm90_mainloop.cuh and flash_attn_fwd_sm90.cu.
#pragma once

#include "fm90_config.cuh"

#if FM_TRACE
// The timeline of FM_TRACE (layout in namespace fm90 below); unmangled, so the host can
// find it by name (cuModuleGetGlobal).
extern "C" {
__device__ long long fm90_trace[132 * (FM_CONSUMERS + 1) * 32 * 12];
}
#endif

namespace fm90 {

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

}  // namespace fm90
