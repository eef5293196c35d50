// mlx_fastops: prefill flash attention, Q.K^T + online softmax + P.V in one kernel, with 8x8
// simdgroup_matrix MMA (MNN step 11; kernel-designs.md section 5.2).
//
// Bodies for mx.fast.metal_kernel, split into sections by `// ==== <name> ====` lines
// (mlx_fastops.kernels.sections); mlx_fastops/backends/metal/attention.py assembles them.
//
// One threadgroup = 4 SIMD-groups (128 threads) handles Q_TILE = 16 query rows of one (batch, head)
// and streams over the keys in KV_TILE = 32 blocks:
//   QK    SIMD-group s computes the 16x8 block of scores for keys kb + 8s .. kb + 8s + 7 (two 8x8
//         accumulators, D/8 MMA steps); Q comes from threadgroup memory (loaded once, in T), K^T is
//         loaded straight from device memory (no threadgroup staging: -45% for MNN); stored as fp32
//         into `sf` (the fp32 QK scratch);
//   softmax  SIMD-group s owns rows 4s .. 4s + 3 (M, S in registers); lane = key column; masked
//         scores are -inf; the two -inf short-circuits keep exp(-inf - -inf) out; P overwrites `sf`
//         in place, the per-row rescale factor goes to `s_alpha`;
//   barrier  (every SIMD-group's P rows and alphas must be visible before P.V reads all 16 rows);
//   PV    SIMD-group s owns output columns [s D/4, (s+1) D/4) for all 16 rows as 2 x D/32 float 8x8
//         accumulators in registers (zero-filled with make_filled_simdgroup_matrix); they are
//         rescaled by the row's alpha, then O += P . V with V loaded straight from device memory.
// Fragments are float: inputs in T (half or bfloat) are converted as each lane loads its two
// elements (thread_elements, MLX's steel/gemm/mma.h layout), so fp16, bf16 and fp32 share one path
// and P stays in fp32 (as stock steel_attention keeps it), instead of MNN's half P for half MMA.
// Causal masks are lower-right aligned (query i sees keys <= i + kL - qL, mlx-lm's convention for a
// prompt continued from a cache offset); KV tiles past the last visible key of the tile's last row are
// skipped (whole-tile causal early exit). Fully masked rows give 0, not NaN.
// Threadgroup memory: 16 D sizeof(T) + 2 KiB + 128 B (D = 256, fp32: 18.1 KiB).

// ==== header ====
#include <metal_simdgroup_matrix>

// ==== loads_float ====
// K/V in T: FO_K(key, d) / FO_V(key, d) read one element as float.
#define FO_KV_POINTERS \
  const device T* kp = k + int64_t(b) * k_strides[0] + int64_t(kvh) * k_strides[1]; \
  const device T* vp = v + int64_t(b) * v_strides[0] + int64_t(kvh) * v_strides[1];
#define FO_K(key, d) static_cast<float>(kp[int64_t(key) * k_strides[2] + int64_t(d) * k_strides[3]])
#define FO_V(key, d) static_cast<float>(vp[int64_t(key) * v_strides[2] + int64_t(d) * v_strides[3]])

// ==== loads_q8 ====
// K/V as mlx-lm's QuantizedKVCache(bits=8) stores them: packed uint32 [B, Hkv, S, D/4] (4 values a
// word, LSB first), scales/biases [B, Hkv, S, D/GS] in T; w = scale * q + bias, dequantised by each
// lane for its two fragment elements at every 8x8 MMA step (no threadgroup staging, so D = 256 fits).
// Template adds GS (quantisation group size).
#define FO_KV_POINTERS \
  const device uint32_t* kp = k + int64_t(b) * k_strides[0] + int64_t(kvh) * k_strides[1]; \
  const device uint32_t* vp = v + int64_t(b) * v_strides[0] + int64_t(kvh) * v_strides[1]; \
  const device T* ksp = k_scales + int64_t(b) * k_scales_strides[0] + int64_t(kvh) * k_scales_strides[1]; \
  const device T* kbp = k_biases + int64_t(b) * k_biases_strides[0] + int64_t(kvh) * k_biases_strides[1]; \
  const device T* vsp = v_scales + int64_t(b) * v_scales_strides[0] + int64_t(kvh) * v_scales_strides[1]; \
  const device T* vbp = v_biases + int64_t(b) * v_biases_strides[0] + int64_t(kvh) * v_biases_strides[1];
