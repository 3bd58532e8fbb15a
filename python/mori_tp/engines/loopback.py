"""Two processes on 127.0.0.1, a prefill rank (this process, the initiator) and a decode rank
(a child process, the target), joined by a transfer engine: what ``python -m mori_tp.demo``,
the engine tests and the engine benchmark run on.

The child holds the decode ranks' host buffers, filled with :func:`sentinel` bytes, and a staging
pool, all registered with its own engine. It does what a decode rank's connector does: waits
for each request's completion (a NIXL notification; Mooncake's write is synchronous), unpacks
staged requests, and reports digests of its buffers so that the parent can check every byte.

Everything is bounded in time: every wait on the child has a timeout, the child exits when its
parent goes quiet or dies (Linux: ``PR_SET_PDEATHSIG``), and :meth:`DecodePeer.close` kills it
if it does not stop by itself.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, Union

import numpy as np

import mori_tp

from . import KvMemory, RequestPlan, SendResult, unpack_groups, unpack_request

#: The engines this harness drives (their adapters are mori_tp.engines.mooncake, .nixl and
#: .mori_io).
ENGINES = ("mooncake", "nixl", "mori_io")


def sentinel(rank: int, buffer: int, nbytes: int) -> "np.ndarray":
    """Bytes a decode buffer starts with: they depend on rank, buffer and position; the prime
    period (251) never lines up with heads, tokens or pages."""
    period = (np.arange(251, dtype=np.uint32) * 31 + 0xA5 + rank * 7 + buffer * 13) % 256
    return np.resize(period.astype(np.uint8), nbytes)


def digest(data: Any) -> str:
    return hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()


def pages_of(buffers: Sequence["np.ndarray"], item_len: int, pages: Sequence[int]) -> "np.ndarray":
    """Pages ``pages`` of ``item_len`` bytes of each buffer, buffer by buffer, as one array:
    what a request wrote, for a digest."""
    index = np.asarray(pages, dtype=np.intp)
    return np.concatenate([b[:len(b) // item_len * item_len].reshape(-1, item_len)[index].ravel()
                           for b in buffers])


class Driver:
    """One engine as the harness uses it: start a transport, exchange addresses, write, send,
    and wait for completion on the receiving side.

    Args:
        hostname: the address this process's engine listens on (127.0.0.1, or an address in a
            network namespace).
        engine_timeout: seconds the engine itself gives a write (Mooncake's ``engine_timeout``;
            NIXL has none, its writes are bounded by their ``timeout``).
    """

    name = ""

    def __init__(self, hostname: str = "127.0.0.1", engine_timeout: float = 30.0) -> None:
        self.hostname = hostname
        self.engine_timeout = engine_timeout

    def start(self, role: str, polled: bool = False) -> Any:
        """A transport for ``role``. ``polled``: this process polls its transport all the time
        (a Receiver thread, or a writer), so the engine needs no thread of its own for
        progress."""
        raise NotImplementedError

    def address(self, transport: Any) -> Any:
        """What the peer needs to reach this transport (after registration)."""
        raise NotImplementedError

    def sender(self, transport: Any) -> str:
        """What this transport's notifications are attributed to on the peer (NIXL: the agent
        name). A receiving peer answers it (``done``, ``cancel``: REFERENCE.md section 13),
        for which a NIXL peer also loads its metadata (:func:`answer_address`)."""
        raise NotImplementedError

    def connect(self, transport: Any, address: Any, epoch: int = 0) -> Any:
        """The peer handle :meth:`send` takes, from the peer's :meth:`address`; with the peer's
        registration ``epoch`` (its memories' ``epoch``), plans against any other are refused."""
        peer = self._connect(transport, address)
        if epoch:
            transport.set_peer_epoch(peer, epoch)
        return peer

    def _connect(self, transport: Any, address: Any) -> Any:
        raise NotImplementedError

    def write(self, transport: Any, peer: Any, src: Any, dst: Any, lengths: Any, tag: bytes,
              timeout: float) -> int:
        raise NotImplementedError

    def send(self, transport: Any, peer: Any, plan: RequestPlan, tag: bytes,
             timeout: float) -> SendResult:
        raise NotImplementedError

    def wait(self, transport: Any, peer: Any, tag: bytes, timeout: float) -> None:
        """Receiver: returns once the write tagged ``tag`` has landed."""


class MooncakeDriver(Driver):
    name = "mooncake"

    def start(self, role: str, polled: bool = False) -> Any:
        from .mooncake import MooncakeTransport

        return MooncakeTransport.start(self.hostname, engine_timeout=self.engine_timeout)

    def address(self, transport: Any) -> Any:
        return transport.session_id

    def sender(self, transport: Any) -> str:
        return transport.session_id

    def _connect(self, transport: Any, address: Any) -> Any:
        return address

    def write(self, transport, peer, src, dst, lengths, tag, timeout):
        return transport.write(peer, src, dst, lengths)

    def send(self, transport, peer, plan, tag, timeout):
        return transport.send(peer, plan)

    def wait(self, transport, peer, tag, timeout):
        # batch_transfer_sync_write returned before the parent said "receive": nothing to wait.
        return None


class NixlDriver(Driver):
    name = "nixl"

    def start(self, role: str, polled: bool = False) -> Any:
        from .nixl import NixlTransport

        # NIXL's progress thread polls without pause (about a third of a core here); a process
        # that polls anyway does without it.
        transport = NixlTransport.start(f"mori-tp-{role}-{os.getpid()}",
                                        progress_thread=False if polled else None)
        _STARTED[transport.name] = transport
        return transport

    def address(self, transport: Any) -> Any:
        return transport.metadata()

    def sender(self, transport: Any) -> str:
        return transport.name

    def _connect(self, transport: Any, address: Any) -> Any:
        return transport.add_peer(address)

    def write(self, transport, peer, src, dst, lengths, tag, timeout):
        return transport.write(peer, src, dst, lengths, notification=tag, timeout=timeout)

    def send(self, transport, peer, plan, tag, timeout):
        return transport.send(peer, plan, notification=tag, timeout=timeout)

    def wait(self, transport, peer, tag, timeout):
        transport.wait_notification(peer, tag, timeout=timeout)


class MoriIoDriver(Driver):
    """MORI-IO with its TCP backend. Completion goes over the transport's side channel
    (``completion="side-channel"``, as SGLang's and vLLM's connectors do), or with
    ``MORI_TP_MORI_IO_COMPLETION=inbound`` also through MORI-IO's inbound transfer status."""

    name = "mori_io"

    def start(self, role: str, polled: bool = False) -> Any:
        from .mori_io import MoriIoTransport

        completion = os.environ.get("MORI_TP_MORI_IO_COMPLETION", "side-channel")
        transport = MoriIoTransport.start(f"mori-tp-{role}-{os.getpid()}", self.hostname,
                                          completion=completion)
        _STARTED[transport.key] = transport
        return transport

    def address(self, transport: Any) -> Any:
        return transport.address()

    def sender(self, transport: Any) -> str:
        return transport.key

    def _connect(self, transport: Any, address: Any) -> Any:
        return transport.add_peer(address)

    def write(self, transport, peer, src, dst, lengths, tag, timeout):
        return transport.write(peer, src, dst, lengths, notification=tag, timeout=timeout)

    def send(self, transport, peer, plan, tag, timeout):
        return transport.send(peer, plan, notification=tag, timeout=timeout)

    def wait(self, transport, peer, tag, timeout):
        transport.wait_notification(peer, tag, timeout=timeout)


#: NIXL and MORI-IO transports this process started, by sender name: a decode child that
#: answers one of them (done, cancel) loads its answer-only address (answer_address).
_STARTED: Dict[str, Any] = {}


def answer_address(sender: str) -> Any:
    """What a decode peer needs to answer ``sender``, a transport of this process: a NIXL
    agent's connection info without memory (``NixlTransport.answer_metadata``: NIXL sends a
    notification only to an agent it loaded metadata of, and this gives the decode peer no
    access to the prefill's memory), None for Mooncake (the answer reads the carrier each
    chunk names)."""
    transport = _STARTED.get(sender)
    if transport is None:
        return None
    if hasattr(transport, "answer_metadata"):  # NIXL
        return transport.answer_metadata()
    return transport.answer_address()  # MORI-IO: its side channel, no memory


def driver(engine: str, hostname: str = "127.0.0.1", engine_timeout: float = 30.0) -> Driver:
    """The :class:`Driver` of ``engine`` (one of :data:`ENGINES`)."""
    drivers = {"mooncake": MooncakeDriver, "nixl": NixlDriver, "mori_io": MoriIoDriver}
    if engine not in drivers:
        raise ValueError(f"unknown engine {engine!r}: one of {', '.join(drivers)}")
    return drivers[engine](hostname, engine_timeout)


def engine_available(engine: str) -> Optional[str]:
    """None if ``engine``'s Python package imports here, else why not."""
    try:
        if engine == "mooncake":
            importlib.import_module("mooncake.engine")
        elif engine == "nixl":
            from .nixl import _import_agent

            _import_agent()
        elif engine == "mori_io":
            importlib.import_module("mori.io")
        else:
            return f"unknown engine {engine!r}"
    except (ImportError, OSError) as error:
        return f"{engine} is not installed or cannot load: {error}"
    return None


@dataclass(frozen=True)
class Receive:
    """One request the decode child must complete: wait for ``tag``, unpack if staged."""

    rank: int
    #: A SliceConfig or a PairConfig.
    config: Union[mori_tp.SliceConfig, mori_tp.PairConfig]
    #: What :func:`unpack_request` takes with that config: the destination pages, or the
    #: Request.
    request: Union[Tuple[int, ...], mori_tp.Request]
    staging: int
    #: Offset of the request's slot in the child's staging pool.
    slot: int
    slot_len: int
    tag: bytes


@dataclass(frozen=True)
class GroupPart:
    """One group of a :class:`ReceiveGroups`, as the decode child rebuilds it on its buffers."""

    #: The child's buffer set (an entry of DecodePeer's ``ranks``) holding the group's buffers.
    rank: int
    #: The group's buffers, as indices into that set.
    buffers: Tuple[int, ...]
    config: mori_tp.PairConfig
    request: mori_tp.Request
    staging: int
    first_token: int

    def group(self, buffers: Sequence["np.ndarray"]) -> mori_tp.Group:
        """The group on the child's buffers of its set."""
        return mori_tp.Group(self.config, self.request, self.staging, self.first_token,
                             num_buffers=len(self.buffers),
                             dst_ptrs=[int(buffers[b].ctypes.data) for b in self.buffers],
                             dst_capacity=buffers[0].nbytes if len(buffers) else 0)


@dataclass(frozen=True)
class ReceiveGroups:
    """One request of several groups the decode child must complete: wait for ``tag``, then
    unpack every staged group (:func:`mori_tp.engines.unpack_groups`) from its slot."""

    parts: Tuple[GroupPart, ...]
    #: Offset of the request's slot in the child's staging pool, and its bytes.
    slot: int
    slot_len: int
    tag: bytes


class PeerError(RuntimeError):
    """The decode child failed, timed out or died; the message holds its report."""


class DecodePeer:
    """The decode child process, seen from the parent.

    Args:
        engine: ``"mooncake"`` or ``"nixl"``.
        ranks: for each decode rank the child holds, ``(num_buffers, capacity)``.
        staging_pool: bytes of the child's staging pool (0: none).
        timeout: seconds any one step may take before the parent gives up and kills the child.
    """

    def __init__(self, engine: str, ranks: Sequence[Tuple[int, int]], staging_pool: int,
                 timeout: float = 60.0) -> None:
        self.engine = engine
        self.timeout = timeout
        self._process, self._conn = _start_child(_serve, engine, list(ranks), staging_pool,
                                                 timeout)
        _, self.address, memories, pool = self._expect("ready", timeout=max(timeout, 120.0))
        #: The child's buffers, one KvMemory per decode rank; staging = the whole pool.
        self.memories = [KvMemory.from_dict(m) for m in memories]
        #: (address, bytes) of the child's staging pool.
        self.pool = tuple(pool)

    def _expect(self, kind: str, timeout: Optional[float] = None) -> Tuple[Any, ...]:
        wait = self.timeout if timeout is None else timeout
        if not self._conn.poll(wait):
            self.close()
            raise PeerError(f"the decode process sent nothing for {wait} s (waiting for {kind})")
        try:
            message = self._conn.recv()
        except EOFError:
            code = self._process.exitcode
            self.close()
            raise PeerError(f"the decode process exited (code {code}) before {kind}") from None
        if message[0] == "error":
            self.close()
            raise PeerError(f"the decode process failed:\n{message[1]}")
        if message[0] != kind:
            self.close()
            raise PeerError(f"the decode process answered {message[0]!r}, expected {kind!r}")
        return message

    def _call(self, request: Tuple[Any, ...], kind: str,
              timeout: Optional[float] = None) -> Tuple[Any, ...]:
        self._conn.send(request)
        return self._expect(kind, timeout)

    def connect(self, sender: str) -> None:
        """Tells the child the name the parent's notifications carry (``Driver.sender``): all it
        needs to receive them. It never loads the parent's address (NIXL metadata), which
        would give it access to the parent's registered memory."""
        self._call(("connect", sender), "ok")

    def reset(self) -> None:
        """Refills every buffer with its sentinel bytes and zeroes the staging pool."""
        self._call(("reset",), "ok")

    def receive(self, requests: Sequence[Union[Receive, "ReceiveGroups"]]) -> float:
        """Completes ``requests`` in order (wait, unpack); returns the seconds spent unpacking."""
        return self._call(("receive", list(requests)), "received")[1]

    def digests(self) -> List[List[str]]:
        """blake2b digests of every buffer, per rank."""
        return self._call(("digests",), "digests")[1]

    def fetch(self, rank: int, buffer: int) -> bytes:
        """One buffer's bytes (to locate a mismatch)."""
        return self._call(("fetch", rank, buffer), "bytes")[1]

    def close(self) -> None:
        """Stops the child: asks, then terminates, then kills."""
        _stop_child(self._process, self._conn, ("stop",))

    def __enter__(self) -> "DecodePeer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        # PR_SET_PDEATHSIG = 1: the kernel kills this process when its parent dies.
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(3)


def enter_netns(name: str) -> None:
    """Moves this process into the network namespace that ``ip netns`` calls ``name``, as
    ``ip netns exec`` does: ``setns`` into ``/run/netns/<name>``, then a mount namespace of its
    own where ``/sys`` is mounted again so that it shows the namespace's devices (UCX reads
    them). Call it first thing, before any thread or engine starts: threads made later inherit
    it. Linux only; needs CAP_SYS_ADMIN (root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet, clone_newns = 0x40000000, 0x00020000
    ms_rec, ms_slave, mnt_detach = 0x4000, 1 << 19, 2

    def check(result: int, what: str) -> None:
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what} for network namespace {name!r}: {os.strerror(code)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, clone_newnet), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(clone_newns), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, ms_rec | ms_slave, None), "mount --make-rslave /")
    libc.umount2(b"/sys", mnt_detach)  # nothing mounted there is fine
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs /sys")


@dataclass(frozen=True)
class Placement:
    """Where a child's engine runs: its address, network namespace and environment."""

    #: The address its engine listens on.
    hostname: str = "127.0.0.1"
    #: A network namespace (``ip netns`` name) to enter first, or None.
    netns: Optional[str] = None
    #: Environment variables set before the engine starts (e.g. ``UCX_TLS``).
    env: Tuple[Tuple[str, str], ...] = ()
    #: Seconds the engine itself gives a write (see :class:`Driver`).
    engine_timeout: float = 30.0

    def driver(self, engine: str) -> "Driver":
        return driver(engine, self.hostname, self.engine_timeout)


def _child_main(serve: Callable[..., None], conn: Any, parent: int, placement: Placement,
                *args: Any) -> None:
    """A decode child's process: ``serve(conn, *args)``, any failure reported to the parent,
    then an exit that skips native destructors (NIXL's can crash, see engines.nixl)."""
    _die_with_parent(parent)
    try:
        if placement.netns:
            enter_netns(placement.netns)
        os.environ.update(dict(placement.env))
        serve(conn, placement, *args)
    except BaseException:  # noqa: B036 - report anything to the parent, then exit
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
        os._exit(1)
    os._exit(0)


def _start_child(serve: Callable[..., None], *args: Any,
                 placement: Placement = Placement()) -> Tuple[Any, Any]:
    """Starts a child running ``serve(conn, placement, *args)`` (in ``placement``'s network
    namespace and environment); returns (process, parent's end)."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(target=_child_main,
                              args=(serve, child_conn, os.getpid(), placement, *args),
                              daemon=True)
    process.start()
    child_conn.close()
    return process, conn


def _stop_child(process: Any, conn: Any, stop: Tuple[Any, ...]) -> None:
    """Asks a decode child to stop, then terminates it, then kills it."""
    if process.is_alive():
        try:
            conn.send(stop)
        except (OSError, ValueError):
            pass
        process.join(5)
    if process.is_alive():
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)
    conn.close()


def _serve(conn: Any, placement: Placement, engine: str, ranks: List[Tuple[int, int]],
           staging_pool: int, timeout: float) -> None:
    drive = placement.driver(engine)
    transport = drive.start("decode")
    buffers = [[np.empty(capacity, dtype=np.uint8) for _ in range(count)]
               for count, capacity in ranks]
    pool = np.zeros(max(staging_pool, 1), dtype=np.uint8)

    def reset() -> None:
        for rank, rank_buffers in enumerate(buffers):
            for b, data in enumerate(rank_buffers):
                data[:] = sentinel(rank, b, data.nbytes)
        pool[:] = 0

    reset()
    pool_address = pool.ctypes.data
    memories = [
        KvMemory(tuple(int(data.ctypes.data) for data in rank_buffers), capacity,
                 pool_address if staging_pool else 0, staging_pool)
        for rank_buffers, (_, capacity) in zip(buffers, ranks)
    ]
    # The pool is registered once, with the first rank's buffers; every memory the parent gets
    # carries the registration epoch.
    memories = [transport.register(memory if rank == 0 else
                                   KvMemory(memory.buffers, memory.capacity))
                for rank, memory in enumerate(memories)]
    memories = [replace(m, staging=memories[0].staging,
                        staging_capacity=memories[0].staging_capacity) for m in memories]
    conn.send(("ready", drive.address(transport), [m.to_dict() for m in memories],
               (pool_address, staging_pool)))
    peer = None
    while True:
        # A parent that stays silent this long is gone or stuck: stop rather than linger.
        if not conn.poll(max(timeout, 60.0) * 2):
            return
        request = conn.recv()
        kind = request[0]
        if kind == "stop":
            return
        if kind == "connect":
            peer = request[1]
            conn.send(("ok",))
        elif kind == "reset":
            reset()
            conn.send(("ok",))
        elif kind == "receive":
            seconds = 0.0
            for item in request[1]:
                drive.wait(transport, peer, item.tag, timeout)
                if isinstance(item, ReceiveGroups):
                    groups = [part.group(buffers[part.rank]) for part in item.parts]
                    start = time.perf_counter()
                    region = pool_address + item.slot if item.slot_len else 0
                    unpack_groups(groups, staging=region, staging_capacity=item.slot_len,
                                  backend="host")
                    seconds += time.perf_counter() - start
                    continue
                memory = memories[item.rank]
                slot = replace(memory, staging=pool_address + item.slot,
                               staging_capacity=item.slot_len) if item.slot_len else memory
                start = time.perf_counter()
                unpack_request(item.config, item.request, memory=slot, staging=item.staging,
                               backend="host")
                seconds += time.perf_counter() - start
            conn.send(("received", seconds))
        elif kind == "digests":
            conn.send(("digests", [[digest(data) for data in rank_buffers]
                                   for rank_buffers in buffers]))
        elif kind == "fetch":
            conn.send(("bytes", buffers[request[1]][request[2]].tobytes()))
        else:
            raise ValueError(f"unknown request {kind!r}")


@dataclass(frozen=True)
class Expected:
    """What a :class:`StreamPeer` child reports when a request it expects ends."""

    request_id: str
    #: The child's time.monotonic() when it ended (the same clock as the parent's on Linux).
    finished_at: float
    #: None, or the error in words.
    error: Optional[str]
    unpack_seconds: float
    #: The ranges of each chunk, in the order they landed.
    chunks: Tuple[Tuple[Tuple[int, int], ...], ...]
    #: How a failed request's memory was let go without its sender's answer ("": it answered,
    #: or the request completed): ``Incoming.released``.
    released: str = ""


class StreamPeer:
    """A decode child that receives pipelined and streamed requests with a
    :class:`~mori_tp.engines.Receiver`, staging slots from a :class:`mori_tp.StagingPool`
    registered once. Its calls may come from several parent threads at once.

    Args:
        engine: ``"mooncake"`` or ``"nixl"``.
        ranks: for each decode rank the child holds, ``(num_buffers, capacity)``.
        pool_bytes: capacity of the child's staging pool (0: none); ``min_slot`` its unit.
        timeout: seconds any one step may take before the parent gives up on the child.
        placement: where the child's engine runs (default 127.0.0.1 in this namespace).
        linger: the child's ``Receiver(linger=)``: seconds a failed request's slot is held
            before it goes back to the pool (and the request is reported ended). Short by
            default: the senders here are the tests' own processes, whose writes have
            returned by the time a request they fail or abandon ends.
    """

    def __init__(self, engine: str, ranks: Sequence[Tuple[int, int]], pool_bytes: int,
                 timeout: float = 60.0, min_slot: int = 1 << 16,
                 placement: Placement = Placement(), linger: float = 0.25) -> None:
        import threading

        self.engine = engine
        self.timeout = timeout
        self._process, self._conn = _start_child(_stream_serve, engine, list(ranks), pool_bytes,
                                                 min_slot, timeout, linger, placement=placement)
        try:
            if not self._conn.poll(max(timeout, 120.0)):
                raise PeerError("the decode process sent nothing before it was ready")
            message = self._conn.recv()
        except (EOFError, OSError, PeerError) as error:
            code = self._process.exitcode
            self.close()
            raise PeerError(f"the decode process did not start (exit code {code}): "
                            f"{error}") from None
        if message[0] != "ready":
            self.close()
            raise PeerError(f"the decode process failed:\n{message[1]}")
        _, self.address, memories, pool = message
        #: The child's buffers, one KvMemory per decode rank, stamped with its registration
        #: epoch (``self.epoch``).
        self.memories = [KvMemory.from_dict(m) for m in memories]
        self.epoch = self.memories[0].epoch if self.memories else 0
        #: (address, bytes) of the child's staging pool.
        self.pool = tuple(pool)
        self._lock = threading.Lock()
        self._calls = 0
        self._replies: dict = {}
        self._ended: dict = {}
        self._changed = threading.Condition()
        self._failure: Optional[str] = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                message = ("error", f"the decode process exited (code {self._process.exitcode})")
            with self._changed:
                if message[0] == "reply":
                    self._replies[message[1]] = message[2]
                elif message[0] == "ended":
                    self._ended[message[1].request_id] = message[1]
                else:
                    self._failure = message[1]
                self._changed.notify_all()
            if message[0] == "error":
                return

    def _wait_for(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not ready():
                if self._failure is not None:
                    raise PeerError(f"the decode process failed:\n{self._failure}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(f"the decode process sent nothing for {timeout} s "
                                    f"(waiting for {what})")
                self._changed.wait(left)

    def call(self, kind: str, *args: Any, timeout: Optional[float] = None) -> Any:
        """Runs ``kind`` in the child; returns its answer."""
        with self._lock:
            self._calls += 1
            call = self._calls
            self._conn.send((kind, call, *args))
        self._wait_for(kind, lambda: call in self._replies,
                       self.timeout if timeout is None else timeout)
        with self._changed:
            answer = self._replies.pop(call)
        if isinstance(answer, tuple) and answer and answer[0] == "refused":
            raise PeerError(f"the decode process refused {kind}: {answer[1]}")
        return answer

    def connect(self, sender: str) -> None:
        """Tells the child the name the parent's notifications carry (``Driver.sender``); its
        requests are bound to that sender. A NIXL child also loads the parent's metadata, to
        answer it (``done``, ``cancel``)."""
        self.call("connect", sender, answer_address(sender))

    def expect(self, request_id: str, rank: int, config: mori_tp.SliceConfig,
               dst_pages: Sequence[int], staging: Union[int, str], slot_bytes: int,
               timeout: Optional[float] = None,
               buffers: Optional[Sequence[int]] = None) -> Tuple[int, str]:
        """Has the child allocate a slot of ``slot_bytes`` (waiting while its pool is full:
        backpressure) and expect the request with ``staging`` (a Staging value, or
        ``BY_SENDER``: the sender chooses, and a slot of ``slot_bytes`` lets it choose DST or
        BOTH); returns the slot's address (0 without one) and the request's token, what
        a decode rank sends the prefill rank. ``buffers``: the rank's buffers the request
        moves, in the request's order (default all)."""
        wait = self.timeout if timeout is None else timeout
        slot, token = self.call("expect", request_id, rank, config, tuple(dst_pages), staging,
                                slot_bytes, wait, None if buffers is None else tuple(buffers),
                                timeout=wait + 30)
        return slot, token

    def ended(self, request_id: str, timeout: Optional[float] = None) -> Expected:
        """Waits until the child reports the request ended; returns the report."""
        self._wait_for(f"request {request_id}", lambda: request_id in self._ended,
                       self.timeout if timeout is None else timeout)
        with self._changed:
            return self._ended.pop(request_id)

    def release(self, request_id: str) -> bool:
        """Has the child let go of a failed request it holds (``Receiver.release``: the
        connector knows its sender is gone or never got the request); whether it was held."""
        return self.call("release", request_id)

    def reset(self) -> None:
        self.call("reset")

    def digests(self) -> List[List[str]]:
        return self.call("digests")

    def fetch(self, rank: int, buffer: int) -> bytes:
        return self.call("fetch", rank, buffer)

    @property
    def pid(self) -> int:
        return self._process.pid

    def kill(self) -> None:
        """Kills the child at once (SIGKILL), as a crash would; calls then raise PeerError."""
        self._process.kill()
        self._process.join(10)

    def digest_pages(self, rank: int, item_len: int, pages: Sequence[int]) -> str:
        """The digest of ``pages`` (of ``item_len`` bytes) of every buffer of ``rank``, as
        :func:`pages_of` lays them out."""
        return self.call("digest_pages", rank, item_len, tuple(int(p) for p in pages))

    def pool_info(self) -> Tuple[int, int]:
        """(live slots, live bytes) of the child's staging pool."""
        return self.call("pool")

    def close(self) -> None:
        """Stops the child: asks, then terminates, then kills."""
        _stop_child(self._process, self._conn, ("stop", 0))

    def __enter__(self) -> "StreamPeer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _stream_serve(conn: Any, placement: Placement, engine: str, ranks: List[Tuple[int, int]],
                  pool_bytes: int, min_slot: int, timeout: float, linger: float) -> None:
    import threading

    from .streaming import Receiver

    drive = placement.driver(engine)
    # The Receiver's thread polls the transport from connect() on.
    transport = drive.start("decode", polled=True)
    buffers = [[np.empty(capacity, dtype=np.uint8) for _ in range(count)]
               for count, capacity in ranks]
    pool = mori_tp.StagingPool(pool_bytes, min_slot=min_slot) if pool_bytes else None

    def reset() -> None:
        for rank, rank_buffers in enumerate(buffers):
            for b, data in enumerate(rank_buffers):
                data[:] = sentinel(rank, b, data.nbytes)

    reset()
    memories = [KvMemory(tuple(int(data.ctypes.data) for data in rank_buffers), capacity)
                for rank_buffers, (_, capacity) in zip(buffers, ranks)]
    memories = [transport.register(memory) for memory in memories]
    if pool is not None:
        transport.register(KvMemory((), 0, pool.address, pool.capacity))
    sending = threading.Lock()

    def send(message: Tuple[Any, ...]) -> None:
        with sending:
            conn.send(message)

    send(("ready", drive.address(transport), [m.to_dict() for m in memories],
          (pool.address if pool else 0, pool.capacity if pool else 0)))
    receiver = Receiver(transport, linger=linger)
    #: The parent's name on the engine: every request is bound to it (connect).
    sender: Optional[str] = None
    #: The requests expected and not ended, by id (the latest of each), for "release".
    expected: dict = {}

    def expect(rid: str, rank: int, config: Any, dst_pages: Sequence[int],
               staging: Union[int, str], slot_bytes: int, wait: float,
               chosen: Optional[Sequence[int]]
               ) -> Tuple[int, str]:
        """A connector's part: a slot, then the request expected; the slot goes back when the
        request has settled (on_done), or at once if expect refuses it."""
        memory = memories[rank]
        if chosen is not None:
            memory = replace(memory, buffers=tuple(memory.buffers[b] for b in chosen))
        slot = None
        if slot_bytes:
            if pool is None:
                raise ValueError("this decode process has no staging pool")
            slot = pool.alloc(slot_bytes, timeout=wait)
            memory = replace(memory, staging=slot.address, staging_capacity=slot.size)
        landed: List[Any] = []

        def ended(incoming: Any) -> None:
            # No write of the request can land any more: its slot goes back.
            if expected.get(incoming.request_id) is incoming:
                del expected[incoming.request_id]
            if slot is not None:
                pool.free(slot)
            error = None if incoming.error is None else str(incoming.error)
            send(("ended", Expected(incoming.request_id,
                                    incoming.finished_at or time.monotonic(), error,
                                    incoming.unpack_seconds, tuple(landed),
                                    incoming.released)))

        try:
            incoming = receiver.expect(
                rid, config, list(dst_pages), memory=memory, staging=staging, backend="host",
                timeout=wait, peer=sender, on_chunk=lambda _, ranges: landed.append(ranges),
                on_done=ended)
        except BaseException:
            if slot is not None:
                pool.free(slot)
            raise
        expected[rid] = incoming
        if len(expected) > 4096:
            del expected[next(iter(expected))]
        return (slot.address if slot is not None else 0), incoming.token

    while True:
        # A parent that stays silent this long is gone or stuck: stop rather than linger.
        if not conn.poll(max(timeout, 60.0) * 2):
            return
        request = conn.recv()
        kind, call, args = request[0], request[1], request[2:]
        if kind == "stop":
            receiver.close()
            return
        answer: Any = None
        try:
            if kind == "connect":
                # The name, and for NIXL the metadata: the receiver answers the sender (done,
                # cancel), which NIXL sends only to an agent whose metadata it loaded.
                sender = args[0]
                if len(args) > 1 and args[1] is not None:
                    drive.connect(transport, args[1])
                receiver.start()
            elif kind == "expect":
                answer = expect(*args)
            elif kind == "reset":
                reset()
            elif kind == "release":
                held = expected.get(args[0])
                answer = held is not None and receiver.release(held, "the parent says so")
            elif kind == "digests":
                answer = [[digest(data) for data in rank_buffers] for rank_buffers in buffers]
            elif kind == "fetch":
                answer = buffers[args[0]][args[1]].tobytes()
            elif kind == "digest_pages":
                rank, item_len, pages = args
                answer = digest(pages_of(buffers[rank], item_len, pages))
            elif kind == "pool":
                info = pool.info() if pool is not None else None
                answer = (info.live_slots, info.live_bytes) if info else (0, 0)
            elif kind == "violations":
                # And the messages for requests not expected (yet).
                answer = list(receiver.violations) + [f"unexpected messages for request {rid}"
                                                      for rid in receiver._early]
            elif kind == "try_read":
                answer = _try_read(engine, transport, sender, *args)
            else:
                raise ValueError(f"unknown request {kind!r}")
        except mori_tp.MoriError as error:
            answer = ("refused", str(error))
        send(("reply", call, answer))


