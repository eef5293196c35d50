// Quantised GEMV on tensor cores for decode (1-8 activation rows): 4-bit weights in groups of 64,
// MLX affine format, a phase of the one-launch layer (EPI 1-3, where gemv.py's mma_takes says so).
//
//   w(n, k) = s[n, g] * q(n, k) + b[n, g],  g = k / 64
//   acc[m, n] = sum_g ( s[n,g] * sum_{k in g} x[m,k] q(n,k)  +  b[n,g] * sum_{k in g} x[m,k] )
//
// Deferred dequantisation as in gemv.cu, but each group's sum x*q is an mma.sync m16n8k16 (fp32
// accumulation): the weights are the A operand (16 rows x 16 k), x the B operand (16 k x 8 tokens),
// so the work per weight does not grow with the rows (gemv.cu's FMA path: one FFMA per weight and
// row), and the instructions per weight at one row are about half of gemv.cu's.
//
// A tile is 16 weight rows (EPI 2: 8 gate rows and the 8 matching up rows; TILE8, EPI 1: 8 rows, the
// mma's rows 8-15 left to sums (below), for twice the tiles of a short phase); lane l holds rows l/4
// and l/4 + 8. A lane loads 8 bytes (16 nibbles) of each of its rows per group: the 4 lanes of a row
// read the group's 32 bytes. One mask-and-or per nibble pair makes T values E + q (nibbles i, i + 4
// of a word, i = 0..3, shifted down 4i bits: alike in every k-slot) under the exponent of E (128
// bf16, 1024 f16: exact). The order of k inside an mma is free as long as A and B agree, so x is
// staged in shared memory in the same order (a permutation of its values), and
//   sum_{k in g} x q = D - E * sum_{k in g} x,   acc += s * (D - E sum x) + b * sum x
// TILE8's mma rows 8-15 hold E (the A word MAGIC): their D is E * sum x of each activation row. So
// a TILE8 phase stages nothing: each lane loads its 8 values of x (row l/4) for a group's half
// straight from global memory and permutes them into the B registers; the others stage x and each
// group and row's sum x in fp32.
// The next chunk's weights, scales and biases load while the current one is used.
//
// K runs in slices of KS groups (all of K in TILE8 and where the staged x fits: gemv.py's mma_plan), each
// staged once per block: for each slice, the block runs its tiles (block b: tiles b, b + STREAM,
// ...; TILE_QUEUE: b, then the queue's; STREAM 0: tile b alone), its NW warps splitting the slice
// in chunks of 4 groups (128 bytes of a row). A warp adds its partial of a tile to its slot in
// shared memory (slices in order); after the last slice the slots of a tile are added in warp
// order, so the float arithmetic depends on KS but not on the blocking. A tile's rows go to L2
// while the one before runs (not a queued tile's: TILE_QUEUE below).
//
// Optional input RMSNorm (HAS_NORM, row_norm.cuh): x <- T(T(x * s_inv) * nw) as it is staged, the
// rounding points of mx.fast.rms_norm. Before WAIT_INPUTS (a phase of the one-launch layer) the
// first tile's first chunk goes into registers and, unless NO_EARLY_PREFETCH, its rows to L2:
// nothing read before it depends on the earlier phases.
//
// Epilogues (EPI): 1 residual y[m, n] = T(res[m, n] + T(acc)); 2 swiglu y[m, j] =
// T(T(silu(T(acc_gate))) * T(acc_up)), gate row j, up row j + N/2 (gemv.cu's rounding points);
// 3 head (QKV): ys[m, n] = float(T(acc)) (HAS_BIAS: float(T(T(acc) + bias[n])), gemv.cu's rounding), then
// the block that completes a head (D / 16 tiles, a block each: STREAM 0) runs head.cuh's epilogue, as
// gemv.cu's EPI 3 does.
// Defines: T (bf16 / f16), MMA_BF16, M (<= 8: the mma's n), NW, EPI, TILE8, HAS_NORM (+ EPS), KS, STREAM,
// TPB (sets of partials: the most tiles a block runs where K is sliced, else 1), BLOCK_X, [WAIT_INPUTS],
// [NO_EARLY_PREFETCH], [PHASE_MARKS], [TILE_QUEUE (STREAM, K in one slice: the offset of the phases'
// queues in WAIT_INPUTS' ctr)]; EPI 3: HAS_BIAS and head.cuh's (L, H, HKV, D, ...).
// KS, TPB and STREAM are planned for one K and N (gemv.py's mma_plan; builds are keyed on shapes).
// Inputs: x [M, K] (K a multiple of 256), w [N, K/8] uint32, sc / bi [N, K/64], [nw [K]], [bias [N]], [res [M, N]];
// EPI 3: head.cuh's inputs, then cnt (a ticket per head). Output: y [M, N] (EPI 2: [M, N/2]); EPI 3:
// yq (head.cuh) and ys [M, N] float32 (scratch). Dynamic shared memory: gemv.py's mma_stage_bytes.

