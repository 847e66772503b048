"""The knobs that travel together, one object each, with their defaults defined once.

* ``Matching``: how weight matching aligns one model to another (``matching.weight_matching``, every
  universe iteration, the strategies).
* ``Learning``: how the shared optimiser learns alignments (``matching.learned_matching``).
* ``Refinement``: Dirichlet refinement of a universe's alignments: ``Learning`` plus its data, its
  Dirichlet concentration and when it stops (``universe_merge(refine=...)``, ``RefinedFedAvg``,
  ``HeteroWidthFedAvg``).
* ``OnClients``: where a refinement's gradients and a guard's losses come from without server data.
* ``Universe``: where a round's universe starts, how long it iterates, the merge's form.
* ``Guard``: the do-no-harm comparison of the aligned aggregate with the plain one.
* ``Robust``: the coordinate-wise combination (mean, median, trimmed mean).
* ``Checks``: what a round accepts: how many valid replies, how large a reply's weights.
* ``Report``: the opt-in per-round scoring of every reply and candidate on a data set.
* ``Scale``: how a server aggregates many replies: on disk, aligned by parallel workers, where, on how
  many threads.
* ``Screen``: which replies a round leaves out as outliers once they are aligned.
* ``Distill``: ensemble distillation of a round's aggregate onto its replies' outputs on server data
  (``fedlmc.merging.distill``, ``DistilledFedAvg``).

The peers' options live with their strategies (``fedlmc.baselines``: ``OTFusion``, ``TaskMerge``).

A knob has one name from ``run_config`` down to the optimiser: run_config ``refine-check-sigmas`` is
``Settings.refine_check_sigmas`` is ``Refinement.check_sigmas``, the one the optimiser reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

RESIDUALS = ("orthogonal", "permutation")
GAUGES = ("orthogonal", "invertible", None)
PRECISIONS = ("auto", "exact", "bfloat16", "int8")
SCHEDULES = ("constant", "cosine")
RELAXATIONS = ("ste", "sinkhorn")
UNIVERSE_STARTS = ("previous", "average")  # Universe.start: the previous global model, or the replies' mean
FF_LIFTS = ("zeros", "split")  # how a narrower FF enters a wider universe (Universe.ff_lift)
FORMS = ("factored", "circuit")
REDUCES = ("average", "median", "trimmed")
ANCHORS = ("heaviest", "central")
DISTILL_STUDENTS = ("average", "merge")  # Distill.student: FedAvg's mean (FedDF), or the strategy's own merge
UNCONFIRMED = ("warn", "error")  # what a round does whose clients did not run the method's client code
TEACHERS = ("logits", "probabilities")  # Distill.teacher: the replies' mean logits (FedDF) or probabilities


def one_of(value: Any, allowed: Iterable[Any], what: str) -> Any:
    """``value`` if it is one of ``allowed``, else a ``ValueError`` that lists the choices."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(map(repr, allowed))}")
    return value


