// RoPE on the fused QKV projection's output plus the K/V write into the pool, in one op.
//
// torch.ops.pdserve.rotary_kv_write(qkv [T, (H + 2 KVH) * D], cos [T, D], signed_sin [T, D],
// slot_mapping [T], pool, layer, num_heads) -> ()
//
// Rotates the q and k parts of qkv in place (HF's "rotate half": x*cos + swap(x)*signed_sin,
// where swap exchanges the two halves of a head and signed_sin = cat(-sin, sin)) and copies
// each token's rotated k and its v into the pool at its slot (block * block_size + offset).
// Pool layout: [blocks, layers, 2, kv_heads, block_size, head_dim]. This replaces a roll, a
// mul, an addcmul and two index_put_ per layer (each its own pass, most of them an OpenMP
// region); a decode step's tokens go on one thread (no fork/join), long prefills in chunks.
// float32 only. The two products and their sum are rounded one by one (compiled without
// contraction: no fused multiply-add), as torch's separate ops round them in transformers.
#include "ops.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace pdserve {
namespace {

constexpr int64_t kTokensPerTask = 128;   // below this many tokens the op runs on one thread

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rotate_head(float* x, const float* cos, const float* ssin, int64_t d) {
  const int64_t half = d / 2;
  float out[256];
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * ssin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * ssin[i];
  std::memcpy(x, out, d * sizeof(float));
}
#pragma GCC pop_options

void run(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& ssin, const at::Tensor& slots,
         at::Tensor& pool, int64_t layer, int64_t heads) {
  const int64_t t = qkv.size(0), layers = pool.size(1), kvh = pool.size(3), bs = pool.size(4), d = pool.size(5);
  const int64_t row = qkv.stride(0);
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = ssin.data_ptr<float>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  float* pp = pool.data_ptr<float>();
  at::parallel_for(0, t, kTokensPerTask, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* x = base + i * row;
      for (int64_t h = 0; h < heads + kvh; ++h) rotate_head(x + h * d, cp + i * d, sp + i * d, d);
      const int64_t blk = sl[i] / bs, off = sl[i] % bs;
      float* tile = pp + (blk * layers + layer) * 2 * kvh * bs * d + off * d;
      for (int64_t h = 0; h < kvh; ++h) {
        std::memcpy(tile + h * bs * d, x + (heads + h) * d, d * sizeof(float));                // k
        std::memcpy(tile + (kvh + h) * bs * d, x + (heads + kvh + h) * d, d * sizeof(float));  // v
      }
    }
  });
}

}  // namespace

void rotary_kv_write(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& ssin,
                     const at::Tensor& slot_mapping, at::Tensor pool, int64_t layer, int64_t num_heads) {
  TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous(),
              "pool must be a contiguous [blocks, layers, 2, kv_heads, block_size, head_dim] tensor");
  const int64_t kvh = pool.size(3), d = pool.size(5), t = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * kvh) * d,
              "qkv must be [T, (heads + 2 * kv_heads) * head_dim] with contiguous rows");
  TORCH_CHECK(d % 2 == 0 && d <= 256, "rotary_kv_write supports even head dims up to 256");
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.numel() == t * d && ssin.numel() == t * d,
              "cos and signed_sin must be contiguous [T, head_dim] tables");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && pool.scalar_type() == at::kFloat &&
                  cos.scalar_type() == at::kFloat && ssin.scalar_type() == at::kFloat,
              "rotary_kv_write takes float32 qkv, tables and pool (other dtypes: RoPE in torch)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == t,
              "slot_mapping must be a contiguous int64 [T] tensor");
  TORCH_CHECK(layer >= 0 && layer < pool.size(1), "layer out of range");
  TORCH_CHECK(qkv.device().is_cpu() && pool.device().is_cpu(), "rotary_kv_write runs on CPU tensors");
  run(qkv, cos, ssin, slot_mapping, pool, layer, num_heads);
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rotary_kv_write(Tensor(a!) qkv, Tensor cos, Tensor signed_sin, Tensor slot_mapping, Tensor(b!) pool, "
        "int layer, int num_heads) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("rotary_kv_write", &pdserve::rotary_kv_write); }
