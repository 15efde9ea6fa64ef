// The limits of this machine that every floor of eyas's CPU forward is computed from
// (models/probe.py caches them, bench/floors.py turns them into floors):
//   - read bandwidth: a buffer much larger than the last-level cache, streamed by `threads`
//     threads in short steps, `runs` times over, a high percentile of the steps' rates (bytes
//     per second);
//   - integer multiply-add peak of the instruction mix the int8 dot products run (int8dot.h):
//     vpdpbusd on 512-bit registers ("avx512vnni"), or vpmaddubsw + vpmaddwd + vpaddd on
//     256-bit ones ("avx2"), in independent chains shaped as the kernels' tiles (weight
//     registers times broadcast activations), best of `runs` short runs (multiply-adds per
//     second, one int8 x int8 product and its addition counted as one);
//   - float32 multiply-add peak of attention's arithmetic (attention.cpp): fused multiply-adds
//     on the widest registers the build has (512-bit with AVX-512, else 256-bit), in chains
//     shaped as its scores (key registers times queries broadcast from memory), best of `runs`
//     short runs (multiply-adds per second, one float32 lane counted as one).
// Floor it chases: none; it measures them. Registered as torch.ops.eyas.* (any source file of
// the extension can add operators that way; the Python module's bindings live elsewhere).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "int8dot.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace eyas {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// `work(thread)` on `threads` threads at once, `runs` times; the shortest wall time of a run
// (every thread starts after one barrier and the clock stops after the last one finishes).
template <typename Work>
double best_seconds(int64_t threads, int64_t runs, Work work) {
  double best = std::numeric_limits<double>::infinity();
  double started = 0.0;
#pragma omp parallel num_threads(int(threads))
  {
    const int thread = omp_get_thread_num();
    for (int64_t run = 0; run < runs; ++run) {
#pragma omp barrier
#pragma omp master
      started = now();
#pragma omp barrier
      work(thread);
#pragma omp barrier
#pragma omp master
      best = std::min(best, now() - started);
    }
  }
  return best;
}

typedef int64_t Lanes __attribute__((vector_size(64)));  // one 64-byte line: 512-bit or 2 x 256-bit loads

// Sum of a slice as 64-byte vectors, four independent chains (the loads, not the additions,
// set the pace).
int64_t read_slice(const Lanes* data, int64_t count) {
  Lanes a = {}, b = {}, c = {}, d = {};
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    a += data[i];
    b += data[i + 1];
    c += data[i + 2];
    d += data[i + 3];
  }
  for (; i < count; ++i) a += data[i];
  const Lanes all = a + b + c + d;
  int64_t total = 0;
  for (int k = 0; k < 8; ++k) total += all[k];
  return total;
}

volatile int64_t sink;  // keeps the sums (and so the loads) alive

// Streams the buffer `runs` times in steps: at each step every thread reads its next 4 MB
// (threads start together after a barrier, the clock stops after the last one), so a step runs
// well inside one scheduler time slice. The rate of a step is threads x 4 MB over its time; the
// result is the 90th percentile of the steps' rates: a step during which a thread waited for a
// core is slow and falls below it, and no single step decides. The buffer is much larger than
// the last-level cache and read in order, so every step reads memory, not cache.
double read_bandwidth(int64_t threads, int64_t megabytes, int64_t runs) {
  TORCH_CHECK(threads >= 1 && megabytes >= 1 && runs >= 1, "threads, megabytes and runs must be >= 1");
  constexpr int64_t kStepLines = (int64_t(4) << 20) / 64;  // 4 MB per thread and step
  const int64_t steps = std::max<int64_t>(1, megabytes * (int64_t(1) << 20) / 64 / (kStepLines * threads));
  const int64_t lines = steps * kStepLines * threads;
  Lanes* data = static_cast<Lanes*>(std::aligned_alloc(64, lines * 64));
  TORCH_CHECK(data != nullptr, "could not allocate ", megabytes, " MB for the bandwidth probe");
  std::vector<double> rates(steps * runs);
  double started = 0.0;
#pragma omp parallel num_threads(int(threads))
  {
    const int64_t thread = omp_get_thread_num();
    for (int64_t step = 0; step < steps; ++step)  // first touch by the thread that reads the lines
      std::memset(static_cast<void*>(data + (step * threads + thread) * kStepLines), 1, kStepLines * 64);
    for (int64_t run = 0; run < runs; ++run) {
      for (int64_t step = 0; step < steps; ++step) {
#pragma omp barrier
#pragma omp master
        started = now();
#pragma omp barrier
        sink = read_slice(data + (step * threads + thread) * kStepLines, kStepLines);
#pragma omp barrier
#pragma omp master
        rates[run * steps + step] = double(threads * kStepLines * 64) / (now() - started);
      }
    }
  }
  std::free(data);
  std::sort(rates.begin(), rates.end());
  return rates[std::min<int64_t>(rates.size() - 1, int64_t(0.9 * rates.size()))];
}

