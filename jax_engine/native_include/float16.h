// Narrow floats as the engine's C++ kernels read them, widened to float32: bfloat16, IEEE half, and the two
// 8-bit floats of an fp8 KV cache (kv_cache_dtype "fp8_e4m3" and "fp8_e5m2").
#pragma once

#include <cstdint>
#include <cstring>

namespace jax_engine {

struct BFloat16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};
struct Float8E4M3 {  // float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities
  uint8_t bits;
};
struct Float8E5M2 {  // float8_e5m2: an IEEE half's high byte (sign, 5 exponent bits, 2 mantissa bits)
  uint8_t bits;
};

inline float from_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return from_bits(static_cast<uint32_t>(x.bits) << 16); }  // float32's high half
inline float to_float(Half x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu, mantissa = x.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t biased = exponent == 0x1fu ? 0xffu : exponent + 112;  // infinity and NaN keep all ones
  return from_bits(sign | biased << 23 | mantissa << 13);
}

// The 8-bit floats widen by way of an IEEE half: an e5m2 byte is a half's high byte.
inline float half_bits_to_float(uint16_t bits) { return to_float(Half{bits}); }
inline float to_float(Float8E5M2 x) { return half_bits_to_float(static_cast<uint16_t>(x.bits) << 8); }
// e4m3 as a half: the sign moves to bit 15, exponent and mantissa go under the half's (5 exponent bits, 10
// mantissa bits) so that the half reads 2^-8 of the value (the biases differ by 8), subnormals alike; times 256.
// Its one NaN (0x7f) would read 480: the engine never writes it (values are clipped to +-448 first).
constexpr float kE4M3HalfScale = 256.0f;
inline uint16_t e4m3_as_half_bits(uint16_t bits) {
  return static_cast<uint16_t>((bits & 0x80u) << 8 | (bits & 0x7fu) << 7);
}
inline float to_float(Float8E4M3 x) { return half_bits_to_float(e4m3_as_half_bits(x.bits)) * kE4M3HalfScale; }

}  // namespace jax_engine
