// topk CPU kernel: threshold selection on integer magnitude keys.
//
// The tensor is cut into fixed chunks (independent of the thread count, so
// results never depend on it). Every full pass works chunk-parallel and
// leaves per-chunk counts; a serial prefix over those counts gives each
// chunk its output offset, so indices come out in ascending order without
// a sort. Passes over n elements:
//   approx: sample (s << n reads), fold + count (read g, r; write r) that
//           also collects the hits, then sparse writes = ~12 bytes/element;
//   exact:  fold, three radix-histogram passes (11/10/10 bits of the key),
//           count, compact.
#include <algorithm>
#include <functional>
#include <vector>

#include "pycomm/compress_math.h"
#include "pycomm/cpu.h"
#include "load.h"

namespace pycomm {
namespace cpu {
namespace {

constexpr int64_t kChunk = int64_t(1) << 16;

// Buffers kept by the calling thread from one call to the next, emptied
// but not freed: a small tensor's selection then allocates nothing. In a
// process that frees many small blocks (Python, torch), glibc first
// consolidates its fast bins on every allocation of a kilobyte or more,
// which cost more than the selection itself on 1K elements.
struct Scratch {
  std::vector<uint32_t> keys, most, above;
  std::vector<std::vector<int32_t>> hits;
};
Scratch& buffers() {
  thread_local Scratch s;
  return s;
}
// Up to this many elements, the k-th largest key is found by a selection
// over a copy of the keys (kth_largest_key, rank_largest).
constexpr int64_t kSmallSelect = int64_t(1) << 14;

struct Counts {
  std::vector<int64_t> gt, eq;  // per chunk: keys > T and keys == T
  int64_t total_gt = 0, total_eq = 0;
};

template <typename Load>
void fold(Load g, const float* r, float* c, int64_t begin, int64_t end) {
  if (r) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) c[i] = g(i) + r[i];
  } else {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) c[i] = g(i);
  }
}

// c[i] = grad[i] (+ r[i]) over [begin, end), for the given dtype.
void fold_range(const void* grad, DType dtype, const float* r, float* c, int64_t begin,
                int64_t end) {
  with_loader(grad, dtype, [&](auto load) { fold(load, r, c, begin, end); });
}

// Elements are scanned in groups of kGroup: a vectorized pass over the group
// computes its counts and a bit mask of the keys that reach t; the (rare)
// hits are then visited through the mask, not by a scalar walk.
constexpr int kGroup = 16;

// Counts keys > t and == t in [begin, end); with `hits`, also appends, in
// order, the index of every element whose key is >= t.
void count_chunk(const float* c, int64_t begin, int64_t end, uint32_t t, int64_t* gt,
                 int64_t* eq, std::vector<int32_t>* hits) {
  int64_t ngt = 0, neq = 0;
  int64_t i = begin;
  for (; i + kGroup <= end; i += kGroup) {
    int64_t ggt = 0, geq = 0;
    uint32_t at_least = 0;  // bit j: element i + j has key >= t
#pragma omp simd reduction(+ : ggt, geq) reduction(| : at_least)
    for (int j = 0; j < kGroup; ++j) {
      const uint32_t key = topk_key(c[i + j]);
      ggt += key > t;
      geq += key == t;
      at_least |= (uint32_t)(key >= t) << j;
    }
    ngt += ggt;
    neq += geq;
    // Visit only the hits, lowest index first.
    for (; hits && at_least; at_least &= at_least - 1)
      hits->push_back((int32_t)(i + __builtin_ctz(at_least)));
  }
  for (; i < end; ++i) {
    const uint32_t key = topk_key(c[i]);
    ngt += key > t;
    neq += key == t;
    if (hits && key >= t) hits->push_back((int32_t)i);
  }
  *gt = ngt;
  *eq = neq;
}

// Counts keys > t and == t per chunk; with `grad`, folds grad into c first
// (chunk by chunk, so c is read from memory once). With `hits`, also
// collects per chunk the indices whose key is >= t, which is the whole
// selection in approximate mode: no second pass over c is needed.
Counts fold_and_count(const void* grad, DType dtype, const float* r, float* c, int64_t n,
                      uint32_t t, std::vector<std::vector<int32_t>>* hits,
                      const ParallelFor& pf) {
  const int64_t chunks = ceil_div(n, kChunk);
  Counts out;
  out.gt.assign(chunks, 0);
  out.eq.assign(chunks, 0);
  if (hits) {
    hits->resize(chunks);
    for (auto& h : *hits) h.clear();
  }
  pf(0, chunks, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      const int64_t b = ch * kChunk, e = std::min(n, b + kChunk);
      if (grad) fold_range(grad, dtype, r, c, b, e);
      count_chunk(c, b, e, t, &out.gt[ch], &out.eq[ch], hits ? &(*hits)[ch] : nullptr);
    }
  });
  for (int64_t ch = 0; ch < chunks; ++ch) {
    out.total_gt += out.gt[ch];
    out.total_eq += out.eq[ch];
  }
  return out;
}

