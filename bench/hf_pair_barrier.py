"""Pairwise barriers of two independently trained Hugging Face GPT-2s (gpt2-tiny's shape, tied head,
``gelu_new``) on Tiny Shakespeare: vanilla vs weight matching, and what the tied head costs.

Each model trains with Hugging Face's own forward (the tie trains as one matrix); ``fedlmc.hf.from_hf``
converts exactly; weight matching aligns B to A. The aligned midpoint (λ = 0.5) is then written back in
the clients' tied form (``HFAdapter.to_client``: embedding kept, final-norm gain fitted) and evaluated
through Hugging Face's forward — the option the strategies use — against the untied midpoint (what
the full group gives, if the client model could hold it).

    python bench/hf_pair_barrier.py --steps 1500     # results/bench_hf_gpt2_pair.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from fedlmc.averaging import interpolate
from fedlmc.barrier import barrier, interpolation_curve
from fedlmc.data import load
from fedlmc.hf import HFAdapter, from_hf
from fedlmc.matching import weight_matching
from fedlmc.symmetry import apply_transform, canonicalize
from fedlmc.train import evaluate

ROOT = Path(__file__).resolve().parents[1]


def hf_model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=65, n_positions=64, n_embd=128, n_layer=4, n_head=4, n_inner=512,
                                      bos_token_id=0, eos_token_id=0))


def train_hf(model: GPT2LMHeadModel, data, steps: int, seed: int) -> GPT2LMHeadModel:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    step = 0
    while step < steps:
        for x, y in data.batches(32, shuffle=True, generator=gen):
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 250 == 0:
                print(f"seed {seed} step {step} loss {float(loss):.3f}", flush=True)
            if step >= steps:
                break
    return model.eval()


def hf_loss(model: GPT2LMHeadModel, data, batches: int = 20) -> float:
    with torch.no_grad():
        losses = [float(F.cross_entropy(model(input_ids=x).logits.reshape(-1, 65), y.reshape(-1)))
                  for _, (x, y) in zip(range(batches), data.batches(64))]
    return sum(losses) / len(losses)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--out", default=str(ROOT / "results" / "bench_hf_gpt2_pair.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    splits = load("shakespeare", block_size=64)
    t0 = time.time()
    hf_a, hf_b = (train_hf(hf_model(s), splits.train, args.steps, s) for s in (0, 1))
    a, b = from_hf(hf_a), from_hf(hf_b)
    ca, cb = canonicalize(a), canonicalize(b)
    vanilla = interpolation_curve(a, b, splits.test)
    T = weight_matching(ca, cb)
    aligned = apply_transform(cb, T)
    wm = interpolation_curve(ca, aligned, splits.test, interpolate=lambda x, y, lam: interpolate(x, y, lam, keep_layernorm=True))
    mid = interpolate(ca, aligned, 0.5, keep_layernorm=True)
    adapter = HFAdapter(hf_a)
    tied_mid = GPT2LMHeadModel(hf_a.config).eval()
    tied_mid.load_state_dict(adapter.to_client(mid, keys=hf_a.state_dict().keys()), strict=True)
    doc = {"steps": args.steps, "seconds": time.time() - t0,
           "client_test_loss": [hf_loss(hf_a, splits.test), hf_loss(hf_b, splits.test)],
           "vanilla_barrier": barrier(vanilla), "wm_barrier": barrier(wm),
           "wm_ratio": barrier(wm) / barrier(vanilla),
           "aligned_midpoint_untied_loss": evaluate(mid, splits.test, batch_size=64, max_batches=20)["loss"],
           "aligned_midpoint_tied_fit_loss": hf_loss(tied_mid, splits.test),
           "tie_fit_relative_error": adapter.fit_error,
           "plain_midpoint_loss": vanilla.loss[len(vanilla.loss) // 2]}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
