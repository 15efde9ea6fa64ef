// Attention of the fused int4 layer over its KV cache (float32, float16 or float64), on the CPU.
// The floor it chases: the multiply-adds of q . k and p * v (2 * heads * head_dim per visible
// key and row) at the float32 FMA peak, each key and value row read once per token's queries.
//
// Two implementations with the same contract (attention.h): `chunked_attention` for a float32
// or float16 cache and head_dim 64 or 128 on AVX2 or AVX-512 (what the engine runs; the same
// bits on both), and `generic_attention` for the rest. Which one runs depends only on the cache's
// dtype, head_dim and the build, never on the pass, so every pass of a process computes a row
// the same way.

#include "attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>
#include <vector>

#include "phase_timer.h"
#include "simd.h"

namespace eyas {
namespace {

// Scaled dot-product attention in the cache's dtype: q [N, Hq, D], keys/values
// [B, KV, S, D] (the cache; row n reads its sequence's), mask [N, S] or none (all kv_len slots
// visible); out [N, Hq, D] rounded to float32 (the o_proj input).
// Each query's scores, softmax and weighted sum run over its visible slots in increasing order
// with the same instructions whatever T is: a row's output does not depend on the other rows
// of the pass, so a one-token step and a verification pass agree bit for bit.
template <typename T>
void generic_attention(const T* q, const T* keys, const T* values, const Visibility& visible, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out) {
  const bool* mask = visible.mask;
  const int64_t kv_len = visible.kv_len, rows = visible.rows();
  using S = Simd<T>;
  const int64_t group = heads / kv_heads;
  const T scale = T(1.0 / std::sqrt(double(head_dim)));
  const int64_t work = rows * group * kv_len * head_dim;
  // Work items: (row, kv head), so that a long pass (a prefill) spreads over the threads; how
  // queries are grouped changes no value.
  const int64_t items = rows * kv_heads;
  eyas::parallel_for(0, items, work >= (1 << 15) ? 1 : items, [&](int64_t begin, int64_t end) {
    std::vector<T> probs(kv_len);
    std::vector<typename S::Vec> acc(head_dim / S::width);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kvh = item % kv_heads, b = visible.sequences[row];
      const T* kb = keys + (b * kv_heads + kvh) * max_slots * head_dim;
      const T* vb = values + (b * kv_heads + kvh) * max_slots * head_dim;
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {  // the queries of kv head kvh
        const T* qv = q + (row * heads + h) * head_dim;
        const bool* visible = mask ? mask + row * kv_len : nullptr;
        constexpr int block = KeyBlock<T>::size;
        for (int64_t s = 0; s < kv_len; s += block) {
          const int64_t n = std::min<int64_t>(block, kv_len - s);
          if (visible && std::none_of(visible + s, visible + s + n, [](bool v) { return v; })) continue;
          const T* k[block];
          for (int i = 0; i < block; ++i) k[i] = kb + (s + std::min<int64_t>(i, n - 1)) * head_dim;
          T dots[block];
          KeyBlock<T>::scores(qv, k, head_dim, dots);
          for (int64_t i = 0; i < n; ++i) probs[s + i] = dots[i] * scale;
        }
        T best = -INFINITY;
        for (int64_t s = 0; s < kv_len; ++s)
          if (!visible || visible[s]) best = std::max(best, probs[s]);
        for (int64_t s = 0; s < kv_len; ++s)
          probs[s] = (!visible || visible[s]) ? exp_of(probs[s] - best) : T(0);
        T total = 0;
        for (auto& a : acc) a = typename S::Vec{};
        for (int64_t s = 0; s < kv_len; ++s) {
          const T p = probs[s];
          if (p == T(0)) continue;
          total += p;
          const T* vr = vb + s * head_dim;
          for (int64_t c = 0; c < head_dim / S::width; ++c) acc[c] += p * S::load(vr + c * S::width);
        }
        float* o = out + (row * heads + h) * head_dim;
        for (int64_t c = 0; c < head_dim / S::width; ++c)
          for (int64_t i = 0; i < S::width; ++i) o[c * S::width + i] = float(acc[c][i] / total);
      }
    }
  });
}


#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EYAS_CHUNKED_ATTENTION 1

// Attention over a float32 (or float16) cache in chunks of a query's visible keys, for
// head_dim = 16 * NV: what the engine runs.
//
// Why: a work item (run of rows of one sequence, kv head, chunk j) covers every query of that
// kv head, and chunk j of a query is its visible keys number 64j .. 64j + 63 in slot order:
// mostly the same slots for all the queries of a sequence, read from L1 by all of them, so a
// one-token step spreads over the threads too. The queries of one token that share a kv head (the GQA group)
// run together: each key and value row is loaded once for all of them, scores are 16-float
// dot products reduced eight keys at a time, the exponentials run 16 lanes at a time
// (exp16), and the weighted sums of up to 4 queries stay in registers. Each query keeps a
// partial softmax (max, sum, weighted sum) per chunk, and the partials are combined in chunk
// order.
//
// Numerics: a query's result depends only on the sequence of keys and values it may see, not
// on the slots they sit in (a tree node's slot differs from its slot in sequential decoding),
// the other rows of the pass, how queries are grouped, or kv_len: chunks count visible keys,
// every chunk runs over a full 64-entry array (padding -inf, then 0) with the same
// instructions, and the chunks are combined in order with a scalar exp. Floats16 gives the same
// bits on AVX-512 and AVX2.
constexpr int64_t kChunk = 64;

// Partial softmaxes of `G` queries of one token over one chunk of its visible keys: n keys
// (1..64) at chunk_slots; part[g] receives max, sum, then the head_dim weighted sums.
template <int NV, int G, typename K>
void chunk_partials(const float* const qv[G], const K* kb, const K* vb, const int32_t* chunk_slots, int64_t n,
                    float scale, float* const part[G]) {
  constexpr int64_t head_dim = 16 * NV;
  alignas(64) float scores[G][kChunk];
  Floats16 query[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) query[g][c] = Floats16::load(qv[g] + 16 * c);
  // 1. Scores, eight keys at a time; a short block repeats its last key (ignored).
  for (int64_t i = 0; i < kChunk; i += 8) {
    const int64_t count = std::min<int64_t>(8, n - i);
    if (count <= 0) {
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < 8; ++j) scores[g][i + j] = -INFINITY;
      continue;
    }
    const K* k[8];
    for (int j = 0; j < 8; ++j) k[j] = kb + int64_t(chunk_slots[i + std::min<int64_t>(j, count - 1)]) * head_dim;
    // keys count.. of the block are padding: -inf
    const __m256 padding = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(float(count)), _CMP_GE_OQ);
    for (int g = 0; g < G; ++g) {  // one query at a time: its 8 sums stay in registers
      Floats16 sums[8];
      for (int j = 0; j < 8; ++j) {
        sums[j] = Floats16::zero();
        for (int c = 0; c < NV; ++c) sums[j].fma(query[g][c], Floats16::load(k[j] + 16 * c));
      }
      const __m256 dots = _mm256_mul_ps(reduce8_halves(sums), _mm256_set1_ps(scale));
      _mm256_store_ps(scores[g] + i, _mm256_blendv_ps(dots, _mm256_set1_ps(-INFINITY), padding));
    }
  }
  // 2. Softmax numerators: e^(score - max), 0 for padding; their sum in a fixed order.
  Floats16 probs[G][kChunk / 16];
  float best[G], total[G];
  for (int g = 0; g < G; ++g) {
    Floats16 top = Floats16::load(scores[g]);
    for (int c = 1; c < kChunk / 16; ++c) top = max(top, Floats16::load(scores[g] + 16 * c));
    alignas(64) float lanes[16];
    top.store(lanes);
    best[g] = *std::max_element(lanes, lanes + 16);  // a max is exact in any order
    const Floats16 shift = Floats16::fill(best[g]);
    for (int c = 0; c < kChunk / 16; ++c) probs[g][c] = exp16(Floats16::load(scores[g] + 16 * c) - shift);
    const Floats16 sum = (probs[g][0] + probs[g][1]) + (probs[g][2] + probs[g][3]);
    __m256 eight[8] = {sum.half_sum()};
    for (int j = 1; j < 8; ++j) eight[j] = _mm256_setzero_ps();
    total[g] = _mm256_cvtss_f32(reduce8(eight));
    for (int c = 0; c < kChunk / 16; ++c) probs[g][c].store(scores[g] + 16 * c);  // scores -> probabilities
  }
  // 3. Weighted sums of the value rows (a zero weight adds exactly nothing).
  Floats16 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = Floats16::zero();
  for (int64_t i = 0; i < n; ++i) {
    const K* vr = vb + int64_t(chunk_slots[i]) * head_dim;
    for (int c = 0; c < NV; ++c) {
      const Floats16 value = Floats16::load(vr + 16 * c);
      for (int g = 0; g < G; ++g) acc[g][c].fma(scores[g][i], value);
    }
  }
  for (int g = 0; g < G; ++g) {
    part[g][0] = best[g];
    part[g][1] = total[g];
    for (int c = 0; c < NV; ++c) acc[g][c].store(part[g] + 2 + 16 * c);
  }
}

