// int4 weights x int8 activations with integer dot products: the matrix products of the fused
// layers, on AVX512-VNNI or AVX2 (int8dot.h: the same bits on both), and where the CPU has AMX,
// whole tiles of 16 rows on its tiles (amx:: below: the same bits again).
//
// Why: PyTorch's CPU int4 kernel turns every weight back into a float and multiplies in bf16;
// on the 2-core machine a SmolLM2 layer costs 134 us for one row and ~47 us more per extra row,
// so a verification pass over 8 tokens spent 13 ms of its 35 in it (old BENCHMARKS.md section 1).
// Here, as in llama.cpp's Q4_1 x Q8 dot products, each row of activations is rounded to
// integers with one scale per 32 inputs and multiplied by the 4-bit codes with the integer
// dot-product instruction (vpdpbusd: 64 multiply-adds per instruction); a block of weights is
// unpacked once and used for up to 8 rows.
//
// Activations get 14 bits, not 8 (int8dot.h): xq = round(x / d) in -8191..8191 with
// d = max|x| / 8191 per group of 32 inputs, split as xq = 128 * hi + lo with hi, lo in -64..64,
// two int8 operands of the same unpacked weights (twice the dot products of 8 bits). Rounding to int8 alone
// (llama.cpp's Q8) cost SmolLM2-135M too much, in any one of its projections: top-1 agreement
// with float32 fell from 99.0% (PyTorch's kernel on bf16 activations) to 94.9%, where 14 bits
// give 99.9% (BENCHMARKS.md, "Kernels and precisions"). No finer 8-bit form closes the gap
// (scripts/activation-arithmetic.py emulates each on the real weights; 40 MT-Bench prompts,
// 4,738 positions, where 14 bits agree at 99.89%): one scale per 16 inputs 96.9%, per 8 97.7%,
// the mean rounding error of each group added back 98.0%, the 4 groups of largest max|x| of a
// row in 14 bits 98.1%, its 16 largest inputs exact 98.6%, 8 bits in o_proj alone 99.2%, 12 bits
// 99.7%. The error is spread over every input and projection; ~13 bits are needed, and past 8
// every multiply-add costs a second pass of the dot-product instruction. 8 bits stay selectable
// (set_int4_activation_bits(8), EYAS_INT4_ACTIVATIONS=8 in fused_cpu.py): xq = round(x / d) in
// -127..127 with d = max|x| / 127, one int8 operand, half the dot products of each row.
//
// The floor it chases: at one row, the packed weights read once (memory bandwidth); at many,
// the integer multiply-adds at the instruction's peak (16 vpdpbusd per row, 16 columns and 32
// inputs at 14 bits, 8 at 8 bits), with the float epilogue of a group (~8 instructions per row)
// and the unpacking of a block (16 instructions per 8 rows) kept small next to them.
//
// Numerics: y[n, o] = sum over groups g of d[n,g] * s[o,g] * (codes[o,g] . xq[n,g])
//                                          + m[o,g] * sum(x[n,g]),
// with s and m the group's float16 scale and minimum. The integer dots are exact; the float
// accumulation runs over groups in order, one output column per SIMD lane. A row's values
// depend on that row alone, never on how many rows share the call or which tile it falls in:
// the property that keeps speculative decoding lossless (decoder_layer.cpp).
//
// On AVX2 the dot products take vpmaddubsw (codes x activations, pairs summed in int16) and
// vpmaddwd: a code is at most 15 and |hi|, |lo| <= 64, so the eight int16 partial sums of a
// group stay below 2^15 and every integer is the one vpdpbusd computes; the float operations
// are the same, lane by lane, so the two give the same bits. The AVX2 tile covers 8 columns
// (half a block) and 4 rows, for the 16 vector registers.
//
// Layout (int4_pack): uint8 [O/16, I/32, 320]. In a block of 16 columns x 32 inputs,
// bytes 0..255 are four 64-byte chunks; chunk p holds, for column c at bytes 4c..4c+3, the codes
// of inputs 4p..4p+3 in the low nibbles and of inputs 16+4p..16+4p+3 in the high nibbles, so
// one AND (and a shift) gives the operand of a vpdpbusd over 16 columns x 4 inputs. Bytes
// 256..287 are the 16 columns' float16 scales, 288..319 their float16 minimums.

#include "int4_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "int8dot.h"
#include "phase_timer.h"

