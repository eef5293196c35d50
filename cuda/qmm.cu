// Quantised matmul on tensor cores for up to 64 activation rows (batched decode, speculative
// verification, short prompts): mma.sync m16n8k16, weights dequantised in registers.
//
//   y[m, n] = sum_k x[m, k] * w(n, k),   w(n, k) = T(s[n, k / GS] * q(n, k) + b[n, k / GS])
//
// The weight is the mma's A operand (16 output rows x 16 k), x^T its B operand (16 k x 8 tokens),
// so a 16-row weight fragment, dequantised once, serves every 8-token tile of the block (up to
// 16 tokens: more tokens are more blocks, each dequantising again, to keep the registers of two
// tiles and the occupancy they allow). The order of k inside an mma is free as long
// as A and B agree, so each lane loads one 16-byte word run per weight row per chunk (4 lanes
// cover a row's 64 contiguous bytes: KC = 128 4-bit / 64 8-bit k) and feeds k-slots {2c, 2c+1,
// 2c+8, 2c+9} of step j from its own k = c*EPT + 4j .. 4j+3; its x fragment is the same four k of
// its token (one 8-byte load). A lane's EPT k lie inside one quantisation group (GS >= 32).
//
// A block is NW warps on the same 32 weight rows (EPI 2: 16 gate rows and the 16 matching up
// rows), splitting the K chunks between them (warp w takes chunks w, w + NW, ...), and 8*MT
// tokens (blockIdx.x picks the token tile, blockIdx.y the weight rows: the token tiles of the same
// weight rows run side by side, so all but the first read the weights from L2); the warps' fp32
// partials are added in shared memory.
// The next chunk's weights, scales and biases are loaded before the current chunk is used.
// Rows past N and tokens past M are clamped for loads and never stored.
//
// Epilogues (EPI), the stock rounding points:
//   0 plain    y[m, n] = T(acc)                 (+ bias: T(T(acc) + bias[n]))
//   1 residual y[m, n] = T(res[m, n] + T(acc))  (o_proj / down_proj + the residual add)
//   2 swiglu   y[m, j] = T(T(T(g) * T(sigmoid(g))) * T(acc_up)), g = T(acc_gate), gate row j, up row j + N/2
//   3 QKV head ys[m, n] = float(EPI 0's y), then the block that completes a head (atomic ticket per
//              token block and head: D / 32 weight blocks a head) runs head.cuh over the block's
//              tokens: q/k RMSNorm + RoPE, q to yq, k/v written into the cache in place
// EPI 1 with NORM_EPS (the next RMSNorm): also yn[m, n] = T(nw[n] * T(y[m, n] * rsqrt(mean_n y[m, n]^2
//              + NORM_EPS))), by the block that completes the token block's rows (atomic ticket per
//              token block over the gridDim.y weight blocks): mx.fast.rms_norm's rounding points
//
// Defines: T, BITS (4/8), GS (32/64/128), MT (token tiles of 8 per block), NW, EPI, HAS_BIAS,
// [NORM_EPS]; EPI 3: head.cuh's (L, H, HKV, D, ...).
// Inputs: x [M, K] (K a multiple of KC), w [N, K*BITS/32] uint32, sc / bi [N, K/GS], [bias [N]],
// [res [M, N] (EPI 1)], [nw [N], cnt (NORM_EPS)]; EPI 3: head.cuh's inputs, then cnt. Tickets cnt
// zero (left zero).
// Output: y [M, N] (EPI 2: [M, N/2]), [yn [M, N] (NORM_EPS)]; EPI 3: ys [M, N] float32 (scratch),
// yq [B, L, H, D].

  constexpr int EPT = BITS == 4 ? 32 : 16;   // k per lane per chunk: one uint4 per weight row
  constexpr int KC = 4 * EPT;
  constexpr int FB = EPI == 2 ? 16 : 32;     // output rows per block
  const int M = x_shape[0], K = x_shape[1], N = w_shape[0];
  const int NOUT = EPI == 2 ? N / 2 : N;
  const int KW = K * BITS / 32, KG = K / GS, nchunk = K / KC;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int m0 = blockIdx.x * 8 * MT;

  auto mma = [](float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#ifdef __CUDA_ARCH__
#if MMA_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
#else
    ::cuemu::mma_m16n8k16<T>(d, a, b);
#endif
  };
  // Weights to the mma's T pairs. 4-bit: one mask-and-or puts nibbles i and i + 4 of a word under
  // the exponent of OFF (128 bf16 / 1024 f16: OFF + q exactly), then two packed FMAs make
  // T(s * q + b) (the first subtracts OFF exactly): 1 instruction per weight plus the shifts. So a
  // register pairs k and k + 4, and x's pairs are permuted to match (__byte_perm). 8-bit: floats.
#if MMA_BF16
  constexpr unsigned MAGIC = 0x43004300u, ONE2 = 0x3F803F80u, NEG_OFF2 = 0xC300C300u;
