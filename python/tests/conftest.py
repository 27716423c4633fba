import os
import pathlib

import pytest


@pytest.fixture
def ckpt(tmp_path) -> pathlib.Path:
    """A checkpoint folder that does not exist yet."""
    return tmp_path / "ckpt"


def data_files(path):
    """The data files of a checkpoint folder (rank folders included)."""
    return sorted(p for p in pathlib.Path(path).rglob("*.safetensors"))


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


os.environ.setdefault("OMP_NUM_THREADS", "1")
