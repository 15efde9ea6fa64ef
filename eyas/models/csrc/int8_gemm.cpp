// int8 weights x 14-bit activations with integer dot products: the matrix products of an int8
// model (quant.Int8Linear), on AVX512-VNNI or AVX2 (int8dot.h: the same bits on both).
//
// Why: a GGUF quantized at 8 bits (Q8_0) or 6 (Q6_K) loses more than its own rounding in int4;
// int8 weights with one float16 scale per 32 inputs hold a Q8_0 block exactly (its scale is
// max|w| / 127 and one of its codes is +-127, so re-quantizing the dequantized block gives back
// the same codes and scale) and a Q6_K block within 1/254 of its largest weight. PyTorch's
// int8 kernel (`_weight_int8pack_mm`) takes bf16 activations (8 significant bits) and one scale
// per output row; `_int_mm` runs reference loops at one row.
//
// Activations as in int4_gemm.cpp: xq = round(x / d) in -8191..8191 with d = max|x| / 8191 per
// group of 32 inputs, split as xq = 128 * hi + lo (hi, lo in -64..64). vpdpbusd multiplies an
// unsigned operand by a signed one: here the weights are the unsigned operand, stored as
// u = code + 128 (1..255), and the activations the signed one, so
//   128 (u . hi) + u . lo = code . xq + 128 * sum(xq)
// and the group's 128 * sum(xq), computed once per row and group, is subtracted: the integer
// dot product code . xq is exact (|128 (u . hi) + u . lo| < 2^27).
//
// Numerics: y[n, o] = sum over groups g of d[n,g] * s[o,g] * (codes[o,g] . xq[n,g]), the float
// accumulation over groups in order, one output column per SIMD lane: a row's values depend on
// that row alone (speculative passes give each row the bits of a one-token pass).
//
// The floor it chases: at one row, the packed weights read once (8.5 bits a weight: 1.7x the
// int4 layout's 5); at many, 16 vpdpbusd per row, 16 columns and 32 inputs (int4's count).
//
// Layout (int8_pack): uint8 [O/16, I/32, 544]. In a block of 16 columns x 32 inputs, bytes
// 0..511 are eight 64-byte chunks; chunk k holds, for column c at bytes 4c..4c+3, the codes
// (+128) of inputs 4k..4k+3: the operand of one vpdpbusd over 16 columns x 4 inputs, as loaded.
// Bytes 512..543 are the 16 columns' float16 scales.

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "int8dot.h"
#include "worker_pool.h"

namespace eyas {
namespace {

constexpr int64_t kColumns = 16, kGroup = 32, kQuads = kGroup / 4, kCodeBytes = 512, kBlockBytes = 544;
// The cache lines of the group kPrefetchBytes ahead of `group` (544 bytes: 9 lines at most),
// prefetched as the int4 kernel's are (int4_prefetch, int8dot.h).
inline void prefetch_ahead(const uint8_t* group) { prefetch_group_ahead<kBlockBytes>(group); }

// Rows of x in the kernel's form: per row and group, hi[32] then lo[32] (signed), the scale d
// and the correction 128 * sum(xq).
struct Activations {
  std::vector<int8_t> codes;  // [rows, groups, 2, 32]
  std::vector<float> scales;  // [rows, groups]
  std::vector<int32_t> corrections;  // [rows, groups]
};

Activations quantize_rows(const float* x, int64_t rows, int64_t in) {
  const int64_t groups = in / kGroup;
  Activations a{std::vector<int8_t>(rows * in * 2), std::vector<float>(rows * groups),
                std::vector<int32_t>(rows * groups)};
  eyas::pool_for(0, rows, rows * in >= (1 << 16) ? 16 : rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + r * in + g * kGroup;
        float amax = 0.0f;
        for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
        const float inverse = amax > 0.0f ? kActivationLevels / amax : 0.0f;
        int8_t* out = a.codes.data() + (r * groups + g) * 2 * kGroup;
        int32_t sum = 0;
        for (int64_t i = 0; i < kGroup; ++i) {
          const int32_t q = int32_t(std::nearbyint(xg[i] * inverse));  // round half to even, as cvtps
          const int32_t hi = activation_high(q);
          out[i] = int8_t(hi);
          out[kGroup + i] = int8_t(q - 128 * hi);
          sum += q;
        }
        a.scales[r * groups + g] = amax / kActivationLevels;
        a.corrections[r * groups + g] = 128 * sum;
      }
    }
  });
  return a;
}

