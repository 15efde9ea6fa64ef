// A draft head's output step on the CPU in two calls, the same numbers as the PyTorch ops they
// replace: the final RMSNorm and the int4 output layer (rms_norm_int4_linear), then the top-k
// of each row's log-softmax (log_softmax_top_k).
//
// Why: an EAGLE-3 drafting step of SmolLM2's head spends more in the small PyTorch ops around
// its three int4 products than in the products' arithmetic. F.rms_norm of one [1, 576] row is
// ~15 ATen ops (pow, mean = sum + div, add, rsqrt, two muls, dtype checks and copies): 8 us in a
// tight loop, but 40-75 us inside a decoding step, where each op's code and data come back cold
// after the target's pass. torch.topk copies 8,192 (value, index) pairs to pick one or two.
//
// Numerics: the drafts must not change (their scores rank and size the trees), so both
// calls reproduce PyTorch's results bit for bit rather than approximately:
// - torch_rms_norm follows aten's rms_norm for float32 (layer_norm.cpp rms_norm_composite:
//   rsqrt(pow(x, 2).mean(-1) + eps), x * that, then * weight) and its sum's order of additions
//   (cpu/SumKernel.cpp: a cascade over vectors of 8 floats, then the vector's lanes in order)
//   on x86; elsewhere, and for rows that aten would sum on several threads, at::rms_norm runs.
//   tests/eagle3/test_head_output.py checks it against F.rms_norm on many widths and rows.
// - log_softmax_top_k calls aten's log_softmax and picks the k largest of each row itself where
//   they are unique (distinct, none of the rest equal to the k-th, no NaN): every top-k then
//   returns the same values in the same order. Where a tie or a NaN leaves the choice to the
//   algorithm, the row goes to at::topk.

#include "head_output.h"

#include <ATen/TensorIterator.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "int4_gemm.h"

namespace eyas {
namespace {

// aten's CeilLog2 (native/cpu/utils.h): ceil(log2(x)), 1 for x <= 2.
int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(uint64_t(x) - 1);
}

// The sum of `count` items of L float lanes each (item(i, lanes) writes item i), lane by lane,
// in the order of aten's cascade sum (cpu/SumKernel.cpp row_sum over multi_row_sum): items
// interleaved over 4 accumulators, each accumulated over 4 levels of 2^level_power items, then
// the levels and the 4 accumulators added in order.
template <int L, typename Item>
void cascade_sum(int64_t count, const Item& item, float* out) {
  constexpr int64_t kInterleave = 4, kLevels = 4;
  const int64_t rows = count / kInterleave;
  float acc[kLevels][kInterleave][L] = {};
  float lanes[L];
  const auto add_row = [&](int64_t i) {
    for (int64_t k = 0; k < kInterleave; ++k) {
      item(i * kInterleave + k, lanes);
      for (int l = 0; l < L; ++l) acc[0][k][l] += lanes[l];
    }
  };
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_row(i);
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kInterleave; ++k) {
        for (int l = 0; l < L; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0;
        }
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kInterleave; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t rest = rows * kInterleave; rest < count; ++rest) {
    item(rest, lanes);
    for (int l = 0; l < L; ++l) acc[0][0][l] += lanes[l];
  }
  for (int64_t k = 1; k < kInterleave; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
  for (int l = 0; l < L; ++l) out[l] = acc[0][0][l];
}

// sum(x[i]^2) of one row of h floats as aten's x.pow(2).sum(-1) adds them (SumKernel.cpp
// vectorized_inner_sum) with vectors of L floats: the cascade over whole vectors, then the
// scalar tail in order, then the vector's lanes in order; rows shorter than a vector take the
// cascade over single floats (scalar_inner_sum).
template <int L>
float torch_sum_of_squares(const float* x, int64_t h) {
  float total = 0;
  if (h < L) {
    cascade_sum<1>(h, [&](int64_t i, float* lane) { lane[0] = x[i] * x[i]; }, &total);
    return total;
  }
  const int64_t vectors = h / L;
  float partial[L];
  cascade_sum<L>(vectors, [&](int64_t i, float* lanes) {
    for (int l = 0; l < L; ++l) lanes[l] = x[i * L + l] * x[i * L + l];
  }, partial);
  for (int64_t i = vectors * L; i < h; ++i) total += x[i] * x[i];
  for (int l = 0; l < L; ++l) total += partial[l];
  return total;
}

// Whether torch_rms_norm_rows computes what at::rms_norm does for rows of h floats: on x86,
// where aten's float sum runs its 8-float build (AVX2 and the plain one; on an AVX-512
// capability too: its sum of squares of [20, 576] random rows agreed with an 8-lane cascade
// every time, with a 16-lane one half the time), and for rows that aten sums in one pass (a
// single row of at least GRAIN_SIZE floats is split between threads).
bool torch_order_known(int64_t h) {
#if defined(__x86_64__) || defined(__i386__)
  return h < at::internal::GRAIN_SIZE;
#else
  (void)h;
  return false;
#endif
}

// Rows of x [rows, h] normed into out [rows, h] as F.rms_norm in float32 (torch_order_known(h)).
void torch_rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t h, double eps, float* out) {
  const float eps_f = float(eps), count = float(h);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * h;
    const float scale = 1.0f / std::sqrt(torch_sum_of_squares<8>(xr, h) / count + eps_f);  // rsqrt(mean + eps)
    for (int64_t i = 0; i < h; ++i) out[r * h + i] = xr[i] * scale * w[i];
  }
}

