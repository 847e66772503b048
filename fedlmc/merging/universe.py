"""Universe merging: M models (mixed widths allowed) aligned by weight matching to one universe,
averaged there, optionally refined (Dirichlet), and projected back to each client's shape."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from fedlmc.matching import residual_activation_cross, weight_matching
from fedlmc.matching.activation import residual_states
from fedlmc.matching.profile import section
from fedlmc.matching.refine import dirichlet_refine
from fedlmc.merging.averaging import RunningSum, add_move, aligned_state, check_circuit, merge, robust_merge
from fedlmc.merging.widths import (
    common_shape,
    lift_residual,
    ones_lift,
    pad,
    permute_masks,
    residual_projector,
    same_shape,
    unit_masks,
    unpad,
)
from fedlmc.models import from_config
from fedlmc.options import ANCHORS, Matching, Refinement, Robust, Scale, Universe, one_of
from fedlmc.scale.allocator import release_freed_memory
from fedlmc.scale.cpu import fitting_threads
from fedlmc.scale.replies import Canonical, ReplyError, ReplyStore, StoredModel, read_ahead, save_model
from fedlmc.scale.workers import AlignmentPool
from fedlmc.symmetry import (
    Transform,
    WidthMap,
    apply_transform,
    canonical,
    invert_transform,
    layernorm_native,
    rebuild,
    spec_for,
    to_layernorm,
)
from fedlmc.symmetry.canonical import recentre

# Flower's own logger (its `flwr.supercore.log`), without importing Flower: the library runs without it
log = logging.getLogger("flwr").log

# a universe iteration that runs longer than this many seconds reports its progress (each such stretch
# of its alignments, and its end), even without ``progress``: a round of many large replies takes minutes
PROGRESS_EVERY = 10.0

Model = Union[nn.Module, StoredModel]


@dataclass
class Members:
    """The models of a universe, each padded exactly to the common shape (with masks marking its padded
    heads / FF neurons when widths differ) and canonical; ``weights`` sum to one. Models may wait on
    disk (``StoredModel``): same-shape ones are then read one at a time, whenever they are needed."""

    models: Sequence[Model]
    weights: list[float]
    shape: dict[str, int]
    padded: Sequence[nn.Module]
    masks: list[Optional[dict]]
    attn_scale: Optional[float]  # the universe's attention scale (mixed widths only)
    hetero: bool  # widths differ: models are padded and masked
    # keep_layernorm with mixed widths: the reflection each narrower padded model was turned by so that its
    # stream stays centred in the universe (``widths.ones_lift``); None for the others
    lifts: Optional[list[Optional[torch.Tensor]]] = None
    ff_lift: str = "zeros"  # mixed widths: how a narrower FF was lifted (``widths.pad``)
    head_lift: str = "zeros"  # ... and fewer heads
    excluded: dict[int, str] = field(default_factory=dict)  # model → why it was left out (unreadable, failed)
    passes: int = 0  # passes over the models so far (``in_turn``)

    @property
    def live(self) -> list[int]:
        return [i for i, w in enumerate(self.weights) if w > 0]

    def in_turn(self) -> list[int]:
        """The live models in the order of the next pass over them: each pass goes the opposite way to
        the one before, the first backwards (the replies were written first to last). A pass then starts
        with the files the one before touched last, which the page cache still holds where the M replies'
        files do not all fit in it (64 GPT-2-small replies are 42 GB); the weighted sums do not depend
        on the order beyond their float rounding."""
        self.passes += 1
        live = self.live
        return live[::-1] if self.passes % 2 else live

    def exclude(self, i: int, reason: str) -> None:
        """Leave model i out of the universe (its weight shared out among the others), with the reason."""
        self.excluded[i] = reason
        self.weights[i] = 0.0
        total = sum(self.weights)
        if total <= 0:
            raise ReplyError(f"every model of the universe was excluded; the last: {reason}")
        self.weights = [w / total for w in self.weights]
        log(WARNING, "universe: excluded model %d: %s", i, reason)

    def load(self, i: int) -> Optional[nn.Module]:
        """Model i in canonical (padded) form, or None after excluding it when its file cannot be read."""
        try:
            return self.padded[i]
        except ReplyError as e:
            self.exclude(i, str(e))
            return None

    def own(self, i: int, T: Transform) -> Transform:
        """Model i's transform as a map of its zero-padded self (its ones-lift composed in)."""
        U = self.lifts[i] if self.lifts is not None else None
        if U is None:
            return T
        R = T.get("residual")
        els = dict(T.elements)
        els["residual"] = U if R is None else R @ U.to(R)
        return Transform(els, dict(T.info), T.width_map)

    def aligned_masks(self, i: int, T: Transform) -> Optional[dict]:
        """Model i's real heads / FF neurons after its permutations, and the universe subspace its
        residual occupies (so every entry is averaged over the models that hold it)."""
        if self.masks[i] is None:
            return None
        out = permute_masks(self.masks[i], T)
        d_c = self.models[i].config.d_model
        if d_c < self.shape["d_model"]:
            out["residual"] = residual_projector(self.own(i, T), d_c, self.shape["d_model"])
        return out

    def merge(
        self, transforms: list[Transform], form: str = "factored", reduce: str = "average", trim: float = 0.2
    ) -> nn.Module:
        """The weighted average of the live models, each aligned by its transform (``reduce``: or their
        coordinate-wise median / trimmed mean, see ``averaging.robust_state``)."""
        live = self.live
        if reduce != "average":
            return robust_merge([apply_transform(self.padded[i], transforms[i]) for i in live], reduce, trim)
        if form == "factored" and not self.hetero:
            return self._streamed_average(transforms)
        aligned = [apply_transform(self.padded[i], transforms[i]) for i in live]
        return merge(
            aligned,
            [self.weights[i] for i in live],
            form=form,
            masks=[self.aligned_masks(i, transforms[i]) for i in live],
        )

    def _streamed_average(self, transforms: list[Transform]) -> nn.Module:
        """The plain weighted average, aligning one model at a time: the server holds the M models plus
        two (the running sum and one aligned model), not 2M (at gpt2-small size, 8 × 650 MB saved).
        Aligned state dicts are summed as they come, never built into models. The heap's freed pages go
        back to the kernel first: the retaining heap's holes from the matchings (or a refinement) would
        otherwise not fit these allocations and grow the peak (``allocator.release_freed_memory``)."""
        release_freed_memory()
        acc, first = RunningSum(), None
        for i in read_ahead(self.in_turn(), lambda j: self.models[j]):
            model = self.load(i)
            if model is None:  # unreadable now: the mean is over the others
                continue
            acc.add(aligned_state(model, transforms[i]), self.weights[i])
            first = model if first is None else first
            del model
        if first is None:
            raise ReplyError("no model of the universe could be read")
        return rebuild(first, acc.mean(), own=True)

    def client_transforms(self, transforms: list[Transform]) -> list[Transform]:
        """Each model's map from *its own* shape into the universe (a rectangular residual map for a
        narrower model; ``info`` records the shapes ``project`` needs)."""
        if not self.hetero:
            return transforms
        out = []
        for i, (m, T) in enumerate(zip(self.models, transforms)):
            if m.config.d_model != self.shape["d_model"]:
                T = lift_residual(self.own(i, T), m.config.d_model)
            out.append(
                Transform(
                    T.elements,
                    T.info,
                    WidthMap(dict(self.shape), self.attn_scale, m.config, self.ff_lift, self.head_lift),
                )
            )
        return out


