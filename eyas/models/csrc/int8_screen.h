// The output layer's int8 screen with integer dot products (int8_screen.cpp): declarations shared with
// int4_decoder_layer.cpp, which binds them to Python.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace eyas {

// codes [V, H] int8 (one scale per vocabulary row) -> the kernel's layout, int8 [V/16, H/4, 64]:
// per block of 16 rows, for every 4 inputs, 16 lanes of 4 bytes.
at::Tensor int8_screen_pack(const at::Tensor& codes);

// x [R, H] float32 -> (approx [R, V], bound [R, V]) float32 with |x . W_j - approx| <= bound
// for every row and vocabulary entry j (int8_screen.cpp derives it). scale [V]: the codes'
// scales; sums [V] int32: each row's sum of codes; weight_error [V]: |W_j - scale_j codes_j|;
// approx_norm [V]: |scale_j codes_j|.
std::tuple<at::Tensor, at::Tensor> int8_screen(const at::Tensor& x, const at::Tensor& packed,
                                               const at::Tensor& scale, const at::Tensor& sums,
                                               const at::Tensor& weight_error, const at::Tensor& approx_norm);

// The same screen, then each row's argmax found exactly: approx [R, V] with every logit whose
// interval [approx - bound, approx + bound] reaches the row's best lower bound replaced by its
// float32 value x . weight_j (weight [V, H] float32). Its argmax is the float32 logits' argmax;
// nothing else may be read from it (models/output_layer.py). Registered as
// torch.ops.eyas.int8_screen_greedy.
at::Tensor int8_screen_greedy(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& sums, const at::Tensor& weight_error,
                              const at::Tensor& approx_norm, const at::Tensor& weight);

// int8_screen_greedy's argmax of each row of x [..., H] (R rows), without its logits leaving C++:
// the first of the candidates' largest float32 logits (every other logit's interval lies below
// them), NaN counting as the largest. Python ints for a caller that reads nothing else (a greedy
// single-stream step: a small PyTorch op after a pass costs ~20-50 us on cold caches).
std::vector<int64_t> int8_screen_argmax(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                        const at::Tensor& sums, const at::Tensor& weight_error,
                                        const at::Tensor& approx_norm, const at::Tensor& weight);

// The same screen, then each row's candidates (the logits that int8_screen_greedy re-checks), for a
// caller that computes their exact values itself (an output layer whose float32 rows are read from
// the checkpoint on demand): (approx [R, V], rows [P], columns [P]) int64, by row then column.
// Registered as torch.ops.eyas.int8_screen_candidates.
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_screen_candidates(
    const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& sums,
    const at::Tensor& weight_error, const at::Tensor& approx_norm);

// int8_screen_gumbel's draws (gumbel_screen.cpp) for x [..., H] (R rows), each row's 1/T (rounded
// to float32) and noise key given as numbers: Python lists in and out, for a single-stream step
// (no small PyTorch ops after a pass, each of which runs cold).
std::vector<int64_t> int8_screen_gumbel_ids(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                            const at::Tensor& sums, const at::Tensor& weight_error,
                                            const at::Tensor& approx_norm, const at::Tensor& weight,
                                            const std::vector<double>& inverse_temperatures,
                                            const std::vector<int64_t>& keys);

// A candidate's float32 logit x . w (x, w: `hidden` floats), accumulated in float64 in a fixed order
// and rounded once: what int8_screen_greedy and the Gumbel sampler (gumbel_screen.cpp) re-check.
float exact_logit(const float* x, const float* w, int64_t hidden);

// The screen's activation arithmetic: 8 bits (one integer pass, the default) or 14 bits (two
// passes, a tighter bound: fewer candidates). The argmax is exact with either.
int screen_activation_bits();
void set_screen_activation_bits(int64_t bits);
// Whether the 8-bit screen writes its [R, V] results around the caches (on unless set off).
bool screen_streams();
void set_screen_streaming(bool on);

}  // namespace eyas
