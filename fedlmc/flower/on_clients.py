"""The refinement's gradients and the guard's losses computed by the clients, through Flower messages.

The server has the aligned replies, the clients have the data. A refinement step sends each of a sample
of the round's clients the merged model (at one or several draws of the merge weights λ) in a message
of type ``query.refine``; the client answers with the gradient of its loss at that model on a few local
batches, the loss and its example count (``answer``: the one handler a ClientApp adds). The server
averages the gradients weighted by the example counts (the gradient of the pooled loss) and
back-propagates them through the merge into the alignments (``matching.optimise.learn_alignments_remote``).
The checks of the objective ask a fixed set of clients for per-example held-out losses the same way.

The guard sends its candidates (the aligned and the plain aggregate) as ordinary ``evaluate`` messages
and keeps the one with the lower example-weighted loss (``client_guard``): an app's own evaluate answers.

What a client reveals is what FedSGD reveals: gradients of its loss at a model the server chose.
"""

from __future__ import annotations

import json
import math
import time
from logging import INFO, WARNING
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore import log
from torch.func import functional_call

from fedlmc.matching.optimise import endless_batches, example_losses, merged_loss
from fedlmc.models import from_config
from fedlmc.options import Learning, OnClients
from fedlmc.symmetry import StateDict
from fedlmc.train import pick_device

# the client code each query needs (the registrations' `client` column says the same)
REFINE_CODE = "answers `query.refine` messages with `fedlmc.flower.on_clients.answer` (fedlmc's ClientApp does)"
DISTILL_CODE = REFINE_CODE[: -len(" (fedlmc's ClientApp does)")] + (
    " and keeps its trained model when the train config says `keep-model` (fedlmc's ClientApp does)"
)


def guard_code(loss_key: str = OnClients.loss_key) -> str:
    """The client code the clients' guard needs: an evaluate that answers the loss and the example count."""
    return f"its evaluate answers `{loss_key}` (`OnClients.loss_key`) and `num-examples` on held-out data"


def unconfirmed(on: OnClients, what: str, code: str, reasons: list[str]) -> str:
    """Every client asked for ``what`` answered without it (``reasons``, the first two said): their
    ClientApp lacks ``code``. Warns, naming the code, or raises with ``on.unconfirmed="error"``;
    returns the code (for the round's record)."""
    why = (
        f"{what}: no client answered with it ({'; '.join(reasons[:2])}): their ClientApp does not run the "
        f"client code this strategy needs, so its method did not run. The ClientApp {code}"
    )
    if on.unconfirmed == "error":
        raise ValueError(why)
    log(WARNING, "%s", why)
    return code


# Flower's deployment grid looks for replies every 3 s, and a refinement step is one exchange with its
# clients: ``exchange`` looks after 0.1 s, then 1.5 times later each time, at most 1 s apart
POLL_FIRST, POLL_MAX = 0.1, 1.0


def exchange(grid, messages: list[Message], timeout: Optional[float]) -> list[Message]:
    """``grid.send_and_receive(messages, timeout=timeout)``: the replies that came within ``timeout``
    seconds (None: all of them). On a Flower ``Grid`` the replies are pulled ``POLL_FIRST`` to
    ``POLL_MAX`` seconds apart (``arrivals.ArrivalGrid``); any other grid (a test double)
    answers through its own ``send_and_receive``."""
    from flwr.serverapp import Grid

    from fedlmc.scale.arrivals import ArrivalGrid

    if isinstance(grid, Grid):
        grid = ArrivalGrid(grid, poll=POLL_FIRST, poll_max=POLL_MAX, one_at_a_time=False)
    return list(grid.send_and_receive(messages, timeout=timeout))


REFINE = f"{MessageType.QUERY}.refine"  # the message type of a refinement query (ClientApp: @app.query("refine"))
GRADIENT, LOSSES = "gradient", "losses"  # what a refinement query asks for (its config's "mode")


class BadAnswer(ValueError):
    """Why a client's answer cannot be used (the message is the reason recorded)."""


