"""Run under mpirun by test_mpi.py: ranks that talk over Open MPI (no
torch.distributed) save one NumPy tensor, each its own rows, then load it
back with the columns split instead."""

import sys

import numpy as np

import cairn

path = sys.argv[1]
comm = cairn.mpi_world()
rank, world = comm.rank, comm.size
full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
rows, cols = 8 // world, 6 // world
mine = full[rank * rows:(rank + 1) * rows].copy()
sd = {"w": cairn.ShardedTensor([8, 6], [((rank * rows, 0), mine)]), "step": 3}
result = cairn.save(sd, path, comm=comm)
assert result.world_size == world, result
dst = np.zeros((8, cols), dtype=np.float32)
back = {"w": cairn.ShardedTensor([8, 6], [((0, rank * cols), dst)]), "step": 0}
cairn.load(back, path, comm=comm)
assert back["step"] == 3
assert np.array_equal(dst, full[:, rank * cols:(rank + 1) * cols]), rank
comm.barrier()
print(f"rank {rank} of {world}: ok", flush=True)
