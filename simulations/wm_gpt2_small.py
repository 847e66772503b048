"""Benchmark: weight matching of a gpt2-small-shaped pair (12 layers, d 768, 12 heads, d_ff 3072).

Writes results/bench_wm_gpt2_small.json. Usage: python simulations/wm_gpt2_small.py [--layers 12] [--out FILE]
Pairs: "independent" — two independently initialised models (random weights; nothing to find, so
every assignment is a hard one: the slow case), with the default starts (the descent and the identity
candidate) or the paper start only ("independent-paper-init"); "planted" — B is A under a random group element
(residual O, head and FF permutations) plus 1 % noise, which weight matching must undo; "common" — B is A
plus 2 % Gaussian noise per tensor (a reply trained a little from the global model, the usual federated
round), matched with ``Matching(min_gain=0.1)`` (it keeps the identity).
Each run records its seconds, iterations, the objective after every iteration, the chosen elements'
objective with float32 products ("objective_exact", computed after the timed run) and a profile (where
the time went); "exact" runs the dense assignment solver and float32 products everywhere (the
reference for the fast path); "independent-float32" the default starts with float32 products
everywhere (the reference for the CPU's fast products at the same solver); "rtol-1e-3" stops on the
previous, tighter tolerance, "tol-1e-2" on a looser one (``simulations/wm_trained.py`` measures what it
costs in barrier on trained pairs). Runs with ``fedlmc.scale.allocator.retain_freed_memory`` as the ServerApp does
(``--default-allocator``: without).

``--replies N`` measures instead the gain that ``Matching.min_gain`` compares, on N replies trained a
little from A (2 % Gaussian noise per tensor, the common round of ``simulations/universe_scale.py``), with the
CPU's fast products (``precision="auto"``) and with float32 ones: per reply and precision the
identity's objective, the descent's, the gain, whether it gave up, the seconds
(results/bench_min_gain_precision.json).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _results import environment, gemm_seconds, write_results  # noqa: E402  (simulations/, the script's own folder)

from fedlmc.matching import weight_matching
from fedlmc.matching.problem import Problem, canonical_state
from fedlmc.matching.profile import profiling
from fedlmc.models import from_preset
from fedlmc.options import Matching
from fedlmc.scale.allocator import retain_freed_memory
from fedlmc.symmetry import apply_transform, canonical_config, canonicalize, random_transform, rebuild

CONFIGS = {  # name: (which B, weight_matching options)
    "independent": ("independent", {}),
    "independent-paper-init": ("independent", {"keep_identity": False}),
    "independent-paper-init-exact": (
        "independent",
        {"keep_identity": False, "ff_candidates": None, "precision": "exact"},
    ),
    "independent-float32": ("independent", {"precision": "exact"}),
    "independent-paper-init-rtol-1e-3": ("independent", {"keep_identity": False, "tol": 1e-3}),
    "independent-paper-init-tol-1e-2": ("independent", {"keep_identity": False, "tol": 1e-2}),
    "independent-tol-1e-2": ("independent", {"tol": 1e-2}),
    "planted-tol-1e-2": ("planted", {"tol": 1e-2}),
    "planted": ("planted", {}),
    "common": ("common", {"min_gain": 0.1}),
}


def relative_distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """‖θ_a − θ_b‖ / ‖θ_a‖ over all parameters."""
    sa, sb = a.state_dict(), b.state_dict()
    num = sum(float((sa[k].double() - sb[k].double()).pow(2).sum()) for k in sa)
    return (num / sum(float(sa[k].double().pow(2).sum()) for k in sa)) ** 0.5


def pair(layers: int):
    """Model A, an independent B, and a planted B with its noise level (relative distance to A's image)."""
    torch.manual_seed(0)
    a = from_preset("gpt2-small", n_layer=layers).eval()
    torch.manual_seed(1)
    b = from_preset("gpt2-small", n_layer=layers).eval()
    ca = canonicalize(a)
    planted = apply_transform(ca, random_transform(ca, seed=2, groups=["residual", "heads", "ff"], dtype=torch.float32))
    clean = {k: v.clone() for k, v in planted.state_dict().items()}
    with torch.no_grad():
        for p_ in planted.parameters():
            p_.add_(0.01 * p_.std() * torch.randn_like(p_))
    num = sum(float((planted.state_dict()[k] - clean[k]).double().pow(2).sum()) for k in clean)
    noise = (num / sum(float(v.double().pow(2).sum()) for v in clean.values())) ** 0.5
    g = torch.Generator().manual_seed(3)
    common = rebuild(
        a,
        {
            k: v + 0.02 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v
            for k, v in a.state_dict().items()
        },
    )
    return a, ca, b, planted, noise, common


def exact_objective(a, b, T) -> float:
    """The chosen elements' objective with every product in float32 (the descent's own figure uses
    bfloat16 factors where ``precision="auto"`` picks them; computed after the timed run)."""
    cpu = torch.device("cpu")
    P = Problem(
        canonical_state(a, cpu, torch.float32),
        canonical_state(b, cpu, torch.float32),
        canonical_config(b.config),
        "exact",
    )
    return P.objective({k: v.float() if v.is_floating_point() else v for k, v in T.elements.items()})


def run(a, ca, b, planted, noise: float, name: str, repeats: int = 1, common=None) -> dict:
    """One config, ``repeats`` times: the median run (by seconds), every run's seconds, and the GEMM
    reference (``_results.gemm_seconds``) timed before it."""
    which, kw = CONFIGS[name]
    other = {"planted": planted, "common": common}.get(which, b)
    gemm = gemm_seconds()
    runs = []
    for _ in range(repeats):
        with profiling() as prof:
            t0 = time.time()
            T = weight_matching(a, other, Matching(**kw))
            secs = time.time() - t0
        runs.append((secs, T, prof))
    secs, T, prof = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]
    out = {
        "options": {k: str(v) for k, v in kw.items()},
        "seconds": round(secs, 2),
        "repeats": [round(r[0], 2) for r in runs],
        "gemm_seconds": round(gemm, 3),
        "seconds_in_gemms": round(secs / gemm, 1),
        "iterations": T.info["iterations"],
        "chosen": T.info["chosen"],
        "objective": T.info["objective"],
        "trace": T.info["trace"],
        "ff_scores": T.info["ff_scores"],  # what the FF similarity scores were here ("int8", "bfloat16", "float32")
        "ff_steps": T.info.get("ff_steps"),  # layer steps settled by the certificate, and solved
        "heads_steps": T.info.get("heads_steps"),
        "profile_seconds": prof,
    }
    out["objective_exact"] = exact_objective(a, other, T)
    if which == "planted":  # recovered: A's canonical form and aligned B differ by the noise only
        out["relative_distance_after_alignment"] = relative_distance(ca, apply_transform(other, T))
        out["noise_relative_distance"] = noise
    return out


