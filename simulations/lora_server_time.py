"""Benchmark: LoraFedAvg's server time per round against Flower's FedAvg on the very same replies.

    python simulations/lora_server_time.py [--repeats 3]

Replies are PEFT LoRA states (keyed, float32) of two adapters: the Llama-style tiny model of the LoRA
harness (d 64, 2 layers, rank 8 on q, k, v, o, gate, up, down) and a GPT-2-small-shaped one (d 768,
12 layers, rank 16 on c_attn, c_proj, c_fc and the FF's c_proj), from 4 and 8 clients. The factors are
random (the aggregation's cost depends on the shapes and ranks, not on the values); fedlmc's server
first runs 3 rounds so that its kept tail is at its steady size (4 × the rank). Each setting times
``LoraFedAvg.aggregate_train`` and ``FedAvg.aggregate_train`` on freshly built copies of the same
messages, interleaved, and reports their medians and the ratio, with a fixed 512 × 512 float32 GEMM
timed in the same run as the machine's speed reference. Writes results/lora_server_time.json.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import torch
from _results import environment, write_results  # noqa: E402  (simulations/, the script's own folder)

SETTINGS = {
    "llama-tiny": dict(family="llama", rank=8),
    "gpt2-small-shape": dict(family="gpt2-small", rank=16),
}


def layout_of(family: str, rank: int):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from fedlmc.hf.pretrained import tiny_causal_lm
    from fedlmc.lora import LoraLayout

    if family == "llama":
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(tiny_causal_lm("llama"), LoraConfig(r=rank, lora_alpha=16, target_modules=targets))
    else:
        with torch.device("meta"):  # the shapes only: no 124M-parameter base in memory
            base = GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12))
        cfg = LoraConfig(r=rank, lora_alpha=32, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
        model = get_peft_model(base, cfg)
        return _shape_layout(model, cfg)
    return LoraLayout.of(model)


def _shape_layout(model, cfg):
    from fedlmc.lora import LoraLayout

    shapes = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            shapes[name.replace(".default", "")] = tuple(p.shape)
    return LoraLayout.from_shapes(shapes, cfg.to_dict())


def replies(layout, rank: int, clients: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            m.name: (
                torch.randn(m.out_features, rank, generator=g) * 0.02,
                torch.randn(rank, m.in_features, generator=g) * 0.3,
            )
            for m in layout.modules
        }
        for _ in range(clients)
    ]


def messages(layout, reps):
    from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict

    out = []
    for i, rep in enumerate(reps):
        content = RecordDict(
            {"arrays": ArrayRecord(layout.write(rep)), "metrics": MetricRecord({"num-examples": 100 + i})}
        )
        md = Metadata(run_id=1, message_id=f"m{i}", src_node_id=i + 1, dst_node_id=0, reply_to_message_id="q",
                      group_id="1", created_at=time.time(), ttl=3600.0, message_type="train")  # fmt: skip
        out.append(Message(content=content, metadata=md))
    return out


def gemm_seconds() -> float:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    return (time.perf_counter() - t0) / 20


def main() -> None:
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from fedlmc.strategies import LoraFedAvg

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/lora_server_time.json")
    args = p.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)  # both strategies log every round
    torch.set_num_threads(1)
    runs = []
    for name, cfg in SETTINGS.items():
        layout = layout_of(cfg["family"], cfg["rank"])
        for clients in (4, 8):
            ours = LoraFedAvg(lora_config=_config(layout), fraction_evaluate=0.0)
            r = cfg["rank"]
            fresh = {m.name: (torch.zeros(m.out_features, r), torch.randn(r, m.in_features)) for m in layout.modules}
            ours.set_initial(ArrayRecord(layout.write(fresh)))
            for warm in range(3):
                ours.aggregate_train(warm + 1, messages(layout, replies(layout, cfg["rank"], clients, warm)))
            reps = replies(layout, cfg["rank"], clients, 99)
            t_ours, t_avg, t_gemm = [], [], []
            for _ in range(args.repeats):
                state, batch = copy.deepcopy(ours.aggregator), messages(layout, reps)
                t0 = time.perf_counter()
                ours.aggregate_train(9, batch)
                t_ours.append(time.perf_counter() - t0)
                ours.aggregator = state
                batch = messages(layout, reps)
                t0 = time.perf_counter()
                FedAvg().aggregate_train(9, batch)
                t_avg.append(time.perf_counter() - t0)
                t_gemm.append(gemm_seconds())
            adapter = sum(4 * (m.out_features + m.in_features) * cfg["rank"] for m in layout.modules)
            run = {
                "setting": name,
                "clients": clients,
                "rank": cfg["rank"],
                "modules": len(layout.modules),
                "adapter_bytes": adapter,
                "lorafedavg_seconds": statistics.median(t_ours),
                "fedavg_seconds": statistics.median(t_avg),
                "ratio": statistics.median(t_ours) / statistics.median(t_avg),
                "gemm_512_seconds": statistics.median(t_gemm),
                "server_state_bytes": ours.server_state_bytes,
                "dense_bytes_per_module_set": sum(4 * m.out_features * m.in_features for m in layout.modules),
            }
            runs.append(run)
            print(
                f"{name} M={clients}: LoraFedAvg {run['lorafedavg_seconds'] * 1e3:.1f} ms, FedAvg "
                f"{run['fedavg_seconds'] * 1e3:.1f} ms ({run['ratio']:.2f}×); server holds "
                f"{run['server_state_bytes'] / 1e6:.2f} MB (the adapter {adapter / 1e6:.2f} MB)",
                flush=True,
            )
    write_results(args.out, {"runs": runs, "repeats": args.repeats, "environment": environment()})


def _config(layout) -> dict:
    m = layout.modules[0]
    return {"r": m.rank, "lora_alpha": m.alpha, "use_rslora": m.rslora, "fan_in_fan_out": m.fan_in_fan_out}


if __name__ == "__main__":
    main()
