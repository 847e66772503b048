"""fedlmc ServerApp: a federation driven by ``run_config`` (see ``fedlmc.federated.Settings``).

Per round it writes ``<out-dir>/metrics.json`` (test loss/accuracy of the global model, round wall
time, what the strategy did: alignment seconds, distances from identity, guard decisions, client /
plain / aggregate losses, excluded replies) and the whole server state to ``<out-dir>/state``
(atomically; ``resume=true`` continues from it), and at the end the global model to
``<out-dir>/final`` (safetensors + JSON).
"""

from __future__ import annotations

import json
import os
import time
from logging import INFO
from pathlib import Path
from typing import Any, Callable, Optional

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from fedlmc import io
from fedlmc.federated import Settings, client_config, evaluate_model, global_model, splits_for
from fedlmc.hf import hf_model_for
from fedlmc.scale.allocator import retain_freed_memory
from fedlmc.strategies.checkpoint import load_state, save_state
from fedlmc.strategies.records import state_arrays
from strategies.factory import build_strategy

from .summary import plot_rounds, summary_table


class Recorder:
    """Collects one record per round and rewrites ``metrics.json`` atomically after each."""

    def __init__(self, path: Path, settings: Settings) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"settings": settings.to_run_config(), "rounds": [], "started": time.time()}
        self._last = time.time()
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, rnd: int, test: dict[str, float], strategy_record: Optional[dict[str, Any]]) -> None:
        now = time.time()
        rec = {
            "round": rnd,
            "test_loss": test["loss"],
            "test_acc": test["acc"],
            "round_seconds": (now - self._last) if rnd > 0 else 0.0,
        }
        if test.get("returned"):  # the smaller clients' own models (mixed widths or depths)
            rec["returned_test_loss"] = test["returned"]
        if strategy_record:
            rec["strategy"] = strategy_record
        self._last = now
        self.doc["rounds"].append(rec)
        self.save()

    def save(self) -> None:
        write_json(self.path, self.doc)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Replace ``path`` by ``doc`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=float))
    os.replace(tmp, path)


def returned_losses(strategy, global_now, s: Settings, splits, nodes: int) -> dict[str, Any]:
    """In a federation of several widths or depths, the test loss of the model each smaller client is
    returned (partitions 0 .. nodes − 1, each of the architecture its partition gets): what it trains
    from next round, and what it would deploy."""
    if all(f == 1 for f in s.factors()) and all(f == 1 for f in s.depth_list()):
        return {}
    out = {}
    for pid in range(nodes):
        cfg = client_config(s, pid)
        if cfg.n_layer == global_now.config.n_layer and cfg.d_model == global_now.config.d_model:
            continue
        model = strategy.returned_model(global_now, pid, cfg)
        out[str(pid)] = evaluate_model(model, splits.test, s.eval_batches)["loss"]
    return {"returned": out} if out else {}


def run_federation(grid: Grid, s: Settings, after_round: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """Run ``s.num_server_rounds`` rounds of ``s.strategy`` on ``grid``; returns the metrics document.
    ``after_round(r)`` is called once round r's state is saved (tests use it to crash the server)."""
    s.apply_threads()
    splits = splits_for(s)
    model = global_model(s)
    out = Path(s.out_dir).expanduser()
    client_model = hf_model_for(model.config, s.seed) if s.hf else None  # the clients' Hugging Face twin
    strategy = build_strategy(s, model.config, splits, client_model)
    recorder = Recorder(out / "metrics.json", s)
    initial, done = (ArrayRecord(client_model.state_dict()) if s.hf else state_arrays(model)), 0
    state = load_state(out / "state") if s.resume else None
    if state is not None:
        done, initial = state.round, state.arrays
        strategy.load_state(
            {
                **state.extra,
                "global_config": state.global_config,
                "history": state.history,
                "transforms": state.transforms,
            },
            round_offset=done,
        )
        recorder.doc = state.metrics
        recorder.doc.pop("finished", None)
        log(INFO, "fedlmc: resuming from %s after round %d of %d", out / "state", done, s.num_server_rounds)
    elif s.resume:
        log(INFO, "fedlmc: resume requested but %s holds no state: starting from round 1", out / "state")
    log(
        INFO,
        "fedlmc: %s on %s (%s, %s partitions), %d rounds → %s",
        type(strategy).__name__,
        s.preset,
        splits.summary(),
        s.partitioner,
        s.num_server_rounds,
        out,
    )

    def evaluate_fn(rnd: int, arrays) -> MetricRecord:
        real = rnd + done
        global_now = strategy.model_of(arrays)
        ev = evaluate_model(global_now, splits.test, s.eval_batches)
        if rnd == 0 and done:  # the resumed model was scored when its round ended
            return MetricRecord({"test-loss": ev["loss"], "test-acc": ev["acc"]})
        if real > 0 and not s.hf:
            ev.update(returned_losses(strategy, global_now, s, splits, len(grid.get_node_ids())))
        hist = strategy.history[-1] if real > 0 and strategy.history and strategy.history[-1]["round"] == real else None
        recorder.add(real, ev, hist)
        if real > 0:
            save_state(out / "state", real, arrays, strategy, recorder.doc)
            if after_round is not None:
                after_round(real)
        return MetricRecord({"test-loss": ev["loss"], "test-acc": ev["acc"]})

    remaining = s.num_server_rounds - done
    if remaining <= 0:
        log(INFO, "fedlmc: all %d rounds already done", s.num_server_rounds)
        return recorder.doc
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=remaining,
        # FedProx's proximal term for any strategy's clients (fedlmc's ClientApp reads it, as Flower's FedProx sends it)
        train_config=ConfigRecord({"proximal-mu": s.proximal_mu} if s.proximal_mu > 0 else {}),
        evaluate_config=ConfigRecord({}),
        timeout=s.round_timeout,
        evaluate_fn=evaluate_fn,
    )
    # Flower's Result holds arrays only from a round that aggregated something: when every round kept
    # the previous model (no valid reply), the run's final model is the one it started from.
    arrays = result.arrays if len(result.arrays) > 0 else initial
    final = strategy.model_of(arrays)
    final.meta = {
        "dataset": splits.name,
        "preset": s.preset,
        **{k: v for k, v in splits.meta.items() if k in ("chars", "block_size", "source")},
    }
    io.save(
        final,
        out / "final",
        {
            **final.meta,
            "settings": s.to_run_config(),
            "test": recorder.doc["rounds"][-1] if recorder.doc["rounds"] else None,
        },
    )
    recorder.doc["finished"] = time.time()
    recorder.save()
    png = plot_rounds(recorder.doc, out / "rounds.png")
    for line in summary_table(recorder.doc).splitlines():
        log(INFO, "%s", line)
    log(
        INFO, "fedlmc: results in %s (per round), %s (plot), %s (final model)", out / "metrics.json", png, out / "final"
    )
    return recorder.doc


def make_app(
    overrides: Optional[dict[str, Any]] = None,
    after_round: Optional[Callable[[int], None]] = None,
    settings: type[Settings] = Settings,
) -> ServerApp:
    """A ServerApp whose settings default to ``overrides`` (run_config keys win). ``flwr run`` uses
    ``app``; the experiment layer (``simulations.experiment``) builds one with its own ``settings``."""
    overrides = dict(overrides or {})
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        retain_freed_memory()  # aggregation's temporaries: reuse freed pages (fedlmc.scale.allocator)
        serve(grid, settings.from_run_config({**overrides, **context.run_config}), after_round)

    return server


def serve(grid: Grid, s: Settings, after_round: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """``run_federation`` (or, when ``s.strategy`` names several, ``run_comparison``: each aggregates the
    same replies); if it raises, the error is first written into ``<out-dir>/metrics.json``."""
    try:
        if len(s.strategies()) > 1:
            from .comparison import run_comparison

            return run_comparison(grid, s, write_json)
        return run_federation(grid, s, after_round)
    except BaseException as e:
        record_failure(Path(s.out_dir).expanduser() / "metrics.json", e)
        raise


def record_failure(path: Path, error: BaseException) -> None:
    """Write the ServerApp's error into ``metrics.json`` (``failed``, ``error``), so whoever started the
    run sees it: ``flwr run`` itself exits 0 when the ServerApp crashes (``fedlmc.flower.launch`` checks)."""
    import traceback

    try:
        doc = json.loads(path.read_text()) if path.is_file() else {"rounds": []}
    except ValueError:
        doc = {"rounds": []}
    doc.pop("finished", None)
    doc["failed"] = time.time()
    doc["error"] = "".join(traceback.format_exception(error)).strip()[-4000:]
    write_json(path, doc)


app = make_app()
