"""LoRA / PEFT aggregation modulo the adapter's gauge (fedlmc.lora, LoraFedAvg): exactness in float64,
gauge invariance, factored = dense, PEFT's keys, scaling and fan_in_fan_out, mixed ranks, the SVD tail
options, and bad input refused with a reason."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from conftest import metadata
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from fedlmc.lora import (  # noqa: E402
    LoraAggregator,
    LoraInputError,
    LoraLayout,
    apply_base_update,
    balanced,
    base_weight_key,
    product_svd,
    set_adapter,
)
from fedlmc.strategies import LoraFedAvg  # noqa: E402

GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# peft before 0.7 (FlowerTune's pin, 0.6.2) has no rsLoRA: its cases run where the installed peft does
RSLORA = "use_rslora" in inspect.signature(LoraConfig.__init__).parameters or hasattr(LoraConfig, "use_rslora")


def gpt2_peft(r=4, alpha=8, rslora=False, seed=0, **extra):
    if rslora:
        if not RSLORA:
            pytest.skip("the installed peft has no rsLoRA")
        extra["use_rslora"] = True
    torch.manual_seed(seed)
    base = GPT2LMHeadModel(
        GPT2Config(vocab_size=33, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    )
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=GPT2_TARGETS, fan_in_fan_out=True, **extra)
    return get_peft_model(base, cfg)


def llama_peft(r=4, alpha=8, seed=0):
    torch.manual_seed(seed)
    base = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=33,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
        )
    )
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=LLAMA_TARGETS))


def random_adapter(layout, rank, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {
        m.name: (
            torch.randn(m.out_features, rank, generator=g, dtype=torch.float64) * scale,
            torch.randn(rank, m.in_features, generator=g, dtype=torch.float64) * scale,
        )
        for m in layout.modules
    }


def weighted_products(layout, clients, weights):
    total = sum(weights)
    return {
        m.name: sum(
            w / total * m.scaling(c[m.name][1].shape[0]) * c[m.name][0] @ c[m.name][1] for c, w in zip(clients, weights)
        )
        for m in layout.modules
    }


def product_of(layout, factors, name, rank=None):
    mod = next(m for m in layout.modules if m.name == name)
    b, a = factors[name]
    return mod.scaling(a.shape[0] if rank is None else rank) * b @ a


# ---- the algebra ------------------------------------------------------------------------------------


def test_lora_aggregate_is_the_weighted_mean_of_the_products_when_the_rank_allows(record):
    layout = LoraLayout.of(llama_peft(r=16)).with_ranks(16)
    clients = [random_adapter(layout, r, seed) for seed, r in enumerate((2, 4, 8))]  # Σr = 14 ≤ 16
    weights = [3.0, 1.0, 2.0]
    agg = LoraAggregator(layout, tail="drop")
    agg.aggregate(clients, weights)
    want, got = weighted_products(layout, clients, weights), agg.factors()
    err = max(float((product_of(layout, got, n) - want[n]).abs().max() / want[n].abs().max()) for n in want)
    record("lora: aggregate ΔW = weighted mean of ΔW (rank allows)", err, 1e-10)


def test_lora_aggregate_is_invariant_to_each_clients_gauge(record):
    layout = LoraLayout.of(gpt2_peft(r=4))
    clients = [random_adapter(layout, 4, seed) for seed in range(3)]
    weights = [1.0, 2.0, 3.0]
    ref = LoraAggregator(layout)
    ref.aggregate(clients, weights)
    g = torch.Generator().manual_seed(7)
    moved = []
    for c in clients:  # a random invertible G per client and module: A → G A, B → B G⁻¹
        out = {}
        for name, (b, a) in c.items():
            G = torch.randn(4, 4, generator=g, dtype=torch.float64) + 2 * torch.eye(4, dtype=torch.float64)
            out[name] = (b @ torch.linalg.inv(G), G @ a)
        moved.append(out)
    agg = LoraAggregator(layout)
    agg.aggregate(moved, weights)
    err = max(
        float((x - y).abs().max())
        for n in ref.factors()
        for x, y in zip(ref.factors()[n], agg.factors()[n])  # the factors themselves, not only the product
    )
    record("lora: aggregate factors invariant to client gauges G", err, 1e-10)


def test_fedrot_lora_undoes_a_rotation_of_one_adapter(record):
    """FedRot-LoRA on planted clients: every client holds the same adapter (B₀, A₀) behind its own
    rotation Q (B₀Q, QᵀA₀); rotated onto the reference A₀ they are the adapter again, so their factor
    means are (B₀, A₀) exactly, where FedIT's means of the same factors are not."""
    from fedlmc.baselines import lora as lb
    from fedlmc.symmetry.random import random_orthogonal

    layout = LoraLayout.of(gpt2_peft(r=4))
    planted = random_adapter(layout, 4, seed=1)
    clients = []
    for s in range(3):
        g = torch.Generator().manual_seed(100 + s)
        rotations = {m.name: random_orthogonal(4, 4, g, torch.float64) for m in layout.modules}
        for Q in rotations.values():
            if float(torch.linalg.det(Q)) < 0:  # a rotation, as FedRot-LoRA's alignment returns
                Q[:, 0] = -Q[:, 0]
        clients.append({n: (b @ rotations[n], rotations[n].T @ a) for n, (b, a) in planted.items()})
    got = lb.fedrot_lora(layout, clients, [1.0, 2.0, 3.0], planted, 4)
    err = max(float((got[n][i] - planted[n][i]).abs().max()) for n in planted for i in (0, 1))
    record("FedRot-LoRA: rotated copies of one adapter give it back (float64)", err, 1e-10)
    fedit = lb.factor_mean(layout, clients, [1.0, 2.0, 3.0], 4)
    assert max(float((fedit[n][1] - planted[n][1]).abs().max()) for n in planted) > 0.1
    R = lb.procrustes_rotation(clients[0][layout.modules[0].name][1], planted[layout.modules[0].name][1])
    assert float(torch.linalg.det(R)) == pytest.approx(1.0) and torch.allclose(R.T @ R, torch.eye(4, dtype=R.dtype))


