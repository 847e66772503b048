"""Describe your own pre-norm Transformer by where it keeps each part: ``Roles`` maps the roles the
symmetry spec needs (residual writers, attention Q/K/V/O, FF in/out, the norms that feed them, the
output head) onto your module names, and ``spec_from_roles`` builds the spec from it.

    roles = Roles(layer="stack.{l}", q="stack.{l}.attention.query", k="stack.{l}.attention.key",
                  v="stack.{l}.attention.value", o="stack.{l}.attention.out", ff_in="stack.{l}.w_in",
                  ff_out="stack.{l}.w_out", norm1="stack.{l}.norm_a", norm2="stack.{l}.norm_b",
                  final_norm="norm", head="readout", writers=[("embedding.weight", 1), ("positions", 1)])
    register_architecture("tiny-lm", TinyLMConfig, TinyLM)
    register_spec("tiny-lm", lambda cfg: spec_from_roles(cfg, roles))

Requirements (what makes these the model's symmetries): blocks compute ``x + attn(norm1(x))`` then
``x + ff(norm2(x))`` with heads as contiguous blocks of ``d_head`` rows of Q/K/V (columns of O) and an
elementwise FF nonlinearity; norms are built with ``fedlmc.models.layers.make_norm(config)`` so the
canonical form can swap LayerNorm for RMSNorm; the config subclasses ``TransformerConfig``.
``tests/test_roles.py`` runs a module whose names match none of fedlmc's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedlmc.models.layers import TransformerConfig
from fedlmc.symmetry.spec import Member, SymmetrySpec, transformer_spec


@dataclass(frozen=True)
class Roles:
    """Module names, with ``{l}`` for the layer index where a module is per layer. ``writers``: the
    residual-writing parameters outside the blocks (embeddings, positions, a CLS token) and the axis
    that indexes the residual dimension in each."""

    layer: str
    q: str
    k: str
    v: str
    o: str
    ff_in: str
    ff_out: str
    norm1: str
    norm2: str
    final_norm: str
    head: str
    writers: list[tuple[str, int]] = field(default_factory=list)

    def modules(self, n_layer: int) -> dict[str, str]:
        """fedlmc's module name → yours, for every layer."""
        ours = {
            "blocks.{l}": self.layer,
            "blocks.{l}.attn.q": self.q,
            "blocks.{l}.attn.k": self.k,
            "blocks.{l}.attn.v": self.v,
            "blocks.{l}.attn.o": self.o,
            "blocks.{l}.mlp.fc1": self.ff_in,
            "blocks.{l}.mlp.fc2": self.ff_out,
            "blocks.{l}.ln1": self.norm1,
            "blocks.{l}.ln2": self.norm2,
        }
        out = {k.format(l=l): v.format(l=l) for l in range(n_layer) for k, v in ours.items()}
        out.update({"ln_f": self.final_norm, "head": self.head})
        return out


def spec_from_roles(cfg: TransformerConfig, roles: Roles) -> SymmetrySpec:
    """The symmetry spec of a pre-norm Transformer described by ``roles`` (see the module docstring)."""
    names = roles.modules(cfg.n_layer)

    def rename(name: str) -> str:
        if name in names:  # a module name (norms, probes)
            return names[name]
        module, _, param = name.rpartition(".")
        return f"{names[module]}.{param}" if module in names else name  # writers are given in your names

    writers = [Member(p, axis, role="writer") for p, axis in roles.writers]
    return transformer_spec(cfg, writers).renamed(rename, arch=cfg.arch)
