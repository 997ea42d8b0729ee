// y = x @ w.T (+ bias) on weights packed once into panels of 16 output features, for the CPU
// products oneDNN does slowly here: bf16 weights on CPUs without bf16 arithmetic (AVX2 hosts),
// small batches of bf16 where it has some, and fp32 weights (AVX2 and AVX-512 hosts).
//
// A small batch's forward pass streams every weight once, so its time is the weights' bytes
// over memory bandwidth: bfloat16 weights halve it against float32. oneDNN has no bfloat16
// kernels for such CPUs (torch's fallback streamed them at ~9 GB/s, slower than float32), so
// this kernel widens each weight to float32 in registers as it streams past and does the
// products in float32.
//
// The weight is packed once (pack_weight) into panels of 16 output features,
// [out / 16][in][16]: a panel row is one 32-byte load. The micro-kernel keeps a 6 x 16 tile of
// the output in 12 registers; per input feature it loads one panel row (16 weights, widened),
// broadcasts 6 activations and does 12 fused multiply-adds, the classic GEMM register tile.
// Panels are split between threads (OpenMP); every row of x is applied to a panel while it is
// in cache, so each weight is read from memory once per call.
//
// Every output is summed in one order whatever the batch: the even input features in one chain,
// the odd ones in another, then the two added. A row's result is therefore the same bits alone
// or in a tile of six, which is what makes greedy decoding batch-invariant (docs/ARCHITECTURE.md).
//
// Built for a CPU with AVX512-BF16 (cpu_kernels selects the flags), bf16 activations take the
// hardware's bf16 dot products instead: one instruction multiplies a pair of input features by
// 16 outputs' pair of weights and adds both to fp32 sums, twice the products per cycle of the
// widening FMA path, with no widening. The panels then hold each pair of input features
// together, [out / 16][in / 2][16][2] (same size and shape), two panels at a time interleaved
// pair by pair (kPairPanels), and a tile is 12 rows x 32 outputs (a group of two panels), 24
// sums in registers. Each output is still one chain in one order (pairs of
// features in turn) whatever the rows or panels beside it, so batch invariance holds; its bits
// differ from the FMA path's, as any other CPU's kernel does. Used where oneDNN's bf16 products
// are (AVX512-BF16 hosts), for a batch-invariant step's products at every row count: at 16 rows
// the FMA path was 2.25x slower than oneDNN there.
//
// On AMX hosts the pair panels also feed oneDNN's AMX micro-kernel (tile_unit_linear, below): a
// group of two is its 32-column right-hand side's layout as it stands.
//
// fp32 weights (fp32_tile) take the same tile with one chain per output, the features in order:
// a panel row is two 32-byte loads, read front to back, and even one row is bound by memory, not
// by the chain's latency. oneDNN's fp32 products on an AVX2 host (Zen 3 EPYC, 2 threads) were
// slow at the few rows of decoding: the default model's products of one step (540 MB of
// weights), oneDNN against the panels, 1 / 16 / 64 / 512 rows 31.9 / 64.7 / 142.3 / 945.9 ms
// against 25.0 / 45.6 / 120.4 / 861.2 (splitting the features into blocks of 128-512 to keep a
// panel's block in L1 was slower at every count). Built with AVX-512, fp32 products take a
// 16-wide tile of 12 rows x 2 panels (fp32_wide_tile), the same chains: 0.7x oneDNN's time at a
// decode's few rows on an AVX-512 Xeon, level at 512 (blocking the features or the rows, or
// packing a tile's rows of x together, did not help there).
//
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "fp32_panel_tile.h"
#include "row_count.h"

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
static_assert(kPanel == kFp32PanelOutputs, "the fp32 tile's panels are these");
constexpr int64_t kTileRows = 6;  // rows of x per micro-kernel call
// Panels per bf16 dot-product tile, and per group of the pair layout: pack_weight stores a
// group's two panels interleaved by pair of input features ([in / 2][2][16][2]: each pair's 128
// bytes hold both panels' rows), so a tile streams one run of memory rather than two 18 KB
// apart, which the hardware's prefetcher follows; a lone last panel stays [in / 2][16][2]. One
// step's products of the default model, every layer and the head (270 MB), one thread of a Zen 4
// EPYC, the two layouts timed in turn: 1 / 4 / 8 rows 12.9 / 13.5 / 12.2 -> 9.8 / 10.3 / 11.0
// ms (16 and 64 rows level); two threads 8.9 / 10.8 / 8.9 / 13.1 -> 8.5 / 9.2 / 7.9 / 11.9 ms
// at 1 / 4 / 8 / 16 rows (64 level).
constexpr int64_t kPairPanels = 2;

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