def test_energy_shares_are_the_leading_squared_singular_values():
    from fedlmc.baselines.lora import energy_shares

    g = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(6, 3, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(5, 3, generator=g, dtype=torch.float64))[0]
    update = U @ torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)) @ V.T  # energies 9, 4, 1
    shares = energy_shares({"m": update, "zero": torch.zeros(4, 4)}, [1, 2, 3])
    assert shares == pytest.approx({1: 9 / 14, 2: 13 / 14, 3: 1.0})


def test_lora_factored_svd_equals_the_dense_one(record):
    g = torch.Generator().manual_seed(3)
    factors = [
        (torch.randn(48, r, generator=g, dtype=torch.float64), torch.randn(r, 40, generator=g, dtype=torch.float64))
        for r in (2, 4, 8, 3)
    ]
    coeffs = [0.5, -0.25, 1.5, 0.125]
    Uf, Sf, Vf = product_svd(factors, coeffs, dense=False)
    Ud, Sd, Vd = product_svd(factors, coeffs, dense=True)
    dense = sum(c * b @ a for (b, a), c in zip(factors, coeffs))
    record("lora: factored SVD = dense SVD (singular values)", float((Sf - Sd).abs().max() / Sd[0]), 1e-12)
    record("lora: factored SVD reproduces Σ cᵢ Bᵢ Aᵢ", float(((Uf * Sf) @ Vf - dense).abs().max()), 1e-10)
    record("lora: factored = dense factors (sign-fixed)", float(((Uf - Ud).abs().max())), 1e-8)


def test_lora_mixed_ranks_get_their_best_approximation_eckart_young(record):
    layout = LoraLayout.of(gpt2_peft(r=16)).with_ranks(16)
    clients = [random_adapter(layout, r, seed) for seed, r in enumerate((2, 4, 8, 16))]
    weights = [1.0, 1.0, 2.0, 4.0]
    agg = LoraAggregator(layout)
    agg.aggregate(clients, weights)
    want = weighted_products(layout, clients, weights)
    worst = 0.0
    for r in (2, 4, 8, 16):
        got = agg.factors(r)
        for m in layout.modules:
            S = torch.linalg.svdvals(want[m.name])
            err = float(torch.linalg.matrix_norm(product_of(layout, got, m.name, r) - want[m.name]))
            worst = max(worst, abs(err - float(S[r:].pow(2).sum().sqrt())) / float(S[0]))
    record("lora: rank-r factors attain the Eckart–Young error", worst, 1e-10)


