// The output layer's int8 screen with integer dot products (AVX512-VNNI or AVX2, int8dot.h):
// approximate logits and a rigorous bound on their error, in one pass (models/output_layer.py
// uses them to find each row's exact argmax).
//
// Floor it chases: read bandwidth for a few rows (the int8 copy of the output layer, V x H bytes
// plus 16 bytes per vocabulary row, read once per call: 29 MB for SmolLM2), the int8
// multiply-add peak for many (V x H multiply-adds per row and per 8-bit pass: 8-bit activations,
// the default, are one pass, 14-bit ones, set_screen_activation_bits(14), two). The exact
// re-check of candidates (int8_screen_greedy) reads a handful of float32 rows, each dot product
// in 32 float64 lanes (exact_logit), and must stay small beside either: 8-bit activations widen
// the bound, so they re-check more candidates (~50 per row on SmolLM2's hidden states, against
// ~5 with 14 bits), for ~20% less time per extra row of greedy_logits at one thread
// (scripts/screen-activations.py).
//
// Why: PyTorch's int8 kernel (`_weight_int8pack_mm`) takes bf16 activations and costs ~0.45 ms
// per row for SmolLM2's 49152 x 576 layer on the 2-core machine, and the bound around it then
// takes several passes over [R, V] in PyTorch. Here each row of activations becomes integers and
// multiplies the int8 codes with vpdpbusd (or vpmaddubsw + vpmaddwd); the bound is computed
// beside each logit.
//   14 bits (int8dot.h): one scale per row, xq = round(x / d), d = max|x| / 8191, split as
//   128 * hi + lo with hi, lo in -64..64 (as in int4_gemm.cpp): two passes.
//   8 bits (prepare_eight): xq in -127..127 with a power-of-two step per group of 32 inputs,
//   x^ = D 2^e_g xq, so a group far below the row's largest input keeps its levels (one scale
//   per row leaves SmolLM2's hidden states, whose few huge inputs set max|x|, so few levels that
//   rows re-check ~1,600 candidates on average, some all 49,152; per group, ~60); the group
//   sums, exact int32, shift left by e_g into one integer T per logit: one pass. Its register
//   tiles (int8_screen_tiles.h) load each 64-byte line of codes once for up to 4 rows.
//
// Error bound, for row x and vocabulary row j (W_j the float32 weights, A_j = s_j * codes_j
// the int8 copy, x^ the rounded activations):
//   x . W_j - approx_j = x . (W_j - A_j) + (x - x^) . A_j + (x^ . A_j - approx_j)
//   |x . (W_j - A_j)| <= |x| |W_j - A_j|            (Cauchy-Schwarz; weight_error)
//   |(x - x^) . A_j|  <= |x - x^| |A_j|              (the row's rounding error, in float64 from
//                        the integers actually used; approx_norm). The term that 8 bits grow.
//   |x^ . A_j - approx_j| <= 8 u |approx_j| (u = 2^-24): the integer dot products are exact.
//   14 bits: the conversions of the two parts are exact while |codes . (hi + 64)| < 2^24
//   (H <= 2048), then three float roundings (128 * hi-part + lo-part, d * s_j, the product).
//   8 bits: x^ . A_j = D s_j T, |T| <= G 2^cap 32 * 127^2 < 2^31 (cap, prepare_eight), and
//   approx_j = fl(fl(float(T)) * fl(s_j * D)): float(T) is exact only while |T| < 2^24, which
//   the shifts exceed, but it is one rounding relative to T itself, so three relative roundings
//   in all, whatever H: (1 + u)^3 / (1 - u)^3 - 1 < 8 u.
// The sum is scaled by 1.01 (the bound's own rounding) plus 1e-6, as in output_layer.py.
//
// Threads: the screen's regions run on worker_pool.h's workers (no thread waits for another to
// start), like the decoder stack's.
//
// Layout (int8_screen_pack): int8 [V/16, H/4, 64]; in a block of 16 vocabulary rows, the 64
// bytes for inputs 4k..4k+3 hold row c's 4 codes at bytes 4c..4c+3.

