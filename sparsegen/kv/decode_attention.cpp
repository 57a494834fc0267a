// sparsegen::decode_attention: one decode step's attention on a CPU, in one pass over a layer's keys and values.
//
// Each sequence brings one query per query head (a decode step) or a few (a speculative verification: the pending
// token and the drafts); the G query heads that share a KV head score its held slots (and the step's own tokens, which
// wait beside them until eviction places them) with all their queries together, so each key and value is read once a
// call (a 5-token verification's forward, SmolLM2 w8a8 at 8K x 8: 1.4-1.5x the grouped matmuls'; compute-bound at
// several queries).
// The slots are cut into chunks, scored, exponentiated against the chunk's own maximum and summed into the
// chunk's output, all while the chunk is in cache; chunks run in parallel and are merged by their maxima
// (flash-decoding). Grouped matmuls, a masked softmax and a second matmul read the cache twice and wrote the scores
// three times: at 2K tokens they were ~60% of a SmolLM2 step on a 2-core AVX2 CPU.
//
// Slots a sequence cannot see (free, evicted, outside a sliding window) are masked; under StreamingLLM's rolling
// positions with keys held at their token ordinal, the sinks are scored against the query turned to its rank instead
// (``sink_query``). The probabilities are returned where a policy observes attention (H2O); an all-masked row gives
// NaN, as PyTorch's softmax does. Keys and values are fp32, or fp16 (``kv_bits=16``, llama.cpp's default cache type:
// half the bytes a step reads), widened to fp32 as they load; scores and sums are fp32 either way.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../avx2.h"

namespace {

constexpr int64_t kChunk = 256;  // slots a task scores: its keys, values and scores stay in L2
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// A [B, H, T, D] operand of fp32 or fp16 numbers (T): the held slots, then the step's own tokens (``extra``) from
// slot ``slots`` on, if any.
template <typename T>
struct Rows {
  const T* held;
  int64_t batch_stride, head_stride, slot_stride, slots;
  const T* extra;
  int64_t extra_batch_stride, extra_head_stride, extra_slot_stride;

  const T* row(int64_t b, int64_t h, int64_t t) const {
    return t < slots ? held + b * batch_stride + h * head_stride + t * slot_stride
                     : extra + b * extra_batch_stride + h * extra_head_stride + (t - slots) * extra_slot_stride;
  }
};

// A [B, 1 or H, Q, T] mask (query row r of a KV head reads its query's, r % Q), by strides (0 where broadcast);
// ``fallback`` where none is given.
struct Flags {
  const bool* data;
  int64_t batch_stride, head_stride, query_stride, slot_stride, queries;
  bool fallback;

  bool at(int64_t b, int64_t h, int64_t r, int64_t t) const {
    return data == nullptr ? fallback : row(b, h, r)[t * slot_stride];
  }
  // query row r's flags (index them by slot times ``slot_stride``)
  const bool* row(int64_t b, int64_t h, int64_t r) const {
    return data + b * batch_stride + h * head_stride + (r % queries) * query_stride;
  }
  // whether any query sees slot t
  bool any(int64_t b, int64_t h, int64_t t) const {
    if (data == nullptr) return fallback;
    const bool* slot = row(b, h, 0) + t * slot_stride;
    for (int64_t r = 0; r < queries; ++r)
      if (slot[r * query_stride]) return true;
    return false;
  }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& held, const c10::optional<at::Tensor>& extra) {
  Rows<T> rows{held.data_ptr<T>(), held.stride(0), held.stride(1), held.stride(2), held.size(2), nullptr, 0, 0, 0};
  if (extra.has_value()) {
    rows.extra = extra->data_ptr<T>();
    rows.extra_batch_stride = extra->stride(0);
    rows.extra_head_stride = extra->stride(1);
    rows.extra_slot_stride = extra->stride(2);
  }
  return rows;
}

// ``mask`` [B, 1 or H, T] (one for every query) or [B, 1 or H, Q, T]
Flags flags_of(const c10::optional<at::Tensor>& mask, bool fallback) {
  if (!mask.has_value()) return {nullptr, 0, 0, 0, 0, 1, fallback};
  const at::Tensor& m = *mask;
  const bool each = m.dim() == 4;
  return {m.data_ptr<bool>(), m.stride(0), m.size(1) == 1 ? 0 : m.stride(1), each ? m.stride(2) : 0,
          m.stride(m.dim() - 1), each ? m.size(2) : 1, fallback};
}

template <typename T>
struct Problem {
  const float* query;       // [B, H, G, D] contiguous (G: the query heads of a KV head times the queries)
  const float* sink_query;  // the same, in the sinks' frame, or null
  Rows<T> keys, values;
  Flags visible, sink;
  int64_t batch, heads, group, dim, value_dim, total, chunks;
  float scaling;
  float* scores;  // [B, H, G, T]: scores, then exp(score - the chunk's maximum), then (if asked) probabilities
  std::vector<float> maxima, sums, outputs;  // per task (b, h, chunk): [G], [G], [G, Dv]
  std::vector<std::pair<int64_t, int64_t>> spans;  // per task: its slots from the first visible block to the last

