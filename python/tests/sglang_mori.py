"""SGLang's mori disaggregation backend, its real code, with and without the mori_tp plugin.

Run with the Python of a venv that has SGLang 0.5.23 (.ci/sglang-venv makes one; tests/sglang.rs
runs this file from ``cargo test``)::

    PYTHONPATH=python MORI_TP_LIBRARY=target/release/libmori_tp.so \\
        /var/cache/mori-tp/venv-sglang-0.5.23/bin/python python/tests/sglang_mori.py

Exits 77 (skipped) when SGLang is not importable. Only AMD's ``mori`` module (MORI-IO: a ROCm
build, no CPU wheel) is replaced, by the minimal in-process fake below: its ``IOEngine.batch_write``
applies every (local offset, remote offset, size) write to byte buffers and counts how often each
destination byte is written. Everything else is SGLang's code from the venv:
``CommonKVManager._resolve_rank_mapping`` (decode side: which prefill ranks a decode rank pulls
from) and ``MoriKVManager.send_kvcache`` (prefill side: descriptors per layer, the slice config,
the transfer plan, ``batch_write``), on managers whose state is set by hand instead of by a
bootstrap handshake.

Layouts: every (H, P, D) with H KV heads in (1, 2, 3, 4, 8, 16), prefill and decode TP sizes P != D
in (1, 2, 3, 4, 6, 8, 16), each dividing H or a multiple of it: 138. Two layers of K and V, pages
of 2 token slots, 4 bytes per head, a request of 4 page pairs (a run of two among them); every
source byte names its buffer, global head, page and slot, and every destination byte starts as a
sentinel, so a wrong, missing, stray or repeated write is seen.

1. Without the plugin (a negative control: it must find SGLang 0.5.23's defects, or this test is
   not testing anything): the 13 layouts listed in SGLANG_WRONG get wrong bytes, with no error;
   among the others, the 41 where a decode byte is written by several prefill ranks (all with
   P > H) get the right bytes but duplicate writes; the rest are right. 4 KV heads, prefill TP 2,
   decode TP 8 (the case older SGLang releases got wrong) is right.
2. The plugin is loaded through SGLang's own mechanism: an entry point in the group
   ``sglang.srt.plugins`` (as pyproject.toml declares it, read from there) found by
   ``sglang.srt.plugins.load_plugins()``, which applies its ``HookRegistry`` hooks.
3. With it: the 20 layouts whose TP sizes divide neither way (the 13, and 7 that SGLang gets
   right by the accident of H = 1) are refused with mori_tp.TopologyError and its message, and
   write nothing; every other layout gets every byte right and each exactly once. Through
   SGLang's prefill transfer worker (MoriKVManager._transfer_worker, with only its ZMQ status
   push to decode recorded instead of sent), a refused request fails with mori-tp's exception
   and message as the reason decode is told, and a valid one succeeds byte-exact. SGLang's
   head-slice helper agrees with mori-tp's pairs, and with SGLang's own wherever one TP size
   divides the other.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import tempfile
import time
import types
from types import SimpleNamespace as NS

SKIPPED = 77
HB = 4  # bytes per head per token slot
PS = 2  # token slots per page
LAYERS = 2
NPAGES = 8
SRC_PAGES = (5, 1, 2, 6)
DST_PAGES = (0, 3, 4, 2)  # pages 1, 2 -> 3, 4 form a run
SENTINEL = 0xEE
HEADS = (1, 2, 3, 4, 8, 16)
SIZES = (1, 2, 3, 4, 6, 8, 16)
#: The layouts (H, P, D) that SGLang 0.5.23's mori path gets wrong bytes for (the trial recorded
#: in the issue found the same 13).
SGLANG_WRONG = {
    (1, 2, 3), (1, 3, 4), (1, 3, 8), (1, 3, 16), (1, 4, 6), (1, 6, 8), (1, 6, 16),
    (2, 4, 6), (2, 6, 4), (2, 6, 8), (2, 6, 16), (2, 8, 6), (2, 16, 6),
}
SGLANG_DUPLICATED = 41


class _Status:
    """mori.cpp.TransferStatus: the fake completes every write at once."""

    def Succeeded(self) -> bool:  # noqa: N802 (MORI-IO's names)
        return True

    def Failed(self) -> bool:  # noqa: N802
        return False

    def InProgress(self) -> bool:  # noqa: N802
        return False

    def Message(self) -> str:  # noqa: N802
        return ""


class _StatusCode:
    """mori.io.StatusCode, the values SGLang compares wait_all's result with."""

    SUCCESS = 0
    IN_PROGRESS = 1