#include "int8_screen.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_screen_tiles.h"
#include "int8dot.h"
#include "worker_pool.h"

namespace eyas {
namespace {

using screen::Eight;
using screen::kAbsolute;
using screen::kRelative;
using screen::kRows;
using screen::kSafety;
constexpr int64_t kMaxHidden = 2048, kTile = 4;

// The screen's activation arithmetic: 8 bits (one pass) or 14 (two); the argmax is exact either way.
int screen_bits = 8;
// Whether the 8-bit tiles stream approx and bound past the caches (int8_screen_tiles.h); off only
// for comparisons (set_screen_streaming). The same bits either way.
bool screen_streaming = true;

using ScreenFn = void (*)(const int8_t*, int64_t, const uint8_t*, const uint8_t*, int64_t, const float*,
                          const float*, const float*, const float*, const int32_t*, const float*, const float*,
                          float*, float*, int64_t);

#ifdef EYAS_VNNI
namespace vnni {

// One block of 16 vocabulary rows for R rows of x: approx and bound at [r, j0 .. j0 + 15].
template <int R>
void screen_tile(const int8_t* block, int64_t quads, const uint8_t* hi, const uint8_t* lo, int64_t hidden,
                 const float* d, const float* x_norm, const float* x_error, const float* scale,
                 const int32_t* sums, const float* weight_error, const float* approx_norm, float* approx,
                 float* bound, int64_t vocab) {
  __m512i acc[R][4];  // per row: hi even/odd quads, lo even/odd quads (independent chains)
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < quads; ++k) {
    const __m512i w = _mm512_loadu_si512(block + 64 * k);
    for (int r = 0; r < R; ++r) {
      int32_t h, l;
      std::memcpy(&h, hi + r * hidden + 4 * k, 4);
      std::memcpy(&l, lo + r * hidden + 4 * k, 4);
      acc[r][k & 1] = _mm512_dpbusd_epi32(acc[r][k & 1], _mm512_set1_epi32(h), w);
      acc[r][2 + (k & 1)] = _mm512_dpbusd_epi32(acc[r][2 + (k & 1)], _mm512_set1_epi32(l), w);
    }
  }
  // the +64 offsets of hi and lo: codes . (v + 64) = codes . v + 64 * sum(codes)
  const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(sums), 6);
  const __m512 s = _mm512_loadu_ps(scale), werr = _mm512_loadu_ps(weight_error);
  const __m512 anorm = _mm512_loadu_ps(approx_norm);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int r = 0; r < R; ++r) {
    const __m512i dot_hi = _mm512_sub_epi32(_mm512_add_epi32(acc[r][0], acc[r][1]), offset);
    const __m512i dot_lo = _mm512_sub_epi32(_mm512_add_epi32(acc[r][2], acc[r][3]), offset);
    const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_hi), _mm512_set1_ps(128.0f), _mm512_cvtepi32_ps(dot_lo));
    const __m512 value = _mm512_mul_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(d[r])));
    __m512 b = _mm512_mul_ps(_mm512_set1_ps(x_norm[r]), werr);
    b = _mm512_fmadd_ps(_mm512_set1_ps(x_error[r]), anorm, b);
    b = _mm512_fmadd_ps(_mm512_andnot_ps(sign, value), _mm512_set1_ps(kRelative), b);
    b = _mm512_fmadd_ps(b, _mm512_set1_ps(kSafety), _mm512_set1_ps(kAbsolute));
    _mm512_storeu_ps(approx + r * vocab, value);
    _mm512_storeu_ps(bound + r * vocab, b);
  }
}

constexpr ScreenFn kScreenTiles[kTile + 1] = {nullptr, screen_tile<1>, screen_tile<2>, screen_tile<3>, screen_tile<4>};

}  // namespace vnni
#endif

