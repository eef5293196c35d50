// metal_emu runtime: runs one Metal kernel dispatch on the CPU.
//
// Every threadgroup runs its lanes as cooperative fibers (ucontext) on one OS thread. Lanes run until
// they block at a threadgroup barrier or a SIMD-group collective (or finish); when no lane can run, the
// scheduler releases the rendezvous that are complete, or reports why none can be (divergence, early
// return before a barrier, deadlock). Device buffers sit against PROT_NONE guard pages so that
// out-of-bounds accesses fault; the fault is turned into an error message naming the buffer.
//
// Compiled once into runtime.o and linked into every kernel .so (each .so has its own state).

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <ucontext.h>
#include <unistd.h>

#include "runtime_api.h"

extern "C" void mtl_emu_lane_entry(void** bufs);  // generated per kernel (build.py)

namespace {

enum LaneState { READY = 0, BLOCK_TG = 1, BLOCK_SG = 2, DONE = 3 };

constexpr int kSimdWidth = 32;
constexpr size_t kStackSize = 256 * 1024;
constexpr size_t kTgLimit = 32 * 1024;

struct Lane {
  ucontext_t ctx;
  int state;
  const char* wfile;
  int wline;
  const char* wwhat;
  int wsize;
  mtl_rt::LaneInfo info;
};

struct SimdGroup {
  unsigned gen;
  unsigned release_mask[2];
  alignas(16) unsigned char slots[2][kSimdWidth][MTL_RT_SLOT];
};

struct Buffer {
  char* map;
  size_t map_len;
  char* data;
  size_t size;
  char* guard_lo_begin;  // [begin, end) of the pages that fault
  char* guard_lo_end;
  char* guard_hi_begin;
  char* guard_hi_end;
  const char* name;
};

struct TgSlot {
  char* map;
  size_t map_len;
  char* data;
  size_t size;
  bool at_end;
  unsigned long long gen;
};

// ---- global state (one dispatch at a time per .so) ----
char* g_stacks = nullptr;  // kMaxLanes stacks, each with a guard page at its low end
size_t g_stack_stride = 0;
constexpr int kMaxLanes = 1024;
Lane g_lanes[kMaxLanes];
SimdGroup g_sgs[kMaxLanes / kSimdWidth];
int g_nlanes = 0;
int g_order[kMaxLanes];
Lane* g_cur = nullptr;
ucontext_t g_sched_ctx;
void** g_bufs = nullptr;

Buffer g_buffers[64];
int g_nbuffers = 0;

TgSlot g_tg_slots[256];
int g_n_tg_slots = 0;
unsigned long long g_tg_gen = 0;
size_t g_tg_bytes = 0;
unsigned char g_tg_poison = 0xFF;
int g_strict_collectives = 1;
bool g_data_at_end = true;  // guard mode of this dispatch: data against the upper (true) or lower guard page

sigjmp_buf g_jmp;
char g_err[4096];
char g_sigstack[64 * 1024];
volatile sig_atomic_t g_in_launch = 0;


void vfail(const char* check, const char* fmt, va_list ap) {
  int n = snprintf(g_err, sizeof g_err, "%s: ", check);
  vsnprintf(g_err + n, sizeof g_err - n, fmt, ap);
  siglongjmp(g_jmp, 1);
}

[[noreturn]] void fail(const char* check, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(check, fmt, ap);
  va_end(ap);
  __builtin_unreachable();
}

size_t page_size() {
  static size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// A region of `size` bytes with a PROT_NONE page on each side; `at_end` places the data against the
// upper guard page (exact end, catches overflow); otherwise against the lower one (catches underflow).
void guarded_alloc(size_t size, bool at_end, char** map, size_t* map_len, char** data) {
  size_t ps = page_size();
  size_t body = round_up(size ? size : 1, ps);
  size_t len = body + 2 * ps;
  char* m = (char*)mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) fail("internal", "mmap of %zu bytes failed", len);
  mprotect(m, ps, PROT_NONE);
  mprotect(m + ps + body, ps, PROT_NONE);
  *map = m;
  *map_len = len;
  *data = at_end ? m + ps + body - size : m + ps;
}

void ensure_stacks() {
  if (g_stacks) return;
  size_t ps = page_size();
  g_stack_stride = kStackSize + ps;
  g_stacks = (char*)mmap(nullptr, g_stack_stride * kMaxLanes, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (g_stacks == MAP_FAILED) {
    g_stacks = nullptr;
    fail("internal", "cannot allocate lane stacks");
  }
  // guard pages are added lazily (guard_stacks): 1024 up front split the mapping into 2049 VMAs per
  // loaded kernel .so, and ~32 kernels exhausted vm.max_map_count (65530) in one process.
}

int g_guarded = 0;  // lane stacks [0, g_guarded) have their guard page

void guard_stacks(int n) {
  for (; g_guarded < n && g_guarded < kMaxLanes; ++g_guarded)
    mprotect(g_stacks + g_guarded * g_stack_stride, page_size(), PROT_NONE);
}

const char* describe_addr(char* a, char* out, size_t outlen) {
  for (int i = 0; i < g_nbuffers; ++i) {
    Buffer& b = g_buffers[i];
    if (a >= b.guard_hi_begin && a < b.guard_hi_end) {
      snprintf(out, outlen,
               "access to device buffer '%s' at byte %td, past its end (size %zu bytes)", b.name,
               a - b.data, b.size);
      return out;
    }
    if (a >= b.guard_lo_begin && a < b.guard_lo_end) {
      snprintf(out, outlen, "access to device buffer '%s' at byte %td, before its start (size %zu bytes)",
               b.name, a - b.data, b.size);
      return out;
    }
  }
  for (int i = 0; i < g_n_tg_slots; ++i) {
    TgSlot& s = g_tg_slots[i];
    size_t ps = page_size();
    if (s.map && ((a >= s.map && a < s.map + ps) || (a >= s.map + s.map_len - ps && a < s.map + s.map_len))) {
      snprintf(out, outlen, "access to a threadgroup array (%zu bytes) at byte %td, outside it", s.size,
               a - s.data);
      return out;
    }
  }
  if (g_stacks && a >= g_stacks && a < g_stacks + g_stack_stride * kMaxLanes) {
    snprintf(out, outlen, "lane stack overflow (more than %zu KiB of thread-private memory)",
             kStackSize / 1024);
    return out;
  }
  snprintf(out, outlen, "invalid memory access at %p (wild pointer, or a misaligned vector access)", (void*)a);
  return out;
}

void on_signal(int sig, siginfo_t* si, void*) {
  if (!g_in_launch) {
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  if (sig == SIGALRM) {
    snprintf(g_err, sizeof g_err,
             "timeout: the dispatch ran longer than the watchdog allows (a spin-wait on memory another "
             "lane or threadgroup writes never ends under the emulator's cooperative scheduling, or an "
             "endless loop)");
    siglongjmp(g_jmp, 1);
  }
  char desc[512];
  describe_addr((char*)si->si_addr, desc, sizeof desc);
  const char* check = "out-of-bounds";
  if (strstr(desc, "stack overflow")) check = "stack-overflow";
  else if (strstr(desc, "invalid memory")) check = (sig == SIGFPE) ? "arithmetic-fault" : "invalid-access";
  if (sig == SIGFPE) {
    snprintf(g_err, sizeof g_err, "arithmetic-fault: integer division by zero or overflow in lane");
  } else {
    snprintf(g_err, sizeof g_err, "%s: %s", check, desc);
  }
  if (g_cur) {
    size_t n = strlen(g_err);
    snprintf(g_err + n, sizeof g_err - n, " [thread_position_in_grid=(%u,%u,%u)]", g_cur->info.tpig[0],
             g_cur->info.tpig[1], g_cur->info.tpig[2]);
  }
  siglongjmp(g_jmp, 1);
}

void lane_main() {
  mtl_emu_lane_entry(g_bufs);
  g_cur->state = DONE;
  // returning switches to uc_link (the scheduler)
}

void yield_to_scheduler() {
  Lane* me = g_cur;
  swapcontext(&me->ctx, &g_sched_ctx);
}

// linear lane id list "0-3,7"
void fmt_lanes(char* out, size_t n, const int* ids, int cnt) {
  size_t used = 0;
  out[0] = 0;
  for (int i = 0; i < cnt && used + 16 < n; ++i) {
    int a = ids[i], b = a;
    while (i + 1 < cnt && ids[i + 1] == b + 1) b = ids[++i];
    used += snprintf(out + used, n - used, "%s%d", used ? "," : "", a);
    if (b != a) used += snprintf(out + used, n - used, "-%d", b);
  }
}

const char* site(const char* file, int line, char* buf, size_t n) {
  snprintf(buf, n, "%s:%d", file ? file : "?", line);
  return buf;
}

void group_desc(char* out, size_t n) {
  Lane& l = g_lanes[0];
  snprintf(out, n, "threadgroup (%u,%u,%u)", l.info.tgpig[0], l.info.tgpig[1], l.info.tgpig[2]);
}

// Releases complete rendezvous. Returns true if some lane became runnable; fails on divergence.
bool release() {
  bool any = false;
  int nsg = (g_nlanes + kSimdWidth - 1) / kSimdWidth;
  char gd[64], s1[256], s2[256], lanes[256];
  group_desc(gd, sizeof gd);
  bool all_tg = true;  // every live lane of the threadgroup is at a threadgroup barrier
  for (int s = 0; s < nsg; ++s) {
    int lo = s * kSimdWidth, hi = lo + kSimdWidth < g_nlanes ? lo + kSimdWidth : g_nlanes;
    int n_sg = 0, n_tg = 0, n_done = 0;
    Lane* first = nullptr;
    for (int i = lo; i < hi; ++i) {
      int st = g_lanes[i].state;
      if (st == BLOCK_SG) {
        ++n_sg;
        if (!first) first = &g_lanes[i];
      } else if (st == BLOCK_TG) {
        ++n_tg;
      } else if (st == DONE) {
        ++n_done;
      }
    }
    if (n_sg + n_tg + n_done < hi - lo) return true;  // someone is runnable (should not happen)
    if (n_sg == 0) continue;
    all_tg = false;
    if (n_tg > 0) {
      int ids[kSimdWidth], c = 0;
      Lane* tgl = nullptr;
      for (int i = lo; i < hi; ++i)
        if (g_lanes[i].state == BLOCK_TG) {
          ids[c++] = i - lo;
          if (!tgl) tgl = &g_lanes[i];
        }
      fmt_lanes(lanes, sizeof lanes, ids, c);
      fail("divergent-collective",
           "in %s, simdgroup %d: some lanes wait at %s (%s) while lanes %s wait at threadgroup_barrier "
           "(%s); SIMD-group functions and barriers must be reached by all lanes together",
           gd, s, first->wwhat, site(first->wfile, first->wline, s1, sizeof s1), lanes,
           site(tgl->wfile, tgl->wline, s2, sizeof s2));
    }
    // all waiting lanes must be at the same call site
    for (int i = lo; i < hi; ++i) {
      Lane& l = g_lanes[i];
      if (l.state == BLOCK_SG && (l.wline != first->wline || l.wfile != first->wfile || l.wwhat != first->wwhat)) {
        fail("divergent-collective",
             "in %s, simdgroup %d: lanes wait at different SIMD-group operations: %s at %s and %s at %s "
             "(a collective inside divergent control flow)",
             gd, s, first->wwhat, site(first->wfile, first->wline, s1, sizeof s1), l.wwhat,
             site(l.wfile, l.wline, s2, sizeof s2));
      }
    }
    if (n_done > 0 && g_strict_collectives) {
      int ids[kSimdWidth], c = 0;
      for (int i = lo; i < hi; ++i)
        if (g_lanes[i].state == DONE) ids[c++] = i - lo;
      fmt_lanes(lanes, sizeof lanes, ids, c);
      fail("divergent-collective",
           "in %s, simdgroup %d: %s at %s is called while lanes %s of the SIMD-group have already "
           "returned (divergent control flow: the result covers only the active lanes; set "
           "METAL_EMU_STRICT_COLLECTIVES=0 if that is intended)",
           gd, s, first->wwhat, site(first->wfile, first->wline, s1, sizeof s1), lanes);
    }
    SimdGroup& g = g_sgs[s];
    unsigned mask = 0;
    for (int i = lo; i < hi; ++i)
      if (g_lanes[i].state == BLOCK_SG) {
        mask |= 1u << (i - lo);
        g_lanes[i].state = READY;
      }
    g.release_mask[g.gen & 1] = mask;
    g.gen++;
    any = true;
  }
  if (any || !all_tg) return any;
  // every live lane is at a threadgroup barrier (or done)
  Lane* first = nullptr;
  int done_ids[kMaxLanes], nd = 0, nlive = 0;
  for (int i = 0; i < g_nlanes; ++i) {
    Lane& l = g_lanes[i];
    if (l.state == DONE) {
      done_ids[nd++] = i;
      continue;
    }
    ++nlive;
    if (!first) first = &l;
    if (l.wline != first->wline || l.wfile != first->wfile) {
      fail("divergent-barrier",
           "in %s: lanes wait at different threadgroup_barrier calls (%s and %s); a barrier must be "
           "reached by all lanes of the threadgroup at the same call",
           gd, site(first->wfile, first->wline, s1, sizeof s1), site(l.wfile, l.wline, s2, sizeof s2));
    }
  }
  if (nlive == 0) return false;
  if (nd > 0) {
    fmt_lanes(lanes, sizeof lanes, done_ids, nd);
    fail("early-return-before-barrier",
         "in %s: lanes (thread_index_in_threadgroup) %s returned while the other lanes wait at "
         "threadgroup_barrier (%s); every lane must reach every barrier",
         gd, lanes, site(first->wfile, first->wline, s1, sizeof s1));
  }
  for (int i = 0; i < g_nlanes; ++i) g_lanes[i].state = READY;
  return true;
}

uint64_t rng_next(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

void make_order(int n, int mode, uint64_t& seed) {
  for (int i = 0; i < n; ++i) g_order[i] = mode == 1 ? n - 1 - i : i;
  if (mode == 2) {
    for (int i = n - 1; i > 0; --i) {
      int j = (int)(rng_next(seed) % (uint64_t)(i + 1));
      int t = g_order[i];
      g_order[i] = g_order[j];
      g_order[j] = t;
    }
  }
}

void run_group(const unsigned grid[3], const unsigned tg[3], const unsigned gpos[3], const unsigned ngroups[3],
               int lane_mode, uint64_t& seed) {
  unsigned sz[3];
  for (int a = 0; a < 3; ++a) {
    unsigned origin = gpos[a] * tg[a];
    sz[a] = grid[a] - origin < tg[a] ? grid[a] - origin : tg[a];
  }
  int n = (int)(sz[0] * sz[1] * sz[2]);
  int dn = (int)(tg[0] * tg[1] * tg[2]);
  g_nlanes = n;
  guard_stacks(n);
  g_tg_gen++;
  g_tg_bytes = 0;
  for (int s = 0; s < (n + kSimdWidth - 1) / kSimdWidth; ++s) {
    g_sgs[s].gen = 0;
    memset(g_sgs[s].slots, 0xFF, sizeof g_sgs[s].slots);
  }
  int i = 0;
  for (unsigned z = 0; z < sz[2]; ++z)
    for (unsigned y = 0; y < sz[1]; ++y)
      for (unsigned x = 0; x < sz[0]; ++x, ++i) {
        Lane& l = g_lanes[i];
        mtl_rt::LaneInfo& I = l.info;
        unsigned loc[3] = {x, y, z};
        for (int a = 0; a < 3; ++a) {
          I.tpitg[a] = loc[a];
          I.tgpig[a] = gpos[a];
          I.tpig[a] = gpos[a] * tg[a] + loc[a];
          I.tptg[a] = sz[a];
          I.dtptg[a] = tg[a];
          I.tpg[a] = grid[a];
          I.tgpg[a] = ngroups[a];
          I.gorigin[a] = 0;
        }
        I.tid = (unsigned)i;
        I.lane = (unsigned)i % kSimdWidth;
        I.sgid = (unsigned)i / kSimdWidth;
        I.sg_per_tg = (unsigned)(n + kSimdWidth - 1) / kSimdWidth;
        I.dsg_per_tg = (unsigned)(dn + kSimdWidth - 1) / kSimdWidth;
        I.qlane = (unsigned)i % 4;
        I.qgid = (unsigned)i / 4;
        I.qg_per_tg = (unsigned)(n + 3) / 4;
        I.dqg_per_tg = (unsigned)(dn + 3) / 4;
        l.state = READY;
        l.wfile = nullptr;
        l.wline = 0;
        l.wwhat = nullptr;
        getcontext(&l.ctx);
        l.ctx.uc_stack.ss_sp = g_stacks + i * g_stack_stride + page_size();
        l.ctx.uc_stack.ss_size = kStackSize;
        l.ctx.uc_link = &g_sched_ctx;
        makecontext(&l.ctx, lane_main, 0);
      }
  make_order(n, lane_mode, seed);
  int live = n;
  while (live > 0) {
    bool ran = false;
    for (int k = 0; k < n; ++k) {
      Lane& l = g_lanes[g_order[k]];
      if (l.state != READY) continue;
      g_cur = &l;
      swapcontext(&g_sched_ctx, &l.ctx);
      g_cur = nullptr;
      ran = true;
      if (l.state == DONE) --live;
    }
    if (live == 0) break;
    if (!release() && !ran) {
      char gd[64], s1[256];
      group_desc(gd, sizeof gd);
      Lane* w = nullptr;
      for (int k = 0; k < n; ++k)
        if (g_lanes[k].state != DONE) {
          w = &g_lanes[k];
          break;
        }
      fail("deadlock", "in %s: no lane can make progress; lane %u waits at %s (%s)", gd, w->info.tid,
           w->state == BLOCK_TG ? "threadgroup_barrier" : (w->wwhat ? w->wwhat : "?"),
           site(w->wfile, w->wline, s1, sizeof s1));
    }
  }
  // final check: a SIMD rendezvous can never be left pending once every lane is done
}

}  // namespace

namespace mtl_rt {

LaneInfo* cur_info() { return &g_cur->info; }

void fail_check(const char* check, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(check, fmt, ap);
  va_end(ap);
  __builtin_unreachable();
}

void barrier_tg(const char* file, int line) {
  Lane* me = g_cur;
  me->state = BLOCK_TG;
  me->wfile = file;
  me->wline = line;
  me->wwhat = "threadgroup_barrier";
  yield_to_scheduler();
}

unsigned exchange(const void* mine, int size, void* all, const char* what, const char* file, int line) {
  Lane* me = g_cur;
  if (size > MTL_RT_SLOT) fail("internal", "SIMD-group exchange of %d bytes (max %d)", size, MTL_RT_SLOT);
  SimdGroup& g = g_sgs[me->info.sgid];
  unsigned buf = g.gen & 1;
  if (size) memcpy(g.slots[buf][me->info.lane], mine, (size_t)size);
  me->state = BLOCK_SG;
  me->wfile = file;
  me->wline = line;
  me->wwhat = what;
  me->wsize = size;
  yield_to_scheduler();
  unsigned mask = g.release_mask[buf];
  if (all && size) {
    unsigned char* out = (unsigned char*)all;
    for (int i = 0; i < kSimdWidth; ++i) {
      if (mask & (1u << i)) memcpy(out + i * size, g.slots[buf][i], (size_t)size);
      else memset(out + i * size, g_tg_poison, (size_t)size);  // inactive lane: this run's poison
    }
  }
  return mask;
}

void* tg_get(int slot, size_t size) {
  if (slot >= g_n_tg_slots) {
    if (slot >= 256) fail("internal", "too many threadgroup declarations");
    g_n_tg_slots = slot + 1;
  }
  TgSlot& s = g_tg_slots[slot];
  if (!s.map || s.size != size || s.at_end != g_data_at_end) {
    if (s.map) munmap(s.map, s.map_len);
    guarded_alloc(size, g_data_at_end, &s.map, &s.map_len, &s.data);
    s.size = size;
    s.at_end = g_data_at_end;
    s.gen = 0;
  }
  if (s.gen != g_tg_gen) {
    s.gen = g_tg_gen;
    memset(s.data, g_tg_poison, size);
    g_tg_bytes += size;
    if (g_tg_bytes > kTgLimit) {
      fail("threadgroup-memory-limit",
           "threadgroup memory of %zu bytes exceeds the 32 KiB (32768 bytes) Apple GPUs allow per "
           "threadgroup (the array that crossed the limit has %zu bytes)",
           g_tg_bytes, size);
    }
  }
  return s.data;
}

int new_slot() {
  static int n = 0;
  return n++;
}

}  // namespace mtl_rt

extern "C" {

// bufs: host copies (in/out); sizes in bytes; names; is_output flags. grid/tg already clamped.
// group_order: linear group ids in the order to run them. lane_mode: 0 forward, 1 reverse, 2 shuffle.
// guard_mode: 0 data against the upper guard page (overflow), 1 against the lower one (underflow).
int mtl_emu_launch(int nbufs, void** host, const unsigned long long* sizes, const char** names,
                   const int* is_output, const unsigned* grid, const unsigned* tg, const long long* group_order,
                   long long ngroups_total, int lane_mode, unsigned long long seed, int tg_poison,
                   int guard_mode, int strict_collectives, int timeout_s, char* err, int errlen) {
  err[0] = 0;
  if (nbufs > 64) {
    snprintf(err, errlen, "internal: too many buffers");
    return 1;
  }
  unsigned tgc[3], ngroups[3];
  long long nthreads_tg = 1;
  for (int a = 0; a < 3; ++a) {
    tgc[a] = tg[a] < grid[a] ? tg[a] : grid[a];
    if (tgc[a] == 0) tgc[a] = 1;
    ngroups[a] = grid[a] == 0 ? 0 : (grid[a] + tgc[a] - 1) / tgc[a];
    nthreads_tg *= tgc[a];
  }
  if (nthreads_tg > kMaxLanes) {
    snprintf(err, errlen,
             "threadgroup-size: threadgroup of %lld threads exceeds 1024 (MLX raises above the pipeline's "
             "maxTotalThreadsPerThreadgroup)",
             nthreads_tg);
    return 1;
  }
  g_tg_poison = (unsigned char)tg_poison;
  g_data_at_end = guard_mode == 0;
  g_strict_collectives = strict_collectives;
  void* dev[64];
  struct sigaction sa, old_segv, old_bus, old_fpe, old_alrm;
  stack_t ss, old_ss;
  int rc = 0;
  g_nbuffers = 0;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  ss.ss_sp = g_sigstack;
  ss.ss_size = sizeof g_sigstack;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  sigaction(SIGFPE, &sa, &old_fpe);
  sigaction(SIGALRM, &sa, &old_alrm);
  g_in_launch = 1;
  if (sigsetjmp(g_jmp, 1) == 0) {
    ensure_stacks();
    size_t ps = page_size();
    for (int i = 0; i < nbufs; ++i) {
      Buffer& b = g_buffers[i];
      guarded_alloc(sizes[i], guard_mode == 0, &b.map, &b.map_len, &b.data);
      g_nbuffers = i + 1;
      b.size = sizes[i];
      b.name = names[i];
      b.guard_lo_begin = b.map;
      b.guard_lo_end = b.map + ps;
      b.guard_hi_begin = b.map + b.map_len - ps;
      b.guard_hi_end = b.map + b.map_len;
      // canary in the slack between data and the far guard page: writes there are checked afterwards
      memset(b.map + ps, 0xA5, b.map_len - 2 * ps);
      memcpy(b.data, host[i], sizes[i]);
      dev[i] = b.data;
    }
    g_bufs = dev;
    if (timeout_s > 0) alarm((unsigned)timeout_s);
    uint64_t s = seed ? seed : 0x9E3779B97F4A7C15ull;
    for (long long k = 0; k < ngroups_total; ++k) {
      long long gid = group_order[k];
      unsigned gpos[3];
      gpos[0] = (unsigned)(gid % ngroups[0]);
      gpos[1] = (unsigned)((gid / ngroups[0]) % ngroups[1]);
      gpos[2] = (unsigned)(gid / ((long long)ngroups[0] * ngroups[1]));
      run_group(grid, tgc, gpos, ngroups, lane_mode, s);
    }
    alarm(0);
    for (int i = 0; i < nbufs; ++i) {
      Buffer& b = g_buffers[i];
      char* lo = b.map + ps;
      char* hi = b.map + b.map_len - ps;
      for (char* p = lo; p < hi; ++p) {
        if (p >= b.data && p < b.data + b.size) {
          p = b.data + b.size - 1;
          continue;
        }
        if ((unsigned char)*p != 0xA5) {
          snprintf(g_err, sizeof g_err,
                   "out-of-bounds: write to device buffer '%s' at byte %td, outside its %zu bytes", b.name,
                   p - b.data, (size_t)b.size);
          siglongjmp(g_jmp, 1);
        }
      }
      if (is_output[i]) memcpy(host[i], b.data, sizes[i]);
    }
  } else {
    alarm(0);
    rc = 1;
    snprintf(err, errlen, "%s", g_err);
  }
  g_in_launch = 0;
  g_cur = nullptr;
  for (int i = 0; i < g_nbuffers; ++i) munmap(g_buffers[i].map, g_buffers[i].map_len);
  g_nbuffers = 0;
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaction(SIGFPE, &old_fpe, nullptr);
  sigaction(SIGALRM, &old_alrm, nullptr);
  sigaltstack(&old_ss, nullptr);
  return rc;
}

}  // extern "C"
