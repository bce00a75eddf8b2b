"""vLLM worker extension (`--worker-extension-cls engines.vllm_ext.worker.RLKernelsWorker`, passed by
engines.vllm.vllm_server_command): vLLM adds this class to its worker class's bases, so each method runs on every
worker with `self` the worker, called by name through the server's /collective_rpc (VLLM_SERVER_DEV_MODE=1).
Method names carry the `rlkernels_` prefix: vLLM refuses an extension whose names clash with the worker's own.
Imports no vLLM (the worker has it loaded)."""

from __future__ import annotations


class RLKernelsWorker:
    def rlkernels_gpu_uuids(self) -> list[str]:
        """This worker's GPU as "GPU-<uuid>" ([] on CPU), so the trainer's sender can tell an engine on its own GPU
        (where an NCCL group with both would fail with "Duplicate GPU") from one elsewhere."""
        from engines.weight_sync.wire import gpu_uuid

        device = self.device  # type: ignore[attr-defined]  (the vLLM worker's torch device)
        return [gpu_uuid(device)] if device.type == "cuda" else []
