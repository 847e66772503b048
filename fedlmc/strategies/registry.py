"""The strategies a ``run_config`` can name: one registration each, read by everything that lists,
checks or builds them.

A registration maps the name (run_config ``strategy``) to a builder and to what the strategy accepts.
``fedlmc.federated.Settings.validate`` checks a run's keys against these capabilities, the apps' factory
(``strategies/factory.py``) calls the builder, the comparison runner (``simulations.compare``) checks its
strategy lists here, ``fedlmc strategies`` prints the table, and docs/strategies.md's table is generated
from it (``python -m bench.tables``). Adding a strategy is its class plus one ``register`` call::

    from fedlmc.strategies import register

    @register("my-fedavg", summary="FedAvg with my twist", reduce=True)
    def _my_fedavg(b):
        return MyFedAvg(**b.common(), **b.robust())

A builder takes a ``Build`` (the run's settings, the global model's config, the data splits and the
clients' model when it is not a fedlmc one) and returns the Flower strategy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from fedlmc.data import split
from fedlmc.options import (
    FF_LIFTS,
    OT_COSTS,
    Distill,
    Guard,
    Matching,
    OnClients,
    OTFusion,
    Report,
    Robust,
    TaskMerge,
    Universe,
)
from fedlmc.scaffold import VARIATES

from .aligned import AlignedFedAvg, RefinedFedAvg
from .distilled import DistilledFedAvg
from .fedavg import FedProxFedAvg, KrumFedAvg, ReportingFedAvg, ScaffoldFedAvg, ServerOptFedAvg, TaskVectorFedAvg
from .fusion import OTFusionFedAvg
from .hetero import HeteroWidthFedAvg, SlicingFedAvg
from .keys import Key


@dataclass(frozen=True)
class Capabilities:
    """What a registered strategy accepts beyond Flower's FedAvg's own parameters.

    Parameters
    ----------
    server_data : bool, default False
        It can learn or guard on the server's held-out data (the guard, a refinement on the server).
    on_clients : bool, default False
        Its refinement and guard run on the clients (no server data).
    reduce : bool, default False
        It takes ``reduce`` median / trimmed (robust aggregation).
    screen : bool, default False
        It can screen its replies (``screen``) once they are aligned.
    universe : bool, default False
        It merges in a universe whose start can be chosen (``universe-start``).
    mixed_widths : bool, default False
        It aggregates clients of several widths (``width-factors``); the others need one width.
    """

    server_data: bool = False
    on_clients: bool = False
    reduce: bool = False
    screen: bool = False
    universe: bool = False
    mixed_widths: bool = False


@dataclass(frozen=True)
class Registered:
    """One registration: the run_config name, a one-line summary, the builder, the capabilities, the
    constructor call that builds the strategy in a Flower app of one's own (``example``: runs with
    ``model`` the clients' model or its config, ``data`` a small data set at the server, ``peft_model``
    a PEFT model; the suite executes every one) and the client code the method needs (``client``: ""
    when an unchanged Flower ClientApp will do)."""

    name: str
    summary: str
    build: Callable[["Build"], Any]
    can: Capabilities
    example: str = ""
    client: str = ""
    keys: tuple[Key, ...] = ()


REGISTRY: dict[str, Registered] = {}


def register(
    name: str,
    *,
    summary: str,
    example: str = "",
    client: str = "",
    keys: tuple[Key, ...] = (),
    override: bool = False,
    **capabilities: bool,
):
    """Register the decorated builder under run_config name ``name`` (a clear error if it is taken,
    unless ``override``); ``example``: the constructor call a Flower app of one's own writes (see
    ``Registered``); ``client``: the client code the method needs ("": none); ``keys``: the run_config
    keys it owns (``Key``: one name, one meaning: a name two registrations use is the same ``Key``);
    ``capabilities`` are ``Capabilities``' fields."""

    def decorate(build: Callable[["Build"], Any]) -> Callable[["Build"], Any]:
        if name in REGISTRY and not override:
            raise ValueError(f"strategy {name!r} is registered already; pass override=True to replace it")
        if not name or "," in name or "@" in name or "+" in name:
            raise ValueError(f"a strategy's name has no ',', '@' or '+' (the runners' separators): {name!r}")
        for key in keys:
            owned = declared(key.name)
            if owned is not None and owned != key:
                raise ValueError(f"run_config key {key.name!r} is declared already, with another meaning: {owned}")
            if key.name in RUN_KEYS:
                raise ValueError(
                    f"run_config key {key.name!r} is one of the run's own keys (fedlmc.federated.Settings)"
                )
        REGISTRY[name] = Registered(name, summary, build, Capabilities(**capabilities), example, client, tuple(keys))
        return build

    return decorate


