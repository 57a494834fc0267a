// W4A8Linear's and W5A8Linear's kernel: 4- or 5-bit weights times 8-bit activations with integer dot products, as
// llama.cpp's AVX2 kernels multiply Q4_1 (or Q5_0) blocks by Q8_1 ones. PyTorch's own int4 CPU kernel takes bfloat16
// activations, which a CPU without native bfloat16 converts in software: it read SmolLM2's weights at 13-16 GB/s
// where this machine copies at 31-45.
//
// Weights: blocks of 32 inputs, w = d * code + m with fp16 d and m and 4-bit codes (llama.cpp's Q4_1 values). A row
// of G blocks is stored as G scales d, G minimums m, then G times 16 bytes whose low nibbles are a block's codes 0-15
// and high nibbles its codes 16-31: two blocks' codes are one 32-byte load, and eight blocks' scales one 16-byte load.
// 5-bit codes (0-31; llama.cpp's Q5_0 is d * code - 16 d) add their fifth bits after the nibbles, as planes of 32
// bytes, one a turn of four pairs: byte k of a plane holds lane k's fifth bit of the pairs' low-nibble vectors in bits
// 0-3 (pair p: bit p) and of their high-nibble vectors in bits 4-7, so that one shift and one mask put a pair's fifth
// bits where its codes need them (bit 4 of each byte); an odd last block takes the next pair's low bits. 4 bytes a
// block, in planes rounded up to 32 bytes.
// Activations, per row and block: x ~ dx * q with q = round(x / dx) in [-127, 127], dx = max|x| / 127.
// A block's product is d * dx * sum(code * q) + m * dx * sum(q): one integer sum and one float term.
//
// The same activations also multiply llama.cpp's Q8_0 blocks (q8_0_linear: int8 codes and one fp16 scale a block of
// 32, the layout of BlockEmbedding's table, so a tied LM head reads the table itself), as llama.cpp's Q8_0 x Q8_0
// dot product: d * dx * sum(code * q).
//
// From kTileRows input rows on (a prompt's chunk, a batch of decode steps), the 4- and 5-bit weights are multiplied
// eight output channels at a time: each thread unpacks eight weight rows' codes to bytes, interleaved four inputs of a
// channel to a 32-bit lane (ChannelTile, in L1), so that one instruction multiplies four inputs of eight channels for a
// row, a block's sums stay integers to its end, and its scales are applied once for the eight (tile_dot). Measured in
// docs/benchmarks.md, "Prompts on the integer kernels".
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../avx2.h"

namespace {

constexpr int64_t kBlock = 32;  // inputs a block holds
constexpr int64_t kTile = 8;  // weight rows tile_dot multiplies at once
// Input rows from which the 4- and 5-bit kernels multiply by tiles: below, unpacking eight rows' codes costs more than
// it saves.
constexpr int64_t kTileRows = 4;
// How far ahead of its dot products a thread asks memory for weight rows. The hardware's prefetcher alone kept too few
// reads in flight: Gemma-3-270M's tied head (178 MB of Q8_0) streamed at 42-53 GB/s where a plain sum of a tensor
// reads 73 on the same machine, and a compiled Gemma step at 8K took 7.7-8.0% longer (one process, interleaved).
constexpr int64_t kPrefetchBytes = 8192;
// Input rows a thread multiplies by all its weight rows before it takes the next ones: their quantized codes stay in
// the core's L1 cache, and only the weights stream from L2, instead of a prefill chunk's every row for each weight row.
constexpr int64_t kRowBlock = 8;

constexpr int64_t row_bytes(int bits, int64_t blocks) {  // 2 + 2 + 16 a block, and the fifth bits' planes
  return 20 * blocks + (bits == 5 ? (blocks + 7) / 8 * 32 : 0);
}

// Where input i of a block goes in a row of codes: for each pair of blocks (b, b + 1), b's first 16, b + 1's first
// 16, b's last 16, b + 1's last 16 (the order the weights' 32-byte loads give); an odd last block in its own order.
int64_t code_slot(int64_t blocks, int64_t block, int64_t i) {
  if (block >= blocks / 2 * 2) return block * kBlock + i;
  return block / 2 * 2 * kBlock + (i < 16 ? 0 : 32) + (block % 2) * 16 + i % 16;
}

// One row of activations, quantized, its codes in code_slot's order (``paired``: for the 4- and 5-bit weights) or in
// their own (Q8_0's). Per pair, spread [dx_b x4, dx_b+1 x4] (the lanes its sums land in); per block, dx * sum(q).
struct QuantizedRow {
  std::vector<int8_t> codes;
  std::vector<float> pair_scales, scale, scaled_sum;
  bool paired = true;

