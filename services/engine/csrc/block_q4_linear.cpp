// y = x @ w.T (+ bias) for bf16 activations on a weight kept as the checkpoint's 4-bit blocks
// (GGUF's Q4_1: every 32 inputs of an output share an fp16 scale d and offset m, and a weight is
// d * q + m for its 4-bit q), for the few rows of decoding.
//
// A decode step streams every weight once, so its time is the weights' bytes: the default model's
// projections are 213 MB in bf16 and 73 MB as blocks. The blocks also hold the checkpoint's
// weights exactly, where bf16 rounds them.
//
// For a row x and one block, w = d * (q + 128) + m' with m' = m - 128 d, so
// x . w = d * (x . (q + 128)) + m' * sum(x). 128 + q (128..143) is a bf16 whose bits are
// 0x4300 | q, so a code becomes a bf16 with one and-or instruction, no shuffles; x . (q + 128)
// runs on the hardware's bf16 dot products, every product exact, only the fp32 sums rounding.
// sum(x) is the row's own, shared by every output. The block's two terms are then added to the
// output's running sum with two fused multiply-adds. m' is computed once, in fp32, when packing.
//
// Layout (pack_blocks in block_q4_weights.py): panels of 16 outputs, [out / 16][in / 32][352 bytes],
// whose pairs of panels are interleaved block by block ([out / 32][in / 32][2][352]; a lone last
// panel stays [in / 32][352]). A block's 352 bytes are its codes (256), the 16 outputs' d (fp16, 32
// bytes) and m' (fp32, 64 bytes). The codes are 4 words of 64 bytes, word c holding input features
// 8c..8c+7: its 16-bit lane L is output L / 2, and the lane's nibble n (bits 4n..4n+3) is feature
// 8c + 2n + L % 2. So nibble n of every lane, shifted down, is one register of the dot product's
// layout (16 outputs x a pair of features).
//
// Every output is summed in one order whatever the rows beside it (blocks in turn; within a block
// pairs of features in turn; then d's term, then m''s), so a row's result is the same bits alone or
// in any batch: what a batch-invariant step needs. A product of more rows than one tile widens a
// group's codes to bf16 once into a buffer and runs every tile on it, the same values in the same
// order, so the same bits.
//
// Built without AVX512-BF16, the kernel computes the same sums one at a time (a reference for
// tests: the engine keeps these weights in bf16 on such hosts, block_q4_products() says which).
//
// fp32 activations (fp32_linear) take the blocks in another layout (pack_fp32_blocks): per panel
// and block, 32 input features of 8 bytes, byte b holding output b's code in its low nibble and
// output b + 8's in its high one, then d and m (fp16). Each weight is rebuilt in registers as
// fma(d, q, m), which is the checkpoint's fp32 value exactly (d * q is exact in fp32, so one
// rounding either way), and multiplied in as the fp32 panels do (panel_linear.cpp): one chain of
// fused multiply-adds per output, the features in order, from zero. So the result is the fp32
// panels' bits, at every row count, read from a seventh of the bytes: the engine picks either
// freely, by row count, even in batch-invariant steps. Up to kFp32TileRows rows take one tile;
// past that a first tile of kFp32KeepTileRows also stores the weights it rebuilds, and the other
// rows run the fp32 panels' tile (fp32_panel_tile.h) on them; rebuilt in every tile instead, the
// blocks took 1.4x the AVX2 panels' time at 512 rows.
// fp32_q8_linear does the same on Q8_0 blocks (d * q for an 8-bit q; pack_fp32_q8_blocks).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define CACHET_Q4_DPBF16 1
#endif

#include "fp32_panel_tile.h"
#include "row_count.h"

