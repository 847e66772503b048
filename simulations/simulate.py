"""Run one federation in-process on Flower's Ray simulation engine (``flwr.simulation.run_simulation``),
with settings given in Python rather than ``pyproject.toml`` — what the comparison runner and the tests
use. They run the production apps (``clients.app``, ``server.app``) with the experiment layer's settings
(``simulations.experiment``); ``flwr run .`` runs the production apps alone."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional


def ray_env() -> None:
    """Keep Ray's socket paths short (AF_UNIX paths are limited to ~107 bytes), telemetry off, and its
    workers at normal priority."""
    if not os.environ.get("RAY_TMPDIR"):
        path = Path(tempfile.gettempdir()) / f"ray-{os.getuid()}"
        if len(str(path)) > 40:
            path = Path("/tmp") / f"ray-{os.getuid()}"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["RAY_TMPDIR"] = str(path)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray starts its workers (the ClientApp actors) at nice 15: beside any ordinary job they get a few
    # per cent of a core
    os.environ.setdefault("RAY_worker_niceness", "0")
    # the apps' packages (clients, server, strategies, simulations) live in the checkout, not in
    # site-packages: Ray's workers import them from here
    root = str(Path(__file__).resolve().parents[1])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


def simulate(
    settings: dict[str, Any],
    num_supernodes: int = 2,
    cpus_per_client: float = 1.0,
    gpus_per_client: float = 0.0,
    total_cpus: Optional[int] = None,
    verbose: bool = False,
    after_round: Optional[Callable[[int], None]] = None,
) -> dict[str, Any]:
    """Run the federation ``settings`` (run_config keys) on ``num_supernodes`` virtual SuperNodes; returns
    the metrics document the ServerApp wrote (``<out-dir>/metrics.json``). ``after_round``: see
    ``server_app.run_federation``."""
    from flwr.simulation import run_simulation

    from simulations.experiment import ExperimentSettings, client_app, server_app

    s = ExperimentSettings.from_run_config(settings)  # fail fast on a bad key, before Ray starts
    ray_env()
    backend = {
        "client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client},
        "init_args": {"num_cpus": total_cpus or os.cpu_count() or 1, "include_dashboard": False},
    }
    run_simulation(
        server_app=server_app(settings, after_round),
        client_app=client_app(settings),
        num_supernodes=num_supernodes,
        backend_config=backend,
        verbose_logging=verbose,
    )
    path = Path(s.out_dir).expanduser() / "metrics.json"
    if not path.is_file():
        raise RuntimeError(f"the simulation wrote no {path}: see the log above for the ServerApp's error")
    doc = json.loads(path.read_text())
    if "finished" not in doc:
        raise RuntimeError(f"the simulation stopped before its last round: {path} has {len(doc['rounds'])} records")
    return doc


def run_in_subprocess(
    settings: dict[str, Any],
    num_supernodes: int = 2,
    timeout: float = 600,
    cpus_per_client: float = 1.0,
    log_path: Optional[Path] = None,
    env: Optional[dict[str, str]] = None,
    script: Optional[Path] = None,
) -> dict[str, Any]:
    """``simulate`` in a fresh Python process, killed after ``timeout`` seconds (Ray never outlives it,
    a crashed run never hangs the caller). Returns the metrics document. ``script``: a Python file to
    run instead of this module's ``main`` (same arguments)."""
    import signal
    import subprocess
    import sys

    entry = [str(script)] if script is not None else ["-m", "simulations.simulate"]
    cmd = [
        sys.executable,
        *entry,
        "--settings",
        json.dumps(settings),
        "--supernodes",
        str(num_supernodes),
        "--cpus-per-client",
        str(cpus_per_client),
    ]
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[1],
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        # whatever happened, nothing of the run (Ray workers included) outlives it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if log_path:
            out.close()
    if code is None:
        raise RuntimeError(f"simulation did not finish within {timeout:.0f} s (log: {log_path})")
    if code != 0:
        raise RuntimeError(f"simulation failed with exit code {code} (log: {log_path})")
    return json.loads((Path(settings.get("out-dir", "runs/flwr")).expanduser() / "metrics.json").read_text())


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Run one fedlmc federation on the Ray simulation engine.")
    p.add_argument(
        "--settings", default="{}", help="JSON object of run_config keys (see pyproject [tool.flwr.app.config])"
    )
    p.add_argument("--supernodes", type=int, default=2)
    p.add_argument("--cpus-per-client", type=float, default=1.0)
    p.add_argument("--gpus-per-client", type=float, default=0.0)
    args = p.parse_args(argv)
    doc = simulate(json.loads(args.settings), args.supernodes, args.cpus_per_client, args.gpus_per_client)
    if doc.get("comparison") is not None:  # a side-by-side comparison: its summary.json
        summary = json.loads((Path(doc["settings"]["out-dir"]).expanduser() / "summary.json").read_text())
        print(
            json.dumps(
                {k: {"test_loss": v["test_loss"], "test_acc": v["test_acc"]} for k, v in summary["strategies"].items()}
            )
        )
        return 0
    last = doc["rounds"][-1]
    print(json.dumps({"rounds": len(doc["rounds"]) - 1, "test_loss": last["test_loss"], "test_acc": last["test_acc"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