#if defined(EYAS_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define EYAS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace eyas {
namespace {

constexpr int64_t kColumns = 16, kGroup = 32, kBlockBytes = 320;
// Software prefetch (int4_prefetch, EYAS_INT4_PREFETCH in models/extension.py), two ways:
// - "stream" (the default): each group's 5 cache lines are requested kPrefetchBytes ahead in the
//   thread's stream of blocks (a chunk's blocks lie one after another; past a chunk's end the
//   lines belong to the next block, read once from DRAM whichever thread claims it);
// - "blocks": each block of columns, whole, kAheadBlocks blocks ahead, in one burst before the
//   block is multiplied (what ran before).
// The bursts stalled where a block is large: on the 1.5B Qwen (a down projection's block is 280
// groups, 90 KB) a one-token step took 52 ms against 40 ms streaming 2 KB ahead, 8 rows 106
// against 78 ms; 1-2.5 KB ahead were within 5% of each other, 5-10 KB as slow as the bursts
// (Intel Xeon model 167; BENCHMARKS.md, "Kernels and precisions"). Only the time changes: the
// values are the same bits either way.
// (kPrefetchBytes, kAheadBlocks and the two prefetches: int8dot.h, shared with int8_gemm.cpp.)
enum class Prefetch { stream, blocks };
std::atomic<int> prefetch_mode{int(Prefetch::stream)};

// The cache lines of the group kPrefetchBytes ahead of `group` (320 bytes: 5 lines).
inline void prefetch_ahead(const uint8_t* group) { prefetch_group_ahead<kBlockBytes>(group); }

// The smallest chunk of blocks a thread claims in a region: ~0.5 us of work at one row, next to
// ~0.1 us for a contended claim.
constexpr int64_t kBlocksPerChunk = 2;

// The implementations this build has, best first, with their names.
const std::vector<std::pair<Int8Dot, std::string>>& built() {
  static const std::vector<std::pair<Int8Dot, std::string>> kinds = {
#ifdef EYAS_VNNI
      {Int8Dot::avx512vnni, "avx512vnni"},
#endif
#ifdef EYAS_AVX2
      {Int8Dot::avx2, "avx2"},
#endif
  };
  return kinds;
}

Int8Dot selected = built().empty() ? Int8Dot::none : built().front().first;

// Per row and group of x [rows, in]: the activation codes (14 bits: hi[32] then lo[32], codes
// [rows, in / 32, 2, 32]; 8 bits: codes [rows, in / 32, 32]), the scale d and the sum of the
// group's 32 inputs, [rows, in / 32].
struct Quantized {
  std::vector<int8_t> codes;
  std::vector<float> scales, sums;
};

// Which activation arithmetic runs (int8dot.h): 14 bits (two int8 parts) unless set to 8.
int activation_bits = 14;

#ifdef EYAS_AMX
// Linux hands out AMX's 8 KB of tile state only on request (arch_prctl, once per process).
bool amx_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}
#endif

// Whether whole tiles of 16 rows run on AMX (int4_amx, EYAS_INT4_AMX): where the CPU and the
// build have it and Linux grants it, unless turned off.
std::atomic<bool> amx_on{
#ifdef EYAS_AMX
    amx_permitted()
#else
    false
#endif
};

#ifdef EYAS_VNNI
namespace vnni {

constexpr int64_t kTileRows = 8;

// Stores the low bytes of 16 int32 lanes (each in -128..127) at out.
inline void store_bytes(int8_t* out, __m512i v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(v));
}

template <int Parts>
void quantize_group(const float* xg, int8_t* out, float* scale, float* sum) {
  constexpr float levels = Parts == 2 ? kActivationLevels : kActivationLevels8;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
  const float inverse = amax > 0.0f ? levels / amax : 0.0f;
  const __m512 scaled = _mm512_set1_ps(inverse);
  for (int i = 0; i < 2; ++i) {  // xq = round(x / d); 14 bits: hi = round(xq / 128), lo = xq - 128 hi
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(i ? b : a, scaled));
    if (Parts == 1) {
      store_bytes(out + 16 * i, q);
      continue;
    }
    const __m512i hi = activation_high(q);
    store_bytes(out + 16 * i, hi);
    store_bytes(out + kGroup + 16 * i, _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 7)));
  }
  *scale = amax / levels;
  const __m512 both = _mm512_add_ps(a, b);
  *sum = sum8(_mm256_add_ps(_mm512_castps512_ps256(both), _mm512_extractf32x8_ps(both, 1)));
}

