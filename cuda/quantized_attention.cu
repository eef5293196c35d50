// GQA decode attention over mlx-lm's QuantizedKVCache (affine 4- or 8-bit keys and values, read
// packed and dequantised in registers), split over the sequence.
//
//   o[b, l, h, :] = sum_{j < n} softmax_j(scale * q[b,l,h,:] . K[b,h/G,j,:]) V[b,h/G,j,:]
//   K[.., j, d] = kw_q[.., j, d] * ks[.., j, d / GS] + kb[.., j, d / GS]   (V likewise)
//   n = S - L + l + 1 with CAUSAL (query l sits at position S - L + l), else S
//
// q, o: [B, L, H, D] contiguous. kw, vw: packed uint32 [B, HKV, S, D * BITS / 32]; ks, kb, vs, vb:
// [B, HKV, S, D / GS] in T; all six read through their strides (the cache's slices of its buffers;
// last axis contiguous), S from kw's shape.
// Grid: x = split, y = kv head, z = b * L + l; NW warps per block. As in attention.cu: CH =
// max(ceil(n / nsplit), MINCH) positions a split; LPP = D / 8 lanes hold one row (8 values each,
// one quantisation group: GS is a multiple of 8), PPW = 32 / LPP rows per warp step, SLOTS
// online-softmax states per block (fp32, exp2, q pre-scaled by scale * log2 e), merged in shared
// memory; with more than one split the last block to finish (ticket on cnt[b*L*HKV + kv head],
// reset to 0 by that block) merges the splits' partials pm (max, sum) and po (unnormalised output):
// split_merge.cuh, attention.cu's, with GB = G (a block takes every query head of its kv head).
// A lane's share of a score is sk * (q . k_q) + kb * sum(q): its 8 q values' sum is taken once.
//
// Defines: T, L, H, HKV, D, G, GB (= G), NW, MINCH, SCALE_LOG2, BITS (4 or 8), GS, CAUSAL.
// Inputs: q, kw, ks, kb, vw, vs, vb, cnt (>= B*L*HKV).
// Outputs: o [B, L, H, D], pm [B*L*HKV, nsplit, G, 2] f32, po [B*L*HKV, nsplit, G, D] f32.

  constexpr int LPP = D / 8;
  constexpr int PPW = 32 / LPP;
  constexpr int SLOTS = NW * PPW;
  constexpr int MAXSPLIT = 64;
  constexpr int WPL = BITS / 4;   // packed words holding a lane's 8 values
  constexpr unsigned QMASK = (1u << BITS) - 1u;
  static_assert(GS % 8 == 0 && D % GS == 0, "a lane's 8 values lie in one quantisation group");

  const int split = blockIdx.x;
  const int nsplit = gridDim.x;
  const int hk = blockIdx.y;
  static_assert(GB == G, "a block takes every query head of its kv head");
  constexpr int NSUB = 1;
  const int g0 = 0, h0 = hk * G;
  const int bl = blockIdx.z;
  const int b = bl / L, l = bl % L;
  const int S = kw_shape[2];
#if CAUSAL
  const int n = S - L + l + 1;
#else
  const int n = S;
#endif
  const int CH = max((n + nsplit - 1) / nsplit, MINCH);
  const int nvalid = (n + CH - 1) / CH;
  if (split >= nvalid) return;
  const int start = split * CH;
  const int end = min(start + CH, n);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int sub = lane / LPP, li = lane % LPP;
  const int d0 = li * 8;

  float qf[G][8], qsum[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qrow = q + (((size_t)bl * H) + h0 + g) * D + d0;
    qsum[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      qf[g][j] = static_cast<float>(qrow[j]) * SCALE_LOG2;
      qsum[g] += qf[g][j];
    }
  }
#include "split_states.cuh"
  const unsigned* kwp = kw + b * kw_strides[0] + hk * kw_strides[1] + li * WPL;
  const unsigned* vwp = vw + b * vw_strides[0] + hk * vw_strides[1] + li * WPL;
  const T* ksp = ks + b * ks_strides[0] + hk * ks_strides[1] + d0 / GS;
  const T* kbp = kb + b * kb_strides[0] + hk * kb_strides[1] + d0 / GS;
  const T* vsp = vs + b * vs_strides[0] + hk * vs_strides[1] + d0 / GS;
  const T* vbp = vb + b * vb_strides[0] + hk * vb_strides[1] + d0 / GS;
#pragma unroll 2
  for (int p = start + warp * PPW + sub; p < end; p += SLOTS) {
    unsigned kq[WPL], vq[WPL];
#if BITS == 8
    const uint2 k2 = *reinterpret_cast<const uint2*>(kwp + p * kw_strides[2]);
    const uint2 v2 = *reinterpret_cast<const uint2*>(vwp + p * vw_strides[2]);
    kq[0] = k2.x; kq[1] = k2.y;
    vq[0] = v2.x; vq[1] = v2.y;
#else
    kq[0] = kwp[p * kw_strides[2]];
    vq[0] = vwp[p * vw_strides[2]];
#endif
    const float sk = static_cast<float>(ksp[p * ks_strides[2]]);
    const float bk = static_cast<float>(kbp[p * kb_strides[2]]);
    const float sv = static_cast<float>(vsp[p * vs_strides[2]]);
    const float bv = static_cast<float>(vbp[p * vb_strides[2]]);
    float kf[8], vf[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      kf[j] = static_cast<float>((kq[j * BITS / 32] >> ((j * BITS) % 32)) & QMASK);
      vf[j] = static_cast<float>((vq[j * BITS / 32] >> ((j * BITS) % 32)) & QMASK);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) dot = fmaf(qf[g][j], kf[j], dot);
      float s = fmaf(sk, dot, bk * qsum[g]);
#pragma unroll
      for (int o = LPP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(gmask, s, o);
      const float mnew = fmaxf(mx_[g], s);
      const float corr = exp2f(mx_[g] - mnew);   // mx_ = -inf on the first row: 0
      const float pw = exp2f(s - mnew);
      ls[g] = ls[g] * corr + pw;
      const float ps = pw * sv, pb = pw * bv;
#pragma unroll
      for (int j = 0; j < 8; ++j) of[g][j] = fmaf(of[g][j], corr, fmaf(ps, vf[j], pb));
      mx_[g] = mnew;
    }
  }
#include "split_merge.cuh"