  int64_t paired_blocks() const { return paired ? static_cast<int64_t>(scale.size()) / 2 * 2 : 0; }
  int8_t& code(int64_t block, int64_t i) {
    return codes[paired ? code_slot(scale.size(), block, i) : block * kBlock + i];
  }
};

void resize(QuantizedRow& row, int64_t blocks, bool paired) {
  row.paired = paired;
  row.codes.resize(blocks * kBlock);
  row.scale.resize(blocks);
  row.scaled_sum.resize(blocks);
  row.pair_scales.resize(paired ? blocks / 2 * 8 : 0);
}

void quantize_row(const float* x, int64_t blocks, QuantizedRow& row) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* in = x + b * kBlock;
    float peak = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) peak = std::fmax(peak, std::fabs(in[i]));
    const float scale = peak / 127.f;
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(in[i] * inverse));  // (ties to even, as torch.round)
      row.code(b, i) = static_cast<int8_t>(q);
      sum += q;
    }
    row.scale[b] = scale;
    row.scaled_sum[b] = scale * static_cast<float>(sum);
    if (b < row.paired_blocks())
      for (int64_t lane = 0; lane < 4; ++lane) row.pair_scales[(b / 2) * 8 + (b % 2) * 4 + lane] = scale;
  }
}

// Eight weight rows' codes as bytes, interleaved four inputs at a time ([group of four][channel], groups in
// code_slot's order), and their blocks' scales and minimums [block][channel]: what tile_dot multiplies a prompt by.
struct ChannelTile {
  std::vector<int32_t> codes;
  std::vector<float> scales, minimums;
  std::vector<uint8_t> unpacked;  // (each row's codes before they are interleaved)
};

float half_bits(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// A weight's code: its nibble, and (5 bits) its fifth bit, found by its code_slot: slots come 64 a pair (32 of its
// low-nibble vector, then 32 of its high one), and a pair's bits sit in plane pair / 4 at bit pair % 4 (+ 4: high).
template <int kBits>
int32_t weight_code(const uint8_t* weights, int64_t blocks, int64_t block, int64_t i) {
  const uint8_t byte = weights[4 * blocks + block * 16 + i % 16];
  const int32_t nibble = i < 16 ? byte & 0xF : byte >> 4;
  if (kBits == 4) return nibble;
  const int64_t slot = code_slot(blocks, block, i), pair = slot / 64, lane = slot % 32;
  const int shift = pair % 4 + (slot % 64 >= 32 ? 4 : 0);
  return nibble | ((weights[20 * blocks + pair / 4 * 32 + lane] >> shift) & 1) << 4;
}

template <int kBits>
float dot_scalar(const uint8_t* weights, QuantizedRow& row, int64_t blocks) {
  const uint8_t* minimums = weights + 2 * blocks;
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) sum += weight_code<kBits>(weights, blocks, b, i) * row.code(b, i);
    total += half_bits(weights + 2 * b) * row.scale[b] * static_cast<float>(sum) +
             half_bits(minimums + 2 * b) * row.scaled_sum[b];
  }
  return total;
}

// Q8_0 weights (``codes``: a row's int8 codes, ``scales``: its fp16 scales) times a row quantized in order.
float dot_q8_0_scalar(const int8_t* codes, const uint8_t* scales, QuantizedRow& row, int64_t blocks) {
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) sum += codes[b * kBlock + i] * row.code(b, i);
    total += half_bits(scales + 2 * b) * row.scale[b] * static_cast<float>(sum);
  }
  return total;
}

#ifdef SPARSEGEN_X86
namespace avx2 {
#define SIMD AVX2
#include "w4a8_dots.h"
#undef SIMD
}  // namespace avx2

