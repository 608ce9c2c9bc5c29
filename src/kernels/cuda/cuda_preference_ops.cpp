// CudaBackend's preference ops (kernels: preference.cu): each segment's summed log-probabilities,
// each pair's coefficients and metrics, and the token weights, all queued on the compute
// stream with no host wait. A segment id outside [-1, S) is flagged as the id checks are
// (backend_impl.h): the kernels leave its row out (no sum, weight 0) and the next result the
// host reads raises it.
#include "kernels/cuda/backend_impl.h"
#include "kernels/cuda/preference_launch.h"

namespace shardlm::cuda {

void CudaBackend::do_segment_logp_sums(const Tensor& row_max, const Tensor& stats,
                                       const Tensor& segments, const Tensor& sums) {
  constexpr std::string_view op = "segment_logp_sums";
  for (const auto& [t, name] : {std::pair{&row_max, "row_max"},
                                {&stats, "stats"},
                                {&segments, "segments"},
                                {&sums, "sums"}})
    on_device(*t, op, name);
  const int64_t S = sums.dim(0);
  if (segments.numel() > 0) impl_->flag_ids(segments, S, true, IdCheck::kSegments, op, "segment");
  cuda_ok(launch_segment_logp_sums(row_max.f32(), stats.f32(), segments.i32(), segments.numel(), S,
                                   sums.f64(), impl_->stream),
          op);
}

void CudaBackend::do_preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                                             const Tensor& reference, double norm,
                                             const Tensor& coef, const Tensor& metrics) {
  constexpr std::string_view op = "preference_coefficients";
  for (const auto& [t, name] :
       {std::pair{&policy, "policy"}, {&coef, "coef"}, {&metrics, "metrics"}})
    on_device(*t, op, name);
  if (!reference.empty()) on_device(reference, op, "reference");
  cuda_ok(launch_preference_coefficients(
              loss, policy.f64(), reference.empty() ? nullptr : reference.f64(), policy.dim(0) / 2,
              norm, coef.f32(), metrics.f64(), impl_->stream),
          op);
}

void CudaBackend::do_gather_segment_weights(const Tensor& coef, const Tensor& segments,
                                            const Tensor& weights) {
  constexpr std::string_view op = "gather_segment_weights";
  for (const auto& [t, name] :
       {std::pair{&coef, "coef"}, {&segments, "segments"}, {&weights, "weights"}})
    on_device(*t, op, name);
  const int64_t S = coef.numel();
  if (segments.numel() > 0) impl_->flag_ids(segments, S, true, IdCheck::kSegments, op, "segment");
  cuda_ok(launch_gather_segment_weights(coef.f32(), S, segments.i32(), segments.numel(),
                                        weights.f32(), impl_->stream),
          op);
}

}  // namespace shardlm::cuda
