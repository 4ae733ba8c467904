// Copies a step's keys and values, already in the cache's 16- or 8-bit dtype, into the paged cache in place, as an
// XLA FFI custom call whose cache operands are aliased to its results.
//
// Why a kernel: XLA:CPU has no bfloat16, float16 or 8-bit float scatter. It widens such a cache to float32 whole,
// scatters, and narrows it back: two cache-sized copies per layer per step (with a 6 GB cache, most of the
// step's time). The rounding to the cache's dtype stays XLA's convert, on the step's few rows
// (jax_engine/attention/cpu.py); a float32 cache is written in place by XLA's own scatter.
//
// Shapes:
//   k, v              [T, K, D]     the step's new keys and values, in the caches' dtype
//   k_cache, v_cache  [L, S, K, D]  bfloat16, float16, float8_e4m3fn or float8_e5m2, aliased to the results
//   layer             []  int32     the layer to write
//   slot_mapping      [T] int32     each token's slot; one out of [0, S) is padding, skipped

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// rows [T, row] -> layer's slots[t]; `out` is the cache the result aliases (or, should XLA ever hand a fresh
// buffer, a copy of it made first).
void write_rows(const ffi::AnyBuffer& rows, const ffi::AnyBuffer& cache, ffi::Result<ffi::AnyBuffer>& out,
                const int32_t* slots, int64_t num_tokens, int64_t layer_offset, int64_t num_slots,
                int64_t row_bytes) {
  if (out->untyped_data() != cache.untyped_data()) {
    std::memcpy(out->untyped_data(), cache.untyped_data(), cache.size_bytes());
  }
  char* layer = static_cast<char*>(out->untyped_data()) + layer_offset;
  const char* in = static_cast<const char*>(rows.untyped_data());
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0 || slots[t] >= num_slots) continue;  // padding
    std::memcpy(layer + slots[t] * row_bytes, in + t * row_bytes, row_bytes);
  }
}

ffi::Error WriteKVImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto dims = k_cache.dimensions();
  const ffi::DataType dtype = k_cache.element_type();
  const bool narrow = dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16 ||
                      dtype == ffi::DataType::F8E4M3FN || dtype == ffi::DataType::F8E5M2;
  if (dims.size() != 4 || !narrow || v_cache.element_type() != dtype || k.element_type() != dtype ||
      v.element_type() != dtype) {
    return ffi::Error::InvalidArgument(
        "write_kv: keys, values and caches must all be bfloat16, float16, float8_e4m3fn or float8_e5m2");
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
  const int64_t item = k_cache.size_bytes() / std::max<size_t>(1, k_cache.element_count());  // bytes each
  const int64_t layer_offset = layer_index * num_slots * row_size * item;
  const int32_t* slots = slot_mapping.typed_data();
  write_rows(k, k_cache, k_out, slots, num_tokens, layer_offset, num_slots, row_size * item);
  write_rows(v, v_cache, v_out, slots, num_tokens, layer_offset, num_slots, row_size * item);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteKV, WriteKVImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Ret<ffi::AnyBuffer>()         // k_cache, written
                                  .Ret<ffi::AnyBuffer>());       // v_cache, written
