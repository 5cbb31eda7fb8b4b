// draftsmith_int8: y = x W^T + b for a drafter's Linears from int8 weight codes and int8 activations, on
// the CPU (serve_eval/int8.py builds this file once per machine and gives the math and its reasons).
//
// pack(C [N, K] int8) -> [ceil(N / 16), ceil(K / 4), 16, 4]: the codes in panels of 16 outputs, each
//   panel's k-groups of 4 contiguous (zero-padded), so a panel streams in one run and one 64-byte load
//   holds 4 inputs of 16 outputs: what one AVX-512 VNNI instruction (or two AVX2 ones) multiplies.
// linear(x [.., K] float, packed, colsum [N] int32, scale [N], bias?, N) -> [.., N] float:
//   1. per row r: step a_r = max_k |x_rk| / L, codes X_rk = round(x_rk / a_r) (half to even) in [-L, L], stored
//      as the unsigned bytes X + L + 1; a row of zeros (a padding row) is not multiplied: its outputs are the bias;
//   2. S_ro = sum_k X_rk C_ok, exact in int32 (|S| <= K 127^2), by one of two kernels chosen at run time:
//      - AVX-512 VNNI, L = 127: vpdpbusd multiplies the unsigned bytes X + 128 by the signed codes into
//        32 bits, 128 sum_k C_ok (colsum) subtracted afterwards;
//      - AVX2, L = 63 (7-bit activations, as fbgemm's AVX2 kernels take them): vpmaddubsw multiplies X + 64
//        (at most 127) by the codes into 16-bit pair sums, at most 2 * 127^2 < 2^15 (no saturation), and
//        vpmaddwd adds the pairs into 32 bits; 64 colsum subtracted afterwards. Eight bits would need the
//        sign moved onto the codes per row (vpsignb), 1.5x the time;
//   3. y_ro = ((float(S_ro) * a_r) * s_o) + b_o, each operation rounded on its own (built without
//      contraction into fused multiply-adds): exactly what torch computes from the same codes with
//      torch._int_mm (serve_eval/int8.py's fallback, L = 127, the VNNI kernel's bits; tests check both).
// Invariant: a row's outputs depend on that row alone (its own step, exact integer sums), not on the
// rows beside it in the call.
//
// The panel is prefetched 8 KB ahead of the loads into L2 (a drafter's weights come from memory after the
// target's forward has streamed through the caches; on Zen 4, right after a target forward, four of a
// draft's six products (fc, o, down, head) took 188-189 µs so against 247-251 prefetched into L1, 8 or
// 16 KB ahead alike), and rows are taken in tiles whose sums stay in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kOut = 16;      // outputs per panel
constexpr int64_t kGroup = 4;     // inputs per 32-bit lane
constexpr int64_t kAhead = 8192;  // bytes of the panel prefetched ahead of the ones read

bool cpu_has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
                          && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f");
  return yes;
}

std::atomic<bool> vnni_allowed{true};  // off: the AVX2 kernel serves (tests compare the two)

bool has_vnni() { return vnni_allowed.load(std::memory_order_relaxed) && cpu_has_vnni(); }

// Let the VNNI kernel serve (where the CPU has it) or not; returns the instruction set that now serves.
std::string allow_vnni(bool allow) {
  vnni_allowed = allow;
  return has_vnni() ? "avx512-vnni" : "avx2";
}

at::Tensor pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "draftsmith_int8::pack: 2-d int8 codes [out, in]");
  const int64_t n = codes.size(0), k = codes.size(1), panels = (n + kOut - 1) / kOut, groups = (k + kGroup - 1) / kGroup;
  auto padded = at::zeros({panels * kOut, groups * kGroup}, codes.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(codes);
  return padded.view({panels, kOut, groups, kGroup}).permute({0, 2, 1, 3}).contiguous();
}

