// Hugging Face folders and .safetensors files loaded as checkpoints
// (hf_import.cc): every dtype, any sharding on several ranks, the key
// mapping, and each kind of damaged source.
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/huggingface.h"
#include "cairn/import_names.h"
#include "cairn/state_dict.h"
#include "cairn/storage.h"
#include "cairn/tensor.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/hf_test_util.h"
#include "checkpoint/test_util.h"
#include "comm/counting_communicator.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using testing::HasSubstr;
using testing_util::CountingCommunicator;
using testing_util::HfBytes;
using testing_util::HfTensor;
using testing_util::TempDir;
using testing_util::WriteFile;
using testing_util::WriteIndex;
using testing_util::WriteSafetensors;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// Row-major bytes of `box` of a tensor whose bytes are `all`.
std::string BoxBytes(const std::string& all, const Shape& shape,
                     const Box& box, size_t es) {
  std::string out;
  testing_util::ForEachIndex(box, [&](const std::vector<int64_t>&,
                                      const std::vector<int64_t>& idx) {
    const int64_t i = testing_util::LinearIndex(shape, idx);
    out.append(all, static_cast<size_t>(i) * es, es);
  });
  return out;
}

const std::vector<HfTensor>& AllKinds() {
  static const auto* t = new std::vector<HfTensor>{
      {"embed.weight", DType::kF32, {12, 8}},
      {"norm.bias", DType::kBF16, {8}},
      {"position_ids", DType::kI64, {1, 5}},
      {"mask", DType::kBool, {3}},
      {"scale", DType::kF8_E8M0, {2, 2}},
      {"rot", DType::kC64, {2}},
      {"u16", DType::kU16, {3, 2}},
      {"u32", DType::kU32, {2}},
      {"fp8", DType::kF8_E4M3, {4}},
      {"step", DType::kF64, {}},
      {"empty", DType::kF16, {0, 4}},
      {"nvfp4", DType::kF4_X2, {3, 4}},
      {"fp6", DType::kF6_E2M3_X4, {2, 1}},
      {"fp6b", DType::kF6_E3M2_X4, {1, 2}},
  };
  return *t;
}

// Loads every tensor of `tensors` whole from `url` and compares bytes.
void ExpectLoadsWhole(const std::string& url,
                      const std::vector<HfTensor>& tensors,
                      const LoadOptions& options = {}) {
  std::vector<std::string> out;
  out.reserve(tensors.size());
  StateDict sd;
  for (const HfTensor& t : tensors) {
    out.emplace_back(HfBytes(t).size(), '\x5a');
    sd[t.name] = TensorView(out.back().data(), t.dtype, t.shape);
  }
  absl::StatusOr<LoadResult> r = Load(sd, url, options);
  ASSERT_TRUE(r.ok()) << r.status();
  uint64_t bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(out[i], HfBytes(tensors[i])) << tensors[i].name;
    bytes += out[i].size();
  }
  EXPECT_FALSE(r->source_has_checksums);
  EXPECT_EQ(r->bytes_loaded, bytes);
  EXPECT_EQ(r->bytes_unverified, bytes);
  EXPECT_EQ(r->bytes_verified, 0u);
  EXPECT_EQ(r->chunks_verified, 0u);
}

TEST(HfImportTest, SingleFileEveryDType) {
  TempDir tmp;
  WriteSafetensors(tmp.Sub("model.safetensors"), AllKinds());
  ExpectLoadsWhole(tmp.path(), AllKinds());
  // The file itself as the URL.
  ExpectLoadsWhole(tmp.Sub("model.safetensors"), AllKinds());
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_FALSE(md->has_checksums);
  EXPECT_EQ(md->tensors.size(), AllKinds().size());
  EXPECT_EQ(md->tensors.at("scale").dtype, DType::kF8_E8M0);
  EXPECT_EQ(IsSafetensorsSource(tmp.path()).value_or(false), true);
}

