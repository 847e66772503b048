"""The FlowerTune-style example app (``examples/flowertune-gpt2``), FedAvg against ``LoraFedAvg``, on many
seeds: is the default's gain over FedIT in a user's app larger than the seed-to-seed noise?

Each seed runs the app's own pieces (its ``get_model``, ``train``, ``load_data`` and ``load_test``, its
seeds per round and partition) in one process, and aggregates the replies with the strategies' own
``aggregate_train`` (Flower's ``FedAvg``, fedlmc's ``LoraFedAvg``): what ``flwr run`` computes, without
a SuperLink per seed. Both strategies see the same round-1 replies. Writes
``results/flowertune_gpt2.{json,png}``. Usage:

    python simulations/flowertune_app.py [--seeds 0 1 2 3 4 5 6 7 8] [--workers 2]
    python simulations/flowertune_app.py --set lora-alpha=8 --out results/flowertune_gpt2_alpha8.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import tomli
from _results import environment, write_results  # noqa: E402  (simulations/, the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flowertune-gpt2"
# the setting a new user tried: r 4 on c_attn, 2 clients on contiguous halves, 3 rounds × 200 AdamW steps
SETTING = {
    "lora-r": 4,
    "lora-targets": "c_attn",
    "partitioner": "contiguous",
    "local-steps": 200,
    "lr": 0.01,
    "num-server-rounds": 3,
}
STRATEGIES = ("fedavg", "lora")


def app_config(overrides: dict) -> dict:
    """The example's ``[tool.flwr.app.config]`` with ``SETTING`` and ``overrides`` applied."""
    doc = tomli.loads((APP / "pyproject.toml").read_text())
    return {**doc["tool"]["flwr"]["app"]["config"], **SETTING, **overrides}


def _reply(arrays, n: int, node: int):
    import time as _time

    from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict

    meta = Metadata(
        run_id=1,
        message_id=f"m{node}",
        src_node_id=node,
        dst_node_id=0,
        reply_to_message_id="q",
        group_id="1",
        created_at=_time.time(),
        ttl=3600.0,
        message_type="train",
    )
    content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": n})})
    return Message(content=content, metadata=meta)


def run_seed(cfg: dict, seed: int) -> dict:
    """Both strategies on one seed: the test loss after every round and the server's seconds per round."""
    import torch

    if str(APP) not in sys.path:
        sys.path.insert(0, str(APP))
    from flowertune_gpt2.dataset import load_data, load_test
    from flowertune_gpt2.models import get_model, train
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from fedlmc.hf.pretrained import test_loss
    from fedlmc.strategies import LoraFedAvg

    torch.set_num_threads(1)
    cfg = {**cfg, "seed": seed}
    n = 2
    server, test = get_model(cfg), load_test()
    data = [load_data(pid, n, str(cfg["partitioner"])) for pid in range(n)]
    initial = ArrayRecord(get_peft_model_state_dict(server))
    first: list = []  # round 1's replies: the same for both strategies
    out = {"seed": seed, "test_loss": {}, "server_seconds": {}}
    for name in STRATEGIES:
        if name == "fedavg":
            strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
        else:
            strategy = LoraFedAvg(fraction_train=1.0, fraction_evaluate=0.0, model=server)
            strategy.set_initial(initial)
        arrays, losses, seconds = initial, [], []
        for rnd in range(1, int(cfg["num-server-rounds"]) + 1):
            if rnd == 1 and first:
                replies = first
            else:
                replies = []
                for pid in range(n):  # the ClientApp's fit
                    model = get_model(cfg)
                    set_peft_model_state_dict(model, arrays.to_torch_state_dict())
                    s = 100_000 * seed + 1000 * rnd + pid
                    train(model, data[pid], int(cfg["local-steps"]), float(cfg["lr"]), int(cfg["batch-size"]), s)
                    replies.append(_reply(get_peft_model_state_dict(model), len(data[pid]), pid + 1))
                first = first or replies
            t0 = time.perf_counter()
            arrays, _ = strategy.aggregate_train(rnd, replies)
            seconds.append(time.perf_counter() - t0)
            set_peft_model_state_dict(server, arrays.to_torch_state_dict())  # the ServerApp's evaluate
            losses.append(test_loss(server, test))
        out["test_loss"][name], out["server_seconds"][name] = losses, seconds
        print(f"  seed {seed} {name}: " + " ".join(f"{x:.4f}" for x in losses), flush=True)
    return out


def summarise(cfg: dict, runs: list[dict]) -> dict:
    rounds = len(runs[0]["test_loss"]["fedavg"])
    diffs = [[r["test_loss"]["lora"][i] - r["test_loss"]["fedavg"][i] for r in runs] for i in range(rounds)]
    per_round = []
    for i, d in enumerate(diffs):
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        per_round.append(
            {
                "round": i + 1,
                "mean_difference": statistics.mean(d),
                "standard_error": se,
                "lora_lower": sum(x < 0 for x in d),
                "seeds": len(d),
            }
        )
    return {"config": cfg, "seeds": [r["seed"] for r in runs], "runs": runs, "per_round": per_round}


