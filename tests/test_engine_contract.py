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
    # A server that does not say which version made which token (stock SGLang): every token gets the request's.
    assert groups[1][1] == Completion([8], [pytest.approx(-0.3)], "stop", 9, [2], weight_versions=((0, 9),))
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


# ----------------------------------------------------------------------------------------------- typed contract
def _serve(routes: dict[tuple[str, str], tuple[int, dict]], seen: list[str]):
    """A loopback HTTP server answering (method, path) -> (status, JSON body); records the paths it is asked."""
    import http.server
    import json
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            seen.append(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            status, body = routes.get((method, self.path), (404, {"message": "Not Found"}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer("GET")

        def do_POST(self):
            self._answer("POST")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_engine_errors_carry_the_status_and_a_missing_route_is_told_by_it():
    """A stock server without our routes (404 / 405): the SGLang client falls back by status. A 400 whose message
    reads "HTTP 404" is still a rejected request: nothing is decided from an error's text."""
    import trio

    from engines.protocol import EngineUnavailableError
    from engines.sglang import SGLangEngine

    seen: list[str] = []
    routes = {("POST", "/abort_request"): (405, {"message": "Method Not Allowed"}),
              ("POST", "/pause_generation"): (200, {"success": True}),
              ("POST", "/continue_generation"): (200, {"success": True}),
              ("GET", "/get_model_info"): (400, {"message": "HTTP 404 lookalike"}),
              ("GET", "/flush_cache"): (503, {"message": "busy"})}
    server = _serve(routes, seen)
    engine = SGLangEngine(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=10)
    try:
        assert trio.run(engine.world_size) == 1 and trio.run(engine.weight_formats) == ("direct",)
        assert trio.run(engine.colocation_info) == {}
        del seen[:]
        trio.run(engine.abort, ["r1"])  # no /abort_request: pause in abort mode + continue cut every request
        assert seen == ["/abort_request", "/pause_generation", "/continue_generation"]
        with pytest.raises(EngineError, match="HTTP 400: HTTP 404 lookalike") as rejected:
            trio.run(engine.get_weight_version)
        assert rejected.value.status == 400 and not rejected.value.missing_route
        with pytest.raises(EngineUnavailableError) as busy:
            trio.run(engine.flush_cache)
        assert busy.value.status == 503
        routes[("POST", "/colocated_weights")] = (400, {"message": "HTTP 404 lookalike"})
        with pytest.raises(EngineError, match="lookalike"):  # a probe that was refused is an error, not "remote"
            trio.run(engine.colocation_info)
        del seen[:]
        assert trio.run(SGLangEngine(engine.url, extensions=False).colocation_info) == {} and seen == []
    finally:
        server.shutdown()


def test_engine_error_status_survives_pickling():
    import pickle

    from engines.protocol import EngineUnavailableError

    err = pickle.loads(pickle.dumps(EngineUnavailableError("http://h:1/generate: HTTP 503: busy", status=503)))
    assert type(err) is EngineUnavailableError and err.status == 503 and str(err).endswith("busy")
    assert EngineError("no answer").status is None and EngineError("x", status=405).missing_route


@pytest.mark.parametrize("fields,message", [
    ({"kind": "trt", "url": "http://h:1"}, "kind = 'trt'"),
    ({"kind": "sglang"}, "needs a url"),
    ({"kind": "vllm", "url": "host:1"}, "http"),
    ({"kind": "sglang", "url": "http://h:1", "tp_size": 0}, "tp_size"),
    ({"kind": "sglang", "url": "http://h:1", "tp_size": True}, "tp_size"),
    ({"kind": "embedded", "tp_size": 2}, "one device"),
    ({"kind": "local", "url": "http://h:1"}, "takes no url"),
    ({"kind": "vllm", "url": "http://h:1", "model": 3}, "model"),
])
def test_engine_spec_names_the_bad_field(fields, message):
    from engines.registry import EngineSpec

    with pytest.raises(ValueError, match=message):
        EngineSpec(**fields)


def test_registry_builds_every_kind_from_its_spec():
    import trio

    from engines.protocol import InferenceEngine
    from engines.registry import ENGINE_KINDS, EngineSpec, build_engine
    from engines.sglang import SGLangEngine
    from engines.tinker import TinkerEngine
    from engines.vllm import VLLMEngine

    assert set(ENGINE_KINDS) == {"sglang", "vllm", "embedded", "local", "tinker"}
    sg = build_engine(EngineSpec("sglang", "http://a:1/", tp_size=4), model_folder="/m", api_key="k",
                      connect_timeout_s=3.0, max_connections=7)
    assert type(sg) is SGLangEngine and sg.url == "http://a:1" and sg.headers == {"Authorization": "Bearer k"}
    assert (sg.connect_timeout_s, sg.max_connections) == (3.0, 7) and trio.run(sg.world_size) == 4
    vl = build_engine(EngineSpec("vllm", "http://b:2"), model_folder="/models/x")
    assert type(vl) is VLLMEngine and vl.model == "/models/x"
    assert build_engine(EngineSpec("vllm", "http://b:2", model="served"), model_folder="/m").model == "served"
    emb = build_engine(EngineSpec("embedded", "http://c:3"), model_folder="/m")
    assert type(emb) is SGLangEngine and trio.run(emb.world_size) == 1
    tk = build_engine(EngineSpec("tinker", "http://d:4", api_key="tml-k"), model_folder="/m")
    assert type(tk) is TinkerEngine and (tk.url, tk.api_key) == ("http://d:4", "tml-k")
    assert all(isinstance(e, InferenceEngine) for e in (sg, vl, emb, tk))
    # (vl.weight_formats asks the server whether it serves synced LoRA adapters: tests/test_vllm_lora_real.py)
    assert trio.run(vl.colocation_info) == {}
    with pytest.raises(ValueError, match="start the engine first"):
        build_engine(EngineSpec("embedded"), model_folder="/m")


def _calls_and_attributes(path: Path) -> tuple[set[str], list[str]]:
    """Names called in a module, and the string constants it compares with `in` (text matching)."""
    tree = ast.parse(path.read_text())
    called = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
    matched = [c.left.value for c in ast.walk(tree) if isinstance(c, ast.Compare) and isinstance(c.left, ast.Constant)
               and isinstance(c.left.value, str) and any(isinstance(op, (ast.In, ast.NotIn)) for op in c.ops)]
    return called, matched


def test_the_engine_contract_is_declared_not_probed():
    """The weight sync calls what engines.protocol declares (no hasattr); no engine error is recognised by its
    text; trainer/ builds engines only through engines.registry."""
    paths = sorted((ROOT / "trainer" / "weight_sync").glob("*.py"))
    for path in paths:
        called, _ = _calls_and_attributes(path)
        assert "hasattr" not in called, path
    for path in [*paths, *sorted((ROOT / "engines").glob("*.py"))]:
        _, matched = _calls_and_attributes(path)
        assert not [m for m in matched if "HTTP" in m], (path, matched)
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        called, _ = _calls_and_attributes(path)
        assert not called & {"SGLangEngine", "VLLMEngine", "LocalEngine"}, path
