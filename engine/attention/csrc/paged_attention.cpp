// Paged attention on the CPU straight from the KV pool (no gathered copy).
//
// Pool layout: [num_blocks, num_layers, 2, kv_heads, block_size, head_dim]; one
// (block, layer, k|v, kv head) tile of block_size x head_dim values is contiguous.
//
// torch.ops.pdserve.paged_attention(q [T, H, D] (rows may be strided), pool, layer, block_tables [S, MB],
// query_start_loc [S+1], context_lens [S], scale) -> out [T, H, D]
//
// Sequence s owns query tokens [qsl[s], qsl[s+1]); its last query token sits at context
// position ctx[s]-1, so query j of s sees keys [0, ctx[s]-qlen+j] (causal with a cached
// prefix; a decode is qlen 1), softmax in fp32 (online, tile by tile, for prefill). Prefill work items are
// (sequence, kv head, query tile): each reads a K/V tile once for all the query heads of its kv
// head (GQA) and all the queries of its tile; tiles of 1-4 vectors of query rows put the rows in the
// vector lanes (attend_tile_lanes), fewer go one row at a time (run_item). A decode is one item
// per sequence over every kv head (run_decode): the scores from each block's K half, one softmax
// per row, then P.V from each block's V half, prefetching a block ahead; decodes with few
// sequences split the context (flash-decoding) and a
// second pass merges the partial softmaxes. Items are handed out costliest first from a shared
// counter.
#include "ops.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace pdserve {
namespace {

constexpr float kNegBig = -1e30f;
constexpr int64_t kMinTokensPerSplit = 64;   // a split decode's least context per item

// The vector width: one register of floats. 16 (512 bits) with AVX-512, else 8 (256 bits: AVX2,
// and two NEON registers on ARM). With 16-float vectors on an AVX2 CPU the compiler splits every
// operation and lane shuffle and the lane tiles' accumulators spill: 13-22x slower prefill
// (docs/benchmarks.md, "cpu_paged on AVX2"). PDSERVE_LANES overrides it (8 or 16), for tests.
#if defined(PDSERVE_LANES)
#define PDSERVE_VEC_LANES PDSERVE_LANES
#elif defined(__AVX512F__)
#define PDSERVE_VEC_LANES 16
#else
#define PDSERVE_VEC_LANES 8
#endif
constexpr int64_t kLanes = PDSERVE_VEC_LANES;
static_assert(kLanes == 8 || kLanes == 16, "PDSERVE_LANES must be 8 or 16");
// Vector registers the lane tiles may fill with accumulators (half the register file).
constexpr int kAccRegs = kLanes == 16 ? 16 : 8;

typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vfi __attribute__((vector_size(kLanes * 4)));

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float v, float* p) { *p = v; }
inline void store(float v, at::BFloat16* p) { *p = at::BFloat16(v); }

inline vf splat(float x) { return vf{} + x; }