# the run's own keys (``fedlmc.federated.Settings``' fields), which no strategy may declare again
RUN_KEYS: set[str] = set()


def declared(name: str) -> Optional[Key]:
    """The registered strategies' key named ``name`` (None: no strategy declares it)."""
    for r in REGISTRY.values():
        for key in r.keys:
            if key.name == name:
                return key
    return None


def owners(name: str) -> list[str]:
    """The registered strategies that own run_config key ``name``."""
    return [r.name for r in REGISTRY.values() if any(k.name == name for k in r.keys)]


def all_keys() -> dict[str, Key]:
    """Every registered strategy's keys, by name, in registration order."""
    out: dict[str, Key] = {}
    for r in REGISTRY.values():
        for key in r.keys:
            out.setdefault(key.name, key)
    return out


def unregister(name: str) -> None:
    """Remove a registration (a test's, or one a user replaces)."""
    REGISTRY.pop(name, None)


def registered(name: str) -> Registered:
    """The registration of ``name``, or a ``ValueError`` that lists every registered name."""
    if name not in REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(map(repr, REGISTRY))}")
    return REGISTRY[name]


def names(**capabilities: bool) -> list[str]:
    """The registered names, in registration order, that have every capability given as True."""
    return [n for n, r in REGISTRY.items() if all(getattr(r.can, k) == v for k, v in capabilities.items())]


@dataclass
class Build:
    """What a builder gets: the run's ``Settings``, the global fedlmc model's config, the data splits and
    the clients' model when it is not a fedlmc one (a Hugging Face twin). Its methods turn the settings
    into the strategies' parameters, each option object built in one place."""

    settings: Any
    model_config: Any
    splits: Any
    model: Any = None

    def common(self) -> dict[str, Any]:
        """Flower's FedAvg parameters and fedlmc's base ones (the model, the report)."""
        s = self.settings
        out: dict[str, Any] = dict(
            fraction_train=s.fraction_train,
            fraction_evaluate=s.fraction_evaluate,
            min_train_nodes=s.min_nodes,
            min_available_nodes=s.min_nodes,
            min_evaluate_nodes=s.min_nodes if s.fraction_evaluate > 0 else 0,
            model=self.model if self.model is not None else self.model_config,
            scale=s.scale(),
        )
        report = s.report_data(self.splits)
        if report is not None:
            out.update(report=Report(report, batches=s.eval_batches or None))
        return out

    def on_clients(self) -> OnClients:
        """Where the refinement's gradients and the guard's losses come from (the ``*-clients`` strategies'
        keys; a strategy that does not own one gets its default)."""
        s = self.settings
        return OnClients(
            clients_per_step=s.key("clients-per-step"),
            batches_per_client=s.key("batches-per-client"),
            samples_per_message=s.key("samples-per-message"),
            check_clients=s.key("check-clients"),
            timeout=min(OnClients.timeout, s.round_timeout),
            guard=s.guard,
        )

    def key(self, name: str) -> Any:
        """The run's value of a strategy's own run_config key (its declared default when unset)."""
        return self.settings.key(name)

    def halves(self) -> tuple[Any, Any]:
        """The server's validation split cut in two: the refinement learns on the first half, the guard
        judges on the second (so the guard never scores a model on data it was refined on)."""
        return split(self.splits.val, 0.5)

    def guard(self) -> Optional[Guard]:
        """The do-no-harm guard on the server's guard half (None with ``guard=false``)."""
        s = self.settings
        return Guard(data=self.halves()[1], batches=s.guard_batches or None) if s.guard else None

    def robust(self) -> dict[str, Any]:
        return dict(robust=Robust(reduce=self.settings.reduce, trim=self.settings.trim))

    def matching(self, permutations: bool = False) -> Matching:
        """Weight matching's options; ``permutations``: the residual stream's group is permutations only."""
        m = self.settings.matching()
        return replace(m, residual="permutation") if permutations else m

    def aligned(self, on_clients: bool = False, permutations: bool = False) -> dict[str, Any]:
        """``AlignedFedAvg``'s options; ``on_clients``: the guard's losses come from the clients."""
        s = self.settings
        universe = Universe(
            iterations=s.iterations, start=s.universe_start, form=s.form, keep_layernorm=s.keep_layernorm
        )
        out: dict[str, Any] = dict(matching=self.matching(permutations), universe=universe, screen=s.screen_options())
        if on_clients:
            out.update(guard=None, on_clients=self.on_clients())
        else:
            out.update(guard=self.guard())
        return out


