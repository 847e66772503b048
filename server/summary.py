"""What a finished federation tells its user: a table per round (global test loss / accuracy,
aggregation seconds, what the guard kept and by how much, excluded and failed replies) and a PNG of
the global test loss and accuracy per round (with the plain average's, when the strategy measured it)."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _guard(rec: dict[str, Any]) -> str:
    """What the round kept and, when the guard compared, the aligned minus the alternative's loss on the
    server's data (the plain average, or slicing for mixed widths; negative: alignment helped)."""
    kept = rec.get("kept", "")
    other = rec.get("guard_average", rec.get("guard_slicing"))
    if "guard_aligned" in rec and other is not None:
        return f"{kept} (Δ {rec['guard_aligned'] - other:+.3f})"
    return kept


def summary_table(doc: dict[str, Any]) -> str:
    """The per-round table of a metrics document (``metrics.json``), as plain text."""
    table = Table(title=f"fedlmc: {doc['settings'].get('strategy')} on {doc['settings'].get('preset')}")
    table.caption = "kept: what the round returned; Δ = aligned − plain average (mixed widths: slicing) loss on the server's data"
    for col in ("round", "test loss", "test acc", "aggregation s", "kept", "replies", "excluded", "failed"):
        table.add_column(col, justify="left" if col == "kept" else "right", no_wrap=True)
    for r in doc["rounds"]:
        rec = r.get("strategy") or {}
        table.add_row(str(r["round"]), f"{r['test_loss']:.4f}", f"{r['test_acc']:.3f}",
                      f"{rec['align_seconds']:.2f}" if "align_seconds" in rec else "–", _guard(rec) or "–",
                      str(len(rec.get("nodes", []))) if rec else "–", str(len(rec.get("excluded", []))) if rec else "–",
                      str(len(rec.get("failures", []))) if rec else "–")
    console = Console(record=True, width=110, force_terminal=False, file=io.StringIO())  # rendered for the log
    console.print(table)
    return console.export_text()


def plot_rounds(doc: dict[str, Any], path: Path) -> Path:
    """Global test loss and accuracy per round (and the plain average's loss where it was measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in doc["rounds"]]
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_l.plot(rounds, [r["test_loss"] for r in doc["rounds"]], "o-", label="global model")
    avg = [(r["round"], r["strategy"]["average_loss"]) for r in doc["rounds"] if "average_loss" in (r.get("strategy") or {})]
    if avg:
        ax_l.plot(*zip(*avg), "s--", label="plain average of the same replies")
    ax_a.plot(rounds, [r["test_acc"] for r in doc["rounds"]], "o-")
    ax_l.set(xlabel="round", ylabel="test loss", title=doc["settings"].get("strategy", ""))
    ax_a.set(xlabel="round", ylabel="test accuracy", ylim=(0, 1))
    ax_l.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
