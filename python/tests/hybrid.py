"""A synthetic hybrid model for the tests of requests of several groups: layers of full
attention (HND KV pages, and DeepSeek V3.2's per-token indexer record beside them), of sliding
window attention (NHD pages, only the window's pages move) and of Mamba2 (one state slot per
request: the conv state's x, B and C parts and the SSM state); every kind of group the
reference documents, each laid out as its engine lays it out, and an oracle that moves a
request element by element. Pipeline stages take any subset of the layers.

Sources, for the layouts (the strides are the caller's: these follow them):
- SGLang ``python/sglang/srt/layers/attention/nsa/index_buf_accessor.py``: a page of the
  indexer cache holds every token's 128 fp8 key bytes, then every token's 4-byte fp32 scale.
- vLLM ``vllm/model_executor/layers/mamba/mamba_utils.py`` (``mamba2_state_shape``,
  ``get_conv_state_layout``): the conv state is ``conv_dim / tp`` channels by ``state_len``
  rows, DS ``(dim, state_len)`` or SD ``(state_len, dim)``, ``conv_dim = n_heads * head_dim +
  2 * n_groups * d_state`` (x, B, C); the SSM state ``(n_heads / tp, head_dim, d_state)``.
  ``mamba_mixer2.py``: when TP does not divide ``n_groups``, only ``n_groups == 1`` is
  supported and every rank holds that group.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import mori_tp
import pair_oracle
from pair_oracle import element, moved

#: Bytes of one head of the attention KV groups.
KV_HEAD_BYTES = 16


def indexer_parts(tp: int, rank: int, page_size: int) -> Tuple[mori_tp.Layout, mori_tp.Layout]:
    """The keys and the scales of SGLang's indexer page, two per-token records (H = 1) that
    share one buffer: 128 bytes per token at ``t * 128``, 4 bytes at ``page_size * 128 + t *
    4``, 132 bytes per token in all."""
    stride = page_size * (128 + 4)

    def part(head_bytes: int, offset: int) -> mori_tp.Layout:
        return mori_tp.Layout(1, tp, rank, page_size, head_bytes, page_stride=stride,
                              offset=offset, token_stride=head_bytes, head_stride=head_bytes)

    return part(128, 0), part(4, page_size * 128)


@dataclass(frozen=True)
class Mamba:
    """A Mamba2 mixer's state, one slot per request of a per-layer buffer: the conv state
    (x by heads, then B and C by groups), then the SSM state by heads, then padding."""

    n_heads: int = 8
    head_dim: int = 4
    n_groups: int = 1
    d_state: int = 4
    state_len: int = 3
    conv_dtype: int = 2
    ssm_dtype: int = 4
    dim_first: bool = True
    slot_pad: int = 24

    def groups_local(self, tp: int) -> int:
        if self.n_groups % tp == 0:
            return self.n_groups // tp
        assert self.n_groups == 1, "vLLM replicates only a single group"
        return 1

    def conv_dim(self, tp: int) -> int:
        return self.n_heads // tp * self.head_dim + 2 * self.groups_local(tp) * self.d_state

    def conv_bytes(self, tp: int) -> int:
        return self.conv_dim(tp) * self.state_len * self.conv_dtype

    def slot_stride(self, tp: int) -> int:
        ssm = self.n_heads // tp * self.head_dim * self.d_state * self.ssm_dtype
        return self.conv_bytes(tp) + ssm + self.slot_pad

    @property
    def conv_rows(self) -> int:
        """Token slots of the conv state's one page: its rows (SD) or 1 (DS)."""
        return 1 if self.dim_first else self.state_len

    def conv_parts(self, tp: int, rank: int) -> List[mori_tp.Layout]:
        """x (by the heads), B and C (by the groups) of a rank's conv state."""
        slot, dt = self.slot_stride(tp), self.conv_dtype
        x = self.n_heads // tp * self.head_dim
        g = self.groups_local(tp) * self.d_state

        def part(units: int, channels: int, first: int) -> mori_tp.Layout:
            if self.dim_first:
                hb = channels * self.state_len * dt
                return mori_tp.Layout(units, tp, rank, 1, hb, page_stride=slot,
                                      offset=first * self.state_len * dt, token_stride=hb,
                                      head_stride=hb)
            hb = channels * dt
            return mori_tp.Layout(units, tp, rank, self.state_len, hb, page_stride=slot,
                                  offset=first * dt, token_stride=self.conv_dim(tp) * dt,
                                  head_stride=hb)

        return [part(self.n_heads, self.head_dim, 0), part(self.n_groups, self.d_state, x),
                part(self.n_groups, self.d_state, x + g)]

    def ssm_part(self, tp: int, rank: int) -> mori_tp.Layout:
        hb = self.head_dim * self.d_state * self.ssm_dtype
        return mori_tp.Layout(self.n_heads, tp, rank, 1, hb, page_stride=self.slot_stride(tp),
                              offset=self.conv_bytes(tp), token_stride=hb, head_stride=hb)


