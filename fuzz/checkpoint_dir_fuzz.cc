// A real checkpoint on disk, damaged or edited by a recipe, then opened
// every way a user can: ReadMetadata, Load on one rank (whole tensors),
// Load on two ranks (each half of a matrix's columns: parts of every chunk,
// checked across the ranks), and LoadAll; a rank-local checkpoint is loaded
// rank-local by its two ranks, then merged and loaded as a global one.
// Never a crash, and never a load that succeeds with values the files do
// not hold.
//
// The checkpoint is saved once per process by two ranks, globally and
// rank-local: a row-split F32 matrix, a replicated BF16 vector, a 0-d F64
// tensor, an object per rank, three scalars and a user object. The recipe then flips bits, sets bytes,
// inserts or erases bytes, truncates or removes files, replaces numbers and
// strings of metadata.json with others (its own, or edge values such as
// 2^63 and -1), plants a symbolic link (to a copy of the file's bytes
// outside the checkpoint) or a FIFO in place of a file, puts a rank folder
// of a second rank-local save (other values, another save id) in place of
// one of the first's, and may reseal the metadata files (recompute their
// checksums, as a tool that edits one on purpose would) so that the edits
// reach the checks behind the checksum. A reader must never follow the
// link or wait on the FIFO: the reference counts both as missing files.
//
// The reference is an independent reading of the edited files (Expected):
// metadata.json decoded and its coverage checked, every chunk and object
// inside its file with a matching CRC32C, the leaves of the destination's
// dtype and shape. A load that succeeds must give exactly what that reading
// gives; where the reading fails, every load must fail. cairn may refuse
// more than the reading does (it also checks that each location is an entry
// of its file's safetensors header, and that no two of them share bytes),
// never less; LoadAll must refuse chunks or objects that share bytes (checked
// pair by pair here). The two ranks of a global
// load must agree on its outcome. A rank-local load is checked against its
// rank folder alone (every element it fills held by that folder's chunks),
// and may succeed only when both rank folders come from one save (same
// save id and world size); Merge refuses folders of two saves.
// Unedited files must load.
//
// Checkpoints go to a folder under $TMPDIR (/tmp by default; /dev/shm makes
// fuzzing faster), removed at exit.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/state_dict.h"
#include "checkpoint/test_util.h"
#include "core/flatten.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "fuzz/fuzz_target.h"

namespace cairn::fuzz {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kRows = 8, kCols = 6, kVec = 6;

// The saved values.
std::vector<float> W() {
  std::vector<float> w(kRows * kCols);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f * static_cast<float>(i) + 1;
  return w;
}
std::vector<uint16_t> B() {
  std::vector<uint16_t> b(kVec);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(0x3f80 + 7 * i);
  return b;
}
constexpr double kS = -2.75;
std::string Rng(int r) { return absl::StrCat("rng state of rank ", r, "!"); }

// Every file under `dir`, by name relative to it.
std::map<std::string, std::string> ReadFolder(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_symlink() || !e.is_regular_file()) continue;
    out[fs::relative(e.path(), dir).string()] =
        testing_util::ReadFile(e.path().string());
  }
  return out;
}

// The files of the checkpoint saved globally or rank-local, by name;
// `second`: another save, every value of model.w 1000 larger.
std::map<std::string, std::string> SaveOnce(bool rank_local,
                                            bool second = false) {
  testing_util::TempDir dir;
  {
    std::vector<float> w = W();
    if (second) {
      for (float& v : w) v += 1000;
    }
    std::vector<uint16_t> b = B();
    double s = kS;
    std::vector<absl::Status> st =
        RunInProcess(2, [&](Communicator& comm) -> absl::Status {
          const int r = comm.rank();
          StateDict sd;
          const int64_t half = kRows / 2;
          sd["model"]["w"] = ShardedTensor(
              DType::kF32, {kRows, kCols},
              {{Box{{half * r, 0}, {half, kCols}},
                TensorView(w.data() + half * r * kCols, DType::kF32,
                           {half, kCols})}});
          sd["model"]["b"] = TensorView(b.data(), DType::kBF16, {kVec});
          sd["model"]["s"] = TensorView(&s, DType::kF64, {});
          sd["rng"][absl::StrCat(r)] = Object{Rng(r)};
          sd["step"] = int64_t{100};
          sd["lr"] = 0.25;
          sd["name"] = std::string("run-7");
          SaveOptions o;
          o.comm = &comm;
          o.rank_local = rank_local;
          o.user_metadata = R"({"note":"x","n":[1,2]})";
          return Save(sd, dir.path(), o).status();
        });
    for (const absl::Status& s : st) {
      CAIRN_FUZZ_CHECK(s.ok(), absl::StrCat("the save failed: ", s.ToString()));
    }
  }
  return ReadFolder(dir.path());
}