  const float* query_of(int64_t b, int64_t h, int64_t t) const {
    const float* q = sink_query != nullptr && sink.at(b, h, 0, t) ? sink_query : query;
    return q + (b * heads + h) * group * dim;
  }
  float* scores_of(int64_t b, int64_t h, int64_t g) const { return scores + ((b * heads + h) * group + g) * total; }
  // whether any of slots [t, t + n) is visible: a block of free or hidden slots (a fixed-shape step's unused
  // budget, a sliding window's past) is neither read nor scored, so a step costs the slots it sees
  bool any_visible(int64_t b, int64_t h, int64_t t, int64_t n) const {
    if (visible.data == nullptr) return true;
    if (n == 8 && visible.slot_stride == 1) {  // (a query's eight flags as one word)
      const bool* flags = visible.row(b, h, 0) + t;
      for (int64_t r = 0; r < visible.queries; ++r) {
        uint64_t word;
        std::memcpy(&word, flags + r * visible.query_stride, 8);
        if (word != 0) return true;
      }
      return false;
    }
    for (int64_t i = 0; i < n; ++i)
      if (visible.any(b, h, t + i)) return true;
    return false;
  }
  // Task (b, h, chunk)'s slots from its first visible block of eight to its last (empty where it sees none): only
  // they are scored, exponentiated and weighed, since a fixed-shape step's unused budget lies at the end (at 512 of
  // 920 slots, a batch-8 SmolLM2 call 1.06-1.08x); the weights outside are 0.
  std::pair<int64_t, int64_t> span(int64_t task) const {
    const int64_t chunk_first = task % chunks * kChunk, b = task / chunks / heads, h = task / chunks % heads;
    int64_t first = chunk_first, last = std::min(chunk_first + kChunk, total);
    while (first < last && !any_visible(b, h, first, std::min<int64_t>(8, last - first)))
      first = std::min(first + 8, last);
    for (int64_t block = chunk_first + (last - chunk_first - 1) / 8 * 8; last > first; block -= 8) {
      if (any_visible(b, h, block, last - block)) break;
      last = block;
    }
    return {first, last};
  }
};

// The first task of each of ``parts`` contiguous runs of tasks holding about equal numbers of visible slots (and
// ``tasks`` after the last). A head's visible chunks come first and its unused ones last, so equal numbers of tasks,
// as parallel_for deals them, can hold unequal work: batch 1 at 512 of 920 slots on 2 threads gave one thread four
// chunks of 256 and the other two (balanced: SmolLM2 1.12x a call, Gemma's one KV head at 512 of 1,100 1.56x).
// Contiguous runs keep each thread's reads one stream (threads taking the next task as they finish: 0.76x at batch 8).
std::vector<int64_t> balanced_runs(const std::vector<std::pair<int64_t, int64_t>>& spans, int64_t parts) {
  const int64_t tasks = static_cast<int64_t>(spans.size());
  int64_t total = 0;
  for (const auto& [first, last] : spans) total += last - first + 1;  // (+1: an empty task costs a little too)
  std::vector<int64_t> starts(parts + 1, tasks);
  int64_t done = 0;
  for (int64_t task = 0, part = 0; task < tasks; ++task) {
    const int64_t cost = spans[task].second - spans[task].first + 1;
    const int64_t owner = std::min(parts - 1, (2 * done + cost) * parts / (2 * total));  // (by its middle)
    while (part <= owner) starts[part++] = task;
    done += cost;
  }
  return starts;
}

// ---- the portable path (any head width; a CPU without AVX2) ----

template <typename T>
void chunk_scalar(Problem<T>& p, int64_t task) {
  const int64_t c = task % p.chunks, bh = task / p.chunks, b = bh / p.heads, h = bh % p.heads;
  const int64_t first = c * kChunk, last = std::min(first + kChunk, p.total);
  float* maxima = p.maxima.data() + task * p.group;
  float* sums = p.sums.data() + task * p.group;
  float* out = p.outputs.data() + task * p.group * p.value_dim;
  for (int64_t g = 0; g < p.group; ++g) {
    float* s = p.scores_of(b, h, g);
    float peak = kMinusInf;
    for (int64_t t = first; t < last; ++t) {
      if (!p.visible.at(b, h, g, t)) {
        s[t] = kMinusInf;
        continue;
      }
      const float* q = p.query_of(b, h, t) + g * p.dim;
      const T* k = p.keys.row(b, h, t);
      float dot = 0.f;
      for (int64_t d = 0; d < p.dim; ++d) dot += q[d] * static_cast<float>(k[d]);
      s[t] = dot * p.scaling;
      peak = std::fmax(peak, s[t]);
    }
    float sum = 0.f;
    float* o = out + g * p.value_dim;
    for (int64_t d = 0; d < p.value_dim; ++d) o[d] = 0.f;
    for (int64_t t = first; t < last; ++t) {
      s[t] = s[t] == kMinusInf ? 0.f : std::exp(s[t] - peak);
      sum += s[t];
      const T* v = p.values.row(b, h, t);
      for (int64_t d = 0; d < p.value_dim; ++d) o[d] += s[t] * static_cast<float>(v[d]);
    }
    maxima[g] = peak;
    sums[g] = sum;
  }
}

#ifdef SPARSEGEN_X86
// Eight numbers as fp32 lanes: fp32 loaded, fp16 widened (F16C).
AVX2 inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
AVX2 inline __m256 load8(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

template <typename T>
AVX2 inline void prefetch_row(const T* row, int64_t width) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < width * static_cast<int64_t>(sizeof(T)); at += 64) _mm_prefetch(bytes + at, _MM_HINT_T0);
}

