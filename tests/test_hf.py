"""Hugging Face models: fedlmc ↔ transformers conversions reproduce logits, and the canonical form and
random group elements are function-preserving through the Hugging Face model's *own* forward."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fedlmc.hf import HFAdapter, from_hf, recognise, to_hf  # noqa: E402
from fedlmc.symmetry import apply_transform, canonicalize, random_transform, to_layernorm  # noqa: E402


def hf_gpt2(tied=True):
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=4,
            vocab_size=40,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=tied,
        )
    )


def hf_vit():
    return transformers.ViTForImageClassification(
        transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=8,
            patch_size=2,
            num_channels=1,
            num_labels=10,
        )
    )


def hf_llama(tied=False):
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=40,
            max_position_embeddings=16,
            tie_word_embeddings=tied,
        )
    )


def hf_opt(tied=True):
    return transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=40,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=16,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=tied,
        )
    )


def hf_neox(tied=False, parallel=True):
    return transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=40,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=16,
            **(  # transformers 4 names them rotary_pct and rotary_emb_base
                {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
                if int(transformers.__version__.split(".")[0]) >= 5
                else {"rotary_pct": 0.5, "rotary_emb_base": 10000.0}
            ),
            use_parallel_residual=parallel,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=tied,
        )
    )


MAKERS = {"gpt2": hf_gpt2, "vit": hf_vit, "llama": hf_llama, "opt": hf_opt, "neox": hf_neox}


def shaken(model, seed=0, scale=0.05):
    """A model whose norms, biases and weights are all non-trivial (HF initialises gains to 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model.eval()


def inputs(name, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return torch.randn(3, 1, 8, 8, generator=g, dtype=dtype)
    return torch.randint(0, 40, (3, 16), generator=g)


def logits(model, x):
    with torch.no_grad():
        if isinstance(model, transformers.PreTrainedModel):
            out = model(pixel_values=x) if model.config.model_type == "vit" else model(input_ids=x)
            return out.logits
        return model(x)


@pytest.mark.parametrize("name", list(MAKERS))
def test_conversions_reproduce_logits(name, tmp_path, record):
    torch.manual_seed(0)
    hf = shaken(MAKERS[name]())
    x = inputs(name)
    ours = from_hf(hf)
    record(f"{name}: from_hf logits (float32)", (logits(ours, x) - logits(hf, x)).abs().max(), 1e-5)
    back = to_hf(ours)
    record(f"{name}: to_hf(from_hf) logits (float32)", (logits(back, x) - logits(hf, x)).abs().max(), 1e-5)
    hf.save_pretrained(tmp_path)
    record(f"{name}: from_hf(save_pretrained dir)", (logits(from_hf(tmp_path), x) - logits(hf, x)).abs().max(), 1e-5)
    assert getattr(back.config, "tie_word_embeddings", False) == getattr(hf.config, "tie_word_embeddings", False)


@pytest.mark.parametrize("name", list(MAKERS))
def test_symmetries_through_the_hf_forward(name, record):
    """float64: canonical form, then a random element of the whole group (O·1 = 1 for LayerNorm models
    so they go back to LayerNorm; Llama's O is unrestricted), then back into a Hugging Face model."""
    if name == "opt" and tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (4, 50):
        pytest.skip("transformers 4.45-4.49's OPT forward cannot build a float64 causal mask (its own bug)")
    torch.manual_seed(0)
    hf = shaken(MAKERS[name](), seed=2).double()
    x = inputs(name, torch.float64)
    ours = from_hf(hf)
    layernorm = name != "llama"
    # HF's LlamaRMSNorm computes in float32 whatever the model's dtype, so Llama's HF forward agrees to
    # float32 rounding only; fedlmc's own Llama forward checks the same elements to 1e-10. (GPT-NeoX's
    # rotary angles are float32 too, but the same in both HF forwards compared here.)
    bound = 1e-10 if layernorm else 1e-5
    for seed in range(2):
        T = random_transform(ours, seed=seed, fix_ones=layernorm)
        moved = apply_transform(canonicalize(ours), T)
        record(
            f"{name}: random element {seed}, fedlmc forward (float64)",
            (logits(moved, x) - logits(ours, x)).abs().max(),
            1e-10,
        )
        back = to_hf(to_layernorm(moved) if layernorm else moved, tied=False)
        assert back.fedlmc_fit_error < 1e-10
        record(
            f"{name}: random element {seed}, Hugging Face forward (float64)",
            (logits(back, x) - logits(hf, x)).abs().max(),
            bound,
        )


def test_tied_gpt2_keeps_one_tensor(record):
    """A tied client gets one tensor for both keys, also after an orthogonal alignment, which breaks the
    tie: the head is then fitted to ``E diag(g)`` and the fit's error is reported, not hidden. Loading the
    result into the client's tied model computes exactly what the fitted weights say."""
    torch.manual_seed(0)
    hf = shaken(hf_gpt2(tied=True), seed=3).double()
    adapter = HFAdapter(hf)
    assert adapter.tied and recognise(hf.state_dict()) == "GPT2LMHeadModel"
    ours = from_hf(hf)
    unchanged = adapter.to_client(ours, keys=hf.state_dict().keys())
    record("gpt2 tied: untouched model, tie fit error", adapter.fit_error, 1e-12)
    assert torch.equal(unchanged["lm_head.weight"], unchanged["transformer.wte.weight"])
    orth = to_layernorm(apply_transform(ours, random_transform(ours, seed=1, fix_ones=True)))
    sd = adapter.to_client(orth, keys=hf.state_dict().keys())
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    assert adapter.fit_error > 1e-3  # an orthogonal residual map breaks the tie: measured, then fitted
    back = transformers.GPT2LMHeadModel(hf.config).double().eval()
    back.load_state_dict({k: v.double() for k, v in sd.items()}, strict=True)
    assert torch.equal(back.lm_head.weight, back.transformer.wte.weight)


def test_hf_model_for_builds_opt_from_a_gpt2_config(record):
    """``hf_model_for(cfg, family="opt")`` is an ``OPTForCausalLM`` (tied, as OPT is) of a GPT-2-architecture
    config's shape, which ``from_hf`` reads back as that config and computes alike; an unknown family is named."""
    from fedlmc.hf import hf_model_for
    from fedlmc.models import GPT2Config, from_preset

    cfg = GPT2Config(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=40, block_size=16, activation="relu")
    hf = shaken(hf_model_for(cfg, seed=0, family="opt"))
    assert isinstance(hf, transformers.OPTForCausalLM) and hf.config.tie_word_embeddings
    ours = from_hf(hf)
    assert ours.config.replace(dropout=0.0) == cfg.replace(dropout=0.0)
    x = inputs("opt")
    record("opt from hf_model_for: from_hf logits (float32)", (logits(ours, x) - logits(hf, x)).abs().max(), 1e-5)
    assert isinstance(hf_model_for(cfg, seed=0), transformers.GPT2LMHeadModel)
    with pytest.raises(ValueError, match="no Hugging Face family 'bert'"):
        hf_model_for(cfg, family="bert")
    with pytest.raises(ValueError, match="'opt' holds fedlmc's 'gpt2' models, not 'llama'"):
        hf_model_for(from_preset("llama-tiny").config, family="opt")


def test_unknown_keys_are_named():
    assert recognise(["fc1.weight", "fc2.weight"]) is None
    with pytest.raises(ValueError, match="model_type"):
        HFAdapter(
            transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
        )


@pytest.mark.parametrize("name", list(MAKERS))
def test_cli_import_and_export_round_trip(name, tmp_path, record):
    """``fedlmc import DIR`` then ``fedlmc export --to hf DIR`` reproduces the logits."""
    from fedlmc.cli import main

    torch.manual_seed(0)
    hf = shaken(MAKERS[name](), seed=6)
    hf.save_pretrained(tmp_path / "src")
    assert main(["import", str(tmp_path / "src"), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "back")]) == 0
    back = getattr(transformers, type(hf).__name__).from_pretrained(tmp_path / "back").eval()
    x = inputs(name)
    record(f"{name}: fedlmc import → export logits (float32)", (logits(back, x) - logits(hf, x)).abs().max(), 1e-5)
