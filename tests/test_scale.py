"""Aggregation at scale: replies memory-mapped from disk, alignments in parallel workers, and nothing
lost (unreadable replies and dying workers are excluded with a reason; files are removed)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import perturbed

from fedlmc.matching import weight_matching
from fedlmc.merging.averaging import aligned_state
from fedlmc.merging.universe import universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Guard, Matching, Scale, Universe
from fedlmc.scale.replies import ReplyError, ReplyStore, StoredModel, mmap_state, save_model, stored, sweep
from fedlmc.scale.workers import AlignmentPool
from fedlmc.symmetry import Transform, apply_transform, canonicalize, planted_copies, random_transform


def _copies(n: int = 4, noise: float = 0.05):
    """``n`` float64 gpt2-shaped models: one base under n random group elements, plus noise each."""
    torch.manual_seed(0)
    base = canonicalize(perturbed(from_preset("gpt2-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=40)))
    return planted_copies(base, n, noise)


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sb = b.state_dict()
    return max(float((v - sb[k]).abs().max()) for k, v in a.state_dict().items())


def _same_transforms(Ta, Tb, record, what: str) -> None:
    """The same permutations, and the same continuous elements (residual map, gauges) to 1e-9."""
    worst = 0.0
    for A, B in zip(Ta, Tb):
        assert A.elements.keys() == B.elements.keys()
        for k, a in A.elements.items():
            b = B.elements[k]
            if a.dtype in (torch.int64, torch.int32):
                assert torch.equal(a, b), f"{what}: {k} differs"
            else:
                worst = max(worst, float((a - b).abs().max()))
    record(f"{what}: transforms' continuous elements vs sequential", worst, 1e-9)


def test_mmap_roundtrip_is_exact_and_mapped(tmp_path):
    model = _copies(1)[0]
    handle = save_model(tmp_path / "m.safetensors", model)
    again = handle.load()
    assert _max_diff(model, again) == 0.0
    assert next(again.parameters()).dtype == torch.float64
    # the tensors are views of a memory map of the file, not copies on the heap
    maps = Path("/proc/self/maps").read_text()
    assert str(tmp_path / "m.safetensors") in maps
    # a private map: writing to a loaded tensor never changes the file
    with torch.no_grad():
        next(again.parameters()).add_(1.0)
    assert _max_diff(model, stored(handle.path).load()) == 0.0
    state, meta = mmap_state(handle.path)
    assert set(state) == set(model.state_dict()) and "config" in meta


def test_mmap_universe_equals_the_in_memory_one(tmp_path, record):
    models = _copies(4)
    ref, T_ref = universe_merge(
        models, matching=Matching(keep_identity=False), universe=Universe(iterations=2, keep_layernorm=False)
    )
    with ReplyStore(tmp_path) as store:
        handles = [store.put(m) for m in models]
        assert all(isinstance(h, StoredModel) for h in handles)
        got, T_got = universe_merge(
            handles, matching=Matching(keep_identity=False), universe=Universe(iterations=2, keep_layernorm=False)
        )
    record("universe of memory-mapped replies vs in memory (max |Δ|)", _max_diff(ref, got), 0.0)
    _same_transforms(T_ref, T_got, record, "mmap")
    assert not any(tmp_path.glob("round-*")), "the store's files were not removed"


def test_mmap_layernorm_replies_go_into_the_memory_of_the_one_before(tmp_path, record, monkeypatch):
    """In the server's process, each LayerNorm reply read from its file is put in canonical form in the
    memory of the reply aligned before it (``Canonical.recycle``): the universe and transforms are
    those of the same replies held in memory, bit for bit."""
    import fedlmc.scale.replies as replies_module
    from fedlmc.symmetry import canonical

    torch.manual_seed(0)
    base = perturbed(from_preset("gpt2-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=40))
    models = [_near(base, s, 0.05) for s in range(4)]  # LayerNorm models
    m = Matching(keep_identity=False)
    ref, T_ref = universe_merge(models, matching=m, universe=Universe(iterations=2, keep_layernorm=True))
    reused = []

    def spy(model, out=None):
        c = canonical(model, out=out)
        given = {v.data_ptr() for v in (out or {}).values()}
        reused.append(sum(v.data_ptr() in given for v in c.state_dict().values()))
        return c

    monkeypatch.setattr(replies_module, "canonical", spy)
    dropped = []  # at the end of each pass the recycled memory is let go (the average needs the room)
    real_let_go = replies_module.Canonical.let_go
    monkeypatch.setattr(
        replies_module.Canonical, "let_go", lambda self: dropped.append(self._spare is not None) or real_let_go(self)
    )
    with ReplyStore(tmp_path) as store:
        handles = [store.put(x) for x in models]
        got, T_got = universe_merge(handles, matching=m, universe=Universe(iterations=2, keep_layernorm=True))
    assert dropped == [True, True]
    record("LayerNorm replies recycled from disk vs in memory (max |Δ|)", _max_diff(ref, got), 0.0)
    _same_transforms(T_ref, T_got, record, "recycled")
    assert sum(n >= 10 for n in reused) >= 4, reused  # most of each iteration's replies went into recycled memory


def test_mmap_unreadable_reply_is_excluded_with_a_reason(tmp_path, record):
    models = _copies(4)
    with ReplyStore(tmp_path) as store:
        handles = [store.put(m) for m in models]
        Path(handles[2].path).write_bytes(Path(handles[2].path).read_bytes()[:5000])  # truncated on disk
        merged, Ts = universe_merge(handles, universe=Universe(iterations=2, keep_layernorm=False))
    assert "excluded" in Ts[2].info and "truncated" in Ts[2].info["excluded"]
    assert all("excluded" not in T.info for i, T in enumerate(Ts) if i != 2)
    ref, _ = universe_merge([models[i] for i in (0, 1, 3)], universe=Universe(iterations=2, keep_layernorm=False))
    record("universe without the unreadable reply vs the same three in memory", _max_diff(ref, merged), 1e-12)
    with pytest.raises(ReplyError, match="could not read"):
        StoredModel(str(tmp_path / "missing.safetensors"), models[0].config).load()


def test_mmap_store_is_removed_and_a_crashed_servers_files_are_swept(tmp_path):
    store = ReplyStore(tmp_path)
    store.put(_copies(1)[0])
    assert any(store.path.iterdir())
    store.close()
    assert not store.path.exists()
    # a server killed mid-round leaves its store behind; the next store under the same root removes it
    code = (
        "import os, sys; from fedlmc.scale.replies import ReplyStore; from fedlmc.models import from_preset;"
        f"s = ReplyStore({str(tmp_path)!r}); s.put(from_preset('gpt2-tiny', n_layer=1)); os._exit(1)"
    )
    subprocess.run([sys.executable, "-c", code], check=False, timeout=120)
    left = list(tmp_path.glob("round-*"))
    assert len(left) == 1 and any(left[0].glob("*.safetensors"))
    assert sweep(tmp_path) == [left[0].name] and not left[0].exists()
    # a live process's store is kept
    live = ReplyStore(tmp_path)
    assert sweep(tmp_path) == [] and live.path.exists()
    live.close()


def _parallel_vs_sequential(tmp_path, record, backend: str):
    """A universe of 4 models aligned by 2 workers of ``backend`` against the sequential path: the same
    permutations, and every continuous element and the universe to float64 noise."""
    models = _copies(4)
    m = Matching(keep_identity=False)
    seq, T_seq = universe_merge(models, matching=m, universe=Universe(iterations=2, keep_layernorm=False))
    par, T_par = universe_merge(
        models,
        matching=m,
        scale=Scale(workers=2, backend=backend, spool_dir=str(tmp_path)),
        universe=Universe(iterations=2, keep_layernorm=False),
    )
    record(f"universe aligned by 2 workers ({backend}) vs sequential (max |Δ|)", _max_diff(seq, par), 1e-10)
    _same_transforms(T_seq, T_par, record, backend)
    return T_par


def test_parallel_alignments_equal_the_sequential_path(tmp_path, record):
    T_par = _parallel_vs_sequential(tmp_path, record, "process")
    pids = {T.info.get("worker_pid") for T in T_par[1:]}
    assert os.getpid() not in pids and None not in pids, "the alignments did not run in the workers"
    assert not any(tmp_path.glob("round-*"))


def test_parallel_min_gain_keeps_replies_from_the_start_as_they_are(tmp_path, record):
    """Matching(min_gain) in the workers: replies that are the start model plus a little noise keep the
    identity, the universe is their plain mean and stops after two iterations, as in the server's process
    (after one from that mean, ``start="average"``)."""
    from fedlmc.symmetry import rebuild

    base = _copies(1, noise=0.0)[0]
    replies = []
    for s in range(4):
        g = torch.Generator().manual_seed(s)
        sd = {
            k: v + 0.01 * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype)
            for k, v in base.state_dict().items()
        }
        replies.append(rebuild(base, sd))
    m = Matching(min_gain=0.3)
    par, T_par = universe_merge(
        replies,
        start=base,
        matching=m,
        scale=Scale(workers=2, backend="process", spool_dir=str(tmp_path)),
        universe=Universe(iterations=5, keep_layernorm=False),
    )
    seq, T_seq = universe_merge(replies, start=base, matching=m, universe=Universe(iterations=5, keep_layernorm=False))
    assert all(T.elements == {} for T in T_par + T_seq)
    assert T_par[0].info["universe_iterations"] == T_seq[0].info["universe_iterations"] == 2
    par_mean, T_mean = universe_merge(
        replies,
        start="average",
        matching=m,
        scale=Scale(workers=2, backend="process", spool_dir=str(tmp_path)),
        universe=Universe(iterations=5, keep_layernorm=False),
    )
    assert all(T.elements == {} for T in T_mean) and T_mean[0].info["universe_iterations"] == 1
    record("min_gain in workers from the mean vs from the start", _max_diff(par_mean, par), 1e-12)
    mean = {k: sum(r.state_dict()[k] for r in replies) / 4 for k in base.state_dict()}
    record(
        "min_gain in workers: universe vs the plain mean",
        max(float((par.state_dict()[k] - v).abs().max()) for k, v in mean.items()),
        1e-12,
    )
    record("min_gain: workers vs sequential", _max_diff(seq, par), 1e-12)


def test_parallel_worker_puts_each_layernorm_reply_in_the_memory_of_the_one_before(tmp_path, monkeypatch):
    """A worker writes each LayerNorm reply's canonical form into the tensors of the reply before it (summed
    by then): the same transforms and the same partial sum, bit for bit, as fresh canonical forms give."""
    import fedlmc.scale.replies as replies_module
    import fedlmc.scale.workers as workers
    from fedlmc.symmetry import canonical, rebuild

    torch.manual_seed(0)
    base = perturbed(from_preset("gpt2-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=40))
    items = []
    for s in range(3):  # LayerNorm replies: each is canonicalised in the worker
        g = torch.Generator().manual_seed(s)
        sd = {
            k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype)
            for k, v in base.state_dict().items()
        }
        items.append((s, save_model(tmp_path / f"reply-{s}.safetensors", rebuild(base, sd)), None, 1.0 / 3))
    universe = str(save_model(tmp_path / "universe.safetensors", canonical(base)).path)
    options = dict(matching=Matching(keep_identity=False), keep_layernorm=True, device=None)
    reused: list[int] = []

    def spy(model, out=None):
        c = canonical(model, out=out)
        given = {v.data_ptr() for v in (out or {}).values()}
        reused.append(sum(v.data_ptr() in given for v in c.state_dict().values()))
        return c

    results = {}
    for name, fn in (("into", spy), ("fresh", lambda model, out=None: canonical(model))):
        monkeypatch.setattr(replies_module, "canonical", fn)
        workers._CACHE.clear()
        done, failed, partial, _ = workers.align_chunk(universe, items, options, 1, str(tmp_path / f"{name}.st"), None)
        assert not failed and len(done) == 3
        results[name] = (done, mmap_state(partial)[0])
    assert reused[0] == 0 and all(n >= 10 for n in reused[1:])  # the 2nd and 3rd went into the memory before
    (T_into, sum_into), (T_fresh, sum_fresh) = results["into"], results["fresh"]
    for i in T_fresh:
        assert T_into[i].elements.keys() == T_fresh[i].elements.keys()
        assert all(torch.equal(v, T_fresh[i].elements[k]) for k, v in T_into[i].elements.items())
    assert all(torch.equal(v, sum_fresh[k]) for k, v in sum_into.items())


class CrashingModel(StoredModel):
    """A stored reply whose reading kills the worker process: once (a marker file remembers), or always."""

    def load(self):
        marker = Path(self.path + ".crashed")
        if not marker.exists() or marker.read_text() == "always":
            if not marker.exists():
                marker.write_text("once")
            os._exit(3)
        return super().load()


class SlowModel(StoredModel):
    """A stored reply that takes two seconds to read: its task is still running when another one dies."""

    def load(self):
        time.sleep(2.0)
        return super().load()


def test_parallel_dead_worker_is_retried_once_then_excluded(tmp_path, record):
    models = _copies(4)
    m = Matching(keep_identity=False)
    with ReplyStore(tmp_path / "replies") as store:
        handles = [store.put(x) for x in models]
        once = list(handles)
        once[1] = CrashingModel(handles[1].path, handles[1].config)
        scale = Scale(workers=2, backend="process", spool_dir=str(tmp_path))
        got, Ts = universe_merge(once, matching=m, scale=scale, universe=Universe(iterations=1, keep_layernorm=False))
        ref, _ = universe_merge(models, matching=m, universe=Universe(iterations=1, keep_layernorm=False))
        record("a worker died once: the retried universe vs sequential", _max_diff(ref, got), 1e-10)
        assert all("excluded" not in T.info for T in Ts)

        Path(handles[2].path + ".crashed").write_text("always")
        always = list(handles)
        always[2] = CrashingModel(handles[2].path, handles[2].config)
        # a reply whose task runs beside the dying one, on every try: it must not go down with it
        always[3] = SlowModel(handles[3].path, handles[3].config)
        got, Ts = universe_merge(always, matching=m, scale=scale, universe=Universe(iterations=1, keep_layernorm=False))
        assert "worker died" in Ts[2].info["excluded"] and "failed 2 times" in Ts[2].info["excluded"]
        assert [i for i, T in enumerate(Ts) if "excluded" in T.info] == [2]
        ref, _ = universe_merge(
            [models[i] for i in (0, 1, 3)], matching=m, universe=Universe(iterations=1, keep_layernorm=False)
        )
        record("a worker died twice: the universe without that reply", _max_diff(ref, got), 1e-10)


def _near(base: torch.nn.Module, seed: int, noise: float = 0.01) -> torch.nn.Module:
    from fedlmc.symmetry import rebuild

    g = torch.Generator().manual_seed(seed)
    return rebuild(
        base,
        {
            k: v + noise * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype)
            for k, v in base.state_dict().items()
        },
    )


def test_parallel_universe_from_the_mean_sums_only_the_replies_that_move(tmp_path, record, monkeypatch):
    """From the replies' mean summed as they arrive, the first iteration adds each reply's move to that
    mean: replies that keep the identity (min_gain) are not summed at all, and the universe is the
    aligned replies' mean as when every reply is summed (the same mean, not marked as one), in the
    workers and in the server's process."""
    from fedlmc.merging.averaging import RunningSum
    from fedlmc.merging.universe import ArrivingMean
    from fedlmc.symmetry import rebuild

    base = _copies(1, noise=0.0)[0]
    far = apply_transform(_near(base, 3), random_transform(base, seed=5, groups=["residual", "heads", "ff"]))
    with ReplyStore(tmp_path / "replies") as store:
        files = [store.put(x) for x in [_near(base, s) for s in range(3)] + [far]]
        arriving, weights = ArrivingMean(), [1.0, 1.0, 1.0, 0.01]  # the mean stays near the near ones
        for f, w in zip(files, weights):
            arriving.add(f.path, f.load(), w)
        mean = arriving.model_for({f.path: w for f, w in zip(files, weights)})
        unmarked = rebuild(mean, mean.state_dict())  # the same weights, not known to be the replies' mean
        adds = []
        real_add = RunningSum.add
        monkeypatch.setattr(RunningSum, "add", lambda self, state, w: adds.append(w) or real_add(self, state, w))
        pooled = []  # each iteration's call of the workers: moves only, and the weight its partial sums carry
        real_align = AlignmentPool.align

        def align(self, *args, mean=False):
            done, failed, acc = real_align(self, *args, mean=mean)
            pooled.append((mean, acc.weight))
            return done, failed, acc

        monkeypatch.setattr(AlignmentPool, "align", align)
        m = Matching(min_gain=0.3)
        for scale in (None, Scale(workers=2, backend="process", spool_dir=str(tmp_path))):
            where = "workers" if scale else "in-process"
            adds.clear()
            got, Ts = universe_merge(
                files,
                weights,
                start=mean,
                matching=m,
                scale=scale,
                universe=Universe(iterations=2, keep_layernorm=False),
            )
            summed = list(adds)
            ref, T_ref = universe_merge(
                files,
                weights,
                start=unmarked,
                matching=m,
                scale=scale,
                universe=Universe(iterations=2, keep_layernorm=False),
            )
            assert [bool(T.elements) for T in Ts] == [False, False, False, True]  # the far one moves
            _same_transforms(T_ref, Ts, record, f"from the mean, {where}")
            record(f"universe from the mean, moves only vs every reply summed ({where})", _max_diff(ref, got), 1e-12)
            if scale is None:  # iteration 1: the far reply's move (two adds); iteration 2: the four replies
                w = 0.01 / 3.01
                assert summed[:2] == pytest.approx([w, -w]) and len(summed) == 6, summed
            else:  # the workers summed moves (weights w − w) in iteration 1, every aligned reply in the 2nd
                assert [mean for mean, _ in pooled] == [True, False, False, False], pooled
                assert pooled[0][1] == pytest.approx(0.0, abs=1e-15) and pooled[1][1] == pytest.approx(1.0)


