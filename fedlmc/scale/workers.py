"""A universe iteration's alignments in parallel workers: Ray tasks, or a pool of local processes.

Every model of a universe iteration is aligned to the same universe, independently of the others, so
the M weight matchings of an iteration can run at once. The server writes the universe to a file
(``replies.save_model``) and splits the replies into one chunk per worker. A task reads the universe
and each reply of its chunk through memory maps, aligns the reply, adds it (aligned, weighted) to a
partial sum while it is at hand, and returns the transforms (a few MB) and the partial sum's file;
the server adds the partial sums. So each reply is read once per iteration, and both the matchings
and the average run in the workers. A worker process keeps the universe it last read, and what
matching computes from it alone (``weight_matching``'s ``reuse``), for its next task.

Backends: ``"process"`` starts ``workers`` local processes (``spawn``) as soon as the pool is made,
so they are up, torch and weight matching imported, by the time the server has written the universe
(a pool whose worker died while it waited is replaced when the next tasks come); ``"ray"`` submits Ray
tasks (to the cluster at ``address``, or a local Ray started for the purpose, or the one already
running), so the same code spreads over the machines of a Ray cluster (the files must then be on
storage that every node reads at the same path). A task that is done with its chunk takes over the
replies that the others have not reached yet, from the ends of their chunks: each reply is claimed
(a file created exclusively in the round's folder) before it is read, so it is aligned by one task,
and a slower worker or node does not hold up the round. A reply that fails, or whose worker dies, is
retried on its own ``retries`` times; then it is excluded with the reason, and the round goes on.
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import zip_longest
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from fedlmc.matching import weight_matching
from fedlmc.merging.averaging import RunningSum, add_move, aligned_state
from fedlmc.options import Scale
from fedlmc.scale.allocator import retain_freed_memory
from fedlmc.scale.cpu import available_cores
from fedlmc.scale.replies import Canonical, StoredModel, mmap_state, read_ahead, stored, write_state
from fedlmc.symmetry import Transform

_CACHE: dict[str, Any] = {}  # in a worker: the universe it last read, and what matching built from it

Item = tuple[int, StoredModel, Optional[Transform], float]  # (index, reply, warm start, weight)


def align_chunk(
    universe_file: str,
    items: list[Item],
    options: dict[str, Any],
    threads: int,
    out: str,
    skip: Optional[int],
    mean: bool = False,
    others: Sequence[list[Item]] = (),
    claims: Optional[str] = None,
) -> tuple[dict[int, Transform], dict[int, str], Optional[str], float]:
    """One task, in a worker: align each reply of ``items`` to the universe in ``universe_file`` and add
    it, aligned and weighted, to a partial sum written to ``out``. Returns the transforms, the replies
    that failed (with the reason), the partial sum's file (None if empty) and its total weight.
    ``skip``: the reply the universe started as (its transform is the identity, exactly). ``mean``: the
    universe is the replies' plain weighted mean, so the partial sum is of each reply's move,
    ``w (T(B) − B)`` (``averaging.add_move``: nothing for a reply that keeps the identity).
    ``claims``: a folder shared with the tasks of ``others`` (their chunks): every reply is claimed
    there before it is read (``claim``), so the task aligns the replies of ``items`` that no other task
    took, then those of ``others`` that no task has claimed yet, from the ends of their chunks."""
    retain_freed_memory()  # (a Ray worker: see ``started``)
    if threads:
        torch.set_num_threads(threads)
    if _CACHE.get("file") != universe_file:
        _CACHE.clear()
        _CACHE.update(file=universe_file, universe=stored(universe_file).load(), reuse={})
    universe, reuse, acc = _CACHE["universe"], _CACHE["reuse"], RunningSum()
    done, failed = {}, {}
    order = list(items) + takeover_order(others)
    canon = Canonical([item[1] for item in order])  # each reply's canonical form in the memory of the one before
    mine = (k for k, item in enumerate(order) if claims is None or claim(claims, item[0]))
    for k in read_ahead(mine, lambda k: order[k][1]):  # the next reply claimed, and its file read, meanwhile
        i, _, warm, w = order[k]
        model = None
        try:
            t0 = time.perf_counter()
            model = canon[k]
            read = time.perf_counter() - t0
            T = Transform() if i == skip else weight_matching(universe, model, warm_start=warm, reuse=reuse, **options)
            if mean:
                add_move(acc, model, T, w)
            else:
                acc.add(aligned_state(model, T), w)
        except Exception as e:  # noqa: BLE001 -- an unreadable reply, a failed matching: retried, then excluded
            failed[i] = f"{type(e).__name__}: {e}"
            continue
        finally:  # summed (a copy), or failed: the next reply is written into its canonical weights
            if model is not None:
                canon.recycle(model)
            del model
        T.info["worker_pid"] = os.getpid()
        T.info["node"] = node_name()
        T.info["worker_peak_rss_mb"] = peak_rss_mb()
        T.info["read_seconds"] = read  # the reply read from its file and put in canonical form
        if k >= len(items):
            T.info["taken_over"] = True  # from another task's chunk
        done[i] = T
    if acc.state is None:
        return done, failed, None, 0.0
    write_state(out, acc.state)
    return done, failed, out, acc.weight


def node_name() -> str:
    """Where this process runs: its Ray node's id in a Ray worker, else the host's name."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return socket.gethostname()


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports kB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def started(_: int = 0) -> tuple[str, int]:
    """A worker's start (its first Ray task, or a local process's initializer): unpickling this function
    imported this module (torch, weight matching) before the worker's first alignment arrives; and the
    worker keeps the memory it frees (``allocator.retain_freed_memory``), so a reply's matching reuses the
    pages of the one before instead of faulting in its temporaries afresh (a few hundred MB per
    GPT-2-small reply). Returns the worker's node and pid."""
    retain_freed_memory()
    return node_name(), os.getpid()