// One block of 16 columns for `R` rows: y[r, col0 .. col0 + 15] for r < R, activations in
// `Parts` int8 parts (2: 14 bits, 1: 8 bits).
template <int R, int Parts>
void tile(const uint8_t* block, int64_t groups, const int8_t* codes, int64_t in, const float* scales,
          const float* sums, float* y, int64_t out, bool prefetch) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, block += kBlockBytes) {
    if (prefetch) prefetch_ahead(block);
    __m512i w[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i chunk = _mm512_loadu_si512(block + 64 * p);
      w[p] = _mm512_and_si512(chunk, low);
      w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 256)));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 288)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = codes + (r * in + g * kGroup) * Parts;  // 14 bits: hi[32] then lo[32]
      // codes . xq = 128 (codes . hi) + codes . lo, exact; independent chains of vpdpbusd (5
      // cycles of latency each) instead of one chain of 16.
      __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                         _mm512_setzero_si512()};
      for (int part = 0; part < Parts; ++part) {
        for (int j = 0; j < 8; ++j) {
          int32_t quad;
          std::memcpy(&quad, xg + part * kGroup + 4 * j, sizeof(quad));
          __m512i& dot = dots[2 * part + (j & 1)];
          dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(quad));
        }
      }
      const __m512i dot = Parts == 1 ? _mm512_add_epi32(dots[0], dots[1])
                                     : _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(dots[0], dots[1]), 7),
                                                        _mm512_add_epi32(dots[2], dots[3]));
      const __m512 d = _mm512_mul_ps(scale, _mm512_set1_ps(scales[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[r]);
      acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out, acc[r]);
}

// The tile for one row (R = 1: a one-token step), where the unpacking of the weights is not
// shared by several rows and competes with the row's own dot products. The high nibbles stay in
// place (byte & 0xF0 = 16 * code: no shift), so their dot products come out 16 times too large:
// with L and H the low and high nibbles' dots of the activations' parts (hi then lo, 14 bits),
// codes . xq = ((L_hi << 7) + L_lo) + (((16 H_hi) << 7) + 16 H_lo) >> 4, the last shift exact.
// 14 vector operations besides the dot products instead of 16, four independent chains of
// vpdpbusd as in tile<>: ~4% less time per block on data in the cache (Xeon model 207). Every
// integer is exact in int32 (|16 * codes . xq| <= 16 * 32 * 15 * 8191 < 2^31) and the float
// operations are tile<1>'s, so a row gets the same bits as in a tile of several rows (and as
// on AVX2).
template <int Parts>
void one_row(const uint8_t* block, int64_t groups, const int8_t* codes, int64_t, const float* scales,
             const float* sums, float* y, int64_t, bool prefetch) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(int8_t(0xF0));
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, block += kBlockBytes) {
    if (prefetch) prefetch_ahead(block);
    __m512i w[8];  // w[p]: codes of inputs 4p..4p+3; w[p + 4]: 16 * codes of inputs 16+4p..16+4p+3
    for (int p = 0; p < 4; ++p) {
      const __m512i chunk = _mm512_loadu_si512(block + 64 * p);
      w[p] = _mm512_and_si512(chunk, low);
      w[p + 4] = _mm512_and_si512(chunk, high);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 256)));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 288)));
    const int8_t* xg = codes + g * kGroup * Parts;  // 14 bits: hi[32] then lo[32]
    __m512i lows[Parts], highs[Parts];  // per part: L, 16 H
    for (int part = 0; part < Parts; ++part) {
      __m512i l = _mm512_setzero_si512(), h = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        int32_t quad_low, quad_high;
        std::memcpy(&quad_low, xg + part * kGroup + 4 * j, sizeof(quad_low));
        std::memcpy(&quad_high, xg + part * kGroup + 16 + 4 * j, sizeof(quad_high));
        l = _mm512_dpbusd_epi32(l, w[j], _mm512_set1_epi32(quad_low));
        h = _mm512_dpbusd_epi32(h, w[j + 4], _mm512_set1_epi32(quad_high));
      }
      lows[part] = l;
      highs[part] = h;
    }
    const __m512i l = Parts == 1 ? lows[0] : _mm512_add_epi32(_mm512_slli_epi32(lows[0], 7), lows[Parts - 1]);
    const __m512i h = Parts == 1 ? highs[0] : _mm512_add_epi32(_mm512_slli_epi32(highs[0], 7), highs[Parts - 1]);
    const __m512i dot = _mm512_add_epi32(l, _mm512_srai_epi32(h, 4));
    const __m512 d = _mm512_mul_ps(scale, _mm512_set1_ps(scales[g]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc);
    acc = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[g]), acc);
  }
  _mm512_storeu_ps(y, acc);
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const float*, const float*, float*, int64_t,
                       bool);
template <int Parts>
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, one_row<Parts>, tile<2, Parts>, tile<3, Parts>, tile<4, Parts>,
                                          tile<5, Parts>, tile<6, Parts>, tile<7, Parts>, tile<8, Parts>};

