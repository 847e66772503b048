"""simulations/deploy_gpt2_small.py: one round of a real deployment (a SuperLink and 2 SuperNodes on loopback,
``deploy/start.sh``) with a GPT-2-small-shaped model: 12 layers, d 768, 12 heads, d_ff 3072, block 1024,
the vocabulary padded to GPT-2's 50257 (124M parameters, ~500 MB in float32), so every message is that
size both ways. Clients receive the global model, take ``--local-steps`` steps and send it back; the
server averages. Samples every process's resident memory twice a second and writes
``results/deploy_gpt2_small.json``: the round's wall time, each process's peak RSS, and what it needed.

    python simulations/deploy_gpt2_small.py [--database memory|sqlite] [--superlink fedlmc|flower] [--burners N]

``--superlink flower`` runs Flower's own ``flower-superlink`` (payloads in the state file, 5 s lock
wait) instead of ``fedlmc-superlink``; ``--burners N`` runs N CPU-bound GEMM processes beside the round
(a busy host). The file is ``deploy_gpt2_small_<database>[_flower][_load<N>].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _results import Burners

from fedlmc import provenance
from fedlmc.flower.launch import free_ports

ROOT = Path(__file__).resolve().parents[1]


def deployment_env(d: Path, **settings: str) -> dict[str, str]:
    """The environment ``deploy/start.sh`` (and ``stop.sh``) run with: the deployment in ``d``, 2 SuperNodes on
    free loopback ports, this venv's binaries, and ``settings`` (MODE, DATABASE, ...) on top."""
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "DIR": str(d),
        "BIN": bin_dir,
        "FLWR_TELEMETRY_ENABLED": "0",
        "N": "2",
        "PORT": str(free_ports()),
        "NODE_PORT": str(free_ports(2)),
        "WIDTHS": "",
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        **settings,
    }
    env.pop("FEDLMC_DEPLOYMENT", None)  # the marker start.sh sets: never one inherited from another deployment
    return env


def role(args: str) -> str:
    for key in (
        "flower-superlink",
        "fedlmc-superlink",
        "flower-supernode",
        "flwr-serverapp",
        "flwr-clientapp",
        "flower-superexec",
        "flwr-superexec",
        "fedlmc.flower.launch",
        "flwr run",
    ):
        if key in args:
            return key
    return args.split()[0] if args else "?"


class Sampler(threading.Thread):
    """Peak RSS (MB) of every process below ``roots`` (re-read from ``ps`` each time: apps come and go)."""

    def __init__(self, roots_file: Path, extra: list[int]) -> None:
        super().__init__(daemon=True)
        self.roots_file, self.extra, self.peak, self.stop = roots_file, extra, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            rows = subprocess.run(["ps", "-eo", "pid=,ppid=,rss=,args="], capture_output=True, text=True).stdout
            procs = {}
            for line in rows.splitlines():
                parts = line.split(None, 3)
                if len(parts) == 4:
                    procs[int(parts[0])] = (int(parts[1]), int(parts[2]), parts[3])
            roots = [int(x) for x in self.roots_file.read_text().split()] if self.roots_file.is_file() else []
            keep = set(roots + self.extra)
            changed = True
            while changed:
                changed = False
                for pid, (ppid, _, _) in procs.items():
                    if ppid in keep and pid not in keep:
                        keep.add(pid)
                        changed = True
            for pid in keep & set(procs):
                _, rss, args = procs[pid]
                key = f"{role(args)} (pid {pid})"
                self.peak[key] = max(self.peak.get(key, 0.0), rss / 1024)
            time.sleep(0.5)


def main() -> None:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local-steps", type=int, default=1)
    p.add_argument("--strategy", default="average")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument(
        "--database",
        choices=["sqlite", "memory"],
        default="memory",
        help="the SuperLink's state: a sqlite file (deploy/start.sh's default) or in memory",
    )
    p.add_argument("--superlink", choices=["fedlmc", "flower"], default="fedlmc")
    p.add_argument("--burners", type=int, default=0, help="CPU-bound GEMM processes running beside the round")
    args = p.parse_args()
    d = Path(tempfile.mkdtemp(prefix="dep-g2s-", dir="/tmp"))
    env = deployment_env(
        d,
        MODE="insecure",
        DATABASE=str(d / "state.db") if args.database == "sqlite" else "",
        SUPERLINK=args.superlink,
    )
    out = d / "out"
    cfg = (
        f"preset='gpt2-small' vocab-size=50257 num-server-rounds=1 local-steps={args.local_steps} batch-size=2 "
        f"strategy='{args.strategy}' independent-start=false eval-batches=1 guard=false threads=1 out-dir='{out}'"
    )
    doc = {"config": cfg, "database": args.database, "superlink": args.superlink, "burners": args.burners}
    burners = Burners(args.burners).__enter__()
    try:
        subprocess.run(["bash", str(ROOT / "deploy/start.sh")], env=env, check=True, timeout=120, capture_output=True)
        sampler = Sampler(d / "pids", [os.getpid()])
        sampler.start()
        t0 = time.time()
        run = subprocess.run(
            [sys.executable, "-m", "fedlmc.flower.launch", ".", "fedlmc-deploy", "-c", cfg],
            cwd=ROOT,
            env={**env, "FLWR_HOME": str(d / "flwr")},
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        doc["wall_seconds"] = time.time() - t0
        sampler.stop.set()
        sampler.join()
        doc["returncode"] = run.returncode
        doc["peak_rss_mb"] = dict(sorted(sampler.peak.items(), key=lambda kv: -kv[1]))
        if (out / "metrics.json").is_file():
            m = json.loads((out / "metrics.json").read_text())
            doc["rounds"] = [{k: r.get(k) for k in ("round", "round_seconds", "test_loss")} for r in m["rounds"]]
            doc["finished"] = "finished" in m
        doc["log_tail"] = (run.stdout + run.stderr)[-3000:]
    finally:
        burners.__exit__()
        subprocess.run(["bash", str(ROOT / "deploy/stop.sh")], env={**env}, timeout=60)
    doc["peak_rss_mb"] = {k: v for k, v in doc.get("peak_rss_mb", {}).items() if not k.startswith("ps ")}
    name = f"deploy_gpt2_small_{args.database}" + ("_flower" if args.superlink == "flower" else "")
    name += f"_load{args.burners}" if args.burners else ""
    provenance.write(ROOT / "results" / f"{name}.json", doc)
    print(json.dumps({k: v for k, v in doc.items() if k != "log_tail"}, indent=1))
    print(doc.get("log_tail", "")[-1500:])


if __name__ == "__main__":
    main()