@dataclass
class Part:
    """One group of a test request: its layouts and pages, and which buffers of which set it
    uses on each side (per-layer buffers: a stage's local layer indices)."""

    name: str
    src: mori_tp.Layout
    dst: mori_tp.Layout
    src_pages: List[int]
    dst_pages: List[int]
    tokens: int
    first_token: int
    set: str
    src_buffers: List[int]
    dst_buffers: List[int]

    def request(self) -> mori_tp.Request:
        return mori_tp.Request(self.src_pages, self.dst_pages, self.tokens)

    def config(self) -> mori_tp.PairConfig:
        return mori_tp.pair_config(self.src, self.dst)


@dataclass(frozen=True)
class Hybrid:
    """A model of layers of kind ``"full"``, ``"swa"`` or ``"mamba"``, served with KV pages of
    ``page_sizes`` (prefill, decode) and indexer pages of ``indexer_pages``."""

    kinds: Tuple[str, ...] = ("full", "swa", "mamba", "full", "swa", "mamba")
    kv_heads: int = 4
    mamba: Mamba = field(default_factory=Mamba)
    page_sizes: Tuple[int, int] = (16, 32)
    indexer_pages: Tuple[int, int] = (64, 64)
    tokens: int = 150
    window: int = 40

    def layers_of(self, kind: str, layers: Sequence[int]) -> List[int]:
        """The positions, among ``layers``, of the layers of ``kind``: a stage's local
        buffer indices of that kind, in layer order."""
        return [layer for layer in layers if self.kinds[layer] == kind]

    def window_start(self) -> int:
        """The window's first token, rounded down to a multiple of both page sizes."""
        a, b = self.page_sizes
        lcm = a * b // _gcd(a, b)
        return max(self.tokens - self.window, 0) // lcm * lcm

    def pages_needed(self, kind: str, side: int) -> int:
        """Pages (or slots) of ``kind`` a request lists on ``side``."""
        if kind == "mamba":
            return 1
        tokens = self.tokens - self.window_start() if kind == "swa" else self.tokens
        size = (self.indexer_pages if kind == "indexer" else self.page_sizes)[side]
        return -(-tokens // size)

    def capacity_pages(self, kind: str, side: int) -> int:
        """Pages (or slots) each buffer of a set holds: a few more than a request needs."""
        return self.pages_needed(kind, side) + 3

    def set_shapes(self, side: int, tp: int, layers: Sequence[int]) -> Dict[str, Tuple[int, int]]:
        """``{set: (buffers, bytes of each)}`` of a rank holding ``layers``."""
        ps, ips = self.page_sizes[side], self.indexer_pages[side]
        local = len(pair_oracle.owned_heads(self.kv_heads, tp, 0))
        kv_page = ps * local * KV_HEAD_BYTES
        full = len(self.layers_of("full", layers))
        swa = len(self.layers_of("swa", layers))
        mamba = len(self.layers_of("mamba", layers))
        cap = lambda kind: self.capacity_pages(kind, side)  # noqa: E731
        return {
            "full": (2 * full, cap("full") * kv_page),
            "swa": (2 * swa, cap("swa") * kv_page),
            "indexer": (full, cap("indexer") * ips * 132),
            "mamba": (mamba, cap("mamba") * self.mamba.slot_stride(tp)),
        }

    def request_pages(self, seed: int) -> Dict[str, Tuple[List[int], List[int]]]:
        """Each kind's page lists on both sides (a request's page table is the same for every
        layer of a kind), and the Mamba slot of each side."""
        rng = random.Random(seed)
        return {kind: tuple(rng.sample(range(self.capacity_pages(kind, side)),
                                       self.pages_needed(kind, side)) for side in (0, 1))
                for kind in ("full", "swa", "indexer", "mamba")}

    def parts(self, pages: Dict[str, Tuple[List[int], List[int]]], p_tp: int, p: int,
              p_layers: Sequence[int], d_tp: int, d: int, d_layers: Sequence[int]) -> List[Part]:
        """The groups of a request from prefill rank ``p`` (holding ``p_layers``) to decode
        rank ``d`` (holding ``d_layers``): the layers both hold, in layer order."""
        shared = [layer for layer in p_layers if layer in d_layers]
        out: List[Part] = []
        sides = ((p_tp, p), (d_tp, d))

        def local(kind: str, layers: Sequence[int], per_layer: int) -> List[int]:
            own = self.layers_of(kind, layers)
            return [own.index(layer) * per_layer + k for layer in self.layers_of(kind, shared)
                    for k in range(per_layer)]

        def buffers(kind: str, per_layer: int) -> Tuple[List[int], List[int]]:
            # K of a layer at 2 * i, V at 2 * i + 1 (per_layer 2).
            return local(kind, p_layers, per_layer), local(kind, d_layers, per_layer)

        def add(name: str, layouts: Sequence[mori_tp.Layout], kind: str, set_name: str,
                tokens: int, first_token: int, per_layer: int) -> None:
            src_b, dst_b = buffers(kind, per_layer)
            if src_b:
                out.append(Part(name, layouts[0], layouts[1], list(pages[set_name][0]),
                                list(pages[set_name][1]), tokens, first_token,
                                "indexer" if set_name == "indexer" else kind, src_b, dst_b))

        ps = self.page_sizes
        add("full attention (HND)",
            [mori_tp.Layout.hnd(self.kv_heads, tp, r, ps[i], KV_HEAD_BYTES)
             for i, (tp, r) in enumerate(sides)], "full", "full", self.tokens, 0, 2)
        start = self.window_start()
        add("sliding window (NHD)",
            [mori_tp.Layout.nhd(self.kv_heads, tp, r, ps[i], KV_HEAD_BYTES)
             for i, (tp, r) in enumerate(sides)], "swa", "swa", self.tokens - start, start, 2)
        records = [indexer_parts(tp, r, self.indexer_pages[i]) for i, (tp, r) in enumerate(sides)]
        for j, name in enumerate(("indexer keys (H = 1)", "indexer scales (H = 1)")):
            add(name, [records[0][j], records[1][j]], "full", "indexer", self.tokens, 0, 1)
        conv = [self.mamba.conv_parts(tp, r) for tp, r in sides]
        for j, name in enumerate(("conv x (by heads)", "conv B (by groups)",
                                  "conv C (by groups)")):
            add(name, [conv[0][j], conv[1][j]], "mamba", "mamba", self.mamba.conv_rows, 0, 1)
        add("SSM state (by heads)", [self.mamba.ssm_part(tp, r) for tp, r in sides], "mamba",
            "mamba", 1, 0, 1)
        return out


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def oracle(parts: Sequence[Part], src: Dict[str, Sequence[bytes]],
           dst: Dict[str, List[bytearray]]) -> None:
    """Moves every group of a request into ``dst``, every moved head of every token of every
    buffer, one by one."""
    for part in parts:
        what = moved(part.src.total_kv_heads, part.src.tp_size, part.src.tp_rank,
                     part.dst.tp_size, part.dst.tp_rank)
        if what.action is not mori_tp.Action.SEND:
            continue
        hb = part.src.head_bytes
        sp, dp = part.src.page_size, part.dst.page_size
        for sb, db in zip(part.src_buffers, part.dst_buffers):
            for k in range(part.tokens):
                for j in range(len(what.heads)):
                    s = element(part.src, part.src_pages[k // sp], k % sp, what.src_first_local + j)
                    t = element(part.dst, part.dst_pages[k // dp], k % dp, what.dst_first_local + j)
                    dst[part.set][db][t:t + hb] = src[part.set][sb][s:s + hb]


def groups(parts: Sequence[Part], src_ptrs: Optional[Dict[str, Sequence[int]]],
           dst_ptrs: Optional[Dict[str, Sequence[int]]], src_capacity: Dict[str, int],
           dst_capacity: Dict[str, int], staging=None) -> List[mori_tp.Group]:
    """The :class:`mori_tp.Group` of each part, with the buffers' addresses of each side (None:
    that side's pointers are not given) and ``staging(i, config)`` choosing the modes (None:
    the library's)."""
    out = []
    for i, part in enumerate(parts):
        config = part.config()
        mode = None if staging is None else staging(i, config)
        src = None if src_ptrs is None else [src_ptrs[part.set][b] for b in part.src_buffers]
        dst = None if dst_ptrs is None else [dst_ptrs[part.set][b] for b in part.dst_buffers]
        out.append(mori_tp.Group(
            config, part.request(), mode, part.first_token, num_buffers=len(part.src_buffers),
            src_ptrs=src, dst_ptrs=dst, src_capacity=src_capacity[part.set],
            dst_capacity=dst_capacity[part.set],
        ))
    return out
