"""Compressed checkpoints (codec=): gloo ranks save trained weights and
AdamW state compressed, other ranks load them bit-exact; the files stay
valid safetensors; bad options are refused."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import cairn
from gloo_jobs import init, run


def make_model():
    """Layers big enough that each rank's shards are compressed chunks."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 301), torch.nn.ReLU(),
                               torch.nn.Linear(301, 64))


def trained(world, dtype):
    mesh = init_device_mesh("cpu", (world,))
    model = make_model().to(dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    model(x.to(dtype)).float().sum().backward()
    opt.step()
    return model, opt


def full(sd):
    """Every DTensor of a state dict, gathered, by dotted name."""
    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}{k}.", x)
        elif isinstance(v, torch.Tensor):
            out[prefix[:-1]] = (v.full_tensor() if hasattr(v, "full_tensor")
                                else v).clone()
    walk("", sd)
    return out


def save_job(rank, world, port, out):
    init(rank, world, port)
    job = json.loads(out)
    model, opt = trained(world, getattr(torch, job["dtype"]))
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    cairn.save(sd, job["url"], codec=job["codec"])
    ref = full(sd)
    if rank == 0:
        torch.save(ref, job["reference"])
    dist.destroy_process_group()


def load_job(rank, world, port, out):
    init(rank, world, port)
    job = json.loads(out)
    model, opt = trained(world, getattr(torch, job["dtype"]))
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    with torch.no_grad():
        for v in full(sd).values():
            v.zero_()
    result = cairn.load(sd, job["url"])
    assert result.bytes_unverified == 0
    got = full(sd)
    reference = torch.load(job["reference"])
    assert set(got) == set(reference)
    for k, v in reference.items():
        assert torch.equal(got[k], v), k
    dist.destroy_process_group()


@pytest.mark.parametrize("codec,dtype", [("grouped-zstd", "bfloat16"),
                                         ("zstd", "float32")])
def test_gloo_ranks_save_compressed_and_reshard_load(tmp_path, codec, dtype):
    url = str(tmp_path / "ckpt")
    job = json.dumps({"url": url, "reference": str(tmp_path / "ref.pt"),
                      "codec": codec, "dtype": dtype})
    run(save_job, 2, job)
    md = cairn.read_metadata(url)
    assert md["version"] == 6
    chunks = [c for t in md["tensors"].values() for c in t["chunks"]]
    compressed = [c for c in chunks if c.get("codec") == codec]
    assert compressed, "no chunk was compressed"
    for c in compressed:
        assert 0 < c["stored_nbytes"] < c["nbytes"]
    run(load_job, 3, job)


def test_files_stay_valid_safetensors(tmp_path):
    from safetensors import safe_open
    g = torch.Generator().manual_seed(3)
    src = {"w": (torch.randn(256, 64, generator=g) * 0.02).to(torch.bfloat16),
           "step": torch.arange(10)}
    cairn.save(src, str(tmp_path / "c"), codec="grouped-zstd", codec_level=5)
    md = cairn.read_metadata(str(tmp_path / "c"))
    w = md["tensors"]["w"]["chunks"][0]
    assert w["codec"] == "grouped-zstd"
    with safe_open(str(tmp_path / "c" / w["file"]), framework="pt") as st:
        stored = st.get_tensor("w")
        # The stored frames: a U8 entry of stored_nbytes.
        assert stored.dtype == torch.uint8
        assert stored.numel() == w["stored_nbytes"]
        # A chunk too small to compress is its raw self.
        assert torch.equal(st.get_tensor("step"), src["step"])
    back = cairn.load_all(str(tmp_path / "c"))
    assert torch.equal(back["w"], src["w"])
    report = cairn.verify(str(tmp_path / "c"))
    assert report.ok and not report.problems


def test_bad_codec_options_are_refused(tmp_path):
    with pytest.raises(cairn.InvalidArgumentError, match="unknown codec"):
        cairn.save({"w": torch.zeros(4096)}, str(tmp_path / "a"), codec="lz4")
    with pytest.raises(cairn.InvalidArgumentError, match="level"):
        cairn.save({"w": torch.zeros(4096)}, str(tmp_path / "b"),
                   codec="zstd", codec_level=99)