namespace {

constexpr int64_t kPanel = 16;        // outputs per panel
static_assert(kPanel == kFp32PanelOutputs, "an fp32 panel of blocks rebuilds to one of the fp32 panels");
constexpr int64_t kBlock = 32;        // inputs per block
constexpr int64_t kCodeBytes = kPanel * kBlock / 2;
constexpr int64_t kScaleBytes = kPanel * 2;                           // d, fp16
constexpr int64_t kBlockBytes = kCodeBytes + kScaleBytes + kPanel * 4;  // codes, d, m' (fp32)
constexpr int64_t kWords = kCodeBytes / 64;
constexpr int64_t kPairs = kBlock / 2;  // dot-product registers a panel's block widens to
// Most fp32 rows one tile rebuilding the weights takes. A second pass, even of one row over
// weights kept in L2, costs about as much as a first one: the default model's layer products at 5
// / 6 rows took 0.65 / 0.78x the time of a 4-row tile and its second pass, level at 1-4 (a Zen 3
// EPYC, one thread, alternated in one process). Its 12 sums and the rebuild's registers spill
// past 16, so the tile is its own function (noinline): inlined into the loop, 6 rows took 1.1x.
constexpr int64_t kFp32TileRows = 6;
// Past kFp32TileRows rows, the rows of the first tile, the one that also stores what it
// rebuilds: at 7-16 rows a first tile of 6 took 1.07-1.24x a first tile of 4.
constexpr int64_t kFp32KeepTileRows = 4;
constexpr int64_t kTileRows = 12;
// Panels a tile computes together, stored interleaved block by block (pack_blocks): a tile then
// streams one run of memory.
constexpr int64_t kGroupPanels = 2;

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline float half_to_float(const uint8_t* at) {
  at::Half half;
  std::memcpy(&half, at, sizeof(half));
  return static_cast<float>(half);
}

// sum(x) over each block of each row: [rows][blocks]. Summed as a tree (feature i with i + 16, and
// so on by halves), the same order in every build, which vectorizes: summed in feature order, one
// chain a block, this took a third of a 512-row product's time.
std::vector<float> block_sums(const uint16_t* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  std::vector<float> sums(rows * blocks);
#pragma omp parallel for schedule(static) if (rows > kTileRows)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* block = x + r * k + b * kBlock;
      float lanes[kBlock / 2];
      for (int64_t i = 0; i < kBlock / 2; ++i) lanes[i] = bf16_to_float(block[i]) + bf16_to_float(block[i + kBlock / 2]);
      for (int64_t width = kBlock / 4; width >= 1; width /= 2) {
        for (int64_t i = 0; i < width; ++i) lanes[i] += lanes[i + width];
      }
      sums[r * blocks + b] = lanes[0];
    }
  }
  return sums;
}

// 128 + the 4-bit code of output j, input feature f (< 32) of a block's codes.
inline float offset_code(const uint8_t* codes, int64_t j, int64_t f) {
  const int64_t word = f / 8, nibble = (f % 8) / 2, lane = 2 * j + f % 2;
  uint16_t bits;
  std::memcpy(&bits, codes + word * 64 + lane * 2, sizeof(bits));
  return static_cast<float>(128 + ((bits >> (4 * nibble)) & 0x0F));
}

#ifdef CACHET_Q4_DPBF16
inline void store_bf16(at::BFloat16* to, __m512 sums) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), (__m256i)_mm512_cvtneps_pbh(sums));
}

// Nibble `shift / 4` of every lane as bf16 128 + q: (lane >> shift) & 0xF | 0x4300.
inline __m512bh offset_codes(__m512i word, int shift) {
  return (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(word, shift), _mm512_set1_epi16(0x000F),
                                             _mm512_set1_epi16(0x4300), 0xEA);  // (a & b) | c
}

// A block's codes as 16 registers of bf16 pairs, in the order the tile reads them.
inline void widen_block(const uint8_t* codes, uint16_t* to) {
  for (int64_t w = 0; w < kWords; ++w) {
    const __m512i word = _mm512_loadu_si512(codes + w * 64);
    for (int n = 0; n < 4; ++n) _mm512_storeu_si512(to + (4 * w + n) * 32, (__m512i)offset_codes(word, 4 * n));
  }
}

