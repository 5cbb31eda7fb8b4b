// draftsmith_fp32: y = x W^T + b for the few rows of a decode or verify step, fp32 arithmetic, AVX2 + FMA (and F16C for fp16 panels)
// (serve_eval/prepack.py builds this file once per machine and loads it; see its docstring for why).
//
// pack(W [N, K]) -> [ceil(N / 16), K, 16]: the weight in panels of 16 output columns, each panel's
//   K x 16 block contiguous (the last panel zero-padded), so a panel streams from memory in one run.
// pack_half(W): the same panels in fp16, for a weight whose values are all fp16 ones (a checkpoint
//   saved in fp16 and served in fp32, the testbed target's): every kernel below widens each weight
//   to fp32 in a register (F16C `vcvtph2ps`, exact), so the products and their bits are those of the
//   fp32 panels, from half the bytes. The testbed target's 45 MB become 22.5, which fit the 32 MB L3
//   of the Zen 4 core beside the KV cache (reading 22.5 MB again and again 0.63 ms, 45 MB 2.02 ms).
// linear(x [.., K], packed, N, bias?, rows?, stream) -> [.., N]: for each panel, rows of x in tiles of up to 6; a tile
//   keeps its 6 x 16 partial sums in twelve 8-wide registers and, for k = 0 .. K-1, adds
//   x[r, k] * W[c, k] by one fused multiply-add per register. A 6-row tile does 12 FMAs per two loads
//   of the weight, enough to keep both FMA units busy, so a tile's products run near the core's
//   peak while the panel streams in; further tiles of the same panel read it from L1/L2.
//   The stream's software prefetch depends on the tile's height (`prefetch`): none for one or two
//   rows, whose loop runs ahead of memory and keeps the hardware prefetcher busy on its own; 16 KB
//   ahead for taller tiles, whose FMAs would otherwise take turns with the stream, into L2 from
//   four rows on, non-temporally (L1) for three. Measured on Zen 4 (the testbed target's 57 Linears
//   streamed from memory, 1 thread, variants alternated in one process): 5-6 rows with the L2 hint
//   cost what one row costs (1.82-2.19 ms against 2.39-2.88 with every tile non-temporal), one row
//   without a prefetch 1.69-2.07 against 2.13-2.30.
//   `stream` (a model whose Linears' weights together exceed the last-level cache, which every
//   forward then streams through it for nothing): one- and two-row tiles prefetch 4 k steps (256 B)
//   ahead non-temporally, so that the weights pass through L1 without being installed in L2 / L3 and
//   the step's other data (the KV cache, activations, small weights) stays cached from one forward
//   to the next. Zen 4, the testbed target (45 MB against a 32 MB L3), plain and speculative decoding
//   alternated prompt by prompt: plain decoding 3-18% faster (six A/Bs, median 7%; whole evals 11%)
//   though the 57 Linears alone stream 3% slower; taller tiles stay as they are (non-temporal at 256 B
//   to 16 KB ahead, speculative decoding ran 5-14% slower).
//   Past the full tiles, the last one or two rows of a taller call (7, 8, 13 rows ...) run across four
//   or two panels at once (`tile_across`), so that they too keep eight FMA chains busy.
//   Where the CPU has AVX-512, calls of 7 rows or more run taller tiles of 16-wide registers instead
//   (`wide_tile`: a batch's verify, several rows of several tokens).
//
// rows (int64 indices into x's rows, flattened): only those rows are computed (gathered, then written
//   back to their places); every other row of y is 0. A batch whose rows verify different numbers of
//   tokens pads them to one length (serve_eval/batch.py): the padding costs no multiply-adds, and its
//   outputs are finite.
//
// Invariant: every output y[r, c] is the same FMA chain over k = 0, 1, .., K-1 (then + b[c]), whatever
// the number of rows or the tile row r fell in, so a row's result does not depend on the rows beside it:
// a token verified among eight gets the same bits as the token decoded alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

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