// Eight keys' dot products with one query (D a multiple of 8): eight chains of fused multiply-adds in flight, as
// their latency needs (four left the FMA units half idle).
template <typename T>
AVX2 inline __m256 dots8(const float* q, const T* const* k, int64_t dim) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qd, load8(k[i] + d), a[i]);
  }
  // (per half: lane sums of keys 0-3 and 4-7; the halves added)
  const __m256 first = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 second = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20), _mm256_permute2f128_ps(first, second, 0x31));
}

// The lane sums of four accumulators, in order.
AVX2 inline __m128 lane_sums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  // (two horizontal adds leave [a0, a1, a2, a3]'s lane sums, split over the two 128-bit halves)
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// Four keys' dot products with one query (D a multiple of 8), one chain each.
template <typename T>
AVX2 inline __m128 dots4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t dim) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qd, load8(k0 + d), a0);
    a1 = _mm256_fmadd_ps(qd, load8(k1 + d), a1);
    a2 = _mm256_fmadd_ps(qd, load8(k2 + d), a2);
    a3 = _mm256_fmadd_ps(qd, load8(k3 + d), a3);
  }
  return lane_sums4(a0, a1, a2, a3);
}

// Four keys' dot products with each of GQ queries (rows ``dim`` apart; D a multiple of 8), times ``scaling``, into
// out[g][0..3]: each key widened once for all GQ queries (against once a query: a batch-8 SmolLM2 call with fp16 K/V
// 1.02-1.05x), GQ x 4 chains in flight, the queries read from L1 as operands (12 accumulators and a key fill AVX2's
// 16 registers).
template <typename T, int GQ>
AVX2 inline void dots4_queries(const float* q, int64_t dim, const T* const* k, float scaling, float* const* out) {
  __m256 a[GQ][4];
  for (int g = 0; g < GQ; ++g)
    for (int i = 0; i < 4; ++i) a[g][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8)
    for (int i = 0; i < 4; ++i) {
      const __m256 key = load8(k[i] + d);
      for (int g = 0; g < GQ; ++g) a[g][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + d), key, a[g][i]);
    }
  for (int g = 0; g < GQ; ++g)
    _mm_storeu_ps(out[g], _mm_mul_ps(lane_sums4(a[g][0], a[g][1], a[g][2], a[g][3]), _mm_set1_ps(scaling)));
}

