"""Several strategies side by side on the same clients: one round of training, every strategy
aggregates the very same replies, and each aggregate is scored on the test split.

What it writes under ``<out-dir>``: ``summary.json`` (per strategy: ``test_loss``, ``test_acc``,
``aggregation_seconds``, what it kept; and the clients' own test losses), ``metrics.json`` (the
settings, the clients, each strategy's round record), ``comparison.png`` and ``final/<strategy>/``
(each aggregate, safetensors + JSON).
"""

from __future__ import annotations

import time
from dataclasses import replace
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedlmc import io
from fedlmc.federated import Settings, evaluate_model, global_model, splits_for
from fedlmc.hf import hf_model_for
from fedlmc.strategies.records import state_arrays
from strategies.factory import build_strategy

from .summary import comparison_table, plot_comparison


def run_comparison(grid: Grid, s: Settings, write_json) -> dict[str, Any]:
    """Train the clients once (round 1), aggregate their replies with every strategy in ``s.strategy``,
    score each aggregate; returns the summary document."""
    s.apply_threads()
    splits, model = splits_for(s), global_model(s)
    out = Path(s.out_dir).expanduser()
    client_model = hf_model_for(model.config, s.seed) if s.hf else None
    strategies = {
        name: build_strategy(replace(s, strategy=name), model.config, splits, client_model) for name in s.strategies()
    }
    initial = ArrayRecord(client_model.state_dict()) if s.hf else state_arrays(model)
    first = next(iter(strategies.values()))
    first.check_architecture(initial)
    log(
        INFO,
        "fedlmc: %s side by side on %s (%s, %s partitions): training the clients once",
        ", ".join(strategies),
        s.preset,
        splits.summary(),
        s.partitioner,
    )
    t0 = time.time()
    messages = list(first.configure_train(1, initial, ConfigRecord({}), grid))
    replies = list(grid.send_and_receive(messages, timeout=s.round_timeout))
    train_seconds = time.time() - t0
    accepted = first.accept(1, replies)
    if accepted is None:
        raise RuntimeError(f"no valid reply to compare: {len(replies)} replies, see the log for why each was excluded")
    _, models, _ = accepted
    clients = [evaluate_model(m, splits.test, s.eval_batches)["loss"] for m in models]
    doc: dict[str, Any] = {
        "settings": s.to_run_config(),
        "train_seconds": train_seconds,
        "client_test_losses": clients,
        "mean_client_test_loss": sum(clients) / len(clients),
        "strategies": {},
    }
    records: dict[str, Any] = {}
    for name, strategy in strategies.items():
        t = time.time()
        arrays, _ = strategy.aggregate_replies(1, replies, initial, grid=grid)
        seconds = time.time() - t
        arrays = arrays if arrays is not None and len(arrays) > 0 else initial
        merged = strategy.model_of(arrays)
        ev = evaluate_model(merged, splits.test, s.eval_batches)
        record = strategy.history[-1] if strategy.history else {}
        records[name] = record
        doc["strategies"][name] = {
            "test_loss": ev["loss"],
            "test_acc": ev["acc"],
            "aggregation_seconds": seconds,
            "kept": record.get("kept", "previous model"),
        }
        log(
            INFO,
            "fedlmc: %s: test loss %.4f, accuracy %.3f (aggregated in %.2f s)",
            name,
            ev["loss"],
            ev["acc"],
            seconds,
        )
        io.save(merged, out / "final" / name, {"preset": s.preset, "strategy": name, "test": ev})
    write_json(out / "summary.json", doc)
    write_json(
        out / "metrics.json",
        {"settings": s.to_run_config(), "rounds": [], "comparison": records, "finished": time.time()},
    )
    png = plot_comparison(doc, out / "comparison.png")
    for line in comparison_table(doc).splitlines():
        log(INFO, "%s", line)
    log(INFO, "fedlmc: results in %s (table), %s (plot), %s (each aggregate)", out / "summary.json", png, out / "final")
    return doc
