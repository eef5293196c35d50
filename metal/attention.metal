// mlx_fastops: GQA decode attention (one query token), split over the sequence, plus the reduce.
//
// Bodies for mx.fast.metal_kernel, split into sections by `// ==== <name> ====` lines
// (mlx_fastops.kernels.sections); mlx_fastops/backends/metal/attention.py assembles them
// (decode body = decode_common + a tail).
//
// Design (MNN step 5 extended; kernel-designs.md section 2.4 / 8):
// - one threadgroup per (chunk of keys, KV head, batch): the G = H / Hkv query heads of the group
//   share every K and V row the threadgroup loads, so each K/V row is read once per KV head, not once
//   per query head as MLX's sdpa_vector does;
// - NSG SIMD-groups per threadgroup; SIMD-group s takes keys start + s, start + s + NSG, ...; each
//   lane holds D/32 elements (element lane + 32 j: coalesced) of q (pre-scaled), k, v and of the G
//   output accumulators; the G scores of one key are reduced with vector simd_sum calls;
// - online softmax in float with -inf guards (a SIMD-group with no keys keeps m = -inf);
// - SIMD-groups are combined through threadgroup memory (NSG * G * D floats, at most 16 KiB);
// - with one chunk the threadgroup writes the normalised output; with several it writes
//   unnormalised partials (o, max, sum) in float and `decode_reduce` combines them;
// - reads mlx-lm's cache buffers in place: k/v are the full [B, Hkv, S_alloc, D] buffers (any
//   strides, ensure_row_contiguous=False), `kv_len` the valid prefix, passed as a 0-d int32 input.

// ==== header ====
// In-place SIMD-group sum of G floats with as few collectives as possible (float4/float2 chunks).
template <int G>
inline void fo_simd_sum_n(thread float* v) {
  for (int g = 0; g + 4 <= G; g += 4) {
    float4 t = simd_sum(float4(v[g], v[g + 1], v[g + 2], v[g + 3]));
    v[g] = t.x;
    v[g + 1] = t.y;
    v[g + 2] = t.z;
    v[g + 3] = t.w;
  }
  if ((G % 4) >= 2) {
    const int g = G - (G % 4);
    float2 t = simd_sum(float2(v[g], v[g + 1]));
    v[g] = t.x;
    v[g + 1] = t.y;
  }
  if ((G % 2) == 1) {
    v[G - 1] = simd_sum(v[G - 1]);
  }
}

// ==== decode_common ====
// Template: T, D, G (query heads per KV head), NSG.
// Inputs: q [B, H, 1, D], k, v [B, Hkv, S_alloc, D] (any strides), kv_len, kv_chunk (0-d int32: valid
// keys, keys per threadgroup), scale (0-d float).
// Grid (32 * NSG * n_chunks, Hkv, B), threadgroup (32 * NSG, 1, 1).
constexpr int NE = D / 32;
uint ln = thread_index_in_simdgroup;
uint sgi = simdgroup_index_in_threadgroup;
uint tid = thread_index_in_threadgroup;
int c = int(threadgroup_position_in_grid.x);
int kvh = int(threadgroup_position_in_grid.y);
int b = int(threadgroup_position_in_grid.z);
int HQ = q_shape[1];

threadgroup float tg_o[NSG * G * D];
threadgroup float tg_m[NSG * G];
threadgroup float tg_s[NSG * G];

float qv[G][NE];
float acc[G][NE];
float mx[G];
float sm[G];
for (int g = 0; g < G; ++g) {
  int64_t qb = int64_t(b) * q_strides[0] + int64_t(kvh * G + g) * q_strides[1];
  for (int j = 0; j < NE; ++j) {
    qv[g][j] = scale * static_cast<float>(q[qb + int64_t(int(ln) + 32 * j) * q_strides[3]]);
    acc[g][j] = 0.0f;
  }
  mx[g] = -INFINITY;
  sm[g] = 0.0f;
}