// exp(x) for x <= 0 to ~2 ulp, branch-free, on a float or on a vector lane by lane (the softmax
// runs on whole vectors: GCC left the scalar form unvectorized in the kernel's `omp simd` loops,
// the masked exp being "control flow", a third of the decode's time).
inline float clamp_exp_arg(float x) { return std::max(x, -87.0f); }
inline vf clamp_exp_arg(vf x) { return x < -87.0f ? splat(-87.0f) : x; }
inline float pow2_of(float n) {    // 2^n for an integral n
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return scale;
}
inline vf pow2_of(vf n) {
  const vfi bits = (__builtin_convertvector(n, vfi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}
template <typename V>
inline V exp_neg(V x) {
  x = clamp_exp_arg(x);
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round to nearest
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = r * 0.f + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * pow2_of(n);
}

inline vf vmax_of(vf a, vf b) { return a > b ? a : b; }
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
#if PDSERVE_VEC_LANES == 16
const vfi kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
const vfi kIota = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

#if PDSERVE_VEC_LANES == 16
// Lanes j < 8: x[2j] + x[2j+1]; lanes 8 + j: y[2j] + y[2j+1] (one two-source permute each on AVX-512).
inline vf pair_sums(vf x, vf y) {
  const vfi even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vfi odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  return __builtin_shuffle(x, y, even) + __builtin_shuffle(x, y, odd);
}

// 16 vectors -> one whose lane j is the sum of a[j]'s lanes (a transposing add tree).
inline vf reduce_lanes(vf* a) {
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) a[j] = pair_sums(a[2 * j], a[2 * j + 1]);
  return a[0];
}
#else
// Pair sums inside each 4-float half: [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7].
// Two in-half shuffles (shufps) and an add: a shuffle across the halves costs AVX2 two permutes
// and a blend per source (the even/odd pair sums above: 7 instructions where these take 3).
inline vf half_pair_sums(vf x, vf y) {
  const vfi even = {0, 2, 8, 10, 4, 6, 12, 14};
  const vfi odd = {1, 3, 9, 11, 5, 7, 13, 15};
  return __builtin_shuffle(x, y, even) + __builtin_shuffle(x, y, odd);
}

// 8 vectors -> one whose lane j is the sum of a[j]'s lanes: two in-half trees leave a[j]'s low
// and high half sums in lane j of the low and high halves; one cross-half add joins them.
inline vf reduce_lanes(vf* a) {
  const vf h0 = half_pair_sums(half_pair_sums(a[0], a[1]), half_pair_sums(a[2], a[3]));
  const vf h1 = half_pair_sums(half_pair_sums(a[4], a[5]), half_pair_sums(a[6], a[7]));
  const vfi lo = {0, 1, 2, 3, 8, 9, 10, 11};
  const vfi hi = {4, 5, 6, 7, 12, 13, 14, 15};
  return __builtin_shuffle(h0, h1, lo) + __builtin_shuffle(h0, h1, hi);
}
#endif

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// Masked row helpers over s[0, n) read in whole vectors (lanes past n, in the vector that
// holds s[n - 1], are ignored): the max, and s = exp(s - m) in place with its sum.
inline vfi live_lanes(int64_t n, int64_t c) { return kIota < static_cast<int32_t>(std::min<int64_t>(n - c, kLanes)); }
inline float row_max(const float* s, int64_t n) {
  vf vmax = splat(kNegBig);
  for (int64_t c = 0; c < n; c += kLanes) vmax = vmax_of(vmax, live_lanes(n, c) ? loadv(s + c) : splat(kNegBig));
  return hmax(vmax);
}
inline float row_exp(float* s, int64_t n, float m) {
  vf vsum = splat(0.f);
  for (int64_t c = 0; c < n; c += kLanes) {
    const vf p = live_lanes(n, c) ? exp_neg(loadv(s + c) - m) : splat(0.f);
    storev(s + c, p);
    vsum += p;
  }
  return hsum(vsum);
}

// Scores of one query row against keys [0, n) of an fp32 tile ([bs, DV*kLanes]) into s. A
// pass takes kLanes keys with one accumulator each, the query vector outermost: kLanes
// independent FMA chains (the FMA latency hidden) and one query vector live, where a key at a
// time with the whole query in registers leaves room for ~4 chains on AVX2's 16 registers.
template <int DV>
inline void scores(const float* q, const float* k, int64_t n, float* s) {
  for (int64_t c = 0; c < n; c += kLanes) {
    const float* kc = k + c * DV * kLanes;
    vf a[kLanes];
    const vf q0 = loadv(q);
    for (int j = 0; j < kLanes; ++j) a[j] = q0 * loadv(kc + j * DV * kLanes);
    for (int i = 1; i < DV; ++i) {
      const vf qi = loadv(q + i * kLanes);
      for (int j = 0; j < kLanes; ++j) a[j] += qi * loadv(kc + (j * DV + i) * kLanes);
    }
    storev(s + c, reduce_lanes(a));
  }
}

// Up to NV * 16 query rows (one per lane) against one K/V tile: scores with the rows in
// the vector lanes (no horizontal sums; K read once per key for all rows), softmax across
// the lanes, then P.V per row. qt: [D][W] transposed scaled queries; lim: each lane's last
// visible key (-1 for padding lanes); keys [0, n) of the tile start at context position kstart.
template <int DV, int NV>
inline void attend_tile_lanes(const float* qt, const float* k, const float* v, int64_t kstart, int64_t n,
                              const int32_t* lim, float* sbuf, float* m, float* l, float* acc, int64_t rows) {
  constexpr int W = NV * kLanes;
  constexpr int D = DV * kLanes;
  constexpr int J = 4 * NV <= kAccRegs ? 4 : 2;    // keys per pass: J x NV accumulators stay in registers
  int64_t t = 0;
  for (; t + J <= n; t += J) {
    vf a[J][NV] = {};
    const float* k0 = k + t * D;
    for (int d = 0; d < D; ++d)
      for (int u = 0; u < NV; ++u) {
        const vf qv = loadv(qt + d * W + u * kLanes);
        for (int j = 0; j < J; ++j) a[j][u] += qv * k0[j * D + d];
      }
    for (int j = 0; j < J; ++j)
      for (int u = 0; u < NV; ++u) storev(sbuf + (t + j) * W + u * kLanes, a[j][u]);
  }
  for (; t < n; ++t) {
    vf a[NV] = {};
    for (int d = 0; d < D; ++d)
      for (int u = 0; u < NV; ++u) a[u] += loadv(qt + d * W + u * kLanes) * k[t * D + d];
    for (int u = 0; u < NV; ++u) storev(sbuf + t * W + u * kLanes, a[u]);
  }
  float bm[W], mn[W];
#pragma omp simd
  for (int i = 0; i < W; ++i) bm[i] = kNegBig;
  for (t = 0; t < n; ++t) {
    const float* st = sbuf + t * W;
#pragma omp simd
    for (int i = 0; i < W; ++i) bm[i] = std::max(bm[i], kstart + t <= lim[i] ? st[i] : kNegBig);
  }
  // the correction and the probabilities on whole vectors (GCC leaves these loops scalar when
  // written lane by lane: the masked exp is "control flow")
  vf lsum[NV];
  for (int u = 0; u < NV; ++u) {
    const vf mo = loadv(m + u * kLanes), mv = vmax_of(mo, loadv(bm + u * kLanes));
    const vf c = exp_neg(mo - mv);    // the correction of what was accumulated
    storev(mn + u * kLanes, mv);
    storev(bm + u * kLanes, c);
    storev(m + u * kLanes, mv);
    lsum[u] = loadv(l + u * kLanes) * c;
  }
  for (t = 0; t < n; ++t) {
    float* st = sbuf + t * W;
    for (int u = 0; u < NV; ++u) {
      vfi lv;
      std::memcpy(&lv, lim + u * kLanes, sizeof(lv));
      const vf p = static_cast<int32_t>(kstart + t) <= lv ? exp_neg(loadv(st + u * kLanes) - loadv(mn + u * kLanes))
                                                          : splat(0.f);
      storev(st + u * kLanes, p);
      lsum[u] += p;
    }
  }
  for (int u = 0; u < NV; ++u) storev(l + u * kLanes, lsum[u]);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t nr = std::min<int64_t>(n, lim[r] - kstart + 1);
    if (nr <= 0) continue;
    float* ar = acc + r * D;
    vf a[DV];
    for (int i = 0; i < DV; ++i) a[i] = loadv(ar + i * kLanes) * bm[r];
    for (int64_t tt = 0; tt < nr; ++tt) {
      const float p = sbuf[tt * W + r];
      const float* vt = v + tt * D;
      for (int i = 0; i < DV; ++i) a[i] += p * loadv(vt + i * kLanes);
    }
    for (int i = 0; i < DV; ++i) storev(ar + i * kLanes, a[i]);
  }
}

