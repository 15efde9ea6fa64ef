// Attention of the fused int4 layer over its KV cache (float32 or float64), on the CPU.
//
// Two implementations with the same contract (attention.h): `chunked_attention` for a float32
// cache and head_dim 64 or 128 on AVX2 or AVX-512 (what the engine runs; the same bits on
// both), and `generic_attention` for the rest. Which one runs depends only on the cache's
// dtype, head_dim and the build, never on the pass, so every pass of a process computes a row
// the same way.

#include "attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "simd.h"

namespace eyas {
namespace {

// Scaled dot-product attention in the cache's dtype: q [B, T, Hq, D], keys/values
// [B, KV, S, D] (the cache), mask [B, T, S] or none (all kv_len slots visible); out
// [B, T, Hq, D] rounded to float32 (the o_proj input).
// Each query's scores, softmax and weighted sum run over its visible slots in increasing order
// with the same instructions whatever T is: a row's output does not depend on the other rows
// of the pass, so a one-token step and a verification pass agree bit for bit.
template <typename T>
void generic_attention(const T* q, const T* keys, const T* values, const bool* mask, int64_t batch,
                       int64_t length, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t max_slots, int64_t kv_len, float* out) {
  using S = Simd<T>;
  const int64_t group = heads / kv_heads, queries = length * group;
  const T scale = T(1.0 / std::sqrt(double(head_dim)));
  const int64_t work = queries * kv_len * head_dim;
  // Work items: (row of the batch, kv head, chunk of 32 queries), so that a long pass (a
  // prefill) spreads over the threads; how queries are grouped changes no value.
  const int64_t chunk = 32, chunks = (queries + chunk - 1) / chunk;
  const int64_t items = batch * kv_heads * chunks;
  at::parallel_for(0, items, work >= (1 << 15) ? 1 : items, [&](int64_t begin, int64_t end) {
    std::vector<T> probs(kv_len);
    std::vector<typename S::Vec> acc(head_dim / S::width);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (kv_heads * chunks), kvh = (item / chunks) % kv_heads;
      const int64_t first = (item % chunks) * chunk, last = std::min(queries, first + chunk);
      const T* kb = keys + (b * kv_heads + kvh) * max_slots * head_dim;
      const T* vb = values + (b * kv_heads + kvh) * max_slots * head_dim;
      for (int64_t m = first; m < last; ++m) {  // query m = head kvh * group + m % group of row m / group
        const int64_t t = m / group, h = kvh * group + m % group;
        const T* qv = q + ((b * length + t) * heads + h) * head_dim;
        const bool* visible = mask ? mask + (b * length + t) * kv_len : nullptr;
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
        float* o = out + ((b * length + t) * heads + h) * head_dim;
        for (int64_t c = 0; c < head_dim / S::width; ++c)
          for (int64_t i = 0; i < S::width; ++i) o[c * S::width + i] = float(acc[c][i] / total);
      }
    }
  });
}


#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EYAS_CHUNKED_ATTENTION 1

// 16 floats: one AVX-512 register, or two AVX2 ones with the same fused multiply-adds lane by
// lane, so that chunked_attention gives the same bits on either (int8dot.h does the same for
// the int4 kernel).
struct Floats16 {
#ifdef __AVX512F__
  __m512 v;
  static Floats16 zero() { return {_mm512_setzero_ps()}; }
  static Floats16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Floats16 load(const at::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  void fma(float weight, const Floats16& x) { v = _mm512_fmadd_ps(_mm512_set1_ps(weight), x.v, v); }
  void store_scaled(float* p, float factor) const { _mm512_storeu_ps(p, _mm512_mul_ps(v, _mm512_set1_ps(factor))); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
#else
  __m256 lo, hi;
  static Floats16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Floats16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Floats16 load(const at::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  void fma(float weight, const Floats16& x) {
    const __m256 w = _mm256_set1_ps(weight);
    lo = _mm256_fmadd_ps(w, x.lo, lo);
    hi = _mm256_fmadd_ps(w, x.hi, hi);
  }
  void store_scaled(float* p, float factor) const {
    const __m256 f = _mm256_set1_ps(factor);
    _mm256_storeu_ps(p, _mm256_mul_ps(lo, f));
    _mm256_storeu_ps(p + 8, _mm256_mul_ps(hi, f));
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
#endif
};

// Attention over a float32 (or float16) cache in chunks of a query's visible keys, for head_dim = 16 * NV.
//
// Why: a one-token step has only B * KV work items in `attention` (3 for SmolLM2: one thread
// does two of them), and its loops keep the weighted sum in memory. Here a work item is (row
// of the batch, kv head, chunk j) and covers every query of that kv head: chunk j of a query
// is its visible keys number 64j .. 64j + 63 in slot order, mostly the same slots for all the
// queries of a pass, read from L1 by all of them. Each query keeps a partial softmax (max,
// sum, weighted sum in registers) per chunk, and the partials are combined in chunk order.
//
// Numerics: a query's result depends only on the sequence of keys and values it may see, not
// on the slots they sit in (a tree node's slot differs from its slot in sequential decoding),
// the other rows of the pass, or kv_len: chunks count visible keys, every chunk runs over a
// full 64-entry array (padding -inf, then 0) with the same instructions, and the chunks are
// combined in order with a scalar exp.
constexpr int64_t kChunk = 64;

template <int NV, typename K>
void chunked_attention(const float* q, const K* keys, const K* values, const bool* mask,
                       int64_t batch, int64_t length, int64_t heads, int64_t kv_heads, int64_t max_slots,
                       int64_t kv_len, float* out) {
  constexpr int64_t head_dim = 16 * NV;
  const int64_t group = heads / kv_heads, queries = length * group;
  const float scale = float(1.0 / std::sqrt(double(head_dim)));
  // visible[(b, t)]: the slots row t of batch row b may see, in increasing order
  std::vector<std::vector<int32_t>> visible(batch * length);
  int64_t chunks = 0;
  for (int64_t bt = 0; bt < batch * length; ++bt) {
    auto& slots = visible[bt];
    slots.reserve(kv_len);
    const bool* row = mask ? mask + bt * kv_len : nullptr;
    for (int64_t s = 0; s < kv_len; ++s)
      if (!row || row[s]) slots.push_back(int32_t(s));
    chunks = std::max<int64_t>(chunks, (int64_t(slots.size()) + kChunk - 1) / kChunk);
  }
  // partials[(b, kvh, chunk), query]: max, sum, then head_dim weighted sums; max = -inf: empty
  constexpr int64_t stride = head_dim + 2;
  std::vector<float> partials(batch * kv_heads * chunks * queries * stride);
  const int64_t items = batch * kv_heads * chunks;
  at::parallel_for(0, items, queries * kv_len * head_dim >= (1 << 14) ? 1 : items, [&](int64_t begin, int64_t end) {
    alignas(64) float scores[kChunk];
    alignas(64) float probs[kChunk];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (kv_heads * chunks), kvh = (item / chunks) % kv_heads, chunk = item % chunks;
      const K* kb = keys + (b * kv_heads + kvh) * max_slots * head_dim;
      const K* vb = values + (b * kv_heads + kvh) * max_slots * head_dim;
      for (int64_t m = 0; m < queries; ++m) {
        const int64_t t = m / group, h = kvh * group + m % group;
        const auto& slots = visible[b * length + t];
        const int64_t first = chunk * kChunk;
        const int64_t n = std::min<int64_t>(kChunk, int64_t(slots.size()) - first);  // keys in this chunk
        float* part = partials.data() + (item * queries + m) * stride;
        part[0] = -INFINITY;
        if (n <= 0) continue;  // fewer visible keys than this chunk starts at
        const float* qv = q + ((b * length + t) * heads + h) * head_dim;
        const int32_t* chunk_slots = slots.data() + first;
        float best = -INFINITY;
        for (int64_t i = 0; i < kChunk; i += 8) {
          const int64_t count = std::min<int64_t>(8, n - i);
          if (count <= 0) {
            for (int j = 0; j < 8; ++j) scores[i + j] = -INFINITY;
            continue;
          }
          const K* k[8];
          for (int j = 0; j < 8; ++j) k[j] = kb + int64_t(chunk_slots[i + std::min<int64_t>(j, count - 1)]) * head_dim;
          float dots[8];
          KeyBlock<float>::scores(qv, k, head_dim, dots);
          for (int j = 0; j < 8; ++j) {
            scores[i + j] = j < count ? dots[j] * scale : -INFINITY;
            best = std::max(best, scores[i + j]);
          }
        }
#pragma omp simd
        for (int64_t i = 0; i < kChunk; ++i)
          probs[i] = scores[i] == -INFINITY ? 0.0f : exp_approx(scores[i] - best);
        float total = 0.0f;
        Floats16 acc[NV];
        for (int c = 0; c < NV; ++c) acc[c] = Floats16::zero();
        for (int64_t i = 0; i < n; ++i) {
          if (probs[i] == 0.0f) continue;
          total += probs[i];
          const K* vr = vb + int64_t(chunk_slots[i]) * head_dim;
          for (int c = 0; c < NV; ++c) acc[c].fma(probs[i], Floats16::load(vr + 16 * c));
        }
        part[0] = best;
        part[1] = total;
        for (int c = 0; c < NV; ++c) acc[c].store(part + 2 + 16 * c);
      }
    }
  });
  // Combine each query's chunks in order: the softmax over all its visible keys.
  at::parallel_for(0, batch * kv_heads * queries, 64, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (kv_heads * queries), kvh = (index / queries) % kv_heads, m = index % queries;
      const int64_t t = m / group, h = kvh * group + m % group;
      const float* base = partials.data() + ((b * kv_heads + kvh) * chunks * queries + m) * stride;
      float best = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) best = std::max(best, base[c * queries * stride]);
      float total = 0.0f;
      Floats16 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = Floats16::zero();
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = base + c * queries * stride;
        if (part[0] == -INFINITY) continue;
        const float weight = float(std::exp(double(part[0]) - double(best)));
        total += weight * part[1];
        for (int v = 0; v < NV; ++v) acc[v].fma(weight, Floats16::load(part + 2 + 16 * v));
      }
      const float inverse = 1.0f / total;
      float* o = out + ((b * length + t) * heads + h) * head_dim;
      for (int v = 0; v < NV; ++v) acc[v].store_scaled(o + 16 * v, inverse);
    }
  });
}
#endif

}  // namespace