constexpr int64_t kIterations = 20000;  // per run: 20,000 x 16 instructions, ~0.1-0.3 ms

// The kernels' shape (int4_gemm.cpp's tiles): a few registers of weight bytes, each multiplied
// by every row's 4 activation bytes broadcast from memory, one accumulator per (row, register).
// Chains that all read one pair of source registers, the shape this probe had before, ran at
// 84 G multiply-adds/s a thread on an AMD Zen 4 where this shape and the kernels run at ~200 G;
// and on AVX2 the compiler hoisted their loop-invariant products out of the loop, so that only
// the additions were timed.
alignas(64) const int32_t kActivations[256] = {
#define EYAS_ROW(b) b + 1, b + 7, b + 13, b + 29, b + 37, b + 43, b + 59, b + 61
#define EYAS_ROWS(b) EYAS_ROW(b), EYAS_ROW(b + 64), EYAS_ROW(b + 128), EYAS_ROW(b + 192)
    EYAS_ROWS(0), EYAS_ROWS(256), EYAS_ROWS(512), EYAS_ROWS(768),
    EYAS_ROWS(1024), EYAS_ROWS(1280), EYAS_ROWS(1536), EYAS_ROWS(1792),
#undef EYAS_ROWS
#undef EYAS_ROW
};

// Row r's 4 activation bytes at iteration k (the array cycles through 64 groups of 4 rows).
inline int32_t activation(int64_t k, int r) { return kActivations[(k & 63) * 4 + r]; }

#ifdef EYAS_VNNI
// 4 weight registers x 4 rows: 16 independent vpdpbusd chains, 16 x 64 multiply-adds per
// iteration.
int64_t vnni_chains(int32_t seed) {
  __m512i w[4], acc[16];
  for (int j = 0; j < 4; ++j) w[j] = _mm512_set1_epi32(seed * (j + 3));
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_epi32(i + seed);
  for (int64_t k = 0; k < kIterations; ++k) {
    for (int r = 0; r < 4; ++r) {
      const __m512i x = _mm512_set1_epi32(activation(k, r));
      for (int j = 0; j < 4; ++j) acc[4 * r + j] = _mm512_dpbusd_epi32(acc[4 * r + j], w[j], x);
    }
    __asm__ volatile("" : "+v"(w[0]), "+v"(w[1]), "+v"(w[2]), "+v"(w[3]));  // opaque weights
  }
  __m512i total = acc[0];
  for (int i = 1; i < 16; ++i) total = _mm512_add_epi32(total, acc[i]);
  return _mm512_reduce_add_epi32(total);
}
#endif

#ifdef EYAS_AVX2
// 4 weight registers x 2 rows: 8 independent chains of vpmaddubsw + vpmaddwd + vpaddd, 8 x 32
// multiply-adds per iteration, as the avx2 kernels multiply.
int64_t avx2_chains(int32_t seed) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i w[4], acc[8];
  for (int j = 0; j < 4; ++j) w[j] = _mm256_set1_epi32(seed * (j + 3));
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi32(i + seed);
  for (int64_t k = 0; k < kIterations; ++k) {
    for (int r = 0; r < 2; ++r) {
      const __m256i x = _mm256_set1_epi32(activation(k, r));
      for (int j = 0; j < 4; ++j)
        acc[4 * r + j] = _mm256_add_epi32(acc[4 * r + j], _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], x), ones));
    }
    __asm__ volatile("" : "+x"(w[0]), "+x"(w[1]), "+x"(w[2]), "+x"(w[3]));  // opaque weights
  }
  __m256i total = acc[0];
  for (int i = 1; i < 8; ++i) total = _mm256_add_epi32(total, acc[i]);
  int32_t lanes[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), total);
  int64_t sum = 0;
  for (int i = 0; i < 8; ++i) sum += lanes[i];
  return sum;
}
#endif