#else
  constexpr unsigned MAGIC = 0x64006400u, ONE2 = 0x3C003C00u, NEG_OFF2 = 0xE400E400u;
#endif
  auto fma2 = [](unsigned a, unsigned b, unsigned c) {
#ifdef __CUDA_ARCH__
    unsigned d;
#if MMA_BF16
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
    return d;
#else
    return ::cuemu::fma2<T>(a, b, c);
#endif
  };
  auto bits2 = [](T v) {   // (v, v) as one register
    const unsigned u = *reinterpret_cast<const unsigned short*>(&v);
    return u | (u << 16);
  };
  auto nibbles = [&](unsigned word, int i, unsigned s2, unsigned b2) {   // T(s q + b) of nibbles i, i + 4
    return fma2(fma2(((word >> (4 * i)) & 0x000F000Fu) | MAGIC, ONE2, NEG_OFF2), s2, b2);
  };
  auto bytes = [](unsigned word, int i, unsigned s2, unsigned b2) {       // bytes i, i + 1
    const float s = static_cast<float>(*reinterpret_cast<const T*>(&s2));
    const float b = static_cast<float>(*reinterpret_cast<const T*>(&b2));
    const T lo = static_cast<T>(fmaf(s, static_cast<float>((word >> (8 * i)) & 255u), b));
    const T hi = static_cast<T>(fmaf(s, static_cast<float>((word >> (8 * i + 8)) & 255u), b));
    return static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(&lo)) |
           (static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(&hi)) << 16);
  };

  // This lane's weight rows: tile r (0, 1), half h (rows g, g + 8 of the tile).
  int wrow[2][2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int local = g + 8 * h;
      wrow[r][h] = EPI == 2 ? min(blockIdx.y * 16 + local, NOUT - 1) + r * NOUT
                            : min(blockIdx.y * 32 + r * 16 + local, N - 1);
    }
  const T* xrow[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) xrow[t] = x + (size_t)min(m0 + t * 8 + g, M - 1) * K + c * EPT;

  unsigned q[2][2][4], nq[2][2][4], s2[2][2], b2[2][2], ns2[2][2], nb2[2][2];
  auto load = [&](int ch, unsigned (&dq)[2][2][4], unsigned (&ds)[2][2], unsigned (&db)[2][2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(w + (size_t)wrow[r][h] * KW) + ch * 4 + c);
        dq[r][h][0] = v.x; dq[r][h][1] = v.y; dq[r][h][2] = v.z; dq[r][h][3] = v.w;
        const size_t gi = (size_t)wrow[r][h] * KG + (ch * KC + c * EPT) / GS;
        ds[r][h] = bits2(sc[gi]);
        db[r][h] = bits2(bi[gi]);
      }
  };

  float acc[2][MT][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][t][e] = 0.0f;

  if (warp < nchunk) load(warp, q, s2, b2);
  for (int ch = warp; ch < nchunk; ch += NW) {
    if (ch + NW < nchunk) load(ch + NW, nq, ns2, nb2);
#if BITS == 4
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
      // Word wi: k = c*32 + 8wi .. +7 of the chunk, two mma steps: nibble pairs (0,4), (1,5) then (2,6), (3,7).
      unsigned xv[MT][4];
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(xrow[t] + ch * KC + 8 * wi));
        xv[t][0] = v.x; xv[t][1] = v.y; xv[t][2] = v.z; xv[t][3] = v.w;
      }
#pragma unroll
      for (int hs = 0; hs < 2; ++hs) {
        unsigned a[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          a[r][0] = nibbles(q[r][0][wi], 2 * hs, s2[r][0], b2[r][0]);
          a[r][1] = nibbles(q[r][1][wi], 2 * hs, s2[r][1], b2[r][1]);
          a[r][2] = nibbles(q[r][0][wi], 2 * hs + 1, s2[r][0], b2[r][0]);
          a[r][3] = nibbles(q[r][1][wi], 2 * hs + 1, s2[r][1], b2[r][1]);
        }
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const unsigned bf[2] = {__byte_perm(xv[t][hs], xv[t][hs + 2], 0x5410),
                                  __byte_perm(xv[t][hs], xv[t][hs + 2], 0x7632)};
          mma(acc[0][t], a[0], bf);
          mma(acc[1][t], a[1], bf);
        }
      }
    }
#else
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // Word j: k = c*16 + 4j .. +3 of the chunk, one mma step of byte pairs (0,1), (2,3).
      unsigned a[2][4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        a[r][0] = bytes(q[r][0][j], 0, s2[r][0], b2[r][0]);
        a[r][1] = bytes(q[r][1][j], 0, s2[r][1], b2[r][1]);
        a[r][2] = bytes(q[r][0][j], 2, s2[r][0], b2[r][0]);
        a[r][3] = bytes(q[r][1][j], 2, s2[r][1], b2[r][1]);
      }
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(xrow[t] + ch * KC + 4 * j));
        const unsigned bf[2] = {v.x, v.y};
        mma(acc[0][t], a[0], bf);
        mma(acc[1][t], a[1], bf);
      }
    }
