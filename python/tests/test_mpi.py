"""Under mpirun, cairn's own MPI communicator (no torch.distributed)."""

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import cairn

MPIRUN = shutil.which("mpirun")


@pytest.mark.skipif(MPIRUN is None or not cairn.has_mpi(),
                    reason="needs Open MPI's mpirun and cairn built with MPI")
def test_two_mpi_ranks_save_and_reshard(tmp_path):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    job = pathlib.Path(__file__).with_name("mpi_job.py")
    out = subprocess.run([MPIRUN, "-n", "2", sys.executable, str(job),
                          str(tmp_path / "ckpt")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 of 2: ok" in out.stdout and "rank 1 of 2: ok" in out.stdout
    back = cairn.load_all(tmp_path / "ckpt", framework="numpy")
    assert np.array_equal(back["w"], np.arange(48, dtype=np.float32).reshape(8, 6))
    assert cairn.read_metadata(tmp_path / "ckpt")["world_size"] == 2


def test_sharded_tensor_errors(tmp_path):
    with pytest.raises(cairn.InvalidArgumentError, match="'w'.*no shards"):
        cairn.save({"w": cairn.ShardedTensor([4], [])}, tmp_path / "a")
    with pytest.raises(cairn.InvalidArgumentError, match="'w'.*offsets"):
        cairn.save({"w": cairn.ShardedTensor([4, 4], [((0,), np.zeros(4))])},
                   tmp_path / "a")
    with pytest.raises(cairn.InvalidArgumentError, match="'w'.*coverage|cover"):
        cairn.save({"w": cairn.ShardedTensor([4], [((0,), np.zeros(2))])},
                   tmp_path / "a")
