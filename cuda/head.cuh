// One head's epilogue of a QKV projection, for MV activation rows from row0 (b = row / L, l = row % L):
// q/k RMSNorm (HAS_QKNORM, eps QEPS / KEPS) + RoPE at position off[0] + l (LEFT_PAD: minus lp[b]),
// with stock's rounding points (projection -> T, norm -> T, weight mul -> T, rope in fp32 with
// precise cos/sin -> T). q goes to yq [B, L, H, D]; k and v are written IN PLACE into the cache
// buffers kc/vc [B, Hkv, S, D] (by strides; last axis contiguous) at position off[0] + l (through a
// const_cast: MLX never sees the write; later readers are ordered after it through their use of yq).
// KV_BITS (a quantised cache, mlx-lm's QuantizedKVCache layout): k and v are quantised as
// mx.quantize does (kv_quantize.cuh) into k_w/k_s/k_b and v_w/v_s/v_b [B, Hkv, S, D * KV_BITS / 32
// or D / KV_GS] at position off[0] + l, instead of kc/vc.
// Included by qkv_head.cuh (gemv.cu, gemv_mma.cu) and qmm.cu (EPI 3). In scope: hb (the head over
// q, k, v heads), warp, lane, row0, M (rows of the shared buffer), MV (the rows that exist, at most
// M), head_in(m, d) (row row0 + m's projection output at column hb * D + d, as a float), and the
// defines and inputs named above.
  __shared__ float s_y[M][D];
  for (int e = threadIdx.x; e < MV * D; e += NW * 32) {
    const int m = e / D, d = e % D;
    s_y[m][d] = head_in(m, d);
  }
  __syncthreads();
  const int kind = hb < H ? 0 : (hb < H + HKV ? 1 : 2);   // q, k, v
  const int head = kind == 0 ? hb : (kind == 1 ? hb - H : hb - H - HKV);
  const int pos0 = off[0];
#ifdef KV_BITS
#include "kv_quantize.cuh"
  // where row (b, l) of kv head `head` goes in a packed cache array of strides st
  auto at = [&](const auto& st, int b, int l) { return b * st[0] + head * st[1] + (pos0 + l) * st[2]; };
#endif
  if (kind < 2) {
    // one warp per activation row: (norm) + rope
    for (int m = warp; m < MV; m += NW) {
      const int b = (row0 + m) / L, l = (row0 + m) % L;
#ifdef LEFT_PAD
      const int pos = pos0 + l - lp[b];   // RoPE at the row's own position (its cache offset)
#else
      const int pos = pos0 + l;
#endif
#if HAS_QKNORM
      {
        float ssq = 0.f;
        for (int d = lane; d < D; d += 32) ssq += s_y[m][d] * s_y[m][d];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
        const float inv = rsqrtf(ssq / D + (kind == 0 ? QEPS : KEPS));
        const T* nwt = kind == 0 ? qn : kn;
        __syncwarp();
        for (int d = lane; d < D; d += 32) {
          const T nv = static_cast<T>(s_y[m][d] * inv);
          s_y[m][d] = static_cast<float>(static_cast<T>(static_cast<float>(nwt[d]) * static_cast<float>(nv)));
        }
        __syncwarp();
      }
#endif
      T* dst;
      if (kind == 0) {
        dst = yq + (((size_t)b * L + l) * H + head) * D;
      } else {
#ifdef KV_BITS
        dst = nullptr;   // k is quantised from s_y below
#else
#ifdef LEFT_PAD
        dst = const_cast<T*>(kc) + b * kc_strides[0] + head * kc_strides[1] + (pos0 + l) * kc_strides[2];
#else
        dst = const_cast<T*>(kc) + b * kc_strides[0] + head * kc_strides[1] + pos * kc_strides[2];
#endif
#endif
      }
      constexpr int HALF = D / 2;
      for (int i = lane; i < HALF; i += 32) {
#if ROPE_FREQS
        const float inv_freq = static_cast<float>(1.0 / static_cast<double>(rf[i]));
#else
        const float dd = static_cast<float>(i) / static_cast<float>(HALF);
        const float inv_freq = exp2f(-dd * ROPE_LOG2_BASE);
#endif
        const float theta = ROPE_SCALE * static_cast<float>(pos) * inv_freq;
        const float cs = cosf(theta), sn = sinf(theta);
#if ROPE_TRAD
        const int i1 = 2 * i, i2 = 2 * i + 1;
#else
        const int i1 = i, i2 = i + HALF;
#endif
        const float x1 = s_y[m][i1], x2 = s_y[m][i2];
        const T r1 = static_cast<T>(x1 * cs - x2 * sn), r2 = static_cast<T>(x1 * sn + x2 * cs);
#ifdef KV_BITS
        if (kind == 1) {   // each lane rewrites only the pair it read
          s_y[m][i1] = static_cast<float>(r1);
          s_y[m][i2] = static_cast<float>(r2);
          continue;
        }
#endif
        dst[i1] = r1;
        dst[i2] = r2;
      }
#ifdef KV_BITS
      if (kind == 1) {
        __syncwarp();
        kv_quantize_row(s_y[m], const_cast<uint32_t*>(k_w) + at(k_w_strides, b, l),
                        const_cast<T*>(k_s) + at(k_s_strides, b, l), const_cast<T*>(k_b) + at(k_b_strides, b, l));
      }
#endif
    }
  } else {
#ifdef KV_BITS
    for (int m = warp; m < MV; m += NW) {
      const int b = (row0 + m) / L, l = (row0 + m) % L;
      kv_quantize_row(s_y[m], const_cast<uint32_t*>(v_w) + at(v_w_strides, b, l),
                      const_cast<T*>(v_s) + at(v_s_strides, b, l), const_cast<T*>(v_b) + at(v_b_strides, b, l));
    }
#else
    for (int e = threadIdx.x; e < MV * D; e += NW * 32) {
      const int m = e / D, d = e % D;
      const int b = (row0 + m) / L, l = (row0 + m) % L;
      const_cast<T*>(vc)[b * vc_strides[0] + head * vc_strides[1] + (pos0 + l) * vc_strides[2] + d] =
          static_cast<T>(s_y[m][d]);
    }
#endif
  }