inline int32_t word(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

// ---- AVX-512 VNNI: tiles of up to 8 rows by one or two panels, one 16-lane accumulator each ----
// x holds X + 128 as unsigned bytes, so each group is one vpdpbusd per row and panel.
template <int R, int P>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void tile_vnni(const int8_t* x, int64_t ldx, const int8_t* panel, int64_t groups, int32_t* out) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512i b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
  const int8_t* second = panel + groups * 64;  // the next panel follows in memory
  for (int64_t g = 0; g < groups; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(panel) + g * 64 + kAhead, _MM_HINT_T1);
    if constexpr (P > 1) _mm_prefetch(reinterpret_cast<const char*>(second) + g * 64 + kAhead, _MM_HINT_T1);
    const __m512i w = _mm512_loadu_si512(panel + g * 64);
    __m512i v = w;
    if constexpr (P > 1) v = _mm512_loadu_si512(second + g * 64);
    const int8_t* xg = x + g * kGroup;
#define DS_ROW(i, acc, bcc)                                          \
    if constexpr (R > i) {                                           \
      const __m512i u = _mm512_set1_epi32(word(xg + i * ldx));       \
      acc = _mm512_dpbusd_epi32(acc, u, w);                          \
      if constexpr (P > 1) bcc = _mm512_dpbusd_epi32(bcc, u, v);     \
    }
    DS_ROW(0, a0, b0) DS_ROW(1, a1, b1) DS_ROW(2, a2, b2) DS_ROW(3, a3, b3)
    DS_ROW(4, a4, b4) DS_ROW(5, a5, b5) DS_ROW(6, a6, b6) DS_ROW(7, a7, b7)
#undef DS_ROW
  }
  const __m512i sums[2][8] = {{a0, a1, a2, a3, a4, a5, a6, a7}, {b0, b1, b2, b3, b4, b5, b6, b7}};
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) _mm512_storeu_si512(out + (p * 8 + r) * kOut, sums[p][r]);
}

// ---- AVX2: tiles of up to 4 rows, two 8-lane accumulators each; x holds X + 64 (at most 127) ----
template <int R>
void tile_avx2(const int8_t* x, int64_t ldx, const int8_t* panel, int64_t groups, int32_t* out) {
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(panel) + g * 64 + kAhead, _MM_HINT_T1);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + g * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + g * 64 + 32));
    const int8_t* xg = x + g * kGroup;
#define DS_ROW(i, acc0, acc1)                                                                     \
    if constexpr (R > i) {                                                                        \
      const __m256i u = _mm256_set1_epi32(word(xg + i * ldx));                                    \
      acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_maddubs_epi16(u, w0), ones));        \
      acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_maddubs_epi16(u, w1), ones));        \
    }
    DS_ROW(0, a00, a01) DS_ROW(1, a10, a11) DS_ROW(2, a20, a21) DS_ROW(3, a30, a31)
#undef DS_ROW
  }
  // lane j of acc0 holds output j (of the first 8), of acc1 output 8 + j: the panel's order
  const __m256i sums[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * kOut), sums[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * kOut + 8), sums[r][1]);
  }
}

using Tile = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, int32_t*);
constexpr Tile kVnni[2][9] = {
    {nullptr, tile_vnni<1, 1>, tile_vnni<2, 1>, tile_vnni<3, 1>, tile_vnni<4, 1>, tile_vnni<5, 1>, tile_vnni<6, 1>,
     tile_vnni<7, 1>, tile_vnni<8, 1>},
    {nullptr, tile_vnni<1, 2>, tile_vnni<2, 2>, tile_vnni<3, 2>, tile_vnni<4, 2>, tile_vnni<5, 2>, tile_vnni<6, 2>,
     tile_vnni<7, 2>, tile_vnni<8, 2>}};
constexpr Tile kAvx2[5] = {nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>};

// Row r's step (its largest magnitude / levels) and codes X + levels + 1 as unsigned bytes (k_size inputs,
// then zeros up to the padded width: zero codes meet zero-padded weights); false for a row of zeros.
bool quantize(const float* x, int64_t k_size, uint8_t* q, int64_t width, float* step, int levels) {
  __m256 peak = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t k = 0;
  for (; k + 8 <= k_size; k += 8) peak = _mm256_max_ps(peak, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, peak);
  float m = 0.0f;
  for (float lane : lanes) m = std::max(m, lane);
  for (; k < k_size; ++k) m = std::max(m, std::fabs(x[k]));
  if (m == 0.0f) return false;  // (its slot goes to the next live row, which writes all of it)
  std::memset(q + k_size, 0, width - k_size);
  const float a = m / static_cast<float>(levels);
  *step = a;
  const __m256 av = _mm256_set1_ps(a);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(levels + 1));
  auto codes = [&](int64_t at) {
    return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + at), av), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  };
  for (k = 0; k + 32 <= k_size; k += 32) {  // 32 codes: packed 32 -> 16 -> 8 bits, then the lanes put in order
    const __m256i lo = _mm256_packs_epi32(codes(k), codes(k + 8)), hi = _mm256_packs_epi32(codes(k + 16), codes(k + 24));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);  // X, signed
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_add_epi8(bytes, offset));  // wraps to X + levels + 1
  }
  for (; k < k_size; ++k) q[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(x[k] / a)) + levels + 1);
  return true;
}