#ifdef __AVX2__
inline __m256 widen(__m128i raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)); }

// out[r, 0:16] = x[r, :] . panel for r < Rows (<= kTileRows). The accumulators are named
// variables, not an array: GCC kept an array of vectors in memory, storing all twelve every
// step (3x slower from 6 rows). With 2 rows or fewer, two input features go per step into two
// sets of accumulators (rows r and r + 3, the even and the odd chain), so that a one-row product
// (one decode) is not bound by the latency of one chain of fused multiply-adds. Three rows and
// more would need more than 16 registers for both chains at once, so they run the even chain
// over the panel, set its sums aside, then the odd chain: the same sums in the same order.
template <int Rows>
void tile(const uint16_t* panel, const float* x, int64_t k, int64_t x_stride, float* out, int64_t out_stride) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0, l4 = l0,
         h4 = l0, l5 = l0, h5 = l0;
#define CACHET_FMA(r, acc, feature, w_low, w_high)                    \
  {                                                                   \
    const __m256 a = _mm256_broadcast_ss(x + r * x_stride + feature); \
    l##acc = _mm256_fmadd_ps(a, w_low, l##acc);                       \
    h##acc = _mm256_fmadd_ps(a, w_high, h##acc);                      \
  }
  int64_t i = 0;
  if constexpr (Rows <= 2) {
    for (; i + 2 <= k; i += 2) {
      const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + i * kPanel));
      const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (i + 1) * kPanel));
      const __m256 e_low = widen(_mm256_castsi256_si128(even)), e_high = widen(_mm256_extracti128_si256(even, 1));
      const __m256 o_low = widen(_mm256_castsi256_si128(odd)), o_high = widen(_mm256_extracti128_si256(odd, 1));
      CACHET_FMA(0, 0, i, e_low, e_high)
      CACHET_FMA(0, 3, i + 1, o_low, o_high)
      if constexpr (Rows > 1) {
        CACHET_FMA(1, 1, i, e_low, e_high)
        CACHET_FMA(1, 4, i + 1, o_low, o_high)
      }
    }
    // k odd: its last feature is even, and ends the even chain.
    for (; i < k; ++i) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + i * kPanel));
      const __m256 w_low = widen(_mm256_castsi256_si128(raw)), w_high = widen(_mm256_extracti128_si256(raw, 1));
      CACHET_FMA(0, 0, i, w_low, w_high)
      if constexpr (Rows > 1) CACHET_FMA(1, 1, i, w_low, w_high)
    }
    l0 = _mm256_add_ps(l0, l3), h0 = _mm256_add_ps(h0, h3);
    l1 = _mm256_add_ps(l1, l4), h1 = _mm256_add_ps(h1, h4);
  } else {
    alignas(32) float even[Rows][kPanel];
    for (int64_t parity = 0; parity < 2; ++parity) {
      for (i = parity; i < k; i += 2) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + i * kPanel));
        const __m256 w_low = widen(_mm256_castsi256_si128(raw)), w_high = widen(_mm256_extracti128_si256(raw, 1));
        CACHET_FMA(0, 0, i, w_low, w_high)
        CACHET_FMA(1, 1, i, w_low, w_high)
        CACHET_FMA(2, 2, i, w_low, w_high)
        if constexpr (Rows > 3) CACHET_FMA(3, 3, i, w_low, w_high)
        if constexpr (Rows > 4) CACHET_FMA(4, 4, i, w_low, w_high)
        if constexpr (Rows > 5) CACHET_FMA(5, 5, i, w_low, w_high)
      }
      if (parity == 0) {
#define CACHET_SET_ASIDE(r)                                 \
  if constexpr (Rows > r) {                                 \
    _mm256_store_ps(even[r], l##r);                         \
    _mm256_store_ps(even[r] + 8, h##r);                     \
    l##r = _mm256_setzero_ps(), h##r = _mm256_setzero_ps(); \
  }
        CACHET_SET_ASIDE(0) CACHET_SET_ASIDE(1) CACHET_SET_ASIDE(2) CACHET_SET_ASIDE(3) CACHET_SET_ASIDE(4)
        CACHET_SET_ASIDE(5)
#undef CACHET_SET_ASIDE
      }
    }
#define CACHET_JOIN(r)                                          \
  if constexpr (Rows > r) {                                     \
    l##r = _mm256_add_ps(_mm256_load_ps(even[r]), l##r);        \
    h##r = _mm256_add_ps(_mm256_load_ps(even[r] + 8), h##r);    \
  }
    CACHET_JOIN(0) CACHET_JOIN(1) CACHET_JOIN(2) CACHET_JOIN(3) CACHET_JOIN(4) CACHET_JOIN(5)
#undef CACHET_JOIN
  }
