"""SCAFFOLD: the control variates on the client (option I), the gradient correction, the server's
update of its variate, and the ClientApp's round trip through the node's state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp.strategy import FedAvg
from test_flower_contract import Grid, _copies, _replies, _same, task_identity  # noqa: F401  (the fixture)

from fedlmc.baselines import ScaffoldFedAvg
from fedlmc.baselines.scaffold import CONTROL_KEY, client_round, corrected, local_gradient, pack, remove, unpack
from fedlmc.data import ArrayData
from fedlmc.models import from_preset
from fedlmc.train import loss_and_correct

KW = dict(n_layer=1, d_model=16, n_head=2, d_ff=32, image_size=8, patch_size=4)


def _data(n: int, seed: int) -> ArrayData:
    g = torch.Generator().manual_seed(seed)
    return ArrayData(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return from_preset("vit-tiny", **KW).double()


def _grad(model, data: ArrayData) -> dict:
    model.zero_grad()
    loss, _ = loss_and_correct(model(data.x.double()), data.y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_control_variate_is_the_local_gradient_over_one_pass():
    model, data = _model(), _data(50, 1)
    got = local_gradient(model, ArrayData(data.x.double(), data.y), batch_size=16, device="cpu")
    want = _grad(model, data)  # the mean over all 50 examples, batches of 16 weighted by their size
    assert all(torch.allclose(got[n], want[n], atol=1e-12) for n in want)


def test_the_correction_turns_a_clients_gradient_into_the_federations():
    """With ``c`` the federation's gradient and ``c_i`` this client's, the corrected local gradient at
    the global model is the federation's gradient: the drift SCAFFOLD removes."""
    model = _model()
    a, b = _data(40, 1), _data(40, 2)
    both = ArrayData(torch.cat([a.x, b.x]), torch.cat([a.y, b.y]))
    c = _grad(model, both)
    double = lambda d: ArrayData(d.x.double(), d.y)  # noqa: E731
    fresh, delta, handles = client_round(model, double(a), 40, control=c, mine={}, device="cpu")
    remove(handles)
    handles = corrected(model, {n: c[n] - fresh[n] for n in c})  # c − c_i with c_i = the local gradient
    try:
        got = _grad(model, a)
    finally:
        remove(handles)
    assert all(torch.allclose(got[n], c[n], atol=1e-12) for n in c)
    assert all(torch.equal(delta[n], fresh[n]) for n in fresh)  # no earlier variate: Δc_i = c_i⁺
    plain = _grad(model, a)  # the hooks are gone
    assert all(torch.allclose(plain[n], fresh[n], atol=1e-12) for n in fresh)


def test_sgd_clients_take_the_papers_corrected_steps():
    """``local-optimizer = "sgd"``: every local step is ``w − lr·(g + c − c_i)`` (constant lr, no momentum,
    weight decay or clipping), SCAFFOLD's update; with no correction, plain SGD. AdamW's first step differs."""
    from dataclasses import replace

    from fedlmc.federated import Settings
    from fedlmc.train import train

    data = _data(16, 3)
    data = ArrayData(data.x.double(), data.y)
    s = Settings.from_run_config({"local-optimizer": "sgd", "lr": 0.5, "local-steps": 1, "batch-size": 16})
    cfg = replace(s.train_config(seed=0), device="cpu")
    g = torch.Generator().manual_seed(7)
    correction = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in _model().named_parameters()}
    for corr in ({}, correction):
        model = _model()
        want = {n: p.detach() - 0.5 * (_grad(model, data)[n] + corr.get(n, 0)) for n, p in model.named_parameters()}
        handles = corrected(model, corr) if corr else []
        try:
            train(model, data, cfg, progress=False)
        finally:
            remove(handles)
        assert all(torch.allclose(p.detach(), want[n], atol=1e-12) for n, p in model.named_parameters())
    adam = _model()
    train(adam, data, replace(cfg, optimizer="adamw"), progress=False)
    assert not torch.allclose(
        next(adam.parameters()).detach(),
        next(_model().parameters()).detach() - 0.5 * next(iter(_grad(_model(), data).values())),
    )
    with pytest.raises(ValueError, match="local-optimizer"):
        Settings.from_run_config({"local-optimizer": "adam"})


