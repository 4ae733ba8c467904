// Paged decode attention for CPU, as an XLA FFI custom call.
//
// Why a kernel: in plain XLA a decode step first gathers every sequence's context blocks into a dense copy
// and then attends over the copy, so each key and value crosses memory three times (read, write, read) and
// padding columns cost as much as real ones. Here each sequence reads its keys and values straight from
// the paged cache through its block table, once, and only up to its own length.
//
// One work item is one sequence (all its KV heads: a cache slot holds them side by side, so reads are
// contiguous). Items are shared out over XLA's own intra-op thread pool.
//
// Shapes (float32 queries and output; float32 or bfloat16 cache):
//   q          [B, N, D]        one query per sequence, N = K * G heads
//   k_cache    [L, S, K, D]     every layer's keys, S = num_blocks * block_size slots
//   v_cache    [L, S, K, D]
//   layer      []   int32       the layer to read
//   tables     [B, C] int32     block ids; only the first ceil(seq_len / block_size) are read
//   seq_lens   [B]  int32       context length; 0 = padding row (output zeros)
//   out        [B, N, D]

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {  // bfloat16 is the high half of a float32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

struct Problem {
  const float* q;
  const void* k_layer;  // this layer's first slot
  const void* v_layer;
  const int32_t* tables;
  const int32_t* seq_lens;
  float* out;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, max_blocks, block_size;
  float scale;
};

// Call visit(t, slot) for the tokens t < n of a sequence, in order, walking its block table block by block.
template <typename Visit>
inline void for_each_slot(const int32_t* table, int64_t n, int64_t block_size, Visit&& visit) {
  for (int64_t first = 0; first < n; first += block_size) {
    const int64_t first_slot = static_cast<int64_t>(table[first / block_size]) * block_size;
    const int64_t end = std::min(n, first + block_size);
    for (int64_t t = first; t < end; ++t) visit(t, first_slot + t - first);
  }
}

// Attend one sequence's queries (all heads) over its context. `scores` is scratch reused between items.
template <typename T>
void attend_sequence(const Problem& p, int64_t seq, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t N = p.num_heads, K = p.num_kv_heads, D = p.head_dim, G = N / K;
  const int64_t n = p.seq_lens[seq];
  float* out = p.out + seq * N * D;
  if (n <= 0) {
    std::fill(out, out + N * D, 0.0f);
    return;
  }
  const float* q = p.q + seq * N * D;
  const int32_t* table = p.tables + seq * p.max_blocks;
  const T* keys = static_cast<const T*>(p.k_layer);
  const T* values = static_cast<const T*>(p.v_layer);
  const int64_t slot_stride = K * D;
  scores.resize(N * n);  // [N, n]

  // Pass 1: scores[h, t] = scale * q[h] . k[t, h / G]
  for_each_slot(table, n, p.block_size, [&](int64_t t, int64_t slot) {
    const T* k_row = keys + slot * slot_stride;
    for (int64_t h = 0; h < N; ++h) {
      const T* k = k_row + (h / G) * D;
      const float* qh = q + h * D;
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * to_float(k[d]);
      scores[h * n + t] = dot * p.scale;
    }
  });
  // Softmax over each head's row, in place.
  for (int64_t h = 0; h < N; ++h) {
    float* row = scores.data() + h * n;
    const float peak = *std::max_element(row, row + n);
    for (int64_t t = 0; t < n; ++t) row[t] = std::exp(row[t] - peak);  // a loop of its own: vectorized
    float total = 0.0f;
    for (int64_t t = 0; t < n; ++t) total += row[t];
    const float inverse = 1.0f / total;
    for (int64_t t = 0; t < n; ++t) row[t] *= inverse;
  }
  // Pass 2: out[h] = sum_t probs[h, t] * v[t, h / G]
  acc.assign(N * D, 0.0f);
  for_each_slot(table, n, p.block_size, [&](int64_t t, int64_t slot) {
    const T* v_row = values + slot * slot_stride;
    for (int64_t h = 0; h < N; ++h) {
      const T* v = v_row + (h / G) * D;
      const float weight = scores[h * n + t];
      float* a = acc.data() + h * D;
      for (int64_t d = 0; d < D; ++d) a[d] += weight * to_float(v[d]);
    }
  });
  std::copy(acc.begin(), acc.end(), out);
}

// Work shared by the calling thread and pool threads. Held by shared_ptr: a pool task that starts after
// the call has returned finds no item left and touches nothing else.
struct WorkQueue {
  Problem problem;
  bool bfloat16;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run() {
    std::vector<float> scores, acc;
    for (int64_t seq; (seq = next.fetch_add(1)) < problem.num_seqs;) {
      if (bfloat16) {
        attend_sequence<uint16_t>(problem, seq, scores, acc);
      } else {
        attend_sequence<float>(problem, seq, scores, acc);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                           ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> tables,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::ResultBuffer<ffi::F32> out, int64_t block_size,
                           float scale) {
  const auto q_dims = q.dimensions();
  const auto cache_dims = k_cache.dimensions();
  const auto table_dims = tables.dimensions();
  if (q_dims.size() != 3 || cache_dims.size() != 4 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode: expected q [B, N, D], caches [L, S, K, D], tables [B, C]");
  }
  const ffi::DataType dtype = k_cache.element_type();
  if (v_cache.element_type() != dtype || (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("paged_decode: caches must both be float32 or both bfloat16");
  }
  const int64_t num_layers = cache_dims[0], num_slots = cache_dims[1], num_kv_heads = cache_dims[2];
  const int64_t head_dim = cache_dims[3];
  const int64_t num_seqs = q_dims[0], num_heads = q_dims[1], max_blocks = table_dims[1];
  if (q_dims[2] != head_dim || num_heads % num_kv_heads != 0 || table_dims[0] != num_seqs ||
      seq_lens.element_count() != static_cast<size_t>(num_seqs) || block_size <= 0 || num_slots % block_size) {
    return ffi::Error::InvalidArgument("paged_decode: inconsistent shapes");
  }
  const int64_t layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= num_layers) {
    return ffi::Error::InvalidArgument("paged_decode: layer " + std::to_string(layer_index) + " out of range");
  }
  // Checked up front, so the kernel itself never reads outside the cache.
  const int32_t* lens = seq_lens.typed_data();
  const int32_t* table_data = tables.typed_data();
  const int64_t num_blocks = num_slots / block_size;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t used = (static_cast<int64_t>(lens[b]) + block_size - 1) / block_size;
    if (lens[b] < 0 || used > max_blocks) {
      return ffi::Error::InvalidArgument("paged_decode: seq_len " + std::to_string(lens[b]) + " beyond its table");
    }
    for (int64_t c = 0; c < used; ++c) {
      const int32_t block = table_data[b * max_blocks + c];
      if (block < 0 || block >= num_blocks) {
        return ffi::Error::InvalidArgument("paged_decode: block id " + std::to_string(block) + " out of range");
      }
    }
  }

  const size_t item = dtype == ffi::DataType::BF16 ? 2 : 4;
  const int64_t layer_offset = layer_index * num_slots * num_kv_heads * head_dim;
  auto work = std::make_shared<WorkQueue>();
  work->problem = Problem{q.typed_data(),
                          static_cast<const char*>(k_cache.untyped_data()) + layer_offset * item,
                          static_cast<const char*>(v_cache.untyped_data()) + layer_offset * item,
                          table_data,
                          lens,
                          out->typed_data(),
                          num_seqs, num_heads, num_kv_heads, head_dim, max_blocks, block_size, scale};
  work->bfloat16 = dtype == ffi::DataType::BF16;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_seqs) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  // Items taken by helpers are being worked on right now; wait for those only (never for a task that has
  // not started, so a busy pool cannot deadlock this call).
  while (work->done.load(std::memory_order_acquire) < num_seqs) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("block_size")
                                  .Attr<float>("scale"));
