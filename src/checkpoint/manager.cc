// CheckpointManager: step folders under a root, async saves through an
// AsyncSaver, retention by rank 0 with un-commit-then-delete, and a restore
// that takes rank 0's view of the newest committed step.
#include "cairn/manager.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/metadata.h"
#include "cairn/storage.h"
#include "checkpoint/checkpoint_impl.h"
#include "core/status.h"
#include "format/references.h"
#include "storage/file_storage.h"

namespace cairn {
namespace {

namespace fs = std::filesystem;
constexpr char kPrefix[] = "step-";

// The step of a folder name "step-NNNNNNNNNN", or nullopt.
std::optional<int64_t> StepOfName(const std::string& name) {
  if (!name.starts_with(kPrefix)) return std::nullopt;
  const std::string digits = name.substr(sizeof(kPrefix) - 1);
  int64_t step = 0;
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(digits, &step)) {
    return std::nullopt;
  }
  return step;
}

struct Folder {
  int64_t step;
  bool committed;
};

absl::StatusOr<std::vector<Folder>> ListLocalFolders(const std::string& root) {
  CAIRN_ASSIGN_OR_RETURN(const std::string path,
                         internal_storage::LocalPathOf(root));
  std::vector<Folder> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
    if (!e.is_directory()) continue;
    std::optional<int64_t> step = StepOfName(e.path().filename().string());
    if (!step) continue;
    out.push_back({*step, fs::exists(e.path() / kMetadataFileName)});
  }
  if (ec) {
    return absl::UnavailableError(
        absl::StrFormat("listing %s: %s", root, ec.message()));
  }
  std::sort(out.begin(), out.end(),
            [](const Folder& a, const Folder& b) { return a.step < b.step; });
  return out;
}

// Object storage: one listing of the root; a step "folder" is the keys
// under "step-NNNNNNNNNN/", committed when one of them is its metadata.json.
absl::StatusOr<std::vector<Folder>> ListFolders(
    const std::string& root, const StorageOptions& storage_options) {
  // A local directory (a path or file:// URL) has folders of its own;
  // object storage has only keys.
  if (internal_storage::IsLocalUrl(root)) return ListLocalFolders(root);
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage,
                         Storage::Open(root, storage_options));
  CAIRN_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->List());
  std::map<int64_t, bool> steps;
  for (const std::string& name : names) {
    const size_t slash = name.find('/');
    if (slash == std::string::npos) continue;
    std::optional<int64_t> step = StepOfName(name.substr(0, slash));
    if (!step) continue;
    steps[*step] |= name.substr(slash + 1) == kMetadataFileName;
  }
  std::vector<Folder> out;
  for (const auto& [step, committed] : steps) out.push_back({step, committed});
  return out;
}

// Un-commits (metadata.json removed, durably), then removes the rest: the
// directory on local files, every object under the prefix on object
// storage. A crash midway leaves an uncommitted folder, which the next
// retention removes.
absl::Status DeleteStep(const std::string& dir,
                        const StorageOptions& storage_options) {
  absl::StatusOr<std::unique_ptr<Storage>> storage =
      Storage::Open(dir, storage_options);
  CAIRN_RETURN_IF_ERROR(storage.status());
  CAIRN_ASSIGN_OR_RETURN(bool committed, (*storage)->Exists(kMetadataFileName));
  if (committed) {
    CAIRN_RETURN_IF_ERROR((*storage)->Remove(kMetadataFileName));
    CAIRN_RETURN_IF_ERROR((*storage)->Sync());
  }
  if (!internal_storage::IsLocalUrl(dir)) {
    CAIRN_ASSIGN_OR_RETURN(std::vector<std::string> names, (*storage)->List());
    for (const std::string& name : names) {
      CAIRN_RETURN_IF_ERROR((*storage)->Remove(name));
    }
    return (*storage)->Sync();
  }
  CAIRN_ASSIGN_OR_RETURN(const std::string path,
                         internal_storage::LocalPathOf(dir));
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrFormat("removing %s: %s", dir, ec.message()));
  }
  return absl::OkStatus();
}

