// One decoder layer of an int4 Llama-family model on the CPU, in a single call from Python.
//
// Why: a decode step of SmolLM2-135M spends ~4.5 ms in its int4 matmuls and more than that in
// the ~25 small ops per layer around them (norms, RoPE, dtype conversions, cache writes) and in
// the Python that issues them. This file does that work in plain loops between the matmuls.
// The matmuls run in the int4 x int8 VNNI kernel (int4_gemm.cpp) where the weights are in its
// layout, else in PyTorch's int4 kernel on activations rounded to bf16.
//
// Numerics (what keeps speculative decoding lossless): every row's values depend on that row's
// inputs and on the keys and values it may attend to, never on how many rows share the call
// or where they sit in it, so a token gets the same logits in a one-token decode step, in a
// verification pass and in any batch. Attention runs in the KV cache's dtype (float32 as the
// engine allocates it; float64 works too), as in the Python layers (models/llama.py), which
// need float64 for the same agreement.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "int4_gemm.h"
#include "int8_screen.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <vector>

using at::BFloat16;
using at::Tensor;

namespace {

// The int4 kernel works in blocks of 4 rows and has slow paths (models/quant.py row_chunks).
std::vector<int64_t> row_chunks(int64_t rows) {
  std::vector<int64_t> sizes(rows / 16, 16);
  int64_t rest = rows % 16;
  if (rest > 4 && (rest % 4 == 1 || rest % 4 == 2)) {
    sizes.push_back(rest - rest % 4);
    sizes.push_back(rest % 4);
  } else if (rest) {
    sizes.push_back(rest);
  }
  return sizes;
}

// a [N, I] bf16 -> [N, O] bf16 through PyTorch's packed int4 kernel.
Tensor int4_mm(const Tensor& a, const Tensor& packed, int64_t group, const Tensor& scales) {
  auto sizes = row_chunks(a.size(0));
  if (sizes.size() == 1) return at::_weight_int4pack_mm_for_cpu(a, packed, group, scales);
  std::vector<Tensor> parts;
  int64_t start = 0;
  for (int64_t size : sizes) {
    parts.push_back(at::_weight_int4pack_mm_for_cpu(a.narrow(0, start, size), packed, group, scales));
    start += size;
  }
  return at::cat(parts);
}

// x [N, I] float32 -> [N, O] float32 through one of the two int4 weight layouts: the VNNI
// kernel's (uint8 [O/16, I/32, 320], int4_gemm.cpp; `scales` unused) on float32 activations,
// or PyTorch's packed int4 on activations rounded to bf16, its output widened back.
Tensor linear(const Tensor& x, const Tensor& packed, int64_t group, const Tensor& scales) {
  if (packed.scalar_type() == at::kByte && packed.dim() == 3) return eyas::int4_vnni_linear(x, packed);
  return int4_mm(x.to(at::kBFloat16), packed, group, scales).to(at::kFloat);
}

// e^x for float x (relative error < 1e-7 over [-87, 88]) in a form the compiler can vectorize,
// where std::exp is a scalar library call: SiLU's and the softmax's exponentials.
// Cody-Waite range reduction x = k ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial.
#pragma omp declare simd
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (int32_t(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float exp_of(float x) { return exp_approx(x); }
inline double exp_of(double x) { return std::exp(x); }

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w for rows of width h.
void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t h, double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * h;
    double squares = 0;
    for (int64_t i = 0; i < h; ++i) squares += double(xr[i]) * xr[i];
    const float scale = float(1.0 / std::sqrt(squares / h + eps));
    for (int64_t i = 0; i < h; ++i) out[r * h + i] = xr[i] * scale * w[i];
  }
}

// Eight floats or four doubles: one AVX register (GCC vector extensions; -march=native picks
// the instructions).
template <typename T>
struct Simd {
  static constexpr int64_t width = 32 / sizeof(T);
  typedef T Vec __attribute__((vector_size(32)));
  static Vec load(const T* p) {
    Vec v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static T sum(Vec v) {
    T total = 0;
    for (int64_t i = 0; i < width; ++i) total += v[i];
    return total;
  }
};

// Scores of one query against a block of keys: q . k[i] for i < KeyBlock<T>::size (head_dim a
// multiple of the SIMD width). Every key goes through this one code path (the caller repeats
// the last key to fill a short block), so a (query, key) score has the same bits wherever the
// key falls: in a block of a one-token step or of a verification pass.
template <typename T>
struct KeyBlock {
  static constexpr int size = 4;
  static void scores(const T* q, const T* const k[size], int64_t head_dim, T out[size]) {
    using S = Simd<T>;
    typename S::Vec acc[size] = {};
    for (int64_t d = 0; d < head_dim; d += S::width) {
      const typename S::Vec qv = S::load(q + d);
      for (int i = 0; i < size; ++i) acc[i] += qv * S::load(k[i] + d);
    }
    for (int i = 0; i < size; ++i) out[i] = S::sum(acc[i]);
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// float on AVX2: eight keys, eight accumulators, one horizontal reduction for all eight.
template <>
struct KeyBlock<float> {
  static constexpr int size = 8;
  static void scores(const float* q, const float* const k[size], int64_t head_dim, float out[size]) {
    __m256 acc[size];
    for (int i = 0; i < size; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int i = 0; i < size; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + d), acc[i]);
    }
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                                        _mm256_permute2f128_ps(a, b, 0x31)));
  }
};
#endif

