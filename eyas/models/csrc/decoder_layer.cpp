// One decoder layer of an int4 Llama-family model on the CPU: RMSNorm, the q/k/v projection,
// RoPE and the KV cache writes, attention (attention.cpp), the output projection, RMSNorm, the
// gated MLP, the residuals. The callers (int4_stack.cpp) run a pass's layers one after another
// without returning to Python.
//
// Why: a decode step of SmolLM2-135M spends ~4.5 ms in its int4 matmuls and more than that in
// the ~25 small ops per layer around them (norms, RoPE, dtype conversions, cache writes) and in
// the Python that issues them. This file does that work in plain loops between the matmuls. The
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

#include "decoder_layer.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"
#include "int4_gemm.h"
#include "phase_timer.h"
#include "simd.h"

namespace eyas {

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

// x [rows, I] float32 -> y [rows, O] float32 (into `y`, grown to fit) through either layout of
// Linear (decoder_layer.h): eyas's int8dot kernel on float32 activations, or PyTorch's packed int4
// on activations rounded to bf16, its output widened back. Returns O. `hooks` (int4_gemm.h) write
// x's rows first and finish y's columns: inside the kernel's own regions, or around PyTorch's.
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

// A matrix in the int8dot kernel's layout (uint8, 3-D) is read through its raw pointers.
Linear linear_weights(const Tensor& packed, const Tensor& scales) {
  const bool fast = packed.scalar_type() == at::kByte && packed.dim() == 3;
  return {packed, scales, fast ? eyas::packed_int4(packed) : eyas::PackedInt4{}};
}

}  // namespace

LayerWeights::LayerWeights(const Tensor& norm_in_, const Tensor& qkv_packed, const Tensor& qkv_scales,
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

LayerWeights LayerWeights::from(const std::vector<Tensor>& w, int64_t group, double eps, int64_t heads,
                                int64_t kv_heads) {
  TORCH_CHECK(w.size() == 11, "a decoder layer takes 11 weight tensors (int4_decoder_layer's order)");
  c10::optional<Tensor> bias;
  if (w[3].defined() && w[3].numel() > 0) bias = w[3];
  return LayerWeights(w[0], w[1], w[2], bias, w[4], w[5], w[6], w[7], w[8], w[9], w[10], group, heads, kv_heads, eps);
}

Pass make_pass(const Tensor& cos, const Tensor& sin, const Tensor& slots, int64_t kv_len,
               const eyas::Visibility& visible) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == visible.rows(),
              "cos, sin: contiguous float32 [N, D], one row per row of x");
  return {cos.data_ptr<float>(), sin.data_ptr<float>(), slots.data_ptr<int64_t>(), cos.size(1), kv_len, visible};
}

CacheLayer CacheLayer::layer(int64_t index) const {
  TORCH_CHECK_INDEX(index >= 0 && index < layers, "cache layer ", index, " of ", layers);
  CacheLayer one = *this;
  one.keys = static_cast<char*>(keys) + index * key_layer_bytes;
  one.values = static_cast<char*>(values) + index * value_layer_bytes;
  one.layers = 1;
  return one;
}

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

void decoder_layer(const float* x, int64_t rows, int64_t hidden, const LayerWeights& w, const Pass& pass,
                   const CacheLayer& cache, float* out, const Tensor* embeds,
                   const Tensor* norm_embeds) {
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

}  // namespace eyas
