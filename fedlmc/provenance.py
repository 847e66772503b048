"""How a results file was made: the record every bench, comparison and ``fedlmc`` command writes beside its
figures, so that a reader can trust a number or rerun it.

    from fedlmc import provenance

    provenance.watch()                       # first thing in a run: starts sampling the machine's load
    ...
    doc["provenance"] = provenance.record(seeds=[0, 1, 2])

The record's fields: ``command`` (the command line that reproduces the file), ``commit`` (with ``dirty``
and, when dirty, ``diff_sha256``: the hash of ``git diff HEAD`` outside ``results/``), ``date`` (UTC),
``versions`` (python, torch, flwr, transformers, peft), ``host`` (CPU model, cores, threads, torch's
threads, the device a fedlmc path picks, the GPU), ``load`` (the 1-minute load average and the share of
the machine's CPU that other processes used, sampled through the run), ``seeds`` and ``wall_seconds``.
A field nobody recorded is ``"unknown"``, and ``reason`` then says why (``validate`` checks both).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Optional

import psutil
import torch

FIELDS = ("command", "commit", "date", "versions", "host", "load", "seeds", "wall_seconds")
PACKAGES = ("python", "torch", "flwr", "transformers", "peft")
LOAD_FIELDS = ("samples", "every_seconds", "loadavg_mean", "loadavg_max", "others_cpu_mean", "others_cpu_max")
HOST_FIELDS = ("cpu", "cores", "threads", "torch_threads", "device")
UNKNOWN = "unknown"
COMMIT = re.compile(r"[0-9a-f]{40}")
# what a trained model depends on (the model cache's key hashes it), and what a federated run does
TRAINING_CODE = ("fedlmc/train.py", "fedlmc/models", "fedlmc/data")
FEDERATION_CODE = ("fedlmc", "server", "clients", "simulations")
_REUSED: list[str] = []
SCRIPTS = ("fedlmc", "flwr", "pytest")  # console scripts a command line names by their own name


def code_hash(parts: Iterable[str] = TRAINING_CODE) -> str:
    """The SHA-256 of the Python sources under ``parts`` (paths from the folder that holds the ``fedlmc``
    package; those absent, as the apps beside an installed wheel, are skipped), with torch's version:
    a cache keyed by it never serves what other code computed."""
    root = Path(__file__).resolve().parents[1]
    files = []
    for part in parts:
        path = root / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []
    stats = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    return _hashed(str(root), stats)  # read again only when a file changed (a pair cache asks per subset)


@functools.lru_cache(maxsize=16)
def _hashed(root: str, stats: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for name, _, _ in stats:
        f = Path(name)
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def reused(entry: "str | Path") -> None:
    """Note that this run read ``entry`` from a cache instead of computing it: the next record names it."""
    if str(entry) not in _REUSED:
        _REUSED.append(str(entry))


class LoadWatch:
    """Samples, every ``every`` seconds in a daemon thread, the 1-minute load average and the share of the
    machine's CPU (0 to 1) that processes other than this one and its children used since the last
    sample."""

    def __init__(self, every: float = 1.0) -> None:
        self.every, self.started = every, time.time()
        self.loadavg: list[float] = []
        self.others: list[float] = []
        self.me = psutil.Process()
        self.cpus = psutil.cpu_count() or 1
        self._stop = threading.Event()
        self._last = (self.started, 0.0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _own_seconds(self) -> float:
        total = 0.0
        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
        return total

    def _run(self) -> None:
        psutil.cpu_percent(interval=None)
        self._last = (time.time(), self._own_seconds())
        while not self._stop.wait(self.every):
            busy = psutil.cpu_percent(interval=None) / 100.0  # of all the machine's CPUs
            self.sample(time.time(), self._own_seconds(), busy, os.getloadavg()[0])

    def sample(self, now: float, own: float, busy: float, loadavg: float) -> None:
        """One sample: at ``now``, this process tree has used ``own`` CPU seconds in all and the machine is
        ``busy`` (0 to 1 of all its CPUs) since the last sample; the others' share is the difference."""
        last_t, last_own = self._last
        mine = max(0.0, own - last_own) / max(1e-9, (now - last_t) * self.cpus)
        self.others.append(min(1.0, max(0.0, busy - mine)))
        self.loadavg.append(loadavg)
        self._last = (now, own)

    def summary(self) -> dict[str, Any]:
        """The samples so far (at least one: the load now, when the run was shorter than a sample)."""
        loadavg = self.loadavg or [os.getloadavg()[0]]
        others = self.others or [max(0.0, psutil.cpu_percent(interval=0.1) / 100.0)]
        return {
            "samples": len(self.loadavg),
            "every_seconds": self.every,
            "loadavg_mean": round(sum(loadavg) / len(loadavg), 3),
            "loadavg_max": round(max(loadavg), 3),
            "others_cpu_mean": round(sum(others) / len(others), 3),
            "others_cpu_max": round(max(others), 3),
        }

    def stop(self) -> None:
        self._stop.set()