// Float scratch that persists between the calls of one calling thread (no allocation or
// zeroing per layer); written and read by the worker threads of one call.
float* scratch(int64_t count) {
  static thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

template <int NV, typename K>
void chunked_attention(const float* q, const K* keys, const K* values, const Visibility& visible,
                       int64_t heads, int64_t kv_heads, int64_t max_slots, float* out) {
  constexpr int64_t head_dim = 16 * NV;
#ifdef __AVX512F__
  constexpr int kTile = NV == 4 ? 4 : 2;  // queries whose weighted sums stay in registers
#else
  constexpr int kTile = 1;
#endif
  const int64_t group = heads / kv_heads, rows = visible.rows(), runs = int64_t(visible.runs.size()) - 1;
  const float scale = float(1.0 / std::sqrt(double(head_dim)));
  const int64_t chunks = (visible.longest + kChunk - 1) / kChunk;
  // partials[(row, kvh, chunk), query of the group]: max, sum, then head_dim weighted sums;
  // max = -inf: empty
  constexpr int64_t stride = head_dim + 2;
  float* partials = scratch(rows * kv_heads * chunks * group * stride);
  const int64_t items = runs * kv_heads * chunks;
  int64_t longest_run = 0;
  for (int64_t r = 0; r < runs; ++r) longest_run = std::max(longest_run, visible.runs[r + 1] - visible.runs[r]);
  const int64_t work = longest_run * group * visible.longest * head_dim;
  eyas::parallel_for(0, items, work >= (1 << 14) ? 1 : items, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t run = item / (kv_heads * chunks), kvh = (item / chunks) % kv_heads, chunk = item % chunks;
      const int64_t b = visible.sequences[visible.runs[run]];
      const K* kb = keys + (b * kv_heads + kvh) * max_slots * head_dim;
      const K* vb = values + (b * kv_heads + kvh) * max_slots * head_dim;
      for (int64_t row = visible.runs[run]; row < visible.runs[run + 1]; ++row) {
        const int64_t first = visible.offsets[row] + chunk * kChunk;
        const int64_t n = std::min<int64_t>(kChunk, visible.offsets[row + 1] - first);  // keys in this chunk
        for (int64_t g0 = 0; g0 < group; g0 += kTile) {
          const int tile = int(std::min<int64_t>(kTile, group - g0));
          const float* qv[kTile];
          float* part[kTile];
          for (int g = 0; g < tile; ++g) {
            qv[g] = q + (row * heads + kvh * group + g0 + g) * head_dim;
            part[g] = partials + (((row * kv_heads + kvh) * chunks + chunk) * group + g0 + g) * stride;
          }
          if (n <= 0) {  // fewer visible keys than this chunk starts at
            for (int g = 0; g < tile; ++g) part[g][0] = -INFINITY;
            continue;
          }
          const int32_t* chunk_slots = visible.slots.data() + first;
          switch (tile) {  // the same arithmetic per query for any tile
            case 1: chunk_partials<NV, 1>(qv, kb, vb, chunk_slots, n, scale, part); break;
#ifdef __AVX512F__
            case 2: chunk_partials<NV, 2>(qv, kb, vb, chunk_slots, n, scale, part); break;
            case 3: chunk_partials<NV, 3>(qv, kb, vb, chunk_slots, n, scale, part); break;
            case 4: chunk_partials<NV, 4>(qv, kb, vb, chunk_slots, n, scale, part); break;
#endif
          }
        }
      }
    }
  });
  // Combine each query's chunks in order: the softmax over all its visible keys.
  eyas::parallel_for(0, rows * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t row = index / heads, h = index % heads, kvh = h / group;
      const float* base = partials + ((row * kv_heads + kvh) * chunks * group + h % group) * stride;
      float best = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) best = std::max(best, base[c * group * stride]);
      float total = 0.0f;
      Floats16 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = Floats16::zero();
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = base + c * group * stride;
        if (part[0] == -INFINITY) continue;
        const float weight = float(std::exp(double(part[0]) - double(best)));
        total += weight * part[1];
        for (int v = 0; v < NV; ++v) acc[v].fma(weight, Floats16::load(part + 2 + 16 * v));
      }
      const float inverse = 1.0f / total;
      float* o = out + (row * heads + h) * head_dim;
      for (int v = 0; v < NV; ++v) acc[v].store_scaled(o + 16 * v, inverse);
    }
  });
}
#endif

}  // namespace

