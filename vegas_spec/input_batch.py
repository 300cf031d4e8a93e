"""The persistent input batch: one row per decoding sequence, from the step its prompt is
prefilled to the step it finishes.

`Batch` is the rows' device state (page tables, committed lengths, newest tokens, sampling
settings and, on the dynamic path, the next round's plan); `InputBatch` keeps it as rows join
(appended after the rows in use), grow (their new pages written into the page tables) and
leave (condensed: the survivors move down in order, keeping their plans). Under static shapes
every change is also made to the rows of the decode loop's buffers (`GraphRunner`), which
hold the plans there, so that both move together; so do a round's outputs that the next
plan is made from (`Round`) and a prefill's completed prompts until they join (`Ready`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegas_spec.attention.context import SparsePlan
from vegas_spec.graphs import GraphRunner
from vegas_spec.sampling import BatchSampling
from vegas_spec.speculative.planning import cat_plans, take_plan
from vegas_spec.step import Prefill


def upload(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host ints -> an int64 device tensor without waiting for the device."""
    host = torch.as_tensor(values, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def page_table(pages: list[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """[len(pages), P] int32: each row's pages, 0 past them (P: the most pages)."""
    width = max(map(len, pages))
    return upload([list(p) + [0] * (width - len(p)) for p in pages], device).to(torch.int32)


@dataclass
class Batch:
    """Device state of the decoding rows. ids: each row's request id; committed: the same
    rows' committed KV lengths on the host (bounds without reading the device); lengths [B]
    committed KV length; last [B] the newest token (not yet in the cache); page_table [B, P];
    plan: the next draft round's selection on the dynamic path (under static shapes it lives
    in the runner's buffers)."""

    ids: list[str]
    committed: list[int]
    page_table: torch.Tensor
    lengths: torch.Tensor
    last: torch.Tensor
    sampling: BatchSampling
    plan: SparsePlan | None = None

    @property
    def longest(self) -> int:
        """The longest committed length, from the host (no device read)."""
        return max(self.committed)

    def keep(self, keep: list[int], idx: torch.Tensor) -> Batch:
        """The rows `keep` (idx: the same on the device); the plan is made again."""
        return Batch([self.ids[i] for i in keep], [self.committed[i] for i in keep],
                     self.page_table[idx], self.lengths[idx], self.last[idx],
                     self.sampling.rows(keep, idx))

    def cat(self, other: Batch) -> Batch:
        """These rows followed by other's, page tables padded to the wider one."""
        width = max(self.page_table.shape[1], other.page_table.shape[1])
        tables = [torch.nn.functional.pad(t, (0, width - t.shape[1]))
                  for t in (self.page_table, other.page_table)]
        return Batch(self.ids + other.ids, self.committed + other.committed,
                     torch.cat(tables), torch.cat([self.lengths, other.lengths]),
                     torch.cat([self.last, other.last]), self.sampling.cat(other.sampling),
                     cat_plans(self.plan, other.plan))


@dataclass
class Round:
    """What the selection after a round needs, until the finished rows leave: the verify
    scores, the position of verify row 0 [B], the accepted counts [B], and whether the
    round's graph already wrote the next plan."""

    scores: torch.Tensor | None
    row: torch.Tensor
    accepted: torch.Tensor
    planned: bool = False

    def take(self, idx: torch.Tensor) -> Round:
        """The rows idx [B'] (rows that leave)."""
        scores = None if self.scores is None else self.scores[:, idx]
        return Round(scores, self.row[idx], self.accepted[idx], self.planned)


@dataclass
class Ready:
    """The prompts a prefill completed (their pieces), each with its first token, until
    they join: first, lengths [n] (the prompts'); scores [layers, n, 1, G, W] of their last
    rows (None: none asked)."""

    pieces: list[Prefill]
    first: torch.Tensor
    sampling: BatchSampling
    scores: torch.Tensor | None
    lengths: torch.Tensor

    def joining(self, device: torch.device) -> tuple[Batch, torch.Tensor | None] | None:
        """The rows of the prompts that go on decoding (`Prefill.joins`), in order, and their
        scores (None: no row joins)."""
        keep = [i for i, p in enumerate(self.pieces) if p.joins]
        if not keep:
            return None
        idx = upload(keep, device)
        joined = [self.pieces[i] for i in keep]
        new = Batch([p.request_id for p in joined], [p.total for p in joined],
                    page_table([p.pages for p in joined], device), self.lengths[idx],
                    self.first[idx], self.sampling.rows(keep, idx))
        return new, None if self.scores is None else self.scores[:, idx]


class InputBatch:
    """The decoding rows (`batch`, None while there are none) and their rows of the static
    buffers (`graphs`, where the runner has them)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.batch: Batch | None = None
        self.graphs: GraphRunner | None = None

    @property
    def rows(self) -> int:
        return 0 if self.batch is None else len(self.batch.ids)

    def place(self, new: Batch) -> int:
        """Buffer rows for sequences about to join -> the first of them (their first plan is
        made there, before `append`)."""
        start = self.rows
        if self.graphs is not None:
            self.graphs.set_rows(start, new.page_table, new.sampling)
        return start

    def append(self, new: Batch) -> None:
        self.batch = new if self.batch is None else self.batch.cat(new)

    def keep(self, alive: list[int], plans: bool) -> torch.Tensor | None:
        """Only rows `alive` stay, moved down in order (their buffer rows with them) -> their
        indices on the device (None: no row is left). plans: the dynamic plan keeps its
        rows' (else it is dropped, to be made again)."""
        old = self.batch
        if not alive:
            self.clear()
            return None
        assert old is not None
        idx = upload(alive, self.device)
        self.batch = old.keep(alive, idx)
        if self.graphs is not None:
            self.graphs.condense(alive, idx)
        if plans:  # static shapes: moved in the buffers
            self.batch.plan = take_plan(old.plan, idx)
        return idx

    def grow(self, rows: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        """Rows whose sequences took more pages (request id, all its pages): their page-table
        rows rewritten, the batch's table widened where they outgrow it."""
        batch = self.batch
        assert batch is not None
        where = {rid: i for i, rid in enumerate(batch.ids)}
        idx = upload([where[rid] for rid, _ in rows], self.device)
        table = page_table([pages for _, pages in rows], self.device)
        width = table.shape[1]
        if width > batch.page_table.shape[1]:
            batch.page_table = torch.nn.functional.pad(
                batch.page_table, (0, width - batch.page_table.shape[1]))
        batch.page_table[idx, :width] = table
        if self.graphs is not None:
            self.graphs.set_pages(idx, table)

    def clear(self) -> None:
        """No row is left (the buffer rows too)."""
        self.batch = None
        if self.graphs is not None:
            self.graphs.condense([], upload([], self.device))
