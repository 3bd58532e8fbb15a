"""Choosing each request's staging mode and chunk count by cost (REFERENCE.md section 13,
"Choosing the staging and the chunks by cost").

The library's :func:`mori_tp.staging_for` is a rule on the layout alone: it stages each side
whose token slot is wider than the slice, so that no copy merges nothing. Whether a mode pays
depends on the transport and the copies as well: a transport with a fixed cost per segment
(Mooncake's TCP transport) wants the fewest segments (BOTH), one with cheap segments and copies
that are slow against the write wants the fewest copies. :class:`CostModel` predicts the time
of every mode and chunk count from

- the plan's segment count for each mode (:func:`mori_tp.plan_transfer` /
  :func:`mori_tp.pair_segments`, one call per mode),
- the transport's costs between this rank and the peer (:class:`TransportCosts`: seconds per
  engine call, per segment, per byte), given, or fitted to the writes this rank made to that
  peer (every :class:`~mori_tp.engines.Streamer` write is recorded; those that ran while no
  pack or other write of this rank did are preferred, since the model shares the cores out
  itself),
- the copy speed of the backend that packs and unpacks (:class:`CopyCosts`): given, or the packs
  (and unpacks, where the decode rank reports them) observed, or one host pack and unpack
  measured at first use,

and picks the cheapest. Until the transport's costs are known it answers ``staging_for``'s mode
(the contract's rule) with :func:`~mori_tp.engines.chunk_ranges`' chunks, and spends a few of the
first requests (``explore``) on the allowed mode with the fewest segments, so that the writes it
observes hold two segment densities and the per-segment cost can be told from the bandwidth.

Both ranks must agree on a request's mode: the prefill rank chooses, and every chunk's
notification says which mode it was staged with (``staging <mode>``,
:mod:`mori_tp.engines.protocol`). A decode rank that lets the sender choose calls
``Receiver.expect(..., staging="sender")`` and offers a staging slot of ``num_buffers *
staging_len`` bytes (or none: then only NONE and SRC may be chosen); the prefill rank passes the
decode rank's memory with that slot to :meth:`CostModel.choose`, which considers DST and BOTH
only when the slot holds the request.

The time of ``n`` chunks of a request of ``B`` bytes and ``S`` segments in mode ``m``::

    P = B / pack_speed  (SRC, BOTH)      W = S * per_segment + B / bytes_per_second
    U = B / unpack_speed (DST, BOTH)     calls = max(n, ceil(S / max_segments_per_call))
    pipelined = (P + W + U) / n + (n - 1) / n * max(P, W, U)
    busy      = max(P_host + h * W, U_host + h * W) / cores      (h: the transport's host cores)
    T(m, n)   = min(max(pipelined, busy), P + W + U) + calls * per_call + n * chunk_overhead

``pipelined`` is the pipeline of three stages on engines of their own; ``busy`` bounds it by the
host cores those stages share: a host copy takes a core, the transport ``h`` cores (this
process's CPU share while it writes alone, measured: a cross-memory copy keeps about one busy,
TCP less, an RDMA NIC next to none), device copies none. ``cores`` is what each rank gets of the
host: measured from how much slower host packs run beside a write than alone (on a loaded host
a pipeline gains nothing, and the model sees it), until then half the host's cores. Every choice, with its figures, is logged at
debug level (logger ``mori_tp.engines.costs``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Deque, Dict, Iterable, Optional, Sequence, Tuple, Union

import numpy as np

import mori_tp
from mori_tp import InvalidArgumentError, PairConfig, Request, SliceConfig, Staging

from .chunks import chunk_ranges

__all__ = [
    "DEFAULT_CHUNK_OVERHEAD",
    "EXPLORE_REQUESTS",
    "MAX_CHUNKS",
    "Choice",
    "CopyCosts",
    "CostModel",
    "Estimate",
    "TransportCosts",
    "segment_counts",
]

log = logging.getLogger(__name__)

#: Seconds each chunk costs besides its engine call: the notification's handling and two thread
#: wake-ups (a chunk cost about 0.3 ms in all on this project's two-core machines, engine call
#: included; BENCHMARKS.md).
DEFAULT_CHUNK_OVERHEAD = 0.2e-3
#: The chunk count chosen is the fewest whose estimate is within this share of the best. Each
#: chunk costs more than the model sees (cache misses of copies cut short, the stages' threads
#: competing for cores): on this project's two-core machines every chunk count above two ran
#: slower than two where the model predicted it 4-7% faster (BENCHMARKS.md, the staged table),
#: so a chunk more must promise more than that.
TOLERANCE = 0.10
#: Packs of each kind (timed alone, and beside a write) needed to measure the cores.
MIN_PACKS = 3
#: The most chunks the model considers for one request (and never more than its buffers).
MAX_CHUNKS = 16
#: Requests per peer, at most, that the model spends on the allowed mode with the fewest
#: segments while the transport's costs are unknown (every other one: staging_for's mode).
EXPLORE_REQUESTS = 8
#: Writes kept for the fit, per peer and per density (segments per byte, in powers of two): the
#: newest of each, so that the writes of a mode no longer chosen still tell its cost.
WINDOW = 64
#: Densities kept per peer (the most recently observed).
MAX_DENSITIES = 32
#: Pack and unpack observations kept (the newest).
COPY_WINDOW = 64
#: A peer's costs are fitted again once this many writes came since the last fit (at once while
#: no fit succeeded).
REFIT_WRITES = 16
#: The fit needs at least this many writes, whose segments per byte differ by at least
#: DENSITY_SPREAD between the sparsest and the densest, and that spread must hold without any
#: one of them: one write (a TCP retransmit, a peer paused for a moment, an exploring write
#: timed slow) must not be able to decide the fit alone (issue 44 F05).
MIN_WRITES = 6
DENSITY_SPREAD = 2.0
#: Writes of one density the fit needs before it uses that density, and how far (a factor) a
#: write's seconds per byte may lie from its density's median before it is left out.
GROUP_WRITES = 3
OUTLIER = 2.0


def _positive(value: Any, name: str, where: str, *, zero: bool = False,
              infinite: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or value < 0 or (value == 0 and not zero) or (value == math.inf and not infinite):
        bound = "at least 0" if zero else "above 0"
        raise InvalidArgumentError(f"{where}: {name} {value!r} must be a number {bound}"
                                   + ("" if infinite else ", finite"))
    return float(value)


@dataclass(frozen=True)
class TransportCosts:
    """What one write through the transport costs between this rank and one peer:
    ``calls * per_call + segments * per_segment + bytes / bytes_per_second`` seconds.

    ``host_cores``: the host cores the transport keeps busy on each rank while it writes
    (about 1 for TCP or a cross-memory copy, where the engine copies the bytes; 0 for an RDMA
    NIC), which pack and unpack on host cores then wait for. ``source`` says where the figures
    came from (``"given"``, or the writes they were fitted to)."""

    per_segment: float
    bytes_per_second: float
    per_call: float = 0.0
    host_cores: float = 1.0
    source: str = "given"

    def __post_init__(self) -> None:
        where = "TransportCosts"
        _positive(self.per_segment, "per_segment", where, zero=True)
        _positive(self.bytes_per_second, "bytes_per_second", where, infinite=True)
        _positive(self.per_call, "per_call", where, zero=True)
        _positive(self.host_cores, "host_cores", where, zero=True)

    def write_seconds(self, segments: int, nbytes: int, calls: int = 1) -> float:
        """Predicted seconds of writes of ``segments`` segments holding ``nbytes`` bytes in
        ``calls`` engine calls."""
        return calls * self.per_call + segments * self.per_segment \
            + nbytes / self.bytes_per_second

    def describe(self) -> str:
        speed = ("unbounded" if self.bytes_per_second == math.inf
                 else f"{self.bytes_per_second / 1e9:.2f} GB/s")
        return (f"{self.per_segment * 1e6:.2f} us/segment, {speed}, "
                f"{self.per_call * 1e6:.0f} us/call, {self.host_cores:.2f} host cores "
                f"({self.source})")


@dataclass(frozen=True)
class CopyCosts:
    """The copy speed of the backend that packs (prefill rank) and unpacks (decode rank), in
    bytes of staged data per second; ``unpack_bytes_per_second`` None: the pack's. ``per_call``:
    seconds each pack or unpack call costs besides its bytes (a kernel launch, a table upload).
    ``on_host``: the copies run on host cores (the host backend), not on a device."""

    pack_bytes_per_second: float
    unpack_bytes_per_second: Optional[float] = None
    per_call: float = 0.0
    on_host: bool = True
    source: str = "given"

    def __post_init__(self) -> None:
        where = "CopyCosts"
        _positive(self.pack_bytes_per_second, "pack_bytes_per_second", where, infinite=True)
        if self.unpack_bytes_per_second is not None:
            _positive(self.unpack_bytes_per_second, "unpack_bytes_per_second", where,
                      infinite=True)
        _positive(self.per_call, "per_call", where, zero=True)

    @property
    def unpack_speed(self) -> float:
        return (self.pack_bytes_per_second if self.unpack_bytes_per_second is None
                else self.unpack_bytes_per_second)

    def describe(self) -> str:
        return (f"pack {self.pack_bytes_per_second / 1e9:.2f} GB/s, unpack "
                f"{self.unpack_speed / 1e9:.2f} GB/s, {'host' if self.on_host else 'device'} "
                f"({self.source})")

    @classmethod
    def measure_host(cls, nbytes: int = 4 << 20, runs: int = 3) -> "CopyCosts":
        """One host pack and one host unpack of ``nbytes`` staged bytes (a slice of 256 bytes
        out of 512-byte tokens, pages of 16), the fastest of ``runs`` each: the host backend's
        speed on this machine."""
        page, head = 16, 256
        tokens = max(page, nbytes // head // page * page)

        def config(prefill_tp: int, decode_tp: int) -> SliceConfig:
            return mori_tp.slice_config(
                prefill_tp_size=prefill_tp, prefill_tp_rank=0, decode_tp_size=decode_tp,
                decode_tp_rank=0, total_kv_heads=2, page_size=page,
                src_item_len=page * head * 2 // prefill_tp,
                dst_item_len=page * head * 2 // decode_tp)

        pages = list(range(tokens // page))
        wide = np.ones(tokens * 2 * head, dtype=np.uint8)
        staged = np.empty(tokens * head, dtype=np.uint8)
        src, region = [int(wide.ctypes.data)], int(staged.ctypes.data)

        def best(copy: Any) -> float:
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                copy()
                times.append(time.perf_counter() - start)
            return staged.nbytes / max(min(times), 1e-9)

        # TP 1 -> 2 packs one head of two (strided reads); TP 2 -> 1 unpacks into one of two
        # (strided writes).
        pack = best(lambda: mori_tp.pack_kvcache(
            config(1, 2), src, region, src_capacity=wide.nbytes, src_pages=pages,
            staging_capacity=staged.nbytes, backend="host"))
        unpack = best(lambda: mori_tp.unpack_kvcache(
            config(2, 1), region, src, dst_capacity=wide.nbytes, dst_pages=pages,
            staging_capacity=staged.nbytes, backend="host"))
        return cls(pack, unpack, source=f"measured: one host pack and unpack of "
                                        f"{staged.nbytes >> 20} MiB")


@dataclass(frozen=True)
class Estimate:
    """The predicted time of one mode in its best chunk count, and its parts."""

    staging: Staging
    chunks: int
    #: Segments handed to the engine, all buffers together.
    segments: int
    seconds: float
    pack_seconds: float
    write_seconds: float
    unpack_seconds: float

    def describe(self) -> str:
        return (f"{self.staging.name}: {self.segments} segments, {self.chunks} chunks, "
                f"{self.seconds * 1e3:.2f} ms (pack {self.pack_seconds * 1e3:.2f}, write "
                f"{self.write_seconds * 1e3:.2f}, unpack {self.unpack_seconds * 1e3:.2f})")


@dataclass(frozen=True)
class Choice:
    """What :meth:`CostModel.choose` chose for one request, and why."""

    staging: Staging
    chunks: int
    #: "model" (the cheapest estimate), "fallback" (staging_for's mode: the transport's costs
    #: are not known yet, or nothing moves), "exploring" (the allowed mode with the fewest
    #: segments, to learn the transport's costs).
    reason: str
    #: Bytes moved, all buffers together (the same in every mode).
    bytes: int
    num_buffers: int
    #: Segments per mode, all buffers together (the modes considered).
    segments: Dict[Staging, int] = field(default_factory=dict)
    #: Each allowed mode in its best chunk count (empty unless the model could estimate).
    estimates: Tuple[Estimate, ...] = ()
    transport: Optional[TransportCosts] = None
    copy: Optional[CopyCosts] = None
    #: The layout's rule (staging_for / pair_staging_for), the fallback.
    rule: Optional[Staging] = None
    #: Host cores per rank the estimates assumed, and where that figure comes from.
    cores: Optional[float] = None
    cores_source: str = ""

    @property
    def seconds(self) -> Optional[float]:
        """The chosen mode's predicted seconds, when the model estimated it."""
        for estimate in self.estimates:
            if estimate.staging is self.staging:
                return estimate.seconds
        return None

    def describe(self) -> str:
        text = (f"{self.staging.name} in {self.chunks} chunks ({self.reason}; "
                f"{self.bytes} bytes in {self.num_buffers} buffers; staging_for: "
                f"{self.rule.name if self.rule is not None else '-'})")
        if self.estimates:
            text += "; " + "; ".join(e.describe() for e in self.estimates)
        else:
            text += "; segments " + ", ".join(f"{m.name} {n}" for m, n in self.segments.items())
        if self.transport is not None:
            text += f"; transport {self.transport.describe()}"
        if self.copy is not None:
            text += f"; copies {self.copy.describe()}"
        if self.cores is not None:
            text += f"; {self.cores:.2f} host cores per rank ({self.cores_source})"
        return text