def _try_read(engine: str, transport: Any, sender: Optional[str], address: int,
              length: int) -> str:
    """Whether this (decode) process can read ``length`` bytes at ``address`` of the process
    named ``sender`` one-sided, through its engine: "read" or "refused: why". The trust model
    (REFERENCE.md section 18): a NIXL agent reads only agents whose metadata it loaded, which
    the decode child never does; a Mooncake engine lets any peer read registered memory."""
    if engine == "mori_io":
        # MORI-IO addresses memory by the owner's MemoryDesc (engine key, region id), which
        # the decode child never receives: there is nothing it could name to read.
        return "refused: not tried (this process holds none of the sender's memory descriptors)"
    scratch = np.zeros(max(length, 1), dtype=np.uint8)
    local = int(scratch.ctypes.data)
    try:
        if engine == "nixl":
            agent = transport.agent
            handle = agent.initialize_xfer(
                "READ", transport._descs(np.array([local], dtype=np.uint64),
                                         np.array([length], dtype=np.uint64)),
                transport._descs(np.array([address], dtype=np.uint64),
                                 np.array([length], dtype=np.uint64)),
                sender, b"")
            agent.release_xfer_handle(handle)
            return "read"
        transport.engine.register_memory(local, scratch.nbytes)
        try:
            status = transport.engine.batch_transfer_sync_read(sender, [local], [address],
                                                               [length])
        finally:
            transport.engine.unregister_memory(local)
        return "read" if status == 0 else f"refused: status {status}"
    except Exception as error:  # noqa: BLE001 - the engine's own exception types
        return f"refused: {type(error).__name__}: {str(error)[:120]}"


def run_program(main: Callable[[], Optional[int]]) -> NoReturn:
    """Runs a program's ``main`` and ends the process with its status: what it returns (None:
    0), or what the ``SystemExit`` it raises carries, or 1 after any other exception (130 after
    Ctrl-C), with the traceback on stderr, as the interpreter would. Once the process has made
    a NIXL transport, it ends through :func:`mori_tp.engines.nixl.exit_process`, so that the
    status stays the program's whatever NIXL's libraries do at exit."""
    try:
        status = main()
    except SystemExit as stop:
        status = stop.code
    except KeyboardInterrupt:
        traceback.print_exc()
        status = 130
    except BaseException:  # noqa: B036 - reported like the interpreter's default, then exit
        traceback.print_exc()
        status = 1
    if status is None:
        status = 0
    elif not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    nixl = sys.modules.get(f"{__package__}.nixl")
    if nixl is not None and nixl.agent_created():
        nixl.exit_process(status if 0 <= status <= 255 else 1)
    sys.exit(status)


def first_difference(got: bytes, want: bytes) -> int:
    """The index of the first differing byte (or the shorter length)."""
    a = np.frombuffer(got, dtype=np.uint8)
    b = np.frombuffer(want, dtype=np.uint8)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
