// Where the time of the int4 decoder stack goes (int4_decoder_layer.cpp), phase by phase, for
// `eyas bench profile` (bench/profile.py). Off by default: a scope then reads one bool and no
// clock, so the normal path pays nothing measurable and computes the same bits either way.
//
// Exclusive time on the calling thread: every nanosecond between the outermost scope's start
// and end is charged to exactly one phase, the innermost open one (a matmul's activation
// quantization is charged to "quantize", not to the matmul around it), so the phases of a call
// add up to its wall time. Parallel regions (parallel_for below) also time each thread's share
// of the work: the time the threads of a region stand idle while another finishes (its barrier,
// and the wake-up of the workers) is moved, averaged over the threads, from the phase to
// "sync". A phase that runs on one thread (the norms, rotary, SiLU and residual loops) shows its
// whole wall time; its idle second thread is not counted as sync.
// The clock: wall time (steady_clock), or the calling thread's CPU time, which a loaded machine
// does not inflate (meaningful with one thread: a worker's time is then never waited for).
#pragma once

#include <ATen/Parallel.h>

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
  kSync,  // threads waiting at the end of parallel regions
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
  explicit PhaseScope(Phase phase) : clock_(phase_clock()), active_(clock_.enabled && at::get_thread_num() == 0 &&
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

// at::parallel_for, and when timing: the idle time of its threads moved from the current phase
// to kSync (the wall time of a region of P parts is P * wall - the parts' busy time, over P).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  PhaseClock& clock = phase_clock();
  if (!clock.enabled || clock.depth == 0 || at::in_parallel_region()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  std::atomic<int64_t> busy{0}, parts{0};
  const int64_t start = PhaseClock::now();
  at::parallel_for(begin, end, grain, [&](int64_t first, int64_t last) {
    const int64_t started = PhaseClock::now();
    f(first, last);
    busy += PhaseClock::now() - started;
    ++parts;
  });
  const int64_t wall = PhaseClock::now() - start, count = parts.load();
  if (count > 1) {
    const int64_t idle = std::max<int64_t>(0, (count * wall - busy.load()) / count);
    clock.switch_to(clock.current);  // charge the region to its phase first
    clock.ns[clock.current] -= idle;
    clock.ns[kSync] += idle;
  }
}

}  // namespace eyas
