// The threads of the int4 decoder stack's parallel regions (decoder_layer.cpp, int4_gemm.cpp,
// attention.cpp, int8_screen.cpp): workers created once, and regions in which no thread waits for
// another to start.
//
// Why: with OpenMP (at::parallel_for) a region gives each thread a fixed share and ends at a
// barrier, so a thread that the OS has descheduled holds up everyone: on the 2-core machine with
// other processes running, 99% of a 2-thread pass of the stack was that wait, and 8-14% on a quiet
// machine (~150 regions per pass of SmolLM2-135M). The floor it chases: a region takes the time of
// its work spread over the threads that are actually running, plus one claim of a chunk per chunk.
//
// How: a region [begin, end) is cut into one contiguous segment per thread (the calling thread
// has the first). Each thread claims chunks from the front of its own segment, then steals
// chunks from the others' (from the back of a segment whose owner is at work on its front, else
// from its front), large ones first, then smaller ones: a quarter of what a segment has left, so
// a chunk claimed late finishes soon after the rest. The calling thread
// works too, and waits only for chunks that another thread has claimed and not finished; a
// worker that has not woken up yet claims nothing, and its segment is done by the others.
// Contiguous segments matter where a region streams memory (a one-row matrix product reads
// each weight once): each thread reads one long run of addresses, which the hardware
// prefetchers and the product's own prefetching follow; chunks handed out in turn from one
// counter (EYAS_POOL_SPLIT=chunks, kept for comparisons: scripts/ab-pool-split.py) make each
// thread jump between short runs; so handed out, Qwen2.5-Coder-1.5B's one-row pass took 5-9%
// longer than with one fixed half per thread (OpenMP's). Where one thread runs a whole region
// (the other descheduled), it still reads it front to back.
// Idle workers spin for a short while (the next region of a pass is microseconds away), then
// sleep on a futex, so an idle server burns no core. Each worker sleeps on a word of its own, and
// a region wakes only the workers it runs on: after torch.set_num_threads lowers the count (from
// 7 to 2, say), the workers beyond it sleep at once and stay asleep. (With one word for all, each
// region woke every worker and each spun for its while: 5 spinning threads on 2 cores made every
// later int4 pass 2-3x slower.)
// A chunk's values must not depend on how the range was cut (every caller's contract: a row, a
// block of columns, an attention work item computes the same bits in any chunk on any thread).
//
// Threads: at::get_num_threads() (torch.set_num_threads / OMP_NUM_THREADS) at each region; one
// thread runs the plain loop, no pool. The pool is never destroyed (its workers sleep until the
// process exits); after fork() the child's caller simply does every chunk itself.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EYAS_PAUSE() _mm_pause()
#else
#define EYAS_PAUSE() ((void)0)
#endif

namespace eyas {

// How a region is handed out (the header): 0 contiguous segments per thread with stealing (the
// default), 1 chunks in turn from one counter. Either gives the same bits (every caller's
// contract); the choice only moves time.
enum class PoolSplit : int { segments = 0, chunks = 1 };
inline std::atomic<int>& pool_split() {
  static std::atomic<int> split{int(PoolSplit::segments)};
  return split;
}

inline std::string pool_split_name() { return pool_split().load() == int(PoolSplit::chunks) ? "chunks" : "segments"; }

inline void set_pool_split(const std::string& name) {
  TORCH_CHECK(name == "segments" || name == "chunks", "pool split: 'segments' or 'chunks', not '", name, "'");
  pool_split().store(int(name == "chunks" ? PoolSplit::chunks : PoolSplit::segments));
}

// True on a pool worker, and on the calling thread while it runs a region's chunks: a region
// inside a region runs as a plain loop, and phase timers (phase_timer.h) ignore these threads.
inline bool& in_pool_region() {
  static thread_local bool inside = false;
  return inside;
}

class WorkerPool {
 public:
  static WorkerPool& instance() {
    static WorkerPool* pool = new WorkerPool();  // never destroyed: see the header
    return *pool;
  }

