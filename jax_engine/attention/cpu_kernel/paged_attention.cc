// Paged attention for CPU, as an XLA FFI custom call: every query token of a step, decode and prefill alike.
//
// Why a kernel: in plain XLA a step first gathers every sequence's context blocks into a dense copy and
// then attends over the copy, so each key and value crosses memory three times (read, write, read), and
// padding costs as much as real work: every prefill chunk is padded to the longest one and every context
// to the longest context. Here each query row reads its keys and values straight from the paged cache
// through its sequence's block table, and only up to its own context length (its position + 1), which
// also makes prefill causal without a mask. The rows are ragged: no padding at all. With a sliding window a
// row reads only its last `sliding_window` keys, from the block the window starts in: the window's saving.
//
// One work item is one query row, all its heads (a cache slot holds the KV heads side by side, so reads are
// contiguous), or with fewer rows than twice the threads one KV head of a row and the G query heads that
// share it: with whole rows a decode step of one sequence ran on one thread, ~1 ms of a batch-1 SmolLM2
// step at a context of 230 tokens (int8 weights, 2 cores: 110-112 tok/s with whole rows, 118-127 per KV
// head). Not always per KV head: batch-8 decode ran ~8% slower so (a third of the work per slot visited). With
// fewer KV heads in the step than threads (one row of Gemma 3, which has one KV head) an item is part of a KV
// head's query heads, which divide among the threads (heads_per_item). Whatever the item, a row's output is the
// same to the bit. Items are shared out over XLA's own intra-op thread pool.
// Within an item, a 16-bit cache's keys are walked once per KV head: walking all heads of each slot at once left
// a bfloat16 cache, half a float32 one's bytes, bound by the arithmetic, no faster than float32 (`bench kernels`,
// 256 decode rows of SmolLM2 over 320 tokens: 134-155 ms), and once per KV head it takes 111-123. The head dims
// models use are fixed at compile time: with a run-time head dim that loop ran at 180-200 ms. A float32 cache's
// keys keep whole slots (768 contiguous bytes of SmolLM2's), faster at small batches (8 and 32 rows: 4.5 and
// 17-18 ms against 4.8 and 19-21 per KV head), as fast at 256 (131-143 ms). They are scored 8 or 16 keys at a time
// like the narrower caches' (score_keys): Gemma 3's 18 layers of attention for one row, from memory, 0.96-1.05 ->
// 0.75-0.85 ms at a context of 192 (in four runs of five; one saw no change) and 2.2-2.3 -> 1.6 at 600, with the
// query heads split between the threads (2-core Zen 4, in turns, medians of 60-100); SmolLM2's within the runs'
// spread (0.93-1.04x) at 1 to 256 rows.
// The values (pass 2) are walked once per KV head and few query heads of every cache, their sums in
// registers (sum_values): on a 2-core Xeon, `bench kernels` as above, old and new in turns, bfloat16 158-183 ->
// 145-166 ms, float32 232-261 -> 209-225, and no slower at 1 to 32 rows nor on Gemma 3's one 256-wide KV head.
//
// Shapes (float32 queries and output; float32, bfloat16, float16 or an 8-bit float cache):
//   q            [R, N, D]        query rows (a step's tokens), N = K * G heads
//   k_cache      [L, S, K, D]     every layer's keys, S = num_blocks * block_size slots
//   v_cache      [L, S, K, D]
//   layer        []   int32       the layer to read
//   sliding_window [] int32       a row sees keys p - sliding_window < t <= p; 0 = no window (an operand, not
//                                 an attribute: a model whose layers differ, Gemma 3, passes each layer's)
//   tables       [B, C] int32     block ids of each sequence
//   query_seq    [R]  int32       the sequence (row of tables) each query belongs to
//   context_lens [R]  int32       keys each query sees; only the first ceil(len / block_size) blocks are
//                                 read; 0 = padding row (output zeros)
//   alibi_slopes [N]  float32     ALiBi slope of each query head: slope * (t - p) is added to the scaled
//                                 score of key t for the query at p = len - 1; all zero = no ALiBi
//   out          [R, N, D]
// Attributes: block_size; scale; logits_soft_cap (Gemma 2: scaled scores s become cap * tanh(s / cap), before
// ALiBi; 0 = none).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "float16.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jax_engine::BFloat16;
using jax_engine::Float8E4M3;
using jax_engine::Float8E5M2;
using jax_engine::Half;
using jax_engine::to_float;

struct Problem {
  const float* q;
  const void* k_layer;  // this layer's first slot
  const void* v_layer;
  const int32_t* tables;
  const int32_t* query_seq;
  const int32_t* context_lens;
  const float* alibi_slopes;  // [N], or nullptr: no ALiBi
  float* out;
  int64_t num_rows, num_heads, num_kv_heads, head_dim, max_blocks, block_size;
  int64_t sliding_window;  // 0: none
  float scale;
  float logits_soft_cap;  // 0: none
};

