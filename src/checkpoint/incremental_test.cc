// Incremental checkpoints (SaveOptions::base, format version 6): unchanged
// chunks are referenced, not written, and load back bit-exact under other
// shardings; references never chain; a missing, replaced or forged base is
// a clear error; verify follows references; RewriteCheckpoint flattens; the
// manager keeps referenced steps and saves a full one every full_every.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/manager.h"
#include "cairn/metadata.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"
#include "cairn/verify.h"
#include "checkpoint/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;
using testing_util::ReadFile;
using testing_util::Resealed;
using testing_util::TempDir;
using testing_util::WriteFile;

constexpr int64_t kRows = 96, kCols = 80;

// Element (r, c) of tensor `name` at version `v`: each tensor's own values,
// which change with v only where `changed` says.
float Value(int name, int v, int64_t r, int64_t c) {
  return static_cast<float>(name * 1000003 + v * 7919) +
         static_cast<float>(r * kCols + c) * 0.5f;
}

// The model: "frozen" (never changes), "trained" (changes with v), both
// [kRows, kCols] F32, each rank holding rows; an object and a scalar.
struct Model {
  std::vector<Tensor> owned;
  StateDict sd;
};

Box RowsOf(int rank, int world) {
  const int64_t lo = kRows * rank / world, hi = kRows * (rank + 1) / world;
  return Box{{lo, 0}, {hi - lo, kCols}};
}
Box ColsOf(int rank, int world) {
  const int64_t lo = kCols * rank / world, hi = kCols * (rank + 1) / world;
  return Box{{0, lo}, {kRows, hi - lo}};
}

Model MakeModel(int rank, int world, int frozen_v, int trained_v,
                bool by_cols = false, bool fill = true) {
  Model m;
  const Box box = by_cols ? ColsOf(rank, world) : RowsOf(rank, world);
  int name = 0;
  for (const auto& [fqn, v] :
       {std::pair{"frozen", frozen_v}, std::pair{"trained", trained_v}}) {
    ++name;
    Tensor t = *Tensor::Zeros(DType::kF32, box.sizes);
    auto* p = static_cast<float*>(t.data());
    for (int64_t r = 0; r < box.sizes[0] && fill; ++r) {
      for (int64_t c = 0; c < box.sizes[1]; ++c) {
        p[r * box.sizes[1] + c] =
            Value(name, v, box.offsets[0] + r, box.offsets[1] + c);
      }
    }
    m.sd["model"][fqn] = ShardedTensor(DType::kF32, {kRows, kCols},
                                       {{box, t.view()}});
    m.owned.push_back(std::move(t));
  }
  m.sd["step"] = int64_t{trained_v};
  m.sd["blob"] = Object{std::string(5000, 'b')};
  return m;
}

// The first wrong element of a model loaded by columns, or "".
std::string CheckModel(const Model& m, int rank, int world, int frozen_v,
                       int trained_v) {
  const Box box = ColsOf(rank, world);
  for (int name = 1; name <= 2; ++name) {
    const int v = name == 1 ? frozen_v : trained_v;
    const auto* p = static_cast<const float*>(m.owned[name - 1].data());
    for (int64_t r = 0; r < box.sizes[0]; ++r) {
      for (int64_t c = 0; c < box.sizes[1]; ++c) {
        if (p[r * box.sizes[1] + c] !=
            Value(name, v, box.offsets[0] + r, box.offsets[1] + c)) {
          return absl::StrCat("tensor ", name, " at (", r, ", ",
                              box.offsets[1] + c, ")");
        }
      }
    }
  }
  return "";
}

struct Saved {
  int chunks_reused = 0;
  uint64_t bytes_reused = 0;
  uint64_t data_bytes = 0;
};

// `world` ranks save versions (frozen_v, trained_v) at `dir` against `base`.
absl::StatusOr<Saved> SaveModel(const std::string& dir, int world,
                                int frozen_v, int trained_v,
                                const std::string& base,
                                SaveOptions options = {}) {
  std::vector<Saved> per_rank(world);
  std::vector<absl::Status> st = RunInProcess(world, [&](Communicator& comm) {
    Model m = MakeModel(comm.rank(), world, frozen_v, trained_v);
    SaveOptions o = options;
    o.comm = &comm;
    o.base = base;
    absl::StatusOr<SaveResult> r = Save(m.sd, dir, o);
    if (!r.ok()) return r.status();
    per_rank[comm.rank()] = {r->chunks_reused, r->bytes_reused, r->data_bytes};
    return absl::OkStatus();
  });
  for (const absl::Status& s : st) {
    if (!s.ok()) return s;
  }
  Saved total;
  for (const Saved& s : per_rank) {
    total.chunks_reused += s.chunks_reused;
    total.bytes_reused += s.bytes_reused;
    total.data_bytes += s.data_bytes;
  }
  return total;
}

