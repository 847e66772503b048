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

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
    ROOT / "simulations" / "README.md",
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
    """The prose, that is: a generated table may name the commit and date its results file records."""
    from simulations.tables import prose

    found = [m.group(0) for m in PROCESS.finditer(prose(page.read_text()))]
    assert not found, found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if not re.match(r"[a-z]+://", target):
            assert (page.parent / target).exists(), target


def test_readme_is_a_short_users_guide():
    """At most 1,200 words, the chooser under a heading that says so, and the full strategy table only in
    docs/strategies.md."""
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1200, len(text.split())
    assert "## Which strategy\n" in text and "<!-- table: chooser -->" in text
    assert "<!-- table: strategies -->" not in text
    body = text[text.index("<!-- table: chooser -->") : text.index("<!-- /table -->", text.index("chooser"))]
    assert len([line for line in body.splitlines() if line.startswith("| ")]) <= 7  # the header and 6 rows


def test_the_apps_run_config_is_every_declared_key_at_its_default():
    """pyproject.toml's ``[tool.flwr.app.config]`` (what ``flwr run`` passes, and the only keys it lets a
    ``--run-config`` override) is the run's keys and every registered strategy's own keys, at their
    declared defaults (the main job's strategy list aside); the docs' key tables are generated from the
    same declarations."""
    from fedlmc.strategies.registry import all_keys

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    want = {f.name.replace("_", "-"): f.default for f in fields(Settings) if f.name != "strategy_keys"}
    want.update({k: key.default for k, key in all_keys().items()})
    assert set(config) == set(want)
    assert {k: v for k, v in config.items() if v != want[k] and k != "strategy"} == {}


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
    # the JSON behind the tables and the pictures the pages show; the tables hold what Markdown copies held
    assert not [f for f in files if not f.endswith((".json", ".png"))]
    shown = set(re.findall(r"results/([\w./-]+\.png)", "\n".join(p.read_text() for p in PAGES)))
    assert not [f for f in files if f.endswith(".png") and f[len("results/") :] not in shown]


# ---- the generated tables, the pages' length, and the snippets that build strategies ------------------


def test_the_generated_tables_are_their_results_files():
    """Every ``<!-- table: NAME -->`` block is what ``python -m simulations.tables`` renders from the results
    files today (rerun it after a bench), and every name is known."""
    from simulations.tables import PAGES as TABLE_PAGES
    from simulations.tables import regenerate

    stale = [str(p.relative_to(ROOT)) for p in TABLE_PAGES if regenerate(p.read_text()) != p.read_text()]
    assert not stale, f"run `python -m simulations.tables`: {stale}"


def _prose(page: Path) -> str:
    """What a page's authors wrote: the page without its generated tables and code blocks."""
    from simulations.tables import prose

    return FENCE.sub("", prose(page.read_text()))


def test_the_docs_are_a_guide_not_a_notebook():
    """docs/ holds at most 12,000 words of prose besides its generated tables and code, and no prose line
    is over 110 characters (table rows aside): the budget is met by saying less, not by longer lines."""
    pages = sorted((ROOT / "docs").glob("*.md"))
    words = sum(len(_prose(p).split()) for p in pages)
    assert words <= 12000, words
    long = [
        (p.name, line[:60])
        for p in [*pages, ROOT / "README.md"]
        for line in _prose(p).splitlines()
        if len(line) > 110 and not line.lstrip().startswith("|")
    ]
    assert not long, long


def test_the_gpu_table_reads_a_successful_check_as_well_as_a_failed_one():
    """``make gpu-check``'s file renders whether its paper step finished (barriers beside the paper's)
    or stopped (the error's last line), with the suite's counts either way."""
    from simulations.tables import gpu

    failed = json.loads((ROOT / "results/gpu/gpu_check.json").read_text())
    assert "not measured:" in gpu(failed) and f"{failed['tests']['passed']} passed" in gpu(failed)
    ok = {
        **failed,
        "paper": {
            "trained": failed["paper"]["trained"],
            "barriers": {
                "average": {"ours": 2.01, "se": 0.05, "paper": 2.02},
                "learned": {"ours": 0.03, "se": 0.01, "paper": 0.02},
            },
            "per_pair": [{"average": 2.0, "learned": 0.03}] * 3,
        },
        "tests": {**failed["tests"], "passed": 230, "failed": 0, "errors": 0},
    }
    table = gpu(ok)
    assert "| barrier, average | 2.010 ± 0.050 (pairs 2.000, 2.000, 2.000); the paper's 2.02 |" in table
    assert "230 passed, 0 failed, 0 collection errors" in table and "not measured" not in table


