// Quantised GEMV family for decode (1-8 activation rows), MLX affine format, one launch per op.
//
//   w(n, k) = s[n, g] * q(n, k) + b[n, g],  g = k / GS,  q = BITS-bit unsigned (LSB-first packing)
//   acc[m, n] = sum_g ( s[n,g] * sum_{k in g} x[m,k] q(n,k)  +  b[n,g] * sum_{k in g} x[m,k] )
//
// Deferred dequantisation, fp32 accumulation. Each lane owns EPW consecutive k (VEC uint32 words,
// one 16/8/4-byte load per row) that lie inside one quantisation group, so its partial of the
// group's x-sum is exact; a warp owns R output rows and reuses the x chunk for all of them.
// Activation rows are processed MC at a time (registers), weights re-read from L1/L2 per pass.
//
// Optional input RMSNorm (HAS_NORM): x <- T(T(x * rsqrt(mean(x^2) + eps)) * nw), exactly the
// rounding points of mx.fast.rms_norm, computed per block (every block reads all of x anyway).
//
// Epilogues (EPI):
//   0 plain      y[m, n] = T(acc)                     (+ bias: T(T(acc) + bias[n]))
//   1 residual   y[m, n] = T(res[m, n] + T(acc))      (o_proj / down_proj + residual add)
//   2 swiglu     y[m, j] = T(T(silu(T(acc_gate))) * T(acc_up)), gate row j, up row j + NOUT
//   3 head       QKV per head: block = one head of D rows; q/k RMSNorm (HAS_QKNORM) + RoPE
//                (stock rounding points: GEMV out -> T, norm -> T, weight mul -> T, rope in fp32
//                with precise cos/sin -> T). q goes to yq [B, L, H, D]; k and v are written IN
//                PLACE into the cache buffers kc/vc [B, Hkv, S, D] at position off[0] + l (the
//                cache arrays are inputs; the write goes through a const_cast: MLX never sees it,
//                and later readers are ordered after this launch through their use of yq).
//
// Defines set by the wrapper: T, BITS, GS, M, MC, R, NW, VEC (K % (32*EPW/32... see wrapper), EPI,
// HAS_NORM, HAS_BIAS, and for EPI 3: L (tokens), H, HKV, D, HAS_QKNORM,
// ROPE_TRAD, ROPE_FREQS.
//
// Inputs (names): x, w, sc, bi, [nw, eps], [bias], [res], EPI 3: [qn, kn, qkeps], off, rb, [rf], kc, vc
//   rb = float[2] {log2(rope base), rope scale}
// Outputs: y, or for EPI 3 yq

  constexpr int EPW = (BITS == 4 ? 8 : 4) * VEC;   // k per lane per step
  constexpr int KSTEP = 32 * EPW;                   // k per warp per step
  constexpr int RR = (EPI == 2) ? 2 * R : R;        // weight rows per warp
  // Sizes at run time (from the weight's shape): one compiled kernel per shape class, not per layer.
  const int N = w_shape[0];                         // weight rows
  const int KW = w_shape[1];                        // uint32 words per weight row
  const int K = KW * (32 / BITS);
  const int NG = K / GS;
  const int NOUT = (EPI == 2) ? N / 2 : N;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  __shared__ float s_inv[8];
  __shared__ float s_red[NW][8];

#if HAS_NORM
  {
    // per-row inverse RMS over K, fp32, like rms_norm
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) ss[m] = 0.f;
    for (int k = threadIdx.x; k < K; k += NW * 32) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float t = static_cast<float>(x[m * K + k]);
        ss[m] += t * t;
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
      for (int i = 0; i < NW; ++i) v += s_red[i][threadIdx.x];
      s_inv[threadIdx.x] = rsqrtf(v / K + eps[0]);
    }
    __syncthreads();
  }
#endif

  // logical rows of this warp
  int row0;
#if EPI == 3
  row0 = blockIdx.x * D + warp * R;
#else
  row0 = (blockIdx.x * NW + warp) * R;
#endif

#if EPI == 3
  __shared__ float s_y[M][D];
#endif

  bool row_ok[RR];
  int wrow[RR];
#pragma unroll
  for (int r = 0; r < RR; ++r) {
    int lr = (EPI == 2) ? (row0 + (r % R)) : (row0 + r);
    bool ok = lr < NOUT;
    int n = (EPI == 2 && r >= R) ? lr + NOUT : lr;
    row_ok[r] = ok;
    wrow[r] = ok ? n : 0;
  }

