// Page-table fill of the free-stack allocator. Torch-free.
//
// One warp per requester (a (sequence, layer, KV head) that needs new pages); its
// lanes write the requester's slice of the popped free-stack entries into its page
// table row. See AllocatePagesParams in launchers.h for the exact contract.
#include "common.cuh"
#include "launchers.h"

namespace kvcompress {
namespace {

constexpr int kAllocThreads = 256;

__global__ void __launch_bounds__(kAllocThreads) allocate_pages_kernel(const AllocatePagesParams p) {
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * warps_per_block;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t r = blockIdx.x * warps_per_block + threadIdx.x / kWarpSize; r < p.num_requesters;
       r += num_warps) {
    const int64_t begin = p.offsets[r];
    const int64_t end = p.offsets[r + 1];
    if (begin >= end) continue;
    int32_t* row = p.page_tables + p.rows[r] * p.row_stride + p.first_column[r];
    const int64_t* pages = p.free_stack + p.stack_start + begin;
    // Ids are < 2^31: the pool's chunk / page counts are checked when it is built.
    for (int64_t j = lane; j < end - begin; j += kWarpSize) row[j] = static_cast<int32_t>(pages[j]);
  }
}

}  // namespace

cudaError_t launch_allocate_pages(const AllocatePagesParams& p, cudaStream_t stream) {
  if (p.num_requesters <= 0) return cudaSuccess;
  const int64_t warps_per_block = kAllocThreads / kWarpSize;
  int64_t blocks = (p.num_requesters + warps_per_block - 1) / warps_per_block;
  const int64_t max_blocks = 65535LL * 8;  // grid-stride loop beyond this
  if (blocks > max_blocks) blocks = max_blocks;
  allocate_pages_kernel<<<static_cast<unsigned>(blocks), kAllocThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvcompress
