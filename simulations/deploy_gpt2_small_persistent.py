"""simulations/deploy_gpt2_small_persistent.py: the SuperLink restart story at GPT-2-small size, on a persistent
state, with TLS and SuperNode authentication, on loopback.

``deploy/start.sh`` (MODE=secure, N=2, the state in ``DIR/state.db``, payloads in the SuperLink's memory:
``fedlmc-superlink``) runs 2 rounds of the aligned strategy on gpt2-small's shape with GPT-2's
vocabulary (163M parameters, 622 MB per message). First one uninterrupted run (the reference). Then,
``--trials`` times on a fresh deployment: round 1 completes; once round 2's ClientApps are training,
the SuperLink is killed with everything below it (its SuperExec and the ServerApp: SIGKILL, as when its
host dies) and started again with the same arguments on the same state file; the SuperNodes, never
restarted, reconnect by themselves; ``flwr run ... resume=true`` continues from the ServerApp's
checkpoint. A trial passes when the resumed run completes round 2 on both nodes and its final metrics
equal the reference's, and ``deploy/stop.sh`` leaves no process of the deployment.

Samples every process's resident memory twice a second and writes
``results/deploy_gpt2_small_persistent.json``::

    python simulations/deploy_gpt2_small_persistent.py [--trials 3] [--local-steps 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy_gpt2_small import Sampler, deployment_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlmc import provenance  # noqa: E402
from fedlmc.flower.launch import kill_tree  # noqa: E402


def wait_for(predicate, seconds: float, every: float = 0.5) -> bool:
    end = time.time() + seconds
    while time.time() < end:
        if predicate():
            return True
        time.sleep(every)
    return False


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def saved_round(out: Path) -> int:
    try:
        return int(json.loads((out / "state" / "state.json").read_text())["round"])
    except (OSError, ValueError, KeyError):
        return 0


def deployment_processes(d: Path) -> list[int]:
    """Live processes carrying this deployment's marker (what deploy/stop.sh must have stopped)."""
    mark = f"FEDLMC_DEPLOYMENT={d}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (
                    mark in (proc / "environ").read_bytes().split(b"\0")
                    and (proc / "stat").read_text().split(") ")[1][0] not in "ZX"
                ):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def summary(out: Path) -> dict:
    if not (out / "metrics.json").is_file():
        return {}
    m = json.loads((out / "metrics.json").read_text())
    rounds = [
        {
            "round": r.get("round"),
            "round_seconds": r.get("round_seconds"),
            "test_loss": r.get("test_loss"),
            "test_acc": r.get("test_acc"),
            "nodes": len((r.get("strategy") or {}).get("nodes", [])),
        }
        for r in m["rounds"]
    ]
    return {"rounds": rounds, "finished": "finished" in m}