  // body(first, last) over chunks of [begin, end), none shorter than `grain` (but the last),
  // on `threads` threads (this one included). Returns the nanoseconds (on `clock`, when given)
  // this thread waited for chunks that others had claimed. Rethrows the first exception a chunk
  // threw, after every chunk has run.
  template <typename F>
  int64_t run(int64_t begin, int64_t end, int64_t grain, int threads, const F& body, int64_t (*clock)() = nullptr) {
    std::lock_guard<std::mutex> one_region(region_mutex_);  // regions of two calling threads take turns
    ensure_workers(threads - 1);
    // 1. Publish the region: mark the word as being written, set the job, then the new word.
    const uint64_t generation = (word_.load(std::memory_order_relaxed) >> kGenerationShift) + 1;
    word_.store(pack(generation, 0) | kWriting, std::memory_order_seq_cst);
    job_call_.store(&call<F>, std::memory_order_relaxed);
    job_body_.store(&body, std::memory_order_relaxed);
    job_begin_.store(begin, std::memory_order_relaxed);
    job_count_.store(end - begin, std::memory_order_relaxed);
    job_grain_.store(std::max<int64_t>(grain, 1), std::memory_order_relaxed);
    job_threads_.store(threads, std::memory_order_relaxed);
    const int64_t count = end - begin;
    const bool segmented = pool_split().load(std::memory_order_relaxed) == int(PoolSplit::segments) &&
                           threads <= kMaxSegments && count <= kSegmentOffsetMask;
    job_segmented_.store(segmented, std::memory_order_relaxed);
    for (int i = 0; segmented && i < threads; ++i)
      segments_[i].word.store(pack_segment(generation, count * i / threads, count * (i + 1) / threads),
                              std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    failed_.store(false, std::memory_order_relaxed);
    word_.store(pack(generation, 0), std::memory_order_seq_cst);
    for (int i = 0; i + 1 < threads; ++i) {  // the workers this region runs on, where asleep
      Slot& slot = slots_[i];
      if (slot.sleeping.load(std::memory_order_seq_cst)) {
        slot.wake.fetch_add(1, std::memory_order_seq_cst);
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&slot.wake), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
      }
    }
    // 2. Work like a worker, then wait for the chunks still running elsewhere.
    in_pool_region() = true;
    work(generation, 0);
    in_pool_region() = false;
    int64_t waited = 0;
    if (done_.load(std::memory_order_acquire) < count) {
      const int64_t started = clock ? clock() : 0;
      for (int spins = 0; done_.load(std::memory_order_acquire) < count; ++spins) {
        if (spins < kCallerSpins) EYAS_PAUSE();
        else sched_yield();  // the chunk's thread may share this core
      }
      if (clock) waited = clock() - started;
    }
    if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
    return waited;
  }

  // How many times each worker has woken from its futex sleep (tests check that the workers
  // beyond a region's thread count are not woken).
  std::vector<int64_t> wakeups() {
    std::lock_guard<std::mutex> one_region(region_mutex_);
    std::vector<int64_t> counts;
    for (const Slot& slot : slots_) counts.push_back(slot.wakeups.load(std::memory_order_relaxed));
    return counts;
  }

 private:
  // A worker's futex word, whether it sleeps on it, and how often it woke.
  struct alignas(64) Slot {
    std::atomic<uint32_t> wake{0};
    std::atomic<int> sleeping{0};
    std::atomic<int64_t> wakeups{0};
  };

  // The word: generation (high bits), a "being written" flag, the offset of the next unclaimed
  // index from the region's begin (low 40 bits).
  static constexpr int kGenerationShift = 41;
  static constexpr uint64_t kWriting = uint64_t(1) << 40, kOffsetMask = kWriting - 1;
  static constexpr int kCallerSpins = 20000;  // ~0.1-0.5 ms of pause before yielding the core
  static constexpr std::chrono::microseconds kWorkerSpin{200};  // then a worker sleeps

  static uint64_t pack(uint64_t generation, int64_t offset) { return (generation << kGenerationShift) | uint64_t(offset); }

  // A segment's word: the generation's low 23 bits, whether its owner has claimed a chunk yet,
  // then its next unclaimed offset from the front and the end of what is unclaimed at the back
  // (offsets from the region's begin, 20 bits each). A region longer than that, or with more
  // threads than segments, is split in chunks.
  static constexpr int kMaxSegments = 64, kSegmentOffsetBits = 20, kSegmentStartedShift = 2 * kSegmentOffsetBits;
  static constexpr uint64_t kSegmentOffsetMask = (uint64_t(1) << kSegmentOffsetBits) - 1;
  static constexpr uint64_t kSegmentStarted = uint64_t(1) << kSegmentStartedShift;
  static constexpr int kSegmentGenerationShift = kSegmentStartedShift + 1;
  static constexpr uint64_t kSegmentGenerationMask = (uint64_t(1) << (64 - kSegmentGenerationShift)) - 1;
  static uint64_t pack_segment(uint64_t generation, int64_t front, int64_t back) {
    return ((generation & kSegmentGenerationMask) << kSegmentGenerationShift) |
           (uint64_t(front) << kSegmentOffsetBits) | uint64_t(back);
  }

