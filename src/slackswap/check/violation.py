"""What the checker reports: one broken rule, naming the op or tensor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    """One broken rule: which op (position), which tensor, and by how many bytes if memory."""

    kind: str
    message: str
    op: str | None = None
    tensor: str | None = None
    bytes_over: int = 0

    def __str__(self) -> str:
        return self.message
