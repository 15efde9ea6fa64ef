// The target's decoder stack (Int4Stack) and an EAGLE-3 head's layer (Int4HeadLayer), one C++
// call a pass (int4_stack.h), and the checks and gathering of a pass's inputs that they and the
// one-layer call (int4_decoder_layer.cpp) share.
//
// Why one call: a pass of SmolLM2-135M's 30 layers issued layer by layer from Python paid ~25
// small ops a layer around the matmuls, and each op after a pass that streamed ~100 MB of weights
// runs cold (~20-50 us on AMD Zen 4). The stack runs every layer of a pass without returning to
// Python, copying out the residual stream an EAGLE-3 head reads (the taps) on the way; the visible
// slots of each row (attention.h's Visibility) are gathered once per pass, not once per layer.
// The floor it chases is decoder_layer.cpp's: the weights read once per pass.

#include "int4_stack.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"
#include "decoder_layer.h"
#include "head_output.h"
#include "int4_gemm.h"
#include "phase_timer.h"

namespace eyas {

using at::Tensor;

// ---- a pass's inputs (decoder_layer.h) -----------------------------------------------------------

Tensor checked_mask(const c10::optional<Tensor>& mask, int64_t rows, int64_t kv_len) {
  if (!mask.has_value()) return Tensor();
  Tensor contiguous = mask->contiguous();
  TORCH_CHECK(contiguous.scalar_type() == at::kBool && contiguous.numel() == rows * kv_len,
              "mask: [N, kv_len] bool (a dense pass: [B, T, kv_len])");
  return contiguous;
}

std::vector<int64_t> check_pass(const Tensor& x, const Tensor& slots, const Tensor& cos,
                                const c10::optional<Tensor>& sequences) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [N, H] float32");
  TORCH_CHECK(cos.size(1) % 8 == 0, "head_dim must be a multiple of 8");
  const int64_t rows = x.size(0);
  if (!sequences.has_value()) {
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2,
                "slots: [B, T] int64 (or [N] with sequences [N])");
    TORCH_CHECK(slots.size(0) * slots.size(1) == rows, "slots must hold one slot per row of x");
    std::vector<int64_t> dense(rows);
    for (int64_t n = 0; n < rows; ++n) dense[n] = n / slots.size(1);
    return dense;
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
              "slots: [N] int64, one per row of x");
  TORCH_CHECK(sequences->scalar_type() == at::kLong && sequences->numel() == rows,
              "sequences: [N] int64, one cache row per row of x");
  const Tensor contiguous = sequences->contiguous();
  const int64_t* data = contiguous.data_ptr<int64_t>();
  for (int64_t n = 0; n < rows; ++n) TORCH_CHECK_INDEX(data[n] >= 0, "sequence ", data[n], " of row ", n);
  return std::vector<int64_t>(data, data + rows);
}

void check_taps(const Tensor& x, int64_t count, const std::vector<int64_t>& tap_before,
                const c10::optional<Tensor>& taps) {
  TORCH_CHECK(taps.has_value() == !tap_before.empty(), "taps [N, len(tap_before), H] and tap_before come together");
  if (!taps.has_value()) return;
  for (int64_t p : tap_before)
    TORCH_CHECK_INDEX(p >= 0 && p <= count, "tap position ", p, " of a run of ", count,
                      " layers: 0 (the input) .. ", count, " (the output)");
  TORCH_CHECK(taps->scalar_type() == at::kFloat && taps->is_contiguous() && taps->dim() == 3 &&
              taps->size(0) == x.size(0) && taps->size(1) == int64_t(tap_before.size()) && taps->size(2) == x.size(1),
              "taps: [N, len(tap_before), H] float32, contiguous, N and H as x");
}

void copy_taps(const float* hidden, int64_t rows, int64_t width, const std::vector<int64_t>& tap_before,
               int64_t position, float* taps) {
  const int64_t count = int64_t(tap_before.size());
  for (int64_t j = 0; j < count; ++j) {
    if (tap_before[j] != position) continue;
    for (int64_t n = 0; n < rows; ++n)
      std::memcpy(taps + (n * count + j) * width, hidden + n * width, width * sizeof(float));
  }
}