_WATCH: Optional[LoadWatch] = None


def watch(every: float = 1.0) -> LoadWatch:
    """Start sampling the load for this run's record (once per process; later calls return the same)."""
    global _WATCH
    if _WATCH is None:
        _WATCH = LoadWatch(every)
    return _WATCH


def command_line(argv: Optional[list[str]] = None) -> str:
    """The command that started this process, as a user types it (``python -m simulations.x --a 1``)."""
    argv = list(argv if argv is not None else getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    if len(argv) > 1 and Path(argv[0]).name.startswith("python") and Path(argv[1]).name in SCRIPTS:
        argv = argv[1:]  # a console script: python /venv/bin/fedlmc ... is `fedlmc ...`
    if argv and Path(argv[0]).name.startswith("python"):
        argv[0] = "python"
    elif argv and Path(argv[0]).name in SCRIPTS:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=True).stdout


def commit(root: Optional[Path] = None) -> dict[str, Any]:
    """The commit of the checkout that holds ``root`` (default: the one this ``fedlmc`` package runs
    from, wherever the command was started), whether it differs from it outside ``results/`` (``dirty``)
    and then the hash of that difference; ``commit: "unknown"`` with the reason outside a git checkout
    (a wheel's install)."""
    root = Path(root or Path(__file__).resolve().parents[1])
    try:
        sha = _git("rev-parse", "HEAD", cwd=root).strip()
        diff = _git("diff", "HEAD", "--", ":(top)", ":(top,exclude)results", cwd=root)
    except (OSError, subprocess.SubprocessError) as e:
        return {"commit": UNKNOWN, "dirty": False, "reason": f"not a git checkout ({type(e).__name__})"}
    out: dict[str, Any] = {"commit": sha, "dirty": bool(diff)}
    if diff:
        out["diff_sha256"] = hashlib.sha256(diff.encode()).hexdigest()
    return out


