// Exact sampling from softmax(logits / T) through the output layer's int8 screen (int8_screen.cpp),
// by the Gumbel-max trick: argmax_j (l_j / T + g_j), g_j i.i.d. Gumbel(0, 1), is a sample of
// softmax(l / T). The screen gives every logit an interval, l_j in [a_j - e_j, a_j + e_j]; only a
// token whose upper value (a_j + e_j) / T + g_j reaches the best lower value max_k (a_k - e_k) / T
// + g_k can win, and only those are computed exactly (exact_logit). The token returned is the
// argmax of the float32 values fl(fl(l_j * (1/T)) + g_j) over the whole vocabulary (first index
// among equal maxima): rounding is monotone, so a bound that holds for l_j still holds after the
// multiplication and the addition. models/output_layer.py (sample_logits) defines the same
// values in PyTorch for rows that are not screened.
//
// Noise: a counter-based generator, so that a row's noise is a function of one 64-bit key (the
// request's seed and the position of the token drawn, engine/gumbel.py), computed only by the
// thread that needs it, in any order: SplitMix64 (Steele, Lea and Flood 2014) over the Weyl
// sequence key' + (j + 1) * 0x9E3779B97F4A7C15, key' the key mixed once. Its 32 high bits give
// w = (k + 0.5) 2^-32 in (0, 1); E = -log(1 - w) ~ Exp(1) (log1p by Goldberg's identity, so that
// small E, the tokens with the largest noise, keep their resolution) and g = -log(E). Float32
// noise spans [-2.8, 22.9]: a token whose noise would lie above 22.9 (probability e^-22.9 ~ 1e-10
// per token) gets 22.9, one below -2.8 (e^-16.6 ~ 6e-8) gets -2.8. The logarithm is a polynomial the compiler
// vectorises (log_positive: ~2 ulp), since std::log is a call per element (the loop must stay
// free of floating-point compares and selects, which GCC vectorises only without
// -ftrapping-math): 0.26 ms for 49,152 tokens on one loaded core of the 2-core Xeon, 14x less
// than the scalar loop. k is capped at 2^32 - 256, so that w <= 1 - 2^-24 after rounding.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "int8_screen.h"
#include "worker_pool.h"

namespace eyas {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr int64_t kChunk = 4096;  // vocabulary entries per task of the noise's pass

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// log(x) for a normal float x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s),
// s = (m - 1) / (m + 1), |s| < 0.172, by its series to s^11; branch-free so that loops vectorise.
inline float log_positive(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t mantissa_bits = (bits & 0x7fffffu) | 0x3f800000u;  // m in [1, 2)
  const uint32_t big = uint32_t(mantissa_bits > 0x3fb504f3u);  // m > sqrt(2): halve it (see fill_noise)
  const uint32_t halved_bits = mantissa_bits - (big << 23);
  const int32_t exponent = int32_t(bits >> 23) - 127 + int32_t(big);
  float m;
  std::memcpy(&m, &halved_bits, 4);
  const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
  const float series =
      s * (2.0f + s2 * (0.666666667f + s2 * (0.4f + s2 * (0.285714286f + s2 * (0.222222222f + s2 * 0.181818182f)))));
  const float e = float(exponent);
  return e * 0.693145752f + (e * 1.42860677e-6f + series);  // log 2 in two parts
}

// The Gumbel noise of entry j of the row whose mixed key is `key`.
inline float noise_of(uint64_t key, int64_t j) {
  const uint64_t z = mix64(key + uint64_t(j + 1) * kGolden);
  // Selects are integer bit operations with both arms computed: GCC vectorises a loop with
  // floating-point comparisons or selects only without -ftrapping-math.
  const uint32_t high = uint32_t(z >> 32);
  const uint32_t k = high - (high > 0xFFFFFF00u ? high - 0xFFFFFF00u : 0u);  // w <= 1 - 2^-24
  const float w = (float(k) + 0.5f) * 2.3283064e-10f;
  const float y = 1.0f - w;  // E = -log1p(-w) = -log(y) w / (1 - y), or w where y rounds to 1
  const float goldberg = -log_positive(y) * (w / (1.0f - y));
  uint32_t y_bits, w_bits, goldberg_bits;
  std::memcpy(&y_bits, &y, 4);
  std::memcpy(&w_bits, &w, 4);
  std::memcpy(&goldberg_bits, &goldberg, 4);
  const uint32_t one = 0u - uint32_t(y_bits == 0x3f800000u);  // all ones where y rounds to 1
  const uint32_t exponential_bits = (w_bits & one) | (goldberg_bits & ~one);
  float exponential;
  std::memcpy(&exponential, &exponential_bits, 4);
  return -log_positive(exponential);
}

// The Gumbel noise of columns [begin, end) of the row whose mixed key is `key`: of entry j, or of
// entry ids[j] where ids is given (a subset of a vocabulary, drawn with its token ids' noise).
void fill_noise(uint64_t key, int64_t begin, int64_t end, float* out, const int64_t* ids = nullptr) {
  if (ids == nullptr) {
    for (int64_t j = begin; j < end; ++j) out[j] = noise_of(key, j);
  } else {
    for (int64_t j = begin; j < end; ++j) out[j] = noise_of(key, ids[j]);
  }
}

// ids [N] int64, each >= 0 (the entries whose noise is asked for).
void check_ids(const int64_t* ids, int64_t count) {
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ids[i] >= 0, "ids must be >= 0, got ", ids[i]);
}