def test_every_lab_entry_is_listed():
    """Every runnable script of the lab is an entry of ``python -m simulations`` (the tables, the
    experiment layer the ClientApp reads and the one-run subprocess are its parts, not entries)."""
    from simulations.__main__ import BENCHES

    parts = {"tables", "experiment", "simulate"}
    scripts = {p.stem for p in (ROOT / "simulations").glob("*.py") if not p.stem.startswith("_")} - parts
    assert scripts == set(BENCHES)


SNIPPET_PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
]


def _snippets():
    for page in SNIPPET_PAGES:
        for m in FENCE.finditer(page.read_text()):
            if m.group(1) == "python":
                yield page.relative_to(ROOT), m.group(2)


@pytest.fixture(scope="module")
def names():
    """What the snippets call their inputs: tiny models of every kind, data, a grid of two nodes."""
    import torch
    import transformers
    from flwr.serverapp.strategy import FedAvg
    from peft import LoraConfig, get_peft_model

    from fedlmc.data import ArrayData
    from fedlmc.models import from_preset
    from fedlmc.strategies import AlignedFedAvg, LoraFedAvg

    torch.manual_seed(0)
    kw = dict(n_layer=1, d_model=16, n_head=2, d_ff=32, image_size=8, patch_size=4)
    a, b = (from_preset("vit-tiny", **kw) for _ in range(2))
    half = from_preset("vit-tiny", **{**kw, "d_model": 8, "d_ff": 16})
    data = ArrayData(torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,)))
    gpt2 = lambda: transformers.GPT2LMHeadModel(  # noqa: E731
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    )
    peft_model = get_peft_model(gpt2(), LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"]))

    from test_flower_contract import Grid

    return {
        "model": gpt2(),
        "config": a.config.to_dict(),
        "peft_model": peft_model,
        "grid": Grid(nodes=2, step=0.0),  # two nodes that send back what they get
        "val": data,
        "train_data": data,
        "x_val": data.x,
        "y_val": data.y,
        "a": a,
        "b": b,
        "models": [a, b],
        "weights": [1.0, 2.0],
        "wide": a,
        "half": half,
        "my_held_out_examples": lambda context: (data.x, data.y),
        "FedAvg": FedAvg,
        "AlignedFedAvg": AlignedFedAvg,
        "LoraFedAvg": LoraFedAvg,
        "fraction": 1.0,
    }


@pytest.mark.parametrize("page,code", list(_snippets()), ids=lambda v: str(v)[:50] if isinstance(v, Path) else "")
def test_every_python_snippet_runs(page, code, names, monkeypatch):
    """Each Python block of the README, docs/ and the examples runs as written, on tiny models; every
    public function it defines is called when its parameters are inputs the snippets name
    (``run(grid, model)`` runs the strategy on two nodes that send back what they get). So a strategy
    built with a wrong parameter cannot ship in the docs."""
    import inspect

    from flwr.supercore.task_identity import TaskIdentity

    from fedlmc.strategies.registry import REGISTRY

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1, raising=False)
    registered = set(REGISTRY)
    scope = dict(names)
    if "flowertune" in str(page):
        scope["model"] = names["peft_model"]
    try:
        exec(compile(code, str(page), "exec"), scope)
        for name, fn in list(scope.items()):
            mine = inspect.isfunction(fn) and fn.__code__.co_filename == str(page)
            if mine and not name.startswith("_") and name not in names:
                params = list(inspect.signature(fn).parameters)
                if params and all(p in names for p in params):
                    fn(*(names["peft_model"] if p == "peft_model" else scope.get(p, names[p]) for p in params))
    finally:
        for name in set(REGISTRY) - registered:
            REGISTRY.pop(name)