// The same panels in fp16, for a weight whose every value is an fp16 one (checked by the caller): half
// the bytes to stream, the same fp32 products (each weight widened exactly in a register).
at::Tensor pack_half(const at::Tensor& weight) { return pack(weight).to(at::kHalf); }

constexpr int64_t kNear = 4;    // k steps ahead of the one read, for a streamed one- or two-row tile

// Eight weights as fp32: read as they are, or widened from fp16 (exact: every fp16 value is an fp32 one).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// The weight ahead of step k of a tile of R rows over `panel` (on into the next panel, which follows
// in memory; past the buffer's end a prefetch is a hint, never a fault); see the header.
template <int R, bool Stream, typename W>
inline void prefetch(const W* panel, int64_t k) {
  if constexpr (R >= 4) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kPanel), _MM_HINT_T1);
  else if constexpr (R == 3) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kPanel), _MM_HINT_NTA);
  else if constexpr (Stream) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kNear) * kPanel), _MM_HINT_NTA);
}

// Rows x[0..R) (row stride ldx) times one panel, into y[0..R) (row stride ldy), `cols` of the 16 columns.
template <int R, bool Stream, typename W>
inline void tile(const float* __restrict x, int64_t ldx, const W* __restrict panel, int64_t k_size,
                 float* __restrict y, int64_t ldy, int64_t cols, const float* __restrict bias) {
  // named registers, not an array: GCC keeps an array of __m256 in memory across the loop
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
  for (int64_t k = 0; k < k_size; ++k) {
    prefetch<R, Stream>(panel, k);
    const __m256 w0 = load8(panel + k * kPanel), w1 = load8(panel + k * kPanel + 8);
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

// The last one or two rows of a call taller than a tile (7, 8, 13, 14 rows ...) over G = 4 / R panels
// at once: eight independent FMA chains, as many as keep the FMA units busy. Over one panel such a
// tile has 2R, each waiting on its own latency: the testbed target's 57 Linears at 8 rows took 0.7 ms
// more than at 6. The panels were just read by the tall tiles: they come from L2, no prefetch.
template <int R, typename W>
inline void tile_across(const float* __restrict x, int64_t ldx, const W* __restrict panels, int64_t k_size,
                        float* __restrict y, int64_t ldy, const float* __restrict bias) {
  static_assert(R == 1 || R == 2, "one or two rows");
  constexpr int G = 4 / R;
  const int64_t stride = k_size * kPanel;  // from one panel to the next
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t k = 0; k < k_size; ++k) {
    const W* w = panels + k * kPanel;
    if constexpr (R == 1) {
      const __m256 b = _mm256_broadcast_ss(x + k);
      a0 = _mm256_fmadd_ps(b, load8(w), a0), a1 = _mm256_fmadd_ps(b, load8(w + 8), a1);
      a2 = _mm256_fmadd_ps(b, load8(w + stride), a2), a3 = _mm256_fmadd_ps(b, load8(w + stride + 8), a3);
      a4 = _mm256_fmadd_ps(b, load8(w + 2 * stride), a4), a5 = _mm256_fmadd_ps(b, load8(w + 2 * stride + 8), a5);
      a6 = _mm256_fmadd_ps(b, load8(w + 3 * stride), a6), a7 = _mm256_fmadd_ps(b, load8(w + 3 * stride + 8), a7);
    } else {
      const __m256 w00 = load8(w), w01 = load8(w + 8);
      const __m256 w10 = load8(w + stride), w11 = load8(w + stride + 8);
      const __m256 b0 = _mm256_broadcast_ss(x + k), b1 = _mm256_broadcast_ss(x + ldx + k);
      a0 = _mm256_fmadd_ps(b0, w00, a0), a1 = _mm256_fmadd_ps(b0, w01, a1);
      a2 = _mm256_fmadd_ps(b0, w10, a2), a3 = _mm256_fmadd_ps(b0, w11, a3);
      a4 = _mm256_fmadd_ps(b1, w00, a4), a5 = _mm256_fmadd_ps(b1, w01, a5);
      a6 = _mm256_fmadd_ps(b1, w10, a6), a7 = _mm256_fmadd_ps(b1, w11, a7);
    }
  }
  const __m256 sums[8] = {a0, a1, a2, a3, a4, a5, a6, a7};  // row r, panel g: sums[2 (r G + g)] and the next
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      alignas(32) float row[kPanel];
      _mm256_store_ps(row, sums[2 * (r * G + g)]);
      _mm256_store_ps(row + 8, sums[2 * (r * G + g) + 1]);
      float* out = y + r * ldy + g * kPanel;
      for (int64_t c = 0; c < kPanel; ++c) out[c] = bias ? row[c] + bias[g * kPanel + c] : row[c];
    }
  }
}

