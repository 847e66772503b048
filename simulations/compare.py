"""FedAvg vs aligned aggregation, side by side, on Flower's Ray simulation engine.

    python -m simulations.compare --setting oneshot --preset vit-tiny --seeds 0 1 2
    python -m simulations.compare --setting multiround --preset vit-tiny
    python -m simulations.compare --setting widths --preset vit-tiny
    python -m simulations.compare --setting robust --preset vit-tiny     # 5 clients, one poisoned

Every strategy runs with identical seeds and partitions (one process per run, so Ray never leaks
between runs). Prints a table (final test loss / accuracy, excess over the mean client loss, seconds
per round and per aggregation) and writes ``results/compare_<setting>_<preset>.{json,png}``.
Finished runs are reused from ``--runs`` (delete it to start over).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from fedlmc import provenance
from fedlmc.strategies.registry import all_keys, registered

from .experiment import ExperimentSettings as Settings
from .simulate import run_in_subprocess

console = Console(stderr=True)

SCREEN_STRATEGIES = [
    "aligned@median",
    "aligned+distance",
    "aligned@median+distance",
    "aligned+loss",
    "aligned@median+loss",
    "aligned+agreement",
    "aligned@median+agreement",
    "aligned+information",
    "aligned@median+information",
    "aligned+krum",
    "krum",
    "multikrum",
    # the screens before a refinement: on the server's data, and on the clients' (no server data)
    "refined",
    "refined+distance",
    "refined+information",
    "refined-clients+distance",
]

# 5 one-shot clients, independently started, the last one poisoned (shuffled labels)
ROBUST: dict[str, Any] = {
    "num-server-rounds": 1,
    "independent-start": True,
    "partitioner": "dirichlet",
    "alpha": 0.5,
    "local-epochs": 20.0,
    "poison-partition": 4,
    "poison": "labels",
}
# 5 rounds from a shared init, the last client a sign-flipper (×4)
ROBUST_MULTIROUND: dict[str, Any] = {
    "num-server-rounds": 5,
    "independent-start": False,
    "partitioner": "iid",
    "local-epochs": 2.0,
    "poison-partition": 4,
    "poison": "sign-flip",
    "poison-scale": 4.0,
}

# FedProx's μ ∈ {0.01, 0.1}, FedAvgM's momentum ∈ {0.5, 0.9} (server learning rate 1), FedAdam's server
# learning rate ∈ {0.001, 0.003, 0.01} (FedYogi takes FedAdam's): the lowest final test loss of the
# multiround setting on seed 5, which no table reports
PEERS_TUNED = [
    "fedprox:proximal-mu=0.1",
    "fedavgm:server-momentum=0.5",
    "fedadam:server-lr=0.003",
    "fedyogi:server-lr=0.003",
]

# federated training from a shared init under strong label skew
MULTIROUND = {
    "num-server-rounds": 5,
    "independent-start": False,
    "partitioner": "dirichlet",
    "alpha": 0.1,
    "local-epochs": 2.0,
}
SGD_ROWS = [f"{s}:local-optimizer=sgd:local-steps=60:lr=0.01" for s in ("average", "scaffold")]

SETTINGS: dict[str, dict[str, Any]] = {
    # one-shot model fusion: independent inits, one round of long local training, one aggregation
    "oneshot": dict(
        strategies=[
            *["average", "permuted", "aligned", "refined", "refined-clients"],
            # the one-shot fusion peers: optimal transport, ensemble distillation (FedDF), and ours distilled
            *["ot-fusion", "feddf", "aligned-distilled", "refined-distilled", "refined-clients-distilled"],
            # OT fusion with its regularisation chosen on held-out seed 5 (weights: 0.02 from 0.02, 0.06,
            # 0.2; activations: 0.2 from 0.01, 0.06, 0.2, 0.5, 1)
            *["ot-fusion:ot-reg=0.02", "ot-fusion:ot-cost=activations:ot-reg=0.2"],
        ],
        clients=4,
        config={
            "num-server-rounds": 1,
            "independent-start": True,
            "partitioner": "dirichlet",
            "alpha": 0.5,
            "local-epochs": 20.0,
        },
    ),
    # federated training from a shared init under strong label skew
    "multiround": dict(
        strategies=[
            *["average", "permuted", "aligned", "aligned-clients", "refined", "refined-clients"],
            # the cures for client drift (hyper-parameters chosen on held-out seed 5: PEERS_TUNED), and
            # FedProx's clients under refined aggregation
            *PEERS_TUNED,
            "scaffold",
            "refined:proximal-mu=0.1",
            # SCAFFOLD as its paper runs it, and its baseline: plain SGD, the same K steps on every client
            # (lr chosen on held-out seed 5 from 0.003, 0.01, 0.03, 0.1 for each)
            *SGD_ROWS,
        ],
        clients=4,
        config=MULTIROUND,
    ),
    # ... with 10 local epochs: more drift. The peers with the 2-epoch setting's hyper-parameters and with
    # this setting's own (held-out seed 5: FedProx mu from 0.001, 0.01; FedAdam's lr from 0.01, 0.03)
    "multiround-drift": dict(
        strategies=[
            *["average", "aligned", "permuted", "refined", "refined:proximal-mu=0.1"],
            *PEERS_TUNED,
            "fedprox:proximal-mu=0.001",
            "fedadam:server-lr=0.03",
            "refined:proximal-mu=0.001",
        ],
        clients=4,
        config={**MULTIROUND, "local-epochs": 10.0},
    ),
    # robust aggregation: 5 one-shot clients, the last one poisoned (shuffled labels); "X@median" is
    # strategy X with reduce=median (average@median is Flower's FedMedian)
    "robust": dict(
        strategies=[
            *["average", "average@median", "aligned", "aligned@median", "aligned@trimmed"],
            *["ot-fusion", "feddf", "refined-distilled"],  # the one-shot fusion peers, and ours distilled
        ],
        clients=5,
        config=ROBUST,
    ),
    # ... and federated training from a shared init with a sign-flipping attacker (scaled ×4: its
    # flipped update cancels the four honest ones in a plain mean)
    "robust-multiround": dict(
        strategies=[
            *["average", "average@median", "aligned", "aligned@median", "aligned@trimmed"],
            *PEERS_TUNED,  # the drift cures, with the multiround setting's hyper-parameters
        ],
        clients=5,
        config=ROBUST_MULTIROUND,
    ),
    # screening modulo symmetries (simulations.screen): the robust settings with screened strategies
    # ("X+distance": strategy X with screen=distance) against Flower's raw Krum / Multi-Krum
    "screen": dict(strategies=SCREEN_STRATEGIES, clients=5, config=ROBUST),
    # ... independently started clients, one of them a sign-flipper (×4)
    "screen-flip": dict(
        strategies=SCREEN_STRATEGIES, clients=5, config={**ROBUST, "poison": "sign-flip", "poison-scale": 4.0}
    ),
    # ... and federated training from a shared init with the sign-flipper
    "screen-multiround": dict(strategies=SCREEN_STRATEGIES, clients=5, config=ROBUST_MULTIROUND),
    # mixed widths: d, d/2, d/4 clients from one shared init (HeteroFL's home ground)
    "widths": dict(
        strategies=["slicing", "hetero-permuted", "hetero", "hetero:ff-lift=split"],
        clients=3,
        config={
            "num-server-rounds": 5,
            "independent-start": False,
            "partitioner": "iid",
            "local-epochs": 2.0,
            "width-factors": "1,2,4",
        },
    ),
    # mixed depths from a shared start: 2 clients of the full depth, 2 of half of it, label skew; local: each
    # client trains alone (what the smaller clients gain by federating)
    "depths": dict(
        strategies=["deep-only", "slicing", "hetero-zeros", "hetero", "local"],
        clients=4,
        config={
            "num-server-rounds": 5,
            "independent-start": False,
            "partitioner": "dirichlet",
            "alpha": 0.5,
            "local-epochs": 1.0,
            "depth-factors": "1,2",
        },
    ),
    # model-heterogeneous one-shot: organisations bring models of widths d, d/2, d/4, trained separately
    "widths-independent": dict(
        strategies=[
            "slicing",
            "hetero-permuted",
            "hetero",
            "hetero-refined",
            "hetero:ff-lift=split",  # narrower FFs split over the extra units, not zero-padded
            "hetero-refined:ff-lift=split",
        ],
        clients=3,
        config={
            "num-server-rounds": 1,
            "independent-start": True,
            "partitioner": "iid",
            "local-epochs": 20.0,
            "width-factors": "1,2,4",
        },
    ),
}

# change how fast a run goes or where its files are, not what it computes (a moved --runs folder is reused)
SPEED_ONLY = ("threads", "device", "round-timeout", "client-cache", "out-dir")

PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "vit-tiny": {"lr": 2e-3, "batch-size": 64, "threads": 1},
    "gpt2-tiny": {"lr": 2e-3, "batch-size": 64, "eval-batches": 20, "threads": 1},
    "vit-digits": {"lr": 3e-3, "batch-size": 32, "threads": 1},
}


def _parse_value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def run_all(
    setting: str,
    preset: str,
    seeds: list[int],
    strategies: list[str],
    clients: int,
    extra: dict[str, Any],
    runs: Path,
    timeout: float,
) -> dict[str, dict[int, dict]]:
    spec = SETTINGS[setting]
    out: dict[str, dict[int, dict]] = {s: {} for s in strategies}
    code = provenance.code_hash(provenance.FEDERATION_CODE)  # what a finished run must have been made by
    for seed in seeds:
        for strategy in strategies:
            name, reduce, screen = variant(strategy)
            cfg = {
                **spec["config"],
                **PRESET_DEFAULTS.get(preset, {}),
                **extra,
                **row_config(strategy),
                "preset": preset,
                "seed": seed,
                "strategy": name,
                "min-nodes": clients,
                "report": True,  # excess losses need every reply scored
                **({"reduce": reduce} if reduce else {}),
                **({"screen": screen} if screen else {}),
            }
            alpha = cfg.get("alpha", "") if cfg["partitioner"] == "dirichlet" else ""
            tag = f"{setting}-{preset}-{cfg['partitioner']}{alpha}"
            run_dir = runs / tag / f"{''.join(c if c.isalnum() or c in '.-' else '-' for c in strategy)}-s{seed}"
            cfg["out-dir"] = str(run_dir.resolve())
            if cfg["num-server-rounds"] == 1:  # one-shot: every strategy aggregates the same clients
                cfg.setdefault("client-cache", str((runs / tag / "clients").resolve()))
            Settings.from_run_config(cfg)  # validate before spending time
            metrics, made_by = run_dir / "metrics.json", run_dir / "code.sha256"
            if metrics.is_file() and made_by.is_file() and made_by.read_text() == code:  # this code's run
                doc = json.loads(metrics.read_text())
                wanted = Settings.from_run_config(cfg).to_run_config()
                # keys added since the run default to their old behaviour (a strategy's own: its declared default)
                defaults = {**{k: key.default for k, key in all_keys().items()}, **Settings().to_run_config()}
                if "finished" in doc and all(
                    doc["settings"].get(k, defaults[k]) == v for k, v in wanted.items() if k not in SPEED_ONLY
                ):
                    console.print(f"[dim]{strategy} seed {seed}: reusing {metrics}[/dim]")
                    provenance.reused(metrics)
                    out[strategy][seed] = doc
                    continue
            console.print(f"{strategy} seed {seed}: running ({clients} clients) → {run_dir}")
            t0 = time.time()
            run_dir.mkdir(parents=True, exist_ok=True)
            doc = run_in_subprocess(cfg, num_supernodes=clients, timeout=timeout, log_path=run_dir / "log.txt")
            made_by.write_text(code)
            last = doc["rounds"][-1]
            console.print(
                f"  done in {time.time() - t0:.0f} s: test loss {last['test_loss']:.4f} acc {last['test_acc']:.4f}"
            )
            out[strategy][seed] = doc
    return out


def row_config(label: str) -> dict[str, Any]:
    """The run_config keys a row's label sets after its first ':' ("refined:proximal-mu=0.01" is refined
    whose clients train with FedProx's proximal term; several keys are separated by ':')."""
    out: dict[str, Any] = {}
    for kv in label.split(":")[1:]:
        key, eq, value = kv.partition("=")
        if not eq or not key:
            raise ValueError(f"row {label!r}: expected STRATEGY:KEY=VALUE, got {kv!r}")
        out[key] = _parse_value(value)
    return out


