"""The refinement's gradients and the guard's losses computed by the clients (``fedlmc.flower.on_clients``):
the chain rule split at the merged state gives the server-data gradient in float64; failing, silent
and malformed clients are excluded with a reason; too few answers stop the refinement at the best
alignment checked; the client guard keeps the candidate with the lower client loss."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Optional

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from torch.func import functional_call

from fedlmc.data import ArrayData
from fedlmc.flower.on_clients import REFINE, ClientLosses, answer, client_guard
from fedlmc.matching.optimise import (
    Alignments,
    Options,
    backpropagate,
    merged_loss,
    merged_pairs,
    merged_template,
)
from fedlmc.matching.problem import canonical_state
from fedlmc.models import from_preset
from fedlmc.options import Learning, OnClients, Refinement, Universe
from fedlmc.symmetry import Transform, canonical_config, random_transform


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Messages built outside Flower's runtime need a run and a node."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


class FakeGrid:
    """A grid whose nodes answer in-process: ``handlers[node](msg) -> Message`` (None: no answer)."""

    def __init__(self, handlers: dict[int, Callable[[Message], Optional[Message]]]) -> None:
        self.handlers, self.sent = handlers, []

    def get_node_ids(self):
        return list(self.handlers)

    def send_and_receive(self, messages, timeout=None):
        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            self.sent.append(m)
            reply = self.handlers[m.metadata.dst_node_id](m)
            if reply is not None:
                reply.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
                out.append(reply)
        return out


def _tiny_gpt2(seed: int, dtype=torch.float64):
    torch.manual_seed(seed)
    return from_preset("gpt2-tiny", n_layer=2, d_model=16, n_head=2, d_ff=32, vocab_size=11, block_size=8).to(dtype)


def _token_data(seed: int, n: int, T: int = 8, vocab: int = 11) -> ArrayData:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, T + 1), generator=g)
    return ArrayData(tokens[:, :-1], tokens[:, 1:])


def _alignments(models, pool, dtype=torch.float64):
    states = [canonical_state(m, torch.device("cpu"), dtype) for m in models]
    cfg = canonical_config(models[0].config)
    starts = [Transform()] + [
        random_transform(cfg, seed=s, groups=["residual", "heads", "ff"], dtype=dtype) for s in range(1, len(models))
    ]
    opts = Options(Learning(batch_size=6), progress=False)
    return states, cfg, Alignments(states, cfg, starts, 0, opts, None, None, pool), opts


def _latent_grads(al) -> list[torch.Tensor]:
    out = []
    for la in al.lat:
        if la is None:
            continue
        out.append(la.o.grad.clone())
        out += [la.p[k].grad.clone() for k in sorted(la.p)]
    return out


def test_client_refine_gradients_equal_the_server_data_gradient_in_float64():
    """Three clients with 6, 6 and 3 examples: the example-weighted mean of their gradients at the merged
    state, back-propagated through the merge, equals the gradient of the loss on all 15 examples at the
    server, to float64 precision (two λ draws per message: the mean over the draws)."""
    models = [_tiny_gpt2(s) for s in range(3)]
    parts = [_token_data(10 + i, n) for i, n in enumerate((6, 6, 3))]
    lams = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]
    with ThreadPoolExecutor(1) as pool:
        states, cfg, al, opts = _alignments(models, pool)
        template = merged_template(states, cfg, "factored")
        x = torch.cat([p.x for p in parts])
        y = torch.cat([p.y for p in parts])
        pairs = al.align_all()
        loss = sum(
            merged_loss(opts.learn, functional_call(template, merged_pairs(pairs, lam, cfg, "factored"), (x,)), y)
            for lam in lams
        ) / len(lams)
        loss.backward()
        server = _latent_grads(al)
        for t in server:
            assert t.abs().max() > 0  # a gradient that can differ
        for la in al.lat:
            if la is not None:
                la.o.grad = None
                for v in la.p.values():
                    v.grad = None

        grid = FakeGrid({n: (lambda m, d=parts[n - 1]: answer(m, d)) for n in (1, 2, 3)})
        remote = ClientLosses(grid, [1, 2, 3], OnClients(clients_per_step=0, batches_per_client=1), 6, 1)
        remote.begin(template.config)
        pairs = al.align_all()
        merged = [merged_pairs(pairs, lam, cfg, "factored") for lam in lams]
        grads, client_loss = remote.gradients([{k: v.detach() for k, v in sd.items()} for sd in merged], 0)
        backpropagate(merged, grads)
        clients = _latent_grads(al)
    assert abs(client_loss - loss.item()) < 1e-12
    for a, b in zip(server, clients):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), float((a - b).abs().max())
    assert remote.record()["excluded"] == [] and remote.messages == 3
    assert all(m.metadata.message_type == REFINE for m in grid.sent)


def _broken(kind: str):
    def handler(msg: Message) -> Optional[Message]:
        if kind == "silent":
            return None
        if kind == "failed":
            return Message(Error(code=1, reason="ClientApp exception: out of memory"), reply_to=msg)
        reply = answer(msg, _token_data(99, 6))
        g = reply.content["gradient-0"].to_torch_state_dict()
        key = next(iter(g))
        if kind == "nan":
            g[key] = g[key] * float("nan")
        elif kind == "shape":
            g[key] = g[key][..., :1]
        elif kind == "keys":
            g["not.a.weight"] = g.pop(key)
        reply.content["gradient-0"] = ArrayRecord(torch_state_dict=g)
        return reply

    return handler


def test_client_refine_excludes_failed_silent_and_malformed_answers_and_continues():
    models = [_tiny_gpt2(s, torch.float32) for s in range(2)]
    good = _token_data(3, 6)
    kinds = ["failed", "silent", "nan", "shape", "keys"]
    handlers = {1: lambda m: answer(m, good)}
    handlers.update({i + 2: _broken(k) for i, k in enumerate(kinds)})
    with ThreadPoolExecutor(1) as pool:
        states, cfg, al, _ = _alignments(models, pool, torch.float32)
        remote = ClientLosses(FakeGrid(handlers), list(handlers), OnClients(clients_per_step=0), 6, 1)
        remote.begin(cfg)
        sd = merged_pairs(al.align_all(), [0.5, 0.5], cfg, "factored")
        got = remote.gradients([{k: v.detach() for k, v in sd.items()}], 0)
    assert got is not None  # the one good client carries the step
    reasons = {e["node"]: e["reason"] for e in remote.record()["excluded"]}
    assert sorted(reasons) == [2, 3, 4, 5, 6]
    assert "failed" in reasons[2] and "no answer" in reasons[3] and "not finite" in reasons[4]
    assert "shape" in reasons[5] and "keys" in reasons[6]
    only = answer_gradients(handlers[1], remote, sd)
    for k, v in got[0][0].items():
        assert torch.allclose(v.float(), only[k], atol=1e-6)


def answer_gradients(handler, remote: ClientLosses, sd) -> dict:
    """What a single client's answer carries (the step with only it)."""
    lone = ClientLosses(FakeGrid({1: handler}), [1], OnClients(clients_per_step=0), remote.batch_size, 1)
    lone.config_json = remote.config_json
    lone.shapes = remote.shapes
    return {k: v.float() for k, v in lone.gradients([{k: v.detach() for k, v in sd.items()}], 0)[0][0].items()}