// out[r, 0:16 * Panels] for r < Rows: a group's outputs (Panels panels, interleaved block by
// block) for a tile of rows. Widened: the group's codes come from `widened` (widen_block's, block
// after block, panel after panel), else from the group itself. The running sums live in L1, read
// and written once a block, so that the registers hold a block's dot products for 12 rows x 2
// panels: chains enough to cover a dot product's latency, and each broadcast pair of x feeds two.
template <int Rows, int Panels, bool Widened>
void tile(const uint8_t* group, const uint16_t* widened, int64_t blocks, const uint16_t* x, int64_t k,
          const float* sums, at::BFloat16* out, int64_t out_stride, const float* bias) {
  constexpr int64_t kWidenedBlock = kPairs * 32;  // 16-bit words of a panel's widened block
  alignas(64) float totals[Rows][Panels][kPanel] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * Panels * kBlockBytes;
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
           c9 = c0, c10 = c0, c11 = c0;
    __m512 e0 = c0, e1 = c0, e2 = c0, e3 = c0, e4 = c0, e5 = c0, e6 = c0, e7 = c0, e8 = c0, e9 = c0, e10 = c0,
           e11 = c0;
    for (int64_t w = 0; w < kWords; ++w) {
      __m512i word0, word1;
      if constexpr (!Widened) {
        word0 = _mm512_loadu_si512(block + w * 64);
        if constexpr (Panels > 1) word1 = _mm512_loadu_si512(block + kBlockBytes + w * 64);
      }
      for (int n = 0; n < 4; ++n) {
        __m512bh codes0, codes1;
        if constexpr (Widened) {
          const uint16_t* at = widened + b * Panels * kWidenedBlock + (4 * w + n) * 32;
          codes0 = (__m512bh)_mm512_loadu_si512(at);
          if constexpr (Panels > 1) codes1 = (__m512bh)_mm512_loadu_si512(at + kWidenedBlock);
        } else {
          codes0 = offset_codes(word0, 4 * n);
          if constexpr (Panels > 1) codes1 = offset_codes(word1, 4 * n);
        }
        const int64_t feature = b * kBlock + 8 * w + 2 * n;
#define CACHET_DOT(r)                                                         \
  if constexpr (Rows > r) {                                                   \
    int32_t pair;                                                             \
    std::memcpy(&pair, x + r * k + feature, sizeof(pair));                    \
    const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);                    \
    c##r = _mm512_dpbf16_ps(c##r, xr, codes0);                                \
    if constexpr (Panels > 1) e##r = _mm512_dpbf16_ps(e##r, xr, codes1);      \
  }
        CACHET_DOT(0) CACHET_DOT(1) CACHET_DOT(2) CACHET_DOT(3) CACHET_DOT(4) CACHET_DOT(5)
        CACHET_DOT(6) CACHET_DOT(7) CACHET_DOT(8) CACHET_DOT(9) CACHET_DOT(10) CACHET_DOT(11)
#undef CACHET_DOT
      }
    }
    const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kCodeBytes)));
    const __m512 m0 = _mm512_loadu_ps(block + kCodeBytes + kScaleBytes);
    __m512 d1 = d0, m1 = m0;
    if constexpr (Panels > 1) {
      const uint8_t* next = block + kBlockBytes;
      d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(next + kCodeBytes)));
      m1 = _mm512_loadu_ps(next + kCodeBytes + kScaleBytes);
    }
