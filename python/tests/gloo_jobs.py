"""What the multi-process tests share: a small MLP sharded with FSDP2 on a
CPU mesh, and jobs of real processes talking over gloo on 127.0.0.1."""

import faulthandler
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from conftest import free_port


def make_model():
    """The same 16-27-3 MLP on every rank (27 rows: uneven over 2 and 4)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 27), torch.nn.ReLU(),
                               torch.nn.Linear(27, 3))


def shard(model, world):
    """`model` with each Linear and the whole FSDP2-sharded over `world`."""
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def init(rank, world, port):
    # A rank that aborts (an unexplained "terminate called without an
    # active exception" has been seen here) prints its Python threads'
    # stacks, so the log says where it was.
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def run(fn, world, out):
    """fn(rank, world, port, out) in `world` fresh processes; raises what
    any of them raised."""
    mp.spawn(fn, args=(world, free_port(), str(out)), nprocs=world, join=True)
