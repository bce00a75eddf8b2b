"""vLLM worker side of this project's weight sync: a `WeightTransferEngine` that joins the trainer's own process
group and receives the project's wire format (engines/weight_sync/wire.py), so one sender serves every engine kind.

Imported only inside a vLLM worker process (vLLM's factory loads it by module path, see `engines.vllm_ext`).

Group: the trainer hosts a TCPStore; each vLLM worker joins the group [trainer, engine ranks...] as rank
`rank_offset + dp_index * (tp * pp) + worker rank`, through `engines.weight_sync.wire.create_store/build_group`:
gloo for CPU workers, NCCL (torch's ProcessGroupNCCL) for GPU ones. vLLM's built-in `nccl` back end rendezvouses
through its own StatelessProcessGroup + PyNccl instead, which our sender does not speak.

Update info: the body of our `/update_weights_from_distributed` (`WeightMeta.to_wire`): names, dtypes, shapes and,
for `load_format="flattened_bucket"`, offsets/bucket_index/bucket_nbytes. Bucketed: one uint8 broadcast per bucket
([bucket_nbytes[k]] bytes), unpacked as views and handed to `model.load_weights` bucket by bucket. Per tensor: one
broadcast per tensor in order. HF names go in; the model's `load_weights` maps them (q/k/v -> qkv_proj, ...).
Loading runs inside vLLM's layerwise-reload lifecycle (start/finish_weight_update), like its NCCL back end.

A LoRA run's adapter-only sync (the update's `lora_adapter` field, engines.weight_sync.wire.lora_adapter_field): the
A/B tensors ("<module>.lora_A.weight" / ".lora_B.weight") are kept on the CPU in `self.adapters` under the adapter's
name, for the worker extension to hand to vLLM's LoRA manager (engines/vllm_ext/lora.py); the other tensors (the
base on the first sync, a trained lm_head) load into the model as above, without LoRA merged into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo

from engines.vllm_ext.lora import AdapterStore, SyncedAdapter
from engines.weight_sync.wire import (
    DEFAULT_GROUP_NAME,
    WeightMeta,
    broadcast_async,
    bucket_members,
    build_group,
    create_store,
    dtype_from_wire,
    is_lora_name,
    lora_adapter_field,
    shutdown_group,
    unpack_bucket,
    wait_work,
)


@dataclass
class ProcessGroupInitInfo(WeightTransferInitInfo):
    """`/init_weight_transfer_engine` {"init_info": {...}}: where the trainer's store is and our ranks in the group."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "gloo"
    timeout_s: float = 300.0

    def __post_init__(self):
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"init_info.backend={self.backend!r}: use 'gloo' (CPU workers) or 'nccl' (GPU workers)")
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"init_info.rank_offset={self.rank_offset} must be in [1, world_size={self.world_size})"
                             f" (rank 0 is the trainer)")


class ProcessGroupWeightTransferEngine(WeightTransferEngine[ProcessGroupInitInfo, WeightMeta]):
    """Receives the project's buckets over a torch process group and loads them into the vLLM model."""

    init_info_cls = ProcessGroupInitInfo
    update_info_cls = WeightMeta
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.timeout_s = 300.0
        self.rank = -1
        self.adapters = AdapterStore()  # adapter syncs' tensors by name (engines/vllm_ext/lora.py)

    def init_transfer_engine(self, init_info: ProcessGroupInitInfo) -> None:
        if self.group is not None:  # a re-init (trainer restarted): drop the old group first
            shutdown_group(self.group, broken=True)
            self.group = None
        pc = self.parallel_config
        self.rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        if self.rank >= init_info.world_size:
            raise ValueError(f"worker rank {self.rank} (rank_offset {init_info.rank_offset} + dp/tp rank) is outside "
                             f"world_size={init_info.world_size}: count every engine worker (tp*pp*dp) in it")
        self.timeout_s = init_info.timeout_s
        store = create_store(init_info.master_address, init_info.master_port, is_master=False,
                             timeout_s=init_info.timeout_s)
        self.group = build_group(store, rank=self.rank, world_size=init_info.world_size,
                                 group_name=init_info.group_name, backend=init_info.backend,
                                 timeout_s=init_info.timeout_s, device=self.device)

    def parse_update_info(self, update_dict: dict) -> WeightMeta:
        return WeightMeta.from_wire(update_dict)  # ValueError names the bad field

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host; our waits
        # already complete every broadcast, and a CUDA copy is ordered before the next forward on its stream.
        lora = lora_adapter_field(update_info)  # ValueError names the bad field
        self.receive_weights(self.parse_update_info(update_info), lora)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, meta: WeightMeta, lora: dict | None = None) -> None:
        """Receive every tensor of `meta`; with `lora` ({name, scaling, default}) its A/B tensors become that
        adapter's pending version in `self.adapters` once all arrived (the worker extension's apply checks and
        serves it; a failed receive keeps the previous version)."""
        if self.group is None:
            raise RuntimeError("no weight-transfer group: POST /init_weight_transfer_engine first")
        lora_names = [n for n in meta.names if is_lora_name(n)]
        if lora_names and lora is None:
            raise ValueError(f"tensors {lora_names[:2]}... are LoRA adapter tensors but the update has no "
                             f"'lora_adapter' field naming their adapter and scaling")
        adapter: dict[str, torch.Tensor] = {}
        if meta.bucket_nbytes is None:  # per tensor, in order
            for name, dtype, shape in zip(meta.names, meta.dtypes, meta.shapes):
                t = torch.empty(shape, dtype=dtype_from_wire(dtype), device=self.device)
                self._recv(t, f"broadcast of {name}")
                self._load([(name, t)], adapter)
        else:
            for k, members in enumerate(bucket_members(meta)):
                bucket = torch.empty(meta.bucket_nbytes[k], dtype=torch.uint8, device=self.device)
                self._recv(bucket, f"broadcast of bucket {k}")
                self._load(list(zip([meta.names[i] for i in members], unpack_bucket(meta, members, bucket))), adapter)
        if lora is not None:
            self.adapters.pending[lora["name"]] = SyncedAdapter(adapter, lora["scaling"])

    def _load(self, named: list[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor]) -> None:
        """Model weights into the model; adapter tensors copied out of the bucket, to the CPU (vLLM's LoRA manager
        builds its adapters on the CPU and copies them into its slots)."""
        weights = [(n, t) for n, t in named if not is_lora_name(n)]
        adapter.update((n, t.to("cpu", copy=True)) for n, t in named if is_lora_name(n))
        if weights:
            self.model.load_weights(weights)

    def _recv(self, t: torch.Tensor, what: str) -> None:
        wait_work(broadcast_async(self.group, t, src=0), timeout_s=self.timeout_s, what=what)

    def shutdown(self) -> None:
        if self.group is not None:
            shutdown_group(self.group, broken=False)
            self.group = None