#ifdef EYAS_AVX2
namespace avx2 {

// The same on 256-bit registers, 8 vocabulary rows at a time: vpmaddubsw multiplies the
// unsigned activation bytes (at most 128) by the signed codes (|c| <= 127), so a pair sums to at
// most 32512 < 2^15, and vpmaddwd widens it to int32 at once: the same integers as vpdpbusd,
// then the same float operations.
template <int R>
void screen_tile(const int8_t* block, int64_t quads, const uint8_t* hi, const uint8_t* lo, int64_t hidden,
                 const float* d, const float* x_norm, const float* x_error, const float* scale,
                 const int32_t* sums, const float* weight_error, const float* approx_norm, float* approx,
                 float* bound, int64_t vocab) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int half = 0; half < 2; ++half) {
    __m256i acc[R][2];  // per row: hi, lo
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t k = 0; k < quads; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * k + 32 * half));
      for (int r = 0; r < R; ++r) {
        int32_t h, l;
        std::memcpy(&h, hi + r * hidden + 4 * k, 4);
        std::memcpy(&l, lo + r * hidden + 4 * k, 4);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(h), w), ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(l), w), ones));
      }
    }
    const int64_t j = 8 * half;
    const __m256i offset = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + j)), 6);
    const __m256 s = _mm256_loadu_ps(scale + j), werr = _mm256_loadu_ps(weight_error + j);
    const __m256 anorm = _mm256_loadu_ps(approx_norm + j);
    for (int r = 0; r < R; ++r) {
      const __m256i dot_hi = _mm256_sub_epi32(acc[r][0], offset);
      const __m256i dot_lo = _mm256_sub_epi32(acc[r][1], offset);
      const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi), _mm256_set1_ps(128.0f), _mm256_cvtepi32_ps(dot_lo));
      const __m256 value = _mm256_mul_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(d[r])));
      __m256 b = _mm256_mul_ps(_mm256_set1_ps(x_norm[r]), werr);
      b = _mm256_fmadd_ps(_mm256_set1_ps(x_error[r]), anorm, b);
      b = _mm256_fmadd_ps(_mm256_andnot_ps(sign, value), _mm256_set1_ps(kRelative), b);
      b = _mm256_fmadd_ps(b, _mm256_set1_ps(kSafety), _mm256_set1_ps(kAbsolute));
      _mm256_storeu_ps(approx + r * vocab + j, value);
      _mm256_storeu_ps(bound + r * vocab + j, b);
    }
  }
}

constexpr ScreenFn kScreenTiles[kTile + 1] = {nullptr, screen_tile<1>, screen_tile<2>, screen_tile<3>, screen_tile<4>};

}  // namespace avx2
#endif

// The selected implementation's tiles (int8dot.h), null where this build has none.
const ScreenFn* screen_tiles() {
#ifdef EYAS_VNNI
  if (int8dot_kernel() == Int8Dot::avx512vnni) return vnni::kScreenTiles;
#endif
#ifdef EYAS_AVX2
  if (int8dot_kernel() == Int8Dot::avx2) return avx2::kScreenTiles;
#endif
  return nullptr;
}


}  // namespace

at::Tensor int8_screen_pack(const at::Tensor& codes_in) {
  TORCH_CHECK(codes_in.dim() == 2 && codes_in.scalar_type() == at::kChar, "codes must be int8 [V, H]");
  const int64_t vocab = codes_in.size(0), hidden = codes_in.size(1);
  TORCH_CHECK(vocab % kRows == 0 && hidden % 4 == 0 && hidden <= kMaxHidden,
              "the int8 screen needs V a multiple of 16 and H a multiple of 4 up to 2048, got [", vocab, ", ",
              hidden, "]");
  const at::Tensor codes = codes_in.contiguous();
  at::Tensor packed = at::empty({vocab / kRows, hidden / 4, 64}, codes.options());
  const int8_t* src = codes.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, vocab / kRows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      for (int64_t k = 0; k < hidden / 4; ++k)
        for (int64_t c = 0; c < kRows; ++c)
          std::memcpy(dst + (block * (hidden / 4) + k) * 64 + 4 * c, src + (block * kRows + c) * hidden + 4 * k, 4);
  });
  return packed;
}

