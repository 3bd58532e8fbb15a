"""A request of several groups through a transfer engine: one plan, one write, one completion.

A hybrid model's request is a list of :class:`mori_tp.Group` (full-attention KV, a sliding
window, per-token records, state-slot parts...). On the prefill rank each group's ``src_ptrs``
are this rank's buffers and its ``dst_ptrs`` the decode rank's (from the handshake), with both
capacities; the staging regions are one slot per side for the whole request::

    plan = engines.plan_groups(groups, local_staging=slot, local_staging_capacity=n,
                               remote_staging=peer_slot, remote_staging_capacity=m)
    transport.send(peer, plan)       # packs the staged groups, writes every segment at once

    # Decode rank, once the request has landed (its groups carry its own dst_ptrs):
    engines.unpack_groups(groups, staging=peer_slot, staging_capacity=m)

Both ranks size their slots with :func:`mori_tp.groups_info` (``src_staging_bytes``,
``dst_staging_bytes``), which they compute alike from the same groups. A :class:`GroupsPlan`
works with the Mooncake, NIXL and MORI-IO transports' ``send`` (Mooncake and NIXL take its
:meth:`~GroupsPlan.addresses`; MORI-IO writes one batch entry per buffer of each group, from
:meth:`~GroupsPlan.buffer_spans`); it moves whole, so the chunked
:class:`~mori_tp.engines.Streamer` does not take it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

import mori_tp
from mori_tp import Group, GroupInfo, GroupsTotal, InvalidArgumentError, Staging

__all__ = ["GroupsPlan", "plan_groups", "unpack_groups"]


@dataclass(frozen=True)
class GroupsPlan:
    """One request of several groups of one (prefill rank, decode rank) pair, ready for an
    engine: get it from :func:`plan_groups`. :meth:`addresses` gives every segment of every
    buffer of every group as absolute addresses, group after group: one engine write (and one
    notification) moves the whole request."""

    groups: Tuple[Group, ...]
    #: Where each group sits in the request (:func:`mori_tp.groups_info`).
    infos: Tuple[GroupInfo, ...]
    total: GroupsTotal
    #: The prefill rank's staging region for the request (0: none) and its bytes.
    local_staging: int
    local_staging_capacity: int
    #: The decode rank's staging region for the request (0: none) and its bytes.
    remote_staging: int
    remote_staging_capacity: int
    #: Every group's segments, group after group: offsets from each buffer's base, lengths.
    src_offsets: "np.ndarray"
    dst_offsets: "np.ndarray"
    lengths: "np.ndarray"
    #: The decode rank's registration epoch the groups' ``dst_ptrs`` came with (its
    #: KvMemory's ``epoch``), checked by the transports before they write; None: not checked.
    remote_epoch: Optional[int] = None

    @property
    def staging(self) -> Tuple[Staging, ...]:
        """Each group's staging, in group order."""
        return tuple(Staging(group.staging) for group in self.groups)

    @property
    def segments(self) -> int:
        """Segments handed to the engine: each group's segments times its buffers."""
        return self.total.transfer_segments

    @property
    def bytes(self) -> int:
        """Bytes moved, all groups and buffers together."""
        return self.total.bytes

    def pack(self, backend: str = "auto", stream: Optional[int] = None,
             synchronize: bool = True, buffers: Any = None) -> float:
        """Packs every group whose staging is SRC or BOTH into the local staging region
        (:func:`mori_tp.pack_kvcache_groups`); returns the seconds it took. Transports call it
        in ``send``. ``buffers`` (chunks of a pipelined send) is not supported: a request of
        groups moves whole."""
        if buffers is not None:
            raise InvalidArgumentError("GroupsPlan.pack: a request of groups packs whole "
                                       "(buffer ranges apply to one group's buffers)")
        if not any(Staging(g.staging).packs for g in self.groups):
            return 0.0
        start = time.perf_counter()
        mori_tp.pack_kvcache_groups(self.groups, self.local_staging,
                                    staging_capacity=self.local_staging_capacity,
                                    backend=backend, stream=stream, synchronize=synchronize)
        return time.perf_counter() - start

    def buffer_spans(self) -> List[Tuple[int, int, int, int, slice]]:
        """``(group, buffer, src_base, dst_base, span)`` for every buffer of every group with
        segments, group after group: the buffer's base on each side (a staged side's: that
        side's region + the group's staging offset + ``buffer * staging_len``; an unstaged
        side's: the buffer) and the group's slice of :attr:`src_offsets`, :attr:`dst_offsets`
        and :attr:`lengths`. Engines that address each buffer through its own registered
        region (MORI-IO) write one entry per span."""
        spans = []
        for g, (group, info) in enumerate(zip(self.groups, self.infos)):
            if not info.num_segments or not group.num_buffers:
                continue
            span = slice(info.first_segment, info.first_segment + info.num_segments)
            mode = Staging(group.staging)
            for b in range(group.num_buffers):
                part = b * info.staging_len
                if mode.packs:
                    src_base = self.local_staging + info.src_staging_offset + part
                else:
                    src_base = int(group.src_ptrs[b])
                if mode.unpacks:
                    dst_base = self.remote_staging + info.dst_staging_offset + part
                else:
                    dst_base = int(group.dst_ptrs[b])
                spans.append((g, b, src_base, dst_base, span))
        return spans

    def addresses(self, buffers: Any = None) -> Tuple["np.ndarray", "np.ndarray", "np.ndarray"]:
        """``(src, dst, lengths)``: absolute addresses of every segment of every buffer of every
        group, as numpy uint64 arrays (what batch-write APIs take), in :meth:`buffer_spans`
        order."""
        if buffers is not None:
            raise InvalidArgumentError("GroupsPlan.addresses: a request of groups moves whole")
        src, dst, lengths = [], [], []
        for _, _, src_base, dst_base, span in self.buffer_spans():
            src.append(np.uint64(src_base) + self.src_offsets[span])
            dst.append(np.uint64(dst_base) + self.dst_offsets[span])
            lengths.append(self.lengths[span])
        if not lengths:
            empty = np.zeros(0, dtype=np.uint64)
            return empty, empty.copy(), empty.copy()
        return np.concatenate(src), np.concatenate(dst), np.concatenate(lengths)


