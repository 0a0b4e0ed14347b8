// Paged decode attention over per-(layer, KV head) pages: templated kernels.
//
// Torch-free. Instantiated per cache dtype in paged_decode_attention_{f32,f16,bf16}.cu
// (one translation unit per dtype keeps each nvcc run short and parallel).
//
// Kernel 1 (paged_decode_attention_kernel), one thread block per
// (partition, KV head x query-head chunk, sequence):
//   1. the chunk's GP (<= 8) query heads go to shared memory (float32);
//   2. QK: each warp takes one page at a time; 32 / BLOCK_SIZE lanes share a token and
//      read its key row with 16-byte loads (a page is one contiguous
//      BLOCK_SIZE x HEAD_SIZE tile, so a warp reads it fully coalesced) and dot it with
//      all GP queries: one page read serves the whole GQA group;
//   3. masked softmax of the partition (one warp per query head), stats kept;
//   4. PV: each warp takes one page; lanes split the head dim in 16-byte vectors;
//   5. cross-warp sum; single partition -> normalised output straight to `out`,
//      else unnormalised partial output + (max, sum) to the workspace.
// Kernel 2 (paged_decode_reduce_kernel): combines the partitions of one (seq, q head).
// Kernel 3 (paged_decode_metrics_kernel, paged_decode_attention.cu): metric pass.
#pragma once

#include "common.cuh"
#include "launchers.h"

