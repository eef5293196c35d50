// Quantised GEMV family for decode (1-8 activation rows), MLX affine format, one launch per op.
//
//   w(n, k) = s[n, g] * q(n, k) + b[n, g],  g = k / GS,  q = BITS-bit unsigned (LSB-first packing)
//   acc[m, n] = sum_g ( s[n,g] * sum_{k in g} x[m,k] q(n,k)  +  b[n,g] * sum_{k in g} x[m,k] )
//
// Deferred dequantisation, fp32 accumulation. One warp owns R output rows (gate/up: R gate rows
// and the R matching up rows) and NW warps form a block, so even a 1024-row projection launches
// hundreds of blocks: a decode GEMV is latency-bound, and short per-warp chains are what makes it
// fast. Each lane owns EPW consecutive k (VEC uint32 words, one 16/8/4-byte load per row) inside
// one quantisation group, so its partial of the group's x-sum is exact. The weights of the next
// k-step are loaded before the current one is used (two steps in flight), and the first step's
// weights are loaded before the input-norm prologue, so DRAM latency overlaps the prologue.
//
// 4-bit weights to floats: one byte permute per nibble makes f = 0.5 + q/32 (the nibble in
// mantissa bits 19-22 under exponent 126); the lane-step's sum x*q = 32 * sum x*f - 16 * sum x uses
// the x-sum the bias term needs anyway (a 1-bit cancellation at most), one instruction per weight
// fewer than 2^23 + q minus 2^23 (how 8-bit weights become floats).
//
// Optional input RMSNorm (HAS_NORM): x <- T(T(x * rsqrt(mean(x^2) + eps)) * nw), exactly the
// rounding points of mx.fast.rms_norm, computed per block (every block reads all of x anyway).
//
// Staged x (XK = K, a define, where it fits): the block converts (and normalizes) x once into its
// dynamic shared memory (the wrapper's x_stage_bytes), with each lane-step's x-sum; otherwise
// every warp converts (and normalizes) its lanes' slices at every k-step: NW times per block, at 2
// (with the norm ~9) instructions per element, as many as the dot products of 1 (4) weight rows.
// Staged as floats where M * K floats fit in 16 KB (x preloaded into registers, one round trip),
// else from 2 rows on (XT, up to the wrapper's STAGE_MAX_BYTES with the sums) as T values, half the
// bytes, converted at each k-step: every normalized element is a T already (the norm's last
// rounding). Same values and summation order every way.
//
// Epilogues (EPI):
//   0 plain      y[m, n] = T(acc)                     (+ bias: T(T(acc) + bias[n]))
//   1 residual   y[m, n] = T(res[m, n] + T(acc))      (o_proj / down_proj + residual add)
//   2 swiglu     y[m, j] = T(T(silu(T(acc_gate))) * T(acc_up)), gate row j, up row j + NOUT
//   3 head       fused QKV with per-head work: each block computes NW*R rows (a slice of one
//                head) for every activation row into the scratch output ys [M, N] (T-rounded,
//                + bias), then takes a ticket on cnt[head]; the block that completes a head does
//                its epilogue: q/k RMSNorm (HAS_QKNORM, eps QEPS / KEPS) + RoPE (stock rounding:
//                GEMV out -> T, norm -> T, weight mul -> T, rope in fp32 with precise cos/sin ->
//                T). q goes to yq [B, L, H, D]; k and v are written IN PLACE into the cache
//                buffers kc/vc [B, Hkv, S, D] (by strides; last axis contiguous) at position
//                off[0] + l (inputs written through a
//                const_cast: MLX never sees the write; later readers are ordered after this
//                launch through their use of yq). The completing block resets its ticket to 0.
//                LEFT_PAD (a batch cache: rows left-padded by lp[b], one write index off[0]):
//                the cache write stays at off[0] + l, RoPE takes row b's position off[0] + l - lp[b].
//
// Row groups in turn (STREAM, a fused launch's EPI 0-2 phases): the phase launches STREAM blocks and
// block b runs row groups b, b + STREAM, ... (each as a block of its own would), sending the next
// group's rows to L2 before it starts the current one; the prologue (norm, staged x) runs once.
//
// Defines set by the wrapper: T, BLOCK_X (blockIdx.x, or the block's index within its phase of a
// fused launch), [WAIT_INPUTS (a fused launch: the wait for the earlier phases)], [NO_EARLY_PREFETCH
// (no rows to L2 before WAIT_INPUTS)], [PHASE_MARKS (layer.cuh's marks)], BITS, GS, M, R, NW, VEC,
// EPI, XK, XT, HAS_NORM (+ EPS), HAS_BIAS, STREAM (0: one row group per block), and for EPI 3: L
// (tokens), H, HKV, D, HAS_QKNORM (+ QEPS, KEPS), ROPE_TRAD, ROPE_FREQS, ROPE_LOG2_BASE, ROPE_SCALE,
// [LEFT_PAD]. Model constants are defines, not inputs: MLX keeps arrays of 8 bytes or less in a
// small managed-memory pool that the host writes too, and reading one from a kernel can fault.
//
// Inputs (names): x, w, sc, bi, [nw], [bias], [res], EPI 3: [qn, kn], off, [lp], [rf], kc, vc, cnt.
// Outputs: y, or for EPI 3: yq, ys

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
  // The block's row group (NW * R output rows); with STREAM, groups BLOCK_X, + STREAM, ... in turn.
  int vb = BLOCK_X;
  auto group_rows = [&](int g, int* rows) {
#pragma unroll
    for (int r = 0; r < RR; ++r) {
      const int lr = (g * NW + warp) * R + (r % R);
      const int n = (EPI == 2 && r >= R) ? lr + NOUT : lr;
      rows[r] = lr < NOUT ? n : 0;   // rows past the end read row 0 and are not stored
    }
  };
  int wrow[RR];
  group_rows(vb, wrow);

  // One k-step's weights, scales and biases of the warp's rows. Two of them in turn (ping-pong):
  // the next step loads into one while the other is used, without copying registers.
  struct WStep { uint32_t w[RR][VEC]; float s[RR], b[RR]; };
  WStep wa, wb;
  auto load_w = [&](WStep& d, int k0) {
    const int g = k0 / GS;
#pragma unroll
    for (int r = 0; r < RR; ++r) {
      const uint32_t* p = w + (uint32_t)(wrow[r] * KW + (k0 * BITS) / 32);   // 32-bit offsets: the row terms stay in registers
      if constexpr (VEC == 4) {
        const uint4 t = __ldg(reinterpret_cast<const uint4*>(p));
        d.w[r][0] = t.x; d.w[r][1] = t.y; d.w[r][2] = t.z; d.w[r][3] = t.w;
      } else if constexpr (VEC == 2) {
        const uint2 t = __ldg(reinterpret_cast<const uint2*>(p));
        d.w[r][0] = t.x; d.w[r][1] = t.y;
      } else {
        d.w[r][0] = __ldg(p);
      }
      d.s[r] = static_cast<float>(sc[(uint32_t)(wrow[r] * NG + g)]);
      d.b[r] = static_cast<float>(bi[(uint32_t)(wrow[r] * NG + g)]);
    }
  };
  if (lane * EPW < K) load_w(wa, lane * EPW);
