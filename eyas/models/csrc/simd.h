// SIMD helpers shared by the fused layer (decoder_layer.cpp) and its attention
// (attention.cpp): a vectorizable exp, AVX-width vectors, the score of a query against a block
// of keys, and Floats16, sixteen floats that compute the same bits on AVX-512 and on AVX2.
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

#ifdef __F16C__
// 16 floats: one AVX-512 register, or two AVX2 ones with the same operations lane by lane, so
// that code written with it gives the same bits on either (int8dot.h does the same for the int4
// kernel). Sums across lanes run in one fixed order on both (half_sum, then the tree of
// reduce8).
struct Floats16 {
#ifdef __AVX512F__
  __m512 v;
  static Floats16 zero() { return {_mm512_setzero_ps()}; }
  static Floats16 fill(float x) { return {_mm512_set1_ps(x)}; }
  static Floats16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Floats16 load(const c10::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  void fma(float weight, const Floats16& x) { v = _mm512_fmadd_ps(_mm512_set1_ps(weight), x.v, v); }
  // fma(*weight, x) with the weight broadcast from memory by the FMA itself ({1to16}): the
  // compiler would broadcast each weight of an unrolled loop into a register of its own and
  // spill them, a store and a load per FMA. The same bits.
  void fma_at(const float* weight, const Floats16& x) {
    asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(v) : "v"(x.v), "m"(*weight));
  }
  void fma(const Floats16& a, const Floats16& b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_scaled(float* p, float factor) const { _mm512_storeu_ps(p, _mm512_mul_ps(v, _mm512_set1_ps(factor))); }
  friend Floats16 operator+(Floats16 a, Floats16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Floats16 operator-(Floats16 a, Floats16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Floats16 operator*(Floats16 a, Floats16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Floats16 operator/(Floats16 a, Floats16 b) { return {_mm512_div_ps(a.v, b.v)}; }
  friend Floats16 max(Floats16 a, Floats16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Floats16 min(Floats16 a, Floats16 b) { return {_mm512_min_ps(a.v, b.v)}; }
  friend Floats16 floor(Floats16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
  // 2^k for integral k in -127..128 (as float lanes)
  friend Floats16 exp2_integer(Floats16 k) {
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k.v), _mm512_set1_epi32(127)), 23);
    return {_mm512_castsi512_ps(bits)};
  }
  // a where keep(lane) (x > -inf), else 0
  friend Floats16 zero_where_minus_infinity(Floats16 a, Floats16 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return {_mm512_maskz_mov_ps(keep, a.v)};
  }
  // lanes i + lanes i + 8, for i < 8
  __m256 half_sum() const { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
  // the largest lane (exact in any order)
  float max_lane() const { return _mm512_reduce_max_ps(v); }
#else
  __m256 lo, hi;
  static Floats16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Floats16 fill(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static Floats16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Floats16 load(const c10::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  void fma(float weight, const Floats16& x) {
    const __m256 w = _mm256_set1_ps(weight);
    lo = _mm256_fmadd_ps(w, x.lo, lo);
    hi = _mm256_fmadd_ps(w, x.hi, hi);
  }
  void fma_at(const float* weight, const Floats16& x) { fma(*weight, x); }
  void fma(const Floats16& a, const Floats16& b) {
    lo = _mm256_fmadd_ps(a.lo, b.lo, lo);
    hi = _mm256_fmadd_ps(a.hi, b.hi, hi);
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  void store_scaled(float* p, float factor) const {
    const __m256 f = _mm256_set1_ps(factor);
    _mm256_storeu_ps(p, _mm256_mul_ps(lo, f));
    _mm256_storeu_ps(p + 8, _mm256_mul_ps(hi, f));
  }
  friend Floats16 operator+(Floats16 a, Floats16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  friend Floats16 operator-(Floats16 a, Floats16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  friend Floats16 operator*(Floats16 a, Floats16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  friend Floats16 operator/(Floats16 a, Floats16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  friend Floats16 max(Floats16 a, Floats16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  friend Floats16 min(Floats16 a, Floats16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
  friend Floats16 floor(Floats16 a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
  friend Floats16 exp2_integer(Floats16 k) {
    const __m256i bias = _mm256_set1_epi32(127);
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k.lo), bias), 23)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k.hi), bias), 23))};
  }
  friend Floats16 zero_where_minus_infinity(Floats16 a, Floats16 x) {
    const __m256 minus = _mm256_set1_ps(-INFINITY);
    return {_mm256_and_ps(a.lo, _mm256_cmp_ps(x.lo, minus, _CMP_NEQ_OQ)),
            _mm256_and_ps(a.hi, _mm256_cmp_ps(x.hi, minus, _CMP_NEQ_OQ))};
  }
  __m256 half_sum() const { return _mm256_add_ps(lo, hi); }
  float max_lane() const {
    const __m256 m = _mm256_max_ps(lo, hi);
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
  }
#endif
};

// exp_approx on 16 lanes, operation by operation (the same bits as the scalar form), with
// e^-inf = 0 exactly: the softmax's exponentials.
inline Floats16 exp16(Floats16 x) {
  const Floats16 clamped = max(min(x, Floats16::fill(88.0f)), Floats16::fill(-87.0f));
  const Floats16 k = floor(clamped * Floats16::fill(1.44269504088896341f) + Floats16::fill(0.5f));
  const Floats16 r = (clamped - k * Floats16::fill(0.693359375f)) + k * Floats16::fill(2.12194440e-4f);
  Floats16 p = Floats16::fill(1.9875691500e-4f);
  p = p * r + Floats16::fill(1.3981999507e-3f);
  p = p * r + Floats16::fill(8.3334519073e-3f);
  p = p * r + Floats16::fill(4.1665795894e-2f);
  p = p * r + Floats16::fill(1.6666665459e-1f);
  p = p * r + Floats16::fill(5.0000001201e-1f);
  p = (p * r * r + r) + Floats16::fill(1.0f);
  return zero_where_minus_infinity(p * exp2_integer(k), x);
}

// The sums of eight 8-lane vectors: lane i = the sum of in[i]'s lanes, each in the order
// ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
inline __m256 reduce8(const __m256 in[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(in[0], in[1]), _mm256_hadd_ps(in[2], in[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(in[4], in[5]), _mm256_hadd_ps(in[6], in[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Lane 0 of reduce8 with `in` first and seven zero vectors: ((0 + 1) + (2 + 3)) + ((4 + 5) +
// (6 + 7)) over in's lanes, in 4 instructions instead of 10.
inline float sum8_tree(__m256 in) {
  const __m256 pairs = _mm256_hadd_ps(in, in);  // [0 + 1, 2 + 3, ., . | 4 + 5, 6 + 7, ., .]
  const __m256 quads = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

// reduce8 of the half sums of eight Floats16: lane j = the sum of in[j]'s 16 lanes as
// ((h0 + h1) + (h2 + h3)) + ((h4 + h5) + (h6 + h7)) with h_i = lane i + lane i + 8. On AVX-512
// the same additions in the same order as half_sum then reduce8, over whole registers: 25
// instructions for eight sums instead of 37 (the scores of attention.cpp).
inline __m256 reduce8_halves(const Floats16 in[8]) {
#ifdef __AVX512F__
  __m512 pairs[4];  // [h(2p) | h(2p + 1)]: lane i + lane i + 8 of both
  for (int p = 0; p < 4; ++p) {
    const __m512 a = in[2 * p].v, b = in[2 * p + 1].v;
    pairs[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // _mm256_hadd_ps in each 128-bit lane: [x0 + x1, x2 + x3, y0 + y1, y2 + y3]
  const auto hadd = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  // 128-bit lanes of `quads`: keys 0, 2, 4, 6 inputs 0..3 | the same, inputs 4..7 | keys 1, 3, 5, 7 ...
  const __m512 quads = hadd(hadd(pairs[0], pairs[1]), hadd(pairs[2], pairs[3]));
  const __m512 lanes = _mm512_shuffle_f32x4(quads, quads, _MM_SHUFFLE(3, 1, 2, 0));
  const __m256 sums = _mm256_add_ps(_mm512_castps512_ps256(lanes), _mm512_extractf32x8_ps(lanes, 1));  // keys 0 2 4 6 1 3 5 7
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
  __m256 halves[8];
  for (int j = 0; j < 8; ++j) halves[j] = in[j].half_sum();
  return reduce8(halves);
#endif
}
#endif  // __F16C__
#endif

}  // namespace eyas
