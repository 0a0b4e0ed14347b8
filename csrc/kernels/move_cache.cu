// MoveCache (KV-Compress Algorithm 1): copy K row, V row, metric and position of each
// move's source slot to its destination slot. Torch-free.
//
// A group of `lanes` threads (a power of two <= 32, about one thread per copy unit of a
// row) handles one move; K and V are copied in the widest unit (16, 8, 4, 2 or 1
// bytes) that the row size, strides and base pointers allow, so the kernel is
// dtype-agnostic and works on strided K / V views of a [N, 2, b, D] pool.
#include "common.cuh"
#include "launchers.h"

namespace kvcompress {
namespace {

constexpr int kMoveThreads = 256;

struct MoveCacheBytes {
  char* key;
  char* value;
  int64_t k_page, k_slot, v_page, v_slot;  // byte strides
};

template <typename U>
__global__ void __launch_bounds__(kMoveThreads)
    move_cache_kernel(const MoveCacheParams p, const MoveCacheBytes b, int units_per_row,
                      int lanes) {
  const int64_t groups_per_block = blockDim.x / lanes;
  const int64_t group = blockIdx.x * groups_per_block + threadIdx.x / lanes;
  const int64_t num_groups = static_cast<int64_t>(gridDim.x) * groups_per_block;
  const int lane = threadIdx.x % lanes;
  for (int64_t m = group; m < p.num_moves; m += num_groups) {
    const int64_t sp = p.src_pages[m], so = p.src_offsets[m];
    const int64_t dp = p.dst_pages[m], dof = p.dst_offsets[m];
    const U* ks = reinterpret_cast<const U*>(b.key + sp * b.k_page + so * b.k_slot);
    U* kd = reinterpret_cast<U*>(b.key + dp * b.k_page + dof * b.k_slot);
    const U* vs = reinterpret_cast<const U*>(b.value + sp * b.v_page + so * b.v_slot);
    U* vd = reinterpret_cast<U*>(b.value + dp * b.v_page + dof * b.v_slot);
    for (int i = lane; i < units_per_row; i += lanes) {
      const U k = ks[i];
      const U v = vs[i];
      kd[i] = k;
      vd[i] = v;
    }
    if (lane == 0) {
      p.slot_metrics[dp * p.metric_stride_page + dof * p.metric_stride_slot] =
          p.slot_metrics[sp * p.metric_stride_page + so * p.metric_stride_slot];
      p.slot_positions[dp * p.pos_stride_page + dof * p.pos_stride_slot] =
          p.slot_positions[sp * p.pos_stride_page + so * p.pos_stride_slot];
    }
  }
}

template <typename U>
cudaError_t launch_unit(const MoveCacheParams& p, const MoveCacheBytes& b, int64_t row_bytes,
                        cudaStream_t stream) {
  const int units = static_cast<int>(row_bytes / static_cast<int64_t>(sizeof(U)));
  int lanes = 1;
  while (lanes < units && lanes < kWarpSize) lanes *= 2;
  const int64_t groups_per_block = kMoveThreads / lanes;
  int64_t blocks = (p.num_moves + groups_per_block - 1) / groups_per_block;
  const int64_t max_blocks = 65535LL * 8;  // grid-stride loop beyond this
  if (blocks > max_blocks) blocks = max_blocks;
  move_cache_kernel<U><<<static_cast<unsigned>(blocks), kMoveThreads, 0, stream>>>(p, b, units, lanes);
  return cudaGetLastError();
}

bool aligned_to(int64_t unit, int64_t value) { return value % unit == 0; }

}  // namespace

cudaError_t launch_move_cache(const MoveCacheParams& p, cudaStream_t stream) {
  if (p.num_moves <= 0) return cudaSuccess;
  if (p.element_size <= 0 || p.head_size <= 0) return cudaErrorInvalidValue;
  const int64_t es = p.element_size;
  MoveCacheBytes b;
  b.key = static_cast<char*>(p.key_cache);
  b.value = static_cast<char*>(p.value_cache);
  b.k_page = p.k_stride_page * es;
  b.k_slot = p.k_stride_slot * es;
  b.v_page = p.v_stride_page * es;
  b.v_slot = p.v_stride_slot * es;
  const int64_t row_bytes = static_cast<int64_t>(p.head_size) * es;
  const int64_t k_addr = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.key_cache));
  const int64_t v_addr = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.value_cache));
  for (int64_t unit = 16; unit >= 1; unit /= 2) {
    const bool ok = aligned_to(unit, row_bytes) && aligned_to(unit, b.k_page) &&
                    aligned_to(unit, b.k_slot) && aligned_to(unit, b.v_page) &&
                    aligned_to(unit, b.v_slot) && aligned_to(unit, k_addr) &&
                    aligned_to(unit, v_addr);
    if (!ok) continue;
    switch (unit) {
      case 16:
        return launch_unit<uint4>(p, b, row_bytes, stream);
      case 8:
        return launch_unit<uint2>(p, b, row_bytes, stream);
      case 4:
        return launch_unit<uint32_t>(p, b, row_bytes, stream);
      case 2:
        return launch_unit<uint16_t>(p, b, row_bytes, stream);
      default:
        return launch_unit<uint8_t>(p, b, row_bytes, stream);
    }
  }
  return cudaErrorInvalidValue;  // unreachable: 1-byte units always fit
}

}  // namespace kvcompress