namespace kvcompress {
namespace decode {

constexpr int kNumThreads = 128;
constexpr int kNumWarps = kNumThreads / kWarpSize;
constexpr int kMaxGroupPerBlock = kPagedDecodeMaxGroupPerBlock;

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int GP>
struct Layout {
  using Traits = VecTraits<T>;
  using Vec = typename Traits::Vec;
  static constexpr int kVec = Traits::kSize;  // elements per 16-byte vector
  static constexpr int kRowVecs = HEAD_SIZE / kVec;  // vectors per K/V row
  static_assert(HEAD_SIZE % kVec == 0, "head size must be a multiple of the vector size");
  static_assert(kWarpSize % BLOCK_SIZE == 0, "block size must divide the warp size");
  // QK: kLanesPerToken lanes per token, each takes every kLanesPerToken-th vector.
  static constexpr int kLanesPerToken = kWarpSize / BLOCK_SIZE;
  static constexpr int kQkVecs = kRowVecs / kLanesPerToken;
  static_assert(kRowVecs % kLanesPerToken == 0, "row vectors must split over token lanes");
  static constexpr int kQkChunk = kQkVecs < 8 ? kQkVecs : 8;
  static_assert(kQkVecs % kQkChunk == 0, "QK chunking");
  // PV: kRowLanes lanes cover one row, kTokenLanes rows are read at once.
  static constexpr int kRowLanes = kRowVecs < kWarpSize ? kRowVecs : kWarpSize;
  static constexpr int kTokenLanes = kWarpSize / kRowLanes;
  static constexpr int kPvVecs = kRowVecs / kRowLanes;  // vectors per lane per row
  static_assert(kRowVecs % kRowLanes == 0, "row vectors must split over row lanes");
  static constexpr int kTokensPerLane = BLOCK_SIZE / kTokenLanes;
  static_assert(BLOCK_SIZE % kTokenLanes == 0, "tokens must split over token lanes");
  static constexpr int kPvChunkRaw = 8 / kPvVecs > 0 ? 8 / kPvVecs : 1;
  static constexpr int kPvChunk = kTokensPerLane < kPvChunkRaw ? kTokensPerLane : kPvChunkRaw;
  static_assert(kTokensPerLane % kPvChunk == 0, "PV chunking");
};

// Dynamic shared memory of kernel 1, in floats: queries + max(logits, warp partials).
template <int HEAD_SIZE, int GP>
__host__ __device__ constexpr int64_t smem_floats(int partition_size) {
  return static_cast<int64_t>(GP) * HEAD_SIZE +
         (static_cast<int64_t>(GP) * partition_size > static_cast<int64_t>(kNumWarps) * GP * HEAD_SIZE
              ? static_cast<int64_t>(GP) * partition_size
              : static_cast<int64_t>(kNumWarps) * GP * HEAD_SIZE);
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int GP>
__global__ void __launch_bounds__(kNumThreads)
    paged_decode_attention_kernel(const PagedDecodeParams p) {
  using L = Layout<T, HEAD_SIZE, BLOCK_SIZE, GP>;
  using Vec = typename L::Vec;
  constexpr int VEC = L::kVec;

  const int part = blockIdx.x;
  const int group_chunks = (p.group + GP - 1) / GP;
  const int kv_head = blockIdx.y / group_chunks;
  const int g0 = (blockIdx.y % group_chunks) * GP;
  const int gn = min(GP, p.group - g0);  // query heads of this block
  const int seq = blockIdx.z;
  const int num_q_heads = p.num_kv_heads * p.group;
  const int q_head0 = kv_head * p.group + g0;
  const int num_partitions =
      static_cast<int>(paged_decode_num_partitions(p.max_pages, BLOCK_SIZE, p.partition_size));
  const bool single = num_partitions == 1;
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;

  T* out = static_cast<T*>(p.out);
  // Slots past the table width are ignored (callers never hold more).
  const int64_t head_len = min(p.head_lens[seq * p.hl_stride_seq + kv_head * p.hl_stride_head],
                               p.max_pages * BLOCK_SIZE);
  const int64_t tok_begin = static_cast<int64_t>(part) * p.partition_size;
  if (tok_begin >= head_len) {
    // Nothing to attend. A sequence with an empty head still needs its (zero) output;
    // with partitions the reduce kernel writes it.
    if (single && part == 0) {
      for (int i = tid; i < gn * HEAD_SIZE; i += kNumThreads) {
        const int g = i / HEAD_SIZE, d = i % HEAD_SIZE;
        out[seq * p.out_stride_seq + (q_head0 + g) * p.out_stride_head + d] = from_float<T>(0.f);
      }
    }
    return;
  }
  const int n_tok = static_cast<int>(
      head_len - tok_begin < p.partition_size ? head_len - tok_begin : p.partition_size);
  const int n_pages = (n_tok + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const int64_t page_begin = tok_begin / BLOCK_SIZE;
  const int64_t q_pos = p.query_positions[seq * p.qp_stride];
  const int64_t* table = p.block_tables + seq * p.bt_stride_seq + kv_head * p.bt_stride_head;
  const bool want_logits = p.metric_seqs != nullptr && p.slot_metrics != nullptr &&
                           p.logits != nullptr && p.metric_seqs[seq] != 0;

  extern __shared__ float4 smem_vec[];
  float* q_s = reinterpret_cast<float*>(smem_vec);  // [GP][HEAD_SIZE]
  float* logit_s = q_s + GP * HEAD_SIZE;  // [GP][partition_size]
  float* red_s = logit_s;  // [kNumWarps][GP][HEAD_SIZE], reused after PV
  __shared__ float max_s[GP];
  __shared__ float sum_s[GP];

  // 1. Queries (rows past gn are zero and never stored).
  const T* query = static_cast<const T*>(p.query);
  for (int i = tid; i < GP * HEAD_SIZE; i += kNumThreads) {
    const int g = i / HEAD_SIZE, d = i % HEAD_SIZE;
    q_s[i] = g < gn ? to_float(query[seq * p.q_stride_seq + (q_head0 + g) * p.q_stride_head + d])
                    : 0.f;
  }
  __syncthreads();

  // 2. QK.
  {
    const T* key_cache = static_cast<const T*>(p.key_cache);
    const int token = lane / L::kLanesPerToken;
    const int sub = lane % L::kLanesPerToken;
    for (int pi = warp; pi < n_pages; pi += kNumWarps) {
      const int64_t page = table[(page_begin + pi) * p.bt_stride_page];
      const T* row = key_cache + page * p.k_stride_page + token * p.k_stride_slot;
      float acc[GP];
#pragma unroll
      for (int g = 0; g < GP; ++g) acc[g] = 0.f;
#pragma unroll
      for (int c = 0; c < L::kQkVecs; c += L::kQkChunk) {
        Vec kv[L::kQkChunk];
#pragma unroll
        for (int i = 0; i < L::kQkChunk; ++i) {
          kv[i] = *reinterpret_cast<const Vec*>(row + ((c + i) * L::kLanesPerToken + sub) * VEC);
        }
#pragma unroll
        for (int i = 0; i < L::kQkChunk; ++i) {
          float kf[VEC];
          L::Traits::to_float(kv[i], kf);
          const int d0 = ((c + i) * L::kLanesPerToken + sub) * VEC;
#pragma unroll
          for (int g = 0; g < GP; ++g) {
            const float4* q4 = reinterpret_cast<const float4*>(q_s + g * HEAD_SIZE + d0);
#pragma unroll
            for (int e = 0; e < VEC / 4; ++e) {
              const float4 q = q4[e];
              acc[g] += kf[4 * e] * q.x + kf[4 * e + 1] * q.y + kf[4 * e + 2] * q.z +
                        kf[4 * e + 3] * q.w;
            }
          }
        }
      }
#pragma unroll
      for (int g = 0; g < GP; ++g) {
#pragma unroll
        for (int offset = L::kLanesPerToken / 2; offset > 0; offset /= 2) {
          acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], offset);
        }
      }
      const int local = pi * BLOCK_SIZE + token;
      if (sub == 0) {
        const bool visible =
            local < n_tok &&
            static_cast<int64_t>(
                p.slot_positions[page * p.pos_stride_page + token * p.pos_stride_slot]) <= q_pos;
#pragma unroll
        for (int g = 0; g < GP; ++g) {
          if (g < gn) logit_s[g * p.partition_size + local] = visible ? acc[g] * p.scale : -INFINITY;
        }
      }
    }
  }
  __syncthreads();

  // 3. Softmax of the partition, one warp per query head.
  for (int g = warp; g < gn; g += kNumWarps) {
    float* row = logit_s + g * p.partition_size;
    float m = -FLT_MAX;
    for (int i = lane; i < n_tok; i += kWarpSize) m = fmaxf(m, row[i]);
    m = warp_max(m);
    if (want_logits) {
      float* dst = p.logits +
                   (static_cast<int64_t>(seq) * num_q_heads + q_head0 + g) *
                       (static_cast<int64_t>(num_partitions) * p.partition_size) +
                   tok_begin;
      for (int i = lane; i < n_tok; i += kWarpSize) dst[i] = row[i];
    }
    float s = 0.f;
    for (int i = lane; i < n_tok; i += kWarpSize) {
      const float l = row[i];
      const float e = l == -INFINITY ? 0.f : __expf(l - m);
      row[i] = e;
      s += e;
    }
    s = warp_sum(s);
    if (lane == 0) {
      max_s[g] = m;
      sum_s[g] = s;
    }
  }
  __syncthreads();

  // 4. PV.
  float acc[GP][L::kPvVecs][VEC];
#pragma unroll
  for (int g = 0; g < GP; ++g)
#pragma unroll
    for (int v = 0; v < L::kPvVecs; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][v][e] = 0.f;
  const int row_lane = lane % L::kRowLanes;
  const int token_lane = lane / L::kRowLanes;
  {
    const T* value_cache = static_cast<const T*>(p.value_cache);
    for (int pi = warp; pi < n_pages; pi += kNumWarps) {
      const int64_t page = table[(page_begin + pi) * p.bt_stride_page];
      const T* tile = value_cache + page * p.v_stride_page;
      const int base = pi * BLOCK_SIZE;
      const int valid = n_tok - base < BLOCK_SIZE ? n_tok - base : BLOCK_SIZE;
#pragma unroll
      for (int c = 0; c < L::kTokensPerLane; c += L::kPvChunk) {
        Vec vv[L::kPvChunk][L::kPvVecs];
#pragma unroll
        for (int i = 0; i < L::kPvChunk; ++i) {
          const int t = (c + i) * L::kTokenLanes + token_lane;
#pragma unroll
          for (int v = 0; v < L::kPvVecs; ++v) {
            vv[i][v] = *reinterpret_cast<const Vec*>(tile + t * p.v_stride_slot +
                                                     (v * L::kRowLanes + row_lane) * VEC);
          }
        }
#pragma unroll
        for (int i = 0; i < L::kPvChunk; ++i) {
          const int t = (c + i) * L::kTokenLanes + token_lane;
          if (t < valid) {  // slots past the head's length may hold anything
            float prob[GP];
#pragma unroll
            for (int g = 0; g < GP; ++g) {
              prob[g] = g < gn ? logit_s[g * p.partition_size + base + t] : 0.f;
            }
#pragma unroll
            for (int v = 0; v < L::kPvVecs; ++v) {
              float vf[VEC];
              L::Traits::to_float(vv[i][v], vf);
#pragma unroll
              for (int g = 0; g < GP; ++g)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][v][e] += prob[g] * vf[e];
            }
          }
        }
      }
    }
  }
  // Sum over the token lanes of the warp.
#pragma unroll
  for (int g = 0; g < GP; ++g)
#pragma unroll
    for (int v = 0; v < L::kPvVecs; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
#pragma unroll
        for (int offset = L::kRowLanes; offset < kWarpSize; offset *= 2)
          acc[g][v][e] += __shfl_xor_sync(0xffffffffu, acc[g][v][e], offset);
  __syncthreads();  // red_s aliases the probabilities
  if (token_lane == 0) {
#pragma unroll
    for (int g = 0; g < GP; ++g)
#pragma unroll
      for (int v = 0; v < L::kPvVecs; ++v) {
        float* dst = red_s + (warp * GP + g) * HEAD_SIZE + (v * L::kRowLanes + row_lane) * VEC;
#pragma unroll
        for (int e = 0; e < VEC; e += 4) {
          *reinterpret_cast<float4*>(dst + e) =
              make_float4(acc[g][v][e], acc[g][v][e + 1], acc[g][v][e + 2], acc[g][v][e + 3]);
        }
      }
  }
  __syncthreads();

  // 5. Cross-warp sum and output.
  for (int i = tid; i < gn * HEAD_SIZE; i += kNumThreads) {
    const int g = i / HEAD_SIZE, d = i % HEAD_SIZE;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) v += red_s[(w * GP + g) * HEAD_SIZE + d];
    if (single) {
      const float s = sum_s[g];
      out[seq * p.out_stride_seq + (q_head0 + g) * p.out_stride_head + d] =
          from_float<T>(s > 0.f ? v / s : 0.f);
    } else {
      p.tmp_out[((static_cast<int64_t>(seq) * num_q_heads + q_head0 + g) * num_partitions + part) *
                    HEAD_SIZE +
                d] = v;
    }
  }
  if (tid < gn) {
    const int64_t stat = (static_cast<int64_t>(seq) * num_q_heads + q_head0 + tid) * num_partitions + part;
    p.max_logits[stat] = max_s[tid];
    p.exp_sums[stat] = sum_s[tid];
  }
}

// Combines the partitions of one (query head, sequence): grid (num_q_heads, num_seqs).
// Dynamic shared memory: num_partitions floats.
template <typename T>
__global__ void __launch_bounds__(kNumThreads)
    paged_decode_reduce_kernel(const PagedDecodeParams p) {
  const int q_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int kv_head = q_head / p.group;
  const int num_q_heads = p.num_kv_heads * p.group;
  const int num_partitions =
      static_cast<int>(paged_decode_num_partitions(p.max_pages, p.block_size, p.partition_size));
  const int64_t head_len = min(p.head_lens[seq * p.hl_stride_seq + kv_head * p.hl_stride_head],
                               p.max_pages * p.block_size);
  const int parts = static_cast<int>((head_len + p.partition_size - 1) / p.partition_size);
  T* out = static_cast<T*>(p.out) + seq * p.out_stride_seq + q_head * p.out_stride_head;

  extern __shared__ float4 smem_vec[];
  float* weight_s = reinterpret_cast<float*>(smem_vec);
  __shared__ float scratch[kWarpSize];

  const int64_t row = static_cast<int64_t>(seq) * num_q_heads + q_head;
  const float* max_logits = p.max_logits + row * num_partitions;
  const float* exp_sums = p.exp_sums + row * num_partitions;
  float m = -FLT_MAX;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) m = fmaxf(m, max_logits[i]);
  m = block_max(m, scratch);
  float s = 0.f;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) {
    const float w = __expf(max_logits[i] - m);
    weight_s[i] = w;
    s += w * exp_sums[i];
  }
  s = block_sum(s, scratch);  // its barriers also publish weight_s
  const float inv = s > 0.f ? 1.f / s : 0.f;
  const float* tmp = p.tmp_out + row * num_partitions * p.head_size;
  for (int d = threadIdx.x; d < p.head_size; d += blockDim.x) {
    float v = 0.f;
    for (int i = 0; i < parts; ++i) v += weight_s[i] * tmp[static_cast<int64_t>(i) * p.head_size + d];
    out[d] = from_float<T>(v * inv);
  }
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int GP>
cudaError_t launch_attention(const PagedDecodeParams& p, cudaStream_t stream) {
  const int64_t num_partitions =
      paged_decode_num_partitions(p.max_pages, p.block_size, p.partition_size);
  const size_t smem = static_cast<size_t>(smem_floats<HEAD_SIZE, GP>(p.partition_size)) * sizeof(float);
  auto kernel = paged_decode_attention_kernel<T, HEAD_SIZE, BLOCK_SIZE, GP>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const int group_chunks = (p.group + GP - 1) / GP;
  const dim3 grid(static_cast<unsigned>(num_partitions),
                  static_cast<unsigned>(p.num_kv_heads * group_chunks),
                  static_cast<unsigned>(p.num_seqs));
  kernel<<<grid, kNumThreads, smem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || num_partitions == 1) return err;
  const dim3 reduce_grid(static_cast<unsigned>(p.num_kv_heads * p.group),
                         static_cast<unsigned>(p.num_seqs));
  paged_decode_reduce_kernel<T>
      <<<reduce_grid, kNumThreads, static_cast<size_t>(num_partitions) * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
