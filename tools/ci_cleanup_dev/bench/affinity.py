"""PostgreSQL on a core of its own, the clients on the other (``bench --traffic``), as on a real installation where
neither GitLab's traffic nor a job's client shares the database host's CPU: ``os.sched_setaffinity``.

The postmaster and every process it started so far go to the server's CPU; the backends it starts later inherit
its mask. This process's threads (those started later inherit the mask of the thread starting them, so the
workload's process and the job's threads too) and the given client-side processes (Redis) go to the other CPU.
Every mask is put back at the end, on the processes alive then.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

SERVER_CPU, CLIENT_CPU = 0, 1


def children(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (a postmaster's backends and helpers)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry.name))
    return found


def own_threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _set(pids: list[int], cpus: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # a backend that ended meanwhile
            os.sched_setaffinity(pid, cpus)


@contextlib.contextmanager
def pinned(postmaster: int | None, client_side: list[int], log: Callable[[str], None]) -> Iterator[str]:
    """PostgreSQL on CPU 0, this process and ``client_side`` on CPU 1 while the block runs; yields what was done, in
    words, for the output. ``postmaster`` None: a server this bench did not start (or cannot see), left alone."""
    if postmaster is None:
        yield "not pinned: the PostgreSQL server is not the embedded one this bench started"
        return
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        yield "not pinned: the machine has a single CPU"
        return
    server_mask, client_mask = os.sched_getaffinity(postmaster), os.sched_getaffinity(0)
    others = {pid: os.sched_getaffinity(pid) for pid in client_side}
    _set([postmaster, *children(postmaster)], {SERVER_CPU})
    _set([*own_threads(), *client_side], {CLIENT_CPU})
    log(f"PostgreSQL (postmaster {postmaster} and its processes) on CPU {SERVER_CPU}; this bench, its workload and "
        f"Redis on CPU {CLIENT_CPU}")
    try:
        yield (f"pinned: PostgreSQL's processes on CPU {SERVER_CPU}, the workload, the job's client (this process) "
               f"and Redis on CPU {CLIENT_CPU} (`os.sched_setaffinity`)")
    finally:
        _set([postmaster, *children(postmaster)], server_mask)
        _set(own_threads(), client_mask)
        for pid, mask in others.items():
            _set([pid], mask)
