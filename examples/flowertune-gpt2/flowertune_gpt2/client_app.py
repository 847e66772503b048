"""The ClientApp, as FlowerTune's: load the global adapter, fine-tune it on this client's shard, reply
with ``get_peft_model_state_dict`` and ``num-examples``. It knows nothing of the server's strategy."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from flowertune_gpt2.dataset import load_data
from flowertune_gpt2.models import get_model, train

app = ClientApp()


@app.train()
def fit(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    cfg = context.run_config
    model = get_model(cfg)
    set_peft_model_state_dict(model, msg.content["arrays"].to_torch_state_dict())
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    data = load_data(pid, n, str(cfg["partitioner"]))
    seed = 100_000 * int(cfg["seed"]) + 1000 * int(msg.content["config"]["server-round"]) + pid
    loss = train(model, data, int(cfg["local-steps"]), float(cfg["lr"]), int(cfg["batch-size"]), seed)
    content = RecordDict(
        {
            "arrays": ArrayRecord(get_peft_model_state_dict(model)),
            "metrics": MetricRecord({"train-loss": loss, "num-examples": len(data)}),
        }
    )
    return Message(content=content, reply_to=msg)
