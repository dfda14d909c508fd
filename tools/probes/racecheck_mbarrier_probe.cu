// Does compute-sanitizer racecheck model mbarrier arrive/wait as synchronisation?
// (docs/design/attention-prefill-sm90.md: racecheck flagged the sm_90a attention kernel's posted work
// tile, a shared-memory slot handed from the producer thread to the consumer warps under
// mbarriers.) Three kernels hand a value through shared memory several times, the same way:
//   mode 0: mbarriers, as the attention kernel does (producer: wait "empty", write, arrive
//           "full"; consumer warps: wait "full", read, __syncwarp, lane 0 arrives "empty");
//   mode 1: the same hand-off with __syncthreads (racecheck's own model: expect 0 hazards);
//   mode 2: no synchronisation at all (a real race: expect hazards);
//   mode 3: mbarriers with every consumer thread arriving on "empty" (no __syncwarp).
// Measured (H100, compute-sanitizer of CUDA 13.0): mode 0 reported a read-then-write hazard
// (112: every later round of every consumer warp), mode 1 none, mode 2 208.
// Each mode also checks the values read, so a wrong hand-off is visible without the tool.
//   nvcc -arch=sm_90a -o probe racecheck_mbarrier_probe.cu
//   compute-sanitizer --tool racecheck ./probe MODE
#include <cstdio>
#include <cstdlib>

__device__ __forceinline__ unsigned smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(unsigned b, unsigned n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(b), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned b, unsigned parity) {
    unsigned ok = 0;
    while (!ok)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(ok)
            : "r"(b), "r"(parity)
            : "memory");
}

constexpr int ROUNDS = 8;
constexpr int CONSUMER_WARPS = 4;

__global__ void handoff(int mode, int* bad) {
    __shared__ int slot;
    __shared__ __align__(8) unsigned long long bars[2];
    const unsigned full = smem(&bars[0]), empty = smem(&bars[1]);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        mbar_init(full, 1);
        mbar_init(empty, mode == 3 ? 32 * CONSUMER_WARPS : CONSUMER_WARPS);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    for (int r = 0; r < ROUNDS; ++r) {
        const int value = 1000 * blockIdx.x + r;
        if (mode == 0 || mode == 3) {
            if (threadIdx.x == 0) {  // producer: warp 0, one thread
                if (r > 0) mbar_wait(empty, (r - 1) & 1);
                slot = value;
                mbar_arrive(full);
            } else if (warp > 0) {  // consumers: warps 1..CONSUMER_WARPS
                mbar_wait(full, r & 1);
                const int v = slot;
                if (v != value) atomicAdd(bad, 1);
                if (mode == 3) {
                    mbar_arrive(empty);
                } else {
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty);
                }
            }
        } else if (mode == 1) {
            if (threadIdx.x == 0) slot = value;
            __syncthreads();
            if (warp > 0 && slot != value) atomicAdd(bad, 1);
            __syncthreads();
        } else {
            if (threadIdx.x == 0) slot = value;
            if (warp > 0) (void)*(volatile int*)&slot;
        }
    }
}

int main(int argc, char** argv) {
    const int mode = argc > 1 ? atoi(argv[1]) : 0;
    int* bad;
    cudaMalloc(&bad, sizeof(int));
    cudaMemset(bad, 0, sizeof(int));
    handoff<<<4, 32 * (1 + CONSUMER_WARPS)>>>(mode, bad);
    int h = -1;
    cudaError_t e = cudaMemcpy(&h, bad, sizeof(int), cudaMemcpyDeviceToHost);
    printf("mode %d: %s, wrong values read: %d\n", mode, cudaGetErrorString(e), h);
    return e != cudaSuccess || h != 0;
}
