"""The one optimiser behind learned matching and Dirichlet refinement: learn every moving model's
alignment (residual map O and head / FF permutations) so that merges of the aligned models have low
loss on training batches.

Each step draws merge weights λ (learned matching: (u, 1 − u) with u ~ U(0.4, 0.6) for a pair;
refinement: λ ~ Dirichlet(α·1_M)) and minimises ``L(Σ_m λ_m π_m(θ_m))``. One model stays fixed: a
symmetry applied to all models at once changes nothing. ``O`` is the polar factor of a square latent
(differentiable, with a stable gradient); permutations are Hungarian projections of their latents with
a straight-through gradient; intra-head gauges (factored merge) are re-aligned to a reference by
Procrustes from the current hard alignment at every step (constants for the gradient). What comes out
is an exact group element in float64 (``solvers.exact_elements``).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedlmc.matching.profile import section
from fedlmc.matching.solvers import Elements, assignments, exact_elements
from fedlmc.matching.steps import apply_elements, gauge_step
from fedlmc.merging.averaging import circuit_state, unit_weighted, weighted_state
from fedlmc.merging.widths import permute_masks
from fedlmc.models import from_config
from fedlmc.options import Learning
from fedlmc.symmetry import StateDict, Transform, apply_to_state, ones_basis, perm_matrix, spec_for
from fedlmc.train import _progress, loss_and_correct


class _Polar(torch.autograd.Function):
    """The orthogonal polar factor ``U Vᵀ`` of a square matrix with a stable gradient.

    Differentiating U and V separately (as SVD's backward does) divides by ``s_i² − s_j²``, which is
    infinite at an orthogonal start; the polar factor itself only needs ``1/(s_i + s_j)``:
    ``∂L/∂X = U [(Ĝ − Ĝᵀ) / (s_i + s_j)] Vᵀ`` with ``Ĝ = Uᵀ (∂L/∂O) V``.
    """

    @staticmethod
    def forward(ctx, X: torch.Tensor) -> torch.Tensor:
        U, S, Vh = torch.linalg.svd(X)
        ctx.save_for_backward(U, S, Vh)
        return U @ Vh

    @staticmethod
    def backward(ctx, G: torch.Tensor) -> torch.Tensor:
        U, S, Vh = ctx.saved_tensors
        Gh = U.T @ G @ Vh.T
        return U @ ((Gh - Gh.T) / (S[:, None] + S[None, :]).clamp_min(1e-12)) @ Vh


def endless_batches(data, batch_size: int, gen: torch.Generator):
    """Shuffled batches of ``data``, epoch after epoch (the latents train for a number of steps); none
    at all for data without a batch (an empty client partition), never an endless empty loop."""
    while True:
        got = False
        for b in data.batches(batch_size, shuffle=True, generator=gen):
            got = True
            yield b
        if not got:
            return


@dataclass
class Options:
    """What the optimiser needs beyond ``learn`` (the ``Learning`` or ``Refinement`` knobs): the merge's
    form and structure, set by learned matching and refinement themselves."""

    learn: Learning = field(default_factory=Learning)
    form: str = "factored"
    keep_layernorm: bool = False  # keep every O·1 = 1 (learn only the centred block)
    gauge: Optional[str] = "orthogonal"
    learn_residual: bool = True  # False: O stays at its start, only permutations learn
    progress: bool = True
    snapshots: tuple[int, ...] = ()  # steps after which the exact elements are also kept (one run, many budgets)
    keep_relaxed: bool = False  # relax="sinkhorn": also return the states under the final soft maps (a pair's)


@dataclass
class Learned:
    """What ``learn_alignments`` returns: each model's exact elements (None for the fixed one), the
    loss trace, the seconds it took, ``{step: elements}`` for the requested snapshots and, when the
    objective was checked, ``{step: objective}`` and the step whose alignment was returned."""

    elements: list[Optional[Elements]]
    trace: list[float]
    seconds: float
    snapshots: dict[int, list[Optional[Elements]]]
    checks: dict[int, float]
    best_step: int
    stopped: Optional[str] = None  # why a remote descent stopped early (too few answers), if it did
    # keep_relaxed and relax="sinkhorn": each moving model's state under the final soft (doubly stochastic)
    # maps, not a group element's image (None for the fixed one; empty otherwise): the relaxed merge's operand
    relaxed: list[Optional[StateDict]] = field(default_factory=list)


class Latents:
    """One moving model's latents: a square residual latent, one matrix per head / FF group, and a
    log-scale per FF neuron where the start carries an FF scale (``ffscale.{l}``: its signs are kept)."""

    def __init__(
        self,
        start: Transform,
        spec,
        d: int,
        Q: Optional[torch.Tensor],
        learn_residual: bool,
        dtype: torch.dtype,
        dev: torch.device,
    ) -> None:
        O0 = start.get("residual")
        O0 = torch.eye(d, dtype=dtype, device=dev) if O0 is None else O0
        self.Q = Q
        self.o = ((Q.T @ O0 @ Q)[1:, 1:] if Q is not None else O0).clone().requires_grad_(learn_residual)
        self.p: dict[str, torch.Tensor] = {}
        self.blocks: dict[str, int] = {}  # "within" groups: their latents are solved block by block
        for g in spec.layer_groups("heads") + spec.layer_groups("qheads") + spec.layer_groups("ff"):
            el = start.get(g.name)
            first = torch.arange(g.size, device=dev) if el is None else el
            self.p[g.name] = perm_matrix(first, dtype).to(dev).requires_grad_(True)
            if g.structure == "within":
                self.blocks[g.name] = g.size // g.count
        self.log_scale: dict[str, torch.Tensor] = {}  # the FF scales' magnitudes, learned
        self.sign: dict[str, torch.Tensor] = {}  # and their signs, fixed at the start's
        for g in spec.layer_groups("ffscale"):
            c = start.get(g.name)
            if c is not None:
                c = c.to(device=dev, dtype=dtype)
                self.log_scale[g.name] = c.abs().log().clone().requires_grad_(True)
                self.sign[g.name] = torch.sign(c)

    def scales(self) -> dict[str, torch.Tensor]:
        return {k: self.sign[k] * v.exp() for k, v in self.log_scale.items()}

    def residual(self) -> torch.Tensor:
        R = _Polar.apply(self.o)
        if self.Q is None:
            return R
        one = torch.ones(1, 1, dtype=R.dtype, device=R.device)
        return self.Q @ torch.block_diag(one, R) @ self.Q.T

    def straight_through(self, perms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward: the hard permutation matrices, exactly (``P + (v − v)``: ``(P + v) − v`` rounds, and an
        exact value lets ``apply_to_state`` gather instead of multiplying); backward: the gradient goes
        to the latents."""
        return {k: perm_matrix(perms[k], v.dtype).to(v.device) + (v - v.detach()) for k, v in self.p.items()}

    def soft(self, tau: float) -> dict[str, torch.Tensor]:
        """Doubly stochastic relaxations ``sinkhorn(latent / tau)`` (block-diagonal for "within" groups)."""
        return {k: sinkhorn(v / tau, self.blocks.get(k)) for k, v in self.p.items()}


def hard_all(lat: Sequence[Optional[Latents]], pool: Executor) -> list[Optional[dict[str, torch.Tensor]]]:
    """Every moving model's hard permutations (None for the fixed one): each group's latent projected to
    its nearest permutation (block by block for "within" groups), all solves at once so that they spread
    over the pool's threads (latents that drifted far from 0/1 make slow assignments)."""
    jobs = [
        (i, k, lo, v[lo : lo + b, lo : lo + b] if b else v)
        for i, la in enumerate(lat)
        if la is not None
        for k, v in la.p.items()
        for b in [la.blocks.get(k)]
        for lo in (range(0, v.shape[0], b) if b else [0])
    ]
    solved = assignments([score for *_, score in jobs], pool)
    out: list[Optional[dict[str, list]]] = [None if la is None else {k: [] for k in la.p} for la in lat]
    for (i, k, lo, _), perm in zip(jobs, solved):
        out[i][k].append(perm + lo)
    return [
        None if d is None else {k: torch.cat(parts).to(lat[i].p[k].device) for k, parts in d.items()}
        for i, d in enumerate(out)
    ]


def sinkhorn(logits: torch.Tensor, block: Optional[int] = None, iters: int = 20) -> torch.Tensor:
    """The doubly stochastic matrix nearest ``exp(logits)`` (log-domain Sinkhorn normalisation);
    ``block``: entries outside the diagonal blocks of that size are zero."""
    if block is not None:
        idx = torch.arange(logits.shape[0], device=logits.device) // block
        logits = logits.masked_fill(idx[:, None] != idx[None, :], float("-inf"))
    for _ in range(iters):
        logits = logits - torch.logsumexp(logits, dim=1, keepdim=True)
        logits = logits - torch.logsumexp(logits, dim=0, keepdim=True)
    return logits.exp()


class Alignments:
    """The latents of every moving model and what is computed from them: each model's aligned state
    (``aligned``, differentiable), every hard permutation at once (``hard``) and the exact group
    elements (``exact``). ``fixed`` has no latents: a symmetry applied to all models changes nothing."""

    def __init__(
        self,
        states: Sequence[StateDict],
        cfg,
        warm_starts: Sequence[Transform],
        fixed: int,
        opts: Options,
        masks: Optional[Sequence[Optional[dict[str, torch.Tensor]]]],
        reference: Optional[StateDict],
        pool: Executor,
    ) -> None:
        ref_t = states[fixed][next(iter(states[fixed]))]
        dtype, dev, M = ref_t.dtype, ref_t.device, len(states)
        self.states, self.cfg, self.fixed, self.opts, self.pool = states, cfg, fixed, opts, pool
        self.spec = spec_for(cfg)
        Q = ones_basis(cfg.d_model, dtype).to(dev) if opts.keep_layernorm else None
        starts = [T.to(dtype=dtype, device=dev) for T in warm_starts]
        self.lat = [
            None if i == fixed else Latents(starts[i], self.spec, cfg.d_model, Q, opts.learn_residual, dtype, dev)
            for i in range(M)
        ]
        self.masks = list(masks) if masks is not None else [None] * M
        self.fixed_state = apply_to_state(states[fixed], cfg, starts[fixed])[0]
        self.fixed_mask = permute_masks(self.masks[fixed], starts[fixed]) if self.masks[fixed] is not None else None
        self.ref = reference if reference is not None else self.fixed_state
        self.read = {m.param for kind in ("qk", "ov") for g in self.spec.layer_groups(kind) for m in g.members}

    def optimizer(self) -> torch.optim.Optimizer:
        learn = self.opts.learn
        groups = [{"params": [v for la in self.lat if la for v in la.p.values()], "lr": learn.perm_lr}]
        if self.opts.learn_residual:
            groups.append({"params": [la.o for la in self.lat if la], "lr": learn.lr})
        scales = [v for la in self.lat if la for v in la.log_scale.values()]
        if scales:
            groups.append({"params": scales, "lr": learn.lr})
        return torch.optim.Adam(groups, lr=learn.lr)

    def gauges(self, i: int, O: torch.Tensor, perms: dict[str, torch.Tensor]) -> Elements:
        """Model i's intra-head gauges re-aligned to the reference (constants for the gradient)."""
        if self.opts.form != "factored" or not self.opts.gauge:
            return {}
        with torch.no_grad():
            B = apply_elements(
                {k: v for k, v in self.states[i].items() if k in self.read},
                self.cfg,
                {"residual": O.detach(), **perms},
                kinds=("residual", "heads", "qheads"),
            )
            return gauge_step(self.ref, B, self.spec, self.opts.gauge)

    def aligned(self, i: int, perms: Optional[dict[str, torch.Tensor]]) -> tuple[StateDict, Optional[dict]]:
        """Model i's aligned state (differentiable in its latents) and its permuted mask."""
        if i == self.fixed:
            return self.fixed_state, self.fixed_mask
        la = self.lat[i]
        O = la.residual()
        moving = la.soft(self.opts.learn.tau) if self.opts.learn.relax == "sinkhorn" else la.straight_through(perms)
        el = {"residual": O, **self.gauges(i, O, perms), **moving, **la.scales()}
        mask = permute_masks(self.masks[i], Transform(perms)) if self.masks[i] is not None else None
        return apply_to_state(self.states[i], self.cfg, Transform(el), relaxed=True)[0], mask

    def hard(self) -> list[Optional[dict[str, torch.Tensor]]]:
        return hard_all(self.lat, self.pool)

    def align_all(self, perms: Optional[list] = None) -> list[tuple[StateDict, Optional[dict]]]:
        return [self.aligned(i, p) for i, p in enumerate(self.hard() if perms is None else perms)]

    def relaxed(self) -> list[Optional[StateDict]]:
        """Every moving model's state aligned by its current soft maps (``relax="sinkhorn"``), detached."""
        with torch.no_grad():
            return [
                None if i == self.fixed else {k: v.detach().clone() for k, v in self.aligned(i, p)[0].items()}
                for i, p in enumerate(self.hard())
            ]

    def exact(self, perms: Optional[list] = None) -> list[Optional[Elements]]:
        """Every moving model's exact elements (CPU float64; None for the fixed one)."""
        with torch.no_grad():
            out = []
            for i, p in enumerate(self.hard() if perms is None else perms):
                if p is None:
                    out.append(None)
                    continue
                O = self.lat[i].residual()
                el = {"residual": O, **p, **self.gauges(i, O, p), **self.lat[i].scales()}
                out.append(exact_elements(el, self.spec, self.opts.keep_layernorm))
            return out


def learn_alignments(
    states: Sequence[StateDict],
    cfg,
    warm_starts: Sequence[Transform],
    data,
    fixed: int,
    sample_weights: Callable[[], list[float]],
    opts: Options,
    masks: Optional[Sequence[Optional[dict[str, torch.Tensor]]]] = None,
    reference: Optional[StateDict] = None,
    label: str = "learning alignments",
    check_weights: Optional[Sequence[float]] = None,
    check_data=None,
) -> Learned:
    """Learn the alignment of every model but ``fixed`` (canonical ``states`` of config ``cfg``, same
    shape), starting from ``warm_starts``; ``sample_weights()`` draws each step's merge weights; ``masks``
    mark padded units; the gauges align to ``reference`` (default: the fixed model aligned);
    ``check_weights`` (default uniform): the merge weights ``opts.learn.check_every`` scores, on the first
    batches of ``check_data`` (default ``data``).

    Returns each model's final elements (None for the fixed one, exact, CPU float64) — with
    ``check_every``, the best checked ones — the loss trace, the seconds, the elements at
    ``opts.snapshots`` and the checks."""
    t0, learn = time.time(), opts.learn
    snaps: dict[int, list[Optional[Elements]]] = {}
    wanted = set(opts.snapshots)
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        al = Alignments(states, cfg, warm_starts, fixed, opts, masks, reference, pool)
        check = None
        if learn.check_every:
            check = _Checks(
                opts,
                check_data if check_data is not None else data,
                cfg,
                check_weights or [1.0 / len(states)] * len(states),
                merged_template(states, cfg, opts.form),
                al,
            )

        def on_step(n: int) -> bool:
            if n in wanted:
                snaps[n] = al.exact()
            return check is not None and check.after(n)

        gradient = _local_gradient(states, cfg, data, opts, al.align_all, sample_weights)
        trace, _ = _descend(opts, al.optimizer(), gradient, label, on_step)
        relaxed = al.relaxed() if opts.keep_relaxed and learn.relax == "sinkhorn" else []
        if check is None:
            return Learned(al.exact(), trace, time.time() - t0, snaps, {}, len(trace), relaxed=relaxed)
        if len(trace) not in check.scores:  # the last steps since the last check
            check.score(len(trace))
        return Learned(check.best, trace, time.time() - t0, snaps, check.scores, check.best_step, relaxed=relaxed)


class _Checks:
    """Stopping on the objective: the merge at fixed weights scored on fixed batches (no gradient), at
    the start and every ``check_every`` steps; keeps the best alignment's exact elements.

    The descent samples merge weights and batches, so its own loss trace is too noisy to stop on; and
    more steps can make the aggregate worse on new data while its training loss still falls: scored
    on held-out batches, the best checked
    alignment is returned. A check replaces the best only when it is significantly lower
    (``check_sigmas``): the best of many checks on the same few batches would otherwise be
    partly chosen by those batches' noise, and steps that buy noise cost as much as the others."""

    def __init__(
        self, opts: Options, data, cfg, weights: Sequence[float], template: torch.nn.Module, alignments: Alignments
    ) -> None:
        self.opts, self.cfg, self.weights, self.template = opts, cfg, list(weights), template
        self.al = alignments
        batches = data.batches(opts.learn.batch_size, shuffle=False)
        self.batches = [b for _, b in zip(range(max(1, opts.learn.check_batches)), batches)]
        if not self.batches:
            raise ValueError("the data to check the objective on has no batch (too small for one block or example)")
        self.scores: dict[int, float] = {}
        self.best_step, self.stale = 0, 0
        self.score(0)

    def score(self, step: int) -> float:
        with torch.no_grad(), section("learned: checks of the objective"):
            perms = self.al.hard()
            sd = merged_pairs(self.al.align_all(perms), self.weights, self.cfg, self.opts.form)
            dev = next(iter(sd.values())).device
            losses = (
                torch.cat(
                    [
                        example_losses(self.opts.learn, functional_call(self.template, sd, (x.to(dev),)), y.to(dev))
                        for x, y in self.batches
                    ]
                )
                .double()
                .cpu()
            )
        loss = self.scores[step] = float(losses.mean())
        if step == 0 or significantly_lower(losses, self.best_losses, self.opts.learn.check_sigmas):
            self.best, self.best_losses, self.best_step, self.stale = self.al.exact(perms), losses, step, 0
        else:
            self.stale += 1
        return loss

    def after(self, step: int) -> bool:
        """Score after ``step`` when it is a check step; whether to stop."""
        if step % self.opts.learn.check_every:
            return False
        self.score(step)
        return self.stale >= self.opts.learn.patience


def significantly_lower(new: torch.Tensor, best: torch.Tensor, sigmas: float) -> bool:
    """Whether the losses ``new`` are lower than ``best`` (the same examples, paired) by more than
    ``sigmas`` standard errors of their mean difference (``sigmas`` 0, or one example: lower at all)."""
    d = best - new
    if sigmas <= 0 or len(d) < 2:
        return bool(d.mean() > 0)
    return bool(d.mean() > sigmas * d.std() / math.sqrt(len(d)))


def merged_state(states: Sequence[StateDict], lam: Sequence[float], masks, cfg, form: str) -> StateDict:
    """``Σ λ_m θ_m`` in ``form`` (masked over the models holding each unit when masks are given)."""
    if form == "circuit":
        return circuit_state(states, lam, cfg, masks)[0]
    if masks is not None and any(m is not None for m in masks):
        return unit_weighted(states, lam, masks, cfg)
    return weighted_state(states, lam)


def merged_pairs(pairs: Sequence[tuple[StateDict, Optional[dict]]], lam: Sequence[float], cfg, form: str) -> StateDict:
    """``merged_state`` of aligned (state, mask) pairs (``align_all``'s), masked only where a model has a mask."""
    masks = [m for _, m in pairs]
    return merged_state([s for s, _ in pairs], lam, masks if any(masks) else None, cfg, form)


def merged_loss(learn: Learning, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss the alignments descend on: ``learn.loss_fn``, else cross-entropy (the checks score the same
    loss per example: ``example_losses``)."""
    return learn.loss_fn(out, y) if learn.loss_fn is not None else loss_and_correct(out, y)[0]


def example_losses(learn: Learning, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``merged_loss`` per example (a sequence's mean token cross-entropy, its ignored targets left out),
    the units a check's significance is judged on; with ``learn.loss_fn`` (one number per batch) per batch."""
    if learn.loss_fn is not None:
        return merged_loss(learn, out, y).reshape(1)
    if y.is_floating_point():  # soft targets (distillation): the cross-entropy to them, per example
        per = -(y * torch.log_softmax(out.float(), dim=-1)).sum(-1)
        return per.reshape(y.shape[0], -1).mean(1)
    per = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none").view(y.shape[0], -1)
    valid = (y != -100).reshape(y.shape[0], -1)  # cross-entropy's default ignore_index
    return (per * valid).sum(1) / valid.sum(1).clamp_min(1)


def merged_template(states: Sequence[StateDict], cfg, form: str) -> torch.nn.Module:
    """A module of the merge's architecture (``functional_call`` runs it on merged states)."""
    M = len(states)
    merged_cfg = circuit_state([states[0]] * M, [1.0 / M] * M, cfg)[1] if form == "circuit" else cfg
    return from_config(merged_cfg).to(next(iter(states[0].values())).device).eval()


def _local_gradient(states, cfg, data, opts: Options, align_all, sample_weights) -> Callable[[int], float]:
    """One step's gradient here: every model aligned (``align_all``: each model's aligned state and mask),
    merged at fresh weights, the loss on the next batch of ``data`` back-propagated into the latents."""
    dev = next(iter(states[0].values())).device
    template = merged_template(states, cfg, opts.form)
    batches = endless_batches(data, opts.learn.batch_size, torch.Generator().manual_seed(opts.learn.seed))

    def gradient(step: int) -> float:
        x, y = next(batches)
        x, y = x.to(dev), y.to(dev)
        with section("learned: aligned models (solves, gauges, actions)"):
            pairs = align_all()
        with section("learned: merge, forward and backward"):
            sd = merged_pairs(pairs, sample_weights(), cfg, opts.form)
            loss = merged_loss(opts.learn, functional_call(template, sd, (x,)), y)
            loss.backward()
        return float(loss.detach())

    return gradient


def _descend(
    opts: Options,
    opt,
    gradient: Callable[[int], Optional[float]],
    label: str,
    on_step: Callable[[int], bool] = lambda n: False,
) -> tuple[list[float], Optional[str]]:
    """The one training loop of learned matching and refinement, here or on the clients: each step
    ``gradient(step)`` leaves the loss's gradient in the latents and returns the loss (None: too few
    answers, the loop stops), the learning rates follow the schedule, the optimiser steps, and
    ``on_step(n)`` runs after the n-th step and stops the loop by returning True. Returns the loss trace
    and why it stopped early (None: it did not, or ``on_step`` stopped it)."""
    trace: list[float] = []
    running = None
    base_lrs = [g["lr"] for g in opt.param_groups]
    with _progress(opts.progress) as bar:
        task = bar.add_task(label, total=opts.learn.steps, info="")
        for step in range(opts.learn.steps):
            opt.zero_grad(set_to_none=True)
            loss = gradient(step)
            if loss is None:
                return trace, f"step {step + 1}: too few answers"
            if opts.learn.schedule == "cosine":
                for g, lr in zip(opt.param_groups, base_lrs):
                    g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / opts.learn.steps))
            opt.step()
            trace.append(loss)
            running = trace[-1] if running is None else 0.9 * running + 0.1 * trace[-1]
            bar.update(task, completed=step + 1, info=f"loss {running:.4f}")
            if on_step(step + 1):
                break
    return trace, None