// Up to R rows of one kv head's group: acc[r] = acc[r] * corr[r] + P[r] . V for keys [0, n)
// (corr null: no rescale).
template <int DV, int R>
inline void pv_rows(const float* v, const float* p, int64_t p_stride, int64_t n, const float* corr,
                    float* acc, int64_t d) {
  vf a[R][DV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < DV; ++i) a[r][i] = corr ? loadv(acc + r * d + i * kLanes) * corr[r] : loadv(acc + r * d + i * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    vf vt[DV];
    for (int i = 0; i < DV; ++i) vt[i] = loadv(v + t * DV * kLanes + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const float pr = p[r * p_stride + t];
      for (int i = 0; i < DV; ++i) a[r][i] += pr * vt[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < DV; ++i) storev(acc + r * d + i * kLanes, a[r][i]);
}

// The `grp` query rows of one kv head against one K/V tile (first n keys valid): scores row by
// row (the K tile stays in L1 for the group), an online softmax per row, then P.V with up to
// three rows per pass so each V row is loaded once for the group.
template <int DV>
inline void attend_group(const float* q, const float* k, const float* v, int64_t n, int64_t grp,
                         int64_t bs, float* s, float* m, float* l, float* acc, float* corr) {
  constexpr int64_t D = DV * kLanes;
  for (int64_t r = 0; r < grp; ++r) {
    float* sr = s + r * bs;
    scores<DV>(q + r * D, k, n, sr);
    const float mn = std::max(m[r], row_max(sr, n));   // scores() filled sr up to n rounded up to kLanes
    const float sum = row_exp(sr, n, mn);
    corr[r] = exp_neg(m[r] - mn);
    l[r] = l[r] * corr[r] + sum;
    m[r] = mn;
  }
  constexpr int RP = DV <= 4 ? 3 : 1;
  int64_t r = 0;
  for (; r + RP <= grp; r += RP) pv_rows<DV, RP>(v, s + r * bs, bs, n, corr + r, acc + r * D, D);
  for (; r < grp; ++r) pv_rows<DV, 1>(v, s + r * bs, bs, n, corr + r, acc + r * D, D);
}

struct Item {
  int64_t seq, q0, q1;        // query tokens [q0, q1) of the sequence (relative)
  int64_t b0, b1;             // context blocks [b0, b1)
  int64_t head;               // kv head; -1: a decode over every kv head (run_decode)
  int64_t partial;            // -1: write the output; else the partial slot (split decode)
};

struct Geometry {
  int64_t layers, layer, kv_heads, block_size, head_dim, group, heads;
  int64_t bt_stride, q_row;   // q_row: elements between two tokens' queries
  float scale;
  int64_t tile() const { return block_size * head_dim; }
};

struct RowState {
  std::vector<float> q, acc, m, l, s, k, v;
  RowState(int64_t rows, int64_t d, int64_t bs)
      : q(rows * d), acc(rows * d), m(rows, kNegBig), l(rows), s(bs), k(bs * d), v(bs * d) {}
};

// A tile in fp32: the pool's own memory for float pools, a converted copy for bf16.
inline const float* tile_f32(const float* src, int64_t, float*) { return src; }
inline const float* tile_f32(const at::BFloat16* src, int64_t n, float* buf) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = to_f(src[i]);
  return buf;
}

// Ask for the next block's K and V tiles while this one is computed: a decode step reads each
// layer's context cold from DRAM (32 x 512 tokens is ~25 MB a layer), one 2-4 KB tile at a
// time from scattered blocks, which the hardware prefetcher only picks up after a few lines.
template <typename T>
inline void prefetch_tiles(const T* pool, const Geometry& g, int64_t blk, int64_t head) {
  const char* k = reinterpret_cast<const char*>(pool + ((blk * g.layers + g.layer) * 2 * g.kv_heads + head) * g.tile());
  const char* v = k + g.kv_heads * g.tile() * sizeof(T);
  const int64_t bytes = g.tile() * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(k + o);
    __builtin_prefetch(v + o);
  }
}