// Read once per process.
const std::map<std::string, std::string>& Saved(bool rank_local) {
  static const std::map<std::string, std::string> global = SaveOnce(false);
  static const std::map<std::string, std::string> local = SaveOnce(true);
  return rank_local ? local : global;
}
const std::map<std::string, std::string>& SecondRankLocalSave() {
  static const std::map<std::string, std::string> second =
      SaveOnce(true, /*second=*/true);
  return second;
}

// Entries planted in place of a file: a symbolic link to a copy of its
// bytes outside the checkpoint, or a FIFO.
enum class Planted { kLink, kFifo };

// ------------------------------------------------------------ the edits

// The tokens of a JSON text outside strings that look like numbers, and the
// strings (contents, without their quotes), as [begin, end) offsets.
struct Tokens {
  std::vector<std::pair<size_t, size_t>> numbers, strings;
};
Tokens Tokenize(const std::string& t) {
  Tokens out;
  for (size_t i = 0; i < t.size();) {
    if (t[i] == '"') {
      size_t j = i + 1;
      while (j < t.size() && t[j] != '"') j += t[j] == '\\' ? 2 : 1;
      out.strings.push_back({i + 1, std::min(j, t.size())});
      i = j + 1;
    } else if (t[i] == '-' || (t[i] >= '0' && t[i] <= '9')) {
      size_t j = i;
      while (j < t.size() && std::strchr("-+.eE0123456789", t[j]) != nullptr) ++j;
      out.numbers.push_back({i, j});
      i = j;
    } else {
      ++i;
    }
  }
  return out;
}

