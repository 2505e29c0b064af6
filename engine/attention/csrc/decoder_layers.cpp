// A stack of Llama-family decoder layers for one step, in one call.
//
// torch.ops.pdserve.decoder_layers(h [T, hidden] f32, norms, panels, packed, qkv_bias, out_features,
//     max_panel_rows, cos [T, D], signed_sin [T, D], slot_mapping [T], pool, block_tables,
//     query_start_loc, context_lens, scale, num_heads, eps, max_serial_numel) -> [T, hidden]
//
// A layer's weights: norms, 2 a layer (input, post-attention: [hidden]); packed, 4 a layer (qkv,
// o_proj, gate_up, down as oneDNN's blocked weights, engine/model/packed_linear.py); panels, 4 a
// layer or none (the same weights in 16-output panels, engine/model/panel_weights.py, read for steps
// of at most max_panel_rows rows); qkv_bias: one per layer (None without); out_features: 4 a layer.
//
// Each layer is what engine/model/llama.py's DecoderLayer runs, op for op, with the same kernels
// (ops.h, and oneDNN's linear through the dispatcher): rms_norm, the qkv projection, rotary_kv_write
// (RoPE + K/V into the pool), paged_attention, o_proj + the residual add, rms_norm, gate_up,
// silu_mul, down + the residual add. So its results are bit-identical to the Python loop's. What it
// removes is the Python between the ops: at batch 1 a SmolLM2 step ran 30 layers x ~10 module calls,
// ~5 ms of a ~30 ms step (benchmarks/step_profile.py --op-table: the ops' own time ~25 ms). No
// tensor parallelism (no all-reduce between layers) and no per-layer callback: the model keeps its
// Python loop for those.
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace pdserve {
namespace {

constexpr int64_t kLinearsPerLayer = 4;
constexpr int64_t kNormsPerLayer = 2;

// F.linear on oneDNN's packed weight: torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], None),
// what engine/model/packed_linear.py calls
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias, c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor decoder_layers(const at::Tensor& h_in, at::TensorList norms,
                          const c10::List<c10::optional<at::Tensor>>& panels, at::TensorList packed,
                          const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::IntArrayRef out_features,
                          int64_t max_panel_rows, const at::Tensor& cos, const at::Tensor& ssin,
                          const at::Tensor& slot_mapping, at::Tensor pool, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale,
                          int64_t num_heads, double eps, int64_t max_serial_numel) {
  const int64_t layers = static_cast<int64_t>(qkv_bias.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == kNormsPerLayer * layers &&
                  static_cast<int64_t>(packed.size()) == kLinearsPerLayer * layers &&
                  static_cast<int64_t>(out_features.size()) == kLinearsPerLayer * layers,
              "decoder_layers: 2 norms, 4 packed weights and 4 output sizes a layer, one qkv bias (or None) a "
              "layer");
  TORCH_CHECK(panels.size() == 0 || static_cast<int64_t>(panels.size()) == kLinearsPerLayer * layers,
              "decoder_layers: panels are 4 a layer, or none");
  TORCH_CHECK(layers <= pool.size(1), "decoder_layers: more layers than the pool holds");
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat, "decoder_layers: h must be float32 [T, hidden]");
  const int64_t t = h_in.size(0), head_dim = pool.size(5);
  const bool use_panels = panels.size() > 0 && t <= max_panel_rows;
  // a layer's i-th projection of x: its panels for a few rows, else the packed weight
  auto linear = [&](const at::Tensor& x, int64_t l, int64_t i, const c10::optional<at::Tensor>& bias) {
    const int64_t k = l * kLinearsPerLayer + i;
    if (use_panels) return panel_linear(x, *panels.get(k), bias, out_features[k]);
    return packed_linear(x, packed[k], bias);
  };
  at::Tensor h = h_in.contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* norm = norms.data() + l * kNormsPerLayer;
    at::Tensor qkv = linear(rms_norm(h, norm[0], eps), l, 0, qkv_bias.get(l));
    rotary_kv_write(qkv, cos, ssin, slot_mapping, pool, l, num_heads);
    const at::Tensor q = qkv.narrow(1, 0, num_heads * head_dim).view({t, num_heads, head_dim});
    const at::Tensor attn = paged_attention(q, pool, l, block_tables, query_start_loc, context_lens, scale);
    h = h + linear(attn.view({t, num_heads * head_dim}), l, 1, c10::nullopt);
    const at::Tensor gate_up = linear(rms_norm(h, norm[1], eps), l, 2, c10::nullopt);
    h = h + linear(silu_mul(gate_up, max_serial_numel), l, 3, c10::nullopt);
  }
  return h;
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("decoder_layers(Tensor h, Tensor[] norms, Tensor?[] panels, Tensor[] packed, Tensor?[] qkv_bias, "
        "int[] out_features, int max_panel_rows, Tensor cos, Tensor signed_sin, Tensor slot_mapping, "
        "Tensor(a!) pool, Tensor block_tables, Tensor query_start_loc, Tensor context_lens, float scale, "
        "int num_heads, float eps, int max_serial_numel) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("decoder_layers", &pdserve::decoder_layers); }
// the packed weights are oneDNN (MkldnnCPU) tensors, whose dispatch key wins over the plain ones'
TORCH_LIBRARY_IMPL(pdserve, MkldnnCPU, m) { m.impl("decoder_layers", &pdserve::decoder_layers); }
