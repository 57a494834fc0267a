// The w4a8, w5a8 and Q8_0 kernels' x86 dot products. w4a8_linear.cpp includes this file twice: in namespace avx2 with
// SIMD the AVX2 target, and in namespace vnni with SIMD the AVX-512 VNNI one and SPARSEGEN_VNNI set. The two differ
// only in byte_dots, so they give the same integer sums and the same float operations: the same outputs, to the bit.
// (No include guard: meant to be included more than once.)

// Each int32 lane of the result: the sum of its four byte products u * s (unsigned times signed), and with a second
// pair, of its eight. AVX2 sums byte pairs into 16 bits, then 16-bit pairs into 32 (sums of at most 4 * 31 * 127 or
// 2 * 128 * 127: 16 bits never saturate); AVX-512 VNNI's vpdpbusd does both in one instruction.
SIMD inline __m256i byte_dots(__m256i u, __m256i s) {
#ifdef SPARSEGEN_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

SIMD inline __m256i byte_dots(__m256i u, __m256i s, __m256i u2, __m256i s2) {
#ifdef SPARSEGEN_VNNI
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), u2, s2);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(u2, s2)),
                           _mm256_set1_epi16(1));
#endif
}

// ROWS input rows against one Q8_0 weight row, as llama.cpp's Q8_0 dot product: |code| times q with code's sign
// (unsigned times signed bytes, pair sums of at most 2 * 127 * 127: 16 bits never saturate); one row alternates two
// accumulators, as dot does.
template <int ROWS>
SIMD void dot_q8_0(const int8_t* codes, const uint8_t* scales, const QuantizedRow* rows, int64_t blocks, float* out,
                   int64_t stride) {
  constexpr int kChains = ROWS == 1 ? 2 : ROWS;
  __m256 sums[kChains];
  for (int c = 0; c < kChains; ++c) sums[c] = _mm256_setzero_ps();
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
        const __m256i products = byte_dots(magnitude, _mm256_sign_epi8(q, w));
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
SIMD inline __m256i fifth_bits(__m256i plane, int bit) {
  const __m256i moved = bit <= 4 ? _mm256_slli_epi16(plane, 4 - bit) : _mm256_srli_epi16(plane, bit - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

SIMD inline __m256i load_plane(const uint8_t* weights, int64_t blocks, int64_t pair) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + 20 * blocks + pair / 4 * 32));
}

// A pair's codes; 5 bits: ``plane`` is its plane, ``bit`` its place there (pair % 4).
template <int kBits>
SIMD inline PairCodes pair_codes(const uint8_t* weights, int64_t blocks, int64_t pair, __m256i plane, int bit) {
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
SIMD inline __m256 pair_sums(const PairCodes& codes, const int8_t* q) {
  return _mm256_cvtepi32_ps(byte_dots(codes.low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), codes.high,
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))));
}

// The odd last block's codes in their own order: 0-15 from the low nibbles, 16-31 from the high ones.
template <int kBits>
SIMD inline __m256i odd_block_codes(const uint8_t* weights, int64_t blocks) {
  const int64_t last = blocks - 1;
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(weights + 4 * blocks + last * 16));
  const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0xF));
  return kBits == 5 ? _mm256_or_si256(codes, fifth_bits(load_plane(weights, blocks, last / 2), last / 2 % 4)) : codes;
}

// sum(m * dx * sum(q)) over a row's blocks, eight at a time, and its odd last block's whole product.
template <int kBits>
SIMD inline float minimums_and_last(const uint8_t* weights, const QuantizedRow& row, int64_t blocks) {
  const uint8_t* minimums = weights + 2 * blocks;
  __m256 sums = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimums + 2 * b)));
    sums = _mm256_fmadd_ps(m, _mm256_loadu_ps(row.scaled_sum.data() + b), sums);
  }
  float total = lanes_sum(sums);
  for (; b < blocks; ++b) total += _cvtsh_ss(minimums[2 * b] | (minimums[2 * b + 1] << 8)) * row.scaled_sum[b];
  if (blocks % 2) {  // (the odd last block: q in its own order)
    const int64_t last = blocks - 1;
    const __m256i codes = odd_block_codes<kBits>(weights, blocks);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.codes.data() + last * kBlock));
    const __m256 sums_last = _mm256_cvtepi32_ps(byte_dots(codes, q));
    total += _cvtsh_ss(weights[2 * last] | (weights[2 * last + 1] << 8)) * row.scale[last] * lanes_sum(sums_last);
  }
  return total;
}

