"""Host-side bookkeeping of the shared KV page pool (the arrays live on the device).

One pool of `n_pages` pages of `page_size` slots is shared by every row of the engine.
Page 0 is scratch: never given to a sequence, it is where the page-table entries a row
does not own point, so writes past a row's pages (padding tokens, idle rows) land there
and no row ever attends to it (a row reads only the positions up to its queries', which
lie in pages it owns; `kv.row_slots`).

Pages are taken as a sequence grows and returned when it finishes or is cancelled, as in
nano-vllm's block manager (`nanovllm/engine/block_manager.py`); without prefix sharing.
Admission reserves a request's worst case (prompt + max_new_tokens + a verify step's
slack) up front, so a running sequence can always grow: nothing is ever preempted, and a
request that does not fit yet waits in the queue instead.
"""

from __future__ import annotations

import dataclasses

from .errors import SpecjaxError

SCRATCH = 0


class PoolError(SpecjaxError):
    """A request that can never fit the pool or a row."""


@dataclasses.dataclass
class PageAllocator:
    n_pages: int
    page_size: int
    free: list[int] = dataclasses.field(init=False)
    reserved: int = 0  # pages promised to admitted sequences but not yet taken

    def __post_init__(self) -> None:
        if self.n_pages < 2:
            raise PoolError(f"the pool needs at least 2 pages (one is scratch), got {self.n_pages}")
        self.free = list(range(self.n_pages - 1, SCRATCH, -1))  # pop() hands out low ids first

    @property
    def usable(self) -> int:
        """Pages a sequence can ever own (all but scratch)."""
        return self.n_pages - 1

    @property
    def free_count(self) -> int:
        """Pages not owned by any sequence."""
        return len(self.free)

    @property
    def in_use(self) -> int:
        return self.usable - len(self.free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_reserve(self, pages: int) -> bool:
        return pages <= len(self.free) - self.reserved

    def reserve(self, pages: int) -> None:
        if not self.can_reserve(pages):
            raise PoolError(f"cannot reserve {pages} pages: {len(self.free)} free, {self.reserved} reserved")
        self.reserved += pages

    def take(self, pages: int) -> list[int]:
        """Pages out of an earlier reservation."""
        if pages > self.reserved or pages > len(self.free):
            raise PoolError(f"taking {pages} pages exceeds the reservation ({self.reserved}) or the free "
                            f"pages ({len(self.free)})")
        self.reserved -= pages
        return [self.free.pop() for _ in range(pages)]

    def release(self, pages: list[int], unreserve: int = 0) -> None:
        """Return owned pages and the unused rest of a reservation."""
        if unreserve > self.reserved:
            raise PoolError(f"releasing {unreserve} reserved pages, only {self.reserved} are reserved")
        self.reserved -= unreserve
        self.free.extend(sorted(pages, reverse=True))
