"""`python -m trainer serve` against the unmodified tinker SDK (0.38) on loopback (issue 39).

One server process for the module (a tiny float32 model saved as an HF folder); each test makes its own
training clients (LoRA adapters on the shared base), so the tests do not depend on each other's state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker  # the dev extra pins it
from tinker import types

from trainer.serve.app import start_subprocess

KEY = "tml-test-key"


def tiny_folder(tmp: Path) -> Path:
    from engines.embedded.presets import build_tiny_model
    from engines.tiny import build_tokenizer

    folder = tmp / "tiny"
    build_tiny_model(0, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def open_sessions(url: str) -> list:
    """The tinker SDK's session clients of the server at `url` still open in this process. Each heartbeats every
    10 s and, once the server is gone, logs "Session heartbeat failed" after 2 min: every test closes its own
    (ServiceClient.close, or `with`) before the server stops."""
    import gc

    from tinker.lib.internal_client_holder import InternalClientHolder

    # type(h), not isinstance(h, ...): isinstance follows a weakref proxy in the heap to its object, and raises
    # ReferenceError when that object is gone (seen in a fresh-clone run).
    return [h for h in gc.get_objects() if issubclass(type(h), InternalClientHolder) and not h._closed
            and getattr(h, "_session_id", None) and h._base_url.rstrip("/") == url.rstrip("/")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base_url, process) of a server on a free loopback port; stopped by SIGINT at the end (exit 0 expected),
    once every SDK session client of the module's tests is closed (no heartbeats left to fail)."""
    tmp = tmp_path_factory.mktemp("tinker")
    folder = tiny_folder(tmp)
    config = tmp / "serve.toml"
    config.write_text(f'[serve]\nport = 0\noutput_dir = "{tmp / "out"}"\nmax_clients = 32\n'
                      f'models = [{{name = "tiny", path = "{folder}"}}, {{name = "{folder}", path = "{folder}"}}]\n')
    env = {**os.environ, "RLKERNELS_API_KEY": KEY, "TRITON_INTERPRET": "0"}
    proc, url = start_subprocess(config, env=env)
    yield url, proc, tmp
    left = open_sessions(url)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 0, f"server exit {proc.returncode} after SIGINT:\n{''.join(proc.tail)}"
    assert not left, f"{len(left)} tinker session client(s) left open: they would log 'Session heartbeat failed'"


@pytest.fixture(scope="module")
def service(server):
    """The module's ServiceClient, closed (its session finished: heartbeats end) before the server stops."""
    client = tinker.ServiceClient(base_url=server[0], api_key=KEY)
    yield client
    client.close("success").result(timeout=60)


def datum(tokens: list[int], weights: list[float] | None = None, **inputs) -> types.Datum:
    """A next-token datum of `tokens`: input tokens[:-1], targets tokens[1:]."""
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights or [1.0] * n, **inputs})


def random_batch(seed: int, lengths=(7, 11, 5)) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    return [datum(rng.integers(0, 250, n + 1).tolist(), rng.uniform(0.5, 1.5, n).tolist()) for n in lengths]


def train(client, batch, steps: int, lr: float = 1e-2) -> list[float]:
    """`steps` of forward_backward + optim_step queued back to back; the losses ("loss:sum")."""
    losses = []
    for _ in range(steps):
        fb = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def forward_logprobs(client, batch) -> list[np.ndarray]:
    out = client.forward(batch, "cross_entropy").result()
    return [np.asarray(o["logprobs"].tolist(), dtype=np.float64) for o in out.loss_fn_outputs]


