// The conformance suite every communicator runs (Local, InProcess over
// several sizes, MPI over 4 processes): each function is a collective, to be
// called by every rank of `comm`, and checks with EXPECT_* only, so that a
// failed check on one rank never makes it skip a collective the others are
// in (which would hang them).
#ifndef CAIRN_COMM_COMM_CONFORMANCE_H_
#define CAIRN_COMM_COMM_CONFORMANCE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cairn/communicator.h"
#include "core/checked.h"
#include "gtest/gtest.h"

namespace cairn::internal_comm::conformance {

// A deterministic buffer for (rank, salt) whose size varies with both,
// from 0 bytes (rank 0, salt 0) up to a few KiB, with bytes that differ
// between ranks at the same offset.
inline std::string Payload(int rank, int salt) {
  const size_t size =
      (static_cast<size_t>(rank) * 131 + static_cast<size_t>(salt) * 977) %
      3001;
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i) {
    s[i] = static_cast<char>((rank * 31 + salt * 7 + i * 13 + i / 256) & 0xff);
  }
  return s;
}

inline std::vector<std::byte> Bytes(int rank, size_t size) {
  std::vector<std::byte> b(size);
  for (size_t i = 0; i < size; ++i) {
    b[i] = static_cast<std::byte>((rank * 17 + i * 7 + (i >> 12)) & 0xff);
  }
  return b;
}

// `result`'s value, or `fallback` after a failed EXPECT.
template <typename T>
T ValueOr(absl::StatusOr<T> result, T fallback) {
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *std::move(result) : std::move(fallback);
}

inline std::string Where(const Communicator& comm) {
  return absl::StrFormat("%s rank %d of %d", internal_core::AsAbsl(comm.kind()),
                         comm.rank(), comm.size());
}

