// The decoder layers of an int4 Llama-family model on the CPU: one layer per call
// (int4_decoder_layer; Int4HeadLayer, an EAGLE-3 head's layer kept with its weights, one call a
// draft pass from token ids) or the whole stack in one call (Int4Stack, what the target runs;
// Int4Stack::decode, a single-stream step from token ids with its final norm).
//
// Why: a decode step of SmolLM2-135M spends ~4.5 ms in its int4 matmuls and more than that in
// the ~25 small ops per layer around them (norms, RoPE, dtype conversions, cache writes) and in
// the Python that issues them. This file does that work in plain loops between the matmuls,
// and Int4Stack runs every layer of a pass without returning to Python, copying out the
// residual stream an EAGLE-3 head reads (the taps) on the way: the visible slots of each row
// (attention.h's Visibility) are gathered once per pass, not once per layer. The
// floor it chases: the int4 weights read once per pass (memory bandwidth) for one token, their
// multiply-adds at the integer peak for many.
// Parallel work runs on worker_pool.h's threads, which never wait for one another to start; the
// small per-row phases run inside the matmuls' regions (the norms and SiLU where the matmul
// rounds its input, the residuals as its columns finish: int4_gemm.h GemmHooks), so a layer has
// 5-7 regions (2-4 at one row), not 15.
// The matmuls run in eyas's int4 x int8 kernel (int4_gemm.cpp, AVX512-VNNI or AVX2) where the
// weights are in its layout, else in PyTorch's int4 kernel on activations rounded to bf16.
//
// Numerics (what keeps speculative decoding lossless): every row's values depend on that row's
// inputs and on the keys and values it may attend to, never on how many rows share the call
// or where they sit in it, so a token gets the same logits in a one-token decode step, in a
// verification pass and in any batch. Attention runs in the KV cache's dtype (float32 as the
// engine allocates it; float64 works too), as in the Python layers (models/llama.py), which
// need float64 for the same agreement.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention.h"
#include "head_output.h"
#include "int4_gemm.h"
#include "int8_screen.h"
#include "int8dot.h"
#include "phase_timer.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

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

// Float buffers of a pass, reused by every layer and by the next pass of the calling thread:
// a layer allocates nothing (each allocation cost ~1 us, ~15 of them a layer).
struct Buffers {
  std::vector<float> both, normed, qkv, q, attended, projected, gate_up, act, down;
};

Buffers& buffers() {
  static thread_local Buffers kept;
  return kept;
}

// The first `count` floats of `buffer`, grown when needed (never shrunk, never cleared).
float* sized(std::vector<float>& buffer, int64_t count) {
  if (int64_t(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

// Rows of a per-row loop given to each thread at least: fewer rows run on the calling thread
// alone (a parallel region costs more than their work). Which thread runs a row changes none
// of its values.
constexpr int64_t kRowsPerThread = 8;
constexpr int64_t kMaxHeadDim = 512;  // rope_and_write's per-head scratch

// x [rows, I] float32 -> y [rows, O] float32 (into `y`, grown to fit) through one of the two int4
// weight layouts: eyas's int8dot kernel's (uint8 [O/16, I/32, 320], int4_gemm.cpp; `scales`
// unused) on float32 activations, or PyTorch's packed int4 on activations rounded to bf16, its
// output widened back. Returns O. `hooks` (int4_gemm.h) write x's rows first and finish y's
// columns: inside the kernel's own regions, or around PyTorch's.
struct Linear {
  Tensor packed, scales;
  eyas::PackedInt4 fast;  // set where `packed` is in the int8dot kernel's layout
};

int64_t linear(eyas::Phase phase, const float* x, int64_t rows, int64_t in, const Linear& weights, int64_t group,
               std::vector<float>& y, const eyas::GemmHooks& hooks = {}) {
  const eyas::PhaseScope timed(phase);
  if (weights.fast.data != nullptr) {
    const int64_t out = weights.fast.blocks * 16;  // 16 columns per block (int4_gemm.h)
    eyas::int4_gemm(x, rows, in, weights.fast, sized(y, rows * out), hooks);
    return out;
  }
  const Tensor& packed = weights.packed;
  const Tensor& scales = weights.scales;
  if (hooks.prepare) eyas::parallel_for(0, rows, kRowsPerThread, hooks.prepare);
  const Tensor input = at::from_blob(const_cast<float*>(x), {rows, in}, at::kFloat);
  const Tensor result = int4_mm(input.to(at::kBFloat16), packed, group, scales).to(at::kFloat).contiguous();
  std::memcpy(sized(y, result.numel()), result.data_ptr<float>(), result.numel() * sizeof(float));
  if (hooks.finish) hooks.finish(0, result.size(1));
  return result.size(1);
}

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w for rows begin..end-1 of width h; out's rows
// are out_stride apart (h, or 2h for one half of a concatenation). Run inside the region of
// the matmul that reads them (GemmHooks::prepare).
void rms_norm_rows(const float* x, const float* w, int64_t begin, int64_t end, int64_t h, double eps, float* out,
                   int64_t out_stride) {
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = x + r * h;
    double squares = 0;
    for (int64_t i = 0; i < h; ++i) squares += double(xr[i]) * xr[i];
    const float scale = float(1.0 / std::sqrt(squares / h + eps));
    for (int64_t i = 0; i < h; ++i) out[r * out_stride + i] = xr[i] * scale * w[i];
  }
}


// The q/k/v projection's rows and where they go (int4_decoder_layer's step 2).
struct QkvRows {
  const float* qkv;  // [N, (Hq + 2 KV) * D]
  const float* bias;  // [(Hq + 2 KV) * D] or null
  const float* cos;  // [N, D]
  const float* sin;  // [N, D], sign-folded
  const int64_t* slots;  // [N]
  const int64_t* sequences;  // [N]: the cache row of each row
  int64_t rows, heads, kv_heads, head_dim, max_slots;
};

// n float32 values stored as K (a float16 cache rounds to nearest even, as c10::Half does).
template <typename K>
inline void store_as(const float* src, K* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = K(src[d]);
}
#if defined(__AVX2__) && defined(__F16C__)
template <>
inline void store_as<c10::Half>(const float* src, c10::Half* dst, int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)  // vcvtps2ph, round to nearest even: c10::Half's _cvtss_sh, 8 at a time
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; d < n; ++d) dst[d] = c10::Half(src[d]);
}
#endif

