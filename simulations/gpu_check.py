"""The GPU check in one command (``make gpu-check``): the paper's own GPT-2 setting, the tests and the
speed benches on a CUDA device, written as JSON under ``--out`` with the device's name.

Steps, in this order, inside one deadline (``--budget`` seconds; each step gets what is left):

1. ``reference``: a fixed 8192² GEMM in float32 and bfloat16 (TFLOP/s), the yardstick for the timings,
   and the error of a float32 cross-covariance against float64 at weight matching's precision.
2. ``paper``: the paper's GPT-2 setting at its size (6 layers, d 256, 4 heads, d_ff 1024, block 256;
   Tiny Shakespeare, character level: no tokenizer ships offline). Three seeds train at once, one
   process each (TF32 matrix products), for ``--steps`` steps, or fewer when a timed trial says the
   budget's share (``--train-seconds``) cannot hold them (the JSON says how many ran), evaluated on
   the validation split every 100 steps and ending with the best weights (trained to convergence
   without overfitting: 1 MB of text overfits within a few thousand steps). Meanwhile the ``tests``
   run. Then the averaging, weight-matching and learned barriers over the 3 seed pairs, beside the
   paper's 2.02 / 0.34 / 0.02.
3. ``tests``: the everyday suite (``pytest -m "not slow"``) with CUDA visible, ``tests/test_cuda.py``
   included: every path that picks a device picks the GPU. A module that cannot be collected (the
   machine lacks Flower, say) is listed, and the rest run.
4. ``bench``: ``simulations/wm_gpt2_small.py`` (GPT-2-small pairs: independent, planted, common) and
   ``simulations/universe_scale.py`` at M = 8 (common replies: FedAvg, aligned, aligned with ``min_gain``).

Usage: ``python simulations/gpu_check.py [--steps 5000] [--only reference,paper,tests,bench] [--out results/gpu]``.
Without a GPU it says so and exits 2 (on 2 CPU cores the paper step alone takes hours); ``--cpu`` runs
it there anyway (for a smoke run with tiny ``--steps``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from fedlmc import provenance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAPER = {"average": 2.02, "wm-orth-factored": 0.34, "learned": 0.02}  # Theus et al., Table 1, GPT-2
PRESET, ARCH = "gpt2-shakespeare", {"block_size": 256}  # the preset is the paper's 6 × 256 × 4 × 1024 model
SEEDS = (0, 1, 2)
# trained to convergence on the validation split: evaluated every 100 steps, the best weights kept
UNTIL = {"eval_every": 100, "keep_best": True}


def device() -> dict:
    """The device, torch, and what decides the precision of float32 products there."""
    precision = {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        **{k: os.environ[k] for k in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE") if k in os.environ},
    }
    if not torch.cuda.is_available():
        return {"name": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(), **precision}
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "memory_gb": round(p.total_memory / 2**30, 1), "torch": torch.__version__, **precision}


def product_error(k: int = 50_257, d: int = 768, device: str = "cuda") -> dict:
    """Relative error of a float32 cross-covariance ``AᵀB`` (k × d factors, GPT-2's embedding) and of
    its trace against float64, at the precision weight matching runs with: the size of the sums its
    objective subtracts (a common reply's gain is ~2 % of an objective ~1e-4 of those sums)."""
    from fedlmc.matching.problem import full_precision_products

    g = torch.Generator().manual_seed(0)
    a = torch.randn(k, d, generator=g)
    a, b = a.to(device), (a + 0.02 * torch.randn(k, d, generator=g)).to(device)
    exact = a.double().T @ b.double()
    with full_precision_products():
        c = (a.T @ b).double()
    return {
        "k": k,
        "max_relative": float((c - exact).abs().max() / exact.abs().max()),
        "trace_relative": float((c.trace() - exact.trace()).abs() / exact.trace().abs()),
    }


def gemm_reference(n: int = 8192, repeats: int = 10) -> dict:
    """TFLOP/s of an n × n × n matrix product in float32 (no TF32) and bfloat16 (mean of ``repeats``)."""
    if not torch.cuda.is_available():
        return {}
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        for _ in range(3):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            a @ b
        end.record()
        torch.cuda.synchronize()
        out[str(dtype).removeprefix("torch.")] = round(2 * n**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12, 1)
    return {"gemm_n": n, "tflops": out}


def _env() -> dict:
    """The environment of a step's process: this checkout importable (no install needed)."""
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run(cmd: list[str], timeout: float) -> dict:
    """A step's command: its exit code, seconds and the tail of its output."""
    t0 = time.time()
    env = _env()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, timeout), env=env)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code = "timeout"
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
    print(out[-3000:], flush=True)
    return {"command": " ".join(cmd), "exit": code, "seconds": round(time.time() - t0, 1), "tail": out[-6000:]}


