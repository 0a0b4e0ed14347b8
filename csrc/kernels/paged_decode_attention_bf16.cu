// Paged decode attention kernels instantiated for __nv_bfloat16 caches (see paged_decode_attention.cuh).
#include "paged_decode_attention.cuh"

namespace kvcompress {
namespace decode {

template cudaError_t launch_typed<__nv_bfloat16>(const PagedDecodeParams& p, cudaStream_t stream);

}  // namespace decode
}  // namespace kvcompress