namespace vnni {
#define SIMD AVX512_VNNI
#define SPARSEGEN_VNNI
#include "w4a8_dots.h"
#undef SPARSEGEN_VNNI
#undef SIMD
}  // namespace vnni

// quantize_row's work with AVX2 (the same values: round half to even, the same float operations), a block at a time.
AVX2 void quantize_row_avx2(const float* x, int64_t blocks, QuantizedRow& row) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    __m256 peak = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(x + b * kBlock + 8 * k);
      peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_movehdup_ps(half));
    const float scale = _mm_cvtss_f32(half) / 127.f;
    const __m256 inverse = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    __m256i q[4];
    __m256i sum = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      sum = _mm256_add_epi32(sum, q[k]);
    }
    // (int32 -> int8 packs interleave 128-bit lanes: the permutation puts the 32 codes back in order)
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const int64_t pairs_end = row.paired_blocks();
    int8_t* first = b < pairs_end ? row.codes.data() + (b / 2) * 2 * kBlock + (b % 2) * 16 : row.codes.data() + b * kBlock;
    int8_t* second = b < pairs_end ? first + 32 : first + 16;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm256_castsi256_si128(packed));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(second), _mm256_extracti128_si256(packed, 1));
    __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0x4E));
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0xB1));
    row.scale[b] = scale;
    row.scaled_sum[b] = scale * static_cast<float>(_mm_cvtsi128_si32(total));
    if (b < pairs_end)
      _mm_storeu_ps(row.pair_scales.data() + (b / 2) * 8 + (b % 2) * 4, _mm_set1_ps(scale));
  }
}

#endif

// Every row of ``flat`` quantized (``paired``: in code_slot's order), a prefill chunk's rows split across threads.
std::vector<QuantizedRow> quantized_rows(const at::Tensor& flat, int64_t count, bool paired) {
  const int64_t rows = flat.size(0), in_features = flat.size(1);
#ifdef SPARSEGEN_X86
  const bool vector = simd_level() != Simd::kScalar;
#endif
  std::vector<QuantizedRow> quantized(rows);
  at::parallel_for(0, rows, 8, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      resize(quantized[r], count, paired);
      const float* row = flat.data_ptr<float>() + r * in_features;
#ifdef SPARSEGEN_X86
      if (vector) {
        quantize_row_avx2(row, count, quantized[r]);
        continue;
      }
#endif
      quantize_row(row, count, quantized[r]);
    }
  });
  return quantized;
}

// The 4- and 5-bit weights' dot products, by output channel, and (fill, tile_dot) eight channels at once.
template <int kBits>
struct BlocksKernel {
  const uint8_t* weights;
  int64_t stride, count;  // (stride: row_bytes(kBits, count), checked by the caller)
#ifdef SPARSEGEN_X86
  template <int ROWS>
  void dot(bool vnni, int64_t n, const QuantizedRow* rows, float* out, int64_t out_stride) const {
    if (vnni) return vnni::dot<ROWS, kBits>(row(n), rows, count, out, out_stride);
    avx2::dot<ROWS, kBits>(row(n), rows, count, out, out_stride);
  }
  // The tile of eight weight rows from ``first`` on.
  void fill(bool vnni, int64_t first, ChannelTile& tile) const {
    const int64_t width = count * kBlock;
    tile.unpacked.resize(kTile * width);
    tile.codes.resize(kTile * width / 4);
    tile.scales.resize(kTile * count);
    tile.minimums.resize(kTile * count);
    for (int64_t j = 0; j < kTile; ++j) {
      const uint8_t* w = row(first + j);
      uint8_t* unpacked = tile.unpacked.data() + j * width;
      if (vnni) vnni::unpack_codes<kBits>(w, count, unpacked);
      else avx2::unpack_codes<kBits>(w, count, unpacked);
      for (int64_t b = 0; b < count; ++b) {
        tile.scales[b * kTile + j] = half_bits(w + 2 * b);
        tile.minimums[b * kTile + j] = half_bits(w + 2 * count + 2 * b);
      }
    }
    for (int64_t g = 0; g < width / 4; ++g)
      for (int64_t j = 0; j < kTile; ++j)
        std::memcpy(&tile.codes[g * kTile + j], tile.unpacked.data() + j * width + 4 * g, 4);
  }
  template <int ROWS>
  void tile_dot(bool vnni, const ChannelTile& tile, const QuantizedRow* rows, float* out, int64_t out_stride) const {
    if (vnni) return vnni::tile_dot<ROWS>(tile, rows, count, out, out_stride);
    avx2::tile_dot<ROWS>(tile, rows, count, out, out_stride);
  }
#endif
  const uint8_t* row(int64_t n) const { return weights + n * stride; }
  int64_t row_bytes() const { return stride; }
  float scalar(int64_t n, QuantizedRow& input) const { return dot_scalar<kBits>(row(n), input, count); }
};