// `world` ranks load `dir` by columns and check versions; the first error.
absl::Status LoadAndCheck(const std::string& dir, int world, int frozen_v,
                          int trained_v) {
  std::vector<absl::Status> st = RunInProcess(world, [&](Communicator& comm) {
    Model m = MakeModel(comm.rank(), world, 0, 0, /*by_cols=*/true,
                        /*fill=*/false);
    LoadOptions o;
    o.comm = &comm;
    absl::StatusOr<LoadResult> r = Load(m.sd, dir, o);
    if (!r.ok()) return r.status();
    if (r->bytes_unverified != 0) {
      return absl::InternalError("bytes returned unverified");
    }
    const std::string wrong =
        CheckModel(m, comm.rank(), world, frozen_v, trained_v);
    if (!wrong.empty()) return absl::InternalError("wrong value in " + wrong);
    if (std::get<int64_t>(*m.sd["step"].scalar()) != trained_v) {
      return absl::InternalError("wrong step");
    }
    return absl::OkStatus();
  });
  for (const absl::Status& s : st) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

constexpr uint64_t kTensorBytes = kRows * kCols * 4;

TEST(IncrementalTest, UnchangedChunksAreReferencedAndLoadResharded) {
  TempDir tmp;
  const std::string one = tmp.Sub("step-1"), two = tmp.Sub("step-2");
  absl::StatusOr<Saved> first = SaveModel(one, 4, 1, 1, "");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->chunks_reused, 0);
  absl::StatusOr<Saved> second = SaveModel(two, 4, 1, 2, one);
  ASSERT_TRUE(second.ok()) << second.status();
  // The frozen tensor's 4 chunks are referenced; the trained one, the
  // object and the scalar are written.
  EXPECT_EQ(second->chunks_reused, 4);
  EXPECT_EQ(second->bytes_reused, kTensorBytes);
  EXPECT_EQ(second->data_bytes, kTensorBytes + 5000);

  absl::StatusOr<Metadata> md = ReadMetadata(two);
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->version, 6);
  ASSERT_EQ(md->references.size(), 1u);
  EXPECT_EQ(md->references[0].url, "../step-1");
  absl::StatusOr<Metadata> base = ReadMetadata(one);
  ASSERT_TRUE(base.ok());
  EXPECT_EQ(md->references[0].save_id, base->save_id);
  for (const ChunkMetadata& c : md->tensors.at("model.frozen").chunks) {
    EXPECT_THAT(c.location.file, ::testing::StartsWith("../step-1/data-"));
    ASSERT_TRUE(c.location.xxh3.has_value());
  }
  for (const ChunkMetadata& c : md->tensors.at("model.trained").chunks) {
    EXPECT_THAT(c.location.file, ::testing::StartsWith("data-"));
    ASSERT_TRUE(c.location.xxh3.has_value());
  }
  // 3 ranks load it by columns, bit-exact and every byte checked.
  absl::Status loaded = LoadAndCheck(two, 3, 1, 2);
  EXPECT_TRUE(loaded.ok()) << loaded;
  // LoadAll and verify follow the reference too, also from a relative
  // path (the sibling is resolved against its absolute form).
  absl::StatusOr<StateDict> all = LoadAll(two);
  ASSERT_TRUE(all.ok()) << all.status();
  const std::string relative = std::filesystem::relative(two).string();
  ASSERT_FALSE(relative.starts_with("/"));
  EXPECT_TRUE(LoadAll(relative).ok()) << LoadAll(relative).status();
  absl::StatusOr<VerifyReport> v = Verify(two);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->ok()) << v->problems[0].message;
  EXPECT_EQ(v->references, 1);
  EXPECT_EQ(v->bytes_checked, 2 * kTensorBytes + 5000);
}

