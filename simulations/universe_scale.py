"""Benchmark: the server's aggregation as the federation grows: M = 8 … 64 GPT-2-small-shaped replies.

Writes results/bench_universe_scale.{json,png}. Usage:
    python simulations/universe_scale.py [--sizes 8,16,32,64] [--independent-sizes 8,16,32] [--layers 12]

Replies (163M parameters, 0.65 GB each in float32) are written once per kind to ``--dir`` and every
strategy reads the same files, memory-mapped (``fedlmc.scale.replies``):

* ``common``: the usual federated round. A global model G; every client trained a little from it:
  G + δ_m, δ_m Gaussian with 2 % of each tensor's standard deviation. The universe starts from G
  (as ``AlignedFedAvg`` does for replies trained from the global model).
* ``independent``: clients that started apart (one-shot fusion). Every reply is π_m(G + ξ_m): ξ_m a
  fresh random initialisation of the architecture (as large as G itself, so after alignment two
  replies still differ by about their own norm, as independently trained models do), under a random
  symmetry π_m (residual rotation, head and FF permutations). The universe starts from a reply.

Strategies on the same replies: ``fedavg`` (the weighted mean streamed over the files: FedAvg's
memory of about one model, its time the reference), ``aligned`` (``universe_merge`` in the server's
process, one reply at a time, 3 iterations, torch's threads: every core), ``aligned-1thread`` (the
same on one torch thread, the ServerApp's default ``threads = 1``) and ``aligned-parallel`` (the same
with ``Scale(workers=0)``: one worker process per core, each on cores / workers threads). A
``+min-gain`` suffix matches with ``Matching(min_gain=0.1)`` (a reply keeps the identity unless its
alignment removes more than 10 % of its distance to the universe); ``+once`` runs one universe
iteration (e.g. ``--plan 64:common:aligned-parallel+min-gain+once``); ``+float32`` keeps every
product of weight matching in float32 (``Matching(precision="exact")``, the reference for the CPU's
fast products: bfloat16 factors, or int8 FF scores); ``+bfloat16`` takes bfloat16 products everywhere
(``Matching(precision="bfloat16")``: without the difference form ``AᵀA + Aᵀ(B − A)`` that
``precision="auto"`` takes for replies near the universe); ``+from-mean`` starts the common replies' universe
at their plain mean instead of G (``Universe(start="average")``), streamed from the files; ``+at-arrival``
starts it at the mean summed as the replies arrive (``universe.ArrivingMean``, what the strategy does
with replies on disk): each reply is read once, canonicalised and added before the round's clock starts,
and that work is reported apart (``arrival_seconds``: a stand-in for the reply coming off the network,
its file read from disk, plus the sum); ``+no-give-up`` (in-process strategies only) runs every
descent to its end under ``min_gain`` instead of stopping once it is settled far from the gain it
needs (the reference for that rule). Each run is
its own process; the peak resident memory of the server process and of its whole process tree
(workers included) is sampled every 50 ms, and a fixed float32 GEMM is timed in the same process as
a reference for a busy machine.
``--ray-address`` adds ``aligned-ray`` runs (the same tasks on a Ray cluster) at the smallest M.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from _results import PeakMemory, environment, gemm_seconds, write_results  # noqa: E402  (simulations/, the script's own folder)

from fedlmc.matching.profile import profiling
from fedlmc.merging.averaging import streamed_mean
from fedlmc.merging.universe import ArrivingMean, universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Matching, Scale, Universe
from fedlmc.scale.allocator import release_freed_memory, retain_freed_memory
from fedlmc.scale.replies import read_ahead, save_model, stored
from fedlmc.symmetry import apply_transform, canonical, random_transform, rebuild

STRATEGIES = ("fedavg", "aligned", "aligned-parallel")
MIN_GAIN = 0.1  # "+min-gain" strategies: Matching(min_gain=MIN_GAIN)


def _model(layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return from_preset("gpt2-small", n_layer=layers).eval()


def make_replies(kind: str, count: int, layers: int, folder: Path) -> list[str]:
    """Write ``count`` replies of ``kind`` (and the global model, ``global.safetensors``) to ``folder``
    once; later calls reuse the files."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"reply-{m:03d}.safetensors" for m in range(count)]
    G_path = folder / "global.safetensors"
    if not G_path.exists():
        save_model(G_path, _model(layers, 0))
    G = stored(G_path).load()
    for m, path in enumerate(paths):
        if path.exists():
            continue
        g = torch.Generator().manual_seed(1000 + m)
        if kind == "common":
            sd = {
                k: v + 0.02 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v.clone()
                for k, v in G.state_dict().items()
            }
            save_model(path, rebuild(G, sd))
        else:
            xi = _model(layers, 1000 + m).state_dict()
            sd = {k: v + xi[k] for k, v in G.state_dict().items()}
            own = rebuild(G, sd)
            pi = random_transform(canonical(own), seed=m, groups=["residual", "heads", "ff"], dtype=torch.float32)
            save_model(path, apply_transform(canonical(own), pi))
        print(f"  {kind} reply {m + 1}/{count} written", flush=True)
    return [str(p) for p in paths]


