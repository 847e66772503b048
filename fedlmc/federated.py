"""What a federation needs from the library, without Flower: settings read from a ``run_config``-like
mapping, each client's partition and width, local training, and the experiment's initial model.

Flower's apps (``clients/``, ``simulations/``) stay thin: they translate messages to these calls.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional

import torch
import torch.nn as nn

from .data import Data, DataNotFound, Splits, TokenData, load, split
from .data.partition import SCHEMES, partition
from .hf import Logits, hf_model_for
from .models import ARCHS, from_config, preset_config, preset_dataset
from .models.layers import TransformerConfig
from .options import (
    FF_LIFTS,
    OT_COSTS,
    PREDICTION_SCREENS,
    REDUCES,
    SCREENS,
    UNIVERSE_STARTS,
    Distill,
    Guard,
    Matching,
    OnClients,
    OTFusion,
    Refinement,
    Robust,
    Scale,
    Screen,
    Universe,
    one_of,
)
from .scaffold import VARIATES
from .strategies.registry import names, registered
from .train import OPTIMIZERS, TrainConfig, evaluate, model_for_data, train
from .widths import width_config


@dataclass
class Settings:
    """One federation, read from ``run_config``: field ``local_epochs`` is run_config key ``local-epochs``.

    These are the production app's keys (``pyproject.toml``'s ``[tool.flwr.app.config]``); the
    experiment layer adds its own (``simulations.experiment.ExperimentSettings``). ``matching()`` and
    ``refinement(data)`` map the keys onto the option objects the strategies take."""

    strategy: str = "average,aligned,refined"  # a registered strategy, or several: a one-shot side-by-side comparison
    num_server_rounds: int = 1
    preset: str = "gpt2-tiny"
    dataset: str = ""  # default: the preset's
    data_dir: str = ""
    text_file: str = ""
    partitioner: str = "iid"  # iid | dirichlet | speaker (text) | contiguous (text)
    alpha: float = 0.5  # Dirichlet concentration of the label partition
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.0
    min_nodes: int = 2
    local_epochs: float = 1.0
    local_steps: int = 0  # > 0 overrides local_epochs
    lr: float = 2e-3
    batch_size: int = 32
    seed: int = 0
    independent_start: bool = True  # round 1: every client starts from its own seed (one-shot / fusion)
    width_factors: str = ""  # e.g. "1,2,4": partition p trains at 1/factor[p % len] of the width
    ff_lift: str = Universe.ff_lift  # Universe.ff_lift (mixed widths): zeros | split (a narrower FF's neurons)
    iterations: int = Universe.iterations  # Universe.iterations
    universe_start: str = Universe.start  # Universe.start: previous | mean (replies trained from it)
    residual: str = "orthogonal"  # Matching.residual
    min_gain: float = Matching.min_gain  # Matching.min_gain: keep the identity unless alignment gains more
    ff_scale: bool = Matching.ff_scale  # Matching.ff_scale: also match ReLU / SwiGLU FF neurons' scales
    guard: bool = True  # do-no-harm (Guard): compare with plain averaging on the server's validation split
    refine_steps: int = Refinement.steps  # Refinement.steps, at most: the refinement stops on its objective
    clients_per_step: int = OnClients.clients_per_step  # OnClients.clients_per_step (0: every client)
    batches_per_client: int = OnClients.batches_per_client  # OnClients.batches_per_client
    samples_per_message: int = OnClients.samples_per_message  # OnClients.samples_per_message (λ draws)
    check_clients: int = OnClients.check_clients  # OnClients.check_clients (0: every client)
    eval_batches: int = 0  # 0: the whole test split
    out_dir: str = "runs/flwr"
    round_timeout: float = 3600.0
    device: str = ""
    resume: bool = False  # continue from <out-dir>/state (the last completed round) if it exists
    # torch intra-op threads per app (0: torch's default); two OpenMP threads per app thrash a busy small host
    threads: int = 1
    reduce: str = Robust.reduce  # Robust.reduce: mean | median | trimmed (robust aggregation)
    trim: float = Robust.trim  # Robust.trim: the fraction of values cut at each end of every coordinate
    vocab_size: int = 0  # 0: the data's; larger pads the vocabulary (50257: GPT-2-small's 124M parameters)
    workers: int = Scale.workers  # Scale.workers: processes aligning a round's replies (1: here; 0: one a core)
    spool: bool = Scale.spool  # Scale.spool: replies wait on disk, memory-mapped (always with workers != 1)
    spool_dir: str = ""  # Scale.spool_dir ("": the system's temporary directory)
    ray_address: str = ""  # Scale.ray_address: align on this Ray cluster ("": local worker processes)
    screen: str = "none"  # Screen.method (none | distance | loss | agreement | information | krum): outlier replies
    screen_threshold: float = Screen.threshold  # Screen.threshold (distance: robust deviations)
    malicious: int = Screen.malicious  # Screen.malicious, and the krum / multikrum baselines' f
    # FedProx's proximal term, sent to the clients in every round's train config (TrainConfig.proximal_mu):
    # any strategy's clients can train with it (0: none; `fedprox` is `average` with it)
    proximal_mu: float = 0.0
    local_optimizer: str = "adamw"  # TrainConfig.optimizer: adamw | sgd (constant lr, no momentum or clipping)
    scaffold_variate: str = "trajectory"  # scaffold: the clients' c_i⁺, option II (trajectory) or I (gradient)
    ot_reg: float = OTFusion.reg  # OTFusion.reg (ot-fusion): Sinkhorn's regularisation, 0: exact maps
    ot_cost: str = OTFusion.cost  # OTFusion.cost (ot-fusion): weights | activations (server data)
    distill_steps: int = Distill.steps  # Distill.steps (feddf, *-distilled)
    distill_lr: float = Distill.lr  # Distill.lr
    distill_temperature: float = Distill.temperature  # Distill.temperature
    server_lr: float = 0.0  # the server optimisers' learning rate (0: Flower's default, FedAvgM 1.0, FedOpt 0.1)
    server_momentum: float = 0.0  # FedAvgM's server momentum (Flower's default 0: FedAvg)

    # Fixed in the production app; the experiment layer makes each a run_config key (ExperimentSettings).
    form: ClassVar[str] = Universe.form  # Universe.form: factored (the clients' shape) or circuit
    keep_layernorm: ClassVar[bool] = Universe.keep_layernorm  # Universe.keep_layernorm
    guard_batches: ClassVar[int] = Guard.batches  # Guard.batches
    aggregate_threads: ClassVar[int] = -1  # Scale.threads while the server combines a round (-1: `threads`)
    hf: ClassVar[bool] = False  # clients train the preset's Hugging Face twin under its own keys

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "Settings":
        """Read ``run_config`` (dashes or underscores); unknown keys are an error, values are coerced."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(
                    f"unknown run_config key {key!r}; known: {', '.join(sorted(k.replace('_', '-') for k in known))}"
                )
            typ = type(known[name].default)
            if typ is bool and isinstance(value, str):
                value = value.strip().lower() in ("1", "true", "yes", "on")
            values[name] = typ(value)
        s = cls(**values)
        s.validate()
        return s

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
        one_of(self.reduce, REDUCES, "reduce")
        one_of(self.universe_start, UNIVERSE_STARTS, "universe-start")
        one_of(self.ff_lift, FF_LIFTS, "ff-lift")
        one_of(self.ot_cost, OT_COSTS, "ot-cost")
        one_of(self.screen, ("none", *SCREENS), "screen")
        self.screen_options()
        one_of(self.partitioner, SCHEMES, "partitioner")
        one_of(self.local_optimizer, OPTIMIZERS, "local-optimizer")
        one_of(self.scaffold_variate, VARIATES, "scaffold-variate")
        if self.proximal_mu < 0 or self.server_lr < 0 or not 0 <= self.server_momentum < 1:
            raise ValueError(
                "proximal-mu and server-lr must be non-negative and server-momentum in [0, 1): got "
                f"{self.proximal_mu}, {self.server_lr}, {self.server_momentum}"
            )
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
        if self.reduce != "mean" and not can.reduce:
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
        if self.ff_lift != Universe.ff_lift and not can.mixed_widths:
            raise ValueError(
                f"ff-lift={self.ff_lift!r} lifts a narrower client into a mixed-width universe: strategies "
                f"{', '.join(names(mixed_widths=True))}, not {name}"
            )
        if self.universe_start != "previous" and not can.universe:
            raise ValueError(
                f"universe-start={self.universe_start!r} is where the aligned and refined strategies' universe "
                f"starts: strategies {', '.join(names(universe=True))}, not {name}"
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

    def on_clients(self) -> OnClients:
        """Where the refinement's gradients and the guard's losses come from for ``*-clients`` strategies."""
        return OnClients(
            clients_per_step=self.clients_per_step,
            batches_per_client=self.batches_per_client,
            samples_per_message=self.samples_per_message,
            check_clients=self.check_clients,
            timeout=min(OnClients.timeout, self.round_timeout),
            guard=self.guard,
        )

    def report_data(self, splits: Splits) -> Optional[Data]:
        """A data set on which the strategy records every reply's loss each round (None: no report)."""
        return None

    def apply_threads(self) -> None:
        """Set torch's intra-op threads when ``threads`` asks for it (in the app's own process)."""
        if self.threads > 0:
            torch.set_num_threads(self.threads)

    def to_run_config(self) -> dict[str, Any]:
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}

    def factors(self) -> list[float]:
        return [float(x) for x in self.width_factors.replace(" ", "").split(",") if x] or [1.0]

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


def client_config(s: Settings, partition_id: int, node_factor: Optional[float] = None) -> TransformerConfig:
    """The architecture a client trains: the global one at its width (node config ``width-factor`` wins
    over the run's ``width-factors`` list)."""
    base = global_model_config(s)
    factors = s.factors()
    f = node_factor if node_factor is not None else factors[partition_id % len(factors)]
    return width_config(base, f)


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
