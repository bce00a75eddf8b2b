"""Subprocess entry points for the trainer tests (fresh processes: FSDP ranks, kill-and-resume).

    python tests/trainer_worker.py fsdp   <out.pt> <world_size>             # spawns world_size gloo ranks
    python tests/trainer_worker.py fsdp_sync <out.pt> <world_size>          # the same, with and without
                                                                            # defer_grad_sync, counting reduce-scatters
    python tests/trainer_worker.py train  <out.pt> <output_dir> <steps> <save_at> [resume]
    python tests/trainer_worker.py gae    <out.pt> <world_size>             # PPO steps with a separate critic
    python tests/trainer_worker.py lora   <out.pt> <world_size>             # LoRA steps (adapters only train)

Both train the tiny llama on a deterministic synthetic batch per step (a function of the step index only), on
the CPU torch path of the kernels, and write the per-step losses (and full parameters) to <out.pt>.
"""

from __future__ import annotations

import os
import sys

import torch

from trainer.types import Sample, TrainingState

BUDGET, BUCKET = 128, 32


def config(output_dir: str = "runs/test", compile: bool = True):
    from trainer.backend.steps import trainer_config_from
    from trainer.config import OptimConfig, SFTTrainingConfig

    sft = SFTTrainingConfig(optim=OptimConfig(lr=3e-3, warmup_steps=1, max_grad_norm=1.0), num_steps=6,
                            token_budget=BUDGET, micro_batch_buckets=BUCKET, output_dir=output_dir, seed=0)
    return trainer_config_from(sft, compile=compile, compile_backend="aot_eager")


def step_samples(step: int, n: int = 6) -> list[Sample]:
    """A deterministic batch for `step`: random prompts + responses of varying lengths."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(n):
        p = int(torch.randint(2, 10, (), generator=g))
        r = int(torch.randint(3, 40, (), generator=g))
        toks = torch.randint(6, 90, (p + r,), generator=g).tolist()
        mask = (torch.rand(r, generator=g) > 0.2).long().tolist()
        out.append(Sample(prompt="", tokens=toks, response_length=r, loss_mask=mask))
    return out


def train_steps(comp, state: TrainingState, steps: range, n: int = 6) -> tuple[TrainingState, list[float]]:
    from trainer.backend.steps import forward_backward, optim_step
    from trainer.batching.micro_batches import build_micro_batches

    losses = []
    for step in steps:
        mbs = build_micro_batches(step_samples(step, n), token_budget=BUDGET, bucket_size=BUCKET,
                                  num_ranks=comp.world_size, rank=comp.rank)
        fut = forward_backward(comp, mbs)
        ofut, state = optim_step(comp, state, num_tokens=fut.num_tokens)
        losses.append(fut.result()["loss"])
        ofut.result()
    return state, losses


def full_params(comp) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(comp.root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _fsdp_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from engines.tiny import tiny_model_config
    from kernels import use_backend
    from trainer.backend.steps import build_components, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    with use_backend("torch"):
        comp = build_components(tiny_model_config(), config(compile=False), mesh=init_distributed("cpu"))
        _, losses = train_steps(comp, TrainingState(), range(3))
        params = full_params(comp)
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out)
    _close_group(dist)


def _fsdp_sync_rank(rank: int, world: int, port: int, out: str) -> None:
    """Three steps with [trainer] defer_grad_sync on and off, from the same weights: the parameters after them, and
    how many reduce-scatters each step's micro-batches launched (FSDP2 calls dist.reduce_scatter_single)."""
    import torch.distributed as dist

    from engines.tiny import tiny_model_config
    from kernels import use_backend
    from trainer.backend.steps import build_components, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    calls = [0]
    real = dist.reduce_scatter_single

    def counted(*args, **kw):
        calls[0] += 1
        return real(*args, **kw)

    dist.reduce_scatter_single = counted
    result = {}
    mesh = init_distributed("cpu")
    with use_backend("torch"):
        for defer in (True, False):
            cfg = config(compile=False).replace(defer_grad_sync=defer)
            comp = build_components(tiny_model_config(), cfg, mesh=mesh)
            calls[0] = 0
            _, losses = train_steps(comp, TrainingState(), range(3), n=16)  # several micro-batches a step
            result[defer] = {"losses": losses, "params": full_params(comp), "reduce_scatters": calls[0]}
    if rank == 0:
        from trainer.batching.micro_batches import build_micro_batches

        result["micro_batches"] = [len(build_micro_batches(step_samples(s, 16), token_budget=BUDGET,
                                                           bucket_size=BUCKET, num_ranks=world, rank=rank))
                                   for s in range(3)]
        torch.save(result, out)
    _close_group(dist)


def lora_config(compile: bool = False):
    """config() with [sft.lora] rank 4 on the q/v/down projections; B starts random (`randomize_adapters`) so
    every adapter has a gradient from step one."""
    from trainer.config import LoRAConfig

    return config(compile=compile).replace(lora=LoRAConfig(rank=4, alpha=8.0,
                                                           target_modules=["q_proj", "v_proj", "down_proj"]))


def randomize_adapters(comp, seed: int = 5) -> None:
    """Every adapter (A and B) drawn from N(0, 0.1^2) by name, the same values on every rank and world size."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from trainer.backend.lora import is_adapter

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(comp.root.named_parameters()):
            if not is_adapter(name):
                continue
            full = torch.randn(p.shape, generator=g) * 0.1
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements).to_local()
                p.to_local().copy_(full)
            else:
                p.copy_(full)


def merged_weights(comp) -> dict[str, torch.Tensor]:
    """The weight sync's full tensors (trainer.weight_sync.common.gathered_weights, float32): collective."""
    from trainer.weight_sync.common import gathered_weights

    return {n: t.clone() for n, t in gathered_weights(comp.model, torch.float32)}


