// Small helpers shared by the `cairn` subcommands: byte sizes, error
// printing, progress lines, JSON output.
//
// Thread safety: ProgressLine::Add may be called from any thread; everything
// else is for the main thread.
#ifndef CAIRN_TOOLS_CLI_UTIL_H_
#define CAIRN_TOOLS_CLI_UTIL_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/checked.h"

namespace cairn::tools {

// Debian 12's Abseil has its own absl::string_view class (not an alias of
// std::string_view), so std::string_view must be converted explicitly.
using internal_core::AsAbsl;

// "256MiB", "2GiB", "1.5G", "500M", "4096", "10KB": K/M/G/T with or without
// "iB" are powers of 1024, KB/MB/GB/TB powers of 1000; case-insensitive.
// kInvalidArgument for anything else, zero or overflow.
absl::StatusOr<uint64_t> ParseByteSize(std::string_view text);

// "256.0 MiB", "1.50 GiB", "512 B".
std::string HumanBytes(uint64_t bytes);

// "1 chunk", "3 chunks".
std::string Plural(uint64_t n, std::string_view noun);

// Decimal gigabytes per second; 0 when seconds is not positive.
double GigabytesPerSecond(uint64_t bytes, double seconds);

// A checkpoint location from the command line: URLs ("file:///x") pass
// through; a plain path is made absolute, since Storage takes absolute paths.
std::string NormalizeUrl(std::string_view path_or_url);

// Prints "cairn <command>: <status>" to stderr.
void PrintError(std::string_view command, const absl::Status& status);

// Seconds on a monotonic clock since construction.
class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double Seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         start_)
        .count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// A self-updating "label: 42% (1.1 GiB of 2.6 GiB, 1.20 GB/s)" line on
// stderr, redrawn twice a second from a background thread, shown only when
// stderr is a terminal and the work has run for more than a second. Done()
// (or the destructor) erases it.
class ProgressLine {
 public:
  ProgressLine(std::string label, uint64_t total_bytes);
  ~ProgressLine();
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  void Add(uint64_t bytes) {
    done_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void Done();

 private:
  void Run();

  std::string label_;
  uint64_t total_;
  std::atomic<uint64_t> done_{0};
  Stopwatch clock_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool drawn_ = false;
  std::thread thread_;
};

}  // namespace cairn::tools

#endif  // CAIRN_TOOLS_CLI_UTIL_H_
