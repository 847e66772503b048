"""Flower's contract, with Flower's own strategies as the oracle on the same inputs (differential tests,
in our words, after what Flower's Message-API strategy tests check): the weighted mean, scalar arrays,
fractional weights, FedMedian / FedTrimmedAvg, Krum / Multi-Krum, node sampling, message contents,
metric aggregation, ``aggregate_evaluate``, ``summary()`` and ``start()``'s Result. Replies come as an
unchanged Flower ClientApp sends them: arrays and metrics, no ``model`` record.

Where a contract does not apply to a strategy the test says why: an aligning strategy given a model
aligns before it averages (its mean is of other coordinates), so its weighted-mean contract is checked
on replies it cannot read (``fallback="average"``) and on replies that are already aligned."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import metadata
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    FedAvg,
    FedAvgM,
    FedMedian,
    FedTrimmedAvg,
    Krum,
    MultiKrum,
)

from fedlmc.baselines import KrumFedAvg, SlicingFedAvg
from fedlmc.models import from_preset
from fedlmc.options import Checks, Refinement, Robust
from fedlmc.strategies import AlignedFedAvg, AverageFedAvg, HeteroWidthFedAvg, LoraFedAvg, RefinedFedAvg
from fedlmc.strategies.records import config_record

KW = dict(n_layer=1, d_model=16, n_head=2, d_ff=32, image_size=8, patch_size=4)


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """Messages take their run / node / task ids from the process's task identity (Flower's runtime's)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)


def flower_reply(arrays, weight: float, node: int, key: str = "num-examples", **metrics) -> Message:
    """A train reply as Flower's quickstart ClientApp sends it: an ArrayRecord and a MetricRecord."""
    record = ArrayRecord([np.asarray(a, dtype=np.float32) for a in arrays]) if isinstance(arrays, list) else arrays
    content = RecordDict({"arrays": record, "metrics": MetricRecord({key: weight, **metrics})})
    return Message(content=content, metadata=metadata(node))


def _copies(replies: list[Message]) -> list[Message]:
    """Fresh copies of replies (Flower's FedMedian pops the arrays it reads)."""
    out = []
    for m in replies:
        content = RecordDict(
            {
                "arrays": ArrayRecord([a.numpy().copy() for a in m.content["arrays"].values()]),
                "metrics": MetricRecord(dict(m.content["metrics"])),
            }
        )
        out.append(Message(content=content, metadata=metadata(int(m.metadata.src_node_id))))
    return out


def _same(a: ArrayRecord, b: ArrayRecord, rtol: float = 1e-6) -> None:
    xs, ys = a.to_numpy_ndarrays(), b.to_numpy_ndarrays()
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-6)


def _replies(n: int = 3, seed: int = 0, weights=None) -> list[Message]:
    rng = np.random.default_rng(seed)
    weights = weights or [1 + i for i in range(n)]
    return [flower_reply([rng.normal(size=(2, 3)), rng.normal(size=4)], w, node=i + 1) for i, w in enumerate(weights)]


# what aggregates Flower-style replies as Flower's FedAvg does: the baseline always; an aligning strategy
# only when told to average what it cannot read
LORA_SKIP = "LoraFedAvg reads LoRA adapters (A, B factors), not arbitrary arrays: its mean is of s·B·A (test_lora.py)"
PLAIN = {
    "AverageFedAvg()": lambda **kw: AverageFedAvg(**kw),
    "AlignedFedAvg(fallback='average')": lambda **kw: AlignedFedAvg(fallback="average", **kw),
    "RefinedFedAvg(fallback='average')": lambda **kw: RefinedFedAvg(
        fallback="average", refine=Refinement(data=[0]), **kw
    ),
    "HeteroWidthFedAvg(fallback='average')": lambda **kw: HeteroWidthFedAvg(fallback="average", **kw),
    "SlicingFedAvg(fallback='average')": lambda **kw: SlicingFedAvg(fallback="average", **kw),
}
ROBUST = {k: v for k, v in PLAIN.items() if k.startswith(("Reporting", "Aligned"))}  # the ones with ``robust``


def test_lora_fedavg_has_its_own_mean():
    pytest.skip(LORA_SKIP)