// Eight keys' scores for query heads [g0, g0 + GQ), four keys at a time.
template <typename T, int GQ>
AVX2 inline void score8_queries(const Problem<T>& p, int64_t b, int64_t h, int64_t t, const float* q,
                                const T* const* k, int64_t g0) {
  float* out[GQ];
  for (int half = 0; half < 8; half += 4) {
    for (int g = 0; g < GQ; ++g) out[g] = p.scores_of(b, h, g0 + g) + t + half;
    dots4_queries<T, GQ>(q + g0 * p.dim, p.dim, k + half, p.scaling, out);
  }
}

// out[g] += sum_t e[g][t] v[t] over ``kRowBlock`` rows from ``first`` for GROUP query heads from ``g0``, VECS * 8
// value dimensions at a time in registers: each value row is read once for the whole group, and the rows stay in L1
// while every VECS * 8 dimensions pass over them. GROUP * VECS accumulators (8-12) keep the FMA units busy.
constexpr int64_t kRowBlock = 8;

template <typename T, int GROUP, int VECS>
AVX2 void weigh_values(const Problem<T>& p, int64_t b, int64_t h, int64_t first, int64_t last, int64_t g0,
                       float* out) {
  const float* e[GROUP];
  for (int g = 0; g < GROUP; ++g) e[g] = p.scores_of(b, h, g0 + g);
  const T* v[kRowBlock];
  for (int64_t t = first; t < last; ++t) v[t - first] = p.values.row(b, h, t);
  for (int64_t d = 0; d < p.value_dim; d += 8 * VECS) {
    __m256 acc[GROUP][VECS];
    for (int g = 0; g < GROUP; ++g)
      for (int j = 0; j < VECS; ++j) acc[g][j] = _mm256_loadu_ps(out + (g0 + g) * p.value_dim + d + 8 * j);
    for (int64_t t = first; t < last; ++t) {
      __m256 weight[GROUP];
      for (int g = 0; g < GROUP; ++g) weight[g] = _mm256_broadcast_ss(e[g] + t);
      for (int j = 0; j < VECS; ++j) {
        const __m256 row = load8(v[t - first] + d + 8 * j);
        for (int g = 0; g < GROUP; ++g) acc[g][j] = _mm256_fmadd_ps(weight[g], row, acc[g][j]);
      }
    }
    for (int g = 0; g < GROUP; ++g)
      for (int j = 0; j < VECS; ++j) _mm256_storeu_ps(out + (g0 + g) * p.value_dim + d + 8 * j, acc[g][j]);
  }
}