StorageOptions StorageOptionsOf(const ManagerOptions& options) {
  StorageOptions out;
  out.s3 = options.save_options.s3;
  return out;
}

}  // namespace

CheckpointManager::CheckpointManager(std::string root, Communicator* comm,
                                     std::unique_ptr<AsyncSaver> saver,
                                     ManagerOptions options)
    : root_(std::move(root)),
      comm_(comm),
      saver_(std::move(saver)),
      options_(std::move(options)) {
  if (comm_ == nullptr) {
    local_comm_ = LocalCommunicator();
    comm_ = local_comm_.get();
  }
}

CheckpointManager::~CheckpointManager() { (void)saver_->WaitAll(); }

absl::StatusOr<std::unique_ptr<CheckpointManager>> CheckpointManager::Create(
    const std::string& root, Communicator* comm, const ManagerOptions& options) {
  std::error_code ec;
  absl::Status made = absl::OkStatus();
  if (internal_storage::IsLocalUrl(root)) {
    absl::StatusOr<std::string> path = internal_storage::LocalPathOf(root);
    if (path.ok()) fs::create_directories(*path, ec);
    made = !path.ok() ? path.status()
           : ec       ? absl::UnavailableError(absl::StrFormat(
                      "creating %s: %s", root, ec.message()))
                      : absl::OkStatus();
  }
  if (options.keep_last < 1) {
    made = absl::InvalidArgumentError("keep_last must be at least 1");
  }
  if (options.full_every < 1) {
    made = absl::InvalidArgumentError("full_every must be at least 1");
  }
  if (options.incremental && !options.save_options.base.empty()) {
    made = absl::InvalidArgumentError(absl::StrFormat(
        "CheckpointManager at %s: save_options.base is set by the manager "
        "(incremental = true), not given",
        root));
  }
  // A rank-local step has no top-level metadata.json until it is merged,
  // so retention would take every one for a crash leftover and delete it.
  if (options.save_options.rank_local) {
    made = absl::InvalidArgumentError(absl::StrFormat(
        "CheckpointManager at %s: save_options.rank_local is not supported "
        "(a step counts as committed by its top-level metadata.json, which "
        "a rank-local save does not write); save rank-locally with "
        "cairn::Save and cairn::Merge, or use global saves here",
        root));
  }
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<AsyncSaver> saver,
                         AsyncSaver::Create(comm, options.async_options));
  CAIRN_RETURN_IF_ERROR(made);
  return std::unique_ptr<CheckpointManager>(
      new CheckpointManager(root, comm, std::move(saver), options));
}

std::string CheckpointManager::StepDir(int64_t step) const {
  return absl::StrFormat("%s/%s%010d", root_, kPrefix, step);
}

absl::StatusOr<std::vector<int64_t>> CheckpointManager::Steps() const {
  CAIRN_ASSIGN_OR_RETURN(std::vector<Folder> folders,
                         ListFolders(root_, StorageOptionsOf(options_)));
  std::vector<int64_t> steps;
  for (const Folder& f : folders) {
    if (f.committed) steps.push_back(f.step);
  }
  return steps;
}

absl::StatusOr<std::optional<int64_t>> CheckpointManager::LatestStep() const {
  CAIRN_ASSIGN_OR_RETURN(std::vector<int64_t> steps, Steps());
  if (steps.empty()) return std::optional<int64_t>();
  return std::optional<int64_t>(steps.back());
}

namespace {

// The metadata of the committed step at `dir`, reached as the manager
// reaches its root.
absl::StatusOr<Metadata> ReadStep(const std::string& dir,
                                  const StorageOptions& storage_options) {
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage,
                         Storage::Open(dir, storage_options));
  return internal_checkpoint::ReadMetadataFromStorage(*storage);
}