# ---- the built-in strategies' own keys -------------------------------------------------------------


def _non_negative(v: float) -> str:
    return "" if v >= 0 else "must be non-negative"


OT_REG = Key(
    "ot-reg",
    OTFusion.reg,
    "Sinkhorn's entropic regularisation of each transport map (costs scaled to at "
    "most 1; the paper's best weight-based value); 0: exact maps, permutations (`OTFusion.reg`)",
    check=_non_negative,
)
OT_COST = Key(
    "ot-cost",
    OTFusion.cost,
    "transport costs from the layers' weight rows, or `activations`: their output "
    "units' activations on the server's refinement half (`OTFusion.cost`)",
    choices=OT_COSTS,
)
DISTILL_STEPS = Key(
    "distill-steps",
    Distill.steps,
    "at most this many distillation steps on the server's refinement "
    "half (`Distill.steps`); it stops on its held-out loss to the ensemble",
    check=_non_negative,
)
DISTILL_LR = Key(
    "distill-lr", Distill.lr, "the distillation's Adam learning rate on the weights (`Distill.lr`)", check=_non_negative
)
DISTILL_TEMPERATURE = Key(
    "distill-temperature",
    Distill.temperature,
    "the distillation's softmax temperature (`Distill.temperature`)",
    check=lambda v: "" if v > 0 else "must be positive",
)
DISTILL_KEYS = (DISTILL_STEPS, DISTILL_LR, DISTILL_TEMPERATURE)
SERVER_LR = Key(
    "server-lr",
    0.0,
    "the server optimiser's learning rate (0: Flower's default, 1.0 for FedAvgM, 0.1 for FedAdam / FedYogi)",
    check=_non_negative,
)
SERVER_MOMENTUM = Key(
    "server-momentum",
    0.0,
    "FedAvgM's server momentum (Flower's default 0 is FedAvg)",
    check=lambda v: "" if 0 <= v < 1 else "must be in [0, 1)",
)
SCAFFOLD_VARIATE = Key(
    "scaffold-variate",
    "trajectory",
    "the clients' variate c_i⁺: the paper's option II "
    "(`trajectory`) or option I (`gradient`, the local gradient at the received model)",
    choices=VARIATES,
    client=True,
)
FF_LIFT = Key(
    "ff-lift",
    Universe.ff_lift,
    "a narrower client's FF enters the universe as zero neurons (masked), or "
    "`split`: its own neurons split over the extra units (`Universe.ff_lift`)",
    choices=FF_LIFTS,
)
CLIENTS_PER_STEP = Key(
    "clients-per-step",
    OnClients.clients_per_step,
    "clients asked for gradients at each refinement step (`OnClients.clients_per_step`; 0: every client)",
    check=_non_negative,
)
BATCHES_PER_CLIENT = Key(
    "batches-per-client",
    OnClients.batches_per_client,
    "local batches each client's gradient averages over (`OnClients.batches_per_client`)",
    check=lambda v: "" if v >= 1 else "at least 1",
)
SAMPLES_PER_MESSAGE = Key(
    "samples-per-message",
    OnClients.samples_per_message,
    "merge-weight draws λ per message, one gradient each (`OnClients.samples_per_message`)",
    check=lambda v: "" if v >= 1 else "at least 1",
)
CHECK_CLIENTS = Key(
    "check-clients",
    OnClients.check_clients,
    "clients that score the checks and the guard (`OnClients.check_clients`; 0: every client)",
    check=_non_negative,
)
REFINE_ON_CLIENTS = (CLIENTS_PER_STEP, BATCHES_PER_CLIENT, SAMPLES_PER_MESSAGE, CHECK_CLIENTS)


# ---- the built-in strategies ------------------------------------------------------------------------


