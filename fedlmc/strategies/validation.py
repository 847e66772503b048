"""Reply validation: every train reply is checked before it can touch the global model.

A reply is excluded (with one log line naming the node and the reason) when its metrics lack a
positive, finite example count; it has no weights; its declared model config is missing or invalid,
or differs from the federation's architecture in anything but width; its tensors miss keys the
declared config needs, carry extra ones, or have other shapes; any value is NaN or infinite; or its
weights are absurdly large (overall norm more than ``max_norm_ratio`` times the current global
model's, or any entry above ``max_abs``).
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import torch

from fedlmc.models import from_config
from fedlmc.strategies.records import MODEL_KEY


class InvalidReply(ValueError):
    """Why a reply cannot be aggregated (the message is the reason logged)."""


def declared_config(content, default: Optional[dict[str, Any]]) -> dict[str, Any]:
    rec = content.get(MODEL_KEY) if hasattr(content, "get") else None
    if rec is not None and "config" in rec:
        try:
            cfg = json.loads(str(rec["config"]))
        except json.JSONDecodeError as e:
            raise InvalidReply(f"its model config is not JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise InvalidReply("its model config is not an object")
        return cfg
    if default is None:
        raise InvalidReply("it declares no model config and the strategy has none")
    return default


def reply_weight(content, weight_key: str) -> float:
    """A reply's weight, the ``weight_key`` entry of its metrics: any positive finite number, as Flower
    weighs replies, and a whole one where the key is ``num-examples`` (an example count)."""
    metrics = list(content.metric_records.values())
    if not metrics or weight_key not in metrics[0]:
        raise InvalidReply(f"its metrics have no '{weight_key}'")
    weight = metrics[0][weight_key]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(float(weight)):
        raise InvalidReply(f"'{weight_key}' is {weight!r}, not a finite number")
    if float(weight) <= 0:
        raise InvalidReply(f"'{weight_key}' is {weight!r}, not positive")
    if weight_key == "num-examples" and float(weight) != int(weight):
        raise InvalidReply(f"'{weight_key}' is {weight!r}, not a whole number of examples")
    return float(weight)


def check_values(
    sd: dict[str, torch.Tensor], reference_norm: Optional[float], max_norm_ratio: float, max_abs: float = 1e6
) -> None:
    """``InvalidReply`` when a floating-point tensor holds NaN or Inf, an entry above ``max_abs``, or the
    whole exceeds ``max_norm_ratio`` times ``reference_norm`` (the global model's weight norm)."""
    total = 0.0
    for k, v in sd.items():
        if not v.is_floating_point():
            continue
        if not bool(torch.isfinite(v).all()):
            raise InvalidReply(f"{k} contains NaN or Inf")
        peak = float(v.abs().max()) if v.numel() else 0.0
        if peak > max_abs:
            raise InvalidReply(f"{k} has an entry of magnitude {peak:.3g} (> {max_abs:.0g})")
        total += float(v.double().pow(2).sum())
    norm = total**0.5
    if reference_norm is not None and reference_norm > 0 and norm > max_norm_ratio * reference_norm:
        raise InvalidReply(
            f"its weight norm {norm:.3g} is {norm / reference_norm:.0f}× the global model's (limit {max_norm_ratio:g}×)"
        )


def check_arrays(
    content,
    *,
    arrays_key: str,
    weight_key: str,
    reference: Optional[dict[str, tuple[int, ...]]],
    reference_norm: Optional[float] = None,
    max_norm_ratio: float = 100.0,
) -> tuple[dict[str, torch.Tensor], float]:
    """What can be checked of a reply without a model (the arrays Flower's FedAvg would average): its
    weight, its ArrayRecord, the keys and shapes of ``reference`` (the global arrays sent, key → shape),
    finite values and the norm bound. Returns (tensors, weight) or raises ``InvalidReply``."""
    weight = reply_weight(content, weight_key)
    if arrays_key not in content.array_records:
        raise InvalidReply(f"it carries no ArrayRecord '{arrays_key}'")
    try:
        sd = content[arrays_key].to_torch_state_dict()
    except Exception as e:  # a malformed record must not take the round down
        raise InvalidReply(f"its arrays cannot be read ({type(e).__name__}: {e})") from None
    if reference is not None:
        missing, extra = sorted(set(reference) - set(sd)), sorted(set(sd) - set(reference))
        if missing or extra:
            which = f"misses {missing[0]}" if missing else f"carries {extra[0]}"
            raise InvalidReply(f"its arrays are not the global model's: it {which}")
        for k, shape in reference.items():
            if tuple(sd[k].shape) != shape:
                raise InvalidReply(f"{k} has shape {tuple(sd[k].shape)}, the global model's is {shape}")
    check_values(sd, reference_norm, max_norm_ratio)
    return sd, weight


def check_reply(
    content,
    *,
    arrays_key: str,
    weight_key: str,
    reference_config: Optional[dict[str, Any]],
    reference_norm: Optional[float] = None,
    same_shape: bool = True,
    max_norm_ratio: float = 100.0,
    max_abs: float = 1e6,
    adapter=None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], float]:
    """Return (config, state dict, weight) of a valid reply, else raise ``InvalidReply``. With an
    ``adapter`` (``fedlmc.hf.HFAdapter``) the reply is under the client model's own keys: it is checked
    against that model's keys and shapes, and its state dict is returned in fedlmc's keys."""
    weight = reply_weight(content, weight_key)
    if arrays_key not in content.array_records:
        raise InvalidReply(f"it carries no ArrayRecord '{arrays_key}'")
    cfg = adapter.config.to_dict() if adapter is not None else declared_config(content, reference_config)
    if reference_config is not None and adapter is None:
        if not same_shape and isinstance(cfg.get("n_layer"), int) and "n_layer" in reference_config:
            if not 1 <= cfg["n_layer"] <= reference_config["n_layer"]:  # a shallower client is padded, not a deeper
                raise InvalidReply(
                    f"its model config has n_layer={cfg['n_layer']}: a client may be as deep as the federation's "
                    f"{reference_config['n_layer']} layers, not deeper"
                )
        for key in (
            "arch",
            *(("n_layer",) if same_shape else ()),
            "vocab_size",
            "block_size",
            "image_size",
            "patch_size",
            "channels",
            "num_classes",
        ):
            if key in reference_config and cfg.get(key) != reference_config[key]:
                raise InvalidReply(
                    f"its model config has {key}={cfg.get(key)!r}, the federation's is {reference_config[key]!r}"
                )
        if same_shape:
            for key in ("d_model", "n_head", "d_ff", "d_head"):
                if cfg.get(key) != reference_config.get(key):
                    raise InvalidReply(
                        f"its width {key}={cfg.get(key)!r} does not match the global model's "
                        f"{reference_config.get(key)!r} (use HeteroWidthFedAvg for mixed widths)"
                    )
    try:
        template = adapter.template if adapter is not None else from_config(cfg).state_dict()
    except (ValueError, TypeError, KeyError) as e:
        raise InvalidReply(f"its model config is invalid ({e})") from None
    try:
        sd = content[arrays_key].to_torch_state_dict()
    except Exception as e:  # a malformed record must not take the round down
        raise InvalidReply(f"its arrays cannot be read ({type(e).__name__}: {e})") from None
    if adapter is not None and adapter.tied:  # a tied model's state dict may list its head's key or not
        template = {k: v for k, v in template.items() if k in sd or k != adapter.family.embeddings[1]}
    missing, extra = sorted(set(template) - set(sd)), sorted(set(sd) - set(template))
    if missing:
        raise InvalidReply(f"it misses {len(missing)} tensor(s) its config needs, e.g. {missing[0]}")
    if extra:
        raise InvalidReply(f"it carries {len(extra)} tensor(s) its config does not have, e.g. {extra[0]}")
    for k, t in template.items():
        shape = tuple(t) if isinstance(t, tuple) else tuple(t.shape)
        if tuple(sd[k].shape) != shape:
            raise InvalidReply(f"{k} has shape {tuple(sd[k].shape)}, its declared config needs {shape}")
    for k, v in sd.items():
        if not v.is_floating_point():
            raise InvalidReply(f"{k} is not a floating-point tensor ({v.dtype})")
    check_values(sd, reference_norm, max_norm_ratio, max_abs)
    if adapter is not None:
        sd = adapter.to_fedlmc(sd).state_dict()
    return cfg, sd, float(weight)