@dataclass
class Aligned:
    """A universe and each model's transform into it, from an earlier ``universe_merge`` of the same
    models (of one shape, factored form): as ``universe_merge``'s ``start``, the merge skips its weight
    matching (a refinement starts from these transforms)."""

    universe: nn.Module
    transforms: list[Transform]


class ArrivingMean:
    """The replies' plain weighted mean in canonical form, summed as they arrive (while each is in memory
    anyway): a universe that starts at it (``universe_merge(start=...)``) needs no pass over the
    replies' files for its start. The sum is kept in float64, so the order the replies arrive in moves
    the mean by at most a float32 rounding; ``model_for`` gives the mean only for exactly the replies
    summed, with their weights (a reply excluded later needs the streamed mean of the others)."""

    def __init__(self) -> None:
        self.acc = RunningSum(torch.float64)
        self.weights: dict[str, float] = {}
        self.config = None
        self.dtypes: dict[str, torch.dtype] = {}
        self.broken = False  # a reply of another shape arrived: its mean would be a padded one
        self._model: Optional[nn.Module] = None

    def add(self, key: str, model: nn.Module, weight: float) -> None:
        """Add ``model`` (a reply, in memory) under ``key`` (its file) with ``weight``."""
        if self._model is not None or self.broken:
            self.broken = True  # a reply after the mean was taken: no mean to give
            return
        canon = canonical(model)
        if self.config is not None and not same_shape([self.config, canon.config]):
            self.broken = True  # another shape: no mean to give
            return
        state = aligned_state(canon, Transform())
        if self.config is None:
            self.config, self.dtypes = canon.config, {k: v.dtype for k, v in state.items()}
        self.acc.add(state, weight)
        self.weights[key] = weight

    def model_for(self, weights: dict[str, float]) -> Optional[nn.Module]:
        """The mean as a model, if ``weights`` (file → weight) are exactly the replies summed; else None."""
        if self.broken or not self.weights or weights != self.weights:
            return None
        if self._model is None:
            total, acc = self.acc.weight, self.acc.state
            # tensor by tensor, each float64 sum let go as it is converted: the peak stays the sum's
            state = {k: (acc.pop(k) / total).to(self.dtypes[k]) for k in list(acc)}
            self.acc.state = None
            with torch.device("meta"):
                model = from_config(self.config)
            model.load_state_dict(state, assign=True)
            model.mean_of = dict(weights)  # what it is the mean of: a universe starting at it knows (``_merge``)
            self._model = model.eval()
        return self._model