def test_parallel_universe_from_the_mean_without_a_reply_that_failed(tmp_path, record):
    """A reply that fails in the first iteration from the replies' mean leaves that mean holding it: the
    universe is then the mean of the others, read again from their files."""
    from fedlmc.merging.universe import ArrivingMean

    base = _copies(1, noise=0.0)[0]
    replies = [_near(base, s) for s in range(4)]
    with ReplyStore(tmp_path / "replies") as store:
        files = [store.put(x) for x in replies]
        arriving = ArrivingMean()
        for f in files:
            arriving.add(f.path, f.load(), 1.0)
        mean = arriving.model_for({f.path: 1.0 for f in files})
        Path(files[2].path + ".crashed").write_text("always")
        files[2] = CrashingModel(files[2].path, files[2].config)
        scale = Scale(workers=2, backend="process", spool_dir=str(tmp_path))
        got, Ts = universe_merge(
            files,
            start=mean,
            matching=Matching(min_gain=0.3),
            scale=scale,
            universe=Universe(iterations=2, keep_layernorm=False),
        )
        assert [i for i, T in enumerate(Ts) if "excluded" in T.info] == [2]
        assert all(not T.elements for i, T in enumerate(Ts) if i != 2)
        others = {k: sum(replies[i].state_dict()[k] for i in (0, 1, 3)) / 3 for k in base.state_dict()}
        record(
            "from the mean, a reply failed: universe vs the others' mean",
            max(float((got.state_dict()[k] - v).abs().max()) for k, v in others.items()),
            1e-12,
        )


