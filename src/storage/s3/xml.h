// Just enough XML for S3's responses: the elements of a given name, their
// text unescaped, and escaping for the one request body cairn sends
// (CompleteMultipartUpload). S3's response documents are flat records
// (ListBucketResult, InitiateMultipartUploadResult, Error) without CDATA,
// comments or namespaces prefixes on the elements read here; anything
// malformed is an error, never a read past the text.
#ifndef CAIRN_STORAGE_S3_XML_H_
#define CAIRN_STORAGE_S3_XML_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace cairn::internal_s3 {

// The inner text of each element <tag ...>...</tag> (or <tag/>: empty) in
// document order, raw (not unescaped). Elements of the same name are not
// nested in S3's documents; a start without its end is kInvalidArgument.
absl::StatusOr<std::vector<std::string_view>> XmlElements(std::string_view xml,
                                                          std::string_view tag);

// Replaces the five predefined entities and numeric character references
// (&#NN; &#xHH;, as UTF-8). kInvalidArgument for anything else after '&'.
absl::StatusOr<std::string> XmlUnescape(std::string_view text);

// The unescaped text of the first element `tag`; nullopt when there is none.
absl::StatusOr<std::optional<std::string>> XmlFirstText(std::string_view xml,
                                                        std::string_view tag);

// Escapes &, <, >, " and ' for element text.
std::string XmlEscape(std::string_view text);

}  // namespace cairn::internal_s3

#endif  // CAIRN_STORAGE_S3_XML_H_
