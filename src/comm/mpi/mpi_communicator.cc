// The Open MPI communicator: the only translation unit of the library that
// includes <mpi.h>.
//
// Every communicator works on its own duplicate of the application's MPI
// communicator (so cairn's messages never match the application's receives),
// with MPI_ERRORS_RETURN set on it, so that an MPI failure is a Status
// naming the MPI call instead of an abort.
//
// Variable-size collectives send sizes first (int64), then bytes with the
// v-variants. Those take int counts and displacements, so Gather, AllGather
// and Scatter refuse, with kInvalidArgument on every rank, a buffer or a
// total larger than INT_MAX bytes: they carry plans and statuses. Large data
// goes through Broadcast or BroadcastBytes, which have no limit and move
// bytes in pieces of at most 256 MiB.
//
// Where a mistake on one rank could otherwise hang or crash the others, the
// ranks first agree on the arguments (AllReduce's length, BroadcastBytes'
// size and root, Gather's root) and all return the same error. Broadcast and
// Scatter check their root only locally: ranks passing different roots to
// them is a bug MPI itself cannot report.
#include "comm/mpi/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "cairn/communicator.h"
#include "comm/checks.h"
#include "comm/timeout.h"
#include "core/checked.h"
#include "core/status.h"

namespace cairn {
namespace internal_comm {
namespace {

using internal_core::AsAbsl;

// Held around every MPI call cairn makes when MPI provides only
// MPI_THREAD_SERIALIZED. Never destroyed: communicators may be destroyed
// during static destruction.
std::mutex& SerializedMpiMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

const char* ThreadLevelName(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown MPI thread level";
}

// The mutex every MPI call must hold (nullptr: none needed), or why cairn
// cannot use MPI as it is.
absl::StatusOr<std::mutex*> MpiSerializer() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    return absl::FailedPreconditionError("MPI has already been finalized");
  }
  if (!initialized) {
    return absl::FailedPreconditionError(
        "MPI is not initialized (initialize it first, or use "
        "MpiWorldCommunicator, which does)");
  }
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  if (provided >= MPI_THREAD_MULTIPLE) return nullptr;
  if (provided == MPI_THREAD_SERIALIZED) return &SerializedMpiMutex();
  return absl::FailedPreconditionError(absl::StrFormat(
      "MPI was initialized with %s; cairn calls MPI from its own threads "
      "and needs MPI_THREAD_SERIALIZED at least (MPI_THREAD_MULTIPLE to use "
      "several communicators at once)",
      ThreadLevelName(provided)));
}

std::unique_lock<std::mutex> LockIf(std::mutex* mu) {
  return mu == nullptr ? std::unique_lock<std::mutex>()
                       : std::unique_lock<std::mutex>(*mu);
}

MPI_Op MpiOpFor(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return MPI_SUM;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
  }
  return MPI_OP_NULL;
}

// Scatter's per-rank header: {bytes, 0}, or one of these markers in every
// rank's entry when root's arguments are wrong, with a detail.
constexpr int64_t kScatterWrongCount = -1;  // detail: buffers root passed
constexpr int64_t kScatterTooLarge = -2;    // detail: bytes root passed

class MpiComm final : public Communicator {
 public:
  // Takes ownership of `comm`.
  MpiComm(MPI_Comm comm, int rank, int size, std::mutex* serializer,
          const MpiOptions& options)
      : comm_(comm),
        rank_(rank),
        size_(size),
        serializer_(serializer),
        options_(options) {
    options_.max_piece_bytes =
        std::clamp<int64_t>(options_.max_piece_bytes, 1, INT_MAX);
    options_.max_gather_bytes =
        std::clamp<int64_t>(options_.max_gather_bytes, 0, INT_MAX);
  }

  ~MpiComm() override {
    // After MPI_Finalize (e.g. a communicator destroyed during static
    // destruction) the duplicate is gone with MPI and no call is allowed.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    std::unique_lock<std::mutex> lock = LockIf(serializer_);
    MPI_Comm_free(&comm_);
  }

  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  MPI_Comm handle() const { return comm_; }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view kind() const override { return "mpi"; }