def test_parallel_pool_reports_a_failing_task(tmp_path, record):
    models = _copies(2)
    with ReplyStore(tmp_path) as store, AlignmentPool(Scale(workers=2, backend="process", retries=1)) as pool:
        u = store.put(models[0])
        missing = StoredModel(str(tmp_path / "gone.safetensors"), models[1].config)
        items = [(0, store.put(models[0]), None, 0.25), (1, missing, None, 0.25), (2, store.put(models[1]), None, 0.5)]
        done, failed, acc = pool.align(u.path, items, {"matching": Matching(keep_identity=False)}, 0)
        assert set(done) == {0, 2} and "could not read" in failed[1] and "2 times" in failed[1]
        assert pool.retried == [1] and acc.weight == 0.75
        # the partial sums added up: reply 0 as it is (the universe itself), reply 2 aligned to it
        T = weight_matching(models[0], models[1], Matching(keep_identity=False))
        aligned = aligned_state(models[1], T)
        want = {k: (0.25 * v + 0.5 * aligned[k]) / 0.75 for k, v in models[0].state_dict().items()}
    got = acc.mean()
    record(
        "the workers' partial sums vs the same mean here",
        max(float((got[k] - v).abs().max()) for k, v in want.items()),
        1e-12,
    )
    assert not list(store.path.glob("partial-*"))


