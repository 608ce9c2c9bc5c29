// CudnnAttention in a build without cuDNN or its frontend (CMake says which was missing, in
// SHARDLM_CUDNN_MISSING): every shape is declined, so attention runs on the own kernel.
#include "kernels/cuda/cudnn_attention.h"

namespace shardlm::cuda {

struct CudnnAttention::State {};

CudnnAttention::CudnnAttention(cudaStream_t) {}
CudnnAttention::~CudnnAttention() = default;
bool CudnnAttention::available() const { return false; }
std::string CudnnAttention::status() const {
  return "this build has no cuDNN attention: " SHARDLM_CUDNN_MISSING;
}
std::string CudnnAttention::ragged_refused() const { return status(); }
int64_t CudnnAttention::unbuilt_calls() const { return 0; }
std::optional<size_t> CudnnAttention::workspace_bytes(const SdpaShape&) { return std::nullopt; }
std::string CudnnAttention::declined(const SdpaShape&) { return status(); }
bool CudnnAttention::forward(const SdpaShape&, const void*, const void*, const void*, void*, float*,
                             void*, size_t, const RaggedIndex&) {
  return false;
}
bool CudnnAttention::backward(const SdpaShape&, const void*, const void*, const void*, const void*,
                              const float*, const void*, void*, void*, void*, void*, size_t,
                              const RaggedIndex&) {
  return false;
}

}  // namespace shardlm::cuda
