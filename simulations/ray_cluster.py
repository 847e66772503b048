"""Benchmark: one universe of gpt2-tiny replies aligned on a Ray cluster of 1 node and of 2 nodes.

Writes results/bench_ray_cluster.json. Usage:
    python -m simulations ray_cluster [--replies 32] [--repeats 3] [--iterations 2]

The replies are planted copies of one gpt2-tiny (4 layers, d 128, 4 heads, d_ff 512), each under a
random symmetry (residual rotation, head and FF permutations) plus 5 % noise, so every alignment has
work to do. Each run starts a Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and, for
2 nodes, a second raylet, each of 1 CPU), runs ``universe_merge`` with ``Scale(workers=2,
backend="ray", ray_address=...)``, and stops the cluster. On 1 node the two tasks share its one CPU (the
first takes over the second's chunk), which is the reference; on 2 nodes each node runs one. The runs
alternate, 1 node then 2, ``--repeats`` times; the figures are the medians, the ratio is of the
medians. Reported per run: the wall time of the merge (the workers' start included, the cluster's not),
how many replies each node aligned, each node's worker peak RSS (``Transform.info``), and the merge's
largest difference from the sequential path's (float64).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections import defaultdict

import torch
from _results import environment, gemm_seconds, write_results  # noqa: E402  (simulations/, the script's own folder)

from fedlmc.merging.universe import universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Scale, Universe
from fedlmc.symmetry import canonicalize, planted_copies


def replies(n: int) -> list:
    """``n`` float64 gpt2-tiny models: one base under ``n`` random group elements, plus noise each."""
    torch.manual_seed(0)
    return planted_copies(canonicalize(from_preset("gpt2-tiny").double()), n)


def one_run(models: list, nodes: int, iterations: int, reference, spool: str) -> dict:
    """The merge on a fresh cluster of ``nodes`` nodes of 1 CPU each."""
    import ray
    from ray.cluster_utils import Cluster

    temp = f"/tmp/rb-{os.getuid()}-{os.getpid()}"
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, "temp_dir": temp}
    )
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        scale = Scale(workers=2, backend="ray", ray_address=cluster.address, spool_dir=spool)
        t0 = time.perf_counter()
        merged, Ts = universe_merge(models, universe=Universe(iterations=iterations, keep_layernorm=False), scale=scale)
        wall = time.perf_counter() - t0
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    by_node, rss = defaultdict(int), defaultdict(float)
    for T in Ts:
        if "node" in T.info:
            by_node[T.info["node"]] += 1
            rss[T.info["node"]] = max(rss[T.info["node"]], T.info["worker_peak_rss_mb"])
    ref = reference.state_dict()
    diff = max(float((v - ref[k]).abs().max()) for k, v in merged.state_dict().items())
    return {
        "nodes": nodes,
        "wall_seconds": round(wall, 3),
        "replies_per_node": sorted(by_node.values(), reverse=True),
        "worker_peak_rss_mb_per_node": sorted((round(v, 1) for v in rss.values()), reverse=True),
        "max_abs_diff_vs_sequential": diff,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replies", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--spool", default="runs/ray_cluster", help="where the replies wait (every node reads it)")
    p.add_argument("--out", default="results/bench_ray_cluster.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.spool, exist_ok=True)
    models = replies(args.replies)
    t0 = time.perf_counter()
    reference, _ = universe_merge(models, universe=Universe(iterations=args.iterations, keep_layernorm=False))
    sequential = time.perf_counter() - t0
    gemm = gemm_seconds()
    runs = []
    for rep in range(args.repeats):
        for nodes in (1, 2):
            run = one_run(models, nodes, args.iterations, reference, args.spool)
            print(
                f"repeat {rep}: {nodes} node(s) {run['wall_seconds']:.1f} s, replies per node {run['replies_per_node']}"
            )
            runs.append(run)
    median = {n: statistics.median(r["wall_seconds"] for r in runs if r["nodes"] == n) for n in (1, 2)}
    write_results(
        args.out,
        {
            "replies": args.replies,
            "model": "gpt2-tiny (4 layers, d 128, 4 heads, d_ff 512), float64",
            "iterations": args.iterations,
            "workers": 2,
            "cpus_per_node": 1,
            "sequential_seconds": round(sequential, 3),
            "gemm_seconds": round(gemm, 4),
            "median_wall_seconds": {f"{n} node{'s' if n > 1 else ''}": round(v, 3) for n, v in median.items()},
            "two_nodes_over_one": round(median[2] / median[1], 3),
            "runs": runs,
            "environment": environment(),
        },
        seeds=[0],
    )


if __name__ == "__main__":
    main()