def _workers_up(pool: AlignmentPool) -> None:
    """Wait until every worker of a process pool has started (spawned, imports done) and is idle."""
    deadline = time.time() + 120
    while time.time() < deadline:
        pids = {f.result(timeout=120) for f in [pool._pool.submit(_pid_after, 0.3) for _ in range(pool.workers)]}
        if len(pids) == pool.workers:
            return
    raise AssertionError("the pool's workers did not start")


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_parallel_task_done_early_takes_over_the_replies_a_slower_one_has_not_reached(tmp_path, record):
    """One worker's chunk is slow to read (2 s a reply): the other worker, done with its own chunk,
    claims and aligns the slow chunk's last reply (and the one before it, when it gets there first),
    so the round does not wait for one worker to read four slow replies in turn. Every reply is
    aligned once, by exactly one worker; the sum is the same as here, and the claims are removed."""
    models = _copies(8)
    m = Matching(keep_identity=False)
    with ReplyStore(tmp_path) as store, AlignmentPool(Scale(workers=2, backend="process")) as pool:
        _workers_up(pool)
        u = store.put(models[0])
        handles = [store.put(x) for x in models]
        # chunks are items[k::2]: the even replies (0, 2, 4, 6) make up the first worker's chunk, which
        # claims its last reply after 4 s of slow reads; the other chunk's four take well under that
        items = [(i, SlowModel(h.path, h.config) if i % 2 == 0 else h, None, 1.0 / 8) for i, h in enumerate(handles)]
        done, failed, acc = pool.align(u.path, items, {"matching": m}, None)
        assert not failed and set(done) == set(range(8))
        by = {i: T.info["worker_pid"] for i, T in done.items()}
        assert by[0] == by[2] != by[6], f"the slow chunk's last reply was not taken over: {by}"
        assert by[1] == by[3] == by[5] == by[7] == by[6]
        # the other worker took the slow chunk's end (6, and 4 too when it got there before the slow
        # worker had read 0: each claims its next reply as it starts one)
        taken = {i for i, T in done.items() if T.info.get("taken_over")}
        assert 6 in taken <= {4, 6} and all(by[i] == by[1] for i in taken), (taken, by)
        assert not [p for p in store.path.iterdir() if p.name.startswith(("claims-", "partial-"))]
    want = {}
    for x in models:
        for k, v in aligned_state(x, weight_matching(models[0], x, m)).items():
            want[k] = want.get(k, 0) + v / 8
    got = acc.mean()
    record(
        "replies taken over by another worker: the mean vs the same mean here",
        max(float((got[k] - v).abs().max()) for k, v in want.items()),
        1e-12,
    )


