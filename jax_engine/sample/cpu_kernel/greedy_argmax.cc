// Each row's greedy token: the index of its largest logit, as an XLA FFI custom call.
//
// Why a kernel: XLA:CPU runs both of its ways to this, argmax (a reduce over (value, index) pairs) and
// top_k(1), as a scalar loop on one thread, ~0.5 ns a logit: 17-39 ms a step for 32 rows of Gemma 3's 262144-token
// vocabulary on 2 cores, 5% or more of a batch-32 decode step (2.5 ms here). Here a row is one pass of
// vectorized integer maxima over blocks of 64 logits, then a scan of the one block that holds the first
// maximum; rows are shared out over XLA's intra-op thread pool.
//
// The order is top_k's, which the engine used before: IEEE total order (what jax.lax.top_k sorts by), so a
// NaN with the sign bit clear is above +inf and one with it set below -inf, and +0 above -0; of equal logits
// the first wins. Each float's bits become an int32 key in that order (negative floats flip their magnitude
// bits), so the comparisons are exact integer ones.
//
// Shapes: logits [R, V] float32 -> tokens [R] int32.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 64;

inline int32_t order_key(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits ^ ((bits >> 31) & 0x7fffffff);  // negative: larger magnitude, smaller key
}

// The largest key of logits[begin, end), in a loop the compiler vectorizes.
inline int32_t max_key(const float* logits, int64_t begin, int64_t end) {
  int32_t best = std::numeric_limits<int32_t>::min();
  for (int64_t i = begin; i < end; ++i) best = std::max(best, order_key(logits[i]));
  return best;
}

int32_t row_argmax(const float* logits, int64_t vocab) {
  int32_t best = std::numeric_limits<int32_t>::min();
  int64_t best_block = 0;
  for (int64_t begin = 0; begin < vocab; begin += kBlock) {
    const int32_t block_best = max_key(logits, begin, std::min(vocab, begin + kBlock));
    if (block_best > best) {  // strictly: an equal maximum in a later block is not the first
      best = block_best;
      best_block = begin;
    }
  }
  int64_t i = best_block;
  while (order_key(logits[i]) != best) ++i;
  return static_cast<int32_t>(i);
}

ffi::Error GreedyArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> tokens) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || dims[1] < 1) {
    return ffi::Error::InvalidArgument("greedy_argmax: expected logits [R, V] with V >= 1");
  }
  const int64_t rows = dims[0], vocab = dims[1];
  const float* x = logits.typed_data();
  int32_t* out = tokens->typed_data();
  jax_engine::parallel_for(pool, rows, [&](int64_t r) { out[r] = row_argmax(x + r * vocab, vocab); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GreedyArgmax, GreedyArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // logits
                                  .Ret<ffi::Buffer<ffi::S32>>());  // tokens
