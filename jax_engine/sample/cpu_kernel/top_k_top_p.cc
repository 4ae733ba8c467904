// Each row's top-k / top-p threshold: the smallest logit a row keeps, as an XLA FFI custom call.
//
// Why a kernel: the definition walks a row in descending order, and XLA:CPU sorts with a comparator call per
// comparison: sorting 256 rows of a 49152-token vocabulary took 2.2 s, ten times the model's step at that
// batch. Here a row takes a few passes that vectorize, and only the logits that can matter are copied:
// - top_k: one pass copies the logits above a bar that rises as it goes (the k-th largest of those copied so
//   far): about k ln(V / k) of a row of V in random order. The k-th largest of them is the row's.
// - top_p: one pass sums the row's mass (in double) and the mass within a few distances of the maximum; the
//   logits within the nearest distance that holds top_p's share are copied, and rounds of buckets by value
//   (each round keeps the one bucket where the mass reaches that share) narrow them to a few, which are sorted.
// - both: top_p walks the logits top_k keeps.
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

constexpr int64_t kLanes = 16;  // a vector of floats (AVX-512; two on AVX2)
constexpr int64_t kBlock = 4 * kLanes;  // logits tested at once before any is copied
constexpr int32_t kSplit = 256;  // buckets a round of top_p's selection splits its logits into
constexpr int kRounds = 4;       // rounds at most, then a sort of what is left
constexpr size_t kSorted = 64;   // narrowing stops at this many logits, which are sorted
constexpr float kLowest = -std::numeric_limits<float>::infinity();

// The kernels compile with -ffast-math, under which the compiler may assume no NaN or infinity: such values
// are told apart by their bits, never by isnan/isinf or a comparison with a NaN. A comparison that a NaN may
// pass only lets it reach a test of its bits.
inline uint32_t bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}
inline bool is_nan(float x) { return (bits_of(x) & 0x7fffffffu) > 0x7f800000u; }
inline bool is_infinite(float x) { return (bits_of(x) & 0x7fffffffu) == 0x7f800000u; }
inline bool is_finite(float x) { return (bits_of(x) & 0x7f800000u) != 0x7f800000u; }

inline double weight_of(float max, float x) {  // exp(x - max): the unnormalised probability
  return std::exp(static_cast<double>(x) - max);
}

inline float not_nan(float x) { return is_nan(x) ? kLowest : x; }

// The largest of n logits, n a multiple of kLanes (NaNs never count): kLanes maxima side by side, which the
// compiler makes one vector.
float lanes_max(const float* x, int64_t n) {
  float lanes[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) lanes[j] = kLowest;
  for (int64_t i = 0; i < n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], not_nan(x[i + j]));
  }
  return *std::max_element(lanes, lanes + kLanes);
}

float row_max(const float* row, int64_t vocab) {
  const int64_t whole = vocab - vocab % kLanes;
  float max = lanes_max(row, whole);
  for (int64_t i = whole; i < vocab; ++i) max = std::max(max, not_nan(row[i]));
  return max;
}

// Calls keep(x) for each finite logit x > bar, skipping blocks of kBlock logits whose maximum is below the bar;
// keep returns the bar for the logits after it.
template <typename Keep>
void for_each_above(const float* row, int64_t vocab, float bar, Keep keep) {
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t end = std::min(start + kBlock, vocab);
    if (end - start == kBlock && lanes_max(row + start, kBlock) < bar) continue;
    for (int64_t i = start; i < end; ++i) {
      if (is_finite(row[i]) && row[i] > bar) bar = keep(row[i]);
    }
  }
}

// The k-th largest logit, and in `larger` every logit larger than it; -inf when fewer than k logits are finite
// (a -inf or none is then the k-th). Logits are copied while above the k-th largest of those copied so far:
// every logit left behind is at most the row's k-th largest, and every larger one is copied.
float kth_largest(const float* row, int64_t vocab, int64_t k, std::vector<float>& larger) {
  std::vector<float> kept;
  const size_t limit = static_cast<size_t>(std::max<int64_t>(2 * k, k + 1024));
  float bar = kLowest;
  auto shrink = [&] {  // keep the k largest; the bar rises to the k-th
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), std::greater<float>());
    kept.resize(k);
    bar = kept[k - 1];
  };
  for_each_above(row, vocab, bar, [&](float x) {
    kept.push_back(x);
    if (kept.size() >= limit) shrink();
    return bar;
  });
  if (kept.size() < static_cast<size_t>(k)) return kLowest;
  shrink();
  for (float x : kept) {
    if (x > bar) larger.push_back(x);
  }
  return bar;
}

int64_t count_of(const float* row, int64_t vocab, float value) {  // value is finite
  int64_t count = 0;
  for (int64_t i = 0; i < vocab; ++i) count += row[i] == value && !is_nan(row[i]);
  return count;
}

