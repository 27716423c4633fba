"""Turning Python state dicts into what the C++ library takes, and back.

A state dict is a nest of dicts (str keys) and lists whose leaves are
torch tensors (DTensors and Parameters included), NumPy arrays, Python
int/float/bool/str (stored as cairn scalars), bytes (stored as they are, as
cairn objects) and any other picklable object (pickled into an object).
Tuples are leaves too (pickled), since they cannot be filled in place.

Tensors cross to C++ by DLPack without a copy. They cross as integers of
the element's width (a bf16 tensor as int16, say) beside the dtype's name,
so dtypes that a framework's DLPack cannot name (float8, bfloat16 in NumPy)
need no special path.
"""

import pickle
import sys

import numpy as np

from . import _cairn
from ._errors import InvalidArgumentError

# Objects that are not plain bytes are stored pickled, behind this prefix;
# plain bytes that happen to start with it (or with TORCH_MAGIC) are pickled
# too, so a stored object decodes one way only.
PICKLE_MAGIC = b"\x00cairn-pickle\x00"
# Objects written through the DCP plugin: torch.save's bytes.
TORCH_MAGIC = b"\x00cairn-torch\x00"

_TORCH_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e8m0fnu": "F8_E8M0",
    "complex64": "C64",
    # Two 4-bit floats a byte, as safetensors' F4 holds them.
    "float4_e2m1fn_x2": "F4_X2",
}
# NumPy's dtype names are the same, but for the packed F4 pairs (ml_dtypes'
# float4_e2m1fn holds one value a byte).
_NUMPY_NAMES = {k: v for k, v in _TORCH_NAMES.items() if v != "F4_X2"}
_CAIRN_TO_NAME = {v: k for k, v in _TORCH_NAMES.items()}
# Packed dtypes neither torch nor NumPy has: four 6-bit floats in 3 bytes.
_NO_ARRAY_DTYPE = ("F6_E2M3_X4", "F6_E3M2_X4")


def _torch():
    return sys.modules.get("torch")


