"""The CTR job's training-loss log: the cross-rank mean loss of every ``--log-every`` window, read back
from the device without making the host wait for the device's queued steps."""

from __future__ import annotations

import collections
from typing import Optional

import torch
import torch.distributed as dist


class LossLog:
    """The cross-rank mean training loss of every ``--log-every`` window, in ``history``
    (``[[step, mean], ...]``, float means, appended in step order).

    :meth:`add` adds a step's 0-d float32 loss, as float64, to the window's sum on the device (no
    host wait). :meth:`close_window` divides the sum by the window's step count, sums that over the
    ranks (``all_reduce``; the mean is that sum / world size) and starts its copy to the host: on CUDA
    into pinned memory behind a CUDA event, so the host goes on launching steps; the mean enters
    ``history`` when the copy is done, at a later :meth:`poll` or at :meth:`flush`, which waits for it
    (before a checkpoint and at the end of the run). On the CPU it enters ``history`` at once. The
    means are those of ``float(sum) / n`` summed over the ranks in float64, bit for bit.
    """

    def __init__(self, device: torch.device, history: list) -> None:
        self.device = torch.device(device)
        self.history = history
        self.window_sum: Optional[torch.Tensor] = None   # 0-d float64 on the device (None: empty)
        self.window_n = 0
        self._pending = collections.deque()   # (step, float64 [1] on the host, CUDA event or None)

    def add(self, loss: torch.Tensor) -> None:
        """Add a step's loss (0-d, on the device) to the open window."""
        self.window_sum = loss.double() if self.window_sum is None else self.window_sum + loss.double()
        self.window_n += 1

    def restore(self, n: int, window_sum: float) -> None:
        """Reopen a window of ``n`` steps whose losses sum to ``window_sum`` (a checkpoint's)."""
        self.window_n = int(n)
        self.window_sum = torch.tensor(window_sum, dtype=torch.float64, device=self.device)

    def open_sum(self) -> float:
        """The open window's loss sum (0.0 when empty); reads the device (a checkpoint's)."""
        return float(self.window_sum) if self.window_sum is not None else 0.0

    def close_window(self, step: int) -> None:
        """End the open window at ``step`` (a collective: every rank calls it at the same step) and
        start reading its cross-rank mean."""
        mean = (self.window_sum / self.window_n).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(mean)
        self.window_sum, self.window_n = None, 0
        if self.device.type == "cuda":
            host = torch.empty(1, dtype=torch.float64, pin_memory=True)
            host.copy_(mean, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((step, host, event))
        else:
            self._pending.append((step, mean, None))
        self.poll()

    def poll(self) -> bool:
        """Move the means whose copies are done into ``history``, in order; whether any moved."""
        moved = False
        while self._pending and (self._pending[0][2] is None or self._pending[0][2].query()):
            self._take()
            moved = True
        return moved

    def flush(self) -> None:
        """Wait for every started copy and move its mean into ``history``."""
        while self._pending:
            if self._pending[0][2] is not None:
                self._pending[0][2].synchronize()
            self._take()

    def _take(self) -> None:
        step, host, _ = self._pending.popleft()
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.history.append([step, float(host[0]) / world])
