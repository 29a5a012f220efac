"""ci_cleanup's workshop: the embedded dev stack, the demo dataset, the benchmark and GitLab's vendored DDL.

Installed beside ``ci_cleanup`` by the development install (``make dev``, ``pip install -e .``), never in the
production image: the code location (``ci_cleanup.definitions``) imports nothing of it.
"""
