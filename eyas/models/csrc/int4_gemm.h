// The int4 x int8 matrix product of the fused layers (int4_gemm.cpp): declarations shared with
// int4_decoder_layer.cpp, which binds them to Python. Which instructions run it: int8dot.h.
#pragma once

#include <ATen/ATen.h>

#include <functional>

namespace eyas {

// codes [O, I] int32 in 0..15, scale and minimum [O, I/32] float32 (weight = code * scale +
// minimum) -> the kernel's layout, uint8 [O/16, I/32, 320]: per block of 16 output columns and
// 32 inputs, 256 bytes of nibbles then 16 float16 scales and 16 float16 minimums.
at::Tensor int4_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& minimum);

// x [N, I] float32 -> y [N, O] float32 = x @ dequant(W)^T, each row's inputs rounded to 14-bit integers
// with one scale per 32 (int4_gemm.cpp says exactly how).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed);

// Per-row and per-column work run inside the product's parallel regions (worker_pool.h), so that
// a layer's small phases add no region of their own (decoder_layer.cpp): prepare(first,
// last) writes rows first..last-1 of x just before they are rounded (an RMSNorm, SiLU * up);
// finish(first, last) runs once columns first..last-1 of y are final for every row (a residual
// add). Neither may depend on other rows or columns than its own. Either may be empty.
struct GemmHooks {
  std::function<void(int64_t, int64_t)> prepare, finish;
};

// The same into a caller's buffer: x [rows, in], y [rows, out] row-major.
void int4_gemm(const float* x, int64_t rows, int64_t in, const at::Tensor& packed, float* y,
               const GemmHooks& hooks = {});

// One matrix's packed weights (int4_pack's layout), checked once and then read through a raw
// pointer: a pass over a model's layers then touches no tensor's metadata, each access of which
// is a cache miss once the weights have streamed through the caches (the decoder stack).
struct PackedInt4 {
  const uint8_t* data = nullptr;  // [blocks, groups, 320]
  int64_t blocks = 0, groups = 0;
};
PackedInt4 packed_int4(const at::Tensor& packed);  // checks the layout; the tensor must outlive it
void int4_gemm(const float* x, int64_t rows, int64_t in, const PackedInt4& packed, float* y,
               const GemmHooks& hooks = {});

}  // namespace eyas