def test_lora_client_and_capabilities(server, service):
    caps = httpx.get(f"{server[0]}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}).json()
    assert [m["model_name"] for m in caps["supported_models"]] == ["tiny", str(server[2] / "tiny")]
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    info = client.get_info()
    assert info.lora_rank == 4 and info.model_data.model_name == "tiny"
    from transformers import AutoTokenizer

    # get_info's tokenizer_id is the base model's folder: the SDK loads its tokenizer from there
    assert client.get_tokenizer().get_vocab() == AutoTokenizer.from_pretrained(server[2] / "tiny").get_vocab()
    assert httpx.get(f"{server[0]}/api/v1/healthz").status_code == 401  # the key is required on every route


def test_cross_entropy_loop_lowers_the_loss(service):
    """loss:sum is Tinker's -(weights * logprobs).sum(); 6 steps on one batch lower it."""
    client = service.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    batch = random_batch(0)
    out = client.forward(batch, "cross_entropy").result()
    expect = -sum(float(np.dot(o["logprobs"].tolist(), d.loss_fn_inputs["weights"].tolist()))
                  for o, d in zip(out.loss_fn_outputs, batch))
    assert out.metrics["loss:sum"] == pytest.approx(expect, rel=1e-5)
    losses = train(client, batch, 6)
    assert losses[0] == pytest.approx(out.metrics["loss:sum"], rel=1e-6)  # forward changed nothing
    assert losses[-1] < 0.8 * losses[0], losses


def test_sampler_logprobs_equal_forward_logprobs(service):
    """The engine's log-probs of its sampled tokens (temperature 1, float32, adapter synced in memory) equal the
    trainer's forward log-probs of the same tokens; the prompt log-probs (compute_logprobs) too."""
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    train(client, random_batch(1), 3, lr=3e-2)  # adapters (B, the lm_head's too) away from zero
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = [5, 17, 99, 3, 42]
    res = sampler.sample(types.ModelInput.from_ints(prompt), 3,
                         types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)).result()
    assert len(res.sequences) == 3
    checked = 0
    for seq in res.sequences:
        full = prompt + list(seq.tokens)
        trainer_lp = forward_logprobs(client, [datum(full)])[0][len(prompt) - 1:]
        assert np.abs(np.asarray(seq.logprobs) - trainer_lp).max() <= 1e-4
        checked += len(seq.tokens)
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert scored[0] is None
        assert np.abs(np.asarray(scored[1:]) - forward_logprobs(client, [datum(full)])[0]).max() <= 1e-5
        tail = sampler.compute_logprobs(types.ModelInput.from_ints(full), prompt_logprobs_last_n=3).result()
        assert tail[:-3] == [None] * (len(full) - 3) and tail[-3:] == scored[-3:]
    assert checked >= 3
    base = service.create_sampling_client(base_model="tiny").result()
    base_lp = base.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert not np.allclose(base_lp[1:], scored[1: len(prompt)])  # the trained adapter is not the base


def test_save_state_load_state_continues_bit_exactly(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    batch = random_batch(2)
    train(client, batch, 2)
    path = client.save_state("mid").result().path
    assert path.endswith("/weights/mid")
    after = train(client, batch, 2)
    final = forward_logprobs(client, batch)

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert train(resumed, batch, 2) == after
    assert all(np.array_equal(a, b) for a, b in zip(forward_logprobs(resumed, batch), final))

    again = service.create_lora_training_client(base_model="tiny", rank=4, seed=99).result()
    with pytest.warns(FutureWarning, match="load_state"):  # deprecated by the SDK, still served
        again.load_state_with_optimizer(path).result()  # into an existing client
    assert train(again, batch, 2) == after
    no_opt = service.create_training_client_from_state(path).result()  # weights only: fresh Adam moments
    assert train(no_opt, batch, 1)[0] == after[0] and train(no_opt, batch, 1)[0] != after[1]


def test_two_clients_interleaved_equal_each_alone(service):
    """Two adapters on one base, their requests interleaved, give what each gives alone (bit for bit)."""
    batches = {5: random_batch(5), 6: random_batch(6, (9, 4))}
    x, y = (service.create_lora_training_client(base_model="tiny", rank=r, seed=s).result()
            for r, s in ((4, 5), (8, 6)))
    mixed = {5: [], 6: []}
    for _ in range(3):
        futures = [(s, c.forward_backward(batches[s], "cross_entropy")) for s, c in ((5, x), (6, y))]
        opts = [c.optim_step(types.AdamParams(learning_rate=1e-2)) for c in (x, y)]
        for s, f in futures:
            mixed[s].append(f.result().metrics["loss:sum"])
        [o.result() for o in opts]
    for (r, s) in ((4, 5), (8, 6)):
        alone = service.create_lora_training_client(base_model="tiny", rank=r, seed=s).result()
        assert train(alone, batches[s], 3) == mixed[s]


def test_rl_losses_follow_tinkers_definitions(service):
    """importance_sampling = -sum(exp(lp - old) A), ppo clipped at [0.8, 1.2], cispo and dro: loss:sum from the
    returned log-probs (forward: no update)."""
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=8).result()
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 250, 10).tolist()
    lp = forward_logprobs(client, [datum(toks)])[0]
    old = (lp + rng.normal(0, 0.5, lp.shape)).astype(np.float32)
    adv = rng.normal(0, 1, lp.shape).astype(np.float32)
    d = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:], "logprobs": old.tolist(), "advantages": adv.tolist()})
    ratio = np.exp(lp - old)
    expect = {"importance_sampling": -(ratio * adv).sum(),
              "ppo": -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv).sum(),
              "cispo": -(np.clip(ratio, 0.8, 1.2) * lp * adv).sum(),
              "dro": -(lp * adv - 0.5 * 0.05 * (lp - old) ** 2).sum()}
    for name, value in expect.items():
        got = client.forward([d], name).result().metrics["loss:sum"]
        assert got == pytest.approx(value, rel=1e-4, abs=1e-5), name


