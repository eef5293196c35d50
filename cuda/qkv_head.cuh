// The QKV phase's head epilogue after a GEMV block (gemv.cu, gemv_mma.cu: EPI 3) whose BR output rows
// lie in one head of D: the block that completes the head (its D / BR blocks, by ticket) runs
// head.cuh on the head's columns of the fp32 scratch ys [M, N]. In scope: BR, BLOCK_X, D, M, N, ys,
// cnt and what head.cuh needs.
  const int hb = (BLOCK_X * BR) / D;   // head index over q, k, v heads
  const int ticket = hb, arrivals = D / BR;
#include "last_block.cuh"

  const int row0 = 0, MV = M;
  auto head_in = [&](int m, int d) { return __ldcg(ys + (size_t)m * N + hb * D + d); };
#include "head.cuh"
