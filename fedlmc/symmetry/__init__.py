"""The symmetry layer: the declarative spec of each architecture (``spec``), group elements and their
exact action (``transform``), the canonical form on which the residual orthogonal group acts
(``canonical``), and random elements for tests and planted experiments (``random``).

Everything downstream (matching, merging, strategies) walks the spec; only spec builders name
parameters.
"""

from fedlmc.symmetry.canonical import (
    apply_transform,
    canonical,
    canonical_config,
    canonicalize,
    layernorm_native,
    residual_offcentre,
    to_layernorm,
)
from fedlmc.symmetry.random import (
    invert_transform,
    ones_basis,
    planted_copies,
    random_invertible,
    random_orthogonal,
    random_transform,
)
from fedlmc.symmetry.roles import Roles, spec_from_roles
from fedlmc.symmetry.spec import (
    Group,
    Member,
    SpecBuilder,
    StateDict,
    SymmetrySpec,
    register_spec,
    spec_for,
    transformer_spec,
)
from fedlmc.symmetry.transform import Transform, WidthMap, act, apply_to_state, check_element, perm_matrix, rebuild

__all__ = [
    "Roles",
    "spec_from_roles",
    "Group",
    "Member",
    "SpecBuilder",
    "StateDict",
    "SymmetrySpec",
    "Transform",
    "act",
    "apply_to_state",
    "apply_transform",
    "canonical",
    "canonical_config",
    "canonicalize",
    "invert_transform",
    "check_element",
    "ones_basis",
    "perm_matrix",
    "random_invertible",
    "random_orthogonal",
    "random_transform",
    "planted_copies",
    "rebuild",
    "register_spec",
    "residual_offcentre",
    "layernorm_native",
    "spec_for",
    "to_layernorm",
    "transformer_spec",
    "WidthMap",
]
