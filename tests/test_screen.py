"""Screening replies modulo symmetries: after alignment, an outlier among rotated and permuted honest
replies is found and excluded, the honest ones are not; Krum's score and Multi-Krum's selection agree
with Flower's; the strategies record what they left out."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed
from flwr.app import ArrayRecord
from flwr.serverapp.strategy.multikrum import select_multikrum
from test_strategies import _reply

from fedlmc.baselines import KrumFedAvg
from fedlmc.merging.averaging import aligned_state
from fedlmc.merging.screen import krum_scores, multikrum_selection, screen, squared_distances
from fedlmc.merging.universe import Aligned, universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Guard, Robust, Screen, Universe
from fedlmc.strategies import AlignedFedAvg
from fedlmc.strategies.records import model_from_arrays
from fedlmc.symmetry import apply_transform, canonical, canonicalize, random_transform, to_layernorm

KW = dict(n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4)
POISONED = 4  # the index of the poisoned reply


def _federation(poisoned: bool = True, n: int = 5, seed: int = 0):
    """n replies of one model: honest ones are the model plus a small update of their own, each in its own
    coordinates (a random residual rotation, head and FF permutations); with ``poisoned`` the last one
    sends the model minus 4 × its update (a sign-flipping attacker), in its own coordinates too."""
    torch.manual_seed(seed)
    base = perturbed(from_preset("vit-tiny", **KW), seed, 0.2).double()
    replies = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + seed * 10 + i)
        sign = -4.0 if poisoned and i == POISONED else 1.0
        update = {k: 0.02 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in base.state_dict().items()}
        client = from_preset("vit-tiny", **KW).double()
        client.load_state_dict({k: v + sign * update[k] for k, v in base.state_dict().items()})
        canon = canonicalize(client)
        T = random_transform(canon, seed=10 + i, fix_ones=True, groups=["residual", "heads", "ff"])
        replies.append(to_layernorm(apply_transform(canon, T)))
    return base, replies


def _aligned(replies):
    merged, transforms = universe_merge(
        replies, universe=Universe(iterations=3, keep_layernorm=True), robust=Robust(reduce="median")
    )
    return [aligned_state(canonical(m), T) for m, T in zip(replies, transforms)]


@pytest.mark.parametrize("method", ["distance", "krum"])
def test_screen_excludes_a_planted_outlier_among_rotated_and_permuted_honest_replies(method):
    _, replies = _federation(poisoned=True)
    found = screen(_aligned(replies), Screen(method=method))
    assert set(found.excluded) == {POISONED}, (found.scores, found.excluded)
    assert max(found.scores) == found.scores[POISONED]


def test_screen_excludes_no_honest_reply():
    for seed in range(3):
        _, replies = _federation(poisoned=False, seed=seed)
        found = screen(_aligned(replies), Screen())
        assert found.excluded == {}, (seed, found.scores)


def test_in_raw_coordinates_the_outlier_does_not_stand_out():
    """The same replies unaligned: each honest one sits in its own coordinates, so they are as far from
    each other as from the attacker, and Flower's raw Krum keeps the attacker's reply in its selection."""
    _, replies = _federation(poisoned=True)
    raw = [m.state_dict() for m in replies]
    found = screen(raw, Screen())
    assert POISONED not in found.excluded
    D = squared_distances(raw)
    honest = D[:POISONED, :POISONED][~torch.eye(POISONED, dtype=torch.bool)]
    assert D[POISONED, :POISONED].mean() < 2 * honest.mean()  # raw: the attacker is not far out


def test_krum_scores_and_selection_are_flowers():
    _, replies = _federation(poisoned=True)
    states = [{k: v.float() for k, v in m.state_dict().items()} for m in replies]
    contents = [_reply(m, 10, node=i + 1).content for i, m in enumerate(replies)]
    for f, select in ((1, 1), (1, 4), (2, 2)):
        theirs = select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=select)
        ours = multikrum_selection(squared_distances(states), f, select)
        assert sorted(contents.index(c) for c in theirs) == ours
    D = squared_distances(states)
    k = 5 - 1 - 2
    manual = torch.stack([D[i][torch.arange(5) != i].sort().values[:k].sum() for i in range(5)])
    assert torch.allclose(krum_scores(D, 1), manual)
    with pytest.raises(ValueError, match="Krum needs"):
        krum_scores(D[:3, :3], 1)


def test_aligned_fedavg_screen_excludes_the_outlier_and_merges_the_rest():
    """AlignedFedAvg(screen=...) excludes the poisoned node (logged, recorded), and its aggregate is the
    one the same strategy gives the honest replies alone; with reduce="median" too."""
    base, replies = _federation(poisoned=True)
    cfg = replies[0].config.to_dict()
    previous = ArrayRecord(torch_state_dict={k: v.float() for k, v in base.state_dict().items()})

    def run(strategy, models):
        msgs = [_reply(m.float(), 10, node=i + 1) for i, m in models]
        arrays, _ = strategy.aggregate_replies(1, msgs, previous)
        return model_from_arrays(arrays, strategy.global_config), strategy.history[-1]

    for reduce in ("average", "median"):
        screened, rec = run(
            AlignedFedAvg(model=cfg, screen=Screen(), robust=Robust(reduce=reduce)), list(enumerate(replies))
        )
        assert rec["screen"]["excluded"] == [POISONED + 1]
        assert [e["node"] for e in rec["excluded"]] == [POISONED + 1] and "screen" in rec["excluded"][0]["reason"]
        honest, _ = run(AlignedFedAvg(model=cfg, robust=Robust(reduce=reduce)), list(enumerate(replies))[:POISONED])
        a, b = screened.state_dict(), honest.state_dict()
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


@pytest.mark.parametrize("where", ["server", "clients"])
def test_refined_fedavg_screen_excludes_the_outlier_and_refines_on_the_rest(where, monkeypatch):
    """RefinedFedAvg(screen=...) screens the weight-matched replies, then refines on the ones it kept
    only: the refinement's transforms are the honest replies', and with the refinement on the clients
    only the honest clients are asked."""
    from test_strategies import _labelled

    from fedlmc.options import OnClients, Refinement
    from fedlmc.strategies import RefinedFedAvg
    from fedlmc.strategies import aligned as aligned_module

    base, replies = _federation(poisoned=True)
    cfg = replies[0].config.to_dict()
    previous = ArrayRecord(torch_state_dict={k: v.float() for k, v in base.state_dict().items()})
    data = _labelled(base.float())
    asked = []

    class Remote:  # records which clients the strategy asks (the spy below refines on `data` instead)
        def __init__(self, grid, nodes, *args, **kwargs):
            asked.append(list(nodes))

        def record(self):
            return {}

    merged_with = []
    real_merge = aligned_module.universe_merge

    def spy(models, weights, start, **kw):
        merged_with.append((len(models), kw.get("refine") is not None))
        if kw.get("refine") is not None and where == "clients":
            kw["refine"] = Refinement(data=data, steps=4)
        return real_merge(models, weights, start, **kw)

    monkeypatch.setattr(aligned_module, "universe_merge", spy)
    monkeypatch.setattr(aligned_module, "ClientLosses", Remote)
    if where == "server":
        strategy = RefinedFedAvg(model=cfg, screen=Screen(), refine=Refinement(data=data, steps=4))
    else:
        strategy = RefinedFedAvg(
            model=cfg, screen=Screen(), refine=Refinement(steps=4), on_clients=OnClients(guard=False)
        )
        strategy.grid = object()
    msgs = [_reply(m.float(), 10, node=i + 1) for i, m in enumerate(replies)]
    strategy.aggregate_replies(1, msgs, previous)
    rec = strategy.history[-1]
    assert rec["screen"]["excluded"] == [POISONED + 1], rec["screen"]
    assert [e["node"] for e in rec["excluded"]] == [POISONED + 1]
    # weight matching on all five to screen, then the refinement on the four honest replies
    assert merged_with == [(5, False), (4, True)], merged_with
    assert "refine_steps_run" in rec and len(rec["moved"]) == POISONED
    assert asked == ([[1, 2, 3, 4]] if where == "clients" else []), asked


def test_refined_fedavg_refines_from_the_screens_weight_matching_when_nobody_is_excluded(monkeypatch):
    """A distance screen that excludes nobody hands its weight matching to the refinement: the round
    weight-matches each reply once (not twice), and its aggregate is the unscreened RefinedFedAvg's."""
    from test_strategies import _labelled

    from fedlmc.matching import weight as weight_module
    from fedlmc.options import Refinement
    from fedlmc.strategies import RefinedFedAvg

    base, replies = _federation(poisoned=False)
    cfg = replies[0].config.to_dict()
    previous = ArrayRecord(torch_state_dict={k: v.float() for k, v in base.state_dict().items()})
    data = _labelled(base.float())
    matchings = []
    real = weight_module.weight_matching
    spy = lambda *a, **kw: matchings.append(1) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr("fedlmc.merging.universe.weight_matching", spy)
    out = {}
    for name, screen_ in (("screened", Screen()), ("plain", None)):
        strategy = RefinedFedAvg(
            model=cfg, screen=screen_, refine=Refinement(data=data, steps=4), universe=Universe(iterations=2)
        )
        msgs = [_reply(m.float(), 10, node=i + 1) for i, m in enumerate(replies)]
        matchings.clear()
        arrays, _ = strategy.aggregate_replies(1, msgs, previous)
        rec = strategy.history[-1]
        if screen_ is not None:
            assert rec["screen"]["excluded"] == [] and "refine_steps_run" in rec, rec
        out[name] = (model_from_arrays(arrays, strategy.global_config).state_dict(), len(matchings))
    (screened, n_screened), (plain, n_plain) = out["screened"], out["plain"]
    assert n_screened == n_plain > 0, (n_screened, n_plain)
    assert max(float((screened[k] - v).abs().max()) for k, v in plain.items()) < 1e-5