def takeover_order(others: Sequence[list[Item]]) -> list[Item]:
    """The items of the other tasks' chunks in the order a task that is done with its own takes them
    over: from each chunk's end (what its task reaches last), the chunks in turn."""
    tails = [list(reversed(chunk)) for chunk in others]
    return [item for group in zip_longest(*tails) for item in group if item is not None]


def claim(folder: str, i: int) -> bool:
    """Claim reply ``i`` in ``folder`` (create the file ``i`` there, exclusively): True for the one
    task that creates it, False for every other."""
    try:
        os.close(os.open(os.path.join(folder, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


class AlignmentPool:
    """Workers that align replies to a universe and sum them there (``align``); ``close()`` stops them.

    Parameters
    ----------
    scale : Scale
        ``workers`` (0: one per available core), ``backend``, ``address`` and ``retries``.
    """

    def __init__(self, scale: Scale) -> None:
        self.scale = scale
        self.workers = scale.workers or available_cores()
        self.backend = scale.backend if scale.backend != "auto" else ("ray" if scale.ray_address else "process")
        # each worker's torch threads: this machine's cores shared out
        self.threads = max(1, available_cores() // self.workers)
        self._pool: Optional[ProcessPoolExecutor] = None
        self._ray_started = False
        self._warming: list = []
        self.retried: list[int] = []
        self._calls = 0
        if self.backend == "ray":
            import ray

            if not ray.is_initialized():
                # a cluster's address, or a Ray of our own on this machine, on the loopback interface
                kwargs = (
                    {"address": scale.ray_address}
                    if scale.ray_address
                    else {"num_cpus": self.workers, "_node_ip_address": "127.0.0.1"}
                )
                ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
                self._ray_started = True
            # spread over the cluster's nodes; one task per worker starts its process now (imports),
            # so that every worker is up when the first universe is written and takes its own chunk
            self._remote = ray.remote(num_cpus=1, max_retries=0, scheduling_strategy="SPREAD")(align_chunk)
            warm = ray.remote(num_cpus=1, max_retries=0, scheduling_strategy="SPREAD")(started)
            self._warming = [warm.remote(k) for k in range(self.workers)]
        else:  # the local workers start now (spawn, imports) while the server writes the universe
            executor = self._executor()
            for _ in range(self.workers):
                executor.submit(os.getpid)

    def align(
        self,
        universe_file: Union[str, os.PathLike],
        items: list[Item],
        options: dict[str, Any],
        skip: Optional[int],
        mean: bool = False,
    ) -> tuple[dict[int, Transform], dict[int, str], RunningSum]:
        """Align and sum ``items`` (split into one chunk per worker): the transforms that succeeded, the
        reasons of those that failed ``1 + retries`` times (a reply that failed, or whose worker died,
        is retried on its own), and the weighted sum of the aligned replies (partial sums added here);
        ``mean``: of their moves (see ``align_chunk``)."""
        self._calls += 1
        folder = Path(universe_file).parent
        chunks = [items[k :: self.workers] for k in range(self.workers) if items[k :: self.workers]]
        done: dict[int, Transform] = {}
        errors: dict[int, str] = {}
        acc = RunningSum()
        for attempt in range(1 + self.scale.retries):
            if attempt:  # one reply a task, so a worker that dies again names its own reply and no other
                chunks = [[item] for item in items if item[0] in errors]
                self.retried += [c[0][0] for c in chunks]
            if not chunks:
                break
            outs = [str(folder / f"partial-{self._calls}-{attempt}-{k}.safetensors") for k in range(len(chunks))]
            claims = None
            if not attempt and len(chunks) > 1:  # a task done with its chunk takes over the others' replies
                claims = Path(tempfile.mkdtemp(prefix=f"claims-{self._calls}-", dir=folder))
            try:
                results = self._run(str(universe_file), chunks, options, outs, skip, mean, claims, attempt > 0)
            finally:
                if claims is not None:
                    shutil.rmtree(claims, ignore_errors=True)
            dead, reported = [], set()
            for chunk, result in zip(chunks, results):
                if isinstance(result, BaseException):  # the worker died (or the task broke)
                    dead.append((chunk, _reason(result)))
                    continue
                ok, failed, partial, weight = result
                done.update(ok)
                errors.update(failed)
                reported.update(failed)
                for i in ok:
                    errors.pop(i, None)
                if partial is not None:
                    acc.add_sum(mmap_state(partial)[0], weight)
                    Path(partial).unlink(missing_ok=True)
            if dead:  # what no live task aligned or reported was claimed by a dead one, and failed with it:
                # a reply of its own chunk with its reason, one it had taken over with the first death's
                why = {i: reason for chunk, reason in dead for i, *_ in chunk}
                for i, *_ in (item for chunk in chunks for item in chunk):
                    if i not in done and i not in reported:
                        errors[i] = why.get(i, dead[0][1])
        tries = 1 + self.scale.retries
        return done, {i: f"alignment failed {tries} times: {why}" for i, why in errors.items()}, acc

    def _run(
        self,
        universe_file: str,
        chunks: list,
        options: dict,
        outs: list[str],
        skip: Optional[int],
        mean: bool,
        claims: Optional[Path],
        isolate: bool,
    ) -> list:
        """Each chunk's result, or the exception that stopped it. ``claims``: the folder in which the
        tasks claim their replies, each task also taking over the other chunks (``align_chunk``); None:
        each task aligns its own chunk. ``isolate``: in the process pool, one task at a time (a worker
        that dies breaks the whole pool, and every task still running in it fails with it, so only a
        task run alone is known to have died of its own reply)."""
        args = [
            (universe_file, c, options, self.threads, o, skip, mean)
            + (([d for d in chunks if d is not c], str(claims)) if claims is not None else ())
            for c, o in zip(chunks, outs)
        ]
        results: list = []
        if self.backend == "ray":
            import ray

            if self._warming:  # every worker started (or failed to: its tasks then say so)
                ray.wait(self._warming, num_returns=len(self._warming), timeout=120)
                self._warming = []
            for ref in [self._remote.remote(*a) for a in args]:
                try:
                    results.append(ray.get(ref))
                except Exception as e:  # noqa: BLE001 -- a dead worker or node
                    results.append(e)
            return results
        batches = [[a] for a in args] if isolate else [args]
        for batch in batches:
            for f in [self._submit(a) for a in batch]:
                try:
                    results.append(f.result())
                except BaseException as e:  # noqa: BLE001 -- a dead worker breaks the pool: a new one next time
                    results.append(e)
            if any(isinstance(r, BrokenProcessPool) for r in results[-len(batch) :]):
                self._reset()
        return results

    def _submit(self, args: tuple):
        try:
            return self._executor().submit(align_chunk, *args)
        except BrokenProcessPool:  # a worker died while the pool waited (it starts with the pool): a new one
            self._reset()
            return self._executor().submit(align_chunk, *args)

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            import multiprocessing

            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=started
            )
        return self._pool

    def _reset(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        self._reset()
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False

    def __enter__(self) -> "AlignmentPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _reason(e: BaseException) -> str:
    if isinstance(e, BrokenProcessPool) or "WorkerCrashed" in type(e).__name__ or "ActorDied" in type(e).__name__:
        return f"its worker died ({type(e).__name__})"
    last = (str(e).strip().splitlines() or [""])[-1]
    return f"{type(e).__name__}: {last}"