def test_bad_requests_fail_with_the_cause(server, service):
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        client.forward_backward([datum([1, 2, 100_000])], "cross_entropy").result(timeout=60)
    with pytest.raises(tinker.RequestFailedError, match="context of 512"):
        client.forward_backward([datum(list(range(200)) * 3)], "cross_entropy").result(timeout=60)
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn 'stable_reinforce'"):
        client.forward_backward([datum([1, 2, 3])], "stable_reinforce").result(timeout=60)
    with pytest.raises(tinker.RequestFailedError, match="unknown base_model 'nope'"):
        service.create_lora_training_client(base_model="nope", rank=4).result(timeout=60)
    sampler = service.create_sampling_client(base_model="tiny").result()
    with pytest.raises(tinker.RequestFailedError, match="exceed the model's context of 512"):
        sampler.sample(types.ModelInput.from_ints([1] * 510), 1, types.SamplingParams(max_tokens=8)).result(60)
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        sampler.sample(types.ModelInput.from_ints([1, 999_999]), 1, types.SamplingParams(max_tokens=2)).result(60)
    assert train(client, random_batch(3), 1)  # the client still works after its failed requests
    headers = {"X-API-Key": KEY}
    r = httpx.post(f"{server[0]}/api/v1/no_such_route", json={}, headers=headers)
    assert r.status_code == 404 and "/api/v1/no_such_route" in r.json()["error"]
    r = httpx.post(f"{server[0]}/api/v1/get_info", json={"model_id": "nope"}, headers=headers)
    assert r.status_code == 404 and "unknown model_id 'nope'" in r.json()["error"]


def test_a_retried_request_runs_once(server, service):
    """The same (model_id, seq_id) twice: one request id, one optimizer step."""
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=10).result()
    batch = random_batch(4)
    client.forward_backward(batch, "cross_entropy").result()
    before = forward_logprobs(client, batch)
    headers = {"X-API-Key": KEY}
    body = {"model_id": client.model_id, "seq_id": 10_000, "optim_params": {"learning_rate": 0.05}}
    ids = [httpx.post(f"{server[0]}/api/v1/optim_step", json=body, headers=headers).json()["request_id"]
           for _ in range(2)]
    assert ids[0] == ids[1]
    done = httpx.post(f"{server[0]}/api/v1/retrieve_future", json={"request_id": ids[0]}, headers=headers).json()
    assert "metrics" in done
    after = forward_logprobs(client, batch)
    assert not all(np.array_equal(a, b) for a, b in zip(before, after))  # it ran


def test_importance_sampling_loop_raises_the_reward(service):
    """RL through the SDK: sample from the latest snapshot, reward = share of completion tokens below 64, group
    advantages, importance_sampling with the sampler's log-probs; the mean reward of 32 samples rises."""
    client = service.create_lora_training_client(base_model="tiny", rank=8, seed=11).result()
    prompt = [7, 21, 3]
    params = types.SamplingParams(max_tokens=6, temperature=1.0)

    def rewards(res) -> list[float]:
        return [float(np.mean(np.asarray(s.tokens) < 64)) if len(s.tokens) else 0.0 for s in res.sequences]

    def mean_reward(sampler, seed: int) -> float:
        res = sampler.sample(types.ModelInput.from_ints(prompt), 32,
                             types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed)).result()
        return float(np.mean(rewards(res)))

    before = mean_reward(client.save_weights_and_get_sampling_client().result(), 1)
    for _ in range(10):
        sampler = client.save_weights_and_get_sampling_client().result()
        res = sampler.sample(types.ModelInput.from_ints(prompt), 8, params).result()
        r = np.asarray(rewards(res))
        data = []
        for seq, adv in zip(res.sequences, r - r.mean()):
            if not len(seq.tokens):
                continue
            pad = [0.0] * (len(prompt) - 1)
            full = prompt + list(seq.tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": full[1:], "logprobs": pad + list(seq.logprobs),
                "advantages": pad + [float(adv)] * len(seq.tokens)}))
        client.forward_backward(data, "importance_sampling")
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = mean_reward(client.save_weights_and_get_sampling_client().result(), 1)
    assert after > before + 0.2, (before, after)


def test_sampling_seed_and_stops(server, service):
    """A seed reproduces a sample; a stop token id or a stop string ends it there (stop_reason "stop")."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server[2] / "tiny")
    sampler = service.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints([9, 8, 7])

    def one(**kw):
        return sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=5, **kw)).result().sequences[0]

    first = one()
    assert list(one().tokens) == list(first.tokens) and first.stop_reason == "length"
    by_id = one(stop=[int(first.tokens[3])])
    assert list(by_id.tokens) == list(first.tokens[:4]) and by_id.stop_reason == "stop"
    for k in range(1, len(first.tokens)):  # a printable piece that the text before it does not contain
        piece = tok.decode([int(first.tokens[k])])
        if piece.strip() and piece.isprintable() and piece not in tok.decode([int(t) for t in first.tokens[:k]]):
            break
    else:
        pytest.fail(f"no printable stop string in {tok.decode(list(first.tokens))!r}")
    by_text = one(stop=[piece])
    assert list(by_text.tokens) == list(first.tokens[: k + 1]) and by_text.stop_reason == "stop"


def test_tinker_cookbook_supervised_driver(server, tmp_path):
    """tinker-cookbook 0.5.8's supervised.train, unmodified, trains through this server: the base model named by its
    folder (the cookbook loads its tokenizer from the name), a local dataset, checkpoints every 4 steps; its
    logged train NLL falls and its final checkpoints are the server's."""
    import json

    from cookbook_support import cookbook_site

    site = cookbook_site()
    log = tmp_path / "cookbook"
    env = {**os.environ, "TINKER_API_KEY": KEY, "PYTHONPATH": str(site), "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "cookbook_driver.py"), server[0],
                          str(server[2] / "tiny"), str(log)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    nll = [json.loads(line)["train_mean_nll"] for line in (log / "metrics.jsonl").read_text().splitlines()
           if "train_mean_nll" in line]
    assert len(nll) == 8 and nll[-1] < 0.8 * nll[0], nll
    final = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()][-1]
    model_id, _, name = final["state_path"].removeprefix("tinker://").split("/")
    assert (server[2] / "out" / model_id / "weights" / name / "optimizer.safetensors").is_file()
    assert final["sampler_path"].endswith(f"/sampler_weights/{name}")


