// cuda_emu: the tensor-core and packed-half instructions of mlx_fastops' kernels (cuda/qmm.cu), as
// its `#ifndef __CUDA_ARCH__` branches call them. Included by cuda_compat.h after the shuffles.

namespace cuemu {

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16} as a warp collective: d += A (16 x 16) B (16 x 8),
// E = the element type. Fragments as the PTX ISA lays them out (lane l: group g = l / 4, c = l % 4;
// the lower 16 bits of a register hold the lower-indexed element):
//   A a[0] (g, 2c..2c+1)  a[1] (g+8, 2c..)  a[2] (g, 2c+8..)  a[3] (g+8, 2c+8..)     (row, k)
//   B b[0] (2c..2c+1, g)  b[1] (2c+8.., g)                                          (k, column)
//   D d[0..1] (g, 2c..2c+1)  d[2..3] (g+8, 2c..2c+1)                                (row, column)
// Each lane gathers its two rows of A and two columns of B with shuffles; products are exact in
// float and summed in k order (a GPU's accumulation order is its own: results agree to rounding).
template <typename E>
inline float mma_elem(unsigned reg, int hi) {
  const uint16_t bits = (uint16_t)(hi ? reg >> 16 : reg & 0xFFFFu);
  E e;
  std::memcpy(&e, &bits, 2);
  return (float)e;
}

template <typename E>
inline void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  const int lane = (int)(S().lanes[S().cur].tid.x & 31), g = lane >> 2, c = lane & 3;
  float A[2][16], B[2][16];
  for (int src = 0; src < 4; ++src)
    for (int r = 0; r < 4; ++r) {
      const unsigned v = __shfl_sync(0xffffffffu, a[r], g * 4 + src);
      const int k = 2 * src + 8 * (r >> 1);
      A[r & 1][k] = mma_elem<E>(v, 0);
      A[r & 1][k + 1] = mma_elem<E>(v, 1);
    }
  for (int j = 0; j < 2; ++j)
    for (int src = 0; src < 4; ++src)
      for (int r = 0; r < 2; ++r) {
        const unsigned v = __shfl_sync(0xffffffffu, b[r], (2 * c + j) * 4 + src);
        const int k = 2 * src + 8 * r;
        B[j][k] = mma_elem<E>(v, 0);
        B[j][k + 1] = mma_elem<E>(v, 1);
      }
  for (int e = 0; e < 4; ++e) {
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc += A[e >> 1][k] * B[e & 1][k];
    d[e] = acc;
  }
}

// fma.rn.{bf16,f16}x2: d = T(a * b + c) for the two halves of each register, one rounding (a
// float FMA, then the rounding to T: a double rounding is possible, far below the tests' slack).
template <typename E>
inline unsigned fma2(unsigned a, unsigned b, unsigned c) {
  unsigned d = 0;
  for (int i = 0; i < 2; ++i) {
    const float r = std::fma(mma_elem<E>(a, i), mma_elem<E>(b, i), mma_elem<E>(c, i));
    const E e = static_cast<E>(r);
    uint16_t bits;
    std::memcpy(&bits, &e, 2);
    d |= static_cast<unsigned>(bits) << (16 * i);
  }
  return d;
}

}  // namespace cuemu
