"""bench/hf_vit_same_init.py: is HF ViT's weaker weight matching the HF forward or the draws? Train fedlmc's own ViT from the HF
models' exact initial weights (from_hf of the untrained HF models, seeds 0 and 1), same trainer/budget.
Run after `bench/hf_pairs.py --family vit` (it reads the HF-trained seeds 0 and 1 from runs/cache).
"""
import json, sys
sys.path.insert(0, "bench")
import torch
from hf_pairs import hf_model
from fedlmc.data import load
from fedlmc.hf import from_hf
from fedlmc.reproduce import pair_curves
from fedlmc.train import train, train_config_for
torch.set_num_threads(1)
splits = load("mnist")
models = []
for seed in (0, 1):
    m = from_hf(hf_model("vit", splits, seed)).train()
    for p in m.parameters():
        p.requires_grad_(True)
    train(m, splits.train, train_config_for("vit-tiny", seed), val=splits.val, progress=False)
    models.append(m.eval())
    from fedlmc import io
    io.save(m, f"runs/cache/fedlmc-vit-from-hf-init-s{seed}")
c = pair_curves(models[0], models[1], splits, ["vanilla", "wm-orth-factored", "learned"], progress=False)
out = {k: v["barrier"] for k, v in c.items()}
print(json.dumps(out))
json.dump(out, open("results/bench_hf_vit_same_init.json", "w"))  # the same-init fedlmc pair
hfa, hfb = from_hf("runs/cache/hf-vit-s0-preset"), from_hf("runs/cache/hf-vit-s1-preset")
for name, (x, y) in {"ours-s0 vs hf-s0": (models[0], hfa), "ours-s1 vs hf-s1": (models[1], hfb)}.items():
    sx, sy = x.state_dict(), y.state_dict()
    print(name, "relative distance", float(sum((sx[k] - sy[k]).pow(2).sum() for k in sx) ** 0.5 / sum(sy[k].pow(2).sum() for k in sy) ** 0.5))
c2 = pair_curves(models[0], hfb, splits, ["vanilla", "wm-orth-factored"], progress=False)
print("ours-s0 x hf-s1", {k: v["barrier"] for k, v in c2.items()})
c3 = pair_curves(hfa, models[1], splits, ["vanilla", "wm-orth-factored"], progress=False)
print("hf-s0 x ours-s1", {k: v["barrier"] for k, v in c3.items()})
