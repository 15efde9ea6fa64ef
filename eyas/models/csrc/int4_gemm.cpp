// int4 weights x int8 activations on AVX512-VNNI: the matrix products of the fused layers.
//
// Why: PyTorch's CPU int4 kernel turns every weight back into a float and multiplies in bf16;
// on the 2-core machine a SmolLM2 layer costs 134 us for one row and ~47 us more per extra row,
// so a verification pass over 8 tokens spent 13 ms of its 35 in it (BENCHMARKS.md section 1).
// Here, as in llama.cpp's Q4_1 x Q8 dot products, each row of activations is rounded to
// integers with one scale per 32 inputs and multiplied by the 4-bit codes with the integer
// dot-product instruction (vpdpbusd: 64 multiply-adds per instruction); a block of weights is
// unpacked once and used for up to 8 rows.
//
// Activations get 14 bits, not 8 (vnni.h): xq = round(x / d) in -8191..8191 with
// d = max|x| / 8191 per group of 32 inputs, split as xq = 128 * hi + lo with hi, lo in -64..64,
// two int8 operands of the same unpacked weights (twice the dot products of 8 bits). Rounding to int8 alone
// (llama.cpp's Q8) cost SmolLM2-135M too much, in any one of its projections: top-1 agreement
// with float32 fell from 99.0% (PyTorch's kernel on bf16 activations) to 94.9%, where 14 bits
// give 99.9% (BENCHMARKS.md section 1).
//
// Numerics: y[n, o] = sum over groups g of d[n,g] * s[o,g] * (codes[o,g] . xq[n,g])
//                                          + m[o,g] * sum(x[n,g]),
// with s and m the group's float16 scale and minimum. The integer dots are exact; the float
// accumulation runs over groups in order, one output column per SIMD lane. A row's values
// depend on that row alone, never on how many rows share the call or which tile it falls in:
// the property that keeps speculative decoding lossless (int4_decoder_layer.cpp).
//
// Layout (int4_vnni_pack): uint8 [O/16, I/32, 320]. In a block of 16 columns x 32 inputs,
// bytes 0..255 are four 64-byte chunks; chunk p holds, for column c at bytes 4c..4c+3, the codes
// of inputs 4p..4p+3 in the low nibbles and of inputs 16+4p..16+4p+3 in the high nibbles, so
// one AND (and a shift) gives the operand of a vpdpbusd over 16 columns x 4 inputs. Bytes
// 256..287 are the 16 columns' float16 scales, 288..319 their float16 minimums.

#include "int4_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "vnni.h"

namespace eyas {
namespace {

constexpr int64_t kColumns = 16, kGroup = 32, kBlockBytes = 320, kTileRows = 8;
// Blocks of columns prefetched ahead by each thread: at one row a block is ~250 ns of work and
// the hardware prefetcher alone kept ~15 GB/s in flight; 2-8 ahead gave 1.10-1.11x on plain
// decoding, side by side in one process (BENCHMARKS.md section 1).
constexpr int64_t kAhead = 4;

#ifdef EYAS_VNNI
// Stores the low bytes of 16 int32 lanes (each in -128..127) at out.
inline void store_bytes(int8_t* out, __m512i v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(v));
}

// Rows of x [rows, in] -> codes [rows, in / 32, 2, 32] int8 (per group: hi then lo), scales d
// and sums [rows, in / 32].
void quantize_rows(const float* x, int64_t rows, int64_t in, int8_t* codes, float* scales, float* sums) {
  const int64_t groups = in / kGroup;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  at::parallel_for(0, rows, rows * in >= (1 << 16) ? 16 : rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + r * in + g * kGroup;
        const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const float inverse = amax > 0.0f ? kActivationLevels / amax : 0.0f;
        const __m512 scale = _mm512_set1_ps(inverse);
        int8_t* out = codes + (r * in + g * kGroup) * 2;
        for (int i = 0; i < 2; ++i) {  // xq = round(x / d); hi = round(xq / 128); lo = xq - 128 hi
          const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(i ? b : a, scale));
          const __m512i hi = activation_high(q);
          store_bytes(out + 16 * i, hi);
          store_bytes(out + kGroup + 16 * i, _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 7)));
        }
        scales[r * groups + g] = amax / kActivationLevels;
        sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
      }
    }
  });
}