namespace {

// The selected implementation's 8-bit tiles (int8_screen_tiles.h) and their shape.
struct TileChoice {
  const screen::TileFn (*tiles)[7];
  screen::TileShape shape;
};

TileChoice eight_bit_tiles() {
#ifdef EYAS_VNNI
  if (int8dot_kernel() == Int8Dot::avx512vnni) return {screen::vnni::kTiles, screen::vnni::kShape};
#endif
#ifdef EYAS_AVX2
  if (int8dot_kernel() == Int8Dot::avx2) return {screen::avx2::kTiles, screen::avx2::kShape};
#endif
  return {nullptr, {}};
}

// The 8-bit activations of x [R, H] (the file's header): per group of 32 inputs an exponent
// e_g = cap - s_g, where s_g (0..cap) is the largest with 2^s_g max|x_g| <= max|x|, so that
// xq = round(x 2^s_g 127 / max|x|) in -127..127 uses the group's range; x^ = D 2^e_g xq with D =
// (max|x| / 127) 2^-cap. cap keeps T = sum_g 2^e_g (codes . xq)_g within int32: G 2^cap 32 127^2
// < 2^31 (7 for H <= 1152, 6 up to 2048). Also |x| and |x - x^| (float64, rounded up).
struct Eighths {
  std::vector<uint8_t> magnitude;
  std::vector<int8_t> value;
  std::vector<int32_t> exponent, factor, correction;
  std::vector<float> step;
  Eight view{};
};

Eighths prepare_eight(const float* xp, int64_t rows, int64_t hidden, float* x_norm, float* x_error) {
  const int64_t quads = hidden / 4, groups = (hidden + 31) / 32;
  int cap = 0;
  while (cap < 7 && groups * (int64_t(32 * 127 * 127) << (cap + 1)) <= int64_t(INT32_MAX)) ++cap;
  Eighths e;
  e.magnitude.resize(rows * hidden);
  e.value.resize(rows * hidden);
  e.exponent.resize(rows * groups);
  e.factor.resize(rows * groups);
  e.correction.resize(rows);
  e.step.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * hidden;
    float amax = 0.0f;
    for (int64_t i = 0; i < hidden; ++i) amax = std::max(amax, std::fabs(xr[i]));
    const float inverse = amax > 0.0f ? kActivationLevels8 / amax : 0.0f, d = amax / kActivationLevels8;
    e.step[r] = std::ldexp(d, -cap);
    double norm = 0.0, error = 0.0;
    int64_t correction = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = 32 * g, end = std::min(hidden, begin + 32);
      float gmax = 0.0f;
      for (int64_t i = begin; i < end; ++i) gmax = std::max(gmax, std::fabs(xr[i]));
      int shift = 0;
      while (shift < cap && amax > 0.0f && std::ldexp(gmax, shift + 1) <= amax) ++shift;
      e.exponent[r * groups + g] = cap - shift;
      e.factor[r * groups + g] = (int32_t(1) << (cap - shift)) * 0x10001;  // 2^e_g in both int16 halves
      const float scaled = std::ldexp(inverse, shift);
      const double group_step = std::ldexp(double(d), -shift);
      int64_t group_sum = 0;
      for (int64_t i = begin; i < end; ++i) {
        const int32_t q = std::clamp(int32_t(std::nearbyint(xr[i] * scaled)), -127, 127);
        e.magnitude[r * hidden + i] = uint8_t(std::abs(q));
        e.value[r * hidden + i] = int8_t(q);
        group_sum += q;
        const double rest = double(xr[i]) - group_step * q;
        norm += double(xr[i]) * xr[i];
        error += rest * rest;
      }
      correction += 128 * group_sum * (int64_t(1) << (cap - shift));
    }
    e.correction[r] = int32_t(uint32_t(uint64_t(correction)));  // modulo 2^32, as the kernel sums
    x_norm[r] = float(std::sqrt(norm) * (1.0 + 1e-6));  // rounded up: the bound stays a bound
    x_error[r] = float(std::sqrt(error) * (1.0 + 1e-6));
  }
  e.view = Eight{e.magnitude.data(), e.value.data(), e.exponent.data(), e.factor.data(), e.correction.data(),
                 e.step.data(),
                 hidden, quads, groups};
  return e;
}

