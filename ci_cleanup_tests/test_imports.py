"""What the code location loads, and how the modules import each other: the runtime never loads the workshop
(``ci_cleanup_dev``: dev stack, demo, benchmark), and no module imports itself back through others."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from .harness import clean_env

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (REPO / "ci_cleanup", REPO / "tools" / "ci_cleanup_dev")


def modules(roots=PACKAGES) -> dict[str, Path]:
    """Each module's dotted name -> its file (a package by its ``__init__.py``)."""
    found = {}
    for root in roots:
        for path in root.rglob("*.py"):
            parts = path.relative_to(root.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` imports anywhere in its file (at the top, in a function, for type
    checking: each is a dependency), a name imported from a package resolved to its submodule when it is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle once, as the modules along it (Tarjan's strongly connected components, then a path)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_module_of_ci_cleanup_or_ci_cleanup_dev_imports_itself_back():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    # ci_cleanup_dev.batches imports each batch's module by name (importlib): every one of them.
    graph["ci_cleanup_dev.batches"] |= {name for name in known if name.startswith("ci_cleanup_dev.batches.")}
    assert len(known) > 60 and graph["ci_cleanup_dev.bench.launched"] >= {"ci_cleanup_dev.batches",
                                                                          "ci_cleanup_dev.bench.floor"}
    found = [" <-> ".join(component) for component in cycles(graph)]
    assert found == [], f"import cycles: {'; '.join(found)}"


def test_the_cycle_search_finds_a_cycle_through_lazy_and_relative_imports(tmp_path):
    package = tmp_path / "toy"
    (package / "bench").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "bench" / "__init__.py").write_text("")
    (package / "bench" / "run.py").write_text("from . import seed\n\ndef main():\n    from . import traffic\n")
    (package / "bench" / "traffic.py").write_text("def grow():\n    from .run import main\n")
    (package / "bench" / "seed.py").write_text("import toy.bench.workload\n")
    (package / "bench" / "workload.py").write_text("from toy import bench\n")
    known = modules((package,))
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert graph["toy.bench.run"] == {"toy.bench.seed", "toy.bench.traffic"}
    assert cycles(graph) == [["toy.bench.run", "toy.bench.traffic"]]


# Importing these in a fresh process, then what of the workshop it loaded.
LOADED = """
import json, sys
import ci_cleanup.definitions
after_definitions = sorted(sys.modules)
import ci_cleanup.cli
ci_cleanup.cli.parser()
print(json.dumps({"definitions": after_definitions, "cli": sorted(sys.modules)}))
"""


def test_the_code_location_and_the_cli_load_no_workshop_demo_or_bench_module():
    done = subprocess.run([sys.executable, "-c", LOADED], env=clean_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=True)
    loaded = json.loads(done.stdout)
    assert "ci_cleanup.batches" in loaded["definitions"] and "ci_cleanup.cli" in loaded["cli"]
    for when, names in loaded.items():
        workshop = [n for n in names if n.split(".")[0] == "ci_cleanup_dev" or n.endswith(".demo") or ".bench" in n]
        assert workshop == [], f"{when}: {workshop}"


# Each command of the development install, in a process that finds ci_cleanup but not ci_cleanup_dev, as in the
# production image: no site (no editable install's finder), the virtualenv's packages on the path, and ci_cleanup.
WITHOUT_WORKSHOP = """
import contextlib, importlib.util, io, json
from ci_cleanup.cli import main
said = {"ci_cleanup_dev": importlib.util.find_spec("ci_cleanup_dev") is not None}
for argv in (["demo"], ["dev"], ["seed"], ["schema", "create"], ["bench"], ["run", "drop_canceling_builds"],
             ["run", "--embedded", "drop_canceling_builds"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            said[" ".join(a for a in argv if a in (argv[0], "--embedded"))] = [e.code, err.getvalue()]
print(json.dumps(said))
"""


def test_without_the_development_install_each_dev_command_says_so_in_one_line(tmp_path):
    (tmp_path / "ci_cleanup").symlink_to(REPO / "ci_cleanup")
    path = f"{tmp_path}:{sysconfig.get_path('purelib')}"
    done = subprocess.run([sys.executable, "-S", "-c", WITHOUT_WORKSHOP], env=clean_env(PYTHONPATH=path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=True)
    install = "needs the development install (ci_cleanup_dev), which this one lacks: make dev, or pip install -e " \
              "'.[embedded]' in the repository\n"
    assert json.loads(done.stdout) == {
        "ci_cleanup_dev": False,
        **{command: [1, f"ci-cleanup {command}: This command {install}"]
           for command in ("demo", "dev", "seed", "schema", "bench")},
        # With nothing set, run refuses before it would need the workshop: GitLab is not configured.
        "run": [1, "ci-cleanup run: No GitLab to run on: none of CI_CLEANUP_GITLAB_CONFIG_DIR, CI_CLEANUP_DATABASE_URL "
                   "and CI_CLEANUP_REDIS_URL is set\n  Set CI_CLEANUP_GITLAB_CONFIG_DIR to GitLab's config folder (or "
                   "the two URLs); to try the job on the embedded stack instead: ci-cleanup run --embedded …\n"],
        "run --embedded": [1, f"ci-cleanup run: The embedded stack (run --embedded) {install}"],
    }


MAX_MODULE_LINES = 400  # GitLab's services stay under about 300; a module past this holds more than one concern


def test_no_module_the_code_location_loads_is_over_400_lines():
    done = subprocess.run(
        [sys.executable, "-c", "import json, sys, ci_cleanup.definitions; print(json.dumps([m.__file__ for n, m in "
         "sys.modules.items() if n.split('.')[0] == 'ci_cleanup' and getattr(m, '__file__', None)]))"],
        env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    files = [Path(f) for f in json.loads(done.stdout)]
    assert len(files) > 30
    too_long = {str(f.relative_to(REPO)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}
    assert too_long == {}


def test_each_private_dagster_import_says_why_no_public_api_serves():
    """``dagster._…`` only where Dagster has no public API for it, with the reason on the line above."""
    unexplained = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.search(r"\bdagster\._", line) and line.lstrip().startswith(("from ", "import ")):
                above = lines[i - 1].strip() if i else ""
                if not above.startswith("#") and not (i > 1 and lines[i - 2].strip().startswith("#")):
                    unexplained.append(f"{name}:{i + 1}")
    assert unexplained == []
