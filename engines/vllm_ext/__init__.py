"""A vLLM plugin shipped by this project: the `rlkernels` weight-transfer back end, and a worker extension
(`worker.py`: what the sender asks every worker through vLLM's /collective_rpc, e.g. its GPU).

vLLM loads `vllm.general_plugins` entry points in every one of its processes (API server, engine core, workers)
before it builds a worker; `register()` adds our back end to vLLM's `WeightTransferEngineFactory` by module path, so
vLLM itself is imported here only inside a vLLM process. Serve with
`--weight-transfer-config '{"backend": "rlkernels"}' --worker-extension-cls engines.vllm_ext.worker.RLKernelsWorker`
(see `engines.vllm.vllm_server_command`).

The entry point lives in the small metadata-only distribution beside this file (`pyproject.toml`), installed into
vLLM's venv next to an editable install of this project (`make .venv-vllm`).
"""

BACKEND_NAME = "rlkernels"
WORKER_EXTENSION = "engines.vllm_ext.worker.RLKernelsWorker"
GPU_UUIDS_METHOD = "rlkernels_gpu_uuids"  # a method of WORKER_EXTENSION, called by name through /collective_rpc
LORA_SYNC_METHOD = "rlkernels_lora_sync"  # WORKER_EXTENSION: can this server take adapter-only syncs
APPLY_ADAPTER_METHOD = "rlkernels_apply_adapter"  # WORKER_EXTENSION: a synced adapter -> vLLM's LoRA manager
# The lora_path under which a synced adapter is registered with vLLM's /v1/load_lora_adapter: the worker builds it
# from the tensors it received (engines/vllm_ext/lora.py), never from a folder.
TENSOR_PATH_SCHEME = "rlkernels-tensors://"


def register() -> None:
    """vLLM general-plugin hook; safe to call more than once per process (vLLM may load plugins repeatedly)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, "engines.vllm_ext.receiver",
                                                    "ProcessGroupWeightTransferEngine")
