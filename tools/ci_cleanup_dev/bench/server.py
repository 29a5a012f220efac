"""The machine and the PostgreSQL server the benchmark's figures come from: what they are, as its output names
them, and the embedded PostgreSQL set up as Omnibus GitLab runs its own."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, text

from . import launched

if TYPE_CHECKING:
    from ci_cleanup_dev.devstack import EmbeddedStack


MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v2, v1


def memory_bytes() -> int:
    """The machine's RAM, or the memory its container may use when that is less."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in MEMORY_LIMITS:
        try:
            ram = min(ram, int(Path(limit).read_text()))
        except (OSError, ValueError):  # not this cgroup version, or no limit ("max")
            pass
    return ram


def machine() -> str:
    mem = memory_bytes() / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}"


def omnibus_postgres() -> dict[str, str]:
    """Omnibus GitLab's own settings for its PostgreSQL's memory and planner (its postgresql cookbook's
    ``attributes/default.rb``): the bench's embedded PostgreSQL runs as GitLab's package runs it, not on
    PostgreSQL's defaults (128 MB of shared buffers). Omnibus' maintenance_work_mem (16 MB) is left out: it only
    slows the seed's index builds, which nothing here measures."""
    ram_mb = memory_bytes() // 2**20  # in a container, a quarter of what it may use, not of the host's RAM
    return {"shared_buffers": f"{ram_mb // 4}MB", "effective_cache_size": f"{ram_mb // 2}MB", "work_mem": "16MB",
            "random_page_cost": "2", "max_parallel_workers_per_gather": "0"}


# glibc's malloc for the bench's PostgreSQL, in its postmaster's environment, which every backend inherits: a backend's
# heap kept as it grew, never given back after a statement (nor its large blocks mapped and unmapped each time). With
# glibc's defaults, the first statements of a new backend decide whether each later statement's planning memory
# (2.4 MB for environments' batch: partitioned p_ci_builds, three times) goes back to the system at its end and is
# faulted in again by the next. On its own new connection, environments' batch statement ran at 370 page faults a
# statement (strace: brk up 2.4 MB and down again each time), the floor's at 92; after 20 of the floor's statements,
# the job's ran at 92 too, and the floor's at 243 after 20 of the job's. That was 0.5-0.7 ms of PostgreSQL CPU a
# batch (1,000-batch runs, 8 pairs) set by which statement came first on a connection, not by the work. Held, the
# job's statement ran within 0.05 ms a batch of the floor's, with the same page faults.
HELD_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


def malloc_settings(pid: int) -> dict[str, str]:
    """The glibc malloc variables (``MALLOC_*``) in process ``pid``'s environment."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(v.decode().split("=", 1) for v in environ if v.startswith(b"MALLOC_"))


def hold_heap(stack: EmbeddedStack) -> None:
    """The embedded PostgreSQL restarted with :data:`HELD_HEAP`, unless it runs with it already."""
    if malloc_settings(stack.postgres_pid) == HELD_HEAP:
        return
    stack.stop_postgres()
    stack.start_postgres(HELD_HEAP)


def postgres_settings(url: str) -> str:
    """The measured PostgreSQL's version and its settings that :func:`omnibus_postgres` names, as it reports them;
    and glibc's malloc variables in its environment, where its processes can be read."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            shown = [f"{name} {conn.scalar(text('SELECT current_setting(:n)'), {'n': name})}"
                     for name in ("server_version", *omnibus_postgres())]
            pid = launched.postmaster_pid(conn.connection.cursor())
    finally:
        engine.dispose()
    if pid is not None:
        malloc = malloc_settings(pid)
        shown.append(" ".join(f"{k}={v}" for k, v in sorted(malloc.items())) if malloc else "glibc malloc's defaults")
    return ", ".join(shown)