def test_client_refine_stops_with_too_few_answers_and_keeps_the_best_checked_alignment():
    """The clients answer the first check and two steps, then go silent: the refinement stops (with the
    reason recorded), and the round still ends with an aggregate, built from the best checked alignment."""
    from fedlmc.merging.universe import universe_merge

    models = [_tiny_gpt2(s, torch.float32) for s in range(3)]
    data = {n: _token_data(20 + n, 12) for n in (1, 2, 3)}
    calls = {"n": 0}

    def handler(n):
        def h(msg):
            calls["n"] += 1
            if msg.content["config"]["mode"] == "gradient" and msg.content["config"]["step"] >= 2:
                return None
            return answer(msg, data[n], data[n])

        return h

    grid = FakeGrid({n: handler(n) for n in data})
    on = OnClients(clients_per_step=2, min_clients=2, timeout=1.0)
    remote = ClientLosses(grid, list(data), on, 6, 1)
    refine = Refinement(steps=20, check_every=1, batch_size=6, check_batches=1, check_sigmas=0.0, patience=50)
    merged, transforms = universe_merge(
        models, None, None, refine=replace(refine, data=remote), universe=Universe(iterations=1, keep_layernorm=False)
    )
    info = transforms[1].info
    assert info["where"] == "remote" and "too few" in info["stopped"]
    assert info["steps_run"] == 2 and set(info["checks"]) == {0, 1, 2}
    assert info["best_step"] in info["checks"]
    rec = remote.record()
    assert rec["steps"] == 3 and len(rec["excluded"]) == 2  # step 3: both asked clients silent
    assert all(torch.isfinite(v).all() for v in merged.state_dict().values())
    # with checks, the alignment returned is a checked one: its check score is the best-step score
    assert info["checks"][info["best_step"]] == min(info["checks"].values()) or info["best_step"] == 0


def test_client_refine_needs_data_somewhere():
    from fedlmc.strategies import RefinedFedAvg

    cfg = _tiny_gpt2(0, torch.float32).config.to_dict()
    with pytest.raises(ValueError, match="at the server or at the clients"):
        RefinedFedAvg(model=cfg, refine=Refinement())
    RefinedFedAvg(model=cfg, refine=Refinement(), on_clients=OnClients())  # the clients hold it


