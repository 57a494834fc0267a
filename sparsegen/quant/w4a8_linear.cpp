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
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../avx2.h"

namespace {

constexpr int64_t kBlock = 32;  // inputs a block holds
// How far ahead of its dot products a thread asks memory for weight rows. The hardware's prefetcher alone kept too few
// reads in flight: Gemma-3-270M's tied head (178 MB of Q8_0) streamed at 42-53 GB/s where a plain sum of a tensor
// reads 73 on the same machine, and a compiled Gemma step at 8K took 7.7-8.0% longer (one process, interleaved).
constexpr int64_t kPrefetchBytes = 8192;

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
// ROWS input rows against one Q8_0 weight row, as llama.cpp's AVX2 Q8_0 dot product: |code| times q with code's sign
// (unsigned times signed bytes, pair sums of at most 2 * 127 * 127: 16 bits never saturate); one row alternates two
// accumulators, as dot_avx2 does.
template <int ROWS>
AVX2 void dot_q8_0_avx2(const int8_t* codes, const uint8_t* scales, const QuantizedRow* rows, int64_t blocks,
                        float* out, int64_t stride) {
  constexpr int kChains = ROWS == 1 ? 2 : ROWS;
  __m256 sums[kChains];
  for (int c = 0; c < kChains; ++c) sums[c] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float steps[ROWS][8];  // (d * dx of eight blocks, each row: one conversion and one product for eight)
  for (int64_t first = 0; first < blocks; first += 8) {
    const int64_t count = blocks - first < 8 ? blocks - first : 8;
    for (int r = 0; r < ROWS; ++r) {
      if (count == 8) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 2 * first)));
        _mm256_store_ps(steps[r], _mm256_mul_ps(d, _mm256_loadu_ps(rows[r].scale.data() + first)));
      } else {
        for (int64_t k = 0; k < count; ++k)
          steps[r][k] = half_bits(scales + 2 * (first + k)) * rows[r].scale[first + k];
      }
    }
    for (int64_t k = 0; k < count; ++k) {
      const int64_t b = first + k;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * kBlock));
      const __m256i magnitude = _mm256_sign_epi8(w, w);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r].codes.data() + b * kBlock));
        const __m256i products = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q, w)), ones);
        const int c = ROWS == 1 ? k % 2 : r;
        sums[c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&steps[r][k]), _mm256_cvtepi32_ps(products), sums[c]);
      }
    }
  }
  if (ROWS == 1) sums[0] = _mm256_add_ps(sums[0], sums[kChains - 1]);
  for (int r = 0; r < ROWS; ++r) out[r * stride] = lanes_sum(sums[r]);
}

// A pair of blocks' codes, low nibbles (codes 0-15 of each) and high (16-31), and scales spread to their sums' lanes.
struct PairCodes {
  __m256i low, high;
  __m256 scales;
};

// Bit ``bit`` of each byte of a plane, moved to bit 4 (16 where it is set, else 0): one 16-bit shift and a mask (bits
// a shift carries across bytes land outside bit 4). ``bit`` is a constant where the callers' loops unroll.
AVX2 inline __m256i fifth_bits(__m256i plane, int bit) {
  const __m256i moved = bit <= 4 ? _mm256_slli_epi16(plane, 4 - bit) : _mm256_srli_epi16(plane, bit - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

AVX2 inline __m256i load_plane(const uint8_t* weights, int64_t blocks, int64_t pair) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + 20 * blocks + pair / 4 * 32));
}

// A pair's codes; 5 bits: ``plane`` is its plane, ``bit`` its place there (pair % 4).
template <int kBits>
AVX2 inline PairCodes pair_codes(const uint8_t* weights, int64_t blocks, int64_t pair, __m256i plane, int bit) {
  const __m256i nibble = _mm256_set1_epi8(0xF);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + 4 * blocks + pair * 32));
  int32_t two_scales;
  std::memcpy(&two_scales, weights + pair * 4, 4);
  const __m256 scales = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two_scales)));
  PairCodes codes{_mm256_and_si256(packed, nibble), _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble),
                  _mm256_permutevar8x32_ps(scales, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))};
  if (kBits == 5) {
    codes.low = _mm256_or_si256(codes.low, fifth_bits(plane, bit));
    codes.high = _mm256_or_si256(codes.high, fifth_bits(plane, bit + 4));
  }
  return codes;
}

// sum(code * q) of the pair's two blocks, four lanes each: unsigned codes (0-31) times signed q, pair sums of at most
// 2 * 31 * 127, two of them added: 16 bits never saturate.
AVX2 inline __m256 pair_sums(const PairCodes& codes, const int8_t* q) {
  const __m256i low = _mm256_maddubs_epi16(codes.low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m256i high = _mm256_maddubs_epi16(codes.high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(low, high), _mm256_set1_epi16(1)));
}

// sum(m * dx * sum(q)) over a row's blocks, eight at a time, and its odd last block's whole product.
template <int kBits>
AVX2 inline float minimums_and_last(const uint8_t* weights, const QuantizedRow& row, int64_t blocks) {
  const uint8_t* minimums = weights + 2 * blocks;
  __m256 sums = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimums + 2 * b)));
    sums = _mm256_fmadd_ps(m, _mm256_loadu_ps(row.scaled_sum.data() + b), sums);
  }
  float total = lanes_sum(sums);
  for (; b < blocks; ++b) total += _cvtsh_ss(minimums[2 * b] | (minimums[2 * b + 1] << 8)) * row.scaled_sum[b];
  if (blocks % 2) {  // (the odd last block: codes 0-15 low, 16-31 high, q in its own order)
    const int64_t last = blocks - 1;
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(weights + 4 * blocks + last * 16));
    __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0xF));
    if (kBits == 5) codes = _mm256_or_si256(codes, fifth_bits(load_plane(weights, blocks, last / 2), last / 2 % 4));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.codes.data() + last * kBlock));
    const __m256 sums_last =
        _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), _mm256_set1_epi16(1)));
    total += _cvtsh_ss(weights[2 * last] | (weights[2 * last + 1] << 8)) * row.scale[last] * lanes_sum(sums_last);
  }
  return total;
}

