"""cairn on s3:// URLs against a real S3-compatible server: moto's server
mode on 127.0.0.1, started by this module. Real torch processes over gloo
save and reshard-load a sharded model and its AdamW state; what cairn
wrote is read back by an independent client (boto3) and checked with the
reference safetensors reader. The URLs reach the server through the
AWS_* environment variables, as a job would."""

import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

import cairn
from conftest import free_port
from gloo_jobs import init, make_model, run, shard

BUCKET = "cairn-py"
ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
       "AWS_REGION")


@pytest.fixture(scope="module")
def s3():
    """The endpoint of a fresh moto server; the AWS_* variables point at it
    while the module's tests run."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        if os.environ.get("CAIRN_REQUIRE_S3_SERVER") == "1":
            pytest.fail(f"no S3 server: {e} (pip install -r python/requirements.txt)")
        pytest.skip(f"no S3 server: {e}")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
         str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.1)
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1")
    try:
        client().create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=30)


def client():
    import boto3
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                        aws_access_key_id="testing",
                        aws_secret_access_key="testing",
                        region_name="us-east-1")


def full_state(model, opt):
    msd, osd = get_state_dict(model, opt)
    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, torch.Tensor):
            out[prefix] = v.full_tensor() if hasattr(v, "full_tensor") else v
    walk("", {"model": msd, "optim": osd})
    return out, {"model": msd, "optim": osd}


def save_job(rank, world, port, out):
    init(rank, world, port)
    url = json.loads(out)["url"]
    model = shard(make_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    opt.step()
    reference, sd = full_state(model, opt)
    cairn.save(sd, url)
    if rank == 0:
        torch.save(reference, json.loads(out)["reference"])
    dist.destroy_process_group()


def load_job(rank, world, port, out):
    init(rank, world, port)
    url = json.loads(out)["url"]
    model = shard(make_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Optimizer state exists only after a step: take one, then load over it.
    model(torch.zeros(1, 16)).sum().backward()
    opt.step()
    _, sd = full_state(model, opt)
    with torch.no_grad():
        for v in sd["model"].values():
            v.zero_()
    cairn.load(sd, url)
    got, _ = full_state(model, opt)
    reference = torch.load(json.loads(out)["reference"])
    for k, v in reference.items():
        assert torch.equal(got[k], v), k
    dist.destroy_process_group()


@pytest.mark.parametrize("load_world", [3, 1])
def test_gloo_ranks_save_and_reshard_load(s3, tmp_path, load_world):
    url = f"s3://{BUCKET}/gloo-{load_world}/ckpt"
    job = json.dumps({"url": url, "reference": str(tmp_path / "ref.pt")})
    run(save_job, 2, job)
    run(load_job, load_world, job)


def test_boto3_and_safetensors_read_what_cairn_wrote(s3, tmp_path):
    from safetensors import safe_open
    g = torch.Generator().manual_seed(3)
    src = {"a": torch.randn(64, 33, generator=g).to(torch.bfloat16),
           "b": torch.arange(1000, dtype=torch.int64),
           "c": torch.randint(0, 2, (17,), generator=g).bool()}
    cairn.save(src, f"s3://{BUCKET}/ref")
    listed = client().list_objects_v2(Bucket=BUCKET, Prefix="ref/")
    keys = sorted(o["Key"] for o in listed["Contents"])
    assert "ref/metadata.json" in keys, keys
    md = json.loads(client().get_object(
        Bucket=BUCKET, Key="ref/metadata.json")["Body"].read())
    files = [k for k in keys if k.endswith(".safetensors")]
    assert files
    seen = set()
    for key in files:
        local = tmp_path / pathlib.Path(key).name
        client().download_file(BUCKET, key, str(local))
        with safe_open(str(local), framework="pt") as st:
            for entry in st.keys():
                fqn = entry.split("@")[0]
                assert any(c["file"] == local.name
                           for c in md["tensors"][fqn]["chunks"])
                t = st.get_tensor(entry)
                assert t.dtype == src[fqn].dtype
                assert torch.equal(t, src[fqn]), fqn
                seen.add(fqn)
    assert seen == set(src)
    back = cairn.load_all(f"s3://{BUCKET}/ref")
    for k, v in src.items():
        assert torch.equal(back[k], v)


def test_compressed_checkpoint_round_trips(s3):
    """The compressed writer writes its header last, over the start of its
    first part: the multipart upload must take that order."""
    g = torch.Generator().manual_seed(5)
    src = {"w": (torch.randn(512, 300, generator=g) * 0.02).to(torch.bfloat16),
           "m": torch.zeros(1 << 16)}
    url = f"s3://{BUCKET}/compressed"
    cairn.save(src, url, codec="grouped-zstd")
    md = cairn.read_metadata(url)
    assert md["tensors"]["w"]["chunks"][0]["codec"] == "grouped-zstd"
    back = cairn.load_all(url)
    for k, v in src.items():
        assert torch.equal(back[k], v), k
    assert cairn.verify(url).ok


def test_commit_refuses_to_replace_and_errors_name_the_url(s3):
    url = f"s3://{BUCKET}/errors"
    cairn.save({"w": torch.ones(4)}, url)
    with pytest.raises(cairn.AlreadyExistsError, match="errors"):
        cairn.save({"w": torch.zeros(4)}, url)
    cairn.save({"w": torch.full((4,), 2.0)}, url, overwrite=True)
    assert torch.equal(cairn.load_all(url)["w"], torch.full((4,), 2.0))
    with pytest.raises(cairn.NotFoundError, match="nothing-here"):
        cairn.load({"w": torch.empty(4)}, f"s3://{BUCKET}/nothing-here")
    with pytest.raises(cairn.InvalidArgumentError, match="bucket"):
        cairn.save({"w": torch.ones(4)}, "s3://Bad_Bucket/x")


def test_manager_on_an_s3_root(s3):
    root = f"s3://{BUCKET}/run"
    with cairn.CheckpointManager(root, keep_last=2, async_save=False) as m:
        for step in range(1, 5):
            m.save(step, {"w": torch.full((8,), float(step))})
        assert m.steps() == [3, 4]
        dst = {"w": torch.empty(8)}
        m.restore(dst)
        assert torch.equal(dst["w"], torch.full((8,), 4.0))
    keys = [o["Key"] for o in client().list_objects_v2(
        Bucket=BUCKET, Prefix="run/")["Contents"]]
    assert all(k.startswith(("run/step-0000000003/", "run/step-0000000004/"))
               for k in keys), keys


def test_s3_option_reaches_a_store_without_the_environment(s3, monkeypatch):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    opts = {"endpoint": s3, "access_key_id": "testing",
            "secret_access_key": "testing", "addressing": "path",
            "max_attempts": 2}
    url = f"s3://{BUCKET}/by-option"
    cairn.save({"w": torch.arange(5.0)}, url, s3=opts)
    dst = {"w": torch.empty(5)}
    cairn.load(dst, url, s3=opts)
    assert torch.equal(dst["w"], torch.arange(5.0))
    with pytest.raises(TypeError, match="unexpected s3 option 'endpoit'"):
        cairn.save({"w": torch.ones(1)}, url, s3={"endpoit": s3})
    with pytest.raises(TypeError,
                       match="s3 option 'max_attempts' does not take a str"):
        cairn.load(dst, url, s3={"max_attempts": "two"})
    with pytest.raises(ValueError, match="addressing"):
        cairn.load(dst, url, s3={"addressing": "sideways"})