// The screen of x [R, H] into approx and bound [R, V]; with `block_max` (float [2, R, V/16]), also
// each block's max(approx - bound) (plane 0) and max(approx + bound) (plane 1) for each row.
void screen_into(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& sums,
                 const at::Tensor& weight_error, const at::Tensor& approx_norm, at::Tensor& approx,
                 at::Tensor& bound, float* block_max) {
  const ScreenFn* tiles = screen_tiles();
  const int64_t vocab = packed.size(0) * kRows, hidden = packed.size(1) * 4, rows = x.size(0);
  const int64_t blocks = vocab / kRows;
  // 1. Each row: its integers (14 bits: hi + 64, lo + 64 as unsigned bytes; 8 bits: Eighths),
  // |x| and |x - x^|.
  const bool eight = screen_bits == 8;
  std::vector<uint8_t> hi(rows * hidden), lo(eight ? 0 : rows * hidden);
  std::vector<float> d(rows), x_norm(rows), x_error(rows);
  Eighths e;
  const float* xp = x.data_ptr<float>();
  if (eight) e = prepare_eight(xp, rows, hidden, x_norm.data(), x_error.data());
  for (int64_t r = 0; r < rows && !eight; ++r) {
    const float* xr = xp + r * hidden;
    float amax = 0.0f;
    for (int64_t i = 0; i < hidden; ++i) amax = std::max(amax, std::fabs(xr[i]));
    const float inverse = amax > 0.0f ? kActivationLevels / amax : 0.0f;
    d[r] = amax / kActivationLevels;
    double norm = 0.0, error = 0.0;
    for (int64_t i = 0; i < hidden; ++i) {
      const int32_t q = int32_t(std::nearbyint(xr[i] * inverse));
      const int32_t h = activation_high(q), l = q - 128 * h;
      hi[r * hidden + i] = uint8_t(h + 64);
      lo[r * hidden + i] = uint8_t(l + 64);
      const double rest = double(xr[i]) - double(d[r]) * q;
      norm += double(xr[i]) * xr[i];
      error += rest * rest;
    }
    x_norm[r] = float(std::sqrt(norm) * (1.0 + 1e-6));  // rounded up: the bound stays a bound
    x_error[r] = float(std::sqrt(error) * (1.0 + 1e-6));
  }
  // 2. Blocks of 16 vocabulary rows over the threads: register tiles of B blocks x R rows (8 bits,
  // int8_screen_tiles.h), or 1 block x 4 rows (14 bits), then each block's extremes.
  const int8_t* weights = packed.data_ptr<int8_t>();
  const int64_t quads = hidden / 4, stride = quads * 64;
  float* ap = approx.data_ptr<float>();
  float* bp = bound.data_ptr<float>();
  if (eight) {
    const TileChoice choice = eight_bit_tiles();
    const int64_t wide = rows == 1 ? choice.shape.blocks_one_row : choice.shape.blocks_many_rows;
    const int64_t wide_tiles = blocks / wide, tiles_total = wide_tiles + blocks % wide;
    const float* scale_p = scale.data_ptr<float>();
    const float* weight_error_p = weight_error.data_ptr<float>();
    const float* approx_norm_p = approx_norm.data_ptr<float>();
    // Streamed where only the candidates' blocks are read again (block_max given: the greedy and
    // candidate screens) and there are several rows; int8_screen's callers read every value (the
    // Gumbel screen), and one row's 400 KB fit in L2 for the argmax that reads them whole next.
    const bool stream = screen_streaming && block_max != nullptr && rows > 1 &&
                        reinterpret_cast<uintptr_t>(ap) % 64 == 0 && reinterpret_cast<uintptr_t>(bp) % 64 == 0;
    eyas::pool_for(0, tiles_total, 4, [&](int64_t begin, int64_t end) {
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t width = tile < wide_tiles ? wide : 1;
        const int64_t block = tile < wide_tiles ? tile * wide : wide_tiles * wide + (tile - wide_tiles);
        const int64_t j = block * kRows;
        for (int64_t r = 0; r < rows; r += choice.shape.max_rows) {
          const int64_t n = std::min<int64_t>(choice.shape.max_rows, rows - r);
          const screen::TileOut out{scale_p + j, weight_error_p + j, approx_norm_p + j, x_norm.data() + r,
                                    x_error.data() + r,
                                    ap + r * vocab + j, bp + r * vocab + j,
                                    block_max == nullptr ? nullptr : block_max + r * blocks + block,
                                    vocab, rows * blocks, blocks,
                                    rows == 1 ? screen::kPrefetchOneRow : width * stride, stream};
          choice.tiles[width][n](weights + block * stride, stride, e.view, r, out);
        }
      }
#ifdef EYAS_AVX2
      _mm_sfence();  // the streamed stores (int8_screen_tiles.h) before the chunk counts as done
#endif
    });
    return;
  }
  eyas::pool_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t j = block * kRows;
      for (int64_t r = 0; r < rows; r += kTile) {
        const int64_t n = std::min(kTile, rows - r);
        tiles[n](weights + block * stride, quads, hi.data() + r * hidden, lo.data() + r * hidden, hidden,
                 d.data() + r, x_norm.data() + r, x_error.data() + r, scale.data_ptr<float>() + j,
                 sums.data_ptr<int32_t>() + j, weight_error.data_ptr<float>() + j,
                 approx_norm.data_ptr<float>() + j, ap + r * vocab + j, bp + r * vocab + j, vocab);
      }
      if (block_max == nullptr) continue;
      for (int64_t r = 0; r < rows; ++r) {  // the block's extremes, while it is in L1
        const float* a = ap + r * vocab + j;
        const float* b = bp + r * vocab + j;
        float lower = a[0] - b[0], upper = a[0] + b[0];
        for (int64_t c = 1; c < kRows; ++c) {
          lower = std::max(lower, a[c] - b[c]);
          upper = std::max(upper, a[c] + b[c]);
        }
        block_max[r * blocks + block] = lower;
        block_max[(rows + r) * blocks + block] = upper;
      }
    }
  });
}

