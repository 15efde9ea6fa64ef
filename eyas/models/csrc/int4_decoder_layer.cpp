// The extension's Python module (eyas_int4_decoder_layer): the bindings of every C++ entry point,
// and the calls that are no more than a check and a call: one int4 decoder layer a call
// (int4_decoder_layer; models/fused_cpu.py's layer-by-layer path and the tests), the layers'
// attention alone, the stack's phase timers; and suffix decoding's trie (suffix_trie.h). The layer itself: decoder_layer.cpp; a whole stack
// or an EAGLE-3 head's layer in one call: int4_stack.cpp. Only this file includes
// <torch/extension.h> (models/extension.py says why).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attention.h"
#include "decoder_layer.h"
#include "head_output.h"
#include "int4_gemm.h"
#include "int4_stack.h"
#include "int8_screen.h"
#include "int8dot.h"
#include "phase_timer.h"
#include "suffix_trie.h"

using at::Tensor;

namespace {

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
  std::vector<int64_t> row_sequences = eyas::check_pass(x, slots, cos, c10::nullopt);
  const Tensor mask_c = eyas::checked_mask(mask, x.size(0), std::max<int64_t>(kv_len, 1));
  const eyas::Visibility visible(mask_c.defined() ? mask_c.data_ptr<bool>() : nullptr, kv_len,
                                 std::move(row_sequences));
  const eyas::LayerWeights weights{norm_in, qkv_packed, qkv_scales, qkv_bias, o_packed, o_scales, norm_post,
                             gate_up_packed, gate_up_scales, down_packed, down_scales, group, heads, kv_heads, eps};
  const eyas::Pass pass = eyas::make_pass(cos, sin, slots, kv_len, visible);
  if (embeds.has_value()) {
    TORCH_CHECK(norm_embeds.has_value() && embeds->scalar_type() == at::kFloat && embeds->is_contiguous() &&
                embeds->sizes() == x.sizes(), "embeds: [N, H] float32 like x, with norm_embeds [H]");
  }
  Tensor out = at::empty_like(x);
  TORCH_CHECK(cache_k.dim() == 4, "cache_k, cache_v: one layer [B, KV, S, D]");
  eyas::decoder_layer(x.data_ptr<float>(), x.size(0), x.size(1), weights, pass, eyas::cache_layers(cache_k, cache_v),
                out.data_ptr<float>(),
                embeds.has_value() ? &*embeds : nullptr, embeds.has_value() ? &*norm_embeds : nullptr);
  return out;
}

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
  pybind11::class_<eyas::Int4Stack>(m, "Int4Stack", "The decoder layers of an int4 model, one call per pass")
      .def(pybind11::init<const std::vector<Tensor>&, int64_t, double, int64_t, int64_t>())
      .def("__len__", &eyas::Int4Stack::size)
      .def("run", &eyas::Int4Stack::run, "x [N, H] through the given layers (see Int4Stack::run)",
           pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("keys"),
           pybind11::arg("values"), pybind11::arg("layers"), pybind11::arg("storage"), pybind11::arg("slots"),
           pybind11::arg("kv_len"), pybind11::arg("mask"), pybind11::arg("sequences") = pybind11::none(),
           pybind11::arg("tap_before") = std::vector<int64_t>{}, pybind11::arg("taps") = pybind11::none(),
           // without the GIL: the server's event loop (HTTP, streaming) runs while a pass computes;
           // its buffers are per calling thread and the worker pool lets two callers take turns
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("decode", &eyas::Int4Stack::decode, "A single-stream step from token ids (see Int4Stack::decode)",
           pybind11::arg("tokens"), pybind11::arg("positions"), pybind11::arg("first_slot"), pybind11::arg("embed"),
           pybind11::arg("cos_table"), pybind11::arg("sin_table"), pybind11::arg("keys"), pybind11::arg("values"),
           pybind11::arg("storage"), pybind11::arg("mask"), pybind11::arg("tap_before"), pybind11::arg("norm"),
           pybind11::arg("eps"), pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<eyas::Int4HeadLayer>(m, "Int4HeadLayer", "An EAGLE-3 head's decoder layer, one call a draft pass")
      .def(pybind11::init<const std::vector<Tensor>&, int64_t, double, int64_t, int64_t, const Tensor&,
                          const Tensor&>())
      .def("step", &eyas::Int4HeadLayer::step, "A draft pass from token ids (see Int4HeadLayer::step)",
           pybind11::arg("x"), pybind11::arg("tokens"), pybind11::arg("positions"), pybind11::arg("first_slot"),
           pybind11::arg("embed"), pybind11::arg("cos_table"), pybind11::arg("sin_table"), pybind11::arg("keys"),
           pybind11::arg("values"), pybind11::arg("mask"), pybind11::call_guard<pybind11::gil_scoped_release>());
  using eyas::SuffixTrie;
  pybind11::class_<SuffixTrie, std::shared_ptr<SuffixTrie>>(
      m, "SuffixTrie", "A depth-bounded suffix trie with counts (suffix_trie.h; its Python twin: suffix_trie.py)")
      .def(pybind11::init<int64_t>(), pybind11::arg("max_depth"))
      .def_property_readonly("max_depth", &SuffixTrie::max_depth)
      .def_property_readonly("nodes", &SuffixTrie::nodes)
      .def("count", &SuffixTrie::count)
      .def("child", &SuffixTrie::child)
      .def("children", &SuffixTrie::children)
      .def("bytes", &SuffixTrie::bytes)
      .def("insert", &SuffixTrie::insert)
      .def("remove", &SuffixTrie::remove)
      .def("match", &SuffixTrie::match, pybind11::arg("context"), pybind11::arg("max_length"),
           pybind11::arg("min_count") = 1)
      .def("continuations", &SuffixTrie::continuations, pybind11::arg("node"), pybind11::arg("denominator"),
           pybind11::arg("scales"), pybind11::arg("limit"), pybind11::arg("max_children"),
           pybind11::arg("min_probability"));
  pybind11::class_<eyas::SuffixAppender>(m, "SuffixAppender", "Appends one sequence to a SuffixTrie")
      .def(pybind11::init<std::shared_ptr<SuffixTrie>>())
      .def("append", &eyas::SuffixAppender::append)
      .def("extend", &eyas::SuffixAppender::extend)
      .def("longest", &eyas::SuffixAppender::longest, pybind11::arg("max_length"), pybind11::arg("min_count") = 1);
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