def trial(args, interrupt: bool) -> dict:
    d = Path(tempfile.mkdtemp(prefix="dep-persist-", dir="/tmp"))
    env = deployment_env(d, MODE="secure", DATABASE=str(d / "state.db"))
    out = d / "out"
    cfg = (
        f"preset='gpt2-small' vocab-size=50257 num-server-rounds=2 local-steps={args.local_steps} batch-size=2 "
        f"strategy='aligned' independent-start=false eval-batches=1 guard=false threads=1 "
        f"round-timeout={args.round_timeout} out-dir='{out}'"
    )
    doc: dict = {"kind": "restart" if interrupt else "uninterrupted", "dir": str(d)}
    flwr_env = {**env, "FLWR_HOME": str(d / "flwr")}
    t_start = time.time()
    sampler = None
    try:
        subprocess.run(["bash", str(ROOT / "deploy/start.sh")], env=env, check=True, timeout=300, capture_output=True)
        link = int((d / "pids").read_text().split()[0])
        argv = Path(f"/proc/{link}/cmdline").read_bytes().split(b"\0")[:-1]
        link_env = dict(kv.split("=", 1) for kv in Path(f"/proc/{link}/environ").read_text().split("\0") if "=" in kv)
        sampler = Sampler(d / "pids", [os.getpid()])
        sampler.start()
        launch = [sys.executable, "-m", "fedlmc.flower.launch", ".", "fedlmc-deploy", "-c", cfg]
        first = subprocess.Popen(
            launch, cwd=ROOT, env=flwr_env, stdout=open(d / "run1.log", "w"), stderr=subprocess.STDOUT
        )
        if not interrupt:
            doc["returncode"] = first.wait(timeout=args.timeout)
        else:
            # round 2 is training: round 1 is checkpointed and each SuperNode started its second ClientApp
            def round_two_training() -> bool:
                return saved_round(out) >= 1 and all(
                    text(d / f"supernode{i}.log").count("Start `flwr-clientapp` process") >= 2 for i in range(2)
                )

            if not wait_for(round_two_training, args.timeout):
                raise RuntimeError("round 2 never started: " + text(d / "run1.log")[-2000:])
            time.sleep(args.kill_after)
            doc["killed_at_seconds"] = time.time() - t_start
            kill_tree(link)  # the SuperLink, its SuperExec and the ServerApp, at once
            doc["first_run_returncode"] = first.wait(timeout=600)
            t_restart = time.time()
            relinked = subprocess.Popen(
                argv,
                env=link_env,
                stdout=open(d / "superlink2.log", "w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            with open(d / "pids", "a") as f:
                f.write(f"{relinked.pid}\n")
            if not wait_for(lambda: "Application startup complete" in text(d / "superlink2.log"), 300):
                raise RuntimeError("the SuperLink did not come back: " + text(d / "superlink2.log")[-2000:])
            doc["restart_seconds"] = time.time() - t_restart
            second = subprocess.run(
                launch[:-1] + [cfg + " resume=true"],
                cwd=ROOT,
                env=flwr_env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            (d / "run2.log").write_text(second.stdout + second.stderr)
            doc["returncode"] = second.returncode
            doc["resumed"] = "resuming from" in second.stdout + second.stderr
            doc["nodes_reconnected"] = [
                "Application startup complete" in text(d / "superlink2.log")
                and text(d / f"supernode{i}.log").count("Start `flwr-clientapp` process") >= 3
                for i in range(2)
            ]
        doc["wall_seconds"] = time.time() - t_start
        doc.update(summary(out))
    except Exception as e:  # noqa: BLE001 - recorded as the trial's failure
        doc["error"] = f"{type(e).__name__}: {e}"
    finally:
        if sampler is not None:
            sampler.stop.set()
            sampler.join()
            doc["peak_rss_mb"] = {
                k: round(v) for k, v in sorted(sampler.peak.items(), key=lambda kv: -kv[1]) if v > 50 and "ps " not in k
            }
        stop = subprocess.run(["bash", str(ROOT / "deploy/stop.sh")], env={**env}, timeout=120, capture_output=True)
        doc["stop_returncode"] = stop.returncode
        doc["left_after_stop"] = deployment_processes(d)
        for pid in doc["left_after_stop"]:
            os.kill(pid, signal.SIGKILL)
        for log in ("run1.log", "run2.log", "superlink.log", "superlink2.log"):
            doc.setdefault("log_tails", {})[log] = text(d / log)[-1500:]
    return doc


def main() -> None:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--local-steps", type=int, default=1)
    p.add_argument("--kill-after", type=float, default=5.0, help="seconds into round 2's training")
    p.add_argument("--round-timeout", type=float, default=1800.0)
    p.add_argument("--timeout", type=float, default=2400.0)
    args = p.parse_args()
    path = ROOT / "results" / "deploy_gpt2_small_persistent.json"
    doc: dict = {"config": vars(args), "reference": None, "trials": []}

    def save() -> None:
        provenance.write(path, doc)

    doc["reference"] = trial(args, interrupt=False)
    save()
    ref = [r["test_loss"] for r in doc["reference"].get("rounds", [])]
    for i in range(args.trials):
        t = trial(args, interrupt=True)
        got = [r["test_loss"] for r in t.get("rounds", [])]
        t["same_metrics_as_reference"] = bool(ref) and got == ref
        t["passed"] = bool(
            t.get("returncode") == 0
            and t.get("resumed")
            and t.get("finished")
            and [r["round"] for r in t.get("rounds", [])] == [0, 1, 2]
            and all(r["nodes"] == 2 for r in t["rounds"][1:])
            and t["same_metrics_as_reference"]
            and not t["left_after_stop"]
        )
        doc["trials"].append(t)
        print(f"trial {i + 1}: passed={t['passed']} {t.get('error', '')}", flush=True)
        save()
    doc["failures"] = sum(not t["passed"] for t in doc["trials"])
    save()
    print(
        json.dumps(
            {k: v for k, v in doc.items() if k != "trials"}
            | {
                "trials": [{k: v for k, v in t.items() if k not in ("log_tails", "peak_rss_mb")} for t in doc["trials"]]
            },
            indent=1,
            default=str,
        )[:6000]
    )


if __name__ == "__main__":
    main()
