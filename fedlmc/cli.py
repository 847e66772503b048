"""The ``fedlmc`` command line: its argument parsers and ``main`` (the subcommands live in ``commands``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from fedlmc.commands import (
    cmd_barrier,
    cmd_demo,
    cmd_export,
    cmd_import,
    cmd_merge,
    cmd_reproduce,
    cmd_train,
    cmd_universe,
    cmd_widths,
    console,
)
from fedlmc.options import Refinement, Universe
from fedlmc.scale.allocator import retain_freed_memory


def _add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir", help="directory holding the data set (else $FEDLMC_DATA, else the data that ships with fedlmc)"
    )
    p.add_argument("--dataset", help="override the preset's data set (digits, mnist, cifar10, shakespeare, text)")
    p.add_argument("--text", help="a UTF-8 text file for --dataset text")


def _add_budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, help="optimizer steps (default: the preset's budget)")
    p.add_argument("--epochs", type=float, help="epochs instead of steps")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--batch-size", type=int, help="batch size")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: CUDA when present)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedlmc", description="Federated learning of Transformers merged modulo symmetries."
    )
    sub = p.add_subparsers(dest="command", required=True)
    _add_model_commands(sub)
    _add_merge_commands(sub)
    _add_hf_commands(sub)
    run = sub.add_parser(
        "run", help="`flwr run APP --stream` for any Flower app; exits non-zero when its ServerApp failed"
    )
    run.add_argument("app", help="the Flower app's directory (its pyproject.toml names the apps)")
    run.add_argument(
        "flwr_args",
        nargs=argparse.REMAINDER,
        help='the rest of `flwr run`\'s arguments: a SuperLink connection, -c "key=value ...", ...',
    )
    run.set_defaults(func=cmd_run)
    st = sub.add_parser("strategies", help="the strategies a run_config's `strategy` can name, and what each accepts")
    st.set_defaults(func=cmd_strategies)
    return p


def cmd_strategies(args: argparse.Namespace) -> int:
    """The registered strategies (``fedlmc.strategies.registry``) as a table."""
    from rich.table import Table

    from fedlmc.strategies.registry import CAPABILITY_COLUMNS, REGISTRY

    table = Table(title="fedlmc strategies (run_config `strategy`)")
    table.add_column("strategy", style="bold", no_wrap=True)
    table.add_column("what it does")
    table.add_column("its own run_config keys")
    table.add_column("client code it needs")
    for _, label in CAPABILITY_COLUMNS:
        table.add_column(label, justify="center")
    for r in REGISTRY.values():
        keys = ", ".join(f"{k.name} = {k.default!r}" for k in r.keys)
        marks = ("✓" if getattr(r.can, f) else "" for f, _ in CAPABILITY_COLUMNS)
        table.add_row(r.name, r.summary, keys, r.client or "none", *marks)
    console.print(table)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """``flwr run`` through ``fedlmc.flower.launch``: its output streamed, its outcome asked of the SuperLink."""
    from fedlmc.flower.launch import launch

    return launch([args.app, *args.flwr_args])


def _add_hf_commands(sub) -> None:
    """export --to hf, import."""
    e = sub.add_parser("export", help="write a fedlmc checkpoint as a Hugging Face save_pretrained directory")
    e.add_argument("checkpoint", help="fedlmc checkpoint directory (gpt2, vit or llama)")
    e.add_argument("--to", choices=["hf"], default="hf", help="target format")
    e.add_argument("out", help="output directory (transformers' from_pretrained reads it)")
    e.add_argument("--tied", action="store_true", help="tie the head to the embedding (fitted; the error is printed)")
    e.set_defaults(func=cmd_export)
    i = sub.add_parser("import", help="read a Hugging Face save_pretrained directory into a fedlmc checkpoint")
    i.add_argument("directory", help="a local save_pretrained directory (GPT-2, ViT or Llama; no hub access)")
    i.add_argument("--out", required=True, help="fedlmc checkpoint directory to write")
    i.set_defaults(func=cmd_import)


def _add_model_commands(sub) -> None:
    """train, barrier, demo, reproduce."""
    from fedlmc.models import PRESETS

    t = sub.add_parser("train", help="train a preset on its data set and save a checkpoint")
    t.add_argument("--preset", required=True, help=f"architecture and data: {', '.join(PRESETS)}")
    t.add_argument("--seed", type=int, default=0, help="initialisation and data-order seed")
    t.add_argument("--out", required=True, help="checkpoint directory")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_data_args(t)
    _add_budget_args(t)
    t.set_defaults(func=cmd_train)

    b = sub.add_parser("barrier", help="interpolation curve and loss barrier between two checkpoints")
    b.add_argument("model_a")
    b.add_argument("model_b")
    b.add_argument("--out", help="JSON file for the curve and barrier")
    b.add_argument("--plot", help="PNG file for the curve")
    b.add_argument("--split", default="test", choices=["train", "val", "test"])
    b.add_argument("--max-batches", type=int, help="evaluate on at most this many batches per λ")
    _add_data_args(b)
    b.set_defaults(func=cmd_barrier)

    d = sub.add_parser("demo", help="train two seeds of the tiny presets and plot their averaging barrier")
    d.add_argument("--out", default="results/demo")
    d.add_argument("--presets", nargs="+", default=["vit-tiny", "gpt2-tiny"])
    d.add_argument("--seeds", nargs=2, type=int, default=[0, 1])
    d.add_argument("--cache", default="runs/cache", help="where trained models are kept for reuse")
    d.add_argument("--quiet", action="store_true")
    _add_data_args(d)
    _add_budget_args(d)
    d.set_defaults(func=cmd_demo)
    r = sub.add_parser("reproduce", help="the paper's Table 1: barriers of every matching method over seed pairs")
    r.add_argument("--preset", required=True)
    r.add_argument("--pairs", type=int, default=3, help="number of seed pairs (3 pairs need seeds 0, 1, 2)")
    r.add_argument("--methods", nargs="+", help="subset of methods (default: all)")
    r.add_argument("--learned-steps", type=int, default=300)
    r.add_argument("--out", default="results")
    r.add_argument("--cache", default="runs/cache")
    r.add_argument("--quiet", action="store_true")
    _add_data_args(r)
    _add_budget_args(r)
    r.set_defaults(func=cmd_reproduce)


def _add_merge_commands(sub) -> None:
    """merge, universe, widths."""
    m = sub.add_parser("merge", help="merge saved models: average, aligned (weight matching to a universe) or refined")
    m.add_argument("models", nargs="+", help="checkpoint directories (widths may differ for aligned/refined)")
    m.add_argument(
        "--method",
        default="aligned",
        choices=["average", "aligned", "refined"],
        help="average | aligned | refined ('universe' and 'refine' are deprecated names)",
    )
    m.add_argument("--out", required=True, help="checkpoint directory for the merged model")
    m.add_argument("--weights", nargs="+", type=float, help="merge weights (default: equal)")
    m.add_argument("--form", default="factored", choices=["factored", "circuit"])
    m.add_argument("--keep-layernorm", action="store_true", help="return an ordinary LayerNorm model")
    m.add_argument("--iterations", type=int, default=Universe.iterations, help="universe iterations")
    m.add_argument("--alpha", type=float, default=Refinement.alpha, help="Dirichlet concentration of the refinement")
    m.add_argument("--steps", type=int, default=Refinement.steps, help="refinement steps")
    m.add_argument("--split", default="test", choices=["val", "test"], help="where the merge is evaluated")
    m.add_argument("--max-batches", type=int, help="evaluate on at most this many batches")
    m.add_argument("--plot", help="PNG of the loss over the 2-simplex (three models)")
    m.add_argument("--simplex-n", type=int, default=8, help="grid resolution of the simplex plot")
    m.add_argument("--quiet", action="store_true")
    _add_data_args(m)
    m.set_defaults(func=cmd_merge)

    u = sub.add_parser("universe", help="M seeds of a preset: average vs universe vs refined merge (table + simplex)")
    u.add_argument("--preset", required=True)
    u.add_argument("--models", type=int, default=4)
    u.add_argument(
        "--iterations", type=int, default=10, help="universe iterations (stops earlier once it stops moving)"
    )
    u.add_argument("--alpha", type=float, nargs="+", default=[1.0], help="Dirichlet concentration(s) of the refinement")
    u.add_argument("--refine-steps", type=int, default=200, help="refinement steps")
    u.add_argument("--forms", nargs="+", default=["factored"], choices=["factored", "circuit"])
    u.add_argument("--simplex-n", type=int, default=8, help="simplex plot grid (0: no plot)")
    u.add_argument("--max-batches", type=int, help="evaluate on at most this many batches")
    u.add_argument(
        "--ff-scale", action="store_true", help="also the universe and refinement that match FF scales (ReLU, SwiGLU)"
    )
    u.add_argument("--out", default="results")
    u.add_argument("--cache", default="runs/cache")
    u.add_argument("--quiet", action="store_true")
    _add_data_args(u)
    _add_budget_args(u)
    u.set_defaults(func=cmd_universe)

    w = sub.add_parser("widths", help="width experiment: one model of width d vs d/2, d/4, d/8 (barriers)")
    w.add_argument("--preset", default="gpt2-tiny")
    w.add_argument("--factors", nargs="+", type=int, default=[2, 4, 8])
    w.add_argument(
        "--narrow-steps", type=int, nargs="+", help="training steps of each narrow model (default: the budget)"
    )
    w.add_argument("--max-batches", type=int)
    w.add_argument("--out", default="results")
    w.add_argument("--cache", default="runs/cache")
    w.add_argument("--quiet", action="store_true")
    _add_data_args(w)
    _add_budget_args(w)
    w.set_defaults(func=cmd_widths)


def main(argv: Optional[list[str]] = None) -> int:
    from fedlmc.data import DataNotFound

    args = build_parser().parse_args(argv)
    retain_freed_memory()
    try:
        return args.func(args)
    except (DataNotFound, FileNotFoundError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