#if (defined(WAIT_INPUTS) && !defined(NO_EARLY_PREFETCH)) || STREAM
  // Rows (weights, scales, biases) sent on to L2 ahead of their loads.
  auto prefetch_rows = [&](const int* rows) {
#pragma unroll
    for (int r = 0; r < RR; ++r) {
      for (int i = lane * 32; i < KW; i += 32 * 32) prefetch_l2(w + (size_t)rows[r] * KW + i);
      if (lane == 0) {
        prefetch_l2(sc + (size_t)rows[r] * NG);
        prefetch_l2(bi + (size_t)rows[r] * NG);
      }
    }
  };
#endif
#ifdef WAIT_INPUTS
  // A phase of the one-launch layer: the weights do not depend on the
  // earlier phases, so this warp's rows (and their scales/biases) are sent on to L2 before the
  // block waits for its inputs (not where NO_EARLY_PREFETCH: layer.py says why). Nothing above
  // reads x, res or any earlier phase's output.
#ifndef NO_EARLY_PREFETCH
  prefetch_rows(wrow);
#endif
  WAIT_INPUTS;
#endif

#if XK
  static_assert(sizeof(T) == 2, "x is staged for 2-byte types (4 elements per 8-byte load)");
  constexpr int NCH = XK / EPW;                               // chunks (lane-steps) per row
