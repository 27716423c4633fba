// A Communicator for tests that forwards every call to another and counts
// them: how many collectives an operation takes, and how much its
// broadcasts and gathers move.
#ifndef CAIRN_COMM_COUNTING_COMMUNICATOR_H_
#define CAIRN_COMM_COUNTING_COMMUNICATOR_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/communicator.h"

namespace cairn::testing_util {

// Forwards every call; counts the collectives (`calls`) and records the
// sizes BroadcastBytes and Gather move.
class CountingCommunicator : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view kind() const override { return inner_.kind(); }
  absl::Status Barrier() override {
    ++calls;
    return inner_.Barrier();
  }
  absl::Status Broadcast(std::string& data, int root) override {
    ++calls;
    return inner_.Broadcast(data, root);
  }
  absl::StatusOr<std::vector<std::string>> Gather(std::string_view data,
                                                  int root) override {
    ++calls;
    ++gathers;
    max_gather_bytes = std::max(max_gather_bytes, data.size());
    return inner_.Gather(data, root);
  }
  absl::StatusOr<std::vector<std::string>> AllGather(
      std::string_view data) override {
    ++calls;
    return inner_.AllGather(data);
  }
  absl::StatusOr<std::string> Scatter(const std::vector<std::string>& data,
                                      int root) override {
    ++calls;
    return inner_.Scatter(data, root);
  }
  absl::Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    ++calls;
    return inner_.AllReduce(values, op);
  }
  absl::Status BroadcastBytes(std::span<std::byte> data, int root) override {
    ++calls;
    ++broadcasts;
    broadcast_roots.push_back(root);
    max_broadcast_bytes = std::max(max_broadcast_bytes, data.size());
    total_broadcast_bytes += data.size();
    return inner_.BroadcastBytes(data, root);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color,
                                                      int key) override {
    ++calls;
    return inner_.Split(color, key);
  }

  int calls = 0;  // collectives of any kind
  int broadcasts = 0;
  std::vector<int> broadcast_roots;  // of each BroadcastBytes
  size_t max_broadcast_bytes = 0;
  size_t total_broadcast_bytes = 0;
  int gathers = 0;
  size_t max_gather_bytes = 0;

 private:
  Communicator& inner_;
};

}  // namespace cairn::testing_util

#endif  // CAIRN_COMM_COUNTING_COMMUNICATOR_H_