def segment_counts(config: Union[SliceConfig, PairConfig], request: Union[Request, Any],
                   dst_pages: Any = None, modes: Iterable[Staging] = tuple(Staging)
                   ) -> Dict[Staging, int]:
    """Segments per buffer of one request in each of ``modes``: the length of the library's
    plan for each (:func:`mori_tp.plan_transfer`, :func:`mori_tp.pair_segments`)."""
    out = {}
    for mode in modes:
        if isinstance(config, PairConfig):
            lengths = mori_tp.pair_segments(config, request, mode, as_arrays=True)[2]
        else:
            lengths = mori_tp.plan_transfer(config, mode, request, dst_pages, as_arrays=True)[2]
        out[Staging(mode)] = len(lengths)
    return out


def _staging_len(config: Union[SliceConfig, PairConfig], request: Any) -> int:
    if isinstance(config, PairConfig):
        return mori_tp.pair_staging_len(config, request.num_tokens)
    return mori_tp.staging_len(config, len(request))


def _rule(config: Union[SliceConfig, PairConfig]) -> Staging:
    return (mori_tp.pair_staging_for(config) if isinstance(config, PairConfig)
            else mori_tp.staging_for(config))


def _fit(writes: Sequence[Tuple[int, int, int, float]]) -> Optional[Tuple[float, float, float]]:
    """``(per_call, per_segment, seconds per byte)``, all at least 0, minimising the relative
    error of ``calls * a + segments * b + bytes * c`` over ``writes`` of ``(calls, segments,
    bytes, seconds)``; the writes more than 3 times the median error off are dropped once.
    None when the writes cannot tell the per-segment cost from the bandwidth (their segments
    per byte differ by less than DENSITY_SPREAD). When every write moved about as many bytes
    per call, the per-call cost cannot be told from the bandwidth either and is taken as 0."""
    if len(writes) < MIN_WRITES:
        return None
    data = np.asarray(writes, dtype=np.float64)
    data = data[(data[:, 3] > 0) & (data[:, 2] > 0) & (data[:, 1] > 0)]
    if len(data) < MIN_WRITES:
        return None
    data = _confirmed(data)
    if data is None:
        return None
    density = data[:, 1] / data[:, 2]
    if density.min() <= 0 or density.max() / density.min() < DENSITY_SPREAD:
        return None
    per_call = data[:, 2] / data[:, 0]
    unknowns = (0, 1, 2) if per_call.max() / per_call.min() >= 1.5 else (1, 2)
    design = data[:, :3] / data[:, 3:4]

    def solve(rows: "np.ndarray") -> Tuple["np.ndarray", float]:
        best: Optional[Tuple["np.ndarray", float]] = None
        # Non-negative least squares over (up to) three unknowns: the best of every subset's
        # unconstrained solution that comes out non-negative.
        for size in range(len(unknowns), 0, -1):
            for columns in combinations(unknowns, size):
                a = rows[:, columns]
                solution, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
                if (solution < 0).any():
                    continue
                x = np.zeros(3)
                x[list(columns)] = solution
                error = float(np.sum((rows @ x - 1.0) ** 2))
                if best is None or error < best[1] - 1e-15:
                    best = (x, error)
        assert best is not None  # a single column with positive entries always fits
        return best

    x, _ = solve(design)
    residual = np.abs(design @ x - 1.0)
    keep = residual <= 3 * max(float(np.median(residual)), 0.02)
    if keep.sum() >= MIN_WRITES and not keep.all() and _spread(density[keep]):
        x, _ = solve(design[keep])
    return float(x[0]), float(x[1]), float(x[2])