@register(
    "average",
    summary="Flower's FedAvg of the validated replies (FedMedian / FedTrimmedAvg with reduce)",
    reduce=True,
    example="ReportingFedAvg()",
)
def _average(b: Build):
    return ReportingFedAvg(**b.common(), **b.robust())


@register(
    "permuted",
    summary="aligned with permutations only (heads, FF, the residual's coordinates): the Git "
    "Re-Basin / FedMA-style peer",
    server_data=True,
    reduce=True,
    screen=True,
    universe=True,
    example='AlignedFedAvg(model=model, matching=Matching(residual="permutation"))',
)
def _permuted(b: Build):
    return AlignedFedAvg(**b.common(), **b.aligned(permutations=True), **b.robust())


@register(
    "aligned",
    summary="weight matching along every symmetry (orthogonal residual, head and FF "
    "permutations, QK/OV gauges) to a universe, then averaging; guarded by the plain average",
    server_data=True,
    reduce=True,
    screen=True,
    universe=True,
    example="AlignedFedAvg(model=model)",
)
def _aligned(b: Build):
    return AlignedFedAvg(**b.common(), **b.aligned(), **b.robust())


@register(
    "aligned-clients",
    summary="aligned, its guard scored by the clients (no server data)",
    on_clients=True,
    reduce=True,
    screen=True,
    universe=True,
    example="AlignedFedAvg(model=model, on_clients=OnClients())",
    keys=(CHECK_CLIENTS,),
    client="its evaluate answers `eval-loss` on held-out data (the guard's scores)",
)
def _aligned_clients(b: Build):
    return AlignedFedAvg(**b.common(), **b.aligned(on_clients=True), **b.robust())


@register(
    "refined",
    summary="aligned, then Dirichlet refinement of the alignments on the server's data",
    server_data=True,
    screen=True,
    universe=True,
    example="RefinedFedAvg(model=model, refine=Refinement(data=data))",
)
def _refined(b: Build):
    return RefinedFedAvg(**b.common(), **b.aligned(), refine=b.settings.refinement(b.halves()[0]))


@register(
    "refined-clients",
    summary="the refinement's gradients and the guard computed by the clients (no server data)",
    on_clients=True,
    screen=True,
    universe=True,
    example="RefinedFedAvg(model=model, refine=Refinement(), on_clients=OnClients())",
    keys=REFINE_ON_CLIENTS,
    client="answers `query.refine` messages with `fedlmc.on_clients.answer` (fedlmc's ClientApp does)",
)
def _refined_clients(b: Build):
    return RefinedFedAvg(**b.common(), **b.aligned(on_clients=True), refine=b.settings.refinement(None))


@register(
    "ot-fusion",
    summary="optimal-transport fusion (Imfeld et al., ICLR 2024), replies carried onto an "
    "anchor by soft transport maps layer by layer, then averaged; guarded by the plain average",
    server_data=True,
    example="OTFusionFedAvg(model=model)",
    keys=(OT_REG, OT_COST),
)
def _ot_fusion(b: Build):
    cost = b.key("ot-cost")
    data = b.halves()[0] if cost == "activations" else None  # the half the refinement learns on
    fusion = OTFusion(reg=b.key("ot-reg"), cost=cost, data=data)
    return OTFusionFedAvg(**b.common(), fusion=fusion, guard=b.guard())


def _distilled(b: Build, start: str, refine: bool = False, on_clients: bool = False):
    s = b.settings
    data = None if on_clients else b.halves()[0]  # the refinement's half: the same data, the same budget of steps
    options = Distill(
        data=data,
        start=start,
        refine=s.refinement(data) if refine else None,
        steps=b.key("distill-steps"),
        lr=b.key("distill-lr"),
        temperature=b.key("distill-temperature"),
    )
    return DistilledFedAvg(**b.common(), **b.aligned(on_clients=on_clients), distill=options)


@register(
    "feddf",
    summary="FedDF, FedAvg's mean distilled toward the replies' ensemble on the server's unlabelled data",
    server_data=True,
    example='DistilledFedAvg(model=model, distill=Distill(data=data, start="average"))',
    keys=DISTILL_KEYS,
)
def _feddf(b: Build):
    return _distilled(b, "average")


@register(
    "aligned-distilled",
    summary="the aligned merge distilled toward the replies' ensemble on the server's data",
    server_data=True,
    universe=True,
    example="DistilledFedAvg(model=model, distill=Distill(data=data))",
    keys=DISTILL_KEYS,
)
def _aligned_distilled(b: Build):
    return _distilled(b, "merge")


