"""The strategies on Hugging Face replies: client keys in, the same keys out (loadable with
``strict=True``), tied keys one tensor, the architecture from ``model=``, and clear errors otherwise."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import metadata
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from test_hf import hf_gpt2, hf_llama, hf_neox, hf_opt, hf_vit, inputs, logits, shaken

from fedlmc.hf import from_hf
from fedlmc.options import Guard, Refinement, Universe
from fedlmc.strategies import AlignedFedAvg
from fedlmc.symmetry import apply_transform, random_transform, to_layernorm


def reply(state: dict, n: int, node: int) -> Message:
    content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": n})})
    md = metadata(node)
    return Message(content=content, metadata=md)


class NoGrid:
    def __getattr__(self, name):
        raise AssertionError("the grid must not be used")


def planted_copies(hf, count: int) -> list[dict]:
    """The same function under different symmetries (O·1 = 1 so each stays a LayerNorm model; Llama's
    O is free), each as the client's own state dict."""
    ours = from_hf(hf)
    out = []
    for s in range(count):
        m = apply_transform(
            ours,
            random_transform(
                ours, seed=s + 1, fix_ones=hf.config.model_type != "llama", groups=("residual", "heads", "ff")
            ),
        )
        m = to_layernorm(m) if hf.config.model_type != "llama" else m
        from fedlmc.hf import to_hf

        out.append({k: v.float() for k, v in to_hf(m, tied=False).state_dict().items()})
    return out


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: hf_gpt2(tied=False), "gpt2"),
        (hf_vit, "vit"),
        (hf_llama, "llama"),
        (lambda: hf_opt(tied=False), "opt"),
        (hf_neox, "neox"),
    ],
)
def test_aligned_fedavg_on_hf_replies(make, name, record):
    torch.manual_seed(0)
    hf = shaken(make(), seed=4)
    strategy = AlignedFedAvg(model=hf.config, universe=Universe(iterations=2))
    initial = ArrayRecord(hf.state_dict())
    strategy.check_architecture(initial)
    strategy._previous = initial
    replies = [reply(sd, 10, i + 1) for i, sd in enumerate(planted_copies(hf, 3))]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert strategy.history[-1]["excluded"] == []
    out = type(hf)(hf.config).eval()
    out.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    x = inputs(name)
    # three copies of one function, aligned, average to that function (plain FedAvg would not)
    record(
        f"{name}: AlignedFedAvg of 3 planted HF replies vs the model",
        (logits(out, x) - logits(hf, x)).abs().max(),
        1e-3,
    )
    plain = type(hf)(hf.config).eval()
    plain.load_state_dict(
        {k: sum(r.content["arrays"].to_torch_state_dict()[k] for r in replies) / 3 for k in arrays.keys()}
    )
    assert (logits(plain, x) - logits(hf, x)).abs().max() > 1e-2


def test_tied_gpt2_aggregate_has_one_tensor_for_both_keys():
    torch.manual_seed(0)
    hf = shaken(hf_gpt2(tied=True), seed=5)
    strategy = AlignedFedAvg(model=hf, universe=Universe(iterations=1))
    initial = ArrayRecord(hf.state_dict())
    strategy.check_architecture(initial)
    strategy._previous = initial
    states = [{k: v.clone() for k, v in shaken(hf_gpt2(tied=True), seed=s).state_dict().items()} for s in (6, 7)]
    arrays, _ = strategy.aggregate_train(1, [reply(sd, 5, i + 1) for i, sd in enumerate(states)])
    sd = arrays.to_torch_state_dict()
    assert set(sd) == set(hf.state_dict())
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])


def test_hf_weights_without_model_name_what_is_missing():
    hf = hf_gpt2()
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*head count.*pass model="):
        AlignedFedAvg().start(grid=NoGrid(), initial_arrays=ArrayRecord(hf.state_dict()), num_rounds=1)
    with pytest.raises(ValueError, match="unexpected keys fc1.weight"):
        AlignedFedAvg(model=hf.config).start(
            grid=NoGrid(), initial_arrays=ArrayRecord({"fc1.weight": torch.zeros(2, 2)}), num_rounds=1
        )


