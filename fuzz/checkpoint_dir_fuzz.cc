// A real checkpoint on disk, damaged or edited by a recipe, then opened
// every way a user can: ReadMetadata, Load on one rank (whole tensors),
// Load on two ranks (each half of a matrix's columns: parts of every chunk,
// checked across the ranks), and LoadAll. Never a crash, and never a load
// that succeeds with values the files do not hold.
//
// The checkpoint is saved once per process by two ranks: a row-split F32
// matrix, a replicated BF16 vector, a 0-d F64 tensor, an object per rank,
// three scalars and a user object. The recipe then flips bits, sets bytes,
// inserts or erases bytes, truncates or removes files, replaces numbers and
// strings of metadata.json with others (its own, or edge values such as
// 2^63 and -1), and may reseal metadata.json (recompute its checksum, as a
// tool that edits it on purpose would) so that the edits reach the checks
// behind the checksum.
//
// The reference is an independent reading of the edited files (Expected):
// metadata.json decoded and its coverage checked, every chunk and object
// inside its file with a matching CRC32C, the leaves of the destination's
// dtype and shape. A load that succeeds must give exactly what that reading
// gives; where the reading fails, every load must fail. cairn may refuse
// more than the reading does (it also checks that each location is an entry
// of its file's safetensors header), never less. The two ranks of a load
// must agree on its outcome.
//
// Checkpoints go to a folder under $TMPDIR (/tmp by default; /dev/shm makes
// fuzzing faster), removed at exit.
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

// The saved checkpoint's files, by name, read once.
const std::map<std::string, std::string>& Saved() {
  static const std::map<std::string, std::string> files = [] {
    testing_util::TempDir dir;
    std::vector<float> w = W();
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
          o.user_metadata = R"({"note":"x","n":[1,2]})";
          return Save(sd, dir.path(), o).status();
        });
    for (const absl::Status& s : st) {
      CAIRN_FUZZ_CHECK(s.ok(), absl::StrCat("the save failed: ", s.ToString()));
    }
    std::map<std::string, std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(dir.path())) {
      if (!e.is_regular_file()) continue;
      out[fs::relative(e.path(), dir.path()).string()] =
          testing_util::ReadFile(e.path().string());
    }
    return out;
  }();
  return files;
}

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

void Edit(Recipe& in, std::map<std::string, std::string>& files) {
  std::vector<std::string> names;
  for (const auto& [name, unused] : files) names.push_back(name);
  if (names.empty()) return;
  const std::string& name = names[in.Byte() % names.size()];
  std::string& f = files[name];
  const uint32_t at = f.empty() ? 0 : in.U32() % f.size();
  switch (in.Byte() % 9) {
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
  }
}

// ------------------------------------------------------------ the reference

struct Leaf {
  std::optional<std::string> bytes;  // a tensor's (row-major) or an object's
  std::optional<Scalar> scalar;
  // A tensor's.
  DType dtype = DType::kU8;
  Shape shape;
  bool tensor = false;
};