#undef CACHET_FMA
  CACHET_STORE_TILE_ROWS(out, out_stride)
}
#endif

void tile_any(const uint16_t* panel, const float* x, int64_t rows, int64_t k, int64_t x_stride, float* out,
              int64_t out_stride) {
#ifdef __AVX2__
  for_row_count<kTileRows>(rows, [&]<int Rows>() { tile<Rows>(panel, x, k, x_stride, out, out_stride); });
#else
  for (int64_t r = 0; r < rows; ++r) {
    float sums[kPanel] = {};
    for (int64_t i = 0; i < k; ++i) {
      const float a = x[r * x_stride + i];
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) sums[j] += a * bf16_to_float(panel[i * kPanel + j]);
    }
    std::memcpy(out + r * out_stride, sums, sizeof(sums));
  }
#endif
}

#ifndef __AVX512F__  // an AVX-512 build's fp32 products take the 16-wide tile below
void fp32_tile_any(const float* panel, const float* x, int64_t rows, int64_t k, int64_t x_stride, float* out,
                   int64_t out_stride, const float* ahead) {
  for_row_count<kFp32PanelTileRows>(rows, [&]<int Rows>() {
    fp32_panel_tile<Rows>(panel, x, k, x_stride, out, out_stride, ahead);
  });
}
#endif

#ifdef __AVX512F__
#define CACHET_FP32_WIDE 1

