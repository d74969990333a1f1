"""Disaggregated preprocessing (`backend.preprocess=disaggregated`): a producer
process beside each trainer decodes and resizes its samples, applies the plan's sample
order and collates every micro-batch of the coming steps, at most `backend.prefetch_steps`
steps ahead (a bounded queue), so the trainer only takes finished batches off the queue.

The paper runs producers on dedicated CPU nodes; here a producer shares its trainer's
machine, so on a small machine it competes with the trainers for cores: the run's
`data_wait_s` shows what the trainer still waits for, its step times what that costs.
"""

from __future__ import annotations

import math
import queue
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

Made = dict[tuple[str, int], dict[str, torch.Tensor]]
ALIGN = 8  # bytes: the largest element size a batch holds (int64, float64)


@dataclass(frozen=True)
class _Field:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _pack(made: Made) -> tuple[torch.Tensor, dict[tuple[str, int], dict[str, _Field]]]:
    """A step's tensors in one buffer: a tensor crosses processes as a shared-memory file
    each, and hundreds of them cost the trainer tens of milliseconds to receive; one costs
    one. Tensors that units share (one collated batch) are stored once."""
    parts: list[torch.Tensor] = []
    where: dict[int, _Field] = {}
    end = 0
    for fields in made.values():
        for tensor in fields.values():
            if id(tensor) in where:
                continue
            pad = -end % ALIGN  # each field's view starts at a multiple of its element size
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            parts += [torch.zeros(pad, dtype=torch.uint8), raw]
            where[id(tensor)] = _Field(end + pad, tensor.dtype, tuple(tensor.shape))
            end += pad + raw.numel()
    buffer = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return buffer, {key: {name: where[id(t)] for name, t in fields.items()} for key, fields in made.items()}


def _unpack(buffer: torch.Tensor, layout: dict[tuple[str, int], dict[str, _Field]]) -> Made:
    def view(f: _Field) -> torch.Tensor:
        nbytes = math.prod(f.shape) * f.dtype.itemsize
        return buffer[f.offset : f.offset + nbytes].view(f.dtype).reshape(f.shape)

    return {key: {name: view(f) for name, f in fields.items()} for key, fields in layout.items()}


class StepMaker(Protocol):
    """What a producer calls for each step's micro-batches (runtime.inputs.StepSamples;
    picklable, as a spawned process needs)."""

    def make(self, step: int) -> Made: ...

    def skipped(self) -> set[str]:
        """The bad shard members left out so far (backend.data_errors=skip)."""
        ...


def _produce(samples: StepMaker, steps: range, made: Any, finished: Any) -> None:
    for step in steps:
        try:
            made.put((step, _pack(samples.make(step)), samples.skipped()))
        except Exception as error:  # the trainer raises it as its own, as inline preprocessing would
            made.put((step, error, set()))
            return
    # Shared-memory tensors live as long as their maker: stay until the trainer is done.
    finished.wait()


class Producer:
    """One trainer's producer process (spawned: it never inherits the trainer's process
    groups or threads), started at once so that it works while the trainer builds its model."""

    def __init__(self, samples: StepMaker, steps: range, depth: int, timeout_s: float, rank: int) -> None:
        """`steps`: the steps to make batches for, in order (a resumed run's start after its checkpoint)."""
        context = mp.get_context("spawn")
        self.made = context.Queue(maxsize=depth)
        self.finished = context.Event()
        self.timeout_s, self.rank = timeout_s, rank
        self.skipped: set[str] = set()  # bad shard members the producer left out (backend.data_errors=skip)
        self.process = context.Process(
            target=_produce, args=(samples, steps, self.made, self.finished), daemon=True, name=f"mmdist-preprocess{rank}"
        )
        self.process.start()

    def get(self, step: int) -> Made:
        """The step's micro-batches, waiting for the producer while it is alive, at most
        `timeout_s` (the first step also waits for its start)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                made_step, made, skipped = self.made.get(timeout=0.1)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the preprocessing producer of rank {self.rank} exited with code {self.process.exitcode} before step {step}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the preprocessing producer of rank {self.rank} made no batch for step {step} within "
                        f"backend.timeout_s={self.timeout_s:g} s"
                    ) from None
                continue
            assert made_step == step, f"producer made step {made_step}, trainer expected {step}"
            if isinstance(made, Exception):
                raise made
            self.skipped |= skipped
            return _unpack(*made)

    def close(self) -> None:
        """After the last step the producer leaves at once; one that is still making batches
        (the trainer failed) or blocked on a full queue is stopped."""
        self.finished.set()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