#ifdef EYAS_AMX
// Intel AMX (Sapphire Rapids and later Xeons): one tdpbsud multiplies a tile of up to 16 rows x
// 32 int8 activations by 32 x 16 unsigned codes into 16 x 16 int32 dot products, 16 x 16 x 32
// multiply-adds in one instruction where vpdpbusd does 16 x 4. The integers are exact, as
// vpdpbusd's, and the float epilogue of each row is tile<>'s, operation for operation, so a row
// gets the same bits with or without AMX (tests/models/test_int4_int8dot.py). With one scale
// per 32 inputs on both sides, every group's 16 x 16 dots leave the tile for that epilogue (the
// int32 dots back from memory, convert, two fused multiply-adds per row), which is what a row
// costs here. Overlapping the tile work of one group with the epilogue of the last (below), the
// product runs 1.27x / 1.34x / 1.42x the VNNI kernel's speed at 16 / 32 / 64 rows (Xeon model
// 167; BENCHMARKS.md, "Kernels and precisions"); below 16 rows it would lose, and stays on vpdpbusd.
namespace amx {

constexpr int64_t kRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0/1 and tmm6/7: dot products of the high and low activation parts, 16 rows x 16 int32 (two
// sets); tmm2, tmm3: the parts, 16 rows x 32 int8; tmm4, tmm5: a group's codes, 8 rows of 16
// columns x 4 inputs (two sets).
const TileConfig& config() {
  static const TileConfig tiles = [] {
    TileConfig c;
    for (int t : {0, 1, 6, 7}) c.colsb[t] = 64, c.rows[t] = kRows;
    for (int t : {2, 3}) c.colsb[t] = kGroup, c.rows[t] = kRows;
    for (int t : {4, 5}) c.colsb[t] = 64, c.rows[t] = 8;
    return c;
  }();
  return tiles;
}

// The epilogue of group g for rows [0, R) of a tile: vnni::tile<>'s, operation for operation.
template <int Parts>
inline void epilogue(const uint8_t* group, const int32_t* dots, const float* scales, const float* sums,
                     int64_t groups, int64_t g, int64_t R, __m512* acc) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 256)));
  const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 288)));
  for (int64_t r = 0; r < R; ++r) {
    const __m512i high = _mm512_load_si512(dots + 16 * r);
    const __m512i dot = Parts == 1 ? high : _mm512_add_epi32(_mm512_slli_epi32(high, 7), _mm512_load_si512(dots + 256 + 16 * r));
    const __m512 d = _mm512_mul_ps(scale, _mm512_set1_ps(scales[r * groups + g]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[r]);
    acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[r * groups + g]), acc[r]);
  }
}

// The dot products of group g for a 16-row tile into dots [Parts][16 x 16]: tiles set 0 (C in
// tmm0/1, codes in tmm4) or set 1 (tmm6/7, tmm5), so that one group's tile work can start while
// the last group's results are still being read; the activation parts load into tmm2/3. (The
// tile intrinsics take literal register numbers, hence the macro.)
#define EYAS_GROUP_DOTS(HI, LO, CODES)            \
  _tile_loadd(CODES, weights, 64);                \
  _tile_zero(HI);                                 \
  _tile_loadd(2, xg, stride);                     \
  _tile_dpbsud(HI, 2, CODES);                     \
  _tile_stored(HI, dots, 64);                     \
  if (Parts == 2) {                               \
    _tile_zero(LO);                               \
    _tile_loadd(3, xg + kGroup, stride);          \
    _tile_dpbsud(LO, 3, CODES);                   \
    _tile_stored(LO, dots + 256, 64);             \
  }

template <int Parts, int Set>
inline void group_dots(const uint8_t* weights, const int8_t* xg, int64_t stride, int32_t* dots) {
  if (Set == 0) {
    EYAS_GROUP_DOTS(0, 1, 4)
  } else {
    EYAS_GROUP_DOTS(6, 7, 5)
  }
}
#undef EYAS_GROUP_DOTS

