// cuda_emu: just enough CUDA to run mlx_fastops' kernel bodies on the CPU.
//
// Every thread is a cooperative fiber (ucontext) on one OS thread. Up to WINDOW blocks are resident
// at once; blocks start in index order as earlier ones finish, as on a GPU. A thread runs until it
// reaches __syncthreads, a warp collective (__shfl_xor_sync, __syncwarp, mma.sync), __nanosleep (a spin loop
// waiting for another block: it lets the others run) or its end. When no thread can run, the
// scheduler completes the collectives whose lanes have all arrived, the barriers of blocks whose
// live threads all wait at them, retires finished blocks and starts new ones, and reports a
// deadlock otherwise (a shuffle whose mask names a lane that left the loop, a barrier some threads
// never reach). With WINDOW > 1 the threads of different blocks interleave, newest block first, so a
// block that reads another block's results without waiting for them reads poison.
// __shared__ arrays live in a per-block arena, filled with 0xFF bytes (NaN, -1) when the block
// starts, so a read before any write shows (the Python side rewrites each declaration).
// Atomics are plain (one OS thread); fences are no-ops.
#pragma once
#include <algorithm>
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

enum { READY = 0, AT_BARRIER = 1, AT_WARP = 2, DONE = 3, FREE = 4 };

struct Lane {
  ucontext_t ctx;
  dim3 tid;
  int slot = 0;
  int state = FREE;
  unsigned mask = 0;     // warp collective: participating lanes
  int src = 0;           // lane whose value this lane receives
  uint64_t val = 0, res = 0;
};

struct Slot {              // one resident block
  bool active = false;
  long long seq = 0;       // admission order
  dim3 block;
  std::vector<std::vector<char>> shared;   // by declaration id
};