def test_zero_corrections_attach_nothing_and_variates_travel_as_safetensors():
    model = _model()
    assert corrected(model, {n: torch.zeros_like(p) for n, p in model.named_parameters()}) == []
    t = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    back = unpack(pack(t))
    assert set(back) == set(t) and all(torch.equal(back[k], t[k]) for k in t)
    assert unpack(b"") == {} and unpack(None) == {}


def _with_delta(msg: Message, delta: dict) -> Message:
    msg.content[CONTROL_KEY] = ConfigRecord({"delta": pack(delta)})
    return msg


def test_the_server_aggregates_as_fedavg_and_moves_its_variate_by_the_mean_change():
    replies = _replies(3, seed=5)
    keys = list(replies[0].content["arrays"].keys())
    deltas = [{keys[0]: torch.full((2, 3), float(i + 1))} for i in range(3)]
    strategy = ScaffoldFedAvg()
    grid = Grid(nodes=4)
    arrays = replies[0].content["arrays"]
    sent = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))
    assert all(unpack(m.content["config"][CONTROL_KEY]) == {} for m in sent)  # round 1: c = 0
    got, _ = strategy.aggregate_train(1, [_with_delta(m, d) for m, d in zip(_copies(replies), deltas)])
    want, _ = FedAvg().aggregate_train(1, _copies(replies))
    _same(got, want)
    # c ← c + |S|/N · Σ wᵢ Δc_i: 3 replies of 4 nodes, weighted as the model (num-examples 1, 2, 3)
    mean = (1 * 1 + 2 * 2 + 3 * 3) / 6
    assert torch.allclose(strategy.control[keys[0]], torch.full((2, 3), 0.75 * mean))
    sent = list(strategy.configure_train(2, got, ConfigRecord({}), grid))
    assert torch.allclose(unpack(sent[0].content["config"][CONTROL_KEY])[keys[0]], torch.full((2, 3), 0.75 * mean))
    rec = strategy.history[-1]
    assert "scaffold_missing" not in rec and rec["scaffold_control_norm"] == pytest.approx(0.75 * mean * 6**0.5)
    # a reply without Δc_i is aggregated, counted as zero and named
    strategy.aggregate_train(2, _copies(replies))
    assert sorted(strategy.history[-1]["scaffold_missing"]) == [1, 2, 3]


def test_with_every_node_the_corrections_cancel_in_the_weighted_aggregate():
    """Every node replies, with uneven num-examples: after a round from c = 0 with fresh variates,
    ``c = Σ wᵢ c_i``, so ``Σ wᵢ (c − c_i) = 0``: the corrections move no weighted aggregate (an unweighted
    ``c`` would push every round's FedAvg step by ``c − Σ wᵢ c_i``)."""
    replies = _replies(3, seed=5, weights=[10, 200, 3000])
    keys = list(replies[0].content["arrays"].keys())
    g = torch.Generator().manual_seed(1)
    variates = [{keys[0]: torch.randn(2, 3, generator=g, dtype=torch.float64)} for _ in range(3)]
    strategy = ScaffoldFedAvg()
    list(strategy.configure_train(1, replies[0].content["arrays"], ConfigRecord({}), Grid(nodes=3)))
    strategy.aggregate_train(1, [_with_delta(m, v) for m, v in zip(_copies(replies), variates)])
    w = torch.tensor([10.0, 200.0, 3000.0], dtype=torch.float64) / 3210
    c = strategy.control[keys[0]].double()
    drift = sum(wi * (c - v[keys[0]]) for wi, v in zip(w, variates))
    assert float(drift.abs().max()) < 1e-6  # float32 on the wire


