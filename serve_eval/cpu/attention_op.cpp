// draftsmith_attn: softmax(q k^T * scale + mask) v for the few queries of a decode or verify step, fp32,
// AVX2 + FMA (serve_eval/cpu/attention.py builds this file once per machine and loads it; see its docstring).
//
// attention(q [B, H, n, D], k [B, Hk, L, D], v [B, Hk, L, D], mask?, scale, causal) -> [B, n, H, D]
//   (the layout attention hands back to the model's output projection). Head h reads key/value head
//   h / (H / Hk). Each tensor may be any strided view whose last dimension is contiguous (the KV cache
//   hands a view of a larger buffer); D a multiple of 8. mask: [1 or B, 1 or H, n, L], bool (true:
//   attend) or float (added to the scores); or, with causal and no mask, query i sits at position
//   L - n + i and sees the positions up to it (a verify's chain: no mask built).
//
// Per (row b, head h), two passes over the cached positions, each reading them once from memory:
//   1. s[i, j] = dot(q_i, k_j) * scale (+ mask), eight keys at a time (eight independent FMA chains);
//      the values' rows are prefetched meanwhile, so that pass 2 finds them in cache;
//   2. p[i, j] = exp(s[i, j] - max_j s[i, j]) (masked: exactly 0), out_i = sum_j p[i, j] v_j / sum_j p[i, j].
// Invariant: every number in query i's output is computed by the same operations in the same order
// whatever the other queries are, so a token verified among eight gets the bits it gets decoded
// alone (as the Linears of linear_op.cpp do). A query that may attend nowhere gets zeros. Positions
// after the last one a bool mask shows a query are skipped for that query: in its sums they would add
// exactly +0 (so a batch's padding queries, which attend nowhere, cost next to nothing).
// exp is Cephes' single-precision polynomial (range reduction by ln 2, degree-6 minimax on
// [-ln2/2, ln2/2]): ~1 ulp, where torch's own flash kernel uses a coarser one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (a score minus its row's maximum); -inf (a masked score) gives exactly 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below, exp underflows float's normal range
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(masked, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

// out[0 .. 8C) = r * sum_j p[j] v[j, 0 .. 8C): one FMA chain per 8 channels, C independent chains
// (unrolled, so the accumulators stay in registers).
template <int C>
inline void weigh(const float* __restrict p, const float* __restrict v, int64_t sv, int64_t L, float r, float* __restrict out) {
  __m256 a[C];
#pragma GCC unroll 8
  for (int t = 0; t < C; ++t) a[t] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + j * sv;
#pragma GCC unroll 8
    for (int t = 0; t < C; ++t) a[t] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * t), a[t]);
  }
  const __m256 scale = _mm256_set1_ps(r);
#pragma GCC unroll 8
  for (int t = 0; t < C; ++t) _mm256_storeu_ps(out + 8 * t, _mm256_mul_ps(a[t], scale));
}

// The scores (unscaled) of query q against the 8 keys at k (row stride sk): one FMA chain per key over
// the channels, then a tree of horizontal adds; every key's sum goes through the same operations,
// whichever keys share its group.
inline __m256 scores8(const float* __restrict q, const float* __restrict k, int64_t sk, int64_t D) {
  const float *k0 = k, *k1 = k + sk, *k2 = k + 2 * sk, *k3 = k + 3 * sk, *k4 = k + 4 * sk, *k5 = k + 5 * sk,
              *k6 = k + 6 * sk, *k7 = k + 7 * sk;
  __m256 qc = _mm256_loadu_ps(q);
  __m256 a0 = _mm256_mul_ps(qc, _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(qc, _mm256_loadu_ps(k1));
  __m256 a2 = _mm256_mul_ps(qc, _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(qc, _mm256_loadu_ps(k3));
  __m256 a4 = _mm256_mul_ps(qc, _mm256_loadu_ps(k4)), a5 = _mm256_mul_ps(qc, _mm256_loadu_ps(k5));
  __m256 a6 = _mm256_mul_ps(qc, _mm256_loadu_ps(k6)), a7 = _mm256_mul_ps(qc, _mm256_loadu_ps(k7));
  for (int64_t c = 8; c < D; c += 8) {
    qc = _mm256_loadu_ps(q + c);
    a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + c), a0);
    a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k1 + c), a1);
    a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k2 + c), a2);
    a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k3 + c), a3);
    a4 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k4 + c), a4);
    a5 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k5 + c), a5);
    a6 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k6 + c), a6);
    a7 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k7 + c), a7);
  }
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // [0-3 low halves, 0-3 high]
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

