"""The summary figures the pages write in prose, recomputed from their results files: each sentence must
say what its file says today (a rerun that moves a figure fails here until the sentence follows it).
The tables themselves are generated (``test_docs.test_the_generated_tables_are_their_results_files``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _file(name: str) -> dict:
    return json.loads((ROOT / "results" / name).read_text())


def _page(name: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / name).read_text())


def _pct(x: float) -> str:
    return f"{round(100 * x)} %"


def _run(doc: dict, m: int, strategy: str) -> dict:
    return next(r for r in doc["runs"] if r["M"] == m and r["strategy"] == strategy)


def _claims():
    vit, gpt2 = _file("reproduce_vit-tiny.json")["summary"], _file("reproduce_gpt2-tiny.json")["summary"]
    ratio = lambda s, m: s[m]["barrier_mean"] / s["average"]["barrier_mean"]  # noqa: E731
    uv, ug = _file("universe_vit-tiny.json")["rows"], _file("universe_gpt2-tiny.json")["rows"]
    scale = _file("bench_universe_scale_amd_curve.json")
    par = _run(scale, 64, "aligned-parallel+min-gain+at-arrival")
    fedavg = _run(scale, 64, "fedavg")
    full = _file("lora_full-speaker-steps100.json")["rows"]
    ref = full["fedavg"]
    behind = [a[-1] - b[-1] for a, b in zip(full["aligned"]["test_loss_per_seed"], ref["test_loss_per_seed"])]
    more = {m: full[m]["final_loss"] - ref["final_loss"] for m in ("ties", "model-stock", "dare")}
    fold = _file("lora_speaker-r8-steps100.json")["rows"]["fedlmc-fold"]
    return [
        (
            "docs/lora.md",
            f"FedAvg is best ({ref['final_loss']:.4f}), `aligned` behind it on all {len(behind)} seeds "
            f"(+{min(behind):.4f} to +{max(behind):.4f}), TIES +{more['ties']:.3f}, Model Stock "
            f"+{more['model-stock']:.3f}, DARE +{more['dare']:.3f}; it beats every adapter (`fedlmc-fold` "
            f"{fold['final_loss']:.4f}) at {ref['bytes_up_per_round'] / fold['bytes_up_per_round']:.1f}× the bytes",
        ),
        (
            "docs/results.md",
            f"On ViT, weight matching removes {_pct(1 - ratio(vit, 'wm-orth-factored'))} of the barrier and "
            f"learned matching {_pct(1 - ratio(vit, 'learned'))};",
        ),
        (
            "docs/results.md",
            f"weight matching leaves {ratio(gpt2, 'wm-orth-factored'):.2f}× of the averaging barrier",
        ),
        ("docs/results.md", f"learned matching {ratio(gpt2, 'learned'):.2f}×. Rotating the residual stream"),
        (
            "docs/results.md",
            f"The universe alone removes {_pct(1 - uv['universe']['ratio'])} of averaging's excess on ViT but only "
            f"{_pct(1 - ug['universe']['ratio'])} on GPT-2; the refinement brings both to "
            f"{uv['refined (α=1)']['ratio']:.2f}–{ug['refined (α=1)']['ratio']:.2f}×",
        ),
        (
            "docs/performance.md",
            f"A round of 64 common replies takes {par['seconds'] / fedavg['seconds']:.1f}× FedAvg's on the same "
            f"files with two worker processes, at {par['seconds_per_reply_iteration']:.1f} s per reply-iteration, "
            f"the server holding about {par['peak_rss_gb']:.1f} GB ({par['peak_rss_in_models']:.0f} models)",
        ),
    ]


@pytest.mark.parametrize("page,sentence", _claims(), ids=lambda x: x[:60] if isinstance(x, str) else None)
def test_the_summary_sentence_says_what_its_file_says(page, sentence):
    assert sentence in _page(page), f"{page} should say: {sentence}"
