// topk CUDA kernels: keep the k largest |c| of c = grad + residual, with fused
// error feedback. The selection rule (keys, sampling, retry, exact fallback)
// is compress_math.h; the oracle is select_reference in
// pycomm/compressors/topk.py, whose control flow topk_select mirrors step by
// step so that counts and indices match bit for bit.
//
// Building blocks, all on 31-bit integer keys (topk_key: |c| bits, NaN above Inf):
//  * radix select: the rank-th largest key in 3 histogram passes over digits
//    of 11/10/10 bits, each followed by a one-block kernel that picks the
//    digit. Its state stays on the device, so no pass waits for the host.
//  * tile counts: per 4096-element tile, how many keys are > T and == T.
//  * compaction: one exclusive scan over the tile counts, then each tile
//    scans its own flags. Output slots come from counts in index order, so the
//    indices are ascending and "the first budget entries equal to T" is exact.
#include "pycomm_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cub/block/block_load.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "pycomm/compress_math.h"

namespace pycomm {
namespace cuda {
namespace {

using u64 = unsigned long long;


constexpr int kThreads = 256;

// ------------------------------------------------------------ radix select ---
// Keys have bit 31 clear, so 31 bits remain: digits are bits 30..20 (11 bits),
// 19..10 and 9..0. Fewer, wider passes would need a histogram that no longer
// fits comfortably in shared memory.
constexpr int kRadixPasses = 3;
constexpr int kRadixMaxBins = 1 << 11;
__host__ __device__ constexpr int radix_shift(int pass) { return pass == 0 ? 20 : (pass == 1 ? 10 : 0); }
__host__ __device__ constexpr int radix_bits(int pass) { return pass == 0 ? 11 : 10; }

struct SelectState {
  uint32_t threshold;   // key bits fixed so far; after the last pass, the rank-th largest key
  uint32_t unused;
  long long n_above;    // keys strictly greater than every key still in the running
  long long rank_left;  // rank among the keys still in the running; finally, how many == threshold to take
};

constexpr int kHistUnroll = 4;  // independent loads in flight per thread

// Histogram of one digit over the keys whose higher digits equal the prefix
// found so far. Pass 0 of exact mode doubles as the pass that materializes c
// (src/residual -> c_out); later passes read c (T = float, no residual).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    radix_histogram_kernel(const T* src, const float* residual, float* c_out, int64_t n, const SelectState* state,
                           int pass, unsigned* hist) {
  __shared__ unsigned local[kRadixMaxBins];
  const int shift = radix_shift(pass);
  const int nbins = 1 << radix_bits(pass);
  const int high = shift + radix_bits(pass);  // <= 31, and keys are < 2^31: pass 0 matches every key
  const uint32_t prefix = pass == 0 ? 0u : state->threshold;
  for (int b = threadIdx.x; b < nbins; b += kThreads) local[b] = 0;
  __syncthreads();

  const int64_t step = (int64_t)gridDim.x * kThreads;
  for (int64_t i0 = (int64_t)blockIdx.x * kThreads + threadIdx.x; i0 < n; i0 += step * kHistUnroll) {
    float c[kHistUnroll];
#pragma unroll
    for (int u = 0; u < kHistUnroll; ++u) {
      const int64_t i = i0 + u * step;
      c[u] = i < n ? load_c(src, residual, i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kHistUnroll; ++u) {
      const int64_t i = i0 + u * step;
      if (i >= n) continue;
      if (c_out != nullptr) c_out[i] = c[u];
      const uint32_t key = topk_key(c[u]);
      if ((key >> high) == (prefix >> high)) atomicAdd(&local[(key >> shift) & (nbins - 1)], 1u);
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < nbins; b += kThreads) {
    if (local[b] != 0) atomicAdd(&hist[b], local[b]);
  }
}

// Picks the digit whose bin holds the rank_left-th largest remaining key:
// bins are scanned from the highest digit down, so an exclusive sum is the
// number of keys with a strictly larger digit. Exactly one bin satisfies
// above < rank_left <= above + count, because 1 <= rank_left <= keys remaining.
// Also clears the histogram for the next pass.
constexpr int kDigitThreads = kRadixMaxBins / 2;

__global__ void __launch_bounds__(kDigitThreads)
    radix_digit_kernel(unsigned* hist, SelectState* state, int pass, long long rank) {
  using BlockScan = cub::BlockScan<unsigned, kDigitThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int shift = radix_shift(pass);
  const int nbins = 1 << radix_bits(pass);
  uint32_t prefix = 0;
  long long n_above = 0;
  long long rank_left = rank;
  if (pass > 0) {
    prefix = state->threshold;
    n_above = state->n_above;
    rank_left = state->rank_left;
  }
  int bin[2];
  unsigned count[2];
  unsigned above[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    bin[q] = nbins - 1 - (2 * (int)threadIdx.x + q);
    count[q] = bin[q] >= 0 ? hist[bin[q]] : 0u;
    if (bin[q] >= 0) hist[bin[q]] = 0u;
  }
  BlockScan(scan_storage).ExclusiveSum(count, above);
  __syncthreads();  // every thread has read the state before the winner rewrites it
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    if (count[q] != 0 && (long long)above[q] < rank_left && rank_left <= (long long)above[q] + count[q]) {
      state->threshold = prefix | ((uint32_t)bin[q] << shift);
      state->n_above = n_above + above[q];
      state->rank_left = rank_left - above[q];
    }
  }
}

// -------------------------------------------------------------- sampling ---
template <typename T>
__global__ void __launch_bounds__(kThreads)
    gather_sample_kernel(const T* grad, const float* residual, int64_t stride, int64_t s, float* sample) {
  for (int64_t j = (int64_t)blockIdx.x * kThreads + threadIdx.x; j < s; j += (int64_t)gridDim.x * kThreads) {
    sample[j] = load_c(grad, residual, j * stride + stride / 2);
  }
}

// ---------------------------------------------------- counts, compaction ---
constexpr int kTileItems = 16;
constexpr int64_t kTile = (int64_t)kThreads * kTileItems;  // 4096 < 2^16: a 16-bit half holds a tile's count

// Flag of one key against the threshold, packed (above << 16 | equal) so one
// reduction or scan counts both.
__device__ __forceinline__ unsigned threshold_flag(uint32_t key, uint32_t threshold) {
  return key > threshold ? (1u << 16) : (key == threshold ? 1u : 0u);
}

// Per tile: keys > T (high 32 bits) and == T (low 32 bits). Summed over
// tiles neither half can carry into the other, as n < 2^31. tile_counts has
// num_tiles + 1 entries; the last is 0 so that the exclusive scan ends with
// the total. The first approximate count also materializes c here.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    tile_count_kernel(const T* src, const float* residual, float* c_out, int64_t n, const SelectState* state,
                      u64* tile_counts, int64_t num_tiles) {
  using BlockReduce = cub::BlockReduce<unsigned, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const uint32_t threshold = state->threshold;
  const int64_t base = (int64_t)blockIdx.x * kTile;
  float c[kTileItems];
#pragma unroll
  for (int j = 0; j < kTileItems; ++j) {
    const int64_t i = base + (int64_t)j * kThreads + threadIdx.x;
    c[j] = i < n ? load_c(src, residual, i) : 0.0f;
  }
  unsigned packed = 0;
#pragma unroll
  for (int j = 0; j < kTileItems; ++j) {
    const int64_t i = base + (int64_t)j * kThreads + threadIdx.x;
    if (i >= n) continue;
    if (c_out != nullptr) c_out[i] = c[j];
    packed += threshold_flag(topk_key(c[j]), threshold);
  }
  const unsigned total = BlockReduce(reduce_storage).Sum(packed);
  if (threadIdx.x == 0) {
    tile_counts[blockIdx.x] = ((u64)(total >> 16) << 32) | (u64)(total & 0xffffu);
    if (blockIdx.x == 0) tile_counts[num_tiles] = 0;
  }
}

// Writes the selected entries in index order: the keys > T, plus, among the
// keys == T, those whose rank in index order is < budget (all of them when
// !limit_equal). With A_i / E_i the numbers of keys > T / == T before i, a
// selected i goes to slot A_i + min(E_i, budget). Zeroes residual where sent.
// Blocked arrangement (thread t owns t*16 .. t*16+15 of the tile) so the
// block scan runs in index order; the warp-transposing load keeps global
// reads coalesced.
__global__ void __launch_bounds__(kThreads)
    compact_kernel(const float* c, int64_t n, const SelectState* state, bool limit_equal, const u64* tile_offsets,
                   int32_t* indices, float* values, int64_t capacity, float* residual) {
  using BlockLoad = cub::BlockLoad<float, kThreads, kTileItems, cub::BLOCK_LOAD_WARP_TRANSPOSE>;
  using BlockScan = cub::BlockScan<unsigned, kThreads>;
  __shared__ union {
    typename BlockLoad::TempStorage load;
    typename BlockScan::TempStorage scan;
  } storage;
  const uint32_t threshold = state->threshold;
  const long long budget = limit_equal ? state->rank_left : LLONG_MAX;
  const int64_t base = (int64_t)blockIdx.x * kTile;
  const int valid = (int)(n - base < kTile ? n - base : kTile);

  float v[kTileItems];
  BlockLoad(storage.load).Load(c + base, v, valid, 0.0f);
  __syncthreads();  // the scan reuses the load's shared memory

  unsigned flag[kTileItems];
#pragma unroll
  for (int j = 0; j < kTileItems; ++j) {
    const int local = (int)threadIdx.x * kTileItems + j;
    flag[j] = local < valid ? threshold_flag(topk_key(v[j]), threshold) : 0u;
  }
  unsigned before[kTileItems];
  BlockScan(storage.scan).ExclusiveSum(flag, before);

  const u64 tile_before = tile_offsets[blockIdx.x];
  const long long tile_above = (long long)(tile_before >> 32);
  const long long tile_equal = (long long)(tile_before & 0xffffffffull);
#pragma unroll
  for (int j = 0; j < kTileItems; ++j) {
    if (flag[j] == 0) continue;
    const long long above_before = tile_above + (before[j] >> 16);
    const long long equal_before = tile_equal + (before[j] & 0xffffu);
    const bool is_above = (flag[j] >> 16) != 0;
    if (!is_above && equal_before >= budget) continue;
    const long long slot = above_before + (equal_before < budget ? equal_before : budget);
    // Cannot fail when the host logic holds (count <= capacity); it keeps a
    // logic error from writing out of bounds. Only what is sent is zeroed.
    if (slot < 0 || slot >= capacity) continue;
    const int64_t i = base + (int64_t)threadIdx.x * kTileItems + j;
    indices[slot] = (int32_t)i;
    values[slot] = v[j];
    if (residual != nullptr) residual[i] = 0.0f;
  }
}

// Plain read-modify-write rather than atomicAdd: indices are unique, and this
// is bit-identical to index_add_ / assignment in the reference.
__global__ void __launch_bounds__(kThreads)
    topk_scatter_kernel(const int32_t* indices, const float* values, int64_t count, float* out, int64_t n,
                        bool accumulate) {
  for (int64_t j = (int64_t)blockIdx.x * kThreads + threadIdx.x; j < count; j += (int64_t)gridDim.x * kThreads) {
    const int64_t idx = indices[j];
    if (idx < 0 || idx >= n) continue;
    out[idx] = accumulate ? out[idx] + values[j] : values[j];
  }
}

// -------------------------------------------------------------- host side ---
constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Byte offsets into the workspace (after aligning its base). The same layout
// serves both modes, so topk_workspace_bytes need not know the mode.
struct Layout {
  int64_t stride = 0, s = 0, num_tiles = 0;
  size_t c = 0, sample = 0, hist = 0, state = 0, tile_counts = 0, tile_offsets = 0, scan_temp = 0;
  size_t scan_temp_bytes = 0, total = 0;
};

void check_sizes(int64_t n, int64_t k) {
  if (n < 1 || n > (int64_t)INT32_MAX) {
    throw std::invalid_argument("pycomm topk: n must be in [1, 2^31 - 1] (indices are int32), got " +
                                std::to_string(n));
  }
  if (k < 1 || k > n) {
    throw std::invalid_argument("pycomm topk: k must be in [1, n], got k=" + std::to_string(k) +
                                ", n=" + std::to_string(n));
  }
}

Layout make_layout(int64_t n, int64_t k, bool has_residual) {
  check_sizes(n, k);
  Layout L;
  L.stride = topk_sample_stride(n, k);
  L.s = topk_sample_count(n, L.stride);
  L.num_tiles = ceil_div(n, kTile);
  size_t off = 0;
  auto take = [&off](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes);
    return at;
  };
  L.c = take(has_residual ? 0 : (size_t)n * sizeof(float));
  L.sample = take((size_t)L.s * sizeof(float));
  L.hist = take(kRadixMaxBins * sizeof(unsigned));
  L.state = take(sizeof(SelectState));
  L.tile_counts = take((size_t)(L.num_tiles + 1) * sizeof(u64));
  L.tile_offsets = take((size_t)(L.num_tiles + 1) * sizeof(u64));
  // A size query only: CUB launches nothing when given no storage.
  check(cub::DeviceScan::ExclusiveSum(nullptr, L.scan_temp_bytes, static_cast<const u64*>(nullptr),
                                      static_cast<u64*>(nullptr), (int)(L.num_tiles + 1)),
        "cub::DeviceScan::ExclusiveSum (size query)");
  L.scan_temp = take(L.scan_temp_bytes);
  L.total = off + kAlign;  // slack to align an arbitrarily aligned workspace pointer
  return L;
}

// Everything one topk_compress call works with.
struct Ctx {
  Layout L;
  cudaStream_t stream = nullptr;
  int grid_cap = 0;  // enough resident blocks to fill the GPU for grid-stride kernels
  float* c_scratch = nullptr;
  float* sample = nullptr;
  unsigned* hist = nullptr;
  SelectState* state = nullptr;
  u64* tile_counts = nullptr;
  u64* tile_offsets = nullptr;
  void* scan_temp = nullptr;
};

int stride_grid(const Ctx& x, int64_t n) {
  const int64_t blocks = ceil_div(n, (int64_t)kThreads * kHistUnroll);
  return (int)(blocks < x.grid_cap ? blocks : x.grid_cap);
}

// rank-th largest key (1 <= rank <= len) into state->threshold, with
// state->n_above = keys above it and state->rank_left = rank - n_above.
// Pass 0 reads first_src (+ residual) and, if c_out, writes c there; passes
// 1-2 read c (which pass 0 wrote, or which is first_src itself).
template <typename T>
void radix_select(const Ctx& x, const T* first_src, const float* residual, float* c_out, const float* c, int64_t len,
                  int64_t rank) {
  check(cudaMemsetAsync(x.hist, 0, kRadixMaxBins * sizeof(unsigned), x.stream), "cudaMemsetAsync(histogram)");
  for (int pass = 0; pass < kRadixPasses; ++pass) {
    if (pass == 0) {
      radix_histogram_kernel<T><<<stride_grid(x, len), kThreads, 0, x.stream>>>(first_src, residual, c_out, len,
                                                                                 x.state, pass, x.hist);
    } else {
      radix_histogram_kernel<float><<<stride_grid(x, len), kThreads, 0, x.stream>>>(c, nullptr, nullptr, len,
                                                                                     x.state, pass, x.hist);
    }
    check(cudaGetLastError(), "radix_histogram_kernel launch");
    radix_digit_kernel<<<1, kDigitThreads, 0, x.stream>>>(x.hist, x.state, pass, (long long)rank);
    check(cudaGetLastError(), "radix_digit_kernel launch");
  }
}

// Tile counts against state->threshold and their exclusive scan. With
// read_back, synchronizes and returns the number of keys >= threshold.
template <typename T>
int64_t count_and_scan(const Ctx& x, const T* src, const float* residual, float* c_out, int64_t n, bool read_back) {
  tile_count_kernel<T><<<(unsigned)x.L.num_tiles, kThreads, 0, x.stream>>>(src, residual, c_out, n, x.state,
                                                                           x.tile_counts, x.L.num_tiles);
  check(cudaGetLastError(), "tile_count_kernel launch");
  size_t temp_bytes = x.L.scan_temp_bytes;
  check(cub::DeviceScan::ExclusiveSum(x.scan_temp, temp_bytes, x.tile_counts, x.tile_offsets,
                                      (int)(x.L.num_tiles + 1), x.stream),
        "cub::DeviceScan::ExclusiveSum");
  if (!read_back) return -1;
  u64 total = 0;
  check(cudaMemcpyAsync(&total, x.tile_offsets + x.L.num_tiles, sizeof(total), cudaMemcpyDeviceToHost, x.stream),
        "cudaMemcpyAsync(count)");
  check(cudaStreamSynchronize(x.stream), "cudaStreamSynchronize(count)");
  return (int64_t)(total >> 32) + (int64_t)(total & 0xffffffffull);
}

void compact(const Ctx& x, const float* c, int64_t n, bool limit_equal, int32_t* indices, float* values,
             int64_t capacity, float* residual) {
  compact_kernel<<<(unsigned)x.L.num_tiles, kThreads, 0, x.stream>>>(c, n, x.state, limit_equal, x.tile_offsets,
                                                                     indices, values, capacity, residual);
  check(cudaGetLastError(), "compact_kernel launch");
}

template <typename T>
int64_t topk_select(const Ctx& x, const T* grad, float* residual, int64_t n, int64_t k, bool approx,
                    int32_t* indices, float* values) {
  // Where c lives: in place in residual (that is the new residual before the
  // sent entries are zeroed), else in scratch; an fp32 grad without residual
  // already is c and is only read.
  const bool c_is_grad = residual == nullptr && std::is_same<T, float>::value;
  float* c_out = c_is_grad ? nullptr : (residual != nullptr ? residual : x.c_scratch);
  const float* c = c_is_grad ? reinterpret_cast<const float*>(grad) : c_out;

  if (approx) {
    const int64_t stride = x.L.stride;
    const int64_t s = x.L.s;
    const int gather_grid = (int)(ceil_div(s, kThreads) < x.grid_cap ? ceil_div(s, kThreads) : x.grid_cap);
    gather_sample_kernel<T><<<gather_grid, kThreads, 0, x.stream>>>(grad, residual, stride, s, x.sample);
    check(cudaGetLastError(), "gather_sample_kernel launch");
    int64_t rank = topk_sample_rank(n, k, s);
    for (int attempt = 0; attempt < 2; ++attempt) {
      radix_select<float>(x, x.sample, nullptr, nullptr, x.sample, s, rank);
      // The first full count is also the pass that materializes c.
      const int64_t count = attempt == 0 ? count_and_scan<T>(x, grad, residual, c_out, n, true)
                                         : count_and_scan<float>(x, c, nullptr, nullptr, n, true);
      if (topk_accept(count, k)) {
        compact(x, c, n, /*limit_equal=*/false, indices, values, topk_capacity(k), residual);
        return count;
      }
      if (attempt == 0) {
        const int64_t new_rank = topk_retry_rank(rank, k, count, s);
        if (new_rank == rank) break;
        rank = new_rank;
      }
    }
    radix_select<float>(x, c, nullptr, nullptr, c, n, k);
  } else {
    radix_select<T>(x, grad, residual, c_out, c, n, k);
  }
  // Exact: n_above < k <= n_above + (#keys == T), so exactly k are taken;
  // nothing needs to come back to the host.
  count_and_scan<float>(x, c, nullptr, nullptr, n, false);
  compact(x, c, n, /*limit_equal=*/true, indices, values, k, residual);
  return k;
}

}  // namespace

