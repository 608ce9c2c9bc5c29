// The communication thread of ZeRO (comm_worker.h).
#include "comm_worker.h"

#include <chrono>

namespace shardlm {

CommWorker::CommWorker(bool threaded) : threaded_(threaded) {
  if (threaded_) thread_ = std::thread([this] { loop(); });
}

CommWorker::~CommWorker() {
  if (!threaded_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_work_.notify_all();
  thread_.join();
}

void CommWorker::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything submitted has run
    std::function<void()> op = std::move(queue_.front());
    queue_.pop_front();
    const bool failed = error_ != nullptr;
    lock.unlock();
    std::exception_ptr err;
    if (!failed) {  // after a failure the group is unusable: later ops are dropped
      try {
        op();
      } catch (...) {
        err = std::current_exception();
      }
    }
    lock.lock();
    if (err && !error_) error_ = err;
    ++completed_;
    cv_done_.notify_all();
  }
}

CommWorker::Ticket CommWorker::submit(std::function<void()> op) {
  if (!threaded_) {
    // Inline: the whole op is time the compute thread spends on communication.
    if (error_) std::rethrow_exception(error_);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      op();
      wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
    completed_ = ++submitted_;
    return submitted_;
  }
  std::lock_guard<std::mutex> lock(mu_);
  queue_.push_back(std::move(op));
  cv_work_.notify_one();
  return ++submitted_;
}

bool CommWorker::done(Ticket t) {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ >= t;
}

void CommWorker::wait(Ticket t) {
  std::unique_lock<std::mutex> lock(mu_);
  if (completed_ < t) {
    const auto t0 = std::chrono::steady_clock::now();
    cv_done_.wait(lock, [&] { return completed_ >= t; });
    wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (error_) std::rethrow_exception(error_);
}

}  // namespace shardlm
