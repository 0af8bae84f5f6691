"""Named tensors from one rank to another, point to point: a header (name, dtype, shape), then the data.

Every path that hands tensors between ranks goes through a Wire: the timestep pipeline (pipeline/steps.py: a block's
latents, the rings' copies, the sink frame) and a live session's chunk relay (pipeline/live.py: each chunk's fields
and its audio samples). Only tensors of the dtypes in DTYPES travel: nothing is pickled, so no rank runs anything
another rank sends.

Sends are asynchronous (isend): `send` returns once the transfer is posted, and the Wire holds the tensor until it
was taken (the caller must not change it in place before then: clone one that will). `end_block` closes a unit of
work (a block of the timestep pipeline); with `pending=n` it then waits for the oldest unit's sends once more than n
are in flight, so a rank runs ahead of its consumer by that much and no further, which bounds the memory its copies
in flight take. Receives block, for at most the group's timeout; then, as when the peer is gone, WireError.

Messages between two ranks of one group arrive in the order they were sent. The receiver names the tensor it
expects next: another name means the two ranks' schedules disagree, and is an error rather than a silent mix-up.
"""

from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)
MAX_DIMS = 8
MAX_NAME = 48  # bytes of a tensor's name (ASCII)
_HEAD = 2 + MAX_DIMS + 1 + MAX_NAME  # dtype, ndim, shape, name length, name bytes: int64 each


class WireError(RuntimeError):
    """A tensor did not arrive (timeout, peer gone) or was not the one expected."""


def _header(name: str, t: torch.Tensor) -> list[int]:
    raw = name.encode("ascii")
    if len(raw) > MAX_NAME:
        raise ValueError(f"wire: the name '{name}' is over {MAX_NAME} bytes")
    if t.dtype not in DTYPES:
        raise ValueError(f"wire: '{name}' is {t.dtype}; a wire carries {', '.join(str(d) for d in DTYPES)}")
    if t.ndim > MAX_DIMS:
        raise ValueError(f"wire: '{name}' has {t.ndim} dimensions; a wire carries at most {MAX_DIMS}")
    shape = [*t.shape, *[0] * (MAX_DIMS - t.ndim)]
    return [DTYPES.index(t.dtype), t.ndim, *shape, len(raw), *raw, *[0] * (MAX_NAME - len(raw))]


def _parse(head: list[int]) -> tuple[str, torch.dtype, tuple[int, ...]]:
    dtype, ndim = DTYPES[head[0]], head[1]
    n = head[2 + MAX_DIMS]
    name = bytes(head[3 + MAX_DIMS:3 + MAX_DIMS + n]).decode("ascii")
    return name, dtype, tuple(head[2:2 + ndim])


class Wire:
    """Named tensors to and from the other ranks of `group` (None: the default group), received onto `device`.

    pending: the units of work (`end_block`) whose sends may be in flight at once; None: no bound."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device | str = "cpu",
                 pending: int | None = None):
        self.group, self.device, self.pending = group, torch.device(device), pending
        self._blocks: deque[list[tuple[dist.Work, torch.Tensor]]] = deque([[]])

    @classmethod
    def gloo(cls, timeout_s: float, pending: int | None = None) -> "Wire":
        """A Wire over a gloo group of its own: CPU tensors whatever backend the models use, and a timeout of
        `timeout_s` (a live source's first audio may take longer than a collective). Every rank must call it, in
        the same order as its other new groups."""
        return cls(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)), "cpu", pending)

    def send(self, dst: int, name: str, t: torch.Tensor) -> None:
        """Post `t` to rank `dst` as `name` and return; the receiver needs no bookkeeping of its dtype or shape."""
        t = t.detach().contiguous()
        head = torch.tensor(_header(name, t), dtype=torch.int64, device=t.device)  # (_HEAD,)
        block = self._blocks[-1]
        block.append((dist.isend(head, dst, group=self.group), head))
        if t.numel():
            block.append((dist.isend(t, dst, group=self.group), t))
        # A finished send's tensor is let go now; the unfinished ones are waited for by end_block or flush.
        self._blocks[-1] = [(w, x) for w, x in block if not w.is_completed()]

    def recv(self, src: int, name: str) -> torch.Tensor:
        """The next tensor from rank `src`, which must be `name`; blocks for at most the group's timeout."""
        head = torch.empty(_HEAD, dtype=torch.int64, device=self.device)
        self._take(head, src, name)
        got, dtype, shape = _parse(head.tolist())
        if got != name:
            raise WireError(f"wire: expected '{name}' from rank {src}, got '{got}': the ranks' schedules disagree")
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if t.numel():
            self._take(t, src, name)
        return t

    def _take(self, t: torch.Tensor, src: int, name: str) -> None:
        try:
            dist.recv(t, src, group=self.group)
        except RuntimeError as e:  # gloo's timeout or a lost peer; its words kept (errors.failure_message reads them)
            raise WireError(f"wire: waiting for '{name}' from rank {src}: {e}") from e

    def end_block(self) -> None:
        """Close this unit's sends; with `pending`, wait for the oldest unit's once more than that are in flight."""
        self._blocks.append([])
        while self.pending is not None and len(self._blocks) > self.pending + 1:
            self._wait(self._blocks.popleft())

    def flush(self) -> None:
        """Wait until every send was taken."""
        while self._blocks:
            self._wait(self._blocks.popleft())
        self._blocks.append([])

    @staticmethod
    def _wait(block: list[tuple[dist.Work, torch.Tensor]]) -> None:
        for work, _ in block:
            work.wait()