def test_parallel_takeover_order_takes_each_chunk_from_its_end(tmp_path):
    """A task done with its chunk takes the others' replies from their ends (what their tasks reach
    last), the chunks in turn; a claim is won once."""
    from fedlmc.scale.workers import claim, takeover_order

    assert takeover_order([[1, 4, 7], [2, 5]]) == [7, 5, 4, 2, 1]
    assert takeover_order([]) == []
    assert claim(str(tmp_path), 3) and not claim(str(tmp_path), 3) and claim(str(tmp_path), 4)


def test_parallel_replies_a_dead_task_had_taken_over_are_retried(tmp_path, monkeypatch):
    """A task that dies loses its own replies that no other task aligned, and those it had taken over
    from another chunk: each is retried on its own (then aligned), none is lost or aligned twice."""
    calls = []

    def run(self, universe_file, chunks, options, outs, skip, mean, claims, isolate):
        calls.append(([[i for i, *_ in c] for c in chunks], claims is not None, isolate))
        if not isolate:  # the first task died after taking over reply 5; the second took over reply 4
            return [RuntimeError("node lost"), ({1: Transform(), 3: Transform(), 4: Transform()}, {}, None, 0.0)]
        return [({c[0][0]: Transform()}, {}, None, 0.0) for c in chunks]

    monkeypatch.setattr(AlignmentPool, "_run", run)
    with AlignmentPool(Scale(workers=2, backend="process", retries=1)) as pool:
        items = [(i, None, None, 1.0 / 6) for i in range(6)]
        done, failed, _ = pool.align(tmp_path / "universe.safetensors", items, {}, None)
    assert set(done) == set(range(6)) and not failed
    assert pool.retried == [0, 2, 5]
    assert calls[0] == ([[0, 2, 4], [1, 3, 5]], True, False)  # claimed, each task may take over the other's
    assert calls[1:] == [([[0], [2], [5]], False, True)]  # retried alone, nothing taken over
    assert not list(tmp_path.iterdir()), "the claims were left behind"


def test_parallel_pool_starts_its_workers_when_made():
    """The local workers are spawned as the pool is made (while the server writes the universe), and
    each one imports weight matching before it takes a task, not when the first alignments come, and
    keeps the memory it frees (``retain_freed_memory``)."""
    with AlignmentPool(Scale(workers=2, backend="process")) as pool:
        assert len(pool._pool._processes) == 2, "the pool's workers were not started with it"
        # eval is a builtin: running it imports nothing, so the module was there before the task came
        probe = (
            "'fedlmc.matching.weight' in __import__('sys').modules, __import__('os').getpid(),"
            "__import__('fedlmc.scale.allocator').scale.allocator.retain_freed_memory.cache_info().currsize"
        )
        got = [f.result(timeout=120) for f in [pool._pool.submit(eval, probe) for _ in range(4)]]
    assert all(imported for imported, _, _ in got), got
    assert all(retained for *_, retained in got), "a worker frees its memory to the kernel: page faults per reply"


def test_parallel_pool_whose_worker_died_while_waiting_still_aligns(tmp_path, record):
    """A worker that dies while the pool waits for its first tasks (it starts with the pool) breaks the
    pool: the next tasks go to a new one, and no reply is lost for it."""
    import signal

    models = _copies(2)
    with ReplyStore(tmp_path) as store, AlignmentPool(Scale(workers=2, backend="process")) as pool:
        broken = pool._pool
        os.kill(next(iter(broken._processes)), signal.SIGKILL)
        deadline = time.time() + 60
        while not broken._broken and time.time() < deadline:  # the executor notices the death
            time.sleep(0.05)
        assert broken._broken, "the pool did not notice its worker's death"
        u = store.put(models[0])
        items = [(0, store.put(models[0]), None, 0.5), (1, store.put(models[1]), None, 0.5)]
        done, failed, acc = pool.align(u.path, items, {"matching": Matching(keep_identity=False)}, 0)
        assert set(done) == {0, 1} and not failed and pool.retried == [] and pool._pool is not broken
    T = weight_matching(models[0], models[1], Matching(keep_identity=False))
    want = aligned_state(models[1], T)
    got = acc.mean()
    record(
        "a new pool after a worker died idle: the mean vs the same mean here",
        max(float((got[k] - (0.5 * v + 0.5 * want[k])).abs().max()) for k, v in models[0].state_dict().items()),
        1e-12,
    )