// Every collective with every root, buffers from empty to multi-MiB, and
// long runs of back-to-back collectives. `big`: include a multi-MiB
// BroadcastBytes.
inline void ExpectCollectivesWork(Communicator& comm, bool big = true) {
  SCOPED_TRACE(Where(comm));
  const int n = comm.size();
  const int me = comm.rank();
  EXPECT_GE(me, 0);
  EXPECT_LT(me, n);
  EXPECT_TRUE(comm.Barrier().ok());

  for (int salt = 0; salt < 3; ++salt) {
    for (int root = 0; root < n; ++root) {
      SCOPED_TRACE(absl::StrFormat("salt %d root %d", salt, root));
      // Non-roots start with something else, of another size.
      std::string s =
          me == root ? Payload(root, salt) : "stale" + Payload(me, salt + 5);
      EXPECT_TRUE(comm.Broadcast(s, root).ok());
      EXPECT_EQ(s, Payload(root, salt));

      std::string empty = me == root ? "" : "stale";
      EXPECT_TRUE(comm.Broadcast(empty, root).ok());
      EXPECT_EQ(empty, "");

      std::vector<std::string> gathered =
          ValueOr(comm.Gather(Payload(me, salt), root), {});
      if (me == root) {
        EXPECT_EQ(gathered.size(), static_cast<size_t>(n));
        for (int r = 0; r < n && r < static_cast<int>(gathered.size()); ++r) {
          EXPECT_EQ(gathered[r], Payload(r, salt)) << "from rank " << r;
        }
      } else {
        EXPECT_TRUE(gathered.empty());
      }

      // Elsewhere than root the argument is ignored, whatever its size.
      std::vector<std::string> parts = {"ignored"};
      if (me == root) {
        parts.clear();
        for (int r = 0; r < n; ++r) parts.push_back(Payload(r, salt + root));
      }
      EXPECT_EQ(ValueOr(comm.Scatter(parts, root), std::string("failed")),
                Payload(me, salt + root));

      for (size_t size : {size_t{0}, size_t{1}, size_t{4099}}) {
        std::vector<std::byte> b = me == root ? Bytes(root + salt, size)
                                              : std::vector<std::byte>(size);
        EXPECT_TRUE(comm.BroadcastBytes(b, root).ok());
        EXPECT_TRUE(b == Bytes(root + salt, size)) << size << " bytes";
      }
    }

    std::vector<std::string> all =
        ValueOr(comm.AllGather(Payload(me, salt)), {});
    EXPECT_EQ(all.size(), static_cast<size_t>(n));
    for (int r = 0; r < n && r < static_cast<int>(all.size()); ++r) {
      EXPECT_EQ(all[r], Payload(r, salt)) << "from rank " << r;
    }
  }

  std::vector<std::string> empties = ValueOr(comm.AllGather(""), {});
  EXPECT_EQ(empties, std::vector<std::string>(n));

  if (big) {
    const size_t size = (size_t{3} << 20) + 5;
    const int root = n - 1;
    std::vector<std::byte> b =
        me == root ? Bytes(root, size) : std::vector<std::byte>(size);
    EXPECT_TRUE(comm.BroadcastBytes(b, root).ok());
    EXPECT_TRUE(b == Bytes(root, size));
  }

  // AllReduce, each op; sums stay clear of overflow.
  {
    std::vector<int64_t> v = {me, -3 * me, (int64_t{1} << 40) * me, 1, 0};
    EXPECT_TRUE(comm.AllReduce(v, ReduceOp::kSum).ok());
    const int64_t ranks = int64_t{n} * (n - 1) / 2;
    EXPECT_EQ(v, (std::vector<int64_t>{ranks, -3 * ranks,
                                       (int64_t{1} << 40) * ranks, n, 0}));
  }
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  {
    std::vector<int64_t> v = {me, -me, kMax - me, kMin + me, 42};
    EXPECT_TRUE(comm.AllReduce(v, ReduceOp::kMin).ok());
    EXPECT_EQ(v, (std::vector<int64_t>{0, -(n - 1), kMax - (n - 1), kMin, 42}));
  }
  {
    std::vector<int64_t> v = {me, -me, kMax - me, kMin + me, 42};
    EXPECT_TRUE(comm.AllReduce(v, ReduceOp::kMax).ok());
    EXPECT_EQ(v, (std::vector<int64_t>{n - 1, 0, kMax, kMin + (n - 1), 42}));
  }
  EXPECT_TRUE(comm.AllReduce({}, ReduceOp::kSum).ok());

  // Back-to-back collectives of every kind: each reuses what the previous
  // one used.
  for (int i = 0; i < 40; ++i) {
    SCOPED_TRACE(absl::StrFormat("iteration %d", i));
    const int root = i % n;
    switch (i % 5) {
      case 0: {
        std::vector<std::string> got =
            ValueOr(comm.AllGather(absl::StrFormat("%d:%d", i, me)), {});
        EXPECT_EQ(got.size(), static_cast<size_t>(n));
        for (int r = 0; r < n && r < static_cast<int>(got.size()); ++r) {
          EXPECT_EQ(got[r], absl::StrFormat("%d:%d", i, r));
        }
        break;
      }
      case 1: {
        std::vector<int64_t> v = {i, me};
        EXPECT_TRUE(comm.AllReduce(v, ReduceOp::kMax).ok());
        EXPECT_EQ(v, (std::vector<int64_t>{i, n - 1}));
        break;
      }
      case 2: {
        std::string s = me == root ? absl::StrFormat("from %d at %d", root, i)
                                   : std::string();
        EXPECT_TRUE(comm.Broadcast(s, root).ok());
        EXPECT_EQ(s, absl::StrFormat("from %d at %d", root, i));
        break;
      }
      case 3:
        EXPECT_TRUE(comm.Barrier().ok());
        break;
      case 4: {
        std::vector<std::string> got =
            ValueOr(comm.Gather(absl::StrFormat("%d", me * i), root), {});
        if (me == root) {
          EXPECT_EQ(got.size(), static_cast<size_t>(n));
          for (int r = 0; r < n && r < static_cast<int>(got.size()); ++r) {
            EXPECT_EQ(got[r], absl::StrFormat("%d", r * i));
          }
        }
        break;
      }
    }
  }
}

