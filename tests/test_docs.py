"""The README and docs/ stay true to the code: every code block parses (Python, bash, TOML), every
relative link resolves, the run_config tables are ``Settings``' keys and defaults, and the pages
describe the product, not the history of its making."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
import tomllib

from fedlmc.federated import Settings
from simulations.experiment import ExperimentSettings

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
    ROOT / "bench" / "README.md",
]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
PROCESS = re.compile(
    r"\bissue \d+|\bsittings?\b|No GPU was lent|\b20\d\d-\d\d-\d\d\b|\bsession\b|"
    r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
    re.I,
)


def _blocks():
    for page in PAGES:
        for m in FENCE.finditer(page.read_text()):
            yield page.relative_to(ROOT), m.group(1), m.group(2)


@pytest.mark.parametrize(
    "page,lang,code", list(_blocks()), ids=lambda v: str(v)[:40] if isinstance(v, (str, Path)) else ""
)
def test_every_code_block_parses(page, lang, code):
    if lang == "python":
        ast.parse(code)
    elif lang == "bash":
        proc = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    elif lang == "toml":
        tomllib.loads(code)
    elif lang == "json":
        json.loads(code)
    else:
        assert lang in ("text", ""), f"{page}: a code block in {lang!r} that nothing checks"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_describe_the_product_not_its_history(page):
    found = [m.group(0) for m in PROCESS.finditer(page.read_text())]
    assert not found, found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if not re.match(r"[a-z]+://", target):
            assert (page.parent / target).exists(), target


def test_readme_is_a_short_users_guide():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def _table(section: str) -> dict[str, str]:
    """key -> default (as written) of the docs/federations.md table under ``section``."""
    text = (ROOT / "docs" / "federations.md").read_text()
    text = text[text.index(section) :]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| `([^`]*)` \|", text.split("\n\n|", 1)[1].split("\n\n")[0], re.M)
    return dict(rows)


def test_the_run_config_tables_are_the_settings():
    production = _table("## run_config keys")
    assert production == {f.name.replace("_", "-"): json.dumps(f.default) for f in fields(Settings)}
    base = {f.name for f in fields(Settings)}
    experiment = _table("### Experiment keys")
    assert experiment == {
        f.name.replace("_", "-"): json.dumps(f.default) for f in fields(ExperimentSettings) if f.name not in base
    }


def _cited_patterns() -> list[str]:
    """Every ``results/...`` path the pages name, braces expanded (``{md,json}``), ``*`` and ``<x>`` as globs."""
    import itertools

    text = "\n".join(p.read_text() for p in PAGES)
    out = []
    for token in re.findall(r"results/[\w.\-{},*<>/]+", text):
        token = re.sub(r"<[^>]*>", "*", token.rstrip(".,)"))
        parts = re.split(r"(\{[^}]*\})", token)
        choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
        out += ["".join(c) for c in itertools.product(*choices)]
    return out


def test_results_holds_only_files_the_docs_cite():
    import fnmatch

    patterns = _cited_patterns()
    files = [str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*") if p.is_file()]
    uncited = [
        f
        for f in files
        if not any(
            fnmatch.fnmatch(f, pat) or fnmatch.fnmatch(f, pat + ".*") or f.startswith(pat.rstrip("/") + "/")
            for pat in patterns
        )
    ]
    assert not uncited, uncited
    assert not [f for f in files if f.endswith(".log") or "_try" in f]
