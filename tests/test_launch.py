"""``fedlmc run`` hands ``flwr run`` a staged copy of the app (``fedlmc.flower.launch.staged_app``): the FAB
built from it is Flower's own, byte for byte, and the folders ``.gitignore`` names (a checkout's
``.venv``) are never walked."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from fedlmc.flower import launch

ROOT = Path(__file__).resolve().parents[1]
# Flower's FAB rules are pathspec "gitwildmatch" patterns, which pathspec now calls deprecated
pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")


def _app(tmp_path: Path) -> Path:
    """The quickstart example with what a checkout has beside it: a virtual environment, run outputs,
    weights, a symbolic link, none of which a FAB holds."""
    app = tmp_path / "app"
    shutil.copytree(ROOT / "examples" / "quickstart", app)
    (app / ".gitignore").write_text(".venv/\nruns/\n*.safetensors\n__pycache__/\n")
    for i in range(3):
        (app / ".venv" / "lib" / f"pkg{i}").mkdir(parents=True)
        (app / ".venv" / "lib" / f"pkg{i}" / "mod.py").write_text("x = 1\n")
    (app / "runs").mkdir()
    (app / "runs" / "metrics.json").write_text("{}")
    (app / "quickstart" / "weights.safetensors").write_bytes(b"\0" * 64)
    (app / "quickstart" / "extra.py").write_text("# part of the app\n")
    os.symlink(app / "quickstart" / "task.py", app / "quickstart" / "linked.py")
    return app


def test_the_staged_app_builds_flowers_own_fab_and_skips_ignored_folders(tmp_path, monkeypatch):
    app = _app(tmp_path)
    walked: list[str] = []
    real_walk = os.walk

    def recording_walk(top, *a, **k):
        for folder, dirs, files in real_walk(top, *a, **k):
            walked.append(folder)
            yield folder, dirs, files

    monkeypatch.setattr(launch.os, "walk", recording_walk)
    with launch.staged_app(app) as stage:
        staged = build_fab_from_disk(stage)
        held = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file())
    monkeypatch.undo()
    assert staged == build_fab_from_disk(app)  # what `flwr run app` would have sent, to the byte
    assert "quickstart/extra.py" in held and "quickstart/linked.py" not in held
    assert not any(".venv" in f or "runs" in Path(f).parts for f in walked), walked
    assert not stage.exists()  # removed after the run


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").iterdir() if p.is_dir()))
def test_every_example_app_stages_to_the_same_fab(example):
    app = ROOT / "examples" / example
    with launch.staged_app(app) as stage:
        assert build_fab_from_disk(stage) == build_fab_from_disk(app)


def test_stop_tree_returns_once_the_tree_is_gone_and_kills_what_ignores_sigterm():
    """A tree that exits on SIGTERM is stopped without waiting out the grace period; a child that ignores
    SIGTERM is killed after it."""
    import subprocess
    import time

    def started(proc: subprocess.Popen) -> list[int]:
        end = time.monotonic() + 10  # a busy machine may take a while to start the shell's child
        while len(launch.process_tree(proc.pid)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        return launch.process_tree(proc.pid)

    polite = subprocess.Popen(["bash", "-c", "sleep 60 & wait"], start_new_session=True)
    tree = started(polite)
    t0 = time.monotonic()
    launch.stop_tree(polite.pid, grace=5.0)
    assert time.monotonic() - t0 < 2.0
    polite.wait(timeout=5)
    assert not any(launch._alive(p) for p in tree)

    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 60 & wait; sleep 60"], start_new_session=True)
    tree = started(stubborn)
    assert len(tree) == 2
    launch.stop_tree(stubborn.pid, grace=0.5)
    stubborn.wait(timeout=5)
    time.sleep(0.2)
    assert not any(launch._alive(p) for p in tree)
