// GQA decode attention over the KV cache buffers, read in place, split over the sequence.
//
//   o[b, l, h, :] = sum_{j < n} softmax_j(scale * q[b,l,h,:] . K[b,h/G,j,:]) V[b,h/G,j,:]
//   n = off[0] + l + 1   (query l of this step sits at position off[0] + l; causal over new tokens)
//
// q, o: [B, L, H, D]; kc, vc: the full cache buffers [B, HKV, S, D] (S = allocated slots, read
// from kc_shape at run time; ensure_row_contiguous=False so MLX never copies them).
// Grid: x = split (CH = ceil(S / gridDim.x) positions each), y = kv head, z = b * L + l.
// One block reads each K/V row of its chunk once for all G = H / HKV query heads of its kv head.
// Lanes: LPP = D / 8 lanes hold one key row (16-byte loads), PPW = 32 / LPP rows per warp step.
// Online softmax in fp32 with exp2 (q pre-scaled by scale * log2 e); a split or slot with no
// valid position keeps m = -inf, l = 0 and is skipped in the merges (no -inf - -inf).
// Splits beyond n exit at once. With more than one valid split, each block writes its partial
// (m, l, o[D]) per query head to `part`, and the last block to finish (atomic ticket on cnt, a
// persistent zeroed int32 buffer that the last block resets) merges them: one launch.
//
// Defines: T, L, H, HKV, D, G, NW (warps; sized so SLOTS*G*D floats fit in 40 KB), SCALE_LOG2.
// Inputs: q, kc, vc, off, cnt.   Outputs: o [B, L, H, D], part [B*L*HKV, nsplit, G, D + 2] f32.

  constexpr int LPP = D / 8;
  constexpr int PPW = 32 / LPP;
  constexpr int SLOTS = NW * PPW;

  const int S = kc_shape[2];
  const int split = blockIdx.x;
  const int nsplit = gridDim.x;
  const int CH = (S + nsplit - 1) / nsplit;   // positions per split (run time: no recompile)
  const int hk = blockIdx.y;
  const int bl = blockIdx.z;
  const int b = bl / L, l = bl % L;
  const int n = off[0] + l + 1;
  const int nvalid = (n + CH - 1) / CH;
  if (split >= nvalid) return;
  const int start = split * CH;
  const int end = min(start + CH, n);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int sub = lane / LPP, li = lane % LPP;
  const int d0 = li * 8;

  float qf[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    alignas(16) T tmp[8];
    *reinterpret_cast<uint4*>(tmp) =
        *reinterpret_cast<const uint4*>(q + (((size_t)bl * H) + hk * G + g) * D + d0);
#pragma unroll
    for (int j = 0; j < 8; ++j) qf[g][j] = static_cast<float>(tmp[j]) * SCALE_LOG2;
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
  const size_t base = ((size_t)b * HKV + hk) * (size_t)S * D + d0;
#pragma unroll 2
  for (int p = start + warp * PPW + sub; p < end; p += SLOTS) {
    alignas(16) T kt[8];
    alignas(16) T vt[8];
    *reinterpret_cast<uint4*>(kt) = *reinterpret_cast<const uint4*>(kc + base + (size_t)p * D);
    *reinterpret_cast<uint4*>(vt) = *reinterpret_cast<const uint4*>(vc + base + (size_t)p * D);
    float kf[8], vf[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      kf[j] = static_cast<float>(kt[j]);
      vf[j] = static_cast<float>(vt[j]);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) s = fmaf(qf[g][j], kf[j], s);
#pragma unroll
      for (int o = LPP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(gmask, s, o);
      const float mnew = fmaxf(mx_[g], s);
      const float corr = exp2f(mx_[g] - mnew);   // mx_ = -inf on the first row: 0
      const float pw = exp2f(s - mnew);
      ls[g] = ls[g] * corr + pw;
#pragma unroll
      for (int j = 0; j < 8; ++j) of[g][j] = fmaf(of[g][j], corr, pw * vf[j]);
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

  // merge the slots: thread per (g, d)
  __shared__ float sm_M[G];
  __shared__ float sm_L[G];
  __shared__ int s_last;
  for (int e = tid; e < G * D; e += NW * 32) {
    const int g = e / D, d = e % D;
    float M = -INFINITY;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) M = fmaxf(M, sm_m[s][g]);
    float acc = 0.f, lsum = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) {
        const float ms = sm_m[s][g];
        if (ms != -INFINITY) {
          const float c = exp2f(ms - M);
          acc = fmaf(sm_o[s][g][d], c, acc);
          lsum = fmaf(sm_l[s][g], c, lsum);
        }
      }
    }
    if (nvalid == 1) {
      o[(((size_t)bl * H) + hk * G + g) * D + d] = static_cast<T>(acc / lsum);
    } else {
      float* pp = part + ((((size_t)bl * HKV + hk) * nsplit + split) * G + g) * (D + 2);
      pp[2 + d] = acc;
      if (d == 0) {
        pp[0] = M;
        pp[1] = lsum;
      }
    }
  }
  if (nvalid == 1) return;

  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* c = const_cast<int*>(cnt) + (bl * HKV + hk);
    const int ticket = atomicAdd(c, 1);
    s_last = (ticket == nvalid - 1);
    if (s_last) *c = 0;   // reset for the next launch (launches are stream-ordered)
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();

  const float* pb = part + (((size_t)bl * HKV + hk) * nsplit) * G * (D + 2);
  if (tid < G) {
    float M = -INFINITY;
    for (int s = 0; s < nvalid; ++s) M = fmaxf(M, __ldcg(pb + ((size_t)s * G + tid) * (D + 2)));
    float lsum = 0.f;
    for (int s = 0; s < nvalid; ++s) {
      const float* pp = pb + ((size_t)s * G + tid) * (D + 2);
      lsum += __ldcg(pp + 1) * exp2f(__ldcg(pp) - M);
    }
    sm_M[tid] = M;
    sm_L[tid] = lsum;
  }
  __syncthreads();
  for (int e = tid; e < G * D; e += NW * 32) {
    const int g = e / D, d = e % D;
    const float M = sm_M[g];
    float acc = 0.f;
    for (int s = 0; s < nvalid; ++s) {
      const float* pp = pb + ((size_t)s * G + g) * (D + 2);
      acc += __ldcg(pp + 2 + d) * exp2f(__ldcg(pp) - M);
    }
    o[(((size_t)bl * H) + hk * G + g) * D + d] = static_cast<T>(acc / sm_L[g]);
  }