using BlockFn = void (*)(const uint8_t*, int64_t, const Activations&, int64_t, int64_t, float*, int64_t);

#ifdef EYAS_VNNI
namespace vnni {

constexpr int64_t kTileRows = 8;

// One block of 16 columns for R rows: y[r, col0 .. col0 + 15].
template <int R>
void tile(const uint8_t* block, int64_t groups, const int8_t* codes, const float* scales,
          const int32_t* corrections, float* y, int64_t out, bool prefetch) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, block += kBlockBytes) {
    if (prefetch) prefetch_ahead(block);
    __m512i w[kQuads];
    for (int k = 0; k < kQuads; ++k) w[k] = _mm512_loadu_si512(block + 64 * k);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kCodeBytes)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = codes + (r * groups + g) * 2 * kGroup;
      __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                         _mm512_setzero_si512()};  // hi even/odd quads, lo even/odd quads
      for (int part = 0; part < 2; ++part) {
        for (int k = 0; k < kQuads; ++k) {
          int32_t quad;
          std::memcpy(&quad, xg + part * kGroup + 4 * k, sizeof(quad));
          __m512i& dot = dots[2 * part + (k & 1)];
          dot = _mm512_dpbusd_epi32(dot, w[k], _mm512_set1_epi32(quad));
        }
      }
      const __m512i high = _mm512_slli_epi32(_mm512_add_epi32(dots[0], dots[1]), 7);
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(high, _mm512_add_epi32(dots[2], dots[3])),
                                           _mm512_set1_epi32(corrections[r * groups + g]));
      const __m512 d = _mm512_mul_ps(scale, _mm512_set1_ps(scales[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out, acc[r]);
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const int32_t*, float*, int64_t, bool);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

void block_columns(const uint8_t* block, int64_t groups, const Activations& a, int64_t rows, int64_t in, float* y,
                   int64_t out) {
  for (int64_t r = 0; r < rows; r += kTileRows) {
    const int64_t n = std::min(kTileRows, rows - r);
    kTiles[n](block, groups, a.codes.data() + r * in * 2, a.scales.data() + r * groups,
              a.corrections.data() + r * groups, y + r * out, out, r == 0 && int4_prefetch_streams());
  }
}

}  // namespace vnni
#endif

#ifdef EYAS_AVX2
namespace avx2 {

constexpr int64_t kTileRows = 4;

// Columns half * 8 .. half * 8 + 7 of one block for R rows. vpmaddubsw: a pair of products
// sums to at most 2 * 255 * 64 = 32640 < 2^15 (no saturation); vpmaddwd widens it to int32 at
// once, so the integers are vpdpbusd's and the float operations the same, lane by lane.
template <int R>
void tile(const uint8_t* block, int half, int64_t groups, const int8_t* codes, const float* scales,
          const int32_t* corrections, float* y, int64_t out, bool prefetch) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, block += kBlockBytes) {
    if (prefetch) prefetch_ahead(block);
    __m256i w[kQuads];
    for (int k = 0; k < kQuads; ++k) w[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * k + 32 * half));
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kCodeBytes + 16 * half)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = codes + (r * groups + g) * 2 * kGroup;
      __m256i dots[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // hi, lo
      for (int part = 0; part < 2; ++part) {
        for (int k = 0; k < kQuads; ++k) {
          int32_t quad;
          std::memcpy(&quad, xg + part * kGroup + 4 * k, sizeof(quad));
          const __m256i pairs = _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(quad));
          dots[part] = _mm256_add_epi32(dots[part], _mm256_madd_epi16(pairs, ones));
        }
      }
      const __m256i dot = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(dots[0], 7), dots[1]),
                                           _mm256_set1_epi32(corrections[r * groups + g]));
      const __m256 d = _mm256_mul_ps(scale, _mm256_set1_ps(scales[r * groups + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * out + 8 * half, acc[r]);
}

using TileFn = void (*)(const uint8_t*, int, int64_t, const int8_t*, const float*, const int32_t*, float*, int64_t,
                       bool);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>};

