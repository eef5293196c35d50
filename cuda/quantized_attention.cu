// GQA decode attention over mlx-lm's QuantizedKVCache (affine 4- or 8-bit keys and values, read
// packed and dequantised in registers), split over the sequence.
//
//   o[b, l, h, :] = sum_{j < n} softmax_j(scale * q[b,l,h,:] . K[b,h/G,j,:]) V[b,h/G,j,:]
//   K[.., j, d] = k_w_q[.., j, d] * k_s[.., j, d / GS] + k_b[.., j, d / GS]   (V likewise)
//   n = off[0] + l + 1 with AT_OFFSET (a static cache of more slots than positions: the one-launch
//   layer's); else n = S - L + l + 1 with CAUSAL (query l sits at position S - L + l), else S
//
// q, o: [B, L, H, D] contiguous. k_w, v_w: packed uint32 [B, HKV, S, D * BITS / 32]; k_s, k_b, v_s,
// v_b: [B, HKV, S, D / GS] in T; all six read through their strides (the cache's slices of its
// buffers; last axis contiguous), S from k_w's shape.
// Grid: x = split, y = kv head * (G / GB) + head subgroup, z = b * L + l; NW warps per block (the
// block's coordinates BLOCK_X/Y/Z, GRID_X: blockIdx/gridDim in a launch of its own, set by the
// caller when it is a phase of the one-launch layer, which also sets WAIT_INPUTS: the wait for the
// earlier phases, after sending the chunk's first PF_ROWS cached rows to L2). As in attention.cu: CH =
// max(ceil(n / nsplit), MINCH) positions a split; a block takes GB of the G query heads of its kv
// head; LPP = D / 8 lanes hold one row (8 values each, one quantisation group: GS is a multiple of
// 8), PPW = 32 / LPP rows per warp step, SLOTS online-softmax states per block (fp32, exp2, q
// pre-scaled by scale * log2 e), merged in shared memory; with more than one split the last block to
// finish (ticket on cnt[(b*L*HKV + kv head) * G/GB + subgroup], reset to 0 by that block) merges the
// splits' partials pm (max, sum) and po (unnormalised output): split_merge.cuh, attention.cu's.
// A lane's share of a score is sk * (q . k_q) + kb * sum(q): its 8 q values' sum is taken once.
//
// Defines: T, L, H, HKV, D, G, GB, NW, MINCH, SCALE_LOG2, BITS (4 or 8), GS, CAUSAL, [AT_OFFSET],
// BLOCK_X/Y/Z, GRID_X, [WAIT_INPUTS, PF_ROWS], [PHASE_MARKS].
// Inputs: q, k_w, k_s, k_b, v_w, v_s, v_b, [off (AT_OFFSET)], cnt (>= B*L*HKV*G/GB).
// Outputs: o [B, L, H, D], pm [B*L*HKV, nsplit, G, 2] f32, po [B*L*HKV, nsplit, G, D] f32.

#include "split_block.cuh"
  constexpr int WPL = BITS / 4;   // packed words holding a lane's 8 values
  static_assert(GS % 8 == 0 && D % GS == 0, "a lane's 8 values lie in one quantisation group");
  // Value j of a lane's packed words as a float. 8 bits: the byte under the exponent of 2^23, less
  // 2^23 (exact; a PRMT and an FADD, full-rate instructions, instead of a conversion, which has a
  // fraction of their throughput). 4 bits: a conversion (the trick there, an OR and an FADD in its
  // place, decoded up to 1% slower: design doc).
  auto qval = [](const unsigned* w, int j) -> float {
#if BITS == 8
    return __uint_as_float(__byte_perm(w[j / 4], 0x4B000000u, 0x7540u | (j % 4))) - 8388608.f;
#else
    return static_cast<float>((w[0] >> (4 * j)) & 0xFu);
#endif
  };

#ifdef AT_OFFSET
  const int n = off[0] + l + 1;
#elif CAUSAL
  const int n = k_w_shape[2] - L + l + 1;
#else
  const int n = k_w_shape[2];
#endif
  const int CH = max((n + nsplit - 1) / nsplit, MINCH);
  const int nvalid = (n + CH - 1) / CH;
  if (split >= nvalid) return;
  const int start = split * CH;
  const int end = min(start + CH, n);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