def test_krum_fedavg_records_the_replies_flowers_krum_left_out():
    base, replies = _federation(poisoned=True)
    cfg = replies[0].config.to_dict()
    previous = ArrayRecord(torch_state_dict={k: v.float() for k, v in base.state_dict().items()})
    msgs = [_reply(m.float(), 10, node=i + 1) for i, m in enumerate(replies)]
    strategy = KrumFedAvg(model=cfg, num_malicious_nodes=1)
    strategy.aggregate_replies(1, msgs, previous)
    rec = strategy.history[-1]
    assert len(rec["screen"]["excluded"]) == 1 and rec["kept"] == "multikrum"
    assert [e["node"] for e in rec["excluded"]] == rec["screen"]["excluded"]
    with pytest.raises(ValueError):
        KrumFedAvg(model=cfg, num_malicious_nodes=-1)
    with pytest.raises(ValueError, match="screen method"):
        Screen(method="bulyan")


def test_screen_run_config_and_the_screening_tally():
    from fedlmc.federated import Settings
    from simulations.screen import detection

    s = Settings.from_run_config({"strategy": "aligned", "screen": "krum", "malicious": 2, "reduce": "median"})
    assert s.screen_options() == Screen(method="krum", malicious=2)
    assert Settings.from_run_config({"strategy": "aligned"}).screen_options() is None
    for name in ("refined", "refined-clients", "permuted", "aligned-clients"):
        assert Settings.from_run_config({"strategy": name, "screen": "distance"}).screen_options() == Screen()
    for name in ("average", "hetero", "slicing", "krum"):
        with pytest.raises(ValueError, match="screen"):
            Settings.from_run_config({"strategy": name, "screen": "distance"})
    with pytest.raises(ValueError, match="screen"):
        Settings.from_run_config({"strategy": "aligned", "screen": "bulyan"})

    def rnd(out):
        parts = {"11": 0, "12": 1, "13": 2, "14": 3, "15": 4}
        return {"test_loss": 1.0, "test_acc": 0.5, "strategy": {"partitions": parts, "screen": {"excluded": out}}}

    docs = {0: {"rounds": [{}, rnd([15]), rnd([12, 15])]}, 1: {"rounds": [{}, rnd([]), rnd([13])]}}
    r = detection(docs, poisoned=4)
    assert r["detection_rate"] == 2 / 4 and r["false_exclusion_rate"] == 2 / 16 and r["rounds"] == 4
    # the results page's table, from the results file
    from simulations.screen import markdown

    docs[0]["rounds"][-1] = {**rnd([12, 15]), "test_loss": 2.0}
    r = detection(docs, poisoned=4)
    table = markdown({"seeds": [0, 1], "rows": {"aligned+information": r}}).splitlines()
    assert table[2] == (
        "| aligned + information screen, mean (`aligned+information`) | 50% of 4 rounds | 12% of 16 | "
        f"1.500 ± {r['final_loss'][1]:.3f} | 0.500 | 2.000, 1.000 |"
    ), table


