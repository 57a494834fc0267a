// What sparsegen's C++ kernels share on x86: AVX2 code paths (functions compiled for AVX2, FMA and F16C, which a
// kernel calls only after checking the CPU at run time; the rest of the extension runs on any x86-64 or other CPU).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPARSEGEN_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))

// The sum of a vector's eight lanes.
AVX2 static inline float lanes_sum(__m256 lanes) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}
#endif