def variant(label: str) -> tuple[str, str, str]:
    """A row's label read as (strategy, reduce, screen): "aligned@median+distance" is the registered
    strategy aligned with reduce=median and screen=distance ("…:KEY=VALUE" sets run_config keys for this
    row only: ``row_config``); a clear error for a name nobody registered."""
    base, _, screen = label.split(":")[0].partition("+")
    name, _, reduce = base.partition("@")
    registered(name)
    return name, reduce, screen


def _mean_se(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) ** 0.5


def summarise(docs: dict[str, dict[int, dict]], baseline: str) -> dict[str, Any]:
    """Per strategy: final loss/acc, excess over the mean client loss (last round), its ratio to the
    baseline's on the same seed, the worst per-round gap to the baseline, and seconds."""
    rows: dict[str, Any] = {}
    for strategy, by_seed in docs.items():
        finals, accs, excess, ratio, worst_gap, round_s, align_s, kept = [], [], [], [], [], [], [], []
        recovered: list[float] = []
        reach: list[Optional[int]] = []
        returned: list[float] = []  # the smaller clients' own models, last round (mixed widths or depths)
        for seed, doc in by_seed.items():
            last = doc["rounds"][-1]
            finals.append(last["test_loss"])
            if last.get("returned_test_loss"):
                returned.append(statistics.mean(last["returned_test_loss"].values()))
            accs.append(last["test_acc"])
            rec = last.get("strategy") or {}
            share = ensemble_share(
                rec, ((docs.get(baseline, {}).get(seed) or {}).get("rounds") or [{}])[-1].get("strategy") or {}
            )
            if share is not None:
                recovered.append(share)
            if "excess" in rec:
                excess.append(rec["excess"])
                base = ((docs.get(baseline, {}).get(seed) or {}).get("rounds") or [{}])[-1].get("strategy") or {}
                if base.get("excess") and base["excess"] > 0:
                    ratio.append(rec["excess"] / base["excess"])
            base_doc = docs.get(baseline, {}).get(seed)
            if base_doc and strategy != baseline:
                gaps = [a["test_loss"] - b["test_loss"] for a, b in zip(doc["rounds"][1:], base_doc["rounds"][1:])]
                worst_gap.append(max(gaps) if gaps else float("nan"))
            if base_doc and len(doc["rounds"]) > 2:  # rounds to the baseline's final test loss on this seed
                target = base_doc["rounds"][-1]["test_loss"]
                reach.append(next((i for i, r in enumerate(doc["rounds"]) if i and r["test_loss"] <= target), None))
            rs = [r["round_seconds"] for r in doc["rounds"][1:]]
            round_s.append(sum(rs) / len(rs) if rs else float("nan"))
            al = [(r.get("strategy") or {}).get("align_seconds", float("nan")) for r in doc["rounds"][1:]]
            align_s.append(sum(al) / len(al) if al else float("nan"))
            kept += [
                (r.get("strategy") or {}).get("kept")
                for r in doc["rounds"][1:]
                if (r.get("strategy") or {}).get("kept")
            ]
        verdicts = [
            v for doc in by_seed.values() for r in doc["rounds"][1:] for v in [guard_verdict(r)] if v is not None
        ]
        costs = [c for doc in by_seed.values() for r in doc["rounds"][1:] for c in [client_cost(r)] if c is not None]
        rows[strategy] = {
            "guard_agreement": (sum(verdicts) / len(verdicts)) if verdicts else None,
            "guard_rounds": len(verdicts),
            "client_comm_per_fedavg_round": _mean_se([c["comm"] for c in costs]) if costs else None,
            "client_messaging_seconds": _mean_se([c["seconds"] for c in costs]) if costs else None,
            "client_refine_steps": _mean_se([c["steps"] for c in costs]) if costs else None,
            "final_loss": _mean_se(finals),
            "final_acc": _mean_se(accs),
            "excess": _mean_se(excess),
            "excess_ratio": _mean_se(ratio),
            "excess_per_seed": excess,
            "final_loss_per_seed": finals,
            "returned_loss": _mean_se(returned) if returned else None,
            "returned_loss_per_seed": returned,
            "rounds_to_baseline_per_seed": reach,
            "worst_gap_to_baseline": max(worst_gap) if worst_gap else None,
            "round_seconds": _mean_se(round_s),
            "aggregation_seconds": _mean_se(align_s),
            "kept": {k: kept.count(k) for k in set(kept)},
            "ensemble_recovered": _mean_se(recovered),
            "per_round_loss": _per_round(by_seed, "test_loss"),
            "per_round_acc": _per_round(by_seed, "test_acc"),
        }
    return rows


