"""Rerun the results files' cheap entries and compare every figure with its file.

    python -m simulations verify             # every cheap entry (about 7 minutes on 2 idle cores), then the table
    python -m simulations verify --quick     # the CI subset (the main job on seed 0, about 2.5 minutes)
    python -m simulations verify --only NAME --record   # one entry, even an expensive one; --record writes the
                                                  # verification into the results file's record

Each entry names its results file, the command that reruns a slice of it into a scratch folder, and the
figures compared: a key path in both documents and its tolerance, with why that tolerance (training and
matching are seeded, so a rerun on the same code is exact up to float summation order: the tolerance is
that; a figure that depends on timing is not compared). The table: file, figure, stored, rerun, within
tolerance. An entry too expensive to rerun here says how long it takes and what its file records of
its last verification by hand. Exit status 1 when a figure is outside its tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rich.console import Console
from rich.table import Table

from fedlmc import provenance

ROOT = Path(__file__).resolve().parents[1]
console = Console(width=160)

# a rerun on the same code is bitwise the same on one machine; across machines and thread counts float
# summation order moves a loss in its fourth decimal at most on these models
SEEDED = 2e-3


@dataclass(frozen=True)
class Entry:
    """A results file's rerunnable slice: ``command`` (``{out}``: the scratch folder, ``{cache}``: a
    fresh model cache) writes ``rerun`` under ``{out}``; ``figures(doc)`` reads the compared figures
    (name → value) from the stored file and from the rerun alike."""

    file: str
    command: str
    rerun: str
    figures: Callable[[dict], dict[str, float]]
    minutes: float
    tolerance: float = SEEDED
    why: str = "seeded training and matching: float summation order only"
    quick: bool = False
    env: dict[str, str] = field(default_factory=dict)


def _reproduce_pair(methods: list[str]) -> Callable[[dict], dict[str, float]]:
    def figures(doc: dict) -> dict[str, float]:
        pair = doc["per_pair"][0]
        out = {f"seed {s} test loss": doc["test"][s]["loss"] for s in ("0", "1")}
        out.update({f"pair (0, 1) {m} barrier": pair[m]["barrier"] for m in methods})
        return out

    return figures


def _main_job_seed0(doc: dict) -> dict[str, float]:
    s = doc["seeds"]["0"]
    out = {"seed 0 clients' mean test loss": s["mean_client_test_loss"]}
    out.update({f"seed 0 {n} test loss": v["test_loss"] for n, v in s["strategies"].items()})
    return out


def _ray_cluster(doc: dict) -> dict[str, float]:
    """What does not depend on timing: the merges' exactness against the sequential path, and every reply
    aligned on both cluster sizes (which node took how many moves with timing, so it is not compared)."""
    out = {"largest |Δ| vs the sequential merge": max(r["max_abs_diff_vs_sequential"] for r in doc["runs"])}
    for n in (1, 2):
        runs = [r for r in doc["runs"] if r["nodes"] == n]
        out[f"replies aligned per run, {n} node(s)"] = float(min(sum(r["replies_per_node"]) for r in runs))
        out[f"nodes used per run, {n} node(s)"] = float(min(len(r["replies_per_node"]) for r in runs))
    return out


WM = ["average", "wm-orth-factored"]
ENTRIES: dict[str, Entry] = {
    # the CI subset: make run's job on seed 0 (tests/test_simulation.py runs it and compares the same way)
    "main-job-seed0": Entry(
        "main_job.json",
        "python simulations/main_job.py --seeds 0 --runs {cache}/main_job --out {out}/main_job",
        "main_job.json",
        _main_job_seed0,
        minutes=2.5,
        quick=True,
    ),
    "reproduce-vit-tiny-wm": Entry(
        "reproduce_vit-tiny.json",
        "fedlmc reproduce --preset vit-tiny --pairs 1 --methods " + " ".join(WM) + " --out {out} --cache {cache}",
        "reproduce_vit-tiny.json",
        _reproduce_pair(WM),
        minutes=1.5,
    ),
    "ray-cluster": Entry(
        "bench_ray_cluster.json",
        "python -m simulations ray_cluster --repeats 1 --spool {cache} --out {out}/bench_ray_cluster.json",
        "bench_ray_cluster.json",
        _ray_cluster,
        minutes=2.5,
        tolerance=1e-10,
        why="the merges are exact against the sequential path; the counts are whole numbers",
    ),
}


def run_entry(name: str, entry: Entry, scratch: Path, results: Path = ROOT / "results") -> tuple[list[tuple], float]:
    """Rerun ``entry`` into ``scratch``; its rows (file, figure, stored, rerun, within) and the seconds."""
    out, cache = scratch / name / "out", scratch / name / "cache"
    out.mkdir(parents=True)
    argv = shlex.split(entry.command.format(out=out, cache=cache))
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "fedlmc":
        argv[0] = str(Path(sys.executable).with_name("fedlmc"))
    console.print(f"[bold]{name}[/bold]: {entry.command}  (about {entry.minutes:g} min)")
    t0 = time.time()
    proc = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, **entry.env}, capture_output=True, text=True, timeout=entry.minutes * 600
    )
    seconds = time.time() - t0
    if proc.returncode != 0:
        console.print((proc.stdout + proc.stderr)[-2000:], markup=False)
        return [(entry.file, "the rerun", "—", f"failed ({proc.returncode})", False)], seconds
    return compare(entry, json.loads((out / entry.rerun).read_text()), results), seconds


def compare(entry: Entry, rerun: dict, results: Path = ROOT / "results") -> list[tuple]:
    """The rows (file, figure, stored, rerun, within tolerance) of ``rerun`` against ``entry``'s file."""
    stored = entry.figures(json.loads((results / entry.file).read_text()))
    again = entry.figures(rerun)
    return [(entry.file, k, v, again[k], abs(again[k] - v) <= entry.tolerance) for k, v in stored.items()]


