// Attention over the serving engine's KV block pool for XLA:CPU through jax.ffi (see README.md next to this file).
//
// out [R, T, H, D] = softmax(scale * q . k) v for each row's T new queries q [R, T, H, D], over two sets of keys:
//   - the row's history, read straight from the pool: key j of row r is pool row kvh * S + src[r, j] of
//     pool_k, pool_v [KVH * S, D] (kv-heads-major, the engine's layout), with kv_seg, kv_pos [R, L];
//   - the T new keys themselves, k, v [R, T, KVH, D], with the queries' q_seg, q_pos [R, T].
// A query sees a key of its own segment (0: empty slot or pad, never seen) at a position <= its own and, with
// window > 0, fewer than `window` positions back; softcap > 0 caps the logits as softcap * tanh(x / softcap).
// The H query heads share KVH kv heads in groups of H / KVH (GQA/MQA). A query that sees no key gets zeros.
// No gather: each visible key's row is read once per query head from where it lies, and only the keys a row
// holds are read (the padding of a batch's history width costs one segment compare per slot).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JF_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"
#include "workers.h"

namespace ffi = xla::ffi;

namespace {

inline float Dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef JF_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 32 <= d; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), a3);
  }
  for (; i + 8 <= d; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
  __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

struct Shapes {
  int64_t R, T, H, KVH, D, S, L;
};

// Each row's slots grouped by segment id (a stable counting sort, once per call): a query then visits only its
// own segment's keys, so a row packing many requests' pieces (long histories side by side) costs what its
// pieces would cost apart. order[begin(r, s) .. end(r, s)) are row r's slots of segment s, in slot order.
struct Groups {
  std::vector<int32_t> order;
  std::vector<int64_t> start;  // [rows, segments + 1]
  int64_t segments = 0;
  void Build(const int32_t* seg, int64_t rows, int64_t len, int64_t max_seg) {
    segments = max_seg + 1;
    order.assign(rows * len, 0);
    start.assign(rows * (segments + 1), 0);
    for (int64_t r = 0; r < rows; ++r) {
      int64_t* st = &start[r * (segments + 1)];
      for (int64_t j = 0; j < len; ++j) ++st[seg[r * len + j] + 1];
      for (int64_t c = 0; c < segments; ++c) st[c + 1] += st[c];
      std::vector<int64_t> next(st, st + segments);
      for (int64_t j = 0; j < len; ++j) order[r * len + next[seg[r * len + j]]++] = static_cast<int32_t>(j);
      for (int64_t c = 0; c <= segments; ++c) st[c] += r * len;
    }
  }
  int64_t begin(int64_t r, int32_t s) const { return s < segments ? start[r * (segments + 1) + s] : 0; }
  int64_t end(int64_t r, int32_t s) const { return s < segments ? start[r * (segments + 1) + s + 1] : 0; }
};

constexpr int32_t kMaxSegment = 1 << 16;

// One (row, kv head): every query of the row, for each of the kv head's query heads. keys/values: scratch.
void RowHead(const Shapes& n, int64_t r, int64_t kvh, const float* q, const float* k, const float* v,
             const float* pool_k, const float* pool_v, const int32_t* src, const int32_t* kv_pos, const int32_t* q_seg, const int32_t* q_pos, const Groups& hist,
             const Groups& fresh, float* out, int64_t window, float scale, float softcap,
             std::vector<const float*>& keys, std::vector<const float*>& values, std::vector<float>& scores,
             std::vector<float>& query) {
  const int64_t g = n.H / n.KVH, D = n.D;
  for (int64_t t = 0; t < n.T; ++t) {
    const int32_t seg = q_seg[r * n.T + t], pos = q_pos[r * n.T + t];
    float* o = out + ((r * n.T + t) * n.H + kvh * g) * D;
    // The keys this query sees, in order: the history, then the new tokens up to itself.
    keys.clear();
    values.clear();
    if (seg != 0) {
      for (int64_t x = hist.begin(r, seg); x < hist.end(r, seg); ++x) {
        const int64_t i = r * n.L + hist.order[x];
        if (kv_pos[i] > pos || (window > 0 && pos - kv_pos[i] >= window)) continue;
        const int64_t row = kvh * n.S + src[i];
        keys.push_back(pool_k + row * D);
        values.push_back(pool_v + row * D);
      }
      for (int64_t x = fresh.begin(r, seg); x < fresh.end(r, seg); ++x) {
        const int64_t i = r * n.T + fresh.order[x];
        if (q_pos[i] > pos || (window > 0 && pos - q_pos[i] >= window)) continue;
        keys.push_back(k + (i * n.KVH + kvh) * D);
        values.push_back(v + (i * n.KVH + kvh) * D);
      }
    }
    const int64_t m = static_cast<int64_t>(keys.size());
    for (int64_t h = 0; h < g; ++h, o += D) {
      for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
      if (m == 0) continue;
      const float* qh = q + ((r * n.T + t) * n.H + kvh * g + h) * D;
      for (int64_t d = 0; d < D; ++d) query[d] = qh[d] * scale;  // scaled first, as the XLA path does
      float top = -INFINITY;
      for (int64_t j = 0; j < m; ++j) {
        float s = Dot(query.data(), keys[j], D);
        if (softcap > 0.0f) s = softcap * std::tanh(s / softcap);
        scores[j] = s;
        top = std::max(top, s);
      }
      float total = 0.0f;
      for (int64_t j = 0; j < m; ++j) {
        const float p = std::exp(scores[j] - top);
        total += p;
        const float* vj = values[j];
        for (int64_t d = 0; d < D; ++d) o[d] += p * vj[d];
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

ffi::Error PagedImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::F32> pool_k, ffi::Buffer<ffi::F32> pool_v, ffi::Buffer<ffi::S32> src,
                     ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> kv_pos, ffi::Buffer<ffi::S32> q_seg,
                     ffi::Buffer<ffi::S32> q_pos, ffi::ResultBuffer<ffi::F32> out, int64_t window,
                     float scale, float softcap) {
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 || pool_k.dimensions().size() != 2 ||
      src.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q, k, v [R, T, heads, D]; pools [kv_heads * S, D]; src [R, L]");
  Shapes n;
  n.R = q.dimensions()[0], n.T = q.dimensions()[1], n.H = q.dimensions()[2], n.D = q.dimensions()[3];
  n.KVH = k.dimensions()[2], n.L = src.dimensions()[1];
  if (n.KVH < 1 || n.H % n.KVH || k.dimensions()[0] != n.R || k.dimensions()[1] != n.T || k.dimensions()[3] != n.D ||
      pool_k.dimensions()[0] % n.KVH || pool_k.dimensions()[1] != n.D || src.dimensions()[0] != n.R)
    return ffi::Error::InvalidArgument("paged attention: the shapes do not match (heads, kv_heads, head_dim, rows)");
  n.S = pool_k.dimensions()[0] / n.KVH;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *pk = pool_k.typed_data(), *pv = pool_v.typed_data();
  const int32_t *sp = src.typed_data(), *ks = kv_seg.typed_data(), *kq = kv_pos.typed_data();
  const int32_t *qs = q_seg.typed_data(), *qq = q_pos.typed_data();
  for (int64_t i = 0; i < n.R * n.L; ++i)
    if (sp[i] < 0 || sp[i] >= n.S) return ffi::Error::InvalidArgument("paged attention: a history slot is outside the pool");
  int32_t max_seg = 0;
  for (int64_t i = 0; i < n.R * n.L; ++i) max_seg = std::max(max_seg, ks[i]);
  for (int64_t i = 0; i < n.R * n.T; ++i) max_seg = std::max(max_seg, qs[i]);
  for (int64_t i = 0; i < n.R * n.L; ++i)
    if (ks[i] < 0) return ffi::Error::InvalidArgument("paged attention: a negative segment id");
  for (int64_t i = 0; i < n.R * n.T; ++i)
    if (qs[i] < 0) return ffi::Error::InvalidArgument("paged attention: a negative segment id");
  if (max_seg > kMaxSegment) return ffi::Error::InvalidArgument("paged attention: segment ids above 65536");
  Groups hist, fresh;
  hist.Build(ks, n.R, n.L, max_seg);
  fresh.Build(qs, n.R, n.T, max_seg);
  float* op = out->typed_data();
  // Items are (row, kv head); the bytes read decide whether to split them over the workers.
  const int64_t items = n.R * n.KVH, bytes = items * (n.L + n.T) * n.D * 8;
  jaxformer::ParallelFor(items, bytes, [&](int64_t i0, int64_t i1) {
    std::vector<const float*> keys, values;
    keys.reserve(n.L + n.T);
    values.reserve(n.L + n.T);
    std::vector<float> scores(n.L + n.T), query(n.D);
    for (int64_t i = i0; i < i1; ++i)
      RowHead(n, i / n.KVH, i % n.KVH, qp, kp, vp, pk, pv, sp, kq, qs, qq, hist, fresh, op, window, scale,
              softcap, keys, values, scores, query);
  }, /*grain=*/1);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfPagedAttention, PagedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k (new)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v (new)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool_k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // src
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_seg
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_seg
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
