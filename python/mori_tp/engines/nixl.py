"""mori-tp requests over NVIDIA's NIXL (``nixl_agent``, UCX backend by default).

Needs: the NIXL wheel for your CUDA (``nixl-cu12``, or ``nixl``) and numpy. For host memory
``pip install --no-deps nixl-cu12 numpy`` is enough: the wheel declares torch but only uses it
for torch tensors. The agent is imported only by :meth:`NixlTransport.start` (as ``nixl._api``,
else ``nixl_cu12``); a transport can also wrap an agent the connector already has.

Who calls what:

- Both ranks: one :class:`NixlTransport` per process and :meth:`~NixlTransport.register` of
  its :class:`~mori_tp.engines.KvMemory` once.
- Prefill rank (initiator): loads the decode rank's metadata (:meth:`~NixlTransport.metadata`
  there, :meth:`~NixlTransport.add_peer` here), then :func:`mori_tp.engines.plan_request` and
  :meth:`~NixlTransport.send` with a notification message; it returns once NIXL reports the
  write done.
- Decode rank (target): needs only the prefill agent's name (:attr:`~NixlTransport.name`,
  sent over the connector's channel) to match notifications: NIXL delivers a notification from
  an agent whose metadata this agent never loaded, named as that agent named itself. Do not
  load the prefill rank's metadata here unless this rank must write to or read from it:
  metadata gives one-sided access to every byte the prefill rank registered, the KV of all its
  requests (REFERENCE.md section 18). :meth:`~NixlTransport.wait_notification` for the
  message, then :func:`mori_tp.engines.unpack_request`. NIXL sends a transfer's notification
  after every descriptor of the transfer (docs/BackendGuide.md in ai-dynamo/nixl); a
  notification sent alone (``send_notif``) has no ordering against transfers.

A crash at exit (nixl-cu12 1.5.1 with the system's rdma-core, as on Debian 12 with
``ibverbs-providers`` 44.0): the wheel bundles UCX, libibverbs and libnl under renamed file
names, but its UCX EFA module needs ``libefa.so.1``, which it does not bundle. Where the system
provides one, creating a UCX agent loads it and with it the system's ``libibverbs.so.1``,
``libnl-route-3.so.200`` and ``libnl-3.so.200`` into the same symbol scope as the wheel's copies,
which come first: the system libnl-route's constructors register its traffic-control modules
with the wheel's copy, which refuses them as duplicates, and at exit its destructors unlink the
never-linked entries and dereference NULL, so the process ends with SIGSEGV (status 139) after
everything else succeeded. :func:`preload_system_libnl` loads the system libnl first, in a scope
of its own, so that each copy keeps to itself; :meth:`NixlTransport.start` calls it before it
creates the agent. A process that creates its agent itself calls it first, or ends with
:func:`exit_process`.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

import numpy as np

from . import KvMemory, RequestPlan, SendResult, TransferError
from .faults import (
    PeerEpochs,
    PeerLostError,
    TransferTimeoutError,
    about,
    new_epoch,
    planned_epoch,
)
from .inbox import SetAside
from .streaming import DEFAULT_TIMEOUT

__all__ = ["NixlTransport", "exit_process", "preload_system_libnl"]

#: The soname of the system's libnl-route (libnl 3), which the system libibverbs links.
SYSTEM_LIBNL_ROUTE = "libnl-route-3.so.200"

#: The loaded system libnl-route (a ctypes handle, kept so it is never unloaded), once loaded.
_system_libnl: Optional[ctypes.CDLL] = None

#: How many NixlTransports this process made (programs that made one end with exit_process).
_agents = 0


def preload_system_libnl() -> Optional[str]:
    """Loads the system's ``libnl-route-3.so.200`` (and its ``libnl-3.so.200``) privately
    (``RTLD_LOCAL``), so that its symbols bind to itself; returns the file's path, or None when
    the system has no libnl-route (nothing for NIXL's copy to collide with).

    Call it before the process creates its first ``nixl_agent`` with the UCX backend:
    :meth:`NixlTransport.start` does. Later, when NIXL's UCX EFA module pulls in the system
    libibverbs, the already loaded libnl is reused as it is, and the process exits cleanly
    instead of crashing in the system libnl's destructors (see the module's documentation). It
    changes nothing else: the system libefa and libibverbs bind to the wheel's libibverbs as
    they would without it. Called after an agent exists, it cannot undo the collision; end such
    a process with :func:`exit_process`. A second call does nothing.
    """
    global _system_libnl
    if _system_libnl is None:
        try:
            # RTLD_LOCAL: loaded globally, it would capture the wheel's copy instead (the same
            # crash, from the wheel's destructors).
            _system_libnl = ctypes.CDLL(SYSTEM_LIBNL_ROUTE, mode=os.RTLD_LOCAL)
        except OSError:
            return None
    return _mapped_path(SYSTEM_LIBNL_ROUTE) or SYSTEM_LIBNL_ROUTE


def _mapped_path(soname: str) -> Optional[str]:
    """The file behind ``soname`` among this process's mappings (Linux), if it is loaded."""
    # libnl-route-3.so.200 is the file libnl-route-3.so.200.26.0; the wheel's copy is named
    # libnl-route-3-<hash>.so.200.26.0.
    stem = soname.split(".so")[0] + ".so."
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