#ifdef WAIT_INPUTS
  // The chunk's rows of earlier steps do not depend on the earlier phases (the QKV phase writes
  // only positions off[0] + l): its first PF_ROWS rows are sent on to L2 before the wait, each
  // array's span of them by lines; the chunk's NSUB blocks take turns by runs of NW * 32 lines (attention.cu).
  {
    const int last = min(end, start + PF_ROWS) - 1;
    auto span = [&](const auto* a, const auto& st, int row_bytes) {
      const char* p0 = reinterpret_cast<const char*>(a + b * st[0] + hk * st[1] + start * st[2]);
      p0 -= reinterpret_cast<unsigned long long>(p0) & 127;   // from the first row's line
      const char* p1 = reinterpret_cast<const char*>(a + b * st[0] + hk * st[1] + last * st[2]) + row_bytes;
      for (const char* p = p0 + (tid + pf_first) * 128; p < p1; p += PF_STRIDE * 128)
        prefetch_l2(p);
    };
    span(k_w, k_w_strides, D * BITS / 8);
    span(v_w, v_w_strides, D * BITS / 8);
    span(k_s, k_s_strides, D / GS * (int)sizeof(T));
    span(k_b, k_b_strides, D / GS * (int)sizeof(T));
    span(v_s, v_s_strides, D / GS * (int)sizeof(T));
    span(v_b, v_b_strides, D / GS * (int)sizeof(T));
  }
  WAIT_INPUTS;
#endif
  const int sub = lane / LPP, li = lane % LPP;
  const int d0 = li * 8;

  float qf[GB][8], qsum[GB];
#pragma unroll
  for (int g = 0; g < GB; ++g) {
    const T* qrow = q + (((size_t)bl * H) + h0 + g) * D + d0;
    qsum[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      qf[g][j] = static_cast<float>(qrow[j]) * SCALE_LOG2;
      qsum[g] += qf[g][j];
    }
  }
#include "split_states.cuh"
  const unsigned* kwp = k_w + b * k_w_strides[0] + hk * k_w_strides[1] + li * WPL;
  const unsigned* vwp = v_w + b * v_w_strides[0] + hk * v_w_strides[1] + li * WPL;
  const T* ksp = k_s + b * k_s_strides[0] + hk * k_s_strides[1] + d0 / GS;
  const T* kbp = k_b + b * k_b_strides[0] + hk * k_b_strides[1] + d0 / GS;
  const T* vsp = v_s + b * v_s_strides[0] + hk * v_s_strides[1] + d0 / GS;
  const T* vbp = v_b + b * v_b_strides[0] + hk * v_b_strides[1] + d0 / GS;
  // The next position's packed words, scales and biases are loaded before this one is used (in the
  // SASS, once this one has arrived; an unrolled loop, which held their dequantised floats too, took
  // the Qwen3-4B kv8 layer launch to 159 registers, 3 blocks per SM; this loop: 127, 4 per SM).
  unsigned nk[WPL], nv[WPL];
  T ns[4];
  auto load = [&](int p) {
    if (p >= end) return;
#if BITS == 8
    const uint2 k2 = *reinterpret_cast<const uint2*>(kwp + p * k_w_strides[2]);
    const uint2 v2 = *reinterpret_cast<const uint2*>(vwp + p * v_w_strides[2]);
    nk[0] = k2.x; nk[1] = k2.y;
    nv[0] = v2.x; nv[1] = v2.y;
#else
    nk[0] = kwp[p * k_w_strides[2]];
    nv[0] = vwp[p * v_w_strides[2]];
#endif
    ns[0] = ksp[p * k_s_strides[2]];
    ns[1] = kbp[p * k_b_strides[2]];
    ns[2] = vsp[p * v_s_strides[2]];
    ns[3] = vbp[p * v_b_strides[2]];
  };
  load(start + warp * PPW + sub);
#pragma unroll 1
  for (int p = start + warp * PPW + sub; p < end; p += SLOTS) {
    unsigned kq[WPL], vq[WPL];
#pragma unroll
    for (int i = 0; i < WPL; ++i) {
      kq[i] = nk[i];
      vq[i] = nv[i];
    }
    const float sk = static_cast<float>(ns[0]), bk = static_cast<float>(ns[1]);
    const float sv = static_cast<float>(ns[2]), bv = static_cast<float>(ns[3]);
    load(p + SLOTS);
    float kf[8], vf[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      kf[j] = qval(kq, j);
      vf[j] = qval(vq, j);
    }
#pragma unroll
    for (int g = 0; g < GB; ++g) {
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
#ifdef PHASE_MARKS
  layer_mark(stamps, 1);
#endif
#include "split_merge.cuh"