#if MMA_BF16
  constexpr uint32_t MAGIC = 0x43004300u;
  constexpr float E = 128.f;
#else
  constexpr uint32_t MAGIC = 0x64006400u;
  constexpr float E = 1024.f;
#endif
  static_assert(M >= 1 && M <= 8, "gemv_mma.cu: the mma's n is 8 activation rows");
  static_assert(!(TILE8 && HAS_NORM), "gemv_mma.cu: the input norm is applied as x is staged");
  constexpr int TR = EPI == 2 || TILE8 ? 8 : 16;   // output rows per tile
  constexpr int SJ = 2;   // staging: items a thread loads before converting them
  constexpr int SC = KS / 4, CPW = (SC + NW - 1) / NW;   // chunks of a slice; of a warp in a slice
  const int N = w_shape[0], KW = w_shape[1], K = KW * 8, NG = K / 64, NC = NG / 4, NS = (NG + KS - 1) / KS;
  const int NOUT = EPI == 2 ? N / 2 : N;
  const int tiles = (NOUT + TR - 1) / TR;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t = lane & 3;
#if STREAM
  const int ntiles = (tiles - BLOCK_X + STREAM - 1) / STREAM;   // this block's tiles
#else
  const int ntiles = 1;
#endif

  int r0, r1;   // this lane's weight rows in the tile (past the end: the last row, not stored)
  int cb, ce;   // this warp's chunks of the slice
  auto item = [&](int tl, int sl) {   // tile tl, slice sl
    if (EPI == 2) { r0 = min(tl * 8 + g8, NOUT - 1); r1 = r0 + NOUT; }
    else { r0 = min(tl * TR + g8, N - 1); r1 = min(tl * TR + g8 + 8, N - 1); }   // TILE8: r1 unused
    cb = sl * SC + warp * CPW;
    ce = min(min(NC, (sl + 1) * SC), cb + CPW);
  };
  struct Chunk { uint2 a[4], b[4], s[4]; };   // rows r0 / r1: 4 groups' words; scales/biases of 4 groups
  auto load = [&](Chunk& k, int c) {
    const uint2* w0 = reinterpret_cast<const uint2*>(w + (size_t)r0 * KW) + t;
    const uint2* w1 = reinterpret_cast<const uint2*>(w + (size_t)r1 * KW) + t;
#pragma unroll
    for (int u = 0; u < 4; ++u) k.a[u] = __ldg(w0 + (4 * c + u) * 4);
    k.s[0] = __ldg(reinterpret_cast<const uint2*>(sc + (size_t)r0 * NG) + c);
    k.s[1] = __ldg(reinterpret_cast<const uint2*>(bi + (size_t)r0 * NG) + c);
    if (TILE8) return;
#pragma unroll
    for (int u = 0; u < 4; ++u) k.b[u] = __ldg(w1 + (4 * c + u) * 4);
    k.s[2] = __ldg(reinterpret_cast<const uint2*>(sc + (size_t)r1 * NG) + c);
    k.s[3] = __ldg(reinterpret_cast<const uint2*>(bi + (size_t)r1 * NG) + c);
  };
  auto prefetch_item = [&]() {   // this warp's chunks of rows r0, r1 (one 128-byte line per chunk)
    for (int c = cb + t; c < ce; c += 4) {
      prefetch_l2(w + (size_t)r0 * KW + 32 * c);
      if (!TILE8) prefetch_l2(w + (size_t)r1 * KW + 32 * c);
    }
    if (t == 0 && cb < ce) {
      prefetch_l2(sc + (size_t)r0 * NG + 4 * cb); prefetch_l2(bi + (size_t)r0 * NG + 4 * cb);
      if (!TILE8) { prefetch_l2(sc + (size_t)r1 * NG + 4 * cb); prefetch_l2(bi + (size_t)r1 * NG + 4 * cb); }
    }
  };
  Chunk ka, kb;   // ping-pong: the next chunk loads while this one is used
  item(BLOCK_X, 0);
  if (cb < ce) load(ka, cb);
