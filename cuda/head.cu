// q/k RMSNorm + RoPE, k/v written into the cache in place, for the rows of a QKV projection made
// by another kernel (qmm's, in FastBlock.wide): head.cuh, the epilogue of gemv.cu's EPI 3, as a
// launch of its own. One warp per block, one block per (head over q, k, v heads, activation row):
// grid (H + 2 HKV, B * L).
//
// Defines: T, L, H, HKV, D, HAS_QKNORM (+ QEPS, KEPS), ROPE_TRAD, ROPE_FREQS, ROPE_LOG2_BASE,
// ROPE_SCALE, [LEFT_PAD], [KV_BITS, KV_GS: a quantised cache].
// Inputs: qkv [B * L, (H + 2 HKV) * D] (T-rounded, bias added), [qn, kn], off, [lp], [rf], kc, vc
// (KV_BITS: k_w, k_s, k_b, v_w, v_s, v_b), after (the cache buffers' last reader: an input only so that this launch waits for it).
// Output: yq [B, L, H, D].

  constexpr int M = 1, NW = 1, N = (H + 2 * HKV) * D;
  const int hb = blockIdx.x, row0 = blockIdx.y, warp = 0, lane = threadIdx.x;
  auto head_in = [&](int m, int d) { return static_cast<float>(qkv[(size_t)(row0 + m) * N + hb * D + d]); };
#include "head.cuh"