// One (row, head): queries q (row stride sq), keys / values k, v (row stride sk, sv), L positions;
// mask row i at mask_b / mask_f + i * smi (element stride 1 along L) or none; out rows at stride so;
// query i reads the first seen[i] <= L positions only (the rest masked for it).
// s: scratch of n * (Lp + 1) floats, Lp = L rounded up to 8 (the scores, then each query's 1 / sum).
void head(const float* q, int64_t sq, const float* k, int64_t sk, const float* v, int64_t sv, int64_t n, int64_t L,
          int64_t D, float scale, const bool* mask_b, const float* mask_f, int64_t smi, float* out, int64_t so,
          float* s, int64_t Lp, const int64_t* seen) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const __m256 vscale = _mm256_set1_ps(scale), vninf = _mm256_set1_ps(ninf);
  float tail[8 * 256];  // the last group's keys, zero-padded to 8 (D <= 256)
  const int64_t full = L / 8 * 8;
  if (full < L) {
    std::fill(tail, tail + 8 * D, 0.0f);
    for (int64_t j = full; j < L; ++j) std::copy(k + j * sk, k + j * sk + D, tail + (j - full) * D);
  }
  bool prefetched = false;
  for (int64_t i = 0; i < n; ++i) {  // pass 1: scores, 8 keys at a time
    const float* qi = q + i * sq;
    float* si = s + i * Lp;
    const int64_t Li = (seen[i] + 7) / 8 * 8;
    const bool first = !prefetched && seen[i] == L;  // the first query that reads every position
    prefetched = prefetched || first;
    for (int64_t j = 0; j < Li; j += 8) {
      if (first)  // the values' rows, for pass 2
        for (int64_t t = j; t < std::min(j + 8, L); ++t)
          for (int64_t c = 0; c < D; c += 16) _mm_prefetch(reinterpret_cast<const char*>(v + t * sv + c), _MM_HINT_T0);
      __m256 x = _mm256_mul_ps(j < full ? scores8(qi, k + j * sk, sk, D) : scores8(qi, tail, D, D), vscale);
      if (mask_b) {  // bool: false -> -inf
        const __m256i m8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask_b + i * smi + j)));
        x = _mm256_blendv_ps(x, vninf, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m8, _mm256_setzero_si256())));
      } else if (mask_f) {
        x = _mm256_add_ps(x, _mm256_loadu_ps(mask_f + i * smi + j));
      }
      _mm256_storeu_ps(si + j, x);
    }
    for (int64_t j = seen[i]; j < Li; ++j) si[j] = ninf;  // past what the query sees (masked there already)
  }
  float* inv = s + n * Lp;
  for (int64_t i = 0; i < n; ++i) {  // softmax numerators and their sums
    float* si = s + i * Lp;
    const int64_t Li = (seen[i] + 7) / 8 * 8;
    __m256 m = _mm256_set1_ps(ninf);
    for (int64_t j = 0; j < Li; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(si + j));
    const float top = hmax(m);
    if (top == ninf) {  // attends nowhere
      for (int64_t j = 0; j < Li; ++j) si[j] = 0.0f;
      inv[i] = 0.0f;
      continue;
    }
    const __m256 t = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < Li; j += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(si + j), t));
      _mm256_storeu_ps(si + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    inv[i] = 1.0f / hsum(sum);
  }
  for (int64_t i = 0; i < n; ++i) {  // pass 2 (the values from L1/L2 after the first query)
    const float *pi = s + i * Lp, r = inv[i];
    float* oi = out + i * so;
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) weigh<8>(pi, v + c, sv, seen[i], r, oi + c);
    for (; c + 32 <= D; c += 32) weigh<4>(pi, v + c, sv, seen[i], r, oi + c);
    for (; c < D; c += 8) weigh<1>(pi, v + c, sv, seen[i], r, oi + c);
  }
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     double scale, bool causal) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "draftsmith_attn::attention: q, k, v of 4 dimensions");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "draftsmith_attn::attention: float32 q, k, v");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3), Hk = k.size(1), L = k.size(2);
  TORCH_CHECK(D % 8 == 0 && D <= 256 && k.size(3) == D && v.size(3) == D,
              "draftsmith_attn::attention: a head size that is a multiple of 8, at most 256");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hk && v.size(2) == L && Hk > 0 && H % Hk == 0,
              "draftsmith_attn::attention: k, v of shape [B, Hk, L, D] with H a multiple of Hk");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "draftsmith_attn::attention: a contiguous last dimension");
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(2) == n && mask->size(3) == L && (mask->size(0) == 1 || mask->size(0) == B)
                    && (mask->size(1) == 1 || mask->size(1) == H),
                "draftsmith_attn::attention: a mask of shape [1 or B, 1 or H, n, L]");
    TORCH_CHECK(mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat, "draftsmith_attn::attention: a bool or float32 mask");
    m = mask->stride(3) == 1 ? *mask : mask->contiguous();
  }
  TORCH_CHECK(!(causal && m.defined()), "draftsmith_attn::attention: a mask or causal, not both");
  TORCH_CHECK(!causal || n <= L, "draftsmith_attn::attention: causal with more queries than positions");
  auto out = at::empty({B, n, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool* mb = m.defined() && m.scalar_type() == at::kBool ? m.data_ptr<bool>() : nullptr;
  const float* mf = m.defined() && m.scalar_type() == at::kFloat ? m.data_ptr<float>() : nullptr;
  const int64_t smb = m.defined() && m.size(0) > 1 ? m.stride(0) : 0, smh = m.defined() && m.size(1) > 1 ? m.stride(1) : 0;
  const int64_t smi = m.defined() ? m.stride(2) : 0, Lp = (L + 7) / 8 * 8, group = H / Hk;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scratch(n * (Lp + 1));
    std::vector<int64_t> seen(n, L);
    if (causal)  // query i sits at position L - n + i and sees the positions up to it
      for (int64_t i = 0; i < n; ++i) seen[i] = L - n + i + 1;
    for (int64_t bh = first; bh < last; ++bh) {
      const int64_t b = bh / H, h = bh % H, hk = h / group;
      const int64_t mo = b * smb + h * smh;
      // Positions after the last one a bool mask lets a query see are not read for it: each would add
      // exactly +0 to its sums (a compiled draft's cache buffers are longer than its context; a batch's
      // padding queries see nothing)
      int64_t all = L;
      if (mb) {
        all = 0;
        for (int64_t i = 0; i < n; ++i) {
          const bool* row = mb + mo + i * smi;
          int64_t j = L;
          while (j > 0 && !row[j - 1]) --j;
          seen[i] = j;
          all = std::max(all, j);
        }
      }
      head(qp + b * q.stride(0) + h * q.stride(1), q.stride(2), kp + b * k.stride(0) + hk * k.stride(1), k.stride(2),
           vp + b * v.stride(0) + hk * v.stride(1), v.stride(2), n, all, D, sc, mb ? mb + mo : nullptr, mf ? mf + mo : nullptr,
           smi, op + (b * n * H + h) * D, H * D, scratch.data(), (all + 7) / 8 * 8, seen.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(draftsmith_attn, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_attn, CPU, m) {
  m.impl("attention", attention);
}
