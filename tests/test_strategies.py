"""Strategy unit tests: aggregate_train on crafted replies (no Flower runtime needed)."""
from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedlmc.canonical import canonicalize, to_layernorm
from fedlmc.models import from_preset
from fedlmc.symmetry import apply_transform, random_transform
from strategies import AlignedFedAvg
from strategies.records import config_record, model_from_arrays

from conftest import perturbed


def _reply(model, n: int, node: int = 1) -> Message:
    """A train reply as a SuperNode would send it (weights, num-examples, the model's config)."""
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict={k: v.float() for k, v in model.state_dict().items()}),
                          "metrics": MetricRecord({"num-examples": n}), "model": config_record(model)})
    md = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="i",
                  group_id="1", created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    return Message(content=content, metadata=md)


def test_planted_replies_aggregate_to_the_model(record):
    torch.manual_seed(0)
    base = perturbed(from_preset("vit-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4), 0, 0.2).float()
    canon = canonicalize(base)
    # each client holds the same function in its own coordinates (a LayerNorm model, as clients train)
    clients = [to_layernorm(apply_transform(canon, random_transform(canon, seed=s, fix_ones=True, dtype=torch.float32,
                                                                    groups=["residual", "heads", "ff"])))
               for s in range(3)]
    replies = [_reply(c, 100 + 10 * i, node=i + 1) for i, c in enumerate(clients)]
    x = torch.randn(8, 1, 12, 12)
    strategy = AlignedFedAvg(model_config=base.config.to_dict())
    strategy._previous = ArrayRecord(torch_state_dict=clients[0].state_dict())
    arrays, metrics = strategy.aggregate_train(1, replies)
    merged = model_from_arrays(arrays, base.config.to_dict())
    with torch.no_grad():
        gap = float((merged(x) - base(x)).abs().max() / base(x).abs().max())
        plain_arrays, _ = FedAvg().aggregate_train(1, replies)
        fedavg_gap = float((model_from_arrays(plain_arrays, base.config.to_dict())(x) - base(x)).abs().max() / base(x).abs().max())
    record("AlignedFedAvg on 3 planted replies: relative |Δlogits|", gap, 1e-3)
    assert fedavg_gap > 0.1, fedavg_gap  # plain FedAvg of the same replies is a different function
    assert merged.config.norm == "layernorm" and isinstance(metrics, MetricRecord)
    assert strategy.history and strategy.history[0]["align_seconds"] > 0