def _lora_rank(rank: int, world: int, port: int, out: str) -> None:
    """Three LoRA steps (lora_config) on `world` gloo ranks: the losses, grad norms and the adapters after them."""
    import torch.distributed as dist

    from engines.tiny import tiny_model_config
    from kernels import use_backend
    from trainer.backend.steps import build_components, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    with use_backend("torch"):
        comp = build_components(tiny_model_config(), lora_config(), mesh=init_distributed("cpu"))
        randomize_adapters(comp)
        _, losses = train_steps(comp, TrainingState(), range(3))
        params = full_params(comp)
        merged = merged_weights(comp)  # what a weight sync sends: merged on each rank's shard, then gathered
    if rank == 0:
        torch.save({"losses": losses, "params": params, "merged": merged}, out)
    _close_group(dist)


def _close_group(dist) -> None:
    """Both ranks reach the teardown together, then leave without the interpreter's and C++'s exit-time
    destructors. A rank that tore its gloo pairs down while the other was still writing results (rank 0 saves)
    aborted with "terminate called without an active exception" (seen once in a full-suite run under load); with
    the barrier first it was seen once more (a fresh-clone `make test` of 2026-11-29, rank 1 of the LoRA run; 0 of
    20 runs beside three CPU hogs reproduced it): a std::thread destroyed while joinable at exit. The results are
    saved before the barrier, so the rank's exit status is all that is left to report."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gae_config():
    """PPO with a separate critic on the synthetic batches (trainer.backend.critic): the RL phase and its
    TrainerConfig."""
    from trainer.backend.steps import trainer_config_from
    from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig

    rl = RLTrainingConfig(advantage_estimator="gae", optim=OptimConfig(lr=3e-3), token_budget=BUDGET,
                          micro_batch_buckets=BUCKET, loss={"loss_agg": "token-mean"}, output_dir="runs/test",
                          rollout=RolloutConfig(apply_chat_template=False, max_new_tokens=64),
                          critic={"optim": {"lr": 3e-3}})
    return rl, trainer_config_from(rl, compile=False)


def gae_steps(policy, critic, steps: range) -> list[dict]:
    """train_on_batch's metrics of each step on step_samples(step, 12), each sample rewarded by its index."""
    import dataclasses

    from trainer.rl import local_backend, train_on_batch
    from trainer.types import RolloutBatch

    rl, tcfg = gae_config()
    state, out = TrainingState(), []
    for step in steps:
        samples = [dataclasses.replace(s, reward=float((i * 7 + step) % 5) / 4)
                   for i, s in enumerate(step_samples(step, 12))]
        backend = local_backend(policy, rl, tcfg, pad_id=0, critic=critic)
        metrics, state = train_on_batch(backend, state, RolloutBatch(samples), rl)
        out.append(metrics)
    return out


def _gae_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from engines.tiny import tiny_model_config
    from kernels import use_backend
    from trainer.backend.critic import build_critic
    from trainer.backend.steps import build_components, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    with use_backend("torch"):
        _, tcfg = gae_config()
        policy = build_components(tiny_model_config(), tcfg, mesh=init_distributed("cpu"))
        critic = build_critic(policy, tcfg)
        metrics = gae_steps(policy, critic, range(2))
        params = {"policy": full_params(policy), "critic": full_params(critic)}
    if rank == 0:
        torch.save({"metrics": metrics, "params": params}, out)
    _close_group(dist)


def main(argv: list[str]) -> None:
    mode, out = argv[0], argv[1]
    if mode in ("fsdp", "fsdp_sync", "gae", "lora"):
        import socket

        import torch.multiprocessing as mp

        world = int(argv[2])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rank_fn = {"fsdp": _fsdp_rank, "fsdp_sync": _fsdp_sync_rank, "gae": _gae_rank, "lora": _lora_rank}[mode]
        mp.spawn(rank_fn, args=(world, port, out), nprocs=world, join=True)
    elif mode == "train":
        from engines.tiny import tiny_model_config
        from kernels import use_backend
        from trainer.backend.checkpoint import load_checkpoint, save_checkpoint
        from trainer.backend.steps import build_components

        output_dir, steps, save_at = argv[2], int(argv[3]), int(argv[4])
        resume = len(argv) > 5 and argv[5] == "resume"
        with use_backend("torch"):
            comp = build_components(tiny_model_config(), config(output_dir, compile=False))
            state, losses = TrainingState(), []
            if resume:
                state, extra = load_checkpoint(comp, output_dir)
                assert extra["next_step"] == state.step
            while state.step < steps:
                state, (loss,) = train_steps(comp, state, range(state.step, state.step + 1))
                losses.append(loss)
                if state.step == save_at and not resume:
                    save_checkpoint(comp, state, {"next_step": state.step})
        torch.save({"losses": losses, "first_step": steps - len(losses)}, out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    # CPU production path: torch implementations of the kernels. Only when run as a process of its own: the
    # test modules import this file, and must not switch the interpreter off for the whole pytest session.
    os.environ["TRITON_INTERPRET"] = "0"
    main(sys.argv[1:])