// Rows in lanes (prefill tiles of >= kLanes rows): the item's K/V tiles through attend_tile_lanes.
template <typename T, int DV, int NV>
void lanes_item(const Item& it, const Geometry& g, const T* pool, const int64_t* bt, int64_t prefix,
                RowState& st) {
  constexpr int W = NV * kLanes;
  const int64_t d = g.head_dim, bs = g.block_size, grp = g.group, rows = (it.q1 - it.q0) * grp;
  std::vector<float> qt(d * W, 0.f), sbuf(bs * W), m(W, kNegBig), l(W, 0.f);
  std::vector<int32_t> lim(W, -1);
  for (int64_t r = 0; r < rows; ++r) {
    lim[r] = static_cast<int32_t>(prefix + it.q0 + r / grp);
    for (int64_t i = 0; i < d; ++i) qt[i * W + r] = st.q[r * d + i];
  }
  const int64_t last_key = prefix + it.q1 - 1;
  const int64_t b1 = std::min(it.b1, last_key / bs + 1);
  const int64_t kv_stride = g.kv_heads * g.tile();
  for (int64_t b = it.b0; b < b1; ++b) {
    const int64_t blk = bt[it.seq * g.bt_stride + b];
    const T* kp = pool + ((blk * g.layers + g.layer) * 2 * g.kv_heads + it.head) * g.tile();
    const float* k = tile_f32(kp, g.tile(), st.k.data());
    const float* v = tile_f32(kp + kv_stride, g.tile(), st.v.data());
    const int64_t n = std::min(bs, last_key - b * bs + 1);
    attend_tile_lanes<DV, NV>(qt.data(), k, v, b * bs, n, lim.data(), sbuf.data(), m.data(), l.data(),
                              st.acc.data(), rows);
  }
  std::copy(m.begin(), m.begin() + rows, st.m.begin());
  std::copy(l.begin(), l.begin() + rows, st.l.begin());
}

