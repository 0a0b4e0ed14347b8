// Paged decode attention kernels instantiated for float caches (see paged_decode_attention.cuh).
#include "paged_decode_attention.cuh"

namespace kvcompress {
namespace decode {

template cudaError_t launch_typed<float>(const PagedDecodeParams& p, cudaStream_t stream);

}  // namespace decode
}  // namespace kvcompress
