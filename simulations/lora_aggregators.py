"""Benchmark: every published LoRA aggregator and fedlmc's, on the same clients, seeds and base.

    python simulations/lora_aggregators.py [--settings NAME,...] [--seeds 0,1,2] [--workers 2]

A Llama-style tiny causal LM (d 64, 2 layers) is pretrained locally on the first half of Tiny
Shakespeare's training text (``fedlmc.hf.pretrained``); 4 clients fine-tune PEFT LoRA adapters on
every attention and FF projection (q, k, v, o, gate, up, down; α = 16) on the second half, dealt out
IID or by speaking character. Every method starts from the same adapters and trains its clients on
the same batches (round 1, identical for all but FFA-LoRA, is computed once). Per setting, method
and round: the global model's test loss (mean of 3 seeds), the bytes each way (float32), the server's
aggregation seconds and what the server holds (the server's time against Flower's FedAvg is
``simulations/lora_server_time.py``'s). Writes ``results/lora_<setting>.{json,png}`` and
prints the tables. Settings are run as Ray tasks, one per (setting, seed).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from _results import environment, write_results  # noqa: E402  (simulations/, the script's own folder)

FAMILY, BASE_STEPS, ALPHA, LR, BATCH, CLIENTS, TEST_BATCHES = "llama", 1500, 16, 3e-3, 16, 4, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HOMOGENEOUS = (
    "average",
    "ffa-lora",
    "fedsa-lora",
    "flora",
    "flexlora",
    "fedex-lora",
    "fedrot-lora",
    "ties-lora",
    "dare-lora",
    "model-stock-lora",
    "fedlmc",
    "fedlmc-fold",
)
# what LoraFedAvg sends back, one change at a time (``LoraAggregator``'s gauge and tail), and clients whose
# AdamW state lives on across rounds (``+adam``)
ABLATION = (
    "average",
    "average+adam",
    "fedlmc-balanced",
    "fedlmc-even",
    "fedlmc-anchored",
    "fedlmc-balanced-drop",
    "fedlmc-anchored-drop",
    "fedlmc-balanced-fold",
    "fedlmc-balanced+adam",
    "fedlmc-anchored+adam",
    "fedex-lora",
    "fedrot-lora",
)
# a FlowerTune-style app: Hugging Face GPT-2 (d 64, 2 layers, pretrained 500 steps as examples/flowertune-gpt2
# does), PEFT LoRA r 4 on c_attn
# at PEFT's default α (8), 2 clients on contiguous halves, 3 rounds × 200 AdamW steps at lr 0.01
SMALL = dict(family="gpt2", base_steps=500, targets=["c_attn"], alpha=8, lr=1e-2, clients=2, scheme="contiguous")
SETTINGS = {
    "small-gpt2-r4-steps200": dict(**SMALL, ranks=[4, 4], steps=200, rounds=3, methods=ABLATION),
    # the same at examples/flowertune-gpt2's α (16: s = 4)
    "small-gpt2-r4-alpha16-steps200": dict(
        **{**SMALL, "alpha": 16},
        ranks=[4, 4],
        steps=200,
        rounds=3,
        methods=("average", "fedlmc", "fedlmc-anchored", "fedlmc-fold", "fedrot-lora"),
    ),
    "speaker-r8-steps10": dict(scheme="speaker", ranks=[8] * CLIENTS, steps=10, rounds=8, methods=HOMOGENEOUS),
    "speaker-r8-steps100": dict(
        scheme="speaker",
        ranks=[8] * CLIENTS,
        steps=100,
        rounds=4,
        methods=HOMOGENEOUS
        + ("fedlmc-even", "fedlmc-anchored", "fedlmc-drop", "fedlmc-anchored-drop")
        + ("average+adam", "fedlmc+adam", "fedlmc-anchored+adam"),
    ),
    "speaker-r8-steps500": dict(scheme="speaker", ranks=[8] * CLIENTS, steps=500, rounds=2, methods=HOMOGENEOUS),
    "iid-r8-steps100": dict(scheme="iid", ranks=[8] * CLIENTS, steps=100, rounds=3, methods=HOMOGENEOUS),
    # FedIT with mixed ranks is HetLoRA's zero-padding; FFA-LoRA, FedSA-LoRA and FedEx-LoRA define none
    "speaker-mixed-steps100": dict(
        scheme="speaker",
        ranks=[2, 4, 8, 16],
        steps=100,
        rounds=3,
        methods=("hetlora", "flora", "flexlora", "fedrot-lora", "fedlmc", "fedlmc-anchored"),
    ),
}
# full fine-tuning from the same base, clients and batches as speaker-r8-steps100 (every weight trained, lr
# 1e-3): FedAvg (normalised Task Arithmetic), TIES, DARE and Model Stock on the task vectors, and fedlmc's
# weight-matched universe; the LoRA rows to set beside it are speaker-r8-steps100's
FULL = ("fedavg", "ties", "dare", "model-stock", "aligned")
SETTINGS["full-speaker-steps100"] = dict(full=True, scheme="speaker", ranks=[0] * CLIENTS, lr=1e-3, steps=100, rounds=4)
SETTINGS["full-speaker-steps100"]["methods"] = FULL
# The task-vector merges as these files ran them: weights normalised, DARE's survivors × 1 / (1 − drop)
TASK_MERGE = {"ties": {}, "model-stock": {}, "dare": dict(normalize=True, rescale="inverse")}
TASK_MERGE["task-arithmetic"] = dict(normalize=True)
DEFAULTS = dict(family=FAMILY, base_steps=BASE_STEPS, targets=TARGETS, alpha=ALPHA, lr=LR, clients=CLIENTS)


def fedlmc_options(method: str) -> dict:
    """``LoraAggregator``'s options for a ``fedlmc[-gauge][-tail][+adam]`` row (defaults where unnamed)."""
    from fedlmc.lora import GAUGES, TAILS

    parts = method.removesuffix("+adam").split("-")[1:]
    return {("gauge" if x in GAUGES else "tail"): x for x in parts if x in GAUGES + TAILS}