def test_guard_fn_decides_on_the_clients_form():
    torch.manual_seed(0)
    hf = shaken(hf_vit(), seed=8)
    seen = []

    def guard_fn(arrays: ArrayRecord) -> float:
        sd = arrays.to_torch_state_dict()
        seen.append(sorted(sd))
        return float(sd["classifier.bias"].sum())  # any loss of the client's form; lower wins

    strategy = AlignedFedAvg(model=hf.config, universe=Universe(iterations=1), guard=Guard(fn=guard_fn))
    initial = ArrayRecord(hf.state_dict())
    strategy.check_architecture(initial)
    strategy._previous = initial
    states = [shaken(hf_vit(), seed=s).state_dict() for s in (9, 10)]
    strategy.aggregate_train(1, [reply(sd, 5, i + 1) for i, sd in enumerate(states)])
    rec = strategy.history[-1]
    assert len(seen) == 2 and seen[0] == sorted(hf.state_dict())
    assert rec["kept"] == ("average" if rec["guard_average"] < rec["guard_aligned"] else "aligned")


def test_refined_fedavg_on_hf_replies_with_a_batch_source_and_loss_fn():
    """RefinedFedAvg on Llama replies: refinement data is any batch source (here ``ArrayData`` over
    token tensors) and the loss a user callable; the aggregate loads strictly into the client model."""
    from fedlmc.data import ArrayData
    from fedlmc.strategies import HeteroWidthFedAvg, RefinedFedAvg

    torch.manual_seed(0)
    hf = shaken(hf_llama(), seed=11)
    calls = []

    def loss_fn(out, y):
        calls.append(1)
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    tokens = torch.randint(0, 40, (32, 17))
    strategy = RefinedFedAvg(
        model=hf,
        refine=Refinement(data=ArrayData(tokens[:, :-1], tokens[:, 1:]), steps=3, loss_fn=loss_fn),
        universe=Universe(iterations=1),
    )
    initial = ArrayRecord(hf.state_dict())
    strategy.check_architecture(initial)
    strategy._previous = initial
    states = [shaken(hf_llama(), seed=s).state_dict() for s in (12, 13)]
    arrays, _ = strategy.aggregate_train(1, [reply(sd, 5, i + 1) for i, sd in enumerate(states)])
    # the user's loss drives the 3 steps and scores the aggregate on the held-out quarter (8 examples: one
    # batch) at the start and after the last step
    assert len(calls) == 3 + 2 and strategy.history[-1]["refine_steps_run"] == 3
    out = type(hf)(hf.config)
    out.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    with pytest.raises(ValueError, match="Llama"):
        HeteroWidthFedAvg(model=hf)


def _vit_of_width(d: int, heads: int):
    return transformers.ViTForImageClassification(
        transformers.ViTConfig(
            hidden_size=d,
            num_hidden_layers=2,
            num_attention_heads=heads,
            intermediate_size=2 * d,
            image_size=8,
            patch_size=2,
            num_channels=1,
            num_labels=10,
        )
    )


