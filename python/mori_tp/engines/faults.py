"""What goes wrong between a prefill process and a decode process, and how
:mod:`mori_tp.engines` names it: the errors a failed transfer raises, and registration epochs,
by which a transport refuses a plan made against memory its peer no longer has.

Errors (all :class:`TransferError`, a ``RuntimeError``; each names the engine call, the peer
and, where the caller said, the request):

- :class:`TransferTimeoutError`: a bounded wait ran out (a write, a notification, a request
  that made no progress, room in a peer's queue).
- :class:`PeerLostError`: the engine reports the peer gone (NIXL: disconnected; its process
  died or closed its agent).
- :class:`StaleRegistrationError`: a plan was made against a registration of the peer's memory
  that the peer has since replaced (it restarted, or unregistered and registered again).
  Nothing was written.

A failure while bytes move leaves the destination as it was for every segment not reported
written, and possibly partly written for the rest: the decode rank unpacks only chunks whose
notification arrived (the engine delivers a notification after its data), so staged data
(DST, BOTH) that did not finish landing is never unpacked; unstaged data (NONE, SRC) lands in
place, in the buffers the error's request names. ``engine_busy`` on an error says that the
engine may still read the source memory (it could not cancel the transfer): do not reuse that
staging slot.

Registration epochs. A peer's memory is identified by the pair (peer, epoch): the epoch is a
random 63-bit number (:func:`new_epoch`) that a transport draws when it is created and again
whenever it unregisters memory, and stamps on every :class:`~mori_tp.engines.KvMemory` that
:meth:`register` returns. The decode rank sends its stamped memory (``to_dict()`` carries the
epoch) with its engine address at handshake; the prefill rank records it with
``transport.set_peer_epoch(peer, memory.epoch)`` and plans against that memory, so every plan
carries the epoch it was made for (``plan.remote.epoch``). Before every engine call the
transport compares the two: a plan for another epoch than the peer's latest handshake is
refused with :class:`StaleRegistrationError`, before any byte moves. A peer with no recorded
epoch is not checked (``set_peer_epoch`` turns the check on). The guarantee needs the new
handshake: a peer that restarts under the same engine address and is written to before it has
handshaken again cannot be told apart by the prefill rank (Mooncake's TCP transport at least
refuses writes outside the target's registered buffers).
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any, Dict, Optional

__all__ = [
    "PeerEpochs",
    "PeerLostError",
    "StaleRegistrationError",
    "TransferError",
    "TransferTimeoutError",
    "new_epoch",
    "planned_epoch",
]


class TransferError(RuntimeError):
    """A transfer engine refused or failed a call, or a bounded wait ran out. The message names
    the engine call, its return value or state, the peer and the segment counts; bytes may have
    landed partially (see the module docs).

    Attributes:
        peer: the peer the call was for (a Mooncake session id, a NIXL agent name), or None.
        request_id: the request, when the caller named it (streams always do), or None.
        engine_busy: True when the engine may still read the source memory: the transfer could
            not be cancelled, so its staging slot must not be reused.
    """

    def __init__(self, message: str, *, peer: Any = None, request_id: Optional[str] = None,
                 engine_busy: bool = False) -> None:
        super().__init__(message)
        self.peer = peer
        self.request_id = request_id
        self.engine_busy = engine_busy


class TransferTimeoutError(TransferError):
    """A bounded wait ran out: the message names what was awaited, for how long, and what was
    missing."""


class PeerLostError(TransferError):
    """The engine reports the peer gone (disconnected; its process died). Requests to it fail
    until it comes back and handshakes again."""


class StaleRegistrationError(TransferError):
    """A plan made against an earlier registration of the peer's memory (its epoch differs from
    the one the peer announced at its latest handshake). Raised before the engine is called:
    nothing was written.

    Attributes:
        planned: the epoch the plan was made for.
        current: the epoch the peer announced last.
    """

    def __init__(self, message: str, *, planned: int, current: int, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.planned = planned
        self.current = current


def new_epoch() -> int:
    """A fresh registration epoch: 63 random bits, never 0 (0 means "no epoch")."""
    return secrets.randbits(63) | 1


def planned_epoch(plan: Any) -> Optional[int]:
    """The registration epoch ``plan`` was made for: a RequestPlan's ``remote.epoch``, a
    GroupsPlan's ``remote_epoch`` (None there unless given: not checked)."""
    remote = getattr(plan, "remote", None)
    if remote is not None:
        return remote.epoch
    return getattr(plan, "remote_epoch", None)