// Stores row r of a 16-wide tile: its sums of the first panel in a<r>, of the second in b<r>.
#define CACHET_STORE_PANELS(r)                                                       \
  if constexpr (Rows > r) {                                                          \
    _mm512_storeu_ps(out + r * out_stride, a##r);                                    \
    if constexpr (Panels > 1) _mm512_storeu_ps(out + r * out_stride + kPanel, b##r); \
  }

// With AVX-512 a panel row of fp32 weights is one register, and 32 registers hold a tile of
// 12 rows x 2 panels: per input feature 2 weight loads and 12 broadcasts feed 24 fused
// multiply-adds, where the 8-wide tile's 6 x 1 panel fed 12 from 2 loads and 6 broadcasts,
// twice the products per cycle. Each output is still one chain over the features in order, so
// a row's bits are the 8-wide tile's, at every row count.
constexpr int64_t kWideTileRows = 12;
constexpr int64_t kWidePanels = 2;

// out[r, 0:16 * Panels] = x[r, :] . panels for r < Rows (<= kWideTileRows); `panel`: a group of
// two panels interleaved by input feature ([in][2][16], pack_weight), or a lone one. Read as one
// stream rather than two 36 KB apart: one step's products of the default model (540 MB), a Zen 4
// EPYC, the two layouts in turn, one thread 1 / 4 / 16 rows 22.3 / 25.4 / 46.1 -> 21.7 / 20.6 /
// 43.3 ms, two threads 19.0 / 18.9 / 25.8 -> 17.3 / 17.1 / 22.5 ms. `ahead`: where the weights
// asked for into L2 as these panels stream start (laid out as these), or null.
template <int Rows, int Panels>
void fp32_wide_tile(const float* panel, const float* x, int64_t k, int64_t x_stride,
                    float* out, int64_t out_stride, const float* ahead) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
         a9 = a0, a10 = a0, a11 = a0;
  __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0, b8 = a0, b9 = a0, b10 = a0,
         b11 = a0;
  for (int64_t i = 0; i < k; ++i) {
    if (ahead != nullptr) {
      __builtin_prefetch(ahead + i * Panels * kPanel, 0, 2);
      if constexpr (Panels > 1) __builtin_prefetch(ahead + i * Panels * kPanel + kPanel, 0, 2);
    }
    const __m512 w0 = _mm512_loadu_ps(panel + i * Panels * kPanel);
    __m512 w1 = w0;
    if constexpr (Panels > 1) w1 = _mm512_loadu_ps(panel + i * Panels * kPanel + kPanel);
#define CACHET_FMA(r)                                              \
  if constexpr (Rows > r) {                                        \
    const __m512 xr = _mm512_set1_ps(x[r * x_stride + i]);         \
    a##r = _mm512_fmadd_ps(xr, w0, a##r);                          \
    if constexpr (Panels > 1) b##r = _mm512_fmadd_ps(xr, w1, b##r); \
  }
    CACHET_FMA(0) CACHET_FMA(1) CACHET_FMA(2) CACHET_FMA(3) CACHET_FMA(4) CACHET_FMA(5) CACHET_FMA(6)
    CACHET_FMA(7) CACHET_FMA(8) CACHET_FMA(9) CACHET_FMA(10) CACHET_FMA(11)
#undef CACHET_FMA
  }
  CACHET_STORE_PANELS(0) CACHET_STORE_PANELS(1) CACHET_STORE_PANELS(2) CACHET_STORE_PANELS(3)
  CACHET_STORE_PANELS(4) CACHET_STORE_PANELS(5) CACHET_STORE_PANELS(6) CACHET_STORE_PANELS(7)
  CACHET_STORE_PANELS(8) CACHET_STORE_PANELS(9) CACHET_STORE_PANELS(10) CACHET_STORE_PANELS(11)
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define CACHET_DPBF16 1

// Fewest rows whose tiles ask for the next group's weights as they go (`next` below), which
// depends on the CPU's own prefetcher. On AMD's (a Zen 4 EPYC) the prefetcher alone keeps up
// with the one stream at a few rows, and the asks got in its way (one thread, 1 / 2 / 4 rows
// 9.8 / 9.8 / 10.3 ms without them, 13.6 with them at 2); from 8 rows they pay (13.3 -> 10.8 ms
// at 8, 19.1 -> 16.6 at 12), level at 6. On Intel's (an AMX Xeon, family 6 model 207) they pay
// at every count: 1 / 2 / 4 rows 33.1 / 37.6 / 46.6 -> 21.7 / 24.1 / 27.5 ms on one thread, 20.4
// / 24.4 / 27.2 -> 14.8 / 16.2 / 17.2 on two, level at 8 (a VM reading ~11 GB/s on two cores).
int64_t pair_prefetch_rows() {
  static const int64_t rows = __builtin_cpu_is("amd") ? 5 : 1;
  return rows;
}
// Rows of x per bf16 dot-product tile: 24 sums in 32 registers, each panel row loaded once for
// twice the rows of the widening tiles. Against 6 rows, one step's products of the default
// model's layers (head apart), 2 threads of a Zen 5: 0.91 / 0.83 / 0.89 / 0.88 / 0.91x the time
// at 16 / 32 / 64 / 128 / 512 rows (level with oneDNN's bf16 products at 512, from 1.13x).
constexpr int64_t kPairTileRows = 12;

// 16 fp32 sums rounded to bf16 (to nearest, ties to even, as torch rounds; fp32 denormals, which
// torch would keep as bf16 denormals, become zero).
inline void store_bf16(at::BFloat16* to, __m512 sums) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), (__m256i)_mm512_cvtneps_pbh(sums));
}