#define FO_Q8(p, sp, bp, pn, sn, bn, key, d) \
  (static_cast<float>(sp[int64_t(key) * sn##_strides[2] + int64_t((d) / GS) * sn##_strides[3]]) * \
       static_cast<float>((p[int64_t(key) * pn##_strides[2] + int64_t((d) / 4) * pn##_strides[3]] >> \
                           (8u * uint((d) % 4))) & 0xFFu) + \
   static_cast<float>(bp[int64_t(key) * bn##_strides[2] + int64_t((d) / GS) * bn##_strides[3]]))
#define FO_K(key, d) FO_Q8(kp, ksp, kbp, k, k_scales, k_biases, key, d)
#define FO_V(key, d) FO_Q8(vp, vsp, vbp, v, v_scales, v_biases, key, d)

// ==== flash_attention ====
// Template: T, D, CAUSAL (+ GS for q8).  Inputs: q [B, H, qL, D], k, v [B, Hkv, kL, D] (any
// strides; q8: k, k_scales, k_biases, v, v_scales, v_biases), scale (0-d float). The wrapper puts
// one of the loads_* sections in front of this body.  Output: out [B, qL, H, D] (the layout o_proj wants).
// Grid (128 * ceil(qL / 16), H, B), threadgroup (128, 1, 1).
constexpr int QT = 16;
constexpr int KT = 32;
constexpr int NSG = 4;
constexpr int NCB = D / 32;  // 8-wide output column blocks per SIMD-group
uint ln = thread_index_in_simdgroup;
uint sgi = simdgroup_index_in_threadgroup;
uint tid = thread_index_in_threadgroup;
int qt = int(threadgroup_position_in_grid.x);
int h = int(threadgroup_position_in_grid.y);
int b = int(threadgroup_position_in_grid.z);
int HQ = q_shape[1];
int qL = q_shape[2];
int HK = k_shape[1];
int kL = k_shape[2];
int kvh = h / (HQ / HK);
int q0 = qt * QT;

threadgroup T sq[QT * D];
threadgroup float sf[QT * KT];
threadgroup float s_alpha[QT];
threadgroup float s_l[QT];

// Fragment coordinates of this lane (row fr, columns fc and fc + 1), as steel/gemm/mma.h get_coord.
short fqid = short(ln / 4);
short fr = (fqid & 4) + short((ln / 2) % 4);
short fc = (fqid & 2) * 2 + short(ln % 2) * 2;

const device T* qp = q + int64_t(b) * q_strides[0] + int64_t(h) * q_strides[1];
FO_KV_POINTERS

for (int idx = int(tid); idx < QT * D; idx += NSG * 32) {
  int r = idx / D;
  int d = idx % D;
  sq[idx] = (q0 + r < qL) ? qp[int64_t(q0 + r) * q_strides[2] + int64_t(d) * q_strides[3]]
                          : static_cast<T>(0.0f);
}

simdgroup_float8x8 acc_o[2][NCB];
for (int rb = 0; rb < 2; ++rb) {
  for (int cb = 0; cb < NCB; ++cb) {
    acc_o[rb][cb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
}
float row_m[4];
float row_s[4];
for (int i = 0; i < 4; ++i) {
  row_m[i] = -INFINITY;
  row_s[i] = 0.0f;
}
const float scale_log2 = scale * 1.44269504088896341f;
const int diag = kL - qL;  // lower-right alignment
int kv_end = kL;
if (CAUSAL) {
  kv_end = min(kL, min(q0 + QT, qL) - 1 + diag + 1);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int kb = 0; kb < kv_end; kb += KT) {
  // ---- S = Q . K^T for keys kb + 8 sgi .. + 7
  simdgroup_float8x8 acc_s[2];
  acc_s[0] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  acc_s[1] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  int key0 = kb + int(sgi) * 8 + fc;
  bool kin0 = key0 < kL;
  bool kin1 = key0 + 1 < kL;
  for (int kd = 0; kd < D / 8; ++kd) {
    // B[i][j] = K[key j][d i]: this lane holds row fr (d = 8 kd + fr), columns fc, fc + 1 (keys)
    simdgroup_float8x8 mk;
    int kdd = kd * 8 + fr;
    mk.thread_elements()[0] = kin0 ? FO_K(key0, kdd) : 0.0f;
    mk.thread_elements()[1] = kin1 ? FO_K(key0 + 1, kdd) : 0.0f;
    for (int rb = 0; rb < 2; ++rb) {
      simdgroup_float8x8 mq;
      int qo = (rb * 8 + fr) * D + kd * 8 + fc;
      mq.thread_elements()[0] = static_cast<float>(sq[qo]);
      mq.thread_elements()[1] = static_cast<float>(sq[qo + 1]);
      simdgroup_multiply_accumulate(acc_s[rb], mq, mk, acc_s[rb]);
    }
  }
  simdgroup_store(acc_s[0], sf + int(sgi) * 8, KT);
  simdgroup_store(acc_s[1], sf + 8 * KT + int(sgi) * 8, KT);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // ---- online softmax, rows 4 sgi .. 4 sgi + 3, lane = key column
  int key = kb + int(ln);
  for (int i = 0; i < 4; ++i) {
    int r = int(sgi) * 4 + i;
    bool ok = key < kL;
    if (CAUSAL) {
      ok = ok && (key <= q0 + r + diag);
    }
    float s = ok ? sf[r * KT + int(ln)] * scale_log2 : -INFINITY;
    float m_new = simd_max(max(row_m[i], s));
    float ms = (row_m[i] == -INFINITY) ? 0.0f : metal::fast::exp2(row_m[i] - m_new);
    float p = (s == -INFINITY) ? 0.0f : metal::fast::exp2(s - m_new);
    row_s[i] = row_s[i] * ms + simd_sum(p);
    row_m[i] = m_new;
    sf[r * KT + int(ln)] = p;
    if (ln == 0) {
      s_alpha[r] = ms;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // ---- O = O * alpha + P . V for columns [sgi D/4, (sgi+1) D/4)
  for (int rb = 0; rb < 2; ++rb) {
    float a = s_alpha[rb * 8 + fr];
    for (int cb = 0; cb < NCB; ++cb) {
      acc_o[rb][cb].thread_elements()[0] *= a;
      acc_o[rb][cb].thread_elements()[1] *= a;
    }
  }
  for (int kk = 0; kk < KT / 8; ++kk) {
    simdgroup_float8x8 mp0;
    simdgroup_float8x8 mp1;
    simdgroup_load(mp0, sf + kk * 8, KT);
    simdgroup_load(mp1, sf + 8 * KT + kk * 8, KT);
    // V[key][d]: this lane holds row fr (key kb + 8 kk + fr), columns fc, fc + 1 (d)
    int vkey = kb + kk * 8 + int(fr);
    bool vin = vkey < kL;
    for (int cb = 0; cb < NCB; ++cb) {
      int d0 = (int(sgi) * NCB + cb) * 8 + fc;
      simdgroup_float8x8 mv;
      mv.thread_elements()[0] = vin ? FO_V(vkey, d0) : 0.0f;
      mv.thread_elements()[1] = vin ? FO_V(vkey, d0 + 1) : 0.0f;
      simdgroup_multiply_accumulate(acc_o[0][cb], mp0, mv, acc_o[0][cb]);
      simdgroup_multiply_accumulate(acc_o[1][cb], mp1, mv, acc_o[1][cb]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

if (ln == 0) {
  for (int i = 0; i < 4; ++i) {
    s_l[int(sgi) * 4 + i] = row_s[i];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int rb = 0; rb < 2; ++rb) {
  int r = rb * 8 + fr;
  int qi = q0 + r;
  float l = s_l[r];
  float inv = l > 0.0f ? 1.0f / l : 0.0f;
  if (qi < qL) {
    int64_t obase = (int64_t(b) * qL + qi) * HQ * D + int64_t(h) * D;
    for (int cb = 0; cb < NCB; ++cb) {
      int d0 = (int(sgi) * NCB + cb) * 8 + fc;
      out[obase + d0] = static_cast<T>(acc_o[rb][cb].thread_elements()[0] * inv);
      out[obase + d0 + 1] = static_cast<T>(acc_o[rb][cb].thread_elements()[1] * inv);
    }
  }
}