// A number in place of another: edge values, or the old one moved by a bit.
std::string NumberFor(Recipe& in, const std::string& old) {
  static const char* const kEdge[] = {
      "0", "1", "-1", "2", "3", "4096", "2147483647", "2147483648",
      "4294967296", "9007199254740993", "9223372036854775807",
      "9223372036854775808", "18446744073709551615", "18446744073709551616",
      "1e300", "1.5", "-0", "00", "1e2"};
  const uint8_t pick = in.Byte();
  if (pick < 2 * std::size(kEdge)) return kEdge[pick % std::size(kEdge)];
  uint64_t v = 0;
  for (char c : old) {
    if (c < '0' || c > '9') break;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return absl::StrCat(v ^ (uint64_t{1} << (pick % 64)));
}

void Edit(Recipe& in, std::map<std::string, std::string>& files,
          std::map<std::string, Planted>& planted) {
  std::vector<std::string> names;
  for (const auto& [name, unused] : files) names.push_back(name);
  if (names.empty()) return;
  const std::string& name = names[in.Byte() % names.size()];
  std::string& f = files[name];
  const uint32_t at = f.empty() ? 0 : in.U32() % f.size();
  switch (in.Byte() % 12) {
    case 0:  // flip bits
      if (!f.empty()) f[at] = static_cast<char>(f[at] ^ (in.Byte() | 1));
      break;
    case 1:  // set a byte
      if (!f.empty()) f[at] = static_cast<char>(in.Byte());
      break;
    case 2:  // truncate
      f.resize(f.empty() ? 0 : in.U32() % (f.size() + 1));
      break;
    case 3:  // remove the file
      files.erase(name);
      break;
    case 4: {  // insert 1..4 bytes
      std::string bytes(1 + in.Byte() % 4, '\0');
      for (char& c : bytes) c = static_cast<char>(in.Byte());
      f.insert(std::min<size_t>(at, f.size()), bytes);
      break;
    }
    case 5:  // erase 1..64 bytes
      if (!f.empty()) f.erase(at, 1 + in.Byte() % 64);
      break;
    case 6: {  // a number of metadata.json
      std::string& m = files.contains(kMetadataFileName)
                           ? files[kMetadataFileName] : f;
      const Tokens tokens = Tokenize(m);
      if (tokens.numbers.empty()) break;
      const auto [b, e] = tokens.numbers[in.U32() % tokens.numbers.size()];
      m.replace(b, e - b, NumberFor(in, m.substr(b, e - b)));
      break;
    }
    case 7: {  // a string of metadata.json: another of its strings, or cut
      std::string& m = files.contains(kMetadataFileName)
                           ? files[kMetadataFileName] : f;
      const Tokens tokens = Tokenize(m);
      if (tokens.strings.empty()) break;
      const auto [b, e] = tokens.strings[in.U32() % tokens.strings.size()];
      const auto [ob, oe] = tokens.strings[in.U32() % tokens.strings.size()];
      std::string value = m.substr(ob, oe - ob);
      if (in.Byte() % 4 == 0) value.resize(value.size() / 2);
      m.replace(b, e - b, value);
      break;
    }
    case 8:  // copy one file over another
      f = files[names[in.Byte() % names.size()]];
      break;
    case 9:  // a link to a copy of the file, outside the checkpoint
      planted[name] = Planted::kLink;
      break;
    case 10:  // a FIFO in its place
      planted[name] = Planted::kFifo;
      break;
    case 11: {  // a rank folder of the second rank-local save instead
      const int rank = internal_format::RankOfMetadataName(name);
      if (rank < 0) break;
      const std::string prefix = internal_format::RankFolderName(rank) + "/";
      std::erase_if(files, [&](const auto& kv) {
        return kv.first.starts_with(prefix);
      });
      for (const auto& [other, bytes] : SecondRankLocalSave()) {
        if (other.starts_with(prefix)) files[other] = bytes;
      }
      break;
    }
  }
}

// `files` without the planted entries: what a reader that follows no link
// and opens no FIFO can read.
std::map<std::string, std::string> Readable(
    std::map<std::string, std::string> files,
    const std::map<std::string, Planted>& planted) {
  for (const auto& [name, unused] : planted) files.erase(name);
  return files;
}

// ------------------------------------------------------------ the reference

struct Leaf {
  // A tensor's (row-major) or an object's; an object's is nullopt when it
  // cannot be read (outside its file, or its CRC32C does not match), a
  // tensor's when it is too large for these files to hold.
  std::optional<std::string> bytes;
  std::optional<Scalar> scalar;
  // A tensor's; `held`: which elements its readable chunks hold (a chunk
  // that cannot be read holds none; in a global checkpoint, whose coverage
  // is checked, the others hold all of them).
  DType dtype = DType::kU8;
  Shape shape;
  bool tensor = false;
  std::vector<bool> held;
  // Every chunk (or the object) readable: LoadAll may succeed only when
  // every leaf is.
  bool complete = true;
};

// What a load of the edited files must give, by FQN: nullopt when the files
// do not hold a valid checkpoint (no load may succeed then). A leaf that
// cannot be read, or a chunk of one, does not make the checkpoint invalid:
// a load that does not need it may succeed (a merge can bring in a damaged
// extra tensor from another rank's folder), and a load that does must fail
// (Destination::Check). Global: from metadata.json; rank-local (`rank` >= 0):
// from that rank's folder, whose metadata must say it is that rank's and
// whose file names are relative to the folder.
std::optional<std::map<std::string, Leaf>> Expected(
    const std::map<std::string, std::string>& files, int rank = -1) {
  const std::string folder =
      rank < 0 ? "" : internal_format::RankFolderName(rank) + "/";
  auto file = files.find(folder + kMetadataFileName);
  if (file == files.end()) return std::nullopt;
  absl::StatusOr<Metadata> md =
      internal_format::DecodeMetadata(file->second, "fuzz");
  if (!md.ok() || md->rank != rank ||
      (rank < 0 && !internal_format::ValidateAllCoverage(*md).ok())) {
    return std::nullopt;
  }
  // A rank folder counts only beside the other rank's folder of the same
  // save (the save's world is two ranks).
  if (rank >= 0 && md->world_size > 1) {
    auto other = files.find(absl::StrCat(
        internal_format::RankFolderName(rank == 0 ? 1 : 0), "/",
        kMetadataFileName));
    if (other == files.end()) return std::nullopt;
    absl::StatusOr<Metadata> theirs =
        internal_format::DecodeMetadata(other->second, "fuzz");
    if (!theirs.ok() || theirs->save_id != md->save_id ||
        theirs->world_size != md->world_size) {
      return std::nullopt;
    }
  }
  // The bytes of `loc`, if it is inside its file and its CRC32C matches.
  auto read = [&](const ByteLocation& loc) -> std::optional<std::string> {
    auto f = files.find(folder + loc.file);
    if (f == files.end() || loc.offset > f->second.size() ||
        loc.nbytes > f->second.size() - loc.offset) {
      return std::nullopt;
    }
    std::string bytes = f->second.substr(loc.offset, loc.nbytes);
    if (internal_format::Crc32c(bytes.data(), bytes.size()) != loc.crc32c) {
      return std::nullopt;
    }
    return bytes;
  };
  std::map<std::string, Leaf> out;
  for (const auto& entry : md->tensors) {
    const std::string& fqn = entry.first;
    const TensorMetadata& t = entry.second;  // (clang 14: no lambda capture
                                             // of a structured binding)
    Leaf& leaf = out[fqn];
    leaf.tensor = true;
    leaf.dtype = t.dtype;
    leaf.shape = t.shape;
    // Small tensors only (the saved ones are); a bigger one cannot be
    // covered by chunks inside these files, so no load may give it.
    int64_t n = 1;
    bool small = true;
    for (int64_t d : t.shape) {
      if (d > (int64_t{1} << 20) || (n *= d) > (int64_t{1} << 20)) {
        small = false;
        break;
      }
    }
    if (!small) {
      leaf.complete = false;
      continue;
    }
    const size_t es = DTypeSize(t.dtype);
    std::string bytes(static_cast<size_t>(n) * es, '\0');
    std::vector<bool> held(static_cast<size_t>(n), false);
    for (const ChunkMetadata& c : t.chunks) {
      std::optional<std::string> chunk = read(c.location);
      if (!chunk) {
        leaf.complete = false;
        continue;
      }
      size_t k = 0;
      testing_util::ForEachIndex(c.box, [&](const std::vector<int64_t>&,
                                            const std::vector<int64_t>& g) {
        const int64_t at = testing_util::LinearIndex(t.shape, g);
        std::memcpy(bytes.data() + at * es, chunk->data() + k * es, es);
        held[at] = true;
        ++k;
      });
    }
    leaf.bytes = std::move(bytes);
    leaf.held = std::move(held);
  }
  for (const auto& [fqn, loc] : md->objects) {
    Leaf& leaf = out[fqn];
    leaf.bytes = read(loc);
    leaf.complete = leaf.bytes.has_value();
  }
  for (const auto& [fqn, s] : md->scalars) out[fqn].scalar = s;
  return out;
}

// Equal, NaN included (edited metadata may hold one).
bool SameScalar(const Scalar& a, const Scalar& b) {
  if (a.index() != b.index()) return false;
  if (const double* x = std::get_if<double>(&a)) {
    const double y = std::get<double>(b);
    return std::memcmp(x, &y, sizeof y) == 0;
  }
  return a == b;
}

// ------------------------------------------------------------ the loads

std::string Bytes(const void* p, size_t n) {
  return std::string(static_cast<const char*>(p), n);
}

// The destinations of one rank: every leaf whole (kWhole, one rank);
// columns [3r, 3r + 3) of model.w (kColumns, rank r of two); or what rank r
// of the rank-local save holds (kOwnRows: rows [4r, 4r + 4) of model.w and
// its own object).
enum class Part { kWhole, kColumns, kOwnRows };

struct Destination {
  Box wbox;
  std::vector<float> w;
  std::vector<uint16_t> b = std::vector<uint16_t>(kVec, 0xeeee);
  double s = 1e99;
  std::vector<int> objects;  // rng.k
  StateDict sd;

  // `sd` holds views of the members.
  Destination(const Destination&) = delete;
  Destination& operator=(const Destination&) = delete;

  Destination(Part part, int r) {
    const int64_t half_rows = kRows / 2, half_cols = kCols / 2;
    wbox = part == Part::kWhole     ? Box{{0, 0}, {kRows, kCols}}
           : part == Part::kColumns ? Box{{0, half_cols * r}, {kRows, half_cols}}
                                    : Box{{half_rows * r, 0}, {half_rows, kCols}};
    w.assign(static_cast<size_t>(wbox.num_elements()), -7.0f);
    sd["model"]["w"] = ShardedTensor(
        DType::kF32, {kRows, kCols},
        {{wbox, TensorView(w.data(), DType::kF32, wbox.sizes)}});
    sd["model"]["b"] = TensorView(b.data(), DType::kBF16, {kVec});
    sd["model"]["s"] = TensorView(&s, DType::kF64, {});
    objects = part == Part::kOwnRows ? std::vector<int>{r} : std::vector<int>{0, 1};
    for (int k : objects) sd["rng"][absl::StrCat(k)] = Object{};
    sd["step"] = int64_t{0};
    sd["lr"] = 0.0;
    sd["name"] = std::string();
  }

  // What was loaded is what `expected` holds.
  void Check(const std::map<std::string, Leaf>& expected,
             const std::string& what) const {
    // The stored leaf `fqn`; a tensor must be of the destination's dtype
    // and shape.
    auto stored = [&](const std::string& fqn, DType dtype = DType::kU8,
                      Shape shape = {}) -> const Leaf& {
      auto it = expected.find(fqn);
      CAIRN_FUZZ_CHECK(it != expected.end() && it->second.bytes,
                       absl::StrCat(what, ": loaded ", fqn, ", not in the files"));
      const Leaf& leaf = it->second;
      CAIRN_FUZZ_CHECK(
          !leaf.tensor || (leaf.dtype == dtype && leaf.shape == shape),
          absl::StrCat(what, ": loaded ", fqn, " stored as ",
                       std::string(DTypeName(leaf.dtype)), " [",
                       absl::StrJoin(leaf.shape, ","), "]"));
      return leaf;
    };
    // Every element of the destination's box held by the files, and equal.
    auto same = [&](const Leaf& leaf, const Box& box, const void* got,
                    size_t es, const std::string& fqn) {
      const std::vector<int64_t> shape = leaf.shape;
      size_t k = 0;
      testing_util::ForEachIndex(box, [&](const std::vector<int64_t>&,
                                          const std::vector<int64_t>& g) {
        const int64_t at = testing_util::LinearIndex(shape, g);
        CAIRN_FUZZ_CHECK(leaf.held[at],
                         absl::StrCat(what, ": loaded element ", at, " of ",
                                      fqn, ", which the files do not hold"));
        CAIRN_FUZZ_CHECK(
            std::memcmp(static_cast<const char*>(got) + k * es,
                        leaf.bytes->data() + at * es, es) == 0,
            absl::StrCat(what, ": element ", at, " of ", fqn,
                         " differs from the files"));
        ++k;
      });
    };
    same(stored("model.w", DType::kF32, {kRows, kCols}), wbox, w.data(),
         sizeof(float), "model.w");
    same(stored("model.b", DType::kBF16, {kVec}), Box{{0}, {kVec}}, b.data(),
         sizeof(uint16_t), "model.b");
    same(stored("model.s", DType::kF64), Box{{}, {}}, &s, sizeof s, "model.s");
    for (int k : objects) {
      const std::string fqn = absl::StrCat("rng.", k);
      CAIRN_FUZZ_CHECK(
          sd.Find("rng")->Find(absl::StrCat(k))->object()->bytes ==
              *stored(fqn).bytes,
          absl::StrCat(what, ": ", fqn, " differs from the files"));
    }
    for (const char* fqn : {"step", "lr", "name"}) {
      auto it = expected.find(fqn);
      CAIRN_FUZZ_CHECK(it != expected.end() && it->second.scalar &&
                           SameScalar(*sd.Find(fqn)->scalar(), *it->second.scalar),
                       absl::StrCat(what, ": scalar ", fqn,
                                    " differs from the files"));
    }
  }
};

// Whether two chunks or objects of the global metadata.json in `files`
// share a byte of a file (every pair compared; zero-byte ones share none).
bool LocationsShareBytes(const std::map<std::string, std::string>& files) {
  auto file = files.find(kMetadataFileName);
  if (file == files.end()) return false;
  absl::StatusOr<Metadata> md =
      internal_format::DecodeMetadata(file->second, "fuzz");
  if (!md.ok()) return false;
  std::vector<const ByteLocation*> locs;
  for (const auto& [fqn, t] : md->tensors) {
    for (const ChunkMetadata& c : t.chunks) locs.push_back(&c.location);
  }
  for (const auto& [fqn, loc] : md->objects) locs.push_back(&loc);
  for (size_t i = 0; i < locs.size(); ++i) {
    for (size_t k = 0; k < i; ++k) {
      const ByteLocation& a = *locs[i];
      const ByteLocation& b = *locs[k];
      if (a.file == b.file && a.nbytes > 0 && b.nbytes > 0 &&
          a.offset < b.offset + b.nbytes && b.offset < a.offset + a.nbytes) {
        return true;
      }
    }
  }
  return false;
}

// LoadAll must give what the files hold, and must refuse a checkpoint whose
// chunks or objects share bytes (it checks that before allocating).
void LoadAllAndCompare(
    const std::string& dir, const std::map<std::string, std::string>& files,
    const std::optional<std::map<std::string, Leaf>>& expected) {
  absl::StatusOr<StateDict> all = LoadAll(dir);
  if (!all.ok()) return;
  CAIRN_FUZZ_CHECK(expected.has_value(),
                   "LoadAll succeeded on files that hold no valid checkpoint");
  for (const auto& [fqn, leaf] : *expected) {
    CAIRN_FUZZ_CHECK(leaf.complete,
                     absl::StrCat("LoadAll succeeded, but ", fqn,
                                  " cannot be read from the files"));
  }
  CAIRN_FUZZ_CHECK(!LocationsShareBytes(files),
                   "LoadAll succeeded on chunks or objects that share bytes");
  absl::StatusOr<internal_core::Flattened> flat = internal_core::Flatten(*all);
  CAIRN_FUZZ_CHECK(flat.ok(), flat.status().ToString());
  // The leaves' FQNs are the metadata's where the structure places each
  // leaf at its own name (as cairn writes it); an edited structure may
  // place a leaf elsewhere, or twice, and such a leaf is not compared.
  for (const internal_core::FlatLeaf& leaf : flat->leaves) {
    auto it = expected->find(leaf.fqn);
    if (it == expected->end()) continue;  // placed under another name
    if (const ShardedTensor* t = leaf.node->tensor()) {
      CAIRN_FUZZ_CHECK(it->second.bytes && t->shards().size() == 1,
                       absl::StrCat("LoadAll: ", leaf.fqn, " is not a tensor"));
      const TensorView& v = t->shards()[0].view;
      CAIRN_FUZZ_CHECK(Bytes(v.data(), v.nbytes()) == *it->second.bytes,
                       absl::StrCat("LoadAll: ", leaf.fqn,
                                    " differs from the files"));
    } else if (const Object* o = leaf.node->object()) {
      CAIRN_FUZZ_CHECK(it->second.bytes && o->bytes == *it->second.bytes,
                       absl::StrCat("LoadAll: ", leaf.fqn,
                                    " differs from the files"));
    } else if (const Scalar* s = leaf.node->scalar()) {
      CAIRN_FUZZ_CHECK(it->second.scalar && SameScalar(*s, *it->second.scalar),
                       absl::StrCat("LoadAll: ", leaf.fqn,
                                    " differs from the files"));
    }
  }
}

std::vector<std::string> Seeds() {
  // Unedited; a flipped data byte; a number of metadata.json resealed; a
  // truncated data file; metadata.json removed; the rank-local save
  // unedited, and with a byte of a rank folder's file flipped.
  return {std::string(),
          std::string("\x02", 1),
          std::string("\x02\x01\x03\x00\x00\x00\x00\x00\x20", 9),
          std::string("\x00\x01\x00\x00\x00\x00\x00\x10", 8),
          std::string("\x01\x06\x00\x00\x00\x00\x00\x05\x00\x00\x00\x03", 12),
          std::string("\x00\x02\x01\x00\x00\x00\x00\x40\x00\x00\x00", 11),
          std::string("\x00\x03\x00\x03", 4),
          // A data file of the global save linked from outside; a FIFO in
          // place of metadata.json; rank 1's folder from a second save.
          std::string("\x00\x01\x00\x00\x00\x00\x00\x09", 8),
          std::string("\x00\x01\x02\x00\x00\x00\x00\x0a", 8),
          std::string("\x02\x01\x04\x00\x00\x00\x00\x0b", 8)};
}

// The loads of a global checkpoint at `dir`, whose files are `files`;
// `edited`: whether they differ from what cairn wrote.
void CheckGlobalLoads(const std::string& dir,
                      const std::map<std::string, std::string>& files,
                      bool edited) {
  const std::optional<std::map<std::string, Leaf>> expected = Expected(files);
  CAIRN_FUZZ_CHECK(edited || expected.has_value(),
                   "the reference rejects the unedited checkpoint");
  (void)ReadMetadata(dir);
  // One rank, whole tensors.
  {
    Destination one(Part::kWhole, 0);
    absl::StatusOr<LoadResult> loaded = Load(one.sd, dir);
    CAIRN_FUZZ_CHECK(edited || loaded.ok(),
                     absl::StrCat("the unedited checkpoint does not load: ",
                                  loaded.status().ToString()));
    if (loaded.ok()) {
      CAIRN_FUZZ_CHECK(expected.has_value(),
                       "a load succeeded on files that hold no valid checkpoint");
      one.Check(*expected, "one rank");
    }
  }
  // Two ranks, half the columns each: every chunk of model.w in parts.
  {
    Destination two[2] = {{Part::kColumns, 0}, {Part::kColumns, 1}};
    std::vector<absl::Status> st =
        RunInProcess(2, [&](Communicator& comm) -> absl::Status {
          LoadOptions o;
          o.comm = &comm;
          return Load(two[comm.rank()].sd, dir, o).status();
        });
    CAIRN_FUZZ_CHECK(st[0].ok() == st[1].ok(),
                     absl::StrCat("the ranks disagree: ", st[0].ToString(),
                                  " / ", st[1].ToString()));
    CAIRN_FUZZ_CHECK(edited || st[0].ok(),
                     absl::StrCat("the unedited checkpoint does not load on two "
                                  "ranks: ", st[0].ToString()));
    if (st[0].ok()) {
      CAIRN_FUZZ_CHECK(expected.has_value(),
                       "a two-rank load succeeded on files that hold no valid "
                       "checkpoint");
      for (int r = 0; r < 2; ++r) {
        two[r].Check(*expected, absl::StrCat("two ranks, rank ", r));
      }
    }
  }
  LoadAllAndCompare(dir, files, expected);
}

}  // namespace