CALL = re.compile(r"`(?P<call>(?P<name>[A-Z]\w*)\((?P<args>[^`]*)\))`")


def _constructor_scope(names) -> dict:
    """What a constructor cell may name: fedlmc's strategies and options, Flower's strategies, and its
    inputs (``model``: the clients' model or its config, ``data``: a small data set at the server,
    ``peft_model``: a PEFT model), as docs/strategies.md says."""
    import flwr.serverapp.strategy as flower

    import fedlmc.baselines as baselines
    import fedlmc.options as options
    import fedlmc.strategies as strategies

    scope = {k: getattr(flower, k) for k in dir(flower) if k[:1].isupper()}
    scope.update({k: getattr(options, k) for k in dir(options) if k[:1].isupper()})
    scope.update({k: getattr(strategies, k) for k in strategies.__all__})
    scope.update({k: getattr(baselines, k) for k in baselines.__all__})
    scope.update(model=names["config"], data=names["train_data"], peft_model=names["peft_model"])
    return scope


def _cells():
    for page in SNIPPET_PAGES:
        for m in CALL.finditer(page.read_text()):
            yield page.relative_to(ROOT), m.group("call")


@pytest.mark.parametrize("page,call", sorted(set(_cells())), ids=lambda v: str(v)[:60])
def test_every_constructor_cell_runs(page, call, names):
    """Every strategy or option constructor written in backticks in the README and docs (the strategy
    table's cells included) builds, as written, with the inputs the docs name."""
    scope = _constructor_scope(names)
    head = call.split("(", 1)[0]
    if head not in scope:
        return  # not a constructor of ours or Flower's (e.g. a model class of transformers)
    assert "..." not in call and "…" not in call, f"{page}: `{call}` is not a call one can run"
    eval(call, scope)  # noqa: S307 -- the docs' own cells


def test_every_registered_example_builds_its_strategy(names):
    """Each registration's constructor call (the strategy table's "in your Flower app") builds a strategy
    of the class the registration's builder builds."""
    from fedlmc.federated import Settings, global_model, splits_for
    from fedlmc.strategies.registry import REGISTRY
    from strategies.factory import build_strategy

    scope = _constructor_scope(names)
    for name, r in REGISTRY.items():
        assert r.example, f"{name} has no constructor example"
        built = eval(r.example, scope)  # noqa: S307
        run = {"strategy": name, "preset": "vit-digits"}
        if r.can.mixed_widths:
            run["width-factors"] = "1,2"
        s = Settings.from_run_config(run)
        model = global_model(s)
        assert type(built) is type(build_strategy(s, model.config, splits_for(s))), name


def test_the_example_apps_quoted_run_config_is_the_benchs_setting():
    """docs/lora.md quotes the example app's figures with the `-c` overrides that run the app at the
    bench's setting: Flower parses them, over the app's defaults, into exactly the bench's config."""
    import sys

    import tomllib
    from flwr.common.config import parse_config_args

    sys.path.insert(0, str(ROOT / "simulations"))
    from simulations.flowertune_app import app_config, run_config_for

    cfg = json.loads((ROOT / "results" / "flowertune_gpt2.json").read_text())["config"]
    quoted = re.search(r'flowertune-gpt2 -c "([^"]+)"', (ROOT / "docs" / "lora.md").read_text()).group(1)
    assert quoted == run_config_for(cfg)
    defaults = tomllib.loads((ROOT / "examples" / "flowertune-gpt2" / "pyproject.toml").read_text())
    ran = {**defaults["tool"]["flwr"]["app"]["config"], **parse_config_args([quoted])}
    assert {k: v for k, v in ran.items() if k not in ("strategy", "seed")} == {
        k: v for k, v in cfg.items() if k not in ("strategy", "seed")
    }
    assert app_config({}) == {**ran, "strategy": app_config({})["strategy"], "seed": app_config({})["seed"]}