// The first key a query with n keys of context sees: 0, or the start of its last `sliding_window` keys.
inline int64_t window_begin(int64_t n, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, n - sliding_window) : 0;
}

// Call visit(t, slot) for the tokens begin <= t < n of a sequence, in order, walking its block table block by
// block from the block that holds `begin` (the blocks before it are not touched).
// While it visits a block it prefetches the same token of the next block from `rows` (the `read_bytes` that
// are read of each slot, slots `row_bytes` apart): blocks lie scattered over the cache, so the hardware
// prefetcher, which follows addresses within a page, cannot see the next one coming. The prefetch goes to
// L2, not L1: a block ahead is further than L1 holds (48 KiB of keys for a 64-token block of SmolLM2), so
// lines prefetched into L1 would push out the lines being read now and be pushed out themselves before their
// turn (`bench kernels`, scattered 64-token blocks: ~9% faster than into L1). The first block, which no block
// before it prefetches, is prefetched whole before the walk starts: each walk of a row (a KV head's keys, then
// its values) began with a block of misses. 256 rows x 320 tokens of SmolLM2's shape over a 2 GB e4m3 cache,
// scattered, in turns in one process on a 2-core Zen 4: 89.6 -> 80.2 ms (medians of 16).
template <typename Visit>
inline void for_each_slot(const int32_t* table, int64_t begin, int64_t n, int64_t block_size, const void* rows,
                          int64_t row_bytes, int64_t read_bytes, Visit&& visit) {
  const char* bytes = static_cast<const char*>(rows);
  auto prefetch_slot = [&](int64_t slot) {
    for (int64_t line = 0; line < read_bytes; line += 64) __builtin_prefetch(bytes + slot * row_bytes + line, 0, 1);
  };
  const int64_t first_block = begin - begin % block_size;
  const int64_t first_block_slot = static_cast<int64_t>(table[first_block / block_size]) * block_size;
  const int64_t first_block_end = std::min(n, first_block + block_size);
  for (int64_t t = begin; t < first_block_end; ++t) prefetch_slot(first_block_slot + t - first_block);
  for (int64_t first = first_block; first < n; first += block_size) {
    const int64_t first_slot = static_cast<int64_t>(table[first / block_size]) * block_size;
    const int64_t end = std::min(n, first + block_size);
    const int64_t next_slot = end < n ? static_cast<int64_t>(table[end / block_size]) * block_size : -1;
    for (int64_t t = std::max(first, begin); t < end; ++t) {
      if (next_slot >= 0) prefetch_slot(next_slot + t - first);
      visit(t, first_slot + t - first);
    }
  }
}

// ALiBi: row[i] += slope * (t - position) for the keys t = begin + i of a query at `position`. The index is
// int32 (contexts are int32) so that its conversion to float vectorizes: AVX2 has no int64 -> float in vectors.
inline void add_alibi(float* row, int64_t count, float slope, int64_t begin, int64_t position) {
  const float offset = slope * static_cast<float>(begin - position);
  for (int32_t i = 0; i < static_cast<int32_t>(count); ++i) row[i] += offset + slope * static_cast<float>(i);
}

// Gemma 2's soft cap: row[i] = cap * tanh(row[i] / cap).
inline void soft_cap(float* row, int64_t count, float cap) {
  const float inverse = 1.0f / cap;
  for (int64_t i = 0; i < count; ++i) row[i] = cap * std::tanh(row[i] * inverse);
}

// One vector register of floats: 16 with AVX-512, 8 with AVX2 (or without either). A vector wider than the
// registers is no faster: GCC keeps it in memory and moves it through the stack in 16-byte pieces. On an
// AVX2-only Zen 1, 16-float vectors left Gemma 3's 18 layers of one-row attention (float32, a context of 256)
// at 2.5-3.4 ms, about a tenth of a batch-1 token, where the keys and values take 0.5 ms to read.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kVectorRegisters = 32;
#else
constexpr int kLanes = 8;
constexpr int kVectorRegisters = 16;
#endif
typedef float Floats __attribute__((vector_size(4 * kLanes)));

inline Floats load_floats(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Floats load_floats(const BFloat16* p) {
  typedef uint32_t Bits32 __attribute__((vector_size(4 * kLanes)));
  Bits32 widened;
#if defined(__AVX512F__)  // one instruction; GCC 12 made four of the vector extension's conversion
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&widened, &words, sizeof widened);
#elif defined(__AVX2__)
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&widened, &words, sizeof widened);
#else
  typedef uint16_t Bits16 __attribute__((vector_size(2 * kLanes)));
  Bits16 bits;
  std::memcpy(&bits, p, sizeof bits);
  widened = __builtin_convertvector(bits, Bits32);