template <typename T, int DV>
void run_item(const Item& it, const Geometry& g, const T* q, const T* pool, const int64_t* bt,
              const int64_t* qsl, const int64_t* ctx, T* out) {
  const int64_t d = g.head_dim, bs = g.block_size, grp = g.group;
  const int64_t tok0 = qsl[it.seq], qlen = qsl[it.seq + 1] - tok0, prefix = ctx[it.seq] - qlen;
  const int64_t rows = (it.q1 - it.q0) * grp;
  RowState st(rows, d, bs);
  for (int64_t j = it.q0; j < it.q1; ++j)
    for (int64_t gi = 0; gi < grp; ++gi) {
      const T* src = q + (tok0 + j) * g.q_row + (it.head * grp + gi) * d;
      float* dst = st.q.data() + ((j - it.q0) * grp + gi) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = to_f(src[i]) * g.scale;
    }
  const int64_t last_key = prefix + it.q1 - 1;
  const int64_t b1 = rows >= kLanes && rows <= 4 * kLanes ? it.b0 : std::min(it.b1, last_key / bs + 1);
  if (rows >= kLanes && rows <= 4 * kLanes) {
    const int64_t nv = (rows + kLanes - 1) / kLanes;
    auto lanes = nv == 1 ? &lanes_item<T, DV, 1> : nv == 2 ? &lanes_item<T, DV, 2> : &lanes_item<T, DV, 4>;
    lanes(it, g, pool, bt, prefix, st);
  }
  const int64_t kv_stride = g.kv_heads * g.tile();
  float corr;
  for (int64_t b = it.b0; b < b1; ++b) {     // rows one at a time (short prefill chunks)
    const int64_t blk = bt[it.seq * g.bt_stride + b];
    const T* kp = pool + ((blk * g.layers + g.layer) * 2 * g.kv_heads + it.head) * g.tile();
    if (b + 1 < b1) prefetch_tiles(pool, g, bt[it.seq * g.bt_stride + b + 1], it.head);
    const float* k = tile_f32(kp, g.tile(), st.k.data());
    const float* v = tile_f32(kp + kv_stride, g.tile(), st.v.data());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min(bs, prefix + it.q0 + r / grp - b * bs + 1);
      if (n <= 0) continue;
      attend_group<DV>(st.q.data() + r * d, k, v, n, 1, bs, st.s.data(), &st.m[r], &st.l[r],
                       st.acc.data() + r * d, &corr);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = st.acc.data() + r * d;
    const float inv = st.l[r] > 0.f ? 1.f / st.l[r] : 0.f;
    T* dst = out + ((tok0 + it.q0 + r / grp) * g.heads + it.head * grp + r % grp) * d;
    for (int64_t i = 0; i < d; ++i) store(a[i] * inv, dst + i);
  }
}