  absl::Status Barrier() override {
    return Call("Barrier", "MPI_Barrier", [&] { return MPI_Barrier(comm_); });
  }

  absl::Status Broadcast(std::string& data, int root) override {
    CAIRN_RETURN_IF_ERROR(CheckRoot(root, size_, Context("Broadcast")));
    int64_t bytes = static_cast<int64_t>(data.size());
    CAIRN_RETURN_IF_ERROR(Call("Broadcast", "MPI_Bcast", [&] {
      return MPI_Bcast(&bytes, 1, MPI_INT64_T, root, comm_);
    }));
    if (rank_ != root) data.resize(static_cast<size_t>(bytes));
    return BroadcastPieces(data.data(), bytes, root, "Broadcast");
  }

  absl::StatusOr<std::vector<std::string>> Gather(std::string_view data,
                                                  int root) override {
    // Everyone learns every size (and root), so that every rank reaches the
    // same verdict on the limits and the roots before any bytes move.
    std::vector<int64_t> sizes;
    std::vector<int64_t> roots;
    CAIRN_RETURN_IF_ERROR(ExchangeHeader(
        "Gather", static_cast<int64_t>(data.size()), root, sizes, roots));
    for (int r = 1; r < size_; ++r) {
      if (roots[r] != roots[0]) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: ranks passed different roots (rank 0 passed %d, rank %d "
            "passed %d)",
            Context("Gather"), roots[0], r, roots[r]));
      }
    }
    CAIRN_RETURN_IF_ERROR(CheckRoot(root, size_, Context("Gather")));
    std::vector<int> counts;
    std::vector<int> displacements;
    CAIRN_ASSIGN_OR_RETURN(
        const int64_t total,
        Layout(sizes, "Gather", "root receives", counts, displacements));
    std::unique_ptr<char[]> received;
    if (rank_ == root) {
      received = std::make_unique_for_overwrite<char[]>(total);
    }
    CAIRN_RETURN_IF_ERROR(Call("Gather", "MPI_Gatherv", [&] {
      return MPI_Gatherv(data.data(), static_cast<int>(data.size()), MPI_BYTE,
                         received.get(), counts.data(), displacements.data(),
                         MPI_BYTE, root, comm_);
    }));
    if (rank_ != root) return std::vector<std::string>();
    return Unpack(received.get(), counts, displacements);
  }

  absl::StatusOr<std::vector<std::string>> AllGather(
      std::string_view data) override {
    std::vector<int64_t> sizes;
    std::vector<int64_t> roots;
    CAIRN_RETURN_IF_ERROR(ExchangeHeader(
        "AllGather", static_cast<int64_t>(data.size()), 0, sizes, roots));
    std::vector<int> counts;
    std::vector<int> displacements;
    CAIRN_ASSIGN_OR_RETURN(const int64_t total,
                           Layout(sizes, "AllGather", "each rank receives",
                                  counts, displacements));
    auto received = std::make_unique_for_overwrite<char[]>(total);
    CAIRN_RETURN_IF_ERROR(Call("AllGather", "MPI_Allgatherv", [&] {
      return MPI_Allgatherv(data.data(), static_cast<int>(data.size()),
                            MPI_BYTE, received.get(), counts.data(),
                            displacements.data(), MPI_BYTE, comm_);
    }));
    return Unpack(received.get(), counts, displacements);
  }

  absl::StatusOr<std::string> Scatter(const std::vector<std::string>& data,
                                      int root) override {
    const std::string context = Context("Scatter");
    CAIRN_RETURN_IF_ERROR(CheckRoot(root, size_, context));
    // Root tells each rank its size, or that root's arguments are wrong, in
    // one MPI_Scatter; so a mistake at root is an error everywhere.
    std::vector<int64_t> headers;
    std::vector<int> counts;
    std::vector<int> displacements;
    std::string concatenated;
    absl::Status root_error;
    if (rank_ == root) {
      headers.resize(2 * size_);
      if (data.size() != static_cast<size_t>(size_)) {
        root_error = absl::InvalidArgumentError(
            absl::StrFormat("%s: root %d passed %d buffers for %d ranks",
                            context, root, data.size(), size_));
        for (int r = 0; r < size_; ++r) {
          headers[2 * r] = kScatterWrongCount;
          headers[2 * r + 1] = static_cast<int64_t>(data.size());
        }
      } else {
        std::vector<int64_t> sizes(size_);
        int64_t total = 0;
        for (int r = 0; r < size_; ++r) {
          sizes[r] = static_cast<int64_t>(data[r].size());
          total += sizes[r];
        }
        absl::StatusOr<int64_t> layout =
            Layout(sizes, "Scatter", "root sends", counts, displacements);
        for (int r = 0; r < size_; ++r) {
          headers[2 * r] = layout.ok() ? sizes[r] : kScatterTooLarge;
          headers[2 * r + 1] = layout.ok() ? 0 : total;
        }
        if (!layout.ok()) {
          root_error = layout.status();
        } else {
          concatenated.reserve(static_cast<size_t>(total));
          for (const std::string& d : data) concatenated += d;
        }
      }
    }
    int64_t header[2] = {0, 0};
    CAIRN_RETURN_IF_ERROR(Call("Scatter", "MPI_Scatter", [&] {
      return MPI_Scatter(headers.data(), 2, MPI_INT64_T, header, 2, MPI_INT64_T,
                         root, comm_);
    }));
    if (!root_error.ok()) return root_error;
    if (header[0] == kScatterWrongCount) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: root %d passed %d buffers for %d ranks", context,
                          root, header[1], size_));
    }
    if (header[0] == kScatterTooLarge) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: root %d passed %d bytes in all, more than the %d bytes "
          "Scatter can move (use BroadcastBytes for large data)",
          context, root, header[1], options_.max_gather_bytes));
    }
    std::string result(static_cast<size_t>(header[0]), '\0');
    CAIRN_RETURN_IF_ERROR(Call("Scatter", "MPI_Scatterv", [&] {
      return MPI_Scatterv(concatenated.data(), counts.data(),
                          displacements.data(), MPI_BYTE, result.data(),
                          static_cast<int>(result.size()), MPI_BYTE, root,
                          comm_);
    }));
    return result;
  }

  absl::Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    const int64_t length = static_cast<int64_t>(values.size());
    int64_t range[2] = {length, -length};  // becomes {max, -min}
    CAIRN_RETURN_IF_ERROR(Call("AllReduce", "MPI_Allreduce", [&] {
      return MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT64_T, MPI_MAX, comm_);
    }));
    if (range[0] != -range[1]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: every rank must pass the same number of values (this rank "
          "passed %d; ranks passed from %d to %d)",
          Context("AllReduce"), length, -range[1], range[0]));
    }
    const int64_t piece = std::max<int64_t>(
        1, options_.max_piece_bytes / static_cast<int64_t>(sizeof(int64_t)));
    for (int64_t offset = 0; offset < length; offset += piece) {
      const int count = static_cast<int>(std::min(piece, length - offset));
      CAIRN_RETURN_IF_ERROR(Call("AllReduce", "MPI_Allreduce", [&] {
        return MPI_Allreduce(MPI_IN_PLACE, values.data() + offset, count,
                             MPI_INT64_T, MpiOpFor(op), comm_);
      }));
    }
    return absl::OkStatus();
  }

  absl::Status BroadcastBytes(std::span<std::byte> data, int root) override {
    const int64_t bytes = static_cast<int64_t>(data.size());
    // {max size, -min size, max root, -min root}
    int64_t agree[4] = {bytes, -bytes, root, -static_cast<int64_t>(root)};
    CAIRN_RETURN_IF_ERROR(Call("BroadcastBytes", "MPI_Allreduce", [&] {
      return MPI_Allreduce(MPI_IN_PLACE, agree, 4, MPI_INT64_T, MPI_MAX, comm_);
    }));
    if (agree[2] != -agree[3]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: ranks passed different roots (this rank passed %d; ranks "
          "passed from %d to %d)",
          Context("BroadcastBytes"), root, -agree[3], agree[2]));
    }
    CAIRN_RETURN_IF_ERROR(CheckRoot(root, size_, Context("BroadcastBytes")));
    if (agree[0] != -agree[1]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: every rank must pass the same buffer size (this rank passed "
          "%d bytes; ranks passed from %d to %d)",
          Context("BroadcastBytes"), bytes, -agree[1], agree[0]));
    }
    return BroadcastPieces(data.data(), bytes, root, "BroadcastBytes");
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color,
                                                      int key) override {
    // MPI_Comm_split takes only non-negative colors; the contract takes any
    // int. So the ranks share their colors and split by each color's index
    // among the distinct ones, which groups and orders ranks the same way.
    int64_t mine[2] = {color, key};
    std::vector<int64_t> all(2 * size_);
    CAIRN_RETURN_IF_ERROR(Call("Split", "MPI_Allgather", [&] {
      return MPI_Allgather(mine, 2, MPI_INT64_T, all.data(), 2, MPI_INT64_T,
                           comm_);
    }));
    std::vector<int64_t> colors;
    colors.reserve(size_);
    for (int r = 0; r < size_; ++r) colors.push_back(all[2 * r]);
    std::sort(colors.begin(), colors.end());
    colors.erase(std::unique(colors.begin(), colors.end()), colors.end());
    const int index = static_cast<int>(
        std::lower_bound(colors.begin(), colors.end(), color) - colors.begin());
    MPI_Comm split = MPI_COMM_NULL;
    CAIRN_RETURN_IF_ERROR(Call("Split", "MPI_Comm_split", [&] {
      return MPI_Comm_split(comm_, index, key, &split);
    }));
    // The new communicator is already cairn's own: no duplicate needed.
    int new_rank = 0;
    int new_size = 0;
    absl::Status status = Call("Split", "MPI_Comm_set_errhandler", [&] {
      int rc = MPI_Comm_set_errhandler(split, MPI_ERRORS_RETURN);
      if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(split, &new_rank);
      if (rc == MPI_SUCCESS) rc = MPI_Comm_size(split, &new_size);
      return rc;
    });
    if (!status.ok()) {
      std::unique_lock<std::mutex> lock = LockIf(serializer_);
      MPI_Comm_free(&split);
      return status;
    }
    return std::unique_ptr<Communicator>(std::make_unique<MpiComm>(
        split, new_rank, new_size, serializer_, options_));
  }

 private:
  std::string Context(std::string_view op) const {
    return OpContext("mpi", op, rank_, size_);
  }

  // One MPI call (returning an MPI error code), under the serialization
  // mutex when MPI needs it.
  template <typename F>
  absl::Status Call(std::string_view op, std::string_view mpi_function, F&& f) {
    std::unique_lock<std::mutex> lock = LockIf(serializer_);
    const int rc = f();
    if (rc == MPI_SUCCESS) return absl::OkStatus();
    return internal_core::Annotate(MpiErrorToStatus(rc, mpi_function),
                                   Context(op));
  }

  // MPI_Bcast of `bytes` bytes at `data` in pieces of at most
  // max_piece_bytes (MPI counts are ints).
  absl::Status BroadcastPieces(void* data, int64_t bytes, int root,
                               std::string_view op) {
    char* p = static_cast<char*>(data);
    for (int64_t offset = 0; offset < bytes;
         offset += options_.max_piece_bytes) {
      const int count =
          static_cast<int>(std::min(options_.max_piece_bytes, bytes - offset));
      CAIRN_RETURN_IF_ERROR(Call(op, "MPI_Bcast", [&] {
        return MPI_Bcast(p + offset, count, MPI_BYTE, root, comm_);
      }));
    }
    return absl::OkStatus();
  }

  // MPI_Allgather of (size, root) from every rank.
  absl::Status ExchangeHeader(std::string_view op, int64_t size, int root,
                              std::vector<int64_t>& sizes,
                              std::vector<int64_t>& roots) {
    int64_t mine[2] = {size, root};
    std::vector<int64_t> all(2 * size_);
    CAIRN_RETURN_IF_ERROR(Call(op, "MPI_Allgather", [&] {
      return MPI_Allgather(mine, 2, MPI_INT64_T, all.data(), 2, MPI_INT64_T,
                           comm_);
    }));
    sizes.resize(size_);
    roots.resize(size_);
    for (int r = 0; r < size_; ++r) {
      sizes[r] = all[2 * r];
      roots[r] = all[2 * r + 1];
    }
    return absl::OkStatus();
  }

  // The int counts and displacements of `sizes` laid end to end, and their
  // total; kInvalidArgument past max_gather_bytes. A pure function of
  // `sizes`, so every rank that knows them reaches the same verdict.
  absl::StatusOr<int64_t> Layout(const std::vector<int64_t>& sizes,
                                 std::string_view op, std::string_view who,
                                 std::vector<int>& counts,
                                 std::vector<int>& displacements) const {
    const int64_t limit = options_.max_gather_bytes;
    int64_t total = 0;
    for (size_t r = 0; r < sizes.size(); ++r) {
      if (sizes[r] > limit) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: rank %d's buffer is %d bytes, more than the %d bytes %s can "
            "move (use BroadcastBytes for large data)",
            Context(op), r, sizes[r], limit, AsAbsl(op)));
      }
      total += sizes[r];  // cannot overflow: each size is at most INT_MAX
    }
    if (total > limit) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s %d bytes in all, more than the %d bytes %s can move (use "
          "BroadcastBytes for large data)",
          Context(op), AsAbsl(who), total, limit, AsAbsl(op)));
    }
    counts.resize(sizes.size());
    displacements.resize(sizes.size());
    int64_t offset = 0;
    for (size_t r = 0; r < sizes.size(); ++r) {
      counts[r] = static_cast<int>(sizes[r]);
      displacements[r] = static_cast<int>(offset);
      offset += sizes[r];
    }
    return total;
  }

  // The received bytes, one string per rank.
  static std::vector<std::string> Unpack(
      const char* received, const std::vector<int>& counts,
      const std::vector<int>& displacements) {
    std::vector<std::string> result;
    result.reserve(counts.size());
    for (size_t r = 0; r < counts.size(); ++r) {
      result.emplace_back(received + displacements[r], counts[r]);
    }
    return result;
  }

  MPI_Comm comm_;
  const int rank_;
  const int size_;
  std::mutex* const serializer_;  // null under MPI_THREAD_MULTIPLE
  MpiOptions options_;
};

