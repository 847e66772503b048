"""The experiment layer: what only studies need, wrapped around the production apps.

``ExperimentSettings`` adds the experiment keys to the production ``Settings`` (their table is in
docs/federations.md); ``client_app`` / ``server_app`` are the production ClientApp and ServerApp built
with them. The ClientApp's training is wrapped (``experiment_fit``), so a deployed ClientApp has no
poisoning or caching code path:

* poisoning: one partition's client trains on shuffled labels, or sends a sign-flipped update;
* the client cache: a round-1 client of an independently started federation is trained once and
  reused by every strategy the comparison runner aggregates;
* the report: every round records each reply's, the plain average's and the aggregate's test loss;
* the refinement's tuning knobs: Dirichlet α and the stop-on-the-objective rule.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from clients.app import Round, fit
from clients.app import make_app as make_client_app
from fedlmc import provenance
from fedlmc.data import ArrayData, Data, Splits, TokenData
from fedlmc.data.partition import PARTITIONS_VERSION
from fedlmc.federated import Settings, doc, local_train
from fedlmc.options import Refinement, one_of
from fedlmc.strategies.registry import RUN_KEYS
from server.app import make_app as make_server_app


@dataclass
class ExperimentSettings(Settings):
    """``Settings`` plus the experiment keys (run_config ``poison-partition`` is ``poison_partition``)."""

    report: bool = doc(
        False,
        "every round records each reply's, the plain average's, the aggregate's and the clients' output "
        "ensemble's test loss",
    )
    client_cache: str = doc(
        "",
        "a directory: round-1 clients of an independently started federation are trained once and reused by "
        "every strategy",
    )
    poison_partition: int = doc(-1, "this partition's client is an attacker (-1: none)")
    poison: str = doc(
        "labels",
        "`labels` (trains on shuffled labels or tokens) or `sign-flip` (sends `start − poison-scale·update`)",
    )
    poison_scale: float = doc(1.0, "the sign-flipper's scale")
    refine_alpha: float = doc(Refinement.alpha, "the refinement's Dirichlet concentration (`Refinement.alpha`)")
    refine_check_every: int = doc(
        Refinement.check_every,
        "score the aggregate on held-out server batches every N refinement steps and keep the best "
        "(`Refinement.check_every`; 0: run every step)",
    )
    refine_patience: int = doc(
        Refinement.patience,
        "stop after this many checks without a significant improvement (`Refinement.patience`)",
    )
    refine_check_sigmas: float = doc(
        Refinement.check_sigmas,
        "an improvement: lower by more than this many standard errors (`Refinement.check_sigmas`; 0: any)",
    )
    form: str = doc(Settings.form, "`Universe.form`: `factored` (the clients' shape) or `circuit` (QK / OV products)")
    keep_layernorm: bool = doc(
        Settings.keep_layernorm,
        "`Universe.keep_layernorm`: the global model stays an ordinary LayerNorm model",
    )
    guard_batches: int = doc(Settings.guard_batches, "`Guard.batches`: how many batches the guard scores")
    aggregate_threads: int = doc(
        Settings.aggregate_threads,
        "`Scale.threads`: torch threads while the server combines a round (-1: `threads`; 0: every core while"
        " the clients wait)",
    )
    hf: bool = doc(
        Settings.hf,
        "the clients train the preset's Hugging Face twin (`GPT2LMHeadModel`, `ViTForImageClassification`, "
        "`LlamaForCausalLM`) under its own keys",
    )

    def validate(self) -> None:
        super().validate()
        one_of(self.poison, ("labels", "sign-flip"), "poison")

    def refinement(self, data) -> Refinement:
        return replace(
            super().refinement(data),
            alpha=self.refine_alpha,
            check_every=self.refine_check_every,
            patience=self.refine_patience,
            check_sigmas=self.refine_check_sigmas,
        )

    def report_data(self, splits: Splits) -> Optional[Data]:
        return splits.test if self.report else None


def shuffled_labels(data: Data, seed: int) -> Data:
    """A poisoned client's data: the labels (for text, the tokens) in a random order."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(data, TokenData):
        return TokenData(data.tokens[torch.randperm(len(data.tokens), generator=g)], data.block_size)
    return ArrayData(data.x, data.y[torch.randperm(len(data.y), generator=g)])


