"""Hugging Face ↔ fedlmc, per model family: configs and state dicts under each side's keys.

Each family maps a ``transformers`` config to a fedlmc config and back, and a state dict key by key
(GPT-2's Conv1D weights are stored transposed and its ``c_attn`` fuses q, k and v; ViT's patch
projection is a Conv2d, which on non-overlapping patches is fedlmc's linear map on unfolded patches).
The output head's affine (tied embeddings, GPT-2's bias-free ``lm_head``) is fitted by the caller
(``fedlmc.hf.head``), so ``state_to_hf`` here receives a fedlmc state whose head needs no bias.
"""

from __future__ import annotations

from typing import Any

import torch

from fedlmc.models import GPT2Config, LlamaConfig, NeoXConfig, ViTConfig
from fedlmc.models.layers import TransformerConfig

StateDict = dict[str, torch.Tensor]
HF_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "relu": "relu"}


def transformers_major() -> int:
    """The installed ``transformers``' major version: 4 and 5 name some keys and config fields apart."""
    import transformers

    return int(transformers.__version__.split(".")[0])


def _act(name: str) -> str:
    if name not in HF_ACT:
        raise ValueError(f"activation {name!r} has no fedlmc equivalent; supported: {sorted(HF_ACT)}")
    return HF_ACT[name]


def _scale_q(sd: StateDict, cfg: TransformerConfig, keys: list[str]) -> None:
    """Hugging Face scores with 1/√d_head: fold a fedlmc model's other attention scale into q."""
    ratio = cfg.attn_scale * cfg.d_head**0.5
    if abs(ratio - 1.0) > 1e-12:
        for k in keys:
            sd[k] = sd[k] * ratio


