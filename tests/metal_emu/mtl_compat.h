// metal_emu compatibility header: the subset of the Metal Shading Language that mlx_fastops kernels
// use, as C++14 for g++ on the CPU. Address spaces are defined away, `half` is _Float16, `bfloat` a
// 16-bit struct with round-to-nearest-even, vectors are metal::vec<T, N> with Metal's components,
// swizzles, constructors and conversions; SIMD-group functions, barriers and simdgroup_matrix go
// through the fiber runtime (runtime_api.h), so they behave as rendezvous of the lanes.
#pragma once
#pragma GCC system_header

#include <stddef.h>
#include <stdint.h>

#include <type_traits>

#include "runtime_api.h"

// ---- address spaces, attributes, qualifiers ----
#define device
#define constant
#define thread
#define threadgroup
#define threadgroup_imageblock
#define ray_data
#define object_data
#define kernel
#define METAL_FUNC inline
#define __METAL_VERSION__ 320
#define __METAL__ 1
#define MTL_EMU 1

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

namespace metal {

// ================================================================= bfloat
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  static uint16_t round(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
  }
  template <class U, class = typename std::enable_if<std::is_arithmetic<U>::value ||
                                                     std::is_same<U, _Float16>::value>::type>
  constexpr bfloat(U u) : bits(round((float)u)) {}
  operator float() const {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
  static bfloat from_bits(uint16_t b) {
    bfloat r;
    r.bits = b;
    return r;
  }
};

template <class T>
struct is_scalar_t : std::integral_constant<bool, std::is_arithmetic<T>::value || std::is_same<T, half>::value ||
                                                      std::is_same<T, bfloat>::value> {};

// bfloat arithmetic: bfloat (op) bfloat -> bfloat; mixed with another scalar -> that scalar's float type
#define MTL_BF_OP(op)                                                                        \
  inline bfloat operator op(bfloat a, bfloat b) { return bfloat((float)a op(float) b); }     \
  template <class U, class = typename std::enable_if<std::is_arithmetic<U>::value ||         \
                                                     std::is_same<U, half>::value>::type>    \
  inline auto operator op(bfloat a, U b)->decltype(1.0f op b) { return (float)a op b; }      \
  template <class U, class = typename std::enable_if<std::is_arithmetic<U>::value ||         \
                                                     std::is_same<U, half>::value>::type>    \
  inline auto operator op(U a, bfloat b)->decltype(a op 1.0f) { return a op(float) b; }      \
  inline bfloat& operator op##=(bfloat& a, bfloat b) { return a = a op b; }                  \
  template <class U, class = typename std::enable_if<std::is_arithmetic<U>::value ||         \
                                                     std::is_same<U, half>::value>::type>    \
  inline bfloat& operator op##=(bfloat& a, U b) { return a = bfloat((float)a op b); }
MTL_BF_OP(+)
MTL_BF_OP(-)
MTL_BF_OP(*)
MTL_BF_OP(/)
#undef MTL_BF_OP
#define MTL_BF_CMP(op)                                                                    \
  inline bool operator op(bfloat a, bfloat b) { return (float)a op(float) b; }            \
  template <class U, class = typename std::enable_if<std::is_arithmetic<U>::value ||      \
                                                     std::is_same<U, half>::value>::type> \
  inline bool operator op(bfloat a, U b) { return (float)a op b; }                        \
  template <class U, class = typename std::enable_if<std::is_arithmetic<U>::value ||      \
                                                     std::is_same<U, half>::value>::type> \
  inline bool operator op(U a, bfloat b) { return a op(float) b; }
MTL_BF_CMP(<)
MTL_BF_CMP(>)
MTL_BF_CMP(<=)
MTL_BF_CMP(>=)
MTL_BF_CMP(==)
MTL_BF_CMP(!=)
#undef MTL_BF_CMP
inline bfloat operator-(bfloat a) { return bfloat::from_bits((uint16_t)(a.bits ^ 0x8000u)); }
inline bfloat operator+(bfloat a) { return a; }

// ================================================================= vectors
template <class T, int N>
struct vec;
template <class T, int NS, int M, unsigned C>
struct swz;

template <class X>
struct vtraits {
  static constexpr bool is_vec = false;
  static constexpr int n = 1;
  typedef X elem;
};
template <class T, int N>
struct vtraits<vec<T, N>> {
  static constexpr bool is_vec = true;
  static constexpr int n = N;
  typedef T elem;
};
template <class T, int NS, int M, unsigned C>
struct vtraits<swz<T, NS, M, C>> {
  static constexpr bool is_vec = true;
  static constexpr int n = M;
  typedef T elem;
};

template <class X>
inline typename vtraits<X>::elem vget(const X& x, int i, std::true_type) {
  return x[i];
}
template <class X>
inline X vget(const X& x, int, std::false_type) {
  return x;
}

template <class T, int NS, int M, unsigned C>
struct swz {
  T d[NS == 3 ? 4 : NS];
  static constexpr int idx(int k) { return (int)((C >> (4 * k)) & 0xFu); }
  static constexpr bool unique() {
    return M < 2 || (idx(0) != idx(1) && (M < 3 || (idx(0) != idx(2) && idx(1) != idx(2))) &&
                     (M < 4 || (idx(0) != idx(3) && idx(1) != idx(3) && idx(2) != idx(3))));
  }
  T operator[](int k) const { return d[idx(k)]; }
  operator vec<T, M>() const {
    vec<T, M> r;
    for (int k = 0; k < M; ++k) r.v[k] = d[idx(k)];
    return r;
  }
  swz& operator=(const vec<T, M>& o) {
    static_assert(unique(), "metal_emu: swizzle with repeated components is not assignable");
    for (int k = 0; k < M; ++k) d[idx(k)] = o.v[k];
    return *this;
  }
  swz& operator=(const swz& o) { return *this = vec<T, M>(o); }
  template <class U, int NS2, unsigned C2>
  swz& operator=(const swz<U, NS2, M, C2>& o) {
    return *this = vec<T, M>(o);
  }
  template <class X>
  swz& operator+=(const X& o) { return *this = vec<T, M>(*this) + o; }
  template <class X>
  swz& operator-=(const X& o) { return *this = vec<T, M>(*this) - o; }
  template <class X>
  swz& operator*=(const X& o) { return *this = vec<T, M>(*this) * o; }
  template <class X>
  swz& operator/=(const X& o) { return *this = vec<T, M>(*this) / o; }
};

// The swizzle members of vec<T, N>. metal_emu defines MTL_SWIZZLES_N itself with only the swizzles a
// kernel names (instantiating all ~700 per vector type dominates compile time); else all of them.
#ifndef MTL_SWIZZLES_4
#include "swizzles.inc"
#endif

template <class T, int N>
struct vec_storage;
template <class T>
struct vec_storage<T, 2> {
  union {
    T v[2];
    struct {
      T x, y;
    };
    struct {
      T r, g;
    };
    MTL_SWIZZLES_2
  };
};
template <class T>
struct vec_storage<T, 3> {
  union {
    T v[4];  // Metal's 3-vectors are padded to 4 elements
    struct {
      T x, y, z;
    };
    struct {
      T r, g, b;
    };
    MTL_SWIZZLES_3
  };
};
template <class T>
struct vec_storage<T, 4> {
  union {
    T v[4];
    struct {
      T x, y, z, w;
    };
    struct {
      T r, g, b, a;
    };
    MTL_SWIZZLES_4
  };
};

template <class X>
struct ncomp : std::integral_constant<int, vtraits<X>::n> {};

template <class T, int N>
struct vec : vec_storage<T, N> {
  typedef T elem;
  static constexpr int size = N;
  vec() = default;
  vec(const vec& o) { __builtin_memcpy((void*)this->v, (const void*)o.v, sizeof(this->v)); }
  vec& operator=(const vec& o) {
    __builtin_memcpy((void*)this->v, (const void*)o.v, sizeof(this->v));
    return *this;
  }
  // scalar splat (implicit, as Metal allows scalar -> vector)
  template <class U, class = typename std::enable_if<is_scalar_t<U>::value>::type>
  vec(U s) {
    for (int i = 0; i < N; ++i) this->v[i] = T(s);
  }
  // element-type conversion: explicit, as in Metal
  template <class U, class = typename std::enable_if<!std::is_same<U, T>::value>::type>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) this->v[i] = T(o.v[i]);
  }
  template <int NS, unsigned C>
  vec(const swz<T, NS, N, C>& s) {
    for (int i = 0; i < N; ++i) this->v[i] = s[i];
  }
  template <class U, int NS, unsigned C, class = typename std::enable_if<!std::is_same<U, T>::value>::type>
  explicit vec(const swz<U, NS, N, C>& s) {
    for (int i = 0; i < N; ++i) this->v[i] = T(s[i]);
  }
  // flattening constructor: float4(v.xy, 0, 1), float3(a, b, c), ...
  template <class A0, class A1, class... As>
  vec(const A0& a0, const A1& a1, const As&... as) {
    static_assert(count<A0, A1, As...>() == N, "metal_emu: vector constructor with the wrong number of components");
    put(0, a0, a1, as...);
  }
  T& operator[](int i) { return this->v[i]; }
  const T& operator[](int i) const { return this->v[i]; }
  template <class X>
  vec& operator+=(const X& o) { return *this = *this + o; }
  template <class X>
  vec& operator-=(const X& o) { return *this = *this - o; }
  template <class X>
  vec& operator*=(const X& o) { return *this = *this * o; }
  template <class X>
  vec& operator/=(const X& o) { return *this = *this / o; }
  template <class X>
  vec& operator%=(const X& o) { return *this = *this % o; }
  template <class X>
  vec& operator&=(const X& o) { return *this = *this & o; }
  template <class X>
  vec& operator|=(const X& o) { return *this = *this | o; }
  template <class X>
  vec& operator^=(const X& o) { return *this = *this ^ o; }
  template <class X>
  vec& operator<<=(const X& o) { return *this = *this << o; }
  template <class X>
  vec& operator>>=(const X& o) { return *this = *this >> o; }

 private:
  template <class A>
  static constexpr int count() { return ncomp<A>::value; }
  template <class A, class B, class... R>
  static constexpr int count() { return ncomp<A>::value + count<B, R...>(); }
  void put(int) {}
  template <class A, class... R>
  void put(int k, const A& a, const R&... r) {
    for (int i = 0; i < ncomp<A>::value; ++i)
      this->v[k + i] = T(vget(a, i, std::integral_constant<bool, vtraits<A>::is_vec>()));
    put(k + ncomp<A>::value, r...);
  }
};