class Clients:
    """The pretrained base, a PEFT model per rank, and LoRA training / evaluation on them."""

    def __init__(
        self, family: str = FAMILY, base_steps: int = BASE_STEPS, targets=TARGETS, alpha: float = ALPHA, lr: float = LR
    ) -> None:
        from fedlmc.hf.pretrained import pretrained_base

        self.base = pretrained_base(family, base_steps, progress=False)
        self.targets, self.alpha, self.lr = list(targets), alpha, lr
        self.models, self.layouts, self.pristine = {}, {}, {}

    def model(self, rank: int):
        from peft import LoraConfig, get_peft_model

        from fedlmc.lora import LoraLayout

        if rank not in self.models:
            cfg = LoraConfig(r=rank, lora_alpha=self.alpha, target_modules=self.targets, lora_dropout=0.0)
            m = get_peft_model(copy.deepcopy(self.base), cfg)
            self.models[rank], self.layouts[rank] = m, LoraLayout.of(m)
            self.pristine[rank] = {
                mod.base_key: m.state_dict()[mod.base_key].clone() for mod in self.layouts[rank].modules
            }
        return self.models[rank]

    def init(self, rank: int, seed: int):
        """PEFT's own initial adapter (A kaiming-uniform, B = 0) for ``seed``."""
        m = self.model(rank)
        torch.manual_seed(seed)
        for mod in m.modules():
            if hasattr(mod, "reset_lora_parameters") and "default" in getattr(mod, "lora_A", {}):
                mod.reset_lora_parameters("default", True)
        from peft import get_peft_model_state_dict

        return self.layouts[rank].read(get_peft_model_state_dict(m), mixed_ranks=True)

    def load(self, rank, factors, base_delta=None):
        from peft import set_peft_model_state_dict

        m, layout = self.model(rank), self.layouts[rank]
        params = dict(m.named_parameters())
        with torch.no_grad():
            for mod in layout.modules:
                w = self.pristine[rank][mod.base_key]
                d = (base_delta or {}).get(mod.name)
                d = d.T if d is not None and mod.fan_in_fan_out else d  # GPT-2's Conv1D stores in × out
                params[mod.base_key].copy_(w if d is None else w + d.to(w.dtype))
        set_peft_model_state_dict(m, layout.write(factors))
        return m

    def train(self, rank, factors, base_delta, data, steps, seed, freeze_a=False, optimizer_state=None):
        from peft import get_peft_model_state_dict

        from fedlmc.hf.pretrained import train_lm

        m = self.load(rank, factors, base_delta)
        params = [p for n, p in m.named_parameters() if "lora_" in n and not (freeze_a and "lora_A" in n)]
        trained = {id(p) for p in params}
        for p in m.parameters():
            p.requires_grad_(id(p) in trained)
        train_lm(
            m, data, steps, lr=self.lr, batch_size=BATCH, seed=seed, params=params, optimizer_state=optimizer_state
        )
        return self.layouts[rank].read(get_peft_model_state_dict(m), mixed_ranks=True)

    def loss(self, rank, factors, base_delta, test) -> float:
        from fedlmc.hf.pretrained import test_loss

        return test_loss(self.load(rank, factors, base_delta), test, TEST_BATCHES)


