// A barrier for ranks on one host, through counters in shared memory (lightning_rec/shm_transport.py).
//
// Each rank publishes "I reached exchange k" by storing k into its own counter (release: the bytes
// it wrote into shared memory before are visible to whoever sees k), then waits until every peer's
// counter reaches k (acquire). A gloo barrier costs 0.4-1 ms on loopback TCP; this costs the
// skew between ranks plus well under 10 us.
//
// Waiting: spin briefly (a peer a few microseconds behind), then yield the core (more ranks than
// cores: the peer we wait for may need this one), then sleep in naps. Every ~50 ms it checks
// the deadline and whether a peer process still exists (/proc/<pid>/stat, state not Z or X), so a
// dead peer is reported at once instead of after the timeout.
#include <torch/extension.h>

#include "check_message.h"

#include <sched.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

bool process_alive(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  // "pid (comm) state ...": comm may hold spaces and parentheses, so read past the last ')'.
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  char* close = std::strrchr(buf, ')');
  if (close == nullptr || close[1] == '\0' || close[2] == '\0') return true;
  char state = close[2];
  return state != 'Z' && state != 'X';
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Returns -1 when every rank arrived; otherwise 2 * peer + (1 if that peer's process is gone, 0 on timeout).
int64_t shm_barrier(at::TensorList arrive, int64_t rank, int64_t k, at::IntArrayRef pids, double timeout_s) {
  const int64_t W = static_cast<int64_t>(arrive.size());
  std::vector<int64_t*> counters(W);
  for (int64_t p = 0; p < W; ++p) {
    LR_CHECK(arrive[p].scalar_type() == at::kLong && arrive[p].numel() >= 1, "shm_barrier: int64 counters");
    counters[p] = arrive[p].data_ptr<int64_t>();
  }
  __atomic_store_n(counters[rank], k, __ATOMIC_RELEASE);
  const auto start = std::chrono::steady_clock::now();
  auto next_check = start + std::chrono::milliseconds(50);
  for (int64_t p = 0; p < W; ++p) {
    if (p == rank) continue;
    int64_t spins = 0;
    while (__atomic_load_n(counters[p], __ATOMIC_ACQUIRE) < k) {
      ++spins;
      if (spins < 2000) {
        cpu_relax();
        continue;
      }
      if (spins < 4000) {
        sched_yield();
        continue;
      }
      // 20 us naps while the wait is short; 500 us once it has lasted 10 ms (a peer writing a
      // checkpoint or logging), so a long wait costs the waiting core almost nothing.
      const bool long_wait = std::chrono::steady_clock::now() - start > std::chrono::milliseconds(10);
      struct timespec nap = {0, long_wait ? 500000 : 20000};
      nanosleep(&nap, nullptr);
      if ((spins & 63) == 0) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= next_check) {
          next_check = now + std::chrono::milliseconds(50);
          if (static_cast<int64_t>(pids.size()) == W && !process_alive(pids[p])) return 2 * p + 1;
          if (timeout_s > 0 && std::chrono::duration<double>(now - start).count() > timeout_s) return 2 * p;
        }
      }
    }
  }
  return -1;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_rec, CPU, m) { m.impl("shm_barrier", &shm_barrier); }
