// mlx_fastops: the quantised GEMV family (decode: 1-8 activation rows) for mx.fast.metal_kernel.
//
// Weights are MLX affine-packed: w[n, k] = scale[n, g] * q[n, k] + bias[n, g], g = k / group_size,
// q packed little-endian in uint32 words (4-bit: 8 per word, 8-bit: 4 per word). Scales may be
// negative: nothing below depends on their sign.
//
// Sections (`// ==== <name> ====` lines, split by mlx_fastops.kernels.sections): `header` is the
// kernel header (shared helpers); the body of kernel KIND (gemv, gate_up, qkv) is `prologue` +
// section KIND, assembled by mlx_fastops/backends/metal/gemv.py. MLX writes the kernel signature
// around each body (template <typename T, int BITS, int MR>, inputs x, w, scales, biases, bias, params).
//
// Work split:
//   threadgroup = 2 SIMD-groups (64 threads); each SIMD-group owns FO_ROWS = 4 weight rows, so a
//   threadgroup reads 8 weight rows. Each lane takes VPL = 64/BITS values per row per step, i.e.
//   exactly one 8-byte ushort4 load per row (16 nibbles or 8 bytes); a SIMD-group covers
//   BLOCK = 32*VPL values of K per step (512 for 4-bit, 256 for 8-bit). A lane's VPL values always
//   lie in one quantisation group (group sizes 32/64/128 are multiples of VPL), so each lane
//   dequantises once per (row, group chunk): acc += scale * dot(x, q) + bias * sum(x).
//   The input block of all MR activation rows is staged once per step in threadgroup memory and
//   shared by both SIMD-groups (and reused for all 4 rows and, for gate/up, both halves).
//   x is staged as float, pre-multiplied by 1, 1/16, 1/256, 1/4096 (4-bit) or 1, 1/256 (8-bit), so
//   the nibbles/bytes are used masked but never shifted (MLX's qmv_fast trick).
//
// params (int32, 9): K, group_size, M (activation rows), has_bias, N0, N1, N2, T0, T1
//   plain:   N0 = N;                    tiles of 8 rows
//   gate/up: N0 = I (rows I..2I-1 = up); tiles of 4 outputs (each SIMD-group: 2 gate + 2 up rows)
//   qkv:     N0/N1/N2 = Nq/Nk/Nv; tiles [0,T0) -> q, [T0,T1) -> k, [T1,..) -> v (each segment gets
//            exactly ceil(N_seg/8) threadgroups: the small K/V segments do not idle).

// ==== header ====
#define FO_ROWS 4
#define FO_TG 64

// x prescale pattern for one float4 of staged input (matches the masks in fo_unpack).
template <int BITS>
inline float4 fo_prescale() {
  return BITS == 4 ? float4(1.0f, 1.0f / 16.0f, 1.0f / 256.0f, 1.0f / 4096.0f)
                   : float4(1.0f, 1.0f / 256.0f, 1.0f, 1.0f / 256.0f);
}

// Masked (not shifted) quantised values of float4 number j of a lane's 8-byte chunk.
template <int BITS>
inline float4 fo_unpack(ushort4 wv, int j) {
  if (BITS == 4) {
    uint u = uint(wv[j]);
    return float4(float(u & 0x000fu), float(u & 0x00f0u), float(u & 0x0f00u), float(u & 0xf000u));
  } else {
    uint a = uint(wv[2 * j]);
    uint b = uint(wv[2 * j + 1]);
    return float4(float(a & 0x00ffu), float(a & 0xff00u), float(b & 0x00ffu), float(b & 0xff00u));
  }
}

// Dot product of one lane's 8-byte weight chunk with its 16 / BITS staged (prescaled) inputs.
template <int BITS>
inline float fo_chunk_dot(ushort4 wv, const thread float4* xv) {
  float d = 0.0f;
  for (int j = 0; j < 16 / BITS; j++) {
    d += dot(xv[j], fo_unpack<BITS>(wv, j));
  }
  return d;
}

