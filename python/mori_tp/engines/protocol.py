"""The notifications a :class:`~mori_tp.engines.Streamer` sends and a
:class:`~mori_tp.engines.Receiver` reads (REFERENCE.md section 13): their text, their bounds,
and the per-request token that binds every message to the request it was written for.

Format, version 3, ASCII words separated by one space::

    mori-tp/3 <request> <token> chunk <index> <b0>-<b1>[,...] staging <mode> [sealed <count>]
    mori-tp/3 <request> <token> sealed <count>
    mori-tp/3 <request> <token> abort <ended|busy> <reason>

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

Versions 1 (no token) and 2 (no staging mode) are refused by a version-3 receiver, which
records them as violations.
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
    "check_request_id",
    "check_token",
    "chunk_message",
    "new_token",
    "parse_message",
    "seal_message",
]

PROTOCOL = "mori-tp/3"
#: The longest notification of this protocol, in bytes: a sender refuses to build a longer one
#: (a chunk of more buffer ranges than fit), and a receiver refuses a longer one unparsed.
#: 64 KiB holds a chunk of about 5000 separate ranges.
MAX_MESSAGE_BYTES = 64 << 10
#: The longest abort reason carried, in characters (the rest is cut).
MAX_REASON = 300

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,200}")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")
_NUMBER = re.compile(r"0|[1-9][0-9]{0,9}")
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
                  sealed: Optional[int] = None, *, staging: Any) -> bytes:
    """Chunk ``index`` of the request, holding buffer ``ranges``, staged as ``staging`` (a
    :class:`~mori_tp.Staging` or its value); with the chunk count when ``sealed``."""
    try:
        mode = Staging(staging)
    except ValueError:
        raise InvalidArgumentError(f"request {request_id}, chunk {index}: staging {staging!r} "
                                   "is not a Staging (0 NONE, 1 SRC, 2 DST, 3 BOTH)") from None
    text = (f"{PROTOCOL} {request_id} {token} chunk {index} "
            + ",".join(f"{a}-{b}" for a, b in ranges) + f" staging {mode.name}")
    if sealed is not None:
        text += f" sealed {sealed}"
    return _bounded(text, f"request {request_id}, chunk {index}")


def seal_message(request_id: str, token: str, count: int) -> bytes:
    return _bounded(f"{PROTOCOL} {request_id} {token} sealed {count}", f"request {request_id}")


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
    #: "chunk", "sealed", "abort", "malformed" (this protocol, but not a valid message: the
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
                               staging=mode)
            if words[8] == "sealed" and _NUMBER.fullmatch(words[9]):
                return Message(request_id, token, kind, int(words[4]), tuple(ranges),
                               int(words[9]), staging=mode)
    elif kind == "sealed" and len(words) == 5 and _NUMBER.fullmatch(words[4]):
        return Message(request_id, token, kind, sealed=int(words[4]))
    elif kind == "abort" and len(words) >= 5 and words[4] in ("ended", "busy"):
        return Message(request_id, token, kind, reason=" ".join(words[5:])[:MAX_REASON],
                       busy=words[4] == "busy")
    return Message(request_id, token, "malformed", reason=_preview(message))
