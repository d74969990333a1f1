"""Busy time of one resource of a rank class, as sorted disjoint intervals.

The simulator runs rank classes one after another, not in time order, so a resource's
busy intervals arrive out of order: a query asks about any point in time, and an added
interval merges with those it touches.
"""

from __future__ import annotations

from bisect import bisect_right


class Intervals:
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def add(self, start: float, end: float) -> None:
        if end <= start:
            return
        starts, ends = self.starts, self.ends
        if not starts or start > ends[-1]:  # after every interval: the usual case
            starts.append(start)
            ends.append(end)
            return
        i = bisect_right(starts, start)
        if i and ends[i - 1] >= start:  # merges with the one before
            i -= 1
            start = starts[i]
        j = i
        while j < len(starts) and starts[j] <= end:
            end = max(end, ends[j])
            j += 1
        starts[i:j] = [start]
        ends[i:j] = [end]

    def stretched_end(self, start: float, work: float, busy_rate: float) -> float:
        """When `work` seconds of full-rate progress starting at `start` are done, if it
        progresses at `busy_rate` while a busy interval lasts and at full rate otherwise."""
        starts, ends = self.starts, self.ends
        i = bisect_right(starts, start)
        if i and ends[i - 1] > start:
            i -= 1
        t, left = start, work
        while i < len(starts) and left > 0:
            if starts[i] > t:
                free = starts[i] - t
                if left <= free:
                    return t + left
                left -= free
                t = starts[i]
            busy = (ends[i] - t) * busy_rate
            if left <= busy:
                return t + left / busy_rate
            left -= busy
            t = ends[i]
            i += 1
        return t + left