Tensor gathered_rows(const Tensor& table, const std::vector<int64_t>& ids, const char* what) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.is_contiguous(), what,
              ": a contiguous float32 [rows, width] table");
  const int64_t width = table.size(1), count = int64_t(ids.size());
  Tensor rows = at::empty({count, width}, table.options());
  for (int64_t t = 0; t < count; ++t) {
    TORCH_CHECK_INDEX(ids[t] >= 0 && ids[t] < table.size(0), what, ": row ", ids[t], " of ", table.size(0));
    std::memcpy(rows.data_ptr<float>() + t * width, table.data_ptr<float>() + ids[t] * width, width * sizeof(float));
  }
  return rows;
}

Tensor slot_range(int64_t first_slot, int64_t count) {
  TORCH_CHECK(first_slot >= 0, "first_slot >= 0");
  Tensor slots = at::empty({1, count}, at::kLong);
  int64_t* data = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t) data[t] = first_slot + t;
  return slots;
}

// ---- Int4Stack ------------------------------------------------------------------------------------

Int4Stack::Int4Stack(const std::vector<Tensor>& weights, int64_t group, double eps, int64_t heads,
                     int64_t kv_heads) {
  TORCH_CHECK(weights.size() % 11 == 0, "Int4Stack takes 11 tensors per layer");
  for (size_t i = 0; i < weights.size(); i += 11) {
    const std::vector<Tensor> layer(weights.begin() + i, weights.begin() + i + 11);
    layers_.push_back(LayerWeights::from(layer, group, eps, heads, kv_heads));
  }
}

Tensor Int4Stack::run(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& keys, const Tensor& values,
                      const std::vector<int64_t>& layers, const std::vector<int64_t>& storage, const Tensor& slots,
                      int64_t kv_len, const c10::optional<Tensor>& mask,
                      const c10::optional<Tensor>& sequences,
                      const std::vector<int64_t>& tap_before, const c10::optional<Tensor>& taps) const {
  const eyas::PhaseScope timed(eyas::kStackOther);
  std::vector<int64_t> row_sequences = check_pass(x, slots, cos, sequences);
  TORCH_CHECK(layers.size() == storage.size(), "one storage index per layer");
  TORCH_CHECK(keys.dim() == 5 && keys.sizes() == values.sizes(), "keys, values: [L, B, KV, S, D]");
  check_taps(x, int64_t(layers.size()), tap_before, taps);
  float* tap_data = taps.has_value() ? taps->data_ptr<float>() : nullptr;
  const int64_t kv_len_checked = std::max<int64_t>(kv_len, 1);
  const Tensor mask_c = checked_mask(mask, x.size(0), kv_len_checked);
  const eyas::Visibility visible(mask_c.defined() ? mask_c.data_ptr<bool>() : nullptr, kv_len,
                                 std::move(row_sequences));
  const Pass pass = make_pass(cos, sin, slots, kv_len, visible);
  const CacheLayer cache = cache_layers(keys, values);
  // Layers write in turn to two buffers (a layer never writes its own input).
  Tensor outputs[2] = {at::empty_like(x), layers.size() > 1 ? at::empty_like(x) : Tensor()};
  const float* input = x.data_ptr<float>();
  Tensor hidden = x;
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK_INDEX(layers[i] >= 0 && layers[i] < size(), "layer ", layers[i], " of ", size());
    copy_taps(input, x.size(0), x.size(1), tap_before, int64_t(i), tap_data);
    hidden = outputs[i % 2];
    decoder_layer(input, x.size(0), x.size(1), layers_[layers[i]], pass, cache.layer(storage[i]),
                  hidden.data_ptr<float>());
    input = hidden.data_ptr<float>();
  }
  copy_taps(input, x.size(0), x.size(1), tap_before, int64_t(layers.size()), tap_data);
  return hidden;
}