@dataclass(frozen=True)
class Matching:
    """How weight matching aligns a model B to a model A, without data.

    Parameters
    ----------
    residual : {"orthogonal", "permutation"}, default "orthogonal"
        The residual stream's group: any orthogonal map (the paper), or permutations only (the Git
        Re-Basin / FedMA-style baseline).
    gauge : {"orthogonal", "invertible", None}, default "orthogonal"
        How the intra-head QK / OV gauges are aligned (the factored merge needs them): Procrustes, least
        squares (recovers any invertible gauge), or not at all.
    descent_iterations : int, default 15
        At most this many coordinate-descent iterations of one alignment (a universe's own iterations
        are ``Universe.iterations``).
    descent_tol : float, default 2e-3
        A descent stops when an iteration improves its objective by less than this (relative).
    keep_identity : bool, default True
        Also score the identity transform (plain averaging) and return it when the descent found nothing
        better: the do-no-harm candidate for models that share an initialisation.
    min_gain : float, default 0.0
        With ``keep_identity``: return the identity unless the descent lowers the objective (the
        relative distance to A) by more than this fraction of the identity's. A client trained a little
        from the global model is already aligned to it, and the continuous maps then fit only its noise:
        ``min_gain=0.1`` returns the identity for it (nothing to apply, and a universe of such replies
        stops after its second iteration), and still aligns models that started apart (their alignment
        removes a large part of the distance). What the continuous maps gain on noise alone grows as
        the model shrinks: a few per cent of the distance at GPT-2-small size, about 20 % at d 32.
        The descent stops early once an iteration leaves every permutation as it was and has gained
        less than half of ``min_gain`` (``info["gave_up"]``): the identity is kept without the
        iterations that would only refine the noise's fit.
    ff_candidates : int or None, default 64
        FF groups of more than 4 × ``ff_candidates`` (and 2048) neurons are assigned on each neuron's
        ``ff_candidates`` best partners (a sparse assignment); None solves every group densely.
    precision : {"auto", "exact", "bfloat16", "int8"}, default "auto"
        The dtype of the large per-iteration products of float32 problems on the CPU. "auto": bfloat16
        factors on CPUs with native bfloat16 dot products; else, on CPUs with native int8 dot products
        (AVX512-VNNI, AVX-VNNI), the FF similarity scores as int8 products of row-scaled codes; else
        exact. "exact", "bfloat16", "int8": always that (int8 on the CPU only; GPUs compute exactly).
    dtype : torch.dtype or None, default None
        The problem's dtype: None picks float64 below 20M parameters, float32 above.
    residual_data : data set or None, default None
        A few batches whose residual-stream activations join the residual map's objective (the
        data-light residual option, ``activation.residual_activation_cross``); universe merges only.
    ff_scale : bool, default False
        Also solve each FF neuron's scale where the nonlinearity allows one (ReLU: positive; SwiGLU's
        ``up``: signed; the ``ffscale.{l}`` groups), in closed form after the descent, then descend once
        more on the rescaled model and solve the scales again (``fedlmc.matching.scales``). Models
        without such groups (GELU) are matched as without it.
    """

    residual: str = "orthogonal"
    gauge: Optional[str] = "orthogonal"
    descent_iterations: int = 15
    descent_tol: float = 2e-3
    keep_identity: bool = True
    min_gain: float = 0.0
    ff_candidates: Optional[int] = 64
    precision: str = "auto"
    dtype: Optional[torch.dtype] = None
    residual_data: Any = None
    ff_scale: bool = False

    def __post_init__(self) -> None:
        one_of(self.residual, RESIDUALS, "residual")
        one_of(self.gauge, GAUGES, "gauge")
        one_of(self.precision, PRECISIONS, "precision")
        if self.descent_iterations < 1:
            raise ValueError(f"descent_iterations must be at least 1, got {self.descent_iterations}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain is a fraction of the identity's objective in [0, 1), got {self.min_gain}")


@dataclass(frozen=True)
class Learning:
    """How the shared optimiser learns alignments (learned matching; ``Refinement`` extends it).

    Parameters
    ----------
    steps : int, default 300
        At most this many optimiser steps.
    lr : float, default 1e-3
        The residual latents' learning rate (Adam).
    perm_lr : float, default 0.05
        The permutation latents' learning rate: they start as 0/1 matrices, so a permutation changes
        once a latent moves by about one.
    batch_size : int, default 64
    seed : int, default 0
        Seeds the batch order and the sampled merge weights.
    schedule : {"constant", "cosine"}, default "constant"
        "cosine" decays both learning rates to 0 over ``steps``.
    relax : {"ste", "sinkhorn"}, default "ste"
        Permutations in the forward pass: hard, with a straight-through gradient, or soft
        (``sinkhorn(latent / tau)``). The result is the latents' hard assignment either way.
    tau : float, default 0.1
        The Sinkhorn temperature.
    loss_fn : callable or None, default None
        ``loss_fn(outputs, targets) -> loss`` instead of cross-entropy.
    check_every : int, default 0
        Stop on the objective: every ``check_every`` steps (and at the start) the merge at the models'
        weights is scored, without gradient, on the first ``check_batches`` batches of the check data;
        the best alignment scored is returned. 0: never, run every step and return the last.
    check_batches : int, default 4
    patience : int, default 2
        Stop after this many checks in a row that did not improve on the best.
    check_sigmas : float, default 2.0
        A check improves when its loss is lower by more than this many standard errors of the paired
        per-example difference (0: lower at all).
    """

    steps: int = 300
    lr: float = 1e-3
    perm_lr: float = 0.05
    batch_size: int = 64
    seed: int = 0
    schedule: str = "constant"
    relax: str = "ste"
    tau: float = 0.1
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    check_every: int = 0
    check_batches: int = 4
    patience: int = 2
    check_sigmas: float = 2.0

    def __post_init__(self) -> None:
        one_of(self.schedule, SCHEDULES, "schedule")
        one_of(self.relax, RELAXATIONS, "relax")
        if self.steps < 0 or self.check_every < 0:
            raise ValueError(f"steps and check_every must be non-negative, got {self.steps} and {self.check_every}")


