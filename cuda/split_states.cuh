// The start of a split decode attention block (attention.cu, quantized_attention.cu): its online-
// softmax states, empty (m = -inf, l = 0, o = 0 for each of its GB query heads; split_merge.cuh
// merges them), and the shuffle mask of its lane group.
// In scope: GB, LPP, sub.
  float mx_[GB], ls[GB], of[GB][8];
#pragma unroll
  for (int g = 0; g < GB; ++g) {
    mx_[g] = -INFINITY;
    ls[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) of[g][j] = 0.f;
  }

  // Lanes of one LPP group share p, so the group leaves the loop together; shuffle on the
  // group's mask only (groups of one warp may run different trip counts).
  const unsigned gmask = LPP == 32 ? 0xffffffffu : (((1u << LPP) - 1u) << (sub * LPP));