@register(
    "refined-distilled",
    summary="the refined merge distilled toward the replies' ensemble on the server's data",
    server_data=True,
    universe=True,
    example="DistilledFedAvg(model=model, distill=Distill(data=data, refine=Refinement(data=data)))",
    keys=DISTILL_KEYS,
)
def _refined_distilled(b: Build):
    return _distilled(b, "merge", refine=True)


@register(
    "refined-clients-distilled",
    summary="refined on the clients, then distilled by them, each "
    "toward the model it trained on its own data (no server data)",
    on_clients=True,
    universe=True,
    example="DistilledFedAvg(model=model, distill=Distill(refine=Refinement()), on_clients=OnClients())",
    keys=(*DISTILL_KEYS, *REFINE_ON_CLIENTS),
    client="answers `query.refine` messages with `fedlmc.on_clients.answer` and keeps its trained model when "
    "the train config says `keep-model` (fedlmc's ClientApp does)",
)
def _refined_clients_distilled(b: Build):
    return _distilled(b, "merge", refine=True, on_clients=True)


def _hetero(b: Build, refine: bool, permutations: bool = False):
    s = b.settings
    guard = b.guard() if b.model is None else None  # Hugging Face widths: no server-side guard model
    return HeteroWidthFedAvg(
        **b.common(),
        matching=b.matching(permutations),
        universe=Universe(iterations=s.iterations, ff_lift=b.key("ff-lift")),
        guard=guard,
        refine=s.refinement(b.halves()[0]) if refine else None,
    )


@register(
    "hetero",
    summary="clients of several widths aligned into the widest one's universe, each sent its own-width projection",
    server_data=True,
    mixed_widths=True,
    example="HeteroWidthFedAvg(model=model)",
    keys=(FF_LIFT,),
    client="builds its model at the width of the arrays it receives",
)
def _hetero_aligned(b: Build):
    return _hetero(b, refine=False)


@register(
    "hetero-permuted",
    summary="hetero with permutations only",
    server_data=True,
    mixed_widths=True,
    example='HeteroWidthFedAvg(model=model, matching=Matching(residual="permutation"))',
    keys=(FF_LIFT,),
    client="builds its model at the width of the arrays it receives",
)
def _hetero_permuted(b: Build):
    return _hetero(b, refine=False, permutations=True)


@register(
    "hetero-refined",
    summary="hetero, then Dirichlet refinement",
    server_data=True,
    mixed_widths=True,
    example="HeteroWidthFedAvg(model=model, refine=Refinement(data=data))",
    keys=(FF_LIFT,),
    client="builds its model at the width of the arrays it receives",
)
def _hetero_refined(b: Build):
    return _hetero(b, refine=True)


@register(
    "slicing",
    summary="HeteroFL, each width the wide model's leading slice",
    mixed_widths=True,
    example="SlicingFedAvg(model=model)",
    client="builds its model at the width of the arrays it receives",
)
def _slicing(b: Build):
    return SlicingFedAvg(**b.common())


@register(
    "krum",
    summary="Flower's Krum on the raw replies (f = malicious)",
    example="KrumFedAvg(num_malicious_nodes=1, num_nodes_to_select=1)",
)
def _krum(b: Build):
    return KrumFedAvg(**b.common(), num_malicious_nodes=b.settings.malicious, num_nodes_to_select=1)


@register(
    "multikrum",
    summary="Flower's Multi-Krum on the raw replies (all but f = malicious)",
    example="KrumFedAvg(num_malicious_nodes=1)",
)
def _multikrum(b: Build):
    return KrumFedAvg(**b.common(), num_malicious_nodes=b.settings.malicious, num_nodes_to_select=None)


@register(
    "fedprox",
    summary="FedProx, FedAvg with the clients' proximal term (`proximal-mu`)",
    example="FedProxFedAvg(proximal_mu=0.1)",
    client="adds μ/2·‖w − w_global‖² to its loss and confirms it with `fedlmc.strategies.knobs.confirm` "
    "(fedlmc's ClientApp does)",
)
def _fedprox(b: Build):
    return FedProxFedAvg(**b.common(), proximal_mu=b.settings.proximal_mu)


