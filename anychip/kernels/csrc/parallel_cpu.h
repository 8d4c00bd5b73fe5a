// at::parallel_for as the CPU kernels' thread pool (w4a8_cpu.cpp, head_cpu.cpp), with a guard for a machine that
// other work oversubscribes.
//
// OpenMP's fork/join makes every call wait for every thread of the team, even one that the OS has not scheduled
// yet and that would find no chunk left.  On the shared 2-core EPYC at load 5-6 that turned a decode step's 120
// SmolLM2 linears from about 8 ms (the fastest step) into 900 ms (the median step): each call waited a scheduler
// tick for the second thread.  So each parallel call measures how late its helper thread started; when two calls
// in a row pass kLateNs (a quiet machine starts it within 1-2 us, a woken one within tens), the next kSoloCalls
// calls run on the calling thread alone, with no parallel region, and then two threads are tried again.  Only the
// start is judged: a helper still busy with its last chunk after the caller's is granularity (a prefill chunk
// takes a millisecond), not load.  Outputs do not depend on the thread count: every block is computed whole by
// one thread, the same way.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace anychip {

class LoadGuard {
 public:
  static constexpr int64_t kLateNs = 200'000;  // several decode linears' worth (5-60 us each); load costs ticks (ms)
  static constexpr int64_t kSoloCalls = 256;  // about two SmolLM2 decode steps

  // The threads a call may use: `wanted`, or 1 while the guard holds.
  int64_t threads(int64_t wanted) {
    if (wanted <= 1) return wanted;
    if (solo_left_.load(std::memory_order_relaxed) > 0) {
      solo_left_.fetch_sub(1, std::memory_order_relaxed);
      return 1;
    }
    return wanted;
  }

  // Two late starts in a row: one alone is the wake-up of a helper that slept through an idle engine (a futex
  // wake of an idle vCPU), which a prefill after a pause should not pay 256 single-threaded calls for.
  void observe(int64_t late_ns) {
    if (late_ns <= kLateNs) {
      late_streak_.store(0, std::memory_order_relaxed);
    } else if (late_streak_.fetch_add(1, std::memory_order_relaxed) + 1 >= 2) {
      late_streak_.store(0, std::memory_order_relaxed);
      solo_left_.store(kSoloCalls, std::memory_order_relaxed);
    }
  }

 private:
  std::atomic<int64_t> solo_left_{0};
  std::atomic<int64_t> late_streak_{0};
};

inline LoadGuard& load_guard() {
  static LoadGuard guard;  // one per process, like the OpenMP team it watches
  return guard;
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// `work` runs once on each of `threads` threads (the caller is one of them), unless the guard holds: then once, on
// the caller.
struct TorchParallel {
  template <typename Work>
  void operator()(int64_t threads, Work&& work) const {
    threads = load_guard().threads(threads);
    if (threads <= 1) return work();
    const int64_t t0 = now_ns();
    std::atomic<int64_t> helper_start{0};
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t) {
      if (b != 0) helper_start.store(now_ns(), std::memory_order_relaxed);  // task 0 runs on the calling thread
      work();
    });
    // 0: at::parallel_for ran every task on the caller (a nested call): nothing to judge
    if (const int64_t start = helper_start.load(std::memory_order_relaxed)) load_guard().observe(start - t0);
  }
};

}  // namespace anychip