#endif
  widened <<= 16;  // float32's high half
  Floats v;
  std::memcpy(&v, &widened, sizeof v);
  return v;
}

// kLanes halves' bits -> floats: one vcvtph2ps (AVX-512 or F16C), subnormals included whatever the denormal
// flags say.
typedef uint16_t HalfBits __attribute__((vector_size(2 * kLanes)));
inline Floats halves_to_floats(HalfBits bits) {
  Floats v;
#if defined(__AVX512F__)
  __m256i packed;
  std::memcpy(&packed, &bits, sizeof packed);
  const __m512 wide = _mm512_cvtph_ps(packed);
  std::memcpy(&v, &wide, sizeof v);
#elif defined(__F16C__)
  __m128i packed;
  std::memcpy(&packed, &bits, sizeof packed);
  const __m256 wide = _mm256_cvtph_ps(packed);
  std::memcpy(&v, &wide, sizeof v);
#else
  for (int i = 0; i < kLanes; ++i) v[i] = jax_engine::half_bits_to_float(bits[i]);
#endif
  return v;
}
inline Floats load_floats(const Half* p) {
  HalfBits bits;
  std::memcpy(&bits, p, sizeof bits);
  return halves_to_floats(bits);
}
// 8-bit floats widen as halves (float16.h says how): kLanes bytes, kLanes floats. AVX2 zero-extends the bytes
// in one instruction; GCC 12 made four of the vector extension's conversion.
inline HalfBits load_bytes_widened(const void* p) {
  HalfBits widened;
#if defined(__AVX512F__)
  const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  std::memcpy(&widened, &words, sizeof widened);
#elif defined(__AVX2__)
  const __m128i words = _mm_cvtepu8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  std::memcpy(&widened, &words, sizeof widened);
#else
  typedef uint8_t Bytes __attribute__((vector_size(kLanes)));
  Bytes bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  widened = __builtin_convertvector(bytes, HalfBits);
#endif
  return widened;
}
inline Floats load_floats(const Float8E5M2* p) { return halves_to_floats(load_bytes_widened(p) << 8); }
// e4m3 reads as 2^-8 of its values (float16.h); the loops below multiply by kLoadScale once per sum instead.
inline Floats load_floats(const Float8E4M3* p) {
  typedef int16_t Signed16 __attribute__((vector_size(2 * kLanes)));
  const Signed16 high = reinterpret_cast<Signed16>(load_bytes_widened(p) << 8);  // sign bit on top
  // An arithmetic shift keeps the sign on top and copies it into bit 14, the half's top exponent bit: cleared.
  return halves_to_floats(reinterpret_cast<HalfBits>(high >> 1) & 0xbfff);
}
template <typename T>
constexpr float kLoadScale = 1.0f;
template <>
constexpr float kLoadScale<Float8E4M3> = jax_engine::kE4M3HalfScale;

// With AVX-512 VBMI an e4m3 row widens 64 bytes at a time by table lookup: two byte permutes give each value's
// bfloat16 (which holds every e4m3 value exactly) as its high and low bytes, and unpacking them with zeros makes
// float32s: 9 instructions for 64 values, where the halves' way takes 5 for 16. The unpacks work within 128-bit
// lanes, so the floats come out in their own order (dim_of), which the queries and the value sums follow.
#if defined(__AVX512VBMI__)
constexpr bool kTableWidening = true;
struct E4M3Tables {  // the bfloat16 of each e4m3 magnitude (the byte's low 7 bits): high bytes, low bytes
  __m512i high[2], low[2];
};
inline E4M3Tables make_e4m3_tables() {
  uint8_t high[128], low[128];
  for (int m = 0; m < 128; ++m) {
    const float value = to_float(Float8E4M3{static_cast<uint8_t>(m)});
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    high[m] = static_cast<uint8_t>(bits >> 24);
    low[m] = static_cast<uint8_t>(bits >> 16);
  }
  E4M3Tables tables;
  for (int i = 0; i < 2; ++i) {
    tables.high[i] = _mm512_loadu_si512(high + 64 * i);
    tables.low[i] = _mm512_loadu_si512(low + 64 * i);
  }
  return tables;
}
const E4M3Tables kE4M3Tables = make_e4m3_tables();
// 64 e4m3 values -> x[0..3], lane 4k + j of x[i] holding value 16k + 4i + j (dim_of).
inline void widen_64(const Float8E4M3* p, const E4M3Tables& tables, Floats* x) {
  const __m512i bytes = _mm512_loadu_si512(p);
  // Each byte's bit 6 picks the table and bits 0-5 the entry; its bit 7, the sign, is ignored, then copied.
  const __m512i low = _mm512_permutex2var_epi8(tables.low[0], bytes, tables.low[1]);
  const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(tables.high[0], bytes, tables.high[1]),
                                                 bytes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);
  const __m512i words[2] = {_mm512_unpacklo_epi8(low, high), _mm512_unpackhi_epi8(low, high)};
  const __m512i zero = _mm512_setzero_si512();
  const __m512i floats[4] = {_mm512_unpacklo_epi16(zero, words[0]), _mm512_unpackhi_epi16(zero, words[0]),
                             _mm512_unpacklo_epi16(zero, words[1]), _mm512_unpackhi_epi16(zero, words[1])};
  std::memcpy(x, floats, sizeof floats);
}
#else
constexpr bool kTableWidening = false;
#endif

