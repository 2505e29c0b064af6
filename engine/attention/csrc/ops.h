// The ops of this extension that other translation units call directly (decoder_layers.cpp runs a
// whole stack of decoder layers in C++ with them). Each is also registered as torch.ops.pdserve.<name>.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

namespace pdserve {

// csrc/paged_attention.cpp: q [T, heads, head_dim] (rows may be strided) -> [T, heads, head_dim]
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& pool, int64_t layer,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& context_lens, double scale);

// csrc/rotary_kv.cpp: RoPE on q and k of qkv in place, k and v written into the pool at their slots
void rotary_kv_write(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& ssin,
                     const at::Tensor& slot_mapping, at::Tensor pool, int64_t layer, int64_t num_heads);

// csrc/panel_linear.cpp: x [M, K] @ W^T (+ bias) from W's 16-output panels
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                        int64_t n);

// csrc/rms_norm.cpp: float32 RMSNorm over the last dimension
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// csrc/silu_mul.cpp: silu(gate) * up of gate_up [.., 2N], on this thread below max_serial_numel elements
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t max_serial_numel);

}  // namespace pdserve