#if !XT
  // Staged as floats: this thread's chunks of x (and nw) are loaded first (at most 32 elements
  // each: M * XK <= 32 * 128), beside the norm's sum-of-squares loads, whose loop then has a
  // compile-time bound: one round trip.
  constexpr int CPT = (M * NCH + NW * 32 - 1) / (NW * 32);    // chunks per thread
  uint2 cx[CPT][EPW / 4];
#if HAS_NORM
  uint2 cn[CPT][EPW / 4];
#endif
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = threadIdx.x + i * NW * 32;
    if (c < M * NCH) {
      const int m = c / NCH, ch = c % NCH;
#pragma unroll
      for (int j = 0; j < EPW / 4; ++j) {
        cx[i][j] = *reinterpret_cast<const uint2*>(x + (size_t)m * XK + ch * EPW + 4 * j);
#if HAS_NORM
        cn[i][j] = *reinterpret_cast<const uint2*>(nw + ch * EPW + 4 * j);
#endif
      }
    }
  }
#endif
  constexpr int KN = XK;
#else
  const int KN = K;
#endif
#if HAS_NORM
#include "row_norm.cuh"
#endif
#if XK
  // Stage x (normalized): chunk ch (EPW elements, one lane-step) of row m is stored as EPW/4
  // float4s s_x4[(m * EPW/4 + j) * NCH + ch] (XT: 4 T values s_xt[...], 8 bytes), so lanes reading
  // consecutive chunks hit consecutive bytes (no bank conflicts), and its sum in s_xsum[m * NCH + ch].
  extern __shared__ float4 s_stage[];   // dynamic: one buffer whichever phase a block runs
#if XT
  uint2* const s_xt = reinterpret_cast<uint2*>(s_stage);
#else
  float4* const s_x4 = s_stage;
#endif
  float* const s_xsum = reinterpret_cast<float*>(s_stage) + (XT ? M * XK / 2 : M * XK);
  // chunk c from its 4-element words of x (and nw)
  auto stage_chunk = [&](int c, int m, int ch, const uint2* wx, const uint2* wn) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < EPW / 4; ++j) {
      alignas(8) T tmp[4];
      *reinterpret_cast<uint2*>(tmp) = wx[j];
#if HAS_NORM
      alignas(8) T nwt[4];
      *reinterpret_cast<uint2*>(nwt) = wn[j];
#endif
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
#if HAS_NORM
        const T nv = static_cast<T>(static_cast<float>(tmp[e]) * s_inv[m]);
        tmp[e] = static_cast<T>(static_cast<float>(nwt[e]) * static_cast<float>(nv));
#endif
        v[e] = static_cast<float>(tmp[e]);
        sum += v[e];
      }
#if XT
      s_xt[(m * (EPW / 4) + j) * NCH + ch] = *reinterpret_cast<const uint2*>(tmp);
#else
      s_x4[(m * (EPW / 4) + j) * NCH + ch] = make_float4(v[0], v[1], v[2], v[3]);
#endif
    }
    s_xsum[c] = sum;
  };
#if XT
  for (int c = threadIdx.x; c < M * NCH; c += NW * 32) {
    const int m = c / NCH, ch = c % NCH;
    uint2 wx[EPW / 4], wn[EPW / 4];
#pragma unroll
    for (int j = 0; j < EPW / 4; ++j) {
      wx[j] = *reinterpret_cast<const uint2*>(x + (size_t)m * XK + ch * EPW + 4 * j);
#if HAS_NORM
      wn[j] = *reinterpret_cast<const uint2*>(nw + ch * EPW + 4 * j);
#endif
    }
    stage_chunk(c, m, ch, wx, wn);
  }
