"""The ``fedlmc`` subcommands' implementations (``cli.py`` parses the arguments and calls these)."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from fedlmc import provenance
from fedlmc.options import Matching, Refinement, Universe

console = Console(stderr=True)


def load_splits(preset: str, args: argparse.Namespace, seed: int = 0):
    """The data splits a preset trains on, honouring --dataset/--data-dir/--text."""
    from fedlmc.data import load
    from fedlmc.models import preset_config, preset_dataset

    cfg = preset_config(preset)
    return load(
        getattr(args, "dataset", None) or preset_dataset(preset),
        data_dir=getattr(args, "data_dir", None),
        block_size=getattr(cfg, "block_size", 64),
        text_file=getattr(args, "text", None),
        seed=seed,
    )


def budget(args: argparse.Namespace) -> dict[str, Any]:
    return dict(steps=args.steps, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, device=args.device)


def cache_name(preset: str, seed: int, splits, cfg, model_overrides: Optional[dict[str, Any]] = None) -> str:
    """The folder name of a trained model under the cache: the preset, the seed and a hash of what made
    the model: the data, every training field, the architecture's overrides and the training code
    (``provenance.code_hash``: the model, data and training modules, and torch's version)."""
    parts: list[Any] = [preset, splits.name, splits.meta.get("source"), cfg.__dict__, model_overrides or {}]
    parts.append(provenance.code_hash(provenance.TRAINING_CODE))
    key = json.dumps(parts, sort_keys=True, default=str)
    tag = "".join(f"-{k}{v}" for k, v in sorted((model_overrides or {}).items())).replace("_", "")
    return f"{preset}{tag}-s{seed}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def trained(
    preset: str,
    seed: int,
    splits,
    cache: Path,
    progress: bool = True,
    model_overrides: Optional[dict[str, Any]] = None,
    **over: Any,
):
    """Train (or reuse from ``cache``) preset ``preset`` with ``seed``; returns the loaded model.
    ``model_overrides`` change the architecture (e.g. ``{"d_model": 64}``), ``over`` the budget."""
    from fedlmc import io
    from fedlmc.train import train_config_for, train_preset

    cfg = train_config_for(preset, seed, **over)
    path = cache / cache_name(preset, seed, splits, cfg, model_overrides)
    if (path / io.WEIGHTS).is_file():
        console.print(f"[dim]reusing {path}[/dim]")
        provenance.reused(path)
        return io.load(path)
    model, hist = train_preset(preset, splits, seed=seed, progress=progress, model_overrides=model_overrides, **over)
    io.save(model, path, model.meta)
    console.print(
        f"{preset} seed {seed}: test loss {hist['test']['loss']:.4f} acc {hist['test']['acc']:.4f} "
        f"({hist['seconds']:.0f} s) → {path}"
    )
    return model


def cmd_train(args: argparse.Namespace) -> int:
    from fedlmc import io
    from fedlmc.train import train_preset

    splits = load_splits(args.preset, args)
    console.print(f"data {splits.summary()}")
    model, hist = train_preset(args.preset, splits, seed=args.seed, progress=not args.quiet, **budget(args))
    io.save(model, args.out, model.meta)
    (Path(args.out) / "history.json").write_text(json.dumps(hist, indent=2, default=float))
    print(json.dumps({"out": str(args.out), "test": hist["test"], "seconds": round(hist["seconds"], 1)}))
    return 0


def _eval_split(model, args: argparse.Namespace):
    """The split a saved model should be evaluated on: its own data set unless --dataset says otherwise."""
    return getattr(_splits_for(model, args), args.split)


def _splits_for(model, args: argparse.Namespace):
    """The data splits of a saved model: its own data set unless --dataset says otherwise."""
    from fedlmc.data import load

    meta = getattr(model, "meta", {})
    name = args.dataset or meta.get("dataset")
    if not name:
        raise SystemExit("the checkpoint does not record its data set: pass --dataset")
    text = args.text or (meta.get("source") if name not in ("digits", "mnist", "cifar10", "shakespeare") else None)
    return load(
        name if name in ("digits", "mnist", "cifar10", "shakespeare") else "text",
        data_dir=args.data_dir,
        block_size=getattr(model.config, "block_size", 64),
        text_file=text,
    )


