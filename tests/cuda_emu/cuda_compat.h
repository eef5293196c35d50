// cuda_emu: just enough CUDA to run mlx_fastops' kernel bodies on the CPU, one block at a time.
//
// Every thread of a block is a cooperative fiber (ucontext) on one OS thread. A thread runs until it
// reaches __syncthreads, a warp collective (__shfl_xor_sync, __syncwarp) or its end; when no thread
// can run, the scheduler completes the collectives whose lanes have all arrived, then the barrier
// once every live thread waits at it, and reports a deadlock otherwise (e.g. a shuffle whose mask
// names a lane that left the loop, or a barrier some threads never reach).
// __shared__ variables become statics (blocks run one after another) that are filled with 0xFF bytes
// (NaN, -1) before every block but the first, so a read before any write shows (the Python side
// rewrites each declaration to register it). Atomics are plain (one OS thread); fences are no-ops.
#pragma once
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __grid_constant__

namespace cuemu {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

enum { READY = 0, AT_BARRIER = 1, AT_WARP = 2, DONE = 3 };

struct Lane {
  ucontext_t ctx;
  dim3 tid;
  int state = READY;
  unsigned mask = 0;     // warp collective: participating lanes
  int src = 0;           // lane whose value this lane receives
  uint64_t val = 0, res = 0;
};

struct Region {
  void* p;
  size_t n;
};

struct State {
  std::vector<Region> shared;
  std::vector<Lane> lanes;
  std::vector<char> stacks;
  ucontext_t sched;
  int cur = -1;
  dim3 block, grid, dim;
  void (*entry)(void**) = nullptr;
  void** args = nullptr;
  std::string err;
};

inline State& S() {
  static State s;
  return s;
}

inline void yield_as(int state) {
  State& s = S();
  s.lanes[s.cur].state = state;
  swapcontext(&s.lanes[s.cur].ctx, &s.sched);
}

inline void shared_region(void* p, size_t n) {
  for (auto& r : S().shared)
    if (r.p == p) return;
  S().shared.push_back(Region{p, n});
}

template <typename V>
V exchange(unsigned mask, V v, int src) {
  static_assert(sizeof(V) <= 8, "warp collectives of at most 8 bytes");
  State& s = S();
  Lane& me = s.lanes[s.cur];
  me.mask = mask;
  me.src = src;
  me.val = 0;
  std::memcpy(&me.val, &v, sizeof(V));
  yield_as(AT_WARP);
  V r;
  std::memcpy(&r, &s.lanes[s.cur].res, sizeof(V));
  return r;
}

}  // namespace cuemu

#define threadIdx (::cuemu::S().lanes[::cuemu::S().cur].tid)
#define blockIdx (::cuemu::S().block)
#define blockDim (::cuemu::S().dim)
#define gridDim (::cuemu::S().grid)

inline void __syncthreads() { ::cuemu::yield_as(::cuemu::AT_BARRIER); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  int lane = (int)(threadIdx.x & 31);
  ::cuemu::exchange<int>(mask, 0, lane);
}
template <typename V>
inline V __shfl_xor_sync(unsigned mask, V v, int offset) {
  int lane = (int)(threadIdx.x & 31);
  return ::cuemu::exchange<V>(mask, v, lane ^ offset);
}
template <typename V>
inline V __shfl_sync(unsigned mask, V v, int src) {
  return ::cuemu::exchange<V>(mask, v, src & 31);
}
inline void __threadfence() {}
inline void __nanosleep(unsigned) {}
inline void __trap() {
  ::cuemu::S().err = "__trap()";
  ::cuemu::yield_as(::cuemu::DONE);
}
inline int atomicAdd(int* p, int v) { int o = *p; *p += v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p += v; return o; }
inline float atomicAdd(float* p, float v) { float o = *p; *p += v; return o; }
template <typename P> inline P __ldg(const P* p) { return *p; }
template <typename P> inline P __ldcg(const P* p) { return *p; }

struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 0xF;
    unsigned b = (unsigned)(v >> ((sel & 7) * 8)) & 0xFF;
    if (sel & 8) b = (b & 0x80) ? 0xFF : 0;
    r |= b << (8 * i);
  }
  return r;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }

// bfloat16 with round-to-nearest-even, as __float2bfloat16 / static_cast on the GPU
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = 0x7fc0;
    } else {
      bits = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
using __half = _Float16;

namespace cuemu {

// Complete the warp collectives whose lanes have all arrived; true if any completed.
inline bool release_warps() {
  State& s = S();
  bool any = false;
  const int n = (int)s.lanes.size();
  for (int w0 = 0; w0 < n; w0 += 32) {
    const int wn = n - w0 < 32 ? n - w0 : 32;
    for (int l = 0; l < wn; ++l) {
      Lane& a = s.lanes[w0 + l];
      if (a.state != AT_WARP) continue;
      bool ok = true;
      for (int m = 0; m < wn && ok; ++m) {
        if (!(a.mask >> m & 1u)) continue;
        const Lane& b = s.lanes[w0 + m];
        ok = b.state == AT_WARP && b.mask == a.mask;
      }
      if (!ok) continue;
      for (int m = 0; m < wn; ++m) {
        if (!(a.mask >> m & 1u)) continue;
        Lane& b = s.lanes[w0 + m];
        if (!(a.mask >> b.src & 1u) || b.src >= wn) {
          s.err = "warp collective reads lane " + std::to_string(b.src) + " outside its mask";
          return false;
        }
      }
      for (int m = 0; m < wn; ++m)
        if (a.mask >> m & 1u) s.lanes[w0 + m].res = s.lanes[w0 + s.lanes[w0 + m].src].val;
      const unsigned mask = a.mask;
      for (int m = 0; m < wn; ++m)
        if (mask >> m & 1u) s.lanes[w0 + m].state = READY;
      any = true;
    }
  }
  return any;
}

inline void lane_main() {
  State& s = S();
  s.entry(s.args);
  s.lanes[s.cur].state = DONE;
  swapcontext(&s.lanes[s.cur].ctx, &s.sched);
}

// Run one block; "" or an error message.
inline std::string run_block(int nthreads) {
  State& s = S();
  constexpr size_t kStack = 128 * 1024;
  if (s.stacks.size() < kStack * nthreads) s.stacks.resize(kStack * nthreads);
  for (auto& r : s.shared) std::memset(r.p, 0xFF, r.n);
  s.lanes.assign(nthreads, Lane());
  for (int t = 0; t < nthreads; ++t) {
    Lane& l = s.lanes[t];
    l.tid.x = t % s.dim.x;
    l.tid.y = (t / s.dim.x) % s.dim.y;
    l.tid.z = t / (s.dim.x * s.dim.y);
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = s.stacks.data() + kStack * t;
    l.ctx.uc_stack.ss_size = kStack;
    l.ctx.uc_link = nullptr;
    makecontext(&l.ctx, lane_main, 0);
  }
  for (;;) {
    bool ran = false;
    for (int t = 0; t < nthreads; ++t) {
      if (s.lanes[t].state != READY) continue;
      s.cur = t;
      swapcontext(&s.sched, &s.lanes[t].ctx);
      ran = true;
    }
    if (!s.err.empty()) return s.err;
    if (ran) continue;
    if (release_warps()) continue;
    if (!s.err.empty()) return s.err;
    int done = 0, barrier = 0, warp = 0;
    for (auto& l : s.lanes) {
      done += l.state == DONE;
      barrier += l.state == AT_BARRIER;
      warp += l.state == AT_WARP;
    }
    if (done == nthreads) return "";
    if (warp == 0 && barrier > 0) {   // every live thread is at the barrier (exited ones count as arrived)
      for (auto& l : s.lanes)
        if (l.state == AT_BARRIER) l.state = READY;
      continue;
    }
    return "deadlock: " + std::to_string(barrier) + " threads at __syncthreads, " + std::to_string(warp) +
           " at warp collectives whose lanes never all arrive, " + std::to_string(done) + " finished";
  }
}

}  // namespace cuemu

extern "C" int cuemu_launch(void (*entry)(void**), void** args, unsigned gx, unsigned gy, unsigned gz,
                            unsigned bx, unsigned by, unsigned bz, char* err, int errlen) {
  using namespace cuemu;
  State& s = S();
  s.entry = entry;
  s.args = args;
  s.err.clear();
  s.grid = dim3{gx, gy, gz};
  s.dim = dim3{bx, by, bz};
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        s.block = dim3{x, y, z};
        std::string e = run_block((int)(bx * by * bz));
        if (!e.empty()) {
          snprintf(err, errlen, "block (%u, %u, %u): %s", x, y, z, e.c_str());
          return 1;
        }
      }
  return 0;
}
