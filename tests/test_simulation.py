"""Real Ray simulations (Flower's simulation engine): every strategy for 2 rounds on 2 SuperNodes, and
``flwr run .`` itself. Each run lives in its own process with a hard timeout, so nothing can hang."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from fedlmc import io
from fedlmc.flower.launch import local_superlinks, stop_tree
from simulations.simulate import run_in_subprocess

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _short_tmp(prefix: str) -> Path:
    # Ray's AF_UNIX socket paths must stay short: never pytest's deep tmp_path
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def _check_rounds(doc: dict, out: Path, strategy: str, factors: str, rounds: int) -> None:
    """A finished run of ``rounds`` rounds on 2 SuperNodes: every round aggregated and evaluated both
    replies, kept the model it reports, and the final model is the last round's."""
    assert [r["round"] for r in doc["rounds"]] == list(range(rounds + 1)) and "finished" in doc
    for r in doc["rounds"][1:]:
        rec = r["strategy"]
        assert rec["round"] == r["round"] and rec["excluded"] == [] and rec["failures"] == []
        assert len(rec["client_losses"]) == 2  # both SuperNodes replied and were evaluated
        assert rec["global_loss"] == pytest.approx(r["test_loss"], abs=1e-5)  # the model the round kept
        # aggregated client metrics are measurements only: no partition ids or widths averaged
        assert "train-loss" in rec["train_metrics"] and set(rec["train_metrics"]) <= {"train-loss", "num-examples"}
        if factors:
            assert sorted(rec["widths"]) == [16, 32]  # vit-digits d=32 and its half-width client
        if strategy == "refined-clients":  # the clients computed the refinement and scored the guard
            cost = rec["refine_clients"]
            assert cost["steps"] >= 1 and cost["excluded"] == [] and cost["bytes_received"] > 0
            assert rec["guard_where"] == "clients" and rec["guard_clients"]["clients"] == sorted(rec["nodes"])
    final = io.load(out / "final")
    assert final.config.d_model == 32
    assert abs(final.meta["test"]["test_loss"] - doc["rounds"][-1]["test_loss"]) < 1e-9


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "strategy,factors,hf",
    [
        # average and aligned federations run in the main job's test and the crash-resume test
        ("refined", "", False),
        ("slicing", "1,2", False),  # hetero: the crash-resume test's uninterrupted run is checked the same way
        ("refined-clients", "", True),  # no server data: the clients compute the refinement and guard
    ],
)
def test_strategy_runs_in_a_ray_simulation(strategy, factors, hf):
    """hf: the clients train ViTForImageClassification (the preset's Hugging Face twin) and exchange its
    state dict under Hugging Face's keys; the server aligns through the adapter."""
    with simulation_dir(f"fl-{strategy}-") as out:
        settings = {
            "strategy": strategy,
            "num-server-rounds": 2,
            "preset": "vit-digits",
            "local-steps": 4,
            "threads": 1,
            "refine-steps": 5,
            "width-factors": factors,
            "out-dir": str(out),
            "fraction-evaluate": 1.0,
            "report": True,
            "hf": hf,
        }
        doc = run_in_subprocess(settings, num_supernodes=2, timeout=300, log_path=out / "log.txt")
        _check_rounds(doc, out, strategy, factors, rounds=2)


@contextmanager
def simulation_dir(prefix: str):
    """A short temporary folder for a simulation's output and ``log.txt`` (its tail printed if the body
    fails), removed afterwards."""
    out = _short_tmp(prefix)
    try:
        yield out
    except Exception:
        log = out / "log.txt"
        print(log.read_text()[-5000:] if log.is_file() else "no log")
        raise
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _stop_local_superlink(home: Path) -> None:
    """A safety net if the test failed before ``launch`` stopped the local SuperLink it started."""
    for pid in local_superlinks(home):
        stop_tree(pid)