void attention(const float* q, const float* keys, const float* values, const bool* mask, int64_t batch,
               int64_t length, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots,
               int64_t kv_len, float* out) {
#ifdef EYAS_CHUNKED_ATTENTION
  if (head_dim == 64 || head_dim == 128) {
    (head_dim == 64 ? chunked_attention<4, float> : chunked_attention<8, float>)(
        q, keys, values, mask, batch, length, heads, kv_heads, max_slots, kv_len, out);
    return;
  }
#endif
  generic_attention<float>(q, keys, values, mask, batch, length, heads, kv_heads, head_dim, max_slots, kv_len, out);
}

void attention(const float* q, const at::Half* keys, const at::Half* values, const bool* mask, int64_t batch,
               int64_t length, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots,
               int64_t kv_len, float* out) {
#ifdef EYAS_CHUNKED_ATTENTION
  if (head_dim == 64 || head_dim == 128) {
    (head_dim == 64 ? chunked_attention<4, at::Half> : chunked_attention<8, at::Half>)(
        q, keys, values, mask, batch, length, heads, kv_heads, max_slots, kv_len, out);
    return;
  }
#endif
  (void)q, (void)keys, (void)values, (void)mask, (void)batch, (void)length, (void)heads, (void)kv_heads,
      (void)max_slots, (void)kv_len, (void)out;
  throw std::invalid_argument("a float16 KV cache needs head_dim 64 or 128 and a CPU with AVX2, FMA and F16C");
}

void attention(const double* q, const double* keys, const double* values, const bool* mask, int64_t batch,
               int64_t length, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots,
               int64_t kv_len, float* out) {
  generic_attention<double>(q, keys, values, mask, batch, length, heads, kv_heads, head_dim, max_slots, kv_len, out);
}

}  // namespace eyas
