// The int8 output screen's register tiles with 8-bit activations (int8_screen.cpp prepares the
// activations, splits the vocabulary over the threads and re-checks candidates).
//
// Floor it chases: the int8 multiply-add peak once a call has a few rows, read bandwidth below.
// A tile is B blocks of 16 vocabulary rows times R rows of x: each 64-byte line of weights is
// loaded once for the R rows (B + R loads per B * R dot-product instructions), the B * R
// accumulators are independent chains, and the epilogue (scale, bound, block maxima) runs once
// per tile, vectorised. A row's integers are exact whichever tile it sits in, and its float
// epilogue is the same operations in the same order, so a row's results have the same bits
// alone or in any batch, in any tile shape, on either implementation.
//
// AVX-512 VNNI: vpdpbusd takes the codes made unsigned (c + 128, one vpxor per line, shared by the
// rows) and xq (-127..127) signed, broadcast; the group sums (8 lines = 32 inputs) are shifted left
// by the group's exponent into the row's total, and the 128 * xq terms come off as one per-row
// integer (`correction`).
// AVX2: vpsignb gives each code xq's sign, vpmaddubsw multiplies |xq| (<= 127) by it (a pair sums
// to at most 32258 < 2^15: no saturation), and vpmaddwd multiplies the pairs by 2^e_g (<= 2^7) and
// widens them to int32 in the same instruction: no per-group accumulator and no shift. The same
// integers (int32 sums wrap alike), then the same float operations.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "int8dot.h"  // the instruction sets this build has, and their intrinsics

