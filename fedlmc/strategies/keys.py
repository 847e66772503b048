"""A strategy's own ``run_config`` keys, declared once where the strategy is registered: the name, the
default (whose type is the key's), what it does, the values it may take, and whether the ClientApp reads
it. Validation, the apps' factory, the comparison runner, ``fedlmc strategies`` and the docs' key table
all read these declarations; none of them names a strategy's key by hand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Key:
    """One ``run_config`` key a registered strategy owns.

    Parameters
    ----------
    name : str
        The key as ``run_config`` spells it (dashes): ``"ot-reg"``.
    default : bool, int, float or str
        Its value when the run does not set it; the key's type is the default's.
    doc : str
        What it does, one line (the docs' key table and ``fedlmc strategies`` print it).
    choices : tuple, default ()
        The values it may take (empty: any value of its type).
    check : callable, optional
        ``check(value)`` returns why a value is refused ("" or None: accepted), for ranges.
    client : bool, default False
        The ClientApp applies it: the strategy sends it in every train message's config, and the client
        reads it from there (``fedlmc.federated.Settings.with_sent``), not from its own run_config.
    """

    name: str
    default: Any
    doc: str
    choices: tuple = ()
    check: Optional[Callable[[Any], Optional[str]]] = None
    client: bool = False

    def __post_init__(self) -> None:
        if not self.name or "_" in self.name or self.name != self.name.lower():
            raise ValueError(f"a run_config key is lower-case with dashes: {self.name!r}")
        if not isinstance(self.default, (bool, int, float, str)):
            raise ValueError(f"key {self.name!r}: the default must be a bool, int, float or str")
        self.value(self.default)

    def value(self, raw: Any) -> Any:
        """``raw`` read as this key's type, checked (a ``ValueError`` naming the key otherwise)."""
        kind = type(self.default)
        try:
            if kind is bool and isinstance(raw, str):
                value: Any = raw.strip().lower() in ("1", "true", "yes", "on")
            else:
                value = kind(raw)
        except (TypeError, ValueError):
            raise ValueError(f"run_config {self.name!r} is a {kind.__name__}, got {raw!r}") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"run_config {self.name!r} must be one of {', '.join(map(repr, self.choices))}: {value!r}")
        why = self.check(value) if self.check is not None else None
        if why:
            raise ValueError(f"run_config {self.name!r} = {value!r}: {why}")
        return value


def non_negative(value: float) -> str:
    """A ``Key.check``: why a negative value is refused ("" when it is not)."""
    return "" if value >= 0 else "must be non-negative"
