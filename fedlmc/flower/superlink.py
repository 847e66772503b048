"""``fedlmc-superlink``: Flower's ``flower-superlink`` with a state file that holds up under large models.

``flower-superlink --database FILE`` keeps two things in one sqlite file: the run state (runs, nodes,
their registered keys, message headers, tasks) and every message's payload (Flower's object store: the
ArrayRecord's 5 MB chunks). With GPT-2-sized models that is 0.6 GB per message, written and deleted
in the same file the SuperLink's housekeeping writes to, and Flower lets a write wait 5 s for the
file's lock (its ``PRAGMA busy_timeout``) before it fails with ``database is locked``. On a busy host
a payload transaction outlasts that, the failed request answers 500 and the ServerApp dies.

This command runs the same SuperLink with two changes, and passes every other argument through::

    fedlmc-superlink [--payloads memory|database] [--busy-timeout SECONDS] [flower-superlink options]

``--payloads memory`` (the default) keeps message payloads in the SuperLink's memory, as Flower does
without ``--database``, while the run state stays in the ``--database`` file, so a restarted SuperLink
still knows its runs and registered SuperNodes. A payload that was in flight when the SuperLink died is
lost with it; ``resume=true`` continues the run from the ServerApp's own checkpoint. ``--payloads
database`` keeps Flower's layout. ``--busy-timeout`` (default 300 s) is how long a write waits for the
lock instead of 5 s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

#: How long a write to the state file waits for its lock (Flower: 5 s), in seconds.
BUSY_TIMEOUT = 300.0


def configure(payloads: str = "memory", busy_timeout: float = BUSY_TIMEOUT) -> None:
    """Set, in this process, how Flower's SuperLink opens its state (before the SuperLink starts).

    Parameters
    ----------
    payloads : str (default: "memory")
        ``"memory"``: message payloads in the SuperLink's memory, the run state in the ``--database``
        file. ``"database"``: both in the file (Flower's layout).
    busy_timeout : float (default: 300.0)
        Seconds a write to the state file waits for the lock before it fails.
    """
    if payloads not in ("memory", "database"):
        raise ValueError(f"payloads must be 'memory' or 'database', not {payloads!r}")
    if not busy_timeout > 0:
        raise ValueError(f"busy_timeout must be positive, not {busy_timeout!r}")
    import flwr.superlink.main as main
    from flwr.supercore import sql_mixin

    pragmas = dict(sql_mixin.SQLITE_PRAGMAS)
    if "busy_timeout" not in pragmas or not hasattr(main, "get_objectstore_linkstate_factories"):
        raise RuntimeError(
            "fedlmc-superlink: this Flower version opens its state differently than the 1.42 series this "
            "command configures; run flower-superlink directly"
        )
    pragmas["busy_timeout"] = str(int(busy_timeout * 1000))
    sql_mixin.SQLITE_PRAGMAS = tuple(pragmas.items())
    if payloads == "memory":
        main.get_objectstore_linkstate_factories = factories


def factories(database: str, federation_manager):
    """Flower's LinkState on ``database`` with the message payloads in an in-memory object store."""
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.config_loader import _is_non_sqlite_database_url

    if _is_non_sqlite_database_url(database):
        raise ValueError(f"fedlmc-superlink keeps payloads in memory only beside a sqlite state, not {database!r}")
    objects = ObjectStoreFactory(FLWR_IN_MEMORY_DB_NAME)
    return objects, LinkStateFactory(database, federation_manager, objects)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(
        prog="fedlmc-superlink",
        description="flower-superlink with message payloads out of its state file and a longer lock wait; "
        "every other option is flower-superlink's",
    )
    p.add_argument("--payloads", choices=["memory", "database"], default="memory")
    p.add_argument("--busy-timeout", type=float, default=BUSY_TIMEOUT, metavar="SECONDS")
    ours, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    configure(ours.payloads, ours.busy_timeout)
    from flwr.superlink.cli import flower_superlink

    sys.argv = ["flower-superlink", *rest]
    flower_superlink()


if __name__ == "__main__":
    main()
