"""cairn.torch.StorageReader: DCP's StorageReader over cairn checkpoints.

The load, as torch.distributed.checkpoint drives it:

 1. All ranks: read_metadata reads the checkpoint's metadata.json (checked)
    and describes it to DCP: each tensor with its dtype, shape and stored
    chunks; each scalar and object as bytes. A list of non-tensors, which
    cairn stores element by element but DCP treats as one value, is
    described once more as a whole.
 2. All ranks: DCP's planner intersects this rank's destinations with the
    stored chunks (ReadItems); the plans pass through unchanged.
 3. All ranks: read_data gathers all of this rank's ReadItems into one cairn
    state dict (each tensor's destination boxes as one _cairn.Sharded, each
    scalar or object as a placeholder) and makes one cairn.load on this
    rank alone: cairn reads only the bytes those boxes need, in parallel,
    checking CRC32Cs. Then commit_tensor for each tensor item and
    load_bytes (torch.save's bytes of the value) for each byte item.
"""

import io
import os
import pickle
import uuid
import warnings

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                   ChunkStorageMetadata,
                                                   Metadata, StorageMeta,
                                                   TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from .. import _api, _cairn, _comm, _state
from .._errors import InvalidArgumentError
from ._writer import _valid_checkpoint_id


def _join(prefix, key):
    return str(key) if not prefix else f"{prefix}.{key}"


def _dcp_leaf_list(node, tensors):
    """Whether DCP takes the list `node` (a cairn structure node) as one
    value: it holds no dict, no tensor and only such lists (DCP's
    _traverse._is_terminal)."""
    for entry in node:
        if isinstance(entry, dict):
            return False
        if isinstance(entry, list):
            if not _dcp_leaf_list(entry, tensors):
                return False
        elif entry in tensors:
            return False
    return True


def _whole_lists(structure, tensors, prefix="", out=None):
    """FQN -> structure node of each list that DCP takes as one value."""
    if out is None:
        out = {}
    if isinstance(structure, dict):
        for key, child in structure.items():
            _whole_lists(child, tensors, _join(prefix, key), out)
    elif isinstance(structure, list):
        if prefix and _dcp_leaf_list(structure, tensors):
            out[prefix] = structure
        else:
            for i, child in enumerate(structure):
                _whole_lists(child, tensors, _join(prefix, i), out)
    return out


def _list_leaves(node, out):
    for entry in node:
        if isinstance(entry, list):
            _list_leaves(entry, out)
        else:
            out.append(entry)
    return out


def _build_list(node, values):
    """The list DCP asked for, from its elements' loaded values."""
    return [_build_list(e, values) if isinstance(e, list)
            else _decoded(values[e]) for e in node]


def _torch_bytes(stored):
    """torch.save's bytes of a value cairn returned with allow_pickle=False
    (a scalar, plain bytes, or an encoded object)."""
    if isinstance(stored, bytes):
        if stored.startswith(_state.TORCH_MAGIC):
            return stored[len(_state.TORCH_MAGIC):]
        if stored.startswith(_state.PICKLE_MAGIC):
            stored = pickle.loads(stored[len(_state.PICKLE_MAGIC):])
    buf = io.BytesIO()
    torch.save(stored, buf)
    return buf.getvalue()


def _decoded(stored):
    if isinstance(stored, bytes):
        return _state.decode_object(stored, allow_pickle=True)
    return stored