#endif
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        s2[r][h] = ns2[r][h];
        b2[r][h] = nb2[r][h];
#pragma unroll
        for (int i = 0; i < 4; ++i) q[r][h][i] = nq[r][h][i];
      }
  }

  // The warps' partials: red[warp][row of the block][token of the tile].
  __shared__ float red[NW][32][8 * MT];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][r * 16 + g + 8 * (e >> 1)][t * 8 + 2 * c + (e & 1)] = acc[r][t][e];
  __syncthreads();
  for (int o = threadIdx.x; o < FB * 8 * MT; o += NW * 32) {
    const int fl = o % FB, tl = o / FB, m = m0 + tl;
    float v = 0.0f;
#pragma unroll
    for (int i = 0; i < NW; ++i) v += red[i][fl][tl];
#if EPI == 2
    const int n = blockIdx.y * 16 + fl;
    if (m >= M || n >= NOUT) continue;
    float up = 0.0f;
#pragma unroll
    for (int i = 0; i < NW; ++i) up += red[i][16 + fl][tl];
    const float gt = static_cast<float>(static_cast<T>(v));
    const float sg = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-gt))));
    const float act = static_cast<float>(static_cast<T>(gt * sg));
    y[(size_t)m * NOUT + n] = static_cast<T>(act * static_cast<float>(static_cast<T>(up)));
#else
    const int n = blockIdx.y * 32 + fl;
    if (m >= M || n >= N) continue;
    T out = static_cast<T>(v);
#if HAS_BIAS
    out = static_cast<T>(static_cast<float>(out) + static_cast<float>(bias[n]));
#endif
#if EPI == 1
    out = static_cast<T>(static_cast<float>(res[(size_t)m * N + n]) + static_cast<float>(out));
#endif
#if EPI == 3
    ys[(size_t)m * N + n] = static_cast<float>(out);
#else
    y[(size_t)m * N + n] = out;
#endif
#endif
  }

#if defined(NORM_EPS) || EPI == 3
  // ---- epilogues of the block that completes a set of blocks: an atomic ticket each set ----
#if EPI == 3
  // the head hb of these tokens: D / 32 weight blocks
  const int hb = blockIdx.y * 32 / D, ticket = blockIdx.x * (H + 2 * HKV) + hb, arrivals = D / 32;
#else
  // these tokens' rows: every weight block
  const int ticket = blockIdx.x, arrivals = gridDim.y;
#endif
#include "last_block.cuh"
#endif
#ifdef NORM_EPS
  // ---- the rows RMS-normalised: a warp a row; each lane's 16-byte words of it in chunks of CH,
  // a chunk's loads issued together (L2 round trips, not one per word, are this tail's time) ----
  constexpr int V = 16 / (int)sizeof(T), CH = 8;   // N is a multiple of 32: rows of whole 16-byte words
  const int words = N / V;
  for (int m = m0 + warp; m < min(m0 + 8 * MT, M); m += NW) {
    const uint4* row = reinterpret_cast<const uint4*>(y + (size_t)m * N);
    float ss = 0.f;
    for (int i0 = 0; i0 < words; i0 += 32 * CH) {
      uint4 r[CH];
#pragma unroll
      for (int j = 0; j < CH; ++j) r[j] = __ldcg(row + min(i0 + j * 32 + lane, words - 1));
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        if (i0 + j * 32 + lane >= words) break;
        const T* v = reinterpret_cast<const T*>(&r[j]);
#pragma unroll
        for (int e = 0; e < V; ++e) ss += static_cast<float>(v[e]) * static_cast<float>(v[e]);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = rsqrtf(ss / N + NORM_EPS);
    for (int i0 = 0; i0 < words; i0 += 32 * CH) {
      uint4 r[CH], wn[CH];
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const int i = min(i0 + j * 32 + lane, words - 1);
        r[j] = __ldcg(row + i);
        wn[j] = reinterpret_cast<const uint4*>(nw)[i];
      }
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const int i = i0 + j * 32 + lane;
        if (i >= words) break;
        T* v = reinterpret_cast<T*>(&r[j]);
        const T* g = reinterpret_cast<const T*>(&wn[j]);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const T nv = static_cast<T>(static_cast<float>(v[e]) * inv);
          v[e] = static_cast<T>(static_cast<float>(g[e]) * static_cast<float>(nv));
        }
        reinterpret_cast<uint4*>(yn + (size_t)m * N)[i] = r[j];
      }
    }
  }
#endif
#if EPI == 3
  // ---- the head epilogue over these tokens ----
  const int row0 = m0, MV = min(8 * MT, M - m0);
  {
    constexpr int M = 8 * MT;   // head.cuh's rows (MV of them exist)
    auto head_in = [&](int m, int d) { return __ldcg(ys + (size_t)(row0 + m) * N + hb * D + d); };
#include "head.cuh"
  }
#endif