class Remote(Protocol):
    """Where the loss lives when it is not at the server (``fedlmc.flower.on_clients.ClientLosses``): it is sent
    merged states and answers with gradients and per-example losses."""

    def begin(self, config) -> None:
        """The config of the model the merged states are states of (sent before the first state)."""

    def gradients(self, states: list[StateDict], step: int) -> Optional[tuple[list[StateDict], float]]:
        """The example-weighted mean gradient of the loss at each state and the mean loss; None when too
        few answered (the refinement then stops)."""

    def losses(self, state: StateDict, step: int) -> Optional[dict[Any, torch.Tensor]]:
        """Per-example held-out losses at ``state``, by who computed them (the same examples every
        call, so two calls are paired); None when too few answered."""


def is_remote(data) -> bool:
    """Whether ``data`` is a ``Remote`` (the loss computed elsewhere) rather than a data set."""
    return all(callable(getattr(data, name, None)) for name in ("begin", "gradients", "losses"))


def learn_alignments_remote(
    states: Sequence[StateDict],
    cfg,
    warm_starts: Sequence[Transform],
    remote: Remote,
    fixed: int,
    sample_weights: Callable[[], list[float]],
    opts: Options,
    masks: Optional[Sequence[Optional[dict[str, torch.Tensor]]]] = None,
    reference: Optional[StateDict] = None,
    label: str = "learning alignments",
    check_weights: Optional[Sequence[float]] = None,
    samples: int = 1,
) -> Learned:
    """``learn_alignments`` with the loss computed elsewhere: each step merges the aligned models at
    ``samples`` draws of the weights, sends the merged states to ``remote`` (detached), and
    back-propagates the gradients it returns through the merges into the latents (the chain rule
    split at the merged state: the same gradient as a loss computed here on the same examples).

    The checks (``opts.learn.check_every``) score the merge at ``check_weights`` on ``remote``'s
    held-out examples, paired by who scored them. When ``remote`` answers None (too few clients), the
    descent stops and the best alignment checked so far is returned (the start when no check ran;
    without checks, the current alignment)."""
    t0, learn = time.time(), opts.learn
    weights = list(check_weights or [1.0 / len(states)] * len(states))
    stopped: Optional[str] = None
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        al = Alignments(states, cfg, warm_starts, fixed, opts, masks, reference, pool)
        remote.begin(merged_template(states, cfg, opts.form).config)
        check = _RemoteChecks(remote, al, weights, opts) if learn.check_every else None
        if check is not None and check.failed:  # not even the start could be scored: keep it
            return Learned(check.best, [], time.time() - t0, {}, {}, 0, "the first check: too few answers")

        def gradient(step: int) -> Optional[float]:
            with section("learned: aligned models (solves, gauges, actions)"):
                pairs = al.align_all()
                merged = [merged_pairs(pairs, sample_weights(), cfg, opts.form) for _ in range(samples)]
            with section("learned: remote gradients"):
                got = remote.gradients([{k: v.detach() for k, v in sd.items()} for sd in merged], step)
            if got is None:
                return None
            grads, loss = got
            with section("learned: back-propagation through the merge"):
                backpropagate(merged, grads)
            return float(loss)

        def on_step(n: int) -> bool:
            nonlocal stopped
            if check is None or n % learn.check_every:
                return False
            check.score(n)
            if check.failed:
                stopped = f"check at step {n}: too few answers"
            return check.failed or check.stale >= learn.patience

        trace, failed = _descend(opts, al.optimizer(), gradient, label, on_step)
        stopped = stopped or failed
        if check is None:
            out = Learned(al.exact(), trace, time.time() - t0, {}, {}, len(trace))
        else:
            if not stopped and len(trace) not in check.scores:
                check.score(len(trace))
            out = Learned(check.best, trace, time.time() - t0, {}, check.scores, check.best_step)
    out.stopped = stopped
    return out


