// The load coordinator's check of the parts of chunks that ranks read and
// checksummed (CheckSharedPieces, on every rank's message): whatever the
// messages hold it must return an error or a count of checked chunks no
// larger than the checkpoint's, without crashing or reading outside them.
//
// Input: up to eight ranks' messages as records (fuzz_target.h,
// SplitRecords), against a fixed metadata of a 1-d, a 2-d and a 3-d tensor.
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_impl.h"
#include "format/crc32c.h"
#include "fuzz/fuzz_target.h"
#include "fuzz/shared_pieces_util.h"

namespace cairn::fuzz {
namespace {

using internal_checkpoint::CrcPiece;
using internal_checkpoint::SharedPieces;
using internal_checkpoint::SignedPart;

std::vector<std::string> Seeds() {
  const std::string b0 = ChunkBytes(24);
  const std::string a0 = ChunkBytes(128);
  auto crc = [](const std::string& s, size_t offset, size_t n) {
    return internal_format::Crc32c(s.data() + offset, n);
  };
  // Rank 0: rows 0-2 of b's chunk 0, columns 0-3 of its chunk 1, the first
  // half of a's chunk 0. Rank 1: the rest of each.
  const Box left{{4, 0}, {4, 3}}, right{{4, 3}, {4, 3}};
  const ChunkMetadata& b1 = TheMetadata().tensors.at("b").chunks[1];
  std::vector<std::vector<SharedPieces>> ranks(2);
  ranks[0].push_back({"b", 0, {CrcPiece{0, 12, crc(b0, 0, 12)}}, {}});
  ranks[0].push_back({"b", 1, {}, {SignedPart{left, SignatureOf(b1, 1, left)}}});
  ranks[0].push_back({"a", 0, {CrcPiece{0, 64, crc(a0, 0, 64)}}, {}});
  ranks[1].push_back({"b", 0, {CrcPiece{12, 12, crc(b0, 12, 12)}}, {}});
  ranks[1].push_back({"b", 1, {}, {SignedPart{right, SignatureOf(b1, 1, right)}}});
  ranks[1].push_back({"a", 0, {CrcPiece{64, 64, crc(a0, 64, 64)}}, {}});
  std::vector<std::string> messages;
  for (const auto& shared : ranks) {
    messages.push_back(
        *internal_checkpoint::EncodeSharedPieces(TheMetadata(), shared));
  }
  // The same with a replica of rank 1 (rank 2 read what rank 1 read).
  std::vector<std::string> replicated = messages;
  replicated.push_back(messages[1]);
  return {JoinRecords(messages), JoinRecords(replicated)};
}

}  // namespace

CAIRN_FUZZ_TARGET(shared_pieces, &Seeds) {
  const std::vector<std::string> payloads = SplitRecords(data, 8);
  absl::StatusOr<uint64_t> checked =
      internal_checkpoint::CheckSharedPieces(TheMetadata(), payloads);
  if (checked.ok()) {
    CAIRN_FUZZ_CHECK(*checked <= 5, absl::StrCat("checked ", *checked,
                                                 " chunks of 5"));
  }
}

}  // namespace cairn::fuzz
