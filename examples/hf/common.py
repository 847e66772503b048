"""What the three Hugging Face example apps share: a plain PyTorch training loop on the client's shard
and a ServerApp that runs a strategy and reports the final model's test loss. The apps themselves
(``gpt2.py``, ``vit.py``, ``llama.py``) only build their ``transformers`` model and pick the strategy.

The ClientApp knows nothing of fedlmc's strategies: it loads the arrays, trains, and replies with
arrays and ``num-examples``, as in Flower's Hugging Face examples. (Data comes from ``fedlmc.data``
for brevity: Tiny Shakespeare is bundled, char-level, so no tokenizer download.)
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from fedlmc.data import load
from fedlmc.data.partition import partition

LOCAL_STEPS = int(os.environ.get("EXAMPLE_LOCAL_STEPS", "20"))
EVAL_BATCHES = 4


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A ``transformers`` model's logits for token ids or images."""
    out = model(pixel_values=x) if x.is_floating_point() else model(input_ids=x)
    return out.logits


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = logits(model, x)
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1))


def test_loss(model: torch.nn.Module, dataset: str) -> float:
    model.eval()
    with torch.no_grad():
        losses = [float(loss_of(model, x, y)) for _, (x, y) in zip(range(EVAL_BATCHES), load(dataset).test.batches(64))]
    return sum(losses) / len(losses)


def client_app(make_model: Callable[[], torch.nn.Module], dataset: str) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        model = make_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=True)
        pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
        shard = partition(load(dataset).train, n, "iid", seed=0)[pid]
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        gen = torch.Generator().manual_seed(pid)
        for step, (x, y) in zip(range(LOCAL_STEPS), _endless(shard, gen)):
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"num-examples": len(shard), "train-loss": float(loss)})})
        return Message(content=content, reply_to=msg)

    return app


def _endless(shard, gen: torch.Generator):
    while True:
        yield from shard.batches(32, shuffle=True, generator=gen)


def server_app(make_model: Callable[[], torch.nn.Module], make_strategy: Callable[[torch.nn.Module], Strategy],
               dataset: str, tag: str, rounds: int = 2) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        model = make_model()
        strategy = make_strategy(model)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
                                train_config=ConfigRecord({}))
        model.load_state_dict(result.arrays.to_torch_state_dict(), strict=True)  # the client's own keys
        print(f"{tag} result: strategy={type(strategy).__name__} test_loss={test_loss(model, dataset):.4f}", flush=True)

    return app


def simulate(server: ServerApp, client: ClientApp, supernodes: int = 2) -> None:
    """Run the app on Flower's simulation engine (Ray), as ``flwr run`` would."""
    from flwr.simulation import run_simulation

    from simulations.simulate import ray_env

    ray_env()
    run_simulation(server_app=server, client_app=client, num_supernodes=supernodes,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
