// y = x W^T for a few rows of x, as an XLA FFI custom call: each weight is read from memory once for all rows.
//
// Why a kernel: with a handful of rows (decode steps of small batches) a matmul's cost is reading the weights,
// and XLA's CPU dot (Eigen) first copies ("packs") the whole weight matrix into its own blocked layout on every
// call, so the weights cross memory three times. Here each output feature's weight row, stored contiguously
// ([out, in], the checkpoint's own layout), streams once from memory and is multiplied into every row of x
// while it sits in L1. The rows of x stay in L1/L2 for the whole call.
//
// Weights may be float32, bfloat16, float16 or int8. int8 rows are scaled by a float32 scale per output
// feature after the dot product. For int8 weights each row of x is first rounded to 16-bit integers (one
// step per row: its largest magnitude / 32767), and the products are summed exactly in int32: widening int8
// to float32 costs more instructions per weight than two cores can issue while memory delivers them, where
// vpmaddwd multiplies and pairwise adds 16 int16 values in one instruction. The rounding moves each x by at
// most half a step (~1.5e-5 of the row's largest value), far below the int8 weights' own rounding;
// matmul.py's XLA path rounds x the same way.
//
// Where the CPU has AVX-512 VNNI, int8 weights skip the widening too: each int16 x is split into bytes,
// x = 256 hi + lo (hi signed, lo unsigned), and vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and
// adds them in fours to 16 int32 sums, one instruction. lo (unsigned) pairs with the weights as stored; hi
// (signed) pairs with the weights + 128 (a byte XOR: unsigned, 1..255), which adds 128 x sum(hi), taken off
// at the end. The sums are the same integers as the int16 path's, with 2 instructions per 64 weights.
//
// GGUF blocks (quantization="gguf", see gguf_blocks.py) come as uint8 rows of Q8_0, Q4_0, Q4_1 or Q5_0 blocks
// of 32 weights or Q4_K, Q5_K or Q6_K super-blocks of 256, with each layer's format named by its ggml_type id.
// They multiply x rounded to int16 like int8 weights: each run of 32 products is summed exactly in int32 (at
// most 4 x 127 x 32767 per lane, below 2^24, so exact in float32 too), then scaled by the run's scale (Q6_K:
// one per 16 weights); a minimum (Q4_1, Q4_K, Q5_K) adds itself times the run's sum of x.
//
// Past a few rows (GGUF 8, 24 for float weights, int8 28, with AVX-512: streamed_rows) the cost is arithmetic,
// not reading the weights: a few output features' weights at a time, as stored (float32) or widened to float32
// once (the rest), in L1, multiply every row of a chunk of x in register blocks (many_rows_features). A layer of
// a stack is read in place, where XLA's dot copies it out of the stack (and widens it) and repacks it at every
// call.
//
// Shapes:
//   x      [M, K]  float32, K a multiple of 8 (of 16 for int8 weights)
//   w      [N, K] or [L, N, K] (every layer's weights, stacked)  float32, bfloat16, float16 or int8;
//          or GGUF blocks: uint8 [N, row bytes] or [L, N, row bytes], rows at least as wide as the format's
//          (a stack of layers in different formats pads the narrower rows)
//   scale  [N] or [L, N] float32 (int8 weights), or [0] (none)
//   block_types  [L] (or [1]) int32: GGUF blocks' ggml_type id per layer (Q8_0 8, Q4_K 12, ...), else [0]
//   layer  [] int32: which of the L stacked matrices to use (0 for a single matrix). Taking the stack and an
//          index, rather than a slice of it, saves XLA copying the layer's weights out before every call.
//   live   [] int32 (or [0]: all M): how many of x's rows are live, the first ones; the rest are a step's
//          padding (its token bucket's), which is not multiplied: those rows of y are zeros. The path is
//          chosen by M; many rows give the live rows the same sums to the last bit (each row is a lane of
//          its own), few rows group them into passes by the live count (sums rounded in another order).
//   y      [M, N]  float32
//
// Work items are ranges of output features (for many rows, of a chunk of rows), shared out over XLA's
// intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "float16.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jax_engine::BFloat16;
using jax_engine::Half;
using jax_engine::to_float;

// Eight float32 lanes (one AVX2 register) as a GCC/Clang vector: explicit SIMD that still compiles anywhere.
typedef float Vec __attribute__((vector_size(32)));
typedef int32_t IntVec __attribute__((vector_size(32)));
typedef uint16_t Bits16x8 __attribute__((vector_size(16)));
typedef uint32_t Bits32x8 __attribute__((vector_size(32)));
typedef int16_t Int16x16 __attribute__((vector_size(32)));
constexpr int kLanes = 8;
constexpr int kIntLanes = 16;  // int16 values per register (int8 weights)

