// Host API of the kvcompress CUDA kernels: raw pointers, element strides and a stream.
//
// Torch-free on purpose: csrc/kernels/*.cu compile with plain nvcc (see
// tests/test_csrc_compile.py); csrc/torch_bindings.cpp is the only file that includes
// torch headers. Every launcher only enqueues work on `stream` and returns the launch
// status (cudaGetLastError); argument validation is the caller's job (the binding
// checks shapes, dtypes, devices and alignment before calling).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#if defined(__CUDACC__)
#define KVC_HOST_DEVICE __host__ __device__
#else
#define KVC_HOST_DEVICE
#endif

namespace kvcompress {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---------------------------------------------------------------------------------
// Paged decode attention over per-(layer, KV head) pages (one layer per call).
//
// One query token per sequence. Query head j reads KV head j / group. Logical slot k
// of (seq s, KV head h) lives at page block_tables[s, h, k / block_size], offset
// k % block_size. Key k is visible iff k < head_lens[s, h] and
// slot_positions[page, offset] <= query_positions[s]. A query that sees no key gets 0.
//
// Grid: (num_partitions, num_kv_heads * group_chunks, num_seqs); one thread block per
// (sequence, KV head, partition of `partition_size` logical slots) reads each K/V page
// once for up to 8 query heads of the group (group_chunks = ceil(group / 8)). With more
// than one partition a reduce kernel combines the partial softmaxes (vLLM v2 style).
// ---------------------------------------------------------------------------------
// Query heads of one GQA group that share a thread block (larger groups are split).
constexpr int kPagedDecodeMaxGroupPerBlock = 8;

struct PagedDecodeParams {
  // [num_seqs, num_q_heads, head_size], last dim contiguous.
  void* out = nullptr;
  int64_t out_stride_seq = 0, out_stride_head = 0;
  const void* query = nullptr;
  int64_t q_stride_seq = 0, q_stride_head = 0;
  // [num_pages, block_size, head_size], last dim contiguous, rows 16-byte aligned.
  const void* key_cache = nullptr;
  int64_t k_stride_page = 0, k_stride_slot = 0;
  const void* value_cache = nullptr;
  int64_t v_stride_page = 0, v_stride_slot = 0;
  // [num_pages, block_size] int32.
  const int32_t* slot_positions = nullptr;
  int64_t pos_stride_page = 0, pos_stride_slot = 0;
  // [num_seqs, num_kv_heads, max_pages] int64.
  const int64_t* block_tables = nullptr;
  int64_t bt_stride_seq = 0, bt_stride_head = 0, bt_stride_page = 0;
  // [num_seqs, num_kv_heads] int64.
  const int64_t* head_lens = nullptr;
  int64_t hl_stride_seq = 0, hl_stride_head = 0;
  // [num_seqs] int64.
  const int64_t* query_positions = nullptr;
  int64_t qp_stride = 1;

  int num_seqs = 0;
  int num_kv_heads = 0;
  int group = 1;  // query heads per KV head
  int head_size = 0;  // 64, 128 or 256
  int block_size = 0;  // 16 or 32
  int64_t max_pages = 0;  // block_tables.size(2)
  int partition_size = 512;  // multiple of block_size
  float scale = 1.f;

  // Workspace (float32, contiguous), see paged_decode_workspace():
  // max_logits / exp_sums [num_seqs, num_q_heads, num_partitions] (always),
  // tmp_out [num_seqs, num_q_heads, num_partitions, head_size] (num_partitions > 1),
  // logits [num_seqs, num_q_heads, num_partitions * partition_size] (metrics only).
  float* max_logits = nullptr;
  float* exp_sums = nullptr;
  float* tmp_out = nullptr;
  float* logits = nullptr;