// result type of a binary vector operation (SFINAE: no type when the operands do not combine)
template <class A, class B, bool VA = vtraits<A>::is_vec, bool VB = vtraits<B>::is_vec>
struct vbin {};
template <class A, class B>
struct vbin<A, B, true, true> {
  typedef typename std::enable_if<
      std::is_same<typename vtraits<A>::elem, typename vtraits<B>::elem>::value && vtraits<A>::n == vtraits<B>::n,
      vec<typename vtraits<A>::elem, vtraits<A>::n>>::type type;
};
template <class A, class B>
struct vbin<A, B, true, false> {
  typedef typename std::enable_if<is_scalar_t<B>::value, vec<typename vtraits<A>::elem, vtraits<A>::n>>::type type;
};
template <class A, class B>
struct vbin<A, B, false, true> {
  typedef typename std::enable_if<is_scalar_t<A>::value, vec<typename vtraits<B>::elem, vtraits<B>::n>>::type type;
};

template <class R, class X>
inline typename R::elem velem(const X& x, int i) {
  return typename R::elem(vget(x, i, std::integral_constant<bool, vtraits<X>::is_vec>()));
}

#define MTL_VEC_BINOP(op)                                                                       \
  template <class A, class B, class R = typename vbin<A, B>::type>                              \
  inline R operator op(const A& a, const B& b) {                                                \
    R r;                                                                                        \
    for (int i = 0; i < R::size; ++i) r.v[i] = typename R::elem(velem<R>(a, i) op velem<R>(b, i)); \
    return r;                                                                                   \
  }
MTL_VEC_BINOP(+)
MTL_VEC_BINOP(-)
MTL_VEC_BINOP(*)
MTL_VEC_BINOP(/)
MTL_VEC_BINOP(%)
MTL_VEC_BINOP(&)
MTL_VEC_BINOP(|)
MTL_VEC_BINOP(^)
MTL_VEC_BINOP(<<)
MTL_VEC_BINOP(>>)
#undef MTL_VEC_BINOP
#define MTL_VEC_CMPOP(op)                                                                   \
  template <class A, class B, class R = typename vbin<A, B>::type>                          \
  inline vec<bool, R::size> operator op(const A& a, const B& b) {                           \
    vec<bool, R::size> r;                                                                   \
    for (int i = 0; i < R::size; ++i) r.v[i] = velem<R>(a, i) op velem<R>(b, i);            \
    return r;                                                                               \
  }
MTL_VEC_CMPOP(<)
MTL_VEC_CMPOP(>)
MTL_VEC_CMPOP(<=)
MTL_VEC_CMPOP(>=)
MTL_VEC_CMPOP(==)
MTL_VEC_CMPOP(!=)
MTL_VEC_CMPOP(&&)
MTL_VEC_CMPOP(||)
#undef MTL_VEC_CMPOP
#define MTL_VEC_UNOP(op)                                                                    \
  template <class A, class = typename std::enable_if<vtraits<A>::is_vec>::type>             \
  inline vec<typename vtraits<A>::elem, vtraits<A>::n> operator op(const A& a) {            \
    typedef vec<typename vtraits<A>::elem, vtraits<A>::n> R;                                \
    R r;                                                                                    \
    for (int i = 0; i < R::size; ++i) r.v[i] = typename R::elem(op a[i]);                   \
    return r;                                                                               \
  }
MTL_VEC_UNOP(-)
MTL_VEC_UNOP(+)
MTL_VEC_UNOP(~)
#undef MTL_VEC_UNOP
template <class A, class = typename std::enable_if<vtraits<A>::is_vec>::type>
inline vec<bool, vtraits<A>::n> operator!(const A& a) {
  vec<bool, vtraits<A>::n> r;
  for (int i = 0; i < vtraits<A>::n; ++i) r.v[i] = !a[i];
  return r;
}

#define MTL_VEC_TYPES(T, name) \
  typedef vec<T, 2> name##2;   \
  typedef vec<T, 3> name##3;   \
  typedef vec<T, 4> name##4;   \
  typedef vec<T, 2> packed_##name##2; \
  typedef vec<T, 3> packed_##name##3; \
  typedef vec<T, 4> packed_##name##4;
MTL_VEC_TYPES(float, float)
MTL_VEC_TYPES(half, half)
MTL_VEC_TYPES(bfloat, bfloat)
MTL_VEC_TYPES(int, int)
MTL_VEC_TYPES(uint, uint)
MTL_VEC_TYPES(short, short)
MTL_VEC_TYPES(ushort, ushort)
MTL_VEC_TYPES(char, char)
MTL_VEC_TYPES(uchar, uchar)
MTL_VEC_TYPES(long, long)
MTL_VEC_TYPES(ulong, ulong)
MTL_VEC_TYPES(bool, bool)
#undef MTL_VEC_TYPES

// ================================================================= type traits (metal:: names)
using std::conditional;
using std::enable_if;
using std::integral_constant;
using std::is_same;
using std::remove_cv;
using std::remove_reference;
template <bool B, class T = void>
using enable_if_t = typename std::enable_if<B, T>::type;
template <bool B, class T, class F>
using conditional_t = typename std::conditional<B, T, F>::type;
template <class A, class B>
constexpr bool is_same_v = std::is_same<A, B>::value;
template <class T>
struct is_floating_point
    : std::integral_constant<bool, std::is_floating_point<T>::value || std::is_same<T, half>::value ||
                                       std::is_same<T, bfloat>::value> {};
template <class T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T>
struct is_integral : std::is_integral<T> {};
template <class T>
constexpr bool is_integral_v = std::is_integral<T>::value;
template <class T>
struct is_signed : std::integral_constant<bool, std::is_signed<T>::value || is_floating_point<T>::value> {};
template <class T>
constexpr bool is_signed_v = is_signed<T>::value;
template <class T>
struct is_unsigned : std::is_unsigned<T> {};
template <class T>
struct is_scalar : is_scalar_t<T> {};
template <class T>
constexpr bool is_scalar_v = is_scalar_t<T>::value;
template <class T>
struct make_unsigned : std::make_unsigned<T> {};
template <class T>
using make_unsigned_t = typename std::make_unsigned<T>::type;
template <class T>
using remove_cv_t = typename std::remove_cv<T>::type;

// ================================================================= numeric_limits
template <class T>
struct numeric_limits;
#define MTL_INT_LIMITS(T, lo, hi)                       \
  template <>                                           \
  struct numeric_limits<T> {                            \
    static constexpr bool is_integer = true;            \
    static constexpr T min() { return lo; }             \
    static constexpr T max() { return hi; }             \
    static constexpr T lowest() { return lo; }          \
  };
MTL_INT_LIMITS(bool, false, true)
MTL_INT_LIMITS(char, (char)-128, (char)127)
MTL_INT_LIMITS(signed char, (signed char)-128, (signed char)127)
MTL_INT_LIMITS(unsigned char, (unsigned char)0, (unsigned char)255)
MTL_INT_LIMITS(short, (short)-32768, (short)32767)
MTL_INT_LIMITS(unsigned short, (unsigned short)0, (unsigned short)65535)
MTL_INT_LIMITS(int, (-2147483647 - 1), 2147483647)
MTL_INT_LIMITS(unsigned int, 0u, 4294967295u)
MTL_INT_LIMITS(long, (-9223372036854775807L - 1), 9223372036854775807L)
MTL_INT_LIMITS(unsigned long, 0ul, 18446744073709551615ul)
MTL_INT_LIMITS(long long, (-9223372036854775807LL - 1), 9223372036854775807LL)
MTL_INT_LIMITS(unsigned long long, 0ull, 18446744073709551615ull)
#undef MTL_INT_LIMITS
template <>
struct numeric_limits<float> {
  static constexpr bool is_integer = false;
  static constexpr float min() { return __FLT_MIN__; }
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float lowest() { return -__FLT_MAX__; }
  static constexpr float epsilon() { return __FLT_EPSILON__; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float denorm_min() { return __FLT_DENORM_MIN__; }
};
template <>
struct numeric_limits<half> {
  static constexpr bool is_integer = false;
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)0.0009765625f; }
  static constexpr half infinity() { return (half)__builtin_inff(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
  static constexpr half denorm_min() { return (half)5.960464477539063e-08f; }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_integer = false;
  static bfloat min() { return bfloat::from_bits(0x0080); }
  static bfloat max() { return bfloat::from_bits(0x7f7f); }
  static bfloat lowest() { return bfloat::from_bits(0xff7f); }
  static bfloat epsilon() { return bfloat::from_bits(0x3c00); }
  static bfloat infinity() { return bfloat::from_bits(0x7f80); }
  static bfloat quiet_NaN() { return bfloat::from_bits(0x7fc0); }
  static bfloat denorm_min() { return bfloat::from_bits(0x0001); }
};

// ================================================================= as_type
template <class To, class From>
inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "metal_emu: as_type between types of different sizes");
  To t;
  __builtin_memcpy((void*)&t, (const void*)&f, sizeof(To));
  return t;
}