def _evaluate_handler(losses: dict[str, float], n: int = 10, fail: bool = False):
    def h(msg):
        if fail:
            return Message(Error(code=1, reason="boom"), reply_to=msg)
        cand = msg.content["config"]["candidate"]
        return Message(
            RecordDict({"metrics": MetricRecord({"num-examples": n, "eval-loss": losses[cand]})}), reply_to=msg
        )

    return h


def test_client_guard_keeps_the_candidate_with_the_lower_weighted_client_loss():
    cands = {
        "aligned": ArrayRecord(torch_state_dict={"w": torch.ones(2)}),
        "average": ArrayRecord(torch_state_dict={"w": torch.zeros(2)}),
    }
    handlers = {
        1: _evaluate_handler({"aligned": 1.0, "average": 2.0}, n=10),
        2: _evaluate_handler({"aligned": 3.0, "average": 2.5}, n=30),  # heavier: the weighted mean favours average
        3: _evaluate_handler({}, fail=True),
    }
    losses, cost = client_guard(FakeGrid(handlers), [1, 2, 3], cands, ConfigRecord({}), OnClients())
    assert losses == pytest.approx({"aligned": (10 * 1.0 + 30 * 3.0) / 40, "average": (10 * 2.0 + 30 * 2.5) / 40})
    assert cost["clients"] == [1, 2] and cost["messages"] == 6
    assert {e["node"] for e in cost["excluded"]} == {3}
    none, _ = client_guard(FakeGrid({3: _evaluate_handler({}, fail=True)}), [3], cands, ConfigRecord({}), OnClients())
    assert none is None


def test_client_guard_in_the_strategy_keeps_the_plain_average_when_the_clients_prefer_it():
    """AlignedFedAvg with on_clients and no server data: the clients' evaluate decides (here every
    client scores the plain average lower), and the round record says where the verdict came from."""
    from fedlmc.strategies import AlignedFedAvg
    from tests.test_strategies import _reply

    models = [_tiny_gpt2(s, torch.float32) for s in range(2)]
    strategy = AlignedFedAvg(model=models[0].config.to_dict(), on_clients=OnClients())
    strategy._previous = ArrayRecord(torch_state_dict={k: v for k, v in models[0].state_dict().items()})
    seen = []

    def h(msg):
        seen.append(msg.metadata.message_type)
        arrays = msg.content["arrays"].to_torch_state_dict()
        plain = {k: (a + b) / 2 for (k, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values())}
        is_plain = all(torch.allclose(arrays[k], plain[k], atol=1e-6) for k in plain)
        return Message(
            RecordDict({"metrics": MetricRecord({"num-examples": 5, "eval-loss": 1.0 if is_plain else 2.0})}),
            reply_to=msg,
        )

    strategy.grid = FakeGrid({1: h, 2: h})
    strategy.aggregate_train(1, [_reply(models[0], 5, node=1), _reply(models[1], 5, node=2)])
    rec = strategy.history[-1]
    assert rec["guard_where"] == "clients" and rec["kept"] == "average"
    assert rec["guard_average"] == 1.0 and rec["guard_aligned"] == 2.0
    assert set(seen) == {MessageType.EVALUATE}


def test_client_refine_answer_clips_and_noises_its_gradient():
    """``answer(clipping_norm=C, noise_multiplier=z)``: the gradient scaled to norm ≤ C, then noised."""
    torch.manual_seed(0)
    model = _tiny_gpt2(0, torch.float32)
    data = _token_data(1, 6)
    state = {k: v.detach() for k, v in canonical_state(model, torch.device("cpu"), torch.float32).items()}
    remote = ClientLosses(FakeGrid({}), [1], OnClients(), 6, 1)
    remote.begin(canonical_config(model.config))
    grads = {}
    for name, kw in (
        ("plain", {}),
        ("clipped", dict(clipping_norm=1e-3)),
        ("noised", dict(clipping_norm=1e-3, noise_multiplier=1.0)),
    ):
        remote.grid = FakeGrid({1: lambda m, kw=kw: answer(m, data, **kw)})
        grads[name] = remote.gradients([state], 0)[0][0]

    def norm(g):
        return float(torch.sqrt(sum(v.pow(2).sum() for v in g.values())))

    assert norm(grads["plain"]) > 1e-2
    assert norm(grads["clipped"]) == pytest.approx(1e-3, rel=1e-4)
    for k in grads["plain"]:  # the same direction, scaled
        assert torch.allclose(grads["clipped"][k], grads["plain"][k] * (1e-3 / norm(grads["plain"])), atol=1e-9)
    noise = {k: grads["noised"][k] - grads["clipped"][k] for k in grads["plain"]}
    n = sum(v.numel() for v in noise.values())
    std = norm(noise) / n**0.5
    assert 0.8e-3 < std < 1.2e-3  # N(0, (z·C)²) per entry