@pytest.mark.parametrize("make", PLAIN.values(), ids=PLAIN.keys())
def test_fedavgm_without_momentum_is_the_weighted_mean(make):
    """FedAvgM with server learning rate 1 and no momentum is FedAvg's weighted mean: so is ours, on
    replies from an unchanged Flower ClientApp (the baseline used to exclude every such reply)."""
    replies = _replies(2, weights=[1, 2])
    oracle = FedAvgM(server_learning_rate=1.0)
    oracle.current_arrays = ArrayRecord([np.zeros((2, 3), np.float32), np.zeros(4, np.float32)])
    want, _ = oracle.aggregate_train(1, _copies(replies))
    got, metrics = make().aggregate_train(1, _copies(replies))
    assert got is not None, "a round of valid Flower replies aggregated nothing"
    _same(got, want)


@pytest.mark.parametrize("make", PLAIN.values(), ids=PLAIN.keys())
def test_scalar_arrays_keep_their_shape(make):
    replies = [flower_reply([np.array(1.0)], 1, 1), flower_reply([np.array(3.0)], 2, 2)]
    got, _ = make().aggregate_train(1, replies)
    value = got.to_numpy_ndarrays()[0]
    assert value.shape == () and value == pytest.approx(7.0 / 3.0)


@pytest.mark.parametrize("make", PLAIN.values(), ids=PLAIN.keys())
def test_fractional_weights_are_weights_as_flower_has_them(make):
    """Any positive finite weight under ``weighted_by_key`` (Flower's own test weights 0.25 / 0.4 /
    0.35); ``num-examples`` stays a whole number of examples."""
    rng = np.random.default_rng(1)
    arrays = [[rng.normal(size=(7, 3)) for _ in range(4)] for _ in range(3)]
    replies = [flower_reply(a, w, i + 1, key="weight") for i, (a, w) in enumerate(zip(arrays, [0.25, 0.4, 0.35]))]
    want, _ = FedAvg(weighted_by_key="weight").aggregate_train(1, _copies(replies))
    got, _ = make(weighted_by_key="weight").aggregate_train(1, _copies(replies))
    _same(got, want)
    strategy = make()
    got, _ = strategy.aggregate_train(1, [flower_reply(arrays[0], 2.5, 1), flower_reply(arrays[1], 3, 2)])
    assert "not a whole number of examples" in strategy.history[-1]["excluded"][0]["reason"]


@pytest.mark.parametrize("reduce", ["median", "trimmed"])
@pytest.mark.parametrize("make", ROBUST.values(), ids=ROBUST.keys())
def test_robust_reduce_is_fedmedian_and_fedtrimmedavg(make, reduce):
    """The reduction is honoured on raw arrays too (the fallback used to return the weighted mean)."""
    replies = _replies(5, seed=2)
    oracle = FedMedian() if reduce == "median" else FedTrimmedAvg(beta=0.2)
    want, _ = oracle.aggregate_train(1, _copies(replies))
    got, _ = make(robust=Robust(reduce=reduce, trim=0.2)).aggregate_train(1, _copies(replies))
    _same(got, want)


@pytest.mark.parametrize("select", [1, None])
def test_krum_fedavg_is_flowers_krum_and_multikrum(select):
    replies = _replies(6, seed=3)
    replies.append(flower_reply([np.full((2, 3), 40.0), np.full(4, -40.0)], 1, node=7))  # the outlier
    f = 1
    oracle = Krum(num_malicious_nodes=f) if select == 1 else MultiKrum(num_malicious_nodes=f, num_nodes_to_select=6)
    want, _ = oracle.aggregate_train(1, _copies(replies))
    strategy = KrumFedAvg(num_malicious_nodes=f, num_nodes_to_select=select)
    got, _ = strategy.aggregate_train(1, _copies(replies))
    _same(got, want)
    assert 7 in strategy.history[-1]["screen"]["excluded"]


