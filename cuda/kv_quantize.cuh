// One cache row (the k or v of one token and kv head, D floats holding T values) quantised into
// mlx-lm's QuantizedKVCache layout as mx.quantize does on MLX's CUDA backend (affine, KV_BITS bits,
// groups of KV_GS): w gets D * KV_BITS / 32 words (value j of a word at bits j * KV_BITS), s and b
// one scale and bias per group, in T. Per group, in fp32:
//   lo = min x, hi = max(0, max x)   (MLX's CUDA kernel starts its maximum at 0)
//   scale = max((hi - lo) / (2^KV_BITS - 1), 1e-7), negated unless |lo| > |hi|; edge = lo or hi
//   (the larger magnitude); q0 = round(edge / scale); unless q0 = 0: scale = edge / q0, bias = edge
//   (the edge exact), else bias = 0;  q = clamp(round((x - bias) / scale), 0, 2^KV_BITS - 1)
// round() is half away from zero; the float scale and bias quantise, their T roundings are stored.
// (MLX's CPU backend rounds half to even and takes the true maximum: this follows the backend the
// kernel runs on.) Called by all 32 lanes of a warp: lane c < D / 8 owns values 8c .. 8c + 7 (one
// group's share); lanes past D / 8 repeat the row's lanes, so every shuffle has a full warp.
// Included inside a kernel body (head.cuh): a lambda. In scope: T, D, KV_BITS, KV_GS.
  auto kv_quantize_row = [&](const float* row, uint32_t* w, T* s, T* b) {
  constexpr int LANES = D / 8;     // lanes holding values
  constexpr int GL = KV_GS / 8;    // lanes per group (aligned, so xor shuffles stay inside one)
  constexpr int WPL = KV_BITS / 4; // words per lane
  constexpr float NBINS = (1 << KV_BITS) - 1;
  static_assert(KV_GS % 8 == 0 && D % KV_GS == 0 && LANES <= 32, "a lane's 8 values lie in one group");
  const int lane = threadIdx.x & 31, c = lane % LANES;
  float v[8];
  float lo = row[8 * c], hi = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = row[8 * c + j];
    lo = fminf(lo, v[j]);
    hi = fmaxf(hi, v[j]);
  }
#pragma unroll
  for (int o = GL / 2; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  float scale = fmaxf((hi - lo) / NBINS, 1e-7f);
  const bool side = fabsf(lo) > fabsf(hi);
  scale = side ? scale : -scale;
  const float edge = side ? lo : hi;
  const float q0 = roundf(edge / scale);
  const bool at_zero = q0 == 0.f;
  scale = at_zero ? scale : edge / q0;
  const float bias = at_zero ? 0.f : edge;
  uint32_t word[WPL];
#pragma unroll
  for (int i = 0; i < WPL; ++i) word[i] = 0u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float q = fminf(fmaxf(roundf((v[j] - bias) / scale), 0.f), NBINS);
    word[j * KV_BITS / 32] |= static_cast<uint32_t>(q) << ((j * KV_BITS) % 32);
  }
  if (lane < LANES) {
#pragma unroll
    for (int i = 0; i < WPL; ++i) w[c * WPL + i] = word[i];
    if (c % GL == 0) {
      s[c / GL] = static_cast<T>(scale);
      b[c / GL] = static_cast<T>(bias);
    }
  }
};