def guard_verdict(rnd: dict) -> Optional[bool]:
    """Whether a round's guard chose the candidate the report data also finds better (None: no guard
    or no report of both candidates)."""
    rec = rnd.get("strategy") or {}
    keys = ("guard_aligned", "guard_average", "report_aligned", "report_average")
    if any(rec.get(k) is None for k in keys):
        return None
    return (rec["guard_aligned"] <= rec["guard_average"]) == (rec["report_aligned"] <= rec["report_average"])


def client_cost(rnd: dict) -> Optional[dict[str, float]]:
    """What asking the clients cost a round (the refinement's, the distillation's and the guard's messages): bytes as a
    multiple of one FedAvg round's (every replying client sent the model and sent one back), and the
    seconds spent waiting for the clients; None when the round asked nothing."""
    rec = rnd.get("strategy") or {}
    refine, guard, distill = rec.get("refine_clients"), rec.get("guard_clients"), rec.get("distill_clients")
    if (refine is None and guard is None and distill is None) or not rec.get("model_bytes") or not rec.get("nodes"):
        return None
    fedavg = 2 * len(rec["nodes"]) * rec["model_bytes"]
    asked = (refine, guard, distill)
    sent = sum((c or {}).get("bytes_sent", 0) + (c or {}).get("bytes_received", 0) for c in asked)
    seconds = sum((c or {}).get("seconds", 0.0) for c in asked)
    return {
        "comm": sent / fedavg,
        "seconds": seconds,
        "steps": sum((c or {}).get("steps", 0) for c in (refine, distill)),
    }