#define CACHET_SCALE(r)                                                                                  \
  if constexpr (Rows > r) {                                                                              \
    const __m512 sum = _mm512_set1_ps(sums[r * blocks + b]);                                             \
    _mm512_store_ps(totals[r][0], _mm512_fmadd_ps(sum, m0, _mm512_fmadd_ps(c##r, d0, _mm512_load_ps(totals[r][0])))); \
    if constexpr (Panels > 1)                                                                            \
      _mm512_store_ps(totals[r][Panels - 1],                                                             \
                      _mm512_fmadd_ps(sum, m1, _mm512_fmadd_ps(e##r, d1, _mm512_load_ps(totals[r][Panels - 1])))); \
  }
    CACHET_SCALE(0) CACHET_SCALE(1) CACHET_SCALE(2) CACHET_SCALE(3) CACHET_SCALE(4) CACHET_SCALE(5)
    CACHET_SCALE(6) CACHET_SCALE(7) CACHET_SCALE(8) CACHET_SCALE(9) CACHET_SCALE(10) CACHET_SCALE(11)
#undef CACHET_SCALE
  }
  for (int64_t r = 0; r < Rows; ++r) {
    for (int64_t p = 0; p < Panels; ++p) {
      __m512 sums16 = _mm512_load_ps(totals[r][p]);
      if (bias != nullptr) sums16 = _mm512_add_ps(sums16, _mm512_loadu_ps(bias + p * kPanel));
      store_bf16(out + r * out_stride + p * kPanel, sums16);
    }
  }
}

#endif

// The same sums one at a time, in the same order (a build without AVX512-BF16).
// `block_stride`: bytes from one of the panel's blocks to its next (a group's panels interleave).
void reference_panel(const uint8_t* panel, int64_t block_stride, int64_t blocks, const uint16_t* x, int64_t rows,
                     int64_t k, const float* sums, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < kPanel; ++j) {
      float total = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = panel + b * block_stride;
        float dot = 0.0f;
        for (int64_t f = 0; f < kBlock; f += 2) {
          // One dot-product instruction: the odd feature's product, then the even one's.
          dot += bf16_to_float(x[r * k + b * kBlock + f + 1]) * offset_code(block, j, f + 1);
          dot += bf16_to_float(x[r * k + b * kBlock + f]) * offset_code(block, j, f);
        }
        float offset;
        std::memcpy(&offset, block + kCodeBytes + kScaleBytes + 4 * j, sizeof(offset));
        total = std::fma(dot, half_to_float(block + kCodeBytes + 2 * j), total);
        total = std::fma(sums[r * blocks + b], offset, total);
      }
      out[r * out_stride + j] = total;
    }
  }
}


// The fp32 layouts' formats: how fp32_tile rebuilds a block's weights. `start` loads what a
// block's features share, `rebuild` gives feature f's 16 weights (outputs 0-7 low, 8-15 high),
// `weight` one of them without vectors.
//
// Q4_1 (pack_fp32_blocks): a feature's 16 codes in 8 bytes (output b low nibble, b + 8 high),
// then d and m (fp16) a block; a weight is fma(d, q, m).
struct Q4_1Fp32 {
  static constexpr int64_t kFeatureBytes = kPanel / 2;
  static constexpr int64_t kCodeBytes = kBlock * kFeatureBytes;
  static constexpr int64_t kBlockBytes = kCodeBytes + 2 * kPanel * 2;
#ifdef __AVX2__
  __m256 d_low, d_high, m_low, m_high;
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  void start(const uint8_t* block) {
    const auto* halves = reinterpret_cast<const __m128i*>(block + kCodeBytes);
    d_low = _mm256_cvtph_ps(_mm_loadu_si128(halves)), d_high = _mm256_cvtph_ps(_mm_loadu_si128(halves + 1));
    m_low = _mm256_cvtph_ps(_mm_loadu_si128(halves + 2)), m_high = _mm256_cvtph_ps(_mm_loadu_si128(halves + 3));
  }
  void rebuild(const uint8_t* block, int64_t f, __m256& low, __m256& high) const {
    const __m256i bytes =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + f * kFeatureBytes)));
    low = _mm256_fmadd_ps(d_low, _mm256_cvtepi32_ps(_mm256_and_si256(bytes, nibble)), m_low);
    high = _mm256_fmadd_ps(d_high, _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), m_high);
  }
#endif
  static float weight(const uint8_t* block, int64_t f, int64_t j) {
    const uint8_t byte = block[f * kFeatureBytes + j % kFeatureBytes];
    const int code = j < kFeatureBytes ? byte & 0x0F : byte >> 4;
    return std::fma(half_to_float(block + kCodeBytes + 2 * j), static_cast<float>(code),
                    half_to_float(block + kCodeBytes + 2 * kPanel + 2 * j));
  }
};

