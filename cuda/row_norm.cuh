// The input RMSNorm's per-row inverse RMS of a decode GEMV (gemv.cu, gemv_mma.cu: HAS_NORM):
// s_inv[m] = rsqrt(mean_k x[m, k]^2 + EPS) in fp32, like mx.fast.rms_norm, computed by every block
// (each reads all of x anyway). Needs T, M, NW, EPS, x [M, KN] (KN a multiple of 16 bytes of T),
// warp, lane.
  __shared__ float s_inv[M];
  {
    // per-row inverse RMS over K, fp32, like rms_norm
    __shared__ float s_red[NW][M];
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) ss[m] = 0.f;
    // 16-byte loads (K is a multiple of the group size, so of 16 / sizeof(T)): the prologue is
    // on every block's critical path
    constexpr int XP = 16 / (int)sizeof(T);
#pragma unroll
    for (int i = 0; i < (KN + NW * 32 * XP - 1) / (NW * 32 * XP); ++i) {
      const int k = (threadIdx.x + i * NW * 32) * XP;
      if (k >= KN) break;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        alignas(16) T tmp[XP];
        *reinterpret_cast<uint4*>(tmp) = *reinterpret_cast<const uint4*>(x + (size_t)m * KN + k);
#pragma unroll
        for (int j = 0; j < XP; ++j) {
          const float t = static_cast<float>(tmp[j]);
          ss[m] += t * t;
        }
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = ss[m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) s_red[warp][m] = v;
    }
    __syncthreads();
    if (threadIdx.x < M) {
      float v = 0.f;
#pragma unroll
      for (int i = 0; i < NW; ++i) v += s_red[i][threadIdx.x];
      s_inv[threadIdx.x] = rsqrtf(v / KN + EPS);
    }
    __syncthreads();
  }