// Bad arguments are an error on every rank (never a hang or a crash), and
// the communicator works normally afterwards.
inline void ExpectArgumentErrors(Communicator& comm) {
  SCOPED_TRACE(Where(comm));
  const int n = comm.size();
  const int me = comm.rank();
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

  for (int root : {-1, n, n + 7}) {
    SCOPED_TRACE(absl::StrFormat("root %d", root));
    std::string s = "unchanged";
    EXPECT_EQ(comm.Broadcast(s, root).code(), kInvalid);
    EXPECT_EQ(s, "unchanged");
    EXPECT_EQ(comm.Gather("x", root).status().code(), kInvalid);
    EXPECT_EQ(comm.Scatter(std::vector<std::string>(n), root).status().code(),
              kInvalid);
    std::vector<std::byte> b(3);
    EXPECT_EQ(comm.BroadcastBytes(b, root).code(), kInvalid);
  }

  // Root passes the wrong number of buffers: every rank learns of it.
  for (int extra : {-1, 1}) {
    std::vector<std::string> parts(me == 0 ? n + extra : 0, "x");
    absl::StatusOr<std::string> got = comm.Scatter(parts, 0);
    EXPECT_EQ(got.status().code(), kInvalid) << got.status();
    EXPECT_NE(got.status().message().find("buffers"), absl::string_view::npos)
        << got.status();
  }

  if (n > 1) {
    // Different lengths: the rank with the odd one out and the others alike.
    std::vector<int64_t> v(me == n - 1 ? 3 : 2, 5);
    const std::vector<int64_t> before = v;
    absl::Status s = comm.AllReduce(v, ReduceOp::kSum);
    EXPECT_EQ(s.code(), kInvalid) << s;
    EXPECT_EQ(v, before);

    std::vector<std::byte> b(me == 0 ? 10 : 11);
    s = comm.BroadcastBytes(b, 0);
    EXPECT_EQ(s.code(), kInvalid) << s;

    // Roots that differ between ranks, where every implementation can tell.
    std::vector<std::byte> same(8);
    s = comm.BroadcastBytes(same, me == 0 ? 1 : 0);
    EXPECT_EQ(s.code(), kInvalid) << s;
    EXPECT_EQ(comm.Gather("x", me == 0 ? 1 : 0).status().code(), kInvalid);
  }

  // Still usable.
  EXPECT_TRUE(comm.Barrier().ok());
  std::vector<std::string> all =
      ValueOr(comm.AllGather(std::to_string(me)), {});
  std::vector<std::string> want;
  for (int r = 0; r < n; ++r) want.push_back(std::to_string(r));
  EXPECT_EQ(all, want);
}

// The old ranks of the group `old_rank` lands in when rank r passes
// (color(r), key(r)), in new-rank order: by (key, old rank).
template <typename ColorFn, typename KeyFn>
std::vector<int> ExpectedMembers(int n, int old_rank, ColorFn color,
                                 KeyFn key) {
  std::vector<std::pair<int, int>> members;  // (key, old rank)
  for (int r = 0; r < n; ++r) {
    if (color(r) == color(old_rank)) members.emplace_back(key(r), r);
  }
  std::sort(members.begin(), members.end());
  std::vector<int> order;
  for (const auto& [k, r] : members) order.push_back(r);
  return order;
}

// `child` holds exactly `members` (old ranks, in new-rank order): checked
// through the child itself, which also proves its collectives work.
inline void ExpectGroup(Communicator& child, int old_rank,
                        const std::vector<int>& members) {
  EXPECT_EQ(child.size(), static_cast<int>(members.size()));
  const auto it = std::find(members.begin(), members.end(), old_rank);
  EXPECT_EQ(child.rank(), static_cast<int>(it - members.begin()));
  std::vector<std::string> got =
      ValueOr(child.AllGather(std::to_string(old_rank)), {});
  std::vector<std::string> want;
  for (int r : members) want.push_back(std::to_string(r));
  EXPECT_EQ(got, want);
}

template <typename ColorFn, typename KeyFn>
std::unique_ptr<Communicator> SplitAndCheck(Communicator& comm, ColorFn color,
                                            KeyFn key) {
  const int me = comm.rank();
  absl::StatusOr<std::unique_ptr<Communicator>> child =
      comm.Split(color(me), key(me));
  EXPECT_TRUE(child.ok()) << child.status();
  if (!child.ok()) return nullptr;
  ExpectGroup(**child, me, ExpectedMembers(comm.size(), me, color, key));
  return *std::move(child);
}