const device T* kb = k + int64_t(b) * k_strides[0] + int64_t(kvh) * k_strides[1];
const device T* vb = v + int64_t(b) * v_strides[0] + int64_t(kvh) * v_strides[1];
int start = c * kv_chunk;
int stop = min(start + kv_chunk, kv_len);
for (int t = start + int(sgi); t < stop; t += NSG) {
  float sc[G];
  float kk[NE];
  for (int j = 0; j < NE; ++j) {
    kk[j] = static_cast<float>(kb[int64_t(t) * k_strides[2] + int64_t(int(ln) + 32 * j) * k_strides[3]]);
  }
  for (int g = 0; g < G; ++g) {
    float d = 0.0f;
    for (int j = 0; j < NE; ++j) {
      d += qv[g][j] * kk[j];
    }
    sc[g] = d;
  }
  fo_simd_sum_n<G>(sc);
  float vv[NE];
  for (int j = 0; j < NE; ++j) {
    vv[j] = static_cast<float>(vb[int64_t(t) * v_strides[2] + int64_t(int(ln) + 32 * j) * v_strides[3]]);
  }
  for (int g = 0; g < G; ++g) {
    float mn = max(mx[g], sc[g]);
    float f = (mx[g] == -INFINITY) ? 0.0f : metal::fast::exp(mx[g] - mn);
    float p = metal::fast::exp(sc[g] - mn);
    sm[g] = sm[g] * f + p;
    for (int j = 0; j < NE; ++j) {
      acc[g][j] = acc[g][j] * f + p * vv[j];
    }
    mx[g] = mn;
  }
}

for (int g = 0; g < G; ++g) {
  for (int j = 0; j < NE; ++j) {
    tg_o[(int(sgi) * G + g) * D + int(ln) + 32 * j] = acc[g][j];
  }
  if (ln == 0) {
    tg_m[int(sgi) * G + g] = mx[g];
    tg_s[int(sgi) * G + g] = sm[g];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int idx = int(tid); idx < G * D; idx += NSG * 32) {
  int g = idx / D;
  int d = idx % D;
  float m_all = -INFINITY;
  for (int s = 0; s < NSG; ++s) {
    m_all = max(m_all, tg_m[s * G + g]);
  }
  float o_sum = 0.0f;
  float l_sum = 0.0f;
  for (int s = 0; s < NSG; ++s) {
    float ms = tg_m[s * G + g];
    float w = (ms == -INFINITY) ? 0.0f : metal::fast::exp(ms - m_all);
    o_sum += w * tg_o[(s * G + g) * D + d];
    l_sum += w * tg_s[s * G + g];
  }
  int hq = kvh * G + g;

// ==== decode_tail_single ====
  // out [B, H, 1, D]
  out[(int64_t(b) * HQ + hq) * D + d] = static_cast<T>(l_sum > 0.0f ? o_sum / l_sum : 0.0f);
}

// ==== decode_tail_split ====
  // o_part [B, H, n_chunks, D], m_part / l_part [B, H, n_chunks], all float.
  int n_chunks = int(threadgroups_per_grid.x);
  int64_t prow = (int64_t(b) * HQ + hq) * n_chunks + c;
  o_part[prow * D + d] = o_sum;
  if (d == 0) {
    m_part[prow] = m_all;
    l_part[prow] = l_sum;
  }
}

// ==== decode_reduce ====
// Combines the chunks of decode attention: o_part [R, C, D], m_part / l_part [R, C] (float,
// R = B * H rows) -> out [R, D] in T.  One SIMD-group per row, D/32 elements per lane.
// Template: T, D.  Grid (32, R, 1), threadgroup (32, min(R, 4), 1).
constexpr int NE = D / 32;
uint ln = thread_position_in_threadgroup.x;
int64_t r = int64_t(thread_position_in_grid.y);
int C = m_part_shape[2];
float m_all = -INFINITY;
for (int c = 0; c < C; ++c) {
  m_all = max(m_all, m_part[r * C + c]);
}
float l_sum = 0.0f;
float acc[NE];
for (int j = 0; j < NE; ++j) {
  acc[j] = 0.0f;
}
for (int c = 0; c < C; ++c) {
  float mc = m_part[r * C + c];
  float w = (mc == -INFINITY) ? 0.0f : metal::fast::exp(mc - m_all);
  l_sum += w * l_part[r * C + c];
  for (int j = 0; j < NE; ++j) {
    acc[j] += w * o_part[(r * C + c) * D + int(ln) + 32 * j];
  }
}
float inv = l_sum > 0.0f ? 1.0f / l_sum : 0.0f;
for (int j = 0; j < NE; ++j) {
  out[r * D + int(ln) + 32 * j] = static_cast<T>(acc[j] * inv);
}
