"""Depth as a symmetry-aware transform: identity blocks inserted and removed without changing the
function (float64, random inputs, GPT-2-, ViT-, Llama- and NeoX-style models and the Hugging Face
conversions), the monotone assignment by dynamic programming against brute force, and a planted deep
model from which a shallower, transformed copy recovers its blocks' positions and its transform."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import perturbed
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlmc.matching import weight_matching
from fedlmc.merging.depths import (
    block_signatures,
    insert_identity_blocks,
    is_identity_block,
    match_layers,
    monotone_assignment,
    pad_to_depth,
    remove_blocks,
)
from fedlmc.models import from_preset
from fedlmc.options import Matching
from fedlmc.symmetry import apply_transform, canonicalize, random_transform

SMALL = dict(n_layer=3, d_model=32, n_head=4, d_ff=64)
PRESETS = {
    "gpt2": ("gpt2-tiny", dict(vocab_size=40, block_size=16)),
    "vit": ("vit-tiny", dict(image_size=12, patch_size=4)),
    "llama": ("llama-tiny", dict(vocab_size=40, block_size=16)),
    "neox": ("neox-tiny", dict(vocab_size=40, block_size=16)),
}


def _model(kind: str, seed: int = 0, **over):
    name, extra = PRESETS[kind]
    torch.manual_seed(seed)
    return perturbed(from_preset(name, **{**SMALL, **extra, **over}), seed=seed)


def _inputs(kind: str, model, n: int = 3):
    g = torch.Generator().manual_seed(7)
    if kind == "vit":
        c = model.config
        return torch.randn(n, c.channels, c.image_size, c.image_size, generator=g, dtype=torch.float64)
    return torch.randint(0, model.config.vocab_size, (n, 12), generator=g)


@pytest.mark.parametrize("kind", sorted(PRESETS))
def test_identity_blocks_leave_the_function_unchanged(kind, record):
    model = _model(kind)
    x = _inputs(kind, model)
    want = model(x)
    for positions in ([0], [3, 4], [1, 3, 5]):
        deeper = insert_identity_blocks(model, positions)
        assert deeper.config.n_layer == 3 + len(positions)
        assert all(is_identity_block(deeper, p) for p in positions)
        assert not any(is_identity_block(deeper, p) for p in range(deeper.config.n_layer) if p not in positions)
        record(f"{kind}: identity blocks at {positions} (max |Δ logits|)", float((deeper(x) - want).abs().max()), 1e-10)
        back = remove_blocks(deeper, positions)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in back.state_dict().items())
    canon = canonicalize(model)  # parameter-free RMSNorm: the identity block has no norm parameters
    record(
        f"{kind}: canonical, identity block inserted",
        float((insert_identity_blocks(canon, [1])(x) - want).abs().max()),
        1e-10,
    )
    with pytest.raises(ValueError):
        insert_identity_blocks(model, [0, 0])
    with pytest.raises(ValueError):
        remove_blocks(model, [0, 1, 2])


@pytest.mark.parametrize("family", ["gpt2", "llama", "vit"])
def test_identity_blocks_through_the_hugging_face_conversions(family, record):
    import test_hf

    from fedlmc.hf import from_hf, to_hf

    hf = getattr(test_hf, f"hf_{family}")().double().eval()
    deeper = to_hf(insert_identity_blocks(from_hf(hf), [0, 2])).double().eval()
    assert deeper.config.num_hidden_layers == hf.config.num_hidden_layers + 2
    g = torch.Generator().manual_seed(3)
    if family == "vit":
        c = hf.config
        x = {
            "pixel_values": torch.randn(2, c.num_channels, c.image_size, c.image_size, generator=g, dtype=torch.float64)
        }
    else:
        x = {"input_ids": torch.randint(0, hf.config.vocab_size, (2, 10), generator=g)}
    with torch.no_grad():
        with torch.random.fork_rng():
            torch.manual_seed(0)  # perturb the HF model off its init so every block writes something
            for p in hf.parameters():
                p.add_(0.1 * torch.randn_like(p))
        deeper = to_hf(insert_identity_blocks(from_hf(hf), [0, 2])).double().eval()
        diff = float((deeper(**x).logits - hf(**x).logits).abs().max())
    record(f"HF {family}: 2 identity blocks inserted through from_hf / to_hf", diff, 1e-10)


def _brute(cost: torch.Tensor) -> float:
    n, m = cost.shape
    return min(sum(float(cost[i, j]) for i, j in enumerate(c)) for c in itertools.combinations(range(m), n))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 10_000))
def test_the_monotone_assignment_is_the_brute_force_optimum(n, extra, seed):
    cost = torch.rand(n, n + extra, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    positions, total = monotone_assignment(cost)
    assert positions == sorted(set(positions)) and len(positions) == n
    assert total == pytest.approx(sum(float(cost[i, j]) for i, j in enumerate(positions)))
    assert total == pytest.approx(_brute(cost))
    with pytest.raises(ValueError):
        monotone_assignment(torch.zeros(3, 2))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_planted_shallow_copy_recovers_its_blocks_positions_and_its_transform(kind, record):
    """A 6-layer model; a 4-layer copy of it without blocks 1 and 4, transformed by a random group
    element. Both costs (weights, activations) place the 4 blocks at 0, 2, 3, 5; padded there with
    identity blocks, weight matching recovers the transform: the copy lands on the 6-layer model with
    blocks 1 and 4 made identity."""
    deep = canonicalize(_model(kind, seed=1, n_layer=6))
    shallow = remove_blocks(deep, [1, 4])
    groups = ["residual", "heads", "ff"]
    moved = apply_transform(shallow, random_transform(shallow, seed=5, groups=groups))
    sig_a, sig_b = block_signatures(shallow), block_signatures(moved)
    record(
        f"{kind}: block signatures under a random group element",
        max(float((a - b).abs().max()) for x, y in zip(sig_a, sig_b) for a, b in zip(x, y)),
        1e-9,
    )
    by_signatures = match_layers(moved, deep, rounds=0)
    by_weights = match_layers(moved, deep)
    by_data = match_layers(moved, deep, data=_inputs(kind, deep))
    assert by_signatures.positions == by_weights.positions == by_data.positions == [0, 2, 3, 5]
    assert by_signatures.cost < 1e-12  # the signatures of matched blocks are equal
    # aligned, the matched blocks' circuits are equal (to weight matching's tolerance), the others far apart
    others = by_weights.costs.clone()
    others[range(4), by_weights.positions] = float("inf")
    assert by_weights.by == "aligned circuits" and by_weights.cost < 1e-3 < 0.5 < float(others.min()), by_weights
    assert float(by_data.costs[0, 0]) < 1e-9  # block 0 sees the same inputs in both (the later ones do not)
    padded = pad_to_depth(moved, by_weights.positions, 6)
    tight = Matching(descent_tol=1e-12)
    T = weight_matching(deep, padded, tight)
    error = _relative_error(apply_transform(padded, T), insert_identity_blocks(shallow, [1, 4]))
    record(f"{kind}: the padded copy aligned onto the deep model (relative parameter error)", error, 1e-3)


def _relative_error(a, b) -> float:
    sa = a.state_dict()
    return max(float((sa[k] - v).abs().max() / v.abs().max().clamp(min=1e-12)) for k, v in b.state_dict().items())


def test_a_shallow_model_is_refused_the_wrong_way_round():
    deep, shallow = _model("gpt2", n_layer=4), _model("gpt2", n_layer=2)
    with pytest.raises(ValueError, match="other way round"):
        match_layers(deep, shallow)
    with pytest.raises(ValueError):
        pad_to_depth(shallow, [2, 1], 4)


def test_a_mixed_depth_merge_averages_each_block_over_its_holders(record):
    """A 6-layer model and a 4-layer copy of it without blocks 1 and 4, each under its own random group
    element: the merge is the 6-layer model's function (blocks 1 and 4 from the deep client alone, the
    others averaged over both), and each client gets back its own depth computing its own function.
    Averaged with the identity padding as zeros, blocks 1 and 4 are halved: far off."""
    from fedlmc.merging.mixed_depths import block_average, depth_merge

    deep = canonicalize(_model("gpt2", seed=1, n_layer=6))
    shallow = remove_blocks(deep, [1, 4])
    groups = ["residual", "heads", "ff"]
    a = apply_transform(deep, random_transform(deep, seed=6, groups=groups))
    b = apply_transform(shallow, random_transform(shallow, seed=5, groups=groups))
    x = _inputs("gpt2", deep)
    with torch.no_grad():
        want = deep(x)
        got = depth_merge([a, b], [3.0, 1.0])
        assert got.positions == [[0, 1, 2, 3, 4, 5], [0, 2, 3, 5]]
        gap = float((got.universe(x) - want).abs().max() / want.abs().max())
        record("mixed-depth merge of planted copies vs the deep model (relative max |Δ logits|)", gap, 1e-2)
        own = [got.client_model(i) for i in (0, 1)]
        assert [m.config.n_layer for m in own] == [6, 4]
        record(
            "the shallow client's returned model vs its own function",
            float((own[1](x) - b(x)).abs().max() / want.abs().max()),
            1e-2,
        )
        zeros = depth_merge([a, b], [3.0, 1.0], padding="zeros")
        assert float((zeros.universe(x) - want).abs().max() / want.abs().max()) > 10 * gap
    states = [
        {"blocks.0.w": torch.tensor([2.0]), "head": torch.tensor([2.0])},
        {"blocks.0.w": torch.tensor([0.0]), "head": torch.tensor([0.0])},
    ]
    skip = block_average(states, [1.0, 1.0], [[0], []])
    assert float(skip["blocks.0.w"]) == 2.0 and float(skip["head"]) == 1.0  # padding skipped, the rest averaged
    assert float(block_average(states, [1.0, 1.0], [[0], []], padding="zeros")["blocks.0.w"]) == 1.0


def test_a_merge_across_depth_and_width_together_is_exact_on_planted_copies(record):
    """Both axes: a 4-layer model of width 32 (4 heads of 8, d_ff 64), and a 6-layer model of width 48
    (6 heads, d_ff 96) that is the narrow one lifted exactly (zero units, ``[I; 0]`` residual) with
    identity blocks at 1 and 4, each under its own random group element. The layer matching finds
    the narrow model's blocks at 0, 2, 3, 5; the merge computes their common function; each client
    gets back its own depth and width computing its own function."""
    from fedlmc.merging.mixed_depths import depth_merge
    from fedlmc.merging.widths import pad

    narrow = canonicalize(_model("gpt2", seed=1, n_layer=4, n_head=4, d_model=32, d_ff=64))
    wide = pad(insert_identity_blocks(narrow, [1, 4]), {"d_model": 48, "n_head": 6, "d_ff": 96})
    groups = ["residual", "heads", "ff"]
    a = apply_transform(wide, random_transform(wide, seed=6, groups=groups))
    b = apply_transform(narrow, random_transform(narrow, seed=5, groups=groups))
    x = _inputs("gpt2", narrow)
    with torch.no_grad():
        want = narrow(x)
        record("both axes: the lifted 6-layer model vs the narrow one", float((a(x) - want).abs().max()), 1e-10)
        got = depth_merge([a, b], [1.0, 1.0], matching=Matching(descent_tol=1e-12))
        assert got.positions == [[0, 1, 2, 3, 4, 5], [0, 2, 3, 5]], got.positions
        assert (got.universe.config.n_layer, got.universe.config.d_model) == (6, 48)
        scale = float(want.abs().max())
        record("both axes: the merge vs the common function", float((got.universe(x) - want).abs().max()) / scale, 1e-5)
        own = [got.client_model(i) for i in (0, 1)]
        assert [(m.config.n_layer, m.config.d_model, m.config.d_ff) for m in own] == [(6, 48, 96), (4, 32, 64)]
        for i, m in enumerate(own):
            record(
                f"both axes: client {i}'s returned model vs its function",
                float((m(x) - want).abs().max()) / scale,
                1e-5,
            )


def test_the_hetero_strategy_merges_replies_of_two_depths_and_sends_each_its_own(record):
    """HeteroWidthFedAvg on a 6-layer reply and a 4-layer one (the 6-layer model without blocks 1 and 4,
    moved by a group element): the global model is the 6-layer function, the shallow node is sent a
    4-layer model computing its own function, the round's record names the placement; a node of half
    width and 4 layers is merged beside the deep one and sent its own shape."""
    from test_strategies import _reply

    from fedlmc.strategies import HeteroWidthFedAvg
    from fedlmc.strategies.records import model_from_arrays

    deep = canonicalize(_model("gpt2", seed=1, n_layer=6))
    shallow = remove_blocks(deep, [1, 4])
    groups = ["residual", "heads", "ff"]
    a = apply_transform(deep, random_transform(deep, seed=6, groups=groups)).float()
    b = apply_transform(shallow, random_transform(shallow, seed=5, groups=groups)).float()
    strategy = HeteroWidthFedAvg(model=a.config.to_dict())
    arrays, _ = strategy.aggregate_train(1, [_reply(a, 100, node=1, partition=0), _reply(b, 100, node=2, partition=1)])
    rec = strategy.history[-1]
    assert rec["depths"] == [6, 4] and rec["placements"][1] == [0, 2, 3, 5], rec
    universe = model_from_arrays(arrays, strategy.global_config)
    x = _inputs("gpt2", deep)
    with torch.no_grad():
        want = deep.float()(x)
        gap = float((universe(x) - want).abs().max() / want.abs().max())
        record("HeteroWidthFedAvg, depths 6 and 4: the global model vs the deep function", gap, 1e-2)
        sent = strategy.model_for(2)
        assert sent.config.n_layer == 4 and strategy.model_for(1).config.n_layer == 6
        record(
            "HeteroWidthFedAvg: the 4-layer node's model vs its own function",
            float((sent(x) - b(x)).abs().max() / want.abs().max()),
            1e-2,
        )
    deeper = canonicalize(_model("gpt2", seed=3, n_layer=7)).float()
    again = HeteroWidthFedAvg(model=a.config.to_dict())
    again.aggregate_train(1, [_reply(a, 100, node=1, partition=0), _reply(deeper, 100, node=3, partition=2)])
    assert [e["node"] for e in again.history[-1]["excluded"]] == [3]
    assert "not deeper" in again.history[-1]["excluded"][0]["reason"]
    # both axes: a 4-layer node of half width gets its own depth and width back
    narrow = canonicalize(_model("gpt2", seed=2, n_layer=4, d_model=16, n_head=2, d_ff=32)).float()
    both = HeteroWidthFedAvg(model=a.config.to_dict())
    both.aggregate_train(1, [_reply(a, 100, node=1, partition=0), _reply(narrow, 100, node=2, partition=1)])
    rec = both.history[-1]
    assert rec["excluded"] == [] and rec["depths"] == [6, 4] and rec["widths"] == [32, 16], rec
    c = both.model_for(2).config
    assert (c.n_layer, c.d_model, c.n_head, c.d_ff) == (4, 16, 2, 32)


def test_each_strategy_returns_a_smaller_client_its_own_model():
    """What a 4-layer client trains from next round (``returned_model``): under ``hetero`` its projection
    of the universe (the model it is sent), under ``deep-only`` the global model's first 4 blocks (as the
    ClientApp cuts it), under ``local`` its own last reply. ``local`` keeps the 6-layer replies' FedAvg as
    the global model and sends each node its own reply back."""
    from test_strategies import _reply

    from fedlmc.baselines import LocalFedAvg
    from fedlmc.strategies import AverageFedAvg, HeteroWidthFedAvg
    from fedlmc.strategies.records import model_from_arrays

    deep = canonicalize(_model("gpt2", seed=1, n_layer=6)).float()
    other = canonicalize(_model("gpt2", seed=2, n_layer=6)).float()
    shallow = canonicalize(_model("gpt2", seed=3, n_layer=4)).float()
    replies = [_reply(deep, 100, node=1, partition=0), _reply(shallow, 100, node=2, partition=1)]
    x = _inputs("gpt2", deep)
    cfg = shallow.config
    with torch.no_grad():
        hetero = HeteroWidthFedAvg(model=deep.config.to_dict())
        arrays, _ = hetero.aggregate_train(1, replies)
        universe = model_from_arrays(arrays, hetero.global_config)
        assert torch.equal(hetero.returned_model(universe, 1, cfg)(x), hetero.model_for(2)(x))
        fedavg = AverageFedAvg(model=deep.config.to_dict())
        arrays, _ = fedavg.aggregate_train(1, [_reply(deep, 100, node=1), _reply(other, 100, node=3)])
        mean = model_from_arrays(arrays, fedavg.global_config)
        cut = fedavg.returned_model(mean, 1, cfg)
        assert cut.config.n_layer == 4 and torch.equal(
            cut.state_dict()["blocks.3.mlp.fc1.weight"], mean.blocks[3].mlp.fc1.weight
        )
        local = LocalFedAvg(model=deep.config.to_dict())
        arrays, _ = local.aggregate_train(1, [*replies, _reply(other, 300, node=3, partition=2)])
        reference = model_from_arrays(arrays, local.global_config)
        want = {k: (deep.state_dict()[k] + 3 * other.state_dict()[k]) / 4 for k in deep.state_dict()}
        assert all(torch.allclose(reference.state_dict()[k], v, atol=1e-6) for k, v in want.items())
        assert torch.equal(local.model_for(2)(x), shallow(x)) and torch.equal(local.model_for(3)(x), other(x))
        assert torch.equal(local.returned_model(reference, 1, cfg)(x), shallow(x))
        assert local.history[-1]["alone"] == [0, 1, 2] and local.history[-1]["kept"] == "average"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_mixed_depth_federation_runs_in_a_ray_simulation():
    """``strategy=hetero`` with ``depth-factors="1,2"`` in a Flower simulation (2 SuperNodes): partition 1
    trains 1 of the 2 layers of vit-digits; both rounds merge both replies (depths 2 and 1, the shallow
    one placed by the layer matching), the global model keeps the full depth and the shallow client's
    own model is scored every round."""
    from test_simulation import simulation_dir

    from fedlmc import io
    from simulations.simulate import run_in_subprocess

    with simulation_dir("fl-depths-") as out:
        settings = {
            "strategy": "hetero",
            "num-server-rounds": 2,
            "preset": "vit-digits",
            "local-steps": 4,
            "threads": 1,
            "depth-factors": "1,2",
            "out-dir": str(out),
            "report": True,
        }
        doc = run_in_subprocess(settings, num_supernodes=2, timeout=300, log_path=out / "log.txt")
        for r in doc["rounds"][1:]:
            rec = r["strategy"]
            assert rec["excluded"] == [] and rec["failures"] == [] and sorted(rec["depths"]) == [1, 2], rec
            assert sorted(len(p) for p in rec["placements"]) == [1, 2]
            assert list(r["returned_test_loss"]) == ["1"], r  # the 1-layer client's own model, scored
        assert io.load(out / "final").config.n_layer == 2


def test_depth_factors_are_refused_where_a_strategy_cannot_honour_them():
    from fedlmc.federated import Settings, client_config

    for strategy in ("aligned", "hetero-refined", "refined"):
        with pytest.raises(ValueError, match="mixed-depth"):
            Settings.from_run_config({"strategy": strategy, "depth-factors": "1,2"}).validate()
    Settings.from_run_config({"strategy": "hetero", "depth-factors": "1,2", "width-factors": "1,2"}).validate()
    with pytest.raises(ValueError, match="mixed-width"):
        Settings.from_run_config({"strategy": "deep-only", "depth-factors": "1,2", "width-factors": "1,2"}).validate()
    s = Settings.from_run_config({"strategy": "hetero", "depth-factors": "1,2", "preset": "vit-digits"})
    s.validate()
    assert [client_config(s, p).n_layer for p in (0, 1, 2)] == [2, 1, 2]
    assert client_config(s, 0, node_depth=2.0).n_layer == 1  # a node's own depth-factor wins
    with pytest.raises(ValueError, match="layers"):
        client_config(s, 0, node_depth=0.5)


def test_the_depth_baselines_prefix_blocks_zero_padding_and_deep_only():
    """``slicing`` with mixed depths averages each block over the clients that have it (a shallow client
    holds the first blocks: InclusiveFL's placement); ``hetero-zeros`` averages the identity padding in as
    zeros; ``deep-only`` excludes the shallower reply, saying why."""
    from test_strategies import _reply

    from fedlmc.baselines import ZeroPaddedDepthFedAvg
    from fedlmc.federated import Settings
    from fedlmc.merging.widths import prefix_average
    from fedlmc.strategies import AverageFedAvg
    from fedlmc.strategies.registry import build

    deep = _model("gpt2", seed=1, n_layer=3).float()
    shallow = _model("gpt2", seed=2, n_layer=2).float()
    d, s = deep.state_dict(), shallow.state_dict()
    got = prefix_average([d, s], [0.5, 0.5], d)
    assert torch.allclose(
        got["blocks.0.attn.q.weight"], (d["blocks.0.attn.q.weight"] + s["blocks.0.attn.q.weight"]) / 2
    )
    assert torch.equal(got["blocks.2.attn.q.weight"], d["blocks.2.attn.q.weight"])  # the deep client's alone
    config = deep.config.to_dict()
    for name, cls in (("hetero-zeros", ZeroPaddedDepthFedAvg), ("deep-only", AverageFedAvg)):
        built = build(Settings.from_run_config({"strategy": name, "depth-factors": "1,1.5"}), config, None)
        assert type(built) is cls
    only = AverageFedAvg(model=config)
    only.aggregate_train(1, [_reply(deep, 10, node=1), _reply(shallow, 10, node=2)])
    assert [e["node"] for e in only.history[-1]["excluded"]] == [2] and "n_layer=2" in only.history[-1]["excluded"][0][
        "reason"
    ]
    a = canonicalize(_model("gpt2", seed=1, n_layer=6))
    b = apply_transform(
        remove_blocks(a, [1, 4]), random_transform(remove_blocks(a, [1, 4]), seed=5, groups=["residual", "heads", "ff"])
    )
    zeros = ZeroPaddedDepthFedAvg(model=a.config.to_dict())
    arrays, _ = zeros.aggregate_train(
        1, [_reply(a.float(), 10, node=1, partition=0), _reply(b.float(), 10, node=2, partition=1)]
    )
    from fedlmc.strategies.records import model_from_arrays

    merged = model_from_arrays(arrays, zeros.global_config).state_dict()
    halved = 0.5 * a.state_dict()["blocks.1.attn.o.weight"].float().abs().sum()
    assert float(merged["blocks.1.attn.o.weight"].abs().sum()) == pytest.approx(float(halved), rel=1e-3)