@pytest.mark.timeout(200)
def test_ray_workers_run_at_normal_priority():
    """Ray starts its workers at nice 15, so beside any ordinary job the ClientApp actors would get a few
    per cent of a core."""
    code = (
        "from simulations.simulate import ray_env; ray_env(); import os, ray; "
        "ray.init(num_cpus=1, include_dashboard=False); "
        "print('worker nice', ray.get(ray.remote(lambda: os.nice(0)).remote())); ray.shutdown()"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    tmp = _short_tmp("raynice-")
    try:
        proc = subprocess.run(
            [os.sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=150,
            env={**env, "RAY_TMPDIR": str(tmp)},
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert "worker nice 0" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def run_example(example: str, run_config: str, home: Path, federation: str = "", cwd: Path = ROOT) -> str:
    """``fedlmc run examples/<example> -c RUN_CONFIG`` on a local simulation whose Flower home is
    ``home`` (``federation``: ``--federation-config``'s value), started in ``cwd``; its output, the run
    having succeeded."""
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "RAY_TMPDIR": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "PATH": f"{Path(os.sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    proc = subprocess.run(
        [os.sys.executable, "-m", "fedlmc.flower.launch", str(ROOT / "examples" / example), "-c", run_config]
        + (["--federation-config", federation] if federation else []),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", ["quickstart", "hf-gpt2", "hf-vit"])
def test_example_app_runs_with_flwr_run_and_both_strategies(example):
    """examples/<name> is a Flower app of its own (pyproject.toml, client_app.py, server_app.py,
    task.py): ``flwr run examples/<name>`` (through ``fedlmc run``) trains 2 rounds on 2 SuperNodes with
    Flower's FedAvg and with AlignedFedAvg; the aggregate loads strictly into the client's model (the
    ServerApp does so) and every reply of both rounds was aggregated."""
    home = _short_tmp("ex-")
    try:
        for strategy, name in (("fedavg", "FedAvg"), ("aligned", "AlignedFedAvg")):
            out = run_example(example, f"strategy='{strategy}'", home)
            line = next(l for l in out.splitlines() if f"{example} result:" in l)
            assert f"strategy={name} " in line and float(line.split("test_loss=")[1].split()[0]) < 10.0, line
            assert out.count("Received 2 results and 0 failures") == 2, out[-3000:]
            if strategy == "aligned":
                assert "AlignedFedAvg round 2: replies from nodes" in out and "excluded the reply" not in out
        assert local_superlinks(home) == set()
    finally:
        _stop_local_superlink(home)
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.timeout(600)
# the hetero federation: its transforms and partition ids go through the checkpoint too
@pytest.mark.parametrize("strategy,factors", [("hetero", "1,2")])
def test_crashed_server_resumes_to_the_same_result(strategy, factors):
    """A server killed hard after round 2 of 3 and restarted with resume=true ends exactly where an
    uninterrupted run with the same seeds ends. Mixed widths too: the restarted simulation numbers its
    nodes anew, and each client must still get its own projection (transforms keyed by partition id)."""
    # a shared initial model, as this test was written for; with independent starts (now the run_config
    # default) two of four loaded clean-clone CI runs ended round 3 elsewhere, in the full run once and
    # in the resumed run once (not reproduced in 9 targeted runs): see the session note
    base = {
        "strategy": strategy,
        "num-server-rounds": 3,
        "preset": "vit-digits",
        "local-steps": 4,
        "threads": 1,
        "report": True,
        "fraction-evaluate": 1.0,
        "independent-start": False,
        "width-factors": factors,
    }
    a, b = _short_tmp("fl-full-"), _short_tmp("fl-crash-")
    try:
        full = run_in_subprocess({**base, "out-dir": str(a)}, timeout=300, log_path=a / "log.txt")
        _check_rounds(full, a, strategy, factors, rounds=3)
        with pytest.raises(RuntimeError, match="exit code"):
            run_in_subprocess(
                {**base, "out-dir": str(b)},
                timeout=300,
                log_path=b / "log1.txt",
                script=Path(__file__).with_name("crashing_server.py"),
            )
        assert not (b / "final").exists() and (b / "state" / "state.json").is_file()
        assert json.loads((b / "state" / "state.json").read_text())["round"] == 2
        resumed = run_in_subprocess({**base, "out-dir": str(b), "resume": True}, timeout=300, log_path=b / "log2.txt")
        assert "resuming" in (b / "log2.txt").read_text()
        assert [r["round"] for r in resumed["rounds"]] == [0, 1, 2, 3]
        for doc in (full, resumed):  # every round aggregated both clients, with no failure
            assert all(len(r["strategy"]["nodes"]) == 2 and not r["strategy"]["failures"] for r in doc["rounds"][1:]), [
                r.get("strategy") for r in doc["rounds"][1:]
            ]
        assert resumed["rounds"][-1]["test_loss"] == pytest.approx(full["rounds"][-1]["test_loss"], abs=1e-6)
        fa, fb = io.load(a / "final").state_dict(), io.load(b / "final").state_dict()
        assert max(float((fa[k] - fb[k]).abs().max()) for k in fa) < 1e-6
        assert len(resumed["rounds"][-1]["strategy"]["client_losses"]) == 2
    finally:
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)


@pytest.mark.timeout(900)
def test_the_main_job_shows_alignment_beating_fedavg():
    """The README's first command, ``fedlmc run .`` (``flwr run .`` on the app's defaults, against a
    local SuperLink the CLI starts itself): FedAvg, aligned and refined aggregate the same one-epoch
    clients, the table reaches the terminal, summary.json / comparison.png / each aggregate are written
    and the SuperLink is stopped; aligned beats FedAvg by the README's margin (``simulations/main_job.py``
    checks the same margin on seeds 0, 1 and 2: three trainings are too long for CI). A ServerApp that
    crashes is a failed run for whoever started it."""
    sys.path.insert(0, str(ROOT / "simulations"))
    from main_job import MAIN_JOB_MARGIN

    home = _short_tmp("flwrhome-")
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "RAY_TMPDIR": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "PATH": f"{Path(os.sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    launch = [os.sys.executable, "-m", "fedlmc.flower.launch", "."]
    try:
        out = home / "s0"
        proc = subprocess.run(  # make run's command
            [*launch, "--federation-config", "client-resources-num-cpus=1", "-c", f"out-dir='{out}'"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert list(summary["strategies"]) == ["average", "aligned", "refined"]
        assert all(
            {"test_loss", "test_acc", "aggregation_seconds"} <= set(row) for row in summary["strategies"].values()
        )
        assert len(summary["client_test_losses"]) == 2 and (out / "comparison.png").is_file()
        assert all((out / "final" / name / io.WEIGHTS).is_file() for name in summary["strategies"])
        assert "finished" in json.loads((out / "metrics.json").read_text())
        assert "fedlmc: results in" in proc.stdout and "aggregation s" in proc.stdout  # the table reaches the terminal
        assert local_superlinks(home) == set()  # the local SuperLink this run started was stopped
        # verify's CI subset: this run is results/main_job.json's seed 0 (python -m simulations verify --quick)
        from simulations.verify import ENTRIES, compare

        rows = compare(ENTRIES["main-job-seed0"], {"seeds": {"0": summary}})
        assert len(rows) == 4 and all(r[4] for r in rows), rows
        loss = {name: row["test_loss"] for name, row in summary["strategies"].items()}
        # a ServerApp that crashes (here: an unknown preset) is a failed run, although `flwr run` exits 0
        bad = home / "bad"
        proc = subprocess.run(
            [*launch, "-c", f"preset='no-such-preset' out-dir='{bad}'"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "finished:failed" in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "no-such-preset" in json.loads((bad / "metrics.json").read_text())["error"]
        assert loss["aligned"] < loss["average"] - MAIN_JOB_MARGIN, loss
        assert loss["refined"] < loss["aligned"] + 0.02, loss
    finally:
        _stop_local_superlink(home)
        shutil.rmtree(home, ignore_errors=True)