# ---- tests ------------------------------------------------------------------------------------------


def start_tests(workers: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider"]
    cmd += ["--continue-on-collection-errors", "-rA", "-n", str(workers), "--dist", "worksteal"]
    env = _env()
    env["OMP_NUM_THREADS"] = "2"  # each worker's torch threads, beside the other workers and the training
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish_tests(proc: subprocess.Popen, t0: float, timeout: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, code = proc.communicate()[0], "timeout"
    print(out[-3000:], flush=True)
    summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed).* in [\d.]+s", line)]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", (summary or [""])[-1])}
    return {
        "command": " ".join(proc.args),
        "exit": code,
        "seconds": round(time.time() - t0, 1),
        **counts,
        "not_collected": sorted(set(re.findall(r"^ERROR (tests/[\w/]+\.py)(?:\s|$)", out, re.M))),
        "failed_tests": sorted(set(re.findall(r"^FAILED (\S+)", out, re.M))),
        "cuda_tests": sorted(set(re.findall(r"^(\w+) tests/(test_cuda\.py::\S+)", out, re.M))),
        "tail": out[-6000:],
    }


# ---- the paper's GPT-2 ------------------------------------------------------------------------------


def _splits():
    from fedlmc.data import load

    return load("shakespeare", block_size=ARCH["block_size"], seed=0)


def train_one(seed: int, steps: int) -> None:
    """One seed of the paper's GPT-2 (run in its own process by ``paper``): trained into the cache."""
    from fedlmc.commands import trained

    torch.set_float32_matmul_precision("high")  # TF32 matrix products, as GPU training usually runs
    m = trained(
        PRESET, seed, _splits(), ROOT / "runs/cache", progress=False, model_overrides=ARCH, steps=steps, **UNTIL
    )
    meta = {k: m.meta.get(k) for k in ("test", "best", "seconds")}
    print(json.dumps({"seed": seed, "steps": steps, **meta}))


def step_seconds(splits, trial: int = 40) -> float:
    """Seconds per training step of one model on this device (after a warm-up), TF32 as in training."""
    from fedlmc.train import TrainConfig, model_for_data, train

    was = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    model = model_for_data(PRESET, splits, 99, **ARCH)
    train(model, splits.train, TrainConfig(steps=10, batch_size=64), progress=False)  # warm-up
    hist = train(model, splits.train, TrainConfig(steps=trial, batch_size=64), progress=False)
    torch.set_float32_matmul_precision(was)
    return hist["seconds"] / trial


def train_seeds(steps: int) -> tuple[list[subprocess.Popen], float]:
    env = _env()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--train-seed", str(s), "--steps", str(steps)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for s in SEEDS
    ]
    return procs, time.time()


def barriers(steps: int, learned_steps: int, trained: dict) -> dict:
    """Averaging, weight-matching and learned barriers of the 3 seed pairs (curves evaluated on the GPU)."""
    from fedlmc.commands import trained as load_trained
    from fedlmc.reproduce import pair_curves, seed_pairs, summarise

    splits = _splits()
    models = {s: load_trained(PRESET, s, splits, ROOT / "runs/cache", False, ARCH, steps=steps, **UNTIL) for s in SEEDS}
    methods = list(PAPER)
    t0 = time.time()
    per_pair = [pair_curves(models[a], models[b], splits, methods, learned_steps) for a, b in seed_pairs(3)]
    rows = summarise(per_pair, methods)
    return {
        "setting": "gpt2: 6 layers, d 256, 4 heads, d_ff 1024, block 256; Tiny Shakespeare, characters",
        "steps": steps,
        "learned_steps": learned_steps,
        "trained": trained,
        "test": {s: m.meta.get("test") for s, m in models.items()},
        "best_validation": {s: m.meta.get("best") for s, m in models.items()},
        "barrier_seconds": round(time.time() - t0, 1),
        "barriers": {
            k: {"ours": rows[k]["barrier_mean"], "se": rows[k]["barrier_se"], "paper": PAPER[k]} for k in methods
        },
        "per_pair": [{k: p[k]["barrier"] for k in methods} for p in per_pair],
        "rows": rows,
    }


# ---- main -------------------------------------------------------------------------------------------