at::Tensor checked_keys(const at::Tensor& keys, int64_t rows) {
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == rows && keys.scalar_type() == at::kLong,
              "keys must be int64 [", rows, "]");
  return keys.contiguous();
}

}  // namespace

at::Tensor gumbel_noise(const at::Tensor& keys_in, int64_t vocab) {
  TORCH_CHECK(keys_in.dim() == 1 && vocab > 0, "keys must be [R] and vocab positive");
  const at::Tensor keys = checked_keys(keys_in, keys_in.size(0));
  const int64_t rows = keys.size(0), chunks = (vocab + kChunk - 1) / kChunk;
  at::Tensor noise = at::empty({rows, vocab}, at::kFloat);
  const int64_t* kp = keys.data_ptr<int64_t>();
  float* np = noise.data_ptr<float>();
  eyas::pool_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, c = task % chunks;
      fill_noise(mix64(uint64_t(kp[r])), c * kChunk, std::min(vocab, (c + 1) * kChunk), np + r * vocab);
    }
  });
  return noise;
}

// The noise of the columns `ids` [N] of each key's row, [R, N]: the values gumbel_noise gives
// there. A draft that ranks its own vocabulary by the noise the target will draw with
// (engine/speculative/coupled_draws.py) needs it at those columns only.
at::Tensor gumbel_noise_at(const at::Tensor& keys_in, const at::Tensor& ids_in) {
  TORCH_CHECK(keys_in.dim() == 1, "keys must be [R]");
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, "ids must be int64 [N]");
  const at::Tensor keys = checked_keys(keys_in, keys_in.size(0));
  const at::Tensor ids = ids_in.contiguous();
  const int64_t rows = keys.size(0), count = ids.size(0);
  at::Tensor noise = at::empty({rows, count}, at::kFloat);
  const int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  check_ids(ip, count);
  float* np = noise.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)  // ~8 ns a column: no thread pays for itself here
    fill_noise(mix64(uint64_t(kp[r])), 0, count, np + r * count, ip);
  return noise;
}

namespace {

// Steps 1 and 2 of a Gumbel draw through the screen: the screen's intervals, every column's noise
// and each row's best lower value, from which a column is a candidate where its upper value
// reaches it (`candidate`).
struct GumbelScreen {
  at::Tensor x, approx, bound, inverse_temperature;
  int64_t rows = 0, vocab = 0, hidden = 0;
  std::vector<float> noise, best_lower;  // [R, V], [R]
  const float *a = nullptr, *b = nullptr, *t = nullptr;  // approx, bound, inverse_temperature's data