// ================================================================= math
// Scalar overloads for float, half and bfloat (half and bfloat compute in float and round), vector
// overloads element-wise. Apple's ULPs differ; compare with tolerances.
#define MTL_VEC1(name)                                                             \
  template <class T, int N>                                                        \
  inline auto name(const vec<T, N>& x)->vec<decltype(name(x.v[0])), N> {           \
    vec<decltype(name(x.v[0])), N> r;                                              \
    for (int i = 0; i < N; ++i) r.v[i] = name(x.v[i]);                             \
    return r;                                                                      \
  }                                                                                \
  template <class T, int NS, int M, unsigned C>                                    \
  inline auto name(const swz<T, NS, M, C>& x)->decltype(name(vec<T, M>(x))) {      \
    return name(vec<T, M>(x));                                                     \
  }
#define MTL_F1(name, fexpr)                                            \
  inline float name(float x) { return fexpr; }                         \
  inline half name(half x) { return (half)name((float)x); }            \
  inline bfloat name(bfloat x) { return bfloat(name((float)x)); }      \
  MTL_VEC1(name)
MTL_F1(exp, __builtin_expf(x))
MTL_F1(exp2, __builtin_exp2f(x))
MTL_F1(exp10, __builtin_powf(10.0f, x))
MTL_F1(log, __builtin_logf(x))
MTL_F1(log2, __builtin_log2f(x))
MTL_F1(log10, __builtin_log10f(x))
MTL_F1(sqrt, __builtin_sqrtf(x))
MTL_F1(rsqrt, 1.0f / __builtin_sqrtf(x))
MTL_F1(fabs, __builtin_fabsf(x))
MTL_F1(floor, __builtin_floorf(x))
MTL_F1(ceil, __builtin_ceilf(x))
MTL_F1(round, __builtin_roundf(x))
MTL_F1(rint, __builtin_rintf(x))
MTL_F1(trunc, __builtin_truncf(x))
MTL_F1(fract, __builtin_fminf(x - __builtin_floorf(x), 0.99999994f))
MTL_F1(sin, __builtin_sinf(x))
MTL_F1(cos, __builtin_cosf(x))
MTL_F1(tan, __builtin_tanf(x))
MTL_F1(asin, __builtin_asinf(x))
MTL_F1(acos, __builtin_acosf(x))
MTL_F1(atan, __builtin_atanf(x))
MTL_F1(sinh, __builtin_sinhf(x))
MTL_F1(cosh, __builtin_coshf(x))
MTL_F1(tanh, __builtin_tanhf(x))
MTL_F1(asinh, __builtin_asinhf(x))
MTL_F1(acosh, __builtin_acoshf(x))
MTL_F1(atanh, __builtin_atanhf(x))
MTL_F1(log1p, __builtin_log1pf(x))
MTL_F1(expm1, __builtin_expm1f(x))
MTL_F1(erf, __builtin_erff(x))
MTL_F1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
MTL_F1(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == 0.0f ? 0.0f : x)))
#undef MTL_F1

#define MTL_PRED(name, fexpr)                                   \
  inline bool name(float x) { return fexpr; }                   \
  inline bool name(half x) { return name((float)x); }           \
  inline bool name(bfloat x) { return name((float)x); }         \
  MTL_VEC1(name)
MTL_PRED(isnan, __builtin_isnan(x))
MTL_PRED(isinf, __builtin_isinf(x))
MTL_PRED(isfinite, __builtin_isfinite(x))
MTL_PRED(signbit, __builtin_signbit(x))
#undef MTL_PRED

