// Linear layers for a few rows (decode steps of batch 1 to 8) on weights laid out in 16-output panels.
//
// torch.ops.pdserve.panel_linear(x [M, K] f32, panels [P, K, 16] f32, bias? [N], N) -> [M, N]
//   y = x @ W^T (+ bias), where panels[p, k, j] = W[16 p + j, k] (rows past N are zero).
//
// A decode step at batch 1 reads every weight once and does 2 flops per 4 bytes: it is bound by
// how fast the weights stream from memory. oneDNN's kernel on its blocked layout streamed them at
// ~20 GB/s on this repo's 2-core hosts, which stream ~30 GB/s (benchmarks/small_linear.py,
// docs/benchmarks.md). Here each thread walks a contiguous range of panels front to back, so the
// whole weight is one sequential read per thread with a software prefetch ahead of it; every
// 64-byte line (one k of one panel: 16 floats) feeds 2 vector FMAs per row. Rows are taken four at
// a time per panel, so more rows re-read a panel from L1/L2, not from memory.
//
// The sum over k runs in k order per output (one or two partial sums per output, added at the
// end): the result differs from oneDNN's and MKL's in rounding only.
#include "ops.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace pdserve {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kRowTile = 4;
// prefetch this many k (64-byte lines) ahead of the FMAs: 16 KB, far enough to cover DRAM latency
// at this stream rate, near enough to stay in L1/L2 until used (4-32 KB measured alike)
#ifndef PDSERVE_PANEL_PREFETCH
#define PDSERVE_PANEL_PREFETCH 256
#endif
constexpr int64_t kPrefetchLines = PDSERVE_PANEL_PREFETCH;

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));   // unaligned loads and stores

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }

// y[r, 0:16] = sum_k x[r, k] * panel[k, 0:16] for R rows (R <= 4) of one panel
template <int R>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* out16) {
  // R <= 2: two k per iteration in separate sums, so at least four FMA chains are in flight
  constexpr int U = R <= 2 ? 2 : 1;
  v8 acc[U][R][2];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r][0] = acc[u][r][1] = v8{};
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      const float* w = panel + (k + u) * kPanel;
      __builtin_prefetch(w + kPrefetchLines * kPanel, 0, 3);
      const v8 w0 = load8(w), w1 = load8(w + 8);
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * ldx + k + u];
        acc[u][r][0] += xv * w0;
        acc[u][r][1] += xv * w1;
      }
    }
  }
  for (; k < K; ++k) {
    const float* w = panel + k * kPanel;
    const v8 w0 = load8(w), w1 = load8(w + 8);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      acc[0][r][0] += xv * w0;
      acc[0][r][1] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    v8 lo = acc[0][r][0], hi = acc[0][r][1];
    if constexpr (U == 2) {
      lo += acc[1][r][0];
      hi += acc[1][r][1];
    }
    *reinterpret_cast<v8u*>(out16 + r * kPanel) = lo;
    *reinterpret_cast<v8u*>(out16 + r * kPanel + 8) = hi;
  }
}

void rows_of_panel(const float* x, int64_t M, int64_t K, const float* panel, float* y, int64_t N,
                   int64_t col0) {
  const int64_t cols = std::min(kPanel, N - col0);
  float tile[kRowTile * kPanel];
  for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
    const int64_t rows = std::min(kRowTile, M - r0);
    const float* xr = x + r0 * K;
    switch (rows) {
      case 1: panel_tile<1>(xr, K, panel, K, tile); break;
      case 2: panel_tile<2>(xr, K, panel, K, tile); break;
      case 3: panel_tile<3>(xr, K, panel, K, tile); break;
      default: panel_tile<4>(xr, K, panel, K, tile); break;
    }
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(y + (r0 + r) * N + col0, tile + r * kPanel, cols * sizeof(float));
  }
}

}  // namespace

at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                        int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel,
              "panel_linear: x must be [M, K] and panels [P, K, 16]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "panel_linear: float32 only");
  TORCH_CHECK(panels.is_contiguous() && panels.size(1) == x_in.size(1), "panel_linear: panels must be "
              "contiguous [P, K, 16] with K = x.size(1)");
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "panel_linear: N does not match the number of panels");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // each thread a contiguous run of panels: one sequential read of its share of the weight
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) rows_of_panel(xp, M, K, wp + p * K * kPanel, yp, n, p * kPanel);
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("panel_linear", &pdserve::panel_linear); }