// Scaled dot-product attention in the cache's dtype: q [B, T, Hq, D], keys/values
// [B, KV, S, D] (the cache), mask [B, T, S] or none (all kv_len slots visible); out
// [B, T, Hq, D] rounded to float32 (the o_proj input).
// Each query's scores, softmax and weighted sum run over its visible slots in increasing order
// with the same instructions whatever T is: a row's output does not depend on the other rows
// of the pass, so a one-token step and a verification pass agree bit for bit.
template <typename T>
void attention(const T* q, const T* keys, const T* values, const bool* mask, int64_t batch,
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

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define EYAS_CHUNKED_ATTENTION 1
// Attention over a float32 cache in chunks of a query's visible keys, for head_dim = 16 * NV.
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

template <int NV>
void chunked_attention(const float* q, const float* keys, const float* values, const bool* mask,
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
      const float* kb = keys + (b * kv_heads + kvh) * max_slots * head_dim;
      const float* vb = values + (b * kv_heads + kvh) * max_slots * head_dim;
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
          const float* k[8];
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
        __m512 acc[NV];
        for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; ++i) {
          if (probs[i] == 0.0f) continue;
          total += probs[i];
          const __m512 p = _mm512_set1_ps(probs[i]);
          const float* vr = vb + int64_t(chunk_slots[i]) * head_dim;
          for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * c), acc[c]);
        }
        part[0] = best;
        part[1] = total;
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(part + 2 + 16 * c, acc[c]);
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
      __m512 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = base + c * queries * stride;
        if (part[0] == -INFINITY) continue;
        const float weight = float(std::exp(double(part[0]) - double(best)));
        total += weight * part[1];
        const __m512 w = _mm512_set1_ps(weight);
        for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(part + 2 + 16 * v), acc[v]);
      }
      const __m512 inverse = _mm512_set1_ps(1.0f / total);
      float* o = out + ((b * length + t) * heads + h) * head_dim;
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(acc[v], inverse));
    }
  });
}
#endif

}  // namespace