// One block of 16 columns for `R` rows: y[r, col0 .. col0 + 15] for r < R.
template <int R>
void tile(const uint8_t* block, int64_t groups, const int8_t* codes, int64_t in, const float* scales,
          const float* sums, float* y, int64_t out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, block += kBlockBytes) {
    __m512i w[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i chunk = _mm512_loadu_si512(block + 64 * p);
      w[p] = _mm512_and_si512(chunk, low);
      w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 256)));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 288)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = codes + (r * in + g * kGroup) * 2;  // hi[32] then lo[32]
      // codes . xq = 128 (codes . hi) + codes . lo, exact; four independent chains of
      // vpdpbusd (5 cycles of latency each) instead of one chain of 16.
      __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                         _mm512_setzero_si512()};
      for (int part = 0; part < 2; ++part) {
        for (int j = 0; j < 8; ++j) {
          int32_t quad;
          std::memcpy(&quad, xg + part * kGroup + 4 * j, sizeof(quad));
          __m512i& dot = dots[2 * part + (j & 1)];
          dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(quad));
        }
      }
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(dots[0], dots[1]), 7),
                                           _mm512_add_epi32(dots[2], dots[3]));
      const __m512 d = _mm512_mul_ps(scale, _mm512_set1_ps(scales[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[r]);
      acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out, acc[r]);
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const float*, const float*, float*, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};
#endif

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBlockBytes &&
              packed.is_contiguous(), "packed int4 weights must be uint8 [O/16, I/32, 320] (int4_vnni_pack)");
}

}  // namespace

bool int4_vnni_supported() {
#ifdef EYAS_VNNI
  return true;
#else
  return false;
#endif
}

at::Tensor int4_vnni_pack(const at::Tensor& codes_in, const at::Tensor& scale_in, const at::Tensor& minimum_in) {
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

void int4_vnni_gemm(const float* x, int64_t rows, int64_t in, const at::Tensor& packed, float* y) {
#ifdef EYAS_VNNI
  check_packed(packed);
  const int64_t blocks = packed.size(0), groups = packed.size(1), out = blocks * kColumns;
  TORCH_CHECK(groups * kGroup == in, "input width ", in, " does not match the packed weights' ", groups * kGroup);
  std::vector<int8_t> codes(rows * in * 2);
  std::vector<float> scales(rows * groups), sums(rows * groups);
  quantize_rows(x, rows, in, codes.data(), scales.data(), sums.data());
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  // Threads split the columns; each streams its blocks' weights once per tile of 8 rows (a
  // block of 16 columns is 320 bytes per 32 inputs: it stays in L1/L2 between tiles).
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t cb = begin; cb < end; ++cb) {
      const uint8_t* block = weights + cb * groups * kBlockBytes;
      if (cb + kAhead < end) {  // more loads in flight than the hardware prefetcher keeps
        const char* next = reinterpret_cast<const char*>(block + kAhead * groups * kBlockBytes);
        for (int64_t byte = 0; byte < groups * kBlockBytes; byte += 64) _mm_prefetch(next + byte, _MM_HINT_T0);
      }
      for (int64_t r = 0; r < rows; r += kTileRows) {
        const int64_t n = std::min(kTileRows, rows - r);
        kTiles[n](block, groups, codes.data() + r * in * 2, in, scales.data() + r * groups, sums.data() + r * groups,
                  y + r * out + cb * kColumns, out);
      }
    }
  });
#else
  (void)x, (void)rows, (void)in, (void)packed, (void)y;
  TORCH_CHECK(false, "this build of the eyas extension has no AVX512-VNNI kernel");
#endif
}

at::Tensor int4_vnni_linear(const at::Tensor& x_in, const at::Tensor& packed) {
  check_packed(packed);
  TORCH_CHECK(x_in.dim() == 2, "x must be [N, I]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), packed.size(0) * kColumns}, x.options());
  if (x.size(0) > 0) int4_vnni_gemm(x.data_ptr<float>(), x.size(0), x.size(1), packed, y.data_ptr<float>());
  return y;
}

}  // namespace eyas