// Q8_0 (pack_fp32_q8_blocks; GGUF's 8-bit blocks, the default model's embedding and tied head): a
// feature's 16 signed codes in 16 bytes, then d (fp16) a block; a weight is d * q, exact in fp32
// (an fp16 d times a code of 8 bits), so the converter's fp32 value.
struct Q8_0Fp32 {
  static constexpr int64_t kFeatureBytes = kPanel;
  static constexpr int64_t kCodeBytes = kBlock * kFeatureBytes;
  static constexpr int64_t kBlockBytes = kCodeBytes + kPanel * 2;
#ifdef __AVX2__
  __m256 d_low, d_high;
  void start(const uint8_t* block) {
    const auto* halves = reinterpret_cast<const __m128i*>(block + kCodeBytes);
    d_low = _mm256_cvtph_ps(_mm_loadu_si128(halves)), d_high = _mm256_cvtph_ps(_mm_loadu_si128(halves + 1));
  }
  void rebuild(const uint8_t* block, int64_t f, __m256& low, __m256& high) const {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + f * kFeatureBytes));
    low = _mm256_mul_ps(d_low, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
    high = _mm256_mul_ps(d_high, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(codes, codes))));
  }
#endif
  static float weight(const uint8_t* block, int64_t f, int64_t j) {
    return half_to_float(block + kCodeBytes + 2 * j) * static_cast<float>(static_cast<int8_t>(block[f * kFeatureBytes + j]));
  }
};

// out[r, 0:16] for r < Rows, fp32 rows on one panel of a fp32 layout's blocks: the fp32 panels'
// chains. With Keep, the weights it rebuilds are also stored to `kept` in the fp32 panels' layout
// ([k][16]), for the tiles of the rows after these.
template <typename Format, int Rows, bool Keep = false>
__attribute__((noinline)) void fp32_tile(const uint8_t* panel, int64_t blocks, const float* x, int64_t k,
                                         float* out, int64_t out_stride, float* kept = nullptr) {
#ifdef __AVX2__
  static_assert(Rows <= kFp32TileRows);
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0, l4 = l0, h4 = l0,
         l5 = l0, h5 = l0;
  Format format;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * Format::kBlockBytes;
    format.start(block);
    for (int64_t f = 0; f < kBlock; ++f) {
      __m256 w_low, w_high;
      format.rebuild(block, f, w_low, w_high);
      const int64_t feature = b * kBlock + f;
      if constexpr (Keep) {
        _mm256_storeu_ps(kept + feature * kPanel, w_low);
        _mm256_storeu_ps(kept + feature * kPanel + 8, w_high);
      }
#define CACHET_FMA(r)                                               \
  if constexpr (Rows > r) {                                         \
    const __m256 a = _mm256_broadcast_ss(x + r * k + feature);      \
    l##r = _mm256_fmadd_ps(a, w_low, l##r);                         \
    h##r = _mm256_fmadd_ps(a, w_high, h##r);                        \
  }
      CACHET_FMA(0) CACHET_FMA(1) CACHET_FMA(2) CACHET_FMA(3) CACHET_FMA(4) CACHET_FMA(5)
#undef CACHET_FMA
    }
  }
#define CACHET_STORE(r)                                       \
  if constexpr (Rows > r) {                                   \
    _mm256_storeu_ps(out + r * out_stride, l##r);             \
    _mm256_storeu_ps(out + r * out_stride + 8, h##r);         \
  }
  CACHET_STORE(0) CACHET_STORE(1) CACHET_STORE(2) CACHET_STORE(3) CACHET_STORE(4) CACHET_STORE(5)
#undef CACHET_STORE
#else
  for (int64_t r = 0; r < Rows; ++r) {
    float sums[kPanel] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = panel + b * Format::kBlockBytes;
      for (int64_t f = 0; f < kBlock; ++f) {
        const float a = x[r * k + b * kBlock + f];
        for (int64_t j = 0; j < kPanel; ++j) {
          const float weight = Format::weight(block, f, j);
          if constexpr (Keep) kept[(b * kBlock + f) * kPanel + j] = weight;
          sums[j] = std::fma(a, weight, sums[j]);
        }
      }
    }
    std::memcpy(out + r * out_stride, sums, sizeof(sums));
  }
#endif
}

}  // namespace