#ifdef TILE_QUEUE
  // A block's tiles after its first come from the phase's queue (ctr[TILE_QUEUE + its group]):
  // thread 0 takes the next one as a tile starts and passes it on through s_queued at the tile's
  // barrier, so a block that runs faster (fewer blocks on its SM, an earlier entry) takes more of
  // them (the next tile's rows are not sent to L2 ahead: it is known only then). A tile's sums do
  // not depend on the block that runs it.
  static_assert(STREAM && TPB == 1 && !TILE8, "gemv_mma.cu: TILE_QUEUE takes a streamed phase, K in one slice");
  __shared__ int s_queued;
  int* const queue = const_cast<int*>(ctr) + TILE_QUEUE + wait_g + 1;
#endif
#ifdef WAIT_INPUTS
#ifndef NO_EARLY_PREFETCH
  prefetch_item();
#endif
  WAIT_INPUTS;
#endif

  // ---- shared memory: s_x [KS][2][M][4] uint4 (a slice's x: mma pairs (2h, 2h + 1) of group g,
  // row m, lane t), s_sx [KS][M] (sum x), both absent in TILE8, s_acc [TPB][NW][32] (the warps'
  // partials; one slice: one set) ----
  extern __shared__ float4 s_stage[];   // dynamic: one buffer whichever phase a block runs
  constexpr int XS = TILE8 ? 0 : KS;   // groups of x staged
  uint4* const s_x = reinterpret_cast<uint4*>(s_stage);
  float* const s_sx = reinterpret_cast<float*>(s_x + XS * 8 * M);
  float4 (*const s_acc)[NW][32] = reinterpret_cast<float4 (*)[NW][32]>(s_sx + XS * M);
  // The staging's loads of SJ items a thread (x, and the norm weight; item c: row m, group gi, lane tt)
  // into wd / nd. Up to 2 rows (STAGE_EARLY) the first slice's first step is issued before the row
  // norm's own loads of x, so the two wait for L2 together (as gemv.cu's staged x does); with more
  // rows the norm's loads of M rows need those registers (offline ptxas: 3 blocks per SM at 3-8 rows).
  constexpr bool STAGE_EARLY = !TILE8 && M <= 2;
  uint32_t wd[SJ][8];
#if HAS_NORM
  uint32_t nd[SJ][8];
#endif
  struct StageItem { int c, m, gl, tt; };   // item c of a slice of ng groups: row m, group gl, lane tt
  // (clamped: items past the slice load its last. Skipping those loads took the 4B layer from 128
  // to 161 registers, offline ptxas)
  auto stage_item = [&](int c0, int j, int ng) {
    const int c = c0 + j * NW * 32 + threadIdx.x;
    return StageItem{c, min((c >> 2) % M, M - 1), min((c >> 2) / M, ng - 1), c & 3};
  };
  auto stage_load = [&](int c0, int g0, int ng) {
#pragma unroll
    for (int j = 0; j < SJ; ++j) {
      const StageItem it = stage_item(c0, j, ng);
      const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)it.m * K + (g0 + it.gl) * 64 + it.tt * 16);
      const uint4 xa = xp[0], xb = xp[1];
      wd[j][0] = xa.x; wd[j][1] = xa.y; wd[j][2] = xa.z; wd[j][3] = xa.w;
      wd[j][4] = xb.x; wd[j][5] = xb.y; wd[j][6] = xb.z; wd[j][7] = xb.w;
