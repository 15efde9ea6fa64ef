// Runs of int4 decoder layers kept with their weights, one C++ call a pass (int4_stack.cpp): the
// target's whole stack (Int4Stack) and an EAGLE-3 head's layer (Int4HeadLayer). Bound to Python
// in int4_decoder_layer.cpp; models/fused_cpu.py and eagle3/fused.py call them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "decoder_layer.h"
#include "int4_gemm.h"

namespace eyas {

// The decoder layers of an int4 model, run in one call per pass (no Python between layers):
// the same code and the same bits as one int4_decoder_layer call per layer.
class Int4Stack {
 public:
  // weights: 11 tensors per layer in int4_decoder_layer's order (an empty qkv bias: none).
  Int4Stack(const std::vector<at::Tensor>& weights, int64_t group, double eps, int64_t heads, int64_t kv_heads);

  int64_t size() const { return int64_t(layers_.size()); }

  // x [N, H] float32 through layers[i] for i in `layers` (in order), layer i reading and
  // writing keys[storage[i]] / values[storage[i]] of the cache [L', B', KV, S, D]; the rest as
  // int4_decoder_layer. A ragged pass gives `sequences` [N] (each row's cache row), slots [N]
  // and mask [N, kv_len]: rows of any number of sequences, each with its own count of rows.
  // Taps (EAGLE-3): for each position p = tap_before[j] (0 <= p <= len(layers), any order,
  // repeats allowed), the hidden entering layers[p] (p == len(layers): the output) is copied
  // to taps[:, j] of `taps` [N, len(tap_before), H] float32, written in place.
  at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                 const at::Tensor& values, const std::vector<int64_t>& layers, const std::vector<int64_t>& storage,
                 const at::Tensor& slots, int64_t kv_len, const c10::optional<at::Tensor>& mask,
                 const c10::optional<at::Tensor>& sequences = c10::nullopt,
                 const std::vector<int64_t>& tap_before = {},
                 const c10::optional<at::Tensor>& taps = c10::nullopt) const;

  // A single-stream step (Transformer.decode_rows): tokens [T] at positions [T], written at slots
  // first_slot .. first_slot + T - 1 of cache row 0, seeing slots [0, first_slot + T) through
  // mask [1, T, first_slot + T] (or none: T = 1), through every layer, then the final RMSNorm
  // (torch_rms_norm: F.rms_norm's bits). run()'s inputs are gathered here, the rows that
  // F.embedding and indexing give: x from embed [V, H], cos and sin from the rotary tables
  // [P, D], so that a step makes no small PyTorch ops, each of which runs cold (~20-50 us on
  // AMD Zen 4) after a pass has streamed ~100 MB of weights. -> [hidden [1, T, H]] or, with
  // taps, [hidden, taps [1, T, len(tap_before) * H]].
  std::vector<at::Tensor> decode(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                                 int64_t first_slot, const at::Tensor& embed, const at::Tensor& cos_table,
                                 const at::Tensor& sin_table, const at::Tensor& keys, const at::Tensor& values,
                                 const std::vector<int64_t>& storage, const c10::optional<at::Tensor>& mask,
                                 const std::vector<int64_t>& tap_before, const at::Tensor& norm, double eps) const;

 private:
  std::vector<LayerWeights> layers_;
};

// An EAGLE-3 head's decoder layer (eagle3/fused.py FusedHead), kept with its weights: one call a
// draft pass from token ids and positions given as Python ints, its inputs gathered here (the
// fc projection of the target's taps, the token embeddings, the rotary rows, the slots, the
// causal mask) as int4_decoder_layer's caller gathered them in PyTorch, so the same bits, and a
// drafting step makes no small PyTorch ops, each of which runs cold after the target's pass.
class Int4HeadLayer {
 public:
  // weights: int4_decoder_layer's 11; norm_embeds [H]; fc: the fc projection's packed int8dot
  // weights (int4_pack's layout) or an empty tensor (then only H-wide inputs are taken).
  Int4HeadLayer(const std::vector<at::Tensor>& weights, int64_t group, double eps, int64_t heads, int64_t kv_heads,
                const at::Tensor& norm_embeds, const at::Tensor& fc);

  // x [..., W] (W: fc's input width, the target's taps, or H, the head's own outputs; T rows),
  // tokens and positions [T]; writes the rows' keys and values at slots first_slot.. of
  // keys/values [1, KV, S, D]; mask [T, first_slot + T] bool or none (causal: row t sees slots
  // up to first_slot + t). embed [V, H], cos_table/sin_table [P, D] float32. -> [1, T, H].
  at::Tensor step(const at::Tensor& x, const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                  int64_t first_slot, const at::Tensor& embed, const at::Tensor& cos_table,
                  const at::Tensor& sin_table, const at::Tensor& keys, const at::Tensor& values,
                  const c10::optional<at::Tensor>& mask) const;

 private:
  LayerWeights weights_;
  at::Tensor norm_embeds_, fc_tensor_;
  PackedInt4 fc_;
};

}  // namespace eyas