def versions() -> dict[str, str]:
    """python's version and the installed torch, flwr, transformers and peft ("absent": not installed)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES[1:]:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def host() -> dict[str, Any]:
    """The CPU model, its cores and threads, torch's threads, the device a fedlmc path picks and the GPU."""
    from fedlmc.scale.cpu import cpu_model
    from fedlmc.train import pick_device

    out = {
        "cpu": cpu_model() or platform.processor() or platform.machine(),
        "cores": psutil.cpu_count(logical=False) or psutil.cpu_count(),
        "threads": psutil.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(pick_device()),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def record(seeds: Iterable[int] = (), command: Optional[str] = None, **extra: Any) -> dict[str, Any]:
    """The provenance record of a results file written now: ``seeds`` the run used, ``command`` (default:
    this process's command line); ``reused``: the cache entries the run read (``reused()``); ``extra``
    fields are kept."""
    w = watch()
    started = psutil.Process().create_time()
    return {
        "command": command or command_line(),
        **commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": versions(),
        "host": host(),
        "load": w.summary(),
        "seeds": [int(s) for s in seeds],
        "wall_seconds": round(time.time() - started, 1),
        **({"reused": list(_REUSED)} if _REUSED else {}),
        **extra,
    }


def unknown(reason: str, command: str = UNKNOWN, **known: Any) -> dict[str, Any]:
    """The record of a file whose making nobody recorded: every field ``"unknown"`` but those ``known``
    from the file itself (never guessed), with ``reason``."""
    return {**{f: UNKNOWN for f in FIELDS}, "command": command, **known, "reason": reason}


def validate(prov: Any) -> list[str]:
    """What is wrong with a provenance record (empty: nothing)."""
    if not isinstance(prov, dict):
        return ["no provenance record"]
    problems = [f"no '{f}'" for f in FIELDS if f not in prov]
    if problems:
        return problems
    unknowns = [f for f in FIELDS if prov[f] == UNKNOWN]
    if unknowns and not (isinstance(prov.get("reason"), str) and prov["reason"]):
        problems.append(f"{unknowns} unknown without a reason")
    if not isinstance(prov["command"], str) or not prov["command"]:
        problems.append("command is not a command line")
    if prov["commit"] != UNKNOWN and not COMMIT.fullmatch(str(prov["commit"])):
        problems.append(f"commit {prov['commit']!r} is not a commit id")
    if prov["commit"] != UNKNOWN and (prov.get("dirty") is True) != ("diff_sha256" in prov):
        problems.append("a dirty checkout's record needs diff_sha256 (and a clean one has none)")
    if prov["date"] != UNKNOWN and not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", str(prov["date"])):
        problems.append(f"date {prov['date']!r} is not UTC ISO 8601")
    checks = {
        "versions": lambda v: isinstance(v, dict) and all(isinstance(v.get(p), str) for p in PACKAGES),
        "host": lambda v: isinstance(v, dict) and all(k in v for k in HOST_FIELDS),
        "load": lambda v: isinstance(v, dict) and all(isinstance(v.get(k), (int, float)) for k in LOAD_FIELDS),
        "seeds": lambda v: isinstance(v, list) and all(isinstance(s, int) for s in v),
        "wall_seconds": lambda v: isinstance(v, (int, float)) and v >= 0,
    }
    for name, ok in checks.items():
        if prov[name] != UNKNOWN and not ok(prov[name]):
            problems.append(f"{name} is malformed: {prov[name]!r}")
    return problems


def conditions(prov: dict[str, Any]) -> str:
    """One line for a table's foot: the commit, the date, the machine and the load it ran under."""
    if prov.get("commit", UNKNOWN) == UNKNOWN:
        return "Commit, versions and load unknown: made before results files recorded them."
    sha = prov["commit"][:10] + ("+local changes" if prov.get("dirty") else "")
    h, load = prov["host"], prov["load"]
    return (
        f"Commit {sha}, {prov['date'][:10]}, {h['cores']} cores ({h['cpu']}, {h['device']}), "
        f"load {load['loadavg_mean']:.1f}, other processes {100 * load['others_cpu_mean']:.0f} % CPU, "
        f"{prov['wall_seconds']:.0f} s."
    )


def seeds_of(doc: dict[str, Any]) -> list[int]:
    """The seeds a results document names itself (``seeds``, or ``seed``), else none."""
    seeds = doc.get("seeds", [doc["seed"]] if isinstance(doc.get("seed"), int) else [])
    if isinstance(seeds, dict):  # per-seed results keyed by the seed
        seeds = [int(k) for k in seeds if str(k).isdigit()]
    return [int(s) for s in seeds] if isinstance(seeds, list) and all(isinstance(s, int) for s in seeds) else []


def write(path: "str | Path", doc: dict[str, Any], seeds: Optional[Iterable[int]] = None, **extra: Any) -> Path:
    """Write ``doc`` as JSON to ``path`` with its provenance record (``seeds``: default, those ``doc`` names;
    ``extra``: more record fields, such as ``reused``); returns the path."""
    import json

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    prov = record(seeds if seeds is not None else seeds_of(doc), **extra)
    out.write_text(json.dumps({**doc, "provenance": prov}, indent=1, default=float))
    return out
