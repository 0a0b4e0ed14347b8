// Shared device helpers of the kvcompress kernels. Torch-free: plain CUDA only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

namespace kvcompress {

constexpr int kWarpSize = 32;

// 16-byte vectors of cache elements and their conversion to float. Only explicit
// intrinsics are used, so the code builds with torch's -D__CUDA_NO_HALF_CONVERSIONS__
// family of flags.
template <typename T>
struct VecTraits;

template <>
struct VecTraits<float> {
  using Vec = float4;
  static constexpr int kSize = 4;
  __device__ __forceinline__ static void to_float(const Vec& v, float* out) {
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  }
};

__device__ __forceinline__ float2 pair_to_float2(const __half2& h) { return __half22float2(h); }
__device__ __forceinline__ float2 pair_to_float2(const __nv_bfloat162& h) { return __bfloat1622float2(h); }

// Eight 16-bit elements (``Pair``: two of them) per vector: fp16 and bf16 alike.
template <typename Pair>
struct PairVecTraits {
  using Vec = uint4;
  static constexpr int kSize = 8;
  __device__ __forceinline__ static void to_float(const Vec& v, float* out) {
    const Pair* h = reinterpret_cast<const Pair*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = pair_to_float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

template <>
struct VecTraits<__half> : PairVecTraits<__half2> {};

template <>
struct VecTraits<__nv_bfloat16> : PairVecTraits<__nv_bfloat162> {};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// Block-wide reductions; `scratch` holds >= 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_max(float x, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  x = warp_max(x);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < num_warps ? scratch[lane] : -FLT_MAX;
  return warp_max(x);
}

__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  x = warp_sum(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < num_warps ? scratch[lane] : 0.f;
  return warp_sum(x);
}

// x ** power for a small non-negative integer power (0 ** 0 == 1, like torch.pow).
__device__ __forceinline__ float int_pow(float x, int power) {
  float result = 1.f;
  for (int i = 0; i < power; ++i) result *= x;
  return result;
}

}  // namespace kvcompress
