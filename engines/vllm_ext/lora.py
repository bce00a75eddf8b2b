"""vLLM worker side of a LoRA run's adapter-only weight sync: the A/B tensors the weight-transfer engine received
(engines/vllm_ext/receiver.py) become a vLLM LoRA model under the adapter's name, built from the tensors (no file
is written or read), replacing the previous version.

Imported only inside a vLLM worker process (the worker extension, engines/vllm_ext/worker.py, calls it).

Why this shape (vLLM 0.32): the API server maps a request's `model` to a LoRARequest(name, int id, path) only for
names registered through /v1/load_lora_adapter, and the worker's LoRA manager builds an adapter the first time it
sees its id, from `lora_path` (`WorkerLoRAManager._load_adapter`: a PEFT folder). So
- the worker's manager gets a loader for the paths `rlkernels-tensors://<name>` (TENSOR_PATH_SCHEME) that builds
  the LoRAModel from the received tensors with vLLM's own constructor for a PEFT state dict
  (`LoRAModel.from_lora_tensors`); a new name is registered through vLLM's route with that path;
- a later sync re-registers the LoRAModel, built from the new tensors, under the id vLLM gave the name, in the
  worker's manager. vLLM's own finish_weight_update has already dropped every adapter of the worker
  (`reset_lora_state`: adapters are derived state of the weights), so without this the next request naming it would
  rebuild it through the loader anyway; building it here makes a bad adapter fail the sync, not a later request.
  Not through the route with load_inplace=True: vLLM keeps that flag in the name's LoRARequest and then rebuilds the
  adapter on every scheduler step (tried: log-probs off by several nats).
An adapter that vLLM evicts from its CPU cache (--max-cpu-loras) is rebuilt by the same loader from the latest
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.vllm_ext import TENSOR_PATH_SCHEME


@dataclass
class SyncedAdapter:
    """One adapter as the last sync sent it: PEFT names ("<module>.lora_A.weight" [r, in], ".lora_B.weight"
    [out, r]) -> CPU tensors, and the scaling (alpha / r) vLLM multiplies B @ A by."""

    tensors: dict[str, torch.Tensor]
    scaling: float

    def __post_init__(self):
        ranks = {t.shape[0] for n, t in self.tensors.items() if n.endswith(".lora_A.weight")}
        if len(ranks) != 1:
            raise ValueError(f"adapter tensors with ranks {sorted(ranks)}: a synced adapter has one rank (the run's "
                             f"[lora] rank) and at least one lora_A")
        a = {n.removesuffix(".lora_A.weight") for n in self.tensors if n.endswith(".lora_A.weight")}
        b = {n.removesuffix(".lora_B.weight") for n in self.tensors if n.endswith(".lora_B.weight")}
        if a != b:
            raise ValueError(f"modules {sorted(a ^ b)[:4]} have lora_A without lora_B or the reverse; send both")

    @property
    def rank(self) -> int:
        return next(t.shape[0] for n, t in self.tensors.items() if n.endswith(".lora_A.weight"))


@dataclass
class AdapterStore:
    """This worker's synced adapters by name (`pending`: received, not yet checked by vLLM's LoRA manager;
    `adapters`: the versions it serves), and the LoRA id vLLM's API server gave each name."""

    pending: dict[str, SyncedAdapter] = field(default_factory=dict)
    adapters: dict[str, SyncedAdapter] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)


def expected_modules(manager) -> set[str]:
    """The module names (last part: q_proj, gate_proj, ...) vLLM's LoRA layers take, as its folder loader checks
    them (WorkerLoRAManager._load_adapter): packed modules listed by their parts."""
    adapter_manager = manager._adapter_manager
    packed = adapter_manager.packed_modules_mapping
    out: set[str] = set()
    for module in adapter_manager.supported_lora_modules:
        out.update(packed.get(module, [module]))
    return out


def build_lora_model(manager, name: str, adapter: SyncedAdapter, lora_id: int):
    """vLLM's LoRAModel of `adapter` under `lora_id` (what its folder loader builds from the same PEFT tensors)."""
    from vllm.lora.peft_helper import PEFTHelper

    modules = {n.rsplit(".", 3)[-3] for n in adapter.tensors}
    unknown = sorted(modules - expected_modules(manager))
    if unknown:
        raise ValueError(f"adapter {name!r}: modules {unknown} are not LoRA targets vLLM serves for this model "
                         f"(it takes {sorted(expected_modules(manager))})")
    r = adapter.rank
    helper = PEFTHelper(r=r, lora_alpha=adapter.scaling * r, target_modules=sorted(modules))
    helper.validate_legal(manager.lora_config)  # e.g. r > --max-lora-rank: vLLM's error names the flag
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)  # what vLLM's own loader applies (a vLLM model attribute)
    # Copies: vLLM keeps CPU tensors as given and folds the scaling into B in place when it registers the adapter
    # (LoRALayerWeights.optimize); a second build from the same tensors (a re-registration, a rebuild after vLLM
    # dropped its adapters) would scale B twice. Its folder loader reads fresh tensors each time; so do we.
    tensors = {n: t.clone() for n, t in adapter.tensors.items()}
    return manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))


def install_loader(manager, store: AdapterStore) -> None:
    """Make the worker's LoRA manager build `rlkernels-tensors://<name>` adapters from `store` (once per manager);
    every other path goes to vLLM's own loader."""
    if getattr(manager, "_rlkernels_store", None) is store:
        return
    folder_loader = manager._load_adapter

    def load(request):
        if not request.lora_path.startswith(TENSOR_PATH_SCHEME):
            return folder_loader(request)
        name = request.lora_path.removeprefix(TENSOR_PATH_SCHEME)
        if name not in store.adapters:
            raise ValueError(f"lora_path {request.lora_path!r}: no adapter {name!r} was synced to this worker "
                             f"(synced: {sorted(store.adapters)})")
        store.ids[name] = request.lora_int_id
        return build_lora_model(manager, name, store.adapters[name], request.lora_int_id)

    manager._load_adapter = load
    manager._rlkernels_store = store


def apply_adapter(manager, store: AdapterStore, name: str) -> str:
    """After a sync of adapter `name`: "replaced" when vLLM already knows the name (its LoRAModel is built from the
    new tensors and registered under the same id, in place of any previous one), else "new" (the caller registers
    it through /v1/load_lora_adapter with the path `rlkernels-tensors://<name>`, which `install_loader` serves)."""
    install_loader(manager, store)
    adapter = store.pending.pop(name)
    lora_id = store.ids.get(name)
    # Built first: a bad adapter (e.g. rank > --max-lora-rank) raises here and the served version stays the last good
    lora = build_lora_model(manager, name, adapter, 1 if lora_id is None else lora_id)
    store.adapters[name] = adapter
    if lora_id is None:
        return "new"
    adapter_manager = manager._adapter_manager
    adapter_manager.remove_adapter(lora_id)  # a no-op after vLLM's reset_lora_state or an eviction
    adapter_manager.add_adapter(lora)
    return "replaced"