// Finalizes MPI at process exit if cairn initialized it and nobody has
// finalized it since.
class FinalizeAtExit {
 public:
  ~FinalizeAtExit() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};

absl::Status InitializeMpiIfNeeded() {
  static std::mutex mu;  // two threads must not both call MPI_Init_thread
  std::lock_guard<std::mutex> lock(mu);
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized || finalized) return absl::OkStatus();  // checked later
  int provided = MPI_THREAD_SINGLE;
  const int rc =
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  if (rc != MPI_SUCCESS) {
    return internal_core::Annotate(MpiErrorToStatus(rc, "MPI_Init_thread"),
                                   "MpiWorldCommunicator");
  }
  // Constructed once MPI is up: at exit, statics constructed after it are
  // destroyed first and free their communicators normally; those
  // constructed before it go after MPI_Finalize and skip their free.
  static FinalizeAtExit finalize_at_exit;
  return absl::OkStatus();
}

// NewMpiCommunicator without context in its errors.
absl::StatusOr<std::unique_ptr<Communicator>> Wrap(MPI_Comm comm,
                                                   const MpiOptions& options) {
  CAIRN_RETURN_IF_ERROR(
      CheckCollectiveTimeout(options.collective_timeout, "options"));
  CAIRN_ASSIGN_OR_RETURN(std::mutex * serializer, MpiSerializer());
  std::unique_lock<std::mutex> lock = LockIf(serializer);
  MPI_Comm dup = MPI_COMM_NULL;
  // A failure here goes to `comm`'s error handler (the application's, by
  // default fatal): cairn must not change it.
  int rc = MPI_Comm_dup(comm, &dup);
  if (rc != MPI_SUCCESS) return MpiErrorToStatus(rc, "MPI_Comm_dup");
  int rank = 0;
  int size = 0;
  const char* failed = "MPI_Comm_set_errhandler";
  rc = MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) {
    failed = "MPI_Comm_rank";
    rc = MPI_Comm_rank(dup, &rank);
  }
  if (rc == MPI_SUCCESS) {
    failed = "MPI_Comm_size";
    rc = MPI_Comm_size(dup, &size);
  }
  if (rc != MPI_SUCCESS) {
    absl::Status status = MpiErrorToStatus(rc, failed);
    MPI_Comm_free(&dup);
    return status;
  }
  lock = {};
  return std::unique_ptr<Communicator>(
      std::make_unique<MpiComm>(dup, rank, size, serializer, options));
}

}  // namespace

