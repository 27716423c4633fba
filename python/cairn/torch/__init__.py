"""cairn for PyTorch: a storage plugin for torch.distributed.checkpoint.

    import torch.distributed.checkpoint as dcp
    import cairn.torch

    dcp.save(state_dict, storage_writer=cairn.torch.StorageWriter(path))
    dcp.async_save(state_dict, storage_writer=cairn.torch.StorageWriter(path))
    dcp.load(state_dict, storage_reader=cairn.torch.StorageReader(path))

DCP's planners decide what each rank writes and reads; the checkpoint is
cairn's (safetensors data files, CRC32C checksums, reads of only the bytes a
rank needs), so cairn.load / cairn.load_all and the cairn CLI read it, and
the reader loads checkpoints that cairn.save wrote. See docs/python.md,
"DCP plugin". Importing this module imports torch; `import cairn` does not.
"""

from ._reader import StorageReader
from ._writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
