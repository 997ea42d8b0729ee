// The fp32 panels' micro-kernel (panel_linear.cpp), shared with the blocks' fp32 products
// (block_q4_linear.cpp), which run it on weights rebuilt from the blocks: the same chains, so the
// same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

constexpr int64_t kFp32PanelOutputs = 16;  // a panel row: one input feature's 16 outputs
constexpr int64_t kFp32PanelTileRows = 6;  // 12 sums in registers, of 16

// Stores rows r < Rows of a tile whose sums are named l<r> (outputs 0-7) and h<r> (8-15), r < 6,
// as the 8-wide tiles keep them (named variables: GCC kept an array of vectors in memory).
#define CACHET_STORE_TILE_ROW(r, out, out_stride)                 \
  if constexpr (Rows > r) {                                       \
    _mm256_storeu_ps((out) + r * (out_stride), l##r);             \
    _mm256_storeu_ps((out) + r * (out_stride) + 8, h##r);         \
  }
#define CACHET_STORE_TILE_ROWS(out, out_stride)                                                 \
  CACHET_STORE_TILE_ROW(0, out, out_stride) CACHET_STORE_TILE_ROW(1, out, out_stride)           \
  CACHET_STORE_TILE_ROW(2, out, out_stride) CACHET_STORE_TILE_ROW(3, out, out_stride)           \
  CACHET_STORE_TILE_ROW(4, out, out_stride) CACHET_STORE_TILE_ROW(5, out, out_stride)

// out[r, 0:16] = x[r, :] . panel for r < Rows (<= kFp32PanelTileRows), fp32 weights: one chain per output,
// the features in order, so a row's sums are the same bits in a tile of any size. `ahead`: where
// the weights asked for into L2 as this panel streams start (row i asks for ahead's row i), or
// null.
template <int Rows>
inline void fp32_panel_tile(const float* panel, const float* x, int64_t k, int64_t x_stride, float* out, int64_t out_stride,
               const float* ahead) {
#ifdef __AVX2__
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0, l4 = l0,
         h4 = l0, l5 = l0, h5 = l0;
  for (int64_t i = 0; i < k; ++i) {
    if (ahead != nullptr) __builtin_prefetch(ahead + i * kFp32PanelOutputs, 0, 2);
    const __m256 w_low = _mm256_loadu_ps(panel + i * kFp32PanelOutputs), w_high = _mm256_loadu_ps(panel + i * kFp32PanelOutputs + 8);
#define CACHET_FMA(r)                                               \
  if constexpr (Rows > r) {                                         \
    const __m256 a = _mm256_broadcast_ss(x + r * x_stride + i);     \
    l##r = _mm256_fmadd_ps(a, w_low, l##r);                         \
    h##r = _mm256_fmadd_ps(a, w_high, h##r);                        \
  }
    CACHET_FMA(0) CACHET_FMA(1) CACHET_FMA(2) CACHET_FMA(3) CACHET_FMA(4) CACHET_FMA(5)
#undef CACHET_FMA
  }
  CACHET_STORE_TILE_ROWS(out, out_stride)
#else
  (void)ahead;
  for (int64_t r = 0; r < Rows; ++r) {
    float sums[kFp32PanelOutputs] = {};
    for (int64_t i = 0; i < k; ++i) {
      const float a = x[r * x_stride + i];
      for (int64_t j = 0; j < kFp32PanelOutputs; ++j) sums[j] = std::fma(a, panel[i * kFp32PanelOutputs + j], sums[j]);
    }
    std::memcpy(out + r * out_stride, sums, sizeof(sums));
  }
#endif
}
