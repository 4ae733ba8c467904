// Each row's LoRA update, as an XLA FFI custom call: Punica's BGMV (gathered shrink, then expand) on a CPU.
//
// Why a kernel: in XLA, a row can only take its own adapter by a mask over every slot (S times the work) or by
// a gather that copies each row's A and B. Here each row reads its own slot's A and B in place, from the whole
// stacks, and nothing is copied: a step of 32 rows over 4 adapters does a quarter of the masked work.
//
//   shrink   xa[t, p, k] = A[layer, s_t, p, k, :] . x[t]          for every piece p and rank k
//   expand   y[t, o]     = sum over k of xa[t, p(o), k] B[layer, s_t, k, o]    o in piece p(o)'s rows
//
// A row without an adapter (s_t = -1) gets zeros. The shrink walks slots, then each (piece, rank) row of A,
// then the rows of x in that slot: each A row streams once for all its rows. The expand adds r rows of the
// slot's B, each scaled by one of the row's r numbers, a range of output features at a time: contiguous
// multiply-adds that vectorize, with the range's B (r x 256 floats) in L1 for every row of the slot. Work is
// shared over XLA's intra-op thread pool, the shrink by four (piece, rank) rows of a slot and the expand by
// the ranges.
//
// Shapes (float32):
//   x      [T, in]
//   a      [L, S, P, r, in]   every layer's slots, stacked (jax_engine/lora/layout.py)
//   b      [L, S, r, out]     the adapter's scaling folded in
//   slots  [T] int32          each row's slot, -1 for none
//   layer  [] int32
//   starts [P + 1] int32      the first output feature of each piece, then out
//   y      [T, out]

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jax_engine::parallel_for;

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];  // vectorized under -O3 -ffast-math
  return sum;
}

ffi::Error LoRABgmvImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a,
                        ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> layer_index,
                        ffi::Buffer<ffi::S32> starts, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  if (xd.size() != 2 || ad.size() != 5 || bd.size() != 4 || ad[4] != xd[1] || bd[0] != ad[0] ||
      bd[1] != ad[1] || bd[2] != ad[3] || slots.element_count() != static_cast<size_t>(xd[0]) ||
      starts.element_count() != static_cast<size_t>(ad[2] + 1)) {
    return ffi::Error::InvalidArgument("lora_bgmv: expected x [T, in], a [L, S, P, r, in], b [L, S, r, out], "
                                       "slots [T], starts [P + 1]");
  }
  const int64_t T = xd[0], in = xd[1], L = ad[0], S = ad[1], P = ad[2], r = ad[3], out = bd[3];
  const int64_t layer = layer_index.typed_data()[0];
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("lora_bgmv: layer out of range");
  const int32_t* slot = slots.typed_data();
  const int32_t* start = starts.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < -1 || slot[t] >= S) return ffi::Error::InvalidArgument("lora_bgmv: slot out of range");
  }
  const float* xs = x.typed_data();
  const float* as = a.typed_data() + layer * S * P * r * in;
  const float* bs = b.typed_data() + layer * S * r * out;
  float* ys = y->typed_data();

  std::vector<std::vector<int64_t>> rows_of(S);  // the rows of each slot
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] >= 0) rows_of[slot[t]].push_back(t);
  }
  std::vector<float> xa(T * P * r, 0.0f);
  const int64_t ranks_per_item = 4, items_per_piece = (r + ranks_per_item - 1) / ranks_per_item;
  parallel_for(pool, S * P * items_per_piece, [&](int64_t item) {  // item: 4 (piece, rank) rows of A of a slot
    const int64_t s = item / (P * items_per_piece), p = item / items_per_piece % P;
    const int64_t first = item % items_per_piece * ranks_per_item, last = std::min(r, first + ranks_per_item);
    for (int64_t k = first; k < last && !rows_of[s].empty(); ++k) {  // each A row streams once for all rows
      const float* row = as + ((s * P + p) * r + k) * in;
      for (int64_t t : rows_of[s]) xa[(t * P + p) * r + k] = dot(row, xs + t * in, in);
    }
  });
  struct Chunk {
    int64_t piece, begin, end;
  };
  std::vector<Chunk> chunks;  // output features in ranges of up to 256, none across a piece's end
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t o = start[p]; o < start[p + 1]; o += 256) {
      chunks.push_back({p, o, std::min<int64_t>(o + 256, start[p + 1])});
    }
  }
  parallel_for(pool, chunks.size(), [&](int64_t item) {
    const Chunk c = chunks[item];
    for (int64_t t = 0; t < T; ++t) {
      float* yt = ys + t * out;
      std::fill(yt + c.begin, yt + c.end, 0.0f);
      if (slot[t] < 0) continue;
      for (int64_t k = 0; k < r; ++k) {  // y[t] += xa[t, p, k] x B[s, k]: a vectorized sweep over features
        const float scale = xa[(t * P + c.piece) * r + k];
        const float* b_row = bs + (slot[t] * r + k) * out;
        for (int64_t o = c.begin; o < c.end; ++o) yt[o] += scale * b_row[o];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoRABgmv, LoRABgmvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // starts
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
