"""Flower's FlowerTune template app (``examples/flowertune-template``: the template ``flwr new`` writes,
trimmed to a local tiny GPT-2 and the shipped text) beside the template's pinned versions, with fedlmc's
``LoraFedAvg`` as its strategy's base class: ``flwr run`` completes its rounds on 2 SuperNodes, every
client's reply is aggregated, and the global adapter's test loss falls. It runs where the template's
packages are installed (``make test-flowertune``, a CI step) and is skipped elsewhere."""

from __future__ import annotations

import re
import shutil

import pytest

trl = pytest.importorskip("trl", reason="the FlowerTune template's packages (make test-flowertune)")
pytest.importorskip("omegaconf", reason="the FlowerTune template's packages (make test-flowertune)")


@pytest.mark.timeout(600)
def test_the_flowertune_template_runs_with_lorafedavg_beside_its_pins():
    import peft
    import transformers
    from test_simulation import _short_tmp, _stop_local_superlink, run_example

    assert (transformers.__version__, peft.__version__, trl.__version__) == ("4.50.3", "0.6.2", "0.8.1")
    home = _short_tmp("ft-")
    try:
        out = run_example(
            "flowertune-template",
            "num-server-rounds=1",
            home,
            "num-supernodes=2 client-resources-num-cpus=1",
            cwd=home,  # the template writes its checkpoints under the working directory's results/
        )
    finally:
        _stop_local_superlink(home)
        shutil.rmtree(home, ignore_errors=True)
    losses = [float(x) for x in re.findall(r"flowertune-template round \d+: global adapter test_loss=([\d.]+)", out)]
    assert len(losses) == 2, out[-3000:]  # the initial adapter and round 1
    assert out.count("Received 2 results and 0 failures") == 1, out[-3000:]
    assert out.count("LoraFedAvg: round") == 1  # fedlmc's aggregation, round by round
    assert "Communication budget" in out  # the template's tracker saw the messages LoraFedAvg sent
    assert losses[-1] < losses[0] - 0.01, losses
