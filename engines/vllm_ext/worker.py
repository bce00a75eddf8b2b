"""vLLM worker extension (`--worker-extension-cls engines.vllm_ext.worker.RLKernelsWorker`, passed by
engines.vllm.vllm_server_command): vLLM adds this class to its worker class's bases, so each method runs on every
worker with `self` the worker, called by name through the server's /collective_rpc (VLLM_SERVER_DEV_MODE=1).
Method names carry the `rlkernels_` prefix: vLLM refuses an extension whose names clash with the worker's own.
Imports no vLLM at module level (the worker has it loaded)."""

from __future__ import annotations


class RLKernelsWorker:
    def rlkernels_gpu_uuids(self) -> list[str]:
        """This worker's GPU as "GPU-<uuid>" ([] on CPU), so the trainer's sender can tell an engine on its own GPU
        (where an NCCL group with both would fail with "Duplicate GPU") from one elsewhere."""
        from engines.weight_sync.wire import gpu_uuid

        device = self.device  # type: ignore[attr-defined]  (the vLLM worker's torch device)
        return [gpu_uuid(device)] if device.type == "cuda" else []

    def rlkernels_lora_sync(self) -> dict:
        """{"adapters": whether this server can take a LoRA run's adapter-only sync, "max_lora_rank": its
        --max-lora-rank or None} (a dict: vLLM's /collective_rpc answers a scalar as its str). It can when started
        with --enable-lora, with
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (the API server's /v1/load_lora_adapter, which registers a synced
        adapter's name; the engine processes share the API server's environment) and our weight-transfer back end."""
        from vllm import envs

        from engines.vllm_ext.receiver import ProcessGroupWeightTransferEngine

        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        lora = self.vllm_config.lora_config  # type: ignore[attr-defined]
        return {"adapters": (lora is not None and bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING)
                             and isinstance(engine, ProcessGroupWeightTransferEngine)),
                "max_lora_rank": None if lora is None else int(lora.max_lora_rank)}

    def rlkernels_apply_adapter(self, name: str) -> str:
        """After an adapter sync of `name` (its tensors are in our weight-transfer engine): "replaced" when vLLM
        serves the name already (rebuilt in place from the new tensors), "new" when the caller must register the
        name through /v1/load_lora_adapter with lora_path `rlkernels-tensors://<name>` (engines/vllm_ext/lora.py)."""
        from engines.vllm_ext.lora import apply_adapter

        if not self.rlkernels_lora_sync()["adapters"]:
            raise RuntimeError("this vLLM cannot serve synced LoRA adapters: start it with --enable-lora (and "
                               "--max-lora-rank >= the run's rank), VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and "
                               "--weight-transfer-config '{\"backend\": \"rlkernels\"}'")
        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        if name not in engine.adapters.pending:
            raise ValueError(f"adapter {name!r}: no new version was synced to this worker (pending: "
                             f"{sorted(engine.adapters.pending)}); send it by an update with a lora_adapter field")
        return apply_adapter(self.model_runner.lora_manager, engine.adapters, name)  # type: ignore[attr-defined]