@dataclass(frozen=True)
class Refinement(Learning):
    """Dirichlet refinement of a universe: every model's alignment learned so that merges at weights
    λ ~ Dirichlet(α·1) have low loss on ``data``. ``Learning``'s parameters, with these defaults:
    at most 100 steps, stopping on the objective every 10 steps.

    Parameters
    ----------
    data : data set or None, default None
        What the refinement learns on: anything with fedlmc's ``batches(batch_size, shuffle, generator)``
        (``fedlmc.data.ArrayData(x, y)`` wraps tensors). The strategies split off its last quarter for
        the checks (``check_data``) when they can. Or the clients' losses
        (``fedlmc.flower.on_clients.ClientLosses``, set by ``RefinedFedAvg(on_clients=...)``): the gradients and
        the checks' losses come from the clients.
    alpha : float, default 1.0
        The Dirichlet concentration: α = 1 samples the whole simplex of merges evenly.
    check_data : data set or None, default None
        Held-out batches the checks score (default: ``data``; held out, the checks do not reward
        overfitting the descent's batches).
    """

    steps: int = 100
    check_every: int = 10
    data: Any = None
    alpha: float = 1.0
    check_data: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alpha <= 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")


@dataclass(frozen=True)
class OnClients:
    """Where a refinement's gradients and a guard's losses come from when the server holds no data: a
    sample of the round's clients, through Flower messages (``fedlmc.flower.on_clients``).

    Each refinement step sends the merged model at ``samples_per_message`` draws of λ to
    ``clients_per_step`` of the round's clients; each answers with the gradient of its loss on
    ``batches_per_client`` local batches, its loss and its example count. The checks of the
    objective and the guard ask ``check_clients`` clients for their held-out losses.

    Parameters
    ----------
    clients_per_step : int, default 4
        Clients asked for gradients at each step (a new sample every step); 0: every client of the round.
    batches_per_client : int, default 1
        Local batches (of the refinement's ``batch_size``) each client's gradient averages over.
    samples_per_message : int, default 1
        Draws of the merge weights λ per message: the client answers one gradient per draw, and the
        step descends on their mean (fewer round trips for the same number of draws).
    check_clients : int, default 0
        Clients that score the checks of the objective and the guard's candidates (always the same
        ones in a round, so the checks are paired); 0: every client of the round.
    min_clients : int, default 1
        Fewest valid answers a step (or a check) needs; with fewer the refinement stops and keeps the
        best alignment checked so far.
    timeout : float, default 300.0
        Seconds a step's (or a check's) messages may take.
    loss_key : str, default "eval-loss"
        The metric that holds the loss in an evaluate reply (the guard reuses the ClientApp's evaluate).
    guard : bool, default True
        With no server-side guard: whether the clients score the do-no-harm guard's candidates.
    unconfirmed : {"warn", "error"}, default "warn"
        What a query or a guard that every asked client answered without the method's result does (their
        ClientApp lacks the client code it needs): warn, naming that code, and go on without it (the
        refinement keeps the best alignment, the guard gives no verdict), or raise.
    """

    clients_per_step: int = 4
    batches_per_client: int = 1
    samples_per_message: int = 1
    check_clients: int = 0
    min_clients: int = 1
    timeout: float = 300.0
    loss_key: str = "eval-loss"
    guard: bool = True
    unconfirmed: str = "warn"

    def __post_init__(self) -> None:
        one_of(self.unconfirmed, UNCONFIRMED, "unconfirmed")
        if min(self.clients_per_step, self.check_clients) < 0:
            raise ValueError("clients_per_step and check_clients must be non-negative (0: every client)")
        if min(self.batches_per_client, self.samples_per_message, self.min_clients) < 1:
            raise ValueError("batches_per_client, samples_per_message and min_clients must be at least 1")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")


