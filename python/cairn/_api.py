"""cairn's Python API: the C++ API in Python's idiom (include/cairn/)."""

import atexit
import json
import threading
import time
import weakref

from . import _cairn, _comm, _kv, _state
from ._errors import InvalidArgumentError

SaveResult = _cairn.SaveResult
LoadResult = _cairn.LoadResult
SavePlanCache = _cairn.SavePlanCache
VerifyReport = _cairn.VerifyReport


def _user_json(user_metadata):
    if user_metadata is None:
        return "{}"
    if isinstance(user_metadata, str):
        return user_metadata
    return json.dumps(user_metadata)


def _save_kwargs(overwrite, save_id, rank_local, user_metadata, extra):
    kw = dict(extra)
    kw.update(overwrite=overwrite, rank_local=rank_local,
              user_metadata=_user_json(user_metadata))
    if save_id is not None:
        kw["save_id"] = save_id
    return kw


def save(state_dict, path, *, comm=None, rank_local=False, plan_cache=None,
         overwrite=False, save_id=None, user_metadata=None, kv_tables=None,
         **options):
    """Saves `state_dict` to the folder `path`; every rank of `comm` calls it
    with its own part of the state.

    `state_dict`: nested dicts and lists of torch tensors, DTensors (any
    mesh and placements but Partial), NumPy arrays, int/float/bool/str
    (scalars), bytes, and other picklable objects (pickled). Replicated
    boxes are written once. Nothing is committed unless every rank
    succeeds; then metadata.json is written last, atomically.

    `comm`: see cairn.local(); None means the torch.distributed job when
    one is initialized. `rank_local`: each rank writes its own folder with
    no collective but the save id's broadcast (see merge()). `plan_cache`:
    a cairn.SavePlanCache that skips global planning when nothing changed.
    `overwrite`: replace a committed checkpoint (it stays loadable until
    the new one commits). `user_metadata`: a JSON-able dict kept in
    metadata.json. `kv_tables`: key-value tables saved beside the state
    dict (cairn.KvTableToSave entries, or dicts of their keys; every rank
    lists the same tables), in chunks of at most `kv_chunk_bytes` (64 MiB).
    `codec`: compress tensor chunks, "zstd" or "grouped-zstd" (zstd of
    each element's bytes grouped by position: best for floating-point
    weights and optimizer state), at zstd level `codec_level` (1); loads
    need no option. `base`: the path of an earlier committed checkpoint
    (an incremental save): tensor chunks the base holds unchanged (same
    FQN, box, dtype, CRC32C and XXH3-128 digest) are referenced there,
    not written; loads follow the references, which must stay in place
    (cairn.CheckpointManager(incremental=True) keeps them; `cairn convert
    --flatten` makes a standalone copy). Further options (io_threads, direct_io,
    write_buffer_bytes, crc32c_block_bytes, dedup) are SaveOptions'
    (include/cairn/checkpoint.h). `path` may be an s3:// URL; `s3`, a dict
    of S3Options' fields (endpoint, region, access_key_id, ...,
    addressing), overrides the AWS_* environment variables.

    Returns a cairn.SaveResult (this rank's bytes and table rows
    (`kv_rows`), chunks and bytes taken from `base` (`chunks_reused`,
    `bytes_reused`), the checkpoint's bytes, seconds, and `phases`). Raises a
    cairn.Error subclass naming the FQN, file or rank on failure (on every
    rank; raised from the exception of this rank's source, if one raised).
    """
    prepared = _state.Prepared(state_dict, for_load=False)
    kw = _save_kwargs(overwrite, save_id, rank_local, user_metadata, options)
    entries, sources = _kv.save_entries(kv_tables)
    with _kv.raised_from_callbacks(sources):
        return _cairn.save(prepared.tree, str(path), _comm.resolve(comm),
                           plan_cache, kv_tables=entries, **kw)