@pytest.mark.parametrize("gauge", ["balanced", "anchored"])
def test_lora_keep_tail_follows_fedavg_on_the_products_across_rounds(gauge, record):
    layout = LoraLayout.of(llama_peft(r=4))
    agg = LoraAggregator(layout, tail="keep", keep_factor=math.inf, gauge=gauge)
    start = random_adapter(layout, 4, 100, scale=0.0)
    agg.start(start)
    exact = {m.name: torch.zeros(m.out_features, m.in_features, dtype=torch.float64) for m in layout.modules}
    for rnd in range(3):
        sent = agg.factors()
        clients, weights = [], [1.0, 2.0, 1.0]
        for c in range(3):  # each client moves its factors from what it was sent
            g = torch.Generator().manual_seed(10 * rnd + c)
            clients.append(
                {
                    n: (
                        b + 0.3 * torch.randn(b.shape, generator=g, dtype=b.dtype),
                        a + 0.3 * torch.randn(a.shape, generator=g, dtype=a.dtype),
                    )
                    for n, (b, a) in sent.items()
                }
            )
        for m in layout.modules:
            exact[m.name] += sum(
                w / 4 * (product_of(layout, cl, m.name) - product_of(layout, sent, m.name))
                for cl, w in zip(clients, weights)
            )
        agg.aggregate(clients, weights)
    err = max(float((agg.products[n].dense() - exact[n]).abs().max()) for n in exact)
    record(f"lora: tail=keep product = FedAvg on products over 3 rounds ({gauge})", err, 1e-10)
    assert any(len(p.S) > 4 * 2 for p in agg.products.values())  # more than the sent rank (4), uncut
    capped = LoraAggregator(layout, tail="keep")  # the default holds at most 4 × r components
    capped.start(start)
    capped.aggregate(clients, weights)
    capped.aggregate(clients, weights)
    assert max(len(p.S) for p in capped.products.values()) <= 16


@pytest.mark.parametrize("gauge", ["balanced", "anchored"])
def test_lora_fold_tail_puts_the_tail_into_the_base(gauge, record):
    layout = LoraLayout.of(gpt2_peft(r=4))
    clients = [random_adapter(layout, 4, seed) for seed in range(3)]
    agg = LoraAggregator(layout, tail="fold", gauge=gauge)
    agg.aggregate(clients, [1.0, 1.0, 1.0])
    want = weighted_products(layout, clients, [1.0, 1.0, 1.0])
    base = agg.base_update()
    err = 0.0
    for m in layout.modules:
        folded = base[m.base_key].double().T  # Conv1D: stored in × out
        err = max(err, float((folded + product_of(layout, agg.factors(), m.name) - want[m.name]).abs().max()))
    record(f"lora: tail=fold base + adapter = exact mean ({gauge})", err, 1e-5)  # the base update travels in float32


def test_lora_anchored_gauge_sends_the_clients_mean_a_and_the_least_squares_b(record):
    """gauge="anchored": A is FedIT's mean A, B the least-squares fit to the exact mean product (its
    residual orthogonal to A's rows), so the product sent is never further from the mean than FedIT's."""
    layout = LoraLayout.of(llama_peft(r=4))
    clients = [random_adapter(layout, 4, seed, scale=0.5) for seed in range(3)]
    weights = [1.0, 2.0, 3.0]
    agg = LoraAggregator(layout, tail="drop", gauge="anchored")
    agg.aggregate(clients, weights)
    got, want = agg.factors(), weighted_products(layout, clients, weights)
    mean_a_err = normal_err = 0.0
    for m in layout.modules:
        b, a = got[m.name]
        mean_a = sum(w / 6 * c[m.name][1] for c, w in zip(clients, weights))
        mean_b = sum(w / 6 * c[m.name][0] for c, w in zip(clients, weights))
        mean_a_err = max(mean_a_err, float((a - mean_a).abs().max()))
        residual = m.scaling() * b @ a - want[m.name]
        normal_err = max(normal_err, float((residual @ a.T).abs().max() / want[m.name].abs().max()))
        fedit = m.scaling() * mean_b @ mean_a - want[m.name]
        assert float(residual.norm()) <= float(fedit.norm()) + 1e-12
    record("lora: anchored A = clients' mean A", mean_a_err, 1e-12)
    record("lora: anchored B: residual ⟂ A's rows (least squares)", normal_err, 1e-10)


def test_lora_even_gauge_is_the_plain_square_root_split(record):
    g = torch.Generator().manual_seed(0)
    b0, a0 = (
        torch.randn(7, 3, generator=g, dtype=torch.float64) * 1e-3,
        torch.randn(3, 5, generator=g, dtype=torch.float64),
    )
    U, S, Vh = product_svd([(b0, a0)], [2.0])
    B, A = balanced(U, S, Vh, 3, 2.0, floor=False)
    err = float((B - U * (S / 2.0).sqrt()).abs().max() + (A - (S / 2.0).sqrt()[:, None] * Vh).abs().max())
    record("lora: even gauge B = U√(S/s), A = √(S/s)Vh", err, 1e-12)
    assert float(A.norm(dim=1).min()) < 0.1  # a small product: the floor's reason (balanced keeps A's rows up)
    assert float(balanced(U, S, Vh, 3, 2.0)[1].norm(dim=1).min()) >= 1 / math.sqrt(3) - 1e-12