// s[t] = -inf where ``seen`` (by ``stride``) is false, t in [first, last): eight flags at a time when they are
// contiguous, a block all seen (the common case) left as it is.
AVX2 inline void hide(const bool* seen, int64_t stride, float* s, int64_t first, int64_t last) {
  int64_t t = first;
  if (stride == 1) {
    for (; t + 8 <= last; t += 8) {
      uint64_t word;
      std::memcpy(&word, seen + t, 8);
      if (word == 0x0101010101010101ULL) continue;
      const __m256i flags = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(seen + t)));
      const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(flags, _mm256_setzero_si256()));
      _mm256_storeu_ps(s + t, _mm256_blendv_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(kMinusInf), hidden));
    }
  }
  for (; t < last; ++t)
    if (!seen[t * stride]) s[t] = kMinusInf;
}

// The chunk's scores, eight keys at a time for every query head while the eight are in L1 (each key read once).
template <typename T>
AVX2 void score_chunk(const Problem<T>& p, int64_t b, int64_t h, int64_t first, int64_t last) {
  int64_t t = first;
  for (; t + 8 <= last; t += 8) {
    if (t + 24 < last && p.any_visible(b, h, t + 16, 8))  // (the keys 16 ahead: memory streams meanwhile)
      for (int i = 0; i < 8; ++i) prefetch_row(p.keys.row(b, h, t + 16 + i), p.dim);
    if (!p.any_visible(b, h, t, 8)) {
      for (int64_t g = 0; g < p.group; ++g) std::fill_n(p.scores_of(b, h, g) + t, 8, kMinusInf);
      continue;
    }
    const T* k[8];
    for (int i = 0; i < 8; ++i) k[i] = p.keys.row(b, h, t + i);
    const float* q = p.query_of(b, h, t);
    bool one_frame = true;
    for (int i = 1; i < 8 && p.sink_query != nullptr; ++i) one_frame = one_frame && q == p.query_of(b, h, t + i);
    if (one_frame) {
      int64_t g = 0;
      for (; g + 3 <= p.group; g += 3) score8_queries<T, 3>(p, b, h, t, q, k, g);
      if (p.group - g == 2) score8_queries<T, 2>(p, b, h, t, q, k, g);
      if (p.group - g == 1)  // (one query: eight chains over eight keys)
        _mm256_storeu_ps(p.scores_of(b, h, g) + t,
                         _mm256_mul_ps(dots8(q + g * p.dim, k, p.dim), _mm256_set1_ps(p.scaling)));
      continue;
    }
    for (int64_t g = 0; g < p.group; ++g) {
      float* s = p.scores_of(b, h, g) + t;
      for (int i = 0; i < 8; ++i)
        s[i] = _mm_cvtss_f32(dots4(p.query_of(b, h, t + i) + g * p.dim, k[i], k[i], k[i], k[i], p.dim)) * p.scaling;
    }
  }
  for (; t < last; ++t) {
    const T* k = p.keys.row(b, h, t);
    for (int64_t g = 0; g < p.group; ++g)
      p.scores_of(b, h, g)[t] = _mm_cvtss_f32(dots4(p.query_of(b, h, t) + g * p.dim, k, k, k, k, p.dim)) * p.scaling;
  }
}