// x [N, H] float32 (N = B * T rows, row n = b * T + t) -> the layer's output [N, H] float32.
// Writes this layer's keys and values at `slots` [B, T] of cache_k / cache_v [B', KV, S, D]
// (B' >= B; float32 or float64). cos, sin [N, D] float32 (sin sign-folded: rotate_half(x) * sin == roll(x) * sin).
Tensor int4_decoder_layer(const Tensor& x, const Tensor& norm_in, const Tensor& qkv_packed,
                          const Tensor& qkv_scales, const c10::optional<Tensor>& qkv_bias,
                          const Tensor& o_packed, const Tensor& o_scales, const Tensor& norm_post,
                          const Tensor& gate_up_packed, const Tensor& gate_up_scales,
                          const Tensor& down_packed, const Tensor& down_scales, int64_t group,
                          double eps, const Tensor& cos, const Tensor& sin, const Tensor& cache_k,
                          const Tensor& cache_v, const Tensor& slots, int64_t kv_len,
                          const c10::optional<Tensor>& mask, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [N, H] float32");
  TORCH_CHECK(cache_k.scalar_type() == cache_v.scalar_type() &&
              (cache_k.scalar_type() == at::kDouble || cache_k.scalar_type() == at::kFloat),
              "the KV cache must be float32 or float64 (attention runs in its dtype)");
  TORCH_CHECK(cache_k.is_contiguous() && cache_v.is_contiguous(), "cache layers must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2, "slots: [B, T] int64");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t batch = slots.size(0), length = slots.size(1);
  TORCH_CHECK(batch * length == rows, "slots must hold one slot per row of x");
  const int64_t head_dim = cos.size(1), half = head_dim / 2, max_slots = cache_k.size(2);
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK_INDEX(kv_len > 0 && kv_len <= max_slots, "KV cache overflow: ", kv_len, " visible slots of ",
                    max_slots);
  TORCH_CHECK(head_dim % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(cache_k.dim() == 4 && cache_k.sizes() == cache_v.sizes() && cache_k.size(0) >= batch &&
              cache_k.size(1) == kv_heads && cache_k.size(3) == head_dim,
              "cache layers must be [B, KV, S, D] with this layer's kv heads and head dim");
  const bool* mask_ptr = nullptr;
  Tensor mask_c;
  if (mask.has_value()) {
    mask_c = mask->contiguous();
    TORCH_CHECK(mask_c.scalar_type() == at::kBool && mask_c.numel() == rows * kv_len, "mask: [B, T, kv_len] bool");
    mask_ptr = mask_c.data_ptr<bool>();
  }
  // 1. Attention input: RMSNorm -> q/k/v projection.
  Tensor normed = at::empty({rows, hidden}, x.options());
  rms_norm_rows(x.data_ptr<float>(), norm_in.data_ptr<float>(), rows, hidden, eps, normed.data_ptr<float>());
  Tensor qkv = linear(normed, qkv_packed, group, qkv_scales);  // [N, (Hq + 2 KV) * D]
  TORCH_CHECK(qkv.size(1) == qkv_width, "qkv projection width does not match the heads");

  // 2. RoPE on q and k (float32, as the Python path), then q in the cache's dtype, k and v
  // into the cache; 3. attention in that dtype, rounded to float32 for o_proj.
  Tensor attended = at::empty({rows, heads * head_dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES(cache_k.scalar_type(), "int4_decoder_layer", [&] {
    Tensor q = at::empty({rows, heads, head_dim}, x.options().dtype(cache_k.scalar_type()));
    const float* src = qkv.data_ptr<float>();
    const float* bias = qkv_bias.has_value() ? qkv_bias->data_ptr<float>() : nullptr;
    const float* cs = cos.data_ptr<float>();
    const float* sn = sin.data_ptr<float>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    scalar_t* qd = q.data_ptr<scalar_t>();
    scalar_t* kc = cache_k.data_ptr<scalar_t>();
    scalar_t* vc = cache_v.data_ptr<scalar_t>();
    std::vector<float> vals(head_dim);
    for (int64_t n = 0; n < rows; ++n) {
      const int64_t b = n / length;
      const int64_t s = slot[n];
      TORCH_CHECK_INDEX(s >= 0 && s < max_slots, "KV cache overflow: slot ", s, " of ", max_slots);
      const float* c = cs + n * head_dim;
      const float* sg = sn + n * head_dim;
      for (int64_t j = 0; j < heads + 2 * kv_heads; ++j) {
        const float* in = src + n * qkv_width + j * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          vals[d] = in[d];
          if (bias) vals[d] += bias[j * head_dim + d];
        }
        scalar_t* dst;
        if (j < heads) dst = qd + (n * heads + j) * head_dim;
        else if (j < heads + kv_heads) dst = kc + ((b * kv_heads + (j - heads)) * max_slots + s) * head_dim;
        else dst = vc + ((b * kv_heads + (j - heads - kv_heads)) * max_slots + s) * head_dim;
        if (j < heads + kv_heads) {
          for (int64_t d = 0; d < half; ++d) dst[d] = scalar_t(vals[d] * c[d] + vals[d + half] * sg[d]);
          for (int64_t d = half; d < head_dim; ++d) dst[d] = scalar_t(vals[d] * c[d] + vals[d - half] * sg[d]);
        } else {
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = scalar_t(vals[d]);
        }
      }
    }
#ifdef EYAS_CHUNKED_ATTENTION
    if (std::is_same_v<scalar_t, float> && (head_dim == 64 || head_dim == 128)) {  // a float32 cache
      (head_dim == 64 ? chunked_attention<4> : chunked_attention<8>)(
          reinterpret_cast<const float*>(qd), reinterpret_cast<const float*>(kc), reinterpret_cast<const float*>(vc),
          mask_ptr, batch, length, heads, kv_heads, max_slots, kv_len, attended.data_ptr<float>());
      return;
    }
#endif
    attention<scalar_t>(qd, kc, vc, mask_ptr, batch, length, heads, kv_heads, head_dim, max_slots,
                        kv_len, attended.data_ptr<float>());
  });
  Tensor projected = linear(attended, o_packed, group, o_scales);  // [N, H]
  Tensor out = at::empty({rows, hidden}, x.options());
  {
    const float* xi = x.data_ptr<float>();
    const float* p = projected.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < rows * hidden; ++i) o[i] = xi[i] + p[i];
  }

  // 5. MLP: RMSNorm -> gate/up -> silu(gate) * up -> down; 6. residual.
  rms_norm_rows(out.data_ptr<float>(), norm_post.data_ptr<float>(), rows, hidden, eps, normed.data_ptr<float>());
  Tensor gate_up = linear(normed, gate_up_packed, group, gate_up_scales);  // [N, 2I]
  const int64_t inner = gate_up.size(1) / 2;
  Tensor act = at::empty({rows, inner}, x.options());
  {
    const float* g = gate_up.data_ptr<float>();
    float* a = act.data_ptr<float>();
    for (int64_t n = 0; n < rows; ++n) {
      const float* gate = g + n * 2 * inner;
      const float* up = gate + inner;
      float* an = a + n * inner;
#pragma omp simd
      for (int64_t i = 0; i < inner; ++i) an[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
    }
  }
  Tensor down = linear(act, down_packed, group, down_scales);  // [N, H]
  {
    const float* p = down.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < rows * hidden; ++i) o[i] += p[i];
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_decoder_layer", &int4_decoder_layer, "One int4 decoder layer (see the file's header)");
  m.def("int4_vnni_supported", &eyas::int4_vnni_supported, "Whether the AVX512-VNNI int4 kernel was built");
  m.def("int4_vnni_pack", &eyas::int4_vnni_pack, "codes [O, I], scale, minimum [O, I/32] -> packed (int4_gemm.cpp)");
  m.def("int4_vnni_linear", &eyas::int4_vnni_linear, "x [N, I] float32 -> [N, O] float32 (int4_gemm.cpp)");
  m.def("int8_screen_pack", &eyas::int8_screen_pack, "codes [V, H] int8 -> packed (int8_screen.cpp)");
  m.def("int8_screen", &eyas::int8_screen, "x [R, H] -> (approx, bound) [R, V] (int8_screen.cpp)");
}
