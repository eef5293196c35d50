// The end of a split decode attention block (attention.cu, quantized_attention.cu): the block's
// SLOTS online-softmax states (mx_, ls, of for its GB query heads, lane group `sub`, lane `li`
// holding d0 .. d0 + 7) merged through shared memory; with one valid split the output is written,
// else the split's partial (pm: max and sum, po: unnormalised output) and, by the last block to
// finish (atomic ticket on cnt[(bl * HKV + hk) * NSUB + g0 / GB], reset to 0 by that block), the
// merge of every split's partials: one launch.
// In scope: T, H, HKV, D, G, GB, NSUB, NW, SLOTS, PPW, MAXSPLIT, bl, hk, g0, h0, split, nsplit,
// nvalid, tid, warp, lane, sub, li, d0, the states, and the inputs / outputs o, pm, po, cnt.
  __shared__ float sm_m[SLOTS][GB];
  __shared__ float sm_l[SLOTS][GB];
  __shared__ float sm_o[SLOTS][GB][D];
  const int slot = warp * PPW + sub;
#pragma unroll
  for (int g = 0; g < GB; ++g) {
    if (li == 0) {
      sm_m[slot][g] = mx_[g];
      sm_l[slot][g] = ls[g];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sm_o[slot][g][d0 + j] = of[g][j];
  }
  __syncthreads();

  // merge the slots: thread per (g, d)
  const size_t pbase = ((size_t)bl * HKV + hk) * nsplit;   // first partial of this (b, l, kv head)
  for (int e = tid; e < GB * D; e += NW * 32) {
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
      o[(((size_t)bl * H) + h0 + g) * D + d] = static_cast<T>(acc / lsum);
    } else {
      po[((pbase + split) * G + g0 + g) * D + d] = acc;
      if (d == 0) {
        pm[((pbase + split) * G + g0 + g) * 2] = M;
        pm[((pbase + split) * G + g0 + g) * 2 + 1] = lsum;
      }
    }
  }
#ifdef PHASE_MARKS
  layer_mark(stamps, 2);
#endif
  if (nvalid == 1) return;

  {
    const int ticket = (bl * HKV + hk) * NSUB + g0 / GB, arrivals = nvalid;
#include "last_block.cuh"
  }

  // final merge over the splits: c[s][g] = exp2(m_s - M_g), o = sum_s c po_s / sum_s c l_s.
  // Every step reads all splits at once (the splits' partials are L2 round trips: a loop of
  // dependent reads over 33 splits was most of the phase's tail).
  __shared__ float sm_c[MAXSPLIT][GB];   // m_s, then c (sm_ls: l_s)
  __shared__ float sm_ls[MAXSPLIT][GB];
  __shared__ float sm_inv[GB];
  for (int e = tid; e < nvalid * GB; e += NW * 32) {
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(pm + ((pbase + e / GB) * G + g0 + e % GB) * 2));
    sm_c[e / GB][e % GB] = ml.x;
    sm_ls[e / GB][e % GB] = ml.y;
  }
  __syncthreads();
  static_assert(MAXSPLIT <= 64, "two splits per lane");
  for (int g = warp; g < GB; g += NW) {   // a warp per head: splits lane and lane + 32
    const bool v0 = lane < nvalid, v1 = lane + 32 < nvalid;
    const float m0 = v0 ? sm_c[lane][g] : -INFINITY;
    const float m1 = v1 ? sm_c[lane + 32][g] : -INFINITY;
    float M = fmaxf(m0, m1);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    // every split has a position, so M is finite; lanes without a split add nothing
    const float c0 = v0 ? exp2f(m0 - M) : 0.f;
    const float c1 = v1 ? exp2f(m1 - M) : 0.f;
    float lsum = (v0 ? sm_ls[lane][g] * c0 : 0.f) + (v1 ? sm_ls[lane + 32][g] * c1 : 0.f);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
    if (v0) sm_c[lane][g] = c0;
    if (v1) sm_c[lane + 32][g] = c1;
    if (lane == 0) sm_inv[g] = 1.f / lsum;
  }
  __syncthreads();
  // o: ITEMS float4 outputs; with fewer than the block's threads, PARTS threads share one, each
  // summing every PARTS-th split, and their sums are added in part order.
  constexpr int ITEMS = GB * D / 4;
  constexpr int PARTS = ITEMS >= NW * 32 ? 1 : NW * 32 / ITEMS;
  __shared__ float4 sm_part[PARTS][ITEMS];
  for (int e = tid; e < ITEMS * PARTS; e += NW * 32) {
    const int item = e % ITEMS, part = e / ITEMS;
    const int g = (item * 4) / D, d = (item * 4) % D;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = part; s < nvalid; s += PARTS) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(po + ((pbase + s) * G + g0 + g) * D + d));
      const float c = sm_c[s][g];
      acc.x = fmaf(v.x, c, acc.x);
      acc.y = fmaf(v.y, c, acc.y);
      acc.z = fmaf(v.z, c, acc.z);
      acc.w = fmaf(v.w, c, acc.w);
    }
    sm_part[part][item] = acc;
  }
  __syncthreads();
  for (int item = tid; item < ITEMS; item += NW * 32) {
    const int g = (item * 4) / D, d = (item * 4) % D;
    float4 acc = sm_part[0][item];
#pragma unroll
    for (int p = 1; p < PARTS; ++p) {
      const float4 v = sm_part[p][item];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    const float inv = sm_inv[g];
    T* dst = o + (((size_t)bl * H) + h0 + g) * D + d;
    dst[0] = static_cast<T>(acc.x * inv);
    dst[1] = static_cast<T>(acc.y * inv);
    dst[2] = static_cast<T>(acc.z * inv);
    dst[3] = static_cast<T>(acc.w * inv);
  }