bool block_q4_products() {
#ifdef CACHET_Q4_DPBF16
  return true;
#else
  return false;
#endif
}

namespace {

// One product's operands, checked: x as [m, k] rows, the weight's panels and blocks, the bias.
struct Product {
  torch::Tensor rows;
  int64_t m, k, n, panels, blocks;
  bool with_bias;
  std::vector<int64_t> shape;  // the output's: x's with n features
};

Product checked_product(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                        int64_t block_bytes, const char* packer, torch::ScalarType activations) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 && packed.size(2) == block_bytes &&
                  packed.is_contiguous(),
              "the weight must come from ", packer, ": uint8 [out / 16, in / 32, ", block_bytes, "]");
  TORCH_CHECK(x.scalar_type() == activations, activations == torch::kBFloat16 ? "bfloat16" : "float32",
              " activations, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  Product product;
  product.panels = packed.size(0), product.blocks = packed.size(1);
  product.k = product.blocks * kBlock, product.n = product.panels * kPanel;
  TORCH_CHECK(x.size(-1) == product.k, "x has ", x.size(-1), " features, the weight ", product.k);
  product.with_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!product.with_bias || bias->numel() == product.n, "bias has ", product.with_bias ? bias->numel() : 0,
              " values for ", product.n, " outputs");
  product.shape = x.sizes().vec();
  product.shape.back() = product.n;
  product.rows = x.reshape({-1, product.k}).contiguous();
  product.m = product.rows.size(0);
  return product;
}

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const Product product = checked_product(x, packed, bias, kBlockBytes, "pack_blocks", torch::kBFloat16);
  const auto& [rows, m, k, n, panels, blocks, with_bias, shape] = product;
  const auto* xs = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
  const auto* w = packed.data_ptr<uint8_t>();
  const std::vector<float> sums = block_sums(xs, m, k);
  const torch::Tensor bias_sums = with_bias ? bias->to(torch::kFloat32).contiguous() : torch::Tensor();
  const float* biases = with_bias ? bias_sums.data_ptr<float>() : nullptr;
#ifdef CACHET_Q4_DPBF16
  torch::Tensor out = torch::empty({m, n}, rows.options());
  auto* ys = out.data_ptr<at::BFloat16>();
  // Widening once pays where a group meets more than one tile of rows.
  const bool widen = m > kTileRows;
  const int64_t groups = (panels + kGroupPanels - 1) / kGroupPanels;
#pragma omp parallel
  {
    std::vector<uint16_t> widened(widen ? kGroupPanels * blocks * kPairs * 32 : 0);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p = g * kGroupPanels, width = std::min(kGroupPanels, panels - p);
      const uint8_t* group = w + p * blocks * kBlockBytes;
      if (widen) {
        for (int64_t b = 0; b < blocks * width; ++b) {
          widen_block(group + b * kBlockBytes, widened.data() + b * kPairs * 32);
        }
      }
      const uint16_t* codes = widen ? widened.data() : nullptr;
      const float* tile_bias = biases == nullptr ? nullptr : biases + p * kPanel;
      for (int64_t r = 0; r < m; r += kTileRows) {
        const int64_t tile_rows = std::min(kTileRows, m - r);
        at::BFloat16* tile_out = ys + r * n + p * kPanel;
        for_row_count<kTileRows>(tile_rows, [&]<int Rows>() {
          const float* tile_sums = sums.data() + r * blocks;
          if (width == kGroupPanels && widen) {
            tile<Rows, 2, true>(group, codes, blocks, xs + r * k, k, tile_sums, tile_out, n, tile_bias);
          } else if (width == kGroupPanels) {
            tile<Rows, 2, false>(group, codes, blocks, xs + r * k, k, tile_sums, tile_out, n, tile_bias);
          } else if (widen) {
            tile<Rows, 1, true>(group, codes, blocks, xs + r * k, k, tile_sums, tile_out, n, tile_bias);
          } else {
            tile<Rows, 1, false>(group, codes, blocks, xs + r * k, k, tile_sums, tile_out, n, tile_bias);
          }
        });
      }
    }
  }
  return out.view(shape);
