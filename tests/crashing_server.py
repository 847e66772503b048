"""``python -m simulations.simulate`` whose server dies hard (``os._exit``) right after round 2's state
is saved: what the crash-resume test runs as its interrupted federation."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations import simulate  # noqa: E402


def crash_after(rnd: int) -> None:
    if rnd == 2:
        print(f"crashing_server: exiting hard after round {rnd}", flush=True)
        os._exit(17)


if __name__ == "__main__":
    original = simulate.simulate
    simulate.simulate = lambda *a, **kw: original(*a, **kw, after_round=crash_after)
    raise SystemExit(simulate.main())