// ROWS input rows against one weight row: each pair's codes unpacked once for every row (a batch of decode steps or
// a prefill chunk is bound by these instructions, not by bytes), one accumulator per row; one row alternates two,
// as a single chain of fused multiply-adds would wait on its own latency.
template <int ROWS, int kBits>
AVX2 void dot_avx2(const uint8_t* weights, const QuantizedRow* rows, int64_t blocks, float* out, int64_t stride) {
  constexpr int kChains = ROWS == 1 ? 2 : ROWS;
  __m256 sums[kChains];
  for (int c = 0; c < kChains; ++c) sums[c] = _mm256_setzero_ps();
  const int64_t pairs = blocks / 2;
  for (int64_t first = 0; first < pairs; first += 4) {  // (a plane's four pairs, unrolled: its shifts are constants)
    const __m256i plane = kBits == 5 ? load_plane(weights, blocks, first) : _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int bit = 0; bit < 4; ++bit) {
      const int64_t pair = first + bit;
      if (pair == pairs) break;
      const PairCodes codes = pair_codes<kBits>(weights, blocks, pair, plane, bit);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 scales = _mm256_mul_ps(codes.scales, _mm256_loadu_ps(rows[r].pair_scales.data() + pair * 8));
        const int c = ROWS == 1 ? bit % 2 : r;
        sums[c] = _mm256_fmadd_ps(scales, pair_sums(codes, rows[r].codes.data() + pair * 2 * kBlock), sums[c]);
      }
    }
  }
  if (ROWS == 1) sums[0] = _mm256_add_ps(sums[0], sums[kChains - 1]);
  for (int r = 0; r < ROWS; ++r) out[r * stride] = lanes_sum(sums[r]) + minimums_and_last<kBits>(weights, rows[r], blocks);
}

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

bool has_avx2() {  // (SPARSEGEN_SCALAR_KERNELS set: the scalar path, as a CPU without AVX2 runs it; tests use it)
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                __builtin_cpu_supports("f16c") && std::getenv("SPARSEGEN_SCALAR_KERNELS") == nullptr;
  return supported;
}
#endif

// Every row of ``flat`` quantized (``paired``: in code_slot's order), a prefill chunk's rows split across threads.
std::vector<QuantizedRow> quantized_rows(const at::Tensor& flat, int64_t count, bool paired) {
  const int64_t rows = flat.size(0), in_features = flat.size(1);
#ifdef SPARSEGEN_X86
  const bool vector = has_avx2();
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

// The 4- and 5-bit weights' dot products, by output channel.
template <int kBits>
struct BlocksKernel {
  const uint8_t* weights;
  int64_t stride, count;  // (stride: row_bytes(kBits, count), checked by the caller)
#ifdef SPARSEGEN_X86
  template <int ROWS>
  void dot(int64_t n, const QuantizedRow* rows, float* out, int64_t out_stride) const {
    dot_avx2<ROWS, kBits>(row(n), rows, count, out, out_stride);
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
  void dot(int64_t n, const QuantizedRow* rows, float* out, int64_t out_stride) const {
    dot_q8_0_avx2<ROWS>(row(n), scales + n * count * 2, rows, count, out, out_stride);
  }
#endif
  const int8_t* row(int64_t n) const { return codes + n * row_bytes(); }  // (its codes; its scales lie apart)
  int64_t row_bytes() const { return count * kBlock; }
  float scalar(int64_t n, QuantizedRow& input) const {
    return dot_q8_0_scalar(row(n), scales + n * count * 2, input, count);
  }
};

// ``x``'s outputs [..., out_features] from its quantized rows: output channels split across threads, each weight row
// read once and used for every input row (four at a time, then one by one), the rows kPrefetchBytes on requested.
template <class Kernel>
at::Tensor outputs(const at::Tensor& x, const Kernel& kernel, std::vector<QuantizedRow>& quantized,
                   int64_t out_features) {
  const int64_t rows = quantized.size();
  at::Tensor out = at::empty({rows, out_features}, x.options());
  float* y = out.data_ptr<float>();
#ifdef SPARSEGEN_X86
  const bool vector = has_avx2();
#endif
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / kernel.row_bytes());
  at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      if (n + ahead < last) {
        const char* next = reinterpret_cast<const char*>(kernel.row(n + ahead));
        for (int64_t at = 0; at < kernel.row_bytes(); at += 64) __builtin_prefetch(next + at);
      }
      int64_t r = 0;
#ifdef SPARSEGEN_X86
      if (vector) {
        for (; r + 4 <= rows; r += 4) kernel.template dot<4>(n, &quantized[r], y + r * out_features + n, out_features);
        for (; r < rows; ++r) kernel.template dot<1>(n, &quantized[r], y + r * out_features + n, 0);
      }
#endif
      for (; r < rows; ++r) y[r * out_features + n] = kernel.scalar(n, quantized[r]);
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return out.view(shape);
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
  return outputs(x, BlocksKernel<kBits>{weights.data_ptr<uint8_t>(), weights.size(1), count}, quantized, out_features);
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
  return outputs(x, kernel, quantized, out_features);
}

}  // namespace

TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("w4a8_linear", linear<4>);
  m.impl("w5a8_linear", linear<5>);
  m.impl("q8_0_linear", q8_0_linear);
}
