"""The ClientApp: a plain PyTorch loop on this client's shard, replying with arrays and ``num-examples``
as in Flower's Hugging Face examples. It knows nothing of fedlmc's strategies."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from hf_vit.task import Net, fit, load_data

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=True)
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    data = load_data(pid, n)
    loss = fit(model, data, int(context.run_config["local-steps"]), float(context.run_config["lr"]), seed=pid)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(data), "train-loss": loss}),
        }
    )
    return Message(content=content, reply_to=msg)