inline Vec load8(const float* w) {
  Vec v;
  std::memcpy(&v, w, sizeof v);
  return v;
}
#if defined(__AVX2__)
// GCC 12 widens uint16 vectors lane by lane; the AVX2 widening load does it in one instruction.
inline Vec load8(const BFloat16* w) {  // bfloat16 is float32's high half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
inline Vec load8(const BFloat16* w) {
  Bits16x8 v;
  std::memcpy(&v, w, sizeof v);
  const Bits32x8 wide = __builtin_convertvector(v, Bits32x8) << 16;  // bfloat16 is float32's high half
  Vec out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}
#endif
inline Vec load8(const Half* w) {
  Vec v;
  for (int j = 0; j < kLanes; ++j) v[j] = to_float(w[j]);
  return v;
}
// The sum of a register's 8 lanes, in Total (int64 for int32 lanes: exact).
template <typename Total, typename Lanes>
inline Total sum(Lanes v) {
  Total total = 0;
  for (int j = 0; j < kLanes; ++j) total += v[j];
  return total;
}

// 16 int16 values of x, and 16 int8 weights widened to int16.
inline Int16x16 load16(const int16_t* x) {
  Int16x16 v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
#if defined(__AVX2__)
inline Int16x16 widen16(const int8_t* w) {
  return reinterpret_cast<Int16x16>(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
// Products of 16 int16 pairs, adjacent ones added: 8 int32 sums (vpmaddwd).
inline IntVec multiply_add_pairs(Int16x16 a, Int16x16 b) {
  return reinterpret_cast<IntVec>(_mm256_madd_epi16(reinterpret_cast<__m256i>(a), reinterpret_cast<__m256i>(b)));
}
#else
inline Int16x16 widen16(const int8_t* w) {
  Int16x16 v;
  for (int j = 0; j < kIntLanes; ++j) v[j] = w[j];
  return v;
}
inline IntVec multiply_add_pairs(Int16x16 a, Int16x16 b) {
  IntVec out;
  for (int j = 0; j < kLanes; ++j) out[j] = int32_t{a[2 * j]} * b[2 * j] + int32_t{a[2 * j + 1]} * b[2 * j + 1];
  return out;
}
#endif

// GGUF block formats (gguf_blocks.py). Each format gives, for one of its blocks (kWeights weights: 32, or 256
// for the K-quants), its scales (one float per 32 weights, or per 16 with kScalesPer16) and, with kHasMinimum,
// a minimum per 32 weights, which multiplies that sub-block's sum of x; and the integer weights of the block's
// j-th run of 32 as two int16 vectors (weights 0-15, 16-31). kType is llama.cpp's ggml_type id for the format.
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__AVX2__) && defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; the portable widening branches, and this runs once per block
#else
  return to_float(Half{bits});
#endif
}
// A 4-bit block of 32 packs weight j in the low nibble of byte j, j + 16 in the high one.
#if defined(__AVX2__)
// The offset comes off the bytes, before they are widened (a 128-bit subtraction, where a 256-bit one costs AVX2
// CPUs that split them, such as the Zen 1, twice the micro-ops).
inline void widen_nibbles(const uint8_t* packed, int8_t offset, Int16x16& low, Int16x16& high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i mask = _mm_set1_epi8(0x0f), shift = _mm_set1_epi8(offset);
  low = reinterpret_cast<Int16x16>(_mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_and_si128(bytes, mask), shift)));
  high = reinterpret_cast<Int16x16>(
      _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), shift)));
}
#else
inline void widen_nibbles(const uint8_t* packed, int8_t offset, Int16x16& low, Int16x16& high) {
  for (int j = 0; j < kIntLanes; ++j) {
    low[j] = static_cast<int16_t>((packed[j] & 0x0f) - offset);
    high[j] = static_cast<int16_t>((packed[j] >> 4) - offset);
  }
}
#endif
struct BlockOf32 {
  static constexpr int64_t kWeights = 32;
  static constexpr bool kScalesPer16 = false, kHasMinimum = false;
  static void scales(const uint8_t* b, float* scale, float*) { scale[0] = half_at(b); }
};
struct Q8_0 : BlockOf32 {
  static constexpr int64_t kBytes = 34;
  static constexpr int kType = 8;
  static void weights(const uint8_t* b, int, Int16x16& low, Int16x16& high) {
    low = widen16(reinterpret_cast<const int8_t*>(b + 2));
    high = widen16(reinterpret_cast<const int8_t*>(b + 2 + kIntLanes));
  }
};
struct Q4_0 : BlockOf32 {
  static constexpr int64_t kBytes = 18;
  static constexpr int kType = 2;
  static void weights(const uint8_t* b, int, Int16x16& low, Int16x16& high) { widen_nibbles(b + 2, 8, low, high); }
};
struct Q4_1 : BlockOf32 {  // w = d q + m
  static constexpr int64_t kBytes = 20;
  static constexpr int kType = 3;
  static constexpr bool kHasMinimum = true;
  static void scales(const uint8_t* b, float* scale, float* minimum) {
    scale[0] = half_at(b);
    minimum[0] = half_at(b + 2);
  }
  static void weights(const uint8_t* b, int, Int16x16& low, Int16x16& high) { widen_nibbles(b + 4, 0, low, high); }
};
// Q5_0: d, 32 high bits (bit j is weight j's fifth bit), then 16 bytes of low nibbles as Q4_0's; w = d (q - 16).
#if defined(__AVX512BW__) && defined(__AVX512VL__)
// The bits are a mask register as they stand: one masked add a half, where spreading them over 16-bit lanes
// took AVX2 five instructions a half (AVX2 now makes bytes first, below). Gemma 3 270M's 18 Q5_0 ffn_gate
// (16 MB, in L3 across repeats) on a 2-core Zen 5, fastest of 21 in three rounds: 0.89-1.05 -> 0.77-0.80 ms at
// one row, 1.36-1.45 -> 1.26-1.28 at four.
inline void add_fifth_bits(uint32_t bits, Int16x16& low, Int16x16& high) {
  const __m256i sixteen = _mm256_set1_epi16(16);
  for (auto [half, part] : {std::pair{&low, bits & 0xffffu}, std::pair{&high, bits >> 16}}) {
    const __m256i value = reinterpret_cast<__m256i>(*half);
    *half = reinterpret_cast<Int16x16>(_mm256_mask_add_epi16(value, static_cast<__mmask16>(part), value, sixteen));
  }
}
#elif !defined(__AVX2__)
inline void add_fifth_bits(uint32_t bits, Int16x16& low, Int16x16& high) {
  for (int j = 0; j < kIntLanes; ++j) {
    low[j] = static_cast<int16_t>(low[j] + (((bits >> j) & 1u) << 4));
    high[j] = static_cast<int16_t>(high[j] + (((bits >> (j + 16)) & 1u) << 4));
  }
}
#endif
#if defined(__AVX2__) && !(defined(__AVX512BW__) && defined(__AVX512VL__))
// Without AVX-512 each half's 16 weights are made signed bytes first, in a 128-bit register, and widened once:
// q - 16 is the nibble with 0xf0 or-ed in where its fifth bit is clear (llama.cpp's way), the bits picked
// out of the 32 by a byte shuffle and tested by a compare. 19 micro-ops a block on a Zen 1 (which splits every
// 256-bit operation in two), where widening first and spreading the fifth bits over 16-bit lanes took 31.
inline Int16x16 q5_0_half(__m128i nibbles, __m128i bits, __m128i byte_of_lane) {
  const __m128i lane_bit = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(bits, byte_of_lane), lane_bit), lane_bit);
  const __m128i q = _mm_or_si128(nibbles, _mm_andnot_si128(set, _mm_set1_epi8(static_cast<char>(0xf0))));
  return reinterpret_cast<Int16x16>(_mm256_cvtepi8_epi16(q));
}
inline void q5_0_weights(const uint8_t* b, Int16x16& low, Int16x16& high) {
  uint32_t word;
  std::memcpy(&word, b + 2, sizeof word);
  const __m128i bits = _mm_cvtsi32_si128(static_cast<int>(word));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6)), mask = _mm_set1_epi8(0x0f);
  low = q5_0_half(_mm_and_si128(packed, mask), bits, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  high = q5_0_half(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), bits,
                   _mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
}
#else
inline void q5_0_weights(const uint8_t* b, Int16x16& low, Int16x16& high) {
  uint32_t bits;
  std::memcpy(&bits, b + 2, sizeof bits);
  widen_nibbles(b + 6, 16, low, high);
  add_fifth_bits(bits, low, high);
}
#endif
struct Q5_0 : BlockOf32 {
  static constexpr int64_t kBytes = 22;
  static constexpr int kType = 6;
  static void weights(const uint8_t* b, int, Int16x16& low, Int16x16& high) { q5_0_weights(b, low, high); }
};

// K-quants pack each run of 32 weights across 32 bytes, several runs in different bits of the same bytes:
// bits_at picks ((byte >> shift) & mask) << up out of 32 bytes, and widen_bytes makes the 32 values int16.
typedef uint8_t Bytes32 __attribute__((vector_size(32)));
#if defined(__AVX2__)
inline Bytes32 bits_at(const uint8_t* p, int shift, uint8_t mask, int up) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i picked = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(mask));
  return reinterpret_cast<Bytes32>(_mm256_sll_epi16(picked, _mm_cvtsi32_si128(up)));  // mask << up fits a byte
}
inline void widen_bytes(Bytes32 v, int16_t offset, Int16x16& low, Int16x16& high) {
  const __m256i bytes = reinterpret_cast<__m256i>(v), shift = _mm256_set1_epi16(offset);
  low = reinterpret_cast<Int16x16>(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(bytes)), shift));
  high = reinterpret_cast<Int16x16>(
      _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes, 1)), shift));
}
#else
inline Bytes32 bits_at(const uint8_t* p, int shift, uint8_t mask, int up) {
  Bytes32 v;
  for (int l = 0; l < 32; ++l) v[l] = static_cast<uint8_t>(((p[l] >> shift) & mask) << up);
  return v;
}
inline void widen_bytes(Bytes32 v, int16_t offset, Int16x16& low, Int16x16& high) {
  for (int l = 0; l < kIntLanes; ++l) {
    low[l] = static_cast<int16_t>(v[l] - offset);
    high[l] = static_cast<int16_t>(v[l + kIntLanes] - offset);
  }
}
#endif
struct SuperBlock {
  static constexpr int64_t kWeights = 256;
};
// Eight small integers (uint8, or int8 when SIGNED) times d, as floats in `out` (K-quant scales and minimums).
template <bool SIGNED>
inline void times(const uint8_t* bytes, float d, float* out) {
#if defined(__AVX2__)
  const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m256i wide = SIGNED ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(d)));
#else
  for (int j = 0; j < 8; ++j) out[j] = d * static_cast<float>(SIGNED ? static_cast<int8_t>(bytes[j]) : bytes[j]);