def fbytes(factors, part="both") -> int:
    """float32 bytes of ``{module: (B, A)}`` (``part``: "A", "B" or both)."""
    return sum(4 * (b.numel() * (part != "A") + a.numel() * (part != "B")) for b, a in factors.values())


def held_updates(layout, g, delta, rank: int) -> dict[str, torch.Tensor]:
    """The global adapter's dense update per module (s·B·A at ``rank``), plus any base update ``delta``."""
    out = {}
    for m in layout.modules:
        b, a = g[m.name]
        out[m.name] = m.scaling(rank) * b.double() @ a.double() + (delta or {}).get(m.name, 0)
    return out


def dense_bytes(layout) -> int:
    return sum(4 * m.out_features * m.in_features for m in layout.modules)


def merge_full(method: str, base, clients: list, weights: list[float]):
    """The global model's state after a full fine-tuning round: ``base`` the model the round sent."""
    from fedlmc.baselines import TaskMerge
    from fedlmc.baselines.task_vectors import task_vector_merge

    if method != "aligned":
        method = "task-arithmetic" if method == "fedavg" else method
        merge = TaskMerge(method=method, **TASK_MERGE[method])
        return task_vector_merge(base.state_dict(), [c.state_dict() for c in clients], weights, merge)
    from fedlmc.hf import from_hf, to_hf
    from fedlmc.merging.universe import universe_merge

    merged, _ = universe_merge([from_hf(c) for c in clients], weights, from_hf(base))
    return to_hf(merged).state_dict()


