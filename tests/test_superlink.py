"""fedlmc-superlink's state: the SuperLink's writes wait for a slow writer instead of failing with
``database is locked``, and message payloads stay out of the state file. A slow writer is what a
GPT-2-sized payload transaction on a busy host is; here another connection holds the file's write lock
for longer than Flower's 5 s wait."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

HOLD = 6.5  # seconds the other writer holds the lock: more than Flower's own 5 s wait


def _state(db, configured: bool):
    import flwr.superlink.main as main
    from flwr.supercore import sql_mixin

    saved = (sql_mixin.SQLITE_PRAGMAS, main.get_objectstore_linkstate_factories)
    try:
        if configured:
            from fedlmc.flower.superlink import configure

            configure(payloads="memory", busy_timeout=60)
        from flwr.superlink.config_loader import get_federation_manager

        objects, links = main.get_objectstore_linkstate_factories(str(db), get_federation_manager())
        return objects.store(), links.state()  # the engines are made (with the pragmas) here
    finally:
        sql_mixin.SQLITE_PRAGMAS, main.get_objectstore_linkstate_factories = saved


def _hold_write_lock(db, seconds: float) -> threading.Thread:
    con = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    con.execute("BEGIN IMMEDIATE")  # the write lock, as a long payload transaction holds it

    def release():
        time.sleep(seconds)
        con.execute("COMMIT")
        con.close()

    t = threading.Thread(target=release, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("configured", [True, False], ids=["fedlmc-superlink", "flower-default"])
def test_state_backend_waits_for_a_slow_writer(tmp_path, configured):
    db = tmp_path / "state.db"
    objects, state = _state(db, configured)
    holder = _hold_write_lock(str(db), HOLD)
    t0 = time.time()
    if configured:
        node = state.create_node("aid", "owner", b"key", heartbeat_interval=30)
        assert node and time.time() - t0 >= HOLD - 0.5  # it waited for the lock, then wrote
    else:  # Flower's own setting: the same write fails after 5 s (what broke GPT-2-sized rounds)
        with pytest.raises(Exception, match="database is locked"):
            state.create_node("aid", "owner", b"key", heartbeat_interval=30)
    holder.join()
    # the payloads: in memory beside the file with fedlmc-superlink, in the file with Flower's layout
    assert type(objects).__name__ == ("InMemoryObjectStore" if configured else "SqlObjectStore")


def test_superlink_options_are_checked():
    from fedlmc.flower.superlink import configure

    with pytest.raises(ValueError, match="payloads"):
        configure(payloads="disk")
    with pytest.raises(ValueError, match="busy_timeout"):
        configure(busy_timeout=0)