// Stage one K block of the MR activation rows: lane-major (xs[(m * NQ + j) * 32 + lane]) so
// SIMD-group reads are contiguous, plus the raw sum per lane chunk.
template <typename T, int BITS, int MR>
inline void fo_stage(const device T* x, int M, int K, int k0, int tid, threadgroup float4* xs,
                     threadgroup float* xsum) {
  const int VPL = 64 / BITS;
  const int NQ = VPL / 4;
  for (int jb = tid; jb < MR * 32; jb += FO_TG) {
    int m = jb / 32;
    int ln = jb % 32;
    int k = k0 + ln * VPL;
    float s = 0.0f;
    if (m < M && k < K) {
      const device T* xp = x + m * K + k;
      float4 f = fo_prescale<BITS>();
      for (int j = 0; j < NQ; j++) {
        float4 v = float4(float(xp[4 * j]), float(xp[4 * j + 1]), float(xp[4 * j + 2]),
                          float(xp[4 * j + 3]));
        s += (v.x + v.y) + (v.z + v.w);
        xs[(m * NQ + j) * 32 + ln] = v * f;
      }
    } else {
      for (int j = 0; j < NQ; j++) {
        xs[(m * NQ + j) * 32 + ln] = float4(0);
      }
    }
    xsum[m * 32 + ln] = s;
  }
}

// GEMV core. rows: the SIMD-group's FO_ROWS weight rows (already clamped to valid rows).
// res[r * MR + m] receives the full dot product of row r with activation row m, in every lane.
template <typename T, int BITS, int MR>
inline void fo_gemv(const device T* x, const device uint32_t* w,
                    const device T* scales, const device T* biases,
                    int K, int GS, int M, const thread int* rows,
                    threadgroup float4* xs, threadgroup float* xsum, int tid, int ln,
                    thread float* res) {
  const int VPL = 64 / BITS;
  const int NQ = VPL / 4;
  const int BLOCK = 32 * VPL;
  const int G = K / GS;
  const int W8 = K / VPL;  // 8-byte words per weight row
  float acc[FO_ROWS * MR];
  for (int i = 0; i < FO_ROWS * MR; i++) {
    acc[i] = 0.0f;
  }
  const device ushort4* w8 = (const device ushort4*)w;
  for (int k0 = 0; k0 < K; k0 += BLOCK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // previous block fully consumed
    fo_stage<T, BITS, MR>(x, M, K, k0, tid, xs, xsum);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int k = k0 + ln * VPL;
    if (k < K) {
      int g = k / GS;
      ushort4 wv[FO_ROWS];
      float sc[FO_ROWS];
      float bi[FO_ROWS];
      for (int r = 0; r < FO_ROWS; r++) {
        wv[r] = w8[rows[r] * W8 + k / VPL];
        sc[r] = float(scales[rows[r] * G + g]);
        bi[r] = float(biases[rows[r] * G + g]);
      }
      for (int m = 0; m < MR; m++) {
        float4 xv[NQ];
        for (int j = 0; j < NQ; j++) {
          xv[j] = xs[(m * NQ + j) * 32 + ln];
        }
        float xsm = xsum[m * 32 + ln];
        for (int r = 0; r < FO_ROWS; r++) {
          acc[r * MR + m] += sc[r] * fo_chunk_dot<BITS>(wv[r], xv) + bi[r] * xsm;
        }
      }
    }
  }
  for (int i = 0; i < FO_ROWS * MR; i++) {
    res[i] = simd_sum(acc[i]);
  }
}

// Round to the output type like the stock path (quantized_matmul output in T, then + bias in T).
template <typename T>
inline T fo_out(float v, bool has_bias, const device T* bias, int row) {
  T y = T(v);
  if (has_bias) {
    y = T(float(y) + float(bias[row]));
  }
  return y;
}

// silu(g) * u as mlx-lm's compiled swiglu computes it in T: g and u rounded to T first.
template <typename T>
inline T fo_swiglu(T g, T u) {
  // Rounded where mlx-lm's compiled swiglu rounds: silu(g) = g * sigmoid(g), each op in T.
  float gf = float(g);
  T sig = T(1.0f / (1.0f + exp(-gf)));
  T silu = T(gf * float(sig));
  return T(float(silu) * float(u));
}