// abs: floats and integers
inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return (half)__builtin_fabsf((float)x); }
inline bfloat abs(bfloat x) { return bfloat::from_bits((uint16_t)(x.bits & 0x7fffu)); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline short abs(short x) { return (short)(x < 0 ? -x : x); }
inline char abs(char x) { return (char)(x < 0 ? -x : x); }
inline long abs(long x) { return x < 0 ? -x : x; }
inline uint abs(uint x) { return x; }
inline ushort abs(ushort x) { return x; }
inline uchar abs(uchar x) { return x; }
inline ulong abs(ulong x) { return x; }
MTL_VEC1(abs)

// two-argument functions, scalar (all scalar types for min/max) and element-wise
#define MTL_VEC2(name)                                                                  \
  template <class T, int N>                                                             \
  inline vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {                       \
    vec<T, N> r;                                                                        \
    for (int i = 0; i < N; ++i) r.v[i] = name(a.v[i], b.v[i]);                          \
    return r;                                                                           \
  }                                                                                     \
  template <class T, int N>                                                             \
  inline vec<T, N> name(const vec<T, N>& a, T b) { return name(a, vec<T, N>(b)); }      \
  template <class T, int N>                                                             \
  inline vec<T, N> name(T a, const vec<T, N>& b) { return name(vec<T, N>(a), b); }
#define MTL_F2(name, fexpr)                                                             \
  inline float name(float x, float y) { return fexpr; }                                 \
  inline half name(half x, half y) { return (half)name((float)x, (float)y); }           \
  inline bfloat name(bfloat x, bfloat y) { return bfloat(name((float)x, (float)y)); }   \
  MTL_VEC2(name)
MTL_F2(pow, __builtin_powf(x, y))
MTL_F2(powr, __builtin_powf(x, y))
MTL_F2(fmin, __builtin_fminf(x, y))
MTL_F2(fmax, __builtin_fmaxf(x, y))
MTL_F2(atan2, __builtin_atan2f(x, y))
MTL_F2(fmod, __builtin_fmodf(x, y))
MTL_F2(copysign, __builtin_copysignf(x, y))
MTL_F2(step, y < x ? 0.0f : 1.0f)
MTL_F2(fdim, __builtin_fdimf(x, y))
#undef MTL_F2
#define MTL_MINMAX(T)                                         \
  inline T min(T a, T b) { return b < a ? b : a; }            \
  inline T max(T a, T b) { return a < b ? b : a; }
MTL_MINMAX(int)
MTL_MINMAX(uint)
MTL_MINMAX(short)
MTL_MINMAX(ushort)
MTL_MINMAX(char)
MTL_MINMAX(uchar)
MTL_MINMAX(long)
MTL_MINMAX(ulong)
#undef MTL_MINMAX
// Metal's float min/max follow fmin/fmax (a NaN operand yields the other operand)
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline half min(half a, half b) { return (half)__builtin_fminf((float)a, (float)b); }
inline half max(half a, half b) { return (half)__builtin_fmaxf((float)a, (float)b); }
inline bfloat min(bfloat a, bfloat b) { return bfloat(__builtin_fminf((float)a, (float)b)); }
inline bfloat max(bfloat a, bfloat b) { return bfloat(__builtin_fmaxf((float)a, (float)b)); }
MTL_VEC2(min)
MTL_VEC2(max)
#undef MTL_VEC2

template <class T, class = typename std::enable_if<is_scalar_t<T>::value>::type>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, const vec<T, N>& lo, const vec<T, N>& hi) {
  return min(max(x, lo), hi);
}
template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, T lo, T hi) {
  return min(max(x, vec<T, N>(lo)), vec<T, N>(hi));
}
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return (half)__builtin_fmaf((float)a, (float)b, (float)c); }
inline bfloat fma(bfloat a, bfloat b, bfloat c) { return bfloat(__builtin_fmaf((float)a, (float)b, (float)c)); }
template <class T, int N>
inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
template <class T, class = typename std::enable_if<is_floating_point<T>::value>::type>
inline T mix(T x, T y, T a) {
  return T(x + (y - x) * a);
}
template <class T, int N>
inline vec<T, N> mix(const vec<T, N>& x, const vec<T, N>& y, const vec<T, N>& a) {
  return x + (y - x) * a;
}
template <class T, int N>
inline vec<T, N> mix(const vec<T, N>& x, const vec<T, N>& y, T a) {
  return x + (y - x) * a;
}
template <class T, class = typename std::enable_if<is_floating_point<T>::value>::type>
inline T smoothstep(T e0, T e1, T x) {
  float t = __builtin_fminf(__builtin_fmaxf(((float)x - (float)e0) / ((float)e1 - (float)e0), 0.0f), 1.0f);
  return T(t * t * (3.0f - 2.0f * t));
}
template <class T, class = typename std::enable_if<is_scalar_t<T>::value>::type>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = c.v[i] ? b.v[i] : a.v[i];
  return r;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) {
  return c ? b : a;
}
inline bool any(bool b) { return b; }
inline bool all(bool b) { return b; }
template <int N>
inline bool any(const vec<bool, N>& b) {
  for (int i = 0; i < N; ++i)
    if (b.v[i]) return true;
  return false;
}
template <int N>
inline bool all(const vec<bool, N>& b) {
  for (int i = 0; i < N; ++i)
    if (!b.v[i]) return false;
  return true;
}
template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  float s = 0.0f;
  for (int i = 0; i < N; ++i) s += (float)a.v[i] * (float)b.v[i];
  return T(s);
}
template <class T, int N>
inline T length(const vec<T, N>& a) {
  return T(__builtin_sqrtf((float)dot(a, a)));
}
template <class T, int N>
inline T length_squared(const vec<T, N>& a) {
  return dot(a, a);
}
template <class T, int N>
inline vec<T, N> normalize(const vec<T, N>& a) {
  return a * T(1.0f / (float)length(a));
}
template <class T, int N>
inline T distance(const vec<T, N>& a, const vec<T, N>& b) {
  return length(a - b);
}
template <class T>
inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}
template <class T, class = typename std::enable_if<is_floating_point<T>::value>::type>
inline T divide(T a, T b) {
  return T(a / b);
}

// integer functions
inline uint popcount(uint x) { return (uint)__builtin_popcount(x); }
inline int popcount(int x) { return __builtin_popcount((uint)x); }
inline ulong popcount(ulong x) { return (ulong)__builtin_popcountl(x); }
inline ushort popcount(ushort x) { return (ushort)__builtin_popcount(x); }
inline uchar popcount(uchar x) { return (uchar)__builtin_popcount(x); }
inline uint clz(uint x) { return x ? (uint)__builtin_clz(x) : 32u; }
inline int clz(int x) { return (int)clz((uint)x); }
inline uint ctz(uint x) { return x ? (uint)__builtin_ctz(x) : 32u; }
inline int ctz(int x) { return (int)ctz((uint)x); }
inline ulong clz(ulong x) { return x ? (ulong)__builtin_clzl(x) : 64ul; }
inline ulong ctz(ulong x) { return x ? (ulong)__builtin_ctzl(x) : 64ul; }
inline uint mulhi(uint a, uint b) { return (uint)(((uint64_t)a * b) >> 32); }
inline int mulhi(int a, int b) { return (int)(((int64_t)a * b) >> 32); }
inline uint abs_diff(int a, int b) { return a > b ? (uint)(a - b) : (uint)(b - a); }
inline uint abs_diff(uint a, uint b) { return a > b ? a - b : b - a; }
template <class T, class = typename std::enable_if<std::is_integral<T>::value>::type>
inline T extract_bits(T x, uint offset, uint bits) {
  typedef typename std::make_unsigned<T>::type U;
  if (bits == 0) return T(0);
  U m = bits >= sizeof(T) * 8 ? (U)~(U)0 : (U)(((U)1 << bits) - 1);
  U v = (U)((U)x >> offset) & m;
  if (std::is_signed<T>::value && bits < sizeof(T) * 8 && (v >> (bits - 1)) & 1) v |= (U)~m;
  return (T)v;
}
template <class T, class = typename std::enable_if<std::is_integral<T>::value>::type>
inline T insert_bits(T base, T insert, uint offset, uint bits) {
  typedef typename std::make_unsigned<T>::type U;
  U m = bits >= sizeof(T) * 8 ? (U)~(U)0 : (U)(((U)1 << bits) - 1);
  return (T)(((U)base & (U) ~(U)(m << offset)) | (U)(((U)insert & m) << offset));
}
inline uint reverse_bits(uint x) {
  uint r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
template <class T, class = typename std::enable_if<std::is_integral<T>::value>::type>
inline T rotate(T v, T i) {
  typedef typename std::make_unsigned<T>::type U;
  const unsigned bits = sizeof(T) * 8;
  unsigned s = (unsigned)((U)i % bits);
  return s ? (T)(((U)v << s) | ((U)v >> (bits - s))) : v;
}

namespace fast {
using metal::abs;
using metal::acos;
using metal::asin;
using metal::atan;
using metal::atan2;
using metal::ceil;
using metal::clamp;
using metal::cos;
using metal::cosh;
using metal::divide;
using metal::exp;
using metal::exp10;
using metal::exp2;
using metal::fabs;
using metal::floor;
using metal::fmax;
using metal::fmin;
using metal::fract;
using metal::length;
using metal::log;
using metal::log10;
using metal::log2;
using metal::max;
using metal::min;
using metal::normalize;
using metal::pow;
using metal::powr;
using metal::rint;
using metal::round;
using metal::rsqrt;
using metal::saturate;
using metal::sin;
using metal::sinh;
using metal::sqrt;
using metal::tan;
using metal::tanh;
using metal::trunc;
}  // namespace fast
namespace precise {
using namespace metal::fast;
}

// ================================================================= synchronisation
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((unsigned)a | (unsigned)b); }

