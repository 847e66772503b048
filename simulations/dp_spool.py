"""Peak server memory of one ``AlignedFedAvg(scale=Scale(spool=True))`` round, run by the strategy's own
``start`` and inside Flower's differential-privacy wrappers, against the same round with the replies
in memory.

A grid of M nodes answers every train message with the global model plus a small step of its own
(GPT-2-small-shaped layers, d 768, vocabulary 50257; replies trained a little from the global model).
Like Flower's grid, it makes each reply only when it is pulled, so a reply the strategy has written to
disk and dropped is not held anywhere. Each condition runs in a fresh process (the peak resident
memory of that process, sampled every 20 ms, less its memory before the round), reported in models.

    python simulations/dp_spool.py [--replies 8] [--layers 2]   # → results/bench_dp_spool.json

Conditions: ``spool`` (the strategy's own ``start``), ``client-dp`` (Flower's
``DifferentialPrivacyClientSideFixedClipping`` around it: replies pass through unchanged, so they are
spooled as they arrive), ``server-dp`` (``DifferentialPrivacyServerSideFixedClipping``: the wrapper
clips every reply before the strategy sees them, so they wait in memory), ``memory`` (no spool).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from _results import PeakMemory, environment, write_results  # noqa: E402  (simulations/'s own folder)

ROOT = Path(__file__).resolve().parents[1]
CONDITIONS = ("spool", "client-dp", "server-dp", "memory")


class LazyGrid:
    """M nodes; a train reply (the arrays sent plus a step seeded by node) is made when it is pulled."""

    def __init__(self, nodes: int, step: float = 0.002) -> None:
        self.nodes, self.step, self.waiting = list(range(1, nodes + 1)), step, {}

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = f"q{len(self.waiting)}-{m.metadata.dst_node_id}"
            self.waiting[mid] = m
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self._answer(self.waiting.pop(mid), mid) for mid in ids if mid in self.waiting]

    def send_and_receive(self, messages, timeout=None):
        return self.pull_messages(self.push_messages(messages))

    def _answer(self, m, mid: str):
        from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict

        node = int(m.metadata.dst_node_id)
        content = RecordDict({"metrics": MetricRecord({"num-examples": 10, "norm_bit": 0})})
        if m.metadata.message_type == "train":
            g = torch.Generator().manual_seed(node)
            sd = m.content["arrays"].to_torch_state_dict()
            for v in sd.values():
                v.add_(torch.randn(v.shape, generator=g), alpha=self.step * float(v.std()) if v.numel() > 1 else 0.0)
            content["arrays"] = ArrayRecord(torch_state_dict=sd)
            del sd
        md = Metadata(
            run_id=1,
            message_id=f"r{mid}",
            src_node_id=node,
            dst_node_id=0,
            reply_to_message_id=mid,
            group_id="1",
            created_at=0.0,
            ttl=3600.0,
            message_type=m.metadata.message_type,
        )
        return Message(content=content, metadata=md)


def one(condition: str, replies: int, layers: int) -> dict:
    """One round of ``condition`` in this process: its peak memory above the start, in bytes and models."""
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideFixedClipping,
    )
    from flwr.supercore.task_identity import TaskIdentity

    from fedlmc.models import from_preset
    from fedlmc.options import Matching, Scale, Universe
    from fedlmc.strategies import AlignedFedAvg

    for name in ("_run_id", "_node_id", "_task_id"):
        setattr(TaskIdentity, name, 1)
    torch.manual_seed(0)
    model = from_preset("gpt2-tiny", n_layer=layers, d_model=768, n_head=12, d_ff=3072, vocab_size=50257)
    model_bytes = sum(p.numel() * 4 for p in model.state_dict().values())
    initial = ArrayRecord(torch_state_dict=model.state_dict())
    strategy = AlignedFedAvg(
        model=model.config,
        scale=Scale(spool=condition != "memory"),
        matching=Matching(min_gain=0.1),
        universe=Universe(start="average"),
        fraction_evaluate=0.0,
        min_available_nodes=replies,
        min_train_nodes=replies,
    )
    run = strategy
    if condition == "client-dp":
        run = DifferentialPrivacyClientSideFixedClipping(strategy, 0.0, 1e6, replies)
    elif condition == "server-dp":
        run = DifferentialPrivacyServerSideFixedClipping(strategy, 0.0, 1e6, replies)
    with PeakMemory() as mem:
        run.start(grid=LazyGrid(replies), initial_arrays=initial, num_rounds=1)
    peak = mem.peak - mem.start
    return {"condition": condition, "peak_bytes": peak, "model_bytes": model_bytes, "peak_models": peak / model_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replies", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--one", choices=CONDITIONS, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "results" / "bench_dp_spool.json"))
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.replies, args.layers)))
        return
    runs = []
    for condition in CONDITIONS:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            condition,
            "--replies",
            str(args.replies),
            "--layers",
            str(args.layers),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{condition}: peak {runs[-1]['peak_models']:.1f} models", flush=True)
    write_results(args.out, {**environment(), "replies": args.replies, "layers": args.layers, "runs": runs})


if __name__ == "__main__":
    main()
