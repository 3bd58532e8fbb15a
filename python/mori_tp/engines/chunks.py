"""How a pipelined request is cut into chunks of whole buffers (:func:`chunk_ranges`), the
rule both the streamer and the cost model use (REFERENCE.md section 13)."""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from mori_tp import InvalidArgumentError

#: No automatic chunk is smaller than this: each chunk costs about 0.3 ms here (an engine call,
#: a notification, two thread wake-ups), which smaller chunks do not win back (measured on
#: 2026-12-01; REFERENCE.md section 13).
MIN_CHUNK_BYTES = 4 << 20
#: At most this many automatic chunks, and at most half the host's cores: overlapped stages need
#: cores of their own (on two cores 2 chunks were best in half the cases measured on 2026-12-01,
#: 4 and 16 in none; REFERENCE.md section 13).
MAX_AUTO_CHUNKS = 8


def chunk_ranges(num_buffers: int, bytes_per_buffer: int,
                 chunks: Optional[int] = None) -> List[Tuple[int, int]]:
    """The buffer ranges of a pipelined request: ``chunks`` ranges of whole buffers (default:
    the rule in the module docs), as even as the buffers allow, in buffer order."""
    if num_buffers <= 0:
        return []
    if chunks is None:
        total = num_buffers * max(bytes_per_buffer, 0)
        cap = max(2, min(MAX_AUTO_CHUNKS, (os.cpu_count() or 2) // 2))
        chunks = min(num_buffers, cap, max(1, total // MIN_CHUNK_BYTES))
    if not 1 <= chunks <= num_buffers:
        raise InvalidArgumentError(
            f"chunk_ranges: {chunks} chunks of {num_buffers} buffers (1 to {num_buffers})"
        )
    bounds = [num_buffers * i // chunks for i in range(chunks + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(chunks)]