def _is_torch_tensor(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _dtensor_type():
    if "torch.distributed.tensor" not in sys.modules:
        return None
    return sys.modules["torch.distributed.tensor"].DTensor


def torch_dtype_name(dtype, fqn):
    name = str(dtype).removeprefix("torch.")
    cairn_name = _TORCH_NAMES.get(name)
    if cairn_name is None:
        raise InvalidArgumentError(
            f"'{fqn}': dtype {dtype} is not one cairn stores "
            f"(it stores {', '.join(sorted(_TORCH_NAMES))})")
    return cairn_name


def _no_array_dtype(cairn_name, fqn, framework):
    return InvalidArgumentError(
        f"'{fqn}' is {cairn_name} (four 6-bit floats in 3 bytes), which "
        f"{framework} has no dtype for; the C++ API loads it")


def has_torch_dtype(cairn_name):
    """False for the dtypes cairn holds that torch has no dtype for (the
    packed 6-bit floats)."""
    return cairn_name not in _NO_ARRAY_DTYPE


def torch_dtype(cairn_name, fqn=""):
    if cairn_name in _NO_ARRAY_DTYPE:
        raise _no_array_dtype(cairn_name, fqn, "torch")
    return getattr(_torch(), _CAIRN_TO_NAME[cairn_name])


def _torch_bits(t):
    """A DLPack capsule of `t`'s bytes (to_dlpack: far cheaper than the
    __dlpack__ protocol, and torch tensors are never read-only). The
    extension checks only the element width against the dtype's name, so
    a tensor goes as it is; float8 goes as uint8, whose DLPack codes
    differ across DLPack versions (the view costs about 1.6 us)."""
    torch = _torch()
    d = t.detach()
    if d.dtype in (torch.float8_e4m3fn, torch.float8_e5m2,
                   torch.float4_e2m1fn_x2):
        d = d.view(torch.uint8)
    return torch.utils.dlpack.to_dlpack(d)


def numpy_dtype_name(dtype, fqn):
    # ml_dtypes' bfloat16 and float8 arrays have those names too.
    cairn_name = _NUMPY_NAMES.get(dtype.name)
    if cairn_name is None:
        raise InvalidArgumentError(
            f"'{fqn}': NumPy dtype {dtype} is not one cairn stores")
    return cairn_name


def numpy_dtype(cairn_name, fqn):
    if cairn_name in _NO_ARRAY_DTYPE:
        raise _no_array_dtype(cairn_name, fqn, "NumPy")
    if cairn_name == "F4_X2":
        raise InvalidArgumentError(
            f"'{fqn}' is F4_X2 (two 4-bit floats a byte), which NumPy has no "
            f"dtype for: load it with framework='torch' "
            f"(torch.float4_e2m1fn_x2)")
    name = _CAIRN_TO_NAME[cairn_name]
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        try:
            import ml_dtypes
        except ImportError:
            raise InvalidArgumentError(
                f"'{fqn}' is {cairn_name}, which NumPy has no dtype for: "
                f"load it with framework='torch', or install ml_dtypes"
            ) from None
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _numpy_bits(a):
    bits = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
    return a.view(bits[a.dtype.itemsize])


def _dtensor_leaf(dt, fqn):
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import (
        compute_local_shape_and_global_offset)

    if any(isinstance(p, Partial) for p in dt.placements):
        raise InvalidArgumentError(
            f"'{fqn}': a DTensor with Partial placements "
            f"({dt.placements}) holds partial sums, not values: "
            f"redistribute it to Shard or Replicate first")
    name = torch_dtype_name(dt.dtype, fqn)
    shape = list(dt.shape)
    local = dt.to_local()
    shards = []
    if dt.device_mesh.get_coordinate() is not None:
        local_shape, offsets = compute_local_shape_and_global_offset(
            dt.shape, dt.device_mesh, dt.placements)
        if list(local.shape) != list(local_shape):
            raise InvalidArgumentError(
                f"'{fqn}': the DTensor's local tensor has shape "
                f"{list(local.shape)}, its placements give {list(local_shape)}")
        # An empty local shard (uneven sharding) holds nothing to store;
        # a tensor with no elements at all is stored by its holders.
        if local.numel() > 0 or dt.numel() == 0:
            shards.append((list(offsets), list(local_shape), _torch_bits(local)))
    return _cairn.Sharded(name, shape, shards)


class ShardedTensor:
    """A tensor of which this rank holds some boxes, for tensors that are
    not DTensors (NumPy arrays, or torch tensors sharded by hand):

        cairn.ShardedTensor([4096, 4096], [((1024, 0), my_rows)])

    `shape`: the global shape; `shards`: (offsets, local) pairs, each local
    a torch tensor or NumPy array of the box's sizes, all of one dtype.
    Ranks holding the same box hold a replica (stored once). Load fills the
    locals in place."""

    def __init__(self, shape, shards):
        self.shape = [int(d) for d in shape]
        self.shards = [(tuple(int(o) for o in offsets), local)
                       for offsets, local in shards]

    def __repr__(self):
        return (f"cairn.ShardedTensor(shape={self.shape}, "
                f"shards={[(o, tuple(t.shape)) for o, t in self.shards]})")


def _local_leaf(local, fqn):
    """(dtype name, bits exporter) of a local tensor or array."""
    if _is_torch_tensor(local):
        return torch_dtype_name(local.dtype, fqn), _torch_bits(local)
    if isinstance(local, np.ndarray):
        return numpy_dtype_name(local.dtype, fqn), _numpy_bits(local)
    raise InvalidArgumentError(
        f"'{fqn}': a shard must be a torch tensor or a NumPy array, not "
        f"{type(local).__name__}")


def _sharded_leaf(x, fqn):
    names, shards = set(), []
    for offsets, local in x.shards:
        name, bits = _local_leaf(local, fqn)
        names.add(name)
        if len(offsets) != len(x.shape):
            raise InvalidArgumentError(
                f"'{fqn}': a shard's offsets {list(offsets)} do not match "
                f"the shape {x.shape}")
        shards.append((list(offsets), list(local.shape), bits))
    if len(names) > 1:
        raise InvalidArgumentError(
            f"'{fqn}': shards of different dtypes ({sorted(names)})")
    if not names:
        raise InvalidArgumentError(
            f"'{fqn}': a ShardedTensor with no shards has no dtype; give "
            f"it a shard, or leave the tensor out on this rank")
    return _cairn.Sharded(names.pop(), x.shape, shards)


def tensor_leaf(x, fqn):
    """A `_cairn.Sharded` for a tensor, DTensor or array leaf; None if `x`
    is no tensor. A `_cairn.Sharded` passes as it is (the DCP plugin builds
    them from DCP's write and read items)."""
    if isinstance(x, _cairn.Sharded):
        return x
    if isinstance(x, ShardedTensor):
        return _sharded_leaf(x, fqn)
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(x, dtensor):
        return _dtensor_leaf(x, fqn)
    if _is_torch_tensor(x):
        if x.is_sparse or x.layout != _torch().strided:
            raise InvalidArgumentError(
                f"'{fqn}': only dense (strided) tensors are stored, "
                f"not {x.layout}")
        name = torch_dtype_name(x.dtype, fqn)
        shape = list(x.shape)
        return _cairn.Sharded(name, shape,
                              [([0] * len(shape), shape, _torch_bits(x))])
    if isinstance(x, np.ndarray):
        name = numpy_dtype_name(x.dtype, fqn)
        shape = list(x.shape)
        return _cairn.Sharded(name, shape,
                              [([0] * len(shape), shape, _numpy_bits(x))])
    return None


class Encoded(bytes):
    """Bytes already in their stored form, stored as they are: the DCP
    plugin's TORCH_MAGIC + torch.save bytes."""


def encode_object(value):
    """The bytes stored for a non-tensor, non-scalar leaf."""
    if isinstance(value, Encoded):
        return bytes(value)
    if isinstance(value, bytes) and not value.startswith(
            (PICKLE_MAGIC, TORCH_MAGIC)):
        return value
    return PICKLE_MAGIC + pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode_object(data, allow_pickle=True):
    """The value stored as `data` (see encode_object)."""
    if data.startswith(PICKLE_MAGIC):
        if not allow_pickle:
            return data
        return pickle.loads(data[len(PICKLE_MAGIC):])
    if data.startswith(TORCH_MAGIC):
        if not allow_pickle:
            return data
        import io

        import torch
        return torch.load(io.BytesIO(data[len(TORCH_MAGIC):]),
                          weights_only=False)
    return data


def _is_scalar(x):
    return isinstance(x, (bool, float, str)) or (
        isinstance(x, int) and -(1 << 63) <= x < (1 << 63))


def _child(fqn, key):
    return key if not fqn else f"{fqn}.{key}"


_torch_hooks = None


def _hooks():
    """What the extension's walk (python/src/prepare.h) takes: the torch
    objects its fast path for plain tensors compares against (None until
    torch is imported), ShardedTensor, and the Python functions for every
    other leaf."""
    global _torch_hooks
    torch = _torch()
    if torch is not None and _torch_hooks is None:
        names = {getattr(torch, n): c for n, c in _TORCH_NAMES.items()
                 if hasattr(torch, n)}
        _torch_hooks = ((torch.Tensor, torch.nn.Parameter), torch.strided,
                        names, (torch.float8_e4m3fn, torch.float8_e5m2),
                        torch.uint8, torch.utils.dlpack.to_dlpack)
    return (_torch_hooks if torch is not None else None, ShardedTensor,
            tensor_leaf, encode_object)


class Prepared:
    """A state dict as the C++ library takes it (`tree`, built by the
    extension in one walk), and where its scalar and object leaves go back
    (for loads). Plain torch tensors and ShardedTensors of them are taken
    without running Python code; other leaves go through tensor_leaf and
    encode_object. Tuples are leaves (pickled): they cannot be filled in
    place."""

    def __init__(self, state_dict, for_load):
        if not isinstance(state_dict, dict):
            raise InvalidArgumentError(
                f"a state dict is a dict, not {type(state_dict).__name__}")
        self.tree = _cairn.Prepared(state_dict, for_load, _hooks())

    def put_back(self, values, missing, allow_pickle):
        """Writes the loaded scalar and object values into the state dict."""
        skip = set(missing)
        for fqn, container, key in self.tree.slots:
            if fqn in skip or fqn not in values:
                continue
            value = values[fqn]
            if isinstance(value, bytes):
                value = decode_object(value, allow_pickle)
            container[key] = value


def from_loaded(tree, framework, allow_pickle, fqn=""):
    """load_all's nest: Exported tensors as torch tensors or NumPy arrays,
    objects decoded."""
    if isinstance(tree, dict):
        return {k: from_loaded(v, framework, allow_pickle, _child(fqn, k))
                for k, v in tree.items()}
    if isinstance(tree, list):
        return [from_loaded(v, framework, allow_pickle, _child(fqn, str(i)))
                for i, v in enumerate(tree)]
    if isinstance(tree, _cairn.Exported):
        # The dtype first: it is the clear error for one that has none.
        if framework == "torch":
            import torch
            dtype = torch_dtype(tree.dtype, fqn)
            return torch.from_dlpack(tree).view(dtype)
        dtype = numpy_dtype(tree.dtype, fqn)
        return np.from_dlpack(tree).view(dtype)
    if isinstance(tree, bytes):
        return decode_object(tree, allow_pickle)
    return tree