// RoPE on q and k in float32, as the Python path; q [N, Hq, D] into `q` (type Q), k and v into
// the cache [B, KV, S, D] at each row's slot of its own cache row (type K; a float16 cache rounds to nearest).
// Each value is one multiply of each half and one add, rounded as written (-ffp-contract=off).
template <typename Q, typename K>
void rope_and_write(const QkvRows& in, Q* q, K* keys, K* values) {
  const int64_t heads = in.heads, kv_heads = in.kv_heads, head_dim = in.head_dim, half = head_dim / 2;
  const int64_t width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(head_dim <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  eyas::parallel_for(0, in.rows, kRowsPerThread, [&](int64_t begin, int64_t end) {
  alignas(64) float vals[kMaxHeadDim], rotated[kMaxHeadDim];
  for (int64_t n = begin; n < end; ++n) {
    const int64_t b = in.sequences[n];
    const int64_t s = in.slots[n];
    TORCH_CHECK_INDEX(s >= 0 && s < in.max_slots, "KV cache overflow: slot ", s, " of ", in.max_slots);
    const float* c = in.cos + n * head_dim;
    const float* sg = in.sin + n * head_dim;
    for (int64_t j = 0; j < heads + 2 * kv_heads; ++j) {
      const float* src = in.qkv + n * width + j * head_dim;
      if (in.bias) {
        const float* bias = in.bias + j * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) vals[d] = src[d] + bias[d];
      } else {
        for (int64_t d = 0; d < head_dim; ++d) vals[d] = src[d];
      }
      const float* result = vals;
      if (j < heads + kv_heads) {
        for (int64_t d = 0; d < half; ++d) rotated[d] = vals[d] * c[d] + vals[d + half] * sg[d];
        for (int64_t d = half; d < head_dim; ++d) rotated[d] = vals[d] * c[d] + vals[d - half] * sg[d];
        result = rotated;
      }
      if (j < heads) {
        store_as(result, q + (n * heads + j) * head_dim, head_dim);
      } else {
        const int64_t kvh = j < heads + kv_heads ? j - heads : j - heads - kv_heads;
        K* dst = (j < heads + kv_heads ? keys : values) + ((b * kv_heads + kvh) * in.max_slots + s) * head_dim;
        store_as(result, dst, head_dim);
      }
    }
  }
  });
}


// The tensors and sizes of one decoder layer, in int4_decoder_layer's argument order (the tensors
// kept alive here), and what a pass reads of them as raw pointers: once the weights have streamed
// through the caches, every access to a tensor's metadata (data_ptr, sizes, checks) is a cache
// miss, ~10 a layer.
struct LayerWeights {
  Tensor norm_in;
  Linear qkv;
  c10::optional<Tensor> qkv_bias;
  Linear o;
  Tensor norm_post;
  Linear gate_up, down;
  int64_t group, heads, kv_heads;
  double eps;
  const float* norm_in_data = nullptr;
  const float* norm_post_data = nullptr;
  const float* bias_data = nullptr;  // [(Hq + 2 KV) * D] or null

  LayerWeights(const Tensor& norm_in_, const Tensor& qkv_packed, const Tensor& qkv_scales,
               const c10::optional<Tensor>& qkv_bias_, const Tensor& o_packed, const Tensor& o_scales,
               const Tensor& norm_post_, const Tensor& gate_up_packed, const Tensor& gate_up_scales,
               const Tensor& down_packed, const Tensor& down_scales, int64_t group_, int64_t heads_,
               int64_t kv_heads_, double eps_)
      : norm_in(norm_in_), qkv(linear_weights(qkv_packed, qkv_scales)), qkv_bias(qkv_bias_),
        o(linear_weights(o_packed, o_scales)), norm_post(norm_post_),
        gate_up(linear_weights(gate_up_packed, gate_up_scales)), down(linear_weights(down_packed, down_scales)),
        group(group_), heads(heads_), kv_heads(kv_heads_), eps(eps_) {
    TORCH_CHECK(norm_in.scalar_type() == at::kFloat && norm_in.is_contiguous() &&
                norm_post.scalar_type() == at::kFloat && norm_post.is_contiguous(),
                "the layer's norm weights must be contiguous float32");
    norm_in_data = norm_in.data_ptr<float>();
    norm_post_data = norm_post.data_ptr<float>();
    if (qkv_bias.has_value()) {
      TORCH_CHECK(qkv_bias->scalar_type() == at::kFloat && qkv_bias->is_contiguous(),
                  "the qkv bias must be contiguous float32");
      bias_data = qkv_bias->data_ptr<float>();
    }
  }