def test_lora_balanced_factors_of_a_rank_deficient_product_still_learn():
    U, S, Vh = product_svd([(torch.zeros(6, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64))], [1.0])
    B, A = balanced(U, S, Vh, 4, 2.0)
    assert B.abs().max() == 0 and len(S) == 0
    assert torch.linalg.matrix_rank(A) == 4  # fresh directions (B = 0), not dead zero rows


# ---- PEFT as users have it ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_peft_scaling_and_fan_in_fan_out_match_peft_merge(family, record):
    """ΔW = s·B·A with s from the LoraConfig (α/r, or α/√r for rsLoRA), landing transposed on GPT-2's
    Conv1D: checked against PEFT's own merge in float64."""
    for rslora in (False, True) if RSLORA else (False,):
        if family == "llama" and rslora:
            continue
        model = (gpt2_peft(r=4, alpha=12, rslora=rslora) if family == "gpt2" else llama_peft(r=4, alpha=12)).double()
        layout = LoraLayout.of(model)
        factors = random_adapter(layout, 4, 5, scale=0.2)
        set_peft_model_state_dict(model, layout.write(factors, dtype=torch.float64))
        own = {m.name: base_weight_key(model.state_dict(), m.base_key) for m in layout.modules}  # peft 0.6 too
        before = {k: v.clone() for k, v in model.state_dict().items() if k in own.values()}
        merged = model.merge_and_unload().state_dict()
        err = 0.0
        for m in layout.modules:
            key = m.base_key.removeprefix("base_model.model.").replace(".base_layer", "")
            delta = merged[key] - before[own[m.name]]
            want = product_of(layout, factors, m.name)
            err = max(err, float((delta - (want.T if m.fan_in_fan_out else want)).abs().max()))
        record(f"peft: {family} ΔW = s·B·A as PEFT merges it (rslora={rslora})", err, 1e-12)


def test_peft_key_order_round_trips_keyed_named_and_keyless():
    model = gpt2_peft(r=4)
    layout = LoraLayout.of(model)
    sd = get_peft_model_state_dict(model)
    assert list(sd) == list(layout.keys)
    factors = random_adapter(layout, 4, 1)
    for keyless in (False, True):
        arrays = ArrayRecord(layout.write(factors, keyless=keyless))
        if keyless:  # FlowerTune's ordered list of numpy arrays
            arrays = ArrayRecord([v.numpy() for v in layout.write(factors).values()])
        back = layout.read(arrays)
        assert all(torch.equal(back[n][0], factors[n][0].float()) for n in factors)
        set_adapter(model, arrays)
        got = get_peft_model_state_dict(model)
        assert list(got) == list(layout.keys)
        for m in layout.modules:
            assert torch.allclose(got[m.a_key].double(), factors[m.name][1].float().double())
    named = {k.replace(".weight", ".default.weight"): v for k, v in layout.write(factors).items()}
    assert all(torch.equal(layout.read(named)[n][1], layout.read(layout.write(factors))[n][1]) for n in factors)


def test_peft_set_adapter_cuts_a_larger_aggregate_to_the_clients_rank(record):
    big = LoraLayout.of(gpt2_peft(r=8))
    agg = LoraAggregator(big)
    agg.aggregate([random_adapter(big, 8, s) for s in range(3)], [1, 1, 1])
    small = gpt2_peft(r=2)
    set_adapter(small, big.write(agg.factors()))  # sent at 8, the client holds rank 2 (α fixed: scaling differs)
    got = LoraLayout.of(small).read(get_peft_model_state_dict(small))
    sl = LoraLayout.of(small)
    err = max(
        float((product_of(sl, got, m.name) - product_of(big, agg.factors(2), m.name)).abs().max()) for m in sl.modules
    )
    record("peft: client-side cut = best rank-2 factors", err, 1e-5)


def test_peft_bad_adapters_are_refused_before_round_one_naming_what_is_wrong():
    model = gpt2_peft(r=4)
    good = get_peft_model_state_dict(model)
    strategy = LoraFedAvg(model=model)
    with pytest.raises(LoraInputError, match="not LoRA factors"):
        strategy.set_initial(ArrayRecord({**good, "base_model.model.lm_head.weight": torch.zeros(3, 3)}))
    with pytest.raises(LoraInputError, match="target modules differ"):
        strategy.set_initial(ArrayRecord({k: v for k, v in good.items() if "c_fc" not in k}))
    other = get_peft_model_state_dict(gpt2_peft(r=2))
    with pytest.raises(LoraInputError, match="rank 2 .* says r=4"):
        strategy.set_initial(ArrayRecord(other))
    with pytest.raises(LoraInputError, match="keyless arrays"):
        strategy.set_initial(ArrayRecord([v.numpy() for v in list(good.values())[:-2]]))
    with pytest.raises(LoraInputError, match="model=<your PeftModel>"):
        LoraFedAvg(lora_config=model.peft_config["default"]).set_initial(
            ArrayRecord([v.numpy() for v in good.values()])
        )
    with pytest.raises(LoraInputError, match="needs model="):
        LoraFedAvg()
    with pytest.raises(ValueError, match="tail"):
        LoraFedAvg(model=model, tail="average")