// One block of 16 columns for every row. The block's codes are unpacked once into tile rows
// (shared by every 16-row tile); then, per tile, group g's tile work (loads, tdpbsud, stores)
// is issued before group g - 1's float epilogue, so the two units overlap. Rows past the last
// 16-row tile go to vpdpbusd.
template <int Parts>
void block_columns(const uint8_t* block, int64_t groups, const Quantized& xq, int64_t rows, int64_t in, float* y,
                   int64_t out) {
  static thread_local std::vector<uint8_t> weights;  // [groups][8 x 64]
  if (int64_t(weights.size()) < groups * 512) weights.resize(groups * 512);
  alignas(64) int32_t dots[2][Parts * 256];
  const __m512i low = _mm512_set1_epi8(0x0F);
  const bool prefetch = int4_prefetch_streams();
  for (int64_t g = 0; g < groups; ++g) {  // tile rows in input order: inputs 4k..4k+3 of each column
    const uint8_t* group = block + g * kBlockBytes;
    if (prefetch) prefetch_ahead(group);
    uint8_t* w = weights.data() + g * 512;
    for (int p = 0; p < 4; ++p) {
      const __m512i chunk = _mm512_loadu_si512(group + 64 * p);
      _mm512_storeu_si512(w + 64 * p, _mm512_and_si512(chunk, low));
      _mm512_storeu_si512(w + 64 * (p + 4), _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low));
    }
  }
  _tile_loadconfig(&config());  // per block: other code on this thread (oneDNN) may set its own
  const int64_t whole = rows / kRows * kRows, stride = in * Parts;
  for (int64_t r0 = 0; r0 < whole; r0 += kRows) {
    const int8_t* codes = xq.codes.data() + r0 * stride;
    const float* scales = xq.scales.data() + r0 * groups;
    const float* sums = xq.sums.data() + r0 * groups;
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g <= groups; ++g) {
      if (g < groups) {
        if (g & 1)
          group_dots<Parts, 1>(weights.data() + g * 512, codes + g * kGroup * Parts, stride, dots[1]);
        else
          group_dots<Parts, 0>(weights.data() + g * 512, codes + g * kGroup * Parts, stride, dots[0]);
      }
      if (g > 0)
        epilogue<Parts>(block + (g - 1) * kBlockBytes, dots[(g - 1) & 1], scales, sums, groups, g - 1, kRows, acc);
    }
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(y + (r0 + r) * out, acc[r]);
  }
  for (int64_t r = whole; r < rows; r += kTileRows) {
    const int64_t n = std::min(kTileRows, rows - r);
    vnni::kTiles<Parts>[n](block, groups, xq.codes.data() + r * stride, in, xq.scales.data() + r * groups,
                           xq.sums.data() + r * groups, y + r * out, out, false);
  }
}

}  // namespace amx
#endif

// Columns [block * 16, block * 16 + 16) of y for every row (the first tile of rows prefetches).
template <int Parts>
void block_columns(const uint8_t* block, int64_t groups, const Quantized& xq, int64_t rows, int64_t in, float* y,
                   int64_t out) {
#ifdef EYAS_AMX
  if (rows >= amx::kRows && amx_on.load(std::memory_order_relaxed))
    return amx::block_columns<Parts>(block, groups, xq, rows, in, y, out);
#endif
  for (int64_t r = 0; r < rows; r += kTileRows) {
    const int64_t n = std::min(kTileRows, rows - r);
    kTiles<Parts>[n](block, groups, xq.codes.data() + r * in * Parts, in, xq.scales.data() + r * groups,
                     xq.sums.data() + r * groups, y + r * out, out, r == 0 && int4_prefetch_streams());
  }
}

}  // namespace vnni
#endif

#ifdef EYAS_AVX2
namespace avx2 {

constexpr int64_t kTileRows = 4;

template <int Parts>
void quantize_group(const float* xg, int8_t* out, float* scale, float* sum) {
  constexpr float levels = Parts == 2 ? kActivationLevels : kActivationLevels8;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xg + 8 * i);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));  // max: exact in any order
  const float inverse = amax > 0.0f ? levels / amax : 0.0f;
  const __m256 scaled = _mm256_set1_ps(inverse);
  __m256i hi[4], lo[4];
  for (int i = 0; i < 4; ++i) {  // xq = round(x / d); 14 bits: hi = round(xq / 128), lo = xq - 128 hi
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scaled));
    hi[i] = Parts == 1 ? q : activation_high(q);
    lo[i] = _mm256_sub_epi32(q, _mm256_slli_epi32(hi[i], 7));
  }
  // 32 int32 -> 32 int8 in order: the packs interleave 128-bit lanes, the permutation undoes it
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i high = _mm256_packs_epi16(_mm256_packs_epi32(hi[0], hi[1]), _mm256_packs_epi32(hi[2], hi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(high, order));
  if (Parts == 2) {
    const __m256i rest = _mm256_packs_epi16(_mm256_packs_epi32(lo[0], lo[1]), _mm256_packs_epi32(lo[2], lo[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kGroup), _mm256_permutevar8x32_epi32(rest, order));
  }
  *scale = amax / levels;
  *sum = sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3])));  // as vnni's
}

