"""The ServerApp, as FlowerTune's: the initial adapter from ``get_peft_model_state_dict``, a strategy,
and a centralised test of the global adapter after every round. Changing Flower's FedAvg for fedlmc's
LoraFedAvg is the one line marked."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from fedlmc.hf.pretrained import test_loss
from fedlmc.strategies import LoraFedAvg
from flowertune_gpt2.dataset import load_test
from flowertune_gpt2.models import get_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    torch.set_num_threads(1)
    cfg = context.run_config
    model = get_model(cfg)  # pretrains (and caches) the base before any client needs it
    fraction = float(cfg["fraction-train"])
    if cfg["strategy"] == "fedavg":
        strategy = FedAvg(fraction_train=fraction, fraction_evaluate=0.0)
    else:
        strategy = LoraFedAvg(fraction_train=fraction, fraction_evaluate=0.0, model=model)  # the one changed line
    test = load_test()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        set_peft_model_state_dict(model, arrays.to_torch_state_dict())
        loss = test_loss(model, test)
        print(f"round {server_round}: test_loss={loss:.4f}", flush=True)
        return MetricRecord({"test-loss": loss})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(get_peft_model_state_dict(model)),
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=ConfigRecord({}),
        evaluate_fn=evaluate,
    )
    final = evaluate(int(cfg["num-server-rounds"]), result.arrays)["test-loss"]
    print(f"flowertune-gpt2 result: strategy={type(strategy).__name__} test_loss={final:.4f}", flush=True)