  bool candidate(int64_t r, int64_t j) const {
    const int64_t i = r * vocab + j;
    return (a[i] + b[i]) * t[r] + noise[i] >= best_lower[r];
  }
};

GumbelScreen gumbel_screen(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& sums, const at::Tensor& weight_error, const at::Tensor& approx_norm,
                           const at::Tensor& inverse_temperature_in, const at::Tensor& keys_in,
                           const at::Tensor& ids_in) {
  GumbelScreen s;
  // 1. The screen: approx and bound [R, V].
  s.x = x_in.to(at::kFloat).contiguous();
  std::tie(s.approx, s.bound) = int8_screen(s.x, packed, scale, sums, weight_error, approx_norm);
  s.rows = s.x.size(0), s.vocab = s.approx.size(1), s.hidden = s.x.size(1);
  TORCH_CHECK(inverse_temperature_in.numel() == s.rows, "inverse_temperature must have R entries");
  s.inverse_temperature = inverse_temperature_in.to(at::kFloat).contiguous();
  const at::Tensor keys = checked_keys(keys_in, s.rows);
  TORCH_CHECK(ids_in.numel() == 0 || (ids_in.dim() == 1 && ids_in.size(0) == s.vocab &&
                                      ids_in.scalar_type() == at::kLong),
              "ids must be empty or int64 [", s.vocab, "] (the token id of each screened row)");
  const at::Tensor ids = ids_in.contiguous();
  const int64_t* ip = ids.numel() ? ids.data_ptr<int64_t>() : nullptr;
  if (ip != nullptr) check_ids(ip, s.vocab);
  // 2. The noise and each chunk's best lower value, over (row, chunk) tasks.
  const int64_t chunks = (s.vocab + kChunk - 1) / kChunk;
  s.noise.resize(s.rows * s.vocab);
  std::vector<float> chunk_lower(s.rows * chunks);
  const float* ap = s.a = s.approx.data_ptr<float>();
  const float* bp = s.b = s.bound.data_ptr<float>();
  const float* tp = s.t = s.inverse_temperature.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  eyas::pool_for(0, s.rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, c = task % chunks;
      const int64_t lo = c * kChunk, hi = std::min(s.vocab, lo + kChunk);
      float* g = s.noise.data() + r * s.vocab;
      fill_noise(mix64(uint64_t(kp[r])), lo, hi, g, ip);
      const float* a = ap + r * s.vocab;
      const float* b = bp + r * s.vocab;
      const float t = tp[r];
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j < hi; ++j) best = std::max(best, (a[j] - b[j]) * t + g[j]);
      chunk_lower[task] = best;
    }
  });
  s.best_lower.resize(s.rows);
  for (int64_t r = 0; r < s.rows; ++r)
    s.best_lower[r] = *std::max_element(chunk_lower.begin() + r * chunks, chunk_lower.begin() + (r + 1) * chunks);
  return s;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> int8_screen_gumbel(
    const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& sums,
    const at::Tensor& weight_error, const at::Tensor& approx_norm, const at::Tensor& weight_in,
    const at::Tensor& inverse_temperature_in, const at::Tensor& keys_in) {
  const GumbelScreen s = gumbel_screen(x_in, packed, scale, sums, weight_error, approx_norm, inverse_temperature_in,
                                       keys_in, at::Tensor());
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.size(0) == s.vocab && weight_in.size(1) == s.hidden &&
              weight_in.scalar_type() == at::kFloat, "weight must be float32 [", s.vocab, ", ", s.hidden, "]");
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor tokens = at::empty({s.rows}, at::kLong), candidates = at::empty({s.rows}, at::kLong);
  // 3. Each row: the candidates' exact values, their argmax.
  const float* xp = s.x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* tp = s.inverse_temperature.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  int64_t* counted = candidates.data_ptr<int64_t>();
  eyas::pool_for(0, s.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = s.noise.data() + r * s.vocab;
      float best = -std::numeric_limits<float>::infinity();
      int64_t token = -1, count = 0;
      for (int64_t j = 0; j < s.vocab; ++j) {
        if (!s.candidate(r, j)) continue;
        ++count;
        const float value = exact_logit(xp + r * s.hidden, wp + j * s.hidden, s.hidden) * tp[r] + g[j];
        if (token < 0 || value > best) best = value, token = j;
      }
      TORCH_CHECK(token >= 0, "the Gumbel screen found no candidate (non-finite hidden state?)");
      out[r] = token;
      counted[r] = count;
    }
  });
  return {tokens, candidates};
}