def run_full(setting: str, seed: int) -> dict:
    """Every method of a full fine-tuning ``setting`` on one seed's clients (round 1 computed once)."""
    from fedlmc.hf.pretrained import finetune_partitions, pretrain_and_finetune_text, pretrained_base, train_lm
    from fedlmc.hf.pretrained import test_loss as loss_of

    cfg = {**DEFAULTS, **SETTINGS[setting]}
    base = pretrained_base(cfg["family"], cfg["base_steps"], progress=False)
    parts = finetune_partitions(cfg["clients"], cfg["scheme"], seed=seed)
    test = pretrain_and_finetune_text()[2]
    weights = [float(len(p)) for p in parts]
    out = {"setting": setting, "seed": seed, "rows": {}, "base_loss": loss_of(base, test, TEST_BATCHES)}
    first: list = []
    nbytes = sum(4 * t.numel() for t in base.state_dict().values())
    for method in cfg["methods"]:
        t_start, glob, losses, server_s = time.perf_counter(), copy.deepcopy(base), [], []
        for rnd in range(1, cfg["rounds"] + 1):
            if rnd == 1 and first:
                clients = first
            else:
                clients = []
                for i, data in enumerate(parts):
                    m = copy.deepcopy(glob)
                    train_lm(m, data, cfg["steps"], lr=cfg["lr"], batch_size=BATCH, seed=10_000 * seed + 100 * rnd + i)
                    clients.append(m)
                first = first or clients
            t0 = time.perf_counter()
            state = merge_full(method, glob, clients, weights)
            server_s.append(time.perf_counter() - t0)
            glob.load_state_dict(state)
            losses.append(loss_of(glob, test, TEST_BATCHES))
        n = len(parts)
        out["rows"][method] = {
            "test_loss": losses,
            "bytes_up": [n * nbytes] * len(losses),
            "bytes_down": [n * nbytes] * len(losses),
            "server_seconds": server_s,
            "server_held_bytes": [nbytes] * len(losses),
            "server_dense_bytes": 0,
            "test_loss_server_product": [],
            "energy_shares": [],
            "wall_seconds": time.perf_counter() - t_start,
        }
        print(f"  {setting} seed {seed} {method}: " + " ".join(f"{x:.4f}" for x in losses), flush=True)
    return out