  static Linear linear_weights(const Tensor& packed, const Tensor& scales) {
    const bool fast = packed.scalar_type() == at::kByte && packed.dim() == 3;
    return {packed, scales, fast ? eyas::packed_int4(packed) : eyas::PackedInt4{}};
  }
};

// What every layer of a pass shares: rows, rotary tables, cache slots, each row's sequence
// and visible slots.
struct Pass {
  const float* cos;  // [N, D] float32
  const float* sin;  // [N, D] float32, sign-folded
  const int64_t* slots;  // [N] (or [B, T]) int64: each row's slot in its own cache row
  int64_t head_dim;
  int64_t kv_len;
  const eyas::Visibility& visible;  // each row's cache row (sequence) and visible slots
};

// The pass's tables, checked (slots: check_pass).
Pass make_pass(const Tensor& cos, const Tensor& sin, const Tensor& slots, int64_t kv_len,
               const eyas::Visibility& visible) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == visible.rows(),
              "cos, sin: contiguous float32 [N, D], one row per row of x");
  return {cos.data_ptr<float>(), sin.data_ptr<float>(), slots.data_ptr<int64_t>(), cos.size(1), kv_len, visible};
}

// A layer of the KV cache, [B', KV, S, D] float64, float32 or float16, by raw pointers; from a
// stack's cache [L, B', KV, S, D], its first layer, `layer(i)` giving the others.
struct CacheLayer {
  at::ScalarType dtype;
  void* keys;
  void* values;
  int64_t rows, kv_heads, slots, head_dim;
  int64_t layers = 1, key_layer_bytes = 0, value_layer_bytes = 0;

  CacheLayer layer(int64_t index) const {
    TORCH_CHECK_INDEX(index >= 0 && index < layers, "cache layer ", index, " of ", layers);
    CacheLayer one = *this;
    one.keys = static_cast<char*>(keys) + index * key_layer_bytes;
    one.values = static_cast<char*>(values) + index * value_layer_bytes;
    one.layers = 1;
    return one;
  }
};

// Checks keys, values (4-D: one layer [B', KV, S, D]; 5-D: a stack's [L, B', KV, S, D]).
CacheLayer cache_layers(const Tensor& keys, const Tensor& values) {
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() &&
              (keys.scalar_type() == at::kDouble || keys.scalar_type() == at::kFloat ||
               keys.scalar_type() == at::kHalf),
              "the KV cache must be float32, float64 or float16 (attention runs in its dtype, float32 for float16)");
  TORCH_CHECK((keys.dim() == 4 || keys.dim() == 5) && keys.sizes() == values.sizes(),
              "cache layers must be [B, KV, S, D] (a stack's: [L, B, KV, S, D])");
  const int64_t d = keys.dim() - 4;
  for (const Tensor* t : {&keys, &values}) {  // each layer contiguous (a stack's layers at any stride)
    int64_t expected = 1;
    for (int64_t k = t->dim() - 1; k >= d; --k) {
      TORCH_CHECK(t->size(k) == 1 || t->stride(k) == expected, "cache layers must be contiguous");
      expected *= t->size(k);
    }
  }
  const int64_t bytes = int64_t(keys.element_size());
  return {keys.scalar_type(), keys.data_ptr(), values.data_ptr(), keys.size(d), keys.size(d + 1), keys.size(d + 2),
          keys.size(d + 3), d ? keys.size(0) : 1, d ? keys.stride(0) * bytes : 0, d ? values.stride(0) * bytes : 0};
}

void check_cache(const CacheLayer& cache, int64_t batch, int64_t kv_heads, int64_t head_dim, int64_t kv_len) {
  TORCH_CHECK(cache.rows >= batch && cache.kv_heads == kv_heads && cache.head_dim == head_dim,
              "cache layers must be [B, KV, S, D] with this layer's kv heads and head dim");
  TORCH_CHECK_INDEX(kv_len > 0 && kv_len <= cache.slots, "KV cache overflow: ", kv_len, " visible slots of ",
                    cache.slots);
}

// SiLU(gate) * up for rows begin..end-1 of gate_up [N, 2I] -> act [N, I] (inside the down
// matmul's region: GemmHooks::prepare).
void silu_mul_rows(const float* gate_up, int64_t begin, int64_t end, int64_t inner, float* act) {
  for (int64_t n = begin; n < end; ++n) {
    const float* gate = gate_up + n * 2 * inner;
    const float* up = gate + inner;
    float* an = act + n * inner;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    for (; i + 16 <= inner; i += 16) {  // exp16: the same operations as exp_approx, 16 lanes
      const eyas::Floats16 gv = eyas::Floats16::load(gate + i);
      const eyas::Floats16 e = eyas::exp16(eyas::Floats16::zero() - gv);
      (gv / (eyas::Floats16::fill(1.0f) + e) * eyas::Floats16::load(up + i)).store(an + i);
    }
#endif
    for (; i < inner; ++i) an[i] = gate[i] / (1.0f + eyas::exp_approx(-gate[i])) * up[i];
  }
}