// Prefetch part `part` of `parts` of `bytes` at p.
inline void prefetch_part(const char* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lo = bytes * part / parts & ~int64_t{63}, hi = bytes * (part + 1) / parts;
  for (int64_t o = lo; o < hi; o += 64) __builtin_prefetch(p + o);
}

// A decode (one query token) over context blocks [b0, b1), every kv head, in two passes over
// the blocks: the scores of every query row against every key (each block's K half of its layer
// slab, [kv_heads, block_size, head_dim], read in one pass), one softmax per row over the whole
// range, then P.V (each block's V half). A softmax per block (an online one) put a serial
// chain of horizontal max, scalar exp and sum into every block: a quarter of the kernel's time.
// The next block's half is prefetched a kv head at a time while this one is computed: 16-token
// blocks are scattered over the pool and the hardware prefetcher stops at each 4 KB page.
template <typename T, int DV>
void run_decode(const Item& it, const Geometry& g, const T* q, const T* pool, const int64_t* bt,
                const int64_t* qsl, const int64_t* ctx, T* out, float* partials) {
  const int64_t d = g.head_dim, bs = g.block_size, grp = g.group, rows = g.heads, kvh = g.kv_heads;
  const int64_t tok = qsl[it.seq], n_ctx = ctx[it.seq];
  const int64_t slab = 2 * kvh * g.tile(), half_bytes = kvh * g.tile() * static_cast<int64_t>(sizeof(T));
  const int64_t b1 = std::min(it.b1, (n_ctx + bs - 1) / bs);
  const int64_t keys = std::max<int64_t>(0, std::min(b1 * bs, n_ctx) - it.b0 * bs);
  const int64_t stride = std::max<int64_t>(0, b1 - it.b0) * bs;    // a row's scores, block_size-aligned
  thread_local std::vector<float> work;    // reused: a long context's scores are MBs
  work.resize(2 * rows * d + rows * stride + 2 * rows);
  float *qf = work.data(), *acc = qf + rows * d, *s = acc + rows * d, *m = s + rows * stride, *l = m + rows;
  std::fill(acc, acc + rows * d, 0.f);
  std::vector<float> kb(std::is_same<T, float>::value ? 0 : g.tile()), vb(kb.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < d; ++i) qf[r * d + i] = to_f(q[tok * g.q_row + r * d + i]) * g.scale;
  const int64_t* row = bt + it.seq * g.bt_stride;
  auto slab_of = [&](int64_t b) { return pool + (row[b] * g.layers + g.layer) * slab; };
  for (int64_t b = it.b0; b < b1; ++b) {
    const T* base = slab_of(b);
    const char* next = b + 1 < b1 ? reinterpret_cast<const char*>(slab_of(b + 1)) : nullptr;
    const int64_t n = std::min(bs, n_ctx - b * bs);
    for (int64_t h = 0; h < kvh; ++h) {
      if (next) prefetch_part(next, half_bytes, h, kvh);
      const float* k = tile_f32(base + h * g.tile(), g.tile(), kb.data());
      for (int64_t r = h * grp; r < (h + 1) * grp; ++r) scores<DV>(qf + r * d, k, n, s + r * stride + (b - it.b0) * bs);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = row_max(s + r * stride, keys);
    l[r] = row_exp(s + r * stride, keys, m[r]);
  }
  constexpr int RP = DV <= 4 ? 3 : 1;
  for (int64_t b = it.b0; b < b1; ++b) {
    const T* base = slab_of(b) + kvh * g.tile();
    const char* next = b + 1 < b1 ? reinterpret_cast<const char*>(slab_of(b + 1) + kvh * g.tile()) : nullptr;
    const int64_t n = std::min(bs, n_ctx - b * bs), off = (b - it.b0) * bs;
    for (int64_t h = 0; h < kvh; ++h) {
      if (next) prefetch_part(next, half_bytes, h, kvh);
      const float* v = tile_f32(base + h * g.tile(), g.tile(), vb.data());
      int64_t r = h * grp;
      for (; r + RP <= (h + 1) * grp; r += RP) pv_rows<DV, RP>(v, s + r * stride + off, stride, n, nullptr, acc + r * d, d);
      for (; r < (h + 1) * grp; ++r) pv_rows<DV, 1>(v, s + r * stride + off, stride, n, nullptr, acc + r * d, d);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * d;
    if (it.partial >= 0) {
      float* dst = partials + (it.partial * rows + r) * (d + 2);
      dst[0] = m[r];
      dst[1] = l[r];
      std::memcpy(dst + 2, a, d * sizeof(float));
      continue;
    }
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    T* dst = out + (tok * g.heads + r) * d;
    for (int64_t i = 0; i < d; ++i) store(a[i] * inv, dst + i);
  }
}

template <typename T, int DV>
void run_any(const Item& it, const Geometry& g, const T* q, const T* pool, const int64_t* bt,
             const int64_t* qsl, const int64_t* ctx, T* out, float* partials) {
  if (it.head < 0) {
    run_decode<T, DV>(it, g, q, pool, bt, qsl, ctx, out, partials);
  } else {
    run_item<T, DV>(it, g, q, pool, bt, qsl, ctx, out);
  }
}

// Merge the partial softmaxes of a split decode (one query token, `group` rows).
template <typename T>
void merge_splits(const float* partials, int64_t first, int64_t splits, int64_t rows, int64_t d,
                  T* dst_row0) {
  std::vector<float> acc(d);
  for (int64_t r = 0; r < rows; ++r) {
    float m = kNegBig;
    for (int64_t k = 0; k < splits; ++k) m = std::max(m, partials[((first + k) * rows + r) * (d + 2)]);
    float l = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k = 0; k < splits; ++k) {
      const float* p = partials + ((first + k) * rows + r) * (d + 2);
      const float w = exp_neg(p[0] - m);
      l += p[1] * w;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[i] += w * p[2 + i];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t i = 0; i < d; ++i) store(acc[i] * inv, dst_row0 + r * d + i);
  }
}

struct Split {
  int64_t seq, first, count;   // `count` partial slots from `first`, each every head of the token
};

struct WorkList {
  std::vector<Item> items;
  std::vector<Split> splits;
  int64_t partial_slots = 0;
};

WorkList plan_work(const int64_t* qsl, const int64_t* ctx, int64_t num_seqs, const Geometry& g) {
  WorkList w;
  const int64_t q_tile = std::max<int64_t>(1, 32 / g.group);
  int64_t units = 0;    // items without splits: a decode is one, a prefill one per kv head and q tile
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = qsl[s + 1] - qsl[s];
    units += qlen == 1 ? 1 : g.kv_heads * ((qlen + q_tile - 1) / q_tile);
  }
  const int64_t threads = at::get_num_threads();
  const int64_t want = 4 * threads;
  const int64_t min_blocks = std::max<int64_t>(1, kMinTokensPerSplit / g.block_size);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = qsl[s + 1] - qsl[s];
    const int64_t nblocks = (ctx[s] + g.block_size - 1) / g.block_size;
    if (qlen > 1) {
      for (int64_t h = 0; h < g.kv_heads; ++h)
        for (int64_t q0 = 0; q0 < qlen; q0 += q_tile)
          w.items.push_back({s, q0, std::min(qlen, q0 + q_tile), 0, nblocks, h, -1});
      continue;
    }
    int64_t splits = units < want ? std::min((want + units - 1) / units, nblocks / min_blocks) : 1;
    if (splits > threads) splits -= splits % threads;    // whole rounds over the threads
    if (splits <= 1) {
      w.items.push_back({s, 0, 1, 0, nblocks, -1, -1});
      continue;
    }
    w.splits.push_back({s, w.partial_slots, splits});
    for (int64_t k = 0; k < splits; ++k)
      w.items.push_back({s, 0, 1, nblocks * k / splits, nblocks * (k + 1) / splits, -1, w.partial_slots++});
  }
  return w;
}