def flip_update(model: nn.Module, start: dict[str, torch.Tensor], scale: float) -> None:
    """A sign-flip attacker: replace the trained weights θ by ``start − scale·(θ − start)`` in place."""
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                v.copy_(start[k] - scale * (v - start[k]))


# What a client's round-1 training depends on (everything else only changes how the server aggregates).
TRAINING_KEYS = (
    "preset",
    "dataset",
    "data_dir",
    "text_file",
    "partitioner",
    "alpha",
    "local_epochs",
    "local_steps",
    "lr",
    "batch_size",
    "seed",
    "independent_start",
    "width_factors",
    "hf",
)


def cached_first_round(model: nn.Module, data: Data, s: ExperimentSettings, rnd: Round) -> Optional[dict[str, Any]]:
    """Round 1 of an independently started client, trained once per ``s.client_cache`` and reused: the
    comparison runner aggregates the very same clients with every strategy (training is seeded, so a
    rerun would produce them again, at 3× the cost). Returns the history, or None without a cache."""
    if not s.client_cache or not s.independent_start or rnd.round != 1:
        return None
    from safetensors.torch import load_file, save_file

    trained = {k: getattr(s, k) for k in TRAINING_KEYS}
    if s.poison_partition >= 0:  # only then part of the key, so unpoisoned caches stay valid
        trained.update(poison_partition=s.poison_partition, poison=s.poison, poison_scale=s.poison_scale)
    made = [rnd.partition, rnd.partitions, rnd.seed, model.config.to_dict(), PARTITIONS_VERSION[s.partitioner]]
    key = json.dumps(
        [trained, *made, provenance.code_hash(provenance.FEDERATION_CODE)],
        sort_keys=True,
        default=str,
    )
    path = Path(s.client_cache).expanduser() / hashlib.sha1(key.encode()).hexdigest()[:16]
    if (path / "model.safetensors").is_file() and (path / "history.json").is_file():
        model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
        provenance.reused(path)
        return json.loads((path / "history.json").read_text())
    hist = local_train(model, data, s, rnd.seed)
    path.mkdir(parents=True, exist_ok=True)
    # clone: a tied model's state dict shares one tensor between two keys, which safetensors refuses
    save_file(
        {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}, str(path / "model.tmp")
    )
    os.replace(path / "model.tmp", path / "model.safetensors")
    (path / "history.json").write_text(json.dumps({"train_loss": hist["train_loss"], "key": key}, default=float))
    return hist


def experiment_fit(model: nn.Module, data: Data, s: ExperimentSettings, rnd: Round) -> dict:
    """The ClientApp's ``fit`` with the experiment's poisoning and client cache around it."""
    poisoned = rnd.partition == s.poison_partition
    if poisoned and s.poison == "labels":
        data = shuffled_labels(data, rnd.seed)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()} if poisoned else None
    hist = cached_first_round(model, data, s, rnd) or fit(model, data, s, rnd)
    if poisoned and s.poison == "sign-flip":
        flip_update(model, start, s.poison_scale)
    return hist


def client_app(overrides: Optional[dict[str, Any]] = None) -> ClientApp:
    """The production ClientApp with the experiment's settings and training wrapper."""
    return make_client_app(overrides, ExperimentSettings, experiment_fit)


def server_app(
    overrides: Optional[dict[str, Any]] = None, after_round: Optional[Callable[[int], None]] = None
) -> ServerApp:
    """The production ServerApp with the experiment's settings (the report, the refinement's knobs)."""
    return make_server_app(overrides, after_round, ExperimentSettings)


RUN_KEYS.update(f.name.replace("_", "-") for f in fields(ExperimentSettings) if f.name != "strategy_keys")