def _strategy_round(scale=None, n=4, **kwargs):
    """One AlignedFedAvg round on ``n`` planted replies (crafted messages, no Flower runtime)."""
    from flwr.app import ArrayRecord
    from test_strategies import _planted_clients, _reply

    from fedlmc.strategies import AlignedFedAvg

    base, clients = _planted_clients(n)
    replies = [_reply(c, 100 + 10 * i, node=i + 1) for i, c in enumerate(clients)]
    strategy = AlignedFedAvg(model=base.config.to_dict(), scale=scale, **kwargs)
    strategy._previous = ArrayRecord(torch_state_dict=clients[0].state_dict())
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays.to_torch_state_dict(), strategy.history[-1]


def test_mmap_strategy_spools_replies_and_leaves_no_file(tmp_path, record):
    ref, _ = _strategy_round()
    got, rec = _strategy_round(Scale(spool=True, spool_dir=str(tmp_path)), guard=Guard(fn=lambda arrays: 0.0))
    record(
        "AlignedFedAvg with replies on disk vs in memory",
        max(float((got[k] - v).abs().max()) for k, v in ref.items()),
        0.0,
    )
    assert rec["excluded"] == [] and rec["kept"] == "aligned"
    assert not list(tmp_path.iterdir()) or not any(tmp_path.glob("round-*/*"))


def test_mmap_strategy_excludes_a_reply_it_cannot_write(tmp_path, monkeypatch):
    import fedlmc.scale.replies as replies

    real, calls = replies.write_state, []

    def full_disk(path, state, metadata=None):  # the third reply finds the disk full
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, state, metadata)

    monkeypatch.setattr(replies, "write_state", full_disk)
    _, rec = _strategy_round(Scale(spool=True, spool_dir=str(tmp_path)))
    assert [e["node"] for e in rec["excluded"]] == [3] and "No space left" in rec["excluded"][0]["reason"]
    assert rec["nodes"] == [1, 2, 4] and rec["kept"] == "aligned"
    assert not any(tmp_path.glob("round-*"))


def test_parallel_strategy_equals_the_sequential_one(tmp_path, record):
    ref, _ = _strategy_round()
    got, rec = _strategy_round(Scale(workers=2, backend="process", spool_dir=str(tmp_path)))
    diff = max(float((got[k] - v).abs().max()) for k, v in ref.items())
    record("AlignedFedAvg aligned by 2 workers vs in this process (float32)", diff, 1e-5)
    assert rec["excluded"] == [] and not any(tmp_path.glob("round-*"))


class ReplyingGrid:
    """A grid whose nodes answer a train message with their planted client's weights (no Flower runtime);
    it records what is pulled at once, and which of the returned replies still carry their arrays."""

    def __init__(self, clients):
        from test_strategies import _reply

        self.replies = {i + 1: _reply(c, 100 + 10 * i, node=i + 1) for i, c in enumerate(clients)}
        self.pushed, self.pulled_at_once = {}, []

    def get_node_ids(self):
        return list(self.replies)

    def push_messages(self, messages):
        ids = []
        for n, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"ins-{n}-{msg.metadata.dst_node_id}"
            self.pushed[msg.metadata.message_id] = msg
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        from flwr.app import Message

        out = []
        for mid in message_ids:
            ins = self.pushed.pop(mid)
            out.append(Message(self.replies[ins.metadata.dst_node_id].content, reply_to=ins))
        self.pulled_at_once.append(len(out))
        return out

    def send_and_receive(self, messages, *, timeout=None):  # Flower's: every reply pulled together
        return self.pull_messages(self.push_messages(messages))


def test_mmap_replies_are_written_as_they_arrive_in_flowers_loop(tmp_path, record, monkeypatch):
    """With ``Scale(spool=True)`` the strategy reads each train reply the moment it is pulled (one at a
    time), writes it to disk and drops its arrays from the message: the round ends with the same model."""
    from flwr.app import ArrayRecord
    from flwr.supercore.task_identity import TaskIdentity
    from test_strategies import _planted_clients

    from fedlmc.strategies import AlignedFedAvg

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # messages outside Flower's runtime
        monkeypatch.setattr(TaskIdentity, attr, value)
    base, clients = _planted_clients(3)
    results = {}
    for name, scale in (("memory", None), ("disk", Scale(spool=True, spool_dir=str(tmp_path)))):
        grid = ReplyingGrid(clients)
        strategy = AlignedFedAvg(model=base.config.to_dict(), scale=scale, fraction_evaluate=0.0)
        seen = []
        if scale is not None:  # what the strategy's Flower loop got back from the grid
            real = strategy.aggregate_train

            def spy(server_round, replies, real=real, seen=seen):
                replies = list(replies)
                seen.extend("arrays" in m.content for m in replies)
                return real(server_round, replies)

            strategy.aggregate_train = spy
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord(torch_state_dict=clients[0].state_dict()), num_rounds=1
        )
        results[name] = result.arrays.to_torch_state_dict()
        if scale is not None:
            assert seen == [False, False, False], "a reply reached aggregation with its arrays still in memory"
            assert set(grid.pulled_at_once) == {1}
            assert strategy.history[-1]["nodes"] == [1, 2, 3] and strategy.history[-1]["excluded"] == []
    diff = max(float((results["disk"][k] - v).abs().max()) for k, v in results["memory"].items())
    record("Flower's loop, replies written as they arrive vs held in memory", diff, 0.0)
    assert not any(tmp_path.glob("round-*"))