def members(
    models: Sequence[nn.Module],
    weights: Optional[Sequence[float]],
    start: Optional[nn.Module],
    keep_layernorm: bool,
    ff_lift: str = "zeros",
    head_lift: str = "zeros",
) -> Members:
    """Validate and prepare the models of a universe (see ``Members``)."""
    if not models:
        raise ValueError("universe_merge needs at least one model")
    n = len(models)
    w = [1.0 / n] * n if weights is None else [float(x) for x in weights]
    if len(w) != n or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weights must be {n} non-negative numbers with a positive sum, got {weights}")
    configs = [m.config for m in models] + ([start.config] if start is not None else [])
    shape = common_shape(configs)
    if same_shape(configs):
        return Members(models, [x / sum(w) for x in w], shape, Canonical(models), [None] * n, None, False)
    canon = [canonical(m.load() if isinstance(m, StoredModel) else m) for m in models]
    if any(getattr(c, "n_kv_head", None) is not None for c in configs):
        # zero-padding a rotary head changes which dimensions RoPE pairs; GQA groups need their own masks
        raise ValueError("mixed widths are not supported for Llama-style models (RoPE, grouped-query attention) yet")
    scale = next((c.attn_scale for c in configs if c.d_head == shape["d_head"]), shape["d_head"] ** -0.5)
    padded = [pad(m, shape, attn_scale=scale, ff_lift=ff_lift, head_lift=head_lift) for m in canon]
    lifts = None
    if keep_layernorm and len({c.d_model for c in configs}) > 1:  # keep every padded stream centred
        D = shape["d_model"]
        lifts = [ones_lift(m.config.d_model, D) if m.config.d_model < D else None for m in models]
        padded = [
            apply_transform(p, Transform({"residual": U.to(next(p.parameters()).dtype)})) if U is not None else p
            for p, U in zip(padded, lifts)
        ]
    return Members(
        models,
        [x / sum(w) for x in w],
        shape,
        padded,
        [unit_masks(m.config, shape, ff_lift=ff_lift, head_lift=head_lift) for m in models],
        scale,
        True,
        lifts,
        ff_lift,
        head_lift,
    )