def _confirmed(data: "np.ndarray") -> Optional["np.ndarray"]:
    """The writes a fit may use: grouped by density (segments per byte, in powers of two),
    only groups of at least GROUP_WRITES writes, and in each only the writes whose seconds per
    byte lie within OUTLIER times the group's median (one slow write cannot move a median of
    three); None unless two such groups differ by DENSITY_SPREAD (the fit is refused rather
    than led by a lone write: issue 44 F05)."""
    density = data[:, 1] / data[:, 2]
    bucket = np.round(np.log2(density))
    rows = []
    for value in np.unique(bucket):
        group = data[bucket == value]
        if len(group) < GROUP_WRITES:
            continue
        speed = group[:, 3] / group[:, 2]
        median = float(np.median(speed))
        kept = group[(speed <= OUTLIER * median) & (speed >= median / OUTLIER)]
        if len(kept) >= GROUP_WRITES - 1:
            rows.append(kept)
    if len(rows) < 2:
        return None
    kept = np.concatenate(rows)
    if len(kept) < MIN_WRITES or not _spread(kept[:, 1] / kept[:, 2]):
        return None
    return kept


def _spread(density: "np.ndarray") -> bool:
    """Whether writes of these densities can tell the per-segment cost from the bandwidth."""
    return len(density) > 0 and density.min() > 0 and \
        density.max() / density.min() >= DENSITY_SPREAD


