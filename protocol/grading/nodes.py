"""The tree `normalize.parse` builds from an answer: leaves, text, sequences, intervals, unions,
equation chains, memberships, relations, clock times, dots. Compared by `equivalence`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NormalizeError", "Node", "Leaf", "Text", "Seq", "Interval", "Union", "Chain", "Member", "Rel",
           "Clock", "Dots"]


class NormalizeError(ValueError):
    """The answer has no readable structure (empty, unbalanced brackets, ...)."""


# ----------------------------------------------------------------------------------------- nodes

@dataclass(frozen=True)
class Node:
    pass


@dataclass(frozen=True)
class Leaf(Node):
    """A scalar (or matrix) in LaTeX; `percent`/`degrees` say a unit marker was removed."""
    text: str
    percent: bool = False
    degrees: bool = False


@dataclass(frozen=True)
class Text(Node):
    """A text answer, normalised: lower case, no ``\\text{}``, no parentheses around a letter."""
    text: str


@dataclass(frozen=True)
class Seq(Node):
    """`tuple`: ``(a, b)``, ordered; `list`: ``a, b`` / ``a and b``; `set`: ``\\{a, b\\}``;
    `pm`: the two values of ``a \\pm b`` (a list)."""
    kind: str
    items: tuple[Node, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Interval(Node):
    left: str  # "(" or "["
    a: Node
    b: Node
    right: str  # ")" or "]"


@dataclass(frozen=True)
class Union(Node):
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Chain(Node):
    """``a = b = c``; a label on the left (``x = 3``) makes the last part the value."""
    parts: tuple[Node, ...]
    label_hint: bool = False  # the left part looks like a name (x, f(x), A:B) at string level


@dataclass(frozen=True)
class Member(Node):
    """``x \\in S``."""
    elem: Node
    container: Node


@dataclass(frozen=True)
class Rel(Node):
    """An inequality or ``\\neq`` (possibly chained), kept as LaTeX for sympy."""
    text: str


@dataclass(frozen=True)
class Clock(Node):
    """A time of day ``5:30``, ``5:30 p.m.``: `seconds` after midnight (read on a 12-hour dial
    when `meridiem` is None)."""
    seconds: int
    meridiem: str | None  # "am", "pm", "24h" (an hour 0 or 13-24), or None (1-12, either half)


@dataclass(frozen=True)
class Dots(Node):
    """``\\ldots`` inside a list: only equal to itself, and makes the list ordered."""
