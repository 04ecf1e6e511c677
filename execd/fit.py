"""Results that fit one reply frame to the client that asked.

A reply travels in one frame, and the client chose how large a frame it takes
(``hello.max_frame``, as small as 4096 bytes). A handler whose result grows
with data uses these helpers to keep it within :func:`result_budget`: it cuts
what can be cut and says so (collected output keeps its head and tail, a list
sets ``truncated``), or refuses with TOO_LARGE *before* doing anything that
cannot be undone. What no handler fits is refused by the dispatcher with
TOO_LARGE as well, so a result never turns into an INTERNAL error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from execd.context import CallContext
from execd.errors import TooLarge
from protocol import limits
from protocol.codec import ENCODER

_T = TypeVar("_T")

CAPTURE_FIELDS = 128
"""Encoded size, at most, of the fields around collected stdout and stderr bytes."""


def result_budget(ctx: CallContext) -> int:
    """Largest encoded result that fits one reply frame to this call's client."""
    return ctx.max_chunk + limits.CHUNK_OVERHEAD - limits.REPLY_OVERHEAD


def encoded_size(value: Any) -> int:
    """Bytes of ``value`` as msgpack."""
    return len(ENCODER.encode(value))


def too_large(what: str, size: int, budget: int) -> TooLarge:
    """The TOO_LARGE error for a result of ``size`` bytes over ``budget``."""
    return TooLarge(
        f"{what} takes {size} bytes, more than fit one reply frame to this client ({budget})",
        {"size": size, "limit": budget},
    )


def ensure_fits(value: Any, ctx: CallContext, what: str, *, spare: int = 0) -> None:
    """Raise TOO_LARGE unless ``value`` (plus ``spare`` bytes) fits a reply frame."""
    budget = result_budget(ctx)
    size = encoded_size(value) + spare
    if size > budget:
        raise too_large(what, size, budget)


def fitting_prefix(items: Sequence[_T], budget: int) -> int:
    """How many leading ``items`` fit in ``budget`` bytes as one msgpack array."""
    # An array header takes at most 5 bytes.
    left = budget - 5
    for count, item in enumerate(items):
        left -= encoded_size(item)
        if left < 0:
            return count
    return len(items)


def fit_list(items: list[_T], budget: int) -> tuple[list[_T], bool]:
    """``items`` cut to what fits in ``budget`` bytes, and whether any were cut."""
    if encoded_size(items) <= budget:
        return items, False
    keep = fitting_prefix(items, budget)
    return items[:keep], True