struct State {
  std::vector<Lane> lanes;   // WINDOW * threads per block, never reallocated while fibers live
  std::vector<Slot> slots;
  std::vector<char> stacks;
  ucontext_t sched;
  int cur = -1, nthreads = 0;
  dim3 grid, dim;
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

// The calling block's __shared__ array number `id` (n bytes), poisoned when first touched.
inline void* shared_slot(int id, size_t n) {
  State& s = S();
  Slot& b = s.slots[s.lanes[s.cur].slot];
  if ((int)b.shared.size() <= id) b.shared.resize(id + 1);
  if (b.shared[id].empty()) b.shared[id].assign(n, (char)0xFF);
  return b.shared[id].data();
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
#define blockIdx (::cuemu::S().slots[::cuemu::S().lanes[::cuemu::S().cur].slot].block)
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
inline void __nanosleep(unsigned) { ::cuemu::yield_as(::cuemu::READY); }
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
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
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

#include "cuda_mma.h"   // mma.sync and packed half FMAs, from the shuffles above

namespace cuemu {

// Complete the warp collectives whose lanes have all arrived; true if any completed.
inline bool release_warps(int base, int n) {
  State& s = S();
  bool any = false;
  for (int w0 = base; w0 < base + n; w0 += 32) {
    const int wn = base + n - w0 < 32 ? base + n - w0 : 32;
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

inline void start_block(int slot, dim3 block, long long seq) {
  State& s = S();
  constexpr size_t kStack = 128 * 1024;
  Slot& b = s.slots[slot];
  b.active = true;
  b.seq = seq;
  b.block = block;
  b.shared.clear();
  for (int t = 0; t < s.nthreads; ++t) {
    Lane& l = s.lanes[slot * s.nthreads + t];
    l = Lane();
    l.slot = slot;
    l.state = READY;
    l.tid.x = t % s.dim.x;
    l.tid.y = (t / s.dim.x) % s.dim.y;
    l.tid.z = t / (s.dim.x * s.dim.y);
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = s.stacks.data() + kStack * (slot * s.nthreads + t);
    l.ctx.uc_stack.ss_size = kStack;
    l.ctx.uc_link = nullptr;
    makecontext(&l.ctx, lane_main, 0);
  }
}

// Run the grid with up to `window` resident blocks; "" or an error message.
inline std::string run_grid(int window) {
  State& s = S();
  constexpr size_t kStack = 128 * 1024;
  const long long nblocks = (long long)s.grid.x * s.grid.y * s.grid.z;
  if (window > nblocks) window = (int)nblocks;
  s.slots.assign(window, Slot());
  s.lanes.assign((size_t)window * s.nthreads, Lane());
  if (s.stacks.size() < kStack * s.lanes.size()) s.stacks.resize(kStack * s.lanes.size());
  long long next = 0;
  auto block_of = [&](long long i) {
    return dim3{(unsigned)(i % s.grid.x), (unsigned)((i / s.grid.x) % s.grid.y), (unsigned)(i / ((long long)s.grid.x * s.grid.y))};
  };
  for (int k = 0; k < window; ++k, ++next) start_block(k, block_of(next), next);
  std::vector<int> order(window);
  unsigned long long rng = 0x9E3779B97F4A7C15ull;
  for (;;) {
    // newest block first: a block that reads what older ones have not written yet (a missing
    // wait) reads poison instead of being rescued by the order of the emulation
    for (int k = 0; k < window; ++k) order[k] = k;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return s.slots[a].seq > s.slots[b].seq; });
    bool ran = false;
    for (int rank = 0; rank < window; ++rank) {
      const int k = order[rank];
      if (!s.slots[k].active) continue;
      // older blocks run less often (1 pass in 1 + 2 * rank, pseudo-random, seeded): blocks drift
      // apart as on a GPU, so a later group can overtake an earlier one it forgot to wait for
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      if (rank > 0 && (rng >> 33) % (1 + 2 * rank) != 0) continue;
      for (int t = k * s.nthreads; t < (k + 1) * s.nthreads; ++t) {
        if (s.lanes[t].state != READY) continue;
        s.cur = t;
        swapcontext(&s.sched, &s.lanes[t].ctx);
        ran = true;
        if (!s.err.empty()) return s.err;
      }
    }
    // collectives, barriers and retirements every pass: a spinning thread (__nanosleep) is always
    // ready, and the blocks it waits for may be parked at a barrier
    bool progress = false, any_active = false;
    for (int k = 0; k < window; ++k) {
      if (!s.slots[k].active) continue;
      any_active = true;
      const int base = k * s.nthreads;
      if (release_warps(base, s.nthreads)) progress = true;
      if (!s.err.empty()) return s.err;
      int done = 0, barrier = 0, warp = 0;
      for (int t = base; t < base + s.nthreads; ++t) {
        done += s.lanes[t].state == DONE;
        barrier += s.lanes[t].state == AT_BARRIER;
        warp += s.lanes[t].state == AT_WARP;
      }
      if (done == s.nthreads) {   // retire; start the next block in index order
        s.slots[k].active = false;
        if (next < nblocks) {
          start_block(k, block_of(next), next);
          ++next;
        }
        progress = true;
      } else if (warp == 0 && barrier > 0 && barrier + done == s.nthreads) {
        for (int t = base; t < base + s.nthreads; ++t)
          if (s.lanes[t].state == AT_BARRIER) s.lanes[t].state = READY;
        progress = true;
      }
    }
    if (!any_active) return "";
    if (progress || ran) continue;
    bool ready = false;   // the ready threads were all skipped this pass
    for (auto& l : s.lanes) ready |= l.state == READY;
    if (ready) continue;
    int barrier = 0, warp = 0, done = 0;
    for (auto& l : s.lanes) {
      barrier += l.state == AT_BARRIER;
      warp += l.state == AT_WARP;
      done += l.state == DONE;
    }
    return "deadlock: " + std::to_string(barrier) + " threads at __syncthreads, " + std::to_string(warp) +
           " at warp collectives whose lanes never all arrive, " + std::to_string(done) + " finished";
  }
}

}  // namespace cuemu

extern "C" int cuemu_launch(void (*entry)(void**), void** args, unsigned gx, unsigned gy, unsigned gz,
                            unsigned bx, unsigned by, unsigned bz, int window, char* err, int errlen) {
  using namespace cuemu;
  State& s = S();
  s.entry = entry;
  s.args = args;
  s.err.clear();
  s.grid = dim3{gx, gy, gz};
  s.dim = dim3{bx, by, bz};
  s.nthreads = (int)(bx * by * bz);
  std::string e = run_grid(window < 1 ? 1 : window);
  if (!e.empty()) {
    snprintf(err, errlen, "%s", e.c_str());
    return 1;
  }
  return 0;
}
