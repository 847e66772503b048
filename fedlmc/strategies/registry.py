"""The strategies a ``run_config`` can name: one registration each, read by everything that lists,
checks or builds them.

A registration maps the name (run_config ``strategy``) to a builder and to what the strategy accepts.
``fedlmc.federated.Settings.validate`` checks a run's keys against these capabilities, the apps' factory
(``strategies/factory.py``) calls the builder, the comparison runner (``simulations.compare``) checks its
strategy lists here, ``fedlmc strategies`` prints the table, and docs/strategies.md's table is generated
from it (``python -m simulations.tables``). Adding a strategy is its class plus one ``register`` call::

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
    Guard,
    Matching,
    OnClients,
    Report,
    Robust,
    Universe,
)
from fedlmc.strategies.keys import Key


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
    mixed_depths : bool, default False
        It aggregates clients of several depths (``depth-factors``); the others need one depth.
    """

    server_data: bool = False
    on_clients: bool = False
    reduce: bool = False
    screen: bool = False
    universe: bool = False
    mixed_widths: bool = False
    mixed_depths: bool = False


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

    @property
    def baseline(self) -> bool:
        """A peer fedlmc is compared with (registered in ``fedlmc.baselines``), not one of fedlmc's own."""
        return self.build.__module__.startswith("fedlmc.baselines")


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
    ("mixed_depths", "mixed depths"),
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


def table(baselines: Optional[bool] = None) -> str:
    """The registered strategies as a Markdown table (docs/strategies.md's; ``fedlmc strategies`` prints it):
    fedlmc's own (``baselines=False``), the peers (True) or all (None)."""
    cols = CAPABILITY_COLUMNS
    lines = [
        "| strategy | in your Flower app | what it does | client code it needs | "
        + " | ".join(c for _, c in cols)
        + " |",
        "|---|---|---|---|" + "---|" * len(cols),
    ]
    for r in REGISTRY.values():
        if baselines is not None and r.baseline != baselines:
            continue
        marks = " | ".join("✓" if getattr(r.can, f) else "" for f, _ in cols)
        example = f"`{r.example}`" if r.example else ""
        lines.append(f"| `{r.name}` | {example} | {r.summary} | {r.client or 'none'} | {marks} |")
    return "\n".join(lines)
