"""A training loop that checkpoints with cairn and survives being killed.

    torchrun --nproc-per-node 4 examples/train_fsdp.py --ckpt /tmp/run --steps 60
    # kill it (Ctrl-C, SIGKILL, a lost node) and start the same command again:
    # it resumes from the newest committed checkpoint.

An FSDP2-sharded MLP with AdamW on CPU (gloo), saved every --every steps by a
cairn.CheckpointManager: asynchronously (training goes on while the
checkpoint is written; it holds the step's values), keeping the newest
--keep steps. A save that was cut off is never committed, so the restart
finds the last complete one. The model, the optimizer state, the step and
the RNG state all come back, so the resumed run computes the same losses as
one that was never interrupted.

--kill-at STEP makes rank 0 SIGKILL itself right after that step (tests
use it); torchrun then stops the other ranks.
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import cairn


def build_model(world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step):
    # Every rank sees the same batch; real jobs give each rank its own.
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :4].sin()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint root folder")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10,
                        help="save every this many steps")
    parser.add_argument("--keep", type=int, default=2,
                        help="committed checkpoints kept")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--losses", default=None,
                        help="append 'step loss' lines to this file (rank 0)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    noise = torch.Generator().manual_seed(1234)  # e.g. dropout's RNG

    def state(step):
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "step": step,
                "rng": noise.get_state()}

    manager = cairn.CheckpointManager(args.ckpt, keep_last=args.keep)
    start = 0
    latest = manager.latest_step()
    if latest is not None:
        sd = state(0)
        manager.restore(sd)
        set_state_dict(model, opt, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        noise.set_state(sd["rng"])
        start = sd["step"]
        if rank == 0:
            print(f"resumed from step {start} ({manager.step_dir(start)})",
                  flush=True)

    for step in range(start + 1, args.steps + 1):
        x, y = batch(step)
        x = x + 0.01 * torch.randn(x.shape, generator=noise)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            if step % 10 == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
            if args.losses:
                with open(args.losses, "a") as f:
                    f.write(f"{step} {loss.item()!r}\n")
        if step % args.every == 0:
            manager.save(step, state(step))  # returns once staged
        if args.kill_at == step and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    manager.wait()  # the last save committed, retention applied
    steps = manager.steps()
    manager.close()
    if rank == 0:
        print(f"done: checkpoints at steps {steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