#endif
}
// Q4_K and Q5_K: d, dmin, 12 bytes of 6-bit scales and minimums (llama.cpp's get_scale_min_k4), [Q5_K: 32 bytes
// of fifth bits, bit j for run j,] then 128 bytes of nibbles: runs 2i and 2i + 1 in the low and high nibbles of
// bytes 32i .. 32i + 31. w = d sc_j q - dmin m_j.
struct KScalesAndMinimums : SuperBlock {
  static constexpr bool kScalesPer16 = false, kHasMinimum = true;
  static void scales(const uint8_t* b, float* scale, float* minimum) {
    // Bytes 0-3: scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the minimums;
    // bytes 8-11: the low 4 bits of scales 4-7 (low nibbles) and of minimums 4-7 (high). Four bytes at a time.
    uint32_t word[3];
    std::memcpy(word, b + 4, sizeof word);
    const uint32_t unpacked[4] = {
        word[0] & 0x3f3f3f3fu, (word[2] & 0x0f0f0f0fu) | (((word[0] >> 6) & 0x03030303u) << 4),  // scales
        word[1] & 0x3f3f3f3fu, ((word[2] >> 4) & 0x0f0f0f0fu) | (((word[1] >> 6) & 0x03030303u) << 4)};  // minimums
    uint8_t bytes[16];
    std::memcpy(bytes, unpacked, sizeof bytes);
    times<false>(bytes, half_at(b), scale);
    times<false>(bytes + 8, -half_at(b + 2), minimum);  // w = d sc q - dmin m
  }
};
struct Q4_K : KScalesAndMinimums {
  static constexpr int64_t kBytes = 144;
  static constexpr int kType = 12;
  static void weights(const uint8_t* b, int j, Int16x16& low, Int16x16& high) {
    widen_bytes(bits_at(b + 16 + 32 * (j / 2), 4 * (j % 2), 0x0f, 0), 0, low, high);
  }
};
struct Q5_K : KScalesAndMinimums {
  static constexpr int64_t kBytes = 176;
  static constexpr int kType = 13;
  static void weights(const uint8_t* b, int j, Int16x16& low, Int16x16& high) {
    widen_bytes(bits_at(b + 48 + 32 * (j / 2), 4 * (j % 2), 0x0f, 0) | bits_at(b + 16, j, 0x01, 4), 0, low, high);
  }
};
// Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per 16 weights), d. Weights
// 128h + 32t + l (h < 2, t < 4, l < 32) take nibble t / 2 of byte 64h + 32 (t % 2) + l and bits 2t, 2t + 1 of
// byte 128 + 32h + l; w = d sc (q - 32).
struct Q6_K : SuperBlock {
  static constexpr int64_t kBytes = 210;
  static constexpr int kType = 14;
  static constexpr bool kScalesPer16 = true, kHasMinimum = false;
  static void scales(const uint8_t* b, float* scale, float*) {
    const float d = half_at(b + 208);
    times<true>(b + 192, d, scale);
    times<true>(b + 200, d, scale + 8);
  }
  static void weights(const uint8_t* b, int j, Int16x16& low, Int16x16& high) {
    const int h = j / 4, t = j % 4;
    const Bytes32 q = bits_at(b + 64 * h + 32 * (t % 2), 4 * (t / 2), 0x0f, 0) | bits_at(b + 128 + 32 * h, 2 * t, 0x03, 4);
    widen_bytes(q, 32, low, high);
  }
};
constexpr int64_t kBlock = 32;  // x's sums for the minimums are per run of 32
template <typename T>
constexpr bool kIsBlockFormat = std::is_base_of_v<BlockOf32, T> || std::is_base_of_v<SuperBlock, T>;

// Register blocking: ROWS rows of x times FEATURES weight rows, ROWS x FEATURES accumulators (at most 8 of the
// 16 AVX2 registers). Per 8 inputs it loads FEATURES weight vectors and ROWS x vectors for ROWS x FEATURES
// multiply-adds, so with 4 rows it is bound by arithmetic, and with 1 row by memory as it should be.
constexpr int kMaxRows = 4;
// Weight rows are short (576 values for SmolLM2's hidden size) and read a few at a time, too short a stream
// for the hardware prefetcher to get ahead: a single thread then reads 6 GB/s from memory. Each row is read
// together with a software prefetch this far ahead of it (rows lie back to back, so this reaches rows later
// in the same or the next block), which keeps enough lines in flight.
//
// The prefetch goes into L2 (prefetcht1), not L1 (likely because L1's few miss buffers then stay free for
// the loads, while L2 holds many more lines in flight). Chains of SmolLM2's 30 layers of matmuls on a 2-core
// Zen 4, from memory, L1 against L2 prefetch: float32 at one row 24.9-25.5 against 19.0-19.3 ms (21 -> 28
// GB/s), at 8 rows 35.2-36.8 against 23.8-24.6 (in turns); int8 at 8 rows 16.6-17.1 against 14.0-14.5.
constexpr int64_t kAhead = 16384;

inline void prefetch_ahead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + kAhead, 0, /*locality: prefetcht1, into L2*/ 2);
}
// Work items of about this many weight bytes (at least 4 output features). The two threads take items from
// a shared counter. Small items cost twice: trading the counter's cache line (with 16 features an int8 item
// was 9 KB: a fifth of the bandwidth), and each item's start is a jump in the thread's streams that the
// prefetch has not reached. Chains of SmolLM2's 30 layers on a 2-core Xeon, 144 KB items against 36 KB:
// float32 13.8 against 17.5 ms at one row, 22.5 against 26.0 at 8; int8 2.7-2.9 against 3.5-3.9 at one row,
// 9.1 against 10.0 at 8, the same at 16 and 32.
constexpr int64_t kBytesPerItem = 147456;

struct Problem {
  const float* x;
  const void* w;
  const float* scale;  // nullptr: unscaled
  float* y;
  int64_t rows, in_features, out_features;
  const int16_t* x_int16;  // int8 weights and GGUF blocks: x rounded to int16, x ~= x_int16 * x_step (per row)
  const float* x_step;
  const float* x_block_sums;  // GGUF blocks streamed: [M, K/32] sums of x_int16 over each run of 32 (minimums)
  // Many rows of int8 weights or GGUF blocks (many_rows_features): x_int16 as float32 [M, K], which each thread
  // packs into panels (chunk_panels) as float32 weights' rows pack x.
  const float* x_rounded;
  int64_t block_row_bytes;  // GGUF blocks: the bytes from one weight row to the next
  const uint8_t* x_low;  // int8 weights with VNNI: x_int16's low bytes [M, K] (unsigned),
  const int8_t* x_high;  // its high bytes (signed): x_int16 = 256 x_high + x_low
  const int64_t* x_high_sums;  // [M] sums of x_high over the row
  uint64_t call;  // many rows: which call this is (chunk_panels' packed panels belong to one); 0 for few rows
};

// Each int32 lane sums products of at most 127 x 32767 (2^22); this many inputs per lane-sum (here 4096 / 8
// lanes = 512 products) cannot overflow. Longer rows are summed in spans of this length.
constexpr int64_t kExactSpan = 4096;
constexpr float kInt16Max = 32767.0f;

// Each row of x as int16 values and one step: x_int16 = rint(x * (32767 / max |x|)), step = max |x| / 32767
// (a zero row: x_int16 = 0, step 1). matmul.round_rows_to_int16 computes the same in XLA.
// S is int16_t, or float for the many-rows path (the same integers, held as float32: exact).
template <typename S>
void round_rows_to_int16(const float* x, int64_t rows, int64_t K, S* x_int16, float* x_step) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * K;
    float peak = 0.0f;
    for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(row[k]));
    const float inverse = peak > 0.0f ? kInt16Max / peak : 1.0f;
    x_step[m] = peak > 0.0f ? peak / kInt16Max : 1.0f;
    for (int64_t k = 0; k < K; ++k) x_int16[m * K + k] = static_cast<S>(std::nearbyint(row[k] * inverse));
  }
}

