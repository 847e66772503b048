"""Every results file says how it was made (``fedlmc.provenance``): the record's fields, a commit that is
the checkout's (dirty when it differs outside ``results/``), the versions installed, the load measured
while it ran; a file nobody recorded says so, with the reason, and the tables built from it show it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlmc import provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "results").rglob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: str(p.relative_to(ROOT / "results")))
def test_every_results_file_carries_a_valid_provenance_record(path):
    doc = json.loads(path.read_text())
    assert provenance.validate(doc.get("provenance")) == []


def test_a_record_written_now_is_complete_and_true(tmp_path):
    out = provenance.write(tmp_path / "r.json", {"seeds": [0, 2], "figure": 1.5})
    prov = json.loads(out.read_text())["provenance"]
    assert provenance.validate(prov) == [] and "reason" not in prov
    assert prov["seeds"] == [0, 2] and prov["wall_seconds"] >= 0
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert prov["commit"] == head
    import flwr
    import torch

    assert prov["versions"]["torch"] == torch.__version__ and prov["versions"]["flwr"] == flwr.__version__
    assert prov["host"]["threads"] >= prov["host"]["cores"] >= 1
    assert prov["command"].startswith("python ") or prov["command"].startswith("pytest")


def test_dirty_is_a_change_outside_results(tmp_path):
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    run("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "start")
    (tmp_path / "results").mkdir()
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "results" / "r.json").write_text("{}")
    run("add", ".")
    run("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "files")
    (tmp_path / "results" / "r.json").write_text('{"new": 1}')
    clean = provenance.commit(tmp_path)
    assert clean["dirty"] is False and "diff_sha256" not in clean and len(clean["commit"]) == 40
    (tmp_path / "code.py").write_text("x = 2\n")
    dirty = provenance.commit(tmp_path)
    assert dirty["dirty"] is True and len(dirty["diff_sha256"]) == 64
    (tmp_path / "code.py").write_text("x = 3\n")
    assert provenance.commit(tmp_path)["diff_sha256"] != dirty["diff_sha256"]
    assert provenance.commit(tmp_path / "results") == provenance.commit(tmp_path)  # from anywhere inside
    outside = provenance.commit(Path("/"))
    assert outside["commit"] == "unknown" and outside["reason"]
    here = subprocess.run(  # by default, the checkout this fedlmc runs from, wherever the command started
        [sys.executable, "-c", "from fedlmc import provenance; print(provenance.commit()['commit'])"],
        cwd="/",
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert here == subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def test_the_command_is_the_one_a_user_types():
    assert provenance.command_line(["/x/.venv/bin/python3.11", "-m", "simulations", "lora", "--seeds", "0 1"]) == (
        "python -m simulations lora --seeds '0 1'"
    )
    assert provenance.command_line(["/x/bin/fedlmc", "reproduce", "--preset", "vit-tiny"]) == (
        "fedlmc reproduce --preset vit-tiny"
    )
    assert provenance.command_line(["/x/bin/python", "/x/bin/fedlmc", "demo"]) == "fedlmc demo"  # a console script


def test_an_unknown_field_needs_its_reason_and_malformed_fields_are_named():
    assert provenance.validate(None) == ["no provenance record"]
    full = provenance.unknown("made before records")
    assert provenance.validate(full) == []
    assert "unknown without a reason" in provenance.validate({**full, "reason": ""})[0]
    bad = {**provenance.record(seeds=[1]), "commit": "abc", "seeds": ["0"], "date": "yesterday"}
    problems = " ".join(provenance.validate(bad))
    assert "commit" in problems and "seeds" in problems and "date" in problems
    assert provenance.validate({k: v for k, v in full.items() if k != "load"}) == ["no 'load'"]


def test_the_load_is_other_processes_share_of_the_machine():
    """``others_cpu`` is the machine's busy share less this process tree's own, sample by sample (figures
    given here, so the check holds on a busy machine too); the thread samples on its own."""
    w = provenance.LoadWatch(every=3600)  # its thread waits: the samples below are the only ones
    w.stop()
    w.cpus, w._last = 4, (0.0, 10.0)
    w.sample(now=2.0, own=12.0, busy=0.75, loadavg=1.5)  # own: 2 s of CPU over 2 s of 4 CPUs = 0.25
    w.sample(now=4.0, own=12.0, busy=0.40, loadavg=2.5)  # own idle: all 0.40 is the others'
    w.sample(now=6.0, own=20.0, busy=0.90, loadavg=3.0)  # own 8 s over 2 s × 4 CPUs = 1.0 > busy: 0
    got = w.summary()
    assert got["samples"] == 3 and got["others_cpu_max"] == pytest.approx(0.5)
    assert got["others_cpu_mean"] == pytest.approx(0.3, abs=1e-3) and got["loadavg_max"] == 3.0
    live = provenance.LoadWatch(every=0.05)
    time.sleep(0.6)
    live.stop()
    real = live.summary()
    assert real["samples"] >= 3 and 0.0 <= real["others_cpu_mean"] <= 1.0 and real["loadavg_mean"] >= 0.0


def test_the_tables_say_how_their_files_were_made(tmp_path, monkeypatch):
    """A table's foot is its file's record: the commit and load when known, the mark when not."""
    import simulations.tables as tables

    known = {"rows": [], "provenance": provenance.record(seeds=[0])}
    unknown = {"rows": [], "provenance": provenance.unknown("made before records")}
    for doc, want in ((known, known["provenance"]["commit"][:10]), (unknown, "unknown")):
        monkeypatch.setattr(tables, "_load", lambda name, d=doc: d)
        text = tables.one("x.json", "python -m x", lambda d: "| a |\n|---|").markdown()
        assert want in text.splitlines()[-1], text


def test_verify_reruns_an_entry_and_says_which_figures_hold(tmp_path):
    """``python -m simulations verify``'s machinery on an entry whose command writes a known document: a
    figure within its tolerance says yes, one outside says no, a failed rerun is a failed row."""
    from simulations.verify import Entry, run_entry

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text(json.dumps({"a": 1.0, "b": 2.0}))
    write = "import json,sys; json.dump(dict(a=1.0005, b=2.5), open(sys.argv[1] + '/r.json', 'w'))"  # no braces
    entry = Entry("r.json", f"python -c {shlex.quote(write)} {{out}}", "r.json", lambda d: d, minutes=1)
    rows, _ = run_entry("e", entry, tmp_path / "scratch", tmp_path / "results")
    assert [(r[1], r[4]) for r in rows] == [("a", True), ("b", False)]
    broken = Entry("r.json", "python -c 'raise SystemExit(3)'", "r.json", lambda d: d, minutes=1)
    rows, _ = run_entry("f", broken, tmp_path / "scratch", tmp_path / "results")
    assert rows == [("r.json", "the rerun", "—", "failed (3)", False)]