def load(state_dict, path, *, comm=None, strict=True, allow_pickle=True,
         kv_tables=None, **options):
    """Loads the checkpoint at `path` into `state_dict` in place.

    Tensors, DTensors and arrays are filled in place, whatever their
    sharding (each rank reads only the bytes its shards need); their dtype
    and global shape must match the checkpoint's. Scalars and objects are
    replaced in their dicts and lists. With `strict` every leaf must be in
    the checkpoint (cairn.NotFoundError naming it); otherwise missing ones
    are left alone and listed in the result's `missing`. Objects that were
    pickled are unpickled (only load checkpoints you trust, or pass
    allow_pickle=False to get their bytes).

    Every byte returned is checked against its CRC32C (verify_checksums,
    default True). On failure, tensors may be partly written; scalars and
    objects are untouched. `kv_tables`: key-value tables to load
    (cairn.KvTableToLoad entries, or dicts of their keys), each rank's
    rows into its sink, in any world size and bucketing; with `strict` a
    table the checkpoint lacks is cairn.NotFoundError. Further options
    (io_threads, rank_local, broadcast_replicas, memory_budget_bytes, s3,
    ...) are LoadOptions'. Returns a cairn.LoadResult (`kv_rows`: the table
    rows this rank's sinks took).

    `path` may be a Hugging Face folder (model.safetensors, or
    model.safetensors.index.json and its files) or a .safetensors file:
    each stored tensor is one chunk, read in the byte ranges the shards
    need. Such files have no checksums: the result's source_has_checksums
    is False and bytes_unverified counts every byte. `strip_prefix` and
    `add_prefix` rename its tensors; `name_map(tensors)` gets them as a
    list of dicts (fqn, dtype, shape, parts) and returns the list to load
    (see cairn.fuse_tensors and cairn.split_rows).
    """
    prepared = _state.Prepared(state_dict, for_load=True)
    entries, sinks = _kv.load_entries(kv_tables)
    with _kv.raised_from_callbacks(sinks):
        result, values = _cairn.load(prepared.tree, str(path),
                                     _comm.resolve(comm), kv_tables=entries,
                                     strict=strict, **options)
    prepared.put_back(values, result.missing, allow_pickle)
    return result


def load_all(path, framework="torch", *, allow_pickle=True, **options):
    """Everything in the checkpoint, as newly allocated whole tensors
    (framework="torch") or NumPy arrays ("numpy"), in the saved nesting.
    One process. NumPy has no bfloat16 or float8: those need ml_dtypes,
    else framework="torch"."""
    if framework not in ("torch", "numpy"):
        raise InvalidArgumentError(
            f"framework must be 'torch' or 'numpy', not {framework!r}")
    tree = _cairn.load_all(str(path), **options)
    return _state.from_loaded(tree, framework, allow_pickle)


def rewrite(src, dst, *, overwrite=False, **options):
    """Writes the checkpoint at `src` again at `dst`, standalone: every
    leaf read (and checked) into memory, then saved with `options` (save()'s:
    `codec` to recompress, none by default). An incremental checkpoint's
    chunks are copied out of the checkpoints it references, so `dst`
    references none (`cairn convert --flatten`). One process; holds the
    whole state in memory. Returns a cairn.SaveResult."""
    return _cairn.rewrite(str(src), str(dst), overwrite=overwrite, **options)


def read_metadata(path):
    """The checkpoint's metadata.json, checked (its checksum and every
    field), as a dict: tensors (dtype, shape, chunks), objects, scalars,
    structure and user (parsed JSON), kv_tables (spec as a
    cairn.KvTableSpec, buckets, rows, rows_per_bucket, chunks: their count,
    bytes), save_id, world_size, ..."""
    md = _kv.tables_of_metadata(_cairn.read_metadata(str(path)))
    md["structure"] = json.loads(md["structure"])
    md["user"] = json.loads(md["user"])
    return md


def merge(path, *, overwrite=False):
    """Turns a rank-local checkpoint (save(..., rank_local=True)) into a
    global one that any number of ranks can load, without copying data.
    Returns a dict: ranks, data_bytes, duplicates, metadata."""
    result = _cairn.merge(str(path), overwrite)
    _kv.tables_of_metadata(result["metadata"])
    result["metadata"]["structure"] = json.loads(
        result["metadata"]["structure"])
    result["metadata"]["user"] = json.loads(result["metadata"]["user"])
    return result


def verify(path, *, io_threads=8, buffer_bytes=8 << 20, progress=None):
    """Checks every byte of the checkpoint at `path` against its metadata
    without loading a tensor (what `cairn verify` runs): metadata.json's
    checksum and fields, every data file's presence, length and safetensors
    header, and the CRC32C of every chunk, block and object. Returns a
    cairn.VerifyReport (`ok`, `problems`: each with kind, fqn, file, offset
    and message); damage is reported there, not raised. Raises
    cairn.NotFoundError when there is no checkpoint and cairn.DataLossError
    when metadata.json itself is damaged. `progress(bytes_done,
    bytes_total)` is called as it reads."""
    return _cairn.verify(str(path), io_threads, buffer_bytes, progress)


class SaveFuture:
    """The outcome of an asynchronous save."""

    def __init__(self, handle):
        self._handle = handle

    def done(self):
        """True once the save has committed or failed."""
        return self._handle.done()

    def result(self, timeout=None):
        """Waits for the save and returns its cairn.SaveResult (or raises its
        error). With `timeout` (seconds), raises TimeoutError if it is not
        done by then."""
        if timeout is not None:
            deadline = time.monotonic() + timeout
            while not self._handle.done():
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"save not done after {timeout} s")
                time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
        return self._handle.wait()

    def exception(self, timeout=None):
        """The save's error, or None once it succeeded."""
        try:
            self.result(timeout)
            return None
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - returned, not swallowed
            return e

    @property
    def blocked_seconds(self):
        """Seconds save() blocked the caller (waiting for a slot, staging)."""
        return self._handle.blocked_seconds


