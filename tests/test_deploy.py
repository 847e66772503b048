"""Real deployment on loopback: a SuperLink and SuperNodes as separate processes (deploy/start.sh),
insecure and with TLS + SuperNode authentication; ``flwr run`` against them; an unregistered key is
refused. Everything is stopped (deploy/stop.sh) whatever happens; each step is bounded in time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedlmc.flower.launch import free_ports, kill_tree

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _env(d: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "DIR": str(d),
        "BIN": str(Path(sys.executable).parent),
        "FLWR_TELEMETRY_ENABLED": "0",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        **extra,
    }


def _deploy_and_run(mode: str, d: Path, strategy: str = "aligned") -> dict:
    port, node_port = free_ports(), free_ports(2)
    env = _env(d, MODE=mode, N="2", PORT=str(port), NODE_PORT=str(node_port), WIDTHS="")
    subprocess.run(["bash", str(ROOT / "deploy/start.sh")], env=env, check=True, timeout=120, capture_output=True)
    out = d / "out"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedlmc.flower.launch",
            ".",
            "fedlmc-deploy",
            "-c",
            f"strategy='{strategy}' preset='vit-digits' num-server-rounds=1 local-steps=3 threads=1 refine-steps=2 "
            f"out-dir='{out}'",
        ],
        cwd=ROOT,
        env={**env, "FLWR_HOME": str(d / "flwr")},
        capture_output=True,
        text=True,
        timeout=540,  # a busy host: every message of a deployment starts a ClientApp process
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((out / "metrics.json").read_text())
    assert "finished" in doc
    assert [r["round"] for r in doc["rounds"]] == [0, 1]
    assert len(doc["rounds"][1]["strategy"]["nodes"]) == 2  # both SuperNodes trained and were aggregated
    return {"env": env, "port": port, "doc": doc}


def _node(res: dict, log: Path, *tls: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            "flower-supernode",
            *tls,
            "--superlink",
            f"127.0.0.1:{res['port']}",
            "--node-config",
            "partition-id=0 num-partitions=2",
            "--port",
            str(free_ports()),
            "--max-retries",
            "2",
            "--max-wait-time",
            "20",
        ],
        env=res["env"],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


SECURE_TOOLS = bool(shutil.which("openssl") and shutil.which("ssh-keygen"))  # deploy/certs.sh needs them


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["secure" if SECURE_TOOLS else "insecure"])
def test_tls_deployment_refines_on_the_clients_and_refuses_an_unregistered_key(mode):
    """TLS + SuperNode authentication (insecure where openssl / ssh-keygen are missing); the round runs
    refined-clients (no server data: the SuperNodes answer the refinement's queries and score the
    guard). Then an unregistered key and a plaintext client are refused."""
    d = Path(tempfile.mkdtemp(prefix="dep-", dir="/tmp"))
    rogue, procs = None, []
    try:
        res = _deploy_and_run(mode, d, "refined-clients")
        rec = res["doc"]["rounds"][1]["strategy"]
        cost = rec["refine_clients"]
        assert cost["steps"] == 2 and cost["checks"] >= 1 and cost["excluded"] == [] and cost["bytes_received"] > 0
        assert rec["guard_where"] == "clients" and len(rec["guard_clients"]["clients"]) == 2
        if mode != "secure":
            return
        for i in range(2):
            assert "registered successfully" in (d / f"register{i}.log").read_text()
        subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", str(d / "rogue")], check=True)
        # output to files, each in its own process group: a SuperNode's SuperExec child would hold a pipe open
        rogue = _node(
            res,
            d / "rogue.log",
            "--root-certificates",
            str(d / "certs/ca.crt"),
            "--auth-supernode-private-key",
            str(d / "rogue"),
        )
        assert rogue.wait(timeout=180) != 0
        assert "Failed to activate SuperNode" in (d / "rogue.log").read_text()
        # a plaintext client cannot talk to the TLS SuperLink either
        plain = _node(res, d / "plain.log", "--insecure")
        procs.append(plain)
        assert plain.wait(timeout=180) != 0
    finally:
        for p in [rogue, *procs]:
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        subprocess.run(["bash", str(ROOT / "deploy/stop.sh")], env=_env(d), timeout=60)
        shutil.rmtree(d, ignore_errors=True)


def _wait_for(path: Path, text: str, seconds: float) -> bool:
    """Poll a log file until it contains ``text`` (False after ``seconds``)."""
    end = time.time() + seconds
    while time.time() < end:
        if path.is_file() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(900)
# with TLS and node authentication where the tools are there (the insecure mode: the restart test)
@pytest.mark.parametrize("mode", ["secure" if SECURE_TOOLS else "insecure"])
def test_a_supernode_killed_mid_round_does_not_stop_the_run(mode):
    """3 SuperNodes, one killed while round 1 trains: the SuperLink reports its message failed (no
    heartbeat), round 1 aggregates the other two, and round 2 runs with the survivors (min-nodes=2).
    Also with TLS and SuperNode authentication (``secure``), where the dead node's key stays registered.

    The victim is killed the moment it has started its ClientApp for round 1's message, so it is
    always mid-round. The round timeout is generous (a loaded 2-core machine trains slowly): a round
    ends as soon as every sampled node has replied or been declared failed, not at the timeout."""
    d = Path(tempfile.mkdtemp(prefix="dep-", dir="/tmp"))
    try:
        port, node_port = free_ports(), free_ports(3)
        env = _env(d, MODE=mode, N="3", PORT=str(port), NODE_PORT=str(node_port), WIDTHS="")
        subprocess.run(["bash", str(ROOT / "deploy/start.sh")], env=env, check=True, timeout=120, capture_output=True)
        pids = [int(x) for x in (d / "pids").read_text().split()]
        for i in range(3):  # every node registered before round 1 samples (min-nodes=2 would start without one)
            node_log = d / f"supernode{i}.log"
            assert _wait_for(node_log, "SuperNode ID:", 120), node_log.read_text(errors="replace")[-2000:]
        out, log = d / "out", d / "run.log"
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fedlmc.flower.launch",
                ".",
                "fedlmc-deploy",
                "-c",
                f"strategy='aligned' preset='vit-digits' num-server-rounds=2 local-steps=40 threads=1 min-nodes=2 "
                f"round-timeout=400.0 "
                f"out-dir='{out}'",
            ],
            cwd=ROOT,
            env={**env, "FLWR_HOME": str(d / "flwr")},
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        victim_log = d / "supernode2.log"
        assert _wait_for(victim_log, "Start `flwr-clientapp` process", 300), victim_log.read_text()[-2000:]
        victim = pids[3]  # the third SuperNode (pids: SuperLink, node0, node1, node2)
        kill_tree(victim)  # the node, its SuperExec and the ClientApp it started: all at once
        code = run.wait(timeout=780)
        text = log.read_text(errors="replace")
        print("\n".join(line for line in text.splitlines() if "round" in line.lower() or "fail" in line.lower()))
        assert code == 0, text[-3000:]
        doc = json.loads((out / "metrics.json").read_text())
        assert "finished" in doc and [r["round"] for r in doc["rounds"]] == [0, 1, 2]
        first, second = doc["rounds"][1]["strategy"], doc["rounds"][2]["strategy"]
        assert len(first["nodes"]) == 2 and len(second["nodes"]) == 2 and set(first["nodes"]) == set(second["nodes"])
        assert len(first["failures"]) == 1 and "Node Unavailable" in first["failures"][0]["reason"]
        assert second["failures"] == []
    finally:
        subprocess.run(["bash", str(ROOT / "deploy/stop.sh")], env=_env(d), timeout=60)
        shutil.rmtree(d, ignore_errors=True)


def _round_done(out: Path, rnd: int, seconds: float) -> bool:
    """Poll the ServerApp's checkpoint until round ``rnd`` is saved (False after ``seconds``)."""
    end = time.time() + seconds
    while time.time() < end:
        try:
            if json.loads((out / "state" / "state.json").read_text())["round"] >= rnd:
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    return False