def universe_merge(
    models: Sequence[Model],
    weights: Optional[Sequence[float]] = None,
    start: Union[nn.Module, str, Aligned, None] = None,
    *,
    matching: Optional[Matching] = None,
    refine: Optional[Refinement] = None,
    universe: Optional[Universe] = None,
    robust: Optional[Robust] = None,
    device: Optional[str] = None,
    progress: bool = False,
    scale: Optional[Scale] = None,
) -> tuple[nn.Module, list[Transform]]:
    """Merge M models in a shared "universe" (many-model weight matching), optionally refined.

    The universe starts as ``start`` or the anchor model. Every iteration aligns each model to it by
    weight matching (warm-started from the model's last transform), then sets it to the weighted mean of
    the aligned models, until it moves by less than ``universe.tol`` or ``universe.iterations`` are
    done. With ``refine``, every alignment is then learned by Dirichlet refinement.

    Models may differ in width (depth and architecture must agree): each is padded exactly into the
    largest shape, its padded units masked out of the averages, and its transform maps *its own* shape
    into the universe, so ``project(universe, T)`` returns a model of the client's shape. Models may wait
    on disk (``fedlmc.scale.replies.StoredModel``), read one at a time (memory-mapped) when needed. A model
    that cannot be read, or whose alignment fails in a worker twice, is excluded (its transform's
    ``info["excluded"]`` says why) and the others' weights are rescaled.

    Parameters
    ----------
    models : sequence of nn.Module or StoredModel
        The fedlmc models to merge.
    weights : sequence of float or None
        Non-negative merge weights (e.g. example counts); default uniform.
    start : nn.Module, "average", Aligned or None
        The model the universe starts from: a model (e.g. the previous global model); "average", the
        models' plain weighted mean (streamed: FedAvg's aggregate); an ``Aligned``, a universe these
        models are already aligned to (the iterations are skipped: e.g. a screen's weight-matched
        universe, refined when the screen excluded nobody), or None, the ``anchor``. For replies
        trained a little from one global model with ``Matching(min_gain=...)``, "average" ends the merge
        after one iteration: every reply keeps the identity, so the universe stays where it started.
    matching : Matching or None
        Weight matching's knobs; default ``Matching()``. ``matching.residual_data`` adds residual
        activations on a few batches to every residual step.
    refine : Refinement or None
        Dirichlet refinement after the iterations (on ``refine.data``: a data set, or the clients'
        losses, ``fedlmc.flower.on_clients.ClientLosses``); None: aligned only.
    universe : Universe or None
        The iterations, their stopping tolerance, the merge's form, the anchor and whether the merge is
        returned as a LayerNorm model (``fedlmc.options.Universe``; default ``Universe()``).
    robust : Robust or None
        ``Robust(reduce="median" / "trimmed")`` replaces every iteration's weighted mean by a
        coordinate-wise robust combination of the aligned models (unweighted, as Flower's FedMedian /
        FedTrimmedAvg): robust aggregation modulo the symmetries. Same-width models, factored form, no
        refinement.
    device : str or None
        Where matching and refinement run: CUDA when present, else CPU.
    progress : bool, default False
        Log each universe iteration (how far it moved, seconds). Without it, an iteration that takes
        more than ``PROGRESS_EVERY`` seconds (10) still logs how many models it has aligned every 10 s
        (aligning in this process) and its end.
    scale : Scale or None
        ``Scale(workers=n)`` aligns each iteration's models in ``n`` worker processes (or Ray tasks),
        the models read from their files there (models in memory are written to a temporary store
        first); default: one after the other, in this process. Same-shape models without
        ``matching.residual_data`` only (others align here).

    Returns
    -------
    merged : nn.Module
        The merged model in ``form``.
    transforms : list of Transform
        Each model's map into the universe.
    """
    m = matching if matching is not None else Matching()
    u = universe if universe is not None else Universe()
    r = robust if robust is not None else Robust()
    keep_layernorm = u.keep_layernorm and all(layernorm_native(x.config) for x in models)
    _check_options(refine, u, r, start, models)
    iterations, tol, form, anchor, reduce, trim = u.iterations, u.tol, u.form, u.anchor, r.reduce, r.trim
    mem, start, aligned = _members_for(models, weights, start, keep_layernorm, reduce, u.ff_lift, u.head_lift)
    align = dict(matching=m, keep_layernorm=keep_layernorm, device=device)
    sc = scale if scale is not None else Scale()
    if not _in_workers(sc, mem, m, aligned):
        with fitting_threads():  # no more torch threads than idle cores (a busy host)
            return _merge(
                mem, start, anchor, align, refine, iterations, tol, form, reduce, trim, progress, aligned=aligned
            )
    with ReplyStore(sc.spool_dir) as store, AlignmentPool(sc) as pool:
        mem = _on_disk(mem, models, store)  # the workers read the models from files
        return _merge(mem, start, anchor, align, refine, iterations, tol, form, reduce, trim, progress, pool, store)


