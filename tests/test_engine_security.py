"""The engine's open door (issue 30, security): engines the run starts require a random API key that never shows
on their command line; a non-loopback engine without a key is refused. Real processes, real HTTP on loopback."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import trio
from device_support import cpu_child_env

from engines.embedded.launch import API_KEY_ENV, free_port
from engines.protocol import SamplingParams
from trainer.cli import build_engines, engines_for
from trainer.config import EnginesConfig, RunConfig

ROOT = Path(__file__).resolve().parents[1]


def pids_listening_on(port: int) -> list[int]:
    """The processes whose command line names `--port <port>` (the engine started for that port)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engines.embedded" in argv and str(port).encode() in argv:
            out.append(int(pid))
    return out


def test_run_started_engine_requires_its_random_key_and_hides_it_from_ps():
    cfg = RunConfig(engines=EnginesConfig(fleet=({"kind": "embedded"},), start_timeout_s=120.0))
    assert cfg.engines.api_key is None  # nothing configured: the run makes a key of its own
    with engines_for(cfg, Path("tiny"), is_main=True) as fleet:
        spec = fleet[0]
        assert spec.api_key and len(spec.api_key) >= 32 and spec.api_key not in repr(spec)
        # A neighbour without the key: every route refused, the weights and the schedule untouched.
        for route, body in (("/pause_generation", {"mode": "abort"}),
                            ("/update_weights_from_disk", {"model_path": "/tmp/poison"}),
                            ("/colocated_weights", {"op": "probe"}),
                            ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})):
            r = httpx.post(spec.url + route, json=body, timeout=30)
            assert r.status_code == 401, (route, r.status_code, r.text)
        wrong = httpx.post(spec.url + "/pause_generation", json={}, timeout=30,
                           headers={"Authorization": "Bearer " + "x" * len(spec.api_key)})
        assert wrong.status_code == 401
        # The trainer's own client (built from the fleet as the run builds it) is let in.
        (eng,) = build_engines(fleet, Path("tiny"))
        out = trio.run(eng.generate, [[1, 20, 21]], SamplingParams(temperature=0, max_new_tokens=4,
                                                                    ignore_eos=True))
        assert len(out[0][0].output_ids) == 4
        assert trio.run(eng.get_weight_version) == 0
        # The key is in no process's argv (what `ps` shows every local user).
        port = int(spec.url.rsplit(":", 1)[1])
        (pid,) = pids_listening_on(port)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"--port" in argv and spec.api_key.encode() not in argv and b"--api-key" not in argv
        # It travels in the environment instead, which only the engine's owner can read.
        assert os.stat(f"/proc/{pid}/environ").st_mode & 0o077 == 0


def test_configured_key_is_used_for_the_started_engine():
    cfg = RunConfig(engines=EnginesConfig(fleet=({"kind": "embedded"},), api_key="configured-key-123",
                                          start_timeout_s=120.0))
    with engines_for(cfg, Path("tiny"), is_main=True) as fleet:
        assert fleet[0].api_key == "configured-key-123"
        ok = httpx.get(fleet[0].url + "/get_weight_version", timeout=30,
                       headers={"Authorization": "Bearer configured-key-123"})
        assert ok.status_code == 200 and ok.json()["weight_version"] == "0"


