"""Start an embedded engine as a real subprocess (tests, benchmarks, the run's engines) and stop it reliably.

The API key reaches the engine in its environment (API_KEY_ENV), never on its command line: any local user can read
another's argv (`ps`), only the owner can read /proc/<pid>/environ.

An engine started here dies with the process that started it, even on kill -9 (no orphan keeps the port and the
memory): the launcher names itself in PARENT_ENV and the engine calls `die_with_parent` first thing. Such an engine
ignores SIGINT and SIGTERM, which a terminal or a scheduler sends to the whole process group: stopping it is the
launcher's part (a trainer checkpoints first, then kills it).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from engines.protocol import tls_context

# The engine process reads its API key from this variable and drops it from its environment at once.
API_KEY_ENV = "RLKERNELS_ENGINE_API_KEY"


# "<pid>:<main|thread>": the launcher's pid, and whether it launched from its main thread (see die_with_parent).
PARENT_ENV = "RLKERNELS_ENGINE_PARENT"
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
PARENT_POLL_S = 0.2  # how often the watchdog looks for a new parent


def parent_tag() -> str:
    """What the launcher puts in PARENT_ENV."""
    main = threading.current_thread() is threading.main_thread()
    return f"{os.getpid()}:{'main' if main else 'thread'}"


def die_with_parent(tag: str | None) -> None:
    """Engine side: exit when the launcher named by `tag` (PARENT_ENV) dies, however it dies.

    A watchdog thread exits as soon as this process's parent changes (a dead parent's children are re-parented).
    On Linux, when the launcher started us from its main thread, the kernel also sends SIGKILL on its death
    (PR_SET_PDEATHSIG), which works even while Python is stuck in native code; it is not armed for a launch from
    another thread, because the kernel fires it when that *thread* exits, which would kill a healthy engine."""
    if not tag:
        return
    pid_text, _, how = tag.partition(":")
    parent = int(pid_text)
    if how == "main" and sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            print(f"warning: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}); the watchdog thread "
                  f"alone ends this engine with its parent", file=sys.stderr)
    if os.getppid() != parent:  # the launcher died before we got here
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)  # no cleanup to wait for: the engine holds nothing that outlives it

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def new_api_key() -> str:
    """A random key for an engine the run starts (256 bits; URL-safe, so it fits a Bearer header as is)."""
    return secrets.token_urlsafe(32)


def engine_env(api_key: str | None, root: str, base: dict[str, str]) -> dict[str, str]:
    """The engine process's environment: `base` with the project on PYTHONPATH and the key in API_KEY_ENV (removed
    when there is no key, so a key in the caller's own environment never opens or locks an engine by accident).

    TRITON_INTERPRET is set to 0: the engine's kernel (kernels.sampling) takes the production path of its device,
    never Triton's interpreter, which the test process turns on for itself (conftest.py) and which costs tens of
    milliseconds a decode step on the CPU."""
    env = {k: v for k, v in base.items() if k != API_KEY_ENV}
    env["PYTHONPATH"] = root + os.pathsep + base.get("PYTHONPATH", "")
    env["TRITON_INTERPRET"] = "0"
    if api_key:
        env[API_KEY_ENV] = api_key
    return env


PORT_RETRIES = 3  # a picked port taken before the engine bound it: start again on another, this many times


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    """`with EngineProcess(model="tiny") as eng: eng.url ...` — spawns `python -m engines.embedded`, waits for
    /health (deadline `start_timeout_s`), and kills the process on exit (also on errors).

    api_key: required on every route when given (passed in the environment, not argv). None leaves the engine
    open to every local user: fine for a test's throwaway engine, not for a run's (trainer.run.engines_for gives
    each engine it starts the configured key or a new_api_key())."""

    def __init__(self, model: str = "tiny", *, port: int | None = None, api_key: str | None = None, seed: int = 0,
                 extra_args: tuple[str, ...] = (), start_timeout_s: float = 120.0, threads: int = 1,
                 device: str | None = None, cpus: tuple[int, ...] | None = None):
        self.model, self.port, self.api_key, self.seed = model, port or free_port(), api_key, seed
        # A port we picked may be taken by another process before the engine binds it (free_port only finds one
        # free now): wait_healthy then starts the engine again on another, up to PORT_RETRIES times.
        self.port_retries = PORT_RETRIES if port is None else 0
        self.extra_args, self.start_timeout_s, self.threads = extra_args, start_timeout_s, threads
        self.device = device  # None: the engine's default (cuda when available, else cpu)
        self.cpus = cpus  # None: not pinned; else the cores it runs on (its threads: their number)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineProcess:
        return self.launch().wait_healthy()

    def launch(self) -> EngineProcess:
        """Spawn without waiting (start several engines in parallel, then wait_healthy() each)."""
        cmd = [sys.executable, "-m", "engines.embedded", "--model", self.model, "--port", str(self.port),
               "--seed", str(self.seed), "--threads", str(self.threads),
               *(("--device", self.device) if self.device else ()),
               *(("--cpus", ",".join(map(str, self.cpus))) if self.cpus else ()), *self.extra_args]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**engine_env(self.api_key, root, dict(os.environ)), PARENT_ENV: parent_tag()}
        # stderr goes to a file, not a pipe: nobody reads a pipe while the engine runs, and a full one (64 KiB of
        # warnings) would block the engine's next write, i.e. hang it.
        self.stderr_file = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=self.stderr_file)
        return self

    def stderr_tail(self, nbytes: int = 2000) -> str:
        """The last `nbytes` of what the engine wrote to stderr (for error messages)."""
        f = self.stderr_file
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - nbytes))
        return f.read().decode(errors="replace")

    def wait_healthy(self) -> EngineProcess:
        """Poll /health until it answers 200 (or the process exits, or the deadline passes)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client(headers=headers, timeout=2.0, verify=tls_context()) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    err = self.stderr_tail()
                    if self.port_retries and "address already in use" in err:
                        self.port_retries -= 1
                        self.stderr_file.close()
                        self.port = free_port()
                        self.launch()
                        continue
                    raise RuntimeError(f"engine exited with code {self.proc.returncode} while starting:\n{err}")
                try:
                    r = client.get(self.url + "/health")
                    # Our engine's answer (another process that took the port could answer too)
                    if r.status_code == 200 and r.json().get("pid", self.proc.pid) == self.proc.pid:
                        return self
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"engine on port {self.port} not healthy within {self.start_timeout_s:.0f}s")

    def kill(self) -> None:
        """SIGKILL (what a crash looks like to the trainer) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        if self.proc is not None:
            self.stderr_file.close()

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