// Row bookkeeping shared by the bodies.
inline void fo_plain_rows(int tile, int sg, int n, thread int* rows, thread int* outs) {
  for (int r = 0; r < FO_ROWS; r++) {
    int o = tile * 8 + sg * FO_ROWS + r;
    outs[r] = o;
    rows[r] = min(o, n - 1);
  }
}

// gate/up: SIMD-group sg of tile handles outputs p0, p0+1; rows 0,1 gate; rows 2,3 up (+I).
inline void fo_gate_up_rows(int tile, int sg, int n_inter, thread int* rows, thread int* outs) {
  for (int r = 0; r < 2; r++) {
    int o = tile * 4 + sg * 2 + r;
    int c = min(o, n_inter - 1);
    outs[r] = o;
    rows[r] = c;
    rows[r + 2] = n_inter + c;
  }
}

// Write-back of gemv and qkv: lane r * MR + m holds row r x activation row m; outs[r] is the output
// column in dst [M, n], brow[r] the row of `bias`.
template <typename T, int MR>
inline void fo_write(device T* dst, int n, int M, int ln, const thread int* outs,
                     const thread int* brow, const thread float* res, bool has_bias,
                     const device T* bias) {
  for (int r = 0; r < FO_ROWS; r++) {
    for (int m = 0; m < MR; m++) {
      if (ln == r * MR + m && outs[r] < n && m < M) {
        dst[m * n + outs[r]] = fo_out<T>(res[r * MR + m], has_bias, bias, brow[r]);
      }
    }
  }
}

// ==== prologue ====
threadgroup float4 xs[MR * (16 / BITS) * 32];
threadgroup float xsum[MR * 32];
int tid = int(thread_index_in_threadgroup);
int sg = int(simdgroup_index_in_threadgroup);
int ln = int(thread_index_in_simdgroup);
int tile = int(threadgroup_position_in_grid.x);
int K = params[0];
int GS = params[1];
int M = params[2];
bool has_bias = params[3] != 0;
float res[FO_ROWS * MR];

// ==== gemv ====
int N = params[4];
int rows[FO_ROWS];
int outs[FO_ROWS];
fo_plain_rows(tile, sg, N, rows, outs);
fo_gemv<T, BITS, MR>(x, w, scales, biases, K, GS, M, rows, xs, xsum, tid, ln, res);
fo_write<T, MR>(out, N, M, ln, outs, outs, res, has_bias, bias);

// ==== gate_up ====
int NI = params[4];
int rows[FO_ROWS];
int outs[2];
fo_gate_up_rows(tile, sg, NI, rows, outs);
fo_gemv<T, BITS, MR>(x, w, scales, biases, K, GS, M, rows, xs, xsum, tid, ln, res);
for (int r = 0; r < 2; r++) {
  for (int m = 0; m < MR; m++) {
    if (ln == r * MR + m && outs[r] < NI && m < M) {
      T g = fo_out<T>(res[r * MR + m], has_bias, bias, rows[r]);
      T u = fo_out<T>(res[(r + 2) * MR + m], has_bias, bias, rows[r + 2]);
      y[m * NI + outs[r]] = fo_swiglu<T>(g, u);
    }
  }
}

// ==== qkv ====
int seg = tile < params[7] ? 0 : (tile < params[8] ? 1 : 2);
int seg_tile = tile - (seg == 0 ? 0 : (seg == 1 ? params[7] : params[8]));
int seg_n = params[4 + seg];
int seg_row0 = seg == 0 ? 0 : (seg == 1 ? params[4] : params[4] + params[5]);
device T* dst = seg == 0 ? q : (seg == 1 ? k : v);
int rows[FO_ROWS];
int outs[FO_ROWS];
fo_plain_rows(seg_tile, sg, seg_n, rows, outs);
for (int r = 0; r < FO_ROWS; r++) {
  rows[r] += seg_row0;
}
fo_gemv<T, BITS, MR>(x, w, scales, biases, K, GS, M, rows, xs, xsum, tid, ln, res);
fo_write<T, MR>(dst, seg_n, M, ln, outs, rows, res, has_bias, bias);