#if HAS_NORM
      const uint4* np = reinterpret_cast<const uint4*>(nw + (g0 + it.gl) * 64 + it.tt * 16);
      const uint4 na = np[0], nb = np[1];
      nd[j][0] = na.x; nd[j][1] = na.y; nd[j][2] = na.z; nd[j][3] = na.w;
      nd[j][4] = nb.x; nd[j][5] = nb.y; nd[j][6] = nb.z; nd[j][7] = nb.w;
#endif
    }
  };
  if (STAGE_EARLY) stage_load(0, 0, min(KS, NG));   // (converted by stage_convert below)
#if HAS_NORM
  const int KN = K;
#include "row_norm.cuh"
#endif
  auto mma = [](float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef __CUDA_ARCH__
#if MMA_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
#else
    const uint32_t b[2] = {b0, b1};
    ::cuemu::mma_m16n8k16<T>(d, a, b);
#endif
  };
  auto lop = [](uint32_t a, uint32_t m) {   // (a & m) | MAGIC in one LOP3
#ifdef __CUDA_ARCH__
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(m), "r"(MAGIC));
    return d;
#else
    return (a & m) | MAGIC;
#endif
  };
  auto tval = [](uint32_t v, int hi) {   // T value hi (1) or lo (0) of a register, as float
    alignas(4) T h[2];
    *reinterpret_cast<uint32_t*>(h) = v;
    return static_cast<float>(h[hi]);
  };
#if HAS_NORM
  auto pack2 = [](float lo, float hi) {   // (T(lo), T(hi)) in one register
#ifdef __CUDA_ARCH__
    uint32_t d;
#if MMA_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#endif
    return d;
#else
    alignas(4) T h[2] = {static_cast<T>(lo), static_cast<T>(hi)};
    return *reinterpret_cast<const uint32_t*>(h);
#endif
  };
  // T(a * b) of both halves: the product of two T values is exact in fp32, so this rounds as
  // T(float(a) * float(b)) does
  auto mul2 = [](uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    uint32_t d;
#if MMA_BF16
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#endif
    return d;
#else
    return ::cuemu::fma2<T>(a, b, 0x80008000u);   // + -0: the product itself, signed zeros too
#endif
  };
