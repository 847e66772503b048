"""deploy/stop.sh stops every process of its deployment, those no longer below a pid it started included
(a ServerApp whose SuperExec died is reparented to init), and nothing of another deployment. The
processes here are stand-ins (``python -c "sleep"`` under a Flower runtime's name and arguments), so the
test runs in seconds; the deployment tests stop real ones the same way."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLEEP = "import time; time.sleep(300)"


def _orphan(name: str, *args: str, env: dict[str, str]) -> int:
    """Start ``name ARGS`` (a sleeping python whose argv[0] is ``name``) whose parent exits at once, so it
    is reparented to init (or the nearest subreaper) like a ServerApp whose SuperExec died; its pid."""
    script = f"exec -a {name} {sys.executable} -c '{SLEEP}' {' '.join(args)} >/dev/null 2>&1 & echo $!"
    pid = int(subprocess.run(["setsid", "bash", "-c", script], env=env, capture_output=True, text=True).stdout)
    return pid


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _gone(pid: int, seconds: float = 10) -> bool:
    end = time.time() + seconds
    while time.time() < end and _running(pid):
        time.sleep(0.1)
    return not _running(pid)


def test_clean_stop_stops_reparented_apps_by_marker_and_address_and_spares_another_deployment(tmp_path):
    ours, other = tmp_path / "ours", tmp_path / "other"
    for d, port in ((ours, 41000), (other, 42000)):
        d.mkdir()
        (d / "deployment").write_text(
            f"PORT={port}\nNODE_PORT0={port + 1}\nNODE_PORT1={port + 2}\nDATABASE={d}/state.db\n"
        )
    base = {k: v for k, v in os.environ.items() if k != "FEDLMC_DEPLOYMENT"}
    marked = {**base, "FEDLMC_DEPLOYMENT": str(ours)}
    # what start.sh started (in its pids file), with a child below it
    link = subprocess.Popen(
        ["bash", "-c", f"exec -a flower-superlink {sys.executable} -c '{SLEEP}' --database {ours}/state.db"],
        env=marked,
        start_new_session=True,
    )
    (ours / "pids").write_text(f"{link.pid}\n")
    # orphans of our deployment: found by the marker in their environment, or by our addresses alone
    by_marker = _orphan("flwr-serverapp", "--runtime-api-address", "127.0.0.1:1", env=marked)
    by_address = _orphan("flwr-clientapp", "--runtime-api-address", "127.0.0.1:41002", env=base)
    by_database = _orphan("flower-superlink", "--database", f"{ours}/state.db", env=base)
    # another deployment's ServerApp (same name, its own marker and addresses) and a non-Flower process
    # with our marker: neither is ours to stop
    theirs = _orphan(
        "flwr-serverapp", "--runtime-api-address", "127.0.0.1:42000", env={**base, "FEDLMC_DEPLOYMENT": str(other)}
    )
    bystander = _orphan("python-job", env=marked)
    try:
        for pid in (by_marker, by_address, by_database, theirs, bystander):
            assert _running(pid) and pid not in _descendants(link.pid)
        out = subprocess.run(
            ["bash", str(ROOT / "deploy/stop.sh")],
            env={**base, "DIR": str(ours)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        link.wait(timeout=10)
        for pid in (by_marker, by_address, by_database):
            assert _gone(pid), f"deploy/stop.sh left {pid} running"
        assert _running(theirs) and _running(bystander)
        assert not (ours / "pids").exists()
    finally:
        for pid in (link.pid, by_marker, by_address, by_database, theirs, bystander):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def _descendants(pid: int) -> set[int]:
    from fedlmc.flower.launch import process_tree

    return set(process_tree(pid))
