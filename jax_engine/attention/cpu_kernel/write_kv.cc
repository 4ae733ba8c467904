// Writes a step's keys and values into a 16-bit paged cache, in place, as an XLA FFI custom call whose cache
// operands are aliased to its results.
//
// Why a kernel: XLA:CPU has no bfloat16 or float16 scatter. It widens such a cache to float32 whole,
// scatters, and narrows it back: two cache-sized copies per layer per step (with a 6 GB cache, most of the
// step's time). A float32 cache is written in place by XLA's own scatter (jax_engine/attention/xla.py).
// Rounding is to nearest even, as XLA's convert rounds, so both paths store the same bits.
//
// Shapes:
//   k, v              [T, K, D]     float32: the step's new keys and values
//   k_cache, v_cache  [L, S, K, D]  bfloat16 or float16, aliased to the two results
//   layer             []  int32     the layer to write
//   slot_mapping      [T] int32     each token's slot; one out of [0, S) is padding, skipped

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline uint16_t bfloat16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7fc0u);  // NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // to nearest, ties to even
}

inline uint16_t float16_bits(float x) {
  const _Float16 half = static_cast<_Float16>(x);  // the compiler's conversion: to nearest, ties to even
  uint16_t bits;
  std::memcpy(&bits, &half, sizeof bits);
  return bits;
}

template <uint16_t (*Bits)(float)>
void write_rows(const float* rows, uint16_t* cache_layer, const int32_t* slots, int64_t num_tokens,
                int64_t num_slots, int64_t row_size) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0 || slots[t] >= num_slots) continue;  // padding
    uint16_t* out = cache_layer + slots[t] * row_size;
    const float* in = rows + t * row_size;
    for (int64_t i = 0; i < row_size; ++i) out[i] = Bits(in[i]);
  }
}

ffi::Error WriteKVImpl(ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::AnyBuffer k_cache,
                       ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto dims = k_cache.dimensions();
  const ffi::DataType dtype = k_cache.element_type();
  if (dims.size() != 4 || v_cache.element_type() != dtype ||
      (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16)) {
    return ffi::Error::InvalidArgument("write_kv: caches must both be [L, S, K, D], bfloat16 or float16");
  }
  const int64_t num_layers = dims[0], num_slots = dims[1], row_size = dims[2] * dims[3];
  const int64_t num_tokens = slot_mapping.element_count();
  if (k.element_count() != static_cast<size_t>(num_tokens * row_size) || v.element_count() != k.element_count()) {
    return ffi::Error::InvalidArgument("write_kv: inconsistent shapes");
  }
  const int64_t layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= num_layers) {
    return ffi::Error::InvalidArgument("write_kv: layer " + std::to_string(layer_index) + " out of range");
  }
  const size_t cache_bytes = k_cache.size_bytes();
  // XLA hands the aliased results the operands' buffers; should it ever copy instead, start from the cache.
  for (auto [out, cache] : {std::pair{k_out->untyped_data(), k_cache.untyped_data()},
                             std::pair{v_out->untyped_data(), v_cache.untyped_data()}}) {
    if (out != cache) std::memcpy(out, cache, cache_bytes);
  }
  const int64_t layer_offset = layer_index * num_slots * row_size;
  uint16_t* k_layer = static_cast<uint16_t*>(k_out->untyped_data()) + layer_offset;
  uint16_t* v_layer = static_cast<uint16_t*>(v_out->untyped_data()) + layer_offset;
  const int32_t* slots = slot_mapping.typed_data();
  if (dtype == ffi::DataType::BF16) {
    write_rows<bfloat16_bits>(k.typed_data(), k_layer, slots, num_tokens, num_slots, row_size);
    write_rows<bfloat16_bits>(v.typed_data(), v_layer, slots, num_tokens, num_slots, row_size);
  } else {
    write_rows<float16_bits>(k.typed_data(), k_layer, slots, num_tokens, num_slots, row_size);
    write_rows<float16_bits>(v.typed_data(), v_layer, slots, num_tokens, num_slots, row_size);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteKV, WriteKVImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Ret<ffi::AnyBuffer>()         // k_cache, written
                                  .Ret<ffi::AnyBuffer>());       // v_cache, written
