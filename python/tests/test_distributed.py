"""Real torch.distributed jobs (gloo, one process per rank): an FSDP2 model
with AdamW saved by 4 ranks, loaded back bit-exact by 3 ranks, 2 ranks and
one process, which then train on with the losses of the uninterrupted run.
DTensors on a 2-d mesh (Shard on two dims, uneven, Replicate) go along."""

import json
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (DTensor, Replicate, Shard,
                                      distribute_tensor)

import cairn
from gloo_jobs import init, make_model, run, shard

SAVE_STEP = 3
MORE_STEPS = 3




def batch(step):
    # The same global batch on every rank: the gradient does not depend on
    # how many ranks there are, so losses compare across world sizes.
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)


def train_step(model, opt, step):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def flat_tensors(sd, prefix=""):
    out = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(sd, list):
        for i, v in enumerate(sd):
            out.update(flat_tensors(v, f"{prefix}{i}."))
    elif isinstance(sd, torch.Tensor):
        out[prefix[:-1]] = full(sd).detach().clone()
    return out


def extra_tensors(world):
    """DTensors beyond FSDP's: a 2-d mesh with Shard on both dims (uneven)
    and a Replicate, when saving with 4 ranks; a 1-d mesh with other
    placements when loading."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(10, 7, generator=g)
    b = torch.randn(9, 4, generator=g)
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        return {"a": distribute_tensor(a, mesh, [Shard(0), Shard(1)]),
                "b": distribute_tensor(b, mesh, [Replicate(), Shard(0)])}
    mesh = init_device_mesh("cpu", (world,))
    return {"a": distribute_tensor(torch.zeros(10, 7), mesh, [Shard(1)]),
            "b": distribute_tensor(torch.zeros(9, 4), mesh, [Replicate()])}


def state(model, opt, extra):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": extra}



def save_job(rank, world, port, out):
    init(rank, world, port)
    out = pathlib.Path(out)
    model = shard(make_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, SAVE_STEP + 1):
        train_step(model, opt, step)
    sd = state(model, opt, extra_tensors(world))
    result = cairn.save(sd, out / "ckpt")  # comm=None: the torch job
    assert result.world_size == world
    reference = flat_tensors(sd)
    losses = [train_step(model, opt, s)
              for s in range(SAVE_STEP + 1, SAVE_STEP + MORE_STEPS + 1)]
    if rank == 0:
        torch.save(reference, out / "reference.pt")
        (out / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


def check_and_resume(model, opt, sd, out, world):
    reference = torch.load(out / "reference.pt")
    got = flat_tensors(sd)
    assert set(got) == set(reference), set(got) ^ set(reference)
    for k, v in reference.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    losses = [train_step(model, opt, s)
              for s in range(SAVE_STEP + 1, SAVE_STEP + MORE_STEPS + 1)]
    expected = json.loads((out / "losses.json").read_text())
    # Bit-exact state; the losses may differ in the last bits only through
    # the order in which ranks sum gradients.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected),
                               rtol=1e-5, atol=1e-7)
    return losses


def load_job(rank, world, port, out):
    init(rank, world, port)
    out = pathlib.Path(out)
    model = shard(make_model(), world)
    torch.manual_seed(123 + rank)  # the loaded values must replace these
    for p in model.parameters():
        p.data.normal_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = state(model, opt, extra_tensors(world))
    result = cairn.load(sd, out / "ckpt")
    assert result.bytes_unverified == 0
    set_state_dict(model, opt, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"])
    sd = state(model, opt, sd["extra"])
    check_and_resume(model, opt, sd, out, world)
    dist.destroy_process_group()



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    run(save_job, 4, out)
    return out


def test_saved_by_four_ranks(saved):
    md = cairn.read_metadata(saved / "ckpt")
    assert md["world_size"] == 4
    # The replicated DTensor and the optimizer's step counters (replicated
    # plain tensors) are stored once.
    b = md["tensors"]["extra.b"]
    assert sum(c["sizes"][0] for c in b["chunks"]) == 9
    assert "optim.param_groups.0.lr" in md["scalars"]


@pytest.mark.parametrize("world", [3, 2])
def test_loads_into_fewer_ranks(saved, world):
    run(load_job, world, saved)


def test_loads_into_one_process(saved):
    model = make_model()
    for p in model.parameters():
        p.data.normal_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"a": torch.zeros(10, 7), "b": torch.zeros(9, 4)}
    sd = state(model, opt, extra)
    cairn.load(sd, saved / "ckpt")
    set_state_dict(model, opt, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"])
    check_and_resume(model, opt, state(model, opt, extra), saved, 1)


def test_load_all_in_one_process(saved):
    everything = cairn.load_all(saved / "ckpt")
    reference = torch.load(saved / "reference.pt")
    got = flat_tensors(everything)
    for k, v in reference.items():
        assert torch.equal(got[k], v), k
