"""A CUDA device emulated on the CPU, for the device-placement checks of ``tests/test_cuda.py`` on a
machine without a GPU.

Inside ``fake_cuda()``, ``torch.cuda.is_available()`` is true and a tensor put "on CUDA" (a factory
given ``device="cuda"``, ``.to("cuda")``, ``.cuda()``, a module moved there) computes on the CPU but
reports ``cuda:0`` as its device. Every torch call is checked as CUDA would check it: an operation that
mixes such tensors with CPU tensors (other than 0-d ones, which CUDA takes as scalars) raises, as
does ``.numpy()`` of a "CUDA" tensor. Indexing with CPU indices and ``copy_`` across devices are
allowed, as they are on CUDA. The values are the CPU's, so results are checked like the real thing's;
what a real device adds (kernels, its float32 products, its memory, autocast on CUDA) is not emulated:
under ``pytest --emulate-cuda`` the Hugging Face Llama round trip of ``tests/test_hf.py`` differs,
which it does not on a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

CUDA = torch.device("cuda", 0)
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
# calls that take tensors of both devices on CUDA: indexing with CPU indices, copies between devices
_CROSS = {
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.copy_,
    torch._has_compatible_shallow_copy_type,
}


def _accessor(func, prop, name: str) -> bool:
    """Whether ``func`` is property ``prop``'s ``name`` (``__get__``/``__set__``) of a tensor."""
    return getattr(func, "__self__", None) is prop and getattr(func, "__name__", "") == name


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.Tensor):
        return False  # a device taken from a tensor is handled by the caller
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return isinstance(device, int)  # torch takes an ordinal as a CUDA device


def _tensors(x: Any, out: list) -> list:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


class FakeCuda(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.on = WeakIdKeyDictionary()  # the tensors "on CUDA"

    def _mark(self, result: Any) -> Any:
        for t in _tensors(result, []):
            self.on[t] = True
        return result

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _accessor(func, torch.Tensor.device, "__get__"):
            return CUDA if args[0] in self.on else func(*args)
        if _accessor(func, torch.Tensor.is_cuda, "__get__"):
            return args[0] in self.on
        if func is torch.Tensor.get_device:
            return 0 if args[0] in self.on else -1
        if func is torch.Tensor.numpy and args[0] in self.on:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy it first.")
        if func in _MOVES:
            return self._move(func, args, kwargs)
        target = kwargs.get("device")
        if target is not None:
            kwargs["device"] = "cpu"
        tensors = _tensors((args, kwargs), [])
        cuda = [t for t in tensors if t in self.on]
        setting_data = _accessor(func, torch.Tensor.data, "__set__")
        if cuda and func not in _CROSS and not setting_data:
            cpu = [t for t in tensors if t not in self.on and t.dim() > 0]
            if cpu:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and "
                    f"cpu! ({getattr(func, '__qualname__', func)}, emulated)"
                )
        result = func(*args, **kwargs)
        if setting_data:  # a parameter's data replaced (a module moved): it is where its new data is
            if args[1] in self.on:
                self.on[args[0]] = True
            else:
                self.on.pop(args[0], None)
            return result
        if target is not None:
            return self._mark(result) if _is_cuda(target) else result
        if cuda and func is not torch.Tensor.__setitem__:
            # a result of a CUDA tensor is on CUDA (a plain number is not a tensor: nothing marked)
            if func is torch.Tensor.__getitem__ and args[0] not in self.on:
                raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor")
            return self._mark(result)
        return result

    def _move(self, func, args, kwargs):
        t = args[0]
        if func is torch.Tensor.cpu:
            return t.clone() if t in self.on else t
        if func is torch.Tensor.cuda:
            return self._mark(t.clone())
        # Tensor.to(device?, dtype?, ...), Tensor.to(other, ...), Tensor.to(dtype, ...): the device replaced
        # by the CPU (the data stays there), the rest of the call as it was
        rest, device = list(args[1:]), kwargs.get("device")
        if device is not None:
            kwargs["device"] = "cpu"
        if rest and isinstance(rest[0], torch.Tensor):
            other = rest[0]
            device = CUDA if other in self.on else torch.device("cpu")
            rest[0] = other.dtype
        elif rest and isinstance(rest[0], (str, torch.device, int)) and not isinstance(rest[0], bool):
            device, rest[0] = rest[0], "cpu"
        out = func(t, *rest, **kwargs)  # dtype and copy flags only: the data stays on the CPU
        if device is None:
            return self._mark(out) if t in self.on else out
        if _is_cuda(device):
            if out is t and t not in self.on:
                out = t.clone()  # a new tensor, as CUDA's copy is
            return self._mark(out)
        if t in self.on:
            out = out.clone() if out is t else out
        return out


@contextlib.contextmanager
def fake_cuda():
    """Emulate one CUDA device on the CPU (see the module's docstring)."""
    with (
        mock.patch("torch.cuda.is_available", lambda: True),
        mock.patch("torch.cuda.is_initialized", lambda: True),
        mock.patch("torch.cuda.synchronize", lambda *a, **k: None),
        mock.patch("torch.cuda.device_count", lambda: 1),
        FakeCuda(),
    ):
        yield
