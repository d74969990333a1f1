"""What every CPU worker imports, imported once: the local driver's forkserver runs this
before it forks the workers (src/runtime/driver.py), so 4 workers on 2 cores do not each
pay seconds of torch, DeepSpeed and torch._dynamo imports (an optimizer's first
construction imports torch._dynamo, about a second on its own)."""

from __future__ import annotations

import gc
import os
import signal

from src.runtime.lifeline import die_with_parent

die_with_parent()  # first: a door killed while this imports leaves no forkserver behind
# Ctrl-C reaches the door's whole process group, this forkserver with it: the door stops
# it (and a KeyboardInterrupt here would print the traceback of an import).
signal.signal(signal.SIGINT, signal.SIG_IGN)

# Before DeepSpeed's first import: gloo workers use no accelerator (no probe).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch._dynamo  # noqa: E402,F401  (torch.optim constructors import it lazily)

import src.runtime.session  # noqa: E402,F401  (torch, DeepSpeed, our modules)

# DeepSpeed's optimizer check imports its Muon optimizer at a ZeRO engine's first
# construction, whose kernels' torch.compile wrappers import torch._inductor: 1.6 s of CPU
# in every worker of every launch, paid here once.
try:
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
except ImportError:  # a DeepSpeed without Muon checks for none
    pass
from src.runtime.op_build import OpBuildError, prebuild_ops  # noqa: E402

# DeepSpeed's CPU op, built (or loaded from the cache) once, before any worker joins a group.
# A failure must not take the forkserver down with an exception of its own: it is
# remembered, and each worker's own call reports it as the worker's error.
try:
    prebuild_ops()
except OpBuildError:
    pass

# Everything imported so far lives as long as the workers: out of the collector's reach
# (Python's gc docs: freeze before forking without exec), so a worker's collections, the
# full one after each run included, walk its own objects, not the ~300 000 of torch and
# DeepSpeed (0.15-0.2 s of CPU each on this kind of machine).
gc.freeze()