BACKENDS = ("auto", "process", "ray")


@dataclass(frozen=True)
class Scale:
    """How a server aggregates many replies: where they wait, and who aligns them.

    Parameters
    ----------
    workers : int, default 1
        Processes that align a universe iteration's replies at once (``fedlmc.scale.workers``); 1: in the
        server's own process, one after the other; 0: one per available core.
    backend : {"auto", "process", "ray"}, default "auto"
        "process": local worker processes; "ray": Ray tasks (on the cluster at ``ray_address``, or a
        local Ray); "auto": Ray when ``ray_address`` is given, else processes.
    ray_address : str or None, default None
        A Ray cluster's address (``"auto"``, ``"ray://host:10001"``): the alignments spread over its
        machines (``spool_dir`` must then be storage every node reads at the same path).
    spool : bool, default False
        Write every accepted reply to disk (``replies.ReplyStore``) and read it back through a memory map
        when needed, so the server holds a few models whatever the number of replies. Always on with
        more than one worker.
    spool_dir : str or None, default None
        Where the replies wait (a local disk with room for every reply of a round); default: the system's
        temporary directory. Removed after each round; a crashed server's files are removed by the next.
    retries : int, default 1
        A failed alignment (its worker died, or its reply could not be read) is tried this many times
        more, then its reply is excluded with the reason.
    threads : int or None, default None
        Torch threads while a round is combined: None leaves the process's setting alone, 0 uses every
        core (on a busy shared host, extra OpenMP threads can thrash instead).
    device : str or None, default None
        Where the server aligns and refines: CUDA when present, else the CPU.
    """

    workers: int = 1
    backend: str = "auto"
    ray_address: Optional[str] = None
    spool: bool = False
    spool_dir: Optional[str] = None
    retries: int = 1
    threads: Optional[int] = None
    device: Optional[str] = None

    def __post_init__(self) -> None:
        one_of(self.backend, BACKENDS, "backend")
        if self.workers < 0 or self.retries < 0:
            raise ValueError(f"workers and retries must be non-negative, got {self.workers} and {self.retries}")
        if self.threads is not None and self.threads < 0:
            raise ValueError(f"threads must be non-negative (0: every core) or None, got {self.threads}")

    @property
    def parallel(self) -> bool:
        return self.workers != 1

    @property
    def on_disk(self) -> bool:
        return self.spool or self.parallel


SCREENS = ("distance", "loss", "agreement", "information", "krum")
PREDICTION_SCREENS = ("agreement", "information")  # the screens that score replies by their predictions
RAW_SCREENS = ("loss", *PREDICTION_SCREENS)  # the screens that score replies as they came (no alignment)


@dataclass(frozen=True)
class Screen:
    """Which replies to leave out of a round because they are outliers once aligned (``fedlmc.merging.screen``).

    After alignment every reply lives in the universe's coordinates, so distances between replies
    measure how differently they compute, not how differently their neurons happen to be ordered.

    Parameters
    ----------
    method : {"distance", "loss", "agreement", "information", "krum"}, default "distance"
        "distance": a robust z-score of each reply's distance to the coordinate-wise median of the
        aligned replies; replies above ``threshold`` are excluded (none, in a federation of honest
        clients). "loss": the same robust z-score on each reply's loss on the guard's held-out data
        (the strategy's ``Guard``, its data or its function; a loss does not depend on how the reply's
        neurons are arranged, so it needs no alignment). "agreement": the same robust z-score on how
        often each reply's top-1 prediction agrees with the others' on the guard's inputs (its labels
        are not read; ``Guard(data=...)`` required), a reply that agrees least being the outlier.
        "information": the same on each reply's mean chance-adjusted normalised mutual information
        with the others' top-1 predictions (``Guard(data=...)`` required): an honest client trained on
        skewed labels may name a class wrongly, but it still sorts the inputs as the others do, and
        the reply whose predictions tell least about the others' is the outlier. "krum":
        Krum's score (the summed squared distances to each reply's M − f − 2 nearest aligned replies)
        and the ``malicious`` highest scores excluded (Multi-Krum's selection).
    threshold : float, default 3.0
        "distance" / "loss" / "agreement" / "information": exclude a reply whose distance (loss)
        exceeds the median, or whose agreement (information) falls below it, by this many robust
        standard deviations (1.4826 × the median absolute deviation, at least 10 % of the median).
    malicious : int, default 1
        "krum": f, the number of poisoned clients assumed (and excluded every round).
    """

    method: str = "distance"
    threshold: float = 3.0
    malicious: int = 1

    def __post_init__(self) -> None:
        one_of(self.method, SCREENS, "screen method")
        if not self.threshold > 0 or self.malicious < 0:
            raise ValueError(
                f"threshold must be positive and malicious non-negative, got {self.threshold}, {self.malicious}"
            )


