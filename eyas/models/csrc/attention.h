// Attention of the fused layer over its KV cache (attention.cpp): declarations.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace eyas {

// Which cache row each row of a pass reads and writes, and the slots it may see there, in
// increasing order: from the mask [N, kv_len] (null: all kv_len slots). A dense pass [B, T]
// has row n = b * T + t in sequence b; a ragged one names each row's sequence (its KV cache
// row), any number of rows per sequence. Built once per pass and read by every layer.
struct Visibility {
  std::vector<int32_t> slots;  // row r sees slots[offsets[r] .. offsets[r + 1])
  std::vector<int64_t> offsets;  // [N + 1]
  std::vector<int64_t> sequences;  // [N]: the KV cache row of each row
  std::vector<int64_t> runs;  // [R + 1]: rows runs[i] .. runs[i + 1] - 1 share one sequence
  int64_t longest = 0;  // the most slots a row sees
  const bool* mask = nullptr;  // [N, kv_len] or null, as given
  int64_t kv_len = 0;

  Visibility(const bool* mask, int64_t kv_len, std::vector<int64_t> sequences);
  int64_t rows() const { return int64_t(sequences.size()); }
};

// Scaled dot-product attention of q [N, Hq, D] over the cache's keys and values
// [B, KV, S, D] (each row its own sequence's, the slots `visible` names); out [N, Hq, D]
// float32. Computed in the cache's dtype. A row's output depends only on the keys and values
// it may see, in slot order: never on the other rows of the pass, so a one-token step, a
// verification pass and a ragged pass over many sequences agree bit for bit.
void attention(const float* q, const float* keys, const float* values, const Visibility& visible, int64_t heads,
               int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out);
void attention(const double* q, const double* keys, const double* values, const Visibility& visible,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out);
// A float16 cache, read into float32: q and the arithmetic in float32 (the chunked attention
// only: head_dim 64 or 128 on AVX2 with F16C; an error elsewhere).
void attention(const float* q, const at::Half* keys, const at::Half* values, const Visibility& visible,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out);

}  // namespace eyas