def main() -> int:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="reference,paper,tests,bench")
    p.add_argument("--steps", type=int, default=5000, help="training steps per seed of the paper's GPT-2 (at most)")
    p.add_argument("--train-seconds", type=float, default=150, help="the training's share of the budget")
    p.add_argument("--learned-steps", type=int, default=300)
    p.add_argument("--budget", type=float, default=1800, help="seconds the whole check may take")
    p.add_argument("--test-workers", type=int, default=6)
    p.add_argument("--out", default="results/gpu")
    p.add_argument("--cpu", action="store_true", help="run without a GPU too (a smoke run: give tiny --steps)")
    p.add_argument("--train-seed", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train_seed is not None:
        train_one(args.train_seed, args.steps)
        return 0
    if not torch.cuda.is_available() and not args.cpu:
        print("gpu-check: no CUDA device here; nothing run (everything else runs on the CPU: make test)")
        return 2
    deadline = time.time() + args.budget
    left = lambda: deadline - time.time()  # noqa: E731
    steps_wanted = set(args.only.split(","))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": device(), "budget_s": args.budget}

    def write() -> None:
        provenance.write(out / "gpu_check.json", json.loads(json.dumps(res, default=str)))

    if "reference" in steps_wanted:
        res["reference"] = (
            {**gemm_reference(), "float32_product_error": product_error()} if torch.cuda.is_available() else {}
        )
        print(f"gpu-check: reference {res['reference']}", flush=True)
        write()
    tests_proc = None
    if "paper" in steps_wanted:
        splits = _splits()
        per_step = step_seconds(splits)
        # three processes share the GPU: assume each step costs twice the one-model trial
        steps = min(args.steps, max(50, int(args.train_seconds / (2 * per_step))))
        print(f"gpu-check: paper: {per_step * 1e3:.1f} ms a step alone; training 3 seeds × {steps} steps", flush=True)
        procs, t0 = train_seeds(steps)
        if "tests" in steps_wanted:
            tests_proc, tests_t0 = start_tests(args.test_workers), time.time()
        trained = {"step_ms_alone": round(per_step * 1e3, 2), "steps": steps, "seeds": {}}
        for s, proc in zip(SEEDS, procs):
            try:
                text, _ = proc.communicate(timeout=max(1.0, left() - 240))
            except subprocess.TimeoutExpired:
                proc.kill()
                text = proc.communicate()[0]
            print(text[-1500:], flush=True)
            lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
            trained["seeds"][s] = lines[-1] if lines else {"exit": proc.returncode, "tail": text[-3000:]}
        trained["wall_seconds"] = round(time.time() - t0, 1)
        res["paper"] = {"trained": trained}
        write()
        try:
            failed_seeds = [s for s, r in trained["seeds"].items() if "test" not in r]
            if failed_seeds:  # not retrained here: that would take the rest of the budget
                raise RuntimeError(f"seeds {failed_seeds} did not finish training")
            res["paper"] = barriers(steps, args.learned_steps, trained)
        except Exception:  # the rest of the check still runs; the JSON says what broke
            res["paper"]["error"] = traceback.format_exc()
            print(res["paper"]["error"], flush=True)
        print(f"gpu-check: paper {json.dumps(res['paper'].get('barriers'))}", flush=True)
        write()
    if "tests" in steps_wanted:
        if tests_proc is None:
            tests_proc, tests_t0 = start_tests(args.test_workers), time.time()
        res["tests"] = finish_tests(tests_proc, tests_t0, left() - 150)
        write()
    if "bench" in steps_wanted:
        py = sys.executable
        res["bench"] = {
            "wm_gpt2_small": run(
                [py, "simulations/wm_gpt2_small.py", "--configs", "independent", "planted", "common"]
                + ["--out", str(out / "bench_wm_gpt2_small.json")],
                (left() - 30) / 2,
            )
        }
        write()
        plan = "8:common:fedavg,8:common:aligned,8:common:aligned+min-gain"
        replies = tempfile.mkdtemp(prefix="fedlmc-scale-")  # 8 replies of 0.65 GB, removed after
        try:
            res["bench"]["universe_scale"] = run(
                [py, "simulations/universe_scale.py", "--plan", plan, "--dir", replies, "--timeout", "300"]
                + ["--out", str(out / "bench_universe_scale.json")],
                left() - 10,
            )
        finally:
            shutil.rmtree(replies, ignore_errors=True)
        write()
    print(f"gpu-check: wrote {out / 'gpu_check.json'}")
    failed = res.get("tests", {}).get("failed", 0)
    broken = [r["command"] for r in res.get("bench", {}).values() if r["exit"] != 0]
    return 1 if failed or broken or "error" in res.get("paper", {}) else 0


if __name__ == "__main__":
    sys.exit(main())