absl::Status MpiErrorToStatus(int error_code, std::string_view operation) {
  if (error_code == MPI_SUCCESS) return absl::OkStatus();
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(error_code, text, &length) != MPI_SUCCESS) {
    length = 0;
  }
  std::string_view description(text, static_cast<size_t>(length));
  if (description.empty()) description = "unknown MPI error";
  int error_class = MPI_ERR_UNKNOWN;
  MPI_Error_class(error_code, &error_class);
  const std::string message =
      absl::StrFormat("%s: %s (MPI error code %d)", AsAbsl(operation),
                      AsAbsl(description), error_code);
  if (error_class == MPI_ERR_NO_MEM) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

absl::StatusOr<std::unique_ptr<Communicator>> NewMpiCommunicator(
    MPI_Comm comm, const MpiOptions& options) {
  absl::StatusOr<std::unique_ptr<Communicator>> result = Wrap(comm, options);
  if (!result.ok()) {
    return internal_core::Annotate(result.status(), "mpi communicator");
  }
  return result;
}

MPI_Comm NativeHandle(const Communicator& comm) {
  const auto* mpi = dynamic_cast<const MpiComm*>(&comm);
  return mpi == nullptr ? MPI_COMM_NULL : mpi->handle();
}

}  // namespace internal_comm

