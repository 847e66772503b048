"""Pairwise barriers of two independently trained Hugging Face models, by the reproduction protocol
(`fedlmc reproduce`: the matching preset's training budget, test split, learned matching 300 steps
from weight matching): averaging, weight matching, learned matching.

Each model is a ``transformers`` model of a fedlmc preset's shape, trained through its *own* forward
with fedlmc's trainer (AdamW, warmup + cosine, the preset's budget), then converted exactly with
``fedlmc.hf.from_hf``:

- ``gpt2``: ``GPT2LMHeadModel`` of gpt2-tiny's shape (tied head, ``gelu_new``).
- ``vit``: ``ViTForImageClassification`` of vit-tiny's shape.
- ``llama``: ``LlamaForCausalLM`` of llama-tiny's shape (grouped-query attention, untied).
- ``opt``: ``OPTForCausalLM`` of gpt2-tiny-relu's shape (tied head, ReLU, positions at offset 2).
- ``neox``: ``GPTNeoXForCausalLM`` of neox-tiny's shape (parallel attention and MLP, partial rotary).

For the tied GPT-2 and OPT the aligned midpoint is also written back in the clients' tied form
(``HFAdapter.to_client``, what the strategies send) and evaluated through Hugging Face's forward.

    python simulations/hf_pairs.py --family gpt2 [--seeds 0 1] [--steps N]   # results/bench_hf_pair_{family}.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn as nn

from fedlmc import provenance
from fedlmc.data import load
from fedlmc.hf import HFAdapter, Logits, from_hf, hf_model_for
from fedlmc.merging.averaging import interpolate
from fedlmc.models import preset_config, preset_dataset
from fedlmc.reproduce import pair_curves
from fedlmc.symmetry import apply_transform, canonicalize
from fedlmc.train import evaluate, train, train_config_for

ROOT = Path(__file__).resolve().parents[1]
PRESET = {"gpt2": "gpt2-tiny", "vit": "vit-tiny", "llama": "llama-tiny", "opt": "gpt2-tiny-relu", "neox": "neox-tiny"}
TIED = ("gpt2", "opt")
METHODS = ["average", "wm-orth-factored", "wm-orth-keepln", "learned"]  # keepln = factored for Llama (no LayerNorm)


def hf_model(family: str, splits, seed: int) -> nn.Module:
    """A fresh ``transformers`` model of the preset's shape (fedlmc's config → Hugging Face's)."""
    fit = {k: splits.meta[k] for k in ("vocab_size", "channels", "image_size", "num_classes") if k in splits.meta}
    cfg = preset_config(PRESET[family], **fit)
    if family == "gpt2":
        cfg = cfg.replace(activation="gelu_tanh")  # GPT-2's gelu_new
    return hf_model_for(cfg, seed, family=family)  # Hugging Face's own initialisation (GPT-2, OPT tied)


def trained(family: str, splits, seed: int, cache: Path, steps) -> nn.Module:
    path = cache / f"hf-{family}-s{seed}-{steps or 'preset'}"
    if (path / "config.json").is_file():
        print(f"reusing {path}", flush=True)
        return from_hf(path)
    hf = hf_model(family, splits, seed)
    cfg = train_config_for(PRESET[family], seed, steps=steps)
    hist = train(Logits(hf), splits.train, cfg, val=splits.val, progress=False, desc=f"hf-{family} seed {seed}")
    hf.eval().save_pretrained(path)
    print(f"hf-{family} seed {seed}: {hist['steps']} steps in {hist['seconds']:.0f} s", flush=True)
    return from_hf(path)


def tied_midpoint(a, b_aligned, hf_dir: Path, splits) -> dict:
    """The weight-matched midpoint as the strategies send it to tied clients, through HF's forward."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    mid = interpolate(a, b_aligned, 0.5, keep_layernorm=True)  # a LayerNorm pair (plain) is averaged as it is
    adapter = HFAdapter(ref)
    client = type(ref)(ref.config).eval()
    client.load_state_dict(adapter.to_client(mid, keys=ref.state_dict().keys()), strict=True)
    return {
        "untied_midpoint_loss": evaluate(mid, splits.test)["loss"],
        "tied_midpoint_loss": evaluate(Logits(client), splits.test)["loss"],
        "tie_fit_error": adapter.fit_error,
    }


def main() -> None:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", required=True, choices=list(PRESET))
    p.add_argument("--seeds", nargs=2, type=int, default=[0, 1])
    p.add_argument("--steps", type=int, help="training steps (default: the preset's budget)")
    p.add_argument("--cache", default=str(ROOT / "runs" / "cache"))
    p.add_argument("--out", help="default: results/bench_hf_pair_{family}.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    splits = load(
        preset_dataset(PRESET[args.family]), block_size=getattr(preset_config(PRESET[args.family]), "block_size", 64)
    )
    a, b = (trained(args.family, splits, s, Path(args.cache), args.steps) for s in args.seeds)
    curves = pair_curves(a, b, splits, METHODS, progress=False)
    doc = {
        "family": args.family,
        "preset_shape": PRESET[args.family],
        "seeds": args.seeds,
        "steps": args.steps,
        "client_test_loss": [evaluate(m, splits.test)["loss"] for m in (a, b)],
        "barriers": {k: v["barrier"] for k, v in curves.items()},
        "ratio_to_average": {k: v["barrier"] / curves["average"]["barrier"] for k, v in curves.items()},
        "curves": curves,
    }
    if args.family in TIED:  # the tied head: each residual group's midpoint, untied vs written back tied
        from fedlmc.matching import weight_matching
        from fedlmc.options import Matching

        ca, cb = canonicalize(a), canonicalize(b)
        ref = Path(args.cache) / f"hf-{args.family}-s{args.seeds[0]}-{args.steps or 'preset'}"
        doc["tied"] = {
            residual: tied_midpoint(
                ca,
                apply_transform(cb, weight_matching(ca, cb, Matching(residual=residual), keep_layernorm=True)),
                ref,
                splits,
            )
            for residual in ("orthogonal", "permutation")
        }
        doc["tied"]["plain"] = tied_midpoint(a, b, ref, splits)
    doc["seconds"] = time.time() - t0
    out = Path(args.out or ROOT / "results" / f"bench_hf_pair_{args.family}.json")
    provenance.write(out, doc)
    print(
        json.dumps(
            {k: doc[k] for k in ("barriers", "ratio_to_average")} | ({"tied": doc["tied"]} if "tied" in doc else {}),
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