TEST(IncrementalTest, ReferencesNeverChainAndTheFolderMovesWhole) {
  TempDir tmp;
  const std::string root = tmp.Sub("run");
  std::filesystem::create_directories(root);
  ASSERT_TRUE(SaveModel(root + "/step-1", 2, 1, 1, "").ok());
  ASSERT_TRUE(SaveModel(root + "/step-2", 2, 1, 2, root + "/step-1").ok());
  // Step 3 changes nothing: "frozen" is kept in step 1 (where step 2 keeps
  // it), "trained" in step 2.
  absl::StatusOr<Saved> third =
      SaveModel(root + "/step-3", 2, 1, 2, root + "/step-2");
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->chunks_reused, 4);
  absl::StatusOr<Metadata> md = ReadMetadata(root + "/step-3");
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_EQ(md->references.size(), 2u);
  EXPECT_EQ(md->references[0].url, "../step-2");
  EXPECT_EQ(md->references[1].url, "../step-1");
  for (const ChunkMetadata& c : md->tensors.at("model.frozen").chunks) {
    EXPECT_THAT(c.location.file, ::testing::StartsWith("../step-1/"));
  }
  for (const ChunkMetadata& c : md->tensors.at("model.trained").chunks) {
    EXPECT_THAT(c.location.file, ::testing::StartsWith("../step-2/"));
  }
  // References are siblings: the folder of steps moves as a whole.
  const std::string moved = tmp.Sub("moved");
  std::filesystem::rename(root, moved);
  absl::Status loaded = LoadAndCheck(moved + "/step-3", 2, 1, 2);
  EXPECT_TRUE(loaded.ok()) << loaded;
}

TEST(IncrementalTest, AChangedByteIsWrittenAndTheRestReused) {
  TempDir tmp;
  const std::string one = tmp.Sub("a"), two = tmp.Sub("b");
  ASSERT_TRUE(SaveModel(one, 1, 1, 1, "").ok());
  // One process, two chunks of "frozen": the second has one changed byte.
  Model m = MakeModel(0, 1, 1, 1);
  Tensor lower = *Tensor::Empty(DType::kF32, {kRows / 2, kCols});
  Tensor upper = *Tensor::Empty(DType::kF32, {kRows / 2, kCols});
  const auto* src = static_cast<const std::byte*>(m.owned[0].data());
  std::memcpy(lower.data(), src, lower.nbytes());
  std::memcpy(upper.data(), src + lower.nbytes(), upper.nbytes());
  static_cast<std::byte*>(upper.data())[123] ^= std::byte{0x40};
  m.sd["model"]["frozen"] = ShardedTensor(
      DType::kF32, {kRows, kCols},
      {{Box{{0, 0}, {kRows / 2, kCols}}, lower.view()},
       {Box{{kRows / 2, 0}, {kRows / 2, kCols}}, upper.view()}});
  SaveOptions o;
  o.base = one;
  absl::StatusOr<SaveResult> r = Save(m.sd, two, o);
  ASSERT_TRUE(r.ok()) << r.status();
  // The base stored "frozen" as one chunk, so neither half matches a base
  // box; "trained" (one chunk, same box) is reused.
  EXPECT_EQ(r->chunks_reused, 1);
  EXPECT_EQ(r->bytes_reused, kTensorBytes);
  // Against a base of the same two halves, only the changed one is
  // written.
  const std::string three = tmp.Sub("c");
  ASSERT_TRUE(Save(m.sd, three).ok());
  static_cast<std::byte*>(upper.data())[123] ^= std::byte{0x40};
  o.base = three;
  r = Save(m.sd, tmp.Sub("d"), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->chunks_reused, 2);  // "trained" and the lower half
  absl::StatusOr<StateDict> all = LoadAll(tmp.Sub("d"));
  ASSERT_TRUE(all.ok()) << all.status();
  const ShardedTensor* frozen = (*all)["model"]["frozen"].tensor();
  ASSERT_NE(frozen, nullptr);
  const TensorView& v = frozen->shards()[0].view;
  EXPECT_EQ(std::memcmp(v.data(), src, v.nbytes()), 0);
}

TEST(IncrementalTest, MissingOrReplacedBaseIsAClearError) {
  TempDir tmp;
  const std::string one = tmp.Sub("step-1"), two = tmp.Sub("step-2");
  ASSERT_TRUE(SaveModel(one, 2, 1, 1, "").ok());
  ASSERT_TRUE(SaveModel(two, 2, 1, 2, one).ok());
  // Replaced: another save over the base.
  SaveOptions overwrite;
  overwrite.overwrite = true;
  ASSERT_TRUE(SaveModel(one, 2, 1, 1, "", overwrite).ok());
  absl::Status s = LoadAndCheck(two, 2, 1, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("not the one it was saved against"));
  EXPECT_THAT(s.message(), HasSubstr("../step-1"));
  absl::StatusOr<VerifyReport> v = Verify(two);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_FALSE(v->ok());
  EXPECT_EQ(v->problems[0].kind, "reference");
  EXPECT_EQ(v->problems[0].file, "../step-1");
  // Missing: the base deleted.
  std::filesystem::remove_all(one);
  s = LoadAndCheck(two, 2, 1, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("was it deleted?"));
  absl::Status all = LoadAll(two).status();
  EXPECT_EQ(all.code(), absl::StatusCode::kNotFound) << all;
  EXPECT_THAT(all.message(), HasSubstr("was it deleted?"));
  v = Verify(two);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_FALSE(v->ok());
  EXPECT_EQ(v->problems[0].kind, "reference");
}