template <typename W>
using Tile = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int64_t, const float*);
template <typename W, bool S>  // S: one- and two-row tiles streamed
constexpr std::array<Tile<W>, kTile + 1> kTiles = {nullptr, tile<1, S, W>, tile<2, S, W>, tile<3, false, W>,
                                                   tile<4, false, W>, tile<5, false, W>, tile<6, false, W>};

// Where the CPU has AVX-512 (chosen at run time, the rest of the file needing AVX2 only): calls of
// kWideFrom rows or more run tiles of up to kWide rows over a panel, one 16-wide register per row
// (12 of 32 registers), so the panel is read once per 12 rows instead of once per 6 and the tiles' FMAs
// overlap its stream (prefetched into L2, as the tall tiles above do). Each lane is the same FMA chain
// as in `tile`: the same bits. The testbed target's 57 Linears streamed from memory (Zen 4, alternated
// in one process): 7 / 8 / 12 / 16 / 20 / 24 / 32 rows 2.54 / 2.59 / 3.25 / 4.14 / 5.09 / 5.88 / 7.74 ms on
// the tiles above, 2.16 / 2.31 / 3.00 / 3.93 / 4.73 / 5.60 / 7.35 on these (up to 16 or 24 rows a tile:
// slower past 16 rows). At 6 rows and fewer the tiles above stream as fast (2.44 against 2.50 ms at 6).
constexpr int kWide = 12, kWideFrom = 7;

__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int R, typename W>
__attribute__((target("avx512f"))) void wide_tile(const float* __restrict x, int64_t ldx, const W* __restrict panel,
                                                  int64_t k_size, float* __restrict y, int64_t ldy, int64_t cols,
                                                  const float* __restrict bias) {
  __m512 acc[R];  // fully unrolled below: GCC keeps these in registers
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kPanel), _MM_HINT_T1);
    const __m512 w = load16(panel + k * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[kPanel];
    _mm512_store_ps(row, acc[r]);
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = bias ? row[c] + bias[c] : row[c];
  }
}

template <typename W, int... I>
constexpr std::array<Tile<W>, sizeof...(I) + 1> wide_tiles(std::integer_sequence<int, I...>) {
  return {{nullptr, wide_tile<I + 1, W>...}};
}
template <typename W>
constexpr auto kWideTiles = wide_tiles<W>(std::make_integer_sequence<int, kWide>{});
bool has_wide() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  return has;
}