def ensemble_share(rec: dict, base: dict) -> Optional[float]:
    """How much of the output ensemble's advantage over the baseline's model this strategy's model
    recovers, on the report data of one seed: 0 = the baseline's loss, 1 = the ensemble's."""
    ens, mine, theirs = rec.get("ensemble_loss"), rec.get("global_loss"), base.get("global_loss")
    if ens is None or mine is None or theirs is None or theirs - ens <= 0:
        return None
    return (theirs - mine) / (theirs - ens)


def _last_round(docs: dict[str, dict[int, dict]], field: str) -> dict[int, Any]:
    """``field`` of the last round's strategy record per seed, from the first strategy's run that has it
    (references such as the clients and their ensemble are the same for every strategy)."""
    out: dict[int, Any] = {}
    for by_seed in docs.values():
        for seed, doc in by_seed.items():
            value = (doc["rounds"][-1].get("strategy") or {}).get(field)
            if value is not None and value != []:
                out.setdefault(seed, value)
    return out


def ensemble_row(docs: dict[str, dict[int, dict]]) -> Optional[dict[str, tuple[float, float]]]:
    """The clients' output ensemble (same clients for every strategy of a one-shot run): loss and
    accuracy on the report data, over seeds; None when no run recorded it."""
    loss, acc = _last_round(docs, "ensemble_loss"), _last_round(docs, "ensemble_acc")
    if not loss:
        return None
    return {"loss": _mean_se(list(loss.values())), "acc": _mean_se(list(acc.values()))}