#else
  torch::Tensor out = torch::empty({m, n}, rows.options().dtype(torch::kFloat32));
  float* ys = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t first = p / kGroupPanels * kGroupPanels;
    const bool grouped = first + kGroupPanels <= panels;
    const uint8_t* panel = w + first * blocks * kBlockBytes + (grouped ? (p - first) * kBlockBytes : 0);
    reference_panel(panel, (grouped ? kGroupPanels : 1) * kBlockBytes, blocks, xs, m, k, sums.data(), ys + p * kPanel, n);
  }
  if (with_bias) out.add_(bias_sums);
  return out.to(torch::kBFloat16).view(shape);
#endif
}

namespace {

template <typename Format>
torch::Tensor fp32_blocks_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                 const c10::optional<torch::Tensor>& bias, const char* packer) {
  const Product product = checked_product(x, packed, bias, Format::kBlockBytes, packer, torch::kFloat32);
  const auto& [rows, m, k, n, panels, blocks, with_bias, shape] = product;
  torch::Tensor out = torch::empty({m, n}, rows.options());
  const float* xs = rows.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  const auto* w = packed.data_ptr<uint8_t>();
  if (m == 0) {
    // No rows (a head in a step where no request samples): for_row_count's least tile is one row.
  } else if (m <= kFp32TileRows) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      for_row_count<kFp32TileRows>(m, [&]<int Rows>() {
        fp32_tile<Format, Rows>(w + p * blocks * Format::kBlockBytes, blocks, xs, k, ys + p * kPanel, n);
      });
    }
  } else {
    // More rows than one tile: rebuilding in every tile would cost each tile as much again, so
    // the first tile keeps the weights it rebuilds (a panel's k x 16 fp32, 36-98 KB: L2), and
    // the other rows run the fp32 panels' own tile on them, in tiles of as even a size as fits.
#pragma omp parallel
    {
      std::vector<float> weights(k * kPanel);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; ++p) {
        fp32_tile<Format, kFp32KeepTileRows, true>(w + p * blocks * Format::kBlockBytes, blocks, xs, k,
                                                   ys + p * kPanel, n, weights.data());
        const int64_t rest = m - kFp32KeepTileRows;
        const int64_t tiles = (rest + kFp32PanelTileRows - 1) / kFp32PanelTileRows;
        const int64_t tile_rows = (rest + tiles - 1) / tiles;
        for (int64_t r = kFp32KeepTileRows; r < m; r += tile_rows) {
          for_row_count<kFp32PanelTileRows>(std::min(tile_rows, m - r), [&]<int Rows>() {
            fp32_panel_tile<Rows>(weights.data(), xs + r * k, k, k, ys + r * n + p * kPanel, n, nullptr);
          });
        }
      }
    }
  }
  // As the fp32 panels add it: after the products, in fp32.
  if (with_bias) out.add_(bias->to(torch::kFloat32));
  return out.view(shape);
}

}  // namespace

torch::Tensor fp32_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  return fp32_blocks_linear<Q4_1Fp32>(x, packed, bias, "pack_fp32_blocks");
}

torch::Tensor fp32_q8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                             const c10::optional<torch::Tensor>& bias) {
  return fp32_blocks_linear<Q8_0Fp32>(x, packed, bias, "pack_fp32_q8_blocks");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_q4_products", &block_q4_products, "Whether this build runs the blocks on bf16 dot products");
  m.def("linear", &linear, "x @ weight.T (+ bias), bf16 x, on a weight from pack_blocks");
  m.def("fp32_linear", &fp32_linear, "x @ weight.T (+ bias), fp32 x, on a weight from pack_fp32_blocks: the fp32 panels' bits");
  m.def("fp32_q8_linear", &fp32_q8_linear,
        "x @ weight.T (+ bias), fp32 x, on a weight from pack_fp32_q8_blocks: the fp32 panels' bits");
}
