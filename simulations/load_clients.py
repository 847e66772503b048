"""Load: a simulation with many clients over several rounds; peak memory and per-round times.

    python simulations/load_clients.py [--clients 20] [--rounds 3] [--strategy aligned]

Runs the federation in a subprocess (``simulations.simulate``) and samples the resident memory of its
whole process tree (ServerApp, Ray, ClientApp actors) every half second. Writes
results/bench_load_<clients>_clients.json.
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

from fedlmc import provenance

ROOT = Path(__file__).resolve().parents[1]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of the process and all its descendants, RSS of the process alone), bytes (Linux /proc)."""
    kids, todo, seen = _children(), [pid], set()
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(kids.get(p, []))
    return sum(_rss(p) for p in seen), _rss(pid)


def main() -> None:
    provenance.watch()  # samples the load through the run, for the results file's record
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--strategy", default="aligned")
    ap.add_argument("--preset", default="vit-digits")
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="load-", dir="/tmp"))
    settings = {
        "strategy": args.strategy,
        "num-server-rounds": args.rounds,
        "preset": args.preset,
        "local-steps": args.local_steps,
        "min-nodes": args.clients,
        "out-dir": str(out_dir),
        "threads": 1,
    }
    cmd = [
        sys.executable,
        "-m",
        "simulations.simulate",
        "--settings",
        json.dumps(settings),
        "--supernodes",
        str(args.clients),
    ]
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=open(out_dir / "log.txt", "w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    peak, peak_server, samples = 0, 0, []

    def sample() -> None:
        nonlocal peak, peak_server
        while proc.poll() is None:
            total, own = tree_rss(proc.pid)
            peak, peak_server = max(peak, total), max(peak_server, own)
            samples.append((round(time.time() - t0, 1), total))
            time.sleep(0.5)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    code = proc.wait(timeout=3600)
    th.join()
    os.system(f"kill -9 -{proc.pid} 2>/dev/null")
    if code != 0:
        print((out_dir / "log.txt").read_text()[-3000:])
        raise SystemExit(f"simulation failed ({code})")
    doc = json.loads((out_dir / "metrics.json").read_text())
    rounds = [
        {
            "round": r["round"],
            "seconds": round(r["round_seconds"], 1),
            "aggregation_seconds": round((r.get("strategy") or {}).get("align_seconds", 0.0), 2),
            "replies": len((r.get("strategy") or {}).get("client_losses", [])),
            "test_loss": r["test_loss"],
        }
        for r in doc["rounds"][1:]
    ]
    res = {
        "clients": args.clients,
        "rounds": args.rounds,
        "strategy": args.strategy,
        "preset": args.preset,
        "local_steps": args.local_steps,
        "wall_seconds": round(time.time() - t0, 1),
        "cpus": os.cpu_count(),
        "peak_rss_tree_mib": round(peak / 2**20),
        "peak_rss_server_process_mib": round(peak_server / 2**20),
        "per_round": rounds,
        "rss_samples_mib": [(t, round(b / 2**20)) for t, b in samples[:: max(1, len(samples) // 60)]],
    }
    out = Path(args.out or ROOT / f"results/bench_load_{args.clients}_clients.json")
    provenance.write(out, res)
    print(json.dumps({k: v for k, v in res.items() if k != "rss_samples_mib"}, indent=1))


if __name__ == "__main__":
    main()
