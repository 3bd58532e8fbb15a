"""The notifications a :class:`~mori_tp.engines.Streamer` sends and a
:class:`~mori_tp.engines.Receiver` reads (REFERENCE.md section 13): their text, their bounds,
and the per-request token that binds every message to the request it was written for.

Format, version 4, ASCII words separated by one space. The prefill rank sends::

    mori-tp/4 <request> <token> chunk <index> <b0>-<b1>[,...] staging <mode> [sealed <count>] reply <carrier>
    mori-tp/4 <request> <token> sealed <count> reply <carrier>
    mori-tp/4 <request> <token> abort <ended|busy> <reason>

and the decode rank answers (REFERENCE.md section 17)::

    mori-tp/4 <request> <token> done
    mori-tp/4 <request> <token> cancel <carrier> <reason>

``done``: every chunk landed and was unpacked; the sender's ``wait()`` reports success only
after it. ``cancel``: the decode rank gave up on the request (a timeout, a protocol violation,
its caller); the sender writes nothing more of it and answers with ``abort ended`` once every
write of it has returned, and only then does the decode rank reuse the request's memory.
``<carrier>``: a decimal address of the other rank's registered memory that an answer to the
message may read one byte of (Mooncake sends a notification only with a transfer), 0 where the
engine needs none (NIXL).

``<request>`` is the request id (1-200 printable ASCII characters, no space); ``<token>`` is the
request's token: an unguessable string (default 32 hex digits, 128 random bits from
:mod:`secrets`) that the decode rank draws at ``expect()`` and hands to the prefill rank with the
request's slot and pages, over the connector's own channel. The engines do not authenticate who
sends a notification (REFERENCE.md section 18), so the token is what tells the decode rank that
a message comes from the process that holds the request's plan. ``<index>`` and the counts are
decimal numbers without sign or leading zero. ``abort ended`` says that every write of the
stream has returned (completed, or cancelled by the engine); ``abort busy`` that an engine may
still move bytes of it (a transfer it could not cancel), so the decode rank keeps the slot.
``<mode>`` is how the sender staged the chunk: ``NONE``, ``SRC``, ``DST`` or ``BOTH`` (the
:class:`~mori_tp.Staging` names), which says whether the decode rank unpacks it and from where;
the sender may choose it per request (:mod:`mori_tp.engines.costs`), and the decode rank checks it
against what it allowed.

Versions 1 (no token), 2 (no staging mode) and 3 (no answers: a sender reported success
without the decode rank's confirmation) are refused by a version-4 receiver, which records them
as violations.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from mori_tp import InvalidArgumentError, Staging

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL",
    "Message",
    "abort_message",
    "cancel_message",
    "check_request_id",
    "check_token",
    "chunk_message",
    "done_message",
    "new_token",
    "parse_head",
    "parse_message",
    "seal_message",
]

PROTOCOL = "mori-tp/4"
#: The longest notification of this protocol, in bytes: a sender refuses to build a longer one
#: (a chunk of more buffer ranges than fit), and a receiver refuses a longer one unparsed.
#: 64 KiB holds a chunk of about 5000 separate ranges.
MAX_MESSAGE_BYTES = 64 << 10
#: The longest abort reason carried, in characters (the rest is cut).
MAX_REASON = 300

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,200}")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")
_NUMBER = re.compile(r"0|[1-9][0-9]{0,9}")
_ADDRESS = re.compile(r"0|[1-9][0-9]{0,19}")
_RANGE = re.compile(r"(0|[1-9][0-9]{0,9})-(0|[1-9][0-9]{0,9})")
_MODES = {mode.name: mode for mode in Staging}


def new_token() -> str:
    """A fresh request token: 32 hex digits (128 bits from :func:`secrets.token_hex`)."""
    return secrets.token_hex(16)


def check_request_id(request_id: Any, where: str = "request id") -> str:
    """``request_id`` if the protocol can carry it: 1-200 printable ASCII characters, no
    space (what the message's word holds); else InvalidArgumentError naming it."""
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise InvalidArgumentError(
            f"{where}: request id {request_id!r} must be 1-200 printable ASCII characters "
            "without spaces (0x21-0x7e), what the notification protocol carries"
        )
    return request_id


def check_token(token: Any, where: str = "token") -> str:
    """``token`` if it is one: 16-128 characters of ``[A-Za-z0-9_-]`` (hex, or
    :func:`secrets.token_urlsafe`); else InvalidArgumentError. It must come from an
    unguessable source: use :func:`new_token`."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        shown = f"{token[:8]!r}... ({len(token)} characters)" if isinstance(token, str) \
            else repr(type(token).__name__)
        raise InvalidArgumentError(
            f"{where}: a request token must be 16-128 characters of [A-Za-z0-9_-] drawn from "
            f"an unguessable source (mori_tp.engines.new_token()), not {shown}"
        )
    return token


def _bounded(text: str, where: str) -> bytes:
    data = text.encode("ascii")
    if len(data) > MAX_MESSAGE_BYTES:
        raise InvalidArgumentError(
            f"{where}: the notification would be {len(data)} bytes, more than the protocol's "
            f"{MAX_MESSAGE_BYTES}: submit the chunk's buffers as fewer ranges (contiguous "
            "buffers), or in several chunks"
        )
    return data


def chunk_message(request_id: str, token: str, index: int, ranges: Sequence[Tuple[int, int]],
                  sealed: Optional[int] = None, *, staging: Any, reply: int = 0) -> bytes:
    """Chunk ``index`` of the request, holding buffer ``ranges``, staged as ``staging`` (a
    :class:`~mori_tp.Staging` or its value); with the chunk count when ``sealed``; ``reply``:
    the sender's carrier for the decode rank's answers (0: none needed)."""
    try:
        mode = Staging(staging)
    except ValueError:
        raise InvalidArgumentError(f"request {request_id}, chunk {index}: staging {staging!r} "
                                   "is not a Staging (0 NONE, 1 SRC, 2 DST, 3 BOTH)") from None
    text = (f"{PROTOCOL} {request_id} {token} chunk {index} "
            + ",".join(f"{a}-{b}" for a, b in ranges) + f" staging {mode.name}")
    if sealed is not None:
        text += f" sealed {sealed}"
    text += f" reply {_carrier(reply)}"
    return _bounded(text, f"request {request_id}, chunk {index}")


def _carrier(reply: Any) -> int:
    if isinstance(reply, bool) or not isinstance(reply, int) or not 0 <= reply < 1 << 64:
        raise InvalidArgumentError(f"reply carrier {reply!r} must be an address (0 to 2**64-1)")
    return reply


def seal_message(request_id: str, token: str, count: int, reply: int = 0) -> bytes:
    return _bounded(f"{PROTOCOL} {request_id} {token} sealed {count} reply {_carrier(reply)}",
                    f"request {request_id}")


def done_message(request_id: str, token: str) -> bytes:
    """The decode rank's confirmation: every chunk of the request landed and was unpacked."""
    return _bounded(f"{PROTOCOL} {request_id} {token} done", f"request {request_id}")


def cancel_message(request_id: str, token: str, reason: str, reply: int = 0) -> bytes:
    """The decode rank gave up on the request: write nothing more, answer ``abort ended``
    (``reply``: the decode rank's carrier for that answer)."""
    reason = " ".join(str(reason).split())[:MAX_REASON]
    reason = reason.encode("ascii", "replace").decode("ascii") or "-"
    return _bounded(f"{PROTOCOL} {request_id} {token} cancel {_carrier(reply)} {reason}",
                    f"request {request_id}")


def abort_message(request_id: str, token: str, reason: str, busy: bool = False) -> bytes:
    """``abort ended <reason>`` (every write of the stream returned), or ``abort busy`` (an
    engine may still move bytes of it); the reason on one line, ASCII, at most
    :data:`MAX_REASON` characters."""
    reason = " ".join(str(reason).split())[:MAX_REASON]
    reason = reason.encode("ascii", "replace").decode("ascii") or "-"
    state = "busy" if busy else "ended"
    return _bounded(f"{PROTOCOL} {request_id} {token} abort {state} {reason}",
                    f"request {request_id}")


@dataclass(frozen=True)
class Message:
    """A parsed notification of this protocol (or one that claims to be)."""

    request_id: str
    token: str
    #: "chunk", "sealed", "abort", "done", "cancel", "malformed" (this protocol, but not a valid message: the
    #: reason says why), "oversized" (longer than MAX_MESSAGE_BYTES) or "version" (another
    #: version of the protocol).
    kind: str
    index: int = -1
    ranges: Tuple[Tuple[int, int], ...] = ()
    sealed: Optional[int] = None
    reason: str = ""
    #: How the sender staged a chunk (its ``staging`` word).
    staging: Optional[Staging] = None
    #: An abort whose sender's engine may still move bytes of the request.
    busy: bool = False
    #: The sender's carrier for answers (chunk and sealed messages), 0 for none.
    reply: int = 0


#: The most bytes :func:`parse_head` looks at: version, request id (200), token (128), kind.
HEAD_BYTES = 400


def parse_head(message: bytes) -> Optional[Tuple[bytes, str, str, str]]:
    """``(version, request id, token, kind)`` of a message of this protocol family, from its
    first :data:`HEAD_BYTES` bytes only (constant time whatever its length), or None when it is
    not one. A receiver checks the token with this before it parses the rest."""
    if not message.startswith(b"mori-tp/"):
        return None
    head = message[:HEAD_BYTES].split(b" ", 4)
    words = []
    for word in head[1:4]:
        try:
            words.append(word.decode("ascii"))
        except UnicodeDecodeError:
            words.append("")
    while len(words) < 3:
        words.append("")
    return head[0], words[0], words[1], words[2]


def _preview(message: bytes) -> str:
    return repr(message[:120]) + (f" ... ({len(message)} bytes)" if len(message) > 120 else "")


def parse_message(message: bytes) -> Optional[Message]:
    """The protocol message in ``message``, or None when it is not one (another user's
    notification). Never raises, and costs time linear in the message, which it refuses
    unparsed beyond :data:`MAX_MESSAGE_BYTES`."""
    if not message.startswith(b"mori-tp/"):
        return None
    head = message[:400].split(b" ", 3)
    version = head[0]
    try:
        request_id = head[1].decode("ascii") if len(head) > 1 else ""
        token = head[2].decode("ascii") if len(head) > 2 else ""
    except UnicodeDecodeError:
        request_id, token = "", ""
    if version != PROTOCOL.encode():
        return Message(request_id, token, "version",
                       reason=f"{version.decode('ascii', 'replace')!r}, this receiver speaks "
                              f"{PROTOCOL}")
    if len(message) > MAX_MESSAGE_BYTES:
        return Message(request_id, token, "oversized",
                       reason=f"{len(message)} bytes, more than {MAX_MESSAGE_BYTES}")
    try:
        words = message.decode("ascii").split(" ")
    except UnicodeDecodeError:
        return Message(request_id, token, "malformed", reason=f"not ASCII: {_preview(message)}")
    if len(words) < 4:
        return Message(request_id, token, "malformed", reason=_preview(message))
    kind = words[3]
    reply = 0
    if kind in ("chunk", "sealed"):
        # Every chunk and seal ends with "reply <carrier>".
        if len(words) < 6 or words[-2] != "reply" or not _ADDRESS.fullmatch(words[-1]):
            return Message(request_id, token, "malformed", reason=_preview(message))
        reply = int(words[-1])
        words = words[:-2]
    if kind == "chunk" and len(words) in (8, 10) and _NUMBER.fullmatch(words[4]) \
            and words[6] == "staging" and words[7] in _MODES:
        parts = words[5].split(",")
        ranges = []
        for part in parts:
            matched = _RANGE.fullmatch(part)
            if matched is None:
                break
            ranges.append((int(matched.group(1)), int(matched.group(2))))
        else:
            mode = _MODES[words[7]]
            if len(words) == 8:
                return Message(request_id, token, kind, int(words[4]), tuple(ranges),
                               staging=mode, reply=reply)
            if words[8] == "sealed" and _NUMBER.fullmatch(words[9]):
                return Message(request_id, token, kind, int(words[4]), tuple(ranges),
                               int(words[9]), staging=mode, reply=reply)
    elif kind == "sealed" and len(words) == 5 and _NUMBER.fullmatch(words[4]):
        return Message(request_id, token, kind, sealed=int(words[4]), reply=reply)
    elif kind == "done" and len(words) == 4:
        return Message(request_id, token, kind)
    elif kind == "cancel" and len(words) >= 6 and _ADDRESS.fullmatch(words[4]):
        return Message(request_id, token, kind, reason=" ".join(words[5:])[:MAX_REASON],
                       reply=int(words[4]))
    elif kind == "abort" and len(words) >= 5 and words[4] in ("ended", "busy"):
        return Message(request_id, token, kind, reason=" ".join(words[5:])[:MAX_REASON],
                       busy=words[4] == "busy")
    return Message(request_id, token, "malformed", reason=_preview(message))