@pytest.mark.timeout(1200)
def test_superlink_restart_and_resume():
    """The SuperLink is killed (with everything below it: SuperExec, the ServerApp) after round 1 of 2 and
    started again on the same state database and ports. The killed run's ``flwr run`` fails; the same
    two SuperNodes, never restarted, reconnect to the new SuperLink by themselves; ``flwr run`` with
    ``resume=true`` starts a new run whose ServerApp continues from the checkpoint: round 2, numbered as
    such, with both nodes, and the metrics hold rounds 0-2."""
    d = Path(tempfile.mkdtemp(prefix="dep-", dir="/tmp"))
    try:
        port, node_port = free_ports(), free_ports(2)
        env = _env(d, MODE="insecure", N="2", PORT=str(port), NODE_PORT=str(node_port), WIDTHS="")
        subprocess.run(["bash", str(ROOT / "deploy/start.sh")], env=env, check=True, timeout=120, capture_output=True)
        pids = [int(x) for x in (d / "pids").read_text().split()]
        link = pids[0]
        argv = Path(f"/proc/{link}/cmdline").read_bytes().split(b"\0")[:-1]
        out = d / "out"
        cfg = (
            f"strategy='aligned' preset='vit-digits' num-server-rounds=2 local-steps=10 threads=1 round-timeout=400.0 "
            f"out-dir='{out}'"
        )
        flwr_env = {**env, "FLWR_HOME": str(d / "flwr")}
        first = subprocess.Popen(
            [sys.executable, "-m", "fedlmc.flower.launch", ".", "fedlmc-deploy", "-c", cfg],
            cwd=ROOT,
            env=flwr_env,
            stdout=open(d / "run1.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert _round_done(out, 1, 400), (d / "run1.log").read_text()[-2000:]
        kill_tree(link)
        assert first.wait(timeout=300) != 0  # the run's stream broke with its SuperLink
        relinked = subprocess.Popen(
            argv, env=env, stdout=open(d / "superlink2.log", "w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        with open(d / "pids", "a") as f:
            f.write(f"{relinked.pid}\n")
        assert _wait_for(d / "superlink2.log", "Application startup complete", 120)
        second = subprocess.run(
            [sys.executable, "-m", "fedlmc.flower.launch", ".", "fedlmc-deploy", "-c", cfg + " resume=true"],
            cwd=ROOT,
            env=flwr_env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
        assert "resuming from" in second.stdout + second.stderr
        doc = json.loads((out / "metrics.json").read_text())
        assert "finished" in doc and [r["round"] for r in doc["rounds"]] == [0, 1, 2]
        assert all(len(r["strategy"]["nodes"]) == 2 for r in doc["rounds"][1:])
    finally:
        subprocess.run(["bash", str(ROOT / "deploy/stop.sh")], env=_env(d), timeout=60)
        shutil.rmtree(d, ignore_errors=True)
