// One decoder layer of an int4 Llama-family model on the CPU, in a single call from Python.
//
// Why: a decode step of SmolLM2-135M spends ~4.5 ms in its int4 matmuls and more than that in
// the ~25 small ops per layer around them (norms, RoPE, dtype conversions, cache writes) and in
// the Python that issues them. This file does that work in plain loops between the matmuls.
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
#include "int4_gemm.h"
#include "int8_screen.h"
#include "int8dot.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// x [N, I] float32 -> [N, O] float32 through one of the two int4 weight layouts: eyas's int8dot
// kernel's (uint8 [O/16, I/32, 320], int4_gemm.cpp; `scales` unused) on float32 activations,
// or PyTorch's packed int4 on activations rounded to bf16, its output widened back.
Tensor linear(const Tensor& x, const Tensor& packed, int64_t group, const Tensor& scales) {
  if (packed.scalar_type() == at::kByte && packed.dim() == 3) return eyas::int4_linear(x, packed);
  return int4_mm(x.to(at::kBFloat16), packed, group, scales).to(at::kFloat);
}


// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w for rows of width h; out's rows are
// out_stride apart (h, or 2h for one half of a concatenation).
void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t h, double eps, float* out,
                   int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
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
  int64_t rows, length, heads, kv_heads, head_dim, max_slots;
};