struct Checked {
  at::Tensor x, scale, sums, weight_error, approx_norm;
};

Checked check(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_in,
              const at::Tensor& sums_in, const at::Tensor& weight_error_in, const at::Tensor& approx_norm_in) {
  TORCH_CHECK(screen_tiles() != nullptr, "this build of the eyas extension has no int8 dot-product kernel (no AVX2)");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "packed must be int8 [V/16, H/4, 64] (int8_screen_pack)");
  const int64_t vocab = packed.size(0) * kRows, hidden = packed.size(1) * 4;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == hidden, "x must be [R, ", hidden, "]");
  Checked c{x_in.to(at::kFloat).contiguous(), scale_in.to(at::kFloat).contiguous(), sums_in.to(at::kInt).contiguous(),
            weight_error_in.to(at::kFloat).contiguous(), approx_norm_in.to(at::kFloat).contiguous()};
  TORCH_CHECK(c.scale.numel() == vocab && c.sums.numel() == vocab && c.weight_error.numel() == vocab &&
              c.approx_norm.numel() == vocab, "scale, sums, weight_error and approx_norm must have V entries");
  return c;
}

}  // namespace

// A candidate's logit x . w in float64, rounded once to float32: the float32 logit up to its last
// bit. 32 partial sums (lanes i mod 32: four 512-bit or eight 256-bit registers of float64 once
// the compiler vectorises them), then one fixed order of additions: the same bits whatever the
// instruction set, at a few cycles per 8 inputs instead of one float64 addition's latency per input.
float exact_logit(const float* x, const float* w, int64_t hidden) {
  constexpr int kLanes = 32;
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= hidden; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += double(x[i + l]) * double(w[i + l]);
  for (int l = 0; i + l < hidden; ++l) lanes[l] += double(x[i + l]) * double(w[i + l]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return float(lanes[0]);
}

std::tuple<at::Tensor, at::Tensor> int8_screen(const at::Tensor& x_in, const at::Tensor& packed,
                                               const at::Tensor& scale_in, const at::Tensor& sums_in,
                                               const at::Tensor& weight_error_in, const at::Tensor& approx_norm_in) {
  const Checked c = check(x_in, packed, scale_in, sums_in, weight_error_in, approx_norm_in);
  const int64_t rows = c.x.size(0), vocab = packed.size(0) * kRows;
  at::Tensor approx = at::empty({rows, vocab}, c.x.options()), bound = at::empty({rows, vocab}, c.x.options());
  if (rows > 0) screen_into(c.x, packed, c.scale, c.sums, c.weight_error, c.approx_norm, approx, bound, nullptr);
  return {approx, bound};
}

namespace {

// The screen of x [R, H] with each block's extremes, then each row's candidates: every logit whose
// interval [approx - bound, approx + bound] reaches the row's best lower bound. `visit(r, j, a)` is
// called for each (a: the row's approx [V], which it may overwrite at j), rows over the threads,
// in increasing j within a row.
template <typename Visit>
at::Tensor screen_candidates(const Checked& c, const at::Tensor& packed, Visit visit) {
  const int64_t rows = c.x.size(0), vocab = packed.size(0) * kRows, blocks = vocab / kRows;
  at::Tensor approx = at::empty({rows, vocab}, c.x.options()), bound = at::empty({rows, vocab}, c.x.options());
  if (rows == 0) return approx;
  std::vector<float> block_max(2 * rows * blocks);
  screen_into(c.x, packed, c.scale, c.sums, c.weight_error, c.approx_norm, approx, bound, block_max.data());
  float* ap = approx.data_ptr<float>();
  const float* bp = bound.data_ptr<float>();
  eyas::pool_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* lower = block_max.data() + r * blocks;
      const float* upper = block_max.data() + (rows + r) * blocks;
      const float best_lower = *std::max_element(lower, lower + blocks);
      float* a = ap + r * vocab;
      const float* b = bp + r * vocab;
      for (int64_t block = 0; block < blocks; ++block) {
        if (!(upper[block] >= best_lower)) continue;
        for (int64_t j = block * kRows; j < (block + 1) * kRows; ++j)
          if (a[j] + b[j] >= best_lower) visit(r, j, a);
      }
    }
  });
  return approx;
}

}  // namespace