#endif
  // B registers of an mma pair (2h, 2h + 1) from x's 4 words at k = 8h..8h+7 of a lane's 16 (k 2p,
  // 2p + 4 | 2p + 1, 2p + 5 for p = 0, 1): the k order of the A side's nibbles
  auto bfrag = [](uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
    return make_uint4(__byte_perm(w0, w2, 0x5410), __byte_perm(w0, w2, 0x7632),
                      __byte_perm(w1, w3, 0x5410), __byte_perm(w1, w3, 0x7632));
  };
  // lanes past the M rows compute on row M - 1's sums (TILE8: on zero columns) and are not stored
  const int m0 = min(2 * t, M - 1), m1 = min(2 * t + 1, M - 1);
  // The loaded step's items normalised, permuted and stored in the slice's x, with each group's sum
  auto stage_convert = [&](int c0, int ng) {
    const int items = ng * M * 4;
#pragma unroll
    for (int j = 0; j < SJ; ++j) {
      if (c0 + j * NW * 32 >= items) break;   // (uniform: no thread has an item past it)
      const StageItem it = stage_item(c0, j, ng);
      const int m = it.m, gl = it.gl, tt = it.tt;
#if HAS_NORM
#pragma unroll
      for (int i = 0; i < 8; ++i)   // T(T(x s_inv) nw), a pair at a time
        wd[j][i] = mul2(pack2(tval(wd[j][i], 0) * s_inv[m], tval(wd[j][i], 1) * s_inv[m]), nd[j][i]);
#endif
      float sx = 0.f;   // the group's sum over its 4 lanes (a quad: tt = lane & 3)
#pragma unroll
      for (int i = 0; i < 8; ++i) sx += tval(wd[j][i], 0) + tval(wd[j][i], 1);
      sx += __shfl_xor_sync(0xffffffffu, sx, 1);
      sx += __shfl_xor_sync(0xffffffffu, sx, 2);
      if (it.c < items) {
        s_x[((gl * 2 + 0) * M + m) * 4 + tt] = bfrag(wd[j][0], wd[j][1], wd[j][2], wd[j][3]);
        s_x[((gl * 2 + 1) * M + m) * 4 + tt] = bfrag(wd[j][4], wd[j][5], wd[j][6], wd[j][7]);
        if (tt == 0) s_sx[gl * M + m] = sx;
      }
    }
  };
  if (STAGE_EARLY) stage_convert(0, min(KS, NG));   // the first step, loaded before the row norm

  for (int s = 0; s < NS; ++s) {
    const int g0 = s * KS, ng = min(KS, NG - g0);
    if (s > 0) __syncthreads();   // every warp is done with the previous slice's x
    if (!TILE8) {   // (TILE8 loads its x in the compute loop)
      // SJ items a thread per step, all their loads issued before any is converted (a step's loads
      // wait for L2 once, not once per item: stage_load); whole warps per step: the sums' shuffles
      for (int c0 = s == 0 && STAGE_EARLY ? SJ * NW * 32 : 0; c0 < ng * M * 4; c0 += SJ * NW * 32) {
        stage_load(c0, g0, ng);
        stage_convert(c0, ng);
      }
      __syncthreads();
    }
#ifdef PHASE_MARKS
    if (s == 0) layer_mark(stamps, 1);
#endif

#ifdef TILE_QUEUE
    int q_tile = BLOCK_X;
    for (int i = 0; q_tile < tiles; ++i) {   // this block's tiles: its first, then the queue's
      const int tile = q_tile, next_tile = tiles, next_s = NS;   // (the next is known at the barrier)
      int queued = tiles;
      if (threadIdx.x == 0) queued = STREAM + atomicAdd(queue, 1);   // past the last tile: none
#else
    for (int i = 0; i < ntiles; ++i) {   // this block's tiles over the slice
      const int tile = BLOCK_X + i * STREAM;
      // the next item: this slice's next tile, else the block's first tile of the next slice
      const int next_tile = i + 1 < ntiles ? tile + STREAM : BLOCK_X, next_s = i + 1 < ntiles ? s : s + 1;
#endif
      if (next_s < NS) {   // its rows go to L2 while this one runs
        item(next_tile, next_s);
        prefetch_item();
        item(tile, s);
      }
      float acc[4] = {0.f, 0.f, 0.f, 0.f};   // (r0, m0), (r0, m1), (r1, m0), (r1, m1)
      auto compute = [&](const Chunk& k, int c) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int g = 4 * c + u, gl = g - g0;   // gl: the group in the staged slice
          float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint4 xf = make_uint4(0u, 0u, 0u, 0u);
            if (g8 < M && TILE8) {   // x's words at k = 64g + 16t + 8h of row g8, as the staging permutes them
              const uint4 v = *reinterpret_cast<const uint4*>(x + (size_t)g8 * K + g * 64 + t * 16 + 8 * h);
              xf = bfrag(v.x, v.y, v.z, v.w);
            } else if (g8 < M) {
              xf = s_x[((gl * 2 + h) * M + g8) * 4 + t];
            }
            // TILE8: rows 8-15 all E (lop of 0 is MAGIC), their D E * sum x
            const uint32_t wa = h ? k.a[u].y : k.a[u].x, wb = TILE8 ? 0u : (h ? k.b[u].y : k.b[u].x);
#pragma unroll
            for (int p = 0; p < 2; ++p) {
              const uint32_t a[4] = {lop(wa >> (8 * p), 0x000F000Fu), lop(wb >> (8 * p), 0x000F000Fu),
                                     lop(wa >> (8 * p + 4), 0x000F000Fu), lop(wb >> (8 * p + 4), 0x000F000Fu)};
              mma(d, a, p ? xf.z : xf.x, p ? xf.w : xf.y);
            }
          }
          const uint32_t s0 = (u < 2) ? k.s[0].x : k.s[0].y, b0 = (u < 2) ? k.s[1].x : k.s[1].y;
          const float sv0 = tval(s0, u & 1), bv0 = tval(b0, u & 1);
          if (TILE8) {   // E * sum x of rows m0, m1 from the mma's rows 8-15
            acc[0] += sv0 * (d[0] - d[2]) + bv0 * (d[2] * (1.f / E));
            if (M > 1) acc[1] += sv0 * (d[1] - d[3]) + bv0 * (d[3] * (1.f / E));
            continue;
          }
          const float x0 = s_sx[gl * M + m0], x1 = s_sx[gl * M + m1];
          acc[0] += sv0 * (d[0] - E * x0) + bv0 * x0;
          if (M > 1) acc[1] += sv0 * (d[1] - E * x1) + bv0 * x1;
          const uint32_t s1 = (u < 2) ? k.s[2].x : k.s[2].y, b1 = (u < 2) ? k.s[3].x : k.s[3].y;
          const float sv1 = tval(s1, u & 1), bv1 = tval(b1, u & 1);
          acc[2] += sv1 * (d[2] - E * x0) + bv1 * x0;
          if (M > 1) acc[3] += sv1 * (d[3] - E * x1) + bv1 * x1;
        }
      };
      for (int c = cb; c < ce; c += 2) {
        if (c + 1 < ce) load(kb, c + 1);
        compute(ka, c);
        if (c + 1 >= ce) break;
        if (c + 2 < ce) load(ka, c + 2);
        compute(kb, c + 1);
      }
      // this warp's partial of the tile: kept in slot i over the slices, added in warp order after the last
      float4 (&slots)[NW][32] = s_acc[NS > 1 ? i : 0];
      const bool last = s + 1 == NS;