// Query rows x context blocks the item walks (its share of the work).
inline int64_t item_cost(const Item& it, const int64_t* qsl, const int64_t* ctx, int64_t bs, int64_t kv_heads) {
  const int64_t qlen = qsl[it.seq + 1] - qsl[it.seq];
  const int64_t last = (ctx[it.seq] - qlen + it.q1 - 1) / bs + 1;
  return (it.head < 0 ? kv_heads : 1) * (it.q1 - it.q0) * (std::min(it.b1, last) - it.b0);
}

template <typename T>
void launch(const at::Tensor& q, const at::Tensor& pool, const Geometry& g, const at::Tensor& bt,
            const at::Tensor& qsl, const at::Tensor& ctx, at::Tensor& out) {
  const int64_t* qs = qsl.data_ptr<int64_t>();
  const int64_t* cx = ctx.data_ptr<int64_t>();
  WorkList w = plan_work(qs, cx, ctx.size(0), g);
  std::vector<float> partials(w.partial_slots * g.heads * (g.head_dim + 2));
  const T* qp = q.data_ptr<T>();
  const T* pp = pool.data_ptr<T>();
  const int64_t* bp = bt.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t dv = g.head_dim / kLanes;
  auto item = dv == 1 ? &run_any<T, 1> : dv == 2 ? &run_any<T, 2> : dv == 4 ? &run_any<T, 4>
            : dv == 8 ? &run_any<T, 8> : &run_any<T, 16>;   // 16: head_dim 128 in 8-float vectors
  // Costliest items first, handed out one at a time: a mixed batch's long prefill tiles and
  // short decodes balance over the threads (a static split would give one thread the prefills).
  std::stable_sort(w.items.begin(), w.items.end(), [&](const Item& x, const Item& y) {
    return item_cost(x, qs, cx, g.block_size, g.kv_heads) > item_cost(y, qs, cx, g.block_size, g.kv_heads);
  });
  const int64_t n = static_cast<int64_t>(w.items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) item(w.items[i], g, qp, pp, bp, qs, cx, op, partials.data());
  });
  if (w.splits.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(w.splits.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const Split& sp = w.splits[i];
      merge_splits<T>(partials.data(), sp.first, sp.count, g.heads, g.head_dim, op + qs[sp.seq] * g.heads * g.head_dim);
    }
  });
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& pool, int64_t layer,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [T, heads, head_dim] with each token's heads contiguous (rows may be strided)");
  TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous(),
              "pool must be a contiguous [blocks, layers, 2, kv_heads, block_size, head_dim] tensor");
  TORCH_CHECK(pool.scalar_type() == q.scalar_type(), "pool and q must share a dtype");
  TORCH_CHECK(q.device().is_cpu() && pool.device().is_cpu(), "paged_attention runs on CPU tensors");
  TORCH_CHECK(pool.size(5) == q.size(2), "q's head_dim differs from the pool's");
  TORCH_CHECK(q.size(1) % pool.size(3) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(2) == 16 || q.size(2) == 32 || q.size(2) == 64 || q.size(2) == 128,
              "paged_attention supports head_dim 16, 32, 64 and 128");
  TORCH_CHECK(pool.size(4) % kLanes == 0, "paged_attention needs a block_size that is a multiple of 16");
  TORCH_CHECK(layer >= 0 && layer < pool.size(1), "layer out of range");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong, "index tensors must be int64");
  at::Tensor bt = block_tables.contiguous(), qsl = query_start_loc.contiguous(), ctx = context_lens.contiguous();
  TORCH_CHECK(qsl.size(0) == ctx.size(0) + 1 && bt.size(0) == ctx.size(0), "one row per sequence");
  Geometry g{pool.size(1), layer, pool.size(3), pool.size(4), pool.size(5),
             q.size(1) / pool.size(3), q.size(1), bt.size(1), q.stride(0), static_cast<float>(scale)};
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    launch<float>(q, pool, g, bt, qsl, ctx, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    launch<at::BFloat16>(q, pool, g, bt, qsl, ctx, out);
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_attention(Tensor q, Tensor pool, int layer, Tensor block_tables, Tensor query_start_loc, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_attention", &pdserve::paged_attention); }