// Columns half * 8 .. half * 8 + 7 of one block for `R` rows, activations in `Parts` parts.
template <int R, int Parts>
void tile(const uint8_t* block, int half, int64_t groups, const int8_t* codes, int64_t in, const float* scales,
          const float* sums, float* y, int64_t out, bool prefetch) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, block += kBlockBytes) {
    if (prefetch) prefetch_ahead(block);
    __m256i w[8];
    for (int p = 0; p < 4; ++p) {
      const __m256i chunk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * p + 32 * half));
      w[p] = _mm256_and_si256(chunk, low);
      w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), low);
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 256 + 16 * half)));
    const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 288 + 16 * half)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = codes + (r * in + g * kGroup) * Parts;  // 14 bits: hi[32] then lo[32]
      // int16 lanes: |sum of 8 pairs| <= 8 * 2 * 15 * 64 (14 bits) or 8 * 2 * 15 * 127 (8 bits)
      // < 2^15, exact
      __m256i part_sums[2];
      for (int part = 0; part < Parts; ++part) {
        __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int j = 0; j < 8; ++j) {
          int32_t quad;
          std::memcpy(&quad, xg + part * kGroup + 4 * j, sizeof(quad));
          s[j & 1] = _mm256_add_epi16(s[j & 1], _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(quad)));
        }
        part_sums[part] = _mm256_madd_epi16(_mm256_add_epi16(s[0], s[1]), ones);  // int32 per column
      }
      const __m256i dot = Parts == 1 ? part_sums[0] : _mm256_add_epi32(_mm256_slli_epi32(part_sums[0], 7), part_sums[1]);
      const __m256 d = _mm256_mul_ps(scale, _mm256_set1_ps(scales[r * groups + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[r]);
      acc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * out + 8 * half, acc[r]);
}

// One row (a one-token step): both halves of a block in one pass. tile<1> takes the halves one
// after the other and broadcasts the row's activations for each; here each 4 activation bytes are
// broadcast once for the 16 columns. Each int16 lane sums the same 16 products as tile<1>'s two
// accumulators added (exact in any order: |sum| <= 16 * 15 * 64 with 14 bits, 16 * 15 * 127 with
// 8, < 2^15), and each half's float epilogue is tile<1>'s, so the bits are tile<1>'s.
// 14 registers: 2 float sums, 4 int16 sums, 4 unpacked weights, 2 broadcasts, 2 constants.
template <int Parts>
void one_row(const uint8_t* block, int64_t groups, const int8_t* codes, const float* scales, const float* sums,
             float* y, bool prefetch) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g, block += kBlockBytes) {
    if (prefetch) prefetch_ahead(block);
    const int8_t* xg = codes + g * kGroup * Parts;  // 14 bits: hi[32] then lo[32]
    __m256i s[2][Parts];  // [half][part]: int16 dots of 8 column pairs
    for (int half = 0; half < 2; ++half)
      for (int part = 0; part < Parts; ++part) s[half][part] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i lows[2], highs[2];  // codes of inputs 4p .. 4p + 3 and 16 + 4p .. 16 + 4p + 3
      for (int half = 0; half < 2; ++half) {
        const __m256i chunk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * p + 32 * half));
        lows[half] = _mm256_and_si256(chunk, low);
        highs[half] = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), low);
      }
      for (int part = 0; part < Parts; ++part) {
        int32_t quad_low, quad_high;
        std::memcpy(&quad_low, xg + part * kGroup + 4 * p, sizeof(quad_low));
        std::memcpy(&quad_high, xg + part * kGroup + 16 + 4 * p, sizeof(quad_high));
        const __m256i xl = _mm256_set1_epi32(quad_low), xh = _mm256_set1_epi32(quad_high);
        for (int half = 0; half < 2; ++half) {
          s[half][part] = _mm256_add_epi16(s[half][part], _mm256_maddubs_epi16(lows[half], xl));
          s[half][part] = _mm256_add_epi16(s[half][part], _mm256_maddubs_epi16(highs[half], xh));
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256i first = _mm256_madd_epi16(s[half][0], ones);  // int32 per column
      const __m256i dot = Parts == 1 ? first
                                     : _mm256_add_epi32(_mm256_slli_epi32(first, 7),
                                                        _mm256_madd_epi16(s[half][Parts - 1], ones));
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 256 + 16 * half)));
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 288 + 16 * half)));
      const __m256 d = _mm256_mul_ps(scale, _mm256_set1_ps(scales[g]));
      acc[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[half]);
      acc[half] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(sums[g]), acc[half]);
    }
  }
  _mm256_storeu_ps(y, acc[0]);
  _mm256_storeu_ps(y + 8, acc[1]);
}

using TileFn = void (*)(const uint8_t*, int, int64_t, const int8_t*, int64_t, const float*, const float*, float*,
                        int64_t, bool);
template <int Parts>
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1, Parts>, tile<2, Parts>, tile<3, Parts>, tile<4, Parts>};

template <int Parts>
void block_columns(const uint8_t* block, int64_t groups, const Quantized& xq, int64_t rows, int64_t in, float* y,
                   int64_t out) {
  if (rows == 1)
    return one_row<Parts>(block, groups, xq.codes.data(), xq.scales.data(), xq.sums.data(), y,
                          int4_prefetch_streams());
  for (int half = 0; half < 2; ++half) {
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const int64_t n = std::min(kTileRows, rows - r);
      kTiles<Parts>[n](block, half, groups, xq.codes.data() + r * in * Parts, in, xq.scales.data() + r * groups,
                       xq.sums.data() + r * groups, y + r * out, out,
                       half == 0 && r == 0 && int4_prefetch_streams());
    }
  }
}

}  // namespace avx2
#endif