#else
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = threadIdx.x + i * NW * 32;
#if HAS_NORM
    if (c < M * NCH) stage_chunk(c, c / NCH, c % NCH, cx[i], cn[i]);
#else
    if (c < M * NCH) stage_chunk(c, c / NCH, c % NCH, cx[i], nullptr);
#endif
  }
#endif
  __syncthreads();
#endif
#ifdef PHASE_MARKS
  layer_mark(stamps, 1);
#endif

  for (;;) {   // row groups
#if STREAM
    // the next row group's rows go to L2 while this one runs (its loads then hit L2)
    if (vb + STREAM < (NOUT + NW * R - 1) / (NW * R)) {
      int next[RR];
      group_rows(vb + STREAM, next);
      prefetch_rows(next);
    }
#endif
    const int row0 = (vb * NW + warp) * R;
    float acc[RR][M];
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

    auto step = [&](const WStep& cur, int k0) {

      // One word (WE k) of every weight row at a time, with x of those k only: the registers of x
      // are M * WE, not M * EPW, whatever VEC. Per row and activation the products are added in k
      // order, as are the x-sums.
      constexpr int WE = BITS == 4 ? 8 : 4;   // k per uint32 word
      float sx[M];
      float d[RR][M];
#pragma unroll
      for (int m = 0; m < M; ++m) {
#if XK
        sx[m] = s_xsum[m * NCH + k0 / EPW];
#else
        sx[m] = 0.f;
#endif
#pragma unroll
        for (int r = 0; r < RR; ++r) d[r][m] = 0.f;
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float xf[M][WE];
#if XK
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const int ch = k0 / EPW;
#pragma unroll
          for (int jj = 0; jj < WE / 4; ++jj) {
            const int j = v * (WE / 4) + jj;   // the word's 4-element parts within the lane-step
#if XT
            alignas(8) T t4[4];
            *reinterpret_cast<uint2*>(t4) = s_xt[(m * (EPW / 4) + j) * NCH + ch];
#pragma unroll
            for (int e = 0; e < 4; ++e) xf[m][4 * jj + e] = static_cast<float>(t4[e]);
#else
            const float4 t = s_x4[(m * (EPW / 4) + j) * NCH + ch];
            xf[m][4 * jj] = t.x; xf[m][4 * jj + 1] = t.y; xf[m][4 * jj + 2] = t.z; xf[m][4 * jj + 3] = t.w;
#endif
          }
        }
#else
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const T* xp = x + (size_t)m * K + k0 + v * WE;
          constexpr int PER = 16 / (int)sizeof(T);
          constexpr int XV = PER < WE ? PER : WE;      // elements per x load
#pragma unroll
          for (int c = 0; c < WE; c += XV) {
            alignas(16) T tmp[XV];
#if HAS_NORM
            alignas(16) T nwt[XV];
#endif
            if constexpr (XV * sizeof(T) == 16) {
              *reinterpret_cast<uint4*>(tmp) = *reinterpret_cast<const uint4*>(xp + c);
#if HAS_NORM
              *reinterpret_cast<uint4*>(nwt) = *reinterpret_cast<const uint4*>(nw + k0 + v * WE + c);
#endif
            } else {
              *reinterpret_cast<uint2*>(tmp) = *reinterpret_cast<const uint2*>(xp + c);
#if HAS_NORM
              *reinterpret_cast<uint2*>(nwt) = *reinterpret_cast<const uint2*>(nw + k0 + v * WE + c);
#endif
            }
#pragma unroll
            for (int j = 0; j < XV; ++j) {
#if HAS_NORM
              const T nv = static_cast<T>(static_cast<float>(tmp[j]) * s_inv[m]);
              const float e = static_cast<float>(static_cast<T>(static_cast<float>(nwt[j]) * static_cast<float>(nv)));
#else
              const float e = static_cast<float>(tmp[j]);
#endif
              xf[m][c + j] = e;
              sx[m] += e;
            }
          }
        }
#endif
        // dot products: nibbles/bytes to fp32 by byte permutes into an exponent (see the top)
#pragma unroll
        for (int r = 0; r < RR; ++r) {
          const uint32_t wd = cur.w[r][v];
          if constexpr (BITS == 4) {
            const uint32_t lo = (wd << 3) & 0x78787878u;   // even elements, at bits 3-6 of each byte
            const uint32_t hi = (wd >> 1) & 0x78787878u;   // odd elements
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float q0 = __int_as_float(__byte_perm(lo, 0x3F000000u, 0x7044 + (j << 8)));
              const float q1 = __int_as_float(__byte_perm(hi, 0x3F000000u, 0x7044 + (j << 8)));
#pragma unroll
              for (int m = 0; m < M; ++m) {
                d[r][m] = fmaf(xf[m][2 * j], q0, d[r][m]);
                d[r][m] = fmaf(xf[m][2 * j + 1], q1, d[r][m]);
              }
            }
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float q0 = __int_as_float(__byte_perm(wd, 0x4B000000u, 0x7540 + j)) - 8388608.f;
#pragma unroll
              for (int m = 0; m < M; ++m) d[r][m] = fmaf(xf[m][j], q0, d[r][m]);
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < RR; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float dq = (BITS == 4) ? fmaf(32.f, d[r][m], -16.f * sx[m]) : d[r][m];
          acc[r][m] += cur.s[r] * dq + cur.b[r] * sx[m];
        }
    };
    for (int ks = 0; ks < K; ks += 2 * KSTEP) {   // two steps a turn, one per buffer
      int k0 = ks + lane * EPW;
      if (k0 >= K) break;   // only in the last, partial step; no collectives inside the loop
      if (k0 + KSTEP < K) load_w(wb, k0 + KSTEP);   // next step in flight
      step(wa, k0);
      k0 += KSTEP;
      if (k0 >= K) break;
      if (k0 + KSTEP < K) load_w(wa, k0 + KSTEP);
      step(wb, k0);
    }

    // ---- warp reduction; lane r*M + m stores (row r, activation m) ----
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float v = acc[r][m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        acc[r][m] = v;
      }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int n = row0 + r;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (lane != ((r * M + m) & 31) || n >= NOUT) continue;
