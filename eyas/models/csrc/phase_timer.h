// Where the time of the int4 decoder stack goes (decoder_layer.cpp, int4_stack.cpp), phase by
// phase, for `eyas bench profile` (bench/profile.py). Off by default: a scope then reads one bool
// and no clock, so the normal path pays nothing measurable and computes the same bits either way.
//
// Exclusive time on the calling thread: every nanosecond between the outermost scope's start
// and end is charged to exactly one phase, the innermost open one (a matmul's activation
// quantization is charged to "quantize", not to the matmul around it), so the phases of a call
// add up to its wall time. In a parallel region (parallel_for below, on worker_pool.h) the
// calling thread works through chunks like the workers, then waits for the chunks other threads
// still run: that wait is moved from the phase to "sync". The workers' own time is not charged,
// and no scope opens inside a region: work fused into a region (a norm in the matmul's rounding
// of its input, a residual in its columns' end) is charged to the region's phase, to its own
// only where it runs on the calling thread alone (one thread, or too few rows for a region).
// The clock: wall time (steady_clock), or the calling thread's CPU time, which a loaded machine
// does not inflate (with several threads the caller's wait is then its spinning: CPU time too).
#pragma once

#include <ATen/Parallel.h>

#include "worker_pool.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>

namespace eyas {

enum Phase : int {
  kStackOther,  // checks, visible-slot lists, allocations: whatever no other phase covers
  kQkv, kO, kGateUp, kDown,  // the int4 matmuls (integer products and their float epilogue)
  kQuantize,  // rounding activations to the int8 form the matmuls multiply
  kAttention, kNorms, kRotary, kSiluMul, kResiduals,
  kSync,  // the calling thread waiting for chunks of a parallel region that other threads run
  kPhaseCount
};

inline constexpr const char* kPhaseNames[kPhaseCount] = {
    "stack_other", "qkv", "o", "gate_up", "down", "quantize", "attention", "norms", "rotary", "silu_mul",
    "residuals", "sync"};

// Which clock the timers read: false = wall time, true = this thread's CPU time.
inline bool phase_cpu_clock = false;

struct PhaseClock {
  bool enabled = false;
  Phase current = kStackOther;
  int64_t since = 0;  // ns when `current` began to be charged
  int depth = 0;  // open scopes
  std::array<int64_t, kPhaseCount> ns{};  // charged so far

  static int64_t now() {
    if (phase_cpu_clock) {
      timespec t;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
      return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
    }
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  // Charges the time since the last switch to the current phase, then makes `next` current.
  void switch_to(Phase next) {
    const int64_t t = now();
    if (depth > 0) ns[current] += t - since;
    since = t;
    current = next;
  }
};

// One clock per process, read and written by the thread that calls the stack only (the workers
// of a parallel region report to that thread through the region's own counters).
inline PhaseClock& phase_clock() {
  static PhaseClock clock;
  return clock;
}

// Charges its lifetime to `phase` (exclusive of inner scopes); nothing when timing is off.
class PhaseScope {
 public:
  explicit PhaseScope(Phase phase)
      : clock_(phase_clock()), active_(clock_.enabled && !in_pool_region() && at::get_thread_num() == 0 &&
                                       !at::in_parallel_region()) {
    if (!active_) return;
    outer_ = clock_.current;
    clock_.switch_to(phase);
    ++clock_.depth;
  }
  ~PhaseScope() {
    if (!active_) return;
    clock_.switch_to(outer_);
    --clock_.depth;
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  PhaseClock& clock_;
  bool active_;
  Phase outer_ = kStackOther;
};

// pool_for (worker_pool.h), and when timing: the calling thread's wait for other threads'
// chunks moved from the current phase to kSync.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  PhaseClock& clock = phase_clock();
  if (!clock.enabled || clock.depth == 0 || in_pool_region()) {
    pool_for(begin, end, grain, f);
    return;
  }
  const int64_t waited = pool_for(begin, end, grain, f, &PhaseClock::now);
  if (waited > 0) {
    clock.switch_to(clock.current);  // charge the region to its phase first
    clock.ns[clock.current] -= waited;
    clock.ns[kSync] += waited;
  }
}

}  // namespace eyas
