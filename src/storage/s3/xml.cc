#include "storage/s3/xml.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace cairn::internal_s3 {
namespace {

bool IsNameEnd(char c) {
  return c == '>' || c == '/' || c == ' ' || c == '\t' || c == '\n' ||
         c == '\r';
}

void AppendUtf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace

absl::StatusOr<std::vector<std::string_view>> XmlElements(std::string_view xml,
                                                          std::string_view tag) {
  std::vector<std::string_view> out;
  const std::string open = "<" + std::string(tag);
  const std::string close = "</" + std::string(tag) + ">";
  size_t pos = 0;
  while (true) {
    size_t start = xml.find(open, pos);
    if (start == std::string_view::npos) break;
    const size_t after_name = start + open.size();
    if (after_name >= xml.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("XML ends inside the start of <%s>", tag));
    }
    if (!IsNameEnd(xml[after_name])) {  // <KeyCount> when looking for <Key>
      pos = after_name;
      continue;
    }
    const size_t gt = xml.find('>', after_name);
    if (gt == std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrFormat("XML ends inside the start of <%s>", tag));
    }
    if (xml[gt - 1] == '/') {  // <tag/> or <tag attr="x"/>
      out.push_back(std::string_view());
      pos = gt + 1;
      continue;
    }
    const size_t end = xml.find(close, gt + 1);
    if (end == std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrFormat("XML element <%s> at byte %d has no end", tag, start));
    }
    out.push_back(xml.substr(gt + 1, end - gt - 1));
    pos = end + close.size();
  }
  return out;
}

absl::StatusOr<std::string> XmlUnescape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '&') {
      out.push_back(text[i]);
      continue;
    }
    const size_t semi = text.find(';', i);
    if (semi == std::string_view::npos || semi - i > 12) {
      return absl::InvalidArgumentError(
          absl::StrFormat("XML text has an unterminated '&' at byte %d", i));
    }
    const std::string_view ent = text.substr(i + 1, semi - i - 1);
    if (ent == "amp") {
      out.push_back('&');
    } else if (ent == "lt") {
      out.push_back('<');
    } else if (ent == "gt") {
      out.push_back('>');
    } else if (ent == "quot") {
      out.push_back('"');
    } else if (ent == "apos") {
      out.push_back('\'');
    } else if (ent.size() >= 2 && ent[0] == '#') {
      uint32_t cp = 0;
      const bool hex = ent[1] == 'x' || ent[1] == 'X';
      const std::string digits(ent.substr(hex ? 2 : 1));
      const bool parsed = !digits.empty() &&
                          (hex ? absl::SimpleHexAtoi(digits, &cp)
                               : absl::SimpleAtoi(digits, &cp));
      if (!parsed || cp == 0 || cp > 0x10FFFF ||
          (cp >= 0xD800 && cp <= 0xDFFF)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "XML text has a bad character reference &%s; at byte %d", ent, i));
      }
      AppendUtf8(cp, out);
    } else {
      return absl::InvalidArgumentError(absl::StrFormat(
          "XML text has an unknown entity &%s; at byte %d", ent, i));
    }
    i = semi;
  }
  return out;
}

absl::StatusOr<std::optional<std::string>> XmlFirstText(std::string_view xml,
                                                        std::string_view tag) {
  absl::StatusOr<std::vector<std::string_view>> all = XmlElements(xml, tag);
  if (!all.ok()) return all.status();
  if (all->empty()) return std::optional<std::string>();
  absl::StatusOr<std::string> text = XmlUnescape(all->front());
  if (!text.ok()) return text.status();
  return std::optional<std::string>(*std::move(text));
}

std::string XmlEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

}  // namespace cairn::internal_s3
