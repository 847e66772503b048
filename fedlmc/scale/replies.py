"""Replies off the heap: models waiting on disk as safetensors, read back through a memory map.

A server that aligns M replies need not hold M models: each reply is written once to a ``ReplyStore``
(one directory per round) and comes back as a ``StoredModel``, a small handle (path + config) whose
``load()`` builds the model on a read-only memory map of its file. Pages are read when touched and
belong to the page cache, not to the process's heap, so a universe that loads one reply at a time
(``universe.universe_merge`` with ``StoredModel``s) keeps a few models in memory whatever M is, and
workers in other processes (``fedlmc.scale.workers``) read the same file without a copy being sent.

Nothing is lost and nothing is left: a reply that cannot be written or read raises ``ReplyError``
with the reason (the strategies exclude that reply and go on); ``ReplyStore.close()`` removes the
round's files, and a store left behind by a process that died (a crash, a kill) is removed by the
next store opened under the same root.

``Canonical`` is how a pass reads them: each stored reply is put in canonical form when its turn comes,
in the memory of the one before it (handed back with ``recycle``), so a pass over M replies faults in
the pages of one model, not M.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar, Union

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import save_file

from fedlmc.matching.profile import section
from fedlmc.models import from_config
from fedlmc.models.layers import TransformerConfig
from fedlmc.scale.allocator import libc
from fedlmc.symmetry import canonical

T = TypeVar("T")
OWNER = "owner.json"  # in every store: the pid that owns it (stale once that process is gone)
_DTYPES = {  # safetensors dtype → (numpy dtype to map the bytes with, torch dtype to view them as)
    "F64": (np.float64, torch.float64),
    "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16),
    "BF16": (np.int16, torch.bfloat16),
    "I64": (np.int64, torch.int64),
    "I32": (np.int32, torch.int32),
    "I16": (np.int16, torch.int16),
    "I8": (np.int8, torch.int8),
    "U8": (np.uint8, torch.uint8),
    "BOOL": (np.bool_, torch.bool),
}


class ReplyError(RuntimeError):
    """A reply that could not be written to, or read back from, its file (the message says why)."""


def write_state(path: Union[str, Path], state: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None):
    """Write ``state`` as safetensors at ``path``, atomically (a partial file never has the final name)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    seen: set[int] = set()
    flat = {}
    for k, v in state.items():  # safetensors refuses tensors that share memory: copy the second of a pair
        v = v.detach().cpu().contiguous()
        ptr = v.data_ptr()
        flat[k] = v.clone() if ptr in seen and v.numel() else v
        seen.add(ptr)
    save_file(flat, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def mmap_state(path: Union[str, Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a safetensors file as views of a private (copy-on-write) memory map of it, and its
    metadata. No tensor is copied: a page is read from disk (or the page cache) when first touched, and
    writing to a tensor changes this process's copy of that page only, never the file."""
    path = Path(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > 100_000_000:
            raise ReplyError(f"{path.name} is not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    size = path.stat().st_size
    base = 8 + n
    raw = np.memmap(path, dtype=np.uint8, mode="c") if size > base else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        np_dtype, torch_dtype = _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        if base + end > size:
            raise ReplyError(f"{path.name} is truncated: {name} ends at byte {base + end} of {size}")
        t = torch.from_numpy(raw[base + begin : base + end].view(np_dtype)) if end > begin else torch.empty(0)
        out[name] = t.view(torch_dtype).reshape(info["shape"]) if end > begin else torch.zeros(info["shape"])
    return out, meta


# Linux reads at most the device's read-ahead window (``read_ahead_kb``, often 128 KB, at most a few
# MB) per WILLNEED call: a whole file is advised a piece of this size at a time
PREFETCH_PIECE = 128 << 10
_MADV_POPULATE_READ = 22  # Linux ≥ 5.14
POPULATE_WINDOW = 64 << 20  # bytes faulted in per temporary mapping (a multiple of the page size)
_PROT_READ, _MAP_SHARED = 1, 1


def prefetch(path: Union[str, Path]) -> None:
    """Have the file at ``path`` read into the page cache in the background, and return at once: the
    next reply's pages then come from disk while the current one is aligned, not when its tensors are
    first touched. A thread faults the whole file in through mappings of its own, a window at a time
    (Linux's ``MADV_POPULATE_READ``, ``_populate``); where that is missing, it advises ``posix_fadvise``
    WILLNEED, ``PREFETCH_PIECE`` bytes at a time (one call for the whole file would read only its first
    few megabytes). WILLNEED alone is not enough on a busy server: the kernel drops such read-ahead
    when it would have to free memory for it, which is always the case once the page cache is full
    (M replies larger than the memory), so most of the next file was still on disk when its turn
    came. Nothing where neither call exists (Windows, macOS) or the file cannot be opened (its
    ``load()`` will say why)."""
    if getattr(os, "posix_fadvise", None) is None:
        return
    threading.Thread(target=_advise, args=(str(path),), name="fedlmc-prefetch", daemon=True).start()


def _advise(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        if _populate(fd, size):
            return
        for offset in range(0, size, PREFETCH_PIECE):
            os.posix_fadvise(fd, offset, PREFETCH_PIECE, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


@functools.cache
def _libc() -> Optional[ctypes.CDLL]:
    """The C library (``allocator.libc``) with ``mmap``, ``madvise`` and ``munmap`` typed for
    ``_populate`` (ctypes lets the GIL go for a call: Python's own ``mmap.madvise`` holds it while the
    pages are read), or None."""
    lib = libc()
    try:
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except AttributeError:  # no C library here (None), or one without them
        return None
    return lib


def _populate(fd: int, size: int) -> bool:
    """Fault the file open at ``fd`` (``size`` bytes) into the page cache through temporary mappings of
    it (``MADV_POPULATE_READ``: read as page faults would, freeing memory where needed), one
    ``POPULATE_WINDOW`` at a time (a mapped page counts in the process's resident memory until it is
    unmapped: so the prefetch adds at most a window to it); False where the kernel or the C library
    cannot (then nothing more is read)."""
    lib = _libc()
    if lib is None or size == 0:
        return False
    for offset in range(0, size, POPULATE_WINDOW):
        n = min(POPULATE_WINDOW, size - offset)
        addr = lib.mmap(None, n, _PROT_READ, _MAP_SHARED, fd, offset)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return False
        try:
            if lib.madvise(addr, n, _MADV_POPULATE_READ) != 0:
                return False
        finally:
            lib.munmap(addr, n)
    return True


def read_ahead(items: Iterable[T], model_of: Callable[[T], Any]) -> Iterator[T]:
    """Yield ``items`` in order; before each, take the next item and hand its model (``model_of`` of
    it) to ``prefetch`` when it is a ``StoredModel``, so a pass over stored replies reads the next file
    from disk while it works on the current one. ``items`` may be a generator: it is drawn from one
    item ahead of what is yielded."""
    it = iter(items)
    item = next(it, _END)
    while item is not _END:
        upcoming = next(it, _END)
        model = model_of(upcoming) if upcoming is not _END else None
        if isinstance(model, StoredModel):
            prefetch(model.path)
        yield item
        item = upcoming


_END = object()


@dataclass(frozen=True)
class StoredModel:
    """A fedlmc model that waits on disk (a ``ReplyStore`` file): its ``config`` is at hand, its weights
    are read by ``load()``. Picklable and small, so it travels to worker processes as it is."""

    path: str
    config: TransformerConfig

    def load(self) -> nn.Module:
        """The model, on a memory map of the file (``mmap_state``); ``ReplyError`` if it cannot be read."""
        try:
            state, _ = mmap_state(self.path)
            with torch.device("meta"):
                model = from_config(self.config)
            model.load_state_dict(state, strict=True, assign=True)
        except ReplyError:
            raise
        except Exception as e:  # noqa: BLE001 -- a missing, truncated or foreign file: say which and why
            raise ReplyError(f"could not read {Path(self.path).name}: {type(e).__name__}: {e}") from e
        return model.eval()


def save_model(path: Union[str, Path], model: nn.Module, meta: Optional[dict[str, Any]] = None) -> StoredModel:
    """Write ``model`` to ``path`` (safetensors, its config in the file's metadata) and return its handle."""
    doc = {"config": json.dumps(model.config.to_dict()), "meta": json.dumps(meta or {})}
    write_state(path, model.state_dict(), doc)
    return StoredModel(str(path), model.config)


def stored(path: Union[str, Path]) -> StoredModel:
    """The handle of a file written by ``save_model`` (its config read from the file's header)."""
    _, meta = mmap_state(path)
    with torch.device("meta"):
        config = from_config(json.loads(meta["config"])).config
    return StoredModel(str(path), config)


class ReplyStore:
    """One round's replies on disk: ``put`` writes a model and returns its ``StoredModel``; ``close`` (or
    leaving the ``with`` block) removes the files. Opening a store removes the stores under the same
    ``root`` whose owning process has died (what a crash left behind).

    Parameters
    ----------
    root : str or Path, optional
        Where the round directories go (default: the system's temporary directory, ``fedlmc-replies``).
        Put it on a local disk with room for M models.
    """

    def __init__(self, root: Union[str, Path, None] = None) -> None:
        self.root = Path(root) if root is not None else Path(tempfile.gettempdir()) / "fedlmc-replies"
        self.root.mkdir(parents=True, exist_ok=True)
        self.removed_stale = sweep(self.root)
        self.path = self.root / f"round-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        (self.path / OWNER).write_text(json.dumps({"pid": os.getpid()}))
        self._n = 0

    def put(self, model: nn.Module, name: Optional[str] = None) -> StoredModel:
        """Write ``model``; ``ReplyError`` (with the reason) if it cannot be written."""
        self._n += 1
        path = self.path / f"{name or f'reply-{self._n}'}.safetensors"
        try:
            return save_model(path, model)
        except Exception as e:  # noqa: BLE001 -- a full disk, a vanished directory: the reply is excluded, said why
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
            raise ReplyError(f"could not write {path.name}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "ReplyStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sweep(root: Union[str, Path]) -> list[str]:
    """Remove the stores under ``root`` whose owning process is gone; returns their names."""
    removed = []
    for d in Path(root).glob("round-*"):
        try:
            pid = int(json.loads((d / OWNER).read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = int(d.name.split("-")[1]) if d.name.split("-")[1].isdigit() else -1
        if not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class Canonical(Sequence):
    """The models in canonical form: a model in memory converted once and kept, a ``StoredModel`` read
    from its file (memory-mapped) and converted each time it is asked for, then let go. A pass that
    is done with such a model hands it back (``recycle``): the next one is written into its memory."""

    def __init__(self, models: Sequence[Union[nn.Module, StoredModel]]) -> None:
        self.models = models
        self._kept = [None if isinstance(m, StoredModel) else canonical(m) for m in models]
        self._made: Optional[weakref.ref] = None  # the last model converted here from a file
        self._spare: Optional[dict] = None

    def __len__(self) -> int:
        return len(self.models)

    def __getitem__(self, i: int) -> nn.Module:  # type: ignore[override]
        kept = self._kept[i]
        if kept is not None:
            return kept
        with section("reading replies and canonical form"):  # a memory map's pages are read when touched
            loaded = self.models[i].load()
            model, self._spare = canonical(loaded, out=self._spare), None
        self._made = weakref.ref(model) if model is not loaded else None
        return model

    def recycle(self, model: nn.Module) -> None:
        """``model``, the last one converted here, is no longer used by anyone: the next conversion
        writes into its tensors (``symmetry.canonicalize``'s ``out``) instead of fresh memory. Nothing
        for another model (one kept in memory, or a memory-mapped file already canonical)."""
        if self._made is not None and self._made() is model:
            self._spare = {k: v.detach() for k, v in model.state_dict().items()}
            self._made = None

    def let_go(self) -> None:
        """Drop the recycled memory (the end of a pass: the average after it needs the room)."""
        self._spare = None