  template <typename F>
  static void call(const void* body, int64_t first, int64_t last) {
    (*static_cast<const F*>(body))(first, last);
  }

  WorkerPool() = default;

  void ensure_workers(int wanted) {  // under region_mutex_
    while (int(slots_.size()) < wanted) {
      const int index = int(slots_.size());
      Slot& slot = slots_.emplace_back();  // a deque: the slots already handed out stay put
      std::thread([this, index, &slot] { worker(index, slot); }).detach();
    }
  }

  // Whether the newest published region runs on worker `index` (a region being written, or one
  // already seen, does not).
  bool wanted(int index, uint64_t seen) const {
    const uint64_t word = word_.load(std::memory_order_seq_cst);
    return (word >> kGenerationShift) != seen && !(word & kWriting) &&
           index + 1 < job_threads_.load(std::memory_order_relaxed);
  }

  // Sleeps on the worker's own word until a region that runs on it is published (the caller of
  // `run` wakes only those); the sleeping flag is set before the region is checked, and the caller
  // publishes the region before it reads the flag, so no wake-up is lost.
  void sleep(int index, uint64_t seen, Slot& slot) {
    slot.sleeping.store(1, std::memory_order_seq_cst);
    const uint32_t ticket = slot.wake.load(std::memory_order_seq_cst);
    if (!wanted(index, seen)) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&slot.wake), FUTEX_WAIT_PRIVATE, ticket, nullptr, nullptr, 0);
      slot.wakeups.fetch_add(1, std::memory_order_relaxed);
    }
    slot.sleeping.store(0, std::memory_order_seq_cst);
  }

  // Claims and runs chunks of region `generation` until none is left or a newer region began;
  // `segment` is this thread's place (0 for the calling thread, a worker's index + 1).
  void work(uint64_t generation, int segment) {
    // The job's fields are consistent for `generation` if the word still carries it unflagged
    // after reading them (the caller flags the word before writing a new job).
    using Call = void (*)(const void*, int64_t, int64_t);
    const Call body_call = job_call_.load(std::memory_order_relaxed);
    const void* body = job_body_.load(std::memory_order_relaxed);
    const int64_t begin = job_begin_.load(std::memory_order_relaxed), count = job_count_.load(std::memory_order_relaxed);
    const int64_t grain = job_grain_.load(std::memory_order_relaxed);
    const int64_t threads = job_threads_.load(std::memory_order_relaxed);
    const bool segmented = job_segmented_.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    const uint64_t word = word_.load(std::memory_order_relaxed);
    if ((word >> kGenerationShift) != (generation & ((uint64_t(1) << (64 - kGenerationShift)) - 1)) ||
        (word & kWriting))
      return;
    const auto run_chunk = [&](int64_t first, int64_t last) {
      try {
        body_call(body, begin + first, begin + last);
      } catch (...) {
        if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
      }
    };
    // the items this thread ran, counted once at the end (one write to the shared counter)
    const int64_t finished = segmented ? work_segments(generation, segment, int(threads), grain, run_chunk)
                                       : work_chunks(generation, count, grain, threads, run_chunk);
    done_.fetch_add(finished, std::memory_order_release);
  }

  // Chunks from the front of segment `own`, then from the others': from the back of a segment
  // whose owner has started on it, else from its front (where one thread runs the whole region,
  // it reads it front to back). Returns the items run.
  template <typename Run>
  int64_t work_segments(uint64_t generation, int own, int threads, int64_t grain, const Run& run_chunk) {
    const uint64_t tag = generation & kSegmentGenerationMask;
    int64_t finished = 0;
    for (int step = 0; step < threads; ++step) {
      std::atomic<uint64_t>& segment = segments_[(own + step) % threads].word;
      uint64_t word = segment.load(std::memory_order_relaxed);
      while ((word >> kSegmentGenerationShift) == tag) {  // else a newer region's: nothing left here
        const int64_t first = int64_t((word >> kSegmentOffsetBits) & kSegmentOffsetMask);
        const int64_t last = int64_t(word & kSegmentOffsetMask);
        if (first >= last) break;
        // a quarter of what the segment has left: a chunk held by a descheduled thread delays
        // the region by little, and the claims stay few
        const int64_t take = std::min(last - first, std::max(grain, (last - first) / 4));
        const bool front = step == 0 || !(word & kSegmentStarted);
        const uint64_t claimed = (front ? pack_segment(generation, first + take, last)
                                        : pack_segment(generation, first, last - take)) |
                                 (step == 0 ? kSegmentStarted : word & kSegmentStarted);
        if (!segment.compare_exchange_weak(word, claimed, std::memory_order_acq_rel, std::memory_order_relaxed))
          continue;
        if (front) run_chunk(first, first + take);
        else run_chunk(last - take, last);
        finished += take;
        word = segment.load(std::memory_order_relaxed);
      }
    }
    return finished;
  }

  // Chunks in turn from the region's one counter. Returns the items run.
  template <typename Run>
  int64_t work_chunks(uint64_t generation, int64_t count, int64_t grain, int64_t threads, const Run& run_chunk) {
    int64_t finished = 0;
    uint64_t word = word_.load(std::memory_order_relaxed);
    while (true) {
      if ((word >> kGenerationShift) != (generation & ((uint64_t(1) << (64 - kGenerationShift)) - 1)) ||
          (word & kWriting))
        break;
      const int64_t offset = int64_t(word & kOffsetMask);
      if (offset >= count) break;
      // a quarter of a thread's share of what is left (as work_segments)
      const int64_t take = std::min(count - offset, std::max(grain, (count - offset) / (4 * threads)));
      if (!word_.compare_exchange_weak(word, word + uint64_t(take), std::memory_order_acq_rel,
                                       std::memory_order_relaxed))
        continue;
      run_chunk(offset, offset + take);
      finished += take;
      word = word_.load(std::memory_order_relaxed);
    }
    return finished;
  }

  [[noreturn]] void worker(int index, Slot& slot) {
    in_pool_region() = true;
    uint64_t seen = word_.load(std::memory_order_acquire) >> kGenerationShift;
    while (true) {
      // 1. Wait for a newer region: spin, then sleep.
      uint64_t word = word_.load(std::memory_order_acquire);
      const auto spin_until = std::chrono::steady_clock::now() + kWorkerSpin;
      for (int spins = 0; (word >> kGenerationShift) == seen || (word & kWriting); ++spins) {
        EYAS_PAUSE();
        if ((spins & 63) == 63 && std::chrono::steady_clock::now() > spin_until) {
          sleep(index, seen, slot);
          spins = 0;
        }
        word = word_.load(std::memory_order_acquire);
      }
      seen = word >> kGenerationShift;
      // 2. Join it, unless it wants fewer threads than this worker's place: then sleep at once,
      // until a region that runs on this worker wakes it.
      if (index + 1 < job_threads_.load(std::memory_order_relaxed)) work(seen, index + 1);
      else sleep(index, seen, slot);
    }
  }

  std::mutex region_mutex_;
  std::deque<Slot> slots_;  // one per worker, in its index's order: the workers started
  alignas(64) std::atomic<uint64_t> word_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<void (*)(const void*, int64_t, int64_t)> job_call_{nullptr};
  std::atomic<const void*> job_body_{nullptr};
  std::atomic<int64_t> job_begin_{0}, job_count_{0}, job_grain_{1}, job_threads_{1};
  std::atomic<bool> job_segmented_{false};
  struct alignas(64) Segment {
    std::atomic<uint64_t> word{0};
  };
  Segment segments_[kMaxSegments];
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
};

// body(first, last) over [begin, end) on the pool: a plain loop where one thread is set, the
// range is at most `grain` long, or this thread is already inside a region (or an OpenMP one).
// Returns the nanoseconds this thread waited for other threads' chunks (on `clock`, if given).
template <typename F>
int64_t pool_for(int64_t begin, int64_t end, int64_t grain, const F& body, int64_t (*clock)() = nullptr) {
  if (begin >= end) return 0;
  const int threads = at::get_num_threads();
  if (threads <= 1 || end - begin <= grain || in_pool_region() || at::in_parallel_region()) {
    body(begin, end);
    return 0;
  }
  return WorkerPool::instance().run(begin, end, grain, threads, body, clock);
}

}  // namespace eyas