def _in_workers(sc: Scale, mem: "Members", m: Matching, aligned) -> bool:
    """Whether worker processes align (same-shape models without residual data), said when they cannot."""
    parallel = sc.parallel and not mem.hetero and m.residual_data is None and aligned is None
    if sc.parallel and not parallel and aligned is None:
        log(INFO, "universe: aligning in this process (workers take same-shape models without residual data)")
    return parallel


def _on_disk(mem: "Members", models: Sequence, store: ReplyStore) -> "Members":
    """``mem`` with every model in memory written to ``store`` (the ones on disk already stay)."""
    if all(isinstance(x, StoredModel) for x in models):
        return mem
    on_disk = [x if isinstance(x, StoredModel) else store.put(x) for x in models]
    return Members(**{**mem.__dict__, "models": on_disk, "padded": Canonical(on_disk)})


def _members_for(
    models, weights, start, keep_layernorm: bool, reduce: str, ff_lift: str = "zeros", head_lift: str = "zeros"
):
    """``universe_merge``'s members, its start and, when the start is an ``Aligned``, the transforms
    the models already have into it (else None)."""
    aligned = None
    if isinstance(start, Aligned):
        if len(start.transforms) != len(models):
            raise ValueError(f"Aligned: one transform per model, got {len(start.transforms)} for {len(models)}")
        aligned, start = start.transforms, start.universe
    mem = members(models, weights, None if isinstance(start, str) else start, keep_layernorm, ff_lift, head_lift)
    if aligned is not None and mem.hetero:
        raise ValueError("Aligned: models of one shape (a mixed-width universe is padded anew)")
    if reduce != "average" and mem.hetero:
        raise ValueError("a robust reduce needs models of one shape (mixed widths are averaged over their holders)")
    return mem, start, aligned


def _check_options(refine: Optional[Refinement], u: Universe, r: Robust, start, models) -> None:
    """``universe_merge``'s clear errors for options that cannot go together (before any matching)."""
    if u.form == "circuit" and models:
        check_circuit(models[0].config)
    if refine is not None and refine.data is None:
        raise ValueError(
            "refine needs data for the Dirichlet refinement: Refinement(data=...), a data set at the server or "
            "the clients' losses (fedlmc.flower.on_clients.ClientLosses)"
        )
    if r.reduce != "average" and (refine is not None or u.form != "factored"):
        raise ValueError("a robust reduce combines aligned models coordinate-wise: factored form, no refinement")
    if isinstance(start, str):
        one_of(start, ("average",), "start")


def _merge(
    mem: Members,
    start: Union[nn.Module, str, None],
    anchor: str,
    align: dict,
    refine: Optional[Refinement],
    iterations: int,
    tol: float,
    form: str,
    reduce: str,
    trim: float,
    progress: bool,
    pool: Optional[AlignmentPool] = None,
    store: Optional[ReplyStore] = None,
    aligned: Optional[Sequence[Transform]] = None,
) -> tuple[nn.Module, list[Transform]]:
    """``universe_merge`` on prepared members (``align``: weight matching's options)."""
    keep_layernorm, first = align["keep_layernorm"], None
    mean = _is_mean(start, mem)
    if aligned is not None:  # already weight-matched into ``start``
        universe, transforms = canonical(start), list(aligned)
    elif isinstance(start, str):  # "average": the replies' plain weighted mean, streamed (in canonical form)
        universe = mem.merge([Transform() for _ in mem.models])
    elif start is not None:
        universe = (
            pad(start, mem.shape, attn_scale=mem.attn_scale, ff_lift=mem.ff_lift, head_lift=mem.head_lift)
            if mem.hetero
            else start
        )
    else:
        universe = None
        while universe is None:  # an anchor that cannot be read is excluded, and the next one taken
            first = anchor_index(mem, anchor, align)
            universe = mem.load(first)
    if aligned is None:
        universe, transforms = _iterate(
            canonical(universe), mem, iterations, tol, reduce, trim, progress, align, first, pool, store, mean
        )
    live = mem.live
    if refine is not None and len(live) > 1:
        refined = dirichlet_refine(
            [mem.padded[i] for i in live],
            [transforms[i] for i in live],
            refine,
            masks=[mem.masks[i] for i in live],
            weights=[mem.weights[i] for i in live],
            form=form,
            keep_layernorm=keep_layernorm,
            gauge=align["matching"].gauge,
            reference=universe,
            progress=progress,
            device=align["device"],
        )
        for i, T in zip(live, refined):
            transforms[i] = T
        universe = mem.merge(transforms)
    if form == "circuit":  # the last aligned models, merged as circuits
        universe = mem.merge(transforms, form="circuit")
    if keep_layernorm and reduce != "average":  # a median of centred streams is not centred: project it back
        universe = recentre(universe)
    for i, reason in mem.excluded.items():
        transforms[i] = Transform(info={"excluded": reason})
    return (to_layernorm(universe) if keep_layernorm else universe), mem.client_transforms(transforms)