TEST(IncrementalTest, BadBasesAreRefusedBeforeAnythingIsWritten) {
  TempDir tmp;
  const std::string one = tmp.Sub("one");
  ASSERT_TRUE(SaveModel(one, 1, 1, 1, "").ok());
  // The checkpoint being saved.
  absl::StatusOr<Saved> s = SaveModel(one, 2, 1, 1, one + "/");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAlreadyExists) << s.status();
  SaveOptions over;
  over.overwrite = true;
  s = SaveModel(one, 2, 1, 1, one, over);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("is the checkpoint being saved"));
  // No checkpoint there.
  s = SaveModel(tmp.Sub("x"), 2, 1, 1, tmp.Sub("nothing"));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("base"));
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("x") + "/metadata.json"));
  // Another block size.
  SaveOptions blocks;
  blocks.crc32c_block_bytes = 8192;
  s = SaveModel(tmp.Sub("y"), 2, 1, 1, one, blocks);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("checksum blocks"));
  // Rank-local.
  SaveOptions local;
  local.rank_local = true;
  s = SaveModel(tmp.Sub("z"), 2, 1, 1, one, local);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(IncrementalTest, ForgedReferencesAreDataLoss) {
  TempDir tmp;
  const std::string one = tmp.Sub("step-1"), two = tmp.Sub("step-2");
  ASSERT_TRUE(SaveModel(one, 1, 1, 1, "").ok());
  ASSERT_TRUE(SaveModel(two, 1, 1, 2, one).ok());
  const std::string path = two + "/metadata.json";
  const std::string text = ReadFile(path);
  struct Edit {
    std::string from, to, why;
  };
  const Edit edits[] = {
      // A chunk in a checkpoint not listed.
      {"\"file\":\"../step-1/", "\"file\":\"../step-9/", "references"},
      // A reference that escapes.
      {"\"url\":\"../step-1\"", "\"url\":\"../../etc\"", "reference URL"},
      // The same save id as the checkpoint's own.
      {"\"references\":[{\"checksum\":", "\"references\":[{\"checksum\":",
       ""},
  };
  for (const Edit& e : edits) {
    if (e.why.empty()) continue;
    const std::string forged = absl::StrReplaceAll(text, {{e.from, e.to}});
    ASSERT_NE(forged, text) << e.from;
    WriteFile(path, Resealed(forged));
    absl::StatusOr<Metadata> md = ReadMetadata(two);
    EXPECT_EQ(md.status().code(), absl::StatusCode::kDataLoss) << e.to;
    EXPECT_THAT(md.status().message(), HasSubstr(e.why)) << md.status();
  }
  // References in a version 5 text are refused, not ignored.
  std::string v5 = absl::StrReplaceAll(text, {{"\"version\":6", "\"version\":5"}});
  WriteFile(path, Resealed(v5));
  EXPECT_EQ(ReadMetadata(two).status().code(), absl::StatusCode::kDataLoss);
  WriteFile(path, text);
  EXPECT_TRUE(ReadMetadata(two).ok());
}

TEST(IncrementalTest, CompressedBaseChunksAreReusedAsStored) {
  TempDir tmp;
  const std::string one = tmp.Sub("step-1"), two = tmp.Sub("step-2");
  SaveOptions zstd;
  zstd.codec = Codec::kGroupedZstd;
  zstd.crc32c_block_bytes = 4096;
  ASSERT_TRUE(SaveModel(one, 2, 1, 1, "", zstd).ok());
  SaveOptions raw;
  raw.crc32c_block_bytes = 4096;
  absl::StatusOr<Saved> second = SaveModel(two, 2, 1, 2, one, raw);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->chunks_reused, 2);
  absl::StatusOr<Metadata> md = ReadMetadata(two);
  ASSERT_TRUE(md.ok());
  absl::StatusOr<Metadata> base = ReadMetadata(one);
  ASSERT_TRUE(base.ok());
  const auto& kept = md->tensors.at("model.frozen").chunks;
  const auto& there = base->tensors.at("model.frozen").chunks;
  ASSERT_EQ(kept.size(), there.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    EXPECT_TRUE(there[i].location.compressed());
    EXPECT_EQ(kept[i].location.compression, there[i].location.compression);
    EXPECT_EQ(kept[i].location.file, "../step-1/" + there[i].location.file);
  }
  absl::Status loaded = LoadAndCheck(two, 3, 1, 2);
  EXPECT_TRUE(loaded.ok()) << loaded;
}

