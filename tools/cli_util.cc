#include "cli_util.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "commands.h"
#include "format/frame_codec.h"

namespace cairn::tools {

absl::StatusOr<uint64_t> ParseByteSize(std::string_view text_sv) {
  const std::string original(text_sv);
  absl::string_view text = original;
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad size '", original,
        "': expected a positive number of bytes like 4096, 500M, 256MiB, 2GiB "
        "or 1.5GB"));
  };
  text = absl::StripAsciiWhitespace(text);
  size_t i = 0;
  while (i < text.size() &&
         (absl::ascii_isdigit(static_cast<unsigned char>(text[i])) ||
          text[i] == '.')) {
    ++i;
  }
  const absl::string_view number = text.substr(0, i);
  std::string unit =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(text.substr(i)));
  if (number.empty()) return bad();
  double multiplier = 1;
  if (!unit.empty() && unit != "b") {
    const char prefix = unit[0];
    const std::string rest = unit.substr(1);
    int power = 0;
    switch (prefix) {
      case 'k':
        power = 1;
        break;
      case 'm':
        power = 2;
        break;
      case 'g':
        power = 3;
        break;
      case 't':
        power = 4;
        break;
      default:
        return bad();
    }
    double base;
    if (rest.empty() || rest == "i" || rest == "ib") {
      base = 1024;
    } else if (rest == "b") {
      base = 1000;
    } else {
      return bad();
    }
    multiplier = std::pow(base, power);
  }
  double value = 0;
  if (number.find('.') == absl::string_view::npos) {
    uint64_t integer = 0;
    if (!absl::SimpleAtoi(number, &integer)) return bad();
    value = static_cast<double>(integer);
    if (multiplier == 1) {
      if (integer == 0) return bad();
      return integer;
    }
  } else if (!absl::SimpleAtod(number, &value)) {
    return bad();
  }
  const double bytes = std::round(value * multiplier);
  if (!(bytes >= 1) ||
      bytes >= static_cast<double>(std::numeric_limits<uint64_t>::max())) {
    return bad();
  }
  return static_cast<uint64_t>(bytes);
}

std::string HumanBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat(v < 10 ? "%.2f %s" : "%.1f %s", v, kUnits[u]);
}

std::string Plural(uint64_t n, std::string_view noun) {
  return absl::StrCat(n, " ", AsAbsl(noun), n == 1 ? "" : "s");
}

double GigabytesPerSecond(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

std::string NormalizeUrl(std::string_view path_or_url) {
  if (path_or_url.find("://") != std::string_view::npos) {
    return std::string(path_or_url);
  }
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(
      std::filesystem::path(std::string(path_or_url)), ec);
  if (ec) return std::string(path_or_url);
  std::string s = p.lexically_normal().string();
  // "/a/b/" -> "/a/b" (but keep "/").
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

void PrintError(std::string_view command, const absl::Status& status) {
  std::cerr << "cairn " << command << ": " << status.ToString() << std::endl;
}

ProgressLine::ProgressLine(std::string label, uint64_t total_bytes)
    : label_(std::move(label)), total_(total_bytes) {
  if (isatty(STDERR_FILENO)) thread_ = std::thread([this] { Run(); });
}

ProgressLine::~ProgressLine() { Done(); }

void ProgressLine::Done() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (drawn_) std::fprintf(stderr, "\r\033[K");
}

void ProgressLine::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::milliseconds(500),
                       [this] { return stop_; })) {
    const double t = clock_.Seconds();
    if (t < 1.0) continue;
    const uint64_t done = done_.load(std::memory_order_relaxed);
    const double pct = total_ > 0 ? 100.0 * static_cast<double>(done) /
                                        static_cast<double>(total_)
                                  : 100.0;
    std::fprintf(stderr, "\r\033[K%s: %3.0f%% (%s of %s, %.2f GB/s)",
                 label_.c_str(), pct, HumanBytes(done).c_str(),
                 HumanBytes(total_).c_str(), GigabytesPerSecond(done, t));
    std::fflush(stderr);
    drawn_ = true;
  }
}

CLI::Validator ByteSizeValidator(uint64_t min_bytes, uint64_t max_bytes) {
  return CLI::Validator(
      [min_bytes, max_bytes](std::string& v) -> std::string {
        absl::StatusOr<uint64_t> n = ParseByteSize(v);
        if (!n.ok()) return std::string(n.status().message());
        if (*n < min_bytes) {
          return absl::StrCat("at least ", min_bytes, " bytes");
        }
        if (*n > max_bytes) {
          return absl::StrCat("'", v, "' is ", *n, " bytes; at most ",
                              max_bytes, " bytes (", HumanBytes(max_bytes),
                              ")");
        }
        return std::string();
      },
      "SIZE", "byte size");
}

void AddCodecOptions(CLI::App* cmd, CodecFlags* flags, std::string_view what) {
  cmd->add_option("--codec", flags->name,
                  absl::StrCat(
                      "compress ", std::string(what),
                      " (SaveOptions::codec): none; zstd; grouped-zstd, zstd "
                      "of each element's bytes grouped by position, best for "
                      "floating-point weights and optimizer state. Chunks "
                      "under 4 KiB, and chunks that shrink by less than 5%, "
                      "stay raw"))
      ->type_name("CODEC")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "zstd", "grouped-zstd"}));
  cmd->add_option("--codec-level", flags->level,
                  "zstd level for --codec: 1 (fast) to 22 (small), or a "
                  "negative fast level")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(-131072, 22));
}

void ApplyCodec(const CodecFlags& flags, SaveOptions& options) {
  absl::StatusOr<Codec> codec = internal_format::CodecFromName(flags.name);
  options.codec = codec.ok() ? *codec : Codec::kNone;  // checked by CLI11
  options.codec_level = flags.level;
}

CLI::Validator Int64Validator() {
  CLI::Validator validator(
      [](std::string& v) -> std::string {
        int64_t n = 0;
        // SimpleAtoi takes decimal only (an optional sign, no base
        // prefix) and fails on overflow.
        if (!absl::SimpleAtoi(v, &n)) {
          return absl::StrCat("'", v,
                              "' is not a decimal integer in "
                              "[-9223372036854775808, 9223372036854775807]");
        }
        v = absl::StrCat(n);  // what CLI11's strtoll reads back exactly
        return std::string();
      },
      "INT", "64-bit integer");
  return validator;
}

}  // namespace cairn::tools