def record_verification(entry: Entry, rows: list[tuple], seconds: float) -> None:
    """Write the verification into the results file's record (``provenance.verified``)."""
    path = ROOT / "results" / entry.file
    doc = json.loads(path.read_text())
    head = provenance.commit()
    doc["provenance"]["verified"] = {
        "command": entry.command,
        "commit": head["commit"],
        "date": provenance.record()["date"],
        "seconds": round(seconds, 1),
        "tolerance": entry.tolerance,
        "figures": len(rows),
        "within": all(r[4] for r in rows),
    }
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False))


def main(argv: Optional[list[str]] = None) -> int:
    provenance.watch()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="only the CI subset (under 3 minutes)")
    p.add_argument("--only", nargs="+", choices=sorted(ENTRIES), help="these entries, cheap or not")
    p.add_argument("--record", action="store_true", help="write each verification into its results file")
    args = p.parse_args(argv)
    names = args.only or [n for n, e in ENTRIES.items() if e.quick or not args.quick]
    table = Table(title="results files against a rerun")
    for col in ("file", "figure", "stored", "rerun", "within tolerance"):
        table.add_column(col)
    failed = False
    with tempfile.TemporaryDirectory(prefix="fedlmc-verify-") as scratch:
        for name in names:
            entry = ENTRIES[name]
            rows, seconds = run_entry(name, entry, Path(scratch))
            for file, figure, stored, again, ok in rows:
                verdict = "yes" if ok else f"[red]no[/red] (± {entry.tolerance:g}: {entry.why})"
                table.add_row(file, figure, _fmt(stored), _fmt(again), verdict)
                failed |= not ok
            console.print(f"  {len(rows)} figures in {seconds:.0f} s")
            if args.record:
                record_verification(entry, rows, seconds)
    console.print(table)
    if not args.only and not args.quick:
        console.print(by_hand())
    return 1 if failed else 0


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def by_hand() -> Table:
    """The results files no cheap entry reruns: the command that remakes each, and its last verification."""
    covered = {e.file for e in ENTRIES.values()}
    table = Table(title="verified by hand (too long to rerun here)")
    for col in ("file", "command", "last verified"):
        table.add_column(col)
    for path in sorted((ROOT / "results").rglob("*.json")):
        name = str(path.relative_to(ROOT / "results"))
        if name in covered:
            continue
        prov = json.loads(path.read_text()).get("provenance", {})
        v = prov.get("verified")
        said = f"{v['date'][:10]}, {'within' if v['within'] else 'OUTSIDE'} tolerance" if v else "never"
        table.add_row(name, prov.get("command", "unknown"), said)
    return table


if __name__ == "__main__":
    raise SystemExit(main())