cudaError_t dispatch_group(const PagedDecodeParams& p, cudaStream_t stream) {
  if (p.group <= 1) return launch_attention<T, HEAD_SIZE, BLOCK_SIZE, 1>(p, stream);
  if (p.group <= 2) return launch_attention<T, HEAD_SIZE, BLOCK_SIZE, 2>(p, stream);
  if (p.group <= 4) return launch_attention<T, HEAD_SIZE, BLOCK_SIZE, 4>(p, stream);
  return launch_attention<T, HEAD_SIZE, BLOCK_SIZE, kMaxGroupPerBlock>(p, stream);
}

template <typename T, int HEAD_SIZE>
cudaError_t dispatch_block(const PagedDecodeParams& p, cudaStream_t stream) {
  switch (p.block_size) {
    case 16:
      return dispatch_group<T, HEAD_SIZE, 16>(p, stream);
    case 32:
      return dispatch_group<T, HEAD_SIZE, 32>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// Attention (+ reduce) for one cache dtype; the metric pass runs afterwards
// (launch_paged_decode_attention in paged_decode_attention.cu).
template <typename T>
cudaError_t launch_typed(const PagedDecodeParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.num_kv_heads == 0) return cudaSuccess;
  if (p.group < 1 || p.partition_size <= 0 || p.partition_size % p.block_size != 0) {
    return cudaErrorInvalidValue;
  }
  switch (p.head_size) {
    case 64:
      return dispatch_block<T, 64>(p, stream);
    case 128:
      return dispatch_block<T, 128>(p, stream);
    case 256:
      return dispatch_block<T, 256>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace decode
}  // namespace kvcompress