def test_unload_model(server, service):
    """unload_model frees the client's adapter; the id is unknown afterwards (a 404 naming it)."""
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=12).result()
    headers = {"X-API-Key": KEY}
    rid = httpx.post(f"{server[0]}/api/v1/unload_model", json={"model_id": client.model_id},
                     headers=headers).json()["request_id"]
    done = httpx.post(f"{server[0]}/api/v1/retrieve_future", json={"request_id": rid}, headers=headers).json()
    assert done["model_id"] == client.model_id
    r = httpx.post(f"{server[0]}/api/v1/get_info", json={"model_id": client.model_id}, headers=headers)
    assert r.status_code == 404 and client.model_id in r.json()["error"]


def test_malformed_bodies_are_400s(server):
    headers = {"X-API-Key": KEY}
    r = httpx.post(f"{server[0]}/api/v1/forward_backward", content=b"\xff\x00garbage", headers=headers)
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["error"]
    r = httpx.post(f"{server[0]}/api/v1/optim_step", json={"seq_id": 1}, headers=headers)
    assert r.status_code == 400 and "model_id" in r.json()["error"]


def test_remote_backend_equals_the_local_one(server):
    """trainer.backend.remote.TinkerBackend (the TrainingBackend surface over the SDK) gives what the in-process
    LocalLoraBackend gives on the same batches: a loop written against the surface can train on either."""
    import torch

    from trainer.backend.protocol import AdamParams, Datum, LocalLoraBackend, LoraBase, LoraSpec
    from trainer.backend.remote import TinkerBackend
    from trainer.serve.losses import LOSSES

    spec = LoraSpec(rank=4, seed=13)
    g = torch.Generator().manual_seed(13)
    batch = []
    for n in (6, 9):
        toks = torch.randint(0, 250, (n + 1,), generator=g)
        batch.append(Datum(toks[:-1], {"target_tokens": toks[1:], "weights": torch.rand(n, generator=g)}))
    local = LocalLoraBackend(LoraBase(server[2] / "tiny"), "local", spec, LOSSES, server[2] / "local")
    remote = TinkerBackend(server[0], "tiny", spec, api_key=KEY)
    for _ in range(3):
        outs = []
        for backend in (local, remote):
            fb = backend.forward_backward(batch, "cross_entropy")
            backend.optim_step(AdamParams(learning_rate=1e-2)).result()
            outs.append(fb.result())
        assert outs[1].metrics["loss:sum"] == pytest.approx(outs[0].metrics["loss:sum"], rel=1e-5)
        for a, b in zip(outs[0].outputs, outs[1].outputs):
            assert (a["logprobs"] - b["logprobs"]).abs().max() <= 1e-5
    with pytest.raises(NotImplementedError, match="does not send weights"):
        remote.get_weights()
    remote.service.close("success").result(timeout=60)  # its session's heartbeats end before the server stops
    local.base.close()