#if EPI == 0
        T t = static_cast<T>(acc[r][m]);
#if HAS_BIAS
        t = static_cast<T>(static_cast<float>(t) + static_cast<float>(bias[n]));
#endif
        y[(size_t)m * NOUT + n] = t;
#elif EPI == 1
        const T t = static_cast<T>(acc[r][m]);
        y[(size_t)m * NOUT + n] = static_cast<T>(static_cast<float>(res[(size_t)m * NOUT + n]) + static_cast<float>(t));
#elif EPI == 2
        const float gt = static_cast<float>(static_cast<T>(acc[r][m]));
        const float ut = static_cast<float>(static_cast<T>(acc[r + R][m]));
        const float sg = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-gt))));
        const float a = static_cast<float>(static_cast<T>(gt * sg));
        y[(size_t)m * NOUT + n] = static_cast<T>(a * ut);
#else
        T t = static_cast<T>(acc[r][m]);
#if HAS_BIAS
        t = static_cast<T>(static_cast<float>(t) + static_cast<float>(bias[n]));
#endif
        ys[(size_t)m * N + n] = static_cast<float>(t);
#endif
      }
    }
#if STREAM
    vb += STREAM;
    if (vb >= (NOUT + NW * R - 1) / (NW * R)) break;
    group_rows(vb, wrow);
    if (lane * EPW < K) load_w(wa, lane * EPW);
#else
    break;
#endif
  }
#ifdef PHASE_MARKS
  layer_mark(stamps, 2);
#endif

#if EPI == 3
  static_assert(!STREAM, "a head's blocks are its row groups");
  constexpr int BR = NW * R;   // the block's rows: a slice of one head
#include "qkv_head.cuh"
#endif