// A row of D values of a cache widened to D / 16 vectors: loaded 16 at a time in order, or by widen_64.
template <typename T, int D>
constexpr bool kWidenedBy64 = kTableWidening && std::is_same_v<T, Float8E4M3> && D % 64 == 0;
template <typename T, int D>
constexpr float kRowScale = kWidenedBy64<T, D> ? 1.0f : kLoadScale<T>;  // the loaded row's values x kRowScale
template <typename T, int D>
constexpr int dim_of(int vector, int lane) {  // the value a lane of a widened row holds
  if constexpr (kWidenedBy64<T, D>) return vector / 4 * 64 + lane / 4 * 16 + vector % 4 * 4 + lane % 4;
  return vector * kLanes + lane;
}
template <typename T, int D>
inline void load_row(const T* p, Floats* x) {
#if defined(__AVX512VBMI__)
  if constexpr (kWidenedBy64<T, D>) {
    for (int i = 0; i < D / 64; ++i) widen_64(p + 64 * i, kE4M3Tables, x + 4 * i);
    return;
  }
#endif
  for (int i = 0; i < D / kLanes; ++i) x[i] = load_floats(p + i * kLanes);
}

// Lane i of the result: the sum of the lanes of v[i], for kLanes vectors (overwritten). Each round adds the two
// halves of every vector, two vectors' halves packed into one (16 -> 8 -> 4 -> 2 -> 1 vectors with AVX-512): 15
// adds for 16 sums, where summing each vector alone takes 4 dependent adds and shuffles apiece.
typedef int32_t LaneIndex __attribute__((vector_size(4 * kLanes)));
template <int W>  // lanes kept per vector after this round: from each group of 2W lanes of a, then of b
inline Floats add_halves(Floats a, Floats b) {
  LaneIndex low, high;
  for (int i = 0; i < kLanes; ++i) {
    const int from_b = i >= kLanes / 2, j = i % (kLanes / 2), lane = j / W * 2 * W + j % W + from_b * kLanes;
    low[i] = lane;
    high[i] = lane + W;
  }
  return __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
}
template <int W = kLanes / 2>  // v: 2W vectors, each lane group holding partial sums
inline Floats sum_lanes(Floats* v) {
  for (int i = 0; i < W; ++i) v[i] = add_halves<W>(v[2 * i], v[2 * i + 1]);  // reads 2i, 2i + 1 >= i first
  if constexpr (W == 1) {
    return v[0];
  } else {
    return sum_lanes<W / 2>(v);
  }
}

