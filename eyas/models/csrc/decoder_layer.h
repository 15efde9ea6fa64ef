// One decoder layer of an int4 Llama-family model on the CPU (decoder_layer.cpp) and what the
// callers that run layers share: the layer's weights as raw pointers, a pass's tables, the KV
// cache by layer (int4_stack.cpp: the target's stack and an EAGLE-3 head's layer;
// int4_decoder_layer.cpp: one layer a call, and the Python bindings).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "attention.h"
#include "int4_gemm.h"

namespace eyas {

// One int4 weight matrix in one of two layouts: eyas's int8dot kernel's (uint8 [O/16, I/32, 320],
// int4_gemm.cpp; `scales` unused) or PyTorch's packed int4 with its scales.
struct Linear {
  at::Tensor packed, scales;
  PackedInt4 fast;  // set where `packed` is in the int8dot kernel's layout
};

// The tensors and sizes of one decoder layer, in int4_decoder_layer's argument order (the tensors
// kept alive here), and what a pass reads of them as raw pointers: once the weights have streamed
// through the caches, every access to a tensor's metadata (data_ptr, sizes, checks) is a cache
// miss, ~10 a layer.
struct LayerWeights {
  at::Tensor norm_in;
  Linear qkv;
  c10::optional<at::Tensor> qkv_bias;
  Linear o;
  at::Tensor norm_post;
  Linear gate_up, down;
  int64_t group, heads, kv_heads;
  double eps;
  const float* norm_in_data = nullptr;
  const float* norm_post_data = nullptr;
  const float* bias_data = nullptr;  // [(Hq + 2 KV) * D] or null

  LayerWeights(const at::Tensor& norm_in_, const at::Tensor& qkv_packed, const at::Tensor& qkv_scales,
               const c10::optional<at::Tensor>& qkv_bias_, const at::Tensor& o_packed, const at::Tensor& o_scales,
               const at::Tensor& norm_post_, const at::Tensor& gate_up_packed, const at::Tensor& gate_up_scales,
               const at::Tensor& down_packed, const at::Tensor& down_scales, int64_t group_, int64_t heads_,
               int64_t kv_heads_, double eps_);

  // weights: the 11 tensors in that order (an empty qkv bias: none).
  static LayerWeights from(const std::vector<at::Tensor>& weights, int64_t group, double eps, int64_t heads,
                           int64_t kv_heads);
};

// What every layer of a pass shares: rows, rotary tables, cache slots, each row's sequence
// and visible slots.
struct Pass {
  const float* cos;  // [N, D] float32
  const float* sin;  // [N, D] float32, sign-folded
  const int64_t* slots;  // [N] (or [B, T]) int64: each row's slot in its own cache row
  int64_t head_dim;
  int64_t kv_len;
  const Visibility& visible;  // each row's cache row (sequence) and visible slots
};

// The pass's tables, checked (slots: check_pass).
Pass make_pass(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots, int64_t kv_len,
               const Visibility& visible);

// A layer of the KV cache, [B', KV, S, D] float64, float32 or float16, by raw pointers; from a
// stack's cache [L, B', KV, S, D], its first layer, `layer(i)` giving the others.
struct CacheLayer {
  at::ScalarType dtype;
  void* keys;
  void* values;
  int64_t rows, kv_heads, slots, head_dim;
  int64_t layers = 1, key_layer_bytes = 0, value_layer_bytes = 0;

  CacheLayer layer(int64_t index) const;
};

// Checks keys, values (4-D: one layer [B', KV, S, D]; 5-D: a stack's [L, B', KV, S, D]).
CacheLayer cache_layers(const at::Tensor& keys, const at::Tensor& values);

// x [N, H] float32 (row n of sequence pass.visible.sequences[n]) -> the layer's output, written
// to `out` [N, H] (not x); writes this layer's keys and values at each row's slot of its
// sequence's row of the cache layer. With `embeds` [N, H] (and `norm_embeds` [H]) it is an
// EAGLE-3 head's layer: the attention reads cat(RMSNorm(embeds), RMSNorm(x)) [N, 2H] and the
// residual stays x.
void decoder_layer(const float* x, int64_t rows, int64_t hidden, const LayerWeights& w, const Pass& pass,
                   const CacheLayer& cache, float* out, const at::Tensor* embeds = nullptr,
                   const at::Tensor* norm_embeds = nullptr);

// ---- a pass's inputs, checked and gathered (int4_stack.cpp) -----------------------------------

// The mask [N, kv_len] bool (or none: every slot visible), checked.
at::Tensor checked_mask(const c10::optional<at::Tensor>& mask, int64_t rows, int64_t kv_len);

// Checks the pass and returns each row's sequence (cache row): dense, slots [B, T] and no
// `sequences` (row n = b * T + t in sequence b); ragged, slots [N] and sequences [N] int64.
std::vector<int64_t> check_pass(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& cos,
                                const c10::optional<at::Tensor>& sequences);

// Tap positions into a run of `count` layers and the tensor they fill: taps [N, len(tap_before), H]
// float32 like x, given exactly when tap_before is not empty.
void check_taps(const at::Tensor& x, int64_t count, const std::vector<int64_t>& tap_before,
                const c10::optional<at::Tensor>& taps);

// Copies hidden [N, H] (what enters layer `position` of the run) into taps[:, j] for every j
// with tap_before[j] == position.
void copy_taps(const float* hidden, int64_t rows, int64_t width, const std::vector<int64_t>& tap_before,
               int64_t position, float* taps);

// Rows [T, width] float32 of `table` [rows, width] (contiguous float32) at `ids`, checked: the
// rows F.embedding and indexing give.
at::Tensor gathered_rows(const at::Tensor& table, const std::vector<int64_t>& ids, const char* what);

// Slots [1, T] int64: first_slot, first_slot + 1, ...
at::Tensor slot_range(int64_t first_slot, int64_t count);

}  // namespace eyas
