"""The summary figures the pages write in prose, recomputed from their results files: each sentence must
say what its file says today (a rerun that moves a figure fails here until the sentence follows it).
The tables themselves are generated (``test_docs.test_the_generated_tables_are_their_results_files``)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _file(name: str) -> dict:
    return json.loads((ROOT / "results" / name).read_text())


def _page(name: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / name).read_text())


def _pct(x: float) -> str:
    return f"{round(100 * x)} %"


def _signed(x: float, digits: int = 4) -> str:
    """As the pages write a difference: −0.0017, +0.0013, 0.0000."""
    text = f"{x:+.{digits}f}"
    return text[1:] if float(text) == 0 else text.replace("-", "−")


def _lora(setting: str) -> dict:
    return _file(f"lora_{setting}.json")["rows"]


def _vs(rows: dict, row: str, ref: str = "average") -> tuple[float, list[float]]:
    """``row``'s final loss minus ``ref``'s: the mean, and per seed."""
    per = [a[-1] - b[-1] for a, b in zip(rows[row]["test_loss_per_seed"], rows[ref]["test_loss_per_seed"])]
    return rows[row]["final_loss"] - rows[ref]["final_loss"], per


def _relaxed_change(summary: dict) -> tuple[float, bool]:
    """Sinkhorn-learned against straight-through learned matching: the relative change of the mean barrier,
    and whether every pair moved the same way."""
    a, b = summary["learned"], summary["learned-sinkhorn"]
    change = b["barrier_mean"] / a["barrier_mean"] - 1
    return change, all((y < x) == (change < 0) for x, y in zip(a["barriers"], b["barriers"]))


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
    s10, s100, s500 = (_vs(_lora(f"speaker-r8-steps{n}"), "fedlmc")[1] for n in (10, 100, 500))
    small, alpha16 = _lora("small-gpt2-r4-steps200"), _lora("small-gpt2-r4-alpha16-steps200")
    speaker, iid = _lora("speaker-r8-steps100"), _lora("iid-r8-steps100")
    mixed = _lora("speaker-mixed-steps100")
    het = [a[-1] - b[-1] for a, b in zip(mixed["hetlora"]["test_loss_per_seed"], mixed["fedlmc"]["test_loss_per_seed"])]
    top2 = {k: mixed[k]["energy_shares"]["2"] for k in ("fedlmc", "hetlora", "flexlora", "fedrot-lora")}
    others = [v for k, v in top2.items() if k != "fedlmc"]
    lo, hi = lambda xs: _signed(max(xs), 3), lambda xs: _signed(min(xs), 3)  # noqa: E731 (closest to 0 first)
    app = _file("flowertune_gpt2.json")["runs"]
    first = [r["test_loss"]["lora"][0] - r["test_loss"]["fedavg"][0] for r in app]
    third = [r["test_loss"]["lora"][-1] - r["test_loss"]["fedavg"][-1] for r in app]
    se = statistics.stdev(third) / len(third) ** 0.5
    assert max(first) < 0  # "on every seed"
    pair = _file("bench_wm_gpt2_small.json")["runs"]
    level2 = {
        p: _file(f"reproduce_{p}.json")["summary"] for p in ("gpt2-tiny-relu", "neox-tiny", "vit-tiny", "llama-tiny")
    }
    sink = {p: _relaxed_change(s) for p, s in level2.items()}
    scales = [
        s["wm-orth-scale"]["barrier_mean"] / s["wm-orth-factored"]["barrier_mean"] - 1
        for s in level2.values()
        if "wm-orth-scale" in s
    ]
    scales += [
        s["learned-scale"]["barrier_mean"] / s["learned"]["barrier_mean"] - 1
        for s in level2.values()
        if "learned-scale" in s
    ]
    ff = {p: _file(f"universe_{p}.json")["rows"] for p in ("gpt2-tiny-relu", "llama-tiny")}
    ff_change = {
        p: (
            r["universe + FF scales"]["excess"] / r["universe"]["excess"] - 1,
            r["refined (α=1) + FF scales"]["excess"] / r["refined"]["excess"] - 1,
        )
        for p, r in ff.items()
    }
    scales += [x for pair in ff_change.values() for x in pair]
    assert max(abs(x) for x in scales) <= 0.05  # "move by 5 % or less"
    gn = [sink["gpt2-tiny-relu"][0], sink["neox-tiny"][0]]
    assert all(sink[p][1] for p in ("gpt2-tiny-relu", "neox-tiny", "vit-tiny", "llama-tiny"))  # "every pair"
    for p, s in level2.items():  # the relaxed merge: the lowest row on every pair
        rows = [v["barriers"] for v in s.values()]
        assert all(s["learned-relaxed"]["barriers"][i] <= min(r[i] for r in rows) for i in range(len(rows[0]))), p
    width = {r["d_model"]: r["barrier"] for r in _file("width_study_vit.json")["rows"]}
    control = {d: b["wm-orth-circuit"] / b["average-temperature"] for d, b in width.items()}
    calibrated = {d: 1 - b["average-temperature"] / b["average"] for d, b in width.items()}
    assert round(3 * calibrated[32]) == 1 and round(8 * calibrated[128]) == 1  # "a third", "an eighth"
    assert max(b["learned"] / b["average-temperature"] for b in width.values()) <= 0.15
    depths = _file("compare_depths_vit-tiny.json")["rows"]
    best = min(depths, key=lambda n: depths[n]["final_loss"][0])
    own = {n: r["returned_loss"][0] for n, r in depths.items()}
    assert best == "hetero-zeros" == min(own, key=own.get)  # "zero padding does best"
    assert max(own, key=own.get) == "local"  # "every federation leaves the 2-layer clients better off"
    one = _file("mixed_depths_gpt2-tiny.json")["triples"]
    within = sum(r["gap"] <= 0.005 for r in one)
    zeros = sum(r["4+6 zeros"]["test_loss"] < r["4+6"]["test_loss"] for r in one)
    tied = {f: _file(f"bench_hf_pair_{f}.json")["tied"] for f in ("gpt2", "opt")}
    for t in tied.values():  # "with no loss cost"
        assert abs(t["orthogonal"]["tied_midpoint_loss"] - t["orthogonal"]["untied_midpoint_loss"]) < 1e-3
    sci = lambda x: f"{x:.1e}".replace("e-0", "e-")  # noqa: E731  (3.7e-2, as the pages write it)
    return [
        (
            "docs/strategies.md",
            f"the 4 + 6 merge is within 0.005 of the 6 + 6 one, or below it, on {within} of {len(one)} triples "
            f"(mean gap {_signed(statistics.mean(r['gap'] for r in one))}); zero padding beats it on {zeros}",
        ),
        (
            "docs/models.md",
            f"the fit error was GPT-2 {sci(tied['gpt2']['orthogonal']['tie_fit_error'])}, "
            f"OPT {sci(tied['opt']['orthogonal']['tie_fit_error'])}, with no loss cost",
        ),
        (
            "docs/models.md",
            f"its midpoint was {tied['gpt2']['permutation']['tied_midpoint_loss']:.2f} against "
            f"{tied['gpt2']['orthogonal']['tied_midpoint_loss']:.2f} for the fitted orthogonal one",
        ),
        (
            "docs/results.md",
            f"an eighth at d = 128, {_pct(calibrated[256])} at d = 256. Weight matching's barrier is "
            f"{control[32]:.2f}× the control's at d = 32, {control[64]:.2f}× / {control[128]:.2f}× at d = 64 / 128, "
            f"but {control[256]:.2f}× at d = 256",
        ),
        (
            "docs/results.md",
            f"learned matching ends {_pct(-max(gn))[:-2]}–{_pct(-min(gn))} lower on GPT-2 and NeoX (every pair), "
            f"{_pct(-sink['vit-tiny'][0])} on ViT (every pair), "
            f"{_pct(sink['llama-tiny'][0])} higher on llama (every pair)",
        ),
        (
            "docs/results.md",
            f"FF scales lower the ReLU universe's excess by {_pct(-ff_change['gpt2-tiny-relu'][0])} and its "
            f"refinement's by {_pct(-ff_change['gpt2-tiny-relu'][1])}; on llama they raise the universe's by "
            f"{_pct(ff_change['llama-tiny'][0])} and lower the refinement's by {_pct(-ff_change['llama-tiny'][1])}",
        ),
        (
            "docs/performance.md",
            f"An independent pair takes about {pair['independent']['seconds_in_gemms']:.0f} GEMM references, a planted "
            f"one {pair['planted']['seconds_in_gemms']:.0f}, a near reply {pair['common']['seconds_in_gemms']:.0f}",
        ),
        (
            "docs/lora.md",
            f"It is ahead of FedIT after round 1 on every seed ({_signed(statistics.mean(first), 3)}); "
            f"by round 3 it is not better in the app ({_signed(statistics.mean(third))} ± {se:.4f} "
            f"over {len(third)} seeds, lower on {sum(x < 0 for x in third)})",
        ),
        (
            "docs/lora.md",
            f"in the harness (3 seeds: {' / '.join(_signed(x) for x in _vs(alpha16, 'fedlmc')[1])} at α 16)",
        ),
        ("docs/lora.md", f"(10 steps: {' / '.join(_signed(x) for x in s10)});"),
        (
            "docs/lora.md",
            f"ahead on every seed at 100 steps ({lo(s100)} to {hi(s100)}) and 500 ({lo(s500)} to {hi(s500)})",
        ),
        (
            "docs/lora.md",
            f"With no floor (`even`) the small gain halves ({_signed(_vs(small, 'fedlmc-even')[0])} against "
            f"{_signed(_vs(small, 'fedlmc-balanced')[0])}); dropping the tail leaves a third "
            f"({_signed(_vs(small, 'fedlmc-balanced-drop')[0])}); folding it adds most "
            f"({_signed(_vs(small, 'fedlmc-balanced-fold')[0])} small, "
            f"{_signed(_vs(speaker, 'fedlmc-fold')[0])} speaker)",
        ),
        (
            "docs/lora.md",
            f"`anchored` gains as much ({_signed(_vs(small, 'fedlmc-anchored')[0])}) and less with mixed ranks "
            f"({mixed['fedlmc-anchored']['final_loss']:.4f} against {mixed['fedlmc']['final_loss']:.4f})",
        ),
        (
            "docs/lora.md",
            f"within noise of FedIT everywhere ({_signed(_vs(speaker, 'fedrot-lora')[0])} speaker, "
            f"{_signed(_vs(iid, 'fedrot-lora')[0])} IID, {_signed(_vs(small, 'fedrot-lora')[0])} small)",
        ),
        (
            "docs/lora.md",
            f"trail FedIT (TIES {_signed(_vs(speaker, 'ties-lora')[0], 3)} speaker, "
            f"{_signed(_vs(iid, 'ties-lora')[0], 3)} IID; "
            f"Model Stock {_signed(_vs(speaker, 'model-stock-lora')[0], 2)}, "
            f"{_signed(_vs(iid, 'model-stock-lora')[0], 2)}); DARE (drop 0.9, survivors × 10) diverges over rounds "
            f"({speaker['dare-lora']['final_loss']:.2f} speaker)",
        ),
        (
            "docs/lora.md",
            f"`fedlmc` beats HetLoRA's zero-padding by {min(het):.3f}–{max(het):.3f} on every seed and FlexLoRA by "
            f"{mixed['flexlora']['final_loss'] - mixed['fedlmc']['final_loss']:.3f}",
        ),
        (
            "docs/lora.md",
            f"its top 2 components hold {_pct(top2['fedlmc'])} of the update's energy, against "
            f"{round(100 * min(others))}–{_pct(max(others))} for HetLoRA, FlexLoRA and FedRot-LoRA",
        ),
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