// ROWS input rows against one weight row: each pair's codes unpacked once for every row (a batch of decode steps or
// a prefill chunk is bound by these instructions, not by bytes), one accumulator per row; one row alternates two,
// as a single chain of fused multiply-adds would wait on its own latency.
template <int ROWS, int kBits>
SIMD void dot(const uint8_t* weights, const QuantizedRow* rows, int64_t blocks, float* out, int64_t stride) {
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

// A prompt's rows against eight weight rows at once (``ChannelTile``: their codes unpacked to bytes and interleaved,
// four inputs of one channel a 32-bit lane): one instruction multiplies four inputs of eight channels, a block's sums
// stay integers until its end, and a block's scales are applied once for the eight.
SIMD inline __m256i accumulate(__m256i sums, __m256i u, __m256i s) {
#ifdef SPARSEGEN_VNNI
  return _mm256_dpbusd_epi32(sums, u, s);
#else
  return _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// A weight row's codes (0-31) as bytes in code_slot's order, the order a row's activation codes take. (Once a tile,
// not a step's inner loop: each pair reads its plane again, and its bit's shifts are not constants.)
template <int kBits>
SIMD void unpack_codes(const uint8_t* weights, int64_t blocks, uint8_t* out) {
  for (int64_t pair = 0; pair < blocks / 2; ++pair) {
    const __m256i plane = kBits == 5 ? load_plane(weights, blocks, pair) : _mm256_setzero_si256();
    const PairCodes codes = pair_codes<kBits>(weights, blocks, pair, plane, pair % 4);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + pair * 2 * kBlock), codes.low);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + pair * 2 * kBlock + 32), codes.high);
  }
  if (blocks % 2) {
    const __m256i codes = odd_block_codes<kBits>(weights, blocks);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (blocks - 1) * kBlock), codes);
  }
}

// Four groups of four inputs (``codes``: the tile's, from a group on; ``at``: the rows' codes' byte offset) into
// ``dots``, one per row. (Constant indices throughout, so that the sums stay in registers.)
template <int ROWS>
SIMD inline __attribute__((always_inline)) void four_groups(const int32_t* codes, const QuantizedRow* rows, int64_t at,
                                                            __m256i (&dots)[ROWS]) {
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k * 8));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      int32_t four;
      std::memcpy(&four, rows[r].codes.data() + at + 4 * k, 4);
      dots[r] = accumulate(dots[r], w, _mm256_set1_epi32(four));
    }
  }
}

// ``sums`` += a block's integer sums times its scales, eight channels a row.
template <int ROWS>
SIMD inline __attribute__((always_inline)) void scaled(const ChannelTile& tile, const QuantizedRow* rows, int64_t block,
                                                       const __m256i (&dots)[ROWS], __m256 (&sums)[ROWS]) {
  const __m256 d = _mm256_loadu_ps(tile.scales.data() + block * 8);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(d, _mm256_set1_ps(rows[r].scale[block])),
                              sums[r]);
}

// ROWS input rows against a tile's eight channels: out[r * stride + j] for j < 8. A pair's 16 groups of four: groups
// 0-3 and 8-11 are its first block's, 4-7 and 12-15 its second's; the odd last block's 8 are its own.
template <int ROWS>
SIMD void tile_dot(const ChannelTile& tile, const QuantizedRow* rows, int64_t blocks, float* out, int64_t stride) {
  __m256 sums[ROWS];
  for (int r = 0; r < ROWS; ++r) sums[r] = _mm256_setzero_ps();
  const int32_t* codes = tile.codes.data();
  const int64_t paired = blocks / 2 * 2;
  for (int64_t block = 0; block < paired; block += 2) {
    __m256i first[ROWS], second[ROWS];
    for (int r = 0; r < ROWS; ++r) first[r] = second[r] = _mm256_setzero_si256();
    const int32_t* group = codes + block * 8 * 8;
    const int64_t at = block * kBlock;
    four_groups<ROWS>(group, rows, at, first);
    four_groups<ROWS>(group + 32, rows, at + 16, second);
    four_groups<ROWS>(group + 64, rows, at + 32, first);
    four_groups<ROWS>(group + 96, rows, at + 48, second);
    scaled<ROWS>(tile, rows, block, first, sums);
    scaled<ROWS>(tile, rows, block + 1, second, sums);
  }
  if (blocks % 2) {
    __m256i last[ROWS];
    for (int r = 0; r < ROWS; ++r) last[r] = _mm256_setzero_si256();
    four_groups<ROWS>(codes + paired * 8 * 8, rows, paired * kBlock, last);
    four_groups<ROWS>(codes + paired * 8 * 8 + 32, rows, paired * kBlock + 16, last);
    scaled<ROWS>(tile, rows, paired, last, sums);
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256 m = _mm256_loadu_ps(tile.minimums.data() + b * 8);
    for (int r = 0; r < ROWS; ++r) sums[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(rows[r].scaled_sum[b]), sums[r]);
  }
  for (int r = 0; r < ROWS; ++r) _mm256_storeu_ps(out + r * stride, sums[r]);
}