def clients_rows(docs: dict[str, dict[int, dict]]) -> Optional[dict[str, tuple[float, float]]]:
    """The best single client's and the mean client's loss on the report data (last round, over seeds):
    what a user gets without merging."""
    losses = _last_round(docs, "client_losses")
    if not losses:
        return None
    best = {k: min(v) for k, v in sorted(losses.items())}
    mean = {k: sum(v) / len(v) for k, v in sorted(losses.items())}
    return {
        "best_client": _mean_se(list(best.values())),
        "mean_client": _mean_se(list(mean.values())),
        "best_client_per_seed": list(best.values()),
        "mean_client_per_seed": list(mean.values()),
    }


def _per_round(by_seed: dict[int, dict], key: str) -> list[float]:
    series = [[r[key] for r in doc["rounds"]] for doc in by_seed.values()]
    n = min(len(s) for s in series) if series else 0
    return [sum(s[i] for s in series) / len(series) for i in range(n)]


def markdown(
    setting: str,
    preset: str,
    rows: dict[str, Any],
    seeds: list[int],
    cfg: dict[str, Any],
    ensemble: Optional[dict[str, tuple[float, float]]] = None,
    clients: Optional[dict] = None,
) -> str:
    def ms(v: tuple[float, float], fmt: str = ".4f") -> str:
        return "–" if math.isnan(v[0]) else f"{v[0]:{fmt}} ± {v[1]:{fmt}}"

    lines = [
        f"### {setting}, {preset}: {', '.join(f'{k}={v}' for k, v in cfg.items())}; seeds {seeds}",
        "",
        "| strategy | final test loss | acc | excess over mean client | excess / baseline's "
        "| ensemble's gain recovered | worst round gap to baseline | s / round | s / aggregation | guard kept |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        gap = "–" if r["worst_gap_to_baseline"] is None else f"{r['worst_gap_to_baseline']:+.4f}"
        kept = ", ".join(f"{k} {v}" for k, v in sorted(r["kept"].items())) or "–"
        share = r.get("ensemble_recovered", (float("nan"), 0.0))
        lines.append(
            f"| {name} | {ms(r['final_loss'])} | {ms(r['final_acc'], '.3f')} | {ms(r['excess'])} | "
            f"{ms(r['excess_ratio'], '.3f')} | {ms(share, '.3f')} | {gap} | {ms(r['round_seconds'], '.1f')} | "
            f"{ms(r['aggregation_seconds'], '.2f')} | {kept} |"
        )
    if ensemble is not None:
        lines.append(
            f"| *output ensemble of the clients (reference, report data)* | {ms(ensemble['loss'])} | "
            f"{ms(ensemble['acc'], '.3f')} | | | 1 | | | | |"
        )
    if clients is not None and setting.startswith("widths"):
        for key, label in (("best_client", "best single client"), ("mean_client", "mean client")):
            per = ", ".join(f"{x:.3f}" for x in clients[f"{key}_per_seed"])
            lines.append(f"| *{label} (reference, report data; per seed {per})* | {ms(clients[key])} | | | | | | | | |")
    mine = {n: r for n, r in rows.items() if r.get("returned_loss")}
    if mine:
        lines += [
            "",
            "| strategy | the smaller clients' own models: test loss (last round) | per seed |",
            "|---|---|---|",
        ]
        for n, r in mine.items():
            per = ", ".join(f"{x:.4f}" for x in r["returned_loss_per_seed"])
            lines.append(f"| {n} | {ms(r['returned_loss'])} | {per} |")
    asked = {n: r for n, r in rows.items() if r.get("client_comm_per_fedavg_round") or r.get("guard_rounds")}
    if asked:
        lines += [
            "",
            "| strategy | refinement and distillation steps on the clients | bytes to and from the clients per round "
            "/ one FedAvg round's | s waiting for the clients per round | guard agrees with the report data |",
            "|---|---|---|---|---|",
        ]
        for n, r in asked.items():
            agree = "–" if r["guard_agreement"] is None else f"{r['guard_agreement']:.0%} of {r['guard_rounds']} rounds"
            comm, sec, steps = (
                r.get(k) or (float("nan"), 0.0)
                for k in ("client_comm_per_fedavg_round", "client_messaging_seconds", "client_refine_steps")
            )
            lines.append(f"| {n} | {ms(steps, '.0f')} | {ms(comm, '.1f')} | {ms(sec, '.1f')} | {agree} |")
    reach = {n: r["rounds_to_baseline_per_seed"] for n, r in rows.items() if r.get("rounds_to_baseline_per_seed")}
    lines += [
        "",
        "| strategy | excess over the mean client per seed (last round) "
        + ("| first round at the baseline's final loss, per seed (– never) |" if reach else "|"),
        "|---|---|" + ("---|" if reach else ""),
    ]
    for n, r in rows.items():
        excess = ", ".join(f"{x:+.3f}" for x in r["excess_per_seed"] or [])
        first = ", ".join("–" if x is None else str(x) for x in reach.get(n, [])) + " |" if reach else ""
        lines.append(f"| {n} | {excess} |" + (f" {first}" if reach else ""))
    return "\n".join(lines)


def plot(rows: dict[str, Any], path: Path, title: str) -> Path:
    """Loss and accuracy against the round; a one-round (one-shot) run gets bars of the final loss per
    strategy with each seed's value and the mean client loss instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    one_shot = all(len(r["per_round_loss"]) <= 2 for r in rows.values())
    if one_shot:
        names = list(rows)
        for i, name in enumerate(names):
            r = rows[name]
            axes[0].bar(i, r["final_loss"][0], yerr=r["final_loss"][1], color=f"C{i}", alpha=0.7, capsize=4)
            axes[0].scatter([i] * len(r["final_loss_per_seed"]), r["final_loss_per_seed"], color="k", s=12, zorder=3)
            axes[1].bar(i, r["excess"][0], yerr=r["excess"][1], color=f"C{i}", alpha=0.7, capsize=4)
            axes[1].scatter([i] * len(r["excess_per_seed"]), r["excess_per_seed"], color="k", s=12, zorder=3)
        for ax in axes:
            ax.set_xticks(range(len(names)), names)
        axes[0].set(ylabel="global test loss after aggregation", title=title)
        axes[1].set(ylabel="excess over the mean client loss")
        axes[1].axhline(0, color="grey", lw=0.8)
    else:
        for name, r in rows.items():
            axes[0].plot(range(len(r["per_round_loss"])), r["per_round_loss"], marker="o", label=name)
            axes[1].plot(range(len(r["per_round_acc"])), r["per_round_acc"], marker="o", label=name)
        axes[0].set(xlabel="round", ylabel="global test loss (mean over seeds)", title=title)
        axes[1].set(xlabel="round", ylabel="global test accuracy")
        for ax in axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=list(SETTINGS), default="oneshot")
    p.add_argument("--preset", default="vit-tiny")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument(
        "--strategies",
        nargs="+",
        help="default: the setting's (baseline first); any registered strategy (`fedlmc strategies`), "
        "NAME@REDUCE and NAME+SCREEN for its variants, NAME:KEY=VALUE for run_config keys of that row only "
        "(fedprox:proximal-mu=0.01)",
    )
    p.add_argument("--clients", type=int, help="number of SuperNodes (default: the setting's)")
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="run_config overrides, e.g. partitioner=iid"
    )
    p.add_argument("--runs", default="runs/compare", help="where each run's metrics and checkpoint go")
    p.add_argument("--out", default="results")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed")
    args = p.parse_args(argv)
    spec = SETTINGS[args.setting]
    strategies = args.strategies or spec["strategies"]
    for label in strategies:  # a typo fails here, before any run starts
        variant(label)
        row_config(label)
    extra = {}
    for kv in args.set:
        if "=" not in kv:
            raise SystemExit(f"--set expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        extra[k] = _parse_value(v)
    clients = args.clients or spec["clients"]
    docs = run_all(args.setting, args.preset, args.seeds, strategies, clients, extra, Path(args.runs), args.timeout)
    rows = summarise(docs, strategies[0])
    cfg = {**spec["config"], **extra, "clients": clients}
    ensemble, clients_ref = ensemble_row(docs), clients_rows(docs)
    md = markdown(args.setting, args.preset, rows, args.seeds, cfg, ensemble, clients_ref)
    suffix = "".join(
        f"_{k}-{v}"
        for k, v in sorted(extra.items())
        if k
        in (
            "partitioner",
            "alpha",
            "width-factors",
            "hf",
            "local-epochs",
            "local-steps",
            "clients-per-step",
            "refine-steps",
            "min-gain",
        )
    )
    if sorted(args.seeds) != [0, 1, 2]:  # other seeds get a file of their own, not the 3-seed table's
        suffix += "_seeds-" + "-".join(map(str, args.seeds))
    stem = f"compare_{args.setting}_{args.preset}{suffix}".replace(",", "-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    provenance.write(
        out / f"{stem}.json",
        {
            "setting": args.setting,
            "preset": args.preset,
            "seeds": args.seeds,
            "config": cfg,
            "rows": rows,
            "ensemble": ensemble,
            "clients": clients_ref,
        },
    )
    part = cfg.get("partitioner", "iid") + (f"({cfg['alpha']})" if cfg.get("partitioner") == "dirichlet" else "")
    png = plot(
        rows, out / f"{stem}.png", f"{args.setting}, {args.preset}, {part}, {clients} clients, seeds {args.seeds}"
    )
    print(md)
    console.print(f"wrote {out / (stem + '.json')}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