def _is_mean(start: Union[nn.Module, str, None], mem: Members) -> bool:
    """Whether the universe starts at the live models' plain weighted mean, in canonical form: the
    streamed one (``start="average"``), or an ``ArrivingMean``'s of exactly these files and weights."""
    if mem.hetero:
        return False
    if isinstance(start, str):
        return True
    summed = getattr(start, "mean_of", None)
    if not summed or not all(isinstance(mem.models[i], StoredModel) for i in mem.live):
        return False
    total = sum(summed.values())
    ours = {mem.models[i].path: mem.weights[i] for i in mem.live}  # they sum to one
    return ours.keys() == summed.keys() and all(abs(w - summed[p] / total) <= 1e-12 for p, w in ours.items())


def anchor_index(mem: Members, anchor: str, align: dict) -> int:
    """The model a universe starts from: the heaviest, or the "central" one (least summed relative
    distance to the others, each weight-matched to it; ``align``: ``weight_matching``'s options)."""
    one_of(anchor, ANCHORS, "anchor")
    live = mem.live
    if anchor == "heaviest" or len(live) < 3:
        return max(range(len(mem.padded)), key=lambda i: mem.weights[i])
    dist = {i: 0.0 for i in live}
    for n, i in enumerate(live):
        for j in live[n + 1 :]:
            T = weight_matching(mem.padded[i], mem.padded[j], **align)
            d = _relative_change(mem.padded[i], apply_transform(mem.padded[j], T))
            dist[i] += d
            dist[j] += d
    return min(live, key=lambda i: dist[i])


def _iterate(
    universe: nn.Module,
    mem: Members,
    iterations: int,
    tol: float,
    reduce: str,
    trim: float,
    progress: bool,
    align: dict,
    first: Optional[int] = None,
    pool: Optional[AlignmentPool] = None,
    store: Optional[ReplyStore] = None,
    mean: bool = False,
) -> tuple[nn.Module, list[Transform]]:
    """Align every model to the universe, average there, repeat (the warm start is the last transform).
    ``first``: the model the universe started as (its first alignment is the identity, exactly);
    ``pool``: workers that align an iteration's models at once, reading the universe from ``store``;
    ``mean``: the universe starts at the models' plain weighted mean (``_is_mean``), so the first
    iteration sums only the models' moves (``averaging.add_move``) onto it: a model that keeps the
    identity is not summed, and when none moves the universe is left as it is."""
    transforms: list[Transform] = [Transform() for _ in mem.models]
    for it in range(max(1, iterations)):
        t0 = time.time()
        todo = [i for i in mem.live if not (it == 0 and i == first)]
        warm = {i: transforms[i] if it else None for i in todo}
        streamed = reduce == "average" and not mem.hetero  # align and sum each model in one visit
        moves = streamed and mean and it == 0
        excluded = len(mem.excluded)
        if pool is not None:
            path = save_model(store.path / f"universe-{it}.safetensors", universe).path
            tasks = [(i, mem.models[i], warm.get(i), mem.weights[i]) for i in mem.in_turn()]
            done, failed, acc = pool.align(path, tasks, align, first if it == 0 else None, mean=moves)
            for i, reason in sorted(failed.items()):
                mem.exclude(i, reason)
            for i, T in done.items():
                transforms[i] = T
        else:
            acc = _align_here(universe, mem, todo, warm, transforms, align, streamed, it + 1, moves)
        with section("universe averages"):
            if moves and len(mem.excluded) > excluded:  # the mean it started at holds a model now left out
                new = mem.merge(transforms)
            elif moves:
                new = universe if acc.state is None else rebuild(universe, _moved(universe, acc), own=True)
            else:
                new = (
                    rebuild(universe, acc.mean(), own=True)
                    if streamed
                    else mem.merge(transforms, reduce=reduce, trim=trim)
                )
            moved = 0.0 if new is universe else _relative_change(universe, new)
        universe = new
        if progress or time.time() - t0 > PROGRESS_EVERY:
            log(
                INFO,
                "universe iteration %d: %d models aligned, moved %.2e, %.1f s",
                it + 1,
                len(todo),
                moved,
                time.time() - t0,
            )
        if moved < tol:
            break
    for T in transforms:
        T.info["universe_iterations"] = it + 1
    return universe, transforms


