"""Strategy unit tests: aggregate_train on crafted replies (no Flower runtime needed)."""

from __future__ import annotations

import json
import os
from typing import Optional

import pytest
import torch
from conftest import metadata, perturbed
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedlmc.models import from_preset
from fedlmc.options import Guard, Refinement, Report, Scale, Universe
from fedlmc.strategies import AlignedFedAvg
from fedlmc.strategies.records import MODEL_CONFIG_KEY, config_record, model_from_arrays
from fedlmc.symmetry import apply_transform, canonicalize, random_transform, to_layernorm


def _reply(model, n: int, node: int = 1, partition: Optional[int] = None) -> Message:
    """A train reply as a SuperNode would send it (weights, num-examples, the model's config, and with
    ``partition`` who the client is)."""
    content = RecordDict(
        {
            "arrays": ArrayRecord(torch_state_dict={k: v.float() for k, v in model.state_dict().items()}),
            "metrics": MetricRecord({"num-examples": n}),
            "model": config_record(model),
        }
    )
    if partition is not None:
        content["client"] = ConfigRecord({"partition-id": partition})
    md = metadata(node)
    return Message(content=content, metadata=md)


def test_planted_replies_aggregate_to_the_model(record):
    torch.manual_seed(0)
    base = perturbed(
        from_preset("vit-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4), 0, 0.2
    ).float()
    canon = canonicalize(base)
    # each client holds the same function in its own coordinates (a LayerNorm model, as clients train)
    clients = [
        to_layernorm(
            apply_transform(
                canon,
                random_transform(canon, seed=s, fix_ones=True, dtype=torch.float32, groups=["residual", "heads", "ff"]),
            )
        )
        for s in range(3)
    ]
    replies = [_reply(c, 100 + 10 * i, node=i + 1) for i, c in enumerate(clients)]
    x = torch.randn(8, 1, 12, 12)
    strategy = AlignedFedAvg(model=base.config.to_dict())
    strategy._previous = ArrayRecord(torch_state_dict=clients[0].state_dict())
    arrays, metrics = strategy.aggregate_train(1, replies)
    merged = model_from_arrays(arrays, base.config.to_dict())
    with torch.no_grad():
        gap = float((merged(x) - base(x)).abs().max() / base(x).abs().max())
        plain_arrays, _ = FedAvg().aggregate_train(1, replies)
        fedavg_gap = float(
            (model_from_arrays(plain_arrays, base.config.to_dict())(x) - base(x)).abs().max() / base(x).abs().max()
        )
    record("AlignedFedAvg on 3 planted replies: relative |Δlogits|", gap, 1e-3)
    assert fedavg_gap > 0.1, fedavg_gap  # plain FedAvg of the same replies is a different function
    assert merged.config.norm == "layernorm" and isinstance(metrics, MetricRecord)
    rec = strategy.history[0]
    assert rec["kept"] == "aligned" and rec["excluded"] == [] and rec["failures"] == []
    assert len(rec["moved"]) == 3 and max(rec["moved"]) > 0.5  # the planted clients had to be moved


def test_scale_threads_0_combines_on_every_core_and_the_apps_threads_come_back():
    """The simulations run each app on one torch thread; ``Scale(threads=0)`` combines a round on
    every core (the clients wait) and restores the app's setting after; the default leaves it alone."""
    base, clients = _planted_clients()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        strategy = AlignedFedAvg(model=base.config.to_dict(), scale=Scale(threads=0))
        strategy.aggregate_train(1, [_reply(c, 100, node=i + 1) for i, c in enumerate(clients)])
        assert strategy.history[0]["threads"] == len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == 1
        default = AlignedFedAvg(model=base.config.to_dict())
        default.aggregate_train(1, [_reply(c, 100, node=i + 1) for i, c in enumerate(clients)])
        assert default.history[0]["threads"] == 1
    finally:
        torch.set_num_threads(before)


def _planted_clients(n=3):
    torch.manual_seed(0)
    base = perturbed(
        from_preset("vit-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4), 0, 0.2
    ).float()
    canon = canonicalize(base)
    clients = [
        to_layernorm(
            apply_transform(
                canon,
                random_transform(canon, seed=s, fix_ones=True, dtype=torch.float32, groups=["residual", "heads", "ff"]),
            )
        )
        for s in range(n)
    ]
    return base, clients


def _labelled(model, n=128):
    from fedlmc.data.base import ArrayData

    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 1, 12, 12, generator=g)
    with torch.no_grad():
        y = model(x).argmax(-1)
    return ArrayData(x, y)


def test_refined_strategy_on_planted_replies(record):
    from fedlmc.strategies import RefinedFedAvg

    base, clients = _planted_clients()
    data = _labelled(base)
    replies = [_reply(c, 100, node=i + 1) for i, c in enumerate(clients)]
    strategy = RefinedFedAvg(
        model=base.config.to_dict(),
        refine=Refinement(data=data, steps=10),
        guard=Guard(data=data),
        report=Report(data=data),
    )
    strategy._previous = ArrayRecord(torch_state_dict=clients[0].state_dict())
    arrays, _ = strategy.aggregate_train(1, replies)
    merged = model_from_arrays(arrays, strategy.global_config)
    x = data.x[:16]
    with torch.no_grad():
        # the labels are the base model's argmax, so refinement may sharpen the merge a little (α = 1
        # mixes the copies at every step: 1.4e-2 here); a lost alignment would be off by O(1)
        record(
            "RefinedFedAvg on 3 planted replies: relative |Δlogits|",
            float((merged(x) - base(x)).abs().max() / base(x).abs().max()),
            3e-2,
        )
    rec = strategy.history[0]
    # the guard compared both and the report measured client / plain / kept losses
    assert rec["kept"] == "aligned" and rec["guard_aligned"] < rec["guard_average"]
    assert rec["average_excess"] > rec["excess"] + 0.1
    # the clients compute one function, so their output ensemble scores exactly what each of them does
    assert abs(rec["ensemble_loss"] - rec["mean_client_loss"]) < 1e-4
    # it stopped on its objective (checked at steps 0 and 10) and says which alignment it kept
    assert rec["refine_steps_run"] <= 10 and rec["refine_best_step"] in (0, 10)


def test_refinement_checks_score_data_the_descent_does_not_train_on():
    from fedlmc.data.base import ArrayData, TokenData
    from fedlmc.strategies.aligned import refine_split

    arrays = ArrayData(torch.arange(100.0)[:, None], torch.arange(100))
    got = refine_split(Refinement(data=arrays, check_every=10, patience=3, check_sigmas=1.5))
    assert got.check_every == 10 and got.patience == 3 and got.check_sigmas == 1.5
    assert got.data.y.tolist() == list(range(75)) and got.check_data.y.tolist() == list(range(75, 100))
    tokens = refine_split(Refinement(data=TokenData(torch.arange(400), block_size=8)))
    assert len(tokens.data.tokens) == 300 and tokens.check_data.tokens[0] == 300
    every = Refinement(data=arrays, check_every=0)
    assert refine_split(every) is every  # no checks: the descent has all of it
    short = TokenData(torch.arange(12), block_size=8)  # one block: a quarter of it holds none
    assert (
        refine_split(Refinement(data=short)).data is short and refine_split(Refinement(data=short)).check_data is None
    )

    class Batches:  # a user's own batch source: nothing to split, the checks score what is trained on
        def batches(self, batch_size, shuffle=False, generator=None):
            yield arrays.x, arrays.y

    mine = Batches()
    assert refine_split(Refinement(data=mine)).data is mine and refine_split(Refinement(data=mine)).check_data is None


def _near_copies(base, n=2, scale=1e-3):
    """Shared-init replies that barely moved from ``base``."""
    near = []
    for s in range(n):
        m = from_preset("vit-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4)
        m.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(s)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
        near.append(m.eval())
    return near


def test_the_universe_starts_from_the_global_model_only_when_the_replies_were_trained_from_it():
    """One-shot fusion: clients started from their own seeds are unrelated to the server's initial
    model (weight cosine ~0), and a universe seeded by it merged real clients badly; the strategy then
    starts from a reply. Replies trained from the global model start the universe there."""
    from fedlmc.strategies.base import DESCENT_COSINE, weight_cosine

    base, clients = _planted_clients(3)
    torch.manual_seed(123)
    unrelated = from_preset("vit-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4)
    assert max(abs(weight_cosine(c, unrelated)) for c in clients) < DESCENT_COSINE / 2
    strategy = AlignedFedAvg(model=base.config.to_dict())
    strategy._previous = ArrayRecord(torch_state_dict=unrelated.state_dict())
    arrays, _ = strategy.aggregate_train(1, [_reply(c, 100, node=i + 1) for i, c in enumerate(clients)])
    assert strategy.history[0]["start"] == "reply"
    x = torch.randn(8, 1, 12, 12)
    with torch.no_grad():
        merged = model_from_arrays(arrays, base.config.to_dict())
        assert float((merged(x) - base(x)).abs().max() / base(x).abs().max()) < 1e-3

    near = _near_copies(base)
    assert min(weight_cosine(m, base) for m in near) > 0.99
    strategy = AlignedFedAvg(model=base.config.to_dict())
    strategy._previous = ArrayRecord(torch_state_dict=base.state_dict())
    strategy.aggregate_train(1, [_reply(m, 50, node=i + 1) for i, m in enumerate(near)])
    assert strategy.history[0]["start"] == "previous"

    # Universe(start="average"): replies trained from the global model start the universe at their plain mean
    # (with min_gain they keep the identity there, and one universe iteration settles the round)
    from fedlmc.options import Matching

    merged = {}
    for start in ("previous", "average"):
        strategy = AlignedFedAvg(
            model=base.config.to_dict(), matching=Matching(min_gain=0.5), universe=Universe(start=start)
        )
        strategy._previous = ArrayRecord(torch_state_dict=base.state_dict())
        seen = []
        merge = strategy.align
        strategy.align = lambda models, weights, at, merge=merge, seen=seen: (
            seen.append(at) or merge(models, weights, at)
        )
        arrays, _ = strategy.aggregate_train(1, [_reply(m, 50, node=i + 1) for i, m in enumerate(near)])
        assert strategy.history[0]["start"] == start
        assert seen == ["average"] if start == "average" else isinstance(seen[0], torch.nn.Module)
        merged[start] = model_from_arrays(arrays, base.config.to_dict()).state_dict()
    assert max(float((merged["average"][k] - v).abs().max()) for k, v in merged["previous"].items()) < 1e-5
    strategy._previous = ArrayRecord(torch_state_dict=unrelated.state_dict())  # one-shot: still from a reply
    strategy.aggregate_train(2, [_reply(c, 100, node=i + 1) for i, c in enumerate(clients)])
    assert strategy.history[1]["start"] == "reply"
    with pytest.raises(ValueError, match="universe start"):
        Universe(start="median")
    assert AlignedFedAvg(model=base.config.to_dict()).universe.start == "previous"


def test_guard_keeps_plain_average_when_alignment_is_worse():
    """When the aligned aggregate is worse on the server data than the plain average of the same
    replies, the plain average is what the round returns (do no harm), and the history says so."""
    from fedlmc.train import evaluate

    base, _ = _planted_clients(1)
    data = _labelled(base)
    replies = [_reply(c, 50, node=i + 1) for i, c in enumerate(_near_copies(base))]

    class BrokenAlignment(AlignedFedAvg):
        """An alignment that returns a damaged model: the guard must refuse it."""

        def align(self, models, weights, start):
            merged, transforms = super().align(models, weights, start)
            with torch.no_grad():
                for p in merged.parameters():
                    p.add_(torch.randn_like(p))
            return merged, transforms

    strategy = BrokenAlignment(model=base.config.to_dict(), guard=Guard(data=data))
    strategy._previous = ArrayRecord(torch_state_dict=base.state_dict())
    arrays, _ = strategy.aggregate_train(1, replies)
    rec = strategy.history[0]
    assert rec["kept"] == "average" and rec["guard_average"] < rec["guard_aligned"] - 0.1
    plain = FedAvg().aggregate_train(1, replies)[0].to_torch_state_dict()
    kept = arrays.to_torch_state_dict()
    assert max(float((kept[k] - plain[k]).abs().max()) for k in plain) < 1e-6  # exactly the plain average
    assert evaluate(model_from_arrays(arrays, strategy.global_config), data)["loss"] == pytest.approx(
        rec["guard_average"], abs=1e-5
    )


def test_guard_keeps_the_aligned_aggregate_when_it_is_better():
    """Planted replies (one function in three coordinate systems): aligned is far better than plain,
    and the guard keeps it."""
    base, clients = _planted_clients()
    data = _labelled(base)
    strategy = AlignedFedAvg(model=base.config.to_dict(), guard=Guard(data=data))
    strategy._previous = ArrayRecord(torch_state_dict=clients[0].state_dict())
    strategy.aggregate_train(1, [_reply(c, 100, node=i + 1) for i, c in enumerate(clients)])
    rec = strategy.history[0]
    assert rec["kept"] == "aligned" and rec["guard_aligned"] < rec["guard_average"] - 0.1


def _narrow_and_moved_wide(residual: str = "orthogonal"):
    """A narrow model, and a wide one that is it zero-padded and moved by a random group element (one
    function at two widths; ``residual`` the kind of its residual map), with the wide config."""
    from fedlmc.merging.widths import pad

    torch.manual_seed(1)
    narrow = perturbed(
        from_preset("vit-tiny", n_layer=2, d_model=16, n_head=4, d_ff=32, d_head=8, image_size=12, patch_size=4), 1, 0.2
    ).float()
    wide = pad(canonicalize(narrow), {"d_model": 32, "d_ff": 64})
    wide = apply_transform(
        wide, random_transform(wide, seed=4, groups=["residual", "heads", "ff"], residual=residual, dtype=torch.float32)
    )
    return narrow, wide, narrow.config.replace(d_model=32, d_ff=64)


def test_hetero_permuted_aligns_widths_with_permutations_only(record):
    """The peers' method across widths (``strategy=hetero-permuted``): the residual map is a partial
    permutation, so it recovers a wide model that is the narrow one padded and permuted, and the
    universe computes the narrow function; a rotated one is beyond it."""
    from types import SimpleNamespace

    from fedlmc.federated import Settings
    from fedlmc.strategies import HeteroWidthFedAvg
    from strategies.factory import build_strategy

    x = torch.randn(8, 1, 12, 12)
    gaps = {}
    for kind in ("permutation", "orthogonal"):
        narrow, wide, wide_cfg = _narrow_and_moved_wide(residual=kind)
        s = Settings.from_run_config({"strategy": "hetero-permuted", "width-factors": "1,2", "guard": False})
        strategy = build_strategy(s, wide_cfg.to_dict(), splits=SimpleNamespace(val=_labelled(narrow), test=None))
        assert isinstance(strategy, HeteroWidthFedAvg) and strategy.matching.residual == "permutation"
        arrays, _ = strategy.aggregate_train(
            1, [_reply(wide, 100, node=1, partition=0), _reply(narrow, 100, node=2, partition=1)]
        )
        universe = model_from_arrays(arrays, strategy.global_config)
        with torch.no_grad():
            gaps[kind] = float((universe(x) - narrow(x)).abs().max() / narrow(x).abs().max())
    record("hetero-permuted universe vs the narrow function (residual permuted)", gaps["permutation"], 1e-3)
    assert gaps["orthogonal"] > 1e-1, gaps  # a rotated residual is beyond a permutation


def test_hetero_width_strategy_aligns_and_projects(record, monkeypatch, tmp_path):
    """A narrow reply and a wide reply that is the narrow model padded and moved by a group element:
    the universe computes the narrow function, and the narrow node is sent a narrow model."""
    from fedlmc.strategies import HeteroWidthFedAvg

    narrow, wide, wide_cfg = _narrow_and_moved_wide()
    replies = [_reply(wide, 100, node=1, partition=0), _reply(narrow, 100, node=2, partition=1)]
    strategy = HeteroWidthFedAvg(model=wide_cfg.to_dict())
    arrays, _ = strategy.aggregate_train(1, replies)
    universe = model_from_arrays(arrays, strategy.global_config)
    x = torch.randn(8, 1, 12, 12)
    with torch.no_grad():
        ref = narrow(x)
        record(
            "HeteroWidthFedAvg universe vs the narrow function",
            float((universe(x) - ref).abs().max() / ref.abs().max()),
            1e-3,
        )
    sent = strategy.model_for(2)  # what configure_train puts in node 2's message (with its config)
    assert sent.config.d_model == 16 and sent.config.d_ff == 32 and strategy.model_for(3) is None
    with torch.no_grad():
        record(
            "HeteroWidthFedAvg: model sent to the narrow node vs narrow",
            float((sent(x) - ref).abs().max() / ref.abs().max()),
            1e-3,
        )
    # the per-client transforms (typed width maps included) survive a checkpoint, keyed by partition id:
    # a resumed server, whose nodes have new ids, asks them their partition and sends the narrow one
    # the same model from its first round on
    from fedlmc.strategies.checkpoint import load_state, save_state

    path = tmp_path / "state"
    save_state(path, 1, arrays, strategy, {"rounds": []})
    state = load_state(path)
    resumed = HeteroWidthFedAvg(model=wide_cfg.to_dict())
    resumed.load_state(
        {"global_config": state.global_config, "history": state.history, "transforms": state.transforms},
        round_offset=state.round,
    )
    assert resumed.transforms[1].width_map == strategy.transforms[1].width_map
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # what a ServerApp process has when it builds messages
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    grid = _RenumberedGrid({21: 1, 22: 0})  # node 21 now holds partition 1 (the narrow client)
    msgs = {m.metadata.dst_node_id: m for m in resumed.configure_train(1, state.arrays, ConfigRecord({}), grid)}
    assert grid.queried == [21, 22] and resumed.partition_of == {21: 1, 22: 0}
    got = msgs[21].content.array_records["arrays"].to_torch_state_dict()
    again = model_from_arrays(
        msgs[21].content.array_records["arrays"],
        json.loads(msgs[21].content.config_records["config"][MODEL_CONFIG_KEY]),
    )
    assert got["pos_emb"].shape[-1] == 16 and again.config.d_model == 16
    with torch.no_grad():
        assert float((again(x) - sent(x)).abs().max()) < 1e-6


class _RenumberedGrid:
    """The part of a Flower Grid a strategy's configure_train uses, for nodes holding given partitions;
    QUERY messages are answered as fedlmc's ClientApp does."""

    def __init__(self, partitions: dict[int, int]) -> None:
        self.partitions, self.queried = partitions, []

    def get_node_ids(self):
        return list(self.partitions)

    def send_and_receive(self, messages, timeout=None):
        out = []
        for m in messages:
            assert m.metadata.message_type == MessageType.QUERY
            node = m.metadata.dst_node_id
            self.queried.append(node)
            content = RecordDict({"client": ConfigRecord({"partition-id": self.partitions[node]})})
            md = metadata(node, message_type=MessageType.QUERY, message_id=f"q{node}", ttl=60.0)
            out.append(Message(content=content, metadata=md))
        return out


def test_slicing_baseline_averages_each_entry_over_its_holders():
    from fedlmc.baselines import SlicingFedAvg
    from fedlmc.merging.widths import slice_prefix, width_config

    torch.manual_seed(2)
    glob = from_preset("vit-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4).eval()
    small = slice_prefix(glob, width_config(glob.config, 2))
    assert small.config.d_model == 16 and small.config.d_ff == 32
    with torch.no_grad():
        for p in small.parameters():
            p.add_(1.0)
    strategy = SlicingFedAvg(model=glob.config.to_dict())
    strategy._previous = ArrayRecord(torch_state_dict=glob.state_dict())
    arrays, _ = strategy.aggregate_train(1, [_reply(glob, 100, node=1), _reply(small, 100, node=2)])
    out = arrays.to_torch_state_dict()
    w = out["blocks.0.mlp.fc1.weight"]
    g = glob.state_dict()["blocks.0.mlp.fc1.weight"]
    assert torch.allclose(w[:32, :16], g[:32, :16] + 0.5, atol=1e-6)  # held by both: the mean
    assert torch.allclose(w[32:, :], g[32:, :], atol=1e-6) and torch.allclose(w[:, 16:], g[:, 16:], atol=1e-6)


def test_the_aggregate_does_not_depend_on_the_order_replies_arrive_in():
    """Independently started clients: the same replies in another arrival order give the same bits
    (a resumed run must aggregate exactly as an uninterrupted one)."""
    models = [
        perturbed(
            from_preset("vit-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4), s, 0.3
        ).float()
        for s in range(3)
    ]
    replies = [_reply(m, 50 + i, node=10 - i) for i, m in enumerate(models)]
    out = []
    for order in (replies, replies[::-1], [replies[1], replies[2], replies[0]]):
        strategy = AlignedFedAvg(model=models[0].config.to_dict())
        strategy._previous = ArrayRecord(torch_state_dict=models[0].state_dict())
        out.append(strategy.aggregate_train(1, list(order))[0].to_torch_state_dict())
    for other in out[1:]:
        assert all(torch.equal(out[0][k], other[k]) for k in out[0])


def test_client_app_answers_which_partition_it_holds(monkeypatch):
    """The QUERY a restarted HeteroWidthFedAvg sends: fedlmc's ClientApp replies with its partition id."""
    from flwr.app import Context
    from flwr.supercore.task_identity import TaskIdentity

    from clients.app import query
    from fedlmc.strategies.base import declared_partition

    for attr, value in (("_run_id", 1), ("_node_id", 7), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    md = metadata(0, dst=7, message_type=MessageType.QUERY, message_id="q", ttl=60.0)
    ctx = Context(
        run_id=1, node_id=7, node_config={"partition-id": 3, "num-partitions": 4}, state=RecordDict(), run_config={}
    )
    reply = query(Message(content=RecordDict({}), metadata=md), ctx)
    assert declared_partition(reply) == 3


def _sent(strategy, nodes, monkeypatch) -> list:
    """What a round's configure_train sends these nodes (through the strategy's messages_for)."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    msgs = [
        Message(
            content=RecordDict({"arrays": strategy._previous, "config": ConfigRecord({})}),
            message_type=MessageType.TRAIN,
            dst_node_id=n,
        )
        for n in nodes
    ]
    return list(strategy.messages_for(msgs, ConfigRecord({}), MessageType.TRAIN))


def test_hetero_guard_keeps_slicing_when_it_is_better_and_then_everyone_slices(monkeypatch):
    """Clients that sliced the global model and did not move: slicing returns the global model exactly,
    the aligned universe does not (a slice is not the wide function), so the guard keeps slicing and
    drops the transforms: next round every node is sent the global model to slice."""
    from fedlmc.merging.widths import slice_prefix, width_config
    from fedlmc.strategies import HeteroWidthFedAvg

    torch.manual_seed(2)
    glob = (
        perturbed(
            from_preset("vit-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4), 2, 0.2
        )
        .float()
        .eval()
    )
    small = slice_prefix(glob, width_config(glob.config, 2))
    strategy = HeteroWidthFedAvg(model=glob.config.to_dict(), guard=Guard(data=_labelled(glob)))
    strategy._previous = ArrayRecord(torch_state_dict=glob.state_dict())
    assert len(_sent(strategy, [1, 2], monkeypatch)) == 2 and strategy._sliced == {1, 2}
    arrays, _ = strategy.aggregate_train(
        1, [_reply(glob, 100, node=1, partition=0), _reply(small, 100, node=2, partition=1)]
    )
    rec = strategy.history[0]
    assert rec["kept"] == "slicing" and rec["guard_slicing"] < rec["guard_aligned"] - 0.05
    got, want = arrays.to_torch_state_dict(), glob.state_dict()
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6
    assert strategy.transforms == {} and strategy.model_for(2) is None


def test_hetero_guard_keeps_the_universe_when_it_is_better_and_only_compares_sliced_rounds(monkeypatch):
    """A narrow model and a wide one that is it padded and moved by a group element: slicing averages
    unrelated coordinates, the universe computes the narrow function; the guard keeps the universe.
    Next round the nodes get their projections, so there is no slicing aggregate to compare."""
    from fedlmc.strategies import HeteroWidthFedAvg

    narrow, wide, wide_cfg = _narrow_and_moved_wide()
    strategy = HeteroWidthFedAvg(model=wide_cfg.to_dict(), guard=Guard(data=_labelled(narrow)))
    prev = canonicalize(
        from_preset(
            "vit-tiny",
            **{
                k: getattr(wide_cfg, k)
                for k in ("n_layer", "d_model", "n_head", "d_ff", "d_head", "image_size", "patch_size")
            },
        )
    ).float()
    strategy._previous, strategy.global_config = ArrayRecord(torch_state_dict=prev.state_dict()), prev.config.to_dict()
    _sent(strategy, [1, 2], monkeypatch)  # both slice (canonical models, like the replies)
    replies = [_reply(wide, 100, node=1, partition=0), _reply(canonicalize(narrow), 100, node=2, partition=1)]
    arrays, _ = strategy.aggregate_train(1, replies)
    rec = strategy.history[0]
    assert rec["kept"] == "aligned" and rec["guard_aligned"] < rec["guard_slicing"] - 0.05
    strategy._previous = arrays
    _sent(strategy, [1, 2], monkeypatch)  # both nodes now get their own projections
    assert strategy._sliced == set()
    strategy.aggregate_train(2, replies)
    assert strategy.history[1]["kept"] == "aligned" and "guard_slicing" not in strategy.history[1]


def test_hetero_refined_learns_every_clients_alignment_into_the_universe(record):
    """HeteroWidthFedAvg with refine: the transforms come from Dirichlet refinement (one per
    client, mixed widths) and the universe still computes the planted narrow function."""
    from fedlmc.strategies import HeteroWidthFedAvg

    narrow, wide, wide_cfg = _narrow_and_moved_wide()
    strategy = HeteroWidthFedAvg(model=wide_cfg.to_dict(), refine=Refinement(data=_labelled(narrow), steps=3))
    arrays, _ = strategy.aggregate_train(
        1, [_reply(wide, 100, node=1, partition=0), _reply(narrow, 100, node=2, partition=1)]
    )
    assert {T.info.get("method") for T in strategy.transforms.values()} >= {"refined"}
    universe = model_from_arrays(arrays, strategy.global_config)
    x = torch.randn(8, 1, 12, 12)
    with torch.no_grad():
        ref = narrow(x)
        record(
            "HeteroWidthFedAvg refined universe vs the narrow function",
            float((universe(x) - ref).abs().max() / ref.abs().max()),
            5e-2,
        )
