// A stack of Llama-family decoder layers for a step of a few rows, in one call.
//
// torch.ops.pdserve.decoder_layers(h [T, hidden] f32, weights, qkv_bias, out_features, cos [T, D],
//     signed_sin [T, D], slot_mapping [T], pool, block_tables, query_start_loc, context_lens,
//     scale, num_heads, eps, max_serial_numel) -> [T, hidden]
//
// weights: 6 tensors a layer, in order: input norm [hidden], qkv panels, o_proj panels, post-attention
// norm [hidden], gate_up panels, down panels (engine/model/panel_weights.py's [P, K, 16] layout);
// qkv_bias: one per layer (None without); out_features: 4 a layer (qkv, o, gate_up, down).
//
// Each layer is what engine/model/llama.py's DecoderLayer runs, op for op, with the same kernels
// (ops.h): rms_norm, panel_linear, rotary_kv_write (RoPE + K/V into the pool), paged_attention,
// panel_linear + the residual add, rms_norm, panel_linear, silu_mul, panel_linear + the residual add.
// So its results are bit-identical to the Python loop's. What it removes is the Python between the
// ops: at batch 1 a SmolLM2 step ran ~30 layers x ~10 module calls, ~7 ms of a ~30 ms step
// (torch.profiler: the kernels' own time was ~23 ms). No tensor parallelism (no all-reduce between
// layers) and no per-layer callback: the model keeps its Python loop for those.
#include "ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace pdserve {
namespace {

constexpr int64_t kWeightsPerLayer = 6;
constexpr int64_t kOutsPerLayer = 4;

at::Tensor decoder_layers(const at::Tensor& h_in, at::TensorList weights,
                          const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::IntArrayRef out_features,
                          const at::Tensor& cos, const at::Tensor& ssin, const at::Tensor& slot_mapping,
                          at::Tensor pool, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                          const at::Tensor& context_lens, double scale, int64_t num_heads, double eps,
                          int64_t max_serial_numel) {
  const int64_t layers = static_cast<int64_t>(qkv_bias.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers &&
                  static_cast<int64_t>(out_features.size()) == kOutsPerLayer * layers,
              "decoder_layers: 6 weights and 4 output sizes a layer, one qkv bias (or None) a layer");
  TORCH_CHECK(layers <= pool.size(1), "decoder_layers: more layers than the pool holds");
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat, "decoder_layers: h must be float32 [T, hidden]");
  const int64_t t = h_in.size(0), head_dim = pool.size(5);
  at::Tensor h = h_in.contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const int64_t* n = out_features.data() + l * kOutsPerLayer;
    at::Tensor qkv = panel_linear(rms_norm(h, w[0], eps), w[1], qkv_bias.get(l), n[0]);
    rotary_kv_write(qkv, cos, ssin, slot_mapping, pool, l, num_heads);
    const at::Tensor q = qkv.narrow(1, 0, num_heads * head_dim).view({t, num_heads, head_dim});
    const at::Tensor attn = paged_attention(q, pool, l, block_tables, query_start_loc, context_lens, scale);
    h = h + panel_linear(attn.view({t, num_heads * head_dim}), w[2], c10::nullopt, n[1]);
    const at::Tensor gate_up = panel_linear(rms_norm(h, w[3], eps), w[4], c10::nullopt, n[2]);
    h = h + panel_linear(silu_mul(gate_up, max_serial_numel), w[5], c10::nullopt, n[3]);
  }
  return h;
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("decoder_layers(Tensor h, Tensor[] weights, Tensor?[] qkv_bias, int[] out_features, Tensor cos, "
        "Tensor signed_sin, Tensor slot_mapping, Tensor(a!) pool, Tensor block_tables, Tensor query_start_loc, "
        "Tensor context_lens, float scale, int num_heads, float eps, int max_serial_numel) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("decoder_layers", &pdserve::decoder_layers); }
