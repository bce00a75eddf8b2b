"""docs/architecture.md is the page a newcomer reads first: every file and package it names exists, and every
module of trainer/ and engines/ is named on it (a new part is documented where it is looked for)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "architecture.md").read_text()
TOP = ("kernels/", "engines/", "trainer/", "tests/", "docs/", "bench/", "configs/", "examples/")


def named_paths(page: str) -> set[str]:
    """Every path the page writes in backticks: full ones (`trainer/serve/`, `engines/embedded/lora.py`) anywhere,
    and in a package table row (| `engines/` | ...) the names relative to that package (`embedded/lora.py`)."""
    out = {p for p in re.findall(r"`([\w/.]+)`", page) if p.startswith(TOP)}
    for package, text in re.findall(r"^\| `([\w/]+/)` \| (.*) \|$", page, flags=re.M):
        out |= {package + m for m in re.findall(r"`([\w/]+(?:\.py|/))`", text) if not m.startswith(TOP)}
    return out


def test_every_path_the_page_names_exists():
    missing = sorted(p for p in named_paths(PAGE) if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_library_module_is_on_the_page():
    named = named_paths(PAGE)
    # a sub-package a row describes as one part (`embedded/` in the engines/ row) names its modules; a row's own
    # package (| `trainer/rollout/` | ...) does not: the row names each of its modules
    headers = set(re.findall(r"^\| `([\w/]+/)` \|", PAGE, flags=re.M))
    folders = tuple(p for p in named if p.endswith("/") and p.count("/") > 1 and p not in headers)

    def on_page(rel: str) -> bool:
        return rel in named or rel.startswith(folders)

    unnamed = sorted(rel for pkg in ("trainer", "engines") for p in (ROOT / pkg).rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py")
                     and not on_page(rel := str(p.relative_to(ROOT))) and "vllm_ext" not in p.parts)
    assert not unnamed, f"modules docs/architecture.md does not name (add them to its package table): {unnamed}"


def test_the_check_sees_a_missing_path_and_a_row_relative_name():
    page = "| `engines/` | `embedded/lora.py` (x), `nothing_here.py` |\nsee `trainer/serve/`\n"
    assert named_paths(page) == {"engines/", "engines/embedded/lora.py", "engines/nothing_here.py", "trainer/serve/"}


def long_functions(root: Path, limit: int) -> list[str]:
    """Every function under `root` longer than `limit` lines (its def line to its last line), as path:name (n)."""
    import ast

    out = []
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{p.relative_to(root.parent)}:{node.name} ({n} lines)")
    return out


def test_no_function_in_trainer_is_over_80_lines():
    """The house rule the page states (a loop is setup + a readable step, not one long function)."""
    assert long_functions(ROOT / "trainer", 80) == []


def test_the_length_check_sees_a_long_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def short():\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * 81)
    assert long_functions(pkg, 80) == ["pkg/m.py:long (82 lines)"]


def test_the_library_never_imports_the_demo_tasks():
    """The demo tasks live outside the library (examples/tasks/): kernels/, engines/ and trainer/ name them only in
    text (configs, docstrings), never in an import."""
    import ast

    found = []
    for pkg in ("kernels", "engines", "trainer"):
        for p in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{p.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "examples"]
    assert found == []