// out = x + y (or out += y with x == out) over columns begin..end-1 of `rows` rows of width h
// (inside the region of the matmul that produced y: GemmHooks::finish).
void add_columns(const float* x, const float* y, int64_t rows, int64_t h, int64_t begin, int64_t end, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = r * h + begin; i < r * h + end; ++i) out[i] = x[i] + y[i];
}

// x [N, H] float32 (row n of sequence pass.visible.sequences[n]) -> the layer's output, written
// to `out` [N, H] (not x); writes this layer's keys and values at each row's slot of its
// sequence's row of cache_k / cache_v [B', KV, S, D]. With `embeds` (and `norm_embeds`) it is an EAGLE-3 head's layer (see
// int4_decoder_layer).
void decoder_layer(const float* x, int64_t rows, int64_t hidden, const LayerWeights& w, const Pass& pass,
                   const CacheLayer& cache, float* out, const Tensor* embeds = nullptr,
                   const Tensor* norm_embeds = nullptr) {
  const int64_t batch = pass.visible.rows() ? 1 + *std::max_element(pass.visible.sequences.begin(),
                                                                      pass.visible.sequences.end()) : 0;
  const int64_t heads = w.heads, kv_heads = w.kv_heads, head_dim = pass.head_dim;
  const int64_t max_slots = cache.slots;
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim;
  check_cache(cache, batch, kv_heads, head_dim, pass.kv_len);
  Buffers& buf = buffers();
  // 1. Attention input: RMSNorm (of the token embeddings too, for a head) -> q/k/v projection,
  // the norms in the region that rounds the projection's input (GemmHooks).
  float* normed = sized(buf.normed, rows * hidden);
  int64_t width;
  if (embeds != nullptr) {
    float* both = sized(buf.both, rows * 2 * hidden);  // [N, 2H] = cat(norm(e), norm(x))
    const float* e = embeds->data_ptr<float>();
    const float* e_weight = norm_embeds->data_ptr<float>();
    const float* x_weight = w.norm_in_data;
    const auto norms = [&](int64_t begin, int64_t end) {
      const eyas::PhaseScope timed(eyas::kNorms);
      rms_norm_rows(e, e_weight, begin, end, hidden, w.eps, both, 2 * hidden);
      rms_norm_rows(x, x_weight, begin, end, hidden, w.eps, both + hidden, 2 * hidden);
    };
    width = linear(eyas::kQkv, both, rows, 2 * hidden, w.qkv, w.group, buf.qkv, {norms, {}});
  } else {
    const float* weight = w.norm_in_data;
    const auto norm = [&](int64_t begin, int64_t end) {
      const eyas::PhaseScope timed(eyas::kNorms);
      rms_norm_rows(x, weight, begin, end, hidden, w.eps, normed, hidden);
    };
    width = linear(eyas::kQkv, normed, rows, hidden, w.qkv, w.group, buf.qkv, {norm, {}});
  }
  TORCH_CHECK(width == qkv_width, "qkv projection width does not match the heads");

  // 2. RoPE on q and k (float32, as the Python path), then q in the cache's dtype (float32 for
  // a float16 cache), k and v into the cache; 3. attention in that dtype (float32 for float16),
  // rounded to float32 for o_proj.
  float* attended = sized(buf.attended, rows * heads * head_dim);
  const QkvRows qkv_rows{buf.qkv.data(), w.bias_data, pass.cos, pass.sin, pass.slots, pass.visible.sequences.data(),
                         rows, heads, kv_heads, head_dim, max_slots};
  if (cache.dtype == at::kDouble) {
    Tensor q = at::empty({rows, heads, head_dim}, at::TensorOptions().dtype(at::kDouble));
    double* kc = static_cast<double*>(cache.keys);
    double* vc = static_cast<double*>(cache.values);
    {
      const eyas::PhaseScope timed(eyas::kRotary);
      rope_and_write(qkv_rows, q.data_ptr<double>(), kc, vc);
    }
    const eyas::PhaseScope timed(eyas::kAttention);
    eyas::attention(q.data_ptr<double>(), kc, vc, pass.visible, heads, kv_heads, head_dim, max_slots,
                    attended);  // attention.cpp
  } else {
    float* q = sized(buf.q, rows * heads * head_dim);  // [N, Hq, D]
    auto run = [&](auto* kc, auto* vc) {
      {
        const eyas::PhaseScope timed(eyas::kRotary);
        rope_and_write(qkv_rows, q, kc, vc);
      }
      const eyas::PhaseScope timed(eyas::kAttention);
      eyas::attention(q, kc, vc, pass.visible, heads, kv_heads, head_dim, max_slots, attended);  // attention.cpp
    };
    if (cache.dtype == at::kHalf) {
      run(static_cast<at::Half*>(cache.keys), static_cast<at::Half*>(cache.values));
    } else {
      run(static_cast<float*>(cache.keys), static_cast<float*>(cache.values));
    }
  }
  // 4. Output projection, the residual added in its region as each chunk of columns is done.
  const auto residual = [&](int64_t begin, int64_t end) {
    const eyas::PhaseScope timed(eyas::kResiduals);
    add_columns(x, buf.projected.data(), rows, hidden, begin, end, out);
  };
  linear(eyas::kO, attended, rows, heads * head_dim, w.o, w.group, buf.projected, {{}, residual});  // [N, H]

  // 5. MLP: RMSNorm -> gate/up -> silu(gate) * up -> down; 6. residual. The norm and SiLU run in
  // the regions that round the next matmul's input, the residual in the down matmul's.
  const float* post_weight = w.norm_post_data;
  const auto post_norm = [&](int64_t begin, int64_t end) {
    const eyas::PhaseScope timed(eyas::kNorms);
    rms_norm_rows(out, post_weight, begin, end, hidden, w.eps, normed, hidden);
  };
  const int64_t inner = linear(eyas::kGateUp, normed, rows, hidden, w.gate_up, w.group, buf.gate_up,
                               {post_norm, {}}) / 2;  // [N, 2I]
  float* act = sized(buf.act, rows * inner);
  const auto silu_mul = [&](int64_t begin, int64_t end) {
    const eyas::PhaseScope timed(eyas::kSiluMul);
    silu_mul_rows(buf.gate_up.data(), begin, end, inner, act);
  };
  const auto down_residual = [&](int64_t begin, int64_t end) {
    const eyas::PhaseScope timed(eyas::kResiduals);
    add_columns(out, buf.down.data(), rows, hidden, begin, end, out);
  };
  linear(eyas::kDown, act, rows, inner, w.down, w.group, buf.down, {silu_mul, down_residual});  // [N, H]
}