inline void threadgroup_barrier(mem_flags, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  mtl_rt::barrier_tg(file, line);
}
inline void simdgroup_barrier(mem_flags, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  mtl_rt::exchange(nullptr, 0, nullptr, "simdgroup_barrier", file, line);
}

// ================================================================= SIMD-group functions
// Each is a rendezvous of the SIMD-group's lanes (mtl_rt::exchange): the value of every active lane
// is visible to every lane afterwards; inactive lanes read as the run's poison pattern.
template <class T>
struct simd_all_values {
  T v[32];
  unsigned mask;
  unsigned lane;
};
template <class T>
inline void simd_gather(simd_all_values<T>& a, const T& x, const char* what, const char* file, int line) {
  static_assert(sizeof(T) <= MTL_RT_SLOT, "metal_emu: SIMD-group value too large");
  a.mask = mtl_rt::exchange((const void*)&x, (int)sizeof(T), (void*)a.v, what, file, line);
  a.lane = mtl_rt::cur_info()->lane;
}
#define MTL_SITE const char *file = __builtin_FILE(), int line = __builtin_LINE()

// Reduce the live lanes in [first_lane, last_lane) of a gathered SIMD-group with `opexpr` (in r, y).
#define MTL_REDUCE_LANES(name, opexpr, first_lane, last_lane)           \
  template <class T>                                                    \
  inline T name(T x, MTL_SITE) {                                        \
    simd_all_values<T> a;                                               \
    simd_gather(a, x, #name, file, line);                               \
    T r = x;                                                            \
    bool first = true;                                                  \
    for (unsigned i = (first_lane); i < (last_lane); ++i) {             \
      if (!(a.mask >> i & 1u)) continue;                                \
      const T& y = a.v[i];                                              \
      if (first) {                                                      \
        r = y;                                                          \
        first = false;                                                  \
      } else {                                                          \
        r = T(opexpr);                                                  \
      }                                                                 \
    }                                                                   \
    return r;                                                           \
  }
#define MTL_SIMD_REDUCE(name, opexpr) MTL_REDUCE_LANES(name, opexpr, 0u, 32u)
MTL_SIMD_REDUCE(simd_sum, r + y)
MTL_SIMD_REDUCE(simd_product, r * y)
MTL_SIMD_REDUCE(simd_max, max(r, y))
MTL_SIMD_REDUCE(simd_min, min(r, y))
MTL_SIMD_REDUCE(simd_and, r & y)
MTL_SIMD_REDUCE(simd_or, r | y)
MTL_SIMD_REDUCE(simd_xor, r ^ y)
#undef MTL_SIMD_REDUCE

#define MTL_SIMD_PREFIX(name, opexpr, inclusive, init)                 \
  template <class T>                                                   \
  inline T name(T x, MTL_SITE) {                                       \
    simd_all_values<T> a;                                              \
    simd_gather(a, x, #name, file, line);                              \
    T r = T(init);                                                     \
    for (unsigned i = 0; i < (inclusive ? a.lane + 1 : a.lane); ++i) { \
      if (!(a.mask >> i & 1u)) continue;                               \
      const T& y = a.v[i];                                             \
      r = T(opexpr);                                                   \
    }                                                                  \
    return r;                                                          \
  }
MTL_SIMD_PREFIX(simd_prefix_inclusive_sum, r + y, true, 0)
MTL_SIMD_PREFIX(simd_prefix_exclusive_sum, r + y, false, 0)
MTL_SIMD_PREFIX(simd_prefix_inclusive_product, r* y, true, 1)
MTL_SIMD_PREFIX(simd_prefix_exclusive_product, r* y, false, 1)
#undef MTL_SIMD_PREFIX

template <class T>
inline T simd_shuffle(T x, ushort src, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_shuffle", file, line);
  return a.v[src & 31u];
}
template <class T>
inline T simd_broadcast(T x, ushort src, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_broadcast", file, line);
  return a.v[src & 31u];
}
template <class T>
inline T simd_broadcast_first(T x, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_broadcast_first", file, line);
  return a.v[__builtin_ctz(a.mask)];
}
template <class T>
inline T simd_shuffle_down(T x, ushort delta, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_shuffle_down", file, line);
  unsigned s = a.lane + delta;
  return s < 32 ? a.v[s] : x;
}
template <class T>
inline T simd_shuffle_up(T x, ushort delta, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_shuffle_up", file, line);
  return a.lane >= delta ? a.v[a.lane - delta] : x;
}
template <class T>
inline T simd_shuffle_xor(T x, ushort mask, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_shuffle_xor", file, line);
  return a.v[(a.lane ^ mask) & 31u];
}
template <class T>
inline T simd_shuffle_rotate_down(T x, ushort delta, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_shuffle_rotate_down", file, line);
  return a.v[(a.lane + delta) & 31u];
}
template <class T>
inline T simd_shuffle_rotate_up(T x, ushort delta, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_shuffle_rotate_up", file, line);
  return a.v[(a.lane - delta) & 31u];
}
template <class T>
inline T simd_shuffle_and_fill_down(T x, T fill, ushort delta, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_shuffle_and_fill_down", file, line);
  simd_all_values<T> f;
  simd_gather(f, fill, "simd_shuffle_and_fill_down", file, line);
  unsigned s = a.lane + delta;
  return s < 32 ? a.v[s] : f.v[s - 32];
}
template <class T>
inline T simd_shuffle_and_fill_up(T x, T fill, ushort delta, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "simd_shuffle_and_fill_up", file, line);
  simd_all_values<T> f;
  simd_gather(f, fill, "simd_shuffle_and_fill_up", file, line);
  return a.lane >= delta ? a.v[a.lane - delta] : f.v[a.lane + 32 - delta];
}
inline bool simd_all(bool x, MTL_SITE) {
  simd_all_values<bool> a;
  simd_gather(a, x, "simd_all", file, line);
  for (int i = 0; i < 32; ++i)
    if ((a.mask >> i & 1u) && !a.v[i]) return false;
  return true;
}
inline bool simd_any(bool x, MTL_SITE) {
  simd_all_values<bool> a;
  simd_gather(a, x, "simd_any", file, line);
  for (int i = 0; i < 32; ++i)
    if ((a.mask >> i & 1u) && a.v[i]) return true;
  return false;
}
struct simd_vote {
  typedef uint64_t vote_t;
  vote_t v;
  explicit simd_vote(vote_t x = 0) : v(x) {}
  explicit operator vote_t() const { return v; }
  bool all() const { return v == 0xffffffffull; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool x, MTL_SITE) {
  simd_all_values<bool> a;
  simd_gather(a, x, "simd_ballot", file, line);
  uint64_t r = 0;
  for (int i = 0; i < 32; ++i)
    if ((a.mask >> i & 1u) && a.v[i]) r |= 1ull << i;
  return simd_vote(r);
}
inline simd_vote simd_active_threads_mask(MTL_SITE) {
  simd_all_values<bool> a;
  simd_gather(a, true, "simd_active_threads_mask", file, line);
  return simd_vote(a.mask);
}
inline bool simd_is_first(MTL_SITE) {
  simd_all_values<bool> a;
  simd_gather(a, true, "simd_is_first", file, line);
  return a.lane == (unsigned)__builtin_ctz(a.mask);
}

// quad-group functions (4 consecutive lanes)
#define MTL_QUAD_REDUCE(name, opexpr) MTL_REDUCE_LANES(name, opexpr, a.lane & ~3u, (a.lane & ~3u) + 4u)
MTL_QUAD_REDUCE(quad_sum, r + y)
MTL_QUAD_REDUCE(quad_max, max(r, y))
MTL_QUAD_REDUCE(quad_min, min(r, y))
MTL_QUAD_REDUCE(quad_product, r * y)
#undef MTL_QUAD_REDUCE
template <class T>
inline T quad_shuffle(T x, ushort src, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "quad_shuffle", file, line);
  return a.v[(a.lane & ~3u) | (src & 3u)];
}
template <class T>
inline T quad_broadcast(T x, ushort src, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "quad_broadcast", file, line);
  return a.v[(a.lane & ~3u) | (src & 3u)];
}
template <class T>
inline T quad_shuffle_xor(T x, ushort mask, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "quad_shuffle_xor", file, line);
  return a.v[(a.lane & ~3u) | ((a.lane ^ mask) & 3u)];
}
template <class T>
inline T quad_shuffle_down(T x, ushort delta, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "quad_shuffle_down", file, line);
  unsigned q = (a.lane & 3u) + delta;
  return q < 4 ? a.v[(a.lane & ~3u) | q] : x;
}
template <class T>
inline T quad_shuffle_up(T x, ushort delta, MTL_SITE) {
  simd_all_values<T> a;
  simd_gather(a, x, "quad_shuffle_up", file, line);
  unsigned q = a.lane & 3u;
  return q >= delta ? a.v[a.lane - delta] : x;
}

