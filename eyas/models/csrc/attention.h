// Attention of the fused layer over its KV cache (attention.cpp): declarations.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace eyas {

// The slots each row of a pass may see, in increasing order: from the mask [B, T, kv_len]
// (null: all kv_len slots). Built once per pass and read by every layer's attention.
struct Visibility {
  std::vector<int32_t> slots;  // row r = b * T + t sees slots[offsets[r] .. offsets[r + 1])
  std::vector<int64_t> offsets;  // [B * T + 1]
  int64_t longest = 0;  // the most slots a row sees
  const bool* mask = nullptr;  // [B, T, kv_len] or null, as given
  int64_t kv_len = 0;

  Visibility(const bool* mask, int64_t rows, int64_t kv_len);
};

// Scaled dot-product attention of q [B, T, Hq, D] over the cache's keys and values
// [B, KV, S, D] (the slots `visible` names); out [B, T, Hq, D] float32. Computed in the
// cache's dtype. A row's output depends only on the keys and values it may see, in slot
// order: never on the other rows of the pass, so a one-token step and a verification pass
// agree bit for bit.
void attention(const float* q, const float* keys, const float* values, const Visibility& visible, int64_t batch,
               int64_t length, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out);
void attention(const double* q, const double* keys, const double* values, const Visibility& visible,
               int64_t batch, int64_t length, int64_t heads, int64_t kv_heads, int64_t head_dim,
               int64_t max_slots, float* out);
// A float16 cache, read into float32: q and the arithmetic in float32 (the chunked attention
// only: head_dim 64 or 128 on AVX2 with F16C; an error elsewhere).
void attention(const float* q, const at::Half* keys, const at::Half* values, const Visibility& visible,
               int64_t batch, int64_t length, int64_t heads, int64_t kv_heads, int64_t head_dim,
               int64_t max_slots, float* out);

}  // namespace eyas
