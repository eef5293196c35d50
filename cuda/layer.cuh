// Device helpers of the one-launch decoder layer (mlx_fastops/backends/cuda/layer.py), the header
// of that launch; its phases are gemv.cu and attention.cu compiled as device functions.
//
// The phases run as consecutive groups of blocks in one launch; a block of group g first waits
// until every block of group g - 1 has arrived (layer_done / layer_wait on a global counter per
// group). Blocks are dispatched in increasing index order, so the blocks waited for are already
// resident or done: no co-residency is needed.

__device__ __forceinline__ long long layer_now() {
#ifdef __CUDA_ARCH__
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<long long>(t);
#else
  static long long ticks = 0;   // CPU emulator: a logical clock, one tick per reading
  return ++ticks;
#endif
}
// Phase timing (layers_launch(stamps=True)): block b's row stamps[STAMP_COLS * b ...] holds its entry
// and end times, its SM, then its marks (PHASE_MARKS, layer_mark; what each means: phases.py's
// MARKS). The entry is stored at once (held in a register through the block, it cost the Qwen3-4B
// layer 38 registers in ptxas: 3 blocks per SM instead of 4), with the marks zeroed (a block that
// exits early marks nothing); the end is taken once the whole block is done, before it counts as
// arrived.
constexpr int STAMP_COLS = 6;   // phases.STAMP_COLS
template <typename I>
__device__ __forceinline__ void layer_stamp_entry(I* stamps) {
  if (threadIdx.x == 0) {
    I* row = stamps + STAMP_COLS * blockIdx.x;
    row[0] = layer_now();
    for (int i = 3; i < STAMP_COLS; ++i) row[i] = 0;
  }
}
template <typename I>
__device__ __forceinline__ void layer_stamp(I* stamps) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned sm = 0;   // the CPU emulator runs everything on "SM 0"
#ifdef __CUDA_ARCH__
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
#endif
    stamps[STAMP_COLS * blockIdx.x + 1] = layer_now();
    stamps[STAMP_COLS * blockIdx.x + 2] = sm;
  }
}
// Mark i (0: waited, 1: first step, 2: written) of the block, as thread 0 reaches it; mark 0 is part
// of the instrumented launch's WAIT_INPUTS (layer.py), the others stand in the kernel files.
// (Templates: the stamps' int64 type is MLX's to name.)
template <typename I>
__device__ __forceinline__ void layer_mark(I* stamps, int i) {
  if (threadIdx.x == 0) stamps[STAMP_COLS * blockIdx.x + 3 + i] = layer_now();
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#endif
}
__device__ __forceinline__ void layer_done(const int* ctr, int g) {
  // the block's writes, then its arrival: one release add after the barrier (cumulative over the
  // writes the barrier ordered before it), not a fence in every thread
  __syncthreads();
  if (threadIdx.x == 0) {
#ifdef __CUDA_ARCH__
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(ctr + g) : "memory");
#else
    atomicAdd(const_cast<int*>(ctr) + g, 1);
#endif
  }
}
// The launch's last phase: thread 0, after the block barrier, arrives with one acq_rel add (its
// block's writes before it; for the last arrival, every other block's before its counter reset) and
// gets the count before it.
__device__ __forceinline__ int layer_arrive_last(const int* ctr, int g) {
#ifdef __CUDA_ARCH__
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(ctr + g) : "memory");
  return old;
#else
  return atomicAdd(const_cast<int*>(ctr) + g, 1);
#endif
}
__device__ __forceinline__ void layer_wait(const int* ctr, int g, int n) {
  if (g < 0) return;   // the launch's first group
  if (threadIdx.x == 0) {
    int spins = 0;
    // plain loads: polls do not queue behind the arrivals' atomics on the counter's L2 line
    while (*reinterpret_cast<const volatile int*>(ctr + g) < n) {
      // Never for long: the blocks waited for were dispatched first. A trap (~1 s) beats a hang.
      if (++spins > (1 << 22)) __trap();
      __nanosleep(200);
    }
#ifdef __CUDA_ARCH__
    // one acquire load of the counter, not a fence: the arrivals' writes (released by their adds)
    // before this block's reads, and the phase tables' layers 0.4-1.9 us shorter (design doc)
    int seen;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(ctr + g) : "memory");
    (void)seen;
#endif
  }
  __syncthreads();
}
