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
#define CACHET_STORE(r)                                   \
  if constexpr (Rows > r) {                               \
    _mm256_storeu_ps(out + r * out_stride, l##r);         \
    _mm256_storeu_ps(out + r * out_stride + 8, h##r);     \
  }
  CACHET_STORE(0) CACHET_STORE(1) CACHET_STORE(2) CACHET_STORE(3) CACHET_STORE(4) CACHET_STORE(5)
#undef CACHET_STORE
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