class GPT2Family:
    name, model_class, prefix = "gpt2", "GPT2LMHeadModel", "transformer.h.0.attn.c_attn.weight"
    arch = "gpt2"  # the fedlmc architecture this family holds
    embeddings = ("transformer.wte.weight", "lm_head.weight")

    @staticmethod
    def config_from_hf(c: Any) -> GPT2Config:
        if getattr(c, "scale_attn_by_inverse_layer_idx", False) or not getattr(c, "scale_attn_weights", True):
            raise ValueError(
                "GPT-2 configs with scale_attn_by_inverse_layer_idx or without scale_attn_weights are not supported"
            )
        return GPT2Config(
            n_layer=c.n_layer,
            d_model=c.n_embd,
            n_head=c.n_head,
            d_ff=c.n_inner or 4 * c.n_embd,
            vocab_size=c.vocab_size,
            block_size=c.n_positions,
            norm_eps=c.layer_norm_epsilon,
            activation=_act(c.activation_function),
        )

    @staticmethod
    def config_to_hf(cfg: GPT2Config, tied: bool):
        from transformers import GPT2Config as HF

        if cfg.n_head * cfg.d_head != cfg.d_model:
            raise ValueError("Hugging Face GPT-2 needs n_head × d_head = d_model (merge in the factored form)")
        act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}[cfg.activation]
        tok = min(50256, cfg.vocab_size - 1)
        return HF(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.block_size,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_inner=cfg.d_ff,
            activation_function=act,
            layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=tied,
            bos_token_id=tok,
            eos_token_id=tok,
        )

    @staticmethod
    def state_from_hf(hf: StateDict, cfg: GPT2Config) -> StateDict:
        d = cfg.d_model
        sd = {
            "tok_emb.weight": hf["transformer.wte.weight"],
            "pos_emb": hf["transformer.wpe.weight"],
            "ln_f.weight": hf["transformer.ln_f.weight"],
            "ln_f.bias": hf["transformer.ln_f.bias"],
            "head.weight": hf.get("lm_head.weight", hf["transformer.wte.weight"]),
            "head.bias": torch.zeros(cfg.vocab_size, dtype=hf["transformer.wte.weight"].dtype),
        }
        for l in range(cfg.n_layer):
            h, b = f"transformer.h.{l}", f"blocks.{l}"
            W, bias = hf[f"{h}.attn.c_attn.weight"], hf[f"{h}.attn.c_attn.bias"]
            for i, p in enumerate("qkv"):
                sd[f"{b}.attn.{p}.weight"] = W[:, i * d : (i + 1) * d].T
                sd[f"{b}.attn.{p}.bias"] = bias[i * d : (i + 1) * d]
            for mine, theirs in (("attn.o", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                sd[f"{b}.{mine}.weight"], sd[f"{b}.{mine}.bias"] = (
                    hf[f"{h}.{theirs}.weight"].T,
                    hf[f"{h}.{theirs}.bias"],
                )
            for mine, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                sd[f"{b}.{mine}.weight"], sd[f"{b}.{mine}.bias"] = hf[f"{h}.{theirs}.weight"], hf[f"{h}.{theirs}.bias"]
        return {k: v.clone() for k, v in sd.items()}

    @staticmethod
    def state_to_hf(sd: StateDict, cfg: GPT2Config) -> StateDict:
        sd = dict(sd)
        out = {
            "transformer.wte.weight": sd["tok_emb.weight"],
            "transformer.wpe.weight": sd["pos_emb"],
            "transformer.ln_f.weight": sd["ln_f.weight"],
            "transformer.ln_f.bias": sd["ln_f.bias"],
            "lm_head.weight": sd["head.weight"],
        }
        for l in range(cfg.n_layer):
            h, b = f"transformer.h.{l}", f"blocks.{l}"
            _scale_q(sd, cfg, [f"{b}.attn.q.weight", f"{b}.attn.q.bias"])
            out[f"{h}.attn.c_attn.weight"] = torch.cat([sd[f"{b}.attn.{p}.weight"].T for p in "qkv"], dim=1)
            out[f"{h}.attn.c_attn.bias"] = torch.cat([sd[f"{b}.attn.{p}.bias"] for p in "qkv"])
            for mine, theirs in (("attn.o", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                out[f"{h}.{theirs}.weight"], out[f"{h}.{theirs}.bias"] = (
                    sd[f"{b}.{mine}.weight"].T,
                    sd[f"{b}.{mine}.bias"],
                )
            for mine, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                out[f"{h}.{theirs}.weight"], out[f"{h}.{theirs}.bias"] = (
                    sd[f"{b}.{mine}.weight"],
                    sd[f"{b}.{mine}.bias"],
                )
        return {k: v.contiguous() for k, v in out.items()}


class ViTFamily:
    name, model_class, prefix = "vit", "ViTForImageClassification", "vit.embeddings.patch_embeddings.projection.weight"
    arch = "vit"
    embeddings = ()
    LAYER = {  # transformers 5's keys, under vit.layers.{l}.
        "attn.q": "attention.q_proj",
        "attn.k": "attention.k_proj",
        "attn.v": "attention.v_proj",
        "attn.o": "attention.o_proj",
        "mlp.fc1": "mlp.fc1",
        "mlp.fc2": "mlp.fc2",
        "ln1": "layernorm_before",
        "ln2": "layernorm_after",
    }
    LAYER_4 = {  # transformers 4's, under vit.encoder.layer.{l}.
        "attn.q": "attention.attention.query",
        "attn.k": "attention.attention.key",
        "attn.v": "attention.attention.value",
        "attn.o": "attention.output.dense",
        "mlp.fc1": "intermediate.dense",
        "mlp.fc2": "output.dense",
        "ln1": "layernorm_before",
        "ln2": "layernorm_after",
    }

    @classmethod
    def layer_keys(cls, four: bool) -> tuple[str, dict[str, str]]:
        """The block keys' prefix (with ``{l}``) and names: transformers 4's or 5's."""
        return ("vit.encoder.layer.{l}.", cls.LAYER_4) if four else ("vit.layers.{l}.", cls.LAYER)

    @staticmethod
    def config_from_hf(c: Any) -> ViTConfig:
        if not getattr(c, "qkv_bias", True):
            raise ValueError("ViT configs without qkv_bias are not supported")
        return ViTConfig(
            n_layer=c.num_hidden_layers,
            d_model=c.hidden_size,
            n_head=c.num_attention_heads,
            d_ff=c.intermediate_size,
            image_size=c.image_size,
            patch_size=c.patch_size,
            channels=c.num_channels,
            num_classes=c.num_labels,
            norm_eps=c.layer_norm_eps,
            activation=_act(c.hidden_act),
        )

    @staticmethod
    def config_to_hf(cfg: ViTConfig, tied: bool):
        from transformers import ViTConfig as HF

        if cfg.n_head * cfg.d_head != cfg.d_model:
            raise ValueError("Hugging Face ViT needs n_head × d_head = d_model (merge in the factored form)")
        act = {"gelu": "gelu", "gelu_tanh": "gelu_new"}[cfg.activation]
        return HF(
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            intermediate_size=cfg.d_ff,
            hidden_act=act,
            layer_norm_eps=cfg.norm_eps,
            image_size=cfg.image_size,
            patch_size=cfg.patch_size,
            num_channels=cfg.channels,
            num_labels=cfg.num_classes,
            qkv_bias=True,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )

    @classmethod
    def state_from_hf(cls, hf: StateDict, cfg: ViTConfig) -> StateDict:
        proj = hf["vit.embeddings.patch_embeddings.projection.weight"]
        sd = {
            "patch_emb.weight": proj.reshape(proj.shape[0], -1),
            "patch_emb.bias": hf["vit.embeddings.patch_embeddings.projection.bias"],
            "cls_token": hf["vit.embeddings.cls_token"],
            "pos_emb": hf["vit.embeddings.position_embeddings"][0],
            "ln_f.weight": hf["vit.layernorm.weight"],
            "ln_f.bias": hf["vit.layernorm.bias"],
            "head.weight": hf["classifier.weight"],
            "head.bias": hf["classifier.bias"],
        }
        prefix, names = cls.layer_keys(four=any(k.startswith("vit.encoder.layer.") for k in hf))
        for l in range(cfg.n_layer):
            for mine, theirs in names.items():
                for t in ("weight", "bias"):
                    sd[f"blocks.{l}.{mine}.{t}"] = hf[f"{prefix.format(l=l)}{theirs}.{t}"]
        return {k: v.clone() for k, v in sd.items()}

    @classmethod
    def state_to_hf(cls, sd: StateDict, cfg: ViTConfig) -> StateDict:
        sd = dict(sd)
        p = cfg.patch_size
        out = {
            "vit.embeddings.patch_embeddings.projection.weight": sd["patch_emb.weight"].reshape(
                cfg.d_model, cfg.channels, p, p
            ),
            "vit.embeddings.patch_embeddings.projection.bias": sd["patch_emb.bias"],
            "vit.embeddings.cls_token": sd["cls_token"],
            "vit.embeddings.position_embeddings": sd["pos_emb"][None],
            "vit.layernorm.weight": sd["ln_f.weight"],
            "vit.layernorm.bias": sd["ln_f.bias"],
            "classifier.weight": sd["head.weight"],
            "classifier.bias": sd["head.bias"],
        }
        prefix, names = cls.layer_keys(four=transformers_major() < 5)
        for l in range(cfg.n_layer):
            _scale_q(sd, cfg, [f"blocks.{l}.attn.q.weight", f"blocks.{l}.attn.q.bias"])
            for mine, theirs in names.items():
                for t in ("weight", "bias"):
                    out[f"{prefix.format(l=l)}{theirs}.{t}"] = sd[f"blocks.{l}.{mine}.{t}"]
        return {k: v.contiguous() for k, v in out.items()}


class LlamaFamily:
    name, model_class, prefix = "llama", "LlamaForCausalLM", "model.layers.0.mlp.gate_proj.weight"
    arch = "llama"
    embeddings = ("model.embed_tokens.weight", "lm_head.weight")
    LAYER = {
        "attn.q": "self_attn.q_proj",
        "attn.k": "self_attn.k_proj",
        "attn.v": "self_attn.v_proj",
        "attn.o": "self_attn.o_proj",
        "mlp.gate": "mlp.gate_proj",
        "mlp.up": "mlp.up_proj",
        "mlp.down": "mlp.down_proj",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
    }

    @staticmethod
    def config_from_hf(c: Any) -> LlamaConfig:
        rope = (getattr(c, "rope_parameters", None) if transformers_major() >= 5 else None) or {
            "rope_type": (getattr(c, "rope_scaling", None) or {}).get("rope_type", "default"),
            "rope_theta": getattr(c, "rope_theta", 1e4),
        }
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_type {rope.get('rope_type')!r} is not supported (only the default rotary embedding)"
            )
        if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
            raise ValueError("Llama configs with attention_bias or mlp_bias are not supported")
        d_head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return LlamaConfig(
            n_layer=c.num_hidden_layers,
            d_model=c.hidden_size,
            n_head=c.num_attention_heads,
            n_kv_head=c.num_key_value_heads or c.num_attention_heads,
            d_head=d_head,
            d_ff=c.intermediate_size,
            vocab_size=c.vocab_size,
            block_size=c.max_position_embeddings,
            rope_theta=float(rope["rope_theta"]),
            norm_eps=c.rms_norm_eps,
            activation=_act(c.hidden_act),
        )

    @staticmethod
    def config_to_hf(cfg: LlamaConfig, tied: bool):
        from transformers import LlamaConfig as HF

        return HF(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_kv_head,
            head_dim=cfg.d_head,
            max_position_embeddings=cfg.block_size,
            rms_norm_eps=cfg.norm_eps,
            **(
                {"rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
                if transformers_major() >= 5
                else {"rope_theta": cfg.rope_theta}
            ),
            hidden_act=cfg.activation,
            tie_word_embeddings=tied,
            attention_bias=False,
            mlp_bias=False,
        )

    @classmethod
    def state_from_hf(cls, hf: StateDict, cfg: LlamaConfig) -> StateDict:
        sd = {
            "tok_emb.weight": hf["model.embed_tokens.weight"],
            "ln_f.weight": hf["model.norm.weight"],
            "head.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"]),
        }
        for l in range(cfg.n_layer):
            for mine, theirs in cls.LAYER.items():
                sd[f"blocks.{l}.{mine}.weight"] = hf[f"model.layers.{l}.{theirs}.weight"]
        return {k: v.clone() for k, v in sd.items()}

    @classmethod
    def state_to_hf(cls, sd: StateDict, cfg: LlamaConfig) -> StateDict:
        sd = dict(sd)
        ref = sd["tok_emb.weight"]
        ones = torch.ones(cfg.d_model, dtype=ref.dtype, device=ref.device)  # the canonical form has no gains
        out = {
            "model.embed_tokens.weight": ref,
            "model.norm.weight": sd.get("ln_f.weight", ones),
            "lm_head.weight": sd["head.weight"],
        }
        for l in range(cfg.n_layer):
            _scale_q(sd, cfg, [f"blocks.{l}.attn.q.weight"])
            for mine, theirs in cls.LAYER.items():
                out[f"model.layers.{l}.{theirs}.weight"] = sd.get(f"blocks.{l}.{mine}.weight", ones)
        return {k: v.contiguous() for k, v in out.items()}


class OPTFamily:
    """OPT (``OPTForCausalLM``): a pre-LayerNorm decoder with learned positions and ReLU FFs, fedlmc's GPT-2
    architecture with ``activation="relu"``. Its position table has two leading rows no full sequence
    reads (positions start at offset 2); they are dropped on the way in and written as zeros on the way
    out. Configs with post-LayerNorm blocks, a projected embedding or no biases are refused."""

    name, model_class, prefix = "opt", "OPTForCausalLM", "model.decoder.layers.0.self_attn.q_proj.weight"
    arch = "gpt2"
    embeddings = ("model.decoder.embed_tokens.weight", "lm_head.weight")
    OFFSET = 2
    LAYER = {
        "attn.q": "self_attn.q_proj",
        "attn.k": "self_attn.k_proj",
        "attn.v": "self_attn.v_proj",
        "attn.o": "self_attn.out_proj",
        "mlp.fc1": "fc1",
        "mlp.fc2": "fc2",
        "ln1": "self_attn_layer_norm",
        "ln2": "final_layer_norm",
    }

    @staticmethod
    def config_from_hf(c: Any) -> GPT2Config:
        if not c.do_layer_norm_before or c.word_embed_proj_dim != c.hidden_size or not c.enable_bias:
            raise ValueError(
                "OPT configs with post-LayerNorm blocks (do_layer_norm_before=False), a projected embedding "
                "(word_embed_proj_dim != hidden_size) or no biases are not supported"
            )
        if not c.layer_norm_elementwise_affine or getattr(c, "_remove_final_layer_norm", False):
            raise ValueError("OPT configs without affine LayerNorms or without the final LayerNorm are not supported")
        return GPT2Config(
            n_layer=c.num_hidden_layers,
            d_model=c.hidden_size,
            n_head=c.num_attention_heads,
            d_ff=c.ffn_dim,
            vocab_size=c.vocab_size,
            block_size=c.max_position_embeddings,
            activation=_act(c.activation_function),
        )

    @staticmethod
    def config_to_hf(cfg: GPT2Config, tied: bool):
        from transformers import OPTConfig as HF

        if cfg.n_head * cfg.d_head != cfg.d_model:
            raise ValueError("Hugging Face OPT needs n_head × d_head = d_model (merge in the factored form)")
        return HF(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layer,
            ffn_dim=cfg.d_ff,
            num_attention_heads=cfg.n_head,
            max_position_embeddings=cfg.block_size,
            word_embed_proj_dim=cfg.d_model,
            activation_function=cfg.activation,
            dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=tied,
        )

    @classmethod
    def state_from_hf(cls, hf: StateDict, cfg: GPT2Config) -> StateDict:
        emb = hf["model.decoder.embed_tokens.weight"]
        sd = {
            "tok_emb.weight": emb,
            "pos_emb": hf["model.decoder.embed_positions.weight"][cls.OFFSET :],
            "ln_f.weight": hf["model.decoder.final_layer_norm.weight"],
            "ln_f.bias": hf["model.decoder.final_layer_norm.bias"],
            "head.weight": hf.get("lm_head.weight", hf.get("embed_out.weight", emb)),
            "head.bias": torch.zeros(cfg.vocab_size, dtype=emb.dtype),
        }
        for l in range(cfg.n_layer):
            for mine, theirs in cls.LAYER.items():
                for part in ("weight", "bias"):
                    sd[f"blocks.{l}.{mine}.{part}"] = hf[f"model.decoder.layers.{l}.{theirs}.{part}"]
        return {k: v.clone() for k, v in sd.items()}

    @classmethod
    def state_to_hf(cls, sd: StateDict, cfg: GPT2Config) -> StateDict:
        sd = dict(sd)
        pos = sd["pos_emb"]
        out = {
            "model.decoder.embed_tokens.weight": sd["tok_emb.weight"],
            "model.decoder.embed_positions.weight": torch.cat([pos.new_zeros(cls.OFFSET, pos.shape[1]), pos]),
            "model.decoder.final_layer_norm.weight": sd["ln_f.weight"],
            "model.decoder.final_layer_norm.bias": sd["ln_f.bias"],
            "lm_head.weight": sd["head.weight"],
        }
        for l in range(cfg.n_layer):
            _scale_q(sd, cfg, [f"blocks.{l}.attn.q.weight", f"blocks.{l}.attn.q.bias"])
            for mine, theirs in cls.LAYER.items():
                for part in ("weight", "bias"):
                    out[f"model.decoder.layers.{l}.{theirs}.{part}"] = sd[f"blocks.{l}.{mine}.{part}"]
        return {k: v.contiguous() for k, v in out.items()}


class _NeoXEmbeddings:
    """GPT-NeoX's (input embedding, head) keys under the installed transformers."""

    def __get__(self, obj: Any, owner: Any) -> tuple[str, str]:
        return ("gpt_neox.embed_in.weight", "embed_out.weight" if transformers_major() < 5 else "lm_head.weight")


class GPTNeoXFamily:
    """GPT-NeoX (``GPTNeoXForCausalLM``, the Pythia suites): fedlmc's NeoX architecture. Its
    ``query_key_value`` fuses q, k and v head by head (rows ``[q_h; k_h; v_h]`` for each head h);
    ``partial_rotary_factor`` becomes ``rotary_dims``. Configs without attention biases or with another
    rotary embedding than the default are refused."""

    name, model_class, prefix = "neox", "GPTNeoXForCausalLM", "gpt_neox.layers.0.attention.query_key_value.weight"
    arch = "neox"
    embeddings = _NeoXEmbeddings()  # transformers 4 names the head embed_out, 5 lm_head
    LAYER = {
        "attn.o": "attention.dense",
        "mlp.fc1": "mlp.dense_h_to_4h",
        "mlp.fc2": "mlp.dense_4h_to_h",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
    }

    @staticmethod
    def config_from_hf(c: Any) -> NeoXConfig:
        if transformers_major() >= 5:
            rope = dict(getattr(c, "rope_parameters", None) or {})
        else:  # the fields transformers 4's model reads (a rope_parameters there is an unread attribute)
            rope = {"rope_theta": c.rotary_emb_base, "partial_rotary_factor": c.rotary_pct}
        if getattr(c, "rope_scaling", None):
            rope["rope_type"] = c.rope_scaling.get("rope_type", c.rope_scaling.get("type"))
        if rope.get("rope_type", "default") != "default" or not getattr(c, "attention_bias", True):
            raise ValueError(
                "GPT-NeoX configs without attention biases or with a non-default rope_type are not supported"
            )
        d_head = c.hidden_size // c.num_attention_heads
        return NeoXConfig(
            n_layer=c.num_hidden_layers,
            d_model=c.hidden_size,
            n_head=c.num_attention_heads,
            d_ff=c.intermediate_size,
            vocab_size=c.vocab_size,
            block_size=c.max_position_embeddings,
            norm_eps=c.layer_norm_eps,
            activation=_act(c.hidden_act),
            rope_theta=float(rope.get("rope_theta", 1e4)),
            rotary_dims=int(d_head * rope.get("partial_rotary_factor", 1.0)),
            parallel=bool(c.use_parallel_residual),
        )

    @staticmethod
    def config_to_hf(cfg: NeoXConfig, tied: bool):
        from transformers import GPTNeoXConfig as HF

        factor = cfg.rotary_dims / cfg.d_head
        if cfg.n_head * cfg.d_head != cfg.d_model or int(cfg.d_head * factor) != cfg.rotary_dims:
            raise ValueError("Hugging Face GPT-NeoX needs n_head × d_head = d_model (merge in the factored form)")
        act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}[cfg.activation]
        return HF(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            intermediate_size=cfg.d_ff,
            hidden_act=act,
            max_position_embeddings=cfg.block_size,
            layer_norm_eps=cfg.norm_eps,
            **(
                {
                    "rope_parameters": {
                        "rope_type": "default",
                        "rope_theta": cfg.rope_theta,
                        "partial_rotary_factor": factor,
                    }
                }
                if transformers_major() >= 5
                else {"rotary_emb_base": cfg.rope_theta, "rotary_pct": factor}
            ),
            use_parallel_residual=cfg.parallel,
            attention_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=tied,
        )

    @classmethod
    def state_from_hf(cls, hf: StateDict, cfg: NeoXConfig) -> StateDict:
        emb = hf["gpt_neox.embed_in.weight"]
        sd = {
            "tok_emb.weight": emb,
            "ln_f.weight": hf["gpt_neox.final_layer_norm.weight"],
            "ln_f.bias": hf["gpt_neox.final_layer_norm.bias"],
            "head.weight": hf.get("lm_head.weight", hf.get("embed_out.weight", emb)),
            "head.bias": torch.zeros(cfg.vocab_size, dtype=emb.dtype),
        }
        H, dh = cfg.n_head, cfg.d_head
        for l in range(cfg.n_layer):
            pre = f"gpt_neox.layers.{l}"
            for part in ("weight", "bias"):
                qkv = hf[f"{pre}.attention.query_key_value.{part}"]
                qkv = qkv.reshape(H, 3, dh, *qkv.shape[1:])  # per head: q, k, v rows
                for i, p in enumerate("qkv"):
                    sd[f"blocks.{l}.attn.{p}.{part}"] = qkv[:, i].reshape(H * dh, *qkv.shape[3:])
                for mine, theirs in cls.LAYER.items():
                    sd[f"blocks.{l}.{mine}.{part}"] = hf[f"{pre}.{theirs}.{part}"]
        return {k: v.clone() for k, v in sd.items()}

    @classmethod
    def state_to_hf(cls, sd: StateDict, cfg: NeoXConfig) -> StateDict:
        sd = dict(sd)
        out = {
            "gpt_neox.embed_in.weight": sd["tok_emb.weight"],
            "gpt_neox.final_layer_norm.weight": sd["ln_f.weight"],
            "gpt_neox.final_layer_norm.bias": sd["ln_f.bias"],
            cls.embeddings[1]: sd["head.weight"],
        }
        H, dh = cfg.n_head, cfg.d_head
        for l in range(cfg.n_layer):
            pre = f"gpt_neox.layers.{l}"
            _scale_q(sd, cfg, [f"blocks.{l}.attn.q.weight", f"blocks.{l}.attn.q.bias"])
            for part in ("weight", "bias"):
                qkv = [sd[f"blocks.{l}.attn.{p}.{part}"] for p in "qkv"]
                qkv = torch.stack([t.reshape(H, dh, *t.shape[1:]) for t in qkv], dim=1)
                out[f"{pre}.attention.query_key_value.{part}"] = qkv.reshape(3 * H * dh, *qkv.shape[3:])
                for mine, theirs in cls.LAYER.items():
                    out[f"{pre}.{theirs}.{part}"] = sd[f"blocks.{l}.{mine}.{part}"]
        return {k: v.contiguous() for k, v in out.items()}


FAMILIES = {f.name: f for f in (GPT2Family, ViTFamily, LlamaFamily, OPTFamily, GPTNeoXFamily)}
HF_TYPES = {"gpt2": "gpt2", "vit": "vit", "llama": "llama", "opt": "opt", "gpt_neox": "neox"}  # model_type -> family