def plan_groups(groups: Sequence[Group], *, local_staging: int = 0,
                local_staging_capacity: int = 0, remote_staging: int = 0,
                remote_staging_capacity: int = 0,
                remote_epoch: Optional[int] = None) -> GroupsPlan:
    """Plans one request of several groups for a transfer engine, on the prefill rank.

    Checks, before anything moves (:func:`mori_tp.check_groups_transfer`): every group, every
    page of every group within its side's capacity, and each side's staging region holding the
    bytes of the groups that stage it. Every group needs ``src_ptrs`` (this rank's buffers) and
    ``dst_ptrs`` (the decode rank's), whatever its staging. ``remote_epoch``: the decode
    rank's registration epoch those came with; the transports then refuse the plan once the
    peer announces another (:mod:`mori_tp.engines.faults`).

    Raises:
        the errors of :func:`mori_tp.check_groups_transfer`, each naming its group;
        InvalidArgumentError: a group without its pointers.
    """
    groups = tuple(groups)
    for i, group in enumerate(groups):
        if not isinstance(group, Group):
            raise TypeError(f"plan_groups: groups[{i}] must be a mori_tp.Group")
        if group.src_ptrs is None or group.dst_ptrs is None:
            raise InvalidArgumentError(
                f"plan_groups: group {i} needs src_ptrs and dst_ptrs (both ranks' buffers)"
            )
    mori_tp.check_groups_transfer(groups, src_staging_capacity=local_staging_capacity,
                                  dst_staging_capacity=remote_staging_capacity)
    infos, total = mori_tp.groups_info(groups)
    columns = mori_tp.groups_segments(groups, as_arrays=True)
    return GroupsPlan(groups, tuple(infos), total, local_staging, local_staging_capacity,
                      remote_staging, remote_staging_capacity,
                      *(np.ascontiguousarray(column) for column in columns),
                      remote_epoch=remote_epoch)


def unpack_groups(groups: Sequence[Group], *, staging: int = 0, staging_capacity: int = 0,
                  backend: str = "auto", stream: Optional[int] = None,
                  synchronize: bool = True) -> Tuple[Staging, ...]:
    """The decode rank's part of a request of groups, once every segment has landed: unpacks
    every group whose staging is DST or BOTH from the request's staging region (its groups
    carry this rank's ``dst_ptrs``). Returns each group's staging."""
    groups = tuple(groups)
    if any(Staging(g.staging).unpacks for g in groups):
        mori_tp.unpack_kvcache_groups(groups, staging, staging_capacity=staging_capacity,
                                      backend=backend, stream=stream, synchronize=synchronize)
    return tuple(Staging(g.staging) for g in groups)