// Pass 1 for a head dim fixed at compile time: scores[h * m + t] = scale * q[h] . k[t, h / G] over the keys
// begin <= t < n of `kv_walked` KV heads side by side (`keys`: the first one's slot 0), G query heads each
// (h < H = kv_walked x G <= kMaxHeadsScored). Each key is widened once for its G heads, and each head's dot
// products are summed kLanes keys at a time (sum_lanes): summed one key at a time, those sums took most of an
// 8-bit cache's pass (`bench kernels` as at the top: 190 ms, 104 so); a bfloat16 cache's whole kernel, in a C++
// harness, went from 132 to 124 ms (6 GB) and 64 to 59 (L2). A head's scores come out the same whatever else is
// walked with it: a work item's shape (attend) never changes a row's result.
constexpr int64_t kMaxHeadsScored = 16;
// Independent sums of a dot product: in one, each multiply-add waited for the one before (32 of them a key and
// head at Gemma 3's head dim of 256 with AVX2, 5 cycles each on a Zen 1), and that wait was half the pass.
constexpr int kDotChains = 4;
static_assert(kDotChains == 4, "score_keys adds the four sums pairwise");
template <typename T, int D>
void score_keys(const Problem& p, const int32_t* table, int64_t begin, int64_t n, const T* keys, const float* q,
                int64_t kv_walked, int64_t G, float* scores, int64_t m) {
  constexpr int V = D / kLanes;
  const int64_t slot_stride = p.num_kv_heads * D, H = kv_walked * G;
  const float scale = p.scale * kRowScale<T, D>;
  Floats queries[kMaxHeadsScored][V];  // in the widened keys' lane order
  for (int64_t h = 0; h < H; ++h) {
    for (int i = 0; i < V; ++i) {
      for (int lane = 0; lane < kLanes; ++lane) queries[h][i][lane] = q[h * D + dim_of<T, D>(i, lane)];
    }
  }
  Floats partial[kMaxHeadsScored][kLanes];
  int count = 0;
  int64_t first = begin;
  auto flush = [&] {
    for (int64_t h = 0; h < H; ++h) {
      for (int i = count; i < kLanes; ++i) partial[h][i] = Floats{};
      const Floats sums = sum_lanes(partial[h]) * scale;
      std::memcpy(scores + h * m + first, &sums, count * sizeof(float));
    }
    count = 0;
  };
  auto walk = [&](auto walked) {  // walked: kv_walked, a compile-time 1 where it is one (an unrolled prefetch)
    for_each_slot(table, begin, n, p.block_size, keys, slot_stride * sizeof(T), walked * D * sizeof(T),
                  [&](int64_t t, int64_t slot) {
      if (count == 0) first = t;
      for (int64_t j = 0; j < walked; ++j) {
        Floats x[V];
        load_row<T, D>(keys + slot * slot_stride + j * D, x);
        for (int64_t g = 0; g < G; ++g) {
          const Floats* qh = queries[j * G + g];
          Floats sums[kDotChains] = {};
#pragma GCC unroll 32
          for (int i = 0; i < V; ++i) sums[i % kDotChains] += qh[i] * x[i];
          partial[j * G + g][count] = (sums[0] + sums[1]) + (sums[2] + sums[3]);
        }
      }
      if (++count == kLanes) flush();
    });
  };
  if (kv_walked == 1) {
    walk(std::integral_constant<int64_t, 1>{});
  } else {
    walk(kv_walked);
  }
  if (count) flush();
}

// Vectors of value sums kept in registers at once: half the registers, the rest for the values and weights.
constexpr int kSumVectors = kVectorRegisters / 2;
// The vectors of sums one walk of the values keeps per head: a row's D / kLanes, or where that is more than
// kSumVectors (a head dim of 256 with AVX2), the largest divisor of it that fits: the row is walked in parts.
template <int D>
constexpr int kSumsPerHead = [] {
  int vectors = std::min(D / kLanes, kSumVectors);
  while ((D / kLanes) % vectors) --vectors;
  return vectors;
}();
// Query heads whose value sums one walk keeps.
template <int D>
constexpr int64_t kHeadsPerValueWalk = std::max(1, kSumVectors / kSumsPerHead<D>);

// out[g] = sum_t probs[g * m + t] * v[t] for `heads` (at most kHeadsPerValueWalk) query heads sharing the KV head
// whose values start at `values`, with the sums in registers. Summed in memory, each token's sums waited for
// the stores of the token before, and that loop took ~40% of the kernel's time (a C++ harness of the kernel on
// SmolLM2's shapes, caches in L2: 90 ms a step, 76 with the sums in registers). A row wider than the registers
// hold sums for is walked in parts of W dims, each walk reading its own lines of every row.
template <typename T, int D>
void sum_values(const Problem& p, const int32_t* table, int64_t begin, int64_t n, const T* values,
                const float* probs, int64_t m, int64_t heads, float* out) {
  constexpr int V = kSumsPerHead<D>, W = V * kLanes;
  constexpr int64_t most = kHeadsPerValueWalk<D>;
  const int64_t slot_stride = p.num_kv_heads * D;
  for (int first = 0; first < D; first += W) {
    Floats sums[most][V] = {};
    for_each_slot(table, begin, n, p.block_size, values + first, slot_stride * sizeof(T), W * sizeof(T),
                  [&](int64_t t, int64_t slot) {
      Floats x[V];
      load_row<T, W>(values + slot * slot_stride + first, x);
#pragma GCC unroll 16
      for (int64_t g = 0; g < most; ++g) {
        if (g == heads) break;
        const float weight = probs[g * m + t];
        for (int i = 0; i < V; ++i) sums[g][i] += weight * x[i];
      }
    });
    for (int64_t g = 0; g < heads; ++g) {
      for (int i = 0; i < V; ++i) {
        const Floats scaled = sums[g][i] * kRowScale<T, W>;
        for (int lane = 0; lane < kLanes; ++lane) out[g * D + first + dim_of<T, W>(i, lane)] = scaled[lane];
      }
    }
  }
}