@dataclass(frozen=True)
class Universe:
    """How a round's replies are merged in a shared universe (``universe.universe_merge``,
    ``AlignedFedAvg``, ``RefinedFedAvg``).

    Parameters
    ----------
    iterations : int, default 3
        At most this many universe iterations (each aligns every reply to the universe, then averages).
    tol : float, default 1e-4
        Stop once an iteration moves the universe by less than this (relative Frobenius change).
    start : {"previous", "average"}, default "previous"
        A strategy's universe, when the replies were trained from the previous global model: that
        model, or the replies' plain weighted mean (FedAvg's aggregate). With ``Matching(min_gain=...)``
        and replies trained a little from the global model, "average" settles the round in one iteration
        instead of two. (``universe_merge`` takes its start as an argument.)
    form : {"factored", "circuit"}, default "factored"
        The merge's form: factored (the clients' shape) or circuit (QK / OV products).
    anchor : {"heaviest", "central"}, default "heaviest"
        With nothing to start from: the largest-weight model, or the one closest to all others after
        pairwise weight matching (M(M−1)/2 extra matchings).
    keep_layernorm : bool, default True
        Keep every residual map O·1 = 1 and return a LayerNorm model, as the clients train it
        (LayerNorm models only: an RMSNorm model such as Llama has no centring to keep). False returns
        the canonical RMSNorm form, with the residual map free.
    ff_lift : {"zeros", "split"}, default "zeros"
        Mixed widths: a narrower FF enters the universe with zero neurons (masked out of the averages),
        or with its own neurons split over the extra units (a semi-permutation, exact; nothing masked).
    head_lift : {"zeros", "split"}, default "zeros"
        Mixed head counts: fewer heads enter with zero heads (masked), or with their own heads split
        over the extra ones (each copy keeps the QK circuit and carries a share of the OV circuit; exact).
    """

    iterations: int = 3
    tol: float = 1e-4
    start: str = "previous"
    form: str = "factored"
    anchor: str = "heaviest"
    keep_layernorm: bool = True
    ff_lift: str = "zeros"
    head_lift: str = "zeros"

    def __post_init__(self) -> None:
        one_of(self.ff_lift, FF_LIFTS, "ff lift")
        one_of(self.head_lift, FF_LIFTS, "head lift")
        one_of(self.start, UNIVERSE_STARTS, "universe start")
        one_of(self.form, FORMS, "form")
        one_of(self.anchor, ANCHORS, "anchor")
        if self.iterations < 1:
            raise ValueError(f"iterations must be at least 1, got {self.iterations}")


@dataclass(frozen=True)
class Guard:
    """The do-no-harm guard: the aligned aggregate is kept only if it scores no worse than the plain one.

    Parameters
    ----------
    data : data set or None, default None
        A server-side data set (e.g. half a validation split) both candidates are scored on.
    batches : int or None, default 8
        How many batches of ``data`` to score (None: all).
    fn : callable or None, default None
        Instead of ``data``: ``fn(arrays) -> float``, the loss of an ArrayRecord in the clients' own form,
        lower is better (Flower's ``evaluate_fn`` convention).
    """

    data: Any = None
    batches: Optional[int] = 8
    fn: Optional[Callable[[Any], float]] = None

    def __post_init__(self) -> None:
        if self.fn is not None and self.data is not None:
            raise ValueError("Guard takes data or fn, not both")
        if self.fn is None and self.data is None:
            raise ValueError("Guard needs data (a server-side data set) or fn (a loss of the clients' arrays)")