def test_loss_screen_excludes_the_reply_that_computes_worst(monkeypatch):
    """Screen(method="loss"): each reply's loss on the guard (here the squared gap to the base model's
    outputs on fixed inputs, a function of what a reply computes, whatever its coordinates) and the
    robust z-score over them; the attacker is excluded, no honest reply is, and without a guard's data
    the strategy refuses the screen."""
    base, replies = _federation(poisoned=True)
    cfg = replies[0].config.to_dict()
    previous = ArrayRecord(torch_state_dict={k: v.float() for k, v in base.state_dict().items()})
    x = torch.randn(16, 1, 12, 12, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        target = base.float()(x)

    def gap(arrays):
        with torch.no_grad():
            return float((model_from_arrays(arrays, strategy.global_config)(x) - target).pow(2).mean())

    from fedlmc.strategies import aligned as aligned_module

    merged_with = []
    real_merge = aligned_module.universe_merge
    spy = lambda models, *a, **kw: merged_with.append(len(models)) or real_merge(models, *a, **kw)  # noqa: E731
    monkeypatch.setattr(aligned_module, "universe_merge", spy)
    strategy = AlignedFedAvg(model=cfg, screen=Screen(method="loss"), guard=Guard(fn=gap))
    msgs = [_reply(m.float(), 10, node=i + 1) for i, m in enumerate(replies)]
    strategy.aggregate_replies(1, msgs, previous)
    rec = strategy.history[-1]
    assert rec["screen"]["method"] == "loss" and rec["screen"]["excluded"] == [POISONED + 1], rec["screen"]
    assert "held-out loss" in rec["excluded"][0]["reason"]
    # scored as the replies came: one alignment, of the replies kept
    assert merged_with == [POISONED], merged_with
    assert len(rec["moved"]) == POISONED

    honest = screen([], Screen(method="loss"), losses=[1.0, 1.1, 0.9, 1.05, 0.95])
    assert honest.excluded == {} and len(honest.scores) == 5
    with pytest.raises(ValueError, match="guard=Guard"):
        AlignedFedAvg(model=cfg, screen=Screen(method="loss"))
    from fedlmc.federated import Settings

    for method in ("loss", "agreement"):
        assert Settings.from_run_config({"strategy": "aligned", "screen": method}).screen_options().method == method
        assert Settings.from_run_config({"strategy": "refined", "screen": method}).screen_options().method == method
        for bad in (
            {"strategy": "aligned-clients"},
            {"strategy": "refined-clients"},
            {"strategy": "aligned", "guard": False},
        ):
            with pytest.raises(ValueError, match="guard split"):
                Settings.from_run_config({**bad, "screen": method})


@pytest.mark.parametrize("method", ["agreement", "information"])
def test_agreement_screen_excludes_the_reply_whose_predictions_agree_least(method):
    """Screen(method="agreement" / "information"): each reply's top-1 predictions on the guard's inputs
    (labels unread), its mean agreement (mutual information) with the others', and the robust z-score
    of a low one; the planted attacker among rotated and permuted honest replies is excluded and no
    honest reply is; without the guard's data the strategy refuses the screen."""
    from fedlmc.data import ArrayData
    from fedlmc.merging.screen import agreement

    base, replies = _federation(poisoned=True)
    cfg = replies[0].config.to_dict()
    previous = ArrayRecord(torch_state_dict={k: v.float() for k, v in base.state_dict().items()})
    x = torch.randn(256, 1, 12, 12, generator=torch.Generator().manual_seed(5))
    guard = ArrayData(x, torch.full((256,), -1))  # labels that no loss could use: the screen never reads them
    strategy = AlignedFedAvg(model=cfg, screen=Screen(method=method), guard=Guard(data=guard, batches=None))
    strategy.guard_loss = lambda guard, model: 0.0  # the do-no-harm guard is not what this test is about
    msgs = [_reply(m.float(), 10, node=i + 1) for i, m in enumerate(replies)]
    strategy.aggregate_replies(1, msgs, previous)
    rec = strategy.history[-1]
    assert rec["screen"]["method"] == method and rec["screen"]["excluded"] == [POISONED + 1], rec["screen"]
    what = "agrees with the others' predictions" if method == "agreement" else "mutual information"
    assert what in rec["excluded"][0]["reason"]
    assert len(rec["screen"]["values"]) == len(replies)

    P = [torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 0]), torch.tensor([3, 3, 3, 3])]
    assert agreement(P).tolist() == pytest.approx([(0.75 + 0.25) / 2, (0.75 + 0) / 2, (0.25 + 0) / 2])
    with pytest.raises(ValueError, match="guard's data"):
        AlignedFedAvg(model=cfg, screen=Screen(method=method), guard=Guard(fn=lambda arrays: 0.0))