def backpropagate(merged: Sequence[StateDict], grads: Sequence[StateDict]) -> None:
    """Accumulate into the latents the gradient of the mean over the merges of a loss whose gradient at
    each merged state ``merged[k]`` (differentiable in the latents) is ``grads[k]`` (the chain rule,
    split at the merged state)."""
    outs, gs = [], []
    for sd, g in zip(merged, grads):
        for k, v in sd.items():
            if v.requires_grad:
                outs.append(v)
                gs.append(g[k].to(device=v.device, dtype=v.dtype) / len(merged))
    torch.autograd.backward(outs, gs)


class _RemoteChecks:
    """``_Checks`` with the held-out losses computed by ``remote``: the merge at fixed weights, scored at
    the start and every ``check_every`` steps; a check improves when it is significantly lower on the
    examples both it and the best were scored on (paired by who scored them). ``failed``: the last
    check had too few answers."""

    def __init__(self, remote: Remote, al: Alignments, weights: list[float], opts: Options) -> None:
        self.remote, self.al, self.weights, self.opts = remote, al, weights, opts
        self.scores: dict[int, float] = {}
        self.best_step, self.stale, self.failed = 0, 0, False
        self.best_losses: Optional[dict[Any, torch.Tensor]] = None
        self.best = al.exact()  # the start, kept when not even it can be scored
        self.score(0)

    def score(self, step: int) -> None:
        with torch.no_grad(), section("learned: checks of the objective"):
            perms = self.al.hard()
            sd = merged_pairs(self.al.align_all(perms), self.weights, self.al.cfg, self.opts.form)
            got = self.remote.losses({k: v.detach() for k, v in sd.items()}, step)
        if got is None:
            self.failed = True
            return
        got = {k: v.double().cpu().reshape(-1) for k, v in got.items()}
        self.scores[step] = float(torch.cat(list(got.values())).mean())
        if self.best_losses is None:
            self.best, self.best_losses, self.best_step = self.al.exact(perms), got, step
            return
        common = [k for k in got if k in self.best_losses and len(got[k]) == len(self.best_losses[k])]
        new = torch.cat([got[k] for k in common]) if common else None
        if new is not None and significantly_lower(
            new, torch.cat([self.best_losses[k] for k in common]), self.opts.learn.check_sigmas
        ):
            self.best, self.best_losses, self.best_step, self.stale = self.al.exact(perms), got, step, 0
        else:
            self.stale += 1