def test_option_two_is_the_mean_raw_gradient_along_the_local_steps():
    """With plain SGD, ``c_i⁺ = c_i − c + (x − y)/(K·η)`` is the mean of the uncorrected gradients at the
    K iterates (full-batch steps, replayed by hand), whatever the correction was."""
    from dataclasses import replace

    from fedlmc.baselines.scaffold import correct, trajectory_variate
    from fedlmc.federated import Settings
    from fedlmc.train import train

    data = _data(24, 4)
    data = ArrayData(data.x.double(), data.y)
    s = Settings.from_run_config({"local-optimizer": "sgd", "lr": 0.2, "local-steps": 4, "batch-size": 24})
    g = torch.Generator().manual_seed(3)
    rand = lambda: {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in _model().named_parameters()}  # noqa: E731
    control, mine = rand(), rand()
    replay, raw = _model(), []
    for _ in range(4):
        grads = _grad(replay, data)
        raw.append(grads)
        with torch.no_grad():
            for n, p in replay.named_parameters():
                p -= 0.2 * (grads[n] + control[n] - mine[n])
    model = _model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    handles = correct(model, control, mine)
    try:
        train(model, data, replace(s.train_config(seed=0), device="cpu"), progress=False)
    finally:
        remove(handles)
    fresh, delta = trajectory_variate(start, model, control, mine, 4, 0.2)
    for n in fresh:
        want = sum(r[n] for r in raw) / 4
        assert torch.allclose(fresh[n], want, atol=1e-10) and torch.allclose(delta[n], want - mine[n], atol=1e-10)
    with pytest.raises(ValueError, match="option II"):
        trajectory_variate(start, model, control, mine, 0, 0.2)


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("variate", ["trajectory", "gradient"])
def test_the_clientapp_keeps_its_variate_in_the_node_state_and_answers_with_its_change(variate):
    """Round 1 (c = 0, no variate yet) trains exactly as FedAvg's client; the reply carries Δc_i and the
    node's state c_i⁺; the next round's correction uses both."""
    from flwr.app import Message as M
    from flwr.app import MessageType

    from clients.app import train
    from fedlmc.federated import Settings, global_model

    run = {
        "preset": "vit-digits",
        "local-steps": 3,
        "independent-start": False,
        "batch-size": 16,
        "strategy": "scaffold",
        "scaffold-variate": variate,
    }
    s = Settings.from_run_config(run)
    model = global_model(s)
    arrays = ArrayRecord(torch_state_dict=model.state_dict())
    strategy = ScaffoldFedAvg(model=model.config.to_dict())
    strategy.check_architecture(arrays)
    config = strategy._with_config(ConfigRecord({"server-round": 1}))

    def context():
        return Context(
            run_id=1,
            node_id=1,
            node_config={"partition-id": 0, "num-partitions": 2},
            state=RecordDict(),
            run_config=run,
        )

    def message(cfg):
        return M(content=RecordDict({"arrays": arrays, "config": cfg}), message_type=MessageType.TRAIN, dst_node_id=1)

    plain = train(message(ConfigRecord(dict(config))), context())
    ctx = context()
    first = train(message(ConfigRecord({**dict(config), CONTROL_KEY: pack({})})), ctx)
    a, b = plain.content["arrays"].to_torch_state_dict(), first.content["arrays"].to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # c − c_i = 0: FedAvg's client, bit for bit
    mine = unpack(ctx.state[CONTROL_KEY]["control"])
    delta = unpack(first.content[CONTROL_KEY]["delta"])
    assert set(mine) == set(delta) and all(torch.equal(mine[k], delta[k]) for k in mine)
    assert len(first.content.array_records) == 1  # what Flower's strategies check
    assert first.content[CONTROL_KEY]["had-variate"] is False
    control = {k: torch.ones_like(v) for k, v in mine.items()}
    second = train(message(ConfigRecord({**dict(config), CONTROL_KEY: pack(control)})), ctx)
    moved = second.content["arrays"].to_torch_state_dict()
    assert any(not torch.equal(moved[k], a[k]) for k in a)  # the correction changed the training
    assert second.content[CONTROL_KEY]["had-variate"] is True
    again = unpack(second.content[CONTROL_KEY]["delta"])
    if variate == "gradient":  # option I: same start, same data, so c_i⁺ = c_i
        assert all(np.allclose(again[k], 0.0, atol=1e-6) for k in again)
    else:  # option II: Δc_i = −c + (x − y)/(K·η)
        x = arrays.to_torch_state_dict()
        want = {k: -control[k] + (x[k] - moved[k]) / (3 * s.lr) for k in again}
        assert all(torch.allclose(again[k], want[k], atol=1e-3) for k in again)
        assert not all(np.allclose(again[k], 0.0, atol=1e-6) for k in again)
