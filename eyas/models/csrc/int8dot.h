// What the int8 dot-product code (int4_gemm.cpp, int8_screen.cpp) shares: which instruction sets
// this build has, which one runs, and the 14-bit integer form of activations both multiply.
//
// Two implementations compute the same integers and the same float operations in the same
// order, so they give the same bits (tests/models/test_int4_int8dot.py checks it):
//   - "avx512vnni": vpdpbusd, 64 multiply-adds per instruction (Ice Lake and later Xeons, Zen 4);
//   - "avx2": vpmaddubsw + vpmaddwd on 256-bit registers (Haswell and later, Zen 1-3, client
//     cores without AVX-512).
// A -march=native build compiles what the CPU has; set_int8dot_kernel picks among them at run
// time (models/extension.py does it once, from EYAS_INT4_KERNEL).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EYAS_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EYAS_VNNI 1  // its code also uses sum8 below
#endif
#endif
#if defined(EYAS_VNNI) || defined(EYAS_AVX2)
#include <immintrin.h>
#endif

namespace eyas {

// Activations become xq = round(x / d) in -8191..8191 with d = max|x| / 8191 (over a group of
// 32 inputs in int4_gemm.cpp, over the row in int8_screen.cpp), split as xq = 128 * hi + lo
// with hi = round(xq / 128) in -64..64 and lo in -64..63: two int8 operands of the integer dot
// products, whose sum 128 (w . hi) + w . lo is exact in int32.
constexpr float kActivationLevels = 8191.0f;
// With 8-bit activations (set_int4_activation_bits(8), the int4 kernel only): xq = round(x / d)
// in -127..127 with d = max|x| / 127, one int8 operand: half the dot products of 14 bits.
constexpr float kActivationLevels8 = 127.0f;

inline int32_t activation_high(int32_t q) { return (q + 64) >> 7; }

enum class Int8Dot { none = 0, avx2 = 1, avx512vnni = 2 };

// The implementations this build has, best first ("avx512vnni", "avx2"); empty where none.
std::vector<std::string> int8dot_kernels();
// The one in use (the best compiled, until set_int8dot_kernel); Int8Dot::none where none is.
Int8Dot int8dot_kernel();
std::string int8dot_kernel_name();
// Selects a compiled implementation by name; an error names the accepted ones.
void set_int8dot_kernel(const std::string& name);
// Whether the int4 kernel multiplies whole tiles of 16 rows with AMX (int4_gemm.cpp): on where
// available (the CPU, the build and Linux's permission), unless set off. The same bits either way.
bool int4_amx_available();
bool int4_amx();
void set_int4_amx(bool on);
// The int4 kernel's activation arithmetic: 14 bits (the default) or 8 bits (int4_gemm.cpp).
int int4_activation_bits();
void set_int4_activation_bits(int64_t bits);

// How the int4 and int8 weight kernels prefetch their weights (int4_gemm.cpp): "stream" (each
// group's lines a fixed distance ahead, the default) or "blocks" (whole blocks of columns a few
// ahead, in bursts). The same bits either way.
bool int4_prefetch_streams();
std::string int4_prefetch();
void set_int4_prefetch(const std::string& name);

// Streaming: a group's `Bytes` bytes of weights are requested kPrefetchBytes ahead of `group`
// in a thread's stream of blocks. Bursts: a whole block of columns (`bytes`), kAheadBlocks
// blocks ahead, before the block is multiplied.
constexpr int64_t kPrefetchBytes = 2048, kAheadBlocks = 4;

template <int64_t Bytes>
inline void prefetch_group_ahead(const uint8_t* group) {
  const char* ahead = reinterpret_cast<const char*>(group) + kPrefetchBytes;
  for (int64_t byte = 0; byte < Bytes; byte += 64) __builtin_prefetch(ahead + byte, 0, 3);
}

inline void prefetch_bytes(const uint8_t* start, int64_t bytes) {
  const char* first = reinterpret_cast<const char*>(start);
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(first + byte, 0, 3);
}

#ifdef EYAS_VNNI
inline __m512i activation_high(__m512i q) { return _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(64)), 7); }
#endif
#ifdef EYAS_AVX2
inline __m256i activation_high(__m256i q) { return _mm256_srai_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(64)), 7); }

// The sum of 8 floats in one fixed order, (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1: both
// implementations reduce with it, so a group's sum has the same bits in each.
inline float sum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#endif

}  // namespace eyas
