"""The GPU check in one command (``make gpu-check``): the tests, the speed benches and the paper's own
GPT-2 setting on a CUDA device, each written as JSON under ``--out`` with the device's name.

Steps (each with its own time limit, so one slow step cannot eat the others' time):

1. ``tests``: the everyday suite (``pytest -m "not slow"``) with CUDA visible: every path that picks
   a device picks the GPU. Records passed / failed counts.
2. ``bench``: ``bench/wm_gpt2_small.py`` (a GPT-2-small pair, independent and planted) and
   ``bench/universe_scale.py`` at small M, on the GPU.
3. ``paper``: the paper's GPT-2 setting at its size (6 layers, d 256, 4 heads, d_ff 1024, block 256;
   Tiny Shakespeare, character level: no tokenizer ships offline), ``--steps`` training steps per
   seed, and the vanilla, weight-matching and learned barriers over 3 seed pairs beside the paper's
   2.02 / 0.34 / 0.02.

Usage: ``python bench/gpu_check.py [--steps 5000] [--only tests,bench,paper] [--out results/gpu]``.
Without a GPU it says so and exits 2 (on 2 CPU cores the paper step alone takes hours).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAPER = {"vanilla": 2.02, "wm-orth-factored": 0.34, "learned": 0.02}  # Theus et al., Table 1, GPT-2


def device() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "memory_gb": round(p.total_memory / 2**30, 1), "torch": torch.__version__}


def run(cmd: list[str], timeout: float) -> dict:
    """A step's command: its exit code, seconds and the tail of its output."""
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
    print(out[-2000:], flush=True)
    return {"command": " ".join(cmd), "exit": code, "seconds": round(time.time() - t0, 1), "tail": out[-4000:]}


def tests(out: Path, timeout: float) -> dict:
    res = run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-x", "-p", "no:cacheprovider"], timeout)
    counts = dict((k, int(v)) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", res["tail"]))
    return {**res, **counts}


def bench(out: Path, timeout: float) -> dict:
    py = sys.executable
    return {
        "wm_gpt2_small": run([py, "bench/wm_gpt2_small.py", "--out", str(out / "bench_wm_gpt2_small.json")], timeout),
        "universe_scale": run(
            [py, "bench/universe_scale.py", "--sizes", "8,16", "--independent-sizes", "8", "--dir", "/tmp/fedlmc-scale"]
            + ["--out", str(out / "bench_universe_scale.json")],
            timeout,
        ),
    }


def paper(out: Path, steps: int, learned_steps: int = 300) -> dict:
    """Vanilla, weight-matching and learned barriers of 3 pairs of the paper's GPT-2 (block 256)."""
    from fedlmc.commands import trained
    from fedlmc.data import load
    from fedlmc.reproduce import pair_curves, seed_pairs, summarise

    arch = {"block_size": 256}  # the paper's context; the gpt2-shakespeare preset is its 6 × 256 × 4 × 1024 model
    splits = load("shakespeare", block_size=256, seed=0)
    t0 = time.time()
    models = {
        s: trained("gpt2-shakespeare", s, splits, ROOT / "runs/cache", model_overrides=arch, steps=steps)
        for s in range(3)
    }
    train_s = time.time() - t0
    methods = list(PAPER)
    per_pair = [pair_curves(models[a], models[b], splits, methods, learned_steps) for a, b in seed_pairs(3)]
    rows = summarise(per_pair, methods)
    return {
        "setting": "gpt2: 6 layers, d 256, 4 heads, d_ff 1024, block 256; Tiny Shakespeare, characters",
        "steps": steps,
        "train_seconds": round(train_s, 1),
        "test": {s: m.meta.get("test") for s, m in models.items()},
        "barriers": {k: {"ours": rows[k]["barrier"], "paper": PAPER[k]} for k in methods},
        "rows": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="tests,bench,paper")
    p.add_argument("--steps", type=int, default=5000, help="training steps per seed of the paper's GPT-2")
    p.add_argument("--learned-steps", type=int, default=300)
    p.add_argument("--timeout", type=float, default=900, help="seconds each test or bench step may take")
    p.add_argument("--out", default="results/gpu")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing run (everything else runs on the CPU: make test)")
        return 2
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": device()}
    for step in args.only.split(","):
        print(f"gpu-check: {step} ...", flush=True)
        if step == "paper":
            res[step] = paper(out, args.steps, args.learned_steps)
        else:
            res[step] = {"tests": tests, "bench": bench}[step](out, args.timeout)
        (out / "gpu_check.json").write_text(json.dumps(res, indent=2, default=str))
    print(f"gpu-check: wrote {out / 'gpu_check.json'}")
    failed = res.get("tests", {}).get("failed", 0)
    broken = [r["command"] for r in res.get("bench", {}).values() if r["exit"] != 0]
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
