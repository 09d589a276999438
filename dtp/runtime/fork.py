"""Forking ranks from a process that has already run torch.

A forked rank is a copy of its parent, and two things it inherits would break it:

- **OpenMP's thread pool.** GNU libgomp (torch's CPU builds) keeps a pool per thread that has run
  a parallel region on more than one thread. A process forked from that thread inherits the pool
  without its threads, and its first parallel region on more than one thread waits for them forever:
  `dtp train --tp 1` on a 2-core machine hung at step 1, its parent having filled a 32 MB buffer on
  two threads. The forking thread's pool is released first (`omp_pause_resource_all`, OpenMP 5.0:
  its threads exit; the parent's next parallel region starts new ones), so a rank makes its own.
  LLVM's and Intel's OpenMP runtimes mend their pools after a fork themselves. Forking from a thread
  that never ran torch would avoid the pool too, but a rank would then allocate from that thread's
  malloc arena, not the main one, and hold on to memory it frees (12–14 MB more resident while a rank
  builds its shards of a 21 M-parameter model).
- **Objects in reference cycles not yet collected.** The rank's garbage collector would run their
  destructors there, without the threads they own: a process group of an earlier run in this
  process hangs (or crashes) joining its workers. The ranks are forked with every object frozen
  (`gc.freeze`), out of their collector's reach.

Spawned ranks (CUDA) inherit neither.

One thing cannot be mended in a fork: **autograd's device threads.** Once torch's autograd engine has
started them in a process (a backward on a GPU; on torch 2.14, a backward through an Inductor-compiled
graph on the CPU too), torch marks every process forked from it unable to run a backward ("Unable to
handle autograd's threading in combination with fork-based multiprocessing"). `autograd_forbids_fork`
tells, from the threads' names (`pt_autograd_N`), and the launcher then spawns the ranks instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from pathlib import Path

OMP_PAUSE_HARD = 2  # omp_pause_resource_t


def _libgomps() -> list[str]:
    """The GNU OpenMP runtimes loaded in this process (a wheel may bundle its own renamed copy, as
    libgomp-<hash>.so.1, beside the system's)."""
    with contextlib.suppress(OSError):
        paths = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
        return sorted(p for p in paths if Path(p).name.startswith("libgomp"))
    return []


def release_openmp_pool() -> None:
    """Release this thread's GNU OpenMP pool in every loaded libgomp (nothing where none is loaded
    or it predates OpenMP 5.0)."""
    for path in _libgomps():
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(path).omp_pause_resource_all(OMP_PAUSE_HARD)


def autograd_forbids_fork() -> bool:
    """Whether torch's autograd engine runs device threads in this process, so that a forked child
    could not run a backward (False where /proc cannot tell)."""
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                if Path(f"/proc/self/task/{task}/comm").read_text().startswith("pt_autograd"):
                    return True
    return False


def start(procs: list) -> None:
    """`p.start()` for each of `procs` (fork-context processes), this thread's OpenMP pool released
    and every object frozen while they fork."""
    release_openmp_pool()
    # gc has one frozen set: thaw it again only if nothing had frozen objects before
    thaw = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        if thaw:
            gc.unfreeze()
