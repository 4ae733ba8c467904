// 16-bit floats as the engine's C++ kernels read them: bfloat16 and IEEE half, widened to float32.
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

}  // namespace jax_engine