def nbytes(state: StateDict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def record_nbytes(arrays: ArrayRecord) -> int:
    """The tensor bytes an ArrayRecord holds (from its arrays' shapes and dtypes: no copy)."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays.values())


# ---- the client's side --------------------------------------------------------------------------------
def answer(
    msg: Message,
    data,
    check_data=None,
    *,
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    device: Optional[str] = None,
    clipping_norm: Optional[float] = None,
    noise_multiplier: float = 0.0,
) -> Message:
    """The reply to a refinement query: for ``mode="gradient"``, the gradient of the mean loss on
    ``batches`` shuffled batches of ``data`` (seeded by the query) at each model the query carries
    (``model-0``, ``model-1``, ...; the reply's ``gradient-0``, ...); for ``mode="losses"``, the
    per-example losses on the first ``batches`` batches of ``check_data`` (default ``data``).

    ``data``: anything with fedlmc's ``batches(batch_size, shuffle, generator)`` (``fedlmc.data.ArrayData``
    wraps tensors); ``loss_fn(outputs, targets)``: the loss, default cross-entropy. The models are
    fedlmc models of the query's ``model-config``.

    ``clipping_norm``: each gradient is scaled to at most this global L2 norm, then Gaussian noise of
    standard deviation ``noise_multiplier × clipping_norm`` is added to every entry (the Gaussian
    mechanism, as DP-FedSGD clips and noises; the noise is drawn from the operating system's entropy,
    never from the server's seed). Flower's DP mods act on train messages only, so a refinement
    handler clips here."""
    cfg = msg.content["config"]
    mode, n_batches, batch_size = str(cfg["mode"]), int(cfg["batches"]), int(cfg["batch-size"])
    dev = pick_device(device)
    model = from_config(json.loads(str(cfg["model-config"]))).to(dev).eval()
    learn = Learning(loss_fn=loss_fn)
    if mode == LOSSES:
        source = check_data if check_data is not None else data
        state = {k: v.to(dev) for k, v in msg.content["model-0"].to_torch_state_dict().items()}
        losses, n = [], 0
        with torch.no_grad():
            for _, (x, y) in zip(range(n_batches), source.batches(batch_size, shuffle=False)):
                losses.append(example_losses(learn, functional_call(model, state, (x.to(dev),)), y.to(dev)))
                n += len(x)
        per = torch.cat(losses).double().cpu() if losses else torch.zeros(0, dtype=torch.float64)
        metrics = {"num-examples": n, "loss": float(per.mean()) if n else float("nan"), "losses": per.tolist()}
        return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
    if mode != GRADIENT:
        raise ValueError(f"unknown refinement query mode {mode!r}")
    gen = torch.Generator().manual_seed(int(cfg["seed"]))
    batches = [b for _, b in zip(range(n_batches), endless_batches(data, batch_size, gen))]
    content = RecordDict({})
    total_loss, n = 0.0, sum(len(x) for x, _ in batches)
    k = 0
    while f"model-{k}" in msg.content:
        state = {
            name: v.to(dev).requires_grad_(v.is_floating_point())
            for name, v in msg.content[f"model-{k}"].to_torch_state_dict().items()
        }
        loss = sum(
            merged_loss(learn, functional_call(model, state, (x.to(dev),)), y.to(dev)) * len(x) for x, y in batches
        )
        loss = loss / max(n, 1)
        leaves = [name for name, v in state.items() if v.requires_grad]
        grads = torch.autograd.grad(loss, [state[name] for name in leaves], allow_unused=True)
        grad = {
            name: (torch.zeros_like(state[name]) if g is None else g).detach().cpu() for name, g in zip(leaves, grads)
        }
        if clipping_norm is not None:
            grad = clip_and_noise(grad, clipping_norm, noise_multiplier)
        content[f"gradient-{k}"] = ArrayRecord(torch_state_dict=grad)
        total_loss += float(loss.detach())
        k += 1
    content["metrics"] = MetricRecord({"num-examples": n, "loss": total_loss / max(k, 1)})
    return Message(content=content, reply_to=msg)


def clip_and_noise(grad: StateDict, clipping_norm: float, noise_multiplier: float = 0.0) -> StateDict:
    """``grad`` scaled to global L2 norm ≤ ``clipping_norm``, plus N(0, (noise_multiplier·clipping_norm)²)
    noise per entry (a generator seeded from ``os.urandom``)."""
    import os

    if clipping_norm <= 0 or noise_multiplier < 0:
        raise ValueError(
            f"clipping_norm must be positive and noise_multiplier non-negative, got {clipping_norm}, {noise_multiplier}"
        )
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grad.values())))
    scale = min(1.0, clipping_norm / max(norm, 1e-30))
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    out = {}
    for k, g in grad.items():
        g = g * scale
        if noise_multiplier > 0:
            g = g + torch.randn(g.shape, generator=gen, dtype=g.dtype) * (noise_multiplier * clipping_norm)
        out[k] = g
    return out


# ---- the server's side --------------------------------------------------------------------------------
class ClientLosses:
    """The refinement's loss on the round's clients (a ``matching.optimise.Remote``).

    Parameters
    ----------
    grid : flwr.serverapp.Grid
        Where the messages go.
    nodes : list of int
        The round's clients (the nodes whose replies were aggregated).
    on : OnClients
        How many clients per step and per check, batches per client, λ draws per message, the minimum
        of answers, the timeout.
    batch_size : int
        Each client's batch size (the refinement's).
    check_batches : int
        Held-out batches each check client scores.
    seed : int
        Seeds which clients a step asks and their batches.
    server_round : int
        Recorded in each query (``server-round``).
    target : str, default ""
        What the clients' loss compares the model's outputs with: their labels (""), or ``"own-model"``,
        the distributions predicted by the model each client trained this round (distillation; fedlmc's
        ClientApp keeps it when the round's train config asks ``keep-model``).
    """

    def __init__(
        self,
        grid,
        nodes: list[int],
        on: OnClients,
        batch_size: int,
        check_batches: int,
        seed: int = 0,
        server_round: int = 0,
        target: str = "",
    ) -> None:
        if not nodes:
            raise ValueError("the refinement on the clients needs at least one client")
        self.grid, self.nodes, self.on, self.target = grid, sorted(int(n) for n in nodes), on, target
        self.batch_size, self.check_batches, self.seed, self.round = batch_size, check_batches, seed, server_round
        self.samples = on.samples_per_message
        self.check_nodes = self.nodes if not on.check_clients else self.nodes[: on.check_clients]
        self.config_json: Optional[str] = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.excluded: list[dict[str, Any]] = []
        self.code = DISTILL_CODE if target == "own-model" else REFINE_CODE
        self.unconfirmed: Optional[str] = None
        self.steps = self.checks = self.messages = self.bytes_sent = self.bytes_received = 0
        self.seconds = 0.0

    def begin(self, config) -> None:
        self.config_json = json.dumps(config.to_dict())

    def step_nodes(self, step: int) -> list[int]:
        """The clients step ``step`` asks: a fresh seeded sample of ``clients_per_step``."""
        k = self.on.clients_per_step
        if not k or k >= len(self.nodes):
            return list(self.nodes)
        rng = np.random.default_rng([self.seed, self.round, step])
        # indices, not the ids: Flower's node ids are 64-bit and numpy would round them through float64
        return sorted(self.nodes[int(i)] for i in rng.choice(len(self.nodes), size=k, replace=False))

    def _ask(self, nodes: list[int], states: list[StateDict], mode: str, batches: int, step: int) -> dict[int, Message]:
        """Send the query to ``nodes``; the replies by node (a node that did not answer is excluded)."""
        if self.config_json is None:
            raise RuntimeError("ClientLosses.begin(config) must come first")
        t0 = time.time()
        records = {
            f"model-{k}": ArrayRecord(torch_state_dict={n: v.cpu() for n, v in s.items()}) for k, s in enumerate(states)
        }
        config = {
            "model-config": self.config_json,
            "mode": mode,
            "batches": int(batches),
            "batch-size": int(self.batch_size),
            "seed": int(self.seed * 1_000_003 + self.round * 10_007 + step),
            "server-round": int(self.round),
            "step": int(step),
            **({"target": self.target} if self.target else {}),
        }
        msgs = [
            Message(content=RecordDict({**records, "config": ConfigRecord(config)}), dst_node_id=n, message_type=REFINE)
            for n in nodes
        ]
        self.messages += len(msgs)
        self.bytes_sent += len(msgs) * sum(nbytes(s) for s in states)
        replies = {int(r.metadata.src_node_id): r for r in exchange(self.grid, msgs, self.on.timeout)}
        self.seconds += time.time() - t0
        for n in nodes:
            if n not in replies:
                self._exclude(step, mode, n, f"no answer within {self.on.timeout:g} s")
        return {n: r for n, r in replies.items() if n in nodes}

    def _exclude(self, step: int, mode: str, node: int, reason: str) -> None:
        self.excluded.append({"step": step, "mode": mode, "node": node, "reason": reason})
        log(WARNING, "refinement on the clients, step %d (%s): excluded node %d: %s", step, mode, node, reason)

    def gradients(self, states: list[StateDict], step: int) -> Optional[tuple[list[StateDict], float]]:
        self.steps += 1
        if not self.shapes:
            self.shapes = {k: tuple(v.shape) for k, v in states[0].items() if v.is_floating_point()}
        replies = self._ask(self.step_nodes(step), states, GRADIENT, self.on.batches_per_client, step)
        good: list[tuple[float, list[StateDict], float]] = []
        reasons = []
        for node, reply in sorted(replies.items()):
            try:
                n, loss = _count_and_loss(reply)
                grads = [self._gradient(reply, k) for k in range(len(states))]
            except BadAnswer as e:
                self._exclude(step, GRADIENT, node, str(e))
                reasons.append(f"node {node}: {e}")
                continue
            self.bytes_received += sum(nbytes(g) for g in grads)
            good.append((n, grads, loss))
        if reasons and not good:
            self.unconfirmed = unconfirmed(self.on, f"refinement on the clients, step {step}", self.code, reasons)
        if len(good) < self.on.min_clients:
            log(
                WARNING,
                "refinement on the clients, step %d: %d valid answers (minimum %d): stopping",
                step,
                len(good),
                self.on.min_clients,
            )
            return None
        total = sum(n for n, _, _ in good)
        out = []
        for k in range(len(states)):
            acc = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in self.shapes.items()}
            for n, grads, _ in good:
                for name, g in grads[k].items():
                    acc[name].add_(g.double(), alpha=n / total)
            out.append(acc)
        return out, sum(n * loss for n, _, loss in good) / total

    def _gradient(self, reply: Message, k: int) -> StateDict:
        key = f"gradient-{k}"
        if key not in reply.content.array_records:
            raise BadAnswer(f"no '{key}' in the answer")
        g = reply.content.array_records[key].to_torch_state_dict()
        if set(g) != set(self.shapes):
            missing, extra = sorted(set(self.shapes) - set(g)), sorted(set(g) - set(self.shapes))
            raise BadAnswer(f"its gradient's keys differ (missing {missing[:3]}, extra {extra[:3]})")
        for name, v in g.items():
            if tuple(v.shape) != self.shapes[name]:
                raise BadAnswer(f"gradient {name} has shape {tuple(v.shape)}, not {self.shapes[name]}")
            if not v.is_floating_point() or not bool(torch.isfinite(v).all()):
                raise BadAnswer(f"gradient {name} is not finite")
        return g

    def losses(self, state: StateDict, step: int) -> Optional[dict[int, torch.Tensor]]:
        self.checks += 1
        replies = self._ask(self.check_nodes, [state], LOSSES, self.check_batches, step)
        out: dict[int, torch.Tensor] = {}
        reasons = []
        for node, reply in sorted(replies.items()):
            try:
                n, _ = _count_and_loss(reply)
                per = reply.content["metrics"].get("losses")
                per = torch.tensor(list(per) if per is not None else [], dtype=torch.float64)
                if len(per) != n or not bool(torch.isfinite(per).all()):
                    raise BadAnswer(f"{len(per)} per-example losses for {n} examples, or not finite")
            except BadAnswer as e:
                self._exclude(step, LOSSES, node, str(e))
                reasons.append(f"node {node}: {e}")
                continue
            out[node] = per
        if reasons and not out:
            self.unconfirmed = unconfirmed(
                self.on, f"refinement on the clients, check at step {step}", self.code, reasons
            )
        if len(out) < self.on.min_clients:
            log(WARNING, "refinement on the clients, check at step %d: %d valid answers: stopping", step, len(out))
            return None
        return out

    def record(self) -> dict[str, Any]:
        """What the refinement cost and who was excluded (the round record's ``refine_clients``)."""
        return {
            "steps": self.steps,
            "checks": self.checks,
            "messages": self.messages,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "seconds": self.seconds,
            "clients_per_step": len(self.step_nodes(0)),
            "check_clients": len(self.check_nodes),
            "samples_per_message": self.samples,
            "excluded": self.excluded,
            **({"unconfirmed": self.unconfirmed} if self.unconfirmed else {}),
        }


def _count_and_loss(reply: Message) -> tuple[float, float]:
    if reply.has_error():
        raise BadAnswer(f"the client failed: {reply.error.reason}")
    metrics = reply.content.metric_records.get("metrics")
    if metrics is None or "num-examples" not in metrics:
        raise BadAnswer("its metrics have no 'num-examples'")
    n, loss = float(metrics["num-examples"]), float(metrics.get("loss", float("nan")))
    if not (math.isfinite(n) and n > 0):
        raise BadAnswer(f"num-examples is {n}")
    if not math.isfinite(loss):
        raise BadAnswer(f"its loss is {loss}")
    return n, loss


def client_guard(
    grid,
    nodes: Iterable[int],
    candidates: dict[str, ArrayRecord],
    config: ConfigRecord,
    on: OnClients,
    label: str = "guard",
) -> tuple[Optional[dict[str, float]], dict[str, Any]]:
    """The example-weighted held-out loss of each candidate on the clients (``evaluate`` messages: the
    ClientApp's own evaluate answers, its metrics' ``on.loss_key`` and ``num-examples``), over the
    clients that scored every candidate (so the comparison is paired); None when fewer than
    ``on.min_clients`` did. Also returns what it cost and who was excluded."""
    nodes = sorted(int(n) for n in nodes)
    nodes = nodes if not on.check_clients else nodes[: on.check_clients]
    t0 = time.time()
    msgs, sent = [], []
    for name, arrays in candidates.items():
        cfg = ConfigRecord({**dict(config), "purpose": "guard", "candidate": name})
        for n in nodes:
            msgs.append(
                Message(
                    content=RecordDict({"arrays": arrays, "config": cfg}),
                    dst_node_id=n,
                    message_type=MessageType.EVALUATE,
                )
            )
            sent.append((name, n))
    replies = exchange(grid, msgs, on.timeout)
    by_id = {m.metadata.message_id: key for m, key in zip(msgs, sent) if m.metadata.message_id}  # set when sent
    scores: dict[tuple[str, int], tuple[float, float]] = {}
    excluded = []
    for i, r in enumerate(replies):
        key = by_id.get(r.metadata.reply_to_message_id)
        if key is None:  # a grid that does not set message ids: replies come in the order sent
            key = sent[i] if i < len(sent) else None
        if key is None:
            continue
        try:
            if r.has_error():
                raise BadAnswer(f"the client failed: {r.error.reason}")
            metrics = r.content.metric_records.get("metrics")
            if metrics is None or on.loss_key not in metrics or "num-examples" not in metrics:
                raise BadAnswer(f"its metrics have no '{on.loss_key}' or 'num-examples'")
            n, loss = float(metrics["num-examples"]), float(metrics[on.loss_key])
            if not (math.isfinite(n) and n > 0 and math.isfinite(loss)):
                raise BadAnswer(f"num-examples {n}, loss {loss}")
        except BadAnswer as e:
            excluded.append({"node": key[1], "candidate": key[0], "reason": str(e)})
            continue
        scores[key] = (n, loss)
    both = [n for n in nodes if all((c, n) in scores for c in candidates)]
    for n in nodes:
        if n not in both and not any(e["node"] == n for e in excluded):
            excluded.append({"node": n, "reason": f"no answer for every candidate within {on.timeout:g} s"})
    cost = {
        "messages": len(msgs),
        "bytes_sent": sum(record_nbytes(a) for a in candidates.values()) * len(nodes),
        "seconds": time.time() - t0,
        "clients": both,
        "excluded": excluded,
    }
    for e in excluded:
        log(WARNING, "%s on the clients: excluded node %s: %s", label, e["node"], e["reason"])
    answered = [f"node {e['node']}: {e['reason']}" for e in excluded if "no answer" not in e["reason"]]
    if answered and not both:
        cost["unconfirmed"] = unconfirmed(on, f"the {label} on the clients", guard_code(on.loss_key), answered)
    if len(both) < on.min_clients:
        log(
            WARNING,
            "%s on the clients: %d clients scored every candidate (minimum %d): no verdict",
            label,
            len(both),
            on.min_clients,
        )
        return None, cost
    total = sum(scores[(next(iter(candidates)), n)][0] for n in both)
    out = {c: sum(scores[(c, n)][0] * scores[(c, n)][1] for n in both) / total for c in candidates}
    log(INFO, "%s on the clients (%d): %s", label, len(both), ", ".join(f"{c} {v:.4f}" for c, v in out.items()))
    return out, cost