at::Tensor int8_screen_greedy(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_in,
                              const at::Tensor& sums_in, const at::Tensor& weight_error_in,
                              const at::Tensor& approx_norm_in, const at::Tensor& weight_in) {
  const Checked c = check(x_in, packed, scale_in, sums_in, weight_error_in, approx_norm_in);
  const int64_t vocab = packed.size(0) * kRows, hidden = packed.size(1) * 4;
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.size(0) == vocab && weight_in.size(1) == hidden &&
              weight_in.scalar_type() == at::kFloat, "weight must be float32 [", vocab, ", ", hidden, "]");
  const at::Tensor weight = weight_in.contiguous();
  const float* xp = c.x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  return screen_candidates(c, packed, [&](int64_t r, int64_t j, float* a) {
    a[j] = exact_logit(xp + r * hidden, wp + j * hidden, hidden);  // 4. each candidate, exactly
  });
}

std::vector<int64_t> int8_screen_argmax(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_in,
                                        const at::Tensor& sums_in, const at::Tensor& weight_error_in,
                                        const at::Tensor& approx_norm_in, const at::Tensor& weight_in) {
  const int64_t vocab = packed.size(0) * kRows, hidden = packed.size(1) * 4;
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == hidden, "x must be [..., ", hidden, "]");
  const Checked c = check(x_in.reshape({-1, hidden}), packed, scale_in, sums_in, weight_error_in, approx_norm_in);
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.size(0) == vocab && weight_in.size(1) == hidden &&
              weight_in.scalar_type() == at::kFloat, "weight must be float32 [", vocab, ", ", hidden, "]");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t rows = c.x.size(0);
  const float* xp = c.x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  std::vector<int64_t> best(rows, -1);
  std::vector<float> best_value(rows);
  const at::Tensor approx = screen_candidates(c, packed, [&](int64_t r, int64_t j, float* a) {
    const float value = a[j] = exact_logit(xp + r * hidden, wp + j * hidden, hidden);  // increasing j
    const float held = best_value[r];
    if (best[r] < 0 || (!std::isnan(held) && (value > held || std::isnan(value)))) best[r] = j, best_value[r] = value;
  });
  // A row whose inputs are not all finite has no meaningful bound: the first maximum of the whole
  // row as int8_screen_greedy leaves it (NaN counting as the largest, as torch.argmax and NumPy's).
  const float* ap = approx.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * hidden;
    if (best[r] >= 0 && std::all_of(xr, xr + hidden, [](float v) { return std::isfinite(v); })) continue;
    const float* a = ap + r * vocab;
    int64_t at = 0;
    for (int64_t j = 1; j < vocab && !std::isnan(a[at]); ++j)
      if (a[j] > a[at] || std::isnan(a[j])) at = j;
    best[r] = at;
  }
  return best;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_screen_candidates(
    const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_in, const at::Tensor& sums_in,
    const at::Tensor& weight_error_in, const at::Tensor& approx_norm_in) {
  const Checked c = check(x_in, packed, scale_in, sums_in, weight_error_in, approx_norm_in);
  std::vector<std::vector<int64_t>> found(c.x.size(0));
  at::Tensor approx = screen_candidates(c, packed, [&](int64_t r, int64_t j, float*) { found[r].push_back(j); });
  int64_t count = 0;
  for (const auto& row : found) count += int64_t(row.size());
  at::Tensor rows = at::empty({count}, at::kLong), columns = at::empty({count}, at::kLong);
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t* cp = columns.data_ptr<int64_t>();
  for (int64_t r = 0; r < int64_t(found.size()); ++r)
    for (const int64_t j : found[r]) *rp++ = r, *cp++ = j;
  return {approx, rows, columns};
}

int screen_activation_bits() { return screen_bits; }

bool screen_streams() { return screen_streaming; }

void set_screen_streaming(bool on) { screen_streaming = on; }

void set_screen_activation_bits(int64_t bits) {
  TORCH_CHECK(bits == 14 || bits == 8, "int8 screen activations: 14 or 8 bits, not ", bits);
  screen_bits = int(bits);
}

}  // namespace eyas

TORCH_LIBRARY_FRAGMENT(eyas, m) {
  m.def("int8_screen_greedy(Tensor x, Tensor packed, Tensor scale, Tensor sums, Tensor weight_error, "
        "Tensor approx_norm, Tensor weight) -> Tensor", &eyas::int8_screen_greedy);
  m.def("int8_screen_candidates(Tensor x, Tensor packed, Tensor scale, Tensor sums, Tensor weight_error, "
        "Tensor approx_norm) -> (Tensor, Tensor, Tensor)", &eyas::int8_screen_candidates);
}