// safetensors' F4 and F6 entries, written by hand (shapes count values),
// are held packed and reshard in whole elements: 2 ranks, a column each.
TEST(HfImportTest, SubByteTensorsLoadPackedIntoAnySharding) {
  TempDir tmp;
  std::string data;
  for (int i = 0; i < 4 * 8 + 2 * 12; ++i) {
    data.push_back(static_cast<char>(i * 37 + 11));
  }
  // "q": F4 [4, 16] values = [4, 8] bytes; "r": F6_E3M2 [2, 16] values =
  // [2, 4] elements of 3 bytes.
  const std::string json =
      R"({"q":{"dtype":"F4","shape":[4,16],"data_offsets":[0,32]},)"
      R"("r":{"dtype":"F6_E3M2","shape":[2,16],"data_offsets":[32,56]}})";
  std::string file(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(file.data(), &n, 8);
  WriteFile(tmp.Sub("model.safetensors"), file + json + data);
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->tensors.at("q").dtype, DType::kF4_X2);
  EXPECT_EQ(md->tensors.at("q").shape, (Shape{4, 8}));
  EXPECT_EQ(md->tensors.at("r").dtype, DType::kF6_E3M2_X4);
  EXPECT_EQ(md->tensors.at("r").shape, (Shape{2, 4}));
  const std::string q = data.substr(0, 32), r = data.substr(32);
  std::vector<absl::Status> statuses =
      RunInProcess(2, [&](Communicator& comm) -> absl::Status {
        const Box qb({0, 4 * comm.rank()}, {4, 4});
        const Box rb({0, 2 * comm.rank()}, {2, 2});
        std::string qo(16, '\0'), ro(12, '\0');
        StateDict sd;
        sd["q"] = ShardedTensor(
            DType::kF4_X2, {4, 8},
            {Shard{qb, TensorView(qo.data(), DType::kF4_X2, qb.sizes)}});
        sd["r"] = ShardedTensor(
            DType::kF6_E3M2_X4, {2, 4},
            {Shard{rb, TensorView(ro.data(), DType::kF6_E3M2_X4, rb.sizes)}});
        LoadOptions o;
        o.comm = &comm;
        absl::StatusOr<LoadResult> loaded = Load(sd, tmp.path(), o);
        if (!loaded.ok()) return loaded.status();
        if (qo != BoxBytes(q, {4, 8}, qb, 1) || ro != BoxBytes(r, {2, 4}, rb, 3)) {
          return absl::InternalError("wrong bytes");
        }
        return absl::OkStatus();
      });
  for (const absl::Status& st : statuses) EXPECT_TRUE(st.ok()) << st;
}

