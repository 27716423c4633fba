"""cairn.torch.StorageWriter: DCP's StorageWriter over cairn's format.

The save, as torch.distributed.checkpoint drives it (DCP's own planner
decides what each rank writes, dedup included):

 1. All ranks: set_up_storage_writer (records the rank), then
    prepare_local_plan (refuses a committed checkpoint unless `overwrite`).
 2. Coordinator: prepare_global_plan picks a fresh cairn save id and puts it,
    with the world size, into every rank's plan.storage_data; DCP scatters
    the plans.
 3. All ranks: write_data turns this rank's WriteItems into a cairn state
    dict (tensor items as boxes of their global tensor, byte items as cairn
    scalars or objects) and saves it rank-locally into rank-NNNNN/ under
    that save id: no collective at all, so it is safe in the thread that
    dcp.async_save runs it in. A rank with nothing to write still writes
    its (empty) folder, which the merge requires.
 4. Coordinator: finish() runs cairn.merge, which checks that the rank
    folders belong to one save and cover every tensor exactly once, and
    writes the global metadata.json. That rename is the commit.
"""

import collections
import dataclasses
import io
import os
import pickle
import secrets
import threading
import urllib.parse
import uuid

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import WriteItemType
from torch.futures import Future

from .. import _api, _cairn, _state
from .._errors import AlreadyExistsError, InvalidArgumentError

METADATA_FILE = "metadata.json"


@dataclasses.dataclass(frozen=True)
class _SaveSpec:
    """What the coordinator tells every rank in plan.storage_data."""
    save_id: str
    world_size: int


class _Ranks:
    """A communicator that only knows this rank's place in the job: a
    rank-local save with a save id needs nothing more, and any collective
    would be a bug (it would hang or mix with DCP's messages)."""

    def __init__(self, rank, size):
        self._rank = rank
        self._size = size

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def kind(self):
        return "dcp-rank"

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("cairn.torch.StorageWriter: a rank-local save "
                           "attempted a collective")

    barrier = broadcast = gather = all_gather = scatter = _refuse
    all_reduce = broadcast_into = split = _refuse


# DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)) reuses
# an earlier save's final plans, save id included; cairn never reuses a save
# id in one location. Every rank runs the same saves in the same order, so
# numbering the uses of an id in this process gives all ranks the same
# fresh id.
_id_uses = collections.Counter()
_id_lock = threading.Lock()


def _fresh_save_id(base):
    with _id_lock:
        n = _id_uses[base]
        _id_uses[base] += 1
    return base if n == 0 else f"{base}-{n}"


def _path_str(path):
    return os.fspath(path)


def _has_global_metadata(path):
    path = _path_str(path)
    if path.startswith("file://"):
        # As cairn reads a file:// URL: percent-encoded.
        path = urllib.parse.unquote(path[len("file://"):])
    elif "://" in path:
        return False  # cairn itself refuses an existing one then
    return os.path.exists(os.path.join(path, METADATA_FILE))


def _stored_value(value, raw):
    """What cairn stores for a byte item whose torch.load gave `value`:
    Python scalars as cairn scalars; a list (DCP keeps a list of
    non-tensors as one item; cairn.save nests it) as a nested list;
    anything else as a cairn object, pickled like cairn.save pickles it,
    or, when pickle refuses it, torch.save's own bytes behind
    TORCH_MAGIC."""
    if type(value) is list:
        return [_stored_value(v, None) for v in value]
    if _state._is_scalar(value) or isinstance(value, bytes):
        return value
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return value
    except Exception:  # noqa: BLE001 - any failure: keep torch's bytes
        if raw is None:
            buf = io.BytesIO()
            torch.save(value, buf)
            raw = buf.getvalue()
        return _state.Encoded(_state.TORCH_MAGIC + raw)


def _place(root, path, fqn, value):
    """Puts `value` into the nest `root` at DCP's object path `path` (list
    indices become dict keys: a rank holds only the items DCP's dedup gave
    it, so its lists could have holes). A path that collides with another
    item's falls back to the flat FQN as the key."""
    node = root
    for key in path[:-1]:
        key = str(key)
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            root[fqn] = value
            return
        node = child
    last = str(path[-1])
    if last in node:
        root[fqn] = value
        return
    node[last] = value