// The Q8_0 weights' dot products, by output channel.
struct Q8_0Kernel {
  const int8_t* codes;
  const uint8_t* scales;
  int64_t count;
#ifdef SPARSEGEN_X86
  template <int ROWS>
  void dot(bool vnni, int64_t n, const QuantizedRow* rows, float* out, int64_t out_stride) const {
    if (vnni) return vnni::dot_q8_0<ROWS>(row(n), scales + n * count * 2, rows, count, out, out_stride);
    avx2::dot_q8_0<ROWS>(row(n), scales + n * count * 2, rows, count, out, out_stride);
  }
#endif
  const int8_t* row(int64_t n) const { return codes + n * row_bytes(); }  // (its codes; its scales lie apart)
  int64_t row_bytes() const { return count * kBlock; }
  float scalar(int64_t n, QuantizedRow& input) const {
    return dot_q8_0_scalar(row(n), scales + n * count * 2, input, count);
  }
};

// ``x``'s outputs [..., out_features] from its quantized rows: output channels split across threads; kRowBlock input
// rows at a time against each of a thread's weight rows (eight or four rows a call, then one by one), the weight rows
// kPrefetchBytes on requested. A decode step's rows are one block: its weights are read once.
// Channels from ``from`` on (those before it the caller's); ``out``: [rows, out_features].
template <class Kernel>
at::Tensor outputs(const at::Tensor& x, const Kernel& kernel, std::vector<QuantizedRow>& quantized,
                   int64_t out_features, at::Tensor out, int64_t from = 0) {
  const int64_t rows = quantized.size();
  float* y = out.data_ptr<float>();
#ifdef SPARSEGEN_X86
  const Simd level = simd_level();
  const bool vector = level != Simd::kScalar, vnni = level == Simd::kAvx512Vnni;
#endif
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / kernel.row_bytes());
  at::parallel_for(from, out_features, 16, [&](int64_t first, int64_t last) {
    for (int64_t block = 0; block < rows; block += kRowBlock) {
      const int64_t block_end = std::min(rows, block + kRowBlock);
      for (int64_t n = first; n < last; ++n) {
        if (n + ahead < last) {
          const char* next = reinterpret_cast<const char*>(kernel.row(n + ahead));
          for (int64_t at = 0; at < kernel.row_bytes(); at += 64) __builtin_prefetch(next + at);
        }
        int64_t r = block;
#ifdef SPARSEGEN_X86
        if (vector) {
          if (vnni)  // (AVX-512's 32 vector registers hold eight rows' sums; AVX2's 16 spill them)
            for (; r + 8 <= block_end; r += 8)
              kernel.template dot<8>(vnni, n, &quantized[r], y + r * out_features + n, out_features);
          for (; r + 4 <= block_end; r += 4)
            kernel.template dot<4>(vnni, n, &quantized[r], y + r * out_features + n, out_features);
          for (; r < block_end; ++r) kernel.template dot<1>(vnni, n, &quantized[r], y + r * out_features + n, 0);
        }
#endif
        for (; r < block_end; ++r) y[r * out_features + n] = kernel.scalar(n, quantized[r]);
      }
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return out.view(shape);
}

// A prompt's rows against the 4- and 5-bit weights eight channels at a time (tile_dot), each thread its own tiles;
// the channels past the last whole tile, and every channel on a CPU without AVX2, by ``outputs``.
template <int kBits>
at::Tensor tiled_outputs(const at::Tensor& x, const BlocksKernel<kBits>& kernel, std::vector<QuantizedRow>& quantized,
                         int64_t out_features) {
  const int64_t rows = quantized.size();
  at::Tensor out = at::empty({rows, out_features}, x.options());
  int64_t tiles = 0;
#ifdef SPARSEGEN_X86
  const Simd level = simd_level();
  const bool vnni = level == Simd::kAvx512Vnni;
  if (level != Simd::kScalar && rows >= kTileRows) tiles = out_features / kTile;
  float* y = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    ChannelTile tile;
    for (int64_t t = first; t < last; ++t) {
      kernel.fill(vnni, t * kTile, tile);
      float* channels = y + t * kTile;
      int64_t r = 0;
      if (vnni)  // (AVX-512's 32 vector registers hold eight rows' sums; AVX2's 16 hold four)
        for (; r + 8 <= rows; r += 8)
          kernel.template tile_dot<8>(vnni, tile, &quantized[r], channels + r * out_features, out_features);
      for (; r + 4 <= rows; r += 4)
        kernel.template tile_dot<4>(vnni, tile, &quantized[r], channels + r * out_features, out_features);
      for (; r < rows; ++r) kernel.template tile_dot<1>(vnni, tile, &quantized[r], channels + r * out_features, 0);
    }
  });
#endif
  return outputs(x, kernel, quantized, out_features, out, tiles * kTile);
}

