// Each row's top-k / top-p threshold: the smallest logit a row keeps, as an XLA FFI custom call.
//
// Why a kernel: the definition walks a row in descending order, and XLA:CPU sorts with a comparator call per
// comparison: sorting 256 rows of a 49152-token vocabulary took 2.2 s, ten times the model's step at that
// batch. Here a row takes a few passes and no sort of the row: a histogram of the logits by their distance
// below the row's maximum (buckets of 1/kScale of a logit) names the one bucket that holds the k-th largest logit
// and the one where the kept mass reaches top_p; only that bucket's logits are sorted, and walked exactly.
// Rows are shared out over XLA's intra-op thread pool.
//
// What it computes is sampler.py's definition (and the reference sampler's): with k = top_k (the whole row when
// top_k is 0 or larger), the k-th largest logit kth keeps every logit >= kth; of those, in descending order, a
// logit is kept while the probability mass of the strictly larger ones is below top_p times their total mass
// (the largest always stays; top_p >= 1 keeps all). The threshold is the smallest kept logit. Masses are summed
// in double, so near a tie with top_p (within float32 rounding) it may part from the float32 path.
//
// Shapes: logits [R, V] float32, top_k [R] int32, top_p [R] float32 -> threshold [R] float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBuckets = 2048;
constexpr double kScale = 32.0;  // buckets per unit of logit: the last one holds everything 64 below the max

// The kernels compile with -ffast-math, under which the compiler may assume no NaN or infinity: such values
// are told apart by their bits, never by isnan/isinf or a comparison with a NaN.
inline uint32_t bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}
inline bool is_nan(float x) { return (bits_of(x) & 0x7fffffffu) > 0x7f800000u; }
inline bool is_infinite(float x) { return (bits_of(x) & 0x7fffffffu) == 0x7f800000u; }

inline int64_t bucket_of(float max, float x) {
  if (is_infinite(x)) return kBuckets - 1;  // -inf (max is finite)
  const double distance = (static_cast<double>(max) - x) * kScale;
  return distance < kBuckets - 1 ? static_cast<int64_t>(distance) : kBuckets - 1;
}

inline double weight_of(float max, float x) {  // exp(x - max): the unnormalised probability
  return is_infinite(x) ? 0.0 : std::exp(static_cast<double>(x) - max);
}

// The logits of `row` in bucket `bucket` that are >= floor, in descending order.
std::vector<float> bucket_values(const float* row, int64_t vocab, float max, int64_t bucket, float floor) {
  std::vector<float> values;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!is_nan(row[i]) && row[i] >= floor && bucket_of(max, row[i]) == bucket) values.push_back(row[i]);
  }
  std::sort(values.begin(), values.end(), std::greater<float>());
  return values;
}

// The k-th largest logit, from the counts of each bucket; -inf (keep all) when k reaches the row's non-NaN count.
float kth_largest(const float* row, int64_t vocab, float max, int64_t k) {
  std::vector<int64_t> counts(kBuckets, 0);
  int64_t present = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!is_nan(row[i])) {
      ++counts[bucket_of(max, row[i])];
      ++present;
    }
  }
  if (k >= present) return -std::numeric_limits<float>::infinity();
  int64_t bucket = 0, before = 0;
  while (before + counts[bucket] < k) before += counts[bucket++];
  const auto values = bucket_values(row, vocab, max, bucket, -std::numeric_limits<float>::infinity());
  return values[k - before - 1];
}

float row_threshold(const float* row, int64_t vocab, int32_t top_k, float top_p) {
  const float lowest = -std::numeric_limits<float>::infinity();
  float max = lowest;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!is_nan(row[i])) max = std::max(max, row[i]);  // NaNs never count
  }
  if (is_infinite(max)) return max;  // all masked out (-inf), or an infinite logit (+inf): it alone stays
  const float kth = top_k > 0 ? kth_largest(row, vocab, max, top_k) : lowest;  // top_p alone: no count pass
  if (top_p >= 1.0f) return kth;
  std::vector<double> mass(kBuckets, 0.0);
  std::vector<int64_t> kept(kBuckets, 0);  // logits >= kth in each bucket
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!is_nan(row[i]) && row[i] >= kth) {
      const int64_t bucket = bucket_of(max, row[i]);
      const double weight = weight_of(max, row[i]);
      mass[bucket] += weight;
      ++kept[bucket];
      total += weight;
    }
  }
  // Buckets go down from the maximum: the last one whose larger logits' mass is below the target holds the
  // threshold (the first, which holds the maximum, whatever the target).
  const double target = static_cast<double>(top_p) * total;
  int64_t bucket = 0;
  double before = 0.0, mass_above = 0.0;
  for (int64_t b = 0; b < kBuckets && before < target; ++b) {
    if (kept[b] > 0) {
      bucket = b;
      mass_above = before;
    }
    before += mass[b];
  }
  const auto values = bucket_values(row, vocab, max, bucket, kth);
  float threshold = max;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i == 0 || values[i] != values[i - 1]) {  // the first of equal logits decides for all of them
      if (mass_above >= target) break;
      threshold = values[i];
    }
    mass_above += weight_of(max, values[i]);
  }
  return threshold;
}

ffi::Error TopKTopPImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> top_k,
                        ffi::Buffer<ffi::F32> top_p, ffi::ResultBuffer<ffi::F32> threshold) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || dims[1] < 1 || top_k.element_count() != dims[0] || top_p.element_count() != dims[0]) {
    return ffi::Error::InvalidArgument("top_k_top_p: expected logits [R, V] with V >= 1, top_k [R], top_p [R]");
  }
  const int64_t vocab = dims[1];
  const float* x = logits.typed_data();
  const int32_t* k = top_k.typed_data();
  const float* p = top_p.typed_data();
  float* out = threshold->typed_data();
  jax_engine::parallel_for(pool, dims[0], [&](int64_t r) { out[r] = row_threshold(x + r * vocab, vocab, k[r], p[r]); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopKTopP, TopKTopPImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()    // top_k
                                  .Arg<ffi::Buffer<ffi::F32>>()    // top_p
                                  .Ret<ffi::Buffer<ffi::F32>>());  // threshold