namespace eyas {
namespace screen {

constexpr int64_t kRows = 16;  // vocabulary rows per block (one 512-bit register of int32)
// Software prefetch, one line per line loaded, `TileOut::prefetch` bytes ahead: kPrefetchOneRow in
// each block's stream at one row (bound by read bandwidth); at several rows the next tile's blocks
// (B * stride ahead), so that reading them overlaps the whole tile's arithmetic. Into L2
// (prefetcht1): requested into L1, the lines held the core's fill buffers and stalled its loads
// (AMD Zen 4: a 4-request decode step's output layer 1.51-1.74 -> 1.15-1.24 ms, a one-token
// step's 1.10-1.21 -> 0.92-1.16 ms; as fast at 16 rows, where the tiles' arithmetic bounds it).
constexpr int64_t kPrefetchOneRow = 1024;
constexpr float kRelative = 8.0f / 16777216.0f, kSafety = 1.01f, kAbsolute = 1e-6f;

// A pass's 8-bit activations, rows [R, ...]: |xq| [R, H] (AVX2), xq [R, H], each group's
// exponent e_g [R, G], 2^e_g as int16 pairs [R, G] (AVX2), 128 sum_g 2^e_g sum(xq_g) [R]
// (wrapped to int32; AVX-512) and the row's step D [R] (x^ = D 2^e_g xq).
struct Eight {
  const uint8_t* magnitude;
  const int8_t* value;
  const int32_t* exponent;
  const int32_t* factor;
  const int32_t* correction;
  const float* step;
  int64_t hidden, quads, groups;
};

// Where a tile's results go: the tile's first vocabulary row j0 and first row r0 of x are already
// added to every pointer. approx, bound: [rows, V] (row stride `vocab`); block_max: null, or
// [2, rows, blocks] at the tile's first block (plane 0: max(approx - bound), plane 1: max(approx
// + bound) over each block's 16 entries).
struct TileOut {
  const float* scale;
  const float* weight_error;
  const float* approx_norm;
  const float* x_norm;
  const float* x_error;
  float* approx;
  float* bound;
  float* block_max;
  int64_t vocab, plane;  // plane: rows * blocks, the distance between block_max's two planes
  int64_t blocks;        // the row stride of block_max
  int64_t prefetch;      // bytes ahead of each line loaded
  bool stream;           // write approx and bound around the caches (below; 64-byte aligned)
};

// approx and bound ([R, V] floats: 6 MB at 16 rows of SmolLM2, 25 MB at 64) are read again only
// where a block holds a candidate (the greedy and candidate screens), so there, for several rows,
// they are written with non-temporal stores: no read of each line before it is written, and the
// weights and the KV cache stay in the caches. Stored through the caches, the stores stalled the
// tiles (perf: the epilogue's stores and the loads after them). Streamed (AMD Zen 4, 2 threads):
// greedy_logits of 16 / 64 rows 2.27-3.52 / 9.06-12.94 -> 2.01-2.39 / 7.12-8.32 ms, each build in
// its own process; a decode pass of 16 / 64 sequences 1.03x / 1.02x faster than with cached
// stores, alternated in one process (scripts/ab-screen-stores.py). The caller (int8_screen.cpp)
// chooses, and fences (`_mm_sfence`) before another thread reads them.

// B blocks from `weights` (block b at weights + b * stride bytes) times R rows from r0.
using TileFn = void (*)(const int8_t* weights, int64_t stride, const Eight& a, int64_t r0, const TileOut& out);

// The blocks and rows of one tile for a call of `rows` rows (int8_screen.cpp walks them): one row
// takes wider tiles (more independent chains), many rows the most rows the registers hold
// (measured on SmolLM2's and Qwen2.5-1.5B's output layers). AVX-512: 2 blocks x 6 rows (24
// accumulators and totals, 2 weight lines, a broadcast) took 12-64 rows of SmolLM2's screen
// 9-20% faster than 2 x 4 on an AMD Zen 4 (16 rows 2.51-2.62 against 3.02-3.26 ms, alternated
// over three rounds); on Intel Xeons 2 x 6 and 1 x 8 had measured no faster than 2 x 4.
struct TileShape {
  int blocks_one_row, blocks_many_rows, max_rows;
};

#ifdef EYAS_VNNI
namespace vnni {

constexpr TileShape kShape{4, 2, 6};

inline void store_row(float* p, __m512 v, bool stream) { stream ? _mm512_stream_ps(p, v) : _mm512_storeu_ps(p, v); }

inline void epilogue(__m512i total, int64_t j, int64_t r, float step, const TileOut& out, int64_t block) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 s = _mm512_loadu_ps(out.scale + j);
  const __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(s, _mm512_set1_ps(step)));
  __m512 b = _mm512_mul_ps(_mm512_set1_ps(out.x_norm[r]), _mm512_loadu_ps(out.weight_error + j));
  b = _mm512_fmadd_ps(_mm512_set1_ps(out.x_error[r]), _mm512_loadu_ps(out.approx_norm + j), b);
  b = _mm512_fmadd_ps(_mm512_andnot_ps(sign, value), _mm512_set1_ps(kRelative), b);
  b = _mm512_fmadd_ps(b, _mm512_set1_ps(kSafety), _mm512_set1_ps(kAbsolute));
  store_row(out.approx + r * out.vocab + j, value, out.stream);
  store_row(out.bound + r * out.vocab + j, b, out.stream);
  if (out.block_max == nullptr) return;
  out.block_max[r * out.blocks + block] = _mm512_reduce_max_ps(_mm512_sub_ps(value, b));
  out.block_max[out.plane + r * out.blocks + block] = _mm512_reduce_max_ps(_mm512_add_ps(value, b));
}

template <int B, int R>
void tile8(const int8_t* weights, int64_t stride, const Eight& a, int64_t r0, const TileOut& out) {
  const __m512i zero = _mm512_setzero_si512(), bias = _mm512_set1_epi8(char(0x80));
  const int8_t* xq = a.value + r0 * a.hidden;
  __m512i total[B][R];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) total[b][r] = _mm512_sub_epi32(zero, _mm512_set1_epi32(a.correction[r0 + r]));
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512i acc[B][R];
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < R; ++r) acc[b][r] = zero;
    const auto line = [&](int64_t k) {
      __m512i w[B];
      for (int b = 0; b < B; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(weights + b * stride + 64 * k + out.prefetch), _MM_HINT_T1);
        w[b] = _mm512_xor_si512(_mm512_loadu_si512(weights + b * stride + 64 * k), bias);
      }
      for (int r = 0; r < R; ++r) {
        int32_t q;
        std::memcpy(&q, xq + r * a.hidden + 4 * k, 4);
        const __m512i broadcast = _mm512_set1_epi32(q);
        for (int b = 0; b < B; ++b) acc[b][r] = _mm512_dpbusd_epi32(acc[b][r], w[b], broadcast);
      }
    };
    const int64_t k0 = 8 * g;
    if (k0 + 8 <= a.quads) {
#pragma GCC unroll 8
      for (int64_t k = k0; k < k0 + 8; ++k) line(k);
    } else {
      for (int64_t k = k0; k < a.quads; ++k) line(k);
    }
    for (int r = 0; r < R; ++r) {
      const __m128i e = _mm_cvtsi32_si128(a.exponent[(r0 + r) * a.groups + g]);
      for (int b = 0; b < B; ++b) total[b][r] = _mm512_add_epi32(total[b][r], _mm512_sll_epi32(acc[b][r], e));
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) epilogue(total[b][r], kRows * b, r, a.step[r0 + r], out, b);
}

