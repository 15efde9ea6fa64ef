// The int4 x int8 matrix product of the fused layers (int4_gemm.cpp): declarations shared with
// int4_decoder_layer.cpp, which binds them to Python. Which instructions run it: int8dot.h.
#pragma once

#include <torch/extension.h>

namespace eyas {

// codes [O, I] int32 in 0..15, scale and minimum [O, I/32] float32 (weight = code * scale +
// minimum) -> the kernel's layout, uint8 [O/16, I/32, 320]: per block of 16 output columns and
// 32 inputs, 256 bytes of nibbles then 16 float16 scales and 16 float16 minimums.
at::Tensor int4_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& minimum);

// x [N, I] float32 -> y [N, O] float32 = x @ dequant(W)^T, each row's inputs rounded to 14-bit integers
// with one scale per 32 (int4_gemm.cpp says exactly how).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed);

// The same into a caller's buffer: x [rows, in], y [rows, out] row-major.
void int4_gemm(const float* x, int64_t rows, int64_t in, const at::Tensor& packed, float* y);

}  // namespace eyas