// out[c] = ((float(sums[c] - offset colsum[c]) a) s[c]) + b[c] for c < cols, each operation rounded on its own.
inline void rescale(const int32_t* sums, const int32_t* colsum, int32_t offset, float a, const float* s, const float* b,
                    float* out, int64_t cols) {
  int64_t c = 0;
  const __m256i off = _mm256_set1_epi32(offset);
  const __m256 av = _mm256_set1_ps(a);
  for (; c + 8 <= cols; c += 8) {
    const __m256i exact = _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + c)),
                                           _mm256_mullo_epi32(off, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(colsum + c))));
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(exact), av), _mm256_loadu_ps(s + c));
    if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + c));
    _mm256_storeu_ps(out + c, v);
  }
  for (; c < cols; ++c) {
    float v = static_cast<float>(sums[c] - offset * colsum[c]) * a;
    v = v * s[c];
    out[c] = b ? v + b[c] : v;
  }
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& colsum, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kChar && colsum.scalar_type() == at::kInt
              && scale.scalar_type() == at::kFloat, "draftsmith_int8::linear: float32 input, int8 panels, int32 colsum, float32 scale");
  const int64_t k_size = input.size(-1), panels = packed.size(0), groups = (k_size + kGroup - 1) / kGroup;
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) == groups && packed.size(2) == kOut && packed.size(3) == kGroup
              && (out_features + kOut - 1) / kOut == panels && colsum.numel() == out_features && scale.numel() == out_features,
              "draftsmith_int8::linear: input ", input.sizes(), " does not fit panels ", packed.sizes(), " of ", out_features, " outputs");
  const auto x = input.contiguous();
  const int64_t rows = k_size ? x.numel() / k_size : 0, width = groups * kGroup;
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  auto y = at::empty(shape, x.options());
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const float *xp = x.data_ptr<float>(), *sp = scale.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int32_t* cp = colsum.data_ptr<int32_t>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();

  // the rows' codes, the zero rows left out (their outputs: the bias)
  std::vector<uint8_t> q(rows * width);
  std::vector<float> steps(rows);
  std::vector<int64_t> live;
  live.reserve(rows);
  const bool vnni = has_vnni();
  const int levels = vnni ? 127 : 63;  // codes in [-levels, levels], stored offset by levels + 1
  for (int64_t r = 0; r < rows; ++r) {
    if (quantize(xp + r * k_size, k_size, q.data() + live.size() * width, width, &steps[live.size()], levels)) {
      live.push_back(r);
    } else {
      for (int64_t o = 0; o < out_features; ++o) yp[r * out_features + o] = bp ? 0.0f + bp[o] : 0.0f;
    }
  }
  const int64_t count = static_cast<int64_t>(live.size());
  const int tile = vnni ? 8 : 4, pair = vnni ? 2 : 1;  // rows a tile, panels a tile
  const int32_t offset = levels + 1;
  at::parallel_for(0, (panels + pair - 1) / pair, 8, [&](int64_t first, int64_t last) {
    alignas(64) int32_t sums[2 * 8 * kOut];
    for (int64_t p = first * pair; p < std::min(last * pair, panels); p += pair) {
      const int width_p = static_cast<int>(std::min<int64_t>(pair, panels - p));
      const int8_t* panel = wp + p * groups * kOut * kGroup;
      for (int64_t t = 0; t < count; t += tile) {
        const int height = static_cast<int>(std::min<int64_t>(tile, count - t));
        (vnni ? kVnni[width_p - 1] : kAvx2)[height](reinterpret_cast<const int8_t*>(q.data()) + t * width, width, panel,
                                                    groups, sums);
        for (int j = 0; j < width_p; ++j) {
          const int64_t o0 = (p + j) * kOut, cols = std::min(kOut, out_features - o0);
          for (int r = 0; r < height; ++r) {
            float* out = yp + live[t + r] * out_features + o0;
            const int32_t* s = sums + (j * 8 + r) * kOut;
            rescale(s, cp + o0, offset, steps[t + r], sp + o0, bp ? bp + o0 : nullptr, out, cols);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(draftsmith_int8, m) {
  m.def("pack(Tensor codes) -> Tensor");
  m.def("linear(Tensor input, Tensor packed, Tensor colsum, Tensor scale, Tensor? bias, int out_features) -> Tensor");
  m.def("allow_vnni(bool allow) -> str", allow_vnni);
}

TORCH_LIBRARY_IMPL(draftsmith_int8, CPU, m) {
  m.impl("pack", pack);
  m.impl("linear", linear);
}
