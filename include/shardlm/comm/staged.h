// StagedCommunicator: the collectives and transfers of a host communicator (MPI, TCP) on tensors in
// device memory, copied through a bounded host staging buffer, chunk by chunk. With it several
// ranks may share one GPU (NCCL refuses that), so every parallel path's device code runs on a
// single GPU. The comm layer names no backend: the device copies go through DeviceCopier,
// which the caller implements over its Backend, and the staging memory is the caller's (a
// Buffer it allocated through its ledger).
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "shardlm/comm/communicator.h"

namespace shardlm {

// The device side of staging.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  // dst <- src, same bytes, any pools (a Backend::copy): after the device work queued so far,
  // and finished when it returns whenever either side is in the host pool.
  virtual void copy(const Tensor& src, const Tensor& dst) = 0;
};

class StagingEngine;

// Tensors in the host pool pass straight through to the host communicator (no copy, no chunks).
// An op with a tensor in the device pool is staged: the staging buffer is cut into kSlots slots
// and each op in progress holds one; it runs in chunks that fit its slot (a collective's chunk
// holds every rank's piece: all_to_all 2 x size pieces, reduce_scatter size + 1, all_gather
// size), each copied in, moved by the host communicator and copied out. Chunk boundaries
// depend only on the slot size, the dtype and the group size, so they agree on every rank;
// every member of a collective, and both ends of a transfer, must pass tensors of the same pool
// (as the engine does: the same code runs on every rank).
//
// Staged collectives finish before they return (their handles are complete). Staged sends and
// receives return at once; their chunks advance whenever any op of this communicator family
// (the world and its splits) is waited for or tested, so a send left in flight never waits for
// its own handle to be polled (pipeline stages send ahead and then block in a receive).
// Transfers on one (peer, tag, direction) keep their order: a later one starts after the
// earlier has finished. More than kSlots staged ops at once wait for a slot in start order.
class StagedCommunicator final : public Communicator {
 public:
  static constexpr int kSlots = 8;

  // A communicator over the same ranks as `host`, named as it: owned, or borrowed (then `host`
  // must outlive it and its splits; the splits own their host splits).
  explicit StagedCommunicator(std::unique_ptr<Communicator> host);
  explicit StagedCommunicator(Communicator& host);
  ~StagedCommunicator() override;

  // Gives this communicator and every one split from it (before or after) the device copies
  // and the staging memory (kSlots slots of staging.size() / kSlots bytes, each a multiple of 8),
  // which must outlive their use; until then a staged op fails. detach() takes them back (no
  // op may be in flight).
  void attach(DeviceCopier& copier, std::span<std::byte> staging);
  void detach();
  // Bytes of one slot for `staging_bytes` of staging memory (what attach() uses).
  static size_t slot_bytes(size_t staging_bytes);

  // "<host backend>-staged": "mpi-staged", "tcp-staged".
  std::string_view backend() const override { return backend_name_; }
  int local_rank() const override { return host_->local_rank(); }
  int local_size() const override { return host_->local_size(); }
  [[noreturn]] void abort(int exit_code) override;

 protected:
  std::unique_ptr<CommHandle> start_all_reduce(const Tensor& buf, ReduceOp op) override;
  std::unique_ptr<CommHandle> start_reduce_scatter(const Tensor& send, const Tensor& recv,
                                                   ReduceOp op) override;
  std::unique_ptr<CommHandle> start_all_gather(const Tensor& send, const Tensor& recv,
                                               bool in_place) override;
  std::unique_ptr<CommHandle> start_all_to_all(const Tensor& send, const Tensor& recv) override;
  std::unique_ptr<CommHandle> start_broadcast(const Tensor& buf, int root) override;
  std::unique_ptr<CommHandle> start_send(const Tensor& buf, int peer, int tag) override;
  std::unique_ptr<CommHandle> start_recv(const Tensor& buf, int peer, int tag) override;
  std::unique_ptr<CommHandle> start_barrier() override;
  std::unique_ptr<Communicator> split_impl(int color, int key, std::string name) override;
  // Size-1 groups: a device copy through the copier (memcpy for two host tensors).
  void copy_local(const Tensor& dst, const Tensor& src) override;

 private:
  StagedCommunicator(std::unique_ptr<Communicator> host, std::shared_ptr<StagingEngine> engine);
  // A send or receive of a device tensor, registered with the engine.
  std::unique_ptr<CommHandle> start_transfer(const Tensor& buf, int peer, int tag, bool is_send);

  std::unique_ptr<Communicator> owned_host_;
  Communicator* host_ = nullptr;
  std::shared_ptr<StagingEngine> engine_;  // shared with the splits
  std::string backend_name_;
};

}  // namespace shardlm