// Row r of a pair tile: its fp32 sums (plus the bias, where there is one) rounded to bf16 once.
#define CACHET_STORE_PAIR_ROW(r)                                                                 \
  if constexpr (Rows > r) {                                                                      \
    store_bf16(out + r * out_stride, bias == nullptr ? a##r : _mm512_add_ps(a##r, bias0));       \
    if constexpr (Panels > 1)                                                                    \
      store_bf16(out + r * out_stride + kPanel, bias == nullptr ? b##r : _mm512_add_ps(b##r, bias1)); \
  }

// out[r, 0:16 * Panels] = x[r, :] . panels (+ bias), for r < Rows (<= kPairTileRows), in bf16; x
// is bf16, k even; `panel`: a group of two interleaved panels (Panels 2) or a lone one. `bias`:
// the tile's first output's bias in fp32, or null. `next`: where the next group's weights start
// (a group of the same shape), asked for into L2 while this one computes, or null.
template <int Rows, int Panels>
void pair_tile(const uint16_t* panel, const uint16_t* x, int64_t k, int64_t x_stride, at::BFloat16* out,
               int64_t out_stride, const float* bias, const uint16_t* next) {
  // A pair of input features' row of one panel: 16 outputs x 2, 32 bf16s (64 bytes); a group's
  // second panel's row follows its first's.
  constexpr int64_t kPairRow = 2 * kPanel;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
  __m512 a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
  __m512 b6 = a0, b7 = a0, b8 = a0, b9 = a0, b10 = a0, b11 = a0;
  for (int64_t i = 0; i < k; i += 2) {
    const uint16_t* row = panel + i / 2 * Panels * kPairRow;
    if (next != nullptr) {
      __builtin_prefetch(next + i / 2 * Panels * kPairRow, 0, 2);
      if constexpr (Panels > 1) __builtin_prefetch(next + i / 2 * Panels * kPairRow + kPairRow, 0, 2);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row);
    __m512bh w1 = w0;
    if constexpr (Panels > 1) w1 = (__m512bh)_mm512_loadu_si512(row + kPairRow);
#define CACHET_DOT(r)                                           \
  if constexpr (Rows > r) {                                     \
    int32_t pair;                                               \
    std::memcpy(&pair, x + r * x_stride + i, sizeof(pair));     \
    const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);      \
    a##r = _mm512_dpbf16_ps(a##r, xr, w0);                      \
    if constexpr (Panels > 1) b##r = _mm512_dpbf16_ps(b##r, xr, w1); \
  }
    CACHET_DOT(0) CACHET_DOT(1) CACHET_DOT(2) CACHET_DOT(3) CACHET_DOT(4) CACHET_DOT(5)
    CACHET_DOT(6) CACHET_DOT(7) CACHET_DOT(8) CACHET_DOT(9) CACHET_DOT(10) CACHET_DOT(11)
#undef CACHET_DOT
  }
  const __m512 bias0 = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
  __m512 bias1 = bias0;
  if constexpr (Panels > 1) bias1 = bias == nullptr ? bias0 : _mm512_loadu_ps(bias + kPanel);
  CACHET_STORE_PAIR_ROW(0) CACHET_STORE_PAIR_ROW(1) CACHET_STORE_PAIR_ROW(2) CACHET_STORE_PAIR_ROW(3)
  CACHET_STORE_PAIR_ROW(4) CACHET_STORE_PAIR_ROW(5) CACHET_STORE_PAIR_ROW(6) CACHET_STORE_PAIR_ROW(7)
  CACHET_STORE_PAIR_ROW(8) CACHET_STORE_PAIR_ROW(9) CACHET_STORE_PAIR_ROW(10) CACHET_STORE_PAIR_ROW(11)
}
#undef CACHET_STORE_PAIR_ROW
#endif

// Whether this build packs a weight of ``k`` input features in pairs (its bf16 dot products).
bool packs_pairs(int64_t k) {
#ifdef CACHET_DPBF16
  return k % 2 == 0;
#else
  (void)k;
  return false;
#endif
}

// x @ w.T (+ bias) on weights packed in pairs, summed in fp32; x: [m, k]. The result in x's dtype.
torch::Tensor pair_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const int64_t panels = packed.size(0), k = packed.size(1), n = panels * kPanel, m = x.size(0);
  const bool with_bias = bias.has_value() && bias->defined();
#ifdef CACHET_DPBF16
  if (x.scalar_type() == torch::kBFloat16) {
    // The result in bf16 straight from the tiles, each sum rounded once as the fp32 result's
    // conversion rounded it: a pass over the output and an operator call fewer per product (121
    // a decode step of the default model).
    const torch::Tensor rows = x.contiguous();
    torch::Tensor out = torch::empty({m, n}, rows.options());
    const torch::Tensor bias_sums = with_bias ? bias->to(torch::kFloat32).contiguous() : torch::Tensor();
    const float* biases = with_bias ? bias_sums.data_ptr<float>() : nullptr;
    const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
    const auto* xs = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
    at::BFloat16* ys = out.data_ptr<at::BFloat16>();
    const int64_t groups = (panels + kPairPanels - 1) / kPairPanels;
    // Each tile of a group asks for the next group's weights as it goes (from
    // pair_prefetch_rows() rows): with more rows than one tile, the later tiles computed from cache
    // while memory sat idle, and asking in the first tile alone left most of the asks waiting
    // behind each other. The default model's products of one step, every layer's weights and the
    // head (270 MB), in turn (the panels apart, then): 16 rows 11.4 -> 9.2 ms (23 -> 29 GB/s), 8
    // rows 10.3 -> 8.0, 4 rows 8.4 -> 7.1. Two groups ahead was slower.
    const bool ask_ahead = m >= pair_prefetch_rows();
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p = g * kPairPanels;
      const uint16_t* panel = w + p * k * kPanel;
      const uint16_t* next = ask_ahead && p + 2 * kPairPanels <= panels ? panel + kPairPanels * k * kPanel : nullptr;
      const float* tile_bias = biases == nullptr ? nullptr : biases + p * kPanel;
      for (int64_t r = 0; r < m; r += kPairTileRows) {
        const int64_t tile_rows = std::min(kPairTileRows, m - r);
        at::BFloat16* tile_out = ys + r * n + p * kPanel;
        const bool both = panels - p >= 2;
        for_row_count<kPairTileRows>(tile_rows, [&]<int Rows>() {
          if (both) {
            pair_tile<Rows, 2>(panel, xs + r * k, k, k, tile_out, n, tile_bias, next);
          } else {
            pair_tile<Rows, 1>(panel, xs + r * k, k, k, tile_out, n, tile_bias, nullptr);
          }
        });
      }
    }
    return out;
  }