// The steps whose folders the committed step at `dir` keeps chunks in (its
// references that name a step folder of `root`).
absl::StatusOr<std::vector<int64_t>> ReferencedSteps(
    const std::string& root, const std::string& dir,
    const StorageOptions& storage_options) {
  CAIRN_ASSIGN_OR_RETURN(Metadata md, ReadStep(dir, storage_options));
  std::vector<int64_t> out;
  for (const CheckpointReference& r : md.references) {
    const std::string url = internal_format::ResolveReference(dir, r.url);
    const size_t slash = url.rfind('/');
    if (slash == std::string::npos ||
        internal_format::TrimUrl(url.substr(0, slash)) !=
            internal_format::TrimUrl(root)) {
      continue;  // outside the root: not the manager's to delete
    }
    if (std::optional<int64_t> s = StepOfName(url.substr(slash + 1))) {
      out.push_back(*s);
    }
  }
  return out;
}

}  // namespace

absl::Status CheckpointManager::Retain() {
  // Forget finished saves; they are ordinary folders now.
  std::erase_if(pending_, [](const Pending& p) { return p.handle->done(); });
  if (comm_->rank() != 0) return absl::OkStatus();
  std::set<int64_t> busy;
  std::set<int64_t> pending_bases;
  for (const Pending& p : pending_) {
    busy.insert(p.step);
    if (p.base) pending_bases.insert(*p.base);
  }
  CAIRN_ASSIGN_OR_RETURN(std::vector<Folder> folders,
                         ListFolders(root_, StorageOptionsOf(options_)));
  std::vector<int64_t> committed;
  for (const Folder& f : folders) {
    if (f.committed && !busy.contains(f.step)) committed.push_back(f.step);
  }
  std::set<int64_t> keep(busy);
  const size_t n = committed.size();
  for (size_t i = 0; i < n; ++i) {
    const int64_t step = committed[i];
    if (i + static_cast<size_t>(options_.keep_last) >= n ||
        (options_.keep_every > 0 && step % options_.keep_every == 0)) {
      keep.insert(step);
    }
  }
  if (!committed.empty()) keep.insert(committed.back());  // the newest, always
  keep.insert(pending_bases.begin(), pending_bases.end());
  // Steps a kept one keeps chunks in stay too (references never chain,
  // but a step kept for that is followed as well, to be safe). A kept
  // step whose metadata cannot be read might reference anything: then
  // no committed step is deleted this time.
  const std::set<int64_t> committed_set(committed.begin(), committed.end());
  bool unsure = false;
  std::vector<int64_t> todo(keep.begin(), keep.end());
  std::set<int64_t> followed;
  while (!todo.empty() && !unsure) {
    const int64_t step = todo.back();
    todo.pop_back();
    if (!committed_set.contains(step) || !followed.insert(step).second) {
      continue;
    }
    if (std::all_of(committed.begin(), committed.end(),
                    [&](int64_t c) { return keep.contains(c); })) {
      break;  // nothing to delete anyway
    }
    absl::StatusOr<std::vector<int64_t>> refs =
        ReferencedSteps(root_, StepDir(step), StorageOptionsOf(options_));
    if (!refs.ok()) {
      unsure = true;
      break;
    }
    for (int64_t r : *refs) {
      if (keep.insert(r).second) todo.push_back(r);
    }
  }
  for (const Folder& f : folders) {
    if (keep.contains(f.step) || (unsure && f.committed)) continue;
    // Old committed steps, and folders a crash left uncommitted.
    CAIRN_RETURN_IF_ERROR(
        DeleteStep(StepDir(f.step), StorageOptionsOf(options_)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> CheckpointManager::Save(
    int64_t step, const StateDict& state) {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("step %d: steps must not be negative", step));
  }
  // A failed earlier save surfaces here (AsyncSaver::Save reports it too).
  CAIRN_RETURN_IF_ERROR(Retain());
  SaveOptions options = options_.save_options;
  options.overwrite = false;  // a committed step is never silently replaced
  std::optional<int64_t> base_step;
  if (options_.incremental) {
    // Rank 0 picks the base, so every rank saves against the same one.
    std::string base;
    absl::Status picked = absl::OkStatus();
    if (comm_->rank() == 0) {
      absl::StatusOr<std::string> b = NextBase();
      picked = b.status();
      base = b.ok() ? *b : "!" + picked.ToString();
    }
    CAIRN_RETURN_IF_ERROR(comm_->Broadcast(base, 0));
    if (base.starts_with("!")) {
      return picked.ok() ? absl::UnavailableError(absl::StrCat(
                               "incremental save of step ", step,
                               ": rank 0 could not pick a base: ",
                               base.substr(1)))
                         : picked;
    }
    options.base = base;
    if (!base.empty()) {
      base_step = StepOfName(base.substr(base.rfind('/') + 1));
    }
  }
  CAIRN_ASSIGN_OR_RETURN(std::shared_ptr<AsyncSaveHandle> handle,
                         saver_->Save(state, StepDir(step), options));
  pending_.push_back({step, handle, base_step});
  if (comm_->rank() == 0 && options_.incremental) {
    since_full_ = base_step ? *since_full_ + 1 : 0;
  }
  if (!options_.async) {
    absl::StatusOr<SaveResult> r = handle->Wait();
    CAIRN_RETURN_IF_ERROR(r.status());
    CAIRN_RETURN_IF_ERROR(Retain());
  }
  return handle;
}

absl::StatusOr<std::string> CheckpointManager::NextBase() {
  std::set<int64_t> busy;
  for (const Pending& p : pending_) busy.insert(p.step);
  CAIRN_ASSIGN_OR_RETURN(std::vector<int64_t> steps, Steps());
  std::erase_if(steps, [&](int64_t s) { return busy.contains(s); });
  if (steps.empty()) {
    since_full_ = std::nullopt;
    return std::string();
  }
  if (!since_full_) {
    // After a restart: the incremental saves in a row before the newest
    // step, counted back to the newest full one.
    int n = 0;
    for (auto it = steps.rbegin(); it != steps.rend(); ++it, ++n) {
      absl::StatusOr<Metadata> md =
          ReadStep(StepDir(*it), StorageOptionsOf(options_));
      if (!md.ok() || md->references.empty()) break;
    }
    since_full_ = n;
  }
  // The next save is the since_full_ + 1-th after the full one.
  if (*since_full_ + 1 >= options_.full_every) return std::string();
  return StepDir(steps.back());
}

absl::Status CheckpointManager::Wait() {
  absl::Status waited = saver_->WaitAll();
  absl::Status retained = Retain();
  return waited.ok() ? retained : waited;
}

absl::StatusOr<LoadResult> CheckpointManager::Restore(
    StateDict& state, std::optional<int64_t> step) {
  // Rank 0 decides which step, so ranks never restore different ones.
  std::string chosen;
  absl::Status decided = absl::OkStatus();
  if (comm_->rank() == 0) {
    if (step) {
      chosen = std::to_string(*step);
    } else {
      absl::StatusOr<std::optional<int64_t>> latest = LatestStep();
      if (!latest.ok()) {
        decided = latest.status();
      } else if (!latest->has_value()) {
        decided = absl::NotFoundError(absl::StrFormat(
            "%s holds no committed checkpoint to restore", root_));
      } else {
        chosen = std::to_string(**latest);
      }
    }
    if (!decided.ok()) chosen = "!" + decided.ToString();
  }
  CAIRN_RETURN_IF_ERROR(comm_->Broadcast(chosen, 0));
  int64_t which = 0;
  if (chosen.starts_with("!") || !absl::SimpleAtoi(chosen, &which)) {
    return decided.ok() ? absl::NotFoundError(absl::StrCat(
                              "restore: rank 0 found nothing to restore in ",
                              root_, ": ", chosen.substr(1)))
                        : decided;
  }
  LoadOptions options = options_.load_options;
  options.comm = comm_;
  return Load(state, StepDir(which), options);
}

}  // namespace cairn
