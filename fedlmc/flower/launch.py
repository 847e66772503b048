"""``flwr run`` that tells you when the ServerApp failed.

``flwr run . --stream`` exits 0 even when the ServerApp raised: the failure is only in the streamed
log and in the run's status on the SuperLink (``finished:failed``). This wrapper runs ``flwr run``
with ``--stream``, passes its output through, then asks the SuperLink (``flwr ls --run-id``) how the
run ended and exits non-zero unless it completed::

    fedlmc run APP_DIR [SUPERLINK] [flwr run options...]      # any Flower app
    python -m fedlmc.flower.launch APP_DIR [SUPERLINK] [flwr run options...]

A local SuperLink that ``flwr run`` started for this run (``flwr run .`` without a SuperLink of
one's own) is stopped when the run ends. The app is handed to ``flwr run`` as a copy of the files
its FAB can hold (``staged_app``): Flower walks the whole app folder, a virtual environment inside it
included, file by file, before it drops what ``.gitignore`` names. It sets what a run on a shared
machine needs unless the environment says otherwise: no runtime dependency install by the SuperLink
(it would fetch a CUDA torch), short Ray socket paths, telemetry off, Ray workers at normal
priority. It is what ``make run`` and the deployment tests use.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator, Optional

RUN_ID = re.compile(r"run_id `?(\d+)`?")


def free_ports(span: int = 1) -> int:
    """The first of ``span`` consecutive loopback ports that are free (for a local SuperLink and its
    SuperNodes, ``deploy/start.sh``'s PORT and NODE_PORT), picked at random below the ephemeral range:
    a port the kernel hands out (``bind(0)``) is one that any process's outgoing connection may take
    as its source port before the SuperLink or SuperNode binds it."""
    try:  # Linux; elsewhere the usual default
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # seeded from the OS: processes that look at once pick apart
    for _ in range(200):
        base = rng.randrange(10000, low - span)
        socks = [socket.socket() for _ in range(span)]
        try:
            for s, p in zip(socks, range(base, base + span)):
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {span} consecutive free ports below {low}")


def run_status(run_id: int, superlink: Optional[str], timeout: float = 60) -> str:
    """The SuperLink's status of run ``run_id`` as ``status:sub-status`` (e.g. ``finished:completed``)."""
    cmd = ["flwr", "ls", *([superlink] if superlink else []), "--run-id", str(run_id), "--format", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    try:
        runs = json.loads(out[out.index("{") :]).get("runs", [])
    except ValueError:
        return "unknown"
    return str(runs[0].get("status", "unknown")) if runs else "unknown"


def _superlink(args: list[str]) -> Optional[str]:
    """The SuperLink connection named on the command line (the positional after the app), if any."""
    positional = [a for a in args if not a.startswith("-")]
    # flags with a value (-c/--run-config, --federation-config) leave their value as a positional too
    values = {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-c", "--run-config", "--federation-config")}
    rest = [a for a in positional if a not in values]
    return rest[1] if len(rest) > 1 else None


def local_superlinks(flwr_home: Path) -> set[int]:
    """Pids of the local SuperLinks ``flwr run`` started for this Flower home."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    mark = str(flwr_home / "local-superlink")
    return {int(line.split()[0]) for line in ps.splitlines() if "flower-superlink" in line and mark in line}


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    ps = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    children: dict[int, list[int]] = {}
    for child, parent in zip(ps[::2], ps[1::2]):
        children.setdefault(int(parent), []).append(int(child))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to every process of ``pids``, skipping those that have exited since they were listed."""
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it at once (a crash, not a shutdown)."""
    signal_all(process_tree(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def stop_tree(pid: int, grace: float = 1.0) -> None:
    """Stop ``pid`` and every process below it (SuperExec, simulation, ClientApp processes): SIGTERM,
    then SIGKILL for whatever is still there after ``grace`` seconds."""
    tree = process_tree(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        signal_all(tree, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            tree = [p for p in tree if _alive(p)]
            if not tree:
                return
            time.sleep(0.05)


def launch(args: list[str], timeout: Optional[float] = None) -> int:
    """Run ``flwr run ARGS --stream``; 0 only if the SuperLink reports the run completed. A local
    SuperLink that this run started is stopped afterwards, so nothing outlives the command and another
    checkout's run never lands on it."""
    home = Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr")).expanduser().resolve()
    before = local_superlinks(home)
    # a local SuperLink started by ``flwr run`` runs the simulation with this environment: ClientApp
    # actors at normal priority, not Ray's nice 15; no dependency install; Ray's socket paths short
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    if not os.environ.get("RAY_TMPDIR"):
        os.environ["RAY_TMPDIR"] = f"/tmp/ray-{os.getuid()}"
        Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    try:
        local_app = bool(args) and (Path(args[0]) / "pyproject.toml").is_file()
        with staged_app(Path(args[0])) if local_app else nullcontext() as app:
            return _run_and_check([str(app), *args[1:]] if app is not None else args, timeout)
    finally:
        for pid in local_superlinks(home) - before:
            stop_tree(pid)


@contextmanager
def staged_app(app: Path) -> Iterator[Path]:
    """A temporary folder holding the files of the Flower app in ``app`` that its FAB will hold, chosen
    by Flower's own rules (``.gitignore``, the publish rules, ``fab-include`` / ``fab-exclude``), with
    the folders ``.gitignore`` ignores skipped rather than walked. Removed when the block ends."""
    import tomli
    from flwr.cli.build import get_filtered_fab_paths
    from flwr.cli.utils import build_pathspec, filter_paths_for_publish, load_gitignore_patterns

    app = app.expanduser().resolve()
    ignore_file = app / ".gitignore"
    ignored = build_pathspec(tuple(load_gitignore_patterns(ignore_file.read_bytes() if ignore_file.is_file() else b"")))
    files: dict[str, Path] = {}
    for folder, dirs, names in os.walk(app):
        rel = Path(folder).relative_to(app)
        dirs[:] = [d for d in dirs if not ignored.match_file((rel / d).as_posix() + "/")]
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink():  # Flower's walk skips them too
                files[(rel / name).as_posix()] = path
    files = filter_paths_for_publish(files)
    keep = get_filtered_fab_paths(files, tomli.loads((app / "pyproject.toml").read_text()))
    stage = Path(tempfile.mkdtemp(prefix="fedlmc-app-"))
    try:
        for rel in ["pyproject.toml", *keep]:
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(files[rel], stage / rel)
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _submit(args: list[str], timeout: Optional[float]) -> tuple[int, Optional[int]]:
    """``flwr run ARGS --stream`` with its output passed through: (exit code, run id if one was made)."""
    proc = subprocess.Popen(
        ["flwr", "run", *args, "--stream"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    run_id = None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        match = RUN_ID.search(line)
        if run_id is None and match:
            run_id = int(match.group(1))
    return proc.wait(timeout=timeout), run_id


def _run_and_check(args: list[str], timeout: Optional[float], attempts: int = 3) -> int:
    for attempt in range(attempts):
        code, run_id = _submit(args, timeout)
        # No run id: nothing was submitted (on a loaded machine the CLI's 0.4 s probe of its local
        # SuperLink can time out and it gives up), so trying again cannot run anything twice.
        if code == 0 or run_id is not None or attempt == attempts - 1:
            break
        print(
            f"fedlmc: flwr run exited {code} before submitting a run; trying again ({attempt + 2}/{attempts})",
            file=sys.stderr,
        )
        time.sleep(5)
    if code != 0:
        return code
    if run_id is None:
        print("fedlmc: flwr run printed no run id: cannot tell how the run ended", file=sys.stderr)
        return 1
    status = run_status(run_id, _superlink(args))
    for _ in range(30):  # the log stream can end a moment before the SuperLink records the outcome
        if status.startswith("finished"):
            break
        time.sleep(1)
        status = run_status(run_id, _superlink(args))
    if not status.endswith("completed"):
        print(
            f"fedlmc: run {run_id} ended as {status!r}: the ServerApp failed (see the log above and "
            f"`flwr log {run_id}`)",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return launch(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
