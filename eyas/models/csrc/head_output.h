// A draft head's output step in two calls (head_output.cpp): declarations shared with
// int4_decoder_layer.cpp, which binds them to Python.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace eyas {

// x [T, H] float32, weight [H] float32 -> F.rms_norm(x, (H,), weight, eps) [T, H] float32, the
// same bits: PyTorch's float32 order of operations, its cascaded sum included.
at::Tensor torch_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// x [T, H] float32 -> int4_linear(torch_rms_norm(x, weight, eps), packed) [T, O] float32: a
// head's final norm and output layer in one call.
at::Tensor rms_norm_int4_linear(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& packed);

// scores [R, N] float32 -> torch.topk(torch.log_softmax(scores, -1), k) as lists, values [R][k]
// and indices [R][k], the same numbers and the same order.
std::tuple<std::vector<std::vector<double>>, std::vector<std::vector<int64_t>>> log_softmax_top_k(
    const at::Tensor& scores, int64_t k);

}  // namespace eyas
