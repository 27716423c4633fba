// LocalCommunicator: the one-rank job. Every collective is the identity, but
// arguments are still checked so that code tested on one rank fails the same
// way it would on many.
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_format.h"
#include "cairn/communicator.h"
#include "comm/checks.h"
#include "core/status.h"

namespace cairn {
namespace internal_comm {
namespace {

class LocalComm final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view kind() const override { return "local"; }

  absl::Status Barrier() override { return absl::OkStatus(); }

  absl::Status Broadcast(std::string& data, int root) override {
    return CheckRoot(root, 1, Context("Broadcast"));
  }

  absl::StatusOr<std::vector<std::string>> Gather(std::string_view data,
                                                  int root) override {
    CAIRN_RETURN_IF_ERROR(CheckRoot(root, 1, Context("Gather")));
    return std::vector<std::string>{std::string(data)};
  }

  absl::StatusOr<std::vector<std::string>> AllGather(
      std::string_view data) override {
    return std::vector<std::string>{std::string(data)};
  }

  absl::StatusOr<std::string> Scatter(const std::vector<std::string>& data,
                                      int root) override {
    CAIRN_RETURN_IF_ERROR(CheckRoot(root, 1, Context("Scatter")));
    if (data.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: root passed %d buffers for 1 rank",
                          Context("Scatter"), data.size()));
    }
    return data[0];
  }

  absl::Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    return absl::OkStatus();
  }

  absl::Status BroadcastBytes(std::span<std::byte> data, int root) override {
    return CheckRoot(root, 1, Context("BroadcastBytes"));
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color,
                                                      int key) override {
    return std::unique_ptr<Communicator>(std::make_unique<LocalComm>());
  }

 private:
  static std::string Context(std::string_view op) {
    return OpContext("local", op, 0, 1);
  }
};

}  // namespace
}  // namespace internal_comm

std::unique_ptr<Communicator> LocalCommunicator() {
  return std::make_unique<internal_comm::LocalComm>();
}

}  // namespace cairn