// Attend one query row's H query heads first_head .. first_head + H - 1 over its context: whole groups of the
// G heads that share a KV head (H = kv_count x G), or some heads of one group (H < G, kv_count = 1). `scores` and
// `acc` are scratch reused between items. HeadDim: the head dim fixed at compile time, or 0 to read it from the
// problem.
template <typename T, int HeadDim>
void attend(const Problem& p, int64_t row, int64_t first_head, int64_t H, std::vector<float>& scores,
            std::vector<float>& acc) {
  const int64_t N = p.num_heads, K = p.num_kv_heads, D = HeadDim ? HeadDim : p.head_dim;
  const int64_t G = std::min(N / K, H);  // query heads per KV head walked
  const int64_t kv = first_head / (N / K), kv_count = H / G;
  const int64_t n = p.context_lens[row];  // keys 0..n-1; the query is at position n - 1
  float* out = p.out + (row * N + first_head) * D;
  if (n <= 0) {
    std::fill(out, out + H * D, 0.0f);
    return;
  }
  const float* q = p.q + (row * N + first_head) * D;
  const int32_t* table = p.tables + p.query_seq[row] * p.max_blocks;
  const T* keys = static_cast<const T*>(p.k_layer) + kv * D;  // KV head kv of slot 0
  const T* values = static_cast<const T*>(p.v_layer) + kv * D;
  const int64_t slot_stride = K * D;
  const int64_t begin = window_begin(n, p.sliding_window);
  const int64_t m = n - begin;  // keys seen: begin..n-1
  scores.resize(H * m);  // [H, m]

  // A 16- or 8-bit cache is walked once per KV head, whose G queries stay hot while its keys stream by: walking
  // all heads of each slot at once left it bound by the arithmetic (see the top). A float32 cache is read at the
  // memory's pace either way, and faster at small batches with all heads per slot (whole 768-byte slots).
  const int64_t heads_per_walk = sizeof(T) < 4 ? 1 : kv_count;
  const int64_t walk_bytes = heads_per_walk * D * sizeof(T);

  // Pass 1: scores[h, t - begin] = scale * q[h] . k[t, h / G]. By score_keys where the head dim is fixed at
  // compile time and a KV head's whole group fits it (so whether it does never depends on the item's shape).
  bool scored = false;
  if constexpr (HeadDim > 0 && HeadDim % kLanes == 0) {
    scored = N / K <= kMaxHeadsScored;
    const int64_t kv_walked = std::max<int64_t>(1, std::min(heads_per_walk, kMaxHeadsScored / G));
    for (int64_t first = 0; scored && first < kv_count; first += kv_walked) {
      score_keys<T, HeadDim>(p, table, begin, n, keys + first * D, q + first * G * D,
                             std::min(kv_walked, kv_count - first), G, scores.data() + first * G * m - begin, m);
    }
  }
  for (int64_t first = 0; !scored && first < kv_count; first += heads_per_walk) {
    const T* keys_walked = keys + first * D;
    float* scores_walked = scores.data() + first * G * m - begin;
    for_each_slot(table, begin, n, p.block_size, keys_walked, slot_stride * sizeof(T), walk_bytes,
                  [&](int64_t t, int64_t slot) {
      for (int64_t j = 0; j < heads_per_walk; ++j) {
        const T* k = keys_walked + slot * slot_stride + j * D;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = j * G + g;  // of the heads walked
          const float* qh = q + (first * G + h) * D;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * to_float(k[d]);
          scores_walked[h * m + t] = dot * p.scale;
        }
      }
    });
  }
  // Softmax over each head's row, in place (soft cap and ALiBi first: loops of their own, so the dot products
  // stay as fast without them).
  for (int64_t h = 0; h < H; ++h) {
    float* row_scores = scores.data() + h * m;
    if (p.logits_soft_cap > 0.0f) soft_cap(row_scores, m, p.logits_soft_cap);
    if (p.alibi_slopes) add_alibi(row_scores, m, p.alibi_slopes[first_head + h], begin, n - 1);
    const float peak = *std::max_element(row_scores, row_scores + m);
    for (int64_t t = 0; t < m; ++t) row_scores[t] = std::exp(row_scores[t] - peak);  // a loop of its own: vectorized
    float total = 0.0f;
    for (int64_t t = 0; t < m; ++t) total += row_scores[t];
    const float inverse = 1.0f / total;
    for (int64_t t = 0; t < m; ++t) row_scores[t] *= inverse;
  }
  // Pass 2: out[h] = sum_t probs[h, t] * v[t, h / G]
  if constexpr (HeadDim > 0 && HeadDim % kLanes == 0) {
    constexpr int64_t per_walk = kHeadsPerValueWalk<HeadDim>;
    for (int64_t j = 0; j < kv_count; ++j) {
      for (int64_t g = 0; g < G; g += per_walk) {
        sum_values<T, HeadDim>(p, table, begin, n, values + j * D, scores.data() + (j * G + g) * m - begin, m,
                               std::min(per_walk, G - g), out + (j * G + g) * D);
      }
    }
  } else {
    acc.assign(H * D, 0.0f);
    for (int64_t first = 0; first < kv_count; first += heads_per_walk) {
      const T* values_walked = values + first * D;
      const float* probs_walked = scores.data() + first * G * m - begin;
      float* acc_walked = acc.data() + first * G * D;
      for_each_slot(table, begin, n, p.block_size, values_walked, slot_stride * sizeof(T), walk_bytes,
                    [&](int64_t t, int64_t slot) {
        for (int64_t j = 0; j < heads_per_walk; ++j) {
          const T* v = values_walked + slot * slot_stride + j * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = j * G + g;
            const float weight = probs_walked[h * m + t];
            float* a = acc_walked + h * D;
            for (int64_t d = 0; d < D; ++d) a[d] += weight * to_float(v[d]);
          }
        }
      });
    }
    std::copy(acc.begin(), acc.end(), out);
  }
}