def test_rest_client_lists_runs_and_checkpoints(server, service):
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=14).result()
    state = client.save_state("listed").result().path
    sampler = client.save_weights_for_sampler("listed").result().path
    rest = tinker.RestClient(base_url=server[0], api_key=KEY)
    run = rest.get_training_run_by_tinker_path(state).result()
    assert run.training_run_id == client.model_id and run.lora_rank == 4 and run.base_model == "tiny"
    assert {c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints} == {state, sampler}
    info = rest.get_weights_info_by_tinker_path(sampler).result()
    assert info.is_lora and info.lora_rank == 4 and info.base_model == "tiny" and info.train_unembed
    assert client.model_id in {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
    assert state in {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    # a saved sampler checkpoint is sampled from its folder (the other way to make a sampling client)
    from_path = service.create_sampling_client(model_path=sampler).result()
    assert len(from_path.sample(types.ModelInput.from_ints([1, 2]), 1,
                                types.SamplingParams(max_tokens=3)).result().sequences) == 1


MODELS = 'models = [{name = "m", path = "FOLDER"}]'


@pytest.mark.parametrize("table, match", [
    ('host = "0.0.0.0"\n' + MODELS, "no API key is set"),
    ('models = []', "non-empty list"),
    ('models = [{name = "m", path = "/nonexistent"}]', "not a Hugging Face folder"),
    ('prot = 8000\n' + MODELS, r"unknown config key\(s\) \['prot'\] in \[serve\]"),
    ('port = 70000\n' + MODELS, r"\[serve\] port = 70000: a TCP port"),
    ('port = "80"\n' + MODELS, r"serve.port = '80': expected an integer"),
    ('max_clients = 0\n' + MODELS, r"max_clients = 0: an integer >= 1"),
    ('device = "gpu"\n' + MODELS, r"device = 'gpu'"),
    ('models = [{name = "m", path = "FOLDER", rank = 8}]',
     r"unknown config key\(s\) \['rank'\] in \[serve.models\[0\]\]"),
    ('models = [{name = "m", path = "FOLDER"}, {name = "m", path = "FOLDER"}]', "must be unique"),
    (MODELS + '\n[trainer]\ncompile = true', r"\[trainer\] compile: python -m trainer serve does not use it"),
    (MODELS + '\n[trainer]\nparam_dtype = "float64"', "param_dtype"),
    (MODELS + '\n[engines]\nfleet = [{kind = "embedded"}]', r"\[engines\] fleet = \['embedded'\]: .*'local'"),
    (MODELS + '\n[engines]\nsync = "disk"', r"\[engines\] sync: python -m trainer serve does not use it"),
    (MODELS + '\n[engines]\nthreads = 0', r"threads = 0"),
    (MODELS + '\n[rl]\nnum_steps = 3', r"'rl' at the top level: python -m trainer serve does not use it"),
])
def test_serve_config_errors(tmp_path, table, match):
    """Bad serve files are refused naming the key, through the run config's one validation path (trainer/config.py:
    [serve] is ServeConfig, [trainer] and [engines] as in runs) and the keys the service would ignore."""
    from trainer.config import ConfigError
    from trainer.serve.app import load_serve_config

    (tmp_path / "config.json").write_text("{}")
    path = tmp_path / "serve.toml"
    path.write_text("[serve]\n" + table.replace("FOLDER", str(tmp_path)) + "\n")
    with pytest.raises(ConfigError, match=match):
        load_serve_config(path, environ={})
    if "API key" in match:  # the same host with a key (from the environment) is accepted
        assert load_serve_config(path, environ={"RLKERNELS_API_KEY": "tml-k"}).serve.api_key == "tml-k"


def test_serve_reads_trainer_and_engines_tables(tmp_path):
    """[trainer] param_dtype / logprob_chunk_tokens and [engines] prefix_cache_tokens / dtype reach the service's base
    model and engine (bfloat16 training beside a float32 engine, to tell the two dtypes apart)."""
    import torch

    from trainer.serve.app import build_service, load_serve_config

    folder = tiny_folder(tmp_path)
    path = tmp_path / "serve.toml"
    path.write_text(f'seed = 5\n[serve]\nmodels = [{{name = "m", path = "{folder}"}}]\noutput_dir = "{tmp_path}"\n'
                    '[trainer]\nparam_dtype = "bfloat16"\nlogprob_chunk_tokens = 16\n'
                    '[engines]\nthreads = 2\nprefix_cache_tokens = 0\ndtype = "float32"\n')
    cfg = load_serve_config(path, environ={})
    assert cfg.engines.fleet[0].kind == "local" and cfg.seed == 5  # no fleet given: one engine in process
    service = build_service(cfg)
    try:
        base = service.base("m")
        assert base.model.dtype == torch.bfloat16 and base.chunk_tokens == 16
        engine = service.engine("m")
        assert next(engine.server.model.parameters()).dtype == torch.float32
        assert engine.server.prefix_cache is None  # prefix_cache_tokens = 0: off
    finally:
        service.close()
    default = tmp_path / "default.toml"
    default.write_text(f'[serve]\nmodels = [{{name = "m", path = "{folder}"}}]\n')
    cfg = load_serve_config(default, environ={})
    assert (cfg.trainer.param_dtype, cfg.engines.threads, cfg.engines.dtype) == (None, 1, None)


def test_serve_command_exits_2_on_a_bad_config(tmp_path, capsys):
    from trainer.cli import main

    path = tmp_path / "serve.toml"
    path.write_text("[serve]\nmodels = []\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "error:" in capsys.readouterr().err
    path.write_text(f'[serve]\nmodels = [{{name = "m", path = "{tmp_path}"}}]\n')
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--config", str(path), "--set", "serve.max_clients=0"]) == 2  # --set applies, as for runs
    assert "max_clients = 0" in capsys.readouterr().err
    assert main(["serve", "--config", str(path), "--set", "serve.prot=1"]) == 2
    assert "--set serve.prot" in capsys.readouterr().err


def test_serve_set_overrides_apply_over_the_file(tmp_path):
    from trainer.serve.app import load_serve_config

    (tmp_path / "config.json").write_text("{}")
    path = tmp_path / "serve.toml"
    path.write_text(f'[serve]\nmodels = [{{name = "m", path = "{tmp_path}"}}]\n')
    cfg = load_serve_config(path, environ={}, overrides=["serve.port=0", "trainer.param_dtype=bfloat16"])
    assert cfg.serve.port == 0 and cfg.trainer.param_dtype == "bfloat16"


def test_samples_of_two_clients_in_flight_together_equal_each_alone(service):
    """Two clients' samplers (different adapters, one engine) sampled at once give what each gives alone."""
    samplers = []
    for seed in (15, 16):
        client = service.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
        train(client, random_batch(seed), 2, lr=3e-2)
        samplers.append(client.save_weights_and_get_sampling_client().result())
    prompt = types.ModelInput.from_ints([4, 5, 6])
    params = types.SamplingParams(max_tokens=8, seed=21)
    alone = [s.sample(prompt, 2, params).result() for s in samplers]
    together = [f.result() for f in [s.sample(prompt, 2, params) for s in samplers]]
    tokens = [[list(q.tokens) for q in r.sequences] for r in alone]
    assert tokens[0] != tokens[1]  # two adapters: the same draws give different samples
    for a, b in zip(alone, together):
        for qa, qb in zip(a.sequences, b.sequences):
            assert list(qa.tokens) == list(qb.tokens)
            assert np.abs(np.asarray(qa.logprobs) - np.asarray(qb.logprobs)).max() <= 1e-5


def test_retrieve_futures_reports_a_sampling_sessions_completions(server):
    """/api/v1/retrieve_futures (the SDK's session poller, off in this server's client config): a sample's request
    appears once it ended; past the returned cursor nothing until the next one."""
    headers = {"X-API-Key": KEY}
    session = httpx.post(f"{server[0]}/api/v1/create_session", headers=headers,
                         json={"tags": [], "user_metadata": {}, "sdk_version": "raw"}).json()["session_id"]
    sid = httpx.post(f"{server[0]}/api/v1/create_sampling_session", headers=headers, timeout=60, json={
        "session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}).json()["sampling_session_id"]
    body = {"sampling_session_id": sid, "seq_id": 1, "num_samples": 1, "sampling_params": {"max_tokens": 2},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}}
    rid = httpx.post(f"{server[0]}/api/v1/asample", json=body, headers=headers).json()["request_id"]
    poll = {"target": {"type": "sampling_session", "sampling_session_id": sid}, "prev_cursor": 0, "timeout": 20}
    got = httpx.post(f"{server[0]}/api/v1/retrieve_futures", json=poll, headers=headers, timeout=30).json()
    assert got["completions"] == [{"state": "finished", "request_id": rid}]
    again = httpx.post(f"{server[0]}/api/v1/retrieve_futures", headers=headers, timeout=30,
                       json={**poll, "prev_cursor": got["cursor"], "timeout": 0.2}).json()
    assert again == {"completions": [], "cursor": got["cursor"]}


def test_sampling_without_a_session_reuses_one_sampler(server):
    """asample naming base_model (no sampling session), twice: both answered (protobuf), the seeded samples equal
    (the server reuses one sampler for such requests instead of making one per request)."""
    headers = {"X-API-Key": KEY}
    body = {"base_model": "tiny", "num_samples": 1, "sampling_params": {"max_tokens": 2, "seed": 4},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}}
    done = []
    for _ in range(2):
        rid = httpx.post(f"{server[0]}/api/v1/asample", json=body, headers=headers).json()["request_id"]
        r = httpx.post(f"{server[0]}/api/v1/retrieve_future", json={"request_id": rid}, headers=headers, timeout=60)
        assert r.headers["content-type"] == "application/x-protobuf"
        done.append(r.content)
    assert done[0] == done[1]  # the same seed on the same sampler


def test_old_in_memory_snapshots_are_dropped_with_a_clear_error(service):
    """A client's fifth in-memory snapshot unloads its first from the engine; sampling that one says so."""
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=17).result()
    samplers = [client.save_weights_and_get_sampling_client().result() for _ in range(5)]
    params = types.SamplingParams(max_tokens=2)
    assert samplers[-1].sample(types.ModelInput.from_ints([1, 2]), 1, params).result().sequences
    with pytest.raises(tinker.RequestFailedError, match="was dropped"):
        samplers[0].sample(types.ModelInput.from_ints([1, 2]), 1, params).result(timeout=60)


def test_a_finished_session_stops_its_heartbeats(server):
    """ServiceClient.close() finishes the session on the server (/sessions/{id}/finish); a heartbeat of a finished
    session answers 410, the SDK's signal to end its heartbeat loop quietly (no "Session heartbeat failed" warnings
    once the server is gone), and the session takes no new clients."""
    with tinker.ServiceClient(base_url=server[0], api_key=KEY) as svc:
        svc.create_lora_training_client(base_model="tiny", rank=2, seed=30).result()
        session = svc._session_holder.get_session_id()  # the SDK keeps the id on its holder only
        heartbeat = {"session_id": session, "type": "session_heartbeat"}
        assert httpx.post(f"{server[0]}/api/v1/session_heartbeat", headers={"X-API-Key": KEY},
                          json=heartbeat).status_code == 200
    got = httpx.post(f"{server[0]}/api/v1/session_heartbeat", headers={"X-API-Key": KEY}, json=heartbeat)
    assert got.status_code == 410 and "finished" in got.json()["error"]
    late = httpx.post(f"{server[0]}/api/v1/create_model", headers={"X-API-Key": KEY}, json={
        "session_id": session, "model_seq_id": 9, "base_model": "tiny", "lora_config": {"rank": 2}})
    assert late.status_code == 410 and "finished" in late.json()["error"]



def test_stopping_the_server_fails_the_futures_in_flight(tmp_path):
    """SIGTERM with training work queued: every request the server holds fails at once with RequestFailedError
    naming the shutdown (answered while the server drains, before it exits: the SDK retries a poll that meets a
    closed port for ever), none runs to a different error, the checkpoint saved before stays, and the server exits
    0. The SDK keeps only a few of a client's requests in flight; the ones it never sent cannot be answered."""
    folder = tiny_folder(tmp_path)
    config = tmp_path / "serve.toml"
    config.write_text(f'[serve]\nport = 0\noutput_dir = "{tmp_path / "out"}"\n'
                      f'models = [{{name = "tiny", path = "{folder}"}}]\n')
    proc, url = start_subprocess(config, env={**os.environ, "RLKERNELS_API_KEY": KEY})
    svc = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        client = svc.create_lora_training_client(base_model="tiny", rank=4, seed=31).result()
        saved = client.save_state("kept").result().path
        batch = random_batch(5, lengths=(100,) * 64)
        futures = [client.forward_backward(batch, "cross_entropy") for _ in range(24)]
        futures[0].result(timeout=120)  # the rest are queued behind it
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        failed, finished = 0, 0
        deadline = time.monotonic() + 3.0  # one wait for all: the ones never sent would each take their timeout
        for f in futures[1:]:
            try:
                f.result(timeout=max(0.1, deadline - time.monotonic()))  # answered before the exit, or never sent
                finished += 1
            except tinker.RequestFailedError as e:
                assert "shutting down" in str(e)
                failed += 1
            except TimeoutError:
                continue
        assert failed >= 1 and failed + finished >= 2, (failed, finished)
        assert (tmp_path / "out" / saved.removeprefix("tinker://") / "adapter_model.safetensors").is_file()
    finally:
        proc.kill()
        # The server is gone: release the SDK's threads (heartbeats) without the finish request, which the SDK would
        # retry for 5 min against a closed port.
        svc._session_holder.close()


# ----------------------------------------------------------------------------------------------- found by review
def test_checkpoints_are_not_overwritten_and_a_failed_load_changes_nothing(service):
    """Was: save_state(name) over an existing checkpoint replaced it although the SDK's overwrite defaults to False;
    load_state_with_optimizer of a sampler checkpoint (no optimizer state) failed after it had copied the weights
    in; create_training_client_from_state_with_optimizer of one kept the client it had made."""
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=41).result()
    batch = random_batch(41)
    train(client, batch, 1)
    first = client.save_state("ckpt").result().path
    sampler_path = client.save_weights_for_sampler("early").result().path
    train(client, batch, 1)
    with pytest.raises(tinker.RequestFailedError, match="exists: save under another name, or pass overwrite=True"):
        client.save_state("ckpt").result(timeout=60)
    later = forward_logprobs(client, batch)
    check = service.create_training_client_from_state_with_optimizer(first).result()  # the first save, intact
    assert train(check, batch, 1)  # it loads and trains
    assert client.save_state("ckpt", overwrite=True).result().path == first
    with pytest.warns(FutureWarning, match="load_state"):
        failed = client.load_state_with_optimizer(sampler_path)
    with pytest.raises(tinker.RequestFailedError, match="no optimizer state"):
        failed.result(timeout=60)
    assert all(np.array_equal(a, b) for a, b in zip(forward_logprobs(client, batch), later))  # unchanged
    runs = len(service.create_rest_client().list_training_runs().result().training_runs)
    with pytest.raises(tinker.RequestFailedError, match="no optimizer state"):
        service.create_training_client_from_state_with_optimizer(sampler_path).result(timeout=60)
    assert len(service.create_rest_client().list_training_runs().result().training_runs) == runs  # none kept


def test_other_optimizers_are_refused_not_replaced_by_adamw(server, service):
    """Was: a client created with another optimizer (DimuonOptimizerConfig) trained with AdamW, and its optim_step
    parameters (sent as optimizer_params) were replaced by AdamW's defaults (lr 1e-4): the weights moved at lr 0."""
    with pytest.raises(tinker.RequestFailedError, match="AdamW only"):
        service.create_lora_training_client(base_model="tiny", rank=4, optimizer=types.DimuonOptimizerConfig()
                                            ).result(timeout=60)
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=42).result()
    client.forward_backward(random_batch(42), "cross_entropy").result()
    headers = {"X-API-Key": KEY}
    body = {"model_id": client.model_id, "seq_id": 20_000, "optimizer_params": {"learning_rate": 0.0}}
    rid = httpx.post(f"{server[0]}/api/v1/optim_step", json=body, headers=headers).json()["request_id"]
    done = httpx.post(f"{server[0]}/api/v1/retrieve_future", json={"request_id": rid}, headers=headers).json()
    assert "optimizer_params" in json.dumps(done) and "AdamW" in json.dumps(done), done


