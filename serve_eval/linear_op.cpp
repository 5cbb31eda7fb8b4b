// draftsmith_fp32: y = x W^T + b for the few rows of a decode or verify step, fp32, AVX2 + FMA
// (serve_eval/prepack.py builds this file once per machine and loads it; see its docstring for why).
//
// pack(W [N, K]) -> [ceil(N / 16), K, 16]: the weight in panels of 16 output columns, each panel's
//   K x 16 block contiguous (the last panel zero-padded), so a panel streams from memory in one run.
// linear(x [.., K], packed, N, bias?) -> [.., N]: for each panel, rows of x in tiles of up to 6; a tile
//   keeps its 6 x 16 partial sums in twelve 8-wide registers and, for k = 0 .. K-1, adds
//   x[r, k] * W[c, k] by one fused multiply-add per register. A 6-row tile does 12 FMAs per two loads
//   of the weight, enough to keep both FMA units busy, so a tile's products run near the core's
//   peak while the panel streams in (prefetched 16 KB ahead, so that loads and FMAs overlap, and
//   non-temporally, so that the stream does not evict what the rest of the step reuses); further
//   tiles of the same panel read it from L1/L2.
//
// Invariant: every output y[r, c] is the same FMA chain over k = 0, 1, .., K-1 (then + b[c]), whatever
// the number of rows or the tile row r fell in, so a row's result does not depend on the rows beside it:
// a token verified among eight gets the same bits as the token decoded alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: two 8-wide registers
constexpr int kTile = 6;        // rows per tile: 12 accumulators + 2 weights + 1 broadcast = 15 of 16 registers
constexpr int64_t kAhead = 256; // k steps of the weight prefetched ahead of the one read

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "draftsmith_fp32::pack: a 2-d float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

// Rows x[0..R) (row stride ldx) times one panel, into y[0..R) (row stride ldy), `cols` of the 16 columns.
template <int R>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t k_size,
                 float* __restrict y, int64_t ldy, int64_t cols, const float* __restrict bias) {
  // named registers, not an array: GCC keeps an array of __m256 in memory across the loop
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
  for (int64_t k = 0; k < k_size; ++k) {
    // 16 KB ahead (on into the next panel, which follows in memory): without it the FMAs of a tile and
    // the weight's stream take turns; a prefetch past the buffer's end is a hint, never a fault.
    // Non-temporal: the weights (45 MB on the testbed, more than the L3) stream through once a forward
    // and would only evict what the step reuses (the KV cache, the drafter's weights and code)
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kPanel), _MM_HINT_NTA);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    __m256 b = _mm256_broadcast_ss(x0 + k);
    a00 = _mm256_fmadd_ps(b, w0, a00), a01 = _mm256_fmadd_ps(b, w1, a01);
    if constexpr (R > 1) b = _mm256_broadcast_ss(x1 + k), a10 = _mm256_fmadd_ps(b, w0, a10), a11 = _mm256_fmadd_ps(b, w1, a11);
    if constexpr (R > 2) b = _mm256_broadcast_ss(x2 + k), a20 = _mm256_fmadd_ps(b, w0, a20), a21 = _mm256_fmadd_ps(b, w1, a21);
    if constexpr (R > 3) b = _mm256_broadcast_ss(x3 + k), a30 = _mm256_fmadd_ps(b, w0, a30), a31 = _mm256_fmadd_ps(b, w1, a31);
    if constexpr (R > 4) b = _mm256_broadcast_ss(x4 + k), a40 = _mm256_fmadd_ps(b, w0, a40), a41 = _mm256_fmadd_ps(b, w1, a41);
    if constexpr (R > 5) b = _mm256_broadcast_ss(x5 + k), a50 = _mm256_fmadd_ps(b, w0, a50), a51 = _mm256_fmadd_ps(b, w1, a51);
  }
  const __m256 sums[kTile][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) {
    alignas(32) float row[kPanel];
    _mm256_store_ps(row, sums[r][0]);
    _mm256_store_ps(row + 8, sums[r][1]);
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = bias ? row[c] + bias[c] : row[c];
  }
}

using Tile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*);
constexpr Tile kTiles[kTile + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "draftsmith_fp32::linear: float32 input and weight");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && input.size(-1) == packed.size(1)
              && (out_features + kPanel - 1) / kPanel == packed.size(0),
              "draftsmith_fp32::linear: input ", input.sizes(), " does not fit a packed weight ", packed.sizes(),
              " of ", out_features, " outputs");
  const auto x = input.contiguous();
  const int64_t k_size = x.size(-1), rows = k_size ? x.numel() / k_size : 0, panels = packed.size(0);
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  auto y = at::empty(shape, x.options());
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const float *xp = x.data_ptr<float>(), *wp = packed.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 16, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t c0 = p * kPanel, cols = std::min(kPanel, out_features - c0);
      for (int64_t r = 0; r < rows; r += kTile) {
        const int height = static_cast<int>(std::min<int64_t>(kTile, rows - r));
        kTiles[height](xp + r * k_size, k_size, wp + p * k_size * kPanel, k_size, yp + r * out_features + c0,
                       out_features, cols, bp ? bp + c0 : nullptr);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(draftsmith_fp32, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_fp32, CPU, m) {
  m.impl("pack", pack);
  m.impl("linear", linear);
}