class _MemoryDesc:
    """mori.io.MemoryDesc: one registered buffer (a numpy uint8 array) and a write count per
    byte."""

    def __init__(self, buf):
        import numpy as np

        self.buf = buf
        self.writes = np.zeros(buf.size, np.int32)


class _Engine:
    """mori.io.IOEngine: batch_write applies each write to the registered buffers at once, so
    wait_all has nothing to wait for."""

    def __init__(self):
        self.uid = 0
        self.calls = 0

    def wait_all(self, statuses, timeout_ms=None) -> int:
        return _StatusCode.SUCCESS

    def allocate_transfer_uid(self) -> int:
        self.uid += 1
        return self.uid

    def batch_write(self, src_descs, local_offsets, dst_descs, remote_offsets, sizes, uids):
        assert len({len(src_descs), len(local_offsets), len(dst_descs), len(remote_offsets),
                    len(sizes), len(uids)}) == 1, "batch_write: lists of different lengths"
        statuses = []
        for src, los, dst, ros, szs in zip(src_descs, local_offsets, dst_descs, remote_offsets,
                                           sizes):
            assert len(los) == len(ros) == len(szs)
            for lo, ro, sz in zip(los, ros, szs):
                # RDMA would write outside the region: fail loudly instead.
                assert 0 <= lo and lo + sz <= src.buf.size, (lo, sz, src.buf.size)
                assert 0 <= ro and ro + sz <= dst.buf.size, (ro, sz, dst.buf.size)
                dst.buf[ro:ro + sz] = src.buf[lo:lo + sz]
                dst.writes[ro:ro + sz] += 1
            self.calls += 1
            statuses.append(_Status())
        return statuses


def install_fake_mori() -> None:
    """Puts the fake ``mori``, ``mori.cpp`` and ``mori.io`` into sys.modules."""
    cpp = types.ModuleType("mori.cpp")
    cpp.TransferStatus = _Status
    io = types.ModuleType("mori.io")
    for name in ("BackendType", "EngineDesc", "IOEngineConfig", "MemoryLocationType",
                 "PollCqMode", "RdmaBackendConfig"):
        setattr(io, name, type(name, (), {}))
    io.IOEngine = _Engine
    io.StatusCode = _StatusCode
    io.MemoryDesc = _MemoryDesc
    package = types.ModuleType("mori")
    package.__path__ = []
    package.cpp, package.io = cpp, io
    sys.modules.update({"mori": package, "mori.cpp": cpp, "mori.io": io})


