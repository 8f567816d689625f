"""The training-prompt stream: endless, epoch-shuffled, resumable iteration over the prompt rows."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PromptStream(Generic[T]):
    """Endless, epoch-shuffled, resumable iteration over a fixed list of items (prompt rows).

    Epoch e visits every item once in the order `Random(f"{seed}:{e}")` gives, so the sequence is
    a pure function of (items, seed) and `state_dict()` (epoch, position) pins where it is. A
    fingerprint of the items makes a resume with different data fail instead of silently diverging.
    """

    def __init__(self, items: Sequence[T], seed: int = 0):
        if not items:
            raise ValueError("PromptStream needs at least one item (all prompts dropped or none loaded?)")
        self._items = list(items)
        self._seed = seed
        self._fingerprint = hashlib.sha256(repr(self._items).encode()).hexdigest()[:16]
        self._set_position(0, 0)

    def _set_position(self, epoch: int, position: int) -> None:
        self._epoch, self._position = epoch, position
        self._order = list(range(len(self._items)))
        random.Random(f"{self._seed}:{epoch}").shuffle(self._order)

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._position == len(self._order):
            self._set_position(self._epoch + 1, 0)
        item = self._items[self._order[self._position]]
        self._position += 1
        return item

    def take(self, n: int) -> list[T]:
        """The next `n` items (crossing into the next epoch when needed)."""
        return [next(self) for _ in range(n)]

    @property
    def epoch(self) -> int:
        return self._epoch

    def __len__(self) -> int:
        return len(self._items)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed,
                "num_items": len(self._items), "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = (self._seed, len(self._items), self._fingerprint)
        theirs = (state["seed"], state["num_items"], state["fingerprint"])
        if mine != theirs:
            raise ValueError(f"prompt stream state is for other data (seed, items, fingerprint) {theirs} "
                             f"!= {mine}: resume with the same data config and tokenizer")
        self._set_position(state["epoch"], state["position"])
