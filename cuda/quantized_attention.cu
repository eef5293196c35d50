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
// reset to 0 by that block) merges the splits' partials pm (max, sum) and po (unnormalised output).
// A lane's share of a score is sk * (q . k_q) + kb * sum(q): its 8 q values' sum is taken once.
//
// Defines: T, L, H, HKV, D, G, NW, MINCH, SCALE_LOG2, BITS (4 or 8), GS, CAUSAL.
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
    const T* qrow = q + (((size_t)bl * H) + hk * G + g) * D + d0;
    qsum[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      qf[g][j] = static_cast<float>(qrow[j]) * SCALE_LOG2;
      qsum[g] += qf[g][j];
    }
  }
  float mx_[G], ls[G], of[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    mx_[g] = -INFINITY;
    ls[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) of[g][j] = 0.f;
  }

  // Lanes of one LPP group share p, so the group leaves the loop together; shuffle on the
  // group's mask only (groups of one warp may run different trip counts).
  const unsigned gmask = LPP == 32 ? 0xffffffffu : (((1u << LPP) - 1u) << (sub * LPP));
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
  __shared__ float sm_m[SLOTS][G];
  __shared__ float sm_l[SLOTS][G];
  __shared__ float sm_o[SLOTS][G][D];
  const int slot = warp * PPW + sub;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (li == 0) {
      sm_m[slot][g] = mx_[g];
      sm_l[slot][g] = ls[g];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sm_o[slot][g][d0 + j] = of[g][j];
  }
  __syncthreads();

  // merge the slots: thread per (g, d); a slot with no position (m = -inf) adds nothing
  const size_t pbase = ((size_t)bl * HKV + hk) * nsplit;   // first partial of this (b, l, kv head)
  for (int e = tid; e < G * D; e += NW * 32) {
    const int g = e / D, d = e % D;
    float M = -INFINITY;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) M = fmaxf(M, sm_m[s][g]);
    float acc = 0.f, lsum = 0.f;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const float ms = sm_m[s][g];
      if (ms != -INFINITY) {   // every split has a position, so M is finite
        const float c = exp2f(ms - M);
        acc = fmaf(sm_o[s][g][d], c, acc);
        lsum = fmaf(sm_l[s][g], c, lsum);
      }
    }
    if (nvalid == 1) {
      o[(((size_t)bl * H) + hk * G + g) * D + d] = static_cast<T>(acc / lsum);
    } else {
      po[((pbase + split) * G + g) * D + d] = acc;
      if (d == 0) {
        pm[((pbase + split) * G + g) * 2] = M;
        pm[((pbase + split) * G + g) * 2 + 1] = lsum;
      }
    }
  }
  if (nvalid == 1) return;

  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* c = const_cast<int*>(cnt) + bl * HKV + hk;
    const int ticket = atomicAdd(c, 1);
    s_last = (ticket == nvalid - 1);
    if (s_last) *c = 0;   // reset for the next launch (launches are stream-ordered)
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();

  // final merge over the splits: c_s = exp2(m_s - M), o = sum_s c_s po_s / sum_s c_s l_s;
  // a warp per head, splits lane and lane + 32, then a thread per output element.
  __shared__ float sm_c[MAXSPLIT][G];
  __shared__ float sm_inv[G];
  static_assert(MAXSPLIT <= 64, "two splits per lane");
  for (int g = warp; g < G; g += NW) {
    const bool v0 = lane < nvalid, v1 = lane + 32 < nvalid;
    const float* pm0 = pm + ((pbase + lane) * G + g) * 2;
    const float* pm1 = pm + ((pbase + lane + 32) * G + g) * 2;
    const float m0 = v0 ? __ldcg(pm0) : -INFINITY, l0 = v0 ? __ldcg(pm0 + 1) : 0.f;
    const float m1 = v1 ? __ldcg(pm1) : -INFINITY, l1 = v1 ? __ldcg(pm1 + 1) : 0.f;
    float M = fmaxf(m0, m1);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    const float c0 = v0 ? exp2f(m0 - M) : 0.f;
    const float c1 = v1 ? exp2f(m1 - M) : 0.f;
    float lsum = l0 * c0 + l1 * c1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
    if (v0) sm_c[lane][g] = c0;
    if (v1) sm_c[lane + 32][g] = c1;
    if (lane == 0) sm_inv[g] = 1.f / lsum;
  }
  __syncthreads();
  for (int e = tid; e < G * D; e += NW * 32) {
    const int g = e / D, d = e % D;
    float acc = 0.f;
    for (int s = 0; s < nvalid; ++s) acc = fmaf(__ldcg(po + ((pbase + s) * G + g) * D + d), sm_c[s][g], acc);
    o[(((size_t)bl * H) + hk * G + g) * D + d] = static_cast<T>(acc * sm_inv[g]);
  }