def _engine_cli(*args: str, env_key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in cpu_child_env([str(ROOT)]).items() if k != API_KEY_ENV}  # PYTHONPATH kept, ROOT first
    if env_key:
        env[API_KEY_ENV] = env_key
    return subprocess.run([sys.executable, "-m", "engines.embedded", "--model", "tiny", "--port", str(free_port()),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_non_loopback_host_without_a_key_is_refused_before_loading():
    proc = _engine_cli("--host", "0.0.0.0")
    assert proc.returncode != 0
    assert "--host 0.0.0.0 without an API key" in proc.stderr and "--allow-no-key" in proc.stderr
    both = _engine_cli("--host", "0.0.0.0", "--api-key", "k1", env_key="k2")
    assert both.returncode != 0 and f"--api-key and {API_KEY_ENV}" in both.stderr


def test_key_file_must_be_private(tmp_path):
    from engines.embedded.__main__ import check_exposure, resolve_api_key

    f = tmp_path / "key"
    f.write_text("s3cret\n")
    f.chmod(0o644)
    with pytest.raises(SystemExit, match="chmod 600"):
        resolve_api_key(None, str(f), {})
    f.chmod(0o600)
    assert resolve_api_key(None, str(f), {}) == "s3cret"
    assert resolve_api_key(None, None, {API_KEY_ENV: "from-env"}) == "from-env"
    check_exposure("127.0.0.1", None, False)  # loopback: open is allowed (a test's throwaway engine)
    check_exposure("0.0.0.0", None, True)  # the explicit opt-in
    check_exposure("0.0.0.0", "k", False)
    with pytest.raises(SystemExit, match="--allow-no-key"):
        check_exposure("engine.example", None, False)


# A trainer-like parent: starts an engine (from its main thread, or from a thread that then ends) and waits.
PARENT = """
import sys, threading, time
from engines.embedded.launch import EngineProcess
eng = EngineProcess("tiny", start_timeout_s=120.0)
if sys.argv[1] == "thread":
    t = threading.Thread(target=eng.start)
    t.start()
    t.join()  # the launching thread is gone: the engine must outlive it
else:
    eng.start()
print(eng.proc.pid, flush=True)
time.sleep(600)
"""


def is_gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for a reaper that may never come in a container)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


@pytest.mark.parametrize("launched_from", ["main", "thread"])
def test_engine_dies_with_its_trainer_on_kill_9(launched_from):
    env = cpu_child_env([str(ROOT)])  # the parent's engine too sees no GPU
    parent = subprocess.Popen([sys.executable, "-c", PARENT, launched_from], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())  # printed once the engine answered /health
        time.sleep(1.0)  # the engine is serving; a launching thread that ended did not take it down
        assert not is_gone(engine_pid)
        parent.kill()  # SIGKILL: no finally, no atexit in the trainer runs
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10.0
        while not is_gone(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert is_gone(engine_pid), f"engine {engine_pid} outlived its killed parent"
    finally:
        parent.kill()
        parent.wait(timeout=30)


# ------------------------------------------------------------------------------------------ leftovers, open names
def test_colocated_attach_cannot_create_or_grow_shm_files():
    """/colocated_weights maps only the trainer's existing slot files, at their size: a request naming a missing
    file or a huge size leaves nothing in /dev/shm (it used to create a file of any size and leave it)."""
    from engines.embedded.launch import EngineProcess

    key = "k" * 32
    name = f"/dev/shm/rlkernels-weights-probe-{os.getpid()}"
    with EngineProcess("tiny", api_key=key, device="cpu") as proc:
        def attach(nbytes, paths):
            return httpx.post(proc.url + "/colocated_weights", timeout=30, headers={"Authorization": f"Bearer {key}"},
                              json={"op": "attach", "index": 0, "channel": "/nonexistent/signals.sock",
                                    "slots": {"kind": "shm", "nbytes": nbytes, "paths": paths}})

        r = attach(1 << 40, [name + "-0", name + "-1"])
        assert r.status_code == 400 and "cannot be opened" in r.json()["message"]
        assert not os.path.exists(name + "-0") and not os.path.exists(name + "-1")
        fd = os.open(name + "-0", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 4096)
            r = attach(1 << 40, [name + "-0"])  # an existing file is not grown to the asked size
            assert r.status_code == 400 and "of 1099511627776 bytes" in r.json()["message"]
            assert os.fstat(fd).st_size == 4096
        finally:
            os.close(fd)
            os.unlink(name + "-0")
        r = attach(8, ["/etc/passwd"])
        assert r.status_code == 400 and "rlkernels-weights" in r.json()["message"]
        unauth = httpx.post(proc.url + "/colocated_weights", json={"op": "probe"}, timeout=30)
        assert unauth.status_code == 401  # the route needs the key like every other


def test_signal_channel_is_a_private_file_socket_removed_after_use():
    from engines.weight_sync.wire import connect_channel, listen_channel, remove_channel

    sock, address = listen_channel()
    try:
        assert address.startswith("/") and not address.startswith("\0")  # not the abstract namespace
        folder = os.path.dirname(address)
        st = os.stat(folder)
        assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.getuid()
        peer = connect_channel(address, 3, timeout_s=5)
        conn, _ = sock.accept()
        assert conn.recv(8) == (3).to_bytes(8, "little")
        remove_channel(address)
        assert not os.path.exists(folder)
        peer.sendall((7).to_bytes(8, "little"))  # the connection outlives the socket's name
        assert conn.recv(8) == (7).to_bytes(8, "little")
        peer.close()
        conn.close()
    finally:
        sock.close()
        remove_channel(address)
    with pytest.raises(ValueError, match="not one of ours"):
        connect_channel("/tmp/elsewhere.sock", 0, timeout_s=5)


def test_colocated_sync_leaves_no_channel_or_slot_files(tmp_path):
    """A colocated sync through a real engine process: after init_group no slot file and no channel folder is
    left, and the weights arrive (the channel and the slots work through the new names)."""
    import glob
    import tempfile

    from engines.embedded.launch import EngineProcess
    from engines.embedded.presets import build_tiny_model
    from engines.sglang import SGLangEngine
    from trainer.weight_sync import WeightSyncSender, verify_sync

    trainer = build_tiny_model(3)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(0.5)
    key = "k" * 32
    with EngineProcess("tiny", seed=3, api_key=key, device="cpu") as proc:
        eng = SGLangEngine(proc.url, api_key=key, timeout_s=60)
        sender = WeightSyncSender(trainer, [eng], timeout_s=60)
        sender.init_group()
        assert sender.colocated == [0]
        # the channel's name and folder are gone once the engine connected (its own, by the listening socket's
        # address: another test worker's sender may hold a channel of its own meanwhile), and so are the slots' names
        channel = sender._channel.getsockname()
        assert channel.startswith(tempfile.gettempdir()) and not os.path.exists(os.path.dirname(channel))
        assert not glob.glob(f"/dev/shm/rlkernels-weights-{os.getpid()}-*")
        assert sender.sync() == 1
        assert verify_sync(trainer, [eng], [[1, 20, 21, 22]], expected_version=1).ok
        sender.close()


def listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:
                out.append(addr)
    return out


def test_weight_group_store_listens_on_its_address_only():
    from engines.weight_sync.wire import create_store

    store = create_store("127.0.0.1", 0, is_master=True, timeout_s=10)
    client = create_store("127.0.0.1", store.port, is_master=False, timeout_s=10)
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert listeners(store.port) == ["0100007F"]  # 127.0.0.1 only, not 0.0.0.0 or [::]


def test_disk_sync_folder_is_private_unguessable_and_removed(tmp_path):
    import gc

    from engines.embedded.presets import build_tiny_model
    from trainer.weight_sync import DiskWeightSync

    model = build_tiny_model(0)
    a, b = DiskWeightSync(model, [], folder=str(tmp_path)), DiskWeightSync(model, [], folder=str(tmp_path))
    a.init_group()
    b.init_group()
    assert a.folder != b.folder and os.path.dirname(a.folder) == str(tmp_path)
    assert str(os.getpid()) not in os.path.basename(a.folder)  # not derivable from the pid
    assert os.stat(a.folder).st_mode & 0o777 == 0o700
    a.write(1)
    assert os.listdir(a.folder) == ["v1"]
    a.close()
    assert not os.path.exists(a.folder or "") and sorted(os.listdir(tmp_path)) == [os.path.basename(b.folder)]
    b_folder = b.folder
    del b  # a run that ended on an exception, without close(): the folder goes with the object
    gc.collect()
    assert not os.path.exists(b_folder) and os.listdir(tmp_path) == []
    default = DiskWeightSync(model, [])
    default.init_group()
    try:
        assert os.path.basename(default.folder).startswith("rlkernels-disk-sync-")
        assert os.stat(default.folder).st_mode & 0o777 == 0o700
    finally:
        default.close()


def test_a_picked_port_taken_before_the_engine_binds_it_starts_it_on_another():
    """free_port only finds a port free now: another process (a parallel test, another run) may bind it first. The
    engine then exits with "address already in use", and EngineProcess starts it again on a new port; /health is
    accepted only from its own process (the other one answers on the old port)."""
    import socket

    from engines.embedded.launch import EngineProcess

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        proc = EngineProcess("tiny", start_timeout_s=120, device="cpu")
        proc.port = taken.getsockname()[1]  # as if another process had taken the port picked for it
        with proc.launch().wait_healthy():
            assert proc.port != taken.getsockname()[1] and proc.port_retries < 3  # started again (at least once)
            health = httpx.get(proc.url + "/health", timeout=10).json()
            assert health["pid"] == proc.proc.pid
        given = EngineProcess("tiny", port=taken.getsockname()[1], start_timeout_s=120, device="cpu")  # a given port
        with pytest.raises(RuntimeError, match="address already in use"):
            given.launch().wait_healthy()
        given.kill()
    finally:
        taken.close()