def run(setting: str, seed: int) -> dict:
    """Every method of ``setting`` on one seed's clients."""
    torch.set_num_threads(1)
    if SETTINGS[setting].get("full"):
        return run_full(setting, seed)
    from fedlmc.baselines import TaskMerge
    from fedlmc.baselines import lora as lb
    from fedlmc.hf.pretrained import finetune_partitions, pretrain_and_finetune_text
    from fedlmc.lora import LoraAggregator

    cfg = {**DEFAULTS, **SETTINGS[setting]}
    world = Clients(cfg["family"], cfg["base_steps"], cfg["targets"], cfg["alpha"], cfg["lr"])
    parts = finetune_partitions(cfg["clients"], cfg["scheme"], seed=seed)
    test = pretrain_and_finetune_text()[2]
    weights = [float(len(p)) for p in parts]
    ranks, rounds, steps = cfg["ranks"], cfg["rounds"], cfg["steps"]
    rmax = max(ranks)
    world.model(rmax)
    layout = world.layouts[rmax]
    init = {r: world.init(r, 1000 + seed) for r in set(ranks) | {rmax}}
    zero = {n: (torch.zeros_like(b), a) for n, (b, a) in init[rmax].items()}
    first_round: dict = {}
    out = {"setting": setting, "seed": seed, "rows": {}}
    base_loss = world.loss(rmax, zero, None, test)

    def local(i, start, delta, rnd, freeze=False, adam=None):
        key = (i, freeze)
        fresh = delta is None and all(
            torch.equal(start[n][1], init[ranks[i]][n][1]) and not start[n][0].any() for n in start
        )
        if rnd == 1 and fresh and key in first_round and adam is None:
            return first_round[key]
        f = world.train(
            ranks[i], start, delta, parts[i], steps, seed=10_000 * seed + 100 * rnd + i, freeze_a=freeze,
            optimizer_state=adam,
        )  # fmt: skip
        if rnd == 1 and fresh and adam is None:
            first_round[key] = f
        return f

    for method in cfg["methods"]:
        t_start = time.perf_counter()
        losses, up, down, server_s, held, product_losses, energy = [], [], [], [], [], [], []
        g = init[rmax]  # the global factors (FedIT's means, FlexLoRA's cut...)
        delta = None  # a base update (FLoRA's stacks, FedEx-LoRA's residuals, fedlmc-fold)
        local_b = [init[r] for r in ranks]  # FedSA-LoRA's personal B
        agg, replies = None, []  # replies: the last round's (FlexLoRA cuts them for each client)
        adams = [{} for _ in ranks] if method.endswith("+adam") else [None] * len(ranks)  # AdamW across rounds
        if method.startswith("fedlmc"):
            agg = LoraAggregator(layout, **fedlmc_options(method))
            agg.start(init[rmax])
        for rnd in range(1, rounds + 1):
            starts, deltas, freeze = [], [], method == "ffa-lora"
            if method == "flexlora" and rnd > 1:  # one SVD of the sum per rank, not one per client
                cut = {r: lb.flexlora(layout, replies, weights, r) for r in set(ranks)}
            for i, r in enumerate(ranks):
                if rnd == 1 and method not in ("ffa-lora", "fedsa-lora"):  # every method's first start
                    s = init[r]
                elif method in (
                    "average",
                    "average+adam",
                    "hetlora",
                    "fedex-lora",
                    "fedrot-lora",
                    *lb.TASK_VECTOR_METHODS,
                ):
                    s = {n: lb.pad(b, a, r) for n, (b, a) in g.items()}
                elif method == "ffa-lora":
                    s = {n: (g[n][0], init[r][n][1]) for n in g}
                elif method == "fedsa-lora":
                    s = {n: (local_b[i][n][0], g[n][1]) for n in g}
                elif method == "flora":
                    s = init[r]
                elif method == "flexlora":
                    s = cut[r]
                else:
                    s = agg.factors(r)
                starts.append(s)
                deltas.append(delta)
            replies = [local(i, starts[i], deltas[i], rnd, freeze, adams[i]) for i in range(len(ranks))]
            t0 = time.perf_counter()
            if method in ("average", "average+adam", "hetlora", "ffa-lora", "fedsa-lora"):
                g = lb.factor_mean(layout, replies, weights, rmax)
                if method == "fedsa-lora":
                    local_b = replies
            elif method == "flora":
                stack = lb.flora(layout, replies, weights)
                delta = {n: (delta or {}).get(n, 0) + p for n, p in lb.stacked_product(stack).items()}
            elif method == "flexlora":
                g = lb.flexlora(layout, replies, weights, rmax)
            elif method == "fedrot-lora":  # rotated onto the adapter the round sent, then FedIT's means
                g = lb.fedrot_lora(layout, replies, weights, g, rmax)
            elif method in lb.TASK_VECTOR_METHODS:  # the dense products merged as task vectors, cut to the rank
                name = lb.TASK_VECTOR_METHODS[method]
                merge = TaskMerge(method=name, **TASK_MERGE[name])
                g = lb.task_vector_lora(layout, replies, weights, rmax, merge)
            elif method == "fedex-lora":
                g, residual = lb.fedex_lora(layout, replies, weights, rmax)
                delta = {n: (delta or {}).get(n, 0) + p for n, p in residual.items()}
            else:
                agg.aggregate(replies, weights)
                g = agg.factors()
                if agg.tail == "fold":
                    delta = {m.name: agg.base[m.name] for m in layout.modules if m.name in agg.base}
            server_s.append(time.perf_counter() - t0)
            # the global model and its test loss
            if method == "ffa-lora":
                losses.append(world.loss(rmax, {n: (g[n][0], init[rmax][n][1]) for n in g}, None, test))
            elif method == "fedsa-lora":  # personalised: each client's own B with the shared A
                losses.append(
                    statistics.mean(
                        world.loss(r, {n: (local_b[i][n][0], g[n][1]) for n in g}, None, test)
                        for i, r in enumerate(ranks)
                    )
                )
            elif method == "flora":
                losses.append(world.loss(rmax, zero, delta, test))
            else:
                losses.append(world.loss(rmax, g, delta, test))
            if len(set(ranks)) > 1:  # mixed ranks: where the global update's energy sits, per client rank
                held_update = dict(delta or {}) if method == "flora" else held_updates(layout, g, delta, rmax)
                energy.append(lb.energy_shares(held_update, sorted(set(ranks))))
            if method == "fedlmc":  # the server's exact product merged into the base (what "keep" holds)
                full = {n: agg.products[n].dense() for n in agg.products}
                product_losses.append(world.loss(rmax, zero, full, test))
            # bytes on the wire this round (float32)
            part = {"ffa-lora": "B", "fedsa-lora": "A"}.get(method, "both")
            up.append(sum(fbytes(rep, part) for rep in replies))
            if method == "flora":
                down.append(len(ranks) * fbytes(stack))
            elif method == "fedex-lora" or (agg is not None and agg.tail == "fold"):
                down.append(sum(fbytes(s) for s in starts) + len(ranks) * dense_bytes(layout))
            else:
                down.append(sum(fbytes(s, part) for s in starts))
            held.append(
                agg.state_bytes
                if agg is not None
                else fbytes(stack)
                if method == "flora"
                else fbytes(g) + (dense_bytes(layout) if method == "fedex-lora" else 0)
            )
        out["rows"][method] = {
            "test_loss": losses,
            "bytes_up": up,
            "bytes_down": down,
            "server_seconds": server_s,
            "server_held_bytes": held,
            "server_dense_bytes": dense_bytes(layout) if method in ("flexlora", "fedex-lora") else 0,
            "test_loss_server_product": product_losses,
            "energy_shares": energy,
            "wall_seconds": time.perf_counter() - t_start,
        }
        print(f"  {setting} seed {seed} {method}: " + " ".join(f"{x:.4f}" for x in losses), flush=True)
    out["base_loss"] = base_loss
    return out