inline void ExpectSplitWorks(Communicator& comm) {
  SCOPED_TRACE(Where(comm));
  const int n = comm.size();
  const int me = comm.rank();

  // Parity, with keys that reverse the order.
  auto parity = [](int r) { return r % 2; };
  auto reversed = [](int r) { return -r; };
  std::unique_ptr<Communicator> by_parity =
      SplitAndCheck(comm, parity, reversed);
  // One color, equal keys: old order.
  auto one = [](int) { return 7; };
  auto zero = [](int) { return 0; };
  SplitAndCheck(comm, one, zero);
  // First half and second half (2+2 over 4 ranks); keys that tie in pairs.
  SplitAndCheck(
      comm, [n](int r) { return r < n / 2 ? 0 : 1; },
      [](int r) { return r / 2; });
  // Rank 0 alone and the rest (1+3 over 4), with negative and huge colors.
  SplitAndCheck(
      comm, [](int r) { return r == 0 ? std::numeric_limits<int>::max() : -3; },
      [](int r) { return 100 - r; });
  // Every rank alone, negative colors.
  std::unique_ptr<Communicator> alone = SplitAndCheck(
      comm, [](int r) { return -1 - r; }, zero);
  if (alone != nullptr) {
    std::string s = "mine";
    EXPECT_TRUE(alone->Broadcast(s, 0).ok());
    EXPECT_EQ(s, "mine");
  }

  if (by_parity == nullptr) return;
  // Nested: split the parity groups again by halves of their new ranks.
  const int child_rank = by_parity->rank();
  const int child_size = by_parity->size();
  auto lower = [child_size](int r) { return r < (child_size + 1) / 2; };
  std::unique_ptr<Communicator> nested = SplitAndCheck(*by_parity, lower, zero);
  if (nested != nullptr) {
    // The sum of the old ranks in this rank's nested group.
    std::vector<int> parity_members = ExpectedMembers(n, me, parity, reversed);
    int64_t want = 0;
    for (int c : ExpectedMembers(child_size, child_rank, lower, zero)) {
      want += parity_members[c];
    }
    std::vector<int64_t> v = {me};
    EXPECT_TRUE(nested->AllReduce(v, ReduceOp::kSum).ok());
    EXPECT_EQ(v[0], want);
  }

  // Each parity group runs the whole suite while the other does too, and
  // while this rank's other thread runs collectives over `comm`: the
  // communicators are independent of one another.
  std::thread other([&] {
    for (int i = 0; i < 20; ++i) {
      std::vector<int64_t> v = {1, i};
      EXPECT_TRUE(comm.AllReduce(v, ReduceOp::kSum).ok());
      EXPECT_EQ(v, (std::vector<int64_t>{n, int64_t{n} * i}));
    }
  });
  ExpectCollectivesWork(*by_parity, /*big=*/false);
  other.join();
}

// One call of each collective, with root 0 where it takes one, for tests
// that do the same thing to every kind (timeouts).
struct NamedCollective {
  std::string name;  // as in the communicator's errors: "BroadcastBytes"
  std::function<absl::Status(Communicator&)> call;
};

inline std::vector<NamedCollective> EveryCollective() {
  return {
      {"Barrier", [](Communicator& c) { return c.Barrier(); }},
      {"Broadcast",
       [](Communicator& c) {
         std::string s = "x";
         return c.Broadcast(s, 0);
       }},
      {"Gather", [](Communicator& c) { return c.Gather("x", 0).status(); }},
      {"AllGather", [](Communicator& c) { return c.AllGather("x").status(); }},
      {"Scatter",
       [](Communicator& c) {
         return c.Scatter(std::vector<std::string>(c.size(), "x"), 0)
             .status();
       }},
      {"AllReduce",
       [](Communicator& c) {
         int64_t v = 1;
         return c.AllReduce(std::span<int64_t>(&v, 1), ReduceOp::kSum);
       }},
      {"BroadcastBytes",
       [](Communicator& c) {
         std::vector<std::byte> b(8);
         return c.BroadcastBytes(b, 0);
       }},
      {"Split", [](Communicator& c) { return c.Split(0, 0).status(); }},
  };
}

}  // namespace cairn::internal_comm::conformance

#endif  // CAIRN_COMM_COMM_CONFORMANCE_H_