Visibility::Visibility(const bool* mask_in, int64_t kv_len_in, std::vector<int64_t> sequences_in)
    : sequences(std::move(sequences_in)), mask(mask_in), kv_len(kv_len_in) {
  const int64_t rows = int64_t(sequences.size());
  for (int64_t r = 0; r < rows; ++r)
    if (r == 0 || sequences[r] != sequences[r - 1]) runs.push_back(r);
  runs.push_back(rows);
  offsets.reserve(rows + 1);
  offsets.push_back(0);
  slots.reserve(rows * kv_len);
  for (int64_t r = 0; r < rows; ++r) {
    const bool* row = mask ? mask + r * kv_len : nullptr;
    for (int64_t s = 0; s < kv_len; ++s)
      if (!row || row[s]) slots.push_back(int32_t(s));
    offsets.push_back(int64_t(slots.size()));
    longest = std::max(longest, offsets[r + 1] - offsets[r]);
  }
}

void attention(const float* q, const float* keys, const float* values, const Visibility& visible, int64_t heads,
               int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out) {
#ifdef EYAS_CHUNKED_ATTENTION
  if (head_dim == 64 || head_dim == 128) {
    (head_dim == 64 ? chunked_attention<4, float> : chunked_attention<8, float>)(
        q, keys, values, visible, heads, kv_heads, max_slots, out);
    return;
  }
#endif
  generic_attention<float>(q, keys, values, visible, heads, kv_heads, head_dim, max_slots, out);
}

void attention(const float* q, const at::Half* keys, const at::Half* values, const Visibility& visible,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out) {
#ifdef EYAS_CHUNKED_ATTENTION
  if (head_dim == 64 || head_dim == 128) {
    (head_dim == 64 ? chunked_attention<4, at::Half> : chunked_attention<8, at::Half>)(
        q, keys, values, visible, heads, kv_heads, max_slots, out);
    return;
  }
#endif
  (void)q, (void)keys, (void)values, (void)visible, (void)heads, (void)kv_heads, (void)max_slots, (void)out;
  throw std::invalid_argument("a float16 KV cache needs head_dim 64 or 128 and a CPU with AVX2, FMA and F16C");
}

void attention(const double* q, const double* keys, const double* values, const Visibility& visible,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out) {
  generic_attention<double>(q, keys, values, visible, heads, kv_heads, head_dim, max_slots, out);
}

}  // namespace eyas