TEST(HfImportTest, ShardedFolderLoadsIntoAnySharding) {
  TempDir tmp;
  const HfTensor w{"layers.0.w", DType::kF32, {64, 48}};
  const HfTensor v{"layers.1.v", DType::kBF16, {30, 10}};
  const HfTensor b{"layers.0.b", DType::kF16, {48}};
  WriteSafetensors(tmp.Sub("model-00001-of-00002.safetensors"), {b, w});
  WriteSafetensors(tmp.Sub("model-00002-of-00002.safetensors"), {v});
  WriteIndex(tmp.Sub("model.safetensors.index.json"),
             {{w.name, "model-00001-of-00002.safetensors"},
              {b.name, "model-00001-of-00002.safetensors"},
              {v.name, "model-00002-of-00002.safetensors"}});
  ExpectLoadsWhole(tmp.path(), {w, v, b});
  ExpectLoadsWhole(tmp.Sub("model.safetensors.index.json"), {w, v, b});
  // 4 ranks, columns; 3 ranks, rows (each reads only its rows); each also
  // rank-local (no collective: every rank reads the headers itself).
  for (const auto& [cols, rank_local] : {std::pair{true, false},
                                        std::pair{false, false},
                                        std::pair{true, true}}) {
    const int world = cols ? 4 : 3;
    SCOPED_TRACE(absl::StrCat(cols ? "columns on 4 ranks" : "rows on 3 ranks",
                              rank_local ? ", rank-local" : ""));
    std::vector<absl::Status> statuses =
        RunInProcess(world, [&](Communicator& comm) -> absl::Status {
          StateDict sd;
          std::vector<std::string> out;
          std::vector<Box> boxes;
          for (const HfTensor* t : {&w, &v}) {
            const int d = cols ? 1 : 0;
            const int64_t n = t->shape[d];
            const int64_t lo = n * comm.rank() / world;
            const int64_t hi = n * (comm.rank() + 1) / world;
            Box box = Box::Full(t->shape);
            box.offsets[d] = lo;
            box.sizes[d] = hi - lo;
            boxes.push_back(box);
            out.emplace_back(
                static_cast<size_t>(box.num_elements()) * DTypeSize(t->dtype),
                '\0');
          }
          sd[w.name] = ShardedTensor(
              w.dtype, w.shape,
              {Shard{boxes[0], TensorView(out[0].data(), w.dtype,
                                          boxes[0].sizes)}});
          sd[v.name] = ShardedTensor(
              v.dtype, v.shape,
              {Shard{boxes[1], TensorView(out[1].data(), v.dtype,
                                          boxes[1].sizes)}});
          LoadOptions o;
          o.comm = &comm;
          o.strict = false;
          o.rank_local = rank_local;
          absl::StatusOr<LoadResult> r = Load(sd, tmp.path(), o);
          if (!r.ok()) return r.status();
          if (out[0] != BoxBytes(HfBytes(w), w.shape, boxes[0], 4) ||
              out[1] != BoxBytes(HfBytes(v), v.shape, boxes[1], 2)) {
            return absl::InternalError("wrong bytes");
          }
          if (r->source_has_checksums || r->bytes_unverified != r->bytes_loaded) {
            return absl::InternalError("checksums claimed");
          }
          // A row split reads exactly its rows: no whole files.
          if (!cols && r->bytes_read != out[0].size() + out[1].size()) {
            return absl::InternalError(
                absl::StrCat("read ", r->bytes_read, " bytes"));
          }
          // Rank-local: each rank lists what it did not ask for itself.
          if (r->unexpected != std::vector<std::string>{b.name}) {
            return absl::InternalError("unexpected leaves");
          }
          return absl::OkStatus();
        });
    for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(HfImportTest, LoadAllGivesEveryTensor) {
  TempDir tmp;
  WriteSafetensors(tmp.Sub("model.safetensors"), AllKinds());
  absl::StatusOr<StateDict> all = LoadAll(tmp.path());
  ASSERT_TRUE(all.ok()) << all.status();
  for (const HfTensor& t : AllKinds()) {
    const StateDict* leaf = all->Find(t.name);
    ASSERT_NE(leaf, nullptr) << t.name;
    const TensorView& view = leaf->tensor()->shards()[0].view;
    const std::string want = HfBytes(t);
    EXPECT_EQ(std::string(static_cast<const char*>(view.data()), want.size()),
              want)
        << t.name;
  }
}

TEST(HfImportTest, PrefixesAndNameMap) {
  TempDir tmp;
  const HfTensor q{"model.attn.q", DType::kF32, {4, 6}};
  const HfTensor k{"model.attn.k", DType::kF32, {4, 6}};
  const HfTensor v{"model.attn.v", DType::kF32, {4, 6}};
  const HfTensor up{"model.mlp.gate_up", DType::kF32, {10, 3}};
  const HfTensor other{"lm_head", DType::kF32, {2, 2}};
  WriteSafetensors(tmp.Sub("model.safetensors"), {q, k, v, up, other});
  LoadOptions o;
  o.import_names.strip_prefix = "model.";
  o.import_names.add_prefix = "net.";
  o.import_names.map = [](std::vector<ImportedTensor> ts)
      -> absl::StatusOr<std::vector<ImportedTensor>> {
    CAIRN_RETURN_IF_ERROR(FuseTensors(
        ts, {"net.attn.q", "net.attn.k", "net.attn.v"}, "net.attn.qkv", 1));
    CAIRN_RETURN_IF_ERROR(SplitRows(ts, "net.mlp.gate_up",
                                    {{"net.mlp.gate", 4}, {"net.mlp.up", 6}}));
    return ts;
  };
  std::string qkv(4 * 18 * 4, '\0');
  std::string gate(4 * 3 * 4, '\0');
  std::string upb(6 * 3 * 4, '\0');
  std::string head(16, '\0');
  StateDict sd;
  sd["net.attn.qkv"] = TensorView(qkv.data(), DType::kF32, {4, 18});
  sd["net.mlp.gate"] = TensorView(gate.data(), DType::kF32, {4, 3});
  sd["net.mlp.up"] = TensorView(upb.data(), DType::kF32, {6, 3});
  sd["net.lm_head"] = TensorView(head.data(), DType::kF32, {2, 2});
  absl::StatusOr<LoadResult> r = Load(sd, tmp.path(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  // qkv row i is q row i, k row i, v row i.
  std::string want;
  for (int64_t i = 0; i < 4; ++i) {
    for (const HfTensor* t : {&q, &k, &v}) {
      want += HfBytes(*t).substr(static_cast<size_t>(i) * 24, 24);
    }
  }
  EXPECT_EQ(qkv, want);
  EXPECT_EQ(gate, HfBytes(up).substr(0, gate.size()));
  EXPECT_EQ(upb, HfBytes(up).substr(gate.size()));
  EXPECT_EQ(head, HfBytes(other));  // "lm_head" lacks the prefix: kept

  // What a map returns is checked.
  struct Case {
    const char* name;
    std::function<void(std::vector<ImportedTensor>&)> edit;
    const char* error;
  };
  const Case cases[] = {
      {"unknown source",
       [](auto& ts) { ts[0].parts[0].source = "nope"; }, "no stored tensor"},
      {"twice",
       [](auto& ts) { ts.push_back(ts[0]); ts.back().fqn = "copy"; },
       "share"},
      {"gap",
       [](auto& ts) { ts[0].shape[0] += 1; }, "cover"},
      {"wrong dtype",
       [](auto& ts) { ts[0].dtype = DType::kI32; }, "no cast"},
      {"columns",
       [](auto& ts) { ts[0].parts[0].box.sizes[1] -= 1; }, "leading rows"},
      {"empty name", [](auto& ts) { ts[0].fqn = ""; }, "empty name"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ImportNames names;
    names.map = [&](std::vector<ImportedTensor> ts)
        -> absl::StatusOr<std::vector<ImportedTensor>> {
      c.edit(ts);
      return ts;
    };
    absl::StatusOr<Metadata> md = ReadImportedMetadata(tmp.path(), names);
    ASSERT_FALSE(md.ok());
    EXPECT_THAT(Msg(md.status()), HasSubstr(c.error));
  }
  // The helpers' own errors.
  std::vector<ImportedTensor> ts;
  ImportNames none;
  none.map = [&](std::vector<ImportedTensor> t)
      -> absl::StatusOr<std::vector<ImportedTensor>> {
    ts = t;
    return t;
  };
  ASSERT_TRUE(ReadImportedMetadata(tmp.path(), none).ok());
  EXPECT_EQ(FuseTensors(ts, {"model.attn.q", "lm_head"}, "x", 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FuseTensors(ts, {"missing"}, "x", 0).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(SplitRows(ts, "lm_head", {{"a", 1}, {"b", 2}}).code(),
            absl::StatusCode::kInvalidArgument);
}

// A coordinated load of a Hugging Face file whose ranks read different
// columns takes three collectives when all is well in a job of up to 8
// ranks: the plans' gather (with each rank's digest of the headers it read
// itself) and the answer, and the agreement on the reads. On a node with
// more ranks than cores each one waits for descheduled ranks
// (bench/RESULTS.md, issue 37). From 9 ranks on, the coordinator reads
// the headers alone and broadcasts them: four.
TEST(HfImportTest, ColumnLoadTakesThreeCollectivesUpToEightRanks) {
  TempDir tmp;
  const HfTensor w{"w", DType::kF32, {8, 18}};
  WriteSafetensors(tmp.Sub("model.safetensors"), {w});
  for (const int world : {3, 8, 9}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks"));
    std::vector<int> calls(world, 0);
    std::vector<absl::Status> statuses =
        RunInProcess(world, [&](Communicator& inner) -> absl::Status {
          CountingCommunicator comm(inner);
          const int64_t lo = 2 * comm.rank();
          Box box = Box::Full(w.shape);
          box.offsets[1] = lo;
          box.sizes[1] = 2;
          std::string out(8 * 2 * 4, '\0');
          StateDict sd;
          sd[w.name] = ShardedTensor(
              w.dtype, w.shape,
              {Shard{box, TensorView(out.data(), w.dtype, box.sizes)}});
          LoadOptions o;
          o.comm = &comm;
          CAIRN_RETURN_IF_ERROR(Load(sd, tmp.path(), o).status());
          calls[comm.rank()] = comm.calls;
          const std::string all = HfBytes(w);
          for (int64_t row = 0; row < 8; ++row) {
            if (out.substr(static_cast<size_t>(row) * 8, 8) !=
                all.substr(static_cast<size_t>(row * 18 + lo) * 4, 8)) {
              return absl::InternalError(
                  absl::StrCat("wrong bytes, row ", row));
            }
          }
          return absl::OkStatus();
        });
    for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
    EXPECT_THAT(calls, testing::Each(world <= 8 ? 3 : 4));
  }
}

// Where every rank reads the headers itself, ranks that read different
// ones (the folder replaced between their reads, or ranks pointed at
// different models) are refused before anything is read: kAborted on every
// rank, naming the first rank that differs from the coordinator. A rank
// that cannot read them at all fails every rank, naming it.
TEST(HfImportTest, RanksThatReadOtherHeadersAreRefused) {
  TempDir tmp;
  const HfTensor w{"w", DType::kF32, {4, 6}};
  // b holds w at the same offsets, and one more tensor: its header differs.
  const HfTensor extra{"extra", DType::kI32, {3}};
  WriteSafetensors(tmp.Sub("a/model.safetensors"), {w});
  WriteSafetensors(tmp.Sub("b/model.safetensors"), {w, extra});
  ASSERT_TRUE(std::filesystem::create_directories(tmp.Sub("empty")));
  struct Case {
    const char* folder;  // rank 1's
    absl::StatusCode code;
    std::vector<std::string> words;
  };
  const Case cases[] = {
      {"b", absl::StatusCode::kAborted,
       {"rank 1 read other metadata than rank 0 did", "nothing was loaded"}},
      {"empty", absl::StatusCode::kNotFound,
       {"on 1 of 3 ranks", "rank 1: NOT_FOUND: reading metadata"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.folder);
    std::vector<std::string> outs(3, std::string(4 * 2 * 4, '\x7f'));
    std::vector<absl::Status> statuses =
        RunInProcess(3, [&](Communicator& comm) -> absl::Status {
          const int r = comm.rank();
          Box box = Box::Full(w.shape);
          box.offsets[1] = 2 * r;
          box.sizes[1] = 2;
          StateDict sd;
          sd[w.name] = ShardedTensor(
              w.dtype, w.shape,
              {Shard{box, TensorView(outs[r].data(), w.dtype, box.sizes)}});
          LoadOptions o;
          o.comm = &comm;
          return Load(sd, tmp.Sub(r == 1 ? c.folder : "a"), o).status();
        });
    ASSERT_EQ(statuses.size(), 3u);
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), c.code) << s;
      EXPECT_EQ(s, statuses[0]);
      for (const std::string& word : c.words) {
        EXPECT_THAT(Msg(s), HasSubstr(word));
      }
    }
    // Refused while planning: no rank wrote a byte.
    for (const std::string& out : outs) {
      EXPECT_EQ(out, std::string(4 * 2 * 4, '\x7f'));
    }
  }
}

// The ranks build the metadata from the coordinator's headers each with
// their own name map; one whose map fails (here rank 2 of 3) fails every
// rank alike, naming it, and no rank hangs: its error travels in the
// planning gather, which every rank takes part in.
TEST(HfImportTest, NameMapFailingOnOneRankFailsEveryRank) {
  TempDir tmp;
  const HfTensor w{"w", DType::kF32, {6, 4}};
  WriteSafetensors(tmp.Sub("model.safetensors"), {w});
  for (const int failing : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("the map fails on rank ", failing));
    std::vector<absl::Status> statuses =
        RunInProcess(3, [&](Communicator& comm) -> absl::Status {
          std::string out(6 * 4 * 4, '\0');
          StateDict sd;
          sd[w.name] = TensorView(out.data(), w.dtype, w.shape);
          LoadOptions o;
          o.comm = &comm;
          o.import_names.map = [&](std::vector<ImportedTensor> ts)
              -> absl::StatusOr<std::vector<ImportedTensor>> {
            if (comm.rank() == failing) {
              return absl::InvalidArgumentError("map exploded");
            }
            return ts;
          };
          return Load(sd, tmp.path(), o).status();
        });
    ASSERT_EQ(statuses.size(), 3u);
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_EQ(s, statuses[0]);
      EXPECT_THAT(Msg(s), HasSubstr(absl::StrCat("rank ", failing, ": ")));
      EXPECT_THAT(Msg(s), HasSubstr("reading metadata: the import name map"));
      EXPECT_THAT(Msg(s), HasSubstr("map exploded"));
      EXPECT_THAT(Msg(s), HasSubstr("on 1 of 3 ranks"));
    }
  }
}

// Each kind of damaged source is an error naming the file and tensor.
TEST(HfImportTest, DamagedSourcesAreClearErrors) {
  const HfTensor a{"a", DType::kF32, {4, 4}};
  const HfTensor b{"b", DType::kI32, {3}};
  struct Case {
    const char* name;
    std::function<void(const TempDir&)> make;
    absl::StatusCode code;
    std::vector<std::string> words;
  };
  auto header_of = [](const std::string& dtype, const std::string& offsets,
                      const std::string& shape) {
    const std::string json = absl::StrCat(
        "{\"t\": {\"dtype\": \"", dtype, "\", \"shape\": ", shape,
        ", \"data_offsets\": ", offsets, "}}");
    std::string len(8, '\0');
    const uint64_t n = json.size();
    std::memcpy(len.data(), &n, 8);
    return len + json;
  };
  const std::vector<Case> cases = {
      {"nothing there", [](const TempDir&) {}, absl::StatusCode::kNotFound,
       {"model.safetensors.index.json"}},
      {"index names a missing file",
       [&](const TempDir& t) {
         WriteSafetensors(t.Sub("one.safetensors"), {a});
         WriteIndex(t.Sub("model.safetensors.index.json"),
                    {{"a", "one.safetensors"}, {"b", "two.safetensors"}});
       },
       absl::StatusCode::kNotFound, {"two.safetensors", "'b'"}},
      {"index names a tensor the file lacks",
       [&](const TempDir& t) {
         WriteSafetensors(t.Sub("one.safetensors"), {a});
         WriteIndex(t.Sub("model.safetensors.index.json"),
                    {{"a", "one.safetensors"}, {"b", "one.safetensors"}});
       },
       absl::StatusCode::kDataLoss, {"one.safetensors", "'b'"}},
      {"index escapes the folder",
       [&](const TempDir& t) {
         WriteIndex(t.Sub("model.safetensors.index.json"),
                    {{"a", "../one.safetensors"}});
       },
       absl::StatusCode::kDataLoss, {"weight_map", "\"a\""}},
      {"index is not JSON",
       [&](const TempDir& t) {
         WriteFile(t.Sub("model.safetensors.index.json"), "{\"weight_map\":");
       },
       absl::StatusCode::kDataLoss, {"model.safetensors.index.json"}},
      {"unknown dtype",
       [&](const TempDir& t) {
         WriteFile(t.Sub("model.safetensors"),
                   header_of("F7", "[0, 4]", "[4]") + std::string(4, 'x'));
       },
       absl::StatusCode::kDataLoss, {"model.safetensors", "F7"}},
      {"sub-byte dtype that does not pack",
       [&](const TempDir& t) {
         WriteFile(t.Sub("model.safetensors"),
                   header_of("F4", "[0, 2]", "[3]") + std::string(2, 'x'));
       },
       absl::StatusCode::kUnimplemented,
       {"model.safetensors", "\"t\"", "F4_X2"}},
      {"size does not match the shape",
       [&](const TempDir& t) {
         WriteFile(t.Sub("model.safetensors"),
                   header_of("F32", "[0, 12]", "[4]") + std::string(12, 'x'));
       },
       absl::StatusCode::kDataLoss, {"model.safetensors", "\"t\""}},
      {"bytes past the entries",
       [&](const TempDir& t) {
         WriteFile(t.Sub("model.safetensors"),
                   header_of("F32", "[0, 16]", "[4]") + std::string(20, 'x'));
       },
       absl::StatusCode::kDataLoss, {"model.safetensors"}},
      {"header longer than the file",
       [&](const TempDir& t) {
         WriteFile(t.Sub("model.safetensors"),
                   header_of("F32", "[0, 16]", "[4]").substr(0, 30));
       },
       absl::StatusCode::kDataLoss, {"model.safetensors"}},
      {"file truncated after its header",
       [&](const TempDir& t) {
         WriteFile(t.Sub("model.safetensors"),
                   header_of("F32", "[0, 16]", "[4]") + std::string(8, 'x'));
       },
       absl::StatusCode::kDataLoss, {"model.safetensors"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir tmp;
    c.make(tmp);
    std::string out(64, '\0');
    StateDict sd;
    sd["a"] = TensorView(out.data(), DType::kF32, {4, 4});
    LoadOptions o;
    o.strict = false;
    absl::Status s = Load(sd, tmp.path(), o).status();
    EXPECT_EQ(s.code(), c.code) << s;
    for (const std::string& w : c.words) EXPECT_THAT(Msg(s), HasSubstr(w));
    EXPECT_EQ(ReadMetadata(tmp.path()).status().code(), s.code());
  }
}

// A file that changes between the coordinator's read of its header and the
// load's reads: the loader's own check of the header it reads refuses it.
TEST(HfImportTest, FileChangedUnderTheLoadIsRefused) {
  TempDir tmp;
  const HfTensor a{"a", DType::kF32, {4, 4}};
  WriteSafetensors(tmp.Sub("model.safetensors"), {a});
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok());
  for (const HfTensor& now : {HfTensor{"b", DType::kF32, {4, 4}},
                              HfTensor{"a", DType::kI32, {4, 4}},
                              HfTensor{"a", DType::kF32, {2, 8}}}) {
    SCOPED_TRACE(now.name);
    WriteSafetensors(tmp.Sub("model.safetensors"), {now});
    std::string out(64, '\0');
    StateDict sd;
    sd["a"] = TensorView(out.data(), DType::kF32, {4, 4});
    absl::StatusOr<std::unique_ptr<Storage>> storage =
        Storage::Open(tmp.path());
    ASSERT_TRUE(storage.ok());
    absl::Status s = internal_checkpoint::LoadWithMetadata(
                         sd, storage->get(), *md, LoadOptions{})
                         .status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(Msg(s), HasSubstr("header mismatch for a"));
  }
}

TEST(HfImportTest, MetadataOfASourceIsNeverWritten) {
  TempDir tmp;
  WriteSafetensors(tmp.Sub("model.safetensors"), AllKinds());
  absl::StatusOr<StateDict> all = LoadAll(tmp.path());
  ASSERT_TRUE(all.ok());
  // A folder with metadata.json is a checkpoint, whatever else it holds.
  absl::Status saved = Save(*all, tmp.Sub("ckpt")).status();
  ASSERT_TRUE(saved.ok()) << saved;
  WriteSafetensors(tmp.Sub("ckpt/model.safetensors"), AllKinds());
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.Sub("ckpt"));
  ASSERT_TRUE(md.ok());
  EXPECT_TRUE(md->has_checksums);
  EXPECT_FALSE(IsSafetensorsSource(tmp.Sub("ckpt")).value_or(true));
}

}  // namespace
}  // namespace cairn