// Approximate mode's output: the collected hits, chunk after chunk, are the
// selection in index order. Zeroes them in c.
int64_t compact_hits(float* c, const std::vector<std::vector<int32_t>>& hits, int32_t* indices,
                     float* values, const ParallelFor& pf) {
  const int64_t chunks = (int64_t)hits.size();
  std::vector<int64_t> offset(chunks + 1, 0);
  for (int64_t ch = 0; ch < chunks; ++ch) offset[ch + 1] = offset[ch] + (int64_t)hits[ch].size();
  pf(0, chunks, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      int64_t o = offset[ch];
      for (const int32_t i : hits[ch]) {
        indices[o] = i;
        values[o] = c[i];
        c[i] = 0.0f;
        ++o;
      }
    }
  });
  return offset[chunks];
}

// Exact mode's output: every entry with key > t and the first eq_budget
// entries with key == t, in index order, zeroed in c.
int64_t compact(float* c, int64_t n, uint32_t t, int64_t eq_budget, const Counts& counts,
                int32_t* indices, float* values, const ParallelFor& pf) {
  const int64_t chunks = ceil_div(n, kChunk);
  std::vector<int64_t> offset(chunks), eq_take(chunks);
  int64_t pos = 0, eq_left = eq_budget;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    eq_take[ch] = std::min(eq_left, counts.eq[ch]);
    eq_left -= eq_take[ch];
    offset[ch] = pos;
    pos += counts.gt[ch] + eq_take[ch];
  }
  pf(0, chunks, [&](int64_t cb, int64_t ce) {
    std::vector<int32_t> hits;
    for (int64_t ch = cb; ch < ce; ++ch) {
      if (counts.gt[ch] + eq_take[ch] == 0) continue;
      const int64_t b = ch * kChunk, e = std::min(n, b + kChunk);
      hits.clear();
      int64_t gt_unused, eq_unused;
      count_chunk(c, b, e, t, &gt_unused, &eq_unused, &hits);
      int64_t o = offset[ch], eq_room = eq_take[ch];
      for (const int32_t i : hits) {
        if (topk_key(c[i]) == t && eq_room-- <= 0) continue;  // tie past the budget
        indices[o] = i;
        values[o] = c[i];
        c[i] = 0.0f;
        ++o;
      }
    }
  });
  return pos;
}

// The rank-th largest (1-based, counting repeats) of `keys`, which it may
// reorder. For a rank well below the number of groups of kGroup keys, the
// rank-th largest of the groups' maxima, L, bounds it from below (the rank
// largest maxima are rank distinct keys >= L), so a selection over the keys
// >= L (about rank to a few times rank of them) finds it: two passes that
// vectorize, instead of a selection over every key.
uint32_t rank_largest(std::vector<uint32_t>& keys, int64_t rank) {
  const int64_t n = (int64_t)keys.size(), groups = n / kGroup;
  const uint32_t* k = keys.data();
  if (rank * 4 <= groups) {
    std::vector<uint32_t>& most = buffers().most;
    most.resize(groups);
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t m = 0;  // a constant trip count: unrolled and vectorized as a block
      for (int j = 0; j < kGroup; ++j) m = std::max(m, k[g * kGroup + j]);
      most[g] = m;
    }
    std::nth_element(most.begin(), most.begin() + (rank - 1), most.end(), std::greater<uint32_t>());
    const uint32_t low = most[rank - 1];
    std::vector<uint32_t>& above = buffers().above;
    above.clear();
    for (int64_t i = 0; i < n; ++i)
      if (k[i] >= low) above.push_back(k[i]);
    std::nth_element(above.begin(), above.begin() + (rank - 1), above.end(), std::greater<uint32_t>());
    return above[rank - 1];
  }
  std::nth_element(keys.begin(), keys.begin() + (rank - 1), keys.end(), std::greater<uint32_t>());
  return keys[rank - 1];
}

// Radix select: the k-th largest key of c. Keys use 31 bits (the sign is
// cleared), examined 11, 10, 10 bits at a time from the top.
uint32_t kth_largest_key(const float* c, int64_t n, int64_t k, const ParallelFor& pf) {
  // A small tensor: a selection over a copy of its keys costs less than
  // the three histograms of 1-2K bins each (the same key: the k-th largest).
  if (n <= kSmallSelect) {
    std::vector<uint32_t>& keys = buffers().keys;
    keys.resize(n);
    for (int64_t i = 0; i < n; ++i) keys[i] = topk_key(c[i]);
    return rank_largest(keys, k);
  }
  static const int kShift[3] = {20, 10, 0};
  static const int kBins[3] = {1 << 11, 1 << 10, 1 << 10};
  const int64_t chunks = ceil_div(n, kChunk);
  uint32_t prefix = 0;  // bits of the answer fixed so far
  int64_t need = k;     // rank still to find among keys matching prefix
  for (int level = 0; level < 3; ++level) {
    const int shift = kShift[level], bins = kBins[level];
    // Keys match when their bits above this level's digit equal prefix's.
    const int high = shift + (level == 0 ? 11 : 10);
    std::vector<uint32_t> hist((size_t)chunks * bins, 0);
    pf(0, chunks, [&](int64_t cb, int64_t ce) {
      for (int64_t ch = cb; ch < ce; ++ch) {
        uint32_t* h = hist.data() + (size_t)ch * bins;
        const int64_t b = ch * kChunk, e = std::min(n, b + kChunk);
        for (int64_t i = b; i < e; ++i) {
          const uint32_t key = topk_key(c[i]);
          if (high >= 31 || (key >> high) == (prefix >> high)) h[(key >> shift) & (bins - 1)]++;
        }
      }
    });
    std::vector<int64_t> total(bins, 0);
    for (int64_t ch = 0; ch < chunks; ++ch)
      for (int d = 0; d < bins; ++d) total[d] += hist[(size_t)ch * bins + d];
    int digit = bins - 1;
    for (; digit > 0; --digit) {
      if (total[digit] >= need) break;
      need -= total[digit];
    }
    prefix |= (uint32_t)digit << shift;
  }
  return prefix;
}

}  // namespace

