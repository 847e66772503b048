"""A Flower grid that hears each reply as it arrives (``ArrivalGrid``): the strategies write train replies
to disk as they come, and the clients' refinement hears its answers soon after they are sent."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Optional

from flwr.app import Message


class ArrivalGrid:
    """A Flower grid whose ``send_and_receive`` hands every reply to ``on_reply`` as soon as it arrives
    and returns what ``on_reply`` made of it (None: the reply itself); everything else is the wrapped
    grid's. Replies are pulled one message at a time (``one_at_a_time``; else all that have come at
    once); when none had come it looks again ``poll`` seconds later, each wait 1.5 times the last up
    to ``poll_max`` (None: ``poll`` throughout). ``FedlmcStrategy`` uses it to write train replies to
    disk as they come; ``on_clients.exchange`` to hear the clients soon after they answer."""

    def __init__(
        self,
        grid,
        on_reply=None,
        poll: float = 1.0,
        poll_max: Optional[float] = None,
        one_at_a_time: bool = True,
    ) -> None:
        self._grid, self._on_reply, self._one = grid, on_reply or (lambda msg: msg), one_at_a_time
        self._poll, self._poll_max = poll, poll if poll_max is None else poll_max

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> list[Message]:
        pending = set(self._grid.push_messages(messages))
        del messages
        end = None if timeout is None else time.monotonic() + timeout
        out: list[Message] = []
        wait = self._poll
        while pending:
            got = False
            for ids in [[mid] for mid in sorted(pending)] if self._one else [sorted(pending)]:
                for msg in self._grid.pull_messages(ids):
                    pending.discard(msg.metadata.reply_to_message_id)
                    out.append(self._on_reply(msg))
                    got = True
            left = None if end is None else end - time.monotonic()
            if not pending or (left is not None and left <= 0):
                break
            if not got:
                time.sleep(wait if left is None else min(wait, left))
                wait = min(self._poll_max, wait * 1.5)
        return out
