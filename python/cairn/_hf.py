"""Hugging Face interop (include/cairn/huggingface.h): folders of
safetensors files in (load, load_all and read_metadata take them, with
strip_prefix, add_prefix and name_map), and out (save_hf, export_hf), and
convert_to_checkpoint."""

import re

from . import _cairn, _comm, _state
from ._errors import InvalidArgumentError

DEFAULT_MAX_SHARD_SIZE = 5_000_000_000  # huggingface_hub's "5GB"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def _bytes(size):
    """An int, or a size as huggingface_hub writes them ("5GB", "500MiB")."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise InvalidArgumentError(f"max_shard_size must be positive, not {size}")
        return size
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?I?B?)\s*",
                     str(size).upper())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise InvalidArgumentError(
            f"max_shard_size: {size!r} is not a size such as 5GB or 500MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _dtype_name(dtype):
    """None, a cairn dtype name ("BF16") or a torch dtype."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in _state._TORCH_NAMES:
        raise InvalidArgumentError(f"no cairn dtype for {dtype}")
    return _state._TORCH_NAMES[name]


def save_hf(state_dict, path, *, comm=None, max_shard_size=DEFAULT_MAX_SHARD_SIZE,
            dtype=None, overwrite=False, progress=None):
    """Writes `state_dict` (every rank of `comm` its shards, as for save)
    to the Hugging Face folder `path`: tensors named by their FQN, in key
    order, in files of at most `max_shard_size` bytes (an int or "5GB"),
    each rank writing its boxes in place in the final files; the index is
    written last (one file: model.safetensors, no index). `dtype` (e.g.
    torch.bfloat16 or "BF16") casts floating-point tensors on the way.
    Objects and scalars are left out (listed in the result's "skipped").
    Returns a dict: files, total_size, bytes_written (this rank's),
    tensors, skipped, seconds."""
    prepared = _state.Prepared(state_dict, for_load=False)
    return _cairn.save_hf(prepared.tree, str(path), _comm.resolve(comm),
                          _bytes(max_shard_size), _dtype_name(dtype),
                          overwrite, progress)


def export_hf(checkpoint, path, *, max_shard_size=DEFAULT_MAX_SHARD_SIZE,
              dtype=None, overwrite=False, progress=None):
    """Writes every tensor of the cairn checkpoint at `checkpoint` (each
    chunk checked against its CRC32C as it is read) to the Hugging Face
    folder `path`, as save_hf does. One process. `progress(done, total)`
    is called as it goes."""
    return _cairn.export_hf(str(checkpoint), str(path), _bytes(max_shard_size),
                            _dtype_name(dtype), overwrite, progress)


def convert_to_checkpoint(source, path, *, dtype=None, overwrite=False,
                          strip_prefix=None, add_prefix=None, name_map=None):
    """Saves the tensors of the Hugging Face folder (or .safetensors file)
    `source` as a cairn checkpoint at `path`, with a CRC32C per chunk
    (Hugging Face files have none), named as load's options name them.
    Returns a cairn.SaveResult."""
    return _cairn.convert_to_checkpoint(
        str(source), str(path), _dtype_name(dtype), overwrite,
        strip_prefix=strip_prefix, add_prefix=add_prefix, name_map=name_map)


def is_safetensors_source(path):
    """Whether `path` is a Hugging Face folder or .safetensors file (and not
    a cairn checkpoint)."""
    return _cairn.is_safetensors_source(str(path))


def fuse_tensors(tensors, sources, fqn, dim=0):
    """For a name_map: `tensors` (its argument) with the whole stored
    tensors named `sources` replaced by one named `fqn`, their
    concatenation along `dim` (e.g. q, k, v into qkv)."""
    return _cairn.fuse_tensors(tensors, list(sources), fqn, dim)


def split_rows(tensors, source, pieces):
    """For a name_map: `tensors` with the whole stored tensor `source`
    replaced by tensors of its leading rows: `pieces`, (name, rows) pairs
    in order, adding up to its first dimension."""
    return _cairn.split_rows(tensors, source, [tuple(p) for p in pieces])