// RoPE on q and k in float32, as the Python path; q [N, Hq, D] into `q` (type Q), k and v into
// the cache [B, KV, S, D] at each row's slot (type K; a float16 cache rounds to nearest).
template <typename Q, typename K>
void rope_and_write(const QkvRows& in, Q* q, K* keys, K* values) {
  const int64_t heads = in.heads, kv_heads = in.kv_heads, head_dim = in.head_dim, half = head_dim / 2;
  const int64_t width = (heads + 2 * kv_heads) * head_dim;
  std::vector<float> vals(head_dim), rotated(head_dim);
  for (int64_t n = 0; n < in.rows; ++n) {
    const int64_t b = n / in.length;
    const int64_t s = in.slots[n];
    TORCH_CHECK_INDEX(s >= 0 && s < in.max_slots, "KV cache overflow: slot ", s, " of ", in.max_slots);
    const float* c = in.cos + n * head_dim;
    const float* sg = in.sin + n * head_dim;
    for (int64_t j = 0; j < heads + 2 * kv_heads; ++j) {
      const float* src = in.qkv + n * width + j * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        vals[d] = src[d];
        if (in.bias) vals[d] += in.bias[j * head_dim + d];
      }
      if (j < heads + kv_heads) {
        for (int64_t d = 0; d < half; ++d) rotated[d] = vals[d] * c[d] + vals[d + half] * sg[d];
        for (int64_t d = half; d < head_dim; ++d) rotated[d] = vals[d] * c[d] + vals[d - half] * sg[d];
      } else {
        rotated = vals;
      }
      if (j < heads) {
        Q* dst = q + (n * heads + j) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = Q(rotated[d]);
      } else {
        const int64_t kvh = j < heads + kv_heads ? j - heads : j - heads - kv_heads;
        K* dst = (j < heads + kv_heads ? keys : values) + ((b * kv_heads + kvh) * in.max_slots + s) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = K(rotated[d]);
      }
    }
  }
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
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [N, H] float32");
  TORCH_CHECK(cache_k.scalar_type() == cache_v.scalar_type() &&
              (cache_k.scalar_type() == at::kDouble || cache_k.scalar_type() == at::kFloat ||
               cache_k.scalar_type() == at::kHalf),
              "the KV cache must be float32, float64 or float16 (attention runs in its dtype, float32 for float16)");
  TORCH_CHECK(cache_k.is_contiguous() && cache_v.is_contiguous(), "cache layers must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2, "slots: [B, T] int64");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t batch = slots.size(0), length = slots.size(1);
  TORCH_CHECK(batch * length == rows, "slots must hold one slot per row of x");
  const int64_t head_dim = cos.size(1), max_slots = cache_k.size(2);
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
  // 1. Attention input: RMSNorm (of the token embeddings too, for a head) -> q/k/v projection.
  Tensor normed = at::empty({rows, hidden}, x.options());
  Tensor qkv;
  if (embeds.has_value()) {
    TORCH_CHECK(norm_embeds.has_value() && embeds->scalar_type() == at::kFloat && embeds->is_contiguous() &&
                embeds->sizes() == x.sizes(), "embeds: [N, H] float32 like x, with norm_embeds [H]");
    Tensor both = at::empty({rows, 2 * hidden}, x.options());  // [N, 2H] = cat(norm(e), norm(x))
    rms_norm_rows(embeds->data_ptr<float>(), norm_embeds->data_ptr<float>(), rows, hidden, eps,
                  both.data_ptr<float>(), 2 * hidden);
    rms_norm_rows(x.data_ptr<float>(), norm_in.data_ptr<float>(), rows, hidden, eps, both.data_ptr<float>() + hidden,
                  2 * hidden);
    qkv = linear(both, qkv_packed, group, qkv_scales);
  } else {
    rms_norm_rows(x.data_ptr<float>(), norm_in.data_ptr<float>(), rows, hidden, eps, normed.data_ptr<float>(), hidden);
    qkv = linear(normed, qkv_packed, group, qkv_scales);  // [N, (Hq + 2 KV) * D]
  }
  TORCH_CHECK(qkv.size(1) == qkv_width, "qkv projection width does not match the heads");

  // 2. RoPE on q and k (float32, as the Python path), then q in the cache's dtype (float32 for
  // a float16 cache), k and v into the cache; 3. attention in that dtype (float32 for float16),
  // rounded to float32 for o_proj.
  Tensor attended = at::empty({rows, heads * head_dim}, x.options());
  const float* bias = qkv_bias.has_value() ? qkv_bias->data_ptr<float>() : nullptr;
  const QkvRows qkv_rows{qkv.data_ptr<float>(), bias, cos.data_ptr<float>(), sin.data_ptr<float>(),
                         slots.data_ptr<int64_t>(), rows, length, heads, kv_heads, head_dim, max_slots};
  if (cache_k.scalar_type() == at::kHalf) {
    Tensor q = at::empty({rows, heads, head_dim}, x.options());
    at::Half* kc = cache_k.data_ptr<at::Half>();
    at::Half* vc = cache_v.data_ptr<at::Half>();
    rope_and_write(qkv_rows, q.data_ptr<float>(), kc, vc);
    eyas::attention(q.data_ptr<float>(), kc, vc, mask_ptr, batch, length, heads, kv_heads, head_dim, max_slots,
                    kv_len, attended.data_ptr<float>());  // attention.cpp
  } else {
    AT_DISPATCH_FLOATING_TYPES(cache_k.scalar_type(), "int4_decoder_layer", [&] {
      Tensor q = at::empty({rows, heads, head_dim}, x.options().dtype(cache_k.scalar_type()));
      scalar_t* kc = cache_k.data_ptr<scalar_t>();
      scalar_t* vc = cache_v.data_ptr<scalar_t>();
      rope_and_write(qkv_rows, q.data_ptr<scalar_t>(), kc, vc);
      eyas::attention(q.data_ptr<scalar_t>(), kc, vc, mask_ptr, batch, length, heads, kv_heads, head_dim,
                      max_slots, kv_len, attended.data_ptr<float>());  // attention.cpp
    });
  }
  Tensor projected = linear(attended, o_packed, group, o_scales);  // [N, H]
  Tensor out = at::empty({rows, hidden}, x.options());
  {
    const float* xi = x.data_ptr<float>();
    const float* p = projected.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < rows * hidden; ++i) o[i] = xi[i] + p[i];
  }

  // 5. MLP: RMSNorm -> gate/up -> silu(gate) * up -> down; 6. residual.
  rms_norm_rows(out.data_ptr<float>(), norm_post.data_ptr<float>(), rows, hidden, eps, normed.data_ptr<float>(),
                hidden);
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
      for (int64_t i = 0; i < inner; ++i) an[i] = gate[i] / (1.0f + eyas::exp_approx(-gate[i])) * up[i];
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
  m.def("int8dot_kernels", &eyas::int8dot_kernels, "The int8 dot-product implementations built, best first (int8dot.h)");
  m.def("int8dot_kernel", &eyas::int8dot_kernel_name, "The one in use ('none' where none is built)");
  m.def("set_int8dot_kernel", &eyas::set_int8dot_kernel, "Selects a built implementation by name");
  m.def("int4_pack", &eyas::int4_pack, "codes [O, I], scale, minimum [O, I/32] -> packed (int4_gemm.cpp)");
  m.def("int4_linear", &eyas::int4_linear, "x [N, I] float32 -> [N, O] float32 (int4_gemm.cpp)");
  m.def("int8_screen_pack", &eyas::int8_screen_pack, "codes [V, H] int8 -> packed (int8_screen.cpp)");
  m.def("int8_screen", &eyas::int8_screen, "x [R, H] -> (approx, bound) [R, V] (int8_screen.cpp)");
}