def test_hetero_width_fedavg_on_hf_clients_of_two_widths(record, monkeypatch):
    """HF ViT clients of widths 16 and 32, the wide one the narrow one lifted into its width and moved by
    a group element: each reply is read by the adapter of its width, the universe (a LayerNorm model,
    the wide client's class and keys) computes the narrow function, and the narrow node is sent a
    model of its own class and width, under its keys, that computes it too (through HF's forward)."""
    from flwr.app import ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity

    from fedlmc.hf import to_hf
    from fedlmc.merging.widths import ones_lift, pad
    from fedlmc.strategies import HeteroWidthFedAvg
    from fedlmc.symmetry import Transform, canonicalize

    torch.manual_seed(0)
    narrow = shaken(_vit_of_width(16, 2), seed=21)
    wide = pad(canonicalize(from_hf(narrow)), {"d_model": 32, "d_ff": 64, "n_head": 4})
    wide = apply_transform(wide, Transform({"residual": ones_lift(16, 32, torch.float32)}))
    wide = to_layernorm(
        apply_transform(
            wide, random_transform(wide, seed=5, fix_ones=True, dtype=torch.float32, groups=("residual", "heads", "ff"))
        )
    )
    wide_hf = to_hf(wide)
    strategy = HeteroWidthFedAvg(model=[narrow.config, wide_hf.config], universe=Universe(iterations=2))
    initial = ArrayRecord(wide_hf.state_dict())
    strategy.check_architecture(initial)
    strategy._previous = initial
    replies = [
        reply({k: v.float() for k, v in wide_hf.state_dict().items()}, 10, 1),
        reply({k: v.float() for k, v in narrow.state_dict().items()}, 10, 2),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert strategy.history[-1]["excluded"] == [] and strategy.history[-1]["widths"] == [32, 16]
    x = inputs("vit")
    universe = _vit_of_width(32, 4).eval()
    universe.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    ref = logits(narrow, x)
    record(
        "HF hetero: universe (HF ViT, width 32) vs the narrow client",
        float((logits(universe, x) - ref).abs().max()),
        1e-4,
    )
    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)

    class Grid:
        def get_node_ids(self):
            return [1, 2]

    sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(2, arrays, ConfigRecord({}), Grid())}
    own = _vit_of_width(16, 2).eval()
    own.load_state_dict(sent[2].content.array_records["arrays"].to_torch_state_dict(), strict=True)
    record(
        "HF hetero: model sent to the narrow node (HF ViT, width 16) vs narrow",
        float((logits(own, x) - ref).abs().max()),
        1e-4,
    )
    big = _vit_of_width(32, 4).eval()
    big.load_state_dict(sent[1].content.array_records["arrays"].to_torch_state_dict(), strict=True)
    # a reply of a width nobody listed is excluded with the reason
    odd = {k: v.float() for k, v in shaken(_vit_of_width(24, 2), seed=3).state_dict().items()}
    strategy.aggregate_train(2, [reply(odd, 10, 3), replies[1]])
    assert [e["node"] for e in strategy.history[-1]["excluded"]] == [3]


def test_hetero_width_fedavg_on_tied_hf_gpt2_clients(monkeypatch):
    """Independently started tied GPT-2 clients of widths 16 and 32: the aggregate and the narrow node's
    model load strictly into their own GPT2LMHeadModel, with one tensor for the tied keys."""
    from flwr.app import ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity

    from fedlmc.strategies import HeteroWidthFedAvg

    def gpt2(d, heads, seed):
        torch.manual_seed(seed)
        return shaken(
            transformers.GPT2LMHeadModel(
                transformers.GPT2Config(
                    n_layer=2, n_embd=d, n_head=heads, vocab_size=40, n_positions=16, bos_token_id=0, eos_token_id=0
                )
            ),
            seed,
        )

    wide, narrow = gpt2(32, 4, 1), gpt2(16, 2, 2)
    strategy = HeteroWidthFedAvg(model=[wide, narrow], universe=Universe(iterations=1))
    initial = ArrayRecord(wide.state_dict())
    strategy.check_architecture(initial)
    strategy._previous = initial
    arrays, _ = strategy.aggregate_train(
        1, [reply({k: v.float() for k, v in m.state_dict().items()}, 10, i + 1) for i, m in enumerate((wide, narrow))]
    )
    assert strategy.history[-1]["excluded"] == []
    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)

    class Grid:
        def get_node_ids(self):
            return [1, 2]

    sent = {
        m.metadata.dst_node_id: m.content.array_records["arrays"].to_torch_state_dict()
        for m in strategy.configure_train(2, arrays, ConfigRecord({}), Grid())
    }
    for node, width in ((1, 32), (2, 16)):
        sd = sent[node]
        assert sd["transformer.wte.weight"].shape == (40, width)
        assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
        model = type(wide)(wide.config if width == 32 else narrow.config)
        model.load_state_dict(sd, strict=True)