// Narrows `values` to the bucket of kSplit, evenly spaced from their largest to their smallest, that holds the
// threshold: the last bucket whose larger logits' mass (`above`, updated) is still below the target. False when
// all values are equal.
bool narrow_to_one_bucket(std::vector<float>& values, float max, double target, double& above) {
  const auto [low, high] = std::minmax_element(values.begin(), values.end());
  if (*high == *low) return false;
  const double top = *high, scale = kSplit / (top - *low);
  const size_t n = values.size();
  std::vector<int32_t> bucket(n);
  std::vector<double> weight(n);
  for (size_t i = 0; i < n; ++i) {  // a loop of its own: vectorized
    bucket[i] = std::min<int32_t>(static_cast<int32_t>((top - values[i]) * scale), kSplit - 1);
    weight[i] = weight_of(max, values[i]);
  }
  std::vector<double> mass(kSplit, 0.0);
  std::vector<int64_t> count(kSplit, 0);
  for (size_t i = 0; i < n; ++i) {
    mass[bucket[i]] += weight[i];
    ++count[bucket[i]];
  }
  int32_t chosen = 0;
  double before = above;
  for (int32_t b = 0; b < kSplit && before < target; ++b) {
    if (count[b] > 0) {
      chosen = b;
      above = before;
    }
    before += mass[b];
  }
  size_t kept = 0;
  for (size_t i = 0; i < n; ++i) {
    if (bucket[i] == chosen) values[kept++] = values[i];
  }
  values.resize(kept);
  return true;
}

// The smallest of `values` kept by top_p's walk: v stays while the mass of the larger values is below `target`.
// `values` hold every logit that can be kept with all their equals, in any order; none larger is left out. A few
// rounds of buckets narrow them to the threshold's neighbours, which are sorted and walked.
float nucleus_threshold(std::vector<float>& values, float max, double target) {
  double above = 0.0;  // the mass of the logits larger than all of `values`
  for (int round = 0; round < kRounds && values.size() > kSorted; ++round) {
    if (!narrow_to_one_bucket(values, max, target, above)) break;
  }
  std::sort(values.begin(), values.end(), std::greater<float>());
  float threshold = values.front();  // its larger logits' mass is `above`, below the target
  for (size_t i = 0; i < values.size(); ++i) {
    if (i == 0 || values[i] != values[i - 1]) {  // the first of equal logits decides for all of them
      if (above >= target) break;
      threshold = values[i];
    }
    above += weight_of(max, values[i]);
  }
  return threshold;
}

// Distances below the maximum at which top_p's pass over the row also sums the mass above them.
constexpr int kGuides = 6;
constexpr float kGuideDistances[kGuides] = {1, 2, 4, 8, 16, 32};

// top_p without top_k: one pass sums the row's mass and the mass within each guide distance of the maximum;
// the nearest distance holding top_p's share bounds the logits worth copying (all those below are dropped).
float top_p_threshold(const float* row, int64_t vocab, float max, float top_p) {
  double total = 0.0, guides[kGuides] = {};
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = row[i];
    const double weight = is_finite(x) ? weight_of(max, x) : 0.0;
    total += weight;
    for (int t = 0; t < kGuides; ++t) guides[t] += x >= max - kGuideDistances[t] ? weight : 0.0;
  }
  const double target = static_cast<double>(top_p) * total;
  int nearest = 0;
  while (nearest < kGuides && guides[nearest] < target) ++nearest;
  const float bar = nearest < kGuides ? max - kGuideDistances[nearest] : kLowest;
  std::vector<float> values(vocab);
  size_t copied = 0;
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t end = std::min(start + kBlock, vocab);
    if (end - start == kBlock && lanes_max(row + start, kBlock) < bar) continue;
    for (int64_t i = start; i < end; ++i) {  // without a branch: about half may be copied, at random
      values[copied] = row[i];
      copied += is_finite(row[i]) && row[i] >= bar;
    }
  }
  values.resize(copied);
  return nucleus_threshold(values, max, target);
}

float row_threshold(const float* row, int64_t vocab, int32_t top_k, float top_p) {
  const float max = row_max(row, vocab);
  if (is_infinite(max)) return max;  // all masked out (-inf), or an infinite logit (+inf): it alone stays
  std::vector<float> larger;
  const float kth = top_k > 0 && top_k < vocab ? kth_largest(row, vocab, top_k, larger) : kLowest;
  if (top_p >= 1.0f) return kth;
  if (is_infinite(kth)) return top_p_threshold(row, vocab, max, top_p);
  // The kept logits are those larger than kth, and kth with its equals.
  double total = static_cast<double>(count_of(row, vocab, kth)) * weight_of(max, kth);
  for (float x : larger) total += weight_of(max, x);
  larger.push_back(kth);  // once: its equals add to the total alone, never to the mass above a kept logit
  return nucleus_threshold(larger, max, static_cast<double>(top_p) * total);
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