// ================================================================= simdgroup_matrix
// An 8x8 matrix is spread over the 32 lanes, two consecutive columns of one row per lane, in the
// layout Apple GPUs use (as relied on by MLX's steel/gemm/mma.h and tinygrad's Metal WMMA emulation):
//   row = ((lane / 4) & 4) + (lane / 2) % 4,   col = ((lane / 4) & 2) * 2 + (lane % 2) * 2 + {0, 1}.
inline void simdgroup_coord(unsigned lane, unsigned& row, unsigned& col) {
  unsigned q = lane / 4;
  row = (q & 4u) + (lane / 2) % 4;
  col = (q & 2u) * 2 + (lane % 2) * 2;
}
template <class T, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "metal_emu: only 8x8 simdgroup matrices are emulated");
  vec<T, 2> frag;
  simdgroup_matrix() = default;
  // a diagonal matrix with `d` on the diagonal
  explicit simdgroup_matrix(T d) {
    unsigned r, c;
    simdgroup_coord(mtl_rt::cur_info()->lane, r, c);
    frag.v[0] = r == c ? d : T(0);
    frag.v[1] = r == c + 1 ? d : T(0);
  }
  vec<T, 2>& thread_elements() { return frag; }
  const vec<T, 2>& thread_elements() const { return frag; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int R, int C>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> m;
  m.frag = vec<T, 2>(v);
  return m;
}
// matrix_origin = (column, row) of the top-left element in the source; with transpose_matrix the
// matrix read at that origin is transposed.
template <class T, class U, int R, int C>
inline void simdgroup_load(simdgroup_matrix<T, R, C>& d, const U* src, ulong elements_per_row = C,
                           vec<ulong, 2> matrix_origin = vec<ulong, 2>(0ul), bool transpose_matrix = false) {
  static_assert(std::is_same<typename std::remove_cv<U>::type, T>::value,
                "metal_emu: simdgroup_load source element type must match the matrix type");
  unsigned r, c;
  simdgroup_coord(mtl_rt::cur_info()->lane, r, c);
  for (int k = 0; k < 2; ++k) {
    ulong rr = transpose_matrix ? c + k : r, cc = transpose_matrix ? r : c + k;
    d.frag.v[k] = src[(matrix_origin.y + rr) * elements_per_row + matrix_origin.x + cc];
  }
}
template <class T, class U, int R, int C>
inline void simdgroup_store(const simdgroup_matrix<T, R, C>& a, U* dst, ulong elements_per_row = C,
                            vec<ulong, 2> matrix_origin = vec<ulong, 2>(0ul), bool transpose_matrix = false) {
  static_assert(std::is_same<U, T>::value, "metal_emu: simdgroup_store destination type must match the matrix type");
  unsigned r, c;
  simdgroup_coord(mtl_rt::cur_info()->lane, r, c);
  for (int k = 0; k < 2; ++k) {
    ulong rr = transpose_matrix ? c + k : r, cc = transpose_matrix ? r : c + k;
    dst[(matrix_origin.y + rr) * elements_per_row + matrix_origin.x + cc] = a.frag.v[k];
  }
}
template <class TA, class TB, class TC>
struct simdgroup_mma_frags {
  vec<TA, 2> a;
  vec<TB, 2> b;
  vec<TC, 2> c;
};
// d = a * b + c, a collective of the SIMD-group: accumulates in float, rounds to d's type
template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b,
                                          const simdgroup_matrix<TC, 8, 8>& c, MTL_SITE) {
  simdgroup_mma_frags<TA, TB, TC> mine;
  mine.a = a.frag;
  mine.b = b.frag;
  mine.c = c.frag;
  simd_all_values<simdgroup_mma_frags<TA, TB, TC>> all;
  simd_gather(all, mine, "simdgroup_multiply_accumulate", file, line);
  if (all.mask != 0xffffffffu)
    mtl_rt::fail_check("divergent-collective",
                       "simdgroup_multiply_accumulate at %s:%d needs all 32 lanes of the SIMD-group "
                       "(active mask 0x%08x)",
                       file, line, all.mask);
  float A[8][8], B[8][8], Cm[8][8];
  for (unsigned l = 0; l < 32; ++l) {
    unsigned r, col;
    simdgroup_coord(l, r, col);
    for (int k = 0; k < 2; ++k) {
      A[r][col + k] = (float)all.v[l].a.v[k];
      B[r][col + k] = (float)all.v[l].b.v[k];
      Cm[r][col + k] = (float)all.v[l].c.v[k];
    }
  }
  unsigned r, col;
  simdgroup_coord(all.lane, r, col);
  for (int k = 0; k < 2; ++k) {
    float s = Cm[r][col + k];
    for (int j = 0; j < 8; ++j) s += A[r][j] * B[j][col + k];
    d.frag.v[k] = TD(s);
  }
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b, MTL_SITE) {
  simdgroup_matrix<TD, 8, 8> z = make_filled_simdgroup_matrix<TD, 8, 8>(TD(0));
  simdgroup_multiply_accumulate(d, a, b, z, file, line);
}