#endif
  // Activations in fp32 (never the engine's: its bf16 models' are bf16) keep their precision,
  // in one order per output too (pairs of features in turn), slowly: no dot-product instruction.
  const torch::Tensor rows = x.to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty({m, n}, rows.options());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* xs = rows.data_ptr<float>();
  float* ys = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    // Where panel p's first pair row is, and how far apart its rows are (pack_weight's groups).
    const bool grouped = p / kPairPanels * kPairPanels + kPairPanels <= panels;
    const uint16_t* panel = w + p / kPairPanels * kPairPanels * k * kPanel + (grouped ? p % kPairPanels * 2 * kPanel : 0);
    const int64_t row_stride = (grouped ? kPairPanels : 1) * 2 * kPanel;
    for (int64_t r = 0; r < m; ++r) {
      float sums[kPanel] = {};
      for (int64_t i = 0; i < k; i += 2) {
        const float even = xs[r * k + i], odd = xs[r * k + i + 1];
        const uint16_t* row = panel + i / 2 * row_stride;
        for (int64_t j = 0; j < kPanel; ++j) {
          sums[j] += even * bf16_to_float(row[2 * j]) + odd * bf16_to_float(row[2 * j + 1]);
        }
      }
      std::memcpy(ys + r * n + p * kPanel, sums, sizeof(sums));
    }
  }
  if (with_bias) out.add_(bias->to(torch::kFloat32));
  return out;
}

// [out, in] -> [out / 16, in, 16]: groups of `group` panels interleaved by runs of `run` input
// features ([in / run][group][16][run]), so that a tile reading a group streams one run of
// memory; a lone last panel (out not a multiple of the group) is [in / run][16][run]. One panel
// a group and one feature a run are the plain panels.
torch::Tensor interleaved_panels(const torch::Tensor& weight, int64_t group, int64_t run) {
  const int64_t out = weight.size(0), k = weight.size(1);
  const int64_t whole = out / (group * kPanel) * (group * kPanel);
  const torch::Tensor groups = weight.narrow(0, 0, whole)
                                   .reshape({whole / (group * kPanel), group, kPanel, k / run, run})
                                   .permute({0, 3, 1, 2, 4})
                                   .contiguous()
                                   .view({-1});
  if (whole == out) return groups.view({out / kPanel, k, kPanel});
  const torch::Tensor last = weight.narrow(0, whole, kPanel).reshape({kPanel, k / run, run}).permute({1, 0, 2}).contiguous();
  return torch::cat({groups, last.view({-1})}).view({out / kPanel, k, kPanel});
}

}  // namespace

// [out, in] -> the panels `linear` reads: bf16 with AVX512-BF16 in pairs of input features, two
// panels a group (the dot-product tile); fp32 with AVX-512 by single features, two panels a group
// (the wide tile); anything else plain, a panel at a time (bf16 weights a build cannot pair are
// widened from plain panels).
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kBFloat16 || weight.scalar_type() == torch::kFloat32),
              "a bfloat16 or float32 [out, in] weight");
  TORCH_CHECK(weight.size(0) % kPanel == 0, "out features must be a multiple of ", kPanel, ", got ", weight.size(0));
  if (weight.scalar_type() == torch::kBFloat16 && packs_pairs(weight.size(1))) {
    return interleaved_panels(weight, kPairPanels, 2);
  }
#ifdef CACHET_FP32_WIDE
  if (weight.scalar_type() == torch::kFloat32) return interleaved_panels(weight, kWidePanels, 1);
#endif
  return interleaved_panels(weight, 1, 1);
}

namespace {

// x @ w.T on bf16 panels, fp32 math; x: [m, k], any float dtype.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const int64_t k = packed.size(1), panels = packed.size(0), n = panels * kPanel;
  if (packs_pairs(k)) return pair_linear(x, packed, bias);
  const torch::Tensor rows = x.to(torch::kFloat32).contiguous();
  const int64_t m = rows.size(0);
  torch::Tensor out = torch::empty({m, n}, rows.options());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* xs = rows.data_ptr<float>();
  float* ys = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t r = 0; r < m; r += kTileRows) {
      tile_any(w + p * k * kPanel, xs + r * k, std::min(kTileRows, m - r), k, k, ys + r * n + p * kPanel, n);
    }
  }
  if (bias.has_value() && bias->defined()) out.add_(bias->to(torch::kFloat32));
  return out;
}