using GroupFn = void (*)(const float*, int8_t*, float*, float*);
using BlockFn = void (*)(const uint8_t*, int64_t, const Quantized&, int64_t, int64_t, float*, int64_t);

// The selected implementation: how a group of 32 inputs is quantized, how a block of columns
// is multiplied. Null where this build has none.
struct Implementation {
  GroupFn quantize_group = nullptr;
  BlockFn block_columns = nullptr;
  int parts = 2;  // int8 parts per activation: 2 (14 bits) or 1 (8 bits)
};

Implementation implementation() {
  const bool eight = activation_bits == 8;
#ifdef EYAS_VNNI
  if (selected == Int8Dot::avx512vnni)
    return eight ? Implementation{vnni::quantize_group<1>, vnni::block_columns<1>, 1}
                 : Implementation{vnni::quantize_group<2>, vnni::block_columns<2>, 2};
#endif
#ifdef EYAS_AVX2
  if (selected == Int8Dot::avx2)
    return eight ? Implementation{avx2::quantize_group<1>, avx2::block_columns<1>, 1}
                 : Implementation{avx2::quantize_group<2>, avx2::block_columns<2>, 2};
#endif
  (void)eight;
  return {};
}

// The first `count` elements of `buffer`, grown when needed (never shrunk or cleared).
template <typename T>
void grow(std::vector<T>& buffer, int64_t count) {
  if (int64_t(buffer.size()) < count) buffer.resize(count);
}

// Rows of x [rows, in] in the form the kernel multiplies (`parts` int8 parts per input), in
// buffers of the calling thread that the next product reuses (no allocation per product); each
// chunk of rows written first by `prepare` where given (GemmHooks).
const Quantized& quantize_rows(GroupFn group, int parts, const float* x, int64_t rows, int64_t in,
                               const std::function<void(int64_t, int64_t)>& prepare) {
  const PhaseScope timed(kQuantize);
  const int64_t groups = in / kGroup;
  static thread_local Quantized kept;
  Quantized& xq = kept;  // the calling thread's (the workers below must not name `kept`: their own)
  grow(xq.codes, rows * in * parts);
  grow(xq.scales, rows * groups);
  grow(xq.sums, rows * groups);
  eyas::parallel_for(0, rows, rows >= 16 ? 8 : rows, [&](int64_t begin, int64_t end) {  // >= 8 rows a thread
    if (prepare) prepare(begin, end);
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g)
        group(x + r * in + g * kGroup, xq.codes.data() + (r * in + g * kGroup) * parts, &xq.scales[r * groups + g],
              &xq.sums[r * groups + g]);
  });
  return xq;
}

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBlockBytes &&
              packed.is_contiguous(), "packed int4 weights must be uint8 [O/16, I/32, 320] (int4_pack)");
}

}  // namespace

std::vector<std::string> int8dot_kernels() {
  std::vector<std::string> names;
  for (const auto& kind : built()) names.push_back(kind.second);
  return names;
}

Int8Dot int8dot_kernel() { return selected; }

std::string int8dot_kernel_name() {
  for (const auto& kind : built())
    if (kind.first == selected) return kind.second;
  return "none";
}

void set_int8dot_kernel(const std::string& name) {
  std::string accepted;
  for (const auto& kind : built()) {
    if (kind.second == name) {
      selected = kind.first;
      return;
    }
    accepted += (accepted.empty() ? "" : ", ") + kind.second;
  }
  TORCH_CHECK(false, "int8 dot-product kernel '", name, "' is not in this build; it has: ",
              accepted.empty() ? "none (no AVX2 on this CPU)" : accepted);
}

bool int4_prefetch_streams() { return prefetch_mode.load(std::memory_order_relaxed) == int(Prefetch::stream); }

std::string int4_prefetch() { return int4_prefetch_streams() ? "stream" : "blocks"; }

void set_int4_prefetch(const std::string& name) {
  TORCH_CHECK(name == "stream" || name == "blocks", "int4 kernel prefetch: 'stream' or 'blocks', not '", name, "'");
  prefetch_mode.store(int(name == "stream" ? Prefetch::stream : Prefetch::blocks));
}

bool int4_amx_available() {
#ifdef EYAS_AMX
  return amx_permitted();
#else
  return false;
#endif
}

bool int4_amx() { return amx_on.load(std::memory_order_relaxed); }

void set_int4_amx(bool on) {
  TORCH_CHECK(!on || int4_amx_available(), "AMX is not available here (the CPU, this build of the extension "
              "or the kernel's permission for its tile state)");
  amx_on.store(on);
}

