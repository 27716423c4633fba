"""examples/train_fsdp.py under torchrun: killed mid-run, restarted, and
the losses after the restart are those of a run never interrupted."""

import os
import pathlib
import subprocess
import sys

from conftest import free_port

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "train_fsdp.py"


def torchrun(tmp, ckpt, losses, *extra, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
           "2", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(EXAMPLE), "--ckpt", str(ckpt), "--steps",
           "30", "--every", "10", "--losses", str(losses), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def read_losses(path):
    losses = {}
    for line in pathlib.Path(path).read_text().split("\n"):
        if line:
            step, loss = line.split()
            losses[int(step)] = float(loss)  # a rerun step: the last one
    return losses


def test_killed_run_resumes_with_the_same_losses(tmp_path):
    clean = torchrun(tmp_path, tmp_path / "clean", tmp_path / "clean.txt")
    assert "done: checkpoints at steps [20, 30]" in clean.stdout
    killed = torchrun(tmp_path, tmp_path / "run", tmp_path / "run.txt",
                      "--kill-at", "25", check=False)
    assert killed.returncode != 0
    resumed = torchrun(tmp_path, tmp_path / "run", tmp_path / "run.txt")
    assert "resumed from step 20" in resumed.stdout, resumed.stdout
    expected, got = read_losses(tmp_path / "clean.txt"), read_losses(
        tmp_path / "run.txt")
    assert sorted(got) == list(range(1, 31))
    # Same ranks, same data, bit-exact state: the same losses to the bit.
    assert got == expected
