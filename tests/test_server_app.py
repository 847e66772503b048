"""The ServerApp's round loop on a scripted Grid (no SuperLink, no Ray): what it writes when rounds
aggregate nothing, and what it leaves behind when it crashes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import metadata
from flwr.app import Error, Message

from fedlmc import io
from fedlmc.federated import Settings, global_model
from server.app import run_federation, serve


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """Messages take their run / node / task ids from the process's task identity (set by Flower's runtime)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)


class ScriptedGrid:
    """Just enough of ``flwr.serverapp.Grid`` for ``Strategy.start``: two nodes that answer every
    message with ``reply(message)`` (or raise ``fail``)."""

    def __init__(self, reply=None, fail: Exception | None = None) -> None:
        self.reply, self.fail, self.sent = reply, fail, 0

    def get_node_ids(self):
        return [1, 2]

    def send_and_receive(self, messages, timeout=None):
        if self.fail is not None:
            raise self.fail
        messages = list(messages)
        self.sent += len(messages)
        return [self.reply(m) for m in messages]


def node_unavailable(msg: Message) -> Message:
    """The reply the SuperLink makes for a node that stopped sending heartbeats."""
    md = metadata(msg.metadata.dst_node_id, message_id="", ttl=60.0)
    return Message(error=Error(code=5, reason="Node Unavailable"), metadata=md)


def _settings(out: Path, **kw) -> Settings:
    return Settings.from_run_config(
        {
            "strategy": "aligned",
            "preset": "vit-digits",
            "local-epochs": 30.0,
            "num-server-rounds": 2,
            "out-dir": str(out),
            "eval-batches": 2,
            **kw,
        }
    )


def test_rounds_that_aggregate_nothing_end_normally_with_the_initial_model(tmp_path):
    out = tmp_path
    s = _settings(out)
    grid = ScriptedGrid(reply=node_unavailable)
    doc = run_federation(grid, s)
    assert grid.sent == 4  # 2 rounds x 2 nodes
    assert "finished" in doc and [r["round"] for r in doc["rounds"]] == [0, 1, 2]
    for r in doc["rounds"][1:]:
        rec = r["strategy"]
        assert rec["kept"] == "previous" and sorted(f["node"] for f in rec["failures"]) == [1, 2]
        assert "Node Unavailable" in rec["failures"][0]["reason"]
    final = io.load(out / "final")
    initial = global_model(s)
    for k, v in initial.state_dict().items():
        assert torch.equal(final.state_dict()[k].float(), v.float()), k
    assert doc["rounds"][2]["test_loss"] == pytest.approx(doc["rounds"][0]["test_loss"])
    assert (out / "rounds.png").stat().st_size > 1000  # the per-round plot beside metrics.json


def test_the_summary_table_says_what_each_round_did():
    from server.summary import summary_table

    doc = {
        "settings": {"strategy": "aligned", "preset": "vit-digits"},
        "rounds": [
            {"round": 0, "test_loss": 2.3, "test_acc": 0.1},
            {
                "round": 1,
                "test_loss": 0.5,
                "test_acc": 0.91,
                "strategy": {
                    "align_seconds": 1.25,
                    "kept": "aligned",
                    "guard_aligned": 0.4,
                    "guard_average": 0.9,
                    "nodes": [1, 2, 3],
                    "excluded": [{"node": 4, "reason": "NaN"}],
                    "failures": [],
                },
            },
        ],
    }
    text = summary_table(doc)
    row = next(line for line in text.splitlines() if "0.9100" in line or "0.910" in line)
    assert "0.5000" in row and "1.25" in row and "aligned (Δ -0.500)" in row
    assert [c.strip() for c in row.split("│")[-4:-1]] == ["3", "1", "0"]  # replies, excluded, failed
    doc["rounds"][1]["strategy"] = {"kept": "slicing", "guard_aligned": 0.9, "guard_slicing": 0.7}  # mixed widths
    assert "slicing (Δ +0.200)" in summary_table(doc)


def test_a_crash_is_written_into_metrics_json(tmp_path):
    out = tmp_path
    grid = ScriptedGrid(fail=RuntimeError("the grid went away"))
    with pytest.raises(RuntimeError, match="went away"):
        serve(grid, _settings(out))  # what the ServerApp's main runs
    doc = json.loads((out / "metrics.json").read_text())
    assert "failed" in doc and "the grid went away" in doc["error"] and "finished" not in doc
    assert [r["round"] for r in doc["rounds"]] == [0]  # what was recorded before the crash is kept


def test_missing_data_in_a_federation_names_the_run_config_key(monkeypatch, tmp_path):
    """Before any client trains, one clear message: the run_config key to set, no CLI flag, and no place
    inside Flower's unpacked app folder; the run is recorded as failed."""
    from fedlmc.data import DataNotFound

    home = tmp_path / "flwr"
    monkeypatch.setenv("FLWR_HOME", str(home))
    monkeypatch.setenv("FEDLMC_DATA", str(tmp_path / "nowhere"))
    import fedlmc.data as data_mod

    # as inside a Flower run: the user's data-dir, $FEDLMC_DATA, and the app's unpacked copy's neighbours
    monkeypatch.setattr(
        data_mod, "search_dirs", lambda d=None: [Path(d), tmp_path / "nowhere", home / "apps" / "x" / "shared" / "data"]
    )
    out = tmp_path / "out"
    grid = ScriptedGrid(reply=node_unavailable)
    with pytest.raises(DataNotFound) as e:
        serve(grid, _settings(out, preset="vit-tiny", **{"data-dir": str(tmp_path / "mine")}))
    msg = str(e.value)
    assert "data-dir" in msg and "flwr run . -c" in msg and "--data-dir" not in msg
    assert str(tmp_path / "mine") in msg and str(home) not in msg
    assert grid.sent == 0  # nothing was sent to any client
    assert "MNIST not found" in json.loads((out / "metrics.json").read_text())["error"]