def test_concurrent_creates_stay_within_max_clients(tmp_path):
    """Was: the limit was read before each client's (slow) build and the client counted only after it, so ten
    creates at once made nine clients under max_clients = 4."""
    from concurrent.futures import ThreadPoolExecutor

    from trainer.serve.clients import Service, UserError

    service = Service({"tiny": str(tiny_folder(tmp_path))}, tmp_path / "out", max_clients=4)

    def create(i: int):
        try:
            return service.create_model({"base_model": "tiny", "lora_config": {"rank": 2}, "model_id": f"m{i}"})
        except UserError as e:
            return e

    with ThreadPoolExecutor(10) as pool:
        got = list(pool.map(create, range(10)))
    made = [g for g in got if not isinstance(g, Exception)]
    refused = [g for g in got if isinstance(g, Exception)]
    assert len(made) == 4 and len(service.models) == 4, [type(g).__name__ for g in got]
    assert len(refused) == 6 and all(e.status == 429 and "max_clients = 4" in str(e) for e in refused)
    service.unload(made[0].model_id)
    assert not isinstance(create(10), Exception) and len(service.models) == 4  # a freed slot is taken again


def test_training_requests_after_the_stop_are_answered_cancelled(tmp_path):
    """Was: once stop_work had shut the workers down, a training request got an HTTP 500 ("cannot schedule new
    futures after shutdown"), which the SDK retried until the port closed: its future never resolved. Now it is
    answered as stop_work promises, "cancelled: the server is shutting down"."""
    import asyncio

    from trainer.serve import handlers
    from trainer.serve.clients import Service

    async def main():
        service = Service({"tiny": str(tiny_folder(tmp_path))}, tmp_path / "out")
        record = service.create_model({"base_model": "tiny", "lora_config": {"rank": 2}, "model_id": "m"})
        service.stop_work()
        for handler, body in ((handlers.optim_step, {"adam_params": {"learning_rate": 0.1}}),
                              (handlers.save_weights, {"path": "late"}),
                              (handlers.save_for_sampler, {})):
            answer = await handler(service, {"model_id": record.model_id, "seq_id": 1, **body})
            task = service.futures[answer["request_id"]].task
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled(), handler.__name__
        assert not (tmp_path / "out" / "m" / "weights" / "late").exists()

    asyncio.run(main())