void check_norm_inputs(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [T, H] float32");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.size(0) == x.size(1),
              "weight must be [H] float32");
}

// The k largest of row[0..n) by value, largest first, into values / indices where they are
// unique: no NaN, the k values distinct and none of the others equal to the k-th. False
// otherwise (what a top-k returns then depends on its algorithm).
bool unique_top_k(const float* row, int64_t n, int64_t k, std::vector<double>& values, std::vector<int64_t>& indices) {
  std::vector<float> best(k);
  std::vector<int64_t> where(k);
  int64_t filled = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float v = row[j];
    if (filled == k && !(v > best[k - 1])) continue;
    int64_t at = filled < k ? filled++ : k - 1;
    for (; at > 0 && v > best[at - 1]; --at) {
      best[at] = best[at - 1];
      where[at] = where[at - 1];
    }
    best[at] = v;
    where[at] = j;
  }
  for (int64_t i = 1; i < k; ++i)
    if (!(best[i] < best[i - 1])) return false;
  const float kth = best[k - 1];
  int64_t nans = 0, reaching = 0;
  for (int64_t j = 0; j < n; ++j) {
    nans += std::isnan(row[j]);
    reaching += row[j] >= kth;
  }
  if (nans || reaching != k) return false;
  values.assign(best.begin(), best.end());
  indices = where;
  return true;
}

}  // namespace

at::Tensor torch_rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_norm_inputs(x_in, weight_in);
  if (!torch_order_known(x_in.size(1))) return at::rms_norm(x_in, {x_in.size(1)}, weight_in, eps);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty_like(x);
  torch_rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), x.size(1), eps, out.data_ptr<float>());
  return out;
}

at::Tensor rms_norm_int4_linear(const at::Tensor& x_in, const at::Tensor& weight_in, double eps,
                                const at::Tensor& packed) {
  check_norm_inputs(x_in, weight_in);
  TORCH_CHECK(packed.dim() == 3, "packed int4 weights must be uint8 [O/16, I/32, 320] (int4_pack)");
  const int64_t rows = x_in.size(0), hidden = x_in.size(1), out = packed.size(0) * 16;
  at::Tensor y = at::empty({rows, out}, x_in.options());
  if (rows == 0) return y;
  if (!torch_order_known(hidden)) {
    const at::Tensor normed = at::rms_norm(x_in, {hidden}, weight_in, eps).contiguous();
    int4_gemm(normed.data_ptr<float>(), rows, hidden, packed, y.data_ptr<float>());
    return y;
  }
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  static thread_local std::vector<float> normed;  // reused by the next call of this thread
  if (int64_t(normed.size()) < rows * hidden) normed.resize(rows * hidden);
  torch_rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), rows, hidden, eps, normed.data());
  int4_gemm(normed.data(), rows, hidden, packed, y.data_ptr<float>());
  return y;
}

std::tuple<std::vector<std::vector<double>>, std::vector<std::vector<int64_t>>> log_softmax_top_k(
    const at::Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat, "scores must be [R, N] float32");
  TORCH_CHECK(k >= 1 && k <= scores.size(1), "k must lie in 1..N, got ", k, " of ", scores.size(1));
  const at::Tensor log_probs = at::log_softmax(scores, -1).contiguous();
  const int64_t rows = log_probs.size(0), n = log_probs.size(1);
  std::vector<std::vector<double>> values(rows);
  std::vector<std::vector<int64_t>> indices(rows);
  for (int64_t r = 0; r < rows; ++r) {
    if (unique_top_k(log_probs.data_ptr<float>() + r * n, n, k, values[r], indices[r])) continue;
    const auto top = at::topk(log_probs[r], k);  // a tie or a NaN: aten's own choice
    const at::Tensor top_values = std::get<0>(top).to(at::kDouble), top_indices = std::get<1>(top);
    values[r].assign(top_values.data_ptr<double>(), top_values.data_ptr<double>() + k);
    indices[r].assign(top_indices.data_ptr<int64_t>(), top_indices.data_ptr<int64_t>() + k);
  }
  return {values, indices};
}

}  // namespace eyas
