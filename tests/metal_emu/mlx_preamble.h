// metal_emu's CPU version of the subset of MLX's Metal preamble (metal::utils(): kernels/utils.h with
// bf16.h, defines.h, ...) that custom kernels use. Written for the emulator from MLX's documented
// behaviour; MLX's own headers do not compile as C++ (address-space overloads).
#pragma once
#pragma GCC system_header
#include "mtl_compat.h"

using namespace metal;

typedef half float16_t;
typedef bfloat bfloat16_t;

#define MLX_MTL_PRAGMA_UNROLL
#define MTL_CONST

template <typename U>
struct Limits {
  static U max() { return metal::numeric_limits<U>::max(); }
  static U min() { return metal::numeric_limits<U>::min(); }
  static U finite_max() { return metal::numeric_limits<U>::max(); }
  static U finite_min() { return metal::numeric_limits<U>::lowest(); }
};
#define MTL_EMU_FLOAT_LIMITS(T)                                                     \
  template <>                                                                       \
  struct Limits<T> {                                                                \
    static T max() { return metal::numeric_limits<T>::infinity(); }                 \
    static T min() { return -metal::numeric_limits<T>::infinity(); }                \
    static T finite_max() { return metal::numeric_limits<T>::max(); }               \
    static T finite_min() { return metal::numeric_limits<T>::lowest(); }            \
  };
MTL_EMU_FLOAT_LIMITS(float)
MTL_EMU_FLOAT_LIMITS(half)
MTL_EMU_FLOAT_LIMITS(bfloat)
#undef MTL_EMU_FLOAT_LIMITS

template <typename U>
struct WorkPerThread {
  static constexpr int constant_n = 16 / sizeof(U);
  static constexpr int n = constant_n < 1 ? 1 : (constant_n > 8 ? 8 : constant_n);
};

struct complex64_t {
  float real;
  float imag;
};

// linear element index -> memory offset, for a row-major shape with the given strides (elements)
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(IdxT elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
// 3-d position (x fastest) -> memory offset
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(vec<uint, 3> elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = IdxT(elem.x) * IdxT(strides[ndim - 1]) + IdxT(elem.y) * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc_1(uint elem, const int64_t& stride) {
  return elem * IdxT(stride);
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc_2(vec<uint, 2> elem, const int64_t strides[2]) {
  return elem.x * IdxT(strides[1]) + elem.y * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc_3(vec<uint, 3> elem, const int64_t strides[3]) {
  return elem.x * IdxT(strides[2]) + elem.y * IdxT(strides[1]) + elem.z * IdxT(strides[0]);
}

template <typename T, typename U>
inline T ceildiv(T n, U m) {
  return (n + m - 1) / m;
}

template <typename U, typename T>
inline U cast_to(T val) {
  return static_cast<U>(val);
}