// kTiles[B][R]: the tiles kShape uses, B blocks (1, 2 or 4) times R rows (1..6).
constexpr TileFn kTiles[5][7] = {
    {},
    {nullptr, tile8<1, 1>, tile8<1, 2>, tile8<1, 3>, tile8<1, 4>, tile8<1, 5>, tile8<1, 6>},
    {nullptr, tile8<2, 1>, tile8<2, 2>, tile8<2, 3>, tile8<2, 4>, tile8<2, 5>, tile8<2, 6>},
    {},
    {nullptr, tile8<4, 1>},
};

}  // namespace vnni
#endif

#ifdef EYAS_AVX2
namespace avx2 {

constexpr TileShape kShape{2, 1, 3};

inline void store_row(float* p, __m256 v, bool stream) { stream ? _mm256_stream_ps(p, v) : _mm256_storeu_ps(p, v); }

// The epilogue of 8 vocabulary rows (half a block): the same operations as vnni::epilogue's.
inline void epilogue(__m256i total, int64_t j, int64_t r, float step, const TileOut& out, __m256& lower,
                     __m256& upper) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 s = _mm256_loadu_ps(out.scale + j);
  const __m256 value = _mm256_mul_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(s, _mm256_set1_ps(step)));
  __m256 b = _mm256_mul_ps(_mm256_set1_ps(out.x_norm[r]), _mm256_loadu_ps(out.weight_error + j));
  b = _mm256_fmadd_ps(_mm256_set1_ps(out.x_error[r]), _mm256_loadu_ps(out.approx_norm + j), b);
  b = _mm256_fmadd_ps(_mm256_andnot_ps(sign, value), _mm256_set1_ps(kRelative), b);
  b = _mm256_fmadd_ps(b, _mm256_set1_ps(kSafety), _mm256_set1_ps(kAbsolute));
  store_row(out.approx + r * out.vocab + j, value, out.stream);
  store_row(out.bound + r * out.vocab + j, b, out.stream);
  lower = _mm256_sub_ps(value, b);
  upper = _mm256_add_ps(value, b);
}

inline float max8(__m256 v) {
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}

template <int B, int R>
void tile8(const int8_t* weights, int64_t stride, const Eight& a, int64_t r0, const TileOut& out) {
  constexpr int H = 2 * B;  // halves of blocks: 8 vocabulary rows each
  const uint8_t* magnitude = a.magnitude + r0 * a.hidden;
  const int8_t* xq = a.value + r0 * a.hidden;
  __m256i total[H][R];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) total[h][r] = _mm256_setzero_si256();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256i factor[R];
    for (int r = 0; r < R; ++r) factor[r] = _mm256_set1_epi32(a.factor[(r0 + r) * a.groups + g]);
    const auto line = [&](int64_t k) {
      __m256i w[H];
      for (int h = 0; h < H; ++h) {
        if (h % 2 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(weights + (h / 2) * stride + 64 * k + out.prefetch), _MM_HINT_T1);
        w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + (h / 2) * stride + 64 * k + 32 * (h % 2)));
      }
      for (int r = 0; r < R; ++r) {
        int32_t m, q;
        std::memcpy(&m, magnitude + r * a.hidden + 4 * k, 4);
        std::memcpy(&q, xq + r * a.hidden + 4 * k, 4);
        const __m256i mb = _mm256_set1_epi32(m), qb = _mm256_set1_epi32(q);
        for (int h = 0; h < H; ++h)
          total[h][r] = _mm256_add_epi32(
              total[h][r], _mm256_madd_epi16(_mm256_maddubs_epi16(mb, _mm256_sign_epi8(w[h], qb)), factor[r]));
      }
    };
    const int64_t k0 = 8 * g;
    if (k0 + 8 <= a.quads) {
#pragma GCC unroll 8
      for (int64_t k = k0; k < k0 + 8; ++k) line(k);
    } else {
      for (int64_t k = k0; k < a.quads; ++k) line(k);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) {
      __m256 lower[2], upper[2];
      for (int half = 0; half < 2; ++half)
        epilogue(total[2 * b + half][r], kRows * b + 8 * half, r, a.step[r0 + r], out, lower[half], upper[half]);
      if (out.block_max == nullptr) continue;
      out.block_max[r * out.blocks + b] = max8(_mm256_max_ps(lower[0], lower[1]));
      out.block_max[out.plane + r * out.blocks + b] = max8(_mm256_max_ps(upper[0], upper[1]));
    }
}

// kTiles[B][R]: the tiles kShape uses, B blocks (1 or 2) times R rows (1..3): 16 ymm registers
// hold 2B x R totals, 2B weight lines, R factors and two broadcasts.
constexpr TileFn kTiles[5][7] = {
    {},
    {nullptr, tile8<1, 1>, tile8<1, 2>, tile8<1, 3>},
    {nullptr, tile8<2, 1>},
    {},
    {},
};

}  // namespace avx2
#endif

}  // namespace screen
}  // namespace eyas