class Grid:
    """Nodes that answer every train message with the arrays they got, moved by a step of their own
    (seeded by node and round), and every evaluate message with a loss of their own. Replies come all
    at once (``send_and_receive``) or one by one (``push_messages`` / ``pull_messages``, as Flower's
    grid gives them)."""

    def __init__(self, nodes: int = 4, step: float = 0.01) -> None:
        self.nodes, self.step, self._waiting = list(range(1, nodes + 1)), step, {}

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        return self.pull_messages(self.push_messages(messages))

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = f"q{len(self._waiting)}-{m.metadata.dst_node_id}"
            self._waiting[mid] = self._answer(m, mid)
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self._waiting.pop(mid) for mid in ids if mid in self._waiting]

    def _answer(self, m: Message, mid: str) -> Message:
        node = int(m.metadata.dst_node_id)
        rnd = int(m.content["config"].get("server-round", 0))
        metrics = {"num-examples": 10 * node, "norm_bit": 0, "eval-loss": 1.0 / node, "acc": 0.1 * node}
        content = RecordDict({"metrics": MetricRecord(metrics)})
        if m.metadata.message_type == "train":
            g = torch.Generator().manual_seed(1000 * rnd + node)
            sd = m.content["arrays"].to_torch_state_dict()
            moved = {k: v + self.step * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in sd.items()}
            content["arrays"] = ArrayRecord(torch_state_dict=moved)
        md = metadata(node, message_type=m.metadata.message_type, message_id=f"r{mid}", reply_to=mid)
        return Message(content=content, metadata=md)


def _mlp_arrays(seed: int = 0) -> ArrayRecord:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return ArrayRecord(net.state_dict())


@pytest.mark.parametrize("make", PLAIN.values(), ids=PLAIN.keys())
def test_start_returns_flowers_result(make):
    """Two rounds through ``start`` on the same grid: the same final arrays, the same per-round train
    and evaluate metrics as Flower's FedAvg (with a custom metric aggregation for both)."""

    def worst(records, key):  # a custom aggregation: the largest of each metric
        return MetricRecord({k: max(r["metrics"][k] for r in records) for k in ("acc", "eval-loss")})

    initial = _mlp_arrays()
    results = {}
    for name, strategy in (
        ("flower", FedAvg(train_metrics_aggr_fn=worst, evaluate_metrics_aggr_fn=worst)),
        ("ours", make(train_metrics_aggr_fn=worst, evaluate_metrics_aggr_fn=worst)),
    ):
        strategy.summary()  # logs, never raises
        results[name] = strategy.start(grid=Grid(), initial_arrays=initial, num_rounds=2)
    flower, ours = results["flower"], results["ours"]
    _same(ours.arrays, flower.arrays)
    assert dict(ours.train_metrics_clientapp) == dict(flower.train_metrics_clientapp)
    assert dict(ours.evaluate_metrics_clientapp) == dict(flower.evaluate_metrics_clientapp)


def _fedlmc_config():
    return from_preset("vit-tiny", **KW).config.to_dict()


def _vit_arrays() -> ArrayRecord:
    return ArrayRecord(from_preset("vit-tiny", **KW).state_dict())


def _lora(**kw):
    """``LoraFedAvg`` of a tiny PEFT GPT-2, and its adapter's arrays."""
    import transformers
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    model = get_peft_model(transformers.GPT2LMHeadModel(cfg), LoraConfig(r=2, target_modules=["c_attn"]))
    return LoraFedAvg(model=model, **kw), ArrayRecord(get_peft_model_state_dict(model))


def _with(make):
    return lambda **kw: (make(**kw), _vit_arrays())


# every strategy, with arrays of the model it is given
SAMPLED = {
    "AverageFedAvg()": _with(lambda **kw: AverageFedAvg(**kw)),
    "AverageFedAvg(model=...)": _with(lambda **kw: AverageFedAvg(model=_fedlmc_config(), **kw)),
    "AlignedFedAvg(model=...)": _with(lambda **kw: AlignedFedAvg(model=_fedlmc_config(), **kw)),
    "RefinedFedAvg(model=...)": _with(
        lambda **kw: RefinedFedAvg(model=_fedlmc_config(), refine=Refinement(data=[0]), **kw)
    ),
    "HeteroWidthFedAvg(model=...)": _with(lambda **kw: HeteroWidthFedAvg(model=_fedlmc_config(), **kw)),
    "SlicingFedAvg(model=...)": _with(lambda **kw: SlicingFedAvg(model=_fedlmc_config(), **kw)),
    "KrumFedAvg()": _with(lambda **kw: KrumFedAvg(**kw)),
    "LoraFedAvg(model=...)": _lora,
}


