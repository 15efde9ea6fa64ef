// What the AVX512-VNNI code (int4_gemm.cpp, int8_screen.cpp) shares: whether this build has the
// instructions, and the 14-bit integer form of activations both multiply with vpdpbusd.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EYAS_VNNI 1
#include <immintrin.h>
#endif

namespace eyas {

// Activations become xq = round(x / d) in -8191..8191 with d = max|x| / 8191 (over a group of
// 32 inputs in int4_gemm.cpp, over the row in int8_screen.cpp), split as xq = 128 * hi + lo
// with hi = round(xq / 128) in -64..64 and lo in -64..63: two int8 operands of vpdpbusd,
// whose sum 128 (w . hi) + w . lo is exact in int32.
constexpr float kActivationLevels = 8191.0f;

inline int32_t activation_high(int32_t q) { return (q + 64) >> 7; }

#ifdef EYAS_VNNI
inline __m512i activation_high(__m512i q) { return _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(64)), 7); }
#endif

}  // namespace eyas