void block_columns(const uint8_t* block, int64_t groups, const Activations& a, int64_t rows, int64_t in, float* y,
                   int64_t out) {
  for (int half = 0; half < 2; ++half) {
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const int64_t n = std::min(kTileRows, rows - r);
      kTiles[n](block, half, groups, a.codes.data() + r * in * 2, a.scales.data() + r * groups,
                a.corrections.data() + r * groups, y + r * out, out,
                half == 0 && r == 0 && int4_prefetch_streams());
    }
  }
}

}  // namespace avx2
#endif

// The selected implementation (int8dot.h), null where this build has none.
BlockFn block_function() {
#ifdef EYAS_VNNI
  if (int8dot_kernel() == Int8Dot::avx512vnni) return vnni::block_columns;
#endif
#ifdef EYAS_AVX2
  if (int8dot_kernel() == Int8Dot::avx2) return avx2::block_columns;
#endif
  return nullptr;
}

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBlockBytes &&
              packed.is_contiguous(), "packed int8 weights must be uint8 [O/16, I/32, 544] (int8_pack)");
}

}  // namespace

// codes [O, I] int8 in -127..127, scale [O, I/32] (weight = code * scale) -> uint8 [O/16, I/32, 544].
at::Tensor int8_pack(const at::Tensor& codes_in, const at::Tensor& scale_in) {
  TORCH_CHECK(codes_in.dim() == 2 && codes_in.scalar_type() == at::kChar, "codes must be int8 [O, I]");
  const int64_t out = codes_in.size(0), in = codes_in.size(1);
  TORCH_CHECK(out % kColumns == 0 && in % kGroup == 0, "int8 packing needs O a multiple of 16 and I of 32, got [",
              out, ", ", in, "]");
  const int64_t groups = in / kGroup;
  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor scale = scale_in.to(at::kHalf).contiguous();
  TORCH_CHECK(scale.numel() == out * groups, "scale must be [O, I/32]");
  TORCH_CHECK(codes.min().item<int>() >= -127, "codes must lie in -127..127");
  at::Tensor packed = at::empty({out / kColumns, groups, kBlockBytes}, codes.options().dtype(at::kByte));
  const int8_t* c = codes.data_ptr<int8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, out / kColumns, 16, [&](int64_t begin, int64_t end) {
    for (int64_t cb = begin; cb < end; ++cb) {
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* block = dst + (cb * groups + g) * kBlockBytes;
        for (int64_t col = 0; col < kColumns; ++col) {
          const int64_t o = cb * kColumns + col;
          const int8_t* row = c + o * in + g * kGroup;
          for (int64_t k = 0; k < kQuads; ++k)
            for (int i = 0; i < 4; ++i) block[64 * k + 4 * col + i] = uint8_t(int32_t(row[4 * k + i]) + 128);
          std::memcpy(block + kCodeBytes + 2 * col, s + o * groups + g, 2);
        }
      }
    }
  });
  return packed;
}

// x [N, I] float32 -> y [N, O] float32 = x @ dequant(W)^T.
at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& packed) {
  check_packed(packed);
  TORCH_CHECK(x_in.dim() == 2, "x must be [N, I]");
  const BlockFn block_columns = block_function();
  TORCH_CHECK(block_columns != nullptr, "this build of the eyas extension has no int8 dot-product kernel (no AVX2)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), in = x.size(1), blocks = packed.size(0), groups = packed.size(1);
  const int64_t out = blocks * kColumns;
  TORCH_CHECK(groups * kGroup == in, "input width ", in, " does not match the packed weights' ", groups * kGroup);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0) return y;
  const Activations a = quantize_rows(x.data_ptr<float>(), rows, in);
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // threads claim chunks of columns (worker_pool.h), prefetching as int4_prefetch says
  const bool bursts = !int4_prefetch_streams();
  eyas::pool_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    for (int64_t cb = begin; cb < end; ++cb) {
      const uint8_t* block = weights + cb * groups * kBlockBytes;
      if (bursts && cb + kAheadBlocks < blocks)
        prefetch_bytes(block + kAheadBlocks * groups * kBlockBytes, groups * kBlockBytes);
      block_columns(block, groups, a, rows, in, yp + cb * kColumns, out);
    }
  });
  return y;
}

}  // namespace eyas

TORCH_LIBRARY_FRAGMENT(eyas, m) {
  m.def("int8_pack(Tensor codes, Tensor scale) -> Tensor", &eyas::int8_pack);
  m.def("int8_linear(Tensor x, Tensor packed) -> Tensor", &eyas::int8_linear);
}