#pragma unroll
  for (int m0 = 0; m0 < M; m0 += MC) {
    float acc[RR][MC];
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
      for (int mi = 0; mi < MC; ++mi) acc[r][mi] = 0.f;
    for (int ks = 0; ks < K; ks += KSTEP) {
      const int k0 = ks + lane * EPW;
      if (k0 < K) {
        // weights first: RR independent loads in flight
        uint32_t wv[RR][VEC];
#pragma unroll
        for (int r = 0; r < RR; ++r) {
          const uint32_t* p = w + (size_t)wrow[r] * KW + (k0 * BITS) / 32;
          if constexpr (VEC == 4) {
            uint4 t = *reinterpret_cast<const uint4*>(p);
            wv[r][0] = t.x; wv[r][1] = t.y; wv[r][2] = t.z; wv[r][3] = t.w;
          } else if constexpr (VEC == 2) {
            uint2 t = *reinterpret_cast<const uint2*>(p);
            wv[r][0] = t.x; wv[r][1] = t.y;
          } else {
            wv[r][0] = *p;
          }
        }
        const int g = k0 / GS;
        float sv[RR], bv[RR];
#pragma unroll
        for (int r = 0; r < RR; ++r) {
          sv[r] = static_cast<float>(sc[(size_t)wrow[r] * NG + g]);
          bv[r] = static_cast<float>(bi[(size_t)wrow[r] * NG + g]);
        }
        // activations: EPW values per row, 16-byte loads
        float xf[MC][EPW];
        float sx[MC];
#pragma unroll
        for (int mi = 0; mi < MC; ++mi) {
          const int m = m0 + mi;
          sx[mi] = 0.f;
          if (m < M) {
            const T* xp = x + (size_t)m * K + k0;
            constexpr int PER = 16 / (int)sizeof(T);
            constexpr int XV = PER < EPW ? PER : EPW;      // elements per x load
#pragma unroll
            for (int c = 0; c < EPW; c += XV) {
              alignas(16) T tmp[XV];
              if constexpr (XV * sizeof(T) == 16) {
                *reinterpret_cast<uint4*>(tmp) = *reinterpret_cast<const uint4*>(xp + c);
              } else if constexpr (XV * sizeof(T) == 8) {
                *reinterpret_cast<uint2*>(tmp) = *reinterpret_cast<const uint2*>(xp + c);
              } else {
                *reinterpret_cast<uint32_t*>(tmp) = *reinterpret_cast<const uint32_t*>(xp + c);
              }
#pragma unroll
              for (int j = 0; j < XV; ++j) {
#if HAS_NORM
                T nv = static_cast<T>(static_cast<float>(tmp[j]) * s_inv[m]);
                T wn = nw[k0 + c + j];
                float v = static_cast<float>(static_cast<T>(static_cast<float>(wn) * static_cast<float>(nv)));
#else
                float v = static_cast<float>(tmp[j]);
#endif
                xf[mi][c + j] = v;
                sx[mi] += v;
              }
            }
          } else {
#pragma unroll
            for (int j = 0; j < EPW; ++j) xf[mi][j] = 0.f;
          }
        }
        // dot products
#pragma unroll
        for (int r = 0; r < RR; ++r) {
          float d[MC];
#pragma unroll
          for (int mi = 0; mi < MC; ++mi) d[mi] = 0.f;
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            const uint32_t wd = wv[r][v];
            if constexpr (BITS == 4) {
              const uint32_t lo = wd & 0x0F0F0F0Fu;
              const uint32_t hi = (wd >> 4) & 0x0F0F0F0Fu;
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                float q0 = __int_as_float(__byte_perm(lo, 0x4B000000u, 0x7540 + j)) - 8388608.f;
                float q1 = __int_as_float(__byte_perm(hi, 0x4B000000u, 0x7540 + j)) - 8388608.f;
#pragma unroll
                for (int mi = 0; mi < MC; ++mi) {
                  d[mi] = fmaf(xf[mi][v * 8 + 2 * j], q0, d[mi]);
                  d[mi] = fmaf(xf[mi][v * 8 + 2 * j + 1], q1, d[mi]);
                }
              }
            } else {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                float q0 = __int_as_float(__byte_perm(wd, 0x4B000000u, 0x7540 + j)) - 8388608.f;
#pragma unroll
                for (int mi = 0; mi < MC; ++mi) d[mi] = fmaf(xf[mi][v * 4 + j], q0, d[mi]);
              }
            }
          }
#pragma unroll
          for (int mi = 0; mi < MC; ++mi) {
            acc[r][mi] += sv[r] * d[mi] + bv[r] * sx[mi];
          }
        }
      }
    }

    // ---- end of the K loop for rows m0 .. m0+MC: warp reduction and store ----
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
      for (int mi = 0; mi < MC; ++mi) {
        float v = acc[r][mi];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        acc[r][mi] = v;
      }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (!row_ok[r]) continue;
        const int n = row0 + r;