def _reply(arrays, node, n=10):
    content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": n})})
    return Message(content=content, metadata=metadata(node))


def test_peft_strategy_excludes_bad_replies_with_a_reason_and_aggregates_the_rest(caplog, record):
    model = gpt2_peft(r=4)
    layout = LoraLayout.of(model)
    strategy = LoraFedAvg(model=model, lora_config=None)
    strategy.set_initial(ArrayRecord(get_peft_model_state_dict(model)))
    clients = [random_adapter(layout, 4, s, scale=0.1) for s in range(3)]
    nan = {k: v.clone() for k, v in layout.write(clients[0]).items()}
    nan[layout.keys[0]][0, 0] = float("nan")
    replies = [_reply(layout.write(c), node=i + 1) for i, c in enumerate(clients)]
    replies += [
        _reply(nan, 7),
        _reply(get_peft_model_state_dict(gpt2_peft(r=2)), 8),
        _reply({"x.weight": torch.zeros(2)}, 9),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    excluded = {e["node"]: e["reason"] for e in strategy.history[-1]["excluded"]}
    assert set(excluded) == {7, 8, 9} and "NaN" in excluded[7] and "rank 2" in excluded[8] and "not LoRA" in excluded[9]
    assert metrics is not None and strategy.history[-1]["replies"] == 3
    got = layout.read(arrays)
    agg = LoraAggregator(layout)
    agg.start(layout.read(get_peft_model_state_dict(model)))
    agg.aggregate(clients, [1, 1, 1])
    err = max(float((got[n][0] - agg.factors()[n][0]).abs().max()) for n in got)
    record("peft: strategy aggregate (float32) = LoraAggregator on the valid replies", err, 1e-5)
    assert strategy.history[-1]["bytes_received"] > 0


def test_peft_strategy_anchored_gauge_sends_the_replies_mean_a(record):
    model = llama_peft(r=4)
    layout = LoraLayout.of(model)
    strategy = LoraFedAvg(model=model, gauge="anchored")
    strategy.set_initial(ArrayRecord(get_peft_model_state_dict(model)))
    clients = [random_adapter(layout, 4, s, scale=0.1) for s in range(3)]
    arrays, _ = strategy.aggregate_train(1, [_reply(layout.write(c), node=i + 1) for i, c in enumerate(clients)])
    got = layout.read(arrays)
    err = max(float((got[n][1].double() - sum(c[n][1] for c in clients) / 3).abs().max()) for n in got)
    record("peft: LoraFedAvg(gauge='anchored') sends the replies' mean A (float32)", err, 1e-6)
    with pytest.raises(ValueError, match="gauge"):
        LoraFedAvg(model=model, gauge="rotated")


def test_peft_strategy_sends_each_mixed_rank_node_its_own_rank(monkeypatch):
    for attr in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp process has when it builds messages
        monkeypatch.setattr(TaskIdentity, attr, 1)
    model = gpt2_peft(r=8)
    layout = LoraLayout.of(model)
    strategy = LoraFedAvg(model=model, mixed_ranks=True, fraction_evaluate=0.0, min_available_nodes=3)
    strategy.set_initial(ArrayRecord(get_peft_model_state_dict(model)))
    replies = [
        _reply(LoraLayout.of(gpt2_peft(r=r)).write(random_adapter(layout, r, r)), node)
        for node, r in ((1, 2), (2, 8), (3, 4))
    ]
    arrays, _ = strategy.aggregate_train(1, replies)

    class Grid:
        def get_node_ids(self):
            return [1, 2, 3]

    msgs = list(strategy.configure_train(2, arrays, ConfigRecord({}), Grid()))
    ranks = {int(m.metadata.dst_node_id): m.content["arrays"][layout.keys[0]].shape[0] for m in msgs}
    assert ranks == {1: 2, 2: 8, 3: 4}
    assert strategy._sent == sum(m.content["arrays"].count_bytes() for m in msgs)


def test_mixed_ranks_names_the_client_code_when_a_smaller_rank_fails_on_the_declared_one(caplog):
    """Round 1 sends every node the declared rank (8). A FlowerTune-style client of rank 2 that loads it
    with PEFT's ``set_peft_model_state_dict`` fails (a size mismatch); the server warns, naming
    ``fedlmc.lora.set_adapter``, and records the nodes. The same client through ``set_adapter`` answers."""
    from flwr.app import Error

    model = gpt2_peft(r=8)
    layout = LoraLayout.of(model)
    sent = layout.write(random_adapter(layout, 8, 0, scale=0.1))
    small = gpt2_peft(r=2)
    with pytest.raises(RuntimeError, match="size mismatch"):
        set_peft_model_state_dict(small, sent)
    set_adapter(small, ArrayRecord(sent))  # the client code the warning names
    own = LoraLayout.of(small).read(get_peft_model_state_dict(small))
    assert {a.shape[0] for _, a in own.values()} == {2}

    strategy = LoraFedAvg(model=model, mixed_ranks=True)
    strategy.set_initial(ArrayRecord(get_peft_model_state_dict(model)))
    failed = Message(Error(code=2, reason="size mismatch for lora_A"), metadata=metadata(1))
    replies = [failed, _reply(layout.write(random_adapter(layout, 8, 1)), node=2)]
    with caplog.at_level("WARNING"):
        strategy.aggregate_train(1, replies)
        strategy.aggregate_train(2, replies)
    said = [r.getMessage() for r in caplog.records if "set_adapter" in r.getMessage()]
    assert len(said) == 1 and "[1]" in said[0] and "size mismatch" in said[0]
    assert strategy.history[0]["unconfirmed"] == {"mixed-ranks": [1]} and strategy.history[0]["replies"] == 1
    plain = LoraFedAvg(model=model)  # without mixed_ranks the failure is an ordinary failed reply
    plain.set_initial(ArrayRecord(get_peft_model_state_dict(model)))
    plain.aggregate_train(1, replies)
    assert "unconfirmed" not in plain.history[0]


class _OneNode:
    def get_node_ids(self):
        return [1]


def _fold_round_two(clients_n: int, **kw):
    """A ``tail="fold"`` strategy after round 1 on random adapters: the strategy, the layout, the clients'
    factors and its round-2 message to the one node (it carries the base update)."""
    model = gpt2_peft(r=2)
    layout = LoraLayout.of(model)
    strategy = LoraFedAvg(
        model=model, tail="fold", fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1, **kw
    )
    strategy.set_initial(ArrayRecord(get_peft_model_state_dict(model)))
    clients = [random_adapter(layout, 2, s, scale=0.1) for s in range(clients_n)]
    arrays, _ = strategy.aggregate_train(1, [_reply(layout.write(c), i + 1) for i, c in enumerate(clients)])
    (msg,) = strategy.configure_train(2, arrays, ConfigRecord({}), _OneNode())
    return strategy, layout, clients, msg


def test_peft_fold_base_update_travels_and_applies_to_a_fresh_model(record, monkeypatch):
    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    strategy, layout, clients, msg = _fold_round_two(3)
    fresh = gpt2_peft(r=2).double()
    base0 = {k: v.clone() for k, v in fresh.state_dict().items()}
    apply_base_update(fresh, msg.content["base-update"])
    set_adapter(fresh, msg.content["arrays"])
    got = LoraLayout.of(fresh).read(get_peft_model_state_dict(fresh))
    want = weighted_products(layout, clients, [1, 1, 1])
    err = max(
        float(
            (
                (fresh.state_dict()[base_weight_key(base0, m.base_key)] - base0[base_weight_key(base0, m.base_key)]).T
                + product_of(layout, got, m.name)
                - want[m.name]
            )
            .abs()
            .max()
        )
        for m in layout.modules
    )
    record("peft: fold: base update + adapter on a fresh client = exact mean", err, 1e-5)


def test_lora_layout_from_config_and_keyed_arrays_reads_rank_and_alpha_patterns():
    model = gpt2_peft(r=4, alpha=8, rank_pattern={"c_fc": 2}, alpha_pattern={"c_fc": 6})
    sd = get_peft_model_state_dict(model)
    layout = LoraLayout.of(config=model.peft_config["default"], arrays=sd)
    fc = [m for m in layout.modules if m.name.endswith("c_fc")]
    assert fc and all(m.rank == 2 and math.isclose(m.scaling(), 3.0) for m in fc)
    assert all(m.rank == 4 and math.isclose(m.scaling(), 2.0) for m in layout.modules if not m.name.endswith("c_fc"))
    assert layout.read(sd) and np.isfinite(layout.max_rank)


# ---- the FlowerTune-style example app -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_example_app_runs_with_flwr_run_and_both_strategies():
    """examples/flowertune-gpt2 (PEFT LoRA on a locally pretrained HF GPT-2, FlowerTune's client) runs
    2 rounds on 2 SuperNodes of the Ray simulation engine with Flower's FedAvg and with LoraFedAvg:
    every reply of both rounds aggregated, none excluded, and the global adapter learns."""
    import shutil

    from test_simulation import _short_tmp, _stop_local_superlink, run_example

    from fedlmc.flower.launch import local_superlinks

    home = _short_tmp("lora-")
    try:
        for strategy, name in (("fedavg", "FedAvg"), ("lora", "LoraFedAvg")):
            cfg = f"strategy='{strategy}' num-server-rounds=2 local-steps=10 base-steps=200"
            out = run_example("flowertune-gpt2", cfg, home)
            line = next(l for l in out.splitlines() if "flowertune-gpt2 result:" in l)
            assert f"strategy={name} " in line, line
            losses = [float(l.split("test_loss=")[1]) for l in out.splitlines() if l.startswith("round ")]
            assert len(losses) >= 3 and losses[2] < losses[0], out[-3000:]  # rounds 0, 1, 2: it learns
            assert out.count("Received 2 results and 0 failures") == 2, out[-3000:]
            if strategy == "lora":
                assert out.count("LoraFedAvg: round") == 2 and "excluded" not in out
        assert local_superlinks(home) == set()
    finally:
        _stop_local_superlink(home)
        shutil.rmtree(home, ignore_errors=True)


def test_lora_layout_read_copies_and_never_aliases_the_callers_tensors():
    model = gpt2_peft(r=4)
    layout = LoraLayout.of(model)
    live = get_peft_model_state_dict(model)  # the model's own parameters
    got = layout.read(live)
    before = {n: (b.clone(), a.clone()) for n, (b, a) in got.items()}
    with torch.no_grad():
        for v in live.values():
            v.add_(1.0)  # training the model afterwards must not move what was read
    assert all(torch.equal(got[n][0], before[n][0]) and torch.equal(got[n][1], before[n][1]) for n in got)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_harness_claims_hold_on_a_small_run():
    """The LoRA page's claims, on a small run of the same harness (simulations/lora_aggregators.py: a weaker
    base, 30 local steps, 2 rounds, seed 0): LoraFedAvg is not worse than FedIT, and with mixed ranks
    it beats HetLoRA's zero-padding clearly."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations"))
    import lora_aggregators as harness

    harness.SETTINGS["claim-r8"] = dict(
        base_steps=200, scheme="speaker", ranks=[8] * 4, steps=30, rounds=2, methods=("average", "fedlmc")
    )
    harness.SETTINGS["claim-mixed"] = dict(
        base_steps=200, scheme="speaker", ranks=[2, 4, 8, 16], steps=30, rounds=2, methods=("hetlora", "fedlmc")
    )
    same = harness.run("claim-r8", 0)["rows"]
    mixed = harness.run("claim-mixed", 0)["rows"]
    assert same["fedlmc"]["test_loss"][-1] <= same["average"]["test_loss"][-1] + 0.002, same
    assert mixed["fedlmc"]["test_loss"][-1] < mixed["hetlora"]["test_loss"][-1] - 0.01, mixed
    assert same["fedlmc"]["bytes_down"] == same["average"]["bytes_down"]  # no extra bytes on the wire


def test_task_vector_merges_of_lora_products_on_hand_made_adapters():
    """Normalised Task Arithmetic of the dense products is FlexLoRA's cut; TIES on two rank-1 products of opposite
    sign keeps the elected (larger) one alone; DARE at no drop is Task Arithmetic."""
    from fedlmc.baselines import TaskMerge
    from fedlmc.baselines import lora as lb

    layout = LoraLayout.of(gpt2_peft(r=4))
    clients = [random_adapter(layout, 4, seed) for seed in range(3)]
    weights = [1.0, 2.0, 3.0]
    ta = lb.task_vector_lora(layout, clients, weights, 4, TaskMerge(method="task-arithmetic", normalize=True))
    flex = lb.flexlora(layout, clients, weights, 4)
    for m in layout.modules:
        s = m.scaling(4)
        assert torch.allclose(s * ta[m.name][0] @ ta[m.name][1], s * flex[m.name][0] @ flex[m.name][1], atol=1e-10)
    no_drop = lb.task_vector_lora(layout, clients, weights, 4, TaskMerge(method="dare", drop=0.0, normalize=True))
    for m in layout.modules:
        assert torch.allclose(no_drop[m.name][0] @ no_drop[m.name][1], ta[m.name][0] @ ta[m.name][1], atol=1e-10)
    # TIES: client 1's product is +E, client 2's is −2E (E = e₀ e₀ᵀ): the elected sign is −, so the merge
    # is the mean of the entries that agree with it, −2E, not the weighted mean −E/2
    m = layout.modules[0]
    r = 4
    b1 = torch.zeros(m.out_features, r, dtype=torch.float64)
    a1 = torch.zeros(r, m.in_features, dtype=torch.float64)
    b1[0, 0], a1[0, 0] = 1.0, 1.0 / m.scaling(r)
    one = {
        n.name: (
            torch.zeros(n.out_features, r, dtype=torch.float64),
            torch.zeros(r, n.in_features, dtype=torch.float64),
        )
        for n in layout.modules
    }
    two = {k: (v[0].clone(), v[1].clone()) for k, v in one.items()}
    one[m.name], two[m.name] = (b1, a1), (-2 * b1, a1)
    ties = lb.task_vector_lora(layout, [one, two], [1.0, 1.0], r, TaskMerge(method="ties", density=1.0))
    product = m.scaling(r) * ties[m.name][0] @ ties[m.name][1]
    want = torch.zeros_like(product)
    want[0, 0] = -2.0
    assert torch.allclose(product, want, atol=1e-12)


def test_train_lm_carries_the_optimiser_state_across_calls():
    """A client whose AdamW lives on across rounds (the harness's ``+adam`` rows): the second call
    starts from the first's moments and step count, not from a fresh optimiser."""
    from fedlmc.data import TokenData
    from fedlmc.hf.pretrained import train_lm

    model = llama_peft(r=2)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    data = TokenData(torch.randint(0, 33, (600,)), block_size=8)
    holder: dict = {}
    train_lm(model, data, 3, lr=1e-3, batch_size=4, seed=0, params=params, optimizer_state=holder)
    first = {k: v["exp_avg"].clone() for k, v in holder["adamw"]["state"].items()}
    assert all(int(v["step"]) == 3 for v in holder["adamw"]["state"].values())
    train_lm(model, data, 2, lr=1e-3, batch_size=4, seed=1, params=params, optimizer_state=holder)
    assert all(int(v["step"]) == 5 for v in holder["adamw"]["state"].values())
    assert any(not torch.equal(first[k], v["exp_avg"]) for k, v in holder["adamw"]["state"].items())


def test_lora_harness_adds_rows_only_where_its_reference_reproduces(tmp_path):
    """``simulations/lora_aggregators.py --methods``: new rows join a setting's stored results only when the
    reference method run beside them gives the stored figures again (the same clients and code)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations"))
    import lora_aggregators as harness

    row = lambda x: {"test_loss_per_seed": [[x, x - 0.1]], "final_loss": x - 0.1}  # noqa: E731
    stored = {"setting": "speaker-r8-steps10", "seeds": [0], "reference": "average", "rows": {"average": row(2.0)}}
    path = tmp_path / "lora_speaker-r8-steps10.json"
    path.write_text(json.dumps(stored))
    new = {**stored, "rows": {"average": row(2.0), "fedrot-lora": row(1.9)}, "environment": {}}
    out = harness.merged(path, new)
    assert list(out["rows"]) == ["average", "fedrot-lora"] and out["reproduced"]["added"] == ["fedrot-lora"]
    with pytest.raises(SystemExit, match="does not reproduce"):
        harness.merged(path, {**new, "rows": {"average": row(2.01), "fedrot-lora": row(1.9)}})


@pytest.mark.parametrize("confirms", [False, True])
def test_fold_replies_must_confirm_the_base_update_they_were_sent(confirms, monkeypatch, caplog):
    """tail="fold" runs partly in the ClientApp (it adds the base update): a round whose replies do not
    confirm it is warned about, naming the client code (refused with ``unconfirmed="error"``)."""
    import logging

    from fedlmc.strategies.knobs import confirm

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    strategy, layout, clients, msg = _fold_round_two(2)
    assert "base-update" in msg.content
    replies = [_reply(layout.write(c), i + 1) for i, c in enumerate(clients)]
    if confirms:
        for r in replies:
            confirm(r.content["metrics"], msg.content, "base-update")
    with caplog.at_level(logging.WARNING):
        strategy.aggregate_train(2, replies)
    assert ("do not confirm 'base-update'" in caplog.text) is not confirms
    assert ("unconfirmed" in strategy.history[-1]) is not confirms
    if not confirms:
        assert "apply_base_update" in caplog.text
        strict, layout, clients, _ = _fold_round_two(2, unconfirmed="error")
        with pytest.raises(ValueError, match="base-update"):
            strict.aggregate_train(2, [_reply(layout.write(c), i + 1) for i, c in enumerate(clients)])