class CostModel:
    """Predicts and chooses each request's staging mode and chunk count (module docs).

    Args:
        transport: the transport's costs for every peer (:meth:`set_transport` sets one peer's);
            default: fitted to the writes observed.
        copy: the copy speed of the backend that packs and unpacks; default: the packs and
            unpacks observed, else one host pack and unpack measured at first use.
        cores: host cores each rank's copies and writes share. Default: measured, as ``(1 + h)
            / s`` where ``s`` is how much slower the packs that ran beside a write (or another
            pack) were than those that ran alone and ``h`` the transport's host cores (no
            slowdown: at least ``1 + h``); half the host's cores, at least 1, until host packs
            of both kinds were observed (the two ranks of a pair may share one host, as in this
            project's two-process runs).
        chunk_overhead: seconds each chunk costs besides its engine call.
        tolerance: the chunk count chosen is the fewest whose estimate is within this share of
            the best one's (each chunk carries costs the model only estimates).
        max_chunks: the most chunks considered (never more than the request's buffers).
        max_segments_per_call: the engine's segments per call (Mooncake's transport splits
            longer lists; default: no limit), which adds calls.
        explore: requests per peer, at most, spent on the allowed mode with the fewest segments
            while the peer's costs are unknown (0: never; always staging_for's mode then).
    """

    def __init__(self, transport: Optional[TransportCosts] = None,
                 copy: Optional[CopyCosts] = None, *, cores: Optional[float] = None,
                 chunk_overhead: float = DEFAULT_CHUNK_OVERHEAD, max_chunks: int = MAX_CHUNKS,
                 max_segments_per_call: Optional[int] = None,
                 explore: int = EXPLORE_REQUESTS, tolerance: float = TOLERANCE) -> None:
        where = "CostModel"
        if transport is not None and not isinstance(transport, TransportCosts):
            raise TypeError(f"{where}: transport must be a TransportCosts")
        if copy is not None and not isinstance(copy, CopyCosts):
            raise TypeError(f"{where}: copy must be a CopyCosts")
        self.transport = transport
        self.copy = copy
        #: The cores given, or the default until measured (``cores_given`` False).
        self.cores_given = cores is not None
        self.cores = (max(1.0, (os.cpu_count() or 2) // 2) if cores is None
                      else _positive(cores, "cores", where))
        self.tolerance = _positive(tolerance, "tolerance", where, zero=True)
        self.chunk_overhead = _positive(chunk_overhead, "chunk_overhead", where, zero=True)
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise InvalidArgumentError(f"{where}: max_chunks {max_chunks!r} must be at least 1")
        self.max_chunks = max_chunks
        if max_segments_per_call is not None and (
                isinstance(max_segments_per_call, bool)
                or not isinstance(max_segments_per_call, int) or max_segments_per_call < 1):
            raise InvalidArgumentError(f"{where}: max_segments_per_call "
                                       f"{max_segments_per_call!r} must be at least 1 or None")
        self.max_segments_per_call = max_segments_per_call
        if isinstance(explore, bool) or not isinstance(explore, int) or explore < 0:
            raise InvalidArgumentError(f"{where}: explore {explore!r} must be at least 0")
        self.explore = explore
        self._lock = threading.Lock()
        self._given: Dict[Any, TransportCosts] = {}
        #: Per peer, per (density, alone): the newest writes.
        self._writes: Dict[Any, Dict[Tuple[int, bool], Deque[Tuple[int, int, int, float]]]] = {}
        self._fitted: Dict[Any, Optional[TransportCosts]] = {}
        #: Per peer: the CPU share of this process during the writes timed alone.
        self._cpu: Dict[Any, Deque[float]] = {}
        #: Peers whose costs were fitted to writes timed alone.
        self._fit_alone: set = set()
        #: Writes per peer since its last fit, and those timed alone.
        self._new: Dict[Any, int] = {}
        self._new_alone: Dict[Any, int] = {}
        self._explored: Dict[Any, int] = {}
        #: Bytes per second of the packs and unpacks observed: [not alone, alone].
        self._packs = (deque(maxlen=COPY_WINDOW), deque(maxlen=COPY_WINDOW))
        self._unpacks = (deque(maxlen=COPY_WINDOW), deque(maxlen=COPY_WINDOW))
        self._measured: Optional[CopyCosts] = None

    # -- figures --

    def set_transport(self, peer: Any, costs: Optional[TransportCosts]) -> None:
        """Gives the transport's costs to ``peer`` (None: back to the fitted ones)."""
        if costs is not None and not isinstance(costs, TransportCosts):
            raise TypeError("set_transport: costs must be a TransportCosts or None")
        with self._lock:
            if costs is None:
                self._given.pop(peer, None)
            else:
                self._given[peer] = costs

    def observe_write(self, peer: Any, segments: int, nbytes: int, calls: int,
                      seconds: float, *, alone: bool = True,
                      cpu_seconds: Optional[float] = None) -> None:
        """Records one write to ``peer``: its segments, bytes, engine calls and seconds (a
        Streamer records each chunk's). ``alone``: no pack or other write of this rank ran
        meanwhile; the fit prefers such writes (their time is the write's own, which the
        model's pipeline then shares out), and takes the others while those do not suffice.
        ``cpu_seconds``: the CPU time this process spent meanwhile (all its threads: the
        engine's own included); over the writes timed alone, its median share of the write's
        time is the transport's ``host_cores``."""
        if segments <= 0 or nbytes <= 0 or calls <= 0 or not 0 < seconds < math.inf:
            return
        if alone and cpu_seconds is not None and 0 <= cpu_seconds < math.inf:
            with self._lock:
                self._cpu.setdefault(peer, deque(maxlen=COPY_WINDOW)).append(
                    cpu_seconds / seconds)
        density = (round(math.log2(segments / nbytes)), bool(alone))
        with self._lock:
            windows = self._writes.setdefault(peer, {})
            window = windows.pop(density, None) or deque(maxlen=WINDOW)
            window.append((int(calls), int(segments), int(nbytes), float(seconds)))
            windows[density] = window  # the most recently observed density last
            while len(windows) > MAX_DENSITIES:
                del windows[next(iter(windows))]
            self._new[peer] = self._new.get(peer, 0) + 1
            if alone:
                self._new_alone[peer] = self._new_alone.get(peer, 0) + 1

    def observe_copy(self, kind: str, nbytes: int, seconds: float, *,
                     alone: bool = True) -> None:
        """Records one pack (``kind`` "pack") or unpack ("unpack") of ``nbytes`` staged bytes
        that took ``seconds``; ``alone`` as for :meth:`observe_write`."""
        if kind not in ("pack", "unpack"):
            raise InvalidArgumentError(f"observe_copy: kind {kind!r} is neither 'pack' nor "
                                       "'unpack'")
        if nbytes <= 0 or not 0 < seconds < math.inf:
            return
        with self._lock:
            (self._packs if kind == "pack" else self._unpacks)[bool(alone)].append(
                nbytes / seconds)

    def observe(self, peer: Any, result: Any) -> None:
        """Records what one transport ``send`` reported (a :class:`~mori_tp.engines.SendResult`:
        its write, and its pack when it packed)."""
        self.observe_write(peer, result.segments, result.bytes, result.calls,
                           result.write_seconds)
        if result.pack_seconds > 0:
            self.observe_copy("pack", result.bytes, result.pack_seconds)

    def transport_costs(self, peer: Any) -> Optional[TransportCosts]:
        """The costs the model uses for ``peer``: given (for it, else for every peer), else
        fitted to its writes; None while unknown."""
        with self._lock:
            given = self._given.get(peer, self.transport)
            if given is not None:
                return given
            fitted = self._fitted.get(peer)
            new = self._new.get(peer, 0)
            # Fitted again: while no fit succeeded, at every write; then every REFIT_WRITES
            # writes, or at once when a fit to overlapped writes may give way to one to writes
            # timed alone.
            stale = fitted is None or new >= REFIT_WRITES or (
                peer not in self._fit_alone and self._new_alone.get(peer, 0) > 0)
            if (peer in self._fitted and not new) or not stale:
                return fitted
            self._new[peer] = 0
            self._new_alone[peer] = 0
            windows = self._writes.get(peer, {})
            alone = [w for (_, solo), window in windows.items() if solo for w in window]
            every = [w for window in windows.values() for w in window]
            shares = list(self._cpu.get(peer, ()))
        # The host cores the engine keeps busy while it writes: measured, else about one.
        host_cores = (min(float(np.median(shares)), float(os.cpu_count() or 1)) if shares
                      else 1.0)
        costs, from_alone = None, False
        for writes, which in ((alone, "writes timed alone"), (every, "writes")):
            result = _fit(writes)
            if result is not None:
                per_call, per_segment, per_byte = result
                cores = (f"; host cores: this process's CPU share while it wrote alone "
                         f"({len(shares)} writes)" if shares else "")
                costs = TransportCosts(per_segment,
                                       1.0 / per_byte if per_byte > 0 else math.inf,
                                       per_call, host_cores,
                                       source=f"fitted to {len(writes)} {which}{cores}")
                from_alone = writes is alone
                break
        with self._lock:
            self._fitted[peer] = costs
            if from_alone:
                self._fit_alone.add(peer)
            else:
                self._fit_alone.discard(peer)
        return costs

    def copy_costs(self) -> CopyCosts:
        """The copy speeds the model uses: given, else the median of the packs (and unpacks)
        observed, else one host pack and unpack measured now (once)."""
        with self._lock:
            if self.copy is not None:
                return self.copy
            # The copies timed alone, else all.
            packs = list(self._packs[1]) or list(self._packs[0])
            unpacks = list(self._unpacks[1]) or list(self._unpacks[0])
            measured = self._measured
        if packs:
            pack = float(np.median(packs))
            unpack = float(np.median(unpacks)) if unpacks else None
            return CopyCosts(pack, unpack, source=f"observed: {len(packs)} packs, "
                                                  f"{len(unpacks)} unpacks (timed alone where "
                                                  "there were such)")
        if measured is None:
            measured = CopyCosts.measure_host()
            with self._lock:
                self._measured = measured
        if unpacks:
            return CopyCosts(measured.pack_bytes_per_second, float(np.median(unpacks)),
                             source=f"{measured.source}; {len(unpacks)} unpacks observed")
        return measured

    def rank_cores(self, transport: TransportCosts, copy: CopyCosts) -> Tuple[float, str]:
        """The host cores each rank's copies and the transport share, and where the figure
        comes from (the constructor's ``cores``)."""
        if self.cores_given or not copy.on_host:
            return self.cores, "given" if self.cores_given else "default"
        with self._lock:
            alone, beside = list(self._packs[1]), list(self._packs[0])
        if len(alone) < MIN_PACKS or len(beside) < MIN_PACKS:
            return self.cores, "default"
        slowdown = float(np.median(alone)) / float(np.median(beside))
        demand = 1.0 + transport.host_cores
        # Never more than the host has: a rank's stages cannot run on cores it lacks.
        host = float(os.cpu_count() or 1)
        if slowdown <= 1.0:
            return min(host, max(self.cores, demand)), (
                f"measured: packs beside a write as fast as alone ({len(beside)} and "
                f"{len(alone)} packs)")
        return min(host, max(0.1, demand / slowdown)), (
            f"measured: packs beside a write {slowdown:.2f}x slower than alone ({len(beside)} "
            f"and {len(alone)} packs)")

    # -- estimates --

    def estimate(self, staging: Staging, chunks: int, segments: int, nbytes: int,
                 transport: TransportCosts, copy: CopyCosts,
                 cores: Optional[float] = None) -> Estimate:
        """The predicted time of a request of ``nbytes`` bytes and ``segments`` segments (all
        buffers) in mode ``staging`` and ``chunks`` chunks (the formula in the module docs),
        with ``cores`` host cores per rank (default: :meth:`rank_cores`)."""
        staging = Staging(staging)
        if cores is None:
            cores = self.rank_cores(transport, copy)[0]
        seconds, pack, write, unpack = self._seconds(staging, chunks, segments, nbytes,
                                                     transport, copy, cores)
        return Estimate(staging, chunks, segments, seconds, pack, write, unpack)

    def _seconds(self, staging: Staging, n: int, segments: int, nbytes: int,
                 transport: TransportCosts, copy: CopyCosts, cores: float
                 ) -> Tuple[float, float, float, float]:
        """(total, pack, write with its calls, unpack) seconds: :meth:`estimate`'s figures."""
        pack = (nbytes / copy.pack_bytes_per_second + n * copy.per_call) if staging.packs \
            else 0.0
        unpack = (nbytes / copy.unpack_speed + n * copy.per_call) if staging.unpacks else 0.0
        write = segments * transport.per_segment + nbytes / transport.bytes_per_second
        calls = n
        if self.max_segments_per_call is not None:
            calls = max(n, -(-segments // self.max_segments_per_call))
        total = pack + write + unpack
        pipelined = total / n + (n - 1) / n * max(pack, write, unpack)
        host = copy.on_host
        shared = transport.host_cores * write
        busy = max((pack if host else 0.0) + shared,
                   (unpack if host else 0.0) + shared) / cores
        fixed = calls * transport.per_call
        return (min(max(pipelined, busy), total) + fixed + n * self.chunk_overhead, pack,
                write + fixed, unpack)

    def best_chunks(self, staging: Staging, segments: int, nbytes: int, num_buffers: int,
                    transport: TransportCosts, copy: CopyCosts,
                    cores: Optional[float] = None) -> Estimate:
        """The mode's estimate in its cheapest chunk count (1 to ``max_chunks``, at most the
        buffers): the fewest chunks whose estimate is within ``tolerance`` of the least."""
        staging = Staging(staging)
        if cores is None:
            cores = self.rank_cores(transport, copy)[0]
        counts = range(1, max(1, min(num_buffers, self.max_chunks)) + 1)
        times = [self._seconds(staging, n, segments, nbytes, transport, copy, cores)[0]
                 for n in counts]
        least = min(times)
        best = next(n for n, t in zip(counts, times) if t <= least * (1 + self.tolerance))
        return self.estimate(staging, best, segments, nbytes, transport, copy, cores)

    def choose(self, peer: Any, config: Union[SliceConfig, PairConfig],
               request: Union[Request, Any], dst_pages: Any = None, *, num_buffers: int,
               remote_staging: Optional[int] = None, modes: Optional[Iterable[Any]] = None,
               request_id: Optional[str] = None) -> Choice:
        """The staging mode and chunk count for one request to ``peer``: the cheapest estimate
        once the transport's costs are known, else staging_for's mode (or, while exploring,
        the allowed mode with the fewest segments). ``request`` and ``dst_pages`` as for
        :func:`~mori_tp.engines.plan_request`. ``remote_staging``: bytes of the staging slot the
        decode rank offered for this request (None: as much as any mode needs); DST and BOTH
        are considered only when it holds ``num_buffers * staging_len``. ``modes``: the modes
        allowed (default all four). Logs the choice and its figures at debug level.

        Raises:
            InvalidArgumentError: no mode allowed, a bad buffer count, or a config and pages the
                library refuses (as plan_request would).
        """
        where = "CostModel.choose"
        if isinstance(num_buffers, bool) or not isinstance(num_buffers, int) or num_buffers < 1:
            raise InvalidArgumentError(f"{where}: num_buffers {num_buffers!r} must be at least 1")
        allowed = [Staging(m) for m in (Staging if modes is None else modes)]
        length = _staging_len(config, request)
        need = num_buffers * length
        if remote_staging is not None and remote_staging < need:
            allowed = [m for m in allowed if not m.unpacks]
        if not allowed:
            raise InvalidArgumentError(
                f"{where}: request {request_id or ''}: no staging mode allowed (modes "
                f"{[Staging(m).name for m in (modes or ())]}, a decode slot of "
                f"{remote_staging} bytes where DST and BOTH need {need})")
        rule = _rule(config)
        nbytes = need
        per_buffer = segment_counts(config, request, dst_pages, allowed)
        segments = {m: n * num_buffers for m, n in per_buffer.items()}
        fallback = rule if rule in allowed else min(allowed, key=lambda m: (segments[m], m))
        auto = _rule_chunks(num_buffers, length)
        transport = self.transport_costs(peer) if nbytes else None
        if transport is None:
            fewest = min(allowed, key=lambda m: (segments[m], m))
            with self._lock:
                tried = self._explored.get(peer, 0)
                explore = (nbytes > 0 and tried < self.explore and fewest is not fallback
                           and segments[fewest] * DENSITY_SPREAD <= segments[fallback])
                if explore:
                    self._explored[peer] = tried + 1
            # Exploring: the fallback and the fewest segments in turn, every other pair of them in
            # another chunk count, so that the writes differ in bytes per call too.
            pick, chunks = fallback, auto
            if explore:
                pick = fewest if tried % 2 == 1 else fallback
                if tried // 2 % 2 == 1:
                    chunks = 1 if auto > 1 else min(2, num_buffers)
            reason = "exploring" if explore and (pick, chunks) != (fallback, auto) \
                else "fallback"
            choice = Choice(pick, chunks, reason, nbytes, num_buffers, segments, rule=rule)
        else:
            copy = self.copy_costs()
            cores, cores_source = self.rank_cores(transport, copy)
            estimates = tuple(self.best_chunks(m, segments[m], nbytes, num_buffers, transport,
                                               copy, cores) for m in allowed)
            best = min(estimates, key=lambda e: (e.seconds, e.staging is not rule, e.staging))
            choice = Choice(best.staging, best.chunks, "model", nbytes, num_buffers, segments,
                            estimates, transport, copy, rule, cores, cores_source)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s to %s: %s", request_id or "-", peer, choice.describe())
        return choice

    def chunks_for(self, peer: Any, staging: Staging, segments: int, nbytes: int,
                   num_buffers: int) -> int:
        """The cheapest chunk count for a request already planned in ``staging`` (its
        ``segments`` and ``nbytes`` over all ``num_buffers`` buffers): the model's once the
        peer's costs are known, else :func:`~mori_tp.engines.chunk_ranges`' rule."""
        transport = self.transport_costs(peer) if nbytes else None
        if transport is None:
            return _rule_chunks(num_buffers, nbytes // max(num_buffers, 1))
        return self.best_chunks(staging, segments, nbytes, num_buffers, transport,
                                self.copy_costs()).chunks


def _rule_chunks(num_buffers: int, bytes_per_buffer: int) -> int:

    return len(chunk_ranges(num_buffers, bytes_per_buffer)) if num_buffers else 1