bool HasMpi() { return true; }

namespace {

internal_comm::MpiOptions MpiOptionsFor(const CommunicatorOptions& options) {
  internal_comm::MpiOptions mpi;
  mpi.collective_timeout = options.collective_timeout;
  return mpi;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MpiWorldCommunicator(
    const CommunicatorOptions& options) {
  if (absl::Status s = internal_comm::CheckCollectiveTimeout(
          options.collective_timeout, "MpiWorldCommunicator");
      !s.ok()) {
    return s;  // before MPI_Init, which a wrong argument should not cost
  }
  CAIRN_RETURN_IF_ERROR(internal_comm::InitializeMpiIfNeeded());
  absl::StatusOr<std::unique_ptr<Communicator>> result =
      internal_comm::Wrap(MPI_COMM_WORLD, MpiOptionsFor(options));
  if (!result.ok()) {
    return internal_core::Annotate(result.status(), "MpiWorldCommunicator");
  }
  return result;
}

absl::StatusOr<std::unique_ptr<Communicator>> MpiCommunicatorFromFortran(
    int64_t fortran_handle, const CommunicatorOptions& options) {
  constexpr std::string_view kContext = "MpiCommunicatorFromFortran";
  absl::StatusOr<std::mutex*> serializer = internal_comm::MpiSerializer();
  if (!serializer.ok()) {
    return internal_core::Annotate(serializer.status(), kContext);
  }
  MPI_Comm comm = MPI_COMM_NULL;
  if (fortran_handle >= INT_MIN && fortran_handle <= INT_MAX) {
    std::unique_lock<std::mutex> lock = internal_comm::LockIf(*serializer);
    comm = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
  }
  // Open MPI answers an unknown handle with a null pointer rather than
  // MPI_COMM_NULL.
  if (comm == MPI_COMM_NULL || comm == MPI_Comm{}) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d is not the Fortran handle of an MPI communicator",
        internal_core::AsAbsl(kContext), fortran_handle));
  }
  absl::StatusOr<std::unique_ptr<Communicator>> result =
      internal_comm::Wrap(comm, MpiOptionsFor(options));
  if (!result.ok()) {
    return internal_core::Annotate(result.status(), kContext);
  }
  return result;
}

}  // namespace cairn
