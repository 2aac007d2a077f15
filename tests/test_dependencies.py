"""The runtime dependencies are exactly what the engine imports; tools live in extras."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# Modules whose third-party imports are optional extras, not runtime dependencies.
OPTIONAL = {
    SRC / "server" / "bench.py": ({"httpx"}, "bench"),
    SRC / "testing" / "chaos.py": ({"psutil"}, "chaos"),
    SRC / "ray.py": ({"ray", "httpx", "starlette"}, "ray"),
}
# Extras too heavy for the test extra: their tests have a command of their own.
OWN_COMMAND = {"ray"}


def _dist_name(requirement: str) -> str:
    name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return {m for m in modules if m not in sys.stdlib_module_names and m != "legato"}


def test_runtime_dependencies_are_exactly_what_src_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_dist_name(r) for r in project["dependencies"]}
    extras = {k: {_dist_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    providers = importlib.metadata.packages_distributions()
    used = set()
    for path in sorted(SRC.rglob("*.py")):
        optional = OPTIONAL.get(path)
        for module in _third_party_imports(path):
            dists = {_dist_name(d) for d in providers.get(module, [])}
            if not dists and optional is not None and optional[1] in OWN_COMMAND:
                # an extra with its own test command need not be installed here
                assert module in extras[optional[1]], f"{module} must be in the {optional[1]} extra"
                continue
            assert dists, f"{path.relative_to(ROOT)} imports {module}, which nothing provides"
            if optional is not None and module in optional[0]:
                assert not dists & runtime, f"{module} must stay out of the runtime dependencies"
                assert dists & extras[optional[1]], f"{module} must be in the {optional[1]} extra"
                if optional[1] not in OWN_COMMAND:
                    assert dists & extras["test"], f"{module} must be in the test extra"
                continue
            assert dists & runtime, (
                f"{path.relative_to(ROOT)} imports {module} ({', '.join(dists)}), "
                "which is not a runtime dependency"
            )
            used |= dists & runtime
    assert runtime - used == set(), f"declared but never imported: {sorted(runtime - used)}"


def test_bench_serve_without_httpx_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['httpx'] = None; from legato.cli import main; "
        "sys.argv = ['legato', 'bench', 'serve', '--url', 'http://127.0.0.1:9']; main()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == 2, done.stderr.decode()
    assert "pip install 'legato[bench]'" in done.stderr.decode()