@dataclass(frozen=True)
class Robust:
    """How aligned (or raw) replies are combined coordinate-wise.

    Parameters
    ----------
    reduce : {"average", "median", "trimmed"}, default "average"
        The weighted mean (FedAvg), or the unweighted coordinate-wise median / trimmed mean (Flower's
        FedMedian / FedTrimmedAvg; among aligned replies: robust aggregation modulo the symmetries).
    trim : float, default 0.2
        "trimmed": the fraction cut at each end of every coordinate.
    """

    reduce: str = "average"
    trim: float = 0.2

    def __post_init__(self) -> None:
        one_of(self.reduce, REDUCES, "reduce")
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"trim is the fraction cut at each end, in [0, 0.5), got {self.trim}")


@dataclass(frozen=True)
class Report:
    """An opt-in record, every round, of each reply's, the plain average's and the aggregate's loss.

    Parameters
    ----------
    data : data set
        What they are scored on (e.g. the test split).
    batches : int or None, default None
        How many batches to score (None: all).
    """

    data: Any
    batches: Optional[int] = None


@dataclass(frozen=True)
class Checks:
    """What a strategy's round accepts, beyond a reply's own validity (``strategies.validation``).

    Parameters
    ----------
    min_replies : int, default 1
        Fewest valid replies a round aggregates; with fewer, the previous global model is kept.
    max_norm_ratio : float, default 100.0
        A reply whose weight norm exceeds this multiple of the global model's is excluded.
    """

    min_replies: int = 1
    max_norm_ratio: float = 100.0

    def __post_init__(self) -> None:
        if self.min_replies < 1 or not self.max_norm_ratio > 0:
            raise ValueError(
                f"min_replies must be at least 1 and max_norm_ratio positive, got {self.min_replies}, "
                f"{self.max_norm_ratio}"
            )


@dataclass(frozen=True)
class Distill:
    """Ensemble distillation (FedDF: Lin et al., NeurIPS 2020): a round's aggregate is trained on
    unlabelled server data toward the output ensemble of the replies it was built from.

    Parameters
    ----------
    data : data set or None, default None
        What the student is distilled on (labels are not read); the strategies split off its last
        quarter for the checks, as the refinement's (``check_data``).
    check_data : data set or None, default None
        Held-out batches the checks score (default: ``data``).
    student : {"average", "merge"}, default "merge"
        Where the student starts: the replies' plain weighted mean (FedDF), or the strategy's own
        aggregate (the aligned or refined merge).
    refine : Refinement or None, default None
        With ``student="merge"``: refine the aligned merge on this first (``RefinedFedAvg``'s refinement);
        None distils from the weight-matched merge.
    steps : int, default 100
        At most this many Adam steps on the student's weights (the refinement's budget).
    lr : float, default 3e-4
        Adam's learning rate on the weights.
    temperature : float, default 1.0
        The softmax temperature of teacher and student (the loss is scaled by its square).
    teacher : {"logits", "probabilities"}, default "logits"
        The ensemble: the replies' mean logits (FedDF's) or their mean probabilities (the output
        ensemble the results tables report).
    batch_size : int, default 64
    seed : int, default 0
        Seeds the batch order.
    check_every : int, default 10
        Every this many steps (and at the start) the student's loss to the ensemble is scored on the
        first ``check_batches`` batches of the check data; the best student scored is returned (the start
        included). 0: never, the last is returned.
    check_batches : int, default 4
    patience : int, default 2
        Stop after this many checks in a row that did not improve on the best.
    """

    data: Any = None
    check_data: Any = None
    student: str = "merge"
    refine: Optional[Refinement] = None
    steps: int = 100
    lr: float = 3e-4
    temperature: float = 1.0
    teacher: str = "logits"
    batch_size: int = 64
    seed: int = 0
    check_every: int = 10
    check_batches: int = 4
    patience: int = 2

    def __post_init__(self) -> None:
        one_of(self.student, DISTILL_STUDENTS, "distillation student")
        one_of(self.teacher, TEACHERS, "teacher")
        if self.steps < 0 or self.check_every < 0 or self.temperature <= 0 or self.lr <= 0:
            raise ValueError(
                "Distill needs steps, check_every >= 0 and temperature, lr > 0: got "
                f"{self.steps}, {self.check_every}, {self.temperature}, {self.lr}"
            )
        if self.refine is not None and self.student != "merge":
            raise ValueError("Distill(refine=...) refines the merge the student starts from: student must be 'merge'")