@register(
    "scaffold",
    summary="SCAFFOLD, the clients' gradients corrected by control variates (c − c_i) that travel with the messages",
    example="ScaffoldFedAvg()",
    keys=(SCAFFOLD_VARIATE,),
    client="corrects its gradients by c − c_i (`fedlmc.scaffold`), answers Δc_i and confirms it (fedlmc's "
    "ClientApp does)",
)
def _scaffold(b: Build):
    return ScaffoldFedAvg(**b.common(), variate=b.key("scaffold-variate"))


def _server_opt(name: str, summary: str) -> None:
    """Register Flower's server optimiser ``name`` (with Flower's default hyper-parameters)."""
    import flwr.serverapp.strategy as flower

    keys = (SERVER_LR, SERVER_MOMENTUM) if name == "FedAvgM" else (SERVER_LR,)

    @register(name.lower(), summary=summary, example=f"ServerOptFedAvg(optimiser={name}())", keys=keys)
    def _build(b: Build):
        server_lr = b.key("server-lr")
        lr = {"server_learning_rate" if name == "FedAvgM" else "eta": server_lr} if server_lr > 0 else {}
        momentum = {"server_momentum": b.key("server-momentum")} if name == "FedAvgM" else {}
        return ServerOptFedAvg(**b.common(), optimiser=getattr(flower, name)(**lr, **momentum))


_server_opt("FedAvgM", "FedAvg with server momentum (Flower's; `server-momentum`)")
_server_opt("FedAdam", "the Adam server optimiser (Flower's; `server-lr`)")
_server_opt("FedYogi", "the Yogi server optimiser (Flower's; `server-lr`)")


def _task_merge(method: str, summary: str) -> None:
    """Register the task-vector merge ``method`` (``TaskMerge``'s defaults)."""

    @register(method, summary=summary, example=f'TaskVectorFedAvg(merge=TaskMerge(method="{method}"))')
    def _build(b: Build):
        return TaskVectorFedAvg(**b.common(), merge=TaskMerge(method=method))


_task_merge("task-arithmetic", "Task Arithmetic, the clients' task vectors summed (λ = 1: FedAvg)")
_task_merge("ties", "TIES, task vectors trimmed to 20 %, sign elected, agreeing entries averaged")
_task_merge("dare", "DARE, 90 % of each task vector dropped at random, the rest rescaled")
_task_merge("model-stock", "Model Stock, the clients' mean pulled to the base by their angle")


def build(settings: Any, config: Any, splits: Any, model: Any = None):
    """The strategy ``settings.strategy`` names, built by its registration (``config``: the global fedlmc
    model's config)."""
    return registered(settings.strategy).build(Build(settings, config, splits, model))


CAPABILITY_COLUMNS = (
    ("server_data", "server data"),
    ("on_clients", "on clients"),
    ("reduce", "reduce"),
    ("screen", "screen"),
    ("universe", "universe-start"),
    ("mixed_widths", "mixed widths"),
)


def key_table() -> str:
    """Every registered strategy's own run_config keys as a Markdown table: key, default, the strategies
    that own it, what it does (docs/federations.md's; ``fedlmc strategies`` prints it)."""
    import json

    lines = ["| key | default | strategies | what it does |", "|---|---|---|---|"]
    for name, key in all_keys().items():
        values = f" ({' / '.join(f'`{c}`' for c in key.choices)})" if key.choices else ""
        client = "; sent to the clients in every train message" if key.client else ""
        who = ", ".join(f"`{n}`" for n in owners(name))
        lines.append(f"| `{name}` | `{json.dumps(key.default)}` | {who} | {key.doc}{values}{client} |")
    return "\n".join(lines)


def table() -> str:
    """The registered strategies as a Markdown table (docs/strategies.md's; ``fedlmc strategies`` prints it)."""
    cols = CAPABILITY_COLUMNS
    lines = [
        "| strategy | in your Flower app | what it does | client code it needs | "
        + " | ".join(c for _, c in cols)
        + " |",
        "|---|---|---|---|" + "---|" * len(cols),
    ]
    for r in REGISTRY.values():
        marks = " | ".join("✓" if getattr(r.can, f) else "" for f, _ in cols)
        example = f"`{r.example}`" if r.example else ""
        lines.append(f"| `{r.name}` | {example} | {r.summary} | {r.client or 'none'} | {marks} |")
    return "\n".join(lines)
