// GQA decode attention over the KV cache buffers, read in place, split over the sequence.
//
//   o[b, l, h, :] = sum_{j < n} softmax_j(scale * q[b,l,h,:] . K[b,h/G,j,:]) V[b,h/G,j,:]
//   n = off[0] + l + 1   (query l of this step sits at position off[0] + l; causal over new tokens)
//
// q, o: [B, L, H, D] contiguous; kc, vc: the cache buffers [B, HKV, S, D] (S = allocated slots),
// indexed through their strides (ensure_row_contiguous=False: MLX never copies them; the last
// axis must be contiguous and rows 16-byte aligned, as in every KV cache buffer).
// Grid: x = split, y = kv head * (G / GB) + head subgroup, z = b * L + l; NW warps per block. The
// split size is set at run time from the valid length n: CH = max(ceil(n / nsplit), MINCH)
// positions, so every launched split has work however large the allocated cache is (splits past
// n exit at once).
// One block reads each K/V row of its chunk once for GB of the G = H / HKV query heads of its kv
// head (GB = G: once in all; GB < G: fewer registers per thread, the chunk read G / GB times).
// Lanes: LPP = D / 8 lanes hold one key row (16-byte loads), PPW = 32 / LPP rows per warp step,
// SLOTS = NW * PPW independent online-softmax states per block, merged through shared memory.
// Online softmax in fp32 with exp2 (q pre-scaled by scale * log2 e); a slot with no position
// keeps m = -inf, l = 0 and is skipped in the merge (no -inf - -inf).
// With more than one valid split each block writes its partial: pm (max, sum) and po (unnormalised
// output), and the last block to finish (atomic ticket on cnt[(b*L*HKV + kv head) * G/GB +
// subgroup], an input written through a const_cast that the last block resets to 0) merges them:
// one launch (split_merge.cuh, shared with quantized_attention.cu).
//
// LEFT_PAD (a batch cache, mlx-lm's BatchKVCache: rows left-padded, one write index off[0]): row b
// attends over positions [lp[b], off[0] + l + 1), the mask mlx-lm's BatchKVCache makes.
//
// Defines: T, L, H, HKV, D, G, GB, NW, MINCH, SCALE_LOG2; BLOCK_X/Y/Z, GRID_X: the block's
// coordinates (blockIdx/gridDim in a launch of its own; set by the caller when it is one phase of
// a launch); [WAIT_INPUTS, PF_ROWS] (a fused launch: the wait for the earlier phases, after the
// prefetch of the chunk's first PF_ROWS rows);
// [PHASE_MARKS] (layer.cuh's marks); [LEFT_PAD].
// Inputs: q, kc, vc, off, [lp (LEFT_PAD: int32 per row)], cnt (>= B*L*HKV*G/GB).   Outputs: o [B, L, H, D],
//   pm [B*L*HKV, nsplit, G, 2] f32, po [B*L*HKV, nsplit, G, D] f32.

#include "split_block.cuh"
#ifdef LEFT_PAD
  const int first = lp[b];                 // row b's keys start after its left padding
  const int n = off[0] + l + 1 - first;    // ... and these are its valid positions
#else
  const int n = off[0] + l + 1;
#endif
  const int CH = max((n + nsplit - 1) / nsplit, MINCH);
  const int nvalid = (n + CH - 1) / CH;
  if (split >= nvalid) return;
#ifdef LEFT_PAD
  const int start = first + split * CH;
  const int end = min(start + CH, first + n);
#else
  const int start = split * CH;
  const int end = min(start + CH, n);
#endif

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
#ifdef WAIT_INPUTS
  // A phase of the one-launch layer: the chunk's K/V rows of earlier steps do not
  // depend on the earlier phases (which write only positions off[0] + l), so its first PF_ROWS
  // rows are sent on to L2 before the block waits for q, once a chunk: its NSUB blocks take turns
  // by runs of NW * 32 lines (the whole chunk sent by every block decoded 4-5% slower after 8192
  // tokens). A row written later is still read fresh: L2 is coherent and the rows' loads below
  // come after the wait.
  {
    constexpr int LINES = (D * (int)sizeof(T) + 127) / 128;   // 128-byte lines per row
    const int64_t k0 = b * kc_strides[0] + hk * kc_strides[1];
    const int64_t v0 = b * vc_strides[0] + hk * vc_strides[1];
    const int rows = min(end - start, PF_ROWS);
    for (int e = tid + pf_first; e < rows * LINES; e += PF_STRIDE) {
      const int p = start + e / LINES, c = (e % LINES) * (128 / (int)sizeof(T));
      prefetch_l2(kc + k0 + p * kc_strides[2] + c);
      prefetch_l2(vc + v0 + p * vc_strides[2] + c);
    }
  }
  WAIT_INPUTS;
#endif
  const int sub = lane / LPP, li = lane % LPP;
  const int d0 = li * 8;

  float qf[GB][8];
#pragma unroll
  for (int g = 0; g < GB; ++g) {
    alignas(16) T tmp[8];
    *reinterpret_cast<uint4*>(tmp) =
        *reinterpret_cast<const uint4*>(q + (((size_t)bl * H) + h0 + g) * D + d0);
#pragma unroll
    for (int j = 0; j < 8; ++j) qf[g][j] = static_cast<float>(tmp[j]) * SCALE_LOG2;
  }
#include "split_states.cuh"
  const int64_t kbase = b * kc_strides[0] + hk * kc_strides[1] + d0;
  const int64_t vbase = b * vc_strides[0] + hk * vc_strides[1] + d0;
#pragma unroll 4
  for (int p = start + warp * PPW + sub; p < end; p += SLOTS) {
    alignas(16) T kt[8];
    alignas(16) T vt[8];
    *reinterpret_cast<uint4*>(kt) = *reinterpret_cast<const uint4*>(kc + kbase + p * kc_strides[2]);
    *reinterpret_cast<uint4*>(vt) = *reinterpret_cast<const uint4*>(vc + vbase + p * vc_strides[2]);
#pragma unroll
    for (int g = 0; g < GB; ++g) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) s = fmaf(qf[g][j], static_cast<float>(kt[j]), s);
#pragma unroll
      for (int o = LPP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(gmask, s, o);
      const float mnew = fmaxf(mx_[g], s);
      const float corr = exp2f(mx_[g] - mnew);   // mx_ = -inf on the first row: 0
      const float pw = exp2f(s - mnew);
      ls[g] = ls[g] * corr + pw;
#pragma unroll
      for (int j = 0; j < 8; ++j) of[g][j] = fmaf(of[g][j], corr, pw * static_cast<float>(vt[j]));
      mx_[g] = mnew;
    }
  }
#ifdef PHASE_MARKS
  layer_mark(stamps, 1);
#endif
#include "split_merge.cuh"