class StorageReader(dcp_storage.StorageReader):
    """Reads cairn checkpoints for torch.distributed.checkpoint:

        dcp.load(state_dict, storage_reader=cairn.torch.StorageReader(path))

    Any cairn checkpoint: written through cairn.torch.StorageWriter or by
    cairn.save, by any number of ranks, loaded into any sharding with DCP's
    planners. Each rank reads only the bytes its shards need, and every
    byte is checked against its CRC32C. Objects are unpickled (DCP's
    load_bytes does so anyway): load only checkpoints you trust.

    Keyword options (io_threads, verify_checksums, coalesce_gap_bytes,
    bounce_buffer_bytes) are cairn.load's.
    """

    def __init__(self, path, **load_options):
        super().__init__()
        self.path = path
        for bad in ("comm", "strict", "allow_pickle", "rank_local"):
            if bad in load_options:
                raise InvalidArgumentError(
                    f"cairn.torch.StorageReader sets {bad} itself")
        self._options = load_options
        self._load_id = uuid.uuid4().hex
        self._md = None
        self._lists = {}

    # -- DCP's StorageReader interface --

    def reset(self, checkpoint_id=None):
        if checkpoint_id:
            self.path = checkpoint_id
        self._md = None
        self._lists = {}
        self._load_id = uuid.uuid4().hex

    def read_metadata(self, *args, **kwargs):
        # DCP calls this again with rank= when the first call fails (to
        # look for rank-local metadata); cairn's rank folders are not
        # loaded that way, so the second call fails the same.
        md = _api.read_metadata(os.fspath(self.path))
        self._md = md
        state = {}
        # A tensor torch has no dtype for (F6) cannot be in a state dict:
        # DCP is not told of it, so that the rest of the checkpoint loads.
        no_dtype = sorted(fqn for fqn, t in md["tensors"].items()
                          if not _state.has_torch_dtype(t["dtype"]))
        if no_dtype:
            warnings.warn(
                f"cairn.torch.StorageReader: {os.fspath(self.path)} holds "
                f"{len(no_dtype)} tensor(s) of a dtype torch has none for, "
                f"left out of what DCP can load: " + ", ".join(
                    f"'{fqn}' ({md['tensors'][fqn]['dtype']})"
                    for fqn in no_dtype[:8]) +
                (", ..." if len(no_dtype) > 8 else ""), stacklevel=2)
        for fqn, t in md["tensors"].items():
            if not _state.has_torch_dtype(t["dtype"]):
                continue
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_state.torch_dtype(
                    t["dtype"], fqn)),
                size=torch.Size(t["shape"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c["offsets"]),
                                             sizes=torch.Size(c["sizes"]))
                        for c in t["chunks"]])
        for fqn in list(md["objects"]) + list(md["scalars"]):
            state[fqn] = BytesStorageMetadata()
        self._lists = {fqn: node for fqn, node in _whole_lists(
            md["structure"], md["tensors"]).items() if fqn not in state}
        for fqn in self._lists:
            state[fqn] = BytesStorageMetadata()
        return Metadata(
            state_dict_metadata=state,
            storage_meta=StorageMeta(checkpoint_id=self.path,
                                     save_id=md["save_id"],
                                     load_id=self._load_id))

    def set_up_storage_reader(self, metadata, is_coordinator, *args,
                              **kwargs):
        if self._md is None:
            self.read_metadata()

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        if self._md is None:
            self.read_metadata()
        tensors = self._md["tensors"]
        request = {}     # FQN -> Sharded, or None for a scalar or object
        sharded = {}     # FQN -> (dtype name, shape, shards)
        tensor_items = []  # (ReadItem, destination, staging tensor or None)
        byte_items = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                byte_items.append(item)
                for leaf in (_list_leaves(self._lists[fqn], [])
                             if fqn in self._lists else [fqn]):
                    request[leaf] = None
                continue
            t = tensors.get(fqn)
            if t is None:
                raise InvalidArgumentError(
                    f"'{fqn}' is no tensor in {os.fspath(self.path)}")
            dest = planner.resolve_tensor(item).detach()
            lengths = list(item.lengths)
            if list(dest.shape) != lengths:
                raise InvalidArgumentError(
                    f"'{fqn}': the planner resolved a destination of shape "
                    f"{list(dest.shape)} for a read of shape {lengths}")
            dtype = _state.torch_dtype(t["dtype"], fqn)
            target, staging = dest, None
            if dest.dtype != dtype or dest.device.type not in ("cpu", "cuda"):
                staging = torch.empty(lengths, dtype=dtype)
                target = staging
            offsets = [a + b for a, b in zip(item.storage_index.offset,
                                             item.storage_offsets)]
            entry = sharded.setdefault(fqn, (t["dtype"], t["shape"], []))
            entry[2].append((offsets, lengths, _state._torch_bits(target)))
            tensor_items.append((item, dest, staging))
        for fqn, (dtype, shape, shards) in sharded.items():
            request[fqn] = _cairn.Sharded(dtype, shape, shards)
        if request:
            _api.load(request, os.fspath(self.path), comm=_comm.local(),
                      strict=True, allow_pickle=False, **self._options)
        for item, dest, staging in tensor_items:
            if staging is not None:
                dest.copy_(staging)
            planner.commit_tensor(item, dest)
        for item in byte_items:
            fqn = item.storage_index.fqn
            if fqn in self._lists:
                data = _torch_bytes(_build_list(self._lists[fqn], request))
            else:
                data = _torch_bytes(request[fqn])
            planner.load_bytes(item, io.BytesIO(data))
        fut = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return _valid_checkpoint_id(checkpoint_id)