class CountedModel(StoredModel):
    """A stored reply that counts how many models read from the store are alive at once."""

    alive = 0
    most = 0

    def load(self):
        import weakref

        model = super().load()
        CountedModel.alive += 1
        CountedModel.most = max(CountedModel.most, CountedModel.alive)
        weakref.finalize(model, CountedModel._gone)
        return model

    @staticmethod
    def _gone():
        CountedModel.alive -= 1


def test_mmap_universe_holds_one_reply_at_a_time_whatever_m(tmp_path):
    """The claim behind "a few models whatever M is": a universe of 8 stored replies never has more than
    one of them read at once (aligned, summed, let go), in the iterations and in the final average."""
    models = _copies(8, noise=0.2)
    with ReplyStore(tmp_path) as store:
        handles = [CountedModel(h.path, h.config) for h in (store.put(m) for m in models)]
        CountedModel.alive = CountedModel.most = 0
        universe_merge(handles, start=models[0], universe=Universe(iterations=3, keep_layernorm=False))
        assert CountedModel.most == 1, f"{CountedModel.most} replies were held at once"
        # seeded by a reply, the universe is that reply during the first iteration: it and one other
        CountedModel.alive = CountedModel.most = 0
        universe_merge(handles, universe=Universe(iterations=3, keep_layernorm=False))
        assert CountedModel.most == 2, f"{CountedModel.most} replies were held at once"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_parallel_ray_tasks_equal_the_sequential_path(tmp_path, record):
    """The same chunks as Ray tasks (a local Ray started for them, on loopback, stopped after)."""
    import ray

    _parallel_vs_sequential(tmp_path, record, "ray")
    assert not ray.is_initialized() and not any(tmp_path.glob("round-*"))


def test_mmap_replies_on_disk_are_refused_by_strategies_that_hold_them_in_memory():
    from fedlmc.strategies import AverageFedAvg, HeteroWidthFedAvg

    for cls in (AverageFedAvg, HeteroWidthFedAvg):
        with pytest.raises(ValueError, match="AlignedFedAvg and RefinedFedAvg"):
            cls(scale=Scale(spool=True))
    AverageFedAvg(scale=Scale())  # the default (in memory) is every strategy's


def test_mmap_arriving_mean_is_the_streamed_mean_of_exactly_the_replies_summed(tmp_path, record):
    """``ArrivingMean``: the canonical replies' weighted mean summed as they arrive equals the mean a
    universe streams from their files; the order they arrive in hardly shows (a float64 sum); it is
    given only for exactly the replies summed, with their weights, and never across two shapes."""
    from fedlmc.merging.universe import ArrivingMean, members

    models = [m.float() for m in _copies(3, noise=0.2)]
    weights = [1.0, 2.0, 5.0]
    with ReplyStore(tmp_path) as store:
        handles = [store.put(m) for m in models]
        streamed = members(handles, weights, None, False).merge([Transform() for _ in handles])
        means = []
        for order in ((0, 1, 2), (2, 0, 1)):
            arriving = ArrivingMean()
            for i in order:
                arriving.add(handles[i].path, models[i], weights[i])
            exact = {h.path: w for h, w in zip(handles, weights)}
            assert arriving.model_for({**exact, handles[0].path: 3.0}) is None  # another weight
            assert arriving.model_for({h.path: w for h, w in zip(handles[1:], weights[1:])}) is None  # fewer
            means.append(arriving.model_for(exact))
        record("the mean summed as the replies arrived vs streamed from files", _max_diff(means[0], streamed), 1e-6)
        record("the mean summed in two arrival orders", _max_diff(means[0], means[1]), 1e-6)
        arriving.add("late", models[0], 1.0)  # after the mean was taken: no mean for anything now
        assert arriving.model_for({**exact, "late": 1.0}) is None and arriving.model_for(exact) is None
        wider = from_preset("gpt2-tiny", n_layer=2, d_model=48, n_head=4, d_ff=64, vocab_size=40)
        arriving = ArrivingMean()
        arriving.add(handles[0].path, models[0], 1.0)
        arriving.add("wider", wider, 1.0)
        assert arriving.model_for({handles[0].path: 1.0, "wider": 1.0}) is None


def test_mmap_universe_mean_summed_as_replies_arrive_reads_each_file_once(tmp_path, record, monkeypatch):
    """``Universe(start="average")`` on replies written to disk as they arrive: the start (the replies'
    mean) and ``start_for``'s cosines are computed while each reply is in memory, so the round reads each
    reply's file once (its one universe iteration) instead of three times, and merges the same model."""
    from flwr.app import ArrayRecord
    from flwr.supercore.task_identity import TaskIdentity
    from test_strategies import _near_copies, _planted_clients

    from fedlmc.strategies import AlignedFedAvg

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # messages outside Flower's runtime
        monkeypatch.setattr(TaskIdentity, attr, value)
    base, _ = _planted_clients(1)
    near = _near_copies(base, n=3)  # replies trained a little from the global model
    loads = []
    real_load = StoredModel.load
    monkeypatch.setattr(StoredModel, "load", lambda self: loads.append(self.path) or real_load(self))
    results = {}
    for name, scale in (("memory", None), ("disk", Scale(spool=True, spool_dir=str(tmp_path)))):
        strategy = AlignedFedAvg(
            model=base.config.to_dict(),
            scale=scale,
            matching=Matching(min_gain=0.5),
            universe=Universe(start="average"),
            fraction_evaluate=0.0,
        )
        loads.clear()
        result = strategy.start(
            grid=ReplyingGrid(near), initial_arrays=ArrayRecord(torch_state_dict=base.state_dict()), num_rounds=1
        )
        results[name] = result.arrays.to_torch_state_dict()
        assert strategy.history[-1]["start"] == "average" and strategy.history[-1]["excluded"] == []
        if scale is not None:
            assert len(loads) == len(near) == len(set(loads)), f"the replies' files were read {len(loads)} times"
    diff = max(float((results["disk"][k] - v).abs().max()) for k, v in results["memory"].items())
    record("universe from the mean summed as replies arrived vs streamed in memory", diff, 1e-6)
    assert not any(tmp_path.glob("round-*"))