PRECISIONS = ("auto", "exact")  # --replies: the CPU's fast products, and float32 ones


def reply(a: torch.nn.Module, seed: int, noise: float) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    return rebuild(
        a,
        {
            k: v + noise * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v
            for k, v in a.state_dict().items()
        },
    )


def min_gain_precision(args: argparse.Namespace) -> None:
    """``--replies N``: the gain ``Matching(min_gain=…)`` compares on N replies trained a little from A
    (the ``common`` pair's kind, each with its own noise), at each product precision, A's side built
    once per precision as in a universe iteration (results/bench_min_gain_precision.json)."""
    retain_freed_memory()
    args.out = args.out or "results/bench_min_gain_precision.json"
    torch.manual_seed(0)
    a = from_preset("gpt2-small", n_layer=args.layers).eval()
    res = {
        "model": "gpt2-small shape",
        "layers": args.layers,
        "noise": args.noise,
        "min_gain": args.min_gain,
        **environment(),
        "gemm_seconds": [round(gemm_seconds(), 3)],
        "replies": [],
    }
    reuse = {prec: {} for prec in PRECISIONS}
    for i in range(args.replies):
        b = reply(a, 100 + i, args.noise)
        row = {"seed": 100 + i}
        for prec in PRECISIONS:
            t0 = time.perf_counter()
            T = weight_matching(a, b, Matching(min_gain=args.min_gain, precision=prec), reuse=reuse[prec])
            obj = T.info["objective"]
            row[prec] = {
                "seconds": round(time.perf_counter() - t0, 3),
                "identity": obj["identity"],
                "descent": obj["paper"],
                "gain": 1.0 - obj["paper"] / obj["identity"],
                "gave_up": "gave_up" in T.info,
                "chosen": T.info["chosen"],
                # parts whose cross-covariances were AᵀA + Aᵀ(B − A), the difference an int8 product
                "difference_products": T.info.get("difference_products", []),
            }
        res["replies"].append(row)
        print(
            f"reply {i + 1}/{args.replies}: gain "
            + ", ".join(f"{prec} {row[prec]['gain']:.5f} ({row[prec]['seconds']:.2f} s)" for prec in PRECISIONS),
            flush=True,
        )
    res["gemm_seconds"].append(round(gemm_seconds(), 3))
    rows = res["replies"]
    res["summary"] = {
        "max_gain_difference": max(abs(r["auto"]["gain"] - r["exact"]["gain"]) for r in rows),
        "max_identity_relative_difference": max(
            abs(r["auto"]["identity"] - r["exact"]["identity"]) / r["exact"]["identity"] for r in rows
        ),
        "gains": {prec: [round(r[prec]["gain"], 5) for r in rows] for prec in PRECISIONS},
        "same_choice": all(r["auto"]["chosen"] == r["exact"]["chosen"] for r in rows),
        "median_seconds": {prec: statistics.median(r[prec]["seconds"] for r in rows[1:]) for prec in PRECISIONS},
    }
    write_results(args.out, res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--out", default=None, help="default: results/bench_wm_gpt2_small.json")
    p.add_argument(
        "--replies",
        type=int,
        default=0,
        help="instead of the pairs: min_gain's gains on this many near replies at each precision",
    )
    p.add_argument("--noise", type=float, default=0.02, help="--replies: each reply's noise")
    p.add_argument("--min-gain", type=float, default=0.1, help="--replies: Matching.min_gain")
    p.add_argument(
        "--configs",
        nargs="+",
        default=["independent-paper-init", "independent", "planted", "common"],
        choices=list(CONFIGS),
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, i.e. all cores)")
    p.add_argument("--repeats", type=int, default=1, help="run each config this many times, keep the median run")
    p.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's malloc thresholds as they are (fedlmc.scale.allocator is what servers use)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.replies:
        min_gain_precision(args)
        return
    args.out = args.out or "results/bench_wm_gpt2_small.json"
    retained = False if args.default_allocator else retain_freed_memory()
    a, ca, b, planted, noise, common = pair(args.layers)
    results = {
        "model": "gpt2-small shape",
        "layers": args.layers,
        "params": sum(p.numel() for p in a.parameters()),
        **environment(),
        "retain_freed_memory": retained,
        "runs": {},
    }
    for name in args.configs:
        r = results["runs"][name] = run(a, ca, b, planted, noise, name, args.repeats, common)
        print(
            f"{name:<30s} {r['seconds']:7.1f} s  iterations {r['iterations']}  objective "
            f"{ {k: v if v is None else round(v, 4) for k, v in r['objective'].items()} }",
            flush=True,
        )
    write_results(args.out, results)


if __name__ == "__main__":
    main()