// x @ w.T on fp32 panels; x: [m, k], computed in fp32.
torch::Tensor fp32_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const int64_t k = packed.size(1), panels = packed.size(0), n = panels * kPanel;
  const torch::Tensor rows = x.to(torch::kFloat32).contiguous();
  const int64_t m = rows.size(0);
  torch::Tensor out = torch::empty({m, n}, rows.options());
  const float* w = packed.data_ptr<float>();
  const float* xs = rows.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  // With more than one row the multiply-adds take long enough that the hardware's prefetcher
  // falls behind the weights' stream and memory sits idle, so the tiles ask ahead: in one tile
  // (up to 6 rows) 16 weight rows (1 KB) ahead, running into the next panel (a thread's panels
  // are consecutive); with more, the tiles after a panel's first compute from cache, and each
  // asks for the whole next panel as it goes. One step's products of the default model (Zen 3),
  // asking nothing, 16 rows ahead, the next panel; 2 threads: 4 rows 31.5 / 27.6 / 28.3 ms, 16
  // rows 45.7 / 42.3 / 40.0; one thread: 4 rows 49.8 / 42.4 / 49.8, 16 rows 83.0 / 74.5 / 67.1.
  // One row, which the prefetcher keeps up with, asks nothing (asking 16 ahead: 38.2 -> 44.5 ms).
#ifdef CACHET_FP32_WIDE
  // The same asks by groups of two panels (not re-tuned for this tile): 1 KB ahead within one
  // tile (up to 12 rows; 8 feature rows of an interleaved group), the next group's panels with
  // more; a lone last panel asks nothing.
  const int64_t groups = (panels + kWidePanels - 1) / kWidePanels;
  const bool next_group = m > kWideTileRows;
  const int64_t ahead_rows = m == 1 ? 0 : next_group ? kWidePanels * k : 16;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p = g * kWidePanels;
    const float* panel = w + p * k * kPanel;
    const bool whole = panels - p >= kWidePanels;
    const bool next_whole = panels - p >= 2 * kWidePanels;
    const float* ahead = ahead_rows == 0 || !whole || (next_group && !next_whole) ? nullptr : panel + ahead_rows * kPanel;
    for (int64_t r = 0; r < m; r += kWideTileRows) {
      const int64_t tile_rows = std::min(kWideTileRows, m - r);
      float* tile_out = ys + r * n + p * kPanel;
      for_row_count<kWideTileRows>(tile_rows, [&]<int Rows>() {
        if (whole) {
          fp32_wide_tile<Rows, 2>(panel, xs + r * k, k, k, tile_out, n, ahead);
        } else {
          fp32_wide_tile<Rows, 1>(panel, xs + r * k, k, k, tile_out, n, nullptr);
        }
      });
    }
  }
#else
  const int64_t ahead_rows = m == 1 ? 0 : m <= kFp32PanelTileRows ? 16 : k;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const float* panel = w + p * k * kPanel;
    const float* ahead = ahead_rows == 0 || (ahead_rows == k && p + 1 == panels) ? nullptr : panel + ahead_rows * kPanel;
    for (int64_t r = 0; r < m; r += kFp32PanelTileRows) {
      fp32_tile_any(panel, xs + r * k, std::min(kFp32PanelTileRows, m - r), k, k, ys + r * n + p * kPanel, n, ahead);
    }
  }
#endif
  if (bias.has_value() && bias->defined()) out.add_(bias->to(torch::kFloat32));
  return out;
}

#if defined(CACHET_DPBF16)
// Rows of x per tile-unit product: two 16-row tiles of sums per panel.
constexpr int64_t kTileUnitRows = 32;