#pragma unroll
        for (int mi = 0; mi < MC; ++mi) {
          const int m = m0 + mi;
          if (m >= M) continue;
#if EPI == 0
          T t = static_cast<T>(acc[r][mi]);
#if HAS_BIAS
          t = static_cast<T>(static_cast<float>(t) + static_cast<float>(bias[n]));
#endif
          y[(size_t)m * NOUT + n] = t;
#elif EPI == 1
          T t = static_cast<T>(acc[r][mi]);
          y[(size_t)m * NOUT + n] = static_cast<T>(static_cast<float>(res[(size_t)m * NOUT + n]) + static_cast<float>(t));
#elif EPI == 2
          float gt = static_cast<float>(static_cast<T>(acc[r][mi]));
          float ut = static_cast<float>(static_cast<T>(acc[r + R][mi]));
          float sg = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-gt))));
          float a = static_cast<float>(static_cast<T>(gt * sg));
          y[(size_t)m * NOUT + n] = static_cast<T>(a * ut);
#else
          T t = static_cast<T>(acc[r][mi]);
#if HAS_BIAS
          t = static_cast<T>(static_cast<float>(t) + static_cast<float>(bias[n]));
#endif
          s_y[m][warp * R + r] = static_cast<float>(t);
#endif
        }
      }
    }
  }

#if EPI == 3
  // ---- head epilogue: block = one head (D rows) of q, k or v ----
  __syncthreads();
  const int hb = blockIdx.x;
  const int kind = hb < H ? 0 : (hb < H + HKV ? 1 : 2);   // q, k, v
  const int head = kind == 0 ? hb : (kind == 1 ? hb - H : hb - H - HKV);
  const int pos0 = off[0];
  const int S = kc_shape[2];   // allocated cache slots (runtime: no recompile when the cache grows)
  if (kind < 2) {
    // one warp per activation row: (norm) + rope
    for (int m = warp; m < M; m += NW) {
      const int b = m / L, l = m % L;
      const int pos = pos0 + l;
      float inv = 1.f;
#if HAS_QKNORM
      {
        float ssq = 0.f;
        for (int d = lane; d < D; d += 32) ssq += s_y[m][d] * s_y[m][d];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
        inv = rsqrtf(ssq / D + qkeps[0]);
      }
      const T* nwt = kind == 0 ? qn : kn;
#endif
      __syncwarp();
      // normalised values (T-rounded) back into s_y
      for (int d = lane; d < D; d += 32) {
#if HAS_QKNORM
        T nv = static_cast<T>(s_y[m][d] * inv);
        s_y[m][d] = static_cast<float>(static_cast<T>(static_cast<float>(nwt[d]) * static_cast<float>(nv)));
#endif
      }
      __syncwarp();
      T* dst;
      if (kind == 0) {
        dst = yq + (((size_t)b * L + l) * H + head) * D;
      } else {
        dst = const_cast<T*>(kc) + (((size_t)b * HKV + head) * S + pos) * D;
      }
      constexpr int HALF = D / 2;
      for (int i = lane; i < HALF; i += 32) {
#if ROPE_FREQS
        float inv_freq = static_cast<float>(1.0 / static_cast<double>(rf[i]));
#else
        float dd = static_cast<float>(i) / static_cast<float>(HALF);
        float inv_freq = exp2f(-dd * rb[0]);
#endif
        float theta = rb[1] * static_cast<float>(pos) * inv_freq;
        float cs = cosf(theta), sn = sinf(theta);
#if ROPE_TRAD
        const int i1 = 2 * i, i2 = 2 * i + 1;
#else
        const int i1 = i, i2 = i + HALF;
#endif
        float x1 = s_y[m][i1], x2 = s_y[m][i2];
        dst[i1] = static_cast<T>(x1 * cs - x2 * sn);
        dst[i2] = static_cast<T>(x1 * sn + x2 * cs);
      }
    }
  } else {
    for (int m = warp; m < M; m += NW) {
      const int b = m / L, l = m % L;
      T* dst = const_cast<T*>(vc) + (((size_t)b * HKV + head) * S + pos0 + l) * D;
      for (int d = lane; d < D; d += 32) dst[d] = static_cast<T>(s_y[m][d]);
    }
  }
#endif