# Savers and managers still open at exit are waited for while the
# interpreter can still run their collectives.
_open = weakref.WeakSet()
_open_lock = threading.Lock()


@atexit.register
def _close_all():
    with _open_lock:
        live = list(_open)
    for obj in live:
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - at exit, nothing to raise to
            pass


class _Closable:
    """Holds an extension object whose saves run in the background: waited
    for by close(), by leaving a `with` block, or at exit."""

    def _open_with(self, impl):
        self._impl = impl
        with _open_lock:
            _open.add(self)

    def _live(self):
        if self._impl is None:
            raise InvalidArgumentError(
                f"the {type(self).__name__} is closed")
        return self._impl

    def close(self):
        """Waits for the saves in flight (their errors are raised), then
        releases the object; later calls raise."""
        if self._impl is None:
            return
        try:
            self._wait_on_close(self._impl)
        finally:
            self._impl = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncSaver(_Closable):
    """Saves that return once the state is staged (copied to host buffers
    that are reused from save to save; CUDA tensors through pinned memory),
    so training goes on while the checkpoint is written. The checkpoint
    holds the values from when save() was called.

    Collective over `comm` (like save); every rank makes the same calls in
    the same order. Use as a context manager, or call close().
    """

    def __init__(self, comm=None, *, max_in_flight=1, max_cached_bytes=None):
        self._open_with(_cairn.AsyncSaver(_comm.resolve(comm), max_in_flight,
                                          max_cached_bytes))

    def save(self, state_dict, path, *, overwrite=False, save_id=None,
             user_metadata=None, **options):
        """Stages `state_dict` and saves it to `path` in the background;
        returns a SaveFuture. A failure of an earlier save that nobody
        waited for is raised here."""
        impl = self._live()
        prepared = _state.Prepared(state_dict, for_load=False)
        kw = _save_kwargs(overwrite, save_id, False, user_metadata, options)
        return SaveFuture(impl.save(prepared.tree, str(path), **kw))

    def wait(self):
        """Waits for every save in flight; raises the first error not yet
        seen."""
        self._live().wait_all()

    @property
    def in_flight(self):
        return self._live().in_flight

    @property
    def staging_bytes(self):
        """Bytes of staging buffers kept for reuse."""
        return self._live().staging_bytes

    @property
    def staging_allocations(self):
        """Staging buffers allocated so far (stays put once warm)."""
        return self._live().staging_allocations

    @staticmethod
    def _wait_on_close(impl):
        impl.wait_all()  # then the staging buffers go with impl


class CheckpointManager(_Closable):
    """A root folder of step-numbered checkpoints (root/step-0000000100/),
    saved asynchronously by default, with retention (`keep_last` newest,
    and every step divisible by `keep_every`), and restore of the latest
    committed step after a crash.

    `incremental`: each save is against the newest committed step (see
    save()'s `base`), so chunks that did not change are not written again;
    every `full_every`-th save in a row is a full one. Retention never
    deletes a step that a kept step keeps chunks in.

    Collective over `comm`; every rank makes the same calls in the same
    order. `save_options` and `load_options` are keyword options of save()
    and load() (e.g. {"io_threads": 4}).
    """

    def __init__(self, root, comm=None, *, keep_last=3, keep_every=0,
                 async_save=True, max_in_flight=1, save_options=None,
                 load_options=None, allow_pickle=True, incremental=False,
                 full_every=8):
        self._allow_pickle = allow_pickle
        save_options = dict(save_options or {})
        if "user_metadata" in save_options:
            save_options["user_metadata"] = _user_json(
                save_options["user_metadata"])
        self._open_with(_cairn.CheckpointManager(
            str(root), _comm.resolve(comm), keep_last, keep_every, async_save,
            max_in_flight, save_options, dict(load_options or {}),
            incremental, full_every))

    def save(self, step, state_dict):
        """Saves `state_dict` as `step`; returns a SaveFuture (already done
        when async_save is False)."""
        impl = self._live()
        prepared = _state.Prepared(state_dict, for_load=False)
        return SaveFuture(impl.save(int(step), prepared.tree))

    def restore(self, state_dict, step=None):
        """Loads `step` (default: the newest committed) into `state_dict`
        in place, like load(). cairn.NotFoundError when there is none."""
        impl = self._live()
        prepared = _state.Prepared(state_dict, for_load=True)
        result, values = impl.restore(prepared.tree, step)
        prepared.put_back(values, result.missing, self._allow_pickle)
        return result

    def steps(self):
        """Committed steps, ascending."""
        return self._live().steps()

    def latest_step(self):
        """The newest committed step, or None."""
        return self._live().latest_step()

    def step_dir(self, step):
        return self._live().step_dir(int(step))

    def wait(self):
        """Waits for saves in flight, then applies retention."""
        self._live().wait()

    @staticmethod
    def _wait_on_close(impl):
        impl.wait()
