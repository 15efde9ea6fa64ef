// SIMD helpers shared by the fused layer (int4_decoder_layer.cpp) and its attention
// (attention.cpp): a vectorizable exp, AVX-width vectors, and the score of a query against a
// block of keys.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <c10/util/Half.h>

namespace eyas {

// e^x for float x (relative error < 1e-7 over [-87, 88]) in a form the compiler can vectorize,
// where std::exp is a scalar library call: SiLU's and the softmax's exponentials.
// Cody-Waite range reduction x = k ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial.
#pragma omp declare simd
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (int32_t(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float exp_of(float x) { return exp_approx(x); }
inline double exp_of(double x) { return std::exp(x); }

// Eight floats or four doubles: one AVX register (GCC vector extensions; -march=native picks
// the instructions).
template <typename T>
struct Simd {
  static constexpr int64_t width = 32 / sizeof(T);
  typedef T Vec __attribute__((vector_size(32)));
  static Vec load(const T* p) {
    Vec v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static T sum(Vec v) {
    T total = 0;
    for (int64_t i = 0; i < width; ++i) total += v[i];
    return total;
  }
};

// Scores of one query against a block of keys: q . k[i] for i < KeyBlock<T>::size (head_dim a
// multiple of the SIMD width). Every key goes through this one code path (the caller repeats
// the last key to fill a short block), so a (query, key) score has the same bits wherever the
// key falls: in a block of a one-token step or of a verification pass.
template <typename T>
struct KeyBlock {
  static constexpr int size = 4;
  static void scores(const T* q, const T* const k[size], int64_t head_dim, T out[size]) {
    using S = Simd<T>;
    typename S::Vec acc[size] = {};
    for (int64_t d = 0; d < head_dim; d += S::width) {
      const typename S::Vec qv = S::load(q + d);
      for (int i = 0; i < size; ++i) acc[i] += qv * S::load(k[i] + d);
    }
    for (int i = 0; i < size; ++i) out[i] = S::sum(acc[i]);
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// Eight key values as float32: from a float32 cache, or widened exactly from a float16 one.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#ifdef __F16C__
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// float on AVX2: eight keys, eight accumulators, one horizontal reduction for all eight. The
// keys K are float, or c10::Half for a float16 cache (attention.cpp).
template <>
struct KeyBlock<float> {
  static constexpr int size = 8;
  template <typename K>
  static void scores(const float* q, const K* const k[size], int64_t head_dim, float out[size]) {
    __m256 acc[size];
    for (int i = 0; i < size; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int i = 0; i < size; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(k[i] + d), acc[i]);
    }
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                                        _mm256_permute2f128_ps(a, b, 0x31)));
  }
};
#endif

}  // namespace eyas