template <typename T>
AVX2 void chunk_avx2(Problem<T>& p, int64_t task) {
  const int64_t c = task % p.chunks, bh = task / p.chunks, b = bh / p.heads, h = bh % p.heads;
  const int64_t chunk_first = c * kChunk, chunk_last = std::min(chunk_first + kChunk, p.total);
  const auto [first, last] = p.spans[task];
  float* maxima = p.maxima.data() + task * p.group;
  float* sums = p.sums.data() + task * p.group;
  for (int64_t g = 0; g < p.group; ++g) {
    std::fill(p.scores_of(b, h, g) + chunk_first, p.scores_of(b, h, g) + first, 0.f);
    std::fill(p.scores_of(b, h, g) + last, p.scores_of(b, h, g) + chunk_last, 0.f);
  }
  score_chunk(p, b, h, first, last);
  for (int64_t g = 0; g < p.group; ++g) {
    float* s = p.scores_of(b, h, g);
    int64_t t;
    if (p.visible.data != nullptr) hide(p.visible.row(b, h, g), p.visible.slot_stride, s, first, last);
    __m256 peaks = _mm256_set1_ps(kMinusInf);
    for (t = first; t + 8 <= last; t += 8) peaks = _mm256_max_ps(peaks, _mm256_loadu_ps(s + t));
    float peak = lanes_max(peaks);
    for (; t < last; ++t) peak = std::fmax(peak, s[t]);
    // (a chunk with no visible slot: every weight 0, its maximum -inf, which the merge scales to nothing)
    const __m256 shift = _mm256_set1_ps(peak == kMinusInf ? 0.f : peak);
    __m256 total = _mm256_setzero_ps();
    for (t = first; t + 8 <= last; t += 8) {
      const __m256 weight = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
      _mm256_storeu_ps(s + t, weight);
      total = _mm256_add_ps(total, weight);
    }
    float sum = lanes_sum(total);
    for (; t < last; ++t) {
      s[t] = s[t] == kMinusInf ? 0.f : std::exp(s[t] - peak);
      sum += s[t];
    }
    maxima[g] = peak;
    sums[g] = sum;
  }
  float* out = p.outputs.data() + task * p.group * p.value_dim;
  std::fill(out, out + p.group * p.value_dim, 0.f);
  for (int64_t t = first; t < last; t += kRowBlock) {
    const int64_t end = std::min(t + kRowBlock, last);
    if (!p.any_visible(b, h, t, end - t)) continue;  // (every weight 0)
    const int64_t ahead = t + 2 * kRowBlock;  // (the values two blocks on, streaming while these are weighed)
    if (ahead + kRowBlock <= p.total && p.any_visible(b, h, ahead, kRowBlock))
      for (int64_t i = ahead; i < ahead + kRowBlock; ++i) prefetch_row(p.values.row(b, h, i), p.value_dim);
    int64_t g = 0;
    for (; g + 4 <= p.group; g += 4) weigh_values<T, 4, 2>(p, b, h, t, end, g, out);
    switch (p.group - g) {
      case 3: weigh_values<T, 3, 4>(p, b, h, t, end, g, out); break;
      case 2: weigh_values<T, 2, 4>(p, b, h, t, end, g, out); break;
      case 1: weigh_values<T, 1, 8>(p, b, h, t, end, g, out); break;
      default: break;
    }
  }
}

#endif

void check_rows(const at::Tensor& x, const char* name, at::ScalarType dtype, int64_t batch, int64_t heads,
                int64_t width) {
  TORCH_CHECK(x.scalar_type() == dtype && x.dim() == 4 && x.size(0) == batch && x.size(1) == heads &&
                  x.size(3) == width && x.stride(3) == 1,
              "sparsegen::decode_attention: ", name, " must be ", dtype, " (as key) [", batch, ", ", heads,
              ", slots, ", width, "] with unit stride in its last dimension, got ", x.scalar_type(), " ", x.sizes(),
              " strides ", x.strides());
}

// ``mask``: bool [B, 1 or H, T], or (``queries``) [B, 1 or H, Q, T] with Q dividing the rows of a KV head
void check_mask(const c10::optional<at::Tensor>& mask, const char* name, int64_t batch, int64_t heads, int64_t rows,
                int64_t total, bool queries) {
  if (!mask.has_value()) return;
  const at::Tensor& m = *mask;
  const bool each = queries && m.dim() == 4;
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == (each ? 4 : 3) && m.size(0) == batch &&
                  (m.size(1) == 1 || m.size(1) == heads) && m.size(m.dim() - 1) == total &&
                  (!each || (m.size(2) > 0 && rows % m.size(2) == 0)),
              "sparsegen::decode_attention: ", name, " must be bool [", batch, ", 1 or ", heads, ", ",
              queries ? "(queries, dividing " + std::to_string(rows) + ",) " : "", total, "], got ", m.scalar_type(),
              " ", m.sizes());
}

