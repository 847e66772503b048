"""The ServerApp: Flower's FedAvg, or fedlmc's AlignedFedAvg in its place (the one changed line)."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedlmc.strategies import AlignedFedAvg
from quickstart.task import Net, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    torch.set_num_threads(1)
    model = Net()
    if context.run_config["strategy"] == "fedavg":
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    else:
        strategy = AlignedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, model=model)  # the one changed line
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(context.run_config["num-server-rounds"]),
        train_config=ConfigRecord({}),
    )
    model.load_state_dict(result.arrays.to_torch_state_dict())  # the same keys and shapes: LayerNorm kept
    ev = test(model)
    print(
        f"quickstart result: strategy={type(strategy).__name__} test_loss={ev['loss']:.4f} test_acc={ev['acc']:.3f}",
        flush=True,
    )
