"""AsyncSaver and CheckpointManager in one process."""

import torch

import cairn


def test_async_save_holds_the_values_from_before(tmp_path):
    w = torch.arange(1 << 16, dtype=torch.float32)
    sd = {"w": w, "step": 1}
    with cairn.AsyncSaver() as saver:
        fut = saver.save(sd, tmp_path / "a")
        w.add_(1000)  # the next training step, at once
        sd["step"] = 2
        result = fut.result(timeout=120)
        assert fut.done() and fut.exception() is None
        assert result.data_bytes == w.numel() * 4
        assert fut.blocked_seconds >= 0
    back = cairn.load_all(tmp_path / "a")
    assert torch.equal(back["w"], torch.arange(1 << 16, dtype=torch.float32))
    assert back["step"] == 1


def test_async_saver_reuses_its_staging_buffers(tmp_path):
    sd = {"a": torch.ones(4096), "b": torch.zeros(128, 64)}
    with cairn.AsyncSaver() as saver:
        saver.save(sd, tmp_path / "1").result()
        allocations = saver.staging_allocations
        assert allocations > 0 and saver.staging_bytes > 0
        for i in range(2, 5):
            sd["a"].add_(1)
            saver.save(sd, tmp_path / str(i)).result()
        assert saver.staging_allocations == allocations
    assert cairn.load_all(tmp_path / "4")["a"][0].item() == 4.0


def test_async_failure_reaches_the_caller(tmp_path):
    cairn.save({"w": torch.zeros(2)}, tmp_path / "taken")
    with cairn.AsyncSaver() as saver:
        fut = saver.save({"w": torch.ones(2)}, tmp_path / "taken")
        assert isinstance(fut.exception(), cairn.AlreadyExistsError)


def test_manager_saves_retains_and_restores(tmp_path):
    root = tmp_path / "run"
    w = torch.zeros(32)
    with cairn.CheckpointManager(root, keep_last=2) as manager:
        assert manager.latest_step() is None
        for step in range(1, 5):
            w.fill_(step)
            manager.save(step, {"w": w, "step": step})
        manager.wait()
        assert manager.steps() == [3, 4]
        dst = {"w": torch.empty(32), "step": 0}
        result = manager.restore(dst)
        assert dst["step"] == 4 and torch.equal(dst["w"], torch.full((32,), 4.0))
        assert result.bytes_loaded == 32 * 4
        manager.restore(dst, step=3)
        assert dst["step"] == 3
    # A new manager (a restarted job) finds the newest step.
    with cairn.CheckpointManager(root, async_save=False) as manager:
        assert manager.latest_step() == 4


def test_manager_restore_without_checkpoint(tmp_path):
    with cairn.CheckpointManager(tmp_path / "empty") as manager:
        try:
            manager.restore({"w": torch.zeros(1)})
        except cairn.NotFoundError:
            pass
        else:
            raise AssertionError("restore of nothing must raise NotFoundError")


def test_in_process_ranks_as_threads(tmp_path):
    import threading
    world = 4
    comms = cairn.in_process(world)
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    errors = []
    read = [0] * world

    def rank(r):
        try:
            mine = full[2 * r:2 * r + 2].clone()
            cairn.save({"w": cairn.ShardedTensor([8, 6], [((2 * r, 0), mine)]),
                        "step": 9}, tmp_path / "c", comm=comms[r])
            dst = torch.zeros(8, 6)[:, r:r + 1]  # a strided column
            sd = {"w": cairn.ShardedTensor([8, 6], [((0, r), dst)]), "step": 0}
            result = cairn.load(sd, tmp_path / "c", comm=comms[r])
            assert result.world_size == world and sd["step"] == 9
            assert torch.equal(dst, full[:, r:r + 1])
            # Node reads: each row chunk read once, whole, by one rank, and
            # the columns handed out.
            dst = torch.zeros(8, 6)[:, r:r + 1]
            sd = {"w": cairn.ShardedTensor([8, 6], [((0, r), dst)]), "step": 0}
            result = cairn.load(sd, tmp_path / "c", comm=comms[r],
                                share_node_reads=True)
            assert torch.equal(dst, full[:, r:r + 1])
            read[r] = result.bytes_read
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sum(read) == full.numel() * 4  # every chunk once
    assert cairn.read_metadata(tmp_path / "c")["world_size"] == world
    try:
        cairn.in_process(0)
    except cairn.InvalidArgumentError:
        pass
    else:
        raise AssertionError("in_process(0) must raise")


def test_closed_saver_and_manager_refuse_work(tmp_path):
    import pytest
    with cairn.AsyncSaver() as saver:
        saver.save({"w": torch.zeros(2)}, tmp_path / "a")
    with pytest.raises(cairn.InvalidArgumentError, match="AsyncSaver is closed"):
        saver.save({"w": torch.zeros(2)}, tmp_path / "b")
    saver.close()  # again: nothing to do
    assert cairn.load_all(tmp_path / "a")["w"].shape == (2,)
    manager = cairn.CheckpointManager(tmp_path / "m")
    manager.close()
    with pytest.raises(cairn.InvalidArgumentError,
                       match="CheckpointManager is closed"):
        manager.steps()
