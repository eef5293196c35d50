// The block that completes a set of `arrivals` blocks goes on past this point; the others return.
// Each block fences its writes and takes a ticket on cnt[ticket]; the last one resets the ticket for
// the next launch (launches are stream-ordered). Included by qkv_head.cuh (gemv.cu, gemv_mma.cu) and
// qmm.cu (their epilogues that read what the whole set wrote). In scope: cnt, ticket, arrivals.
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* tk = const_cast<int*>(cnt) + ticket;
    s_last = atomicAdd(tk, 1) == arrivals - 1;
    if (s_last) *tk = 0;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