def cmd_barrier(args: argparse.Namespace) -> int:
    from fedlmc import io
    from fedlmc.merging.barrier import barrier, interpolation_curve, plot_curves

    a, b = io.load(args.model_a), io.load(args.model_b)
    data = _eval_split(a, args)
    curve = interpolation_curve(a, b, data, max_batches=args.max_batches)
    out = {
        "model_a": args.model_a,
        "model_b": args.model_b,
        "split": args.split,
        "method": "average",
        "barrier": barrier(curve),
        "curve": curve.to_dict(),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    if args.plot:
        plot_curves({"average": curve}, args.plot, title=f"{Path(args.model_a).name} ↔ {Path(args.model_b).name}")
    print(json.dumps({"barrier": out["barrier"], "loss": curve.loss, "acc": curve.acc}))
    return 0


DEMO_BUDGETS = {"vit-tiny": dict(epochs=15), "gpt2-tiny": dict(steps=500), "vit-digits": dict(epochs=30)}


def cmd_demo(args: argparse.Namespace) -> int:
    """Train two seeds of each preset and measure their interpolation barrier."""
    provenance.watch()  # samples the load through the run, for the results file's record
    from fedlmc.data import DataNotFound
    from fedlmc.merging.barrier import barrier, interpolation_curve, plot_curves

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    for preset in args.presets:
        try:
            splits = load_splits(preset, args)
        except DataNotFound as e:
            console.print(f"[yellow]skipping {preset}:[/yellow] {e}")
            if preset.startswith("vit") and "vit-digits" not in args.presets:
                console.print("[yellow]using the embedded scikit-learn digits with vit-digits instead[/yellow]")
                preset, splits = "vit-digits", load_splits("vit-digits", args)
            else:
                continue
        console.rule(f"{preset} on {splits.summary()}")
        over = {**DEMO_BUDGETS.get(preset, {}), **{k: v for k, v in budget(args).items() if v is not None}}
        t0 = time.time()
        models = [trained(preset, s, splits, Path(args.cache), progress=not args.quiet, **over) for s in args.seeds[:2]]
        train_s = time.time() - t0
        curve = interpolation_curve(models[0], models[1], splits.test)
        png = plot_curves(
            {"average": curve}, out / f"barrier_{preset}.png", title=f"{preset}: seed {args.seeds[0]} ↔ {args.seeds[1]}"
        )
        summary[preset] = {
            "dataset": splits.name,
            "budget": over,
            "train_seconds": round(train_s, 1),
            "test": [m.meta.get("test") for m in models],
            "barrier": barrier(curve),
            "curve": curve.to_dict(),
            "plot": str(png),
        }
        console.print(
            f"{preset}: test loss {[round(t['loss'], 4) for t in summary[preset]['test']]}, "
            f"averaging barrier {summary[preset]['barrier']:.4f}  → {png}"
        )
    provenance.write(out / "summary.json", summary, seeds=args.seeds)
    print(json.dumps({k: {"barrier": round(v["barrier"], 4), "test": v["test"]} for k, v in summary.items()}, indent=1))
    return 0


def _pair_key(ident: list, methods, learned_steps: int) -> str:
    """A pair's cache key: its models (seeds, training seconds), the methods, learned matching's steps and
    the library's code (``provenance.code_hash``), so curves another version measured are not served."""
    a_seed, a_secs, b_seed, b_secs = ident
    code = provenance.code_hash(("fedlmc",))
    return hashlib.sha1(
        json.dumps([a_seed, b_seed, a_secs, b_secs, sorted(methods), learned_steps, code]).encode()
    ).hexdigest()[:12]


def _cached_pair(cache: Path, preset: str, pair, ident: list, methods, learned_steps: int) -> dict:
    """The curves already kept for this pair's models under any subset of ``methods`` (larger sets first;
    beyond 12 methods, under exactly these: 2^n keys)."""
    found: dict = {}
    if not any(cache.glob(f"pair-{preset}-{pair[0]}-{pair[1]}-*.json")):
        return found
    for r in range(len(methods), 0 if len(methods) <= 12 else len(methods) - 1, -1):
        for subset in itertools.combinations(sorted(methods), r):
            if set(subset) <= set(found):
                continue
            f = cache / f"pair-{preset}-{pair[0]}-{pair[1]}-{_pair_key(ident, subset, learned_steps)}.json"
            if f.is_file():
                found.update({k: v for k, v in json.loads(f.read_text()).items() if k in subset and k not in found})
                provenance.reused(f)
    return found


def cmd_reproduce(args: argparse.Namespace) -> int:
    """Train the seeds a Table-1 reproduction needs (cached) and measure every method's barrier."""
    provenance.watch()  # samples the load through the run, for the results file's record
    from fedlmc.models import preset_config
    from fedlmc.models.layers import is_rotary
    from fedlmc.reproduce import METHODS, markdown, pair_curves, seed_pairs, summarise, write_results

    rotary = is_rotary(preset_config(args.preset))  # no circuit form (``check_circuit``)
    methods = args.methods or [m for m in METHODS if not (rotary and METHODS[m][2] == "circuit")]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
    if any(METHODS[m][2] == "circuit" for m in methods):  # refused before any training
        from fedlmc.merging.averaging import check_circuit

        check_circuit(preset_config(args.preset))
    splits = load_splits(args.preset, args)
    pairs = seed_pairs(args.pairs)
    seeds = sorted({s for p in pairs for s in p})
    console.rule(f"{args.preset}: seeds {seeds}, pairs {pairs} on {splits.summary()}")
    over = {k: v for k, v in budget(args).items() if v is not None}
    models = {s: trained(args.preset, s, splits, Path(args.cache), progress=not args.quiet, **over) for s in seeds}
    per_pair = []
    for a, b in pairs:
        # a pair's curves are kept beside its models, so a later run with more pairs or more methods reuses them
        ident = [models[x].meta.get(k) for x in (a, b) for k in ("seed", "seconds")]
        found = _cached_pair(Path(args.cache), args.preset, (a, b), ident, methods, args.learned_steps)
        missing = [m for m in methods if m not in found]
        if found:
            console.print(f"pair ({a}, {b}): reusing {sorted(found)}")
        if missing:
            console.print(f"pair ({a}, {b}): {missing}")
            found.update(
                pair_curves(
                    models[a],
                    models[b],
                    splits,
                    missing,
                    args.learned_steps,
                    progress=not args.quiet,
                    log=console.print,
                )
            )
            key = _pair_key(ident, methods, args.learned_steps)
            (Path(args.cache) / f"pair-{args.preset}-{a}-{b}-{key}.json").write_text(json.dumps(found))
        per_pair.append({m: found[m] for m in methods})
    rows = summarise(per_pair, methods)
    test_losses = {s: (m.meta.get("test") or {}).get("loss", float("nan")) for s, m in models.items()}
    md = markdown(args.preset, rows, pairs, show_acc=models[seeds[0]].config.arch == "vit", test_losses=test_losses)
    payload = {
        "preset": args.preset,
        "pairs": pairs,
        "dataset": splits.name,
        "budget": over,
        "learned_steps": args.learned_steps,
        "test": {s: m.meta.get("test") for s, m in models.items()},
        "summary": rows,
        "per_pair": per_pair,
    }
    files = write_results(Path(args.out), args.preset, payload, per_pair, methods)
    print(md)
    console.print(f"wrote {files}")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """Merge saved models (``average``, ``aligned`` universe or ``refined`` universe); mixed widths allowed."""
    from fedlmc import io
    from fedlmc.merging.averaging import merge
    from fedlmc.merging.manyway import aligned_models, excess, plot_simplex, simplex_losses
    from fedlmc.merging.universe import universe_merge
    from fedlmc.train import evaluate

    models = [io.load(p) for p in args.models]
    if len(models) < 2:
        raise ValueError("fedlmc merge needs at least two checkpoints")
    splits = _splits_for(models[0], args)
    t = time.time()
    method = args.method
    if method == "average":
        merged, Ts = merge(models, args.weights or [1 / len(models)] * len(models), form=args.form), None
    else:
        refine = (
            Refinement(data=splits.train, alpha=args.alpha, steps=args.steps, check_every=0)
            if method == "refined"
            else None
        )
        merged, Ts = universe_merge(
            models,
            args.weights,
            matching=Matching(),
            refine=refine,
            progress=not args.quiet,
            universe=Universe(iterations=args.iterations, form=args.form, keep_layernorm=args.keep_layernorm),
        )
    seconds = time.time() - t
    data = getattr(splits, args.split)
    ends = [evaluate(m, data, max_batches=args.max_batches)["loss"] for m in models]
    ev = evaluate(merged, data, max_batches=args.max_batches)
    meta = {
        "merged_from": [str(p) for p in args.models],
        "method": method,
        "form": args.form,
        "dataset": models[0].meta.get("dataset"),
        "source": models[0].meta.get("source"),
        "chars": models[0].meta.get("chars"),
        "block_size": models[0].meta.get("block_size"),
        args.split: ev,
        "endpoint_loss": ends,
        "excess": excess(ev["loss"], ends),
        "seconds": seconds,
    }
    io.save(merged, args.out, meta)
    result = {
        "out": str(args.out),
        "method": method,
        args.split: ev,
        "endpoint_loss": ends,
        "excess": meta["excess"],
        "seconds": round(seconds, 1),
    }
    if args.plot:
        if len(models) != 3:
            raise ValueError("--plot draws the loss over the 2-simplex: give exactly three models")
        panels = {"average": simplex_losses(models, data, args.simplex_n, max_batches=args.max_batches)}
        if Ts is not None:
            al, masks = aligned_models(models, Ts)
            panels[method] = simplex_losses(al, data, args.simplex_n, masks=masks, max_batches=args.max_batches)
        result["plot"] = str(plot_simplex(panels, Path(args.plot), title=f"{args.split} loss over the 2-simplex"))
    print(json.dumps(result, default=float))
    return 0


def cmd_universe(args: argparse.Namespace) -> int:
    """Train (cached) M seeds of a preset and compare average / universe / refined merges (+ simplex plot)."""
    provenance.watch()  # samples the load through the run, for the results file's record
    from fedlmc.merging.manyway import plot_simplex, universe_markdown, universe_table, write

    splits = load_splits(args.preset, args)
    seeds = list(range(args.models))
    over = {k: v for k, v in budget(args).items() if v is not None}
    console.rule(f"{args.preset}: universe of {len(seeds)} models on {splits.summary()}")
    models = [trained(args.preset, s, splits, Path(args.cache), progress=not args.quiet, **over) for s in seeds]
    res = universe_table(
        models,
        splits,
        Refinement(steps=args.refine_steps, check_every=0),
        alphas=args.alpha,
        iterations=args.iterations,
        log=console.print,
        progress=not args.quiet,
        simplex_n=args.simplex_n,
        max_batches=args.max_batches,
        forms=args.forms,
        ff_scale=args.ff_scale,
    )
    res.update(preset=args.preset, seeds=seeds, dataset=splits.name, budget=over)
    md = universe_markdown(args.preset, res, seeds)
    stem = f"universe_{args.preset}"
    files = write(Path(args.out), stem, res)
    if "simplex" in res:
        files.append(
            plot_simplex(
                res["simplex"],
                Path(args.out) / f"simplex_{args.preset}.png",
                title=f"{args.preset}: test loss over the simplex of seeds 0, 1, 2",
            )
        )
    print(md)
    console.print(f"wrote {[str(f) for f in files]}")
    return 0


def cmd_widths(args: argparse.Namespace) -> int:
    """One model of the preset's width vs models of d/2, d/4, d/8 (trained, cached): barriers."""
    from fedlmc.merging.manyway import plot_width_curves, width_experiment, width_markdown, write
    from fedlmc.models import preset_config

    splits = load_splits(args.preset, args)
    over = {k: v for k, v in budget(args).items() if v is not None}
    cfg = preset_config(args.preset)
    d = cfg.d_model
    wide = trained(args.preset, 0, splits, Path(args.cache), progress=not args.quiet, **over)
    narrow = {}
    if args.narrow_steps and len(args.narrow_steps) != len(args.factors):
        raise ValueError("--narrow-steps needs one value per factor")
    for j, f in enumerate(args.factors):
        if d % f:
            raise ValueError(f"width {d} is not divisible by {f}")
        budget_f = {**over, **({"steps": args.narrow_steps[j]} if args.narrow_steps else {})}
        # only the residual width shrinks (heads and FF keep their sizes), as in the paper
        narrow[d // f] = trained(
            args.preset,
            1,
            splits,
            Path(args.cache),
            progress=not args.quiet,
            model_overrides={"d_model": d // f, "d_head": cfg.d_head},
            **budget_f,
        )
    res = width_experiment(wide, narrow, splits.test, log=console.print, max_batches=args.max_batches)
    res.update(
        preset=args.preset,
        d=d,
        factors=args.factors,
        budget=over,
        narrow_steps=args.narrow_steps,
        steps={str(k): m.meta.get("steps") for k, m in narrow.items()} | {"wide": wide.meta.get("steps")},
    )
    md = width_markdown(args.preset, res, d)
    files = write(Path(args.out), f"widths_{args.preset}", res)
    files.append(
        plot_width_curves(
            res, Path(args.out) / f"widths_{args.preset}.png", f"{args.preset}: width {d} ↔ narrower models"
        )
    )
    print(md)
    console.print(f"wrote {[str(f) for f in files]}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A fedlmc checkpoint as a ``save_pretrained`` directory (LayerNorm families leave canonical form first)."""
    from fedlmc.hf import to_hf
    from fedlmc.io import load as load_checkpoint
    from fedlmc.symmetry import to_layernorm

    model = load_checkpoint(args.checkpoint)
    family = model.meta.get("hf_family")  # the Hugging Face family it was imported from (OPT is GPT-2's architecture)
    if model.config.arch in ("gpt2", "vit") and model.config.norm != "layernorm":
        model = to_layernorm(model)
    hf = to_hf(model, tied=True if args.tied else None, family=family)
    hf.save_pretrained(args.out)
    console.print(f"wrote {type(hf).__name__} to {args.out} (head fit relative error {hf.fedlmc_fit_error:.2e})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """A ``save_pretrained`` directory as a fedlmc checkpoint."""
    from fedlmc.hf import from_hf
    from fedlmc.io import save

    model = from_hf(args.directory)
    save(model, args.out, meta={"source": str(args.directory), "hf_family": model.meta["hf_family"]})
    console.print(f"wrote fedlmc {model.config.arch} checkpoint to {args.out}")
    return 0