// ================================================================= atomics
// Fibers share one OS thread and never switch inside these, so plain operations are atomic.
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel, memory_order_seq_cst };
template <class T>
struct atomic {
  T v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;
template <class T, class U>
inline void atomic_store_explicit(atomic<T>* p, U v, memory_order) {
  p->v = T(v);
}
template <class T>
inline T atomic_load_explicit(const atomic<T>* p, memory_order) {
  return p->v;
}
template <class T, class U>
inline T atomic_exchange_explicit(atomic<T>* p, U v, memory_order) {
  T o = p->v;
  p->v = T(v);
  return o;
}
template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* p, T* expected, U desired, memory_order,
                                                  memory_order) {
  if (p->v == *expected) {
    p->v = T(desired);
    return true;
  }
  *expected = p->v;
  return false;
}
#define MTL_ATOMIC_RMW(name, expr)                                  \
  template <class T, class U>                                       \
  inline T name(atomic<T>* p, U arg, memory_order) {                \
    T o = p->v;                                                     \
    T b = T(arg);                                                   \
    p->v = T(expr);                                                 \
    return o;                                                       \
  }
MTL_ATOMIC_RMW(atomic_fetch_add_explicit, o + b)
MTL_ATOMIC_RMW(atomic_fetch_sub_explicit, o - b)
MTL_ATOMIC_RMW(atomic_fetch_max_explicit, o < b ? b : o)
MTL_ATOMIC_RMW(atomic_fetch_min_explicit, b < o ? b : o)
MTL_ATOMIC_RMW(atomic_fetch_and_explicit, o & b)
MTL_ATOMIC_RMW(atomic_fetch_or_explicit, o | b)
MTL_ATOMIC_RMW(atomic_fetch_xor_explicit, o ^ b)
#undef MTL_ATOMIC_RMW
#undef MTL_SITE

}  // namespace metal

// half literals: 0.5h
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wliteral-suffix"
constexpr half operator"" h(long double v) { return (half)v; }
constexpr half operator"" h(unsigned long long v) { return (half)v; }
#pragma GCC diagnostic pop

#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.78539816339744830962f
#define M_1_PI_F 0.31830988618379067154f
#define M_2_PI_F 0.63661977236758134308f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.43429448190325182765f
#define M_LN2_F 0.69314718055994530942f
#define M_LN10_F 2.30258509299404568402f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.70710678118654752440f
#define MAXFLOAT __FLT_MAX__
#define HUGE_VALF __builtin_huge_valf()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__

// threadgroup variable declarations in kernel source are rewritten to this: one allocation per
// threadgroup per declaration, shared by its lanes, poisoned, counted against the 32 KiB limit.
namespace mtl_rt {
template <class T, int SITE>
inline T* tg_alloc() {
  static const int slot = new_slot();
  return (T*)tg_get(slot, sizeof(T));
}
inline metal::vec<unsigned, 3> u3(const unsigned* p) { return metal::vec<unsigned, 3>(p[0], p[1], p[2]); }
}  // namespace mtl_rt