// x @ w.T (+ bias) on bf16 pair panels through oneDNN's batch-reduce GEMM micro-kernel (torch's
// cpublas::brgemm: AMX tiles where the CPU has them). A group of two interleaved pair panels,
// [in / 2][2][16][2], is that kernel's "VNNI" layout of a 32-column right-hand side as it
// stands (a lone last panel, [in / 2][16][2], of a 16-column one), so this reads the panels the
// dot-product tiles read, with no copy of the weights. Each thread takes whole groups (each
// read from memory once per call, kept in cache across the row blocks) and rounds each group's
// fp32 sums (bias added) to bf16 as it stores them. A row's sums are ordered by the tile unit,
// not by the dot-product tiles' chains (their bits differ), but in one order whatever the rows
// beside it: threads split the groups, never the features, so batch-invariant steps may run here.
torch::Tensor unit_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const int64_t panels = packed.size(0), k = packed.size(1), n = panels * kPanel;
  const torch::Tensor rows = x.contiguous();
  const int64_t m = rows.size(0);
  torch::Tensor out = torch::empty({m, n}, rows.options());
  const bool with_bias = bias.has_value() && bias->defined();
  const torch::Tensor bias_sums = with_bias ? bias->to(torch::kFloat32).contiguous() : torch::Tensor();
  const float* biases = with_bias ? bias_sums.data_ptr<float>() : nullptr;
  const auto* w = packed.data_ptr<at::BFloat16>();
  const auto* xs = rows.data_ptr<at::BFloat16>();
  auto* ys = out.data_ptr<at::BFloat16>();
  const int64_t groups = (panels + kPairPanels - 1) / kPairPanels;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    float sums[kTileUnitRows * kPairPanels * kPanel];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p = g * kPairPanels;
      const int64_t columns = std::min(kPairPanels, panels - p) * kPanel;
      for (int64_t r0 = 0; r0 < m; r0 += kTileUnitRows) {
        const int64_t block = std::min(kTileUnitRows, m - r0);
        at::native::cpublas::brgemm(block, columns, k, k, columns, columns, false, xs + r0 * k, w + p * k * kPanel, sums);
        for (int64_t r = 0; r < block; ++r) {
          for (int64_t c = 0; c < columns; c += kPanel) {
            const __m512 bias16 = biases == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(biases + p * kPanel + c);
            store_bf16(ys + (r0 + r) * n + p * kPanel + c, _mm512_add_ps(_mm512_loadu_ps(sums + r * columns + c), bias16));
          }
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}
#endif

// Whether unit_linear runs here: bf16 pair panels, and a torch whose oneDNN has a bf16 micro-kernel
// for this CPU (AMX).
bool tile_unit_products() {
#if defined(CACHET_DPBF16)
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;
#endif
}

}  // namespace

// x @ weight.T (+ bias) on the tile unit (tile_unit_products()), for a bf16 weight from pack_weight
// and bf16 x; the result in bf16.
torch::Tensor tile_unit_linear(const torch::Tensor& x, const torch::Tensor& packed,
                               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(tile_unit_products(), "no tile-unit products on this CPU or build");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && x.scalar_type() == torch::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == kPanel && packed.is_contiguous() && packs_pairs(packed.size(1)),
              "bf16 x and a bf16 weight from pack_weight (pair panels)");
  TORCH_CHECK(x.device().is_cpu(), "CPU tensors only");
  const int64_t k = packed.size(1);
  TORCH_CHECK(x.size(-1) == k, "x has ", x.size(-1), " features, the weight ", k);
  auto shape = x.sizes().vec();
  shape.back() = packed.size(0) * kPanel;
#if defined(CACHET_DPBF16)
  return unit_linear(x.reshape({-1, k}), packed, bias).view(shape);
#else
  return torch::Tensor();
#endif
}

// x @ weight.T (+ bias) for a weight from pack_weight; the result in x's dtype.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK((packed.scalar_type() == torch::kBFloat16 || packed.scalar_type() == torch::kFloat32) &&
                  packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "the weight must come from pack_weight");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  const int64_t k = packed.size(1);
  TORCH_CHECK(x.size(-1) == k, "x has ", x.size(-1), " features, the weight ", k);
  auto shape = x.sizes().vec();
  shape.back() = packed.size(0) * kPanel;
  const torch::Tensor rows = x.reshape({-1, k});
  const torch::Tensor out = packed.scalar_type() == torch::kBFloat16 ? bf16_linear(rows, packed, bias) : fp32_linear(rows, packed, bias);
  return out.view(shape).to(x.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "[out, in] bfloat16 or float32 -> [out / 16, in, 16] panels");
  m.def("linear", &linear, "x @ weight.T (+ bias) on a weight from pack_weight, float32 math");
  m.def("tile_unit_products", &tile_unit_products, "Whether tile_unit_linear runs on this CPU and build");
  m.def("tile_unit_linear", &tile_unit_linear, "x @ weight.T (+ bias) on pair panels through oneDNN's AMX micro-kernel");
}