// y [rows, out_features] = x [rows, k_size] W^T (+ b), both contiguous; the weight's panels in fp32 or fp16
template <typename W>
void compute(const float* xp, int64_t rows, int64_t k_size, const W* wp, int64_t panels, int64_t out_features,
             const float* bp, float* yp, bool stream) {
  // rows [r, r + height) of panel p on `tile` (the last panel may hold fewer than 16 columns)
  auto run = [&](Tile<W> tile, int64_t p, int64_t r) {
    const int64_t c0 = p * kPanel;
    tile(xp + r * k_size, k_size, wp + p * k_size * kPanel, k_size, yp + r * out_features + c0, out_features,
         std::min(kPanel, out_features - c0), bp ? bp + c0 : nullptr);
  };
  if (rows >= kWideFrom && has_wide()) {  // tiles of up to kWide rows, as even as they split
    const int64_t count = (rows + kWide - 1) / kWide;
    at::parallel_for(0, panels, 16, [&](int64_t first, int64_t last) {
      for (int64_t p = first; p < last; ++p)
        for (int64_t t = 0, r = 0, height; t < count; ++t, r += height) {
          height = (rows - r) / (count - t);
          run(kWideTiles<W>[height], p, r);
        }
    });
    return;
  }
  // rows [0, upto) of panel p in tiles of up to kTile
  const Tile<W>* table = stream ? kTiles<W, true>.data() : kTiles<W, false>.data();
  auto tiles = [&](int64_t p, int64_t upto) {
    for (int64_t r = 0; r < upto; r += kTile) run(table[std::min<int64_t>(kTile, upto - r)], p, r);
  };
  // the rows past the full tiles, when one or two: over a group of whole panels at once (tile_across)
  const int64_t tall = rows / kTile * kTile, rest = rows - tall, whole = out_features / kPanel;
  const int64_t group = tall && rest && rest <= 2 ? 4 / rest : 1;
  at::parallel_for(0, panels, 16, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last;) {
      if (group == 1 || p + group > std::min(last, whole)) {
        tiles(p++, rows);
        continue;
      }
      for (int64_t q = p; q < p + group; ++q) tiles(q, tall);
      const float* xr = xp + tall * k_size;
      const W* wr = wp + p * k_size * kPanel;
      float* yr = yp + tall * out_features + p * kPanel;
      const float* br = bp ? bp + p * kPanel : nullptr;
      if (rest == 1) tile_across<1>(xr, k_size, wr, k_size, yr, out_features, br);
      else tile_across<2>(xr, k_size, wr, k_size, yr, out_features, br);
      p += group;
    }
  });
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& rows, bool stream) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kHalf),
              "draftsmith_fp32::linear: a float32 input and a float32 or float16 packed weight");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && input.size(-1) == packed.size(1)
              && (out_features + kPanel - 1) / kPanel == packed.size(0),
              "draftsmith_fp32::linear: input ", input.sizes(), " does not fit a packed weight ", packed.sizes(),
              " of ", out_features, " outputs");
  const auto x = input.contiguous();
  const int64_t k_size = x.size(-1), all = k_size ? x.numel() / k_size : 0, panels = packed.size(0);
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const float *xp = x.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto product = [&](const float* rows_x, int64_t m, float* rows_y) {  // m rows of x times the weight, in its format
    if (packed.scalar_type() == at::kHalf)
      compute(rows_x, m, k_size, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>()), panels, out_features, bp, rows_y, stream);
    else
      compute(rows_x, m, k_size, packed.data_ptr<float>(), panels, out_features, bp, rows_y, stream);
  };
  if (!rows.has_value() || !rows->defined()) {
    auto y = at::empty(shape, x.options());
    product(xp, all, y.data_ptr<float>());
    return y;
  }
  TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kLong, "draftsmith_fp32::linear: rows, a 1-d int64 tensor");
  const auto index = rows->contiguous();
  const int64_t* ip = index.data_ptr<int64_t>();
  const int64_t m = index.numel();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < all, "draftsmith_fp32::linear: row ", ip[i], " of ", all);
  auto gathered = at::empty({m, k_size}, x.options()), out = at::empty({m, out_features}, x.options());
  float *gp = gathered.data_ptr<float>(), *op = out.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) std::copy(xp + ip[i] * k_size, xp + (ip[i] + 1) * k_size, gp + i * k_size);
  product(gp, m, op);
  auto y = at::zeros(shape, x.options());
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) std::copy(op + i * out_features, op + (i + 1) * out_features, yp + ip[i] * out_features);
  return y;
}

}  // namespace

TORCH_LIBRARY(draftsmith_fp32, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("pack_half(Tensor weight) -> Tensor");
  m.def("linear(Tensor input, Tensor packed, int out_features, Tensor? bias, Tensor? rows=None, bool stream=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_fp32, CPU, m) {
  m.impl("pack", pack);
  m.impl("pack_half", pack_half);
  m.impl("linear", linear);
}
