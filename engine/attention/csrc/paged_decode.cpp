// Fused paged decode attention for CPU: one query token per sequence, K/V read
// in place from the block pool (no gather copy), online softmax in float32.
//
// q        [S, KVH, G, D]     query heads grouped by their KV head
// tiles    [R, BS*D]          the pool viewed as (block, layer, k|v, head) tiles
// rows     [2, S, KVH, MB]    tile row of K (0) and V (1) per sequence/head/block
// ctx_lens [S]                tokens of context per sequence
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace {

constexpr int kMaxD = 256;
constexpr int kMaxG = 16;
constexpr int kMaxBS = 64;

inline void load_row(const float* src, float* dst, int d) {
  std::memcpy(dst, src, sizeof(float) * d);
}

inline void load_row(const c10::BFloat16* src, float* dst, int d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = 0; i < d; ++i) {
    uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    dst[i] = f;
  }
}

inline void store_row(const float* src, float* dst, int d) { std::memcpy(dst, src, sizeof(float) * d); }
inline void store_row(const float* src, c10::BFloat16* dst, int d) {
  for (int i = 0; i < d; ++i) dst[i] = c10::BFloat16(src[i]);
}

template <typename T>
void decode_one(const T* q, const T* tiles, const int64_t* krow, const int64_t* vrow, int64_t ctx,
                int G, int D, int BS, float scale, T* out) {
  float qf[kMaxG][kMaxD], acc[kMaxG][kMaxD], p[kMaxG][kMaxBS], row[kMaxD];
  float m[kMaxG], l[kMaxG];
  for (int g = 0; g < G; ++g) {
    load_row(q + g * D, qf[g], D);
    for (int i = 0; i < D; ++i) { qf[g][i] *= scale; acc[g][i] = 0.f; }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const int64_t nblocks = (ctx + BS - 1) / BS;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int n = static_cast<int>(std::min<int64_t>(BS, ctx - b * BS));
    const T* kt = tiles + krow[b] * BS * D;
    const T* vt = tiles + vrow[b] * BS * D;
    for (int t = 0; t < n; ++t) {
      load_row(kt + t * D, row, D);
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int i = 0; i < D; ++i) dot += qf[g][i] * row[i];
        p[g][t] = dot;
      }
    }
    for (int g = 0; g < G; ++g) {
      float mx = m[g];
      for (int t = 0; t < n; ++t) mx = std::max(mx, p[g][t]);
      const float corr = std::exp(m[g] - mx);
      float sum = l[g] * corr;
      for (int t = 0; t < n; ++t) { p[g][t] = std::exp(p[g][t] - mx); sum += p[g][t]; }
      if (corr != 1.f) {
#pragma omp simd
        for (int i = 0; i < D; ++i) acc[g][i] *= corr;
      }
      m[g] = mx;
      l[g] = sum;
    }
    for (int t = 0; t < n; ++t) {
      load_row(vt + t * D, row, D);
      for (int g = 0; g < G; ++g) {
        const float w = p[g][t];
#pragma omp simd
        for (int i = 0; i < D; ++i) acc[g][i] += w * row[i];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.f / l[g];
    for (int i = 0; i < D; ++i) acc[g][i] *= inv;
    store_row(acc[g], out + g * D, D);
  }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& tiles, const torch::Tensor& rows,
         const torch::Tensor& ctx_lens, double scale, torch::Tensor& out, int BS) {
  const int64_t S = q.size(0), KVH = q.size(1);
  const int G = q.size(2), D = q.size(3);
  const int64_t MB = rows.size(3);
  const T* qp = q.data_ptr<T>();
  const T* tp = tiles.data_ptr<T>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* cp = ctx_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / KVH;
      decode_one<T>(qp + i * G * D, tp, rp + i * MB, rp + (S * KVH + i) * MB,
                    std::min<int64_t>(cp[s], MB * BS), G, D, BS, static_cast<float>(scale),
                    op + i * G * D);
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor tiles, torch::Tensor rows,
                           torch::Tensor ctx_lens, double scale, int64_t block_size) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q must be contiguous [S, KVH, G, D]");
  TORCH_CHECK(tiles.dim() == 2 && tiles.is_contiguous(), "tiles must be contiguous [R, BS*D]");
  TORCH_CHECK(rows.dim() == 4 && rows.is_contiguous() && rows.scalar_type() == torch::kInt64,
              "rows must be contiguous int64 [2, S, KVH, MB]");
  TORCH_CHECK(ctx_lens.scalar_type() == torch::kInt64 && ctx_lens.is_contiguous(), "ctx_lens int64");
  TORCH_CHECK(q.size(3) <= kMaxD && q.size(2) <= kMaxG && block_size <= kMaxBS,
              "head_dim <= 256, group <= 16, block_size <= 64");
  TORCH_CHECK(tiles.size(1) == block_size * q.size(3), "tile width must be block_size * head_dim");
  TORCH_CHECK(q.scalar_type() == tiles.scalar_type(), "q and pool dtypes differ");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat32) {
    run<float>(q, tiles, rows, ctx_lens, scale, out, static_cast<int>(block_size));
  } else if (q.scalar_type() == torch::kBFloat16) {
    run<c10::BFloat16>(q, tiles, rows, ctx_lens, scale, out, static_cast<int>(block_size));
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "fused paged decode attention (CPU)");
}
