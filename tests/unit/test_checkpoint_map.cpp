// CheckpointMap: which layers keep their tensors, where they wait, and that the slots a
// backward needs at once never collide (model/checkpoint_map.h).
#include <gtest/gtest.h>

#include <set>

#include "shardlm/core/check.h"
#include "shardlm/model/checkpoint_map.h"

namespace shardlm {
namespace {

ModelConfig layers(int n) {
  ModelConfig c = model_preset("tiny");
  c.n_layers = n;
  return c;
}

const Checkpointing kFull = Checkpointing::kFull;
const int kAll = CheckpointPlacement::kAll;

TEST(CheckpointMap, EveryLayerOnTheDeviceByDefault) {
  const CheckpointMap m(layers(6), kFull, {});
  EXPECT_EQ(m.kept_layers(), 6);
  EXPECT_EQ(m.host_layers(), 0);
  EXPECT_EQ(m.rotating_slots(), 0);
  EXPECT_EQ(m.device_slots(), 6);
  for (int l = 0; l < 6; ++l) EXPECT_EQ(m.slot(l), l);
}

TEST(CheckpointMap, AllOnTheHostTakesTwoSlots) {
  const CheckpointMap m(layers(6), kFull, {1, kAll});
  EXPECT_EQ(m.host_layers(), 6);
  EXPECT_EQ(m.device_slots(), 2);
  for (int l = 0; l < 6; ++l) {
    EXPECT_TRUE(m.on_host(l));
    EXPECT_EQ(m.slot(l), l % 2);
    EXPECT_EQ(m.host_index(l), l);
  }
}

TEST(CheckpointMap, SomeOnTheHostTheFirstOnes) {
  const CheckpointMap m(layers(6), kFull, {1, 4});
  EXPECT_EQ(m.host_layers(), 4);
  EXPECT_EQ(m.device_slots(), 2 + 2);  // layers 4 and 5 resident, two rotating
  for (int l = 0; l < 4; ++l) EXPECT_TRUE(m.on_host(l));
  EXPECT_FALSE(m.on_host(4));
  EXPECT_EQ(m.slot(4), 0);
  EXPECT_EQ(m.slot(5), 1);
  EXPECT_EQ(m.slot(0), 2);
  EXPECT_EQ(m.slot(1), 3);
}

TEST(CheckpointMap, EveryKthLayerKeepsItsInput) {
  const CheckpointMap m(layers(7), kFull, {3, 0});  // kept 0, 3, 6
  EXPECT_EQ(m.kept_layers(), 3);
  EXPECT_EQ(m.rotating_slots(), 2);  // a segment's two recomputed inputs
  EXPECT_EQ(m.device_slots(), 5);
  EXPECT_TRUE(m.kept(3));
  EXPECT_FALSE(m.kept(4));
  EXPECT_EQ(m.segment_start(5), 3);
  EXPECT_EQ(m.segment_start(6), 6);
}

TEST(CheckpointMap, FewLayersNeverGetMoreRotatingSlotsThanUseThem) {
  EXPECT_EQ(CheckpointMap(layers(1), kFull, {1, kAll}).device_slots(), 1);
  EXPECT_EQ(CheckpointMap(layers(2), kFull, {1, 1}).device_slots(), 2);  // 1 resident, 1 rotating
  EXPECT_EQ(CheckpointMap(layers(3), kFull, {4, 0}).device_slots(), 3);  // 1 kept, 2 recomputed
}

// What backward holds at once: a whole segment's inputs (none may share a slot, nor a resident
// layer's), and at the segment start's backward the next segment's start, fetched from the
// host a layer ahead: with every + 1 rotating slots it never lands in the start's own slot.
TEST(CheckpointMap, ASegmentAndThePrefetchedStartNeverShareASlot) {
  for (int n : {1, 2, 5, 8, 13})
    for (int every : {1, 2, 3, 4})
      for (int host : {0, 1, 2, 3, kAll}) {
        SCOPED_TRACE(::testing::Message() << n << " layers, every " << every << ", host " << host);
        const CheckpointMap m(layers(n), kFull, {every, host});
        std::set<int> resident;
        for (int l = 0; l < n; ++l) {
          ASSERT_GE(m.slot(l), 0);
          ASSERT_LT(m.slot(l), m.device_slots());
          if (m.kept(l) && !m.on_host(l)) {
            EXPECT_TRUE(resident.insert(m.slot(l)).second);
          }
        }
        for (int start = 0; start < n; start += every) {
          std::set<int> live = resident;
          for (int l = start; l < std::min(n, start + every); ++l)
            if (!m.kept(l) || m.on_host(l)) {
              EXPECT_TRUE(live.insert(m.slot(l)).second) << l;
            }
          const int next = start - every;
          if (next >= 0 && m.on_host(next) && m.rotating_slots() == every + 1) {
            EXPECT_NE(m.slot(next), m.slot(start)) << "prefetch of " << next;
          }
        }
      }
}

// fewest_host_checkpoints bisects on this: from one host layer on, another never adds a slot.
TEST(CheckpointMap, DeviceSlotsNeverGrowFromOneHostLayerOn) {
  for (int n : {1, 2, 3, 5, 8, 13, 32})
    for (int every : {1, 2, 3, 4}) {
      const int kept = CheckpointMap(layers(n), kFull, {every, 0}).kept_layers();
      for (int host = 1; host < kept; ++host)
        EXPECT_LE(CheckpointMap(layers(n), kFull, {every, host + 1}).device_slots(),
                  CheckpointMap(layers(n), kFull, {every, host}).device_slots())
            << n << " layers, every " << every << ", host " << host;
    }
}

TEST(CheckpointMap, RefusesWhatCannotBeRecomputed) {
  EXPECT_THROW(CheckpointMap(layers(4), Checkpointing::kSelective, {2, 0}), Error);
  EXPECT_THROW(CheckpointMap(layers(4), kFull, {0, 0}), Error);
  EXPECT_THROW(CheckpointMap(layers(4), Checkpointing::kNone, {1, 1}), Error);
}

}  // namespace
}  // namespace shardlm
