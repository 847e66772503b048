"""What a federation needs from the library, without Flower: settings read from a ``run_config``-like
mapping, each client's partition and width, local training, and the experiment's initial model.

Flower's apps (``clients/``, ``simulations/``) stay thin: they translate messages to these calls.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional

import torch
import torch.nn as nn

from fedlmc.data import Data, DataNotFound, Splits, TokenData, load, split
from fedlmc.data.partition import SCHEMES, partition
from fedlmc.hf import Logits, hf_model_for
from fedlmc.merging.widths import width_config
from fedlmc.models import ARCHS, from_config, preset_config, preset_dataset
from fedlmc.models.layers import TransformerConfig
from fedlmc.options import (
    PREDICTION_SCREENS,
    REDUCES,
    SCREENS,
    UNIVERSE_STARTS,
    Guard,
    Matching,
    Refinement,
    Robust,
    Scale,
    Screen,
    Universe,
    one_of,
)
from fedlmc.strategies.registry import RUN_KEYS, all_keys, declared, names, owners, registered
from fedlmc.train import OPTIMIZERS, TrainConfig, evaluate, model_for_data, train

# the run's own keys a strategy may send its clients in the train config (FedProx's proximal term); any
# other run key in a train config (a user's app may send `lr`) leaves the client's settings as they are
SENT_RUN_KEYS = ("proximal-mu",)


def doc(default: Any, text: str) -> Any:
    """A run_config key's default and what it does (the docs' key table prints ``text``)."""
    return field(default=default, metadata={"doc": text})


@dataclass
class Settings:
    """One federation, read from ``run_config``: field ``local_epochs`` is run_config key ``local-epochs``.

    These are the production app's keys (``pyproject.toml``'s ``[tool.flwr.app.config]``); the
    experiment layer adds its own (``simulations.experiment.ExperimentSettings``). ``matching()`` and
    ``refinement(data)`` map the keys onto the option objects the strategies take."""

    strategy: str = doc(
        "average,aligned,refined",
        "a registered strategy ([the table](strategies.md#the-registered-strategies); `fedlmc strategies` "
        "prints it); several, comma-separated: a one-shot side-by-side comparison",
    )
    num_server_rounds: int = doc(1, "rounds (1 for a comparison)")
    preset: str = doc(
        "gpt2-tiny",
        "the model and its data: `gpt2-tiny`, `llama-tiny` (Tiny Shakespeare, shipped), `vit-digits` (scikit-"
        "learn's digits, shipped), `vit-tiny` (MNIST), `vit-cifar`, `gpt2-shakespeare`, `gpt2-small`",
    )
    dataset: str = doc("", "another data set than the preset's (`mnist`, `digits`, `cifar10`, `shakespeare`, `text`)")
    data_dir: str = doc(
        "",
        "where data sets are looked for (then `$FEDLMC_DATA`, then the data that ships with fedlmc)",
    )
    text_file: str = doc("", "any UTF-8 text file for `dataset='text'` (character-level)")
    partitioner: str = doc(
        "iid",
        "images: `iid` or `dirichlet` by label; text: the play's speeches dealt out `iid`, by Dirichlet(α) "
        "per speaker (`dirichlet`), every speaker on one client (`speaker`, as LEAF's Shakespeare), or "
        "`contiguous` shards",
    )
    alpha: float = doc(0.5, "the Dirichlet partitioner's concentration")
    fraction_train: float = doc(1.0, "Flower's share of nodes sampled for training")
    fraction_evaluate: float = doc(0.0, "Flower's share of nodes sampled for federated evaluation")
    min_nodes: int = doc(2, "nodes needed before a round starts")
    local_epochs: float = doc(1.0, "local training per round, in passes over the client's data")
    local_steps: int = doc(0, "local training in optimiser steps (overrides `local-epochs` when > 0)")
    lr: float = doc(2e-3, "AdamW learning rate (warm-up, then cosine)")
    batch_size: int = doc(32, "local batch size")
    seed: int = doc(0, "seeds partitions, initialisations and training")
    independent_start: bool = doc(
        True,
        "round 1: every client starts from its own initialisation (one-shot fusion); false: from the server's model",
    )
    width_factors: str = doc(
        "",
        'e.g. `"1,2,4"`: partition p trains at 1/factor of the width (simulations; deployments use the node config)',
    )
    depth_factors: str = doc(
        "",
        'e.g. `"1,2"`: partition p trains 1/factor of the layers (rounded; simulations; deployments use the node '
        "config `depth-factor`)",
    )
    iterations: int = doc(Universe.iterations, "universe iterations per round (`Universe.iterations`)")
    universe_start: str = doc(
        Universe.start,
        "where the universe starts when the replies were trained from the global model (`Universe.start`): "
        "that model, or `average`, the replies' weighted mean; with `min-gain`, `average` settles such a "
        "round in one universe iteration — [performance](performance.md#many-replies)",
    )
    residual: str = doc(
        "orthogonal",
        "the residual stream's group in weight matching (`Matching.residual`): `orthogonal` or `permutation`",
    )
    min_gain: float = doc(
        Matching.min_gain,
        "keep each reply as it is (the identity) unless weight matching lowers its relative distance to the "
        "universe by more than this fraction (`Matching.min_gain`): `0.1` skips aligning clients trained a "
        "little from the global model, for large models — [performance](performance.md#many-replies)",
    )
    ff_scale: bool = doc(
        Matching.ff_scale,
        "weight matching also solves each FF neuron's scale where ReLU or SwiGLU allows one "
        "(`Matching.ff_scale`; GELU models have none) — [models](models.md#the-symmetry-spec)",
    )
    guard: bool = doc(
        True,
        "do no harm (`Guard`): keep the plain average when it scores better on half the server's validation "
        "split (`*-clients`: on half of each client's)",
    )
    refine_steps: int = doc(
        Refinement.steps,
        "at most this many refinement steps (`Refinement.steps`); it stops on its objective",
    )
    eval_batches: int = doc(0, "test batches the server scores each round (0: the whole test split)")
    out_dir: str = doc("runs/flwr", "where the run writes")
    round_timeout: float = doc(3600.0, "seconds a round waits for replies")
    device: str = doc("", "`cuda`, `cpu`; empty: CUDA when present")
    resume: bool = doc(False, "continue from `<out-dir>/state` after a crash")
    threads: int = doc(
        1,
        "torch threads per app process (0: torch's default; more than one per process thrashes a busy small host)",
    )
    reduce: str = doc(
        Robust.reduce,
        "`Robust.reduce`: `average`, or `median` / `trimmed`: robust aggregation (for the `average` strategy, Flower's "
        "FedMedian / FedTrimmedAvg; for `aligned` and `permuted`, among the aligned replies)",
    )
    trim: float = doc(Robust.trim, "`Robust.trim`, for `trimmed`: the fraction cut at each end of every coordinate")
    vocab_size: int = doc(0, "0: the data's vocabulary; larger pads it (50257: GPT-2-small's 124M parameters)")
    workers: int = doc(
        Scale.workers,
        "aligned / refined: processes that align a round's replies at once (`Scale.workers`; 0: one per core)"
        " — [many replies](performance.md#many-replies)",
    )
    spool: bool = doc(
        Scale.spool,
        "aligned / refined: every reply waits on disk and is read back memory-mapped, so the server holds a "
        "few models whatever their number (always on with `workers` ≠ 1)",
    )
    spool_dir: str = doc(
        "",
        "where the replies wait (a local disk with room for one round's replies; `\"\"`: the system's "
        "temporary directory); removed after each round",
    )
    ray_address: str = doc(
        "",
        'align on this Ray cluster (`"auto"`, `"ray://host:10001"`) instead of local worker processes',
    )
    screen: str = doc(
        "none",
        "`aligned` / `permuted` / `aligned-clients` / `refined` / `refined-clients` (the refinement then "
        "learns on the kept replies only): leave out the replies that are outliers once aligned "
        "(`Screen.method`: `distance`, `loss`, `agreement` or `information` — the last three on the server's "
        "guard split — or `krum`) and merge the rest with `reduce` — [screening](strategies.md#screening-"
        "replies-modulo-symmetries)",
    )
    screen_threshold: float = doc(
        Screen.threshold,
        "`distance` / `loss` / `agreement` / `information`: exclude a reply whose aligned distance to the "
        "median (held-out loss) is this many robust deviations above the others' (whose agreement or "
        "information is this many below) (`Screen.threshold`)",
    )
    malicious: int = doc(
        Screen.malicious,
        "f, the attackers assumed: the `krum` screen excludes the f highest Krum scores "
        "(`Screen.malicious`); the `krum` / `multikrum` baselines are Flower's Krum / Multi-Krum with this f",
    )
    proximal_mu: float = doc(
        0.0,
        "the clients' proximal term's weight μ (FedProx's): fedlmc's ClientApp adds μ/2·‖w − w_global‖² to "
        "its local loss (`TrainConfig.proximal_mu`) under any strategy (`refined` with it: FedProx clients "
        "under refined aggregation); `fedprox` also sends it in every train message and checks the replies "
        "confirm it",
    )
    local_optimizer: str = doc(
        "adamw",
        "the clients' optimiser: `adamw` (warmup, cosine decay, gradient clipping) or `sgd` (plain SGD at a "
        "constant `lr`: the local solver of SCAFFOLD's paper)",
    )
    # the strategies' own keys (fedlmc.strategies.keys.Key, declared where each strategy is registered):
    # read with key(name); run_config spells them as they are declared ("ot-reg")
    strategy_keys: dict = field(default_factory=dict)

    # Fixed in the production app; the experiment layer makes each a run_config key (ExperimentSettings).
    form: ClassVar[str] = Universe.form  # Universe.form: factored (the clients' shape) or circuit
    keep_layernorm: ClassVar[bool] = Universe.keep_layernorm  # Universe.keep_layernorm
    guard_batches: ClassVar[int] = Guard.batches  # Guard.batches
    aggregate_threads: ClassVar[int] = -1  # Scale.threads while the server combines a round (-1: `threads`)
    hf: ClassVar[bool] = False  # clients train the preset's Hugging Face twin under its own keys

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], client: bool = False) -> "Settings":
        """Read ``run_config`` (dashes or underscores): the run's own keys and the registered strategies'
        keys (``fedlmc.strategies.keys.Key``); values are coerced and validated, an unknown key is an error.
        ``client``: a ClientApp's reading, which keeps keys it does not know (a strategy registered only
        at the server) unread, and does not validate the strategies."""
        known = {f.name: f for f in fields(cls) if f.name != "strategy_keys"}
        values: dict[str, Any] = {}
        keys: dict[str, Any] = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name in known:
                typ = type(known[name].default)
                if typ is bool and isinstance(value, str):
                    value = value.strip().lower() in ("1", "true", "yes", "on")
                values[name] = typ(value)
            elif declared(key.replace("_", "-")) is not None:
                keys[key.replace("_", "-")] = declared(key.replace("_", "-")).value(value)
            elif client:
                keys[key.replace("_", "-")] = value
            else:
                every = sorted([k.replace("_", "-") for k in known] + list(all_keys()))
                raise ValueError(f"unknown run_config key {key!r}; known: {', '.join(every)}")
        s = cls(**values, strategy_keys=keys)
        if not client:
            s.validate()
        return s

    def key(self, name: str) -> Any:
        """A strategy's own run_config key: this run's value, else its declared default."""
        if name in self.strategy_keys:
            return self.strategy_keys[name]
        key = declared(name)
        if key is None:
            raise KeyError(f"no registered strategy declares run_config key {name!r}")
        return key.default

    def with_sent(self, config: Mapping[str, Any]) -> "Settings":
        """These settings with what the server sent in a train message's config: the run's keys the
        strategy sets for its clients (``proximal-mu``) and the strategies' client keys
        (``Key(client=True)``: ``scaffold-variate``). The one path by which a strategy's client-side knob
        reaches the client's trainer."""
        values = {k.replace("-", "_"): config[k] for k in SENT_RUN_KEYS if k in config}
        keys = dict(self.strategy_keys)
        for k in config:
            key = declared(k)
            if key is not None and key.client:
                keys[k] = key.value(config[k])
        typed = {k: type(getattr(self, k))(v) for k, v in values.items()}
        return replace(self, **typed, strategy_keys=keys)

    def validate(self) -> None:
        """A clear error for values no run could use."""
        names = self.strategies()
        if len(names) > 1 and self.num_server_rounds != 1:
            raise ValueError(
                f"strategy {self.strategy!r} compares {len(names)} strategies on the same replies: "
                f"a one-shot run, so num-server-rounds must be 1 (got {self.num_server_rounds})"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"strategy {self.strategy!r} names a strategy twice")
        for name in names:
            self._check_capabilities(registered(name))
        self._check_keys(names)
        one_of(self.reduce, REDUCES, "reduce")
        one_of(self.universe_start, UNIVERSE_STARTS, "universe-start")
        one_of(self.screen, ("none", *SCREENS), "screen")
        self.screen_options()
        one_of(self.partitioner, SCHEMES, "partitioner")
        one_of(self.local_optimizer, OPTIMIZERS, "local-optimizer")
        if self.proximal_mu < 0:
            raise ValueError(f"proximal-mu must be non-negative: got {self.proximal_mu}")
        self.matching()
        self.scale()

    def _check_capabilities(self, r) -> None:
        """What strategy ``r`` (a registration) is asked to do, against what it accepts."""
        name, can = repr(r.name), r.can
        if any(f != 1 for f in self.factors()) and not can.mixed_widths:
            raise ValueError(
                f"width-factors {self.width_factors!r} make a mixed-width federation: use one of the strategies "
                f"{', '.join(names(mixed_widths=True))}, not {name}"
            )
        if any(f != 1 for f in self.depth_list()) and not can.mixed_depths:
            raise ValueError(
                f"depth-factors {self.depth_factors!r} make a mixed-depth federation: use one of the strategies "
                f"{', '.join(names(mixed_depths=True))}, not {name}"
            )
        if self.reduce != "average" and not can.reduce:
            raise ValueError(
                f"reduce={self.reduce!r} applies to strategies {', '.join(names(reduce=True))}, not {name}"
            )
        if self.screen != "none" and not can.screen:
            raise ValueError(
                f"screen={self.screen!r} screens aligned replies: strategies {', '.join(names(screen=True))} "
                f"(krum / multikrum are the raw-coordinate baselines), not {name}"
            )
        if self.screen in ("loss", *PREDICTION_SCREENS) and (can.on_clients or not can.server_data or not self.guard):
            raise ValueError(
                f"screen={self.screen!r} scores each reply on the server's guard split: strategies "
                f"{', '.join(names(screen=True, server_data=True))} with guard=true, not {name}"
                + ("" if self.guard else " with guard=false")
            )
        if self.universe_start != "previous" and not can.universe:
            raise ValueError(
                f"universe-start={self.universe_start!r} is where the aligned and refined strategies' universe "
                f"starts: strategies {', '.join(names(universe=True))}, not {name}"
            )

    def _check_keys(self, strategies: list[str]) -> None:
        """A strategy's key set to other than its default is refused unless a strategy of the run owns it
        (an option no strategy of the run would read is never accepted in silence)."""
        for name, value in self.strategy_keys.items():
            key = declared(name)
            mine = [n for n in strategies if any(k.name == name for k in registered(n).keys)]
            if key is not None and value != key.default and not mine:
                raise ValueError(
                    f"{name}={value!r} is an option of the strategies {', '.join(owners(name))}, not of "
                    f"{', '.join(map(repr, strategies))}"
                )

    def strategies(self) -> list[str]:
        """The strategy, or the strategies a side-by-side comparison aggregates the same replies with."""
        return [x.strip() for x in self.strategy.split(",") if x.strip()]

    def matching(self) -> Matching:
        """Weight matching's options (the permutation-only strategies' builders replace the residual's)."""
        return Matching(residual=self.residual, min_gain=self.min_gain, ff_scale=self.ff_scale)

    def scale(self) -> Scale:
        """Where a round's replies wait, who aligns them, where and on how many threads."""
        return Scale(
            workers=self.workers,
            spool=self.spool,
            spool_dir=self.spool_dir or None,
            ray_address=self.ray_address or None,
            threads=self.aggregate_threads if self.aggregate_threads >= 0 else None,
            device=self.device or None,
        )

    def screen_options(self) -> Optional[Screen]:
        """The aligned strategies' screening of outlier replies (None: no screening)."""
        if self.screen == "none":
            return None
        return Screen(method=self.screen, threshold=self.screen_threshold, malicious=self.malicious)

    def refinement(self, data) -> Refinement:
        """The refinement's options, learning on ``data`` (the server's refinement half)."""
        return Refinement(data=data, steps=self.refine_steps)

    def report_data(self, splits: Splits) -> Optional[Data]:
        """A data set on which the strategy records every reply's loss each round (None: no report)."""
        return None

    def apply_threads(self) -> None:
        """Set torch's intra-op threads when ``threads`` asks for it (in the app's own process)."""
        if self.threads > 0:
            torch.set_num_threads(self.threads)

    def to_run_config(self) -> dict[str, Any]:
        own = {k.replace("_", "-"): v for k, v in asdict(self).items() if k != "strategy_keys"}
        return {**own, **self.strategy_keys}

    def factors(self) -> list[float]:
        return [float(x) for x in self.width_factors.replace(" ", "").split(",") if x] or [1.0]

    def depth_list(self) -> list[float]:
        return [float(x) for x in self.depth_factors.replace(" ", "").split(",") if x] or [1.0]

    def train_config(self, seed: int) -> TrainConfig:
        budget = dict(steps=self.local_steps) if self.local_steps > 0 else dict(epochs=self.local_epochs)
        return TrainConfig(
            lr=self.lr,
            batch_size=self.batch_size,
            seed=seed,
            device=self.device or None,
            proximal_mu=self.proximal_mu,
            optimizer=self.local_optimizer,
            **budget,
        )