TEST(IncrementalTest, RewriteFlattensIntoAStandaloneCheckpoint) {
  TempDir tmp;
  const std::string one = tmp.Sub("step-1"), two = tmp.Sub("step-2");
  ASSERT_TRUE(SaveModel(one, 2, 1, 1, "").ok());
  ASSERT_TRUE(SaveModel(two, 2, 1, 2, one).ok());
  const std::string flat = tmp.Sub("flat");
  absl::StatusOr<SaveResult> r = RewriteCheckpoint(two, flat);
  ASSERT_TRUE(r.ok()) << r.status();
  std::filesystem::remove_all(one);
  absl::StatusOr<Metadata> md = ReadMetadata(flat);
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_TRUE(md->references.empty());
  absl::Status loaded = LoadAndCheck(flat, 2, 1, 2);
  EXPECT_TRUE(loaded.ok()) << loaded;
}

TEST(IncrementalTest, ManagerKeepsReferencedStepsAndSavesFullOnes) {
  TempDir tmp;
  const std::string root = tmp.Sub("run");
  ManagerOptions mo;
  mo.keep_last = 1;
  mo.async = false;
  mo.incremental = true;
  mo.full_every = 3;
  std::vector<bool> full;
  {
    absl::StatusOr<std::unique_ptr<CheckpointManager>> mgr =
        CheckpointManager::Create(root, nullptr, mo);
    ASSERT_TRUE(mgr.ok()) << mgr.status();
    for (int step = 1; step <= 5; ++step) {
      Model m = MakeModel(0, 1, 1, step);
      absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h =
          (*mgr)->Save(step, m.sd);
      ASSERT_TRUE(h.ok()) << h.status();
      absl::StatusOr<Metadata> md = ReadMetadata((*mgr)->StepDir(step));
      ASSERT_TRUE(md.ok()) << md.status();
      full.push_back(md->references.empty());
    }
    ASSERT_TRUE((*mgr)->Wait().ok());
    // Steps 1 and 4 are full; 5 keeps "frozen" in 4, which stays though
    // keep_last is 1.
    EXPECT_EQ(full, (std::vector<bool>{true, false, false, true, false}));
    absl::StatusOr<std::vector<int64_t>> steps = (*mgr)->Steps();
    ASSERT_TRUE(steps.ok());
    EXPECT_EQ(*steps, (std::vector<int64_t>{4, 5}));
    absl::Status loaded = LoadAndCheck((*mgr)->StepDir(5), 2, 1, 5);
    EXPECT_TRUE(loaded.ok()) << loaded;
  }
  // A new manager (a restart) counts the saves since the full one: step 6
  // is the second in a row after step 4 (it keeps "frozen" there, as step
  // 5 does), step 7 the third, so full.
  absl::StatusOr<std::unique_ptr<CheckpointManager>> again =
      CheckpointManager::Create(root, nullptr, mo);
  ASSERT_TRUE(again.ok());
  std::vector<std::vector<std::string>> refs;
  for (int step = 6; step <= 7; ++step) {
    Model m = MakeModel(0, 1, 1, step);
    ASSERT_TRUE((*again)->Save(step, m.sd).ok());
    absl::StatusOr<Metadata> md = ReadMetadata((*again)->StepDir(step));
    ASSERT_TRUE(md.ok()) << md.status();
    refs.emplace_back();
    for (const CheckpointReference& r : md->references) {
      refs.back().push_back(r.url);
    }
  }
  EXPECT_EQ(refs, (std::vector<std::vector<std::string>>{
                      {"../step-0000000004"}, {}}));
  ASSERT_TRUE((*again)->Wait().ok());
  absl::StatusOr<std::vector<int64_t>> steps = (*again)->Steps();
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(*steps, (std::vector<int64_t>{7}));
}

}  // namespace
}  // namespace cairn
