// The CUDA backend's plan cache (kernels/cuda/plan_cache.h, free of CUDA headers): a plan is
// made once per key and reused, the least recently used plan is destroyed when a new key
// arrives at capacity, a failed make() caches nothing, clear() destroys everything; every
// field of GemmKey tells plans apart; pointer alignments are powers of two up to 256.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/plan_cache.h"

namespace shardlm::cuda {
namespace {

// A plan that records its destruction, as GemmPlan releases its descriptors.
struct CountedPlan {
  int id;
  std::shared_ptr<std::vector<int>> destroyed;
  CountedPlan(int id, std::shared_ptr<std::vector<int>> log) : id(id), destroyed(std::move(log)) {}
  CountedPlan(CountedPlan&& o) noexcept : id(o.id), destroyed(std::move(o.destroyed)) {}
  ~CountedPlan() {
    if (destroyed) destroyed->push_back(id);
  }
};

TEST(PlanCache, MakesOncePerKeyAndEvictsTheLeastRecentlyUsed) {
  auto destroyed = std::make_shared<std::vector<int>>();
  PlanCache<int, CountedPlan> cache(3);
  int made = 0;
  auto get = [&](int key) {
    return cache
        .get(key,
             [&] {
               ++made;
               return CountedPlan(key, destroyed);
             })
        .id;
  };
  EXPECT_EQ(get(1), 1);
  EXPECT_EQ(get(2), 2);
  EXPECT_EQ(get(3), 3);
  EXPECT_EQ(get(1), 1);  // a hit: 1 is now the most recent, 2 the least
  EXPECT_EQ(made, 3);
  EXPECT_EQ(cache.hits(), 1u);
  EXPECT_TRUE(destroyed->empty());
  EXPECT_EQ(get(4), 4);  // at capacity: 2 goes
  EXPECT_EQ(*destroyed, std::vector<int>{2});
  EXPECT_EQ(cache.size(), 3u);
  EXPECT_FALSE(cache.contains(2));
  EXPECT_TRUE(cache.contains(1) && cache.contains(3) && cache.contains(4));
  EXPECT_EQ(get(2), 2);  // made again; 3 is now the least recent
  EXPECT_EQ((*destroyed)[1], 3);
  EXPECT_EQ(cache.misses(), 5u);
  EXPECT_EQ(cache.evictions(), 2u);
  cache.clear();
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(destroyed->size(), 5u);  // every plan released exactly once
}

TEST(PlanCache, AFailedMakeCachesNothingAndEvictsNothing) {
  auto destroyed = std::make_shared<std::vector<int>>();
  PlanCache<int, CountedPlan> cache(1);
  cache.get(1, [&] { return CountedPlan(1, destroyed); });
  EXPECT_THROW(cache.get(2, []() -> CountedPlan { throw std::runtime_error("no algorithm"); }),
               std::runtime_error);
  EXPECT_TRUE(cache.contains(1));
  EXPECT_FALSE(cache.contains(2));
  EXPECT_TRUE(destroyed->empty());
}

TEST(GemmKey, EveryFieldTellsPlansApart) {
  const GemmKey base{.trans_a = true,
                     .m = 64,
                     .n = 32,
                     .k = 16,
                     .lda = 16,
                     .ldb = 16,
                     .ldc = 64,
                     .align_a = 256,
                     .align_b = 256,
                     .align_c = 256,
                     .align_d = 256};
  std::vector<GemmKey> variants(18, base);
  variants[0].trans_a = false;
  variants[1].trans_b = true;
  variants[2].m = 65;
  variants[3].n = 33;
  variants[4].k = 17;
  variants[5].a_type = 1;
  variants[6].b_type = 1;
  variants[7].c_type = 1;
  variants[8].lda = 17;
  variants[9].ldb = 17;
  variants[10].ldc = 65;
  variants[11].bias = true;
  variants[12].beta_zero = true;
  variants[13].c_apart = true;
  variants[14].align_a = 16;
  variants[15].align_b = 16;
  variants[16].align_c = 16;
  variants[17].align_d = 16;
  PlanCache<GemmKey, int, GemmKeyHash> cache(64);
  cache.get(base, [] { return 0; });
  for (size_t i = 0; i < variants.size(); ++i) {
    EXPECT_FALSE(variants[i] == base) << "variant " << i;
    EXPECT_FALSE(cache.contains(variants[i])) << "variant " << i << " found the base's plan";
    cache.get(variants[i], [i] { return int(i) + 1; });
  }
  EXPECT_EQ(cache.size(), variants.size() + 1);
  GemmKey same = base;
  EXPECT_EQ(cache.get(same, [] { return -1; }), 0);  // an equal key finds the base's plan
}

TEST(GemmKey, PointerAlignmentIsAPowerOfTwoUpTo256) {
  alignas(512) static unsigned char buf[1024];
  EXPECT_EQ(pointer_alignment(buf), 256u);
  EXPECT_EQ(pointer_alignment(buf + 256), 256u);
  EXPECT_EQ(pointer_alignment(buf + 128), 128u);
  EXPECT_EQ(pointer_alignment(buf + 2), 2u);
  EXPECT_EQ(pointer_alignment(buf + 6), 2u);
  EXPECT_EQ(pointer_alignment(buf + 1), 1u);
  EXPECT_EQ(pointer_alignment(buf + 48), 16u);
  EXPECT_EQ(pointer_alignment(nullptr), 256u);
}

}  // namespace
}  // namespace shardlm::cuda
