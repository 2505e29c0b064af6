// RMSNorm of float32 rows in one pass per row.
//
// torch.ops.pdserve.rms_norm(x [.., H] f32, weight [H] f32, eps) -> [.., H]
//   y = x * rsqrt(mean(x^2) + eps) * weight, as transformers' LlamaRMSNorm computes it in float32.
//
// F.rms_norm on CPU runs as a chain of ATen ops (pow, mean, add, rsqrt, mul, mul), each its own
// pass and, for a decode step's few rows, each its own OpenMP fork/join: ~50 us a call, 61 calls
// a SmolLM2 step, ~3 ms of a ~33 ms batch-1 step (torch.profiler, benchmarks/step_profile.py).
// Here a row is read twice (sum of squares, then scale) on one thread; rows are split over the
// team only when there are enough of them to pay for the fork. The sum of squares is taken in
// eight partial sums, so results differ from torch's in rounding only.
#include "ops.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace pdserve {
namespace {

constexpr int64_t kRowsPerTask = 64;   // a task's rows (~150 KB at H = 576): below that, one thread

void norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= H; i += 8)
#pragma omp simd
    for (int j = 0; j < 8; ++j) part[j] += x[i + j] * x[i + j];
  float ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; i < H; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) y[j] = w[j] * (x[j] * inv);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: float32 only");
  const int64_t H = x_in.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight must be [H] with H = x.size(-1)");
  const at::Tensor x = x_in.contiguous(), w = weight.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * H, wp, yp + r * H, H, e);
  });
  return y;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("rms_norm", &pdserve::rms_norm); }