def summarise(setting: str, runs: list[dict]) -> dict:
    cfg = SETTINGS[setting]
    rows = {}
    for method in cfg["methods"]:
        per_seed = [r["rows"][method] for r in runs]
        curves = [p["test_loss"] for p in per_seed]
        mean = [statistics.mean(c[i] for c in curves) for i in range(len(curves[0]))]
        rows[method] = {
            "test_loss": mean,
            "test_loss_per_seed": curves,
            "final_loss": mean[-1],
            "final_loss_range": [min(c[-1] for c in curves), max(c[-1] for c in curves)],
            "bytes_up_per_round": statistics.mean(x for p in per_seed for x in p["bytes_up"]),
            "bytes_down_per_round": statistics.mean(x for p in per_seed for x in p["bytes_down"]),
            "server_seconds_per_round": statistics.median(x for p in per_seed for x in p["server_seconds"]),
            "server_held_bytes": max(x for p in per_seed for x in p["server_held_bytes"]),
            "server_dense_bytes": per_seed[0]["server_dense_bytes"],
        }
        shares = [p["energy_shares"][-1] for p in per_seed if p.get("energy_shares")]
        if shares:  # the last round's energy per client rank, mean over seeds
            rows[method]["energy_shares"] = {r: statistics.mean(s[r] for s in shares) for r in shares[0]}
        products = [p["test_loss_server_product"] for p in per_seed if p["test_loss_server_product"]]
        if products:
            rows[method]["test_loss_server_product"] = [
                statistics.mean(c[i] for c in products) for i in range(len(products[0]))
            ]
    ref = next(m for m in ("hetlora", "average", "fedavg") if m in rows)
    target = rows[ref]["final_loss"]
    for row in rows.values():
        row["rounds_to_reference_final"] = next((i + 1 for i, x in enumerate(row["test_loss"]) if x <= target), None)
    return {
        "setting": setting,
        "config": {
            **{k: v for k, v in {**DEFAULTS, **cfg}.items() if k != "methods"},
            "batch_size": BATCH,
        },
        "seeds": [r["seed"] for r in runs],
        "reference": ref,
        "base_loss": statistics.mean(r["base_loss"] for r in runs),
        "rows": rows,
        "environment": environment(),
    }


