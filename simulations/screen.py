"""Screening poisoned replies modulo symmetries against Flower's Krum / Multi-Krum on raw coordinates.

    python -m simulations.screen [--settings screen screen-flip screen-multiround] [--seeds 0 1 2]

Runs the comparison runner's screening settings (vit-tiny, 5 clients, partition 4 poisoned: shuffled
labels or a ×4 sign flip; independently started one-shot clients, or 5 rounds from a shared init) for
``aligned@median`` (the robust aggregate, no screen), ``aligned+distance`` / ``aligned@median+distance``
(the distance screen, then the mean / the median of the rest), ``aligned+loss`` /
``aligned@median+loss`` (the loss screen on the server's guard split), ``aligned+agreement`` /
``aligned@median+agreement`` (the agreement screen on the guard split's inputs), ``aligned+information`` /
``aligned@median+information`` (the mutual information of the replies' predictions on those inputs),
``aligned+krum`` (Krum's score among the aligned replies, f = 1), Flower's ``krum`` / ``multikrum`` on
the raw replies (f = 1; Krum keeps one reply, Multi-Krum all but f), and the screens before a
refinement: ``refined`` (no screen), ``refined+distance`` / ``refined+information`` (the screen, then the
refinement on the server's data, kept replies only) and ``refined-clients+distance`` (the refinement
computed by the kept clients). For each: how often the poisoned client's reply was excluded
(detection, per round), how often an honest one was (false exclusions, per honest reply and round),
and the final test loss. Writes ``results/screen_<setting>.json`` and prints a table per setting.
Finished runs are reused from ``--runs``; with ``--strategies``, the results file keeps its other rows.
``--table`` prints the results files' tables in Markdown (the results page's) and runs nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedlmc import provenance
from fedlmc.scale.cpu import cpu_model

from .compare import SETTINGS, _mean_se, run_all

console = Console(stderr=True)
SCREEN_SETTINGS = ("screen", "screen-flip", "screen-multiround")


def screened_out(rnd: dict) -> set[str]:
    """The nodes a round left out as outliers (the screen, or Krum's selection), not for invalid replies."""
    rec = rnd.get("strategy") or {}
    return {str(n) for n in (rec.get("screen") or {}).get("excluded", [])}


def detection(docs: dict[int, dict], poisoned: int) -> dict[str, Any]:
    """Detection and false-exclusion rates of one strategy's runs (over seeds and rounds)."""
    caught = rounds = honest_out = honest = 0
    per_seed = {}
    for seed, doc in docs.items():
        hits = []
        for rnd in doc["rounds"][1:]:
            rec = rnd.get("strategy") or {}
            parts = rec.get("partitions") or {}
            if not parts:
                continue
            out = screened_out(rnd)
            bad = {n for n, p in parts.items() if p == poisoned}
            good = set(parts) - bad
            rounds += 1
            caught += bool(bad & out)
            honest += len(good)
            honest_out += len(good & out)
            hits.append(bool(bad & out))
        per_seed[seed] = {
            "caught": hits,
            "final_loss": doc["rounds"][-1]["test_loss"],
            "final_acc": doc["rounds"][-1]["test_acc"],
        }
    return {
        "detection_rate": caught / rounds if rounds else None,
        "false_exclusion_rate": honest_out / honest if honest else None,
        "rounds": rounds,
        "honest_replies": honest,
        "final_loss": _mean_se([d["final_loss"] for d in per_seed.values()]),
        "final_acc": _mean_se([d["final_acc"] for d in per_seed.values()]),
        "per_seed": per_seed,
    }


LABELS = {  # the results page's names for the strategies
    "aligned@median": "aligned, median (no screen)",
    "aligned+distance": "aligned + distance screen, mean",
    "aligned@median+distance": "aligned + distance screen, median",
    "aligned+loss": "aligned + loss screen, mean",
    "aligned@median+loss": "aligned + loss screen, median",
    "aligned+agreement": "aligned + agreement screen, mean",
    "aligned@median+agreement": "aligned + agreement screen, median",
    "aligned+information": "aligned + information screen, mean",
    "aligned@median+information": "aligned + information screen, median",
    "aligned+krum": "aligned + Krum screen (f = 1), mean",
    "krum": "Flower's Krum, raw (keeps 1)",
    "multikrum": "Flower's Multi-Krum, raw (keeps 4)",
    "refined": "refined (no screen)",
    "refined+distance": "distance screen, then refined",
    "refined+information": "information screen, then refined",
    "refined-clients+distance": "distance screen, then refined on the clients (no server data)",
}


def markdown(doc: dict) -> str:
    """A results file's table in Markdown, one row per strategy (the results page's table)."""
    rate = lambda x: "–" if x is None else f"{x:.0%}"  # noqa: E731
    lines = [
        "| strategy | poisoned client excluded | honest replies excluded | final test loss | acc | per seed |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in doc["rows"].items():
        per_seed = {str(k): v for k, v in r["per_seed"].items()}  # JSON's keys are strings
        seeds = ", ".join(f"{per_seed[str(k)]['final_loss']:.3f}" for k in doc["seeds"] if str(k) in per_seed)
        lines.append(
            f"| {LABELS.get(name, name)} (`{name}`) | {rate(r['detection_rate'])} of {r['rounds']} rounds | "
            f"{rate(r['false_exclusion_rate'])} of {r['honest_replies']} | {r['final_loss'][0]:.3f} ± "
            f"{r['final_loss'][1]:.3f} | {r['final_acc'][0]:.3f} | {seeds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", choices=SCREEN_SETTINGS, default=list(SCREEN_SETTINGS))
    p.add_argument("--preset", default="vit-tiny")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--strategies", nargs="+", help="default: the setting's")
    p.add_argument("--runs", default="runs/compare")
    p.add_argument("--out", default="results")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--table", action="store_true", help="print the results files' tables in Markdown; run nothing")
    args = p.parse_args(argv)
    if args.table:
        for setting in args.settings:
            print(markdown(json.loads((Path(args.out) / f"screen_{setting}.json").read_text())) + "\n")
        return 0
    for setting in args.settings:
        spec = SETTINGS[setting]
        strategies = args.strategies or spec["strategies"]
        docs = run_all(setting, args.preset, args.seeds, strategies, spec["clients"], {}, Path(args.runs), args.timeout)
        poisoned = spec["config"]["poison-partition"]
        rows = {name: {**detection(by_seed, poisoned), "processor": cpu_model()} for name, by_seed in docs.items()}
        path = Path(args.out) / f"screen_{setting}.json"
        if args.strategies and path.is_file():  # a few strategies re-run: keep the file's other rows
            old = json.loads(path.read_text())
            if old.get("seeds") == args.seeds and old.get("config") == spec["config"]:
                rows = {**{k: v for k, v in old["rows"].items() if k not in rows}, **rows}
        doc = {
            "setting": setting,
            "preset": args.preset,
            "seeds": args.seeds,
            "clients": spec["clients"],
            "config": spec["config"],
            "rows": rows,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        provenance.write(path, doc)
        table = Table(title=f"{setting}, {args.preset}: {spec['config']}")
        for col in ("strategy", "poisoned client caught", "honest excluded", "final test loss", "acc"):
            table.add_column(col)
        for name, r in rows.items():
            rate = lambda x: "–" if x is None else f"{x:.0%}"  # noqa: E731
            table.add_row(
                name,
                f"{rate(r['detection_rate'])} of {r['rounds']} rounds",
                f"{rate(r['false_exclusion_rate'])} of {r['honest_replies']}",
                f"{r['final_loss'][0]:.3f} ± {r['final_loss'][1]:.3f}",
                f"{r['final_acc'][0]:.3f}",
            )
        Console().print(table)
        console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
