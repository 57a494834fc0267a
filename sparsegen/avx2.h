// What sparsegen's C++ kernels share on x86: AVX2 code paths (functions compiled for AVX2, FMA and F16C, and some
// also for AVX-512 VNNI, which a kernel calls only after checking the CPU at run time: simd_level; the rest of the
// extension runs on any x86-64 or other CPU).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#define SPARSEGEN_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

enum class Simd { kScalar, kAvx2, kAvx512Vnni };

// The widest instructions this CPU gives the kernels, capped by SPARSEGEN_KERNELS ("scalar" or "avx2": the paths a
// CPU without them takes, which the tests force).
inline Simd simd_level() {
  static const Simd level = [] {
    const char* cap = std::getenv("SPARSEGEN_KERNELS");
    TORCH_CHECK(cap == nullptr || *cap == '\0' || std::strcmp(cap, "scalar") == 0 || std::strcmp(cap, "avx2") == 0,
                "SPARSEGEN_KERNELS=", cap, ": give scalar or avx2 (the widest path the kernels may take), or unset it");
    if ((cap != nullptr && std::strcmp(cap, "scalar") == 0) || !__builtin_cpu_supports("avx2") ||
        !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
      return Simd::kScalar;
    if ((cap != nullptr && std::strcmp(cap, "avx2") == 0) || !__builtin_cpu_supports("avx512vnni") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512bw"))
      return Simd::kAvx2;
    return Simd::kAvx512Vnni;
  }();
  return level;
}

// The sum of a vector's eight lanes.
AVX2 static inline float lanes_sum(__m256 lanes) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

// The largest of a vector's eight lanes.
AVX2 static inline float lanes_max(__m256 lanes) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

// exp(x) for x <= 0 (a score less its maximum): Cephes' expf, 2^n times a degree-6 polynomial of the remainder,
// within ~2 ulp; 0 below -87.3 (where fp32 leaves normal numbers) and for -inf (a masked slot).
AVX2 static inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(power)));
}
#endif