def streamed_fedavg(paths: list[str]) -> torch.nn.Module:
    """FedAvg over files: a running weighted sum, one reply at a time (the next file read ahead, as the
    universe's passes read theirs)."""

    replies = read_ahead([stored(p) for p in paths], lambda reply: reply)
    return streamed_mean((reply.load() for reply in replies), [1.0 / len(paths)] * len(paths))


def one_run(args: argparse.Namespace) -> dict:
    """One (M, kind, strategy) in this process: seconds, peaks, the GEMM reference."""
    retain_freed_memory()
    folder = Path(args.dir) / args.kind
    paths = sorted(str(p) for p in folder.glob("reply-*.safetensors"))[: args.models]
    replies = [stored(p) for p in paths]
    start = stored(folder / "global.safetensors").load() if args.kind == "common" else None
    gemm = gemm_seconds()
    release_freed_memory()
    arrival_seconds = None
    with PeakMemory(every=0.05) as mem, profiling() as prof:
        t0 = time.perf_counter()
        if args.strategy == "fedavg":
            streamed_fedavg(paths)
            its = identity = iterations = gave_up = taken_over = None
            matched = read = []
            threads_used = {}
        else:
            # "aligned-parallel+min-gain": Matching(min_gain=MIN_GAIN); "+once": one universe iteration;
            # "+float32": float32 products everywhere
            base, *flags = args.strategy.split("+")
            if base == "aligned-1thread":  # the ServerApp's default (run_config threads = 1)
                torch.set_num_threads(1)
            gain, iterations = "min-gain" in flags, 1 if "once" in flags else args.iterations
            scale = {
                "aligned": Scale(spool=True),
                "aligned-1thread": Scale(spool=True),
                "aligned-parallel": Scale(workers=0, backend="process"),
                "aligned-ray": Scale(workers=0, backend="ray", ray_address=args.ray_address),
            }[base]
            # "+bfloat16": bfloat16 products everywhere, without the difference form of near replies
            precision = "exact" if "float32" in flags else "bfloat16" if "bfloat16" in flags else "auto"
            matching = Matching(min_gain=MIN_GAIN if gain else 0.0, precision=precision)
            # common replies are LayerNorm models (kept so, as AlignedFedAvg does); independent ones were
            # written in canonical form under a random rotation of the residual stream
            keep = args.kind == "common"
            if "no-give-up" in flags:  # the descent run to its end under min_gain (the reference for give_up)
                if base not in ("aligned", "aligned-1thread"):
                    raise SystemExit("+no-give-up patches this process's weight matching: in-process strategies only")
                import fedlmc.matching.weight as weight_module

                descent = weight_module.coordinate_descent
                weight_module.coordinate_descent = lambda P, el, give_up=None, **kw: descent(P, el, **kw)
            if "from-mean" in flags:  # the replies' plain mean instead of G (Universe(start="average"))
                start = "average"
            if "at-arrival" in flags:  # that mean summed as the replies arrive: not on the round's clock
                t_arrival = time.perf_counter()
                arriving, w = ArrivingMean(), 1.0 / len(replies)
                for r in replies:
                    arriving.add(r.path, r.load(), w)
                start = arriving.model_for({r.path: w for r in replies})
                arrival_seconds = time.perf_counter() - t_arrival
                t0 += arrival_seconds
            _, Ts = universe_merge(
                replies,
                start=start,
                scale=scale,
                matching=matching,
                universe=Universe(iterations=iterations, keep_layernorm=keep),
            )
            its = max(T.info.get("universe_iterations", 0) for T in Ts)
            excluded = [T.info["excluded"] for T in Ts if "excluded" in T.info]
            assert not excluded, excluded
            identity = sum(not T.elements for T in Ts)
            gave_up = sum("gave_up" in T.info for T in Ts)  # descents stopped far below min_gain's gain
            taken_over = sum("taken_over" in T.info for T in Ts)  # aligned by a worker done with its own chunk
            matched = sorted(T.info["seconds"] for T in Ts if "seconds" in T.info)  # each last weight matching
            read = sorted(T.info["read_seconds"] for T in Ts if "read_seconds" in T.info)  # in a worker
            # the torch threads each reply's last matching ran with (``cpu.fitting_threads``), counted
            threads_used = dict(sorted(Counter(str(T.info["threads"]) for T in Ts if "threads" in T.info).items()))
        secs = time.perf_counter() - t0
    model_gb = os.path.getsize(paths[0]) / 1e9
    return {
        "M": args.models,
        "kind": args.kind,
        "strategy": args.strategy,
        "seconds": round(secs, 2),
        "seconds_per_reply": round(secs / args.models, 3),
        "arrival_seconds": None if arrival_seconds is None else round(arrival_seconds, 2),
        "universe_iterations": its,
        "max_iterations": None if args.strategy == "fedavg" else iterations,
        "identity_kept": identity,  # replies whose final transform is the identity (min_gain)
        "gave_up": gave_up,
        "taken_over": taken_over,  # replies a worker took over from another's chunk (workers only)
        # one reply's last weight matching, in the process that ran it (median over the replies; a worker's
        # first reply of an iteration also builds what matching computes from the universe alone)
        "matching_seconds_median": round(matched[len(matched) // 2], 2) if matched else None,
        # a reply read from its file and put in canonical form by a worker (median; workers only)
        "read_seconds_median": round(read[len(read) // 2], 2) if read else None,
        "seconds_per_reply_iteration": round(secs / args.models / its, 3) if its else None,
        "peak_rss_gb": round(mem.peak / 1e9, 2),
        "peak_rss_tree_gb": round(mem.tree / 1e9, 2),
        "model_gb": round(model_gb, 3),
        "peak_rss_in_models": round(mem.peak / 1e9 / model_gb, 1),
        "gemm_seconds": round(gemm, 3),
        "threads": torch.get_num_threads(),
        "alignment_threads": threads_used,  # {threads: replies whose last matching ran with that many}
        "load_average": os.getloadavg()[0],
        # where the server process's time went (``fedlmc.matching.profile`` sections, nested; a worker's
        # own sections stay in its process)
        "profile_seconds": prof,
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (kind, strategy), style in [
        (("common", "fedavg"), "k:"),
        (("common", "aligned"), "C0-"),
        (("common", "aligned-parallel"), "C0--"),
        (("independent", "fedavg"), "C7:"),
        (("independent", "aligned"), "C3-"),
        (("independent", "aligned-parallel"), "C3--"),
        (("common", "aligned-parallel+min-gain"), "C2-."),
        (("independent", "aligned-parallel+min-gain"), "C1-."),
        (("common", "aligned-parallel+min-gain+from-mean"), "C4-."),
        (("common", "aligned-parallel+min-gain+at-arrival"), "C5-."),
        (("common", "aligned+min-gain+at-arrival"), "C5:"),
        (("common", "aligned-1thread+min-gain+at-arrival"), "C6:"),
    ]:
        runs = sorted((r for r in res["runs"] if r["kind"] == kind and r["strategy"] == strategy), key=lambda r: r["M"])
        if not runs:
            continue
        Ms = [r["M"] for r in runs]
        axes[0].plot(Ms, [r["seconds"] for r in runs], style, marker="o", label=f"{strategy} ({kind})")
        axes[1].plot(Ms, [r["peak_rss_gb"] for r in runs], style, marker="o", label=f"{strategy} ({kind})")
    model_gb = res["runs"][0]["model_gb"] if res["runs"] else 0.65
    Ms = sorted({r["M"] for r in res["runs"]})
    axes[1].plot(Ms, [(m + 4) * model_gb for m in Ms], color="0.7", lw=1, label="holding every reply (M + 4 models)")
    axes[1].axhline(6 * model_gb, color="C2", lw=1, label="target: 6 models")
    axes[0].axhline(180, color="C2", lw=1, label="target: 3 min (common, M = 64)")
    for ax, ylabel in zip(axes, ("seconds per round", "server peak RSS (GB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ms, [str(m) for m in Ms])
        ax.set_xlabel("replies M (GPT-2-small shape)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle("Aggregation of M GPT-2-small replies on 2 CPU cores: aligned (memory-mapped replies) vs FedAvg")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(res: dict) -> str:
    """The results as a markdown table (``--table``): one row per M and kind, a column per strategy."""
    strategies = [
        s
        for s in (
            "fedavg",
            "aligned",
            "aligned-1thread",
            "aligned-parallel",
            "aligned-ray",
            "aligned+min-gain",
            "aligned-parallel+min-gain",
            "aligned-parallel+min-gain+once",
            "aligned+min-gain+float32",
            "aligned-parallel+min-gain+float32",
            "aligned+min-gain+from-mean",
            "aligned-parallel+min-gain+from-mean",
            "aligned+min-gain+at-arrival",
            "aligned-1thread+min-gain+at-arrival",
            "aligned-parallel+min-gain+at-arrival",
            "aligned-parallel+min-gain+at-arrival+bfloat16",
        )
        if any(r["strategy"] == s for r in res["runs"])
    ]
    by = {(r["M"], r["kind"], r["strategy"]): r for r in res["runs"]}
    head = ["kind", "M"] + [f"{s}: s (per reply-iteration) / peak GB" for s in strategies] + ["GEMM ref. s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in ("common", "independent"):
        for M in sorted({m for m, k, _ in by if k == kind}):
            cells = [kind, str(M)]
            for s in strategies:
                r = by.get((M, kind, s))
                if r is None:
                    cells.append("")
                    continue
                per = f" ({r['seconds_per_reply_iteration']:.2f})" if r.get("seconds_per_reply_iteration") else ""
                tree = f", tree {r['peak_rss_tree_gb']:.1f}" if r["peak_rss_tree_gb"] > r["peak_rss_gb"] + 0.05 else ""
                arrival = f" + {r['arrival_seconds']:.0f} at arrival" if r.get("arrival_seconds") else ""
                cells.append(f"{r['seconds']:.1f}{per}{arrival} / {r['peak_rss_gb']:.2f}{tree}")
            refs = [by[(M, kind, s)]["gemm_seconds"] for s in strategies if (M, kind, s) in by]
            cells.append(f"{min(refs):.2f}–{max(refs):.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,16,32,64", help="M for the common kind")
    p.add_argument("--independent-sizes", default="8,16,32", help="M for the independent kind")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--plan", help="explicit runs instead: M:kind:strategy,... (e.g. 64:common:aligned-parallel)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--dir", default="runs/universe_scale", help="where the replies are written (M × 0.65 GB)")
    p.add_argument("--ray-address", default=None, help="also run aligned-ray on this Ray cluster at the smallest M")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    p.add_argument("--repeats", type=int, default=1, help="run each job this many times and keep the median run")
    p.add_argument("--out", default="results/bench_universe_scale.json")
    p.add_argument(
        "--table",
        action="store_true",
        help="summarise the results file, redraw its plot, print its markdown table, stop",
    )
    p.add_argument("--one", nargs=3, metavar=("M", "KIND", "STRATEGY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        args.models, args.kind, args.strategy = int(args.one[0]), args.one[1], args.one[2]
        print("RESULT " + json.dumps(one_run(args)), flush=True)
        return
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {"runs": []}
    if args.table:  # the summary recomputed from the runs, the file rewritten, the table printed
        summarise(res)
        out.write_text(json.dumps(res, indent=2))
        plot(res, out.with_suffix(".png"))
        print(table(res))
        return
    res.update(environment())
    res["replies"] = {
        "common": "G + 2 % Gaussian per tensor (trained a little from the global model); universe starts from G",
        "independent": "π_m(G + ξ_m), ξ_m a fresh random init, π_m a random symmetry; universe starts from a reply",
    }
    plan = [("common", int(m)) for m in args.sizes.split(",") if m] + [
        ("independent", int(m)) for m in args.independent_sizes.split(",") if m
    ]
    jobs = [(m, kind, s) for kind, m in plan for s in args.strategies.split(",")]
    if args.plan:
        jobs = [(int(m), kind, s) for m, kind, s in (x.split(":") for x in args.plan.split(","))]
        plan = [(kind, m) for m, kind, _ in jobs]
    if args.ray_address and not any(s == "aligned-ray" for *_, s in jobs):
        jobs.append((min(m for _, m in plan), "common", "aligned-ray"))
    for kind in {k for k, _ in plan}:  # the replies the runs read, written once
        make_replies(kind, max(m for k, m in plan if k == kind), args.layers, Path(args.dir) / kind)
    for m, kind, strategy in jobs:
        cmd = [sys.executable, __file__, "--one", str(m), kind, strategy, "--dir", args.dir]
        cmd += ["--iterations", str(args.iterations)] + (
            ["--ray-address", args.ray_address] if args.ray_address else []
        )
        print(f"M={m} {kind} {strategy} ...", flush=True)
        repeats = []
        for _ in range(args.repeats):
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"  timed out after {args.timeout:.0f} s")
                continue
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                continue
            repeats.append(json.loads(line[len("RESULT ") :]))
            r = repeats[-1]
            print(f"  {r['seconds']} s, peak RSS {r['peak_rss_gb']} GB (tree {r['peak_rss_tree_gb']} GB)", flush=True)
        if not repeats:
            continue
        run = sorted(repeats, key=lambda r: r["seconds"])[(len(repeats) - 1) // 2]  # the median run
        if len(repeats) > 1:
            run = {**run, "repeats": [{k: r[k] for k in ("seconds", "gemm_seconds", "peak_rss_gb")} for r in repeats]}
        res["runs"] = [r for r in res["runs"] if (r["M"], r["kind"], r["strategy"]) != (m, kind, strategy)] + [run]
        summarise(res)
        write_results(out, res)
        plot(res, out.with_suffix(".png"))


def summarise(res: dict) -> None:
    """``parallel_speedup`` (sequential ÷ parallel seconds at the largest M run both ways; ``_over_1thread``:
    against the sequential path on one torch thread), each aligned run's time as a multiple of FedAvg's
    on the same replies, and ``fits``: each strategy's round as fixed seconds plus seconds per reply."""
    by = {(r["M"], r["kind"], r["strategy"]): r for r in res["runs"]}
    for r in res["runs"]:
        ref = by.get((r["M"], r["kind"], "fedavg"))
        r["fedavg_ratio"] = round(r["seconds"] / ref["seconds"], 1) if ref and r["strategy"] != "fedavg" else None
    for seq_name, par_name, key in (
        ("aligned", "aligned-parallel", "parallel_speedup"),
        ("aligned-1thread", "aligned-parallel", "parallel_speedup_over_1thread"),
        ("aligned+min-gain", "aligned-parallel+min-gain", "parallel_speedup_min_gain"),
        ("aligned+min-gain+at-arrival", "aligned-parallel+min-gain+at-arrival", "parallel_speedup_at_arrival"),
        (
            "aligned-1thread+min-gain+at-arrival",
            "aligned-parallel+min-gain+at-arrival",
            "parallel_speedup_at_arrival_over_1thread",
        ),
    ):
        both = [k for k in by if k[2] == seq_name and (k[0], k[1], par_name) in by]
        if both:
            M, kind, _ = max(both)
            res[key] = round(by[(M, kind, seq_name)]["seconds"] / by[(M, kind, par_name)]["seconds"], 2)
            res[key + "_at"] = {"M": M, "kind": kind}
    # an aligned round's seconds as a fixed part plus a part per reply: the least-squares line through
    # every M a (kind, strategy) ran at, where it ran at three or more (not FedAvg's: its replies come
    # from the page cache up to M = 32 and from disk at 64, so its seconds are no line)
    fits = {}
    for kind, strategy in sorted({(k, s) for _, k, s in by if s != "fedavg"}):
        pts = sorted((m, by[(m, kind, strategy)]["seconds"]) for m, k, s in by if (k, s) == (kind, strategy))
        if len(pts) >= 3:
            slope, fixed = np.polyfit([m for m, _ in pts], [y for _, y in pts], 1)
            fits[f"{kind}:{strategy}"] = {
                "seconds_per_reply": round(float(slope), 3),
                "fixed_seconds": round(float(fixed), 2),
                "M": [m for m, _ in pts],
            }
    if fits:
        res["fits"] = fits


if __name__ == "__main__":
    main()