// The mask [N, kv_len] bool (or none: every slot visible), checked.
Tensor checked_mask(const c10::optional<Tensor>& mask, int64_t rows, int64_t kv_len) {
  if (!mask.has_value()) return Tensor();
  Tensor contiguous = mask->contiguous();
  TORCH_CHECK(contiguous.scalar_type() == at::kBool && contiguous.numel() == rows * kv_len,
              "mask: [N, kv_len] bool (a dense pass: [B, T, kv_len])");
  return contiguous;
}

// Checks the pass and returns each row's sequence (cache row): dense, slots [B, T] and no
// `sequences` (row n = b * T + t in sequence b); ragged, slots [N] and sequences [N] int64.
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

// Tap positions into a run of `count` layers and the tensor they fill: taps [N, len(tap_before), H]
// float32 like x, given exactly when tap_before is not empty.
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

// Copies hidden [N, H] (what enters layer `position` of the run) into taps[:, j] for every j
// with tap_before[j] == position.
void copy_taps(const float* hidden, int64_t rows, int64_t width, const std::vector<int64_t>& tap_before,
               int64_t position, float* taps) {
  const int64_t count = int64_t(tap_before.size());
  for (int64_t j = 0; j < count; ++j) {
    if (tap_before[j] != position) continue;
    for (int64_t n = 0; n < rows; ++n)
      std::memcpy(taps + (n * count + j) * width, hidden + n * width, width * sizeof(float));
  }
}

// Rows [T, width] float32 of `table` [rows, width] (contiguous float32) at `ids`, checked: the
// rows F.embedding and indexing give.
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

// Slots [1, T] int64: first_slot, first_slot + 1, ...
Tensor slot_range(int64_t first_slot, int64_t count) {
  TORCH_CHECK(first_slot >= 0, "first_slot >= 0");
  Tensor slots = at::empty({1, count}, at::kLong);
  int64_t* data = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t) data[t] = first_slot + t;
  return slots;
}

// The decoder layers of an int4 model, run in one call per pass (no Python between layers):
// the same code and the same bits as one int4_decoder_layer call per layer.
class Int4Stack {
 public:
  // weights: 11 tensors per layer in int4_decoder_layer's order (an empty qkv bias: none).
  Int4Stack(const std::vector<Tensor>& weights, int64_t group, double eps, int64_t heads, int64_t kv_heads) {
    TORCH_CHECK(weights.size() % 11 == 0, "Int4Stack takes 11 tensors per layer");
    for (size_t i = 0; i < weights.size(); i += 11) {
      const Tensor* t = weights.data() + i;
      c10::optional<Tensor> bias;
      if (t[3].defined() && t[3].numel() > 0) bias = t[3];
      layers_.emplace_back(t[0], t[1], t[2], bias, t[4], t[5], t[6], t[7], t[8], t[9], t[10], group, heads, kv_heads,
                           eps);
    }
  }

  int64_t size() const { return int64_t(layers_.size()); }

