// The coordinates of a split decode attention block (attention.cu, quantized_attention.cu): its
// lanes per key row (LPP: 8 values each), rows per warp step, online-softmax slots, and from
// BLOCK_X/Y/Z, GRID_X its split, kv head hk, first query head g0 of its subgroup (h0 within all H)
// and its (b, l) row. In scope: D, NW, G, GB, L and the block coordinate defines.
  constexpr int LPP = D / 8;
  constexpr int PPW = 32 / LPP;
  constexpr int SLOTS = NW * PPW;
  constexpr int MAXSPLIT = 64;

  const int split = BLOCK_X;
  const int nsplit = GRID_X;
  static_assert(GB >= 1 && G % GB == 0, "GB (query heads per block) must divide G");
  constexpr int NSUB = G / GB;
  const int hk = BLOCK_Y / NSUB;
  const int g0 = (BLOCK_Y % NSUB) * GB;   // this block's first head within the kv head's group
  const int h0 = hk * G + g0;             // ... and within all H
  // Sending a chunk's rows on to L2 before the wait (WAIT_INPUTS), its NSUB blocks take turns by runs
  // of NW * 32 lines: this block's first line and the stride over the chunk's lines.
  const int pf_first = (BLOCK_Y % NSUB) * NW * 32;
  constexpr int PF_STRIDE = NSUB * NW * 32;
  const int bl = BLOCK_Z;
  const int b = bl / L, l = bl % L;