// What a load of the edited files must give, by FQN: nullopt when the files
// do not hold a valid checkpoint (no load may succeed then).
std::optional<std::map<std::string, Leaf>> Expected(
    const std::map<std::string, std::string>& files) {
  auto file = files.find(kMetadataFileName);
  if (file == files.end()) return std::nullopt;
  absl::StatusOr<Metadata> md =
      internal_format::DecodeMetadata(file->second, "fuzz");
  if (!md.ok() || md->rank >= 0 ||
      !internal_format::ValidateAllCoverage(*md).ok()) {
    return std::nullopt;
  }
  // The bytes of `loc`, if it is inside its file and its CRC32C matches.
  auto read = [&](const ByteLocation& loc) -> std::optional<std::string> {
    auto f = files.find(loc.file);
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
    // Small tensors only (the saved ones are); a bigger one cannot be
    // covered by chunks inside these files anyway.
    int64_t n = 1;
    for (int64_t d : t.shape) {
      if (d > (int64_t{1} << 20) || (n *= d) > (int64_t{1} << 20)) {
        return std::nullopt;
      }
    }
    const size_t es = DTypeSize(t.dtype);
    std::string bytes(static_cast<size_t>(n) * es, '\0');
    const std::vector<int64_t> strides = [&] {
      std::vector<int64_t> s(t.shape.size(), 1);
      for (size_t d = t.shape.size(); d-- > 1;) s[d - 1] = s[d] * t.shape[d];
      return s;
    }();
    for (const ChunkMetadata& c : t.chunks) {
      std::optional<std::string> chunk = read(c.location);
      if (!chunk) return std::nullopt;
      size_t k = 0;
      testing_util::ForEachIndex(c.box, [&](const std::vector<int64_t>&,
                                            const std::vector<int64_t>& g) {
        int64_t at = 0;
        for (size_t d = 0; d < g.size(); ++d) at += g[d] * strides[d];
        std::memcpy(bytes.data() + at * es, chunk->data() + k * es, es);
        ++k;
      });
    }
    Leaf& leaf = out[fqn];
    leaf.bytes = std::move(bytes);
    leaf.tensor = true;
    leaf.dtype = t.dtype;
    leaf.shape = t.shape;
  }
  for (const auto& [fqn, loc] : md->objects) {
    std::optional<std::string> bytes = read(loc);
    if (!bytes) return std::nullopt;
    out[fqn].bytes = std::move(bytes);
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

// The destinations of one rank of `world` (1 or 2): whole tensors on one
// rank; on two, rank r takes columns [3r, 3r + 3) of model.w.
struct Destination {
  std::vector<float> w;
  std::vector<uint16_t> b = std::vector<uint16_t>(kVec, 0xeeee);
  double s = 1e99;
  StateDict sd;

  // `sd` holds views of the members.
  Destination(const Destination&) = delete;
  Destination& operator=(const Destination&) = delete;

  Destination(int world, int r) {
    const int64_t cols = kCols / world;
    w.assign(kRows * cols, -7.0f);
    sd["model"]["w"] = ShardedTensor(
        DType::kF32, {kRows, kCols},
        {{Box{{0, cols * r}, {kRows, cols}},
          TensorView(w.data(), DType::kF32, {kRows, cols})}});
    sd["model"]["b"] = TensorView(b.data(), DType::kBF16, {kVec});
    sd["model"]["s"] = TensorView(&s, DType::kF64, {});
    for (int k = 0; k < 2; ++k) sd["rng"][absl::StrCat(k)] = Object{};
    sd["step"] = int64_t{0};
    sd["lr"] = 0.0;
    sd["name"] = std::string();
  }

  // What was loaded is what `expected` holds.
  void Check(const std::map<std::string, Leaf>& expected, int world, int r,
             const char* what) const {
    // The stored bytes of `fqn`; a tensor must be of the destination's
    // dtype and shape.
    auto stored = [&](const std::string& fqn, DType dtype = DType::kU8,
                      Shape shape = {}) -> const std::string& {
      auto it = expected.find(fqn);
      CAIRN_FUZZ_CHECK(it != expected.end() && it->second.bytes,
                       absl::StrCat(what, ": loaded ", fqn, ", not in the files"));
      const Leaf& leaf = it->second;
      CAIRN_FUZZ_CHECK(
          !leaf.tensor || (leaf.dtype == dtype && leaf.shape == shape),
          absl::StrCat(what, ": loaded ", fqn, " stored as ",
                       std::string(DTypeName(leaf.dtype)), " [",
                       absl::StrJoin(leaf.shape, ","), "]"));
      return *leaf.bytes;
    };
    const std::string& ew = stored("model.w", DType::kF32, {kRows, kCols});
    const int64_t cols = kCols / world;
    CAIRN_FUZZ_CHECK(ew.size() == kRows * kCols * sizeof(float),
                     absl::StrCat(what, ": model.w of another size loaded"));
    for (int64_t i = 0; i < kRows; ++i) {
      CAIRN_FUZZ_CHECK(
          std::memcmp(w.data() + i * cols,
                      ew.data() + (i * kCols + cols * r) * sizeof(float),
                      cols * sizeof(float)) == 0,
          absl::StrCat(what, ": rank ", r, " loaded other values in row ", i,
                       " of model.w than the files hold"));
    }
    CAIRN_FUZZ_CHECK(Bytes(b.data(), kVec * 2) ==
                         stored("model.b", DType::kBF16, {kVec}),
                     absl::StrCat(what, ": model.b differs from the files"));
    CAIRN_FUZZ_CHECK(Bytes(&s, sizeof s) == stored("model.s", DType::kF64),
                     absl::StrCat(what, ": model.s differs from the files"));
    for (int k = 0; k < 2; ++k) {
      const std::string fqn = absl::StrCat("rng.", k);
      CAIRN_FUZZ_CHECK(
          sd.Find("rng")->Find(absl::StrCat(k))->object()->bytes == stored(fqn),
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

void LoadAllAndCompare(
    const std::string& dir,
    const std::optional<std::map<std::string, Leaf>>& expected) {
  absl::StatusOr<StateDict> all = LoadAll(dir);
  if (!all.ok()) return;
  CAIRN_FUZZ_CHECK(expected.has_value(),
                   "LoadAll succeeded on files that hold no valid checkpoint");
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
  // truncated data file; metadata.json removed.
  return {std::string(),
          std::string("\x00\x01\x00\x00\x00\x00\x00\x10", 8),
          std::string("\x01\x06\x00\x00\x00\x00\x00\x05\x00\x00\x00\x03", 12),
          std::string("\x00\x02\x01\x00\x00\x00\x00\x40\x00\x00\x00", 11),
          std::string("\x00\x03\x00\x03", 4)};
}

}  // namespace

CAIRN_FUZZ_TARGET(checkpoint_dir, &Seeds) {
  Recipe in(data);
  const bool reseal = in.Byte() & 1;
  std::map<std::string, std::string> files = Saved();
  const int edits = static_cast<int>(in.In(0, 4));
  for (int k = 0; k < edits; ++k) Edit(in, files);
  auto meta = files.find(kMetadataFileName);
  if (reseal && meta != files.end()) {
    meta->second = testing_util::Resealed(meta->second);
  }
  const bool edited = files != Saved();

  static const testing_util::TempDir work;
  const std::string dir = work.Sub("ckpt");
  std::error_code ec;
  fs::remove_all(dir, ec);
  for (const auto& [name, bytes] : files) {
    fs::create_directories(fs::path(dir + "/" + name).parent_path());
    testing_util::WriteFile(dir + "/" + name, bytes);
  }

  const std::optional<std::map<std::string, Leaf>> expected = Expected(files);
  CAIRN_FUZZ_CHECK(edited || expected.has_value(),
                   "the reference rejects the unedited checkpoint");

  absl::StatusOr<Metadata> read = ReadMetadata(dir);
  (void)read;

  // One rank, whole tensors.
  {
    Destination one(1, 0);
    absl::StatusOr<LoadResult> loaded = Load(one.sd, dir);
    CAIRN_FUZZ_CHECK(edited || loaded.ok(),
                     absl::StrCat("the unedited checkpoint does not load: ",
                                  loaded.status().ToString()));
    if (loaded.ok()) {
      CAIRN_FUZZ_CHECK(expected.has_value(),
                       "a load succeeded on files that hold no valid checkpoint");
      one.Check(*expected, 1, 0, "one rank");
    }
  }
  // Two ranks, half the columns each: every chunk of model.w in parts.
  {
    Destination two[2] = {{2, 0}, {2, 1}};
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
      for (int r = 0; r < 2; ++r) two[r].Check(*expected, 2, r, "two ranks");
    }
  }
  LoadAllAndCompare(dir, expected);
}

}  // namespace cairn::fuzz