#ifdef TILE_QUEUE
      if (threadIdx.x == 0) s_queued = queued;   // (read after this barrier, written again after the next)
#endif
      if (last) __syncthreads();   // (one slice: warp 0 is done with the previous tile's slots)
#ifdef TILE_QUEUE
      q_tile = s_queued;
#endif
      const float4 prev = s > 0 ? slots[warp][lane] : make_float4(0.f, 0.f, 0.f, 0.f);
      slots[warp][lane] = make_float4(prev.x + acc[0], prev.y + acc[1], prev.z + acc[2], prev.w + acc[3]);
#ifdef TILE_QUEUE
      if (q_tile < tiles) {   // the queue's next tile: its first chunk
        item(q_tile, 0);
        if (cb < ce) load(ka, cb);
      }
#else
      if (next_s < NS) {
        item(next_tile, next_s);
        if (cb < ce) load(ka, cb);
      }
#endif
      if (!last) continue;
      __syncthreads();
      if (warp != 0) continue;
      float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < NW; ++j) {
        const float4 p = slots[j][lane];
        v[0] += p.x; v[1] += p.y; v[2] += p.z; v[3] += p.w;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {   // e: activation row 2t + e
        const int m = 2 * t + e;
        if (m >= M) continue;
#if EPI == 2
        const int n = tile * 8 + g8;
        if (n >= NOUT) continue;
        const float gt = static_cast<float>(static_cast<T>(v[e]));
        const float ut = static_cast<float>(static_cast<T>(v[2 + e]));
        const float sg = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-gt))));
        const float a = static_cast<float>(static_cast<T>(gt * sg));
        y[(size_t)m * NOUT + n] = static_cast<T>(a * ut);
#else
#pragma unroll
        for (int h = 0; h < (TILE8 ? 1 : 2); ++h) {
          const int n = tile * TR + g8 + 8 * h;
          if (n >= N) continue;
          const T y0 = static_cast<T>(v[2 * h + e]);
#if EPI == 1
          y[(size_t)m * N + n] = static_cast<T>(static_cast<float>(res[(size_t)m * N + n]) + static_cast<float>(y0));
#elif HAS_BIAS
          ys[(size_t)m * N + n] =
              static_cast<float>(static_cast<T>(static_cast<float>(y0) + static_cast<float>(bias[n])));
#else
          ys[(size_t)m * N + n] = static_cast<float>(y0);
#endif
        }
#endif
      }
    }
  }
#ifdef PHASE_MARKS
  layer_mark(stamps, 2);
#endif

#if EPI == 3
  static_assert(!STREAM && !TILE8, "gemv_mma.cu: a head's blocks are its tiles of 16 rows");
  constexpr int BR = 16;
#include "qkv_head.cuh"
#endif
