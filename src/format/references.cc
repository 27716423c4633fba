#include "format/references.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "format/names.h"

namespace cairn::internal_format {
namespace {

constexpr size_t kMaxUrlBytes = 4096;

absl::Status BadUrl(std::string_view url, std::string_view why) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "reference URL \"%s\": %s", absl::CHexEscape(std::string(url.substr(0, 256))), why));
}

// Where the path of an absolute URL starts ("/p" -> 0, "s3://b/p" -> 4),
// or npos when `url` is not absolute.
size_t PathStart(std::string_view url) {
  if (url.starts_with('/')) return 0;
  const size_t colon = url.find("://");
  if (colon == std::string_view::npos || colon == 0) return url.npos;
  for (size_t i = 0; i < colon; ++i) {
    const char c = url[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (i > 0 && ((c >= '0' && c <= '9') || c == '+' ||
                               c == '-' || c == '.'));
    if (!ok) return url.npos;
  }
  return colon + 3;
}

// The parent of a trimmed checkpoint URL, or empty when it has none that
// a sibling could share (a bucket, "/", a bare name).
std::string_view ParentOf(std::string_view url) {
  const size_t start = PathStart(url);
  if (start == url.npos) return {};
  const size_t slash = url.rfind('/');
  if (slash == url.npos || slash <= start) {
    // "/x" (parent "/") or "s3://bucket" (no slash after the authority).
    return {};
  }
  // "s3://bucket/x": the parent "s3://bucket" is the bucket itself, which
  // is fine as a parent of siblings.
  return url.substr(0, slash);
}

}  // namespace

absl::Status ValidateReferenceUrl(std::string_view url) {
  if (url.empty()) return BadUrl(url, "empty");
  if (url.size() > kMaxUrlBytes) return BadUrl(url, "too long");
  for (char c : url) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return BadUrl(url, "control character");
    }
    if (c == '\\') return BadUrl(url, "backslash");
  }
  if (url.starts_with("../")) {
    const absl::Status s = ValidatePlainName(url.substr(3));
    if (!s.ok()) return BadUrl(url, "\"../\" must be followed by one name");
    return absl::OkStatus();
  }
  const size_t start = PathStart(url);
  if (start == url.npos) {
    return BadUrl(url, "must be \"../<name>\" or an absolute URL");
  }
  std::string_view path = url.substr(start);
  // The leading '/' ("/x", "file:///x").
  if (path.starts_with('/')) path.remove_prefix(1);
  if (path.empty()) return BadUrl(url, "no path");
  if (path.ends_with('/')) return BadUrl(url, "trailing '/'");
  if (!ValidateRelativeName(path).ok()) {
    return BadUrl(url, "empty, '.' or '..' path component");
  }
  return absl::OkStatus();
}

absl::Status ValidateReferences(std::span<const CheckpointReference> refs,
                                std::string_view own_save_id) {
  for (size_t i = 0; i < refs.size(); ++i) {
    const CheckpointReference& r = refs[i];
    if (absl::Status s = ValidateReferenceUrl(r.url); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("references[", i, "]: ", s.message()));
    }
    if (!IsSaveId(r.save_id)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "references[%d] (%s): the save id \"%s\" is not 1 to 64 "
          "characters of [0-9A-Za-z_-]",
          i, r.url, absl::CHexEscape(r.save_id)));
    }
    if (!own_save_id.empty() && r.save_id == own_save_id) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "references[%d] (%s) has this checkpoint's own save id %s", i,
          r.url, r.save_id));
    }
    for (size_t j = 0; j < i; ++j) {
      const CheckpointReference& o = refs[j];
      const auto nested = [](std::string_view a, std::string_view b) {
        return a.size() > b.size() && a.starts_with(b) && a[b.size()] == '/';
      };
      if (o.url == r.url || nested(o.url, r.url) || nested(r.url, o.url)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "references[%d] (%s) and references[%d] (%s) name the same "
            "checkpoint or one inside the other",
            j, o.url, i, r.url));
      }
      if (o.save_id == r.save_id) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "references[%d] (%s) and references[%d] (%s) have the same save "
            "id %s",
            j, o.url, i, r.url, r.save_id));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ReferenceOf(std::string_view file,
                                std::span<const CheckpointReference> refs,
                                std::string_view* name) {
  if (ValidateRelativeName(file).ok()) {
    *name = file;
    return -1;
  }
  for (size_t i = 0; i < refs.size(); ++i) {
    const std::string& url = refs[i].url;
    if (file.size() > url.size() + 1 && file.starts_with(url) &&
        file[url.size()] == '/') {
      const std::string_view rest = file.substr(url.size() + 1);
      if (absl::Status s = ValidateRelativeName(rest); !s.ok()) return s;
      *name = rest;
      return static_cast<int>(i);
    }
  }
  // The name's own error, or that it lies in no reference.
  if (refs.empty()) return ValidateRelativeName(file);
  return absl::InvalidArgumentError(absl::StrFormat(
      "file \"%s\" is neither a name in the checkpoint nor in one of its %d "
      "references",
      absl::CHexEscape(std::string(file.substr(0, 256))), refs.size()));
}

absl::Status CheckReferencedFiles(const Metadata& metadata,
                                  std::string_view source) {
  if (absl::Status s =
          ValidateReferences(metadata.references, metadata.save_id);
      !s.ok()) {
    return absl::DataLossError(
        absl::StrCat(std::string(source), ": ", s.message()));
  }
  for (const auto& [fqn, tensor] : metadata.tensors) {
    for (size_t i = 0; i < tensor.chunks.size(); ++i) {
      std::string_view name;
      absl::StatusOr<int> ref = ReferenceOf(tensor.chunks[i].location.file,
                                            metadata.references, &name);
      if (!ref.ok()) {
        // Named as the decoders name a chunk.
        return absl::DataLossError(absl::StrFormat(
            "%s: tensor \"%s\" chunk %d: %s", source, absl::CHexEscape(fqn),
            i, ref.status().message()));
      }
    }
  }
  return absl::OkStatus();
}

std::string_view TrimUrl(std::string_view url) {
  while (url.size() > 1 && url.ends_with('/')) url.remove_suffix(1);
  return url;
}

std::string ResolveReference(std::string_view checkpoint_url,
                             std::string_view reference_url) {
  if (!reference_url.starts_with("../")) return std::string(reference_url);
  const std::string_view parent = ParentOf(TrimUrl(checkpoint_url));
  return absl::StrCat(std::string(parent), "/",
                      std::string(reference_url.substr(3)));
}

std::string ReferenceFrom(std::string_view checkpoint_url,
                          std::string_view target_url) {
  const std::string_view self = TrimUrl(checkpoint_url);
  const std::string_view target = TrimUrl(target_url);
  const std::string_view parent = ParentOf(self);
  if (!parent.empty() && ParentOf(target) == parent) {
    return absl::StrCat("..", std::string(target.substr(parent.size())));
  }
  return std::string(target);
}

}  // namespace cairn::internal_format
