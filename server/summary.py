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
    guard's data, the server's or the clients' (the plain average, or slicing for mixed widths; negative:
    alignment helped)."""
    kept = rec.get("kept", "")
    other = rec.get("guard_average", rec.get("guard_slicing"))
    if "guard_aligned" in rec and other is not None:
        return f"{kept} (Δ {rec['guard_aligned'] - other:+.3f})"
    return kept


def summary_table(doc: dict[str, Any]) -> str:
    """The per-round table of a metrics document (``metrics.json``), as plain text."""
    table = Table(title=f"fedlmc: {doc['settings'].get('strategy')} on {doc['settings'].get('preset')}")
    table.caption = (
        "kept: what the round returned; Δ = aligned − plain average (mixed widths: slicing) loss on the guard's "
        "data (the server's or the clients')"
    )
    for col in ("round", "test loss", "test acc", "aggregation s", "kept", "replies", "excluded", "failed"):
        table.add_column(col, justify="left" if col == "kept" else "right", no_wrap=True)
    for r in doc["rounds"]:
        rec = r.get("strategy") or {}
        table.add_row(
            str(r["round"]),
            f"{r['test_loss']:.4f}",
            f"{r['test_acc']:.3f}",
            f"{rec['align_seconds']:.2f}" if "align_seconds" in rec else "–",
            _guard(rec) or "–",
            str(len(rec.get("nodes", []))) if rec else "–",
            str(len(rec.get("excluded", []))) if rec else "–",
            str(len(rec.get("failures", []))) if rec else "–",
        )
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
    avg = [
        (r["round"], r["strategy"]["average_loss"])
        for r in doc["rounds"]
        if "average_loss" in (r.get("strategy") or {})
    ]
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


def comparison_table(doc: dict[str, Any]) -> str:
    """A side-by-side comparison (``summary.json``) as plain text: one row per strategy, and the
    clients' own mean test loss as the reference every merge is measured against."""
    s = doc["settings"]
    table = Table()
    for col in ("strategy", "test loss", "test acc", "excess", "aggregation s", "kept"):
        table.add_column(col, justify="left" if col in ("strategy", "kept") else "right", no_wrap=True)
    for name, row in doc["strategies"].items():
        table.add_row(
            name,
            f"{row['test_loss']:.4f}",
            f"{row['test_acc']:.3f}",
            f"{row['test_loss'] - doc['mean_client_test_loss']:+.4f}",
            f"{row['aggregation_seconds']:.2f}",
            str(row.get("kept", "")),
        )
    console = Console(record=True, width=110, force_terminal=False, file=io.StringIO())
    console.print(
        f"fedlmc: {len(doc['client_test_losses'])} clients of {s.get('preset')} trained once "
        f"({doc['train_seconds']:.0f} s), each strategy aggregating the same replies"
    )
    console.print(table)
    console.print(f"excess = the aggregate's test loss − the clients' own mean ({doc['mean_client_test_loss']:.4f})")
    return console.export_text()


def plot_comparison(doc: dict[str, Any], path: Path) -> Path:
    """Each strategy's excess on the same replies: its aggregate's test loss minus the clients' own mean
    (how much of what the clients learned the merge loses), labelled with the test loss itself."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["strategies"])
    mean = doc["mean_client_test_loss"]
    excess = [doc["strategies"][n]["test_loss"] - mean for n in names]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2.5, 3.6))
    bars = ax.bar(names, excess, color=["#9e9e9e" if n == "average" else "#1f77b4" for n in names])
    ax.bar_label(bars, labels=[f"{doc['strategies'][n]['test_loss']:.3f}" for n in names])
    ax.axhline(0, color="k", lw=0.8)
    ax.set(
        ylabel=f"test loss − clients' own mean ({mean:.3f})",
        title=f"{doc['settings'].get('preset')}: the same {len(doc['client_test_losses'])} replies, aggregated",
    )
    ax.set_ylim(min(0.0, min(excess)) * 1.2, max(excess) * 1.2 if max(excess) > 0 else 0.1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
