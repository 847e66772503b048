"""The docs' results and performance tables, generated from the files under ``results/``.

    python -m simulations.tables            # rewrite every generated table in README.md and docs/*.md
    python -m simulations.tables --check    # exit 1 if a page differs from what its files give (the tests run this)

A page holds a generated table between two markers::

    <!-- table: main-job -->
    ...
    <!-- /table -->

and the name picks a ``Table`` below: the results file it reads, the command that regenerates that file,
and how the table is rendered (the strategies' table is the registry's). Rerun a bench, then this, and
the pages say what the files say.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fedlmc import provenance

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "simulations"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), BENCH / "README.md"]
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def _load(name: str) -> dict:
    return json.loads((ROOT / "results" / name).read_text())


def _bench(module: str):
    """A bench script as a module (they import their helpers from simulations/ itself)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return __import__(module)


def _ms(values: list[float], fmt: str = ".3f", sign: str = "") -> str:
    return ", ".join(f"{v:{sign}{fmt}}" for v in values)


# ---- renderers: a results document in, a Markdown table (and its condition line) out -----------------


def main_job(doc: dict) -> str:
    seeds = doc["seeds"]
    lines = [
        "| strategy | test loss (mean of 3) | test acc | excess per seed | excess ÷ FedAvg's per seed "
        "| aggregation s |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in doc["mean"].items():
        ex = [s["strategies"][name]["test_loss"] - s["mean_client_test_loss"] for s in seeds.values()]
        base = [s["strategies"]["average"]["test_loss"] - s["mean_client_test_loss"] for s in seeds.values()]
        agg = [s["strategies"][name]["aggregation_seconds"] for s in seeds.values()]
        ratio = "1" if name == "average" else _ms([e / b for e, b in zip(ex, base)])
        lines.append(
            f"| {name} | {m['test_loss']:.4f} | {m['test_acc']:.3f} | {_ms(ex, '.3f', '+')} | {ratio} | "
            f"{_ms(agg, '.1f')} |"
        )
    clients = _ms([s["mean_client_test_loss"] for s in seeds.values()])
    walls = _ms(list(doc["wall_seconds"].values()), ".0f")
    lines += ["", f"Seeds {', '.join(seeds)}; the clients' own mean test loss {clients}; {walls} s a run "]
    lines[-1] += f"({doc['cpus']} CPU cores, {doc['machine']})."
    return "\n".join(lines)


def reproduce(doc: dict) -> str:
    from fedlmc.reproduce import markdown

    test = {int(k): v["loss"] for k, v in doc["test"].items()}
    return markdown(doc["preset"], doc["summary"], doc["pairs"], doc["dataset"] != "shakespeare", test).strip()


def universe(doc: dict) -> str:
    from fedlmc.merging.manyway import universe_markdown

    return "\n".join(universe_markdown(doc["preset"], doc, doc["seeds"]).splitlines()[2:])


def widths(doc: dict) -> str:
    from fedlmc.merging.manyway import width_markdown

    return "\n".join(width_markdown(doc["preset"], doc, doc["d"]).splitlines()[2:])


def width_study(doc: dict) -> str:
    import argparse

    args = argparse.Namespace(seeds=doc["seeds"], train_steps=doc["steps"], learned_steps=doc["learned_steps"])
    md = _bench("width_study").markdown(doc["arch"], doc["rows"], args)
    return "\n".join(md.splitlines()[2:]).strip()


def compare(doc: dict) -> str:
    from simulations.compare import markdown

    md = markdown(
        doc["setting"], doc["preset"], doc["rows"], doc["seeds"], doc["config"], doc.get("ensemble"), doc.get("clients")
    )
    return "\n".join(md.splitlines()[2:])


def screen(doc: dict) -> str:
    from simulations.screen import markdown

    return markdown(doc).strip()


def lora(docs: list[dict]) -> str:
    return _bench("lora_aggregators").markdown(docs).strip()


def flowertune_app(doc: dict) -> str:
    return _bench("flowertune_app").markdown(doc).strip()


def wm_pair(doc: dict) -> str:
    lines = [
        "| pair | seconds (median of 3) | × GEMM reference | iterations | FF layers solved / certified |",
        "|---|---|---|---|---|",
    ]
    for name, r in doc["runs"].items():
        its = ", ".join(f"{k} {v}" for k, v in r["iterations"].items())
        ff = f"{r['ff_steps']['solved']} / {r['ff_steps']['certified']}"
        lines.append(f"| {name} | {r['seconds']:.1f} | {r['seconds_in_gemms']:.1f} | {its} | {ff} |")
    lines += ["", f"{doc['processor']}, {doc['threads']} threads, {doc['device']}, torch {doc['torch']}."]
    return "\n".join(lines)


def ff_scale_overhead(doc: dict) -> str:
    med, runs = doc["median_seconds"], doc["seconds"]
    n = len(runs["in_process"])
    lines = [
        f"| weight matching, {doc['preset']} pair (GELU), {doc['threads']} thread(s) | median of {n} s | ratio |",
        "|---|---|---|",
        f"| in this process, `ff_scale=False` | {med['in_process']:.2f} | 1 |",
        f"| in this process, `ff_scale=True` | {med['in_process_ff_scale']:.2f} | "
        f"{doc['ratios']['ff_scale_over_plain']:.3f} |",
    ]
    if "fresh_process_against" in med:
        lines += [
            f"| a fresh process, a checkout without the FF-scale groups | {med['fresh_process_against']:.2f} | 1 |",
            f"| a fresh process, this checkout | {med['fresh_process']:.2f} | "
            f"{doc['ratios']['this_over_against']:.3f} |",
        ]
    return "\n".join(lines)


def universe_scale(doc: dict) -> str:
    text = _bench("universe_scale").table(doc).strip()
    return text + f"\n\n{doc['processor']}, {doc['threads']} threads, torch {doc['torch']}."


def busy_host(doc: dict) -> str:
    lines = [
        "| CPU-bound neighbours | GEMM s | pair s, fitted threads | pair s, unfitted | universe s, fitted | "
        "universe s, unfitted |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        lines.append(
            f"| {r['competitors']} | {r['gemm_seconds']:.2f} | {r['pair_fitted_seconds']:.1f} | "
            f"{r['pair_unfitted_seconds']:.1f} | {r['universe_fitted_seconds']:.1f} | "
            f"{r.get('universe_unfitted_seconds', float('nan')):.1f} |"
        )
    lines += ["", f"{doc['what']}; {doc['processor']}, {doc['cores']} cores."]
    return "\n".join(lines)


def mixed_depths(doc: dict) -> str:
    rows = doc["triples"]
    merges = ("6+6", "4+6", "4+6 weights", "4+6 zeros", "4+6 prefix", "both axes", "4+6 distilled", "FedDF zeros")
    lines = [
        "| seeds | clients 6, 6, 4, 4 at ½ width | " + " | ".join(f"`{m}`" for m in merges) + " | gap |",
        "|---|---|" + "---|" * len(merges) + "---|",
    ]
    for r in rows:
        merged = " | ".join(f"{r[m]['test_loss']:.4f}" for m in merges)
        clients = " / ".join(f"{c:.4f}" for c in r["clients"])
        lines.append(f"| {', '.join(map(str, r['seeds']))} | {clients} | {merged} | {r['gap']:+.4f} |")
    below = sum(r["distilled_below_both"] for r in rows)
    lines += [
        "",
        f"Test loss of {doc['preset']} on {doc['dataset']}, each client trained {doc['steps']} steps on its own seed; "
        f"gap: `4+6` minus `6+6` (mean {doc['gap_mean']:+.4f}); `both axes` merges the ½-width 4-layer client "
        f"with the first 6-layer one (mean {doc['both_axes_gap_mean']:+.4f} against `6+6`); the distilled rows ran "
        f"{doc['distill_steps']} steps, `4+6 distilled` is below both its clients on {below} of {len(rows)} triples.",
        "",
        "| seeds | placement: activations (s) | aligned circuits (s) | signatures | best of 15 (its loss) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        best = ",".join(map(str, r["best_placement"]))
        lines.append(
            f"| {', '.join(map(str, r['seeds']))} | {r['placement']} ({r['match_seconds']:.1f}) | "
            f"{r['placement_weights']} ({r['match_seconds_weights']:.1f}) | {r['placement_signatures']} | "
            f"{r['best_placement']} ({r['every_placement'][best]:.4f}) |"
        )
    weights = sum(r["placement_weights"] == r["best_placement"] for r in rows)
    lines += [
        "",
        f"Placed on activations, the merge is the best of the 15 placements (by its test loss) on "
        f"{doc['picked_best']} of {len(rows)} triples; on weights, on {weights}.",
    ]
    return "\n".join(lines)


def ray_cluster(doc: dict) -> str:
    lines = [
        "| cluster | merge s (median) | replies per node | worker peak RSS per node | max \\|Δ\\| vs sequential |",
        "|---|---|---|---|---|",
    ]
    for key, median in doc["median_wall_seconds"].items():
        runs = [r for r in doc["runs"] if r["nodes"] == int(key.split()[0])]
        per_node = sorted({" + ".join(map(str, r["replies_per_node"])) for r in runs})
        rss = max(max(r["worker_peak_rss_mb_per_node"]) for r in runs)
        diff = max(r["max_abs_diff_vs_sequential"] for r in runs)
        lines.append(f"| {key} of 1 CPU | {median:.1f} | {', '.join(per_node)} | ≤ {rss:.0f} MB | {diff:.1e} |")
    lines += [
        "",
        f"{doc['replies']} replies of {doc['model']}, {doc['iterations']} universe iterations, "
        f"{doc['workers']} workers; 2 nodes take {doc['two_nodes_over_one']:.2f}× the time of 1 "
        f"(sequential, in the server's process: {doc['sequential_seconds']:.1f} s). "
        f"{doc['environment']['processor']}, torch {doc['environment']['torch']}.",
    ]
    return "\n".join(lines)


def dp_spool(doc: dict) -> str:
    what = {
        "spool": "`Scale(spool=True)`, the strategy's own `start`",
        "client-dp": "`Scale(spool=True)` inside `DifferentialPrivacyClientSideFixedClipping`",
        "server-dp": "`Scale(spool=True)` inside `DifferentialPrivacyServerSideFixedClipping`",
        "memory": "replies in memory",
    }
    lines = ["| round | peak memory above the start | in models |", "|---|---|---|"]
    for r in doc["runs"]:
        lines.append(f"| {what[r['condition']]} | {r['peak_bytes'] / 2**30:.2f} GiB | {r['peak_models']:.1f} |")
    lines += [
        "",
        f"{doc['replies']} replies of a {doc['layers']}-layer GPT-2-small-shaped model "
        f"({doc['runs'][0]['model_bytes'] / 2**20:.0f} MiB); {doc['processor']}, {doc['threads']} threads.",
    ]
    return "\n".join(lines)


def lora_server_time(doc: dict) -> str:
    lines = [
        "| adapters | clients | rank | LoraFedAvg s | FedAvg s | ratio | server state KB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        lines.append(
            f"| {r['setting']} | {r['clients']} | {r['rank']} | {r['lorafedavg_seconds'] * 1e3:.1f} ms | "
            f"{r['fedavg_seconds'] * 1e3:.1f} ms | {r['ratio']:.1f} | {r['server_state_bytes'] / 1024:.0f} |"
        )
    env = doc["environment"]
    lines += ["", f"Median of {doc['repeats']}; {env['threads']} thread, {env['device']}, torch {env['torch']}."]
    return "\n".join(lines)


def _peak(peak: dict[str, float], prefix: str) -> str:
    return f"{max((v for k, v in peak.items() if k.startswith(prefix)), default=float('nan')):.0f}"


def deploy(docs: list[dict]) -> str:
    lines = [
        "| state database | wall s | round s | peak ServerApp MB | peak ClientApp MB | peak SuperLink MB |",
        "|---|---|---|---|---|---|",
    ]
    for d in docs:
        peak = d["peak_rss_mb"]
        link = max(_peak(peak, "flower-superlink"), _peak(peak, "fedlmc-superlink"), key=lambda s: s != "nan")
        lines.append(
            f"| {d['database']} | {d['wall_seconds']:.0f} | {d['rounds'][-1]['round_seconds']:.0f} | "
            f"{_peak(peak, 'flwr-serverapp')} | {_peak(peak, 'flwr-clientapp')} | {link} |"
        )
    return "\n".join(lines)


def gpu(doc: dict) -> str:
    dev, ref, tests = doc["device"], doc["reference"], doc["tests"]
    lines = ["| what | figure |", "|---|---|"]
    lines.append(f"| device | {dev['name']}, {dev['memory_gb']} GB, torch {dev['torch']} |")
    lines.append(
        f"| GEMM reference | {ref['tflops']['float32']} TFLOP/s float32, {ref['tflops']['bfloat16']} bfloat16 |"
    )
    paper = doc.get("paper", {})
    trained = paper.get("trained")
    if trained:
        losses = sorted(s["test"]["loss"] for s in trained["seeds"].values())
        lines.append(
            f"| the paper's GPT-2, 3 seeds | {trained['steps']} steps in {trained['wall_seconds']:.0f} s; "
            f"test loss {losses[0]:.2f}–{losses[-1]:.2f} |"
        )
    for name, b in (paper.get("barriers") or {}).items():
        pairs = ", ".join(f"{p[name]:.3f}" for p in paper.get("per_pair", []))
        lines.append(f"| barrier, {name} | {b['ours']:.3f} ± {b['se']:.3f} (pairs {pairs}); the paper's {b['paper']} |")
    if paper.get("error"):
        lines.append(f"| the paper's barriers | not measured: {paper['error'].strip().splitlines()[-1]} |")
    lines.append(
        f"| everyday suite, CUDA visible | {tests['passed']} passed, {tests['failed']} failed, "
        f"{tests['errors']} collection errors |"
    )
    for name, b in doc.get("bench", {}).items():
        lines.append(f"| `{name}` bench | {'exit 0' if b['exit'] == 0 else 'failed'} in {b['seconds']:.0f} s |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Table:
    """A generated table: the results file(s) it reads, the command that writes each, its renderer (one
    document in, or the list of them for a table of several files)."""

    files: tuple[str, ...]
    commands: tuple[str, ...]
    render: Callable
    several: bool = False

    def markdown(self) -> str:
        if not self.files:  # not a results file: the code's own registry
            return self.render(None) + "\n"
        docs = [_load(f) for f in self.files]
        body = self.render(docs if self.several else docs[0])
        made = "; ".join(dict.fromkeys(f"`{c}`" for c in self.commands))
        files = ", ".join(f"`results/{f}`" for f in self.files)
        return f"{made} → {files}\n\n{body}\n\n{self.conditions(docs)}\n"

    def conditions(self, docs: list[dict]) -> str:
        """The foot: how the files were made (their records), each condition naming its files when the
        files differ."""
        by: dict[str, list[str]] = {}
        for f, d in zip(self.files, docs):
            by.setdefault(provenance.conditions(d.get("provenance", {})), []).append(f)
        if len(by) == 1:
            return next(iter(by))
        unknown = by.pop(provenance.conditions({}), [])
        said = [f"{', '.join(f'`{f}`' for f in fs)}: {c}" for c, fs in by.items()]
        if unknown:
            said.append(
                f"The other {len(unknown)}: {provenance.conditions({})[0].lower()}{provenance.conditions({})[1:]}"
            )
        return " ".join(said)


def one(file: str, command: str, render: Callable) -> Table:
    return Table((file,), (command,), render)


def _compare(stem: str, extra: str = "") -> Table:
    doc = _load(f"{stem}.json")
    command = f"python -m simulations.compare --setting {doc['setting']} --preset {doc['preset']}" + extra
    return one(f"{stem}.json", command, compare)


def _scale_command(file: str) -> str:
    """The universe-scale bench's command for a results file: its plan is the file's runs, in order."""
    plan = ",".join(dict.fromkeys(f"{r['M']}:{r['kind']}:{r['strategy']}" for r in _load(file)["runs"]))
    return f"python simulations/universe_scale.py --repeats 3 --plan {plan} --out results/{file}"


# the speaker setting's rows: the one-shot setting's but the slowest (refined-clients-distilled, 16 min a seed)
SPEAKER_ROWS = (
    "average permuted aligned refined refined-clients ot-fusion feddf aligned-distilled refined-distilled "
    "ot-fusion:ot-reg=0.02 ot-fusion:ot-cost=activations:ot-reg=0.2"
).split()
WIDTH_STUDY = "python simulations/width_study.py --arch vit --widths 32 64 128 256"
LORA = (
    "small-gpt2-r4-steps200",
    "small-gpt2-r4-alpha16-steps200",
    "speaker-r8-steps100",
    "iid-r8-steps100",
    "speaker-r8-steps10",
    "speaker-r8-steps500",
    "speaker-mixed-steps100",
    "full-speaker-steps100",
)


def _wins(mine: list[float], theirs: list[float]) -> str:
    """'k of n seeds' on which ``mine`` is lower than ``theirs`` (per-seed final losses)."""
    return f"{sum(a < b for a, b in zip(mine, theirs))} of {len(mine)} seeds"


CHOOSER_FILES = (
    "main_job.json",
    "compare_oneshot_vit-tiny.json",
    "compare_oneshot_vit-tiny_partitioner-iid.json",
    "compare_multiround_vit-tiny.json",
    "compare_widths-independent_vit-tiny.json",
    "compare_widths_vit-tiny.json",
    "lora_speaker-r8-steps100.json",
    "compare_robust-multiround_vit-tiny.json",
    "compare_depths_vit-tiny.json",
)


def chooser(docs: list[dict]) -> str:
    """The README's "which strategy" table: a situation, what to use, the figure to expect and the peer that
    does better where one does, every figure read from its results file."""
    job, oneshot, iid, multi, widths, shared, lora, robust, depths = docs
    ex = {
        n: [s["strategies"][n]["test_loss"] - s["mean_client_test_loss"] for s in job["seeds"].values()]
        for n in ("average", "aligned")
    }
    ratio = sorted(a / b for a, b in zip(ex["aligned"], ex["average"]))
    o, i, m, w, sw, r = oneshot["rows"], iid["rows"], multi["rows"], widths["rows"], shared["rows"], robust["rows"]
    d = depths["rows"]

    def loss(rows, name):
        return rows[name]["final_loss"][0]

    def kept(rows, name):
        return f"{rows[name]['ensemble_recovered'][0]:.0%}"

    def seeds(rows, name):
        return rows[name]["final_loss_per_seed"]

    lr = lora["rows"]
    last = {
        n: [per[-1] for per in lr[n]["test_loss_per_seed"]] for n in ("fedlmc", "average", "fedex-lora", "fedlmc-fold")
    }
    prox = "fedprox:proximal-mu=0.1"
    rows = [
        (
            "clients trained apart (each from its own start), merged once",
            "`aligned`: `AlignedFedAvg(model=model)`",
            f"excess over the clients {ratio[0]:.2f}–{ratio[-1]:.2f}× FedAvg's (GPT-2, 2 clients, 3 seeds; "
            "`results/main_job.json`)",
            f"none measured: OT fusion {loss(o, 'ot-fusion'):.2f} vs `aligned` {loss(o, 'aligned'):.2f} (ViT)",
            "none",
        ),
        (
            "the same, with unlabelled inputs at the server",
            "`refined-distilled`",
            f"keeps {kept(o, 'refined-distilled')} of the clients' ensemble's gain over FedAvg (ViT, label skew), "
            f"{kept(i, 'refined-distilled')} IID",
            f"FedDF keeps {kept(o, 'feddf')} / {kept(i, 'feddf')}, `refined` "
            f"({kept(o, 'refined')} / {kept(i, 'refined')}), behind `refined-distilled`",
            "none",
        ),
        (
            "many rounds from a shared start, strong label skew",
            "`fedprox` (a peer), or `refined` with `proximal-mu`",
            f"`refined` {loss(m, 'refined'):.2f}, with FedProx's clients {loss(m, 'refined:proximal-mu=0.1'):.2f}, "
            f"FedAvg {loss(m, 'average'):.2f} (ViT, 5 rounds)",
            f"FedProx {loss(m, prox):.2f}: lower than `refined` on {_wins(seeds(m, prox), seeds(m, 'refined'))}",
            "FedProx's proximal term (fedlmc's ClientApp has it)",
        ),
        (
            "clients of different widths, trained apart; or of different depths",
            "`hetero-refined`; depths: `hetero-zeros`",
            f"{loss(w, 'hetero-refined'):.2f} vs HeteroFL slicing {loss(w, 'slicing'):.2f} (ViT); depths "
            f"{loss(d, 'hetero-zeros'):.2f} vs first-blocks slicing {loss(d, 'slicing'):.2f} (5 rounds)",
            f"from a shared start slicing ties: {loss(sw, 'slicing'):.3f} vs `hetero` {loss(sw, 'hetero'):.3f}",
            "a model built at the received arrays' width and depth",
        ),
        (
            "LoRA adapters (a FlowerTune-style app)",
            "`LoraFedAvg(model=peft_model)`",
            f"{sum(last['fedlmc']) / len(last['fedlmc']):.4f} vs FedIT "
            f"{sum(last['average']) / len(last['average']):.4f} "
            f"(Llama, 4 speakers; lower on {_wins(last['fedlmc'], last['average'])})",
            f'FedEx-LoRA {sum(last["fedex-lora"]) / 3:.4f}; ours with `tail="fold"` {sum(last["fedlmc-fold"]) / 3:.4f}',
            'none (`tail="fold"`: the base update applied)',
        ),
        (
            "some clients may be attackers",
            '`aligned` with `reduce = "median"`',
            f"{loss(r, 'aligned@median'):.2f} vs Flower's FedMedian {loss(r, 'average@median'):.2f} and FedAvg "
            f"{loss(r, 'average'):.2f} (ViT, one sign-flipping client of 5, 5 rounds)",
            "none measured over rounds; one-shot, distillation (`refined-distilled`) beats every robust merge",
            "none",
        ),
    ]
    lines = [
        "| your situation | use | what to expect | where a peer does better | client code |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return "\n".join(lines)


def strategies(_) -> str:
    from fedlmc.strategies.registry import table

    return table(baselines=False)


def baselines(_) -> str:
    from fedlmc.strategies.registry import table

    return table(baselines=True)


def run_keys(_) -> str:
    from fedlmc.federated import Settings, key_table

    return key_table(Settings)


def experiment_keys(_) -> str:
    from fedlmc.federated import Settings, key_table
    from simulations.experiment import ExperimentSettings

    return key_table(ExperimentSettings, beyond=Settings)


def strategy_keys(_) -> str:
    from fedlmc.strategies.registry import key_table

    return key_table()


def benches(_) -> str:
    from simulations.__main__ import table

    return table()


TABLES: dict[str, Table] = {
    "strategies": Table((), (), strategies),
    "baselines": Table((), (), baselines),
    "chooser": Table(
        CHOOSER_FILES,
        (
            "python simulations/main_job.py",
            "python -m simulations.compare",
            "python simulations/lora_aggregators.py",
        ),
        chooser,
        several=True,
    ),
    "benches": Table((), (), benches),
    "run-keys": Table((), (), run_keys),
    "experiment-keys": Table((), (), experiment_keys),
    "strategy-keys": Table((), (), strategy_keys),
    "main-job": one("main_job.json", "python simulations/main_job.py", main_job),
    "reproduce-vit": one("reproduce_vit-tiny.json", "fedlmc reproduce --preset vit-tiny --pairs 3", reproduce),
    "reproduce-gpt2": one("reproduce_gpt2-tiny.json", "fedlmc reproduce --preset gpt2-tiny --pairs 3", reproduce),
    "reproduce-llama-scales": one(
        "reproduce_llama-tiny.json",
        "fedlmc reproduce --preset llama-tiny --pairs 3 --steps 2000 "
        "--methods average wm-orth-factored wm-orth-scale learned learned-scale learned-sinkhorn learned-relaxed",
        reproduce,
    ),
    "reproduce-relu-scales": one(
        "reproduce_gpt2-tiny-relu.json",
        "fedlmc reproduce --preset gpt2-tiny-relu --pairs 3 --steps 1000 "
        "--methods average wm-orth-factored wm-orth-scale learned learned-scale learned-sinkhorn learned-relaxed",
        reproduce,
    ),
    "reproduce-neox": one(
        "reproduce_neox-tiny.json",
        "fedlmc reproduce --preset neox-tiny --pairs 3 --steps 1000 "
        "--methods average wm-orth-factored learned learned-sinkhorn learned-relaxed",
        reproduce,
    ),
    "reproduce-gelu-relax": one(
        "relax/reproduce_gpt2-tiny.json",
        "fedlmc reproduce --preset gpt2-tiny --pairs 3 --steps 1000 "
        "--methods average wm-orth-factored learned learned-sinkhorn learned-relaxed --out results/relax",
        reproduce,
    ),
    "reproduce-vit-relax": one(
        "relax/reproduce_vit-tiny.json",
        "fedlmc reproduce --preset vit-tiny --pairs 3 "
        "--methods average wm-orth-factored learned learned-sinkhorn learned-relaxed --out results/relax",
        reproduce,
    ),
    "ff-scale-overhead": one(
        "bench_ff_scale_overhead_vit-tiny_w128.json",
        "python -m simulations ff_scale_overhead --preset vit-tiny --width 128 --repeats 5 --threads 1 "
        "--against DIR  # DIR: a checkout without the FF-scale groups",
        ff_scale_overhead,
    ),
    "universe-vit": one(
        "universe_vit-tiny.json",
        "fedlmc universe --preset vit-tiny --models 4 --forms factored circuit --alpha 0.1 1.0",
        universe,
    ),
    "universe-gpt2": one(
        "universe_gpt2-tiny.json",
        "fedlmc universe --preset gpt2-tiny --models 4 --forms factored circuit --alpha 0.1 1.0",
        universe,
    ),
    "universe-relu-scales": one(
        "universe_gpt2-tiny-relu.json",
        "fedlmc universe --preset gpt2-tiny-relu --models 4 --steps 1000 --alpha 1.0 --ff-scale --simplex-n 0",
        universe,
    ),
    "universe-llama-scales": one(
        "universe_llama-tiny.json",
        "fedlmc universe --preset llama-tiny --models 4 --steps 2000 --alpha 1.0 --ff-scale --simplex-n 0",
        universe,
    ),
    "widths-gpt2": one("widths_gpt2-tiny.json", "fedlmc widths --preset gpt2-tiny", widths),
    "width-control": one("width_study_vit.json", WIDTH_STUDY, width_study),
    "oneshot-dirichlet": _compare("compare_oneshot_vit-tiny"),
    "oneshot-iid": _compare("compare_oneshot_vit-tiny_partitioner-iid", " --set partitioner=iid"),
    "oneshot-gpt2-speaker": _compare(
        "compare_oneshot_gpt2-tiny_hf-True_local-steps-1500_partitioner-speaker",
        " --set partitioner=speaker local-steps=1500 hf=true --strategies " + " ".join(SPEAKER_ROWS),
    ),
    "multiround": _compare("compare_multiround_vit-tiny"),
    "multiround-drift": _compare("compare_multiround-drift_vit-tiny"),
    "widths": _compare("compare_widths_vit-tiny"),
    "depths": _compare("compare_depths_vit-tiny"),
    "widths-independent": _compare("compare_widths-independent_vit-tiny"),
    "robust": _compare("compare_robust_vit-tiny"),
    "robust-multiround": _compare("compare_robust-multiround_vit-tiny"),
    **{
        f"screen{tag}": one(f"screen_screen{tag}.json", f"python -m simulations.screen --settings screen{tag}", screen)
        for tag in ("", "-flip", "-multiround")
    },
    "lora": Table(
        tuple(f"lora_{s}.json" for s in LORA), ("python simulations/lora_aggregators.py",), lora, several=True
    ),
    "flowertune-app": one("flowertune_gpt2.json", "python simulations/flowertune_app.py", flowertune_app),
    "gpu": one("gpu/gpu_check.json", "make gpu-check", gpu),
    "wm-pair": one("bench_wm_gpt2_small.json", "python simulations/wm_gpt2_small.py --repeats 3", wm_pair),
    "universe-scale": one(
        "bench_universe_scale_amd_curve.json", _scale_command("bench_universe_scale_amd_curve.json"), universe_scale
    ),
    "busy-host": one("bench_load.json", "python simulations/busy_host.py", busy_host),
    "mixed-depths": one("mixed_depths_gpt2-tiny.json", "python -m simulations mixed_depths --steps 800", mixed_depths),
    "ray-cluster": one("bench_ray_cluster.json", "python -m simulations ray_cluster", ray_cluster),
    "dp-spool": one("bench_dp_spool.json", "python simulations/dp_spool.py --replies 8 --layers 2", dp_spool),
    "lora-server-time": one("lora_server_time.json", "python simulations/lora_server_time.py", lora_server_time),
    "deploy": Table(
        ("deploy_gpt2_small_memory.json", "deploy_gpt2_small_sqlite_load4.json"),
        (
            "python simulations/deploy_gpt2_small.py --database memory",
            "python simulations/deploy_gpt2_small.py --database sqlite --burners 4",
        ),
        deploy,
        several=True,
    ),
}


def regenerate(text: str) -> str:
    """``text`` with every generated table block rendered anew (an unknown name is an error)."""

    def one(m: re.Match) -> str:
        name = m.group("name")
        if name not in TABLES:
            raise KeyError(f"no generated table {name!r}; known: {', '.join(TABLES)}")
        return m.group(1) + TABLES[name].markdown() + m.group(4)

    return BLOCK.sub(one, text)


def prose(text: str) -> str:
    """A page without its generated tables (what its authors wrote)."""
    return BLOCK.sub("", text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is out of date")
    args = p.parse_args(argv)
    stale = []
    for page in PAGES:
        old = page.read_text()
        new = regenerate(old)
        if new != old:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    verb = "out of date" if args.check else "rewritten"
    print(f"{len(stale)} page(s) {verb}" + (": " + ", ".join(map(str, stale)) if stale else ""))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