int int4_activation_bits() { return activation_bits; }

void set_int4_activation_bits(int64_t bits) {
  TORCH_CHECK(bits == 14 || bits == 8, "int4 kernel activations: 14 or 8 bits, not ", bits);
  activation_bits = int(bits);
}

at::Tensor int4_pack(const at::Tensor& codes_in, const at::Tensor& scale_in, const at::Tensor& minimum_in) {
  TORCH_CHECK(codes_in.dim() == 2, "codes must be [O, I]");
  const int64_t out = codes_in.size(0), in = codes_in.size(1);
  TORCH_CHECK(out % kColumns == 0 && in % kGroup == 0, "int4 packing needs O a multiple of 16 and I of 32, got [",
              out, ", ", in, "]");
  const int64_t groups = in / kGroup;
  const at::Tensor codes = codes_in.to(at::kInt).contiguous();
  const at::Tensor scale = scale_in.to(at::kHalf).contiguous(), minimum = minimum_in.to(at::kHalf).contiguous();
  TORCH_CHECK(scale.numel() == out * groups && minimum.numel() == out * groups, "scale and minimum must be [O, I/32]");
  TORCH_CHECK(codes.min().item<int>() >= 0 && codes.max().item<int>() <= 15, "codes must lie in 0..15");
  at::Tensor packed = at::zeros({out / kColumns, groups, kBlockBytes}, codes.options().dtype(at::kByte));
  const int32_t* c = codes.data_ptr<int32_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* m = minimum.data_ptr<at::Half>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t cb = 0; cb < out / kColumns; ++cb) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* block = dst + (cb * groups + g) * kBlockBytes;
      for (int64_t col = 0; col < kColumns; ++col) {
        const int64_t o = cb * kColumns + col;
        const int32_t* row = c + o * in + g * kGroup;
        for (int p = 0; p < 4; ++p)
          for (int i = 0; i < 4; ++i)
            block[64 * p + 4 * col + i] = uint8_t(row[4 * p + i] | (row[16 + 4 * p + i] << 4));
        std::memcpy(block + 256 + 2 * col, s + o * groups + g, 2);
        std::memcpy(block + 288 + 2 * col, m + o * groups + g, 2);
      }
    }
  }
  return packed;
}

PackedInt4 packed_int4(const at::Tensor& packed) {
  check_packed(packed);
  return {packed.data_ptr<uint8_t>(), packed.size(0), packed.size(1)};
}

void int4_gemm(const float* x, int64_t rows, int64_t in, const at::Tensor& packed, float* y, const GemmHooks& hooks) {
  int4_gemm(x, rows, in, packed_int4(packed), y, hooks);
}

void int4_gemm(const float* x, int64_t rows, int64_t in, const PackedInt4& packed, float* y, const GemmHooks& hooks) {
  const Implementation kernel = implementation();
  TORCH_CHECK(kernel.block_columns != nullptr, "this build of the eyas extension has no int8 dot-product kernel (no AVX2)");
  const int64_t blocks = packed.blocks, groups = packed.groups, out = blocks * kColumns;
  TORCH_CHECK(groups * kGroup == in, "input width ", in, " does not match the packed weights' ", groups * kGroup);
  const Quantized& xq = quantize_rows(kernel.quantize_group, kernel.parts, x, rows, in, hooks.prepare);
  const uint8_t* weights = packed.data;
  // Threads claim chunks of columns (worker_pool.h); each streams its blocks' weights once per
  // tile of rows (a block of 16 columns is 320 bytes per 32 inputs: it stays in L1/L2 between
  // tiles), prefetching as int4_prefetch says (kPrefetchBytes ahead as it goes, or whole blocks).
  const bool bursts = !int4_prefetch_streams();
  eyas::parallel_for(0, blocks, kBlocksPerChunk, [&](int64_t begin, int64_t end) {
    for (int64_t cb = begin; cb < end; ++cb) {
      const uint8_t* block = weights + cb * groups * kBlockBytes;
      if (bursts && cb + kAheadBlocks < blocks)
        prefetch_bytes(block + kAheadBlocks * groups * kBlockBytes, groups * kBlockBytes);
      kernel.block_columns(block, groups, xq, rows, in, y + cb * kColumns, out);
    }
    if (hooks.finish) hooks.finish(begin * kColumns, end * kColumns);  // while the columns are in cache
  });
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& packed) {
  check_packed(packed);
  TORCH_CHECK(x_in.dim() == 2, "x must be [N, I]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), packed.size(0) * kColumns}, x.options());
  if (x.size(0) > 0) int4_gemm(x.data_ptr<float>(), x.size(0), x.size(1), packed, y.data_ptr<float>());
  return y;
}

}  // namespace eyas