_SPLITS: dict[tuple, Splits] = {}


def splits_for(s: Settings) -> Splits:
    """The experiment's data (cached per process: Ray actors serve many rounds)."""
    key = (s.preset, s.dataset, s.data_dir, s.text_file, s.seed)
    if key not in _SPLITS:
        cfg = preset_config(s.preset)
        try:
            _SPLITS[key] = load(
                s.dataset or preset_dataset(s.preset),
                data_dir=s.data_dir or None,
                block_size=getattr(cfg, "block_size", 64),
                text_file=s.text_file or None,
                seed=0,
            )
        except DataNotFound as e:  # told as a federation user provides data: a run_config key
            raise e.in_federation(Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr"))) from None
    return _SPLITS[key]


def global_model(s: Settings) -> nn.Module:
    """The initial global model (the preset shaped to the data, seed ``s.seed``)."""
    splits = splits_for(s)
    if not s.vocab_size:
        return model_for_data(s.preset, splits, s.seed)
    need = splits.meta.get("vocab_size")
    if need is None or s.vocab_size < need:
        raise ValueError(f"vocab-size {s.vocab_size} is for text models and must be at least the data's ({need})")
    return model_for_data(s.preset, splits, s.seed, vocab_size=s.vocab_size)


def client_config(
    s: Settings, partition_id: int, node_factor: Optional[float] = None, node_depth: Optional[float] = None
) -> TransformerConfig:
    """The architecture a client trains: the global one at its width and depth (node config
    ``width-factor`` / ``depth-factor`` win over the run's ``width-factors`` / ``depth-factors`` lists)."""
    base = global_model_config(s)
    factors, depths = s.factors(), s.depth_list()
    f = node_factor if node_factor is not None else factors[partition_id % len(factors)]
    d = node_depth if node_depth is not None else depths[partition_id % len(depths)]
    cfg = width_config(base, f)
    if d != 1:
        layers = int(round(base.n_layer / d))
        if not 1 <= layers <= base.n_layer:
            raise ValueError(f"depth factor {d} gives {layers} layers of the global model's {base.n_layer}")
        cfg = cfg.replace(n_layer=layers)
    return cfg


_GLOBAL_CFG: dict[tuple, TransformerConfig] = {}


def global_model_config(s: Settings) -> TransformerConfig:
    key = (s.preset, s.dataset, s.data_dir, s.text_file, s.vocab_size)
    if key not in _GLOBAL_CFG:
        _GLOBAL_CFG[key] = global_model(s).config
    return _GLOBAL_CFG[key]


_PARTS: dict[tuple, tuple[Data, Data]] = {}


def client_data(s: Settings, partition_id: int, num_partitions: int) -> tuple[Data, Data]:
    """A client's (train, validation) partitions, deterministic in the settings."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    key = (s.preset, s.dataset, s.data_dir, s.text_file, s.partitioner, s.alpha, s.seed, num_partitions, partition_id)
    if key not in _PARTS:
        sp = splits_for(s)
        tr = partition(sp.train, num_partitions, s.partitioner, s.alpha, s.seed)[partition_id]
        va = partition(
            sp.val, num_partitions, "contiguous" if isinstance(sp.val, TokenData) else "iid", s.alpha, s.seed
        )[partition_id]
        _PARTS[key] = (tr, va)
    return _PARTS[key]


def fresh_client_model(s: Settings, partition_id: int, cfg: TransformerConfig) -> nn.Module:
    """An independently initialised client model (its own seed) for the one-shot / fusion setting
    (with ``s.hf``: the Hugging Face twin, initialised by Hugging Face)."""
    seed = 1000 * (s.seed + 1) + partition_id
    if s.hf:
        return hf_model_for(cfg, seed)
    torch.manual_seed(seed)
    return from_config(cfg)


def local_train(model: nn.Module, data: Data, s: Settings, seed: int) -> dict[str, Any]:
    """Train ``model`` on a client's partition; returns the history (``train_loss``, ``seconds``, ...)."""
    return train(Logits(model) if s.hf else model, data, s.train_config(seed), progress=False)


def config_from_json(text: str) -> TransformerConfig:
    d = json.loads(text)
    return ARCHS[d["arch"]][0].from_dict(d)


def evaluate_model(model: nn.Module, data: Data, max_batches: int = 0) -> dict[str, float]:
    """Mean loss and accuracy (a ``transformers`` model is evaluated through its logits)."""
    model = Logits(model) if hasattr(model.config, "model_type") else model
    return evaluate(model, data, max_batches=max_batches or None)


def halves(data: Data) -> tuple[Data, Data]:
    """Two disjoint halves of a data set (the server refines on one and guards on the other)."""
    return split(data, 0.5)


def refine_parts(val: Data) -> tuple[Data, Data, Data]:
    """A client's validation partition cut as the server cuts its own for ``refined``: the refinement's
    half (its first three quarters for the gradients, the last quarter for the checks) and the guard's
    half."""
    refine, guard = halves(val)
    train, check = split(refine, 0.75)
    return train, check, guard


def key_table(cls: type = Settings, beyond: Optional[type] = None) -> str:
    """The run's own run_config keys of ``cls`` (those not in ``beyond``) as a Markdown table: key, default,
    what it does (docs/federations.md's)."""
    skip = {"strategy_keys"} | ({f.name for f in fields(beyond)} if beyond is not None else set())
    lines = ["| key | default | what it does |", "|---|---|---|"]
    for f in fields(cls):
        if f.name not in skip:
            lines.append(f"| `{f.name.replace('_', '-')}` | `{json.dumps(f.default)}` | {f.metadata.get('doc', '')} |")
    return "\n".join(lines)


RUN_KEYS.update(f.name.replace("_", "-") for f in fields(Settings) if f.name != "strategy_keys")