def merged(path: Path, new: dict) -> dict:
    """``new``'s rows added to the results at ``path``, once its reference row reproduces the stored one
    on every seed (the same clients, batches and code): the rows run before stand as they are."""
    import json

    old = json.loads(path.read_text())
    ref = new["reference"]
    if old["seeds"] != new["seeds"] or old["reference"] != ref:
        raise SystemExit(f"{path}: seeds or reference differ ({old['seeds']} vs {new['seeds']})")
    a, b = old["rows"][ref]["test_loss_per_seed"], new["rows"][ref]["test_loss_per_seed"]
    gap = max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca, cb))
    if gap > 1e-6:
        raise SystemExit(f"{path}: {ref} does not reproduce (largest gap {gap:.2e}): rerun the setting whole")
    added = {m: r for m, r in new["rows"].items() if m != ref}
    out = {**old, "rows": {**{m: r for m, r in old["rows"].items() if m not in added}, **added}}
    out["reproduced"] = {"method": ref, "largest_gap": gap, "added": list(added)}
    out["environment"] = new["environment"]
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for method, row in res["rows"].items():
        xs = list(range(1, len(row["test_loss"]) + 1))
        lo = [min(c[i] for c in row["test_loss_per_seed"]) for i in range(len(xs))]
        hi = [max(c[i] for c in row["test_loss_per_seed"]) for i in range(len(xs))]
        style = "-" if method.startswith("fedlmc") else "--"
        ax.plot(xs, row["test_loss"], style, marker="o", ms=3, label=method, lw=2 if method == "fedlmc" else 1)
        ax.fill_between(xs, lo, hi, alpha=0.12)
    ax.axhline(res["base_loss"], color="grey", lw=0.8, ls=":", label="pretrained base")
    ax.set_xticks(range(1, res["config"]["rounds"] + 1))
    ax.set_xlabel("round")
    ax.set_ylabel("global test loss")
    cfg = res["config"]
    ax.set_title(
        f"{res['setting']}: {cfg['clients']} clients, ranks {sorted(set(cfg['ranks']))}, {len(res['seeds'])} seeds"
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(results: list[dict]) -> str:
    header = "| method | final test loss (range over seeds) | − {ref}'s, per seed | rounds to {ref}'s final | "
    header += "KB up / round | KB down / round | server held KB | server s / round |"
    lines = []
    for res in results:
        cfg, ref = res["config"], res["reference"]
        seeds = ", ".join(map(str, res["seeds"]))
        lines += [f"### {res['setting']}", ""]
        what = (
            f"full fine-tuning at lr {cfg.get('lr', LR):g}"
            if cfg.get("full")
            else f"LoRA r {'/'.join(map(str, sorted(set(cfg['ranks']))))} on {', '.join(cfg.get('targets', TARGETS))}, "
            f"α {cfg.get('alpha', ALPHA)}, lr {cfg.get('lr', LR):g}"
        )
        lines += [
            f"{cfg.get('family', FAMILY)}, {what}; {cfg['clients']} clients ({cfg['scheme']}), {cfg['steps']} local "
            f"steps, {cfg['rounds']} rounds, seeds {seeds}; base pretrained {cfg.get('base_steps', BASE_STEPS)} steps, "
            f"test loss {res['base_loss']:.4f}."
        ]
        lines += ["", header.format(ref=ref), "|---|---|---|---|---|---|---|---|"]
        base = [c[-1] for c in res["rows"][ref]["test_loss_per_seed"]]
        for method, row in res["rows"].items():
            lo, hi = row["final_loss_range"]
            held = row["server_held_bytes"] + row["server_dense_bytes"]
            cells = [
                method,
                f"{row['final_loss']:.4f} ({lo:.4f}–{hi:.4f})",
                " / ".join(f"{c[-1] - b:+.4f}" for c, b in zip(row["test_loss_per_seed"], base)),
                str(row["rounds_to_reference_final"] or "—"),
                f"{row['bytes_up_per_round'] / 1e3:.0f}",
                f"{row['bytes_down_per_round'] / 1e3:.0f}",
                f"{held / 1e3:.0f}",
                f"{row['server_seconds_per_round']:.3f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        energy = {m: row["energy_shares"] for m, row in res["rows"].items() if row.get("energy_shares")}
        if energy:
            ranks = list(next(iter(energy.values())))
            lines += ["", "Share of the global update's energy in its leading r components (last round):", ""]
            lines += ["| method | " + " | ".join(f"r = {r}" for r in ranks) + " |", "|---|" + "---|" * len(ranks)]
            lines += [f"| {m} | " + " | ".join(f"{e[r]:.3f}" for r in ranks) + " |" for m, e in energy.items()]
        if "test_loss_server_product" in res["rows"].get("fedlmc", {}):
            final = res["rows"]["fedlmc"]["test_loss_server_product"][-1]
            lines += ["", f"fedlmc's exact product merged into the base (what tail=keep holds): {final:.4f}."]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default="results")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 steps, 2 rounds per setting")
    p.add_argument("--tables", action="store_true", help="only rewrite the summary and plots from --out's JSON")
    p.add_argument(
        "--methods",
        help="run only these methods (comma-separated) and add their rows to --out's JSON of each setting, "
        "after checking that its reference method (FedIT, HetLoRA or FedAvg, always run) reproduces",
    )
    args = p.parse_args()
    if args.quick:
        for cfg in SETTINGS.values():
            cfg.update(steps=2, rounds=2)
    settings, seeds = args.settings.split(","), [int(s) for s in args.seeds.split(",")]
    for s in settings:
        if s not in SETTINGS:
            raise SystemExit(f"unknown setting {s!r}; choose from {', '.join(SETTINGS)}")
    adding = None
    if args.methods:
        adding = [m for m in args.methods.split(",") if m]
        for s in settings:
            listed = SETTINGS[s]["methods"]
            unknown = [m for m in adding if m not in listed]
            if unknown:
                raise SystemExit(f"{s} has no method {unknown}; it runs {', '.join(listed)}")
            ref = next(m for m in ("hetlora", "average", "fedavg") if m in listed)
            SETTINGS[s] = {**SETTINGS[s], "methods": tuple(m for m in listed if m == ref or m in adding)}
    if args.tables:
        import json

        results = [json.loads((Path(args.out) / f"lora_{s}.json").read_text()) for s in settings]
        for res in results:
            plot(res, Path(args.out) / f"lora_{res['setting']}.png")
        print(markdown(results))
        return
    from fedlmc.hf.pretrained import pretrained_base

    for family, steps in {
        (SETTINGS[s].get("family", FAMILY), SETTINGS[s].get("base_steps", BASE_STEPS)) for s in settings
    }:
        pretrained_base(family, steps)  # once per base, cached, before the workers load it
    import ray

    ray.init(num_cpus=args.workers, include_dashboard=False, _temp_dir="/tmp/ray", log_to_driver=True)
    task = ray.remote(num_cpus=1)(run)
    t0 = time.perf_counter()
    pending = {task.remote(s, seed): (s, seed) for s in settings for seed in seeds}
    done: dict[str, list] = {s: [] for s in settings}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        s, seed = pending.pop(ready[0])
        done[s].append(ray.get(ready[0]))
        print(f"done {s} seed {seed} ({time.perf_counter() - t0:.0f} s; {len(pending)} left)", flush=True)
    ray.shutdown()
    out, results = Path(args.out), []
    for s in settings:
        res = summarise(s, sorted(done[s], key=lambda r: r["seed"]))
        res["wall_seconds_all_settings"] = time.perf_counter() - t0
        if adding is not None:
            res = merged(out / f"lora_{s}.json", res)
        write_results(out / f"lora_{s}.json", res)
        plot(res, out / f"lora_{s}.png")
        results.append(res)
    print(markdown(results))


if __name__ == "__main__":
    main()