class StorageWriter(dcp_storage.StorageWriter):
    """Writes torch.distributed.checkpoint saves as cairn checkpoints:

        dcp.save(state_dict, storage_writer=cairn.torch.StorageWriter(path))

    Works with dcp.save and dcp.async_save and DCP's planners; the result
    is an ordinary cairn checkpoint (cairn.load, cairn.load_all, the cairn
    CLI, cairn.torch.StorageReader all read it).

    `overwrite` (default True, like DCP's FileSystemWriter): replace a
    committed checkpoint at `path`; else the save fails before writing
    anything. Note that the old checkpoint is un-committed when the ranks
    start writing, not when the new one commits (cairn's rank-local saves
    work that way). Further keyword options (io_threads, direct_io,
    write_buffer_bytes, crc32c_block_bytes) are cairn.save's.
    """

    def __init__(self, path, *, overwrite=True, **save_options):
        super().__init__()
        self.path = path
        self.overwrite = overwrite
        for bad in ("comm", "rank_local", "save_id", "plan_cache"):
            if bad in save_options:
                raise InvalidArgumentError(
                    f"cairn.torch.StorageWriter sets {bad} itself")
        self._options = save_options
        self._dcp_save_id = uuid.uuid4().hex
        self._rank = 0
        self._is_coordinator = True

    # -- DCP's StorageWriter interface --

    def reset(self, checkpoint_id=None):
        if checkpoint_id:
            self.path = checkpoint_id
        self._dcp_save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self._is_coordinator = is_coordinator
        self._rank = kwargs.get("rank") or 0
        if not kwargs.get("use_collectives", True):
            raise InvalidArgumentError(
                "cairn.torch.StorageWriter writes one global checkpoint and "
                "needs dcp.save's collectives (use_collectives=True); for "
                "saves without coordination use "
                "cairn.save(..., rank_local=True)")

    def prepare_local_plan(self, plan):
        if not self.overwrite and _has_global_metadata(self.path):
            raise AlreadyExistsError(
                f"{_path_str(self.path)} already holds a committed "
                f"checkpoint; pass overwrite=True to replace it")
        return plan

    def prepare_global_plan(self, plans):
        spec = _SaveSpec(save_id=secrets.token_hex(8), world_size=len(plans))
        return [dataclasses.replace(p, storage_data=spec) for p in plans]

    def write_data(self, plan, planner):
        spec = plan.storage_data
        if not isinstance(spec, _SaveSpec):
            raise InvalidArgumentError(
                "cairn.torch.StorageWriter: the plan carries no save id "
                "(prepare_global_plan did not run on the coordinator)")
        if not 0 <= self._rank < spec.world_size:
            raise InvalidArgumentError(
                f"cairn.torch.StorageWriter: rank {self._rank} outside a "
                f"save of {spec.world_size} ranks")
        local, results = self._local_state(plan, planner)
        _api.save(local, self.path, comm=_Ranks(self._rank, spec.world_size),
                  rank_local=True, save_id=_fresh_save_id(spec.save_id),
                  overwrite=self.overwrite, **self._options)
        fut = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results):
        _api.merge(self.path, overwrite=self.overwrite)

    def storage_meta(self):
        return StorageMeta(checkpoint_id=self.path, save_id=self._dcp_save_id)

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return _valid_checkpoint_id(checkpoint_id)

    # -- helpers --

    def _local_state(self, plan, planner):
        """This rank's items as a cairn state dict, and their
        WriteResults."""
        mappings = getattr(planner, "mappings", None) or {}
        tensors = {}  # fqn -> _Tensor
        local = {}
        results = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                raw = planner.resolve_data(item).getvalue()
                value = torch.load(io.BytesIO(raw), weights_only=False)
                _place(local, mappings.get(fqn, (fqn,)), fqn,
                       _stored_value(value, raw))
                results.append(dcp_storage.WriteResult(
                    index=item.index, size_in_bytes=len(raw),
                    storage_data=None))
                continue
            td = item.tensor_data
            data = planner.resolve_data(item).detach()
            if data.device.type not in ("cpu", "cuda"):
                data = data.cpu()
            sizes = list(td.chunk.sizes)
            if list(data.shape) != sizes:
                raise InvalidArgumentError(
                    f"'{fqn}': the planner resolved a tensor of shape "
                    f"{list(data.shape)} for a chunk of shape {sizes}")
            if data.dtype != td.properties.dtype:
                data = data.to(td.properties.dtype)
            entry = tensors.get(fqn)
            if entry is None:
                entry = _Tensor(
                    _state.torch_dtype_name(td.properties.dtype, fqn),
                    list(td.size))
                tensors[fqn] = entry
                _place(local, mappings.get(fqn, (fqn,)), fqn, entry)
            entry.shards.append((list(td.chunk.offsets), sizes,
                                 _state._torch_bits(data)))
            results.append(dcp_storage.WriteResult(
                index=item.index,
                size_in_bytes=data.numel() * data.element_size(),
                storage_data=None))
        return _sharded_leaves(local), results


class _Tensor:
    """A tensor's boxes on this rank, gathered item by item."""

    def __init__(self, dtype, shape):
        self.dtype = dtype
        self.shape = shape
        self.shards = []


def _sharded_leaves(node):
    """Replaces the _Tensor entries of `node` by _cairn.Sharded leaves."""
    for key, value in node.items():
        if isinstance(value, dict):
            _sharded_leaves(value)
        elif isinstance(value, _Tensor):
            node[key] = _cairn.Sharded(value.dtype, value.shape, value.shards)
    return node


def _valid_checkpoint_id(checkpoint_id):
    if isinstance(checkpoint_id, os.PathLike):
        return True
    text = str(checkpoint_id)
    return "://" not in text or text.startswith("file://")
