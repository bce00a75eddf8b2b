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
