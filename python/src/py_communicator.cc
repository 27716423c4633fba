#include "py_communicator.h"

#include <pybind11/stl.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace cairn::python {
namespace {

class PyCommunicator final : public Communicator {
 public:
  PyCommunicator(py::object impl, int rank, int size, std::string kind)
      : impl_(std::move(impl)), rank_(rank), size_(size),
        kind_(std::move(kind)) {}

  ~PyCommunicator() override {
    // The last reference may go from a thread without the GIL.
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view kind() const override { return kind_; }

  absl::Status Barrier() override {
    return Call("barrier", [&] { impl_.attr("barrier")(); });
  }

  absl::Status Broadcast(std::string& data, int root) override {
    return Call("broadcast", [&] {
      py::object out = impl_.attr("broadcast")(py::bytes(data), root);
      data = py::cast<std::string>(out);
    });
  }

  absl::StatusOr<std::vector<std::string>> Gather(std::string_view data,
                                                  int root) override {
    std::vector<std::string> out;
    absl::Status s = Call("gather", [&] {
      out = py::cast<std::vector<std::string>>(
          impl_.attr("gather")(py::bytes(data.data(), data.size()), root));
    });
    if (!s.ok()) return s;
    if (rank_ == root && static_cast<int>(out.size()) != size_) {
      return Broken("gather", absl::StrCat("returned ", out.size(),
                                           " buffers for ", size_, " ranks"));
    }
    return out;
  }

  absl::StatusOr<std::vector<std::string>> AllGather(
      std::string_view data) override {
    std::vector<std::string> out;
    absl::Status s = Call("all_gather", [&] {
      out = py::cast<std::vector<std::string>>(
          impl_.attr("all_gather")(py::bytes(data.data(), data.size())));
    });
    if (!s.ok()) return s;
    if (static_cast<int>(out.size()) != size_) {
      return Broken("all_gather", absl::StrCat("returned ", out.size(),
                                               " buffers for ", size_, " ranks"));
    }
    return out;
  }

  absl::StatusOr<std::string> Scatter(const std::vector<std::string>& data,
                                      int root) override {
    if (rank_ == root && static_cast<int>(data.size()) != size_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Scatter: root passed ", data.size(), " buffers for ", size_,
          " ranks"));
    }
    std::string out;
    absl::Status s = Call("scatter", [&] {
      py::object arg = py::none();
      if (rank_ == root) {
        py::list l;
        for (const std::string& d : data) l.append(py::bytes(d));
        arg = l;
      }
      out = py::cast<std::string>(impl_.attr("scatter")(arg, root));
    });
    if (!s.ok()) return s;
    return out;
  }

  absl::Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    const char* name = op == ReduceOp::kSum ? "sum"
                       : op == ReduceOp::kMin ? "min"
                                              : "max";
    return Call("all_reduce", [&] {
      std::vector<int64_t> in(values.begin(), values.end());
      auto out = py::cast<std::vector<int64_t>>(
          impl_.attr("all_reduce")(in, name));
      if (out.size() != values.size()) {
        throw std::runtime_error(absl::StrCat("returned ", out.size(),
                                              " values for ", values.size()));
      }
      std::copy(out.begin(), out.end(), values.begin());
    });
  }

  absl::Status BroadcastBytes(std::span<std::byte> data, int root) override {
    return Call("broadcast_into", [&] {
      py::memoryview view = py::memoryview::from_memory(
          data.data(), static_cast<py::ssize_t>(data.size()),
          /*readonly=*/false);
      impl_.attr("broadcast_into")(view, root);
      view.attr("release")();
    });
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color,
                                                      int key) override {
    py::object child;
    absl::Status s = Call("split", [&] {
      child = impl_.attr("split")(color, key);
    });
    if (!s.ok()) return s;
    py::gil_scoped_acquire gil;
    return MakePyCommunicator(std::move(child));
  }

 private:
  // Runs `fn` with the GIL; a Python exception (or a C++ one from a cast)
  // becomes a status and breaks the communicator.
  template <typename Fn>
  absl::Status Call(const char* method, Fn&& fn) {
    if (!broken_.ok()) return broken_;
    py::gil_scoped_acquire gil;
    try {
      fn();
      return absl::OkStatus();
    } catch (py::error_already_set& e) {
      const bool timeout = e.matches(PyExc_TimeoutError);
      std::string what = e.what();
      broken_ = timeout
                    ? absl::DeadlineExceededError(absl::StrCat(
                          kind_, " communicator, rank ", rank_, ": ", method,
                          " timed out: ", what))
                    : absl::AbortedError(absl::StrCat(
                          kind_, " communicator, rank ", rank_, ": ", method,
                          " failed: ", what));
      return broken_;
    } catch (const std::exception& e) {
      return Broken(method, e.what());
    }
  }

  absl::Status Broken(const char* method, const std::string& what) {
    broken_ = absl::AbortedError(absl::StrCat(
        kind_, " communicator, rank ", rank_, ": ", method, " failed: ", what));
    return broken_;
  }

  py::object impl_;
  const int rank_;
  const int size_;
  const std::string kind_;
  absl::Status broken_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakePyCommunicator(
    py::object impl) {
  try {
    const int rank = py::cast<int>(impl.attr("rank")());
    const int size = py::cast<int>(impl.attr("size")());
    std::string kind = "python";
    if (py::hasattr(impl, "kind")) kind = py::cast<std::string>(impl.attr("kind")());
    if (size < 1 || rank < 0 || rank >= size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "communicator reports rank ", rank, " of size ", size));
    }
    return std::unique_ptr<Communicator>(
        new PyCommunicator(std::move(impl), rank, size, std::move(kind)));
  } catch (py::error_already_set& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a communicator: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a communicator: ", e.what()));
  }
}

}  // namespace cairn::python