def exit_process(status: int) -> NoReturn:
    """Ends the process with ``status`` (0-255) whatever native libraries do at exit: runs
    Python's exit handlers (``atexit``, which include logging's flush), flushes stdout and
    stderr, then calls ``os._exit(status)``, which skips the C libraries' destructors, where
    NIXL's bundled libraries can crash (see the module's documentation).

    For programs that hold a NIXL agent and own their exit status; the demo, the engine tests
    and the engine benchmark end this way once they created an agent.
    """
    if not isinstance(status, int) or not 0 <= status <= 255:
        raise ValueError(f"exit status {status!r} is not an integer in 0..255")
    # CPython's runner of the atexit handlers (the module has no public one); they run once.
    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_handlers is not None:
        run_handlers()
    else:
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def agent_created() -> bool:
    """Whether this process has made a :class:`NixlTransport` (wrapped or created an agent)."""
    return _agents > 0


def _import_agent() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError as error:
            raise ImportError(
                "the NIXL transport needs a NIXL wheel (pip install --no-deps nixl-cu12 numpy "
                f"for host memory): {error}"
            ) from error
    return nixl_agent, nixl_agent_config


class NixlTransport:
    """Writes mori-tp requests through one ``nixl_agent`` (one per process).

    Args:
        agent: a ``nixl_agent`` with a backend that handles ``mem_type`` (UCX for DRAM).
        mem_type: ``"DRAM"`` for host memory, ``"VRAM"`` for GPU memory.
        device_id: the GPU of the buffers (0 for DRAM).
        poll_interval: seconds between polls while waiting for a transfer or a notification
            (0: poll again at once, letting other Python threads run in between).
    """

    def __init__(self, agent: Any, *, mem_type: str = "DRAM", device_id: int = 0,
                 poll_interval: float = 0.0) -> None:
        global _agents
        _agents += 1
        self.agent = agent
        self.mem_type = mem_type
        self.device_id = device_id
        self.poll_interval = poll_interval
        self._registered: List[Any] = []
        #: This process's registration epoch: stamped on what register() returns, drawn anew
        #: after unregister().
        self.epoch = new_epoch()
        #: The epoch each peer announced at its latest handshake (set_peer_epoch).
        self.peer_epochs = PeerEpochs()
        #: Held while notifications are taken (poll_notifications, wait_notification): from
        #: several threads, each notification goes to exactly one caller.
        self._notify_lock = threading.Lock()
        #: Held around every agent call of a transfer or a notification: a process's Streamer
        #: takes the decode ranks' answers (update_notifs) while its writing thread posts and
        #: polls transfers, and a Receiver answers (send_notif) while its thread polls; one
        #: agent call at a time (an engine_load soak crashed in UCX without it).
        self._agent_lock = threading.RLock()
        #: Notifications wait_notification did not match (taken out of the agent's own
        #: dictionary, which keeps everything): bounded in entries and bytes (names counted),
        #: each for at most a minute.
        self._set_aside = SetAside()

    @classmethod
    def start(cls, name: str, *, backends: Sequence[str] = ("UCX",), mem_type: str = "DRAM",
              device_id: int = 0,
              progress_thread: Optional[bool] = None) -> "NixlTransport":
        """Creates a ``nixl_agent(name)`` with ``backends`` (names must be unique among the
        agents that talk to each other). Loads the system libnl first
        (:func:`preload_system_libnl`), so that the process exits cleanly.

        ``progress_thread``: NIXL's own progress thread (``enable_prog_thread``; None: NIXL's
        default, on). It polls continuously; without it the agent makes progress when this
        transport polls (writes, notifications), which leaves the cores to the copies."""
        nixl_agent, nixl_agent_config = _import_agent()
        preload_system_libnl()
        options: Dict[str, Any] = {"backends": list(backends)}
        if progress_thread is not None:
            options["enable_prog_thread"] = progress_thread
        agent = nixl_agent(name, nixl_agent_config(**options))
        return cls(agent, mem_type=mem_type, device_id=device_id)

    @property
    def name(self) -> str:
        """This agent's name: what notifications from it are attributed to on the peer (the
        decode rank binds a request to it, ``Receiver.expect(peer=)``). Agents choose their
        own names: NIXL does not authenticate them."""
        return _text(self.agent.name)

    def metadata(self) -> bytes:
        """This agent's metadata, for the peer's :meth:`add_peer` (send it after
        :meth:`register`, so that it describes the registered memory)."""
        return self.agent.get_agent_metadata()

    def answer_metadata(self) -> bytes:
        """This agent's connection info without any memory (NIXL's partial metadata with no
        descriptors): what a decode rank loads to answer this agent's streams (``done``,
        ``cancel``: REFERENCE.md section 13). An agent that loads it can send this one
        notifications but can neither read nor write its memory (NIXL refuses a transfer to
        memory the loaded metadata does not describe: NIXL_ERR_NOT_FOUND, measured here)."""
        partial = getattr(self.agent, "get_partial_agent_metadata", None)
        module = sys.modules.get(type(self.agent).__module__)
        bind = getattr(module, "nixlBind", None)
        if partial is None or bind is None:
            return self.metadata()  # an agent without partial metadata (a stand-in)
        return partial(bind.nixlRegDList(bind.DRAM_SEG), True, list(self.agent.backends))

    def add_peer(self, metadata: bytes) -> str:
        """Loads a peer's metadata; returns the peer's name, which :meth:`send` and
        :meth:`wait_notification` take."""
        return _text(self.agent.add_remote_agent(metadata))

    def register(self, memory: KvMemory) -> KvMemory:
        """Registers every buffer and the staging region of ``memory`` with the agent; returns
        ``memory`` stamped with this transport's registration epoch (send that one to peers)."""
        regions = [(address, length, self.device_id, "") for address, length in memory.regions()]
        if regions:
            self._registered.append(self.agent.register_memory(regions, self.mem_type))
        return replace(memory, epoch=self.epoch)

    def unregister(self) -> None:
        """Deregisters everything :meth:`register` registered (before the memory is freed), and
        draws a new epoch: plans against the old registration are refused once peers learn it."""
        while self._registered:
            self.agent.deregister_memory(self._registered.pop())
        self.epoch = new_epoch()

    def set_peer_epoch(self, peer: str, epoch: int) -> None:
        """Records the registration epoch ``peer`` announced at its handshake (its
        :class:`~mori_tp.engines.KvMemory`'s ``epoch``); from then on a plan for any other
        epoch is refused before it reaches the agent."""
        self.peer_epochs.set(peer, epoch)

    def _descs(self, addresses: "np.ndarray", lengths: "np.ndarray") -> Any:
        table = np.empty((len(lengths), 3), dtype=np.uint64)
        table[:, 0] = addresses
        table[:, 1] = lengths
        table[:, 2] = self.device_id
        return self.agent.get_xfer_descs(table, self.mem_type)

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              *, notification: bytes = b"", timeout: float = DEFAULT_TIMEOUT,
              epoch: Optional[int] = None, request_id: Optional[str] = None) -> int:
        """Writes ``lengths[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]`` as one
        NIXL transfer, and waits until NIXL reports it done; ``notification`` reaches the peer
        after the data. Returns the number of transfers posted (1, or 0 for an empty list).

        ``epoch``: the registration epoch the addresses were planned against (a plan's
        ``remote.epoch``), checked against the peer's (:meth:`set_peer_epoch`) before anything
        moves. ``timeout``: seconds until a transfer still in progress is cancelled.
        ``request_id`` names the request in errors.

        Raises:
            StaleRegistrationError: ``epoch`` is not the peer's; nothing was written.
            PeerLostError: NIXL reports the peer disconnected.
            TransferTimeoutError: still in progress after ``timeout`` (then cancelled; when
                NIXL cannot cancel it, ``engine_busy`` is set: the source may still be read).
            TransferError: NIXL refused the transfer or ended it in another state than DONE.
        """
        lengths = np.asarray(lengths, dtype=np.uint64)
        if not len(src) == len(dst) == len(lengths):
            raise ValueError(f"{len(src)} sources, {len(dst)} destinations, {len(lengths)} lengths")
        self.peer_epochs.check("nixl", peer, epoch, request_id)
        what = f"nixl: a write of {len(lengths)} segments {about(peer, request_id)}"
        if not len(lengths):
            # Nothing to move (a pair that is not SEND): the peer still gets its notification.
            if notification:
                self._call(what, self.agent.send_notif, peer, notification,
                           peer=peer, request_id=request_id)
            return 0
        local = self._descs(np.asarray(src, dtype=np.uint64), lengths)
        remote = self._descs(np.asarray(dst, dtype=np.uint64), lengths)
        handle = self._call(what, self.agent.initialize_xfer, "WRITE", local, remote, peer,
                            notification, peer=peer, request_id=request_id)
        failure: Optional[TransferError] = None
        try:
            state = self._call(what, self.agent.transfer, handle, peer=peer,
                               request_id=request_id)
            deadline = time.monotonic() + timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    failure = TransferTimeoutError(
                        f"{what} was still in progress after {timeout} s",
                        peer=peer, request_id=request_id)
                    raise failure
                # sleep(0) still releases the GIL: a thread packing the next chunk, or any
                # other Python thread, is not held up for the interpreter's switch interval.
                time.sleep(self.poll_interval)
                state = self._call(what, self.agent.check_xfer_state, handle, peer=peer,
                                   request_id=request_id)
            if state != "DONE":
                failure = TransferError(f"{what} ended in state {state}", peer=peer,
                                        request_id=request_id)
                raise failure
        except TransferError as error:
            failure = error
            raise
        finally:
            try:
                # Cancels a transfer still in progress (after a timeout or an error).
                with self._agent_lock:
                    self.agent.release_xfer_handle(handle)
            except Exception as error:  # noqa: BLE001 - NIXL's own exception types
                if failure is None:
                    raise _wrapped(what, error, peer, request_id) from error
                # It could not be cancelled: the engine may still read the source.
                failure.engine_busy = True
                failure.args = (f"{failure.args[0]}; and it could not be cancelled "
                                f"({type(error).__name__}: {error}): the source may still be "
                                "read",)
        return 1

    def _call(self, what: str, function: Any, *args: Any, peer: Any,
              request_id: Optional[str]) -> Any:
        """``function(*args)``, with NIXL's exceptions as TransferError (PeerLostError for a
        disconnected peer)."""
        try:
            with self._agent_lock:
                return function(*args)
        except Exception as error:  # noqa: BLE001 - NIXL's own exception types
            if type(error).__module__.split(".")[0] not in ("nixl", "nixl_cu12", "nixl_cu13") \
                    and not type(error).__name__.startswith("nixl"):
                raise
            raise _wrapped(what, error, peer, request_id) from error

    def send(self, peer: str, plan: RequestPlan, *, notification: bytes = b"",
             timeout: float = DEFAULT_TIMEOUT, backend: str = "auto",
             stream: Optional[int] = None, request_id: Optional[str] = None) -> SendResult:
        """Moves one request: packs the local staging region if the plan's staging is SRC or
        BOTH, then writes every segment of every buffer to ``peer`` as one NIXL transfer, with
        ``notification`` delivered to the peer after the data. A plan against another
        registration epoch than the peer's is refused
        (:class:`~mori_tp.engines.StaleRegistrationError`) before anything is packed; see
        :meth:`write` for ``timeout`` and the errors."""
        self.peer_epochs.check("nixl", peer, planned_epoch(plan), request_id)
        pack_seconds = plan.pack(backend=backend, stream=stream)
        src, dst, lengths = plan.addresses()
        start = time.perf_counter()
        calls = self.write(peer, src, dst, lengths, notification=notification, timeout=timeout,
                           epoch=planned_epoch(plan), request_id=request_id)
        return SendResult(plan.staging, plan.segments, plan.bytes, calls, pack_seconds,
                          time.perf_counter() - start)

    def notify(self, peer: str, message: bytes, *, carrier: Any = None,
               timeout: float = DEFAULT_TIMEOUT, epoch: Optional[int] = None,
               request_id: Optional[str] = None) -> None:
        """Sends ``message`` to ``peer`` without data (``send_notif``, which does not wait);
        ``carrier`` and ``timeout`` are for engines that write to notify (Mooncake) and are
        ignored here; ``epoch`` is checked as by :meth:`write`."""
        self.peer_epochs.check("nixl", peer, epoch, request_id)
        self._call(f"nixl: a notification {about(peer, request_id)}", self.agent.send_notif,
                   peer, message, peer=peer, request_id=request_id)

    def poll_notifications(self) -> List[Tuple[str, bytes]]:
        """Every notification received and not yet taken, as ``(peer name, message)``, oldest
        first per peer. Thread-safe with :meth:`wait_notification`: each notification goes to
        exactly one of them (so a message this takes is not there for a later
        ``wait_notification``)."""
        with self._notify_lock:
            return self._set_aside.drain() + self._take_new()

    def _take_new(self) -> List[Tuple[str, bytes]]:
        """What the agent received since the last call, taken out of its dictionary."""
        out = []
        with self._agent_lock:
            notifs: Dict[Any, List[bytes]] = self.agent.update_notifs()
            for peer, messages in notifs.items():
                taken = list(messages)
                del messages[:len(taken)]
                out.extend((_text(peer), bytes(m)) for m in taken)
        return out

    def wait_notification(self, peer: str, message: bytes, *,
                          timeout: float = DEFAULT_TIMEOUT) -> None:
        """Waits until ``peer`` has sent exactly ``message`` (a :meth:`send` notification) and
        consumes it. Raises :class:`~mori_tp.engines.TransferTimeoutError` after ``timeout``
        seconds."""
        deadline = time.monotonic() + timeout
        while not self._take_notification(peer, message):
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"nixl: no notification {message!r} from {peer} within {timeout} s",
                    peer=peer,
                )
            time.sleep(self.poll_interval or 0.0005)

    def _take_notification(self, peer: str, message: bytes) -> bool:
        # Exact match: check_remote_xfer_done matches prefixes, so b"req-1" would take b"req-10".
        with self._notify_lock:
            for sender, received in self._take_new():
                self._set_aside.add(sender, received)
            return self._set_aside.take(_text(peer), message)


def _wrapped(what: str, error: BaseException, peer: Any,
             request_id: Optional[str]) -> TransferError:
    """A NIXL exception as a TransferError naming the write."""
    kind = PeerLostError if "Disconnect" in type(error).__name__ else TransferError
    return kind(f"{what} failed: {type(error).__name__}: {error}", peer=peer,
                request_id=request_id)


def _text(name: Any) -> str:
    """A NIXL agent name as text; a name that is not UTF-8 (agents choose their own) keeps its
    bytes as escapes rather than raising."""
    return name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else str(name)
