"""The lab, one entry point: the comparison runner, the benches, the verification of the results files.

    python -m simulations                    # list the entries: what each measures, how long, what it writes
    python -m simulations NAME [OPTIONS...]  # run simulations/NAME.py with its own options (NAME --help)
    python -m simulations verify [--quick]   # rerun the cheap results files' figures and compare them

``python -m simulations.tables`` then regenerates the docs' tables from the files they write. Every entry
writes its results file through ``fedlmc.provenance`` (the record of how it was made). The library never
imports this folder, and the wheel does not ship it.
"""

from __future__ import annotations

import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Bench:
    what: str
    writes: str
    about: str


BENCHES: dict[str, Bench] = {
    "compare": Bench(
        "the comparison runner: registered strategies side by side in Flower simulations on the same seeds and "
        "partitions, one setting at a time (`--setting`, `--strategies`, `--set KEY=VALUE`)",
        "`results/compare_<setting>_<preset>.{json,png}`",
        "5 min – 3 h a setting",
    ),
    "screen": Bench(
        "the screens against poisoned replies: each screen and robust reduction on the same federations",
        "`results/screen_<setting>.json`",
        "20–60 min",
    ),
    "main_job": Bench(
        "the main job (`make run`) on seeds 0, 1, 2: each strategy's test loss on the same replies; fails unless "
        "aligned beats FedAvg by 0.25 on each",
        "`results/main_job.{json,png}`",
        "6 min",
    ),
    "wm_gpt2_small": Bench(
        "weight matching of a gpt2-small-shaped pair: independent, planted, a reply trained a little from A; "
        "`--repeats 3` keeps the median beside a GEMM reference, with a profile per section; `--replies 8`: "
        "`min_gain`'s gains on near replies with the fast products and with float32 ones",
        "`results/bench_wm_gpt2_small.json` (`--out` for the profile and the looser stops), "
        "`results/bench_min_gain_precision.json`",
        "8 min",
    ),
    "wm_trained": Bench(
        "weight matching on independently trained gpt2-tiny pairs (`--width` for wider): the barrier after "
        "k iterations and at each `Matching.descent_tol`, or at each product precision (`--precisions`)",
        "`results/bench_wm_stopping_gpt2-tiny{,_w256}.json`, `results/bench_precision_quality_gpt2-tiny.json`",
        "15–50 min",
    ),
    "ff_scale_overhead": Bench(
        "weight matching of a GELU pair (no FF-scale group) with and without `Matching.ff_scale`, and against "
        "another checkout (`--against DIR`) in the same run: medians of 3 and their ratios",
        "`results/bench_ff_scale_overhead_gpt2-tiny.json`",
        "10 min",
    ),
    "universe_gpt2_small": Bench(
        "a universe of 8 planted gpt2-small-shaped copies: seconds, peak memory",
        "`results/bench_universe_gpt2_small.json`",
        "3 min",
    ),
    "universe_scale": Bench(
        "aggregation of M = 8 … 64 GPT-2-small-shaped replies on disk: in the server, in worker processes, "
        "FedAvg; seconds and peak memory against M (`--plan` picks the runs)",
        "`results/bench_universe_scale*.json`",
        "1 h",
    ),
    "mixed_depths": Bench(
        "one-shot merges of a 4-layer and a 6-layer client against two 6-layer ones (layer matching, zero "
        "padding, prefix placement, every placement), 3 seed triples",
        "`results/mixed_depths_<preset>.json`",
        "15 min",
    ),
    "ray_cluster": Bench(
        "one universe of 32 gpt2-tiny replies aligned on a Ray cluster (`ray.cluster_utils.Cluster`) of 1 node "
        "and of 2 nodes of 1 CPU each: wall time, replies and worker peak RSS per node, medians of 3",
        "`results/bench_ray_cluster.json`",
        "5 min",
    ),
    "dp_spool": Bench(
        "peak server memory of a `Scale(spool=True)` round under its own `start` and inside Flower's client- "
        "and server-side DP wrappers, against replies in memory",
        "`results/bench_dp_spool.json`",
        "5 min",
    ),
    "busy_host": Bench(
        "an independent gpt2-small pair and an 8-model universe idle and beside 2 and 4 CPU-bound processes",
        "`results/bench_load.json`",
        "30 min",
    ),
    "refine": Bench(
        "Dirichlet refinement as a federation runs it: one refinement's seconds (`step`), each round's "
        "aggregate five ways (`rounds`), the aggregation's share of a simulated round (`share`)",
        "`results/bench_refine_gpt2_tiny.json`, `results/bench_refine_rounds_gpt2-tiny.json`, "
        "`results/bench_round_share_gpt2-tiny.json`",
        "3–15 min",
    ),
    "load_clients": Bench(
        "a simulation of 20 clients: peak memory of every process, seconds per round",
        "`results/bench_load_20_clients.json`",
        "10 min",
    ),
    "deploy_gpt2_small": Bench(
        "a real deployment round (SuperLink, 2 SuperNodes) with 622 MB messages; `--superlink flower`, `--burners N`",
        "`results/deploy_gpt2_small_<database>[_flower][_loadN].json`",
        "5 min",
    ),
    "deploy_gpt2_small_persistent": Bench(
        "the restart story at GPT-2-small size (TLS, node auth, sqlite state): SuperLink killed in round 2, "
        "restarted, resumed",
        "`results/deploy_gpt2_small_persistent.json`",
        "30 min",
    ),
    "hf_pairs": Bench(
        "pairwise barriers of two trained Hugging Face GPT-2 / ViT / Llama models",
        "`results/bench_hf_pair_{gpt2,vit,llama}*.json`",
        "30–60 min",
    ),
    "learned_budget": Bench(
        "barrier against learned-matching steps and one-epoch recipes",
        "`results/learned_budget_*.json`",
        "1–3 h",
    ),
    "width_study": Bench(
        "barriers of one trained pair per width (d = 32 … 256)",
        "`results/width_study_{vit,gpt2}.json`",
        "10 min – 3 h",
    ),
    "universe_variants": Bench(
        "every universe / refinement variant on the same 4 trained models",
        "`results/universe_variants_*.json`",
        "1 h",
    ),
    "lora_aggregators": Bench(
        "PEFT LoRA federations: FedIT, FFA-LoRA, FedSA-LoRA, FLoRA, FlexLoRA, FedEx-LoRA, FedRot-LoRA, task-vector "
        "merges and `LoraFedAvg` on the same clients, 8 settings × 3 seeds",
        "`results/lora_<setting>.json`",
        "2 h",
    ),
    "flowertune_app": Bench(
        "`examples/flowertune-gpt2`'s own client and server pieces, Flower's FedAvg against `LoraFedAvg`, on 9 "
        "seeds: the paired difference per round against the seeds' noise",
        "`results/flowertune_gpt2.{json,png}`",
        "5 min",
    ),
    "lora_server_time": Bench(
        "`LoraFedAvg`'s server seconds per round against Flower's FedAvg on the same replies",
        "`results/lora_server_time.json`",
        "1 min",
    ),
    "verify": Bench(
        "reruns a slice of each cheap results file into a scratch folder and compares every figure with the "
        "file, within a stated tolerance (`--quick`: the CI subset); lists the files verified by hand",
        "nothing (`--record`: the verification, into the file's record)",
        "`--quick` (the main job, seed 0) 3 min, all 5 min",
    ),
    "gpu_check": Bench(
        "`make gpu-check` on a CUDA machine: the paper's GPT-2 setting, the everyday suite with CUDA visible, "
        "the speed benches",
        "`results/gpu/*.json`",
        "`--budget` s",
    ),
}


def table() -> str:
    """The entries as a Markdown table (simulations/README.md's)."""
    lines = ["| entry | what it measures | writes | about |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {b.what} | {b.writes} | {b.about} |" for name, b in BENCHES.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + table())
        return 0
    name, args = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"no entry {name!r}; choose one of {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    sys.argv = [str(HERE / f"{name}.py"), *args]
    sys.path.insert(0, str(HERE))  # the benches import their helpers from simulations/ itself
    runpy.run_module(f"simulations.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
