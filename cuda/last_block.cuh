// The block that completes a set of `arrivals` blocks goes on past this point; the others return.
// After the block barrier, thread 0 takes a ticket on cnt[ticket] with one acq_rel add (the release
// covers the writes the barrier ordered before it; the winner's acquire, the others' writes); the
// last one resets the ticket for the next launch (launches are stream-ordered). Included by
// qkv_head.cuh (gemv.cu, gemv_mma.cu), qmm.cu and split_merge.cuh (their epilogues that read what the
// whole set wrote). In scope: cnt, ticket, arrivals.
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    int* tk = const_cast<int*>(cnt) + ticket;
#ifdef __CUDA_ARCH__
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(tk) : "memory");
#else
    const int old = atomicAdd(tk, 1);
#endif
    s_last = old == arrivals - 1;
    if (s_last) *tk = 0;
  }
  __syncthreads();
  if (!s_last) return;