// First byte: bit 0 reseals every metadata file after the edits; bit 1
// takes the rank-local save (loaded rank-local, then merged and loaded as
// a global checkpoint).
CAIRN_FUZZ_TARGET(checkpoint_dir, &Seeds) {
  Recipe in(data);
  const uint8_t flags = in.Byte();
  const bool reseal = flags & 1;
  const bool rank_local = flags & 2;
  const std::map<std::string, std::string>& saved = Saved(rank_local);
  std::map<std::string, std::string> files = saved;
  std::map<std::string, Planted> planted;
  const int edits = static_cast<int>(in.In(0, 4));
  for (int k = 0; k < edits; ++k) Edit(in, files, planted);
  std::erase_if(planted,
                [&](const auto& kv) { return !files.contains(kv.first); });
  if (reseal) {
    for (auto& [name, bytes] : files) {
      if (name == kMetadataFileName ||
          internal_format::RankOfMetadataName(name) >= 0) {
        bytes = testing_util::Resealed(bytes);
      }
    }
  }
  const bool edited = files != saved || !planted.empty();

  static const testing_util::TempDir work;
  const std::string dir = work.Sub("ckpt");
  const std::string outside = work.Sub("outside");
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::remove_all(outside, ec);
  for (const auto& [name, bytes] : files) {
    const std::string path = dir + "/" + name;
    fs::create_directories(fs::path(path).parent_path());
    auto p = planted.find(name);
    if (p == planted.end()) {
      testing_util::WriteFile(path, bytes);
    } else if (p->second == Planted::kLink) {
      std::string target = name;
      std::replace(target.begin(), target.end(), '/', '_');
      target = outside + "/" + target;
      fs::create_directories(outside);
      testing_util::WriteFile(target, bytes);
      fs::create_symlink(target, path);
    } else {
      CAIRN_FUZZ_CHECK(::mkfifo(path.c_str(), 0644) == 0,
                       absl::StrCat("mkfifo ", path));
    }
  }
  const std::map<std::string, std::string> readable =
      Readable(files, planted);
  if (!rank_local) {
    CheckGlobalLoads(dir, readable, edited);
    return;
  }

  // Rank-local: each rank loads what it saved from its own folder, with no
  // collective (the ranks need not agree).
  Destination own[2] = {{Part::kOwnRows, 0}, {Part::kOwnRows, 1}};
  std::vector<absl::Status> st =
      RunInProcess(2, [&](Communicator& comm) -> absl::Status {
        LoadOptions o;
        o.comm = &comm;
        o.rank_local = true;
        return Load(own[comm.rank()].sd, dir, o).status();
      });
  for (int r = 0; r < 2; ++r) {
    CAIRN_FUZZ_CHECK(edited || st[r].ok(),
                     absl::StrCat("the unedited rank-local checkpoint does not "
                                  "load on rank ", r, ": ", st[r].ToString()));
    if (!st[r].ok()) continue;
    const std::optional<std::map<std::string, Leaf>> expected =
        Expected(readable, r);
    CAIRN_FUZZ_CHECK(expected.has_value(),
                     absl::StrCat("a rank-local load succeeded on rank ", r,
                                  " whose folder holds no valid checkpoint"));
    own[r].Check(*expected, absl::StrCat("rank-local, rank ", r));
  }
  // Merged (no data is read), then loaded as any global checkpoint.
  absl::StatusOr<MergeResult> merged = Merge(dir);
  CAIRN_FUZZ_CHECK(edited || merged.ok(),
                   absl::StrCat("the unedited rank-local checkpoint does not "
                                "merge: ", merged.status().ToString()));
  if (merged.ok()) CheckGlobalLoads(dir, ReadFolder(dir), edited);
}

}  // namespace cairn::fuzz
