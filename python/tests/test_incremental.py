"""Incremental checkpoints (base=): gloo ranks with a frozen layer save
against the previous step, writing only what changed; other ranks load
the result bit-exact; the manager saves incrementally, keeps what kept
steps reference and saves a full step every full_every; a bad base is a
clear error."""

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

import cairn
from gloo_jobs import init, make_model, run, shard
from test_compression import full


def trained_with_frozen_first_layer(world, steps):
    model = make_model()
    model[0].requires_grad_(False)
    model = shard(model, world)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=1e-2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return model, opt


def save_job(rank, world, port, out):
    init(rank, world, port)
    job = json.loads(out)
    model, opt = trained_with_frozen_first_layer(world, 1)
    msd, osd = get_state_dict(model, opt)
    cairn.save({"model": msd, "optim": osd, "step": 1}, job["one"])
    model, opt = trained_with_frozen_first_layer(world, 2)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": 2}
    result = cairn.save(sd, job["two"], base=job["one"])
    reused = torch.tensor([result.chunks_reused, result.bytes_reused])
    dist.all_reduce(reused)
    tensors = full(sd)  # a collective: every rank
    if rank == 0:
        torch.save({"tensors": tensors, "reused": reused.tolist()},
                   job["reference"])
    dist.destroy_process_group()


def load_job(rank, world, port, out):
    init(rank, world, port)
    job = json.loads(out)
    model, opt = trained_with_frozen_first_layer(world, 1)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": 0}
    with torch.no_grad():
        for v in full(sd).values():
            v.zero_()
    result = cairn.load(sd, job["two"])
    assert result.bytes_unverified == 0
    assert sd["step"] == 2
    got = full(sd)
    reference = torch.load(job["reference"])["tensors"]
    assert set(got) == set(reference)
    for k, v in reference.items():
        assert torch.equal(got[k], v), k
    dist.destroy_process_group()


def test_gloo_ranks_save_against_a_base_and_reshard_load(tmp_path):
    one, two = tmp_path / "step-1", tmp_path / "step-2"
    job = json.dumps({"one": str(one), "two": str(two),
                      "reference": str(tmp_path / "ref.pt")})
    run(save_job, 2, job)
    reference = torch.load(tmp_path / "ref.pt")
    # The frozen layer's weight and bias, on both ranks (FSDP2 shards
    # [27, 16] and [27] by rows), and nothing else: its parameters have no
    # AdamW state, and everything else changed.
    chunks, nbytes = reference["reused"]
    assert chunks == 4
    assert nbytes == (27 * 16 + 27) * 4
    md = cairn.read_metadata(str(two))
    assert md["version"] == 6
    assert [r["url"] for r in md["references"]] == ["../step-1"]
    assert md["references"][0]["save_id"] == cairn.read_metadata(
        str(one))["save_id"]
    for name, t in md["tensors"].items():
        for c in t["chunks"]:
            assert len(c["xxh3"]) == 32
            kept = c["file"].startswith("../step-1/")
            assert kept == name.startswith("model.0."), (name, c["file"])
    run(load_job, 3, job)
    report = cairn.verify(str(two))
    assert report.ok and report.references == 1
    # Flattened, it stands alone.
    flat = tmp_path / "flat"
    cairn.rewrite(two, flat)
    assert cairn.read_metadata(str(flat))["references"] == []
    shutil.rmtree(one)
    with pytest.raises(cairn.NotFoundError, match="was it deleted"):
        cairn.load_all(str(two))
    back = cairn.load_all(str(flat))
    ref = torch.load(tmp_path / "ref.pt")["tensors"]
    assert torch.equal(back["model"]["0.weight"], ref["model.0.weight"])


def test_manager_saves_incrementally_and_keeps_what_is_referenced(tmp_path):
    frozen = torch.arange(4096, dtype=torch.float32)
    mgr = cairn.CheckpointManager(tmp_path, keep_last=1, async_save=False,
                                  incremental=True, full_every=2)
    with mgr:
        for step in range(1, 5):
            mgr.save(step, {"frozen": frozen,
                            "trained": torch.full((1024,), float(step))})
        refs = {s: [r["url"] for r in
                    cairn.read_metadata(mgr.step_dir(s))["references"]]
                for s in mgr.steps()}
    # Steps 1 and 3 are full; 4 keeps "frozen" in 3, which retention keeps.
    assert refs == {3: [], 4: ["../step-0000000003"]}
    back = cairn.load_all(str(tmp_path / "step-0000000004"))
    assert torch.equal(back["frozen"], frozen)
    assert torch.equal(back["trained"], torch.full((1024,), 4.0))


def test_bad_bases_are_refused(tmp_path):
    sd = {"w": torch.zeros(4096)}
    cairn.save(sd, str(tmp_path / "a"))
    with pytest.raises(cairn.NotFoundError, match="base"):
        cairn.save(sd, str(tmp_path / "b"), base=str(tmp_path / "none"))
    with pytest.raises(cairn.InvalidArgumentError, match="being saved"):
        cairn.save(sd, str(tmp_path / "a"), base=str(tmp_path / "a"),
                   overwrite=True)
    with pytest.raises(TypeError):
        cairn.save(sd, str(tmp_path / "c"), base=3)