def test_client_refine_samples_real_node_ids_exactly():
    """Flower's node ids are 64-bit: the per-step sample must return them exactly (numpy rounds such
    integers through float64 when it samples the ids themselves), a fresh seeded sample each step."""
    nodes = [2**63 + 12345, 14865438448911923200, 7106825706875898880, 5]
    remote = ClientLosses(FakeGrid({}), nodes, OnClients(clients_per_step=2), 6, 1, seed=3, server_round=1)
    seen = set()
    for step in range(20):
        picked = remote.step_nodes(step)
        assert len(picked) == 2 and set(picked) <= set(nodes)
        seen.update(picked)
        assert picked == remote.step_nodes(step)  # seeded
    assert seen == set(nodes)


def test_client_guard_and_checks_ask_only_check_clients():
    cands = {
        "aligned": ArrayRecord(torch_state_dict={"w": torch.ones(2)}),
        "average": ArrayRecord(torch_state_dict={"w": torch.zeros(2)}),
    }
    handlers = {n: _evaluate_handler({"aligned": 1.0, "average": 2.0}) for n in (1, 2, 3)}
    grid = FakeGrid(handlers)
    losses, cost = client_guard(grid, [3, 1, 2], cands, ConfigRecord({}), OnClients(check_clients=2))
    assert cost["clients"] == [1, 2] and cost["messages"] == 4 and losses["aligned"] == 1.0
    remote = ClientLosses(grid, [3, 1, 2], OnClients(check_clients=1), 6, 1)
    assert remote.check_nodes == [1]


def test_client_guard_counts_the_candidates_bytes():
    from fedlmc.flower.on_clients import record_nbytes

    arrays = ArrayRecord(torch_state_dict={"w": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.float64)})
    assert record_nbytes(arrays) == 3 * 4 * 4 + 5 * 8


def test_the_client_app_imports_no_assignment_solver():
    """A deployment starts a ClientApp process for every message: its import must not pull in
    scipy.optimize (about a second), which only the server's matching uses."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, clients.app; print(sorted(m for m in sys.modules if m.startswith('scipy.optimize')))"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


class _DelayedGrid(Grid):
    """A Flower ``Grid`` whose node ``n`` answers ``delays[n]`` seconds after a message was pushed (None:
    never), as a deployment's SuperLink would hand the replies out."""

    def __init__(self, delays: dict[int, Optional[float]]) -> None:
        self.delays, self.sent, self.pulls = delays, {}, 0

    def set_run(self, run_id):
        pass

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, *a, **k):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.delays)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = str(uuid.uuid4())
            m.metadata.__dict__["_message_id"] = mid
            self.sent[mid] = (m, time.monotonic())
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = []
        for mid in message_ids:
            m, at = self.sent[mid]
            delay = self.delays[m.metadata.dst_node_id]
            if delay is not None and time.monotonic() >= at + delay:
                reply = Message(RecordDict({"metrics": MetricRecord({"ok": 1.0})}), reply_to=m)
                reply.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
                out.append(reply)
                del self.sent[mid]
        return out

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("exchange polls the grid itself")


def test_exchange_collects_replies_soon_after_they_come_and_stops_at_the_timeout():
    """A refinement step waits for its clients through ``exchange``: the replies are there within a
    poll of their arrival (Flower's deployment grid looks every 3 s), a node that never answers is
    given up after the timeout, and the polls stay few."""
    from fedlmc.flower.on_clients import POLL_MAX, exchange

    grid = _DelayedGrid({1: 0.0, 2: 0.4, 3: None})
    msgs = [Message(RecordDict(), dst_node_id=n, message_type=REFINE) for n in (1, 2, 3)]
    t0 = time.monotonic()
    replies = exchange(grid, msgs, timeout=2.0)
    took = time.monotonic() - t0
    assert sorted(int(r.metadata.src_node_id) for r in replies) == [1, 2]
    assert 2.0 <= took < 2.0 + POLL_MAX, took  # node 3 given up at the timeout
    assert grid.pulls <= 12, grid.pulls
    grid = _DelayedGrid({1: 0.3, 2: 0.5})
    t0 = time.monotonic()
    replies = exchange(grid, [Message(RecordDict(), dst_node_id=n, message_type=REFINE) for n in (1, 2)], None)
    assert len(replies) == 2 and time.monotonic() - t0 < 0.5 + POLL_MAX