  // x [N, H] float32 through layers[i] for i in `layers` (in order), layer i reading and
  // writing keys[storage[i]] / values[storage[i]] of the cache [L', B', KV, S, D]; the rest as
  // int4_decoder_layer. A ragged pass gives `sequences` [N] (each row's cache row), slots [N]
  // and mask [N, kv_len]: rows of any number of sequences, each with its own count of rows.
  // Taps (EAGLE-3): for each position p = tap_before[j] (0 <= p <= len(layers), any order,
  // repeats allowed), the hidden entering layers[p] (p == len(layers): the output) is copied
  // to taps[:, j] of `taps` [N, len(tap_before), H] float32, written in place.
  Tensor run(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& keys, const Tensor& values,
             const std::vector<int64_t>& layers, const std::vector<int64_t>& storage, const Tensor& slots,
             int64_t kv_len, const c10::optional<Tensor>& mask,
             const c10::optional<Tensor>& sequences = c10::nullopt,
             const std::vector<int64_t>& tap_before = {}, const c10::optional<Tensor>& taps = c10::nullopt) const {
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

  // A single-stream step (Transformer.decode_rows): tokens [T] at positions [T], written at slots
  // first_slot .. first_slot + T - 1 of cache row 0, seeing slots [0, first_slot + T) through
  // mask [1, T, first_slot + T] (or none: T = 1), through every layer, then the final RMSNorm
  // (torch_rms_norm: F.rms_norm's bits). run()'s inputs are gathered here, the rows that
  // F.embedding and indexing give: x from embed [V, H], cos and sin from the rotary tables
  // [P, D], so that a step makes no small PyTorch ops, each of which runs cold (~20-50 us on
  // AMD Zen 4) after a pass has streamed ~100 MB of weights. -> [hidden [1, T, H]] or, with
  // taps, [hidden, taps [1, T, len(tap_before) * H]].
  std::vector<Tensor> decode(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
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

 private:
  std::vector<LayerWeights> layers_;
};

// Per-phase timing of the stack (phase_timer.h): on or off, on which clock ("wall" or "cpu":
// this thread's CPU time), and the seconds charged so far.
void set_phase_timing(bool enabled, const std::string& clock_name) {
  eyas::PhaseClock& clock = eyas::phase_clock();
  TORCH_CHECK(clock.depth == 0, "phase timing cannot change during a pass");
  TORCH_CHECK(clock_name == "wall" || clock_name == "cpu", "phase timing clock: 'wall' or 'cpu', not '",
              clock_name, "'");
  clock.enabled = enabled;
  eyas::phase_cpu_clock = clock_name == "cpu";
}

std::map<std::string, double> phase_seconds(bool reset) {
  eyas::PhaseClock& clock = eyas::phase_clock();
  std::map<std::string, double> seconds;
  for (int phase = 0; phase < eyas::kPhaseCount; ++phase) seconds[eyas::kPhaseNames[phase]] = clock.ns[phase] * 1e-9;
  if (reset) clock.ns.fill(0);
  return seconds;
}

}  // namespace

// x [N, H] float32 (N = B * T rows, row n = b * T + t) -> the layer's output [N, H] float32.
// Writes this layer's keys and values at `slots` [B, T] of cache_k / cache_v [B', KV, S, D]
// (B' >= B; float32, float64, or float16 with attention in float32). cos, sin [N, D] float32 (sin sign-folded: rotate_half(x) * sin == roll(x) * sin).
// With `embeds` [N, H] and `norm_embeds` [H] it is an EAGLE-3 head's layer (eagle3/fused.py):
// the attention reads cat(RMSNorm(embeds), RMSNorm(x)) [N, 2H] and the residual stays x.
Tensor int4_decoder_layer(const Tensor& x, const Tensor& norm_in, const Tensor& qkv_packed,
                          const Tensor& qkv_scales, const c10::optional<Tensor>& qkv_bias,
                          const Tensor& o_packed, const Tensor& o_scales, const Tensor& norm_post,
                          const Tensor& gate_up_packed, const Tensor& gate_up_scales,
                          const Tensor& down_packed, const Tensor& down_scales, int64_t group,
                          double eps, const Tensor& cos, const Tensor& sin, const Tensor& cache_k,
                          const Tensor& cache_v, const Tensor& slots, int64_t kv_len,
                          const c10::optional<Tensor>& mask, int64_t heads, int64_t kv_heads,
                          const c10::optional<Tensor>& embeds, const c10::optional<Tensor>& norm_embeds) {
  const eyas::PhaseScope timed(eyas::kStackOther);
  std::vector<int64_t> row_sequences = check_pass(x, slots, cos, c10::nullopt);
  const Tensor mask_c = checked_mask(mask, x.size(0), std::max<int64_t>(kv_len, 1));
  const eyas::Visibility visible(mask_c.defined() ? mask_c.data_ptr<bool>() : nullptr, kv_len,
                                 std::move(row_sequences));
  const LayerWeights weights{norm_in, qkv_packed, qkv_scales, qkv_bias, o_packed, o_scales, norm_post,
                             gate_up_packed, gate_up_scales, down_packed, down_scales, group, heads, kv_heads, eps};
  const Pass pass = make_pass(cos, sin, slots, kv_len, visible);
  if (embeds.has_value()) {
    TORCH_CHECK(norm_embeds.has_value() && embeds->scalar_type() == at::kFloat && embeds->is_contiguous() &&
                embeds->sizes() == x.sizes(), "embeds: [N, H] float32 like x, with norm_embeds [H]");
  }
  Tensor out = at::empty_like(x);
  TORCH_CHECK(cache_k.dim() == 4, "cache_k, cache_v: one layer [B, KV, S, D]");
  decoder_layer(x.data_ptr<float>(), x.size(0), x.size(1), weights, pass, cache_layers(cache_k, cache_v),
                out.data_ptr<float>(),
                embeds.has_value() ? &*embeds : nullptr, embeds.has_value() ? &*norm_embeds : nullptr);
  return out;
}

// An EAGLE-3 head's decoder layer (eagle3/fused.py FusedHead), kept with its weights: one call a
// draft pass from token ids and positions given as Python ints, its inputs gathered here (the
// fc projection of the target's taps, the token embeddings, the rotary rows, the slots, the
// causal mask) as int4_decoder_layer's caller gathered them in PyTorch, so the same bits, and a
// drafting step makes no small PyTorch ops, each of which runs cold after the target's pass.
class Int4HeadLayer {
 public:
  // weights: int4_decoder_layer's 11; norm_embeds [H]; fc: the fc projection's packed int8dot
  // weights (int4_pack's layout) or an empty tensor (then only H-wide inputs are taken).
  Int4HeadLayer(const std::vector<Tensor>& w, int64_t group, double eps, int64_t heads, int64_t kv_heads,
                const Tensor& norm_embeds, const Tensor& fc)
      : weights_(w.at(0), w.at(1), w.at(2), w.at(3).numel() ? c10::optional<Tensor>(w.at(3)) : c10::nullopt,
                 w.at(4), w.at(5), w.at(6), w.at(7), w.at(8), w.at(9), w.at(10), group, heads, kv_heads, eps),
        norm_embeds_(norm_embeds), fc_tensor_(fc) {
    TORCH_CHECK(w.size() == 11, "Int4HeadLayer takes int4_decoder_layer's 11 weight tensors");
    TORCH_CHECK(norm_embeds.scalar_type() == at::kFloat && norm_embeds.is_contiguous(),
                "norm_embeds: contiguous float32 [H]");
    if (fc.numel()) fc_ = eyas::packed_int4(fc);
  }