def _align_here(
    universe: nn.Module,
    mem: Members,
    todo: list[int],
    warm: dict,
    transforms: list[Transform],
    align: dict,
    streamed: bool,
    iteration: int = 1,
    moves: bool = False,
) -> Optional[RunningSum]:
    """One iteration's alignments in this process, one model at a time (each read when its turn comes);
    ``streamed``: each aligned model is added to the returned weighted sum while it is at hand (``moves``:
    its move, ``averaging.add_move``). Every ``PROGRESS_EVERY`` seconds it logs how many of ``todo`` are
    aligned (universe iteration ``iteration``)."""
    residual_data = align["matching"].residual_data
    states = residual_states(universe, residual_data) if residual_data is not None else None
    reuse: dict = {}  # every model aligns to this universe: what matching computes from it alone is built once
    acc = RunningSum() if streamed else None
    weights = list(mem.weights)  # as they are now (an exclusion below rescales mem.weights; the mean divides)
    t0 = last = time.time()
    done = 0
    for i in read_ahead(mem.in_turn(), lambda j: mem.models[j]):  # the next file read while this one is aligned
        m = mem.load(i) if i in todo or streamed else None
        if m is None:
            continue
        if i in todo:
            acts = (
                residual_activation_cross(universe, m, residual_data, states_a=states) if states is not None else None
            )
            transforms[i] = weight_matching(universe, m, warm_start=warm[i], residual_acts=acts, reuse=reuse, **align)
            done += 1
            if time.time() - last > PROGRESS_EVERY and done < len(todo):
                last = time.time()
                log(
                    INFO,
                    "universe iteration %d: %d of %d models aligned, %.0f s",
                    iteration,
                    done,
                    len(todo),
                    last - t0,
                )
        if streamed:
            with section("universe averages"):
                if moves:
                    add_move(acc, m, transforms[i], weights[i])
                else:
                    acc.add(aligned_state(m, transforms[i]), weights[i])
        if isinstance(mem.padded, Canonical):  # aligned and summed (a copy): the next reply goes into its memory
            mem.padded.recycle(m)
        del m
    reuse.clear()
    if isinstance(mem.padded, Canonical):
        mem.padded.let_go()
    release_freed_memory()  # before the average, the merge's peak of memory
    return acc


def _moved(universe: nn.Module, acc: RunningSum) -> dict:
    """The universe plus the weighted sum of the models' moves (their weights sum to one), tensor by
    tensor, each sum let go as it is used."""
    sd, moves = universe.state_dict(), acc.state
    acc.state = None
    return {k: sd[k].detach() + moves.pop(k).to(sd[k].dtype) for k in list(moves)}


def _relative_change(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    num = sum(float((sa[k] - sb[k]).pow(2).sum()) for k in sa)
    den = sum(float(sa[k].pow(2).sum()) for k in sa)
    return (num / max(den, 1e-30)) ** 0.5


def project(universe: nn.Module, transform: Transform) -> nn.Module:
    """A client's own-width model from the universe: the inverse of the client's transform into it.

    ``transform`` maps the client (width d_c) into the universe (width d_u ≥ d_c); its residual element
    is ``d_u × d_c`` with orthonormal columns, so the projection is its transpose (and every other group
    is inverted too, returning the client's own unit order). A transform from a mixed-width
    ``universe_merge`` also records the client's shape: padded heads and FF neurons are dropped.
    Exact on a lifted model.
    """
    wm = transform.width_map
    if wm is not None and universe.config.d_head != wm.shape["d_head"]:
        raise ValueError("project needs the universe in the factored form (a circuit merge changed the head width)")
    out = apply_transform(universe, invert_transform(transform, spec_for(universe))) if transform.elements else universe
    return unpad(out, wm.client, wm.ff_lift, wm.head_lift) if wm is not None else out
