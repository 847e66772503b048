"""An ordinary Flower app (Message API) whose server swaps ``FedAvg`` for ``AlignedFedAvg`` — the only
change. The ClientApp knows nothing of fedlmc's strategies: it loads the arrays into its model, trains,
and replies with arrays and ``num-examples``, exactly as in Flower's PyTorch quickstart.

    python -m examples.dropin.app        # 2 rounds on 2 SuperNodes (Ray simulation engine)
"""
from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedlmc.data import load
from fedlmc.data.partition import partition
from fedlmc.models import from_preset
from fedlmc.train import TrainConfig, evaluate, train
from fedlmc.strategies import AlignedFedAvg  # was: from flwr.serverapp.strategy import FedAvg


def Net() -> torch.nn.Module:
    torch.manual_seed(0)
    return from_preset("vit-digits")


client = ClientApp()


@client.train()
def client_train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    data = partition(load("digits").train, n, "iid", seed=0)[pid]
    train(model, data, TrainConfig(steps=10, lr=3e-3, batch_size=32, seed=pid), progress=False)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": len(data)})})
    return Message(content=content, reply_to=msg)


server = ServerApp()
RESULT: dict = {}


@server.main()
def server_main(grid: Grid, context: Context) -> None:
    model = Net()
    # strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    strategy = AlignedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, model=model.config.to_dict())
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=2,
                            train_config=ConfigRecord({}))
    model.load_state_dict(result.arrays.to_torch_state_dict())  # same keys and shapes as before: LayerNorm kept
    RESULT.update(test=evaluate(model, load("digits").test), history=strategy.history)
    print("dropin result:", RESULT["test"], [h["kept"] for h in strategy.history], flush=True)


if __name__ == "__main__":
    from flwr.simulation import run_simulation

    from simulations.simulate import ray_env

    ray_env()
    run_simulation(server_app=server, client_app=client, num_supernodes=2,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