std::vector<Tensor> Int4Stack::decode(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                                      int64_t first_slot, const Tensor& embed, const Tensor& cos_table,
                                      const Tensor& sin_table, const Tensor& keys, const Tensor& values,
                                      const std::vector<int64_t>& storage, const c10::optional<Tensor>& mask,
                                      const std::vector<int64_t>& tap_before, const Tensor& norm, double eps) const {
  const int64_t count = int64_t(tokens.size());
  TORCH_CHECK(count > 0 && positions.size() == tokens.size(), "tokens and positions: T > 0 of each");
  TORCH_CHECK(cos_table.sizes() == sin_table.sizes(), "cos_table and sin_table differ in shape");
  TORCH_CHECK(int64_t(storage.size()) == size(), "one storage index per layer");
  const int64_t hidden = embed.size(1);
  const Tensor x = gathered_rows(embed, tokens, "embed");
  const Tensor cos = gathered_rows(cos_table, positions, "cos_table");
  const Tensor sin = gathered_rows(sin_table, positions, "sin_table");
  const Tensor slots = slot_range(first_slot, count);
  std::vector<int64_t> layers(size());
  for (int64_t i = 0; i < size(); ++i) layers[i] = i;
  c10::optional<Tensor> taps;
  if (!tap_before.empty()) taps = at::empty({count, int64_t(tap_before.size()), hidden}, embed.options());
  const Tensor out = run(x, cos, sin, keys, values, layers, storage, slots, first_slot + count, mask, c10::nullopt,
                         tap_before, taps);
  std::vector<Tensor> result{eyas::torch_rms_norm(out, norm, eps).view({1, count, hidden})};
  if (taps.has_value()) result.push_back(taps->view({1, count, -1}));
  return result;
}

// ---- Int4HeadLayer --------------------------------------------------------------------------------

Int4HeadLayer::Int4HeadLayer(const std::vector<Tensor>& weights, int64_t group, double eps, int64_t heads,
                             int64_t kv_heads, const Tensor& norm_embeds, const Tensor& fc)
    : weights_(LayerWeights::from(weights, group, eps, heads, kv_heads)), norm_embeds_(norm_embeds), fc_tensor_(fc) {
  TORCH_CHECK(norm_embeds.scalar_type() == at::kFloat && norm_embeds.is_contiguous(),
              "norm_embeds: contiguous float32 [H]");
  if (fc.numel()) fc_ = eyas::packed_int4(fc);
}

Tensor Int4HeadLayer::step(const Tensor& x_in, const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                           int64_t first_slot, const Tensor& embed, const Tensor& cos_table, const Tensor& sin_table,
                           const Tensor& keys, const Tensor& values, const c10::optional<Tensor>& mask) const {
  const int64_t count = int64_t(tokens.size());
  TORCH_CHECK(count > 0 && positions.size() == tokens.size(), "tokens and positions: T > 0 of each");
  const int64_t hidden = embed.size(1);
  Tensor x = x_in.reshape({-1, x_in.size(-1)}).to(at::kFloat).contiguous();
  TORCH_CHECK(x.size(0) == count, "x must have one row per token (", count, ")");
  if (fc_.data != nullptr && x.size(1) == fc_.groups * 32) {  // the target's taps through fc
    Tensor projected = at::empty({count, fc_.blocks * 16}, x.options());
    eyas::int4_gemm(x.data_ptr<float>(), count, x.size(1), fc_, projected.data_ptr<float>());
    x = projected;
  }
  TORCH_CHECK(x.size(1) == hidden, "x must be [..., ", hidden, "] (or fc's input width)");
  const Tensor embeds = gathered_rows(embed, tokens, "embed");
  const Tensor cos = gathered_rows(cos_table, positions, "cos_table");
  const Tensor sin = gathered_rows(sin_table, positions, "sin_table");
  const Tensor slots = slot_range(first_slot, count);
  const int64_t kv_len = first_slot + count;
  Tensor mask_c;
  if (mask.has_value()) {
    mask_c = checked_mask(mask, count, kv_len);
  } else if (count > 1) {
    mask_c = at::empty({count, kv_len}, at::kBool);
    bool* m = mask_c.data_ptr<bool>();
    for (int64_t t = 0; t < count; ++t)
      for (int64_t j = 0; j < kv_len; ++j) m[t * kv_len + j] = j <= first_slot + t;
  }
  const eyas::Visibility visible(mask_c.defined() ? mask_c.data_ptr<bool>() : nullptr, kv_len,
                                 std::vector<int64_t>(count, 0));
  const Pass pass = make_pass(cos, sin, slots, kv_len, visible);
  TORCH_CHECK(keys.dim() == 4, "keys, values: the head's cache [1, KV, S, D]");
  Tensor out = at::empty({count, hidden}, x.options());
  decoder_layer(x.data_ptr<float>(), count, hidden, weights_, pass, cache_layers(keys, values),
                out.data_ptr<float>(), &embeds, &norm_embeds_);
  return out.view({1, count, hidden});
}

}  // namespace eyas