def test_information_screen_excludes_the_reply_whose_predictions_tell_nothing_about_the_others():
    """Screen(method="information"): honest replies that name the classes differently (each a relabelling
    of one partition of the inputs, as clients trained on different classes do) share their
    predictions' information, so none is excluded although they agree on few labels; a reply whose
    predictions are unrelated to the inputs' classes is excluded, with the statistic in the reason and
    the record; the agreement screen cannot tell them apart here."""
    from fedlmc.merging.screen import information, mutual_information

    g = torch.Generator().manual_seed(0)
    truth = torch.randint(0, 10, (2000,), generator=g)
    honest = []
    for _ in range(4):  # each its own names for the classes, and a few mistakes
        names = torch.randperm(10, generator=g)
        p = names[truth]
        wrong = torch.rand(2000, generator=g) < 0.1
        honest.append(torch.where(wrong, torch.randint(0, 10, (2000,), generator=g), p))
    noise = torch.randint(0, 10, (2000,), generator=g)  # learned nothing about the classes
    preds = honest + [noise]
    found = screen([], Screen(method="information"), predictions=preds)
    assert list(found.excluded) == [4], found
    assert "mutual information" in found.excluded[4] and found.values[4] < 0.05 < min(found.values[:4])
    assert not screen([], Screen(method="agreement"), predictions=preds).excluded  # labels disagree throughout
    assert not screen([], Screen(method="information"), predictions=honest).excluded
    # the measure: a relabelling keeps all of it, independence none, a constant none
    assert mutual_information(truth, (truth + 3) % 10) == pytest.approx(1.0)
    assert abs(mutual_information(truth, noise)) < 0.01  # chance removed: the plug-in estimate alone is ~0.01
    assert mutual_information(truth, torch.zeros_like(truth)) == 0.0
    assert information([truth, truth]).tolist() == pytest.approx([1.0, 1.0])
    tokens = torch.randint(0, 50257, (4096,), generator=g)  # a GPT-2 vocabulary: only the pairs that occur
    assert mutual_information(tokens, tokens) == pytest.approx(1.0)
    other = torch.randint(0, 50257, (4096,), generator=g)  # most tokens once: the plug-in I is near H, chance too
    assert mutual_information(tokens, other) < 0.05
    with pytest.raises(ValueError, match="guard's data"):
        AlignedFedAvg(model=from_preset("vit-tiny", **KW).config.to_dict(), screen=Screen(method="information"))


def test_universe_merge_from_an_earlier_merges_alignment_skips_the_matching(monkeypatch):
    """``universe_merge(start=Aligned(universe, transforms))``: the universe an earlier merge returned, with
    its transforms, and no weight matching; a transform per model missing is refused."""
    _, replies = _federation(poisoned=False, n=3)
    universe, transforms = universe_merge(replies, universe=Universe(iterations=2, keep_layernorm=True))
    monkeypatch.setattr("fedlmc.merging.universe.weight_matching", lambda *a, **kw: pytest.fail("matched again"))
    again, same = universe_merge(
        replies, start=Aligned(universe, transforms), universe=Universe(keep_layernorm=True, iterations=5)
    )
    a, b = universe.state_dict(), again.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-12
    assert all(s is t for s, t in zip(same, transforms))
    with pytest.raises(ValueError, match="one transform per model"):
        universe_merge(
            replies, start=Aligned(universe, transforms[:2]), universe=Universe(iterations=5, keep_layernorm=False)
        )