def run_config_for(cfg: dict) -> str:
    """The ``-c`` overrides that run the example app at ``cfg`` (its defaults differ)."""
    defaults = tomli.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    diff = {k: v for k, v in cfg.items() if k in defaults and defaults[k] != v and k not in ("strategy", "seed")}
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in diff.items())


def markdown(doc: dict) -> str:
    cfg = doc["config"]
    lines = [
        f"`examples/flowertune-gpt2`: HF GPT-2 (d 64, 2 layers, base {cfg['base-steps']} steps), LoRA r "
        f"{cfg['lora-r']} α {cfg['lora-alpha']} on `{cfg['lora-targets']}`, 2 clients ({cfg['partitioner']}), "
        f"{cfg['num-server-rounds']} rounds × {cfg['local-steps']} AdamW steps, lr {cfg['lr']}; "
        f"seeds {doc['seeds'][0]}–{doc['seeds'][-1]}. In the app (its defaults differ): "
        f'`fedlmc run examples/flowertune-gpt2 -c "{run_config_for(cfg)}"`.',
        "",
        "| round | FedAvg (FedIT) | LoraFedAvg | LoraFedAvg − FedAvg, mean ± s.e. | seeds where LoraFedAvg is lower |",
        "|---|---|---|---|---|",
    ]
    for row in doc["per_round"]:
        i = row["round"] - 1
        fa = statistics.mean(r["test_loss"]["fedavg"][i] for r in doc["runs"])
        lo = statistics.mean(r["test_loss"]["lora"][i] for r in doc["runs"])
        lines.append(
            f"| {row['round']} | {fa:.4f} | {lo:.4f} | {row['mean_difference']:+.4f} ± {row['standard_error']:.4f} "
            f"| {row['lora_lower']} of {row['seeds']} |"
        )
    finals = " / ".join(f"{r['test_loss']['lora'][-1] - r['test_loss']['fedavg'][-1]:+.4f}" for r in doc["runs"])
    sec = {k: statistics.median(x for r in doc["runs"] for x in r["server_seconds"][k]) for k in STRATEGIES}
    lines += [
        "",
        f"Final round, per seed (LoraFedAvg − FedAvg): {finals}. Server seconds per round (median): FedAvg "
        f"{sec['fedavg'] * 1e3:.1f} ms, LoraFedAvg {sec['lora'] * 1e3:.1f} ms.",
    ]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [row["round"] for row in doc["per_round"]]
    for r in doc["runs"]:
        d = [a - b for a, b in zip(r["test_loss"]["lora"], r["test_loss"]["fedavg"])]
        ax.plot(xs, d, color="0.7", lw=1, marker=".")
    means = [row["mean_difference"] for row in doc["per_round"]]
    ses = [row["standard_error"] for row in doc["per_round"]]
    ax.errorbar(xs, means, yerr=ses, color="C0", lw=2, marker="o", capsize=4, label="mean ± s.e.")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(xs)
    ax.set_xlabel("round")
    ax.set_ylabel("test loss: LoraFedAvg − FedAvg")
    ax.set_title(f"flowertune-gpt2, {len(doc['runs'])} seeds (grey: one seed each)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(9)))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="the app's run_config overrides")
    p.add_argument("--out", default="results/flowertune_gpt2.json")
    args = p.parse_args()
    defaults, over = app_config({}), {}
    for item in args.set:
        key, _, value = item.partition("=")
        over[key] = type(defaults[key])(value) if key in defaults else value
    cfg = app_config(over)
    if str(APP) not in sys.path:
        sys.path.insert(0, str(APP))
    from flowertune_gpt2.models import get_model

    get_model(cfg)  # pretrains and caches the base once, before the workers load it
    import ray

    ray.init(num_cpus=args.workers, include_dashboard=False, _temp_dir="/tmp/ray", log_to_driver=True)
    task = ray.remote(num_cpus=1)(run_seed)
    t0 = time.perf_counter()
    pending = {task.remote(cfg, s): s for s in args.seeds}
    runs = []
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        seed = pending.pop(ready[0])
        runs.append(ray.get(ready[0]))
        print(f"done seed {seed} ({time.perf_counter() - t0:.0f} s; {len(pending)} left)", flush=True)
    ray.shutdown()
    doc = summarise(cfg, sorted(runs, key=lambda r: r["seed"]))
    doc["environment"], doc["wall_seconds"] = environment(), time.perf_counter() - t0
    out = Path(args.out)
    write_results(out, doc)
    plot(doc, out.with_suffix(".png"))
    print(markdown(doc))


if __name__ == "__main__":
    main()
