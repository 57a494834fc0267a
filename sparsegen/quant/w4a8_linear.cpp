// W4A8Linear's kernel: 4-bit weights times 8-bit activations with integer dot products, as llama.cpp's AVX2 kernels
// multiply Q4_1 blocks by Q8_1 ones. PyTorch's own int4 CPU kernel takes bfloat16 activations, which a CPU without
// native bfloat16 converts in software: it read SmolLM2's weights at 13-16 GB/s where this machine copies at 31-45.
//
// Weights, per output row, in blocks of 32 inputs of 20 bytes: fp16 scale d, fp16 minimum m, then 16 bytes whose low
// nibbles are codes 0-15 and high nibbles codes 16-31 (llama.cpp's Q4_1 layout): w = d * code + m.
// Activations, per row and block: x ~ dx * q with q = round(x / dx) in [-127, 127], dx = max|x| / 127.
// So a block's product is d * dx * sum(code * q) + m * dx * sum(q): one integer sum and one float term.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPARSEGEN_X86 1
#endif

namespace {

constexpr int64_t kBlock = 32;       // inputs a block holds
constexpr int64_t kBlockBytes = 20;  // its bytes: 2 + 2 + 16

float half_bits(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One row of activations, quantized: codes [blocks * 32], and per block dx and dx * sum(q).
struct QuantizedRow {
  std::vector<int8_t> codes;
  std::vector<float> scale, scaled_sum;
};

void quantize_row(const float* x, int64_t blocks, QuantizedRow& row) {
  row.codes.resize(blocks * kBlock);
  row.scale.resize(blocks);
  row.scaled_sum.resize(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* in = x + b * kBlock;
    float peak = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) peak = std::fmax(peak, std::fabs(in[i]));
    const float scale = peak / 127.f;
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(in[i] * inverse));  // (ties to even, as torch.round)
      row.codes[b * kBlock + i] = static_cast<int8_t>(q);
      sum += q;
    }
    row.scale[b] = scale;
    row.scaled_sum[b] = scale * static_cast<float>(sum);
  }
}

float dot_scalar(const uint8_t* weights, const QuantizedRow& row, int64_t blocks) {
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = weights + b * kBlockBytes;
    const int8_t* q = row.codes.data() + b * kBlock;
    int32_t sum = 0;
    for (int64_t i = 0; i < 16; ++i) {
      sum += static_cast<int32_t>(block[4 + i] & 0xF) * q[i];
      sum += static_cast<int32_t>(block[4 + i] >> 4) * q[16 + i];
    }
    total += half_bits(block) * row.scale[b] * static_cast<float>(sum) + half_bits(block + 2) * row.scaled_sum[b];
  }
  return total;
}

#ifdef SPARSEGEN_X86
// One block's integer sum, as 8 int32 lanes turned to float: unsigned codes (0-15) times signed q, whose pair sums
// (at most 2 * 15 * 127) never saturate 16 bits.
__attribute__((target("avx2,fma,f16c"))) inline __m256 block_sums(const uint8_t* block, const int8_t* q) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0xF));
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
}

__attribute__((target("avx2,fma,f16c"))) inline float half_at(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, 2);
  return _cvtsh_ss(bits);
}

// Two blocks a turn into two accumulators each: a single chain of fused multiply-adds waits on its own latency.
__attribute__((target("avx2,fma,f16c"))) float dot_avx2(const uint8_t* weights, const QuantizedRow& row,
                                                        int64_t blocks) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  float minimums_even = 0.f, minimums_odd = 0.f;
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    const uint8_t* first = weights + b * kBlockBytes;
    const uint8_t* second = first + kBlockBytes;
    even = _mm256_fmadd_ps(_mm256_set1_ps(half_at(first) * row.scale[b]),
                           block_sums(first, row.codes.data() + b * kBlock), even);
    odd = _mm256_fmadd_ps(_mm256_set1_ps(half_at(second) * row.scale[b + 1]),
                          block_sums(second, row.codes.data() + (b + 1) * kBlock), odd);
    minimums_even += half_at(first + 2) * row.scaled_sum[b];
    minimums_odd += half_at(second + 2) * row.scaled_sum[b + 1];
  }
  if (b < blocks) {
    const uint8_t* last = weights + b * kBlockBytes;
    even = _mm256_fmadd_ps(_mm256_set1_ps(half_at(last) * row.scale[b]), block_sums(last, row.codes.data() + b * kBlock),
                           even);
    minimums_even += half_at(last + 2) * row.scaled_sum[b];
  }
  const __m256 products = _mm256_add_ps(even, odd);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(products), _mm256_extractf128_ps(products, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half) + minimums_even + minimums_odd;
}

bool has_avx2() {
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                __builtin_cpu_supports("f16c");
  return supported;
}
#endif

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "sparsegen::w4a8_linear: float32 inputs, got ", x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(0) == out_features,
              "sparsegen::w4a8_linear: blocks must be uint8 [out_features, in_features / 32 * 20]");
  const int64_t in_features = x.size(-1);
  TORCH_CHECK(in_features % kBlock == 0 && blocks.size(1) == in_features / kBlock * kBlockBytes,
              "sparsegen::w4a8_linear: ", in_features, " inputs do not match blocks of shape ", blocks.sizes());
  const at::Tensor flat = x.reshape({-1, in_features}).contiguous();
  const at::Tensor weights = blocks.contiguous();
  const int64_t rows = flat.size(0), count = in_features / kBlock;
  std::vector<QuantizedRow> quantized(rows);
  for (int64_t r = 0; r < rows; ++r) quantize_row(flat.data_ptr<float>() + r * in_features, count, quantized[r]);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  float* y = out.data_ptr<float>();
  const uint8_t* w = weights.data_ptr<uint8_t>();
  const int64_t row_bytes = weights.size(1);
#ifdef SPARSEGEN_X86
  const bool vector = has_avx2();
#endif
  // (output channels split across threads; each weight row is read once and used for every input row)
  at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      for (int64_t r = 0; r < rows; ++r) {
#ifdef SPARSEGEN_X86
        y[r * out_features + n] = vector ? dot_avx2(w + n * row_bytes, quantized[r], count)
                                         : dot_scalar(w + n * row_bytes, quantized[r], count);
#else
        y[r * out_features + n] = dot_scalar(w + n * row_bytes, quantized[r], count);
#endif
      }
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("w4a8_linear", w4a8_linear);
}