// The attention itself, over fp32 or fp16 (T) keys and values, checked by ``decode_attention``.
template <typename T>
std::tuple<at::Tensor, at::Tensor> attend(const at::Tensor& q, const at::Tensor& sq, const at::Tensor& key,
                                          const at::Tensor& value, const c10::optional<at::Tensor>& new_key,
                                          const c10::optional<at::Tensor>& new_value,
                                          const c10::optional<at::Tensor>& visible,
                                          const c10::optional<at::Tensor>& sink, double scaling, bool probs) {
  const int64_t batch = q.size(0), heads = q.size(1), group = q.size(2), dim = q.size(3);
  const int64_t value_dim = value.size(-1), total = key.size(2) + (new_key.has_value() ? new_key->size(2) : 0);
  at::Tensor scores = at::empty({batch, heads, group, total}, q.options());
  Problem<T> p{q.data_ptr<float>(), sq.defined() ? sq.data_ptr<float>() : nullptr,
               rows_of<T>(key, new_key), rows_of<T>(value, new_value), flags_of(visible, true), flags_of(sink, false),
               batch, heads, group, dim, value_dim, total, (total + kChunk - 1) / kChunk,
               static_cast<float>(scaling), scores.data_ptr<float>(), {}, {}, {}};
  const int64_t tasks = batch * heads * p.chunks;
  p.maxima.resize(tasks * group);
  p.sums.resize(tasks * group);
  p.outputs.resize(tasks * group * value_dim);
#ifdef SPARSEGEN_X86
  const bool vector = simd_level() != Simd::kScalar && dim % 8 == 0 && value_dim % 64 == 0;
#endif
  p.spans.resize(tasks);
  for (int64_t task = 0; task < tasks; ++task) p.spans[task] = p.span(task);
  const int64_t parts = std::min<int64_t>(tasks, at::get_num_threads());
  const std::vector<int64_t> starts = balanced_runs(p.spans, parts);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {  // (a thread: parts [begin, end), one run)
    for (int64_t task = starts[begin]; task < starts[end]; ++task) {
#ifdef SPARSEGEN_X86
      if (vector) {
        chunk_avx2(p, task);
        continue;
      }
#endif
      chunk_scalar(p, task);
    }
  });
  // merge each row's chunks by their maxima: out = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M)
  at::Tensor out = at::empty({batch, heads, group, value_dim}, q.options());
  std::vector<float> factors(tasks * group);  // each chunk's weights' factor to probabilities
  at::parallel_for(0, batch * heads * group, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bh = row / group, g = row % group;
      float peak = kMinusInf;
      for (int64_t c = 0; c < p.chunks; ++c) peak = std::fmax(peak, p.maxima[(bh * p.chunks + c) * group + g]);
      float* o = out.data_ptr<float>() + row * value_dim;
      if (peak == kMinusInf) {  // nothing visible: NaN, as softmax over -inf gives
        for (int64_t d = 0; d < value_dim; ++d) o[d] = std::numeric_limits<float>::quiet_NaN();
        for (int64_t c = 0; c < p.chunks; ++c) factors[(bh * p.chunks + c) * group + g] = std::nanf("");
        continue;
      }
      float sum = 0.f;
      for (int64_t c = 0; c < p.chunks; ++c) {
        const int64_t at = (bh * p.chunks + c) * group + g;
        factors[at] = p.maxima[at] == kMinusInf ? 0.f : std::exp(p.maxima[at] - peak);
        sum += p.sums[at] * factors[at];
      }
      for (int64_t d = 0; d < value_dim; ++d) o[d] = 0.f;
      for (int64_t c = 0; c < p.chunks; ++c) {
        const int64_t at = (bh * p.chunks + c) * group + g;
        factors[at] /= sum;
        const float* acc = p.outputs.data() + at * value_dim;
        for (int64_t d = 0; d < value_dim; ++d) o[d] += acc[d] * factors[at];
      }
    }
  });
  if (!probs) return {out, at::empty({0}, q.options())};
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task % p.chunks, bh = task / p.chunks;
      const int64_t first = c * kChunk, last = std::min(first + kChunk, total);
      for (int64_t g = 0; g < group; ++g) {
        float* s = p.scores + (bh * group + g) * total;
        const float factor = factors[task * group + g];
        for (int64_t t = first; t < last; ++t) s[t] *= factor;
      }
    }
  });
  return {out, scores};
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& query, const c10::optional<at::Tensor>& sink_query,
                                                    const at::Tensor& key, const at::Tensor& value,
                                                    const c10::optional<at::Tensor>& new_key,
                                                    const c10::optional<at::Tensor>& new_value,
                                                    const c10::optional<at::Tensor>& visible,
                                                    const c10::optional<at::Tensor>& sink, double scaling,
                                                    bool probs) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 4,
              "sparsegen::decode_attention: query must be float32 [batch, kv_heads, group, dim], got ",
              query.scalar_type(), " ", query.sizes());
  const int64_t batch = query.size(0), heads = query.size(1), group = query.size(2), dim = query.size(3);
  const int64_t value_dim = value.size(-1);
  TORCH_CHECK(key.scalar_type() == at::kFloat || key.scalar_type() == at::kHalf,
              "sparsegen::decode_attention: keys and values must be float32 or float16, got ", key.scalar_type());
  const at::ScalarType dtype = key.scalar_type();
  check_rows(key, "key", dtype, batch, heads, dim);
  check_rows(value, "value", dtype, batch, heads, value_dim);
  TORCH_CHECK(key.size(2) == value.size(2), "sparsegen::decode_attention: ", key.size(2), " keys but ",
              value.size(2), " values");
  TORCH_CHECK(new_key.has_value() == new_value.has_value(),
              "sparsegen::decode_attention: new_key and new_value come together");
  if (new_key.has_value()) {
    check_rows(*new_key, "new_key", dtype, batch, heads, dim);
    check_rows(*new_value, "new_value", dtype, batch, heads, value_dim);
    TORCH_CHECK(new_key->size(2) == new_value->size(2), "sparsegen::decode_attention: ", new_key->size(2),
                " new keys but ", new_value->size(2), " new values");
  }
  const int64_t total = key.size(2) + (new_key.has_value() ? new_key->size(2) : 0);
  TORCH_CHECK(total > 0, "sparsegen::decode_attention: no slots to attend over");
  check_mask(visible, "visible", batch, heads, group, total, true);
  check_mask(sink, "sink", batch, heads, group, total, false);
  TORCH_CHECK(sink.has_value() == sink_query.has_value(),
              "sparsegen::decode_attention: sink and sink_query come together");
  const at::Tensor q = query.contiguous();
  const at::Tensor sq = sink_query.has_value() ? sink_query->contiguous() : at::Tensor();
  if (sink_query.has_value())
    TORCH_CHECK(sq.sizes() == q.sizes() && sq.scalar_type() == at::kFloat,
                "sparsegen::decode_attention: sink_query must be float32 like query ", q.sizes());
  return key.scalar_type() == at::kHalf
             ? attend<c10::Half>(q, sq, key, value, new_key, new_value, visible, sink, scaling, probs)
             : attend<float>(q, sq, key, value, new_key, new_value, visible, sink, scaling, probs);
}

}  // namespace

TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("decode_attention", decode_attention);
}
