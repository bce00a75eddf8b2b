"""The layer rules and the engine protocol's wire parsing.

Layers: `kernels/` imports neither `trainer/` nor `engines/`; `engines/` never imports `trainer/`; no import cycle
among the project's modules. Imports are read with `ast` from every module (function-level imports included, so
a lazy import cannot hide a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engines.protocol import Completion
from engines.sglang import EngineError, parse_finish_reason, parse_generate, parse_weight_version

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "trainer", "engines")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in its body (`from a import b` counts a.b when it is a module)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a module we do not own a file for: its package
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cyc := visit(m)):
                return cyc
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cyc := visit(n)):
            return cyc
    return None


def test_layers_engines_never_import_trainer_and_kernels_import_neither():
    graph = _graph()
    assert len(graph) > 20 and "engines.tiny" in graph and "trainer.rollout.manager" in graph
    bad = [(a, b) for a, deps in graph.items() for b in deps
           if (a.startswith("engines") and b.startswith("trainer"))
           or (a.startswith("kernels") and b.split(".")[0] in ("trainer", "engines"))]
    assert bad == [], f"layer violations (importer, imported): {bad}"


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_cycle_finder_finds_a_lazy_import_cycle(tmp_path):
    """The checker itself: a function-level import closing a loop is reported."""
    known = {"trainer.a", "trainer.b"}
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from trainer.b import f\n")
    b.write_text("def f():\n    from trainer import a\n    return a\n")
    graph = {"trainer.a": _imports("trainer.a", a, known), "trainer.b": _imports("trainer.b", b, known)}
    assert graph == {"trainer.a": {"trainer.b"}, "trainer.b": {"trainer.a"}}
    assert _find_cycle(graph) in (["trainer.a", "trainer.b", "trainer.a"], ["trainer.b", "trainer.a", "trainer.b"])


# ---------------------------------------------------------------------------------------------- SGLang wire
@pytest.mark.parametrize("reason, expect", [
    ({"type": "stop", "matched": 2}, "stop"),
    ({"type": "stop", "matched": "</s>"}, "stop"),  # a stop string
    ({"type": "stop", "matched": None}, "stop"),
    ({"type": "length", "length": 6}, "length"),
    ({"type": "abort", "message": "Abort in waiting queue"}, "abort"),
    ({"type": "abort", "status_code": 400, "err_type": "BadRequest"}, "abort"),
    ("stop", "stop"), ("length", "length"), ("abort", "abort"),
])
def test_every_sglang_finish_reason_is_parsed(reason, expect):
    assert parse_finish_reason(reason) == expect


@pytest.mark.parametrize("reason", [{"type": "eos_maybe"}, "completed", {"matched": 2}, None, 3])
def test_unknown_finish_reason_is_an_error(reason):
    with pytest.raises(EngineError, match="finish_reason"):
        parse_finish_reason(reason)


def test_weight_version_default_string_and_numbers():
    assert parse_weight_version("default", fallback=4) == 4
    assert parse_weight_version(None, fallback=2) == 2
    assert parse_weight_version("7", fallback=0) == 7 and parse_weight_version(3, fallback=0) == 3
    with pytest.raises(EngineError, match="weight_version"):
        parse_weight_version("v1.2", fallback=0)


def test_parse_generate_groups_prompt_major_and_checks_logprobs():
    out = [{"output_ids": [5 + k], "meta_info": {"finish_reason": {"type": "stop", "matched": 5 + k},
                                                 "output_token_logprobs": [[-0.1 * k, 5 + k, None]],
                                                 "weight_version": "default"}} for k in range(4)]
    groups = parse_generate(out, [[1], [2]], 2, fallback_version=9)
    assert [[c.output_ids for c in g] for g in groups] == [[[5], [6]], [[7], [8]]]
    assert groups[1][1] == Completion([8], [pytest.approx(-0.3)], "stop", 9, [2])
    out[3]["meta_info"]["output_token_logprobs"] = []
    with pytest.raises(EngineError, match="log-probs"):
        parse_generate(out, [[1], [2]], 2)


def test_one_pooled_keep_alive_connection_per_event_loop():
    """Sequential calls from one event loop reuse one TCP connection; another loop gets its own client."""
    import http.server
    import threading

    import trio

    from engines.sglang import SGLangEngine

    connections = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def setup(self):
            super().setup()
            connections.append(self.client_address)

        def do_GET(self):
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = SGLangEngine(f"http://127.0.0.1:{server.server_address[1]}")

    async def many():
        assert all([await engine.health() for _ in range(20)])
        await engine.aclose()

    try:
        trio.run(many)
        assert len(connections) == 1
        trio.run(many)
        assert len(connections) == 2
    finally:
        server.shutdown()