  // Optional sparse metric update (both null = off). For every sequence s with
  // metric_seqs[s] != 0 and every visible held slot k of KV head h:
  //   slot_metrics[page, offset] += sum_{g < group} prob[s, h * group + g, k] ** metric_power
  float* slot_metrics = nullptr;  // [num_pages, block_size] float32
  int64_t metric_stride_page = 0, metric_stride_slot = 0;
  const uint8_t* metric_seqs = nullptr;  // [num_seqs] bool
  int metric_power = 2;
};

KVC_HOST_DEVICE inline int64_t paged_decode_num_partitions(int64_t max_pages, int block_size,
                                           int partition_size) {
  const int64_t slots = max_pages * block_size;
  const int64_t parts = (slots + partition_size - 1) / partition_size;
  return parts > 0 ? parts : 1;
}

// Float32 element counts of the workspace buffers of one call.
struct PagedDecodeWorkspace {
  int64_t num_partitions;
  int64_t softmax_stats;  // max_logits and exp_sums, each
  int64_t tmp_out;  // 0 when num_partitions == 1
  int64_t logits;  // 0 unless metrics are requested
};

inline PagedDecodeWorkspace paged_decode_workspace(int num_seqs, int num_q_heads, int head_size,
                                                   int64_t max_pages, int block_size,
                                                   int partition_size, bool metrics) {
  PagedDecodeWorkspace w;
  w.num_partitions = paged_decode_num_partitions(max_pages, block_size, partition_size);
  const int64_t rows = static_cast<int64_t>(num_seqs) * num_q_heads;
  w.softmax_stats = rows * w.num_partitions;
  w.tmp_out = w.num_partitions > 1 ? rows * w.num_partitions * head_size : 0;
  w.logits = metrics ? rows * w.num_partitions * partition_size : 0;
  return w;
}

// Whether (head_size, block_size) has a compiled kernel (every dtype has the same set).
bool paged_decode_supported(int head_size, int block_size);

// Partition size used when the caller passes 0: 512 slots, halved (down to
// max(64, block_size)) while fewer than 4 thread blocks per SM would be launched.
int paged_decode_default_partition_size(int num_seqs, int num_kv_heads, int group,
                                        int64_t max_pages, int block_size, int num_sms);

cudaError_t launch_paged_decode_attention(const PagedDecodeParams& params, DType dtype,
                                          cudaStream_t stream);

// ---------------------------------------------------------------------------------
// MoveCache: move i copies the K row, V row, metric and position of slot
// (src_pages[i], src_offsets[i]) to slot (dst_pages[i], dst_offsets[i]).
// Sources and destinations must be disjoint (moves run in any order, concurrently).
// Strides are in ELEMENTS of the respective tensor; the cache copy is dtype-agnostic
// (row_bytes = head_size * element_size).
// ---------------------------------------------------------------------------------
struct MoveCacheParams {
  void* key_cache = nullptr;
  int64_t k_stride_page = 0, k_stride_slot = 0;
  void* value_cache = nullptr;
  int64_t v_stride_page = 0, v_stride_slot = 0;
  int element_size = 2;  // bytes per cache element
  int head_size = 0;  // elements per row (last dim contiguous)
  float* slot_metrics = nullptr;
  int64_t metric_stride_page = 0, metric_stride_slot = 0;
  int32_t* slot_positions = nullptr;
  int64_t pos_stride_page = 0, pos_stride_slot = 0;
  const int64_t* src_pages = nullptr;
  const int64_t* src_offsets = nullptr;
  const int64_t* dst_pages = nullptr;
  const int64_t* dst_offsets = nullptr;
  int64_t num_moves = 0;
};

cudaError_t launch_move_cache(const MoveCacheParams& params, cudaStream_t stream);

// ---------------------------------------------------------------------------------
// Page-table fill of the free-stack allocator (PageAllocator.allocate_for + the
// page-table scatter of PerHeadPagedCache.append, in one kernel).
//
// Requester r (one (sequence, layer, KV head)) receives the pages
//   free_stack[stack_start + offsets[r] + j],  j < offsets[r + 1] - offsets[r],
// written to page_tables[rows[r] * row_stride + first_column[r] + j].
// offsets is the exclusive prefix sum of the demands with the total appended
// ([num_requesters + 1], offsets[0] == 0); stack_start = num_free - offsets[R], i.e.
// the popped slice is free_stack[stack_start : num_free]. No bounds are checked.
// ---------------------------------------------------------------------------------
struct AllocatePagesParams {
  int32_t* page_tables = nullptr;  // [num_rows, row_stride] (the chunk tables [S, L, H, P / C])
  int64_t row_stride = 0;
  const int64_t* free_stack = nullptr;
  int64_t stack_start = 0;
  const int64_t* offsets = nullptr;  // [num_requesters + 1]
  const int64_t* first_column = nullptr;  // [num_requesters]
  const int64_t* rows = nullptr;  // [num_requesters]
  int64_t num_requesters = 0;
};

cudaError_t launch_allocate_pages(const AllocatePagesParams& params, cudaStream_t stream);

}  // namespace kvcompress