def about(peer: Any, request_id: Optional[str]) -> str:
    """``"to <peer>"`` and, when known, ``" (request <id>)"``: how errors name their target."""
    return f"to {peer}" + (f" (request {request_id})" if request_id else "")


class PeerEpochs:
    """The registration epoch each peer announced at its latest handshake (thread-safe); a
    transport holds one and checks every plan against it before the engine moves a byte."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epochs: Dict[Any, int] = {}

    def set(self, peer: Any, epoch: int) -> None:
        """Records ``peer``'s epoch from a handshake (replacing an earlier one)."""
        if not isinstance(epoch, int) or not 0 < epoch < (1 << 64):
            raise ValueError(f"epoch {epoch!r} of peer {peer!r} is not a nonzero uint64")
        with self._lock:
            self._epochs[peer] = epoch

    def get(self, peer: Any) -> Optional[int]:
        with self._lock:
            return self._epochs.get(peer)

    def forget(self, peer: Any) -> None:
        with self._lock:
            self._epochs.pop(peer, None)

    def check(self, engine: str, peer: Any, planned: Optional[int],
              request_id: Optional[str] = None) -> None:
        """Raises :class:`StaleRegistrationError` when ``peer`` announced an epoch and
        ``planned`` (the plan's ``remote.epoch``; None: the caller has no plan, so nothing to
        check) differs from it."""
        if planned is None:
            return
        current = self.get(peer)
        if current is None or current == planned:
            return
        raise StaleRegistrationError(
            f"{engine}: a write {about(peer, request_id)} was planned against registration "
            f"epoch {planned:#x} of the peer's memory, but the peer's latest handshake announced "
            f"epoch {current:#x} (it restarted or registered new memory): plan the request "
            "again against the memory it sent; nothing was written",
            planned=planned, current=current, peer=peer, request_id=request_id,
        )


class SegmentBudget:
    """Room for segments in the engine's per-peer queue: a call takes ``count`` before it
    reaches the engine and gives them back when it returns, so that calls from any number of
    threads never hold more than ``capacity`` segments at once for one peer."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: Dict[Any, int] = {}
        self._changed = threading.Condition()

    def acquire(self, peer: Any, count: int, timeout: Optional[float]) -> bool:
        """Waits until ``count`` more segments fit for ``peer`` and takes them; False, taking
        nothing, after ``timeout`` seconds (None: no limit of its own)."""
        if count > self.capacity:
            raise ValueError(f"{count} segments can never fit a queue of {self.capacity}")
        with self._changed:
            if not self._changed.wait_for(
                    lambda: self._held.get(peer, 0) + count <= self.capacity, timeout):
                return False
            self._held[peer] = self._held.get(peer, 0) + count
            return True

    def release(self, peer: Any, count: int) -> None:
        with self._changed:
            left = self._held.get(peer, 0) - count
            if left > 0:
                self._held[peer] = left
            else:
                self._held.pop(peer, None)
            self._changed.notify_all()

    def held(self, peer: Any) -> int:
        with self._changed:
            return self._held.get(peer, 0)


def env_int(name: str, default: int, environ: Optional[Dict[str, str]] = None) -> int:
    """``int(os.environ[name])`` when it is a positive integer, else ``default`` (as the engines
    read their own settings)."""
    value = (os.environ if environ is None else environ).get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default
