// Paged decode attention: dtype dispatch and the sparse metric pass.
//
// The attention and reduce kernels are instantiated per dtype in
// paged_decode_attention_{f32,f16,bf16}.cu.
#include "common.cuh"
#include "launchers.h"

namespace kvcompress {
namespace decode {

template <typename T>
cudaError_t launch_typed(const PagedDecodeParams& p, cudaStream_t stream);
extern template cudaError_t launch_typed<float>(const PagedDecodeParams&, cudaStream_t);
extern template cudaError_t launch_typed<__half>(const PagedDecodeParams&, cudaStream_t);
extern template cudaError_t launch_typed<__nv_bfloat16>(const PagedDecodeParams&, cudaStream_t);

constexpr int kMetricThreads = 128;

// Metric pass, after the attention (and reduce) kernels have stored every
// partition's (max logit, exp sum) and, for the selected sequences, the raw logits
// (-inf where a held slot is not visible). Grid (num_partitions, num_kv_heads,
// num_seqs); dynamic shared memory: 2 * group floats. Each held visible slot of a
// selected sequence gets sum over its group of (exp(logit - max) / sum) ** power.
// Every slot belongs to exactly one (sequence, layer, head), so the adds never
// collide within a call; atomicAdd keeps duplicate sequences correct anyway.
__global__ void __launch_bounds__(kMetricThreads)
    paged_decode_metrics_kernel(const PagedDecodeParams p) {
  const int part = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.z;
  if (p.metric_seqs[seq] == 0) return;
  const int64_t head_len = min(p.head_lens[seq * p.hl_stride_seq + kv_head * p.hl_stride_head],
                               p.max_pages * p.block_size);
  const int64_t tok_begin = static_cast<int64_t>(part) * p.partition_size;
  if (tok_begin >= head_len) return;
  const int n_tok = static_cast<int>(
      head_len - tok_begin < p.partition_size ? head_len - tok_begin : p.partition_size);
  const int parts = static_cast<int>((head_len + p.partition_size - 1) / p.partition_size);
  const int64_t num_partitions =
      paged_decode_num_partitions(p.max_pages, p.block_size, p.partition_size);
  const int num_q_heads = p.num_kv_heads * p.group;
  const int64_t logits_stride = num_partitions * p.partition_size;

  extern __shared__ float4 smem_vec[];
  float* max_g = reinterpret_cast<float*>(smem_vec);
  float* inv_g = max_g + p.group;
  for (int g = threadIdx.x; g < p.group; g += blockDim.x) {
    const int64_t row = (static_cast<int64_t>(seq) * num_q_heads + kv_head * p.group + g) * num_partitions;
    float m = -FLT_MAX;
    for (int i = 0; i < parts; ++i) m = fmaxf(m, p.max_logits[row + i]);
    float s = 0.f;
    for (int i = 0; i < parts; ++i) s += p.exp_sums[row + i] * __expf(p.max_logits[row + i] - m);
    max_g[g] = m;
    inv_g[g] = s > 0.f ? 1.f / s : 0.f;
  }
  __syncthreads();

  const float* logits =
      p.logits + (static_cast<int64_t>(seq) * num_q_heads + kv_head * p.group) * logits_stride;
  const int64_t* table = p.block_tables + seq * p.bt_stride_seq + kv_head * p.bt_stride_head;
  for (int i = threadIdx.x; i < n_tok; i += blockDim.x) {
    const int64_t k = tok_begin + i;
    if (logits[k] == -INFINITY) continue;  // held but not visible to this query
    float gained = 0.f;
    for (int g = 0; g < p.group; ++g) {
      const float prob = __expf(logits[g * logits_stride + k] - max_g[g]) * inv_g[g];
      gained += int_pow(prob, p.metric_power);
    }
    const int64_t page = table[(k / p.block_size) * p.bt_stride_page];
    atomicAdd(p.slot_metrics + page * p.metric_stride_page + (k % p.block_size) * p.metric_stride_slot,
              gained);
  }
}

}  // namespace decode

bool paged_decode_supported(int head_size, int block_size) {
  return (head_size == 64 || head_size == 128 || head_size == 256) &&
         (block_size == 16 || block_size == 32);
}

int paged_decode_default_partition_size(int num_seqs, int num_kv_heads, int group,
                                        int64_t max_pages, int block_size, int num_sms) {
  const int64_t slots = max_pages * block_size;
  const int64_t group_chunks = (group + kPagedDecodeMaxGroupPerBlock - 1) / kPagedDecodeMaxGroupPerBlock;
  const int64_t rows = static_cast<int64_t>(num_seqs) * num_kv_heads * group_chunks;
  const int64_t target = 4LL * (num_sms > 0 ? num_sms : 132);
  const int min_size = block_size > 64 ? block_size : 64;
  int size = 512;
  while (size / 2 >= min_size && rows * ((slots + size - 1) / size) < target) size /= 2;
  return size;
}

cudaError_t launch_paged_decode_attention(const PagedDecodeParams& params, DType dtype,
                                          cudaStream_t stream) {
  if (!paged_decode_supported(params.head_size, params.block_size)) return cudaErrorInvalidValue;
  cudaError_t err;
  switch (dtype) {
    case DType::kFloat32:
      err = decode::launch_typed<float>(params, stream);
      break;
    case DType::kFloat16:
      err = decode::launch_typed<__half>(params, stream);
      break;
    case DType::kBFloat16:
      err = decode::launch_typed<__nv_bfloat16>(params, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  if (err != cudaSuccess) return err;
  const bool metrics = params.slot_metrics != nullptr && params.metric_seqs != nullptr;
  if (!metrics || params.num_seqs == 0 || params.num_kv_heads == 0) return cudaSuccess;
  if (params.logits == nullptr || params.metric_power < 0) return cudaErrorInvalidValue;
  const int64_t num_partitions =
      paged_decode_num_partitions(params.max_pages, params.block_size, params.partition_size);
  const dim3 grid(static_cast<unsigned>(num_partitions), static_cast<unsigned>(params.num_kv_heads),
                  static_cast<unsigned>(params.num_seqs));
  decode::paged_decode_metrics_kernel<<<grid, decode::kMetricThreads,
                                        2 * static_cast<size_t>(params.group) * sizeof(float), stream>>>(
      params);
  return cudaGetLastError();
}

}  // namespace kvcompress