def test_mmap_next_reply_is_prefetched_while_one_is_aligned(tmp_path, monkeypatch):
    """Each pass over stored replies (the server's alignments, a worker's chunk, the streamed mean) asks
    the kernel for the next reply's file before reading the current one's, so its pages come from disk
    while the current one is aligned; ``prefetch`` survives a missing file. The
    server's passes go back and forth (``Members.in_turn``), the first backwards: each starts with the
    files the one before read last (how ``prefetch`` reads a file: the test after this one)."""
    import fedlmc.scale.replies as replies
    import fedlmc.scale.workers as workers
    from fedlmc.scale.workers import align_chunk

    paths = [save_model(tmp_path / f"r{i}.safetensors", m).path for i, m in enumerate(_copies(4))]
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(replies, "prefetch", lambda path: events.append(("prefetch", str(path))))
    real_load = StoredModel.load
    monkeypatch.setattr(StoredModel, "load", lambda self: events.append(("load", self.path)) or real_load(self))

    def one_ahead(files: list[str]) -> list[tuple[str, str]]:  # each read after the next one was asked for
        out = []
        for k, f in enumerate(files):
            out += ([("prefetch", files[k + 1])] if k + 1 < len(files) else []) + [("load", f)]
        return out

    universe_merge(
        [stored(p) for p in paths],
        matching=Matching(keep_identity=False),
        universe=Universe(iterations=1, keep_layernorm=False),
    )
    assert events == [("load", paths[0])] + one_ahead(paths[::-1]), events  # the anchor, then the iteration's pass
    events.clear()
    universe_merge(
        [stored(p) for p in paths],
        start="average",
        matching=Matching(keep_identity=False),
        universe=Universe(iterations=1, keep_layernorm=False),
    )
    assert events == one_ahead(paths[::-1]) + one_ahead(paths), events  # the streamed mean, then the iteration
    events.clear()
    items = [(i, stored(p), None, 0.25) for i, p in enumerate(paths[:3])]
    out = str(tmp_path / "sum.safetensors")
    monkeypatch.setattr(workers, "_CACHE", {})  # a worker that has not read this universe yet
    align_chunk(paths[3], items, {"matching": Matching(keep_identity=False)}, 0, out, None)
    assert events == [("load", paths[3])] + one_ahead(paths[:3]), events  # the universe, then the chunk
    monkeypatch.undo()
    replies.prefetch(tmp_path / "missing.safetensors")  # nothing to read: no error (load() will say why)


def _kernel_at_least(major: int, minor: int) -> bool:
    import platform
    import re

    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return sys.platform.startswith("linux") and found is not None and tuple(map(int, found.groups())) >= (major, minor)


def _prefetched(replies, path) -> None:
    before = set(threading.enumerate())
    replies.prefetch(path)
    for t in set(threading.enumerate()) - before:
        t.join(timeout=30)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here: prefetch does nothing")
def test_mmap_prefetch_faults_the_whole_file_in(tmp_path, monkeypatch):
    """``prefetch`` reads the whole file in a thread of its own: on Linux ≥ 5.14 by faulting it in through
    mappings of a window each (``MADV_POPULATE_READ``, which frees memory for it where WILLNEED's
    read-ahead is dropped); elsewhere, or where that fails, by WILLNEED advice over the whole file, a
    piece at a time. A file shorter than the size asked for is not an error (no SIGBUS): nothing is
    populated."""
    import fedlmc.scale.replies as replies

    path = save_model(tmp_path / "r.safetensors", _copies(1)[0]).path
    size = os.path.getsize(path)
    advised: list[tuple[int, int, int]] = []
    real_fadvise = os.posix_fadvise
    monkeypatch.setattr(
        os, "posix_fadvise", lambda fd, offset, length, advice: advised.append((offset, length, advice))
    )
    populated: list[tuple[int, bool]] = []
    real_populate = replies._populate
    monkeypatch.setattr(
        replies, "_populate", lambda fd, n: populated.append((n, real_populate(fd, n))) or populated[-1][1]
    )
    _prefetched(replies, path)
    if _kernel_at_least(5, 14):  # faulted in: no advice needed
        assert populated == [(size, True)] and advised == []
    piece = 256
    monkeypatch.setattr(replies, "PREFETCH_PIECE", piece)
    monkeypatch.setattr(replies, "_populate", lambda fd, n: False)  # an older kernel: the whole file advised
    advised.clear()
    _prefetched(replies, path)
    assert advised == [(o, piece, os.POSIX_FADV_WILLNEED) for o in range(0, size, piece)] and len(advised) > 1
    monkeypatch.setattr(os, "posix_fadvise", real_fadvise)
    fd = os.open(path, os.O_RDONLY)
    try:
        if _kernel_at_least(5, 14):  # a window at a time (here a page: every window, the last one short)
            monkeypatch.setattr(replies, "POPULATE_WINDOW", 4096)
            assert size % 4096 and real_populate(fd, size) is True
        assert real_populate(fd, size + (1 << 20)) is False  # past the end of the file: refused, not a crash
        assert real_populate(fd, 0) is False
    finally:
        os.close(fd)