@pytest.mark.parametrize("make", SAMPLED.values(), ids=SAMPLED.keys())
def test_sampling_and_message_contents_are_flowers(make):
    """Under ``fraction_*`` / ``min_*`` as many nodes are sampled as Flower's FedAvg samples, every
    message carries the arrays given and Flower's config (plus the model's config, ``model-config``)."""
    kw = dict(fraction_train=0.5, min_train_nodes=3, fraction_evaluate=0.25, min_evaluate_nodes=2)
    grid = Grid(nodes=10)
    ours, arrays = make(**kw)
    for strategy in (FedAvg(**kw), ours):
        train = list(strategy.configure_train(1, arrays, ConfigRecord({"lr": 0.1}), grid))
        evaluate = list(strategy.configure_evaluate(1, arrays, ConfigRecord({}), grid))
        assert (len(train), len(evaluate)) == (5, 2)
        assert len({m.metadata.dst_node_id for m in train}) == 5
        for m in train:
            assert m.metadata.message_type == "train"
            assert m.content["arrays"].object_id == arrays.object_id
            config = dict(m.content["config"])
            assert config["lr"] == 0.1 and config["server-round"] == 1
            assert set(config) - {"lr", "server-round"} <= {"model-config"}


@pytest.mark.parametrize("make", SAMPLED.values(), ids=SAMPLED.keys())
def test_aggregate_evaluate_is_flowers(make):
    replies = [
        Message(
            content=RecordDict(
                {"metrics": MetricRecord({"eval-loss": 0.5 * i, "acc": 0.1 * i, "num-examples": 3 * i})}
            ),
            metadata=metadata(i, message_type="evaluate"),
        )
        for i in (1, 2, 3)
    ]
    strategy = make()[0]
    strategy.summary()  # logs, never raises
    assert dict(strategy.aggregate_evaluate(1, replies)) == dict(FedAvg().aggregate_evaluate(1, replies))


def test_an_aligning_strategy_averages_already_aligned_replies_as_fedavg_does():
    """Replies that are the global model plus small steps are already aligned: weight matching keeps
    them as they are (``min_gain``), and the aggregate computes FedAvg's aggregate's function (its
    weights may differ by what LayerNorm ignores: the canonical form drops each writer's mean)."""
    from fedlmc.options import Matching
    from fedlmc.strategies.records import model_from_arrays, state_arrays

    base = from_preset("vit-tiny", **KW).eval()
    arrays = state_arrays(base)
    replies = []
    for node in (1, 2, 3):
        g = torch.Generator().manual_seed(node)
        sd = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.state_dict().items()}
        content = RecordDict(
            {"arrays": ArrayRecord(torch_state_dict=sd), "metrics": MetricRecord({"num-examples": 10 * node})}
        )
        replies.append(Message(content=content, metadata=metadata(node)))
    strategy = AlignedFedAvg(model=base.config.to_dict(), matching=Matching(min_gain=0.5))
    list(strategy.configure_train(1, arrays, ConfigRecord({}), Grid(3)))
    got, _ = strategy.aggregate_train(1, replies)
    want, _ = FedAvg().aggregate_train(1, replies)
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model_from_arrays(got, base.config.to_dict()).eval()(x)
        flower = model_from_arrays(want, base.config.to_dict()).eval()(x)
    assert float((ours - flower).abs().max()) < 1e-4


def test_the_model_config_reply_record_is_not_needed():
    """fedlmc's own replies carry their config (``model``); Flower's do not, and need not."""
    base = from_preset("vit-tiny", **KW)
    replies = []
    for node, declare in ((1, True), (2, False)):
        content = RecordDict({"arrays": ArrayRecord(base.state_dict()), "metrics": MetricRecord({"num-examples": 5})})
        if declare:
            content["model"] = config_record(base)
        replies.append(Message(content=content, metadata=metadata(node)))
    strategy = AverageFedAvg(model=base.config.to_dict(), checks=Checks(min_replies=2))
    got, _ = strategy.aggregate_train(1, replies)
    assert got is not None and strategy.history[-1]["excluded"] == []