def test_an_unloaded_clients_snapshots_are_bounded_with_the_checkpoint_samplers(tmp_path, monkeypatch):
    """Was: the engine kept every training client's newest in-memory snapshots (KEEP_SNAPSHOTS) after unload_model,
    for as long as the server ran. Now they stay sampleable, counted with the ownerless samplers of their base
    (KEEP_CHECKPOINT_SAMPLERS, 1 here): the older is dropped from the engine, another client's are untouched."""
    import asyncio

    from engines.local import LocalEngine
    from trainer.serve import clients, handlers
    from trainer.serve.clients import Service, UserError

    monkeypatch.setattr(clients, "KEEP_CHECKPOINT_SAMPLERS", 1)

    async def main():
        service = Service({"tiny": str(tiny_folder(tmp_path))}, tmp_path / "out",
                          engine_factory=lambda path: LocalEngine(path, seed=0))
        gone, kept = (service.create_model({"base_model": "tiny", "lora_config": {"rank": 2, "seed": s},
                                            "model_id": f"m{s}"}) for s in (1, 2))
        snaps = {}
        for record in (gone, kept):
            weights = await record.backend.get_weights().aresult()
            snaps[record.model_id] = [await service.sampler_from_weights(record, f"s{k}", weights) for k in range(2)]
        engine = service.engines["tiny"]
        try:
            answer = await handlers.unload_model(service, {"model_id": gone.model_id})
            await service.futures[answer["request_id"]].task
            old, new = snaps[gone.model_id]
            with pytest.raises(UserError, match="was dropped"):
                service.sampler(old)
            assert service.sampler(new).owner is None
            loaded = set(engine.server.adapter_names())
            assert new in loaded and old not in loaded and set(snaps[kept.model_id]) <= loaded
            assert all(service.sampler(s).owner == kept.model_id for s in snaps[kept.model_id])
        finally:
            engine.close()

    asyncio.run(main())