// y[m, n + f] for ROWS rows of x (from `x`) and FEATURES consecutive output features (weight rows from `w`).
template <typename T, int ROWS, int FEATURES>
inline void block(const float* x, int64_t K, const T* w, float* y, int64_t N, const float* scale) {
  Vec acc[ROWS][FEATURES] = {};
  for (int64_t k = 0; k < K; k += kLanes) {
    Vec wk[FEATURES];
    if (k % (64 / sizeof(T)) == 0) {  // once per cache line of each weight row
      for (int f = 0; f < FEATURES; ++f) prefetch_ahead(w + f * K + k);
    }
    for (int f = 0; f < FEATURES; ++f) wk[f] = load8(w + f * K + k);
    for (int m = 0; m < ROWS; ++m) {
      const Vec xm = load8(x + m * K + k);
      for (int f = 0; f < FEATURES; ++f) acc[m][f] += xm * wk[f];
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int f = 0; f < FEATURES; ++f) y[m * N + f] = sum<float>(acc[m][f]) * (scale ? scale[f] : 1.0f);
  }
}

// The same for int8 weights and x rounded to int16: exact int32 sums, scaled by x's step and w's scale.
template <int ROWS, int FEATURES>
inline void block_int8(const int16_t* x, const float* x_step, int64_t K, const int8_t* w, float* y, int64_t N,
                       const float* scale) {
  int64_t total[ROWS][FEATURES] = {};
  for (int64_t span = 0; span < K; span += kExactSpan) {
    IntVec acc[ROWS][FEATURES] = {};
    for (int64_t k = span; k < std::min(K, span + kExactSpan); k += kIntLanes) {
      Int16x16 wk[FEATURES];
      if (k % 64 == 0) {  // once per cache line of each weight row
        for (int f = 0; f < FEATURES; ++f) prefetch_ahead(w + f * K + k);
      }
      for (int f = 0; f < FEATURES; ++f) wk[f] = widen16(w + f * K + k);
      for (int m = 0; m < ROWS; ++m) {
        const Int16x16 xm = load16(x + m * K + k);
        for (int f = 0; f < FEATURES; ++f) acc[m][f] += multiply_add_pairs(xm, wk[f]);
      }
    }
    for (int m = 0; m < ROWS; ++m) {
      for (int f = 0; f < FEATURES; ++f) total[m][f] += sum<int64_t>(acc[m][f]);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int f = 0; f < FEATURES; ++f) y[m * N + f] = static_cast<float>(total[m][f]) * x_step[m] * scale[f];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kSplitsBytes = true;
// x_int16 split into bytes for vpdpbusd (see the top of the file); returns sum(x_high) per row.
void split_bytes(const int16_t* x_int16, int64_t rows, int64_t K, uint8_t* low, int8_t* high, int64_t* high_sums) {
  for (int64_t m = 0; m < rows; ++m) {
    high_sums[m] = 0;
    for (int64_t k = m * K; k < (m + 1) * K; ++k) {
      low[k] = static_cast<uint8_t>(x_int16[k] & 0xff);
      high[k] = static_cast<int8_t>(x_int16[k] >> 8);  // arithmetic shift: the floor, so low is 0..255
      high_sums[m] += high[k];
    }
  }
}

// block_int8 with vpdpbusd: 64 weights a step, the last step masked. Each int32 lane adds 4 products of at
// most 255 x 128 per step, so a span of kExactSpan inputs (64 steps) stays below 2^24 and the span's 16 lanes
// add up below 2^28.
//
// pass() gives it one weight row at a time: a chain of SmolLM2's 30 int8 layers and LM head at one row (134
// MB, from memory) on a 2-core Zen 4 took 5.8-6.5 ms with four rows side by side (the other paths' blocking,
// which a Xeon preferred when the prefetch went to L1), 4.8-5.9 with one.
template <int ROWS, int FEATURES>
inline void block_int8_vnni(const Problem& p, int64_t m0, const int8_t* w, float* y, const float* scale) {
  const int64_t K = p.in_features, N = p.out_features;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // w XOR 0x80 = w + 128 as an unsigned byte
  int64_t total[ROWS][FEATURES] = {};
  for (int64_t span = 0; span < K; span += kExactSpan) {
    __m512i low_acc[ROWS][FEATURES], high_acc[ROWS][FEATURES];
    for (int m = 0; m < ROWS; ++m) {
      for (int f = 0; f < FEATURES; ++f) low_acc[m][f] = high_acc[m][f] = _mm512_setzero_si512();
    }
    const int64_t end = std::min(K, span + kExactSpan);
    for (int64_t k = span; k < end; k += 64) {
      const __mmask64 mask = end - k >= 64 ? ~__mmask64{0} : (__mmask64{1} << (end - k)) - 1;
      __m512i wk[FEATURES], shifted[FEATURES];
      for (int f = 0; f < FEATURES; ++f) {
        prefetch_ahead(w + f * K + k);  // once per cache line, as in block_int8
        wk[f] = _mm512_maskz_loadu_epi8(mask, w + f * K + k);
        shifted[f] = _mm512_xor_si512(wk[f], flip);  // a masked-out 0 becomes 128, times a masked-out 0
      }
      for (int m = 0; m < ROWS; ++m) {
        const __m512i low = _mm512_maskz_loadu_epi8(mask, p.x_low + (m0 + m) * K + k);
        const __m512i high = _mm512_maskz_loadu_epi8(mask, p.x_high + (m0 + m) * K + k);
        for (int f = 0; f < FEATURES; ++f) {
          low_acc[m][f] = _mm512_dpbusd_epi32(low_acc[m][f], low, wk[f]);
          high_acc[m][f] = _mm512_dpbusd_epi32(high_acc[m][f], shifted[f], high);
        }
      }
    }
    for (int m = 0; m < ROWS; ++m) {
      for (int f = 0; f < FEATURES; ++f) {
        total[m][f] += 256 * int64_t{_mm512_reduce_add_epi32(high_acc[m][f])} + _mm512_reduce_add_epi32(low_acc[m][f]);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    const int64_t correction = 256 * 128 * p.x_high_sums[m0 + m];  // the + 128 on the weights, times 256 hi
    for (int f = 0; f < FEATURES; ++f) {
      y[m * N + f] = static_cast<float>(total[m][f] - correction) * p.x_step[m0 + m] * scale[f];
    }
  }
}
#else
constexpr bool kSplitsBytes = false;
#endif

// Blocks are prefetched at every kPrefetchEvery-th one, a line (64 bytes) at a time from its start: fewer than 64
// bytes apart, so every line is reached, without a branch on where lines start. (Prefetching each line once, at the
// block it starts in, took such a branch per block and weight row, which the predictor missed: on a 2-core Zen 4,
// chains of one row times 18 or 30 layers, 20 runs in turns, Gemma 3 270M's Q5_0 gate+up 3.2-3.5 -> 2.8-2.9 ms,
// SmolLM2's Q4_1 layers 10.9 -> 8.7 ms, 0.76x at 8 rows.)
template <typename T>
constexpr int64_t kPrefetchEvery = T::kBytes >= 64 ? 1 : 64 / T::kBytes;

// block_int8 for GGUF blocks: per run of 32 weights, exact int32 sums of products, times the run's scale(s)
// (float32); minimums times the run's sum of x. Row f of the weights starts at w + f x p.block_row_bytes.
//
// (An AVX-512 version, a run of 32 int16 weights in one register, one vpmaddwd per run and row instead of two,
// was slower on a 2-core Xeon with AVX-512 BW: Gemma 3 270M's Q8_0 LM head, 262144 x 640, took 42 / 82 / 312 ms
// at 1 / 8 / 32 rows against 30 / 75 / 280 with AVX2, timed in turns.)
template <typename T, int ROWS, int FEATURES>
inline void block_gguf(const Problem& p, int64_t m0, const uint8_t* w, float* y) {
  constexpr int kRuns = T::kWeights / kBlock, kScales = kRuns * (T::kScalesPer16 ? 2 : 1);
  const int64_t K = p.in_features, N = p.out_features, runs_per_row = K / kBlock;
  Vec acc[ROWS][FEATURES] = {};
  float minimums[ROWS][FEATURES] = {};
  Vec run_minimums[ROWS][FEATURES] = {};  // K-quants: lane j sums run j's minimum times x's sum over it
  for (int64_t b = 0; b < K / T::kWeights; ++b) {
    const uint8_t* block[FEATURES];
    float scale[FEATURES][kScales], minimum[FEATURES][kRuns];
#pragma GCC unroll 4
    for (int f = 0; f < FEATURES; ++f) {
      block[f] = w + f * p.block_row_bytes + b * T::kBytes;
      if (b % kPrefetchEvery<T> == 0) {
#pragma GCC unroll 4
        for (int64_t line = 0; line < T::kBytes; line += 64) prefetch_ahead(block[f] + line);
      }
      T::scales(block[f], scale[f], minimum[f]);
      for (int m = 0; m < ROWS && T::kHasMinimum; ++m) {
        const float* sums = p.x_block_sums + (m0 + m) * runs_per_row + b * kRuns;
        if constexpr (kRuns == kLanes) {
          run_minimums[m][f] += load8(minimum[f]) * load8(sums);
        } else {
          minimums[m][f] += minimum[f][0] * sums[0];
        }
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < kRuns; ++j) {
      Int16x16 low[FEATURES], high[FEATURES];
      for (int f = 0; f < FEATURES; ++f) T::weights(block[f], j, low[f], high[f]);
      for (int m = 0; m < ROWS; ++m) {
        const int16_t* x = p.x_int16 + (m0 + m) * K + (b * kRuns + j) * kBlock;
        const Int16x16 x_low = load16(x), x_high = load16(x + kIntLanes);
        for (int f = 0; f < FEATURES; ++f) {
          const IntVec first = multiply_add_pairs(x_low, low[f]), second = multiply_add_pairs(x_high, high[f]);
          if constexpr (T::kScalesPer16) {
            acc[m][f] += __builtin_convertvector(first, Vec) * scale[f][2 * j] +
                         __builtin_convertvector(second, Vec) * scale[f][2 * j + 1];
          } else {
            acc[m][f] += __builtin_convertvector(first + second, Vec) * scale[f][j];
          }
        }
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int f = 0; f < FEATURES; ++f) {
      y[m * N + f] = (sum<float>(acc[m][f]) + sum<float>(run_minimums[m][f]) + minimums[m][f]) * p.x_step[m0 + m];
    }
  }
}

// Many rows: the cost is arithmetic, not reading the weights. A few output features' weights at a time are
// made float32 ([features, K]: float32 weights as stored, read in place; 16-bit floats widened, int8 rows times
// their scale, GGUF blocks dequantized, once, into the thread's buffer in L1), and every row of a chunk of x
// multiplies them there with float32 multiply-adds in register blocks (block_dequantized). For int8 and GGUF, x
// is the same x rounded to int16 (held as float32: exact), so these are the sums matmul.py's XLA path computes,
// x_int16 times the widened weights, without a widened matrix crossing memory or a stacked layer being copied out
// of its stack.
//
// GGUF, streamed, each pass of 4 rows unpacked every block again (Q5_0: up to 17 instructions per run of 32
// weights), and each run of 32 products and row took two vpmaddwd, an add, a conversion to float and a scaled
// add (5 instructions); here a register's multiply-adds take 16 products with AVX-512 (8 with AVX2), and
// nothing else. Timed in turns on a 2-core Zen 5, chains of Gemma 3 270M's matrices, streamed (int16 weights
// unpacked once per 4 features before 2026-11-28) against dequantized: the Q8_0 LM head (262144 x 640) 32 / 67
// / 136 ms against 24 / 39 / 75 at 12 / 32 / 64 rows (its int8 requantization: 24 / 47-55 / 109), the 18 Q5_0
// ffn_gate 4.7 / 11.2 / 21.1 against 3.8 / 5.1 / 9.1, the Q4_K ffn_down 5.2 / 11.7 / 21.4 against 3.2 / 5.3 /
// 10.7. Not for 8 rows or fewer: a register of 16 rows then holds half padding, and streaming wins (the LM head
// at 4 / 6 / 8 rows: 12.8 / 10.7 / 11.7 ms streamed against 21.0 / 21.1 / 21.6 dequantized).
//
// Float32 past 24 rows (matmul.py sends a stacked layer's any rows, with AVX-512): XLA's dot would copy the layer
// out of the stack and repack it. 12 features x 2 registers of rows take 24 of AVX-512's 32 registers, and each
// input loads 2 registers of x and broadcasts 12 weights for 24 multiply-adds. (A one-core harness, 256 rows of
// SmolLM2's MLP: 140 GFLOP/s with 12 features, 146 with 14, 125 with 8; blocking over K was no faster. 12
// divides SmolLM2's widths, 576, 960, 3072 and 49152, where 14 would leave every matrix a tail.)
//
// The rows each weight type streams before it takes this path: where reading each weight once for all rows
// still costs more than the register blocks' padding (a register holds 16 rows). With AVX-512, chains of
// SmolLM2's 30 layers on a 2-core Xeon, streamed against these blocks (q/k/v, ms): float32 at 16 / 24 / 32 rows
// 6.0 / 7.7 / 9.0 against 6.9 / 7.7 / 6.9, int8 at 24 / 32 / 64 4.4 / 7.0 / 12.2 against 5.3 / 5.5 / 9.7. Without
// AVX-512 (blocks of 8 rows, not timed) float32, 16-bit floats and int8 stream as many rows as matmul.py sends.
int64_t streamed_rows(ffi::DataType dtype) {
#if defined(__AVX512F__)
  constexpr int64_t kFloat32 = 24, kFloat16 = 24, kInt8 = 28;
#else
  constexpr int64_t kFloat32 = 32, kFloat16 = 32, kInt8 = 64;
#endif
  switch (dtype) {
    case ffi::DataType::F32: return kFloat32;
    case ffi::DataType::BF16:
    case ffi::DataType::F16: return kFloat16;
    case ffi::DataType::S8: return kInt8;
    default: return 8;  // GGUF blocks
  }
}
#if defined(__AVX512F__)
typedef float Wide __attribute__((vector_size(64)));  // one AVX-512 register: 16 rows of x
constexpr int kManyFeatures = 12;
#else
typedef Vec Wide;  // 8 rows of x
constexpr int kManyFeatures = 4;  // 4 x 2: 8 accumulators of the 16 AVX2 registers
#endif
// Rows of x multiplied by one item's weights: 256 rows of 1536 inputs (SmolLM2's MLP down) are 1.5 MB of panels,
// which stay in a core's L2 while the item's weights stream past. Longer x (prefill) is cut into chunks. Smaller
// chunks read the weights once per chunk: 64 rows made the LM head (113 MB of float32) ~30% slower.
constexpr int64_t kManyRowsPerChunk = 256;
// Items per chunk: the threads take them from a shared counter, so the last one is all either waits for.
constexpr int64_t kManyItemsPerChunk = 16;
constexpr int kWideLanes = sizeof(Wide) / sizeof(float);
constexpr int64_t kPanelRows = 2 * kWideLanes;
constexpr int64_t kLineFloats = 64 / sizeof(float);

inline Wide load_wide(const float* p) {
  Wide v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// Weights q (one run's 16 integers) times scale plus minimum, as float32, into out. The product is exact (a
// float16 scale, or one times a 6-bit sub-block scale, times a small integer), so this rounds once, as gguf-py.
#if defined(__AVX512F__)
inline void store_dequantized(Int16x16 q, float scale, float minimum, float* out) {
  typedef float Float32x16 __attribute__((vector_size(64)));
  const Float32x16 w = __builtin_convertvector(q, Float32x16) * scale + minimum;
  std::memcpy(out, &w, sizeof w);
}
#else
// Eight at a time, one AVX2 register: without AVX-512 a 16-float vector stays in memory, and GCC built the
// scale's broadcast there from 16 scalar stores.
inline void store_dequantized(Int16x16 q, float scale, float minimum, float* out) {
  typedef int16_t Int16x8 __attribute__((vector_size(16)));
  Int16x8 halves[2];
  std::memcpy(halves, &q, sizeof halves);
  for (int h = 0; h < 2; ++h) {
    const Vec w = __builtin_convertvector(halves[h], Vec) * scale + minimum;
    std::memcpy(out + h * kLanes, &w, sizeof w);
  }
}
#endif

// Output features' weights from `w` (block rows p.block_row_bytes apart), dequantized into out [features, K].
template <typename T>
void dequantize_features(const Problem& p, const uint8_t* w, int features, float* out) {
  constexpr int kRuns = T::kWeights / kBlock;
  const int64_t K = p.in_features, blocks = K / T::kWeights;
  for (int f = 0; f < features; ++f) {
    const uint8_t* row = w + f * p.block_row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * T::kBytes;
      prefetch_ahead(block);
      float scale[2 * kRuns], minimum[kRuns] = {};
      T::scales(block, scale, minimum);
      for (int j = 0; j < kRuns; ++j) {
        Int16x16 low, high;
        T::weights(block, j, low, high);
        float* run = out + f * K + (b * kRuns + j) * kBlock;
        store_dequantized(low, scale[T::kScalesPer16 ? 2 * j : j], minimum[j], run);
        store_dequantized(high, scale[T::kScalesPer16 ? 2 * j + 1 : j], minimum[j], run + kIntLanes);
      }
    }
  }
}

// int8 weight rows times their scales, into out [features, K].
void dequantize_int8(const Problem& p, int64_t n, int features, float* out) {
  const int64_t K = p.in_features;
  const int8_t* w = static_cast<const int8_t*>(p.w) + n * K;
  for (int f = 0; f < features; ++f) {
    const float scale = p.scale[n + f];
    for (int64_t k = 0; k < K; ++k) out[f * K + k] = static_cast<float>(w[f * K + k]) * scale;
  }
}

// Float32 weights w [FEATURES, K] (dequantized or float32 as stored) times REGISTERS x kWideLanes rows of x from
// m0 (the start of a panel) into y: for each input, a register of the panel's rows times each feature's weight
// (broadcast), so every multiply-add is a whole register's and nothing is summed across lanes. (Dot products
// along K, a register of x times one of weights per multiply-add, ran at a third of this speed in a one-core
// harness.)
template <int REGISTERS, int FEATURES, bool STEPPED>
inline void block_dequantized(const Problem& p, const float* panel, int64_t m0, const float* w, float* y) {
  const int64_t K = p.in_features, N = p.out_features;
  Wide acc[FEATURES][REGISTERS] = {};
  for (int64_t k = 0; k < K; ++k) {
    Wide xk[REGISTERS];
    for (int r = 0; r < REGISTERS; ++r) xk[r] = load_wide(panel + k * kPanelRows + r * kWideLanes);
    for (int f = 0; f < FEATURES; ++f) {
      const float wf = w[f * K + k];
      for (int r = 0; r < REGISTERS; ++r) acc[f][r] += wf * xk[r];
    }
  }
  // Lanes taken out of registers by constant index. Indexed by a variable, the compiler stored the registers
  // and read lanes back at once, which took a third of the time (likely a store not forwarded to a narrower load).
  const int64_t rows = std::min<int64_t>(REGISTERS * kWideLanes, p.rows - m0);
#pragma GCC unroll 16
  for (int lane = 0; lane < kWideLanes; ++lane) {
    for (int r = 0; r < REGISTERS; ++r) {
      const int64_t m = r * kWideLanes + lane;
      if (m >= rows) continue;
      if constexpr (STEPPED) {
        for (int f = 0; f < FEATURES; ++f) y[m * N + f] = acc[f][r][lane] * p.x_step[m0 + m];
      } else {
        for (int f = 0; f < FEATURES; ++f) y[m * N + f] = acc[f][r][lane];
      }
    }
  }
}

// Rows m .. m + ROWS - 1 of x times the FEATURES output features from n, in register blocks.
template <typename T, int ROWS, int FEATURES>
inline void pass(const Problem& p, int64_t m, int64_t n) {
  // int8 weights times one or two rows of x take vpdpbusd where the CPU has it. With more rows the work is
  // arithmetic, where vpdpbusd on split bytes does no more multiply-adds a cycle than vpmaddwd (a chain of
  // SmolLM2's int8 layers at 8 rows: 17 ms against 13), so those take block_int8.
  constexpr bool kUsesVnni = std::is_same_v<T, int8_t> && kSplitsBytes && ROWS <= 2;
  // Q8_0 blocks times one row also take one weight row at a time: Gemma 3 270M's LM head (178 MB) on a 2-core
  // Zen 4, 20 runs of each in turns, 7.45 / 8.53 -> 6.72 / 7.46 ms (medians of two rounds; Q5_0 was slower by a
  // third with two).
  constexpr bool kOneAtATime = kUsesVnni || (std::is_same_v<T, Q8_0> && ROWS == 1);  // VNNI: see block_int8_vnni
  constexpr int kPerBlock = kOneAtATime ? 1 : std::min(FEATURES, ROWS <= 2 ? 4 : 2);
  const int64_t K = p.in_features, N = p.out_features;
  for (int f = 0; f < FEATURES; f += kPerBlock) {
    float* y = p.y + m * N + n + f;
    if constexpr (kIsBlockFormat<T>) {
      block_gguf<T, ROWS, kPerBlock>(p, m, static_cast<const uint8_t*>(p.w) + (n + f) * p.block_row_bytes, y);
    } else if constexpr (kUsesVnni) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      block_int8_vnni<ROWS, kPerBlock>(p, m, static_cast<const T*>(p.w) + (n + f) * K, y, p.scale + n + f);
#endif
    } else if constexpr (std::is_same_v<T, int8_t>) {
      block_int8<ROWS, kPerBlock>(p.x_int16 + m * K, p.x_step + m, K, static_cast<const T*>(p.w) + (n + f) * K, y,
                                  N, p.scale + n + f);
    } else {
      block<T, ROWS, kPerBlock>(p.x + m * K, K, static_cast<const T*>(p.w) + (n + f) * K, y, N,
                                p.scale ? p.scale + n + f : nullptr);
    }
  }
}

// Rows [m_begin, m_end) of x (whole panels) times FEATURES output features' float32 weights w [FEATURES, K],
// a panel at a time.
template <int FEATURES, bool STEPPED>
void rows_times(const Problem& p, const float* panels, int64_t m_begin, int64_t m_end, int64_t n, const float* w) {
  for (int64_t m = m_begin; m < m_end; m += kPanelRows) {
    const float* panel = panels + (m - m_begin) * p.in_features;
    float* y = p.y + m * p.out_features + n;
    if (m_end - m > kWideLanes) {
      block_dequantized<2, FEATURES, STEPPED>(p, panel, m, w, y);
    } else {
      block_dequantized<1, FEATURES, STEPPED>(p, panel, m, w, y);
    }
  }
}

#if defined(__AVX512F__)
// 16 rows of x (K apart) by 16 inputs into 16 runs of 16 rows, `stride` apart: a transpose in registers.
inline void transpose_16x16(const float* x, int64_t K, float* out, int64_t stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(x + i * K);
  for (int i = 0; i < 16; i += 2) {  // pairs of rows, interleaved by 32 bits
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads, by 64 bits
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes of quads 4 apart, then of quads 8 apart
    for (int j = 0; j < 16; j += 8) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + i * stride, r[i]);
}
#endif

// x [rows, K] into panels of kPanelRows rows, [panels, K, kPanelRows], zeros past the last row: a panel's rows of
// one input are one or two registers.
void pack_panels(const float* x, int64_t rows, int64_t K, float* panels) {
  const int64_t padded = (rows + kPanelRows - 1) / kPanelRows * kPanelRows;
  auto at = [&](int64_t m, int64_t k) { return panels + (m / kPanelRows * K + k) * kPanelRows + m % kPanelRows; };
  int64_t m = 0;
#if defined(__AVX512F__)
  for (; K % 16 == 0 && m + 16 <= rows; m += 16) {
    for (int64_t k = 0; k < K; k += 16) transpose_16x16(x + m * K + k, K, at(m, k), kPanelRows);
  }
#endif
  for (; m < padded; ++m) {
    for (int64_t k = 0; k < K; ++k) *at(m, k) = m < rows ? x[m * K + k] : 0.0f;
  }
}
// The panels of rows [m_begin, m_end) of x (int8 and GGUF: of x rounded), packed by this thread into its own
// buffer (once per call and chunk: items of one chunk taken in a row reuse them). Each thread packs the chunks it
// works on while they are hot in its own cache; one thread packing all of x for both took longer than a matmul's
// worth of setup (256 rows of 1536 inputs: ~190 us, x and its panels twice the size of L2).
const float* chunk_panels(const Problem& p, int64_t m_begin, int64_t m_end) {
  thread_local std::vector<float> buffer;
  thread_local uint64_t packed_call = 0;
  thread_local int64_t packed_begin = -1;
  const int64_t K = p.in_features;
  const size_t size = (m_end - m_begin + kPanelRows - 1) / kPanelRows * kPanelRows * K + kLineFloats;
  if (buffer.size() < size) {
    buffer.resize(size);
    packed_begin = -1;
  }
  float* panels = buffer.data();
  panels += (kLineFloats - reinterpret_cast<uintptr_t>(panels) / sizeof(float) % kLineFloats) % kLineFloats;
  if (packed_call != p.call || packed_begin != m_begin) {
    pack_panels((p.x_rounded ? p.x_rounded : p.x) + m_begin * K, m_end - m_begin, K, panels);
    packed_call = p.call;
    packed_begin = m_begin;
  }
  return panels;
}

// bfloat16 or float16 weight rows widened to float32, into out [features, K] (the rows lie back to back).
template <typename T>
void widen_features(const Problem& p, int64_t n, int features, float* out) {
  const T* w = static_cast<const T*>(p.w) + n * p.in_features;
  for (int64_t i = 0; i < features * p.in_features; i += kLanes) {
    const Vec v = load8(w + i);
    std::memcpy(out + i, &v, sizeof v);
  }
}

// Weights of output features [n, n + features) as float32 [features, K] (see above).
template <typename T>
const float* features_as_float(const Problem& p, int64_t n, int features) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<const float*>(p.w) + n * p.in_features;
  } else {
    thread_local std::vector<float> buffer;
    buffer.resize(features * p.in_features);
    if constexpr (kIsBlockFormat<T>) {
      dequantize_features<T>(p, static_cast<const uint8_t*>(p.w) + n * p.block_row_bytes, features, buffer.data());
    } else if constexpr (std::is_same_v<T, int8_t>) {
      dequantize_int8(p, n, features, buffer.data());
    } else {
      widen_features<T>(p, n, features, buffer.data());
    }
    return buffer.data();
  }
}

// Rows [m_begin, m_end) of x times output features [n, end), kManyFeatures at a time.
template <typename T>
void many_rows_features(const Problem& p, int64_t m_begin, int64_t m_end, int64_t n, int64_t end) {
  constexpr bool kStepped = std::is_same_v<T, int8_t> || kIsBlockFormat<T>;  // x rounded: times each row's step
  const float* panels = chunk_panels(p, m_begin, m_end);
  for (; n + kManyFeatures <= end; n += kManyFeatures) {
    rows_times<kManyFeatures, kStepped>(p, panels, m_begin, m_end, n, features_as_float<T>(p, n, kManyFeatures));
  }
  for (; n + 4 <= end; n += 4) rows_times<4, kStepped>(p, panels, m_begin, m_end, n, features_as_float<T>(p, n, 4));
  for (; n < end; ++n) rows_times<1, kStepped>(p, panels, m_begin, m_end, n, features_as_float<T>(p, n, 1));
}

// Every row of x for FEATURES output features from n on: passes of kMaxRows rows while their weights stay in L1.
template <typename T, int FEATURES>
void features(const Problem& p, int64_t n) {
  int64_t m = 0;
  for (; m + kMaxRows <= p.rows; m += kMaxRows) pass<T, kMaxRows, FEATURES>(p, m, n);
  switch (p.rows - m) {  // the last, partial pass: one instantiation per row count keeps accumulators in registers
    case 1: pass<T, 1, FEATURES>(p, m, n); break;
    case 2: pass<T, 2, FEATURES>(p, m, n); break;
    case 3: pass<T, 3, FEATURES>(p, m, n); break;
    default: break;
  }
}

// Work shared by the calling thread and pool threads (jax_engine::share_work).
struct WorkQueue {
  Problem problem;
  std::vector<int16_t> x_int16;  // int8 weights and GGUF blocks streamed only
  std::vector<float> x_step;
  std::vector<float> x_block_sums;  // GGUF blocks streamed only
  std::vector<float> x_rounded;  // int8 weights and GGUF blocks past streamed_rows only
  std::vector<uint8_t> x_low;  // int8 weights with VNNI only
  std::vector<int8_t> x_high;
  std::vector<int64_t> x_high_sums;
  ffi::DataType dtype;
  int block_type;  // GGUF blocks: the format's ggml_type id
  int64_t num_items;
  int64_t features_per_item;
  int64_t items_per_chunk;  // items share out the output features of each chunk of rows_per_chunk rows
  int64_t rows_per_chunk;  // whole panels past streamed_rows; every row otherwise
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  template <typename T>
  void item_features(int64_t item) {
    const int64_t m_begin = item / items_per_chunk * rows_per_chunk;
    item %= items_per_chunk;
    const int64_t end = std::min(problem.out_features, (item + 1) * features_per_item);
    int64_t n = item * features_per_item;
    if (problem.call) {
      return many_rows_features<T>(problem, m_begin, std::min(problem.rows, m_begin + rows_per_chunk), n, end);
    }
    for (; n + 4 <= end; n += 4) features<T, 4>(problem, n);
    for (; n < end; ++n) features<T, 1>(problem, n);
  }

  // int8 weights and GGUF blocks multiply x rounded to int16 per row (round_rows_to_int16).
  bool rounds_x() const { return dtype == ffi::DataType::S8 || dtype == ffi::DataType::U8; }

  // Many rows (see many_rows_features): items are chunks of rows times kManyFeatures-aligned feature ranges.
  void prepare_many_rows() {
    Problem& p = problem;
    static std::atomic<uint64_t> calls{0};
    p.call = ++calls;
    if (rounds_x()) {  // x rounded to int16, held as float32
      x_rounded.resize(p.rows * p.in_features);
      x_step.resize(p.rows);
      round_rows_to_int16(p.x, p.rows, p.in_features, x_rounded.data(), x_step.data());
      p.x_rounded = x_rounded.data();
      p.x_step = x_step.data();
    }
    const int64_t blocks = (p.out_features + kManyFeatures - 1) / kManyFeatures;
    features_per_item = (blocks + kManyItemsPerChunk - 1) / kManyItemsPerChunk * kManyFeatures;
    rows_per_chunk = kManyRowsPerChunk;
  }

  // Few rows (see pass): items are ranges of about kBytesPerItem weight bytes, over every row.
  void prepare_streamed(size_t row_bytes) {
    Problem& p = problem;
    const int64_t M = p.rows, K = p.in_features;
    if (rounds_x()) {
      x_int16.resize(M * K);
      x_step.resize(M);
      round_rows_to_int16(p.x, M, K, x_int16.data(), x_step.data());
      p.x_int16 = x_int16.data();
      p.x_step = x_step.data();
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (dtype == ffi::DataType::S8 && (M % kMaxRows == 1 || M % kMaxRows == 2)) {  // see pass()
      x_low.resize(M * K);
      x_high.resize(M * K);
      x_high_sums.resize(M);
      split_bytes(x_int16.data(), M, K, x_low.data(), x_high.data(), x_high_sums.data());
      p.x_low = x_low.data();
      p.x_high = x_high.data();
      p.x_high_sums = x_high_sums.data();
    }
#endif
    if (dtype == ffi::DataType::U8) {  // each run of 32's sum of x, for the blocks' minimums
      x_block_sums.assign(M * (K / kBlock), 0.0f);
      for (int64_t i = 0; i < M * K; ++i) x_block_sums[i / kBlock] += x_int16[i];
      p.x_block_sums = x_block_sums.data();
    }
    features_per_item = std::max<int64_t>(4, kBytesPerItem / static_cast<int64_t>(row_bytes) / 4 * 4);
    rows_per_chunk = std::max<int64_t>(1, M);
  }

  void run() {
    for (int64_t item; (item = next.fetch_add(1)) < num_items;) {
      switch (dtype) {
        case ffi::DataType::BF16: item_features<BFloat16>(item); break;
        case ffi::DataType::F16: item_features<Half>(item); break;
        case ffi::DataType::S8: item_features<int8_t>(item); break;
        case ffi::DataType::U8:
          switch (block_type) {
            case Q8_0::kType: item_features<Q8_0>(item); break;
            case Q4_0::kType: item_features<Q4_0>(item); break;
            case Q4_1::kType: item_features<Q4_1>(item); break;
            case Q5_0::kType: item_features<Q5_0>(item); break;
            case Q4_K::kType: item_features<Q4_K>(item); break;
            case Q5_K::kType: item_features<Q5_K>(item); break;
            case Q6_K::kType: item_features<Q6_K>(item); break;
            default: break;
          }
          break;
        default: item_features<float>(item); break;
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename T>
int64_t row_bytes_of(int64_t K) {
  return K % T::kWeights ? 0 : K / T::kWeights * T::kBytes;
}
// The bytes of a row of K weights in the format of ggml_type id `type`; 0 for no kept format, or a K it cannot hold.
int64_t gguf_row_bytes(int type, int64_t K) {
  switch (type) {
    case Q8_0::kType: return row_bytes_of<Q8_0>(K);
    case Q4_0::kType: return row_bytes_of<Q4_0>(K);
    case Q4_1::kType: return row_bytes_of<Q4_1>(K);
    case Q5_0::kType: return row_bytes_of<Q5_0>(K);
    case Q4_K::kType: return row_bytes_of<Q4_K>(K);
    case Q5_K::kType: return row_bytes_of<Q5_K>(K);
    case Q6_K::kType: return row_bytes_of<Q6_K>(K);
    default: return 0;
  }
}

ffi::Error FewRowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> block_types,
                             ffi::Buffer<ffi::S32> layer_index, ffi::Buffer<ffi::S32> live_rows,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const bool stacked = w_dims.size() == 3;
  const int64_t layers = stacked ? w_dims[0] : 1;
  const ffi::DataType dtype = w.element_type();
  const bool gguf_blocks = dtype == ffi::DataType::U8;
  const int64_t K = x_dims.size() == 2 ? x_dims[1] : 0, row_values = w_dims[w_dims.size() - 1];
  if (x_dims.size() != 2 || (w_dims.size() != 2 && !stacked) || (!gguf_blocks && K != row_values) || K % kLanes) {
    return ffi::Error::InvalidArgument(
        "few_rows_matmul: expected x [M, K], w [N, K] or [L, N, K], K a multiple of 8");
  }
  if (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16 &&
      dtype != ffi::DataType::S8 && !gguf_blocks) {
    return ffi::Error::InvalidArgument("few_rows_matmul: w must be float32, bfloat16, float16, int8 or GGUF blocks");
  }
  const int64_t layer = layer_index.typed_data()[0];
  if (layer < 0 || layer >= layers) {
    return ffi::Error::InvalidArgument("few_rows_matmul: layer " + std::to_string(layer) + " out of range [0, " +
                                       std::to_string(layers) + ")");
  }
  if (block_types.element_count() != static_cast<size_t>(gguf_blocks ? layers : 0)) {
    return ffi::Error::InvalidArgument("few_rows_matmul: GGUF blocks (uint8 rows) name one ggml_type per layer, "
                                       "other weights none");
  }
  const int block_type = gguf_blocks ? block_types.typed_data()[layer] : 0;
  const int64_t used_bytes = gguf_blocks ? gguf_row_bytes(block_type, K) : 0;
  if (gguf_blocks && (used_bytes == 0 || used_bytes > row_values)) {
    return ffi::Error::InvalidArgument("few_rows_matmul: uint8 rows of " + std::to_string(row_values) +
                                       " bytes hold no " + std::to_string(K) + " weights of ggml_type " +
                                       std::to_string(block_type) + " (kept: Q4_0 2, Q4_1 3, Q5_0 6, Q8_0 8, " +
                                       "Q4_K 12, Q5_K 13, Q6_K 14)");
  }
  const int64_t N = w_dims[w_dims.size() - 2];
  const bool scaled = scale.element_count() != 0;
  if (scaled && scale.element_count() != static_cast<size_t>(layers * N)) {
    return ffi::Error::InvalidArgument("few_rows_matmul: scale must have one value per output feature, or none");
  }
  if (gguf_blocks && scaled) {
    return ffi::Error::InvalidArgument("few_rows_matmul: GGUF blocks carry their own scales; scale must be empty");
  }
  if (dtype == ffi::DataType::S8 && (!scaled || K % kIntLanes)) {
    return ffi::Error::InvalidArgument("few_rows_matmul: int8 weights need a scale and K a multiple of 16");
  }
  const int64_t M = x_dims[0];
  const int64_t live = live_rows.element_count() == 0 ? M : live_rows.typed_data()[0];
  if (live < 0 || live > M) {
    return ffi::Error::InvalidArgument("few_rows_matmul: live rows " + std::to_string(live) + " out of range [0, " +
                                       std::to_string(M) + "]");
  }
  std::memset(y->typed_data() + live * N, 0, (M - live) * N * sizeof(float));
  if (live == 0) return ffi::Error::Success();
  const size_t row_bytes = static_cast<size_t>(row_values) * ffi::ByteWidth(dtype);
  const size_t matrix_bytes = N * row_bytes;
  const void* weights = static_cast<const char*>(w.untyped_data()) + layer * matrix_bytes;
  auto work = std::make_shared<WorkQueue>();
  work->problem = Problem{x.typed_data(), weights, scaled ? scale.typed_data() + layer * N : nullptr,
                          y->typed_data(), live, x_dims[1], N};
  work->dtype = dtype;
  work->block_type = block_type;
  work->problem.block_row_bytes = row_values;
  if (M > streamed_rows(dtype)) {
    work->prepare_many_rows();
  } else {
    work->prepare_streamed(row_bytes);
  }
  work->items_per_chunk = (N + work->features_per_item - 1) / work->features_per_item;
  work->num_items = work->items_per_chunk * ((live + work->rows_per_chunk - 1) / work->rows_per_chunk);
  jax_engine::share_work(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsMatmul, FewRowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // w
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_types
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
