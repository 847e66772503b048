"""The output ensemble (the one-shot reference): averaged probabilities, never worse than the mean
member's loss (cross-entropy is convex in the probabilities), and the compare table's share of its gain."""

from __future__ import annotations

import torch

from fedlmc.data.base import ArrayData
from fedlmc.merging.ensemble import Ensemble
from fedlmc.models import from_preset
from fedlmc.train import evaluate
from simulations.compare import ensemble_share

KW = dict(n_layer=1, d_model=16, n_head=2, d_ff=32, image_size=8, patch_size=4)


def test_ensemble_averages_probabilities_and_beats_the_mean_member():
    torch.manual_seed(0)
    models = [from_preset("vit-tiny", **KW).eval() for _ in range(3)]
    x = torch.randn(64, 1, 8, 8)
    y = torch.randint(0, 10, (64,))
    ens = Ensemble(models).eval()
    with torch.no_grad():
        p = torch.stack([m(x).softmax(-1) for m in models]).mean(0)
        assert torch.allclose(ens(x).softmax(-1), p, atol=1e-6)
        assert torch.allclose(Ensemble([models[0]])(x).softmax(-1), models[0](x).softmax(-1), atol=1e-6)
    data = ArrayData(x, y)
    members = [evaluate(m, data)["loss"] for m in models]
    assert evaluate(ens, data)["loss"] <= sum(members) / len(members) + 1e-6


def test_share_of_the_ensembles_gain():
    base = {"global_loss": 3.0}
    assert ensemble_share({"global_loss": 3.0, "ensemble_loss": 2.0}, base) == 0.0
    assert ensemble_share({"global_loss": 2.5, "ensemble_loss": 2.0}, base) == 0.5
    assert ensemble_share({"global_loss": 1.5, "ensemble_loss": 2.0}, base) == 1.5  # beats the ensemble
    assert ensemble_share({"global_loss": 2.5}, base) is None
    assert ensemble_share({"global_loss": 2.5, "ensemble_loss": 3.2}, base) is None  # no gain to recover


def test_clients_rows_give_the_best_and_the_mean_client_per_seed():
    from simulations.compare import clients_rows

    def doc(losses):
        return {"rounds": [{}, {"strategy": {"client_losses": losses}}]}

    docs = {"slicing": {0: doc([1.0, 2.0, 3.0]), 1: doc([2.0, 4.0])}, "hetero": {0: doc([9.0]), 1: doc([9.0])}}
    got = clients_rows(docs)
    assert got["best_client_per_seed"] == [1.0, 2.0] and got["mean_client_per_seed"] == [2.0, 3.0]
    assert got["best_client"][0] == 1.5 and clients_rows({"x": {0: {"rounds": [{}]}}}) is None