size_t topk_workspace_bytes(int64_t n, int64_t k, bool has_residual) {
  return make_layout(n, k, has_residual).total;
}

int64_t topk_compress(const void* grad, DType dtype, float* residual, int64_t n, int64_t k, bool approx,
                      int32_t* indices, float* values, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
  Ctx x;
  x.L = make_layout(n, k, residual != nullptr);
  if (workspace == nullptr || workspace_bytes < x.L.total) {
    throw std::invalid_argument("pycomm topk_compress: workspace of " + std::to_string(workspace_bytes) +
                                " bytes, needs topk_workspace_bytes() = " + std::to_string(x.L.total));
  }
  x.stream = stream;
  int device = 0;
  int sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  x.grid_cap = sms * (2048 / kThreads);  // one full SM's worth of threads per SM
  char* base = reinterpret_cast<char*>(align_up(reinterpret_cast<uintptr_t>(workspace)));
  x.c_scratch = reinterpret_cast<float*>(base + x.L.c);
  x.sample = reinterpret_cast<float*>(base + x.L.sample);
  x.hist = reinterpret_cast<unsigned*>(base + x.L.hist);
  x.state = reinterpret_cast<SelectState*>(base + x.L.state);
  x.tile_counts = reinterpret_cast<u64*>(base + x.L.tile_counts);
  x.tile_offsets = reinterpret_cast<u64*>(base + x.L.tile_offsets);
  x.scan_temp = base + x.L.scan_temp;

  switch (dtype) {
    case DType::kFloat32:
      return topk_select(x, static_cast<const float*>(grad), residual, n, k, approx, indices, values);
    case DType::kFloat16:
      return topk_select(x, static_cast<const __half*>(grad), residual, n, k, approx, indices, values);
    case DType::kBFloat16:
      return topk_select(x, static_cast<const __nv_bfloat16*>(grad), residual, n, k, approx, indices, values);
  }
  throw std::invalid_argument("pycomm topk_compress: unsupported dtype");
}

void topk_decompress(const int32_t* indices, const float* values, int64_t count, float* out, int64_t n,
                     bool accumulate, cudaStream_t stream) {
  if (n < 0 || count < 0) throw std::invalid_argument("pycomm topk_decompress: negative size");
  if (!accumulate && n > 0) {
    check(cudaMemsetAsync(out, 0, (size_t)n * sizeof(float), stream), "cudaMemsetAsync(out)");
  }
  if (count == 0) return;
  const int64_t blocks = ceil_div(count, kThreads);
  topk_scatter_kernel<<<(int)(blocks < 65536 ? blocks : 65536), kThreads, 0, stream>>>(indices, values, count, out,
                                                                                        n, accumulate);
  check(cudaGetLastError(), "topk_scatter_kernel launch");
}

}  // namespace cuda
}  // namespace pycomm