template <int kBits>
at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
  const char* name = kBits == 5 ? "sparsegen::w5a8_linear" : "sparsegen::w4a8_linear";
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": float32 inputs, got ", x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(0) == out_features, name,
              ": blocks must be uint8 [out_features, ", kBits == 5 ? "W5A8Linear's row bytes]" : "in_features / 32 * 20]");
  const int64_t in_features = x.size(-1);
  TORCH_CHECK(in_features % kBlock == 0 && blocks.size(1) == row_bytes(kBits, in_features / kBlock), name, ": ",
              in_features, " inputs do not match blocks of shape ", blocks.sizes());
  const at::Tensor weights = blocks.contiguous();
  const int64_t count = in_features / kBlock;
  std::vector<QuantizedRow> quantized = quantized_rows(x.reshape({-1, in_features}).contiguous(), count, true);
  return tiled_outputs(x, BlocksKernel<kBits>{weights.data_ptr<uint8_t>(), weights.size(1), count}, quantized,
                       out_features);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t out_features) {
  const int64_t in_features = x.size(-1), count = in_features / kBlock;
  TORCH_CHECK(x.scalar_type() == at::kFloat, "sparsegen::q8_0_linear: float32 inputs, got ", x.scalar_type());
  TORCH_CHECK(in_features % kBlock == 0 && codes.scalar_type() == at::kChar && codes.dim() == 2 &&
                  codes.size(0) == out_features && codes.size(1) == in_features && scales.scalar_type() == at::kHalf &&
                  scales.dim() == 2 && scales.size(0) == out_features && scales.size(1) == count,
              "sparsegen::q8_0_linear: codes must be int8 [out_features, in_features] and scales float16 "
              "[out_features, in_features / 32], got ", codes.sizes(), " and ", scales.sizes(), " for ", in_features,
              " inputs");
  const at::Tensor weights = codes.contiguous(), steps = scales.contiguous();
  std::vector<QuantizedRow> quantized = quantized_rows(x.reshape({-1, in_features}).contiguous(), count, false);
  const Q8_0Kernel kernel{weights.data_ptr<int8_t>(), reinterpret_cast<const uint8_t*>(steps.data_ptr<at::Half>()),
                          count};
  return outputs(x, kernel, quantized, out_features, at::empty({static_cast<int64_t>(quantized.size()), out_features},
                                                               x.options()));
}

// The dot products the w4a8, w5a8 and Q8_0 kernels take on this CPU (simd_level): what a benchmark records.
std::string simd_name() {
#ifdef SPARSEGEN_X86
  switch (simd_level()) {
    case Simd::kAvx512Vnni: return "avx512-vnni";
    case Simd::kAvx2: return "avx2";
    case Simd::kScalar: break;
  }
#endif
  return "scalar";
}

}  // namespace

TORCH_LIBRARY(sparsegen_cpu, m) { m.def("simd() -> str", simd_name); }

TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("w4a8_linear", linear<4>);
  m.impl("w5a8_linear", linear<5>);
  m.impl("q8_0_linear", q8_0_linear);
}
