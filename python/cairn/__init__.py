"""cairn: distributed checkpointing of sharded tensor state.

    import cairn
    cairn.save(state_dict, "/ckpt/step-100")          # any ranks, any sharding
    cairn.load(state_dict, "/ckpt/step-100")          # in place, resharded
    sd = cairn.load_all("/ckpt/step-100")             # everything, one process

Hugging Face folders: load(), load_all() and read_metadata() read them
(strip_prefix, add_prefix, name_map rename and fuse tensors); save_hf()
and export_hf() write them; convert_to_checkpoint() adds checksums.

Key-value embedding tables go beside the state dict: save(...,
kv_tables=[cairn.KvTableToSave(...)]), load(..., kv_tables=[...]).

Ranks: in a torch.distributed job (torchrun) cairn talks over a gloo group
of its own; under mpirun pass comm=cairn.mpi_world(). A DCP user switches
with cairn.torch.StorageWriter / StorageReader. See docs/python.md.
"""

from . import _cairn
from ._api import (AsyncSaver, CheckpointManager, LoadResult, SaveFuture,
                   SavePlanCache, SaveResult, VerifyReport, load, load_all,
                   merge, read_metadata, rewrite, save, verify)
from ._hf import (convert_to_checkpoint, export_hf, fuse_tensors,
                  is_safetensors_source, save_hf, split_rows)
from ._comm import TorchCommunicator, in_process, local, mpi_world
from ._kv import (InMemoryKvTable, KvColumn, KvTableSource, KvTableSpec,
                  KvTableToLoad, KvTableToSave, RocksDbKvTable, kv_bucket_of,
                  kv_buckets_of_rank)
from ._state import ShardedTensor
from ._errors import (AbortedError, AlreadyExistsError, CancelledError,
                      DataLossError, DeadlineExceededError, Error,
                      FailedPreconditionError, InternalError,
                      InvalidArgumentError, NotFoundError, OutOfRangeError,
                      PermissionDeniedError, ResourceExhaustedError,
                      UnavailableError, UnimplementedError)

__version__ = _cairn.__version__
FORMAT_VERSION = _cairn.FORMAT_VERSION
Communicator = _cairn.Communicator
has_mpi = _cairn.has_mpi

__all__ = [
    "AbortedError", "AlreadyExistsError", "AsyncSaver", "CancelledError",
    "CheckpointManager", "Communicator", "DataLossError",
    "DeadlineExceededError", "Error", "FailedPreconditionError",
    "FORMAT_VERSION", "InMemoryKvTable", "InternalError",
    "InvalidArgumentError", "KvColumn", "KvTableSource", "KvTableSpec",
    "KvTableToLoad", "KvTableToSave", "LoadResult",
    "NotFoundError", "OutOfRangeError", "PermissionDeniedError",
    "ResourceExhaustedError", "RocksDbKvTable", "SaveFuture",
    "SavePlanCache", "SaveResult",
    "TorchCommunicator", "UnavailableError", "UnimplementedError",
    "convert_to_checkpoint", "export_hf", "fuse_tensors",
    "is_safetensors_source", "save_hf", "split_rows",
    "has_mpi", "in_process", "kv_bucket_of", "kv_buckets_of_rank", "load",
    "load_all", "local", "merge", "mpi_world",
    "read_metadata", "rewrite", "save", "ShardedTensor", "verify",
    "VerifyReport",
]