// 4 key registers x 3 queries broadcast from memory: 12 independent chains of fused
// multiply-adds (attention.cpp score_vectors: up to 8 queries per key vector), kFloatLanes
// multiply-adds each per instruction. The keys stay opaque to the compiler, as the weights above.
alignas(64) const float kQueries[64] = {
#define EYAS_QUERY(b) b * 1e-6f, (b + 3) * 1e-6f, (b + 5) * 1e-6f, (b + 11) * 1e-6f
#define EYAS_QUERIES(b) EYAS_QUERY(b), EYAS_QUERY(b + 16), EYAS_QUERY(b + 32), EYAS_QUERY(b + 48)
    EYAS_QUERIES(1), EYAS_QUERIES(2), EYAS_QUERIES(3), EYAS_QUERIES(4),
#undef EYAS_QUERIES
#undef EYAS_QUERY
};
#if defined(__AVX512F__)
constexpr int64_t kFloatLanes = 16;
using FloatRegister = __m512;
inline FloatRegister float_fill(float v) { return _mm512_set1_ps(v); }
inline FloatRegister float_fma(FloatRegister a, FloatRegister b, FloatRegister c) { return _mm512_fmadd_ps(a, b, c); }
inline float float_lane_sum(FloatRegister v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kFloatLanes = 8;
using FloatRegister = __m256;
inline FloatRegister float_fill(float v) { return _mm256_set1_ps(v); }
inline FloatRegister float_fma(FloatRegister a, FloatRegister b, FloatRegister c) { return _mm256_fmadd_ps(a, b, c); }
inline float float_lane_sum(FloatRegister v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  return sum;
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define EYAS_FLOAT_PROBE 1
float float_chains(float seed) {
  FloatRegister keys[4], acc[12];
  for (int j = 0; j < 4; ++j) keys[j] = float_fill(seed * float(j + 1));
  for (int i = 0; i < 12; ++i) acc[i] = float_fill(float(i));
  for (int64_t k = 0; k < kIterations; ++k) {
    for (int r = 0; r < 3; ++r) {
      const FloatRegister x = float_fill(kQueries[(k & 15) * 4 + r]);
      for (int j = 0; j < 4; ++j) acc[4 * r + j] = float_fma(x, keys[j], acc[4 * r + j]);
    }
    __asm__ volatile("" : "+x"(keys[0]), "+x"(keys[1]), "+x"(keys[2]), "+x"(keys[3]));  // opaque keys
  }
  float total = 0.0f;
  for (int i = 0; i < 12; ++i) total += float_lane_sum(acc[i]);
  return total;
}
#endif

volatile float float_sink;

double float_peak(int64_t threads, int64_t runs) {
  TORCH_CHECK(threads >= 1 && runs >= 1, "threads and runs must be >= 1");
#ifdef EYAS_FLOAT_PROBE
  volatile float seed = 1e-3f;  // not a compile-time constant: the chains cannot be folded
  const double seconds =
      best_seconds(threads, runs, [&](int thread) { float_sink = float_chains(seed * float(thread + 1)); });
  return double(threads) * kIterations * 12 * kFloatLanes / seconds;
#else
  (void)threads, (void)runs;
  TORCH_CHECK(false, "this build has no float32 multiply-add probe (it needs AVX2 and FMA, or AVX-512)");
  return 0.0;
#endif
}

double int8_peak(c10::string_view kernel, int64_t threads, int64_t runs) {
  TORCH_CHECK(threads >= 1 && runs >= 1, "threads and runs must be >= 1");
  volatile int32_t seed = 7;  // not a compile-time constant: the chains cannot be folded
#ifdef EYAS_VNNI
  if (kernel == "avx512vnni") {
    const double seconds = best_seconds(threads, runs, [&](int thread) { sink = vnni_chains(seed + thread); });
    return double(threads) * kIterations * 16 * 64 / seconds;
  }
#endif
#ifdef EYAS_AVX2
  if (kernel == "avx2") {
    // vpmaddubsw: 32 byte products summed in pairs; the pairs' sums are the 32 multiply-adds.
    const double seconds = best_seconds(threads, runs, [&](int thread) { sink = avx2_chains(seed + thread); });
    return double(threads) * kIterations * 8 * 32 / seconds;
  }
#endif
  TORCH_CHECK(false, "this build has no int8 dot-product kernel named '", kernel, "'; it has: ",
              [] {
                std::string names;
                for (const auto& name : int8dot_kernels()) names += (names.empty() ? "" : ", ") + name;
                return names.empty() ? std::string("none") : names;
              }());
  return 0.0;
}

}  // namespace
}  // namespace eyas

TORCH_LIBRARY_FRAGMENT(eyas, m) {
  m.def("probe_read_bandwidth(int threads, int megabytes, int runs) -> float", &eyas::read_bandwidth);
  m.def("probe_int8_peak(str kernel, int threads, int runs) -> float", &eyas::int8_peak);
  m.def("probe_float_peak(int threads, int runs) -> float", &eyas::float_peak);
}
