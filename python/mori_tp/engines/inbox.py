"""One transport's notifications, shared by the :class:`~mori_tp.engines.Receiver` and the
:class:`~mori_tp.engines.Streamer` of a process (REFERENCE.md section 13): the decode rank's
answers (``done``, ``cancel``) go to the streamer, everything else to the receiver. At most one
Receiver takes a transport's notifications: a second one is refused (two would split them, and
each would time out requests whose messages the other took).

Also :class:`SetAside`, the bounded store of notifications a transport's
``wait_notification`` did not match (the non-streaming flow): bounded in entries and bytes
(sender names counted), and each dropped after an expiry.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

from mori_tp import InvalidArgumentError

from .protocol import PROTOCOL, parse_head

__all__ = ["Inbox", "SetAside", "inbox_of", "name_bytes"]

#: What an Inbox keeps for a role that has not taken it yet, at most (entries, bytes).
MAX_PENDING = 4096
MAX_PENDING_BYTES = 32 << 20

_ANSWERS = (b"done", b"cancel")
_PREFIX = PROTOCOL.encode() + b" "


def name_bytes(name: Any) -> int:
    """What keeping a sender's name costs, in bytes (its text's length; 16 for None)."""
    if isinstance(name, (str, bytes)):
        return len(name)
    return 16


def _answer(raw: bytes) -> bool:
    """Whether ``raw`` is a decode rank's answer (``done``, ``cancel``): for the streamer."""
    if not raw.startswith(_PREFIX):
        return False
    head = parse_head(raw)
    return head is not None and head[3].encode() in _ANSWERS


class Inbox:
    """The notifications of one transport, split between its receiver and its streamers."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self._lock = threading.Lock()
        self._receiver: Optional["weakref.ref[Any]"] = None
        self._streamers = 0
        #: The streamers of this transport: an answer goes to the one that knows its token.
        self._streamer_refs: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._for: dict = {"receiver": deque(), "streamer": deque()}
        self._bytes = {"receiver": 0, "streamer": 0}
        #: Notifications dropped because the role they were for kept too many.
        self.dropped = 0

    def attach_receiver(self, receiver: Any) -> None:
        with self._lock:
            held = self._receiver() if self._receiver is not None else None
            if held is not None and held is not receiver:
                raise InvalidArgumentError(
                    "Receiver: this transport already has a Receiver (one per transport: two "
                    "would split its notifications, and each would time out the requests whose "
                    "messages the other took); use one Receiver for every decode rank of the "
                    "process, or close() and detach() the first")
            self._receiver = weakref.ref(receiver)

    def detach_receiver(self, receiver: Any) -> None:
        with self._lock:
            if self._receiver is not None and self._receiver() is receiver:
                self._receiver = None
                self._for["receiver"].clear()
                self._bytes["receiver"] = 0

    def attach_streamer(self, streamer: Any = None) -> None:
        with self._lock:
            self._streamers += 1
            if streamer is not None:
                self._streamer_refs.add(streamer)

    def detach_streamer(self, streamer: Any = None) -> None:
        with self._lock:
            if streamer is None or streamer in self._streamer_refs:
                self._streamers = max(0, self._streamers - 1)
            if streamer is not None:
                self._streamer_refs.discard(streamer)

    def owner(self, token: str) -> Any:
        """The streamer of this transport that knows a stream with ``token``, or None."""
        with self._lock:
            streamers = list(self._streamer_refs)
        for streamer in streamers:
            if token in streamer._known:
                return streamer
        return None

    def take(self, role: str) -> List[Tuple[Any, bytes]]:
        """Polls the transport and returns what is for ``role`` ("receiver" or "streamer"),
        oldest first; keeps the rest for the other role (bounded), or drops it when the other
        role has no taker. Raises what the transport's ``poll_notifications`` raises."""
        with self._lock:
            batch = list(self.transport.poll_notifications())
            has_receiver = self._receiver is not None and self._receiver() is not None
            for sender, raw in batch:
                target = "streamer" if self._streamers and _answer(raw) else "receiver"
                if target == "receiver" and not has_receiver and target != role:
                    self.dropped += 1
                    continue
                queue = self._for[target]
                queue.append((sender, raw))
                self._bytes[target] += len(raw) + name_bytes(sender)
                while len(queue) > MAX_PENDING or self._bytes[target] > MAX_PENDING_BYTES:
                    old_sender, old = queue.popleft()
                    self._bytes[target] -= len(old) + name_bytes(old_sender)
                    self.dropped += 1
            mine = self._for[role]
            out = list(mine)
            mine.clear()
            self._bytes[role] = 0
            return out


_inboxes_lock = threading.Lock()


def inbox_of(transport: Any) -> Inbox:
    """The transport's Inbox (made on first use, kept on the transport). A wrapper that keeps
    the transport it wraps in its ``inner`` attribute shares that transport's Inbox (one
    engine, one set of notifications), which polls the wrapped transport."""
    while isinstance(getattr(transport, "__dict__", None), dict) \
            and "inner" in transport.__dict__:
        transport = transport.__dict__["inner"]
    with _inboxes_lock:
        inbox = getattr(transport, "_mori_tp_inbox", None)
        if not isinstance(inbox, Inbox) or inbox.transport is not transport:
            inbox = Inbox(transport)
            try:
                transport._mori_tp_inbox = inbox
            except AttributeError:
                pass  # a transport without attributes: one Inbox per call site
        return inbox


class SetAside:
    """Notifications a ``wait_notification`` did not match, kept for later calls: at most
    ``max_count`` entries and ``max_bytes`` bytes (message plus sender name), each for at most
    ``expiry`` seconds; the oldest go first. ``dropped`` counts what was dropped."""

    def __init__(self, max_count: int = 1024, max_bytes: int = 16 << 20,
                 expiry: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.expiry = expiry
        self._clock = clock
        self._items: Deque[Tuple[float, Any, bytes]] = deque()
        self._bytes = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def add(self, sender: Any, message: bytes) -> None:
        size = len(message) + name_bytes(sender)
        if size > self.max_bytes:
            self.dropped += 1
            return
        self._items.append((self._clock(), sender, message))
        self._bytes += size
        self._trim()

    def _trim(self) -> None:
        limit = self._clock() - self.expiry
        while self._items and (len(self._items) > self.max_count or self._bytes > self.max_bytes
                               or self._items[0][0] < limit):
            _, sender, message = self._items.popleft()
            self._bytes -= len(message) + name_bytes(sender)
            self.dropped += 1

    def take(self, sender: Any, message: bytes) -> bool:
        """Removes one ``message`` from ``sender``; whether there was one."""
        self._trim()
        for i, (_, who, kept) in enumerate(self._items):
            if who == sender and kept == message:
                del self._items[i]
                self._bytes -= len(message) + name_bytes(sender)
                return True
        return False

    def drain(self) -> List[Tuple[Any, bytes]]:
        """Everything kept (not expired), oldest first, and forgets it."""
        self._trim()
        out = [(sender, message) for _, sender, message in self._items]
        self._items.clear()
        self._bytes = 0
        return out
