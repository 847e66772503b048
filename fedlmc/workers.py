"""A universe iteration's alignments in parallel workers: Ray tasks, or a pool of local processes.

Every model of a universe iteration is aligned to the same universe, independently of the others, so
the M weight matchings of an iteration can run at once. The server writes the universe to a file
(``replies.save_model``); each task gets that file's path, one reply's ``StoredModel`` and its warm
start, reads both through memory maps, and returns only the transform (a few MB). A worker process
keeps the universe it last read, and what matching computes from it alone (``weight_matching``'s
``reuse``), for the next task of the same iteration.

Backends: ``"process"`` starts ``workers`` local processes (``spawn``); ``"ray"`` submits Ray tasks
(to the cluster at ``address``, or a local Ray started for the purpose, or the one already running),
so the same code spreads over the machines of a Ray cluster. A task that fails, or whose worker dies,
is retried ``retries`` times; then its reply is excluded with the reason, and the round goes on.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Optional, Union

import torch

from .matching import weight_matching
from .options import Scale
from .replies import StoredModel, stored
from .symmetry import Transform, canonical

_CACHE: dict[str, Any] = {}  # in a worker: the universe it last read, and what matching built from it


def align_one(
    universe_file: str, source: StoredModel, warm: Optional[Transform], options: dict[str, Any], threads: int
) -> Transform:
    """One task: align the reply ``source`` to the universe in ``universe_file`` (in a worker)."""
    if threads:
        torch.set_num_threads(threads)
    if _CACHE.get("file") != universe_file:
        _CACHE.clear()
        _CACHE.update(file=universe_file, universe=stored(universe_file).load(), reuse={})
    model = canonical(source.load())
    T = weight_matching(_CACHE["universe"], model, warm_start=warm, reuse=_CACHE["reuse"], **options)
    T.info["worker_pid"] = os.getpid()
    return T


Task = tuple[int, StoredModel, Optional[Transform]]


class AlignmentPool:
    """Workers that align replies to a universe (``align``); ``close()`` stops them.

    Parameters
    ----------
    scale : Scale
        ``workers`` (0: one per available core), ``backend``, ``address`` and ``retries``.
    """

    def __init__(self, scale: Scale) -> None:
        self.scale = scale
        self.workers = scale.workers or available_cores()
        self.backend = scale.backend if scale.backend != "auto" else ("ray" if scale.address else "process")
        # each worker's torch threads: the cores shared out (a task on a remote Ray node keeps this count too)
        self.threads = max(1, available_cores() // self.workers)
        self._pool: Optional[ProcessPoolExecutor] = None
        self._ray_started = False
        self.retried: list[int] = []
        if self.backend == "ray":
            import ray

            if not ray.is_initialized():
                kwargs = {"address": scale.address} if scale.address else {"num_cpus": self.workers}
                ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
                self._ray_started = True
            self._remote = ray.remote(num_cpus=1, max_retries=scale.retries, retry_exceptions=True)(align_one)

    def align(self, universe_file: Union[str, os.PathLike], tasks: list[Task], options: dict[str, Any]):
        """``{index: Transform}`` for the tasks that succeeded and ``{index: reason}`` for those that
        failed ``1 + retries`` times."""
        if not tasks:
            return {}, {}
        if self.backend == "ray":
            return self._align_ray(str(universe_file), tasks, options)
        return self._align_processes(str(universe_file), tasks, options)

    def _align_ray(self, universe_file: str, tasks: list[Task], options: dict[str, Any]):
        import ray

        refs = {i: self._remote.remote(universe_file, src, warm, options, self.threads) for i, src, warm in tasks}
        done, failed = {}, {}
        for i, ref in refs.items():
            try:
                done[i] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 -- after Ray's retries: the reply is excluded, with the reason
                failed[i] = _reason(e, self.scale.retries)
        return done, failed

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            import multiprocessing

            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def _reset(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _align_processes(self, universe_file: str, tasks: list[Task], options: dict[str, Any]):
        done: dict[int, Transform] = {}
        errors: dict[int, BaseException] = {}
        futures = {
            i: self._executor().submit(align_one, universe_file, s, w, options, self.threads) for i, s, w in tasks
        }
        for i, f in futures.items():
            try:
                done[i] = f.result()
            except BaseException as e:  # noqa: BLE001 -- a failed task or a dead worker: retried below
                errors[i] = e
        if any(isinstance(e, BrokenProcessPool) for e in errors.values()):
            self._reset()  # a worker died: every task that was in flight failed with it
        # retries one task at a time, so a worker that dies again names its own task and no other
        for _ in range(self.scale.retries):
            for i, src, warm in [t for t in tasks if t[0] in errors]:
                self.retried.append(i)
                try:
                    done[i] = (
                        self._executor().submit(align_one, universe_file, src, warm, options, self.threads).result()
                    )
                    del errors[i]
                except BaseException as e:  # noqa: BLE001
                    errors[i] = e
                    if isinstance(e, BrokenProcessPool):
                        self._reset()
        return done, {i: _reason(e, self.scale.retries) for i, e in errors.items()}

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


def _reason(e: BaseException, retries: int) -> str:
    what = "its worker died" if isinstance(e, BrokenProcessPool) or "WorkerCrashed" in type(e).__name__ else "failed"
    last = (str(e).strip().splitlines() or [""])[-1]
    return f"alignment {what} ({1 + retries} attempts): {type(e).__name__}: {last}"


def available_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota when one is set."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n
