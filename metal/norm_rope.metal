// mlx_fastops: RMSNorm with the residual add fused, and per-head q/k RMSNorm + RoPE in one kernel.
//
// Bodies for mx.fast.metal_kernel (MLX writes the signatures). The file is split into sections by
// the `// ==== <name> ====` lines (mlx_fastops.kernels.sections); mlx_fastops/backends/metal/norm_rope.py
// reads them.
//
// Numerics follow MLX's own kernels so the fused path rounds where stock rounds:
//   rms_norm: sum of squares in float, precise::rsqrt(mean + eps), out = w * T(x * inv) (weight
//             multiply in T after rounding), as mlx/backend/metal/kernels/rms_norm.metal;
//   rope:     theta = (scale * position) * inv_freq, fast::cos/sin, rotation in float, one rounding.

// ==== header ====

// ==== rms_norm_residual ====
// h = residual + x (rounded to T, written out), n = rms_norm(h) * weight.
// One threadgroup of TG threads per row; each thread keeps N_PER elements of h in registers
// (element c = tid + i * TG: coalesced), so h is read once and written once.
// Template: T, HIDDEN, TG, N_PER.  Inputs: x, residual [rows, HIDDEN], weight [HIDDEN], eps (0-d).
// Grid (rows * TG, 1, 1), threadgroup (TG, 1, 1).
uint row = threadgroup_position_in_grid.x;
uint tid = thread_position_in_threadgroup.x;
uint sgi = simdgroup_index_in_threadgroup;
uint ln = thread_index_in_simdgroup;
threadgroup float partial_sums[32];

size_t base = size_t(row) * HIDDEN;
T hv[N_PER];
float ss = 0.0f;
for (int i = 0; i < N_PER; ++i) {
  int c = int(tid) + i * TG;
  if (c < HIDDEN) {
    T hval = static_cast<T>(static_cast<float>(residual[base + c]) + static_cast<float>(x[base + c]));
    h[base + c] = hval;
    hv[i] = hval;
    float f = static_cast<float>(hval);
    ss += f * f;
  } else {
    hv[i] = static_cast<T>(0.0f);
  }
}
ss = simd_sum(ss);
if (ln == 0) {
  partial_sums[sgi] = ss;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = 0.0f;
for (int s = 0; s < (TG + 31) / 32; ++s) {
  total += partial_sums[s];
}
float inv = metal::precise::rsqrt(total / static_cast<float>(HIDDEN) + eps);
for (int i = 0; i < N_PER; ++i) {
  int c = int(tid) + i * TG;
  if (c < HIDDEN) {
    n[base + c] = static_cast<T>(weight[c] * static_cast<T>(static_cast<float>(hv[i]) * inv));
  }
}

// ==== qk_norm_rope ====
// q [B, L, H, D], k [B, L, Hkv, D] (any strides) -> q_out [B, H, L, D], k_out [B, Hkv, L, D].
// One SIMD-group per (b, l, head) row, q heads first, then k heads. Each lane holds D/32 elements,
// laid out so that both elements of every rotation pair sit in the same lane:
//   half-split (traditional = false): element e = lane + 32 j, partner j + DIMS/64 (e + DIMS/2);
//   traditional: elements 64 (j/2) + 2 lane + (j & 1), pair (j, j + 1) = (2p, 2p + 1).
// Template: T, D, DIMS (rotated features), TRAD, NORM.
// Inputs: q, k, q_w, k_w [D] (unused when !NORM), inv_freq [DIMS/2] float, offset (0-d int32: the
// position of token 0), eps, scale (0-d float).  Grid (32, rows, 1), threadgroup (32, R, 1).
constexpr int NE = D / 32;
uint ln = thread_position_in_threadgroup.x;
int row = int(thread_position_in_grid.y);
int L = q_shape[1];
int HQ = q_shape[2];
int HK = k_shape[2];
int NH = HQ + HK;
int hh = row % NH;
int bl = row / NH;
int l = bl % L;
int b = bl / L;
bool isq = hh < HQ;
int hd = isq ? hh : hh - HQ;
int64_t sbase = isq ? (int64_t(b) * q_strides[0] + int64_t(l) * q_strides[1] + int64_t(hd) * q_strides[2])
                    : (int64_t(b) * k_strides[0] + int64_t(l) * k_strides[1] + int64_t(hd) * k_strides[2]);
int64_t sd = isq ? q_strides[3] : k_strides[3];
const device T* src = isq ? q : k;

float v[NE];
for (int j = 0; j < NE; ++j) {
  int e = TRAD ? (64 * (j / 2) + 2 * int(ln) + (j & 1)) : (int(ln) + 32 * j);
  v[j] = static_cast<float>(src[sbase + int64_t(e) * sd]);
}
if (NORM) {
  float ss = 0.0f;
  for (int j = 0; j < NE; ++j) {
    ss += v[j] * v[j];
  }
  ss = simd_sum(ss);
  float inv = metal::precise::rsqrt(ss / static_cast<float>(D) + eps);
  for (int j = 0; j < NE; ++j) {
    int e = TRAD ? (64 * (j / 2) + 2 * int(ln) + (j & 1)) : (int(ln) + 32 * j);
    T wv = isq ? q_w[e] : k_w[e];
    v[j] = static_cast<float>(static_cast<T>(wv * static_cast<T>(v[j] * inv)));
  }
}
float pos = scale * static_cast<float>(offset + l);
if (TRAD) {
  for (int j = 0; j < NE; j += 2) {
    int p = 32 * (j / 2) + int(ln);
    if (2 * p < DIMS) {
      float th = pos * inv_freq[p];
      float cs = metal::fast::cos(th);
      float sn = metal::fast::sin(th);
      float x1 = v[j];
      float x2 = v[j + 1];
      v[j] = x1 * cs - x2 * sn;
      v[j + 1] = x1 * sn + x2 * cs;
    }
  }
} else {
  for (int j = 0; j < DIMS / 64; ++j) {
    float th = pos * inv_freq[int(ln) + 32 * j];
    float cs = metal::fast::cos(th);
    float sn = metal::fast::sin(th);
    float x1 = v[j];
    float x2 = v[j + DIMS / 64];
    v[j] = x1 * cs - x2 * sn;
    v[j + DIMS / 64] = x1 * sn + x2 * cs;
  }
}
device T* dst = isq ? q_out : k_out;
int HD = isq ? HQ : HK;
int64_t obase = ((int64_t(b) * HD + hd) * L + l) * D;
for (int j = 0; j < NE; ++j) {
  int e = TRAD ? (64 * (j / 2) + 2 * int(ln) + (j & 1)) : (int(ln) + 32 * j);
  dst[obase + e] = static_cast<T>(v[j]);
}