  // x [..., W] (W: fc's input width, the target's taps, or H, the head's own outputs; T rows),
  // tokens and positions [T]; writes the rows' keys and values at slots first_slot.. of
  // keys/values [1, KV, S, D]; mask [T, first_slot + T] bool or none (causal: row t sees slots
  // up to first_slot + t). embed [V, H], cos_table/sin_table [P, D] float32. -> [1, T, H].
  Tensor step(const Tensor& x_in, const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
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

 private:
  LayerWeights weights_;
  Tensor norm_embeds_, fc_tensor_;
  eyas::PackedInt4 fc_;
};

// The layers' attention alone (attention.cpp), for tests and measurements: q [N, Hq, D] float32
// over keys, values [B, KV, S, D] (float32 or float16), row n reading cache row sequences[n]
// and the slots mask[n] [N, kv_len] marks -> [N, Hq, D] float32.
Tensor attention_only(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& mask,
                      const Tensor& sequences) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q: [N, Hq, D] float32");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf),
              "keys, values: [B, KV, S, D] float32 or float16, alike");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2), kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(3) == head_dim && heads % kv_heads == 0, "q and the cache disagree on heads or head_dim");
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == rows && mask.scalar_type() == at::kBool && mask.size(1) <= keys.size(2),
              "mask: [N, kv_len] bool, kv_len <= S");
  TORCH_CHECK(sequences.dim() == 1 && sequences.numel() == rows && sequences.scalar_type() == at::kLong,
              "sequences: [N] int64");
  const Tensor q_c = q.contiguous(), k_c = keys.contiguous(), v_c = values.contiguous(), mask_c = mask.contiguous();
  const Tensor sequences_c = sequences.contiguous();
  std::vector<int64_t> row_sequences(sequences_c.data_ptr<int64_t>(), sequences_c.data_ptr<int64_t>() + rows);
  for (int64_t b : row_sequences) TORCH_CHECK(b >= 0 && b < keys.size(0), "sequences: cache rows 0 .. B - 1");
  const eyas::Visibility visible(mask_c.data_ptr<bool>(), mask.size(1), std::move(row_sequences));
  Tensor out = at::empty({rows, heads, head_dim}, q.options());
  if (keys.scalar_type() == at::kHalf) {
    eyas::attention(q_c.data_ptr<float>(), k_c.data_ptr<at::Half>(), v_c.data_ptr<at::Half>(), visible, heads,
                    kv_heads, head_dim, keys.size(2), out.data_ptr<float>());
  } else {
    eyas::attention(q_c.data_ptr<float>(), k_c.data_ptr<float>(), v_c.data_ptr<float>(), visible, heads, kv_heads,
                    head_dim, keys.size(2), out.data_ptr<float>());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_decoder_layer", &int4_decoder_layer, "One int4 decoder layer (see the file's header)");
  m.def("attention", &attention_only, "The layers' attention alone (see attention_only)", pybind11::arg("q"),
        pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("mask"), pybind11::arg("sequences"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<Int4Stack>(m, "Int4Stack", "The decoder layers of an int4 model, one call per pass")
      .def(pybind11::init<const std::vector<Tensor>&, int64_t, double, int64_t, int64_t>())
      .def("__len__", &Int4Stack::size)
      .def("run", &Int4Stack::run, "x [N, H] through the given layers (see Int4Stack::run)",
           pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("keys"),
           pybind11::arg("values"), pybind11::arg("layers"), pybind11::arg("storage"), pybind11::arg("slots"),
           pybind11::arg("kv_len"), pybind11::arg("mask"), pybind11::arg("sequences") = pybind11::none(),
           pybind11::arg("tap_before") = std::vector<int64_t>{}, pybind11::arg("taps") = pybind11::none(),
           // without the GIL: the server's event loop (HTTP, streaming) runs while a pass computes;
           // its buffers are per calling thread and the worker pool lets two callers take turns
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("decode", &Int4Stack::decode, "A single-stream step from token ids (see Int4Stack::decode)",
           pybind11::arg("tokens"), pybind11::arg("positions"), pybind11::arg("first_slot"), pybind11::arg("embed"),
           pybind11::arg("cos_table"), pybind11::arg("sin_table"), pybind11::arg("keys"), pybind11::arg("values"),
           pybind11::arg("storage"), pybind11::arg("mask"), pybind11::arg("tap_before"), pybind11::arg("norm"),
           pybind11::arg("eps"), pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<Int4HeadLayer>(m, "Int4HeadLayer", "An EAGLE-3 head's decoder layer, one call a draft pass")
      .def(pybind11::init<const std::vector<Tensor>&, int64_t, double, int64_t, int64_t, const Tensor&,
                          const Tensor&>())
      .def("step", &Int4HeadLayer::step, "A draft pass from token ids (see Int4HeadLayer::step)",
           pybind11::arg("x"), pybind11::arg("tokens"), pybind11::arg("positions"), pybind11::arg("first_slot"),
           pybind11::arg("embed"), pybind11::arg("cos_table"), pybind11::arg("sin_table"), pybind11::arg("keys"),
           pybind11::arg("values"), pybind11::arg("mask"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("set_phase_timing", &set_phase_timing, pybind11::arg("enabled"), pybind11::arg("clock") = "wall",
        "Per-phase timers of the stack on or off, on the 'wall' or 'cpu' clock (phase_timer.h)");
  m.def("phase_seconds", &phase_seconds, pybind11::arg("reset") = false,
        "Seconds charged to each phase since the last reset (phase_timer.h)");
  m.def("int8dot_kernels", &eyas::int8dot_kernels, "The int8 dot-product implementations built, best first (int8dot.h)");
  m.def("int8dot_kernel", &eyas::int8dot_kernel_name, "The one in use ('none' where none is built)");
  m.def("set_int8dot_kernel", &eyas::set_int8dot_kernel, "Selects a built implementation by name");
  m.def("int4_activation_bits", &eyas::int4_activation_bits, "The int4 kernel's activation bits: 14 or 8");
  m.def("set_int4_activation_bits", &eyas::set_int4_activation_bits, "Sets them (int4_gemm.cpp)");
  m.def("int4_amx_available", &eyas::int4_amx_available, "Whether the int4 kernel can use AMX tiles here");
  m.def("int4_amx", &eyas::int4_amx, "Whether the int4 kernel multiplies tiles of 16 rows with AMX");
  m.def("set_int4_amx", &eyas::set_int4_amx, "Turns AMX on or off for the int4 kernel (int4_gemm.cpp)");
  m.def("int4_prefetch", &eyas::int4_prefetch, "How the int4 and int8 weight kernels prefetch: 'stream' or 'blocks'");
  m.def("set_int4_prefetch", &eyas::set_int4_prefetch, "Sets it (int4_gemm.cpp)");
  m.def("pool_split", &eyas::pool_split_name, "How the worker pool hands out a region: 'segments' or 'chunks'");
  m.def("set_pool_split", &eyas::set_pool_split, "Sets it (worker_pool.h)");
  m.def("pool_worker_wakeups", [] { return eyas::WorkerPool::instance().wakeups(); },
        "How many times each pool worker has woken from its sleep (worker_pool.h)");
  m.def("int4_pack", &eyas::int4_pack, "codes [O, I], scale, minimum [O, I/32] -> packed (int4_gemm.cpp)");
  m.def("int4_linear", &eyas::int4_linear, "x [N, I] float32 -> [N, O] float32 (int4_gemm.cpp)");
  m.def("torch_rms_norm", &eyas::torch_rms_norm, "F.rms_norm of x [T, H] float32, the same bits (head_output.cpp)");
  m.def("rms_norm_int4_linear", &eyas::rms_norm_int4_linear,
        "int4_linear(torch_rms_norm(x, weight, eps), packed): a head's norm and output layer (head_output.cpp)");
  m.def("log_softmax_top_k", &eyas::log_softmax_top_k,
        "torch.topk(torch.log_softmax(scores, -1), k) as lists (values, indices) (head_output.cpp)");
  m.def("screen_activation_bits", &eyas::screen_activation_bits, "The int8 screen's activation bits: 8 or 14");
  m.def("set_screen_activation_bits", &eyas::set_screen_activation_bits, "Sets them (int8_screen.cpp)");
  m.def("screen_streams", &eyas::screen_streams, "Whether the int8 screen streams its results past the caches");
  m.def("set_screen_streaming", &eyas::set_screen_streaming, "Sets it (off only for comparisons; same bits)");
  m.def("int8_screen_pack", &eyas::int8_screen_pack, "codes [V, H] int8 -> packed (int8_screen.cpp)");
  m.def("int8_screen", &eyas::int8_screen, "x [R, H] -> (approx, bound) [R, V] (int8_screen.cpp)");
  m.def("int8_screen_gumbel_ids", &eyas::int8_screen_gumbel_ids,
        "x [..., H], 1/T and noise key per row -> each row's Gumbel draw (gumbel_screen.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_screen_argmax", &eyas::int8_screen_argmax,
        "x [..., H] -> each row's argmax, as int8_screen_greedy's logits give it (int8_screen.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
