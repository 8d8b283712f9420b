"""Keep the engine thread's OpenMP workers spinning between ops (CPU, GNU OpenMP only).

torch's CPU wheels run intra-op parallelism on GNU OpenMP (libgomp). Each OS thread that runs a
parallel op gets its own pool of workers. Between parallel regions a worker spins for a while
(``GOMP_SPINCOUNT``; about 3 ms by default) before it sleeps, and waking a sleeping worker costs
tens of microseconds: at batch 1 a decode step runs ~120 small matmuls, so that cost is paid
~120 times a step. libgomp spins only while it manages no more threads than there are CPUs; past
that it spins for 100 iterations ("throttled"), which is as good as sleeping.

An engine runs its model on its own loop thread, while the thread that built it (usually the
main thread) has typically run torch ops already (loading the model): two pools, one worker
each, on a 2-core machine are three managed threads, and every step of the loop thread is
throttled. Measured on the default model in bfloat16, 2 threads: the weight matmuls of one step
take ~28 ms throttled vs ~21 ms with full spinning.

:func:`release_caller_pool` frees the calling thread's idle pool (OpenMP 5.0
``omp_pause_resource_all``). The engine calls it where a pool may be left idle while a loop
thread computes: on the thread that built it (after the model loaded), on the caller's thread at
every ``submit`` (torch work done there since rebuilt one), and on its own loop thread whenever
it goes idle (an idle engine's pool would throttle another engine's, or the caller's torch work),
so that only busy threads hold pools. A thread's next parallel op builds a new pool, which is
correct, only slower once (a thread start). Where the library is not libgomp (another OpenMP,
macOS, CUDA-only work) it does nothing.

Measured on the 2-core machine (SmolLM2 int4, 2 threads, 128 decode steps): with an idle pool
left on the main thread, or on an idle second engine, the loop thread's workers made ~300
voluntary context switches (futex sleeps) a step; with it freed, ~0 (they spin). Spinning is the
right policy only while the process has the cores to itself: with other processes keeping the
cores busy, the spinning master and worker wait on each other's time slices. The engine then runs
its forwards on fewer threads (:mod:`sgrt.engine.threads`, chosen by each forward's measured
time), which needs no barrier at all on one.
"""
from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache

import torch

logger = logging.getLogger("sgrt.engine")

_OMP_PAUSE_SOFT = 1  # OpenMP 5.0 omp_pause_resource_t


@lru_cache(maxsize=1)
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp that this process has loaded (torch's own copy), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    # torch's own copy first: another library may have loaded a second libgomp.
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in sorted(paths, key=lambda p: (not p.startswith(torch_lib), p)):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_caller_pool() -> bool:
    """Free the calling thread's idle OpenMP worker pool; True if one was released.

    Call it from the thread that built an engine, after the model is loaded. Safe to call from
    any thread outside a parallel region (torch never returns to Python inside one).
    """
    lib = _libgomp()
    if lib is None:
        return False
    rc = lib.omp_pause_resource_all(_OMP_PAUSE_SOFT)
    if rc != 0:
        logger.debug("omp_pause_resource_all returned %d", rc)
    return rc == 0
