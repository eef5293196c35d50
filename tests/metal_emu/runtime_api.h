// Interface between kernels compiled against mtl_compat.h and the fiber runtime (runtime.cpp).
#pragma once
#include <stddef.h>

#define MTL_RT_SLOT 128  // largest value a SIMD-group function exchanges per lane, in bytes

namespace mtl_rt {

struct LaneInfo {
  unsigned tpig[3], tpitg[3], tgpig[3], tptg[3], dtptg[3], tpg[3], tgpg[3], gorigin[3];
  unsigned tid, lane, sgid, sg_per_tg, dsg_per_tg, qlane, qgid, qg_per_tg, dqg_per_tg;
};

LaneInfo* cur_info();
// Deposits `size` bytes, waits until every live lane of the SIMD-group arrives at the same call,
// copies the 32 lanes' values (poison for inactive lanes) into `all`; returns the active-lane mask.
unsigned exchange(const void* mine, int size, void* all, const char* what, const char* file, int line);
void barrier_tg(const char* file, int line);
void* tg_get(int slot, size_t size);
int new_slot();
[[noreturn]] void fail_check(const char* check, const char* fmt, ...);

}  // namespace mtl_rt
