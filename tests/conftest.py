"""Shared fixtures; measured numerical errors are collected and printed at the end of the run."""

from __future__ import annotations

import os
import random
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest
import torch

MEASURED: list[tuple[str, float, float]] = []

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
# The library looks for data in --data-dir, $FEDLMC_DATA, then what ships with it; the tests (and the
# processes they start) find the lab's data beside the checkout through FEDLMC_DATA, as CI does.
_SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
if not os.environ.get("FEDLMC_DATA") and _SHARED_DATA.is_dir():
    os.environ["FEDLMC_DATA"] = str(_SHARED_DATA)


def _unused_ports(n: int, slot: int, low: int = 20000, high: int = 32768) -> list[int]:
    """``n`` distinct ports that nothing on this machine listens on now, drawn below Linux's ephemeral
    range (where outgoing connections take theirs), all ≡ ``slot`` (mod 16)."""
    rng, ports = random.Random(), []
    while len(ports) < n:
        port = rng.randrange(low, high) // 16 * 16 + slot % 16
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


# `flwr run` starts its local SuperLink on fixed ports (Flower's 39091 and 39093) and runs on any
# SuperLink already answering there. Each pytest process takes two unused ports instead, pytest-xdist's
# worker gw<i> (`make test` runs two) from ports ≡ i (mod 16): two workers never draw the same port, and
# two checkouts testing at once only if they draw the same one of about 800.
_http, _control = _unused_ports(2, slot=int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0))
os.environ["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(_http)
os.environ["FLWR_LOCAL_CONTROL_API_PORT"] = str(_control)
# One torch thread: on a 2-core machine that is busy with anything else, two OpenMP threads spin-wait
# for each other and the fast suite goes from ~20 s to over 10 minutes (measured; see the CI note in
# README "Development"). FEDLMC_TEST_THREADS overrides it.
torch.set_num_threads(int(os.environ.get("FEDLMC_TEST_THREADS", "1")))

# Every process a test starts inherits this marker; after each test none of the deployment's runtime
# processes (Flower's SuperLink, SuperNodes, SuperExecs, ServerApps, ClientApps, ``flwr``) or Ray's
# daemons that carry it may be left (``leftovers`` below).
SESSION_MARK = f"FEDLMC_TEST_SESSION={uuid.uuid4().hex}"
os.environ["FEDLMC_TEST_SESSION"] = SESSION_MARK.split("=", 1)[1]
RUNTIME = (
    b"flower-superlink",
    b"fedlmc-superlink",
    b"flower-supernode",
    b"flower-superexec",
    b"flwr-serverapp",
    b"flwr-clientapp",
    b"bin/flwr",
    b"raylet",
    b"gcs_server",
)


def leftovers() -> dict[int, str]:
    """This test session's Flower and Ray runtime processes still running: {pid: command line}."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if not any(name in cmdline for name in RUNTIME):
                continue
            if SESSION_MARK.encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().split(") ")[1][0] == "Z":
                continue
        except OSError:
            continue
        found[int(proc.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
    return found


def pytest_addoption(parser):
    parser.addoption(
        "--emulate-cuda",
        action="store_true",
        help="run every test on a CUDA device emulated on the CPU (tests/fake_cuda.py): device-placement bugs",
    )


@pytest.fixture(autouse=True)
def emulated_cuda(request):
    """With ``--emulate-cuda`` (and no real GPU), every test runs as if a GPU were present."""
    if not request.config.getoption("--emulate-cuda") or torch.cuda.is_available():
        yield
        return
    from fake_cuda import fake_cuda

    with fake_cuda():
        yield


@pytest.fixture(autouse=True)
def no_process_left():
    """Fail a test that leaves a runtime process behind (after a grace period for processes on their way
    out), and kill what it left so the next test starts clean."""
    yield
    end = time.time() + 20
    left = leftovers()
    while left and time.time() < end:
        time.sleep(0.5)
        left = leftovers()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left running after the test: {left}"


@pytest.fixture
def record():
    """``record(name, error, bound)``: assert error <= bound and keep it for the end-of-run table."""

    def _record(name: str, error: float, bound: float) -> float:
        MEASURED.append((name, float(error), bound))
        assert error <= bound, f"{name}: measured {error:.3e} > {bound:.0e}"
        return error

    return _record


def pytest_terminal_summary(terminalreporter):
    if not MEASURED:
        return
    terminalreporter.section("measured errors (max |Δ|)")
    for name, err, bound in MEASURED:
        terminalreporter.write_line(f"{name:<60s} {err:10.3e}  (bound {bound:.0e})")


def perturbed(model: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> torch.nn.Module:
    """Float64 model with every parameter (LN gains and biases included) moved off its init."""
    g = torch.Generator().manual_seed(seed)
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model


def inputs_for(model: torch.nn.Module, seed: int = 0, batch: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if hasattr(cfg, "vocab_size"):  # a language model (gpt2, llama)
        return torch.randint(0, cfg.vocab_size, (batch, min(cfg.block_size, 16)), generator=g)
    return torch.randn(batch, cfg.channels, cfg.image_size, cfg.image_size, generator=g, dtype=torch.float64)


def metadata(
    src: int, dst: int = 0, message_type: str = "train", message_id: str = "", ttl: float = 3600.0, reply_to: str = "i"
):
    """Flower message metadata for a crafted reply (from node ``src``, answering ``reply_to``) or query
    (to node ``dst``)."""
    import time

    from flwr.app import Metadata

    return Metadata(
        run_id=1,
        message_id=message_id or f"m{src}",
        src_node_id=src,
        dst_node_id=dst,
        reply_to_message_id=reply_to,
        group_id="1",
        created_at=time.time(),
        ttl=ttl,
        message_type=message_type,
    )
