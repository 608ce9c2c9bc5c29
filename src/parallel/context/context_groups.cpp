// ContextGroups: the Ulysses and ring sub-groups of a cp group, split once.
#include "shardlm/parallel/context_groups.h"

#include "shardlm/core/check.h"

namespace shardlm {

ContextGroups::ContextGroups(Communicator& cp, int64_t ulysses_size)
    : cp_(cp), ulysses_size_(ulysses_size) {
  const int64_t P = cp.size(), U = ulysses_size;
  SHARDLM_CHECK(U >= 1 && P % U == 0,
                "context parallelism: a Ulysses degree of {} does not divide the {} cp ranks", U,
                P);
  const int64_t R = P / U;
  const int g = int(cp.rank() / U), u = int(cp.rank() % U);
  if (U == P) {
    ulysses_ = &cp;
  } else if (U > 1) {
    ulysses_owned_ = cp.split(g, u, "ulysses");
    ulysses_ = ulysses_owned_.get();
  }
  if (R == P) {
    ring_ = &cp;
  } else if (R > 1) {
    ring_owned_ = cp.split(u, g, "ring");
    ring_ = ring_owned_.get();
  }
  // Ulysses' all-to-alls pair every member; the ring passes blocks to its neighbours.
  if (ulysses_ != nullptr) connect_all_peers(*ulysses_);
  if (ring_ != nullptr) connect_neighbours(*ring_, /*ring=*/true);
}

int64_t ContextGroups::sum_over_owned(int64_t (Communicator::*count)() const) const {
  int64_t total = 0;
  for (const auto* group : {&ulysses_owned_, &ring_owned_})
    if (*group) total += ((**group).*count)();
  return total;
}

}  // namespace shardlm