// Steps 1 and 2 only, for a caller that computes the candidates' exact logits itself (an output
// layer whose float32 rows are read from the checkpoint on demand, a subset of a vocabulary):
// (rows [P], columns [P], noise [P]), by row then column, where noise is the candidate's Gumbel
// noise. ids [V] int64, or empty: column j is drawn with the noise of entry ids[j] (of entry j).
// The draw is the argmax over a row's candidates of fl(fl(l * (1/T)) + noise), the first column
// among equal maxima (models/output_layer.py).
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_screen_gumbel_candidates(
    const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& sums,
    const at::Tensor& weight_error, const at::Tensor& approx_norm, const at::Tensor& inverse_temperature_in,
    const at::Tensor& keys_in, const at::Tensor& ids_in) {
  const GumbelScreen s = gumbel_screen(x_in, packed, scale, sums, weight_error, approx_norm, inverse_temperature_in,
                                       keys_in, ids_in);
  std::vector<std::vector<int64_t>> found(s.rows);  // each row's candidate columns, rows in parallel
  eyas::pool_for(0, s.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t j = 0; j < s.vocab; ++j)
        if (s.candidate(r, j)) found[r].push_back(j);
  });
  int64_t count = 0;
  for (const auto& row : found) {
    TORCH_CHECK(!row.empty(), "the Gumbel screen found no candidate (non-finite hidden state?)");
    count += int64_t(row.size());
  }
  at::Tensor rows = at::empty({count}, at::kLong), columns = at::empty({count}, at::kLong);
  at::Tensor noise = at::empty({count}, at::kFloat);
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t* cp = columns.data_ptr<int64_t>();
  float* np = noise.data_ptr<float>();
  for (int64_t r = 0; r < s.rows; ++r)
    for (const int64_t j : found[r]) *rp++ = r, *cp++ = j, *np++ = s.noise[r * s.vocab + j];
  return {rows, columns, noise};
}

std::vector<int64_t> int8_screen_gumbel_ids(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                            const at::Tensor& sums, const at::Tensor& weight_error,
                                            const at::Tensor& approx_norm, const at::Tensor& weight,
                                            const std::vector<double>& inverse_temperatures,
                                            const std::vector<int64_t>& keys) {
  const int64_t hidden = packed.size(1) * 4;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == hidden, "x must be [..., ", hidden, "]");
  const at::Tensor flat = x.reshape({-1, hidden});
  const int64_t rows = flat.size(0);
  TORCH_CHECK(int64_t(inverse_temperatures.size()) == rows && int64_t(keys.size()) == rows,
              "one inverse temperature and one key per row of x (", rows, ")");
  at::Tensor scales = at::empty({rows}, at::kFloat), key_tensor = at::empty({rows}, at::kLong);
  for (int64_t r = 0; r < rows; ++r) {
    scales.data_ptr<float>()[r] = float(inverse_temperatures[r]);  // as torch.tensor(..., float32) rounds
    key_tensor.data_ptr<int64_t>()[r] = keys[r];
  }
  const at::Tensor tokens = std::get<0>(
      int8_screen_gumbel(flat, packed, scale, sums, weight_error, approx_norm, weight, scales, key_tensor));
  const int64_t* tp = tokens.data_ptr<int64_t>();
  return std::vector<int64_t>(tp, tp + rows);
}

}  // namespace eyas

TORCH_LIBRARY_FRAGMENT(eyas, m) {
  m.def("gumbel_noise(Tensor keys, int vocab) -> Tensor", &eyas::gumbel_noise);
  m.def("gumbel_noise_at(Tensor keys, Tensor ids) -> Tensor", &eyas::gumbel_noise_at);
  m.def("int8_screen_gumbel(Tensor x, Tensor packed, Tensor scale, Tensor sums, Tensor weight_error, "
        "Tensor approx_norm, Tensor weight, Tensor inverse_temperature, Tensor keys) -> (Tensor, Tensor)",
        &eyas::int8_screen_gumbel);
  m.def("int8_screen_gumbel_candidates(Tensor x, Tensor packed, Tensor scale, Tensor sums, Tensor weight_error, "
        "Tensor approx_norm, Tensor inverse_temperature, Tensor keys, Tensor ids) -> (Tensor, Tensor, Tensor)",
        &eyas::int8_screen_gumbel_candidates);
}