// attend<T> with the head dim fixed at compile time for the common ones.
template <typename T>
void attend_any(const Problem& p, int64_t row, int64_t first_head, int64_t H, std::vector<float>& scores,
                std::vector<float>& acc) {
  switch (p.head_dim) {
    case 64: return attend<T, 64>(p, row, first_head, H, scores, acc);
    case 80: return attend<T, 80>(p, row, first_head, H, scores, acc);
    case 96: return attend<T, 96>(p, row, first_head, H, scores, acc);
    case 128: return attend<T, 128>(p, row, first_head, H, scores, acc);
    case 256: return attend<T, 256>(p, row, first_head, H, scores, acc);
    default: return attend<T, 0>(p, row, first_head, H, scores, acc);
  }
}

// Work shared by the calling thread and pool threads (jax_engine::share_work).
struct WorkQueue {
  Problem problem;
  ffi::DataType dtype;
  int64_t heads_per_item;  // num_heads (whole rows), G (a KV head's group) or a part of a group
  int64_t num_items;  // num_rows x num_heads / heads_per_item
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run() {
    std::vector<float> scores, acc;
    const int64_t per_row = problem.num_heads / heads_per_item;
    for (int64_t item; (item = next.fetch_add(1)) < num_items;) {
      const int64_t row = item / per_row, first_head = item % per_row * heads_per_item;
      if (dtype == ffi::DataType::BF16) {
        attend_any<BFloat16>(problem, row, first_head, heads_per_item, scores, acc);
      } else if (dtype == ffi::DataType::F8E4M3FN) {
        attend_any<Float8E4M3>(problem, row, first_head, heads_per_item, scores, acc);
      } else if (dtype == ffi::DataType::F8E5M2) {
        attend_any<Float8E5M2>(problem, row, first_head, heads_per_item, scores, acc);
      } else if (dtype == ffi::DataType::F16) {
        attend_any<Half>(problem, row, first_head, heads_per_item, scores, acc);
      } else {
        attend_any<float>(problem, row, first_head, heads_per_item, scores, acc);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Query heads per work item: whole rows (a slot's KV heads side by side: contiguous reads) when there are rows
// enough to keep every thread busy, else one KV head's group of G, else, when even the groups are fewer than the
// threads, parts of a group (its heads divide among the threads; each part reads the group's keys and values).
// Gemma 3 has one KV head: at batch 1 each layer's attention was one item, on one thread, while the other waited.
int64_t heads_per_item(int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t num_threads) {
  if (num_rows >= 2 * num_threads) return num_heads;
  const int64_t G = num_heads / num_kv_heads;
  int64_t parts = 1;  // of a group: the fewest that divide it and give every thread an item
  while (num_rows * num_kv_heads * parts < num_threads && parts < G) {
    do ++parts;
    while (G % parts);  // the next divisor of G
  }
  return G / parts;
}

// The blocks any query of each sequence reads (from its earliest window's block to its longest context's last),
// checked against its table before anything is read. Blocks before every window are not read, so not checked.
ffi::Error check_tables(const int32_t* tables, int64_t num_seqs, int64_t max_blocks, const int32_t* query_seq,
                        const int32_t* context_lens, int64_t num_rows, int64_t block_size, int64_t num_blocks,
                        int64_t sliding_window) {
  std::vector<int64_t> longest(num_seqs, 0), earliest(num_seqs, INT64_MAX);
  for (int64_t r = 0; r < num_rows; ++r) {
    if (context_lens[r] < 0) {
      return ffi::Error::InvalidArgument("paged_attention: context_len " + std::to_string(context_lens[r]));
    }
    if (context_lens[r] == 0) continue;  // padding row: reads nothing
    if (query_seq[r] < 0 || query_seq[r] >= num_seqs) {
      return ffi::Error::InvalidArgument("paged_attention: query_seq " + std::to_string(query_seq[r]) +
                                         " out of range");
    }
    longest[query_seq[r]] = std::max<int64_t>(longest[query_seq[r]], context_lens[r]);
    earliest[query_seq[r]] = std::min(earliest[query_seq[r]], window_begin(context_lens[r], sliding_window));
  }
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t used = (longest[b] + block_size - 1) / block_size;
    if (used > max_blocks) {
      return ffi::Error::InvalidArgument("paged_attention: context_len " + std::to_string(longest[b]) +
                                         " beyond its table");
    }
    for (int64_t c = used ? earliest[b] / block_size : 0; c < used; ++c) {
      const int32_t block = tables[b * max_blocks + c];
      if (block < 0 || block >= num_blocks) {
        return ffi::Error::InvalidArgument("paged_attention: block id " + std::to_string(block) + " out of range");
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                              ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                              ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> query_seq,
                              ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::F32> alibi_slopes,
                              ffi::ResultBuffer<ffi::F32> out, int64_t block_size, float scale,
                              float logits_soft_cap) {
  const auto q_dims = q.dimensions();
  const auto cache_dims = k_cache.dimensions();
  const auto table_dims = tables.dimensions();
  if (q_dims.size() != 3 || cache_dims.size() != 4 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention: expected q [R, N, D], caches [L, S, K, D], tables [B, C]");
  }
  const ffi::DataType dtype = k_cache.element_type();
  const bool known = dtype == ffi::DataType::F32 || dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16 ||
                     dtype == ffi::DataType::F8E4M3FN || dtype == ffi::DataType::F8E5M2;
  if (v_cache.element_type() != dtype || !known) {
    return ffi::Error::InvalidArgument(
        "paged_attention: caches must both be float32, bfloat16, float16, float8_e4m3fn or float8_e5m2");
  }
  const int64_t num_layers = cache_dims[0], num_slots = cache_dims[1], num_kv_heads = cache_dims[2];
  const int64_t head_dim = cache_dims[3];
  const int64_t num_rows = q_dims[0], num_heads = q_dims[1], num_seqs = table_dims[0], max_blocks = table_dims[1];
  if (q_dims[2] != head_dim || num_heads % num_kv_heads != 0 ||
      query_seq.element_count() != static_cast<size_t>(num_rows) ||
      context_lens.element_count() != static_cast<size_t>(num_rows) ||
      alibi_slopes.element_count() != static_cast<size_t>(num_heads) || block_size <= 0 || num_slots % block_size) {
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  }
  if (!(logits_soft_cap >= 0.0f)) {  // NaN too
    return ffi::Error::InvalidArgument("paged_attention: logits_soft_cap " + std::to_string(logits_soft_cap));
  }
  const int64_t sliding_window = window.typed_data()[0];
  if (sliding_window < 0) {
    return ffi::Error::InvalidArgument("paged_attention: sliding_window " + std::to_string(sliding_window));
  }
  const int64_t layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= num_layers) {
    return ffi::Error::InvalidArgument("paged_attention: layer " + std::to_string(layer_index) + " out of range");
  }
  // Checked up front, so the kernel itself never reads outside the cache.
  ffi::Error checked = check_tables(tables.typed_data(), num_seqs, max_blocks, query_seq.typed_data(),
                                    context_lens.typed_data(), num_rows, block_size, num_slots / block_size,
                                    sliding_window);
  if (checked.failure()) return checked;

  // All zero (what the caller passes for no ALiBi) adds nothing: skip the term.
  const float* slopes = alibi_slopes.typed_data();
  const bool alibi = std::any_of(slopes, slopes + num_heads, [](float slope) { return slope != 0.0f; });
  const size_t item = k_cache.size_bytes() / std::max<size_t>(1, k_cache.element_count());  // bytes per element
  const int64_t layer_offset = layer_index * num_slots * num_kv_heads * head_dim;
  auto work = std::make_shared<WorkQueue>();
  work->problem = Problem{q.typed_data(),
                          static_cast<const char*>(k_cache.untyped_data()) + layer_offset * item,
                          static_cast<const char*>(v_cache.untyped_data()) + layer_offset * item,
                          tables.typed_data(),
                          query_seq.typed_data(),
                          context_lens.typed_data(),
                          alibi ? slopes : nullptr,
                          out->typed_data(),
                          num_rows, num_heads, num_kv_heads, head_dim, max_blocks, block_size, sliding_window, scale,
                          logits_soft_cap};
  work->dtype = dtype;
  work->heads_per_item = heads_per_item(num_rows, num_heads, num_kv_heads, pool.num_threads());
  work->num_items = num_rows * (num_heads / work->heads_per_item);
  jax_engine::share_work(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sliding_window
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_seq
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens
                                  .Arg<ffi::Buffer<ffi::F32>>()  // alibi_slopes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("block_size")
                                  .Attr<float>("scale")
                                  .Attr<float>("logits_soft_cap"));