def heads_of(rank: int, tp: int, heads: int):
    if tp <= heads:
        n = heads // tp
        return list(range(rank * n, rank * n + n))
    return [rank // (tp // heads)]


def source_buffers(np, rank, tp, heads):
    """K then V of every layer: byte (buffer + 1, head + 1, page + 1, slot + 1) per head."""
    own = heads_of(rank, tp, heads)
    out = []
    for b in range(2 * LAYERS):
        buf = np.zeros((NPAGES, PS, len(own), HB), np.uint8)
        for page, slot, (j, h) in itertools.product(range(NPAGES), range(PS), enumerate(own)):
            buf[page, slot, j] = (b + 1, h + 1, page + 1, slot + 1)
        out.append(buf.reshape(-1))
    return out


def expected_buffers(np, rank, tp, heads):
    own = heads_of(rank, tp, heads)
    out = []
    for b in range(2 * LAYERS):
        buf = np.full((NPAGES, PS, len(own), HB), SENTINEL, np.uint8)
        for (sp, dp), slot, (j, h) in itertools.product(zip(SRC_PAGES, DST_PAGES), range(PS),
                                                        enumerate(own)):
            buf[dp, slot, j] = (b + 1, h + 1, sp + 1, slot + 1)
        out.append(buf.reshape(-1))
    return out


def item_len(rank, tp, heads):
    return PS * len(heads_of(rank, tp, heads)) * HB


def layouts():
    valid = lambda h, t: h % t == 0 or t % h == 0  # noqa: E731
    for h, p, d in itertools.product(HEADS, SIZES, SIZES):
        if p != d and valid(h, p) and valid(h, d):
            yield h, p, d


def targets(conn, prefill_tp, decode_tp, d):
    """SGLang's decode side: the prefill ranks decode rank d pulls from."""
    manager = object.__new__(conn.CommonKVManager)
    manager.attn_tp_size, manager.kv_args = decode_tp, NS(engine_rank=d)
    manager.is_mla_backend = manager.is_hybrid_mla_backend = False
    manager.attn_cp_size, manager.attn_cp_rank, manager.pp_size, manager.pp_rank = 1, 0, 1, 0
    manager.enable_all_cp_ranks_for_transfer = False
    info = conn.PrefillServerInfo(attn_tp_size=prefill_tp, attn_cp_size=1, dp_size=1, pp_size=1,
                                  page_size=PS, kv_cache_dtype="auto", follow_bootstrap_room=True)
    manager._resolve_rank_mapping(info)
    return info.target_tp_ranks


def move(np, conn, mori_conn, heads, prefill_tp, decode_tp):
    """Every decode rank pulls from the prefill ranks SGLang maps it to; each of them runs
    MoriKVManager.send_kvcache into the fake engine. Returns (wrong bytes, bytes written more
    than once, [exceptions raised], write calls, (prefill, decode) pairs run)."""
    wrong = duplicated = calls = pairs = 0
    errors = []
    for d in range(decode_tp):
        expected = expected_buffers(np, d, decode_tp, heads)
        dst = [_MemoryDesc(np.full(e.size, SENTINEL, np.uint8)) for e in expected]
        for p in targets(conn, prefill_tp, decode_tp, d):
            engine = _Engine()
            manager = object.__new__(mori_conn.MoriKVManager)
            manager.attn_tp_size = prefill_tp
            manager.is_mla_backend = manager.is_hybrid_mla_backend = False
            manager.kv_args = NS(page_size=PS, kv_item_lens=[item_len(p, prefill_tp, heads)]
                                 * (2 * LAYERS), total_kv_head_num=heads,
                                 kv_head_num=len(heads_of(p, prefill_tp, heads)), engine_rank=p,
                                 prefill_start_layer=0, kv_layer_ids=[])
            manager.kv_mem_descs = [_MemoryDesc(b)
                                    for b in source_buffers(np, p, prefill_tp, heads)]
            manager.engine = engine
            manager._submission_local = mori_conn._SubmissionLocal()
            peer = mori_conn.KVArgsRegisterInfo(
                endpoint="127.0.0.1", dst_port=0, engine_desc=None, dst_kv_mem_descs=dst,
                dst_aux_mem_descs=[], dst_state_mem_descs=[], gpu_id=0,
                decode_tp_size=decode_tp, decode_tp_rank=d,
                dst_kv_item_len=item_len(d, decode_tp, heads), dst_state_item_lens=[],
                dst_state_dim_per_tensor=[])
            try:
                manager.send_kvcache(peer, np.array(SRC_PAGES, np.int32),
                                     np.array(DST_PAGES, np.int32))
            except Exception as error:  # noqa: BLE001 - recorded and checked by the caller
                errors.append(error)
            calls += engine.calls
            pairs += 1
        for desc, e in zip(dst, expected):
            wrong += int(np.count_nonzero(desc.buf != e))
            duplicated += int(np.count_nonzero(desc.writes > 1))
    return wrong, duplicated, errors, calls, pairs


def through_transfer_worker(np, mori_conn, heads, prefill_tp, decode_tp, p, d):
    """One request chunk through SGLang's MoriKVManager._transfer_worker (the prefill rank's
    worker loop: _process_transfer_chunk, _submit_kv_transfer, send_kvcache, then
    conclude_transfer), with the room's state set as a bootstrap would. Only the ZMQ push of the
    request's status to the decode rank (send_kv_status_message) is replaced, on this instance,
    by a recorder. Returns (statuses pushed, the decode buffers, the room's final status)."""
    import queue
    import threading

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    room = 7
    manager = object.__new__(mori_conn.MoriKVManager)
    manager.attn_tp_size = prefill_tp
    manager.is_mla_backend = manager.is_hybrid_mla_backend = False
    manager.kv_args = NS(page_size=PS, kv_item_lens=[item_len(p, prefill_tp, heads)] * (2 * LAYERS),
                         total_kv_head_num=heads, kv_head_num=len(heads_of(p, prefill_tp, heads)),
                         engine_rank=p, prefill_start_layer=0, kv_layer_ids=[])
    manager.kv_mem_descs = [_MemoryDesc(b) for b in source_buffers(np, p, prefill_tp, heads)]
    manager.engine = _Engine()
    manager._submission_local = mori_conn._SubmissionLocal()
    manager.disaggregation_mode = DisaggregationMode.PREFILL
    manager.enable_deferred_decode_kv_release = False
    manager.request_status = {room: KVPoll.WaitingForInput}
    manager.transfer_lock, manager.failure_lock = threading.Lock(), threading.Lock()
    manager.failure_records = {}
    manager.deferred_bootstrap = None
    manager._transfer_timeout_ms, manager._wait_poll_ms = 10000, 10
    dst = [_MemoryDesc(np.full(e.size, SENTINEL, np.uint8))
           for e in expected_buffers(np, d, decode_tp, heads)]
    manager.decode_kv_args_table = {"decode": mori_conn.KVArgsRegisterInfo(
        endpoint="127.0.0.1", dst_port=1, engine_desc=NS(key="decode"), dst_kv_mem_descs=dst,
        dst_aux_mem_descs=[], dst_state_mem_descs=[], gpu_id=0, decode_tp_size=decode_tp,
        decode_tp_rank=d, dst_kv_item_len=item_len(d, decode_tp, heads), dst_state_item_lens=[],
        dst_state_dim_per_tensor=[])}
    manager.transfer_infos = {room: {"decode": NS(
        engine_key="decode", is_dummy=False, dst_kv_indices=np.array(DST_PAGES, np.int32),
        endpoint="127.0.0.1", dst_port=1)}}
    pushed = []
    manager.send_kv_status_message = lambda **message: pushed.append(message)
    chunk = NS(room=room, prefill_kv_indices=np.array(SRC_PAGES, np.int32),
               index_slice=slice(0, len(SRC_PAGES)), is_last_chunk=True, prefill_aux_index=None,
               state_indices=None, num_kv_tokens=None, wait_event=None)
    work = queue.Queue()
    work.put(chunk)
    work.put(None)  # the worker's stop sentinel
    manager._transfer_worker(work)
    return pushed, dst, manager.request_status[room]


def refusal(heads, prefill_tp, decode_tp):
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    return (
        "mori_tp.sglang: MoriKVManager._build_tp_slice_config: prefill attention TP size "
        f"{prefill_tp} and decode attention TP size {decode_tp} divide neither way: SGLang's "
        "decode side (CommonKVManager._resolve_rank_mapping) picks the prefill ranks it pulls "
        f"from by integer division ({big} // {small} = {big // small}), so some decode heads "
        "would come from ranks that do not hold them, or from none; choose TP sizes where one "
        "is a multiple of the other"
    )


def load_plugin_through_sglang():
    """Declares the plugin as pyproject.toml does (a dist-info with its entry points, on
    sys.path) and has SGLang's load_plugins() find, run and apply it."""
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        groups = tomllib.load(f)["project"]["entry-points"]
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {value}" for name, value in entries.items())
    site = tempfile.mkdtemp(prefix="mori-tp-sglang-plugin-")
    info = os.path.join(site, "mori_tp-0.0.0.dist-info")
    os.mkdir(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: mori-tp\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    sys.path.insert(0, site)
    from sglang.srt import plugins

    assert "sglang.srt.plugins" in groups and groups["sglang.srt.plugins"].get(
        "mori_tp") == "mori_tp.sglang:register", groups
    plugins.load_plugins()


def main() -> int:
    try:
        import numpy as np

        install_fake_mori()
        from sglang.srt.disaggregation.common import conn
        from sglang.srt.disaggregation.common import staging_buffer
        from sglang.srt.disaggregation.mori import conn as mori_conn
        import sglang
    except ImportError as error:
        print(f"SGLang is not importable here ({error}): run this with the Python of "
              f".ci/sglang-venv's venv")
        return SKIPPED
    import mori_tp
    import mori_tp.sglang as plugin

    passed = failed = 0

    def check(name, ok, detail=""):
        nonlocal passed, failed
        if ok:
            passed += 1
            print(f"ok: {name}")
        else:
            failed += 1
            print(f"FAIL: {name}: {detail}")

    start = time.monotonic()
    print(f"sglang {sglang.__version__}, mori_tp {mori_tp.__version__}")
    check("SGLang is the pinned 0.5.23", sglang.__version__ == "0.5.23", sglang.__version__)
    all_layouts = list(layouts())
    check("138 layouts", len(all_layouts) == 138, len(all_layouts))
    ratio = {(h, p, d) for h, p, d in all_layouts if p % d and d % p}
    original_helper = staging_buffer.compute_head_slice_params

    # 1. SGLang alone.
    wrong, duplicated, raised = set(), set(), []
    for layout in all_layouts:
        w, dup, errors, _, _ = move(np, conn, mori_conn, *layout)
        raised += [(layout, e) for e in errors]
        if w:
            wrong.add(layout)
        elif dup:
            duplicated.add(layout)
    check("without the plugin nothing raises", not raised, raised[:3])
    check("without the plugin exactly the 13 layouts of SGLANG_WRONG get wrong bytes",
          wrong == SGLANG_WRONG, sorted(wrong ^ SGLANG_WRONG))
    check("they are all layouts whose TP sizes divide neither way", wrong <= ratio,
          sorted(wrong - ratio))
    check(f"without the plugin {SGLANG_DUPLICATED} layouts get right bytes written several times",
          len(duplicated) == SGLANG_DUPLICATED, len(duplicated))
    check("each with prefill TP above the head count",
          all(p > h for h, p, _ in duplicated), sorted(duplicated))
    check("H=4, prefill TP 2 -> decode TP 8 is right in 0.5.23 (older releases: half wrong)",
          (4, 2, 8) not in wrong | duplicated)
    print(f"without the plugin: {len(wrong)} wrong, {len(duplicated)} duplicated, "
          f"{len(all_layouts) - len(wrong) - len(duplicated)} right")

    # 2. The plugin, through SGLang's plugin loader.
    load_plugin_through_sglang()
    replaced = {
        "_build_tp_slice_config": plugin.build_tp_slice_config,
        "_build_tp_slice_transfer_plan": plugin.build_tp_slice_transfer_plan,
    }
    for name in replaced:
        function = mori_conn.MoriKVManager.__dict__[name]
        check(f"load_plugins replaced MoriKVManager.{name}",
              getattr(function, "__wrapped__", None) is not None
              and function.__wrapped__.__qualname__ == f"MoriKVManager.{name}", function)
    check("load_plugins replaced compute_head_slice_params",
          staging_buffer.compute_head_slice_params is not original_helper)

    # 3. SGLang with the plugin.
    bad = []
    refused = set()
    for layout in all_layouts:
        w, dup, errors, calls, pairs = move(np, conn, mori_conn, *layout)
        if layout in ratio:
            expected = refusal(*layout)
            if (len(errors) == pairs and all(type(e) is mori_tp.TopologyError and e.code == 3
                               and str(e) == expected for e in errors)
                    and calls == 0):
                refused.add(layout)
            else:
                bad.append((layout, w, dup, calls, errors[:1]))
        elif errors or w or dup:
            bad.append((layout, w, dup, calls, errors[:1]))
    check(f"with the plugin the {len(ratio)} layouts whose TP sizes divide neither way are "
          "refused with mori_tp.TopologyError and write nothing", refused == ratio and
          SGLANG_WRONG <= refused, sorted(ratio - refused))
    check("with the plugin every other layout gets every byte right, each written once",
          not bad, bad[:5])

    # What the decode rank is told, through SGLang's prefill transfer worker.
    import logging

    from sglang.srt.disaggregation.base.conn import KVPoll

    logging.getLogger(mori_conn.__name__).disabled = True  # the worker logs the traceback
    pushed, dst, status = through_transfer_worker(np, mori_conn, 2, 6, 4, 0, 0)
    check("through SGLang's transfer worker, prefill TP 6 -> decode TP 4 fails the request with "
          "mori-tp's exception and message as the reason the decode rank gets, writing nothing",
          status == KVPoll.Failed and len(pushed) == 1
          and pushed[0]["status"] == KVPoll.Failed
          and pushed[0]["failure_reason"] == f"transfer worker raised: "
          f"TopologyError({refusal(2, 6, 4)!r})"
          and all((desc.buf == SENTINEL).all() for desc in dst), (status, pushed))
    logging.getLogger(mori_conn.__name__).disabled = False
    pushed, dst, status = through_transfer_worker(np, mori_conn, 4, 2, 8, 0, 3)
    expected = expected_buffers(np, 3, 8, 4)
    check("through SGLang's transfer worker, prefill rank 0 of TP 2 -> decode rank 3 of TP 8 "
          "(4 heads) succeeds byte-exact",
          status == KVPoll.Success and [m["status"] for m in pushed] == [KVPoll.Success]
          and all((desc.buf == e).all() and desc.writes.max() == 1
                  for desc, e in zip(dst, expected)), (status, pushed))

    # The head-slice helper against mori-tp's pairs, on every pair of every valid-ratio layout.
    mismatched, changed = [], []
    for h, p_tp, d_tp in all_layouts:
        if (h, p_tp, d_tp) in ratio:
            continue
        for p, d in itertools.product(range(p_tp), range(d_tp)):
            pair = mori_tp.slice_config(
                prefill_tp_size=p_tp, prefill_tp_rank=p, decode_tp_size=d_tp, decode_tp_rank=d,
                total_kv_heads=h, page_size=1, src_item_len=len(heads_of(p, p_tp, h)) * HB,
                dst_item_len=len(heads_of(d, d_tp, h)) * HB)
            got = staging_buffer.compute_head_slice_params(p_tp, d_tp, p, d, h)
            if pair.action is mori_tp.Action.SEND:
                want = (pair.src_head_slice_offset // HB, pair.num_heads,
                        pair.dst_head_slice_offset // HB, pair.num_heads)
            else:
                want = original_helper(p_tp, d_tp, p, d, h)
            if got != want:
                mismatched.append(((h, p_tp, d_tp, p, d), got, want))
            if got != original_helper(p_tp, d_tp, p, d, h):
                changed.append(((h, p_tp, d_tp, p, d), got, original_helper(p_tp, d_tp, p, d, h)))
    check("the replaced compute_head_slice_params gives mori-tp's heads for every SEND pair",
          not mismatched, mismatched[:5])
    check("where one TP size divides the other it agrees with SGLang 0.5.23's helper, which "
          "the Mooncake and NIXL backends also call", not changed, changed[:5])
    try:
        staging_buffer.compute_head_slice_params(6, 4, 0, 0, 2)
        check("compute_head_slice_params refuses prefill TP 6 -> decode TP 4", False, "no error")
    except mori_tp.TopologyError as error:
        check("compute_head_slice_params refuses prefill TP 6 -> decode TP 4",
              "divide neither way" in str(error), error)
    try:
        staging_buffer.compute_head_slice_params(2, 4, 0, 0, 3)
        check("compute_head_slice_params refuses 3 heads on TP 2 (mori-tp's message)", False,
              "no error")
    except mori_tp.TopologyError as error:
        check("compute_head_slice_params refuses 3 heads on TP 2 (mori-tp's message)",
              "tp_size 2 and total_kv_heads 3 divide neither way" in str(error), error)

    # A dtype mismatch: mori-tp's LayoutMismatchError, nothing written.
    manager = object.__new__(mori_conn.MoriKVManager)
    manager.attn_tp_size = 2
    manager.kv_args = NS(page_size=PS, kv_item_lens=[PS * 2 * 256], total_kv_head_num=4,
                         kv_head_num=2, engine_rank=0)
    peer = NS(decode_tp_size=4, decode_tp_rank=0, dst_kv_item_len=PS * 1 * 128)
    try:
        manager._build_tp_slice_config(peer)
        check("bytes per head that differ are refused", False, "no error")
    except mori_tp.LayoutMismatchError as error:
        check("bytes per head that differ are refused (LayoutMismatchError)",
              "256" in str(error) and "128" in str(error), error)
    manager.kv_args.total_kv_head_num = 0
    try:
        manager._build_tp_slice_config(peer)
        check("an unset total_kv_head_num is refused", False, "no error")
    except mori_tp.InvalidArgumentError as error:
        check("an unset total_kv_head_num is refused (InvalidArgumentError)",
              "total_kv_head_num is 0" in str(error), error)

    print(f"{time.monotonic() - start:.1f} s")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
