#include "format/names.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace cairn::internal_format {
namespace {

constexpr size_t kMaxNameBytes = 4096;

// Quotes `name` for an error message, escaping control characters.
std::string Quote(std::string_view name) {
  std::string out = "\"";
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f || c == '"' || c == '\\') {
      out += absl::StrFormat("\\x%02x", u);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

absl::Status Bad(std::string_view name, std::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrFormat("unsafe file name %s: %s", Quote(name), why));
}

}  // namespace

absl::Status ValidateRelativeName(std::string_view name) {
  if (name.empty()) return Bad(name, "empty");
  if (name.size() > kMaxNameBytes) return Bad(name.substr(0, 64), "too long");
  for (char c : name) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return Bad(name, "control character");
    }
    if (c == '\\') return Bad(name, "backslash");
  }
  if (name.front() == '/') return Bad(name, "absolute path");
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string_view::npos) end = name.size();
    const std::string_view part = name.substr(start, end - start);
    if (part.empty()) return Bad(name, "empty path component");
    if (part == "." || part == "..") {
      return Bad(name, "'.' or '..' path component");
    }
    start = end + 1;
  }
  return absl::OkStatus();
}

absl::Status ValidatePlainName(std::string_view name) {
  if (name.find('/') != std::string_view::npos) {
    return Bad(name, "must be a plain name inside the checkpoint (no '/')");
  }
  return ValidateRelativeName(name);
}

std::string DataFileName(int index) {
  return absl::StrFormat("data-%05d.safetensors", index);
}

std::string DataFileName(int index, std::string_view save_id) {
  return absl::StrFormat("data-%05d-%s.safetensors", index, save_id);
}

bool IsSaveId(std::string_view id) {
  return !id.empty() && id.size() <= 64 &&
         std::all_of(id.begin(), id.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') ||
                  (c >= 'A' && c <= 'Z') || c == '_' || c == '-';
         });
}

std::string NewSaveId() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const uint64_t id =
      ((uint64_t{rd()} << 32) ^ rd()) ^
      (counter.fetch_add(1) * 0x9e3779b97f4a7c15ULL) ^
      static_cast<uint64_t>(
          std::chrono::steady_clock::now().time_since_epoch().count());
  return absl::StrFormat("%016x", id);
}

std::string SaveLockName(std::string_view prefix) {
  return std::string(prefix) + "save.lock";
}

std::string RankFolderName(int rank) {
  return absl::StrFormat("rank-%05d", rank);
}

int RankOfMetadataName(std::string_view name) {
  constexpr std::string_view kPrefix = "rank-";
  constexpr std::string_view kSuffix = "/metadata.json";
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix) ||
      name.size() < kPrefix.size() + kSuffix.size() + 5) {
    return -1;
  }
  const std::string_view digits = name.substr(
      kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  if (digits.size() > 9 ||
      digits.find_first_not_of("0123456789") != std::string_view::npos) {
    return -1;
  }
  int rank = 0;
  for (char c : digits) rank = rank * 10 + (c - '0');
  // Only the canonical spelling (no extra leading zeros).
  return RankFolderName(rank) == std::string(name.substr(0, kPrefix.size() + digits.size()))
             ? rank
             : -1;
}

std::string EntryName(std::string_view fqn, const Box& box, bool whole) {
  if (whole) return std::string(fqn);
  return std::string(fqn) + "@" + absl::StrJoin(box.offsets, ",");
}

std::string KvEntryName(std::string_view fqn, int64_t bucket, uint64_t row,
                        std::string_view what) {
  std::string name(fqn);
  name += "@kv";
  name += std::to_string(bucket);
  name += '+';
  name += std::to_string(row);
  name += '.';
  name += what;
  return name;
}

std::string KvFileName(int index, int n, std::string_view save_id) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "data-%05d-kv%04d-", index, n);
  std::string name(buf);
  name += save_id;
  name += ".safetensors";
  return name;
}

}  // namespace cairn::internal_format