int64_t topk_compress(const void* grad, DType dtype, const float* residual, float* c, int64_t n,
                      int64_t k, bool approx, int32_t* indices, float* values,
                      const ParallelFor& pf) {
  const bool has_residual = residual != nullptr;
  const void* unfolded = grad;  // non-null until grad has been folded into c
  if (approx) {
    const int64_t stride = topk_sample_stride(n, k);
    const int64_t s = topk_sample_count(n, stride);
    std::vector<uint32_t>& sample = buffers().keys;
    sample.resize(s);
    with_loader(grad, dtype, [&](auto load) {
      pf(0, ceil_div(s, kChunk), [&](int64_t cb, int64_t ce) {
        const int64_t end = std::min(s, ce * kChunk);
        uint32_t* out = sample.data();
        if (has_residual) {
#pragma omp simd
          for (int64_t j = cb * kChunk; j < end; ++j) {
            const int64_t p = j * stride + stride / 2;
            out[j] = topk_key(load(p) + residual[p]);
          }
        } else {
#pragma omp simd
          for (int64_t j = cb * kChunk; j < end; ++j) out[j] = topk_key(load(j * stride + stride / 2) + 0.0f);
        }
      });
    });
    int64_t rank = topk_sample_rank(n, k, s);
    for (int attempt = 0; attempt < 2; ++attempt) {
      const uint32_t t = rank_largest(sample, rank);
      std::vector<std::vector<int32_t>>& hits = buffers().hits;
      const Counts counts = fold_and_count(unfolded, dtype, residual, c, n, t, &hits, pf);
      unfolded = nullptr;
      const int64_t count = counts.total_gt + counts.total_eq;
      if (topk_accept(count, k)) return compact_hits(c, hits, indices, values, pf);
      if (attempt == 0) {
        const int64_t next = topk_retry_rank(rank, k, count, s);
        if (next == rank) break;
        rank = next;
      }
    }
  }
  if (unfolded) {
    const int64_t chunks = ceil_div(n, kChunk);
    pf(0, chunks, [&](int64_t cb, int64_t ce) {
      for (int64_t ch = cb; ch < ce; ++ch)
        fold_range(grad, dtype, residual, c, ch * kChunk, std::min(n, (ch + 1) * kChunk));
    });
  }
  const uint32_t t = kth_largest_key(c, n, k, pf);
  const Counts counts = fold_and_count(nullptr, dtype, nullptr, c, n, t, nullptr, pf);
  return compact(c, n, t, k - counts.total_gt, counts, indices, values, pf);
}

bool topk_decompress(const int32_t* indices, const float* values, int64_t count, float* out,
                     int64_t n, bool accumulate, const ParallelFor& pf) {
  // Every payload's indices are strictly ascending (the compressor writes
  // them so); anything else is forged or corrupt, and a duplicate would make
  // two threads below add to one element at once.
  for (int64_t j = 0; j < count; ++j)
    if (indices[j] < 0 || indices[j] >= n || (j > 0 && indices[j] <= indices[j - 1])) return false;
  if (!accumulate) {
    pf(0, ceil_div(n, kChunk), [&](int64_t cb, int64_t ce) {
      const int64_t b = cb * kChunk, e = std::min(n, ce * kChunk);
      std::fill(out + b, out + e, 0.0f);
    });
  }
  // Indices are unique, so parallel writes never collide. Split in chunks
  // of entries, as every loop here: a split per entry would wake a thread
  // team for a dozen writes (on a small machine the idle team's spinning
  // then slows every later call).
  pf(0, ceil_div(count, kChunk), [&](int64_t cb, int64_t ce) {
    const int64_t b = cb * kChunk, e = std::min(count, ce * kChunk);
    if (accumulate) {
      for (int64_t j = b; j < e; ++j) out[indices[j]] += values[j];
    } else {
      for (int64_t j = b; j < e; ++j) out[indices[j]] = values[j];
    }
  });
  return true;
}

}  // namespace cpu
}  // namespace pycomm
