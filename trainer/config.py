"""The run's configuration: one tree of frozen dataclasses for the whole run file, parsed and validated here.

    RunConfig                  name, output_dir, seed (the top level of configs/*.toml)
      model:   ModelConfig     [model]     a Hugging Face folder or the tiny preset
      data:    DataConfig      [data]      prompt sets, field names, reward, format
      engines: EnginesConfig   [engines]   the fleet (engines.registry.EngineSpec entries) and the weight sync
      sft:     SFTTrainingConfig [sft] + [sft.optim] (OptimConfig)
      rl:      RLTrainingConfig  [rl] + [rl.optim], [rl.loss] (kernels.PolicyLossConfig), [rl.rollout] (RolloutConfig)
      trainer: BackendConfig   [trainer]   backend settings (compile, param_dtype, ...)
      eval:    EvalConfig      [eval]
      serve:   ServeConfig     [serve]     python -m trainer serve (the Tinker API) only

Every field has its default and a one-line help comment where it is declared (a reference can be generated from
this file). `config_from_dict(cls, table)` builds any node from a TOML table, walking `dataclasses.fields`: the
known keys are the fields (no key list beside a dataclass), nested dataclasses come from sub-tables, lists become
tuples. Keys that moved are reported from one table, `MOVED` (by dotted path); `INHERITED` fields (the seed) flow
from a table into its nested tables unless they set their own. The step functions' config
(trainer.backend.steps.TrainerConfig) holds a phase config and the BackendConfig by reference: nothing is copied.
Validation is in each `__post_init__`; every message names the bad field and how to fix it. Change a config with
`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engines.embedded.drafts import MAX_SPECULATIVE_TOKENS
from engines.registry import EngineSpec, launched_by_run
from kernels import PolicyLossConfig
from kernels.advantages import ADVANTAGE_ESTIMATORS, Estimator
from trainer.backend.parallel import ParallelConfig
from trainer.rollout.staleness import StalenessPolicy
from trainer.types import _check, _non_negative, _positive


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are generated: batch shape, sampling, over-sampling, filters, timeouts."""

    rollout_batch_size: int = 8  # prompts per step
    n_samples_per_prompt: int = 4  # group size (GRPO)
    over_sampling_factor: float = 1.0  # submit this many times the prompts needed, stop once the batch is full
    max_new_tokens: int = 32  # generation limit per sample (per turn in multi-turn episodes)
    temperature: float = 1.0  # the run's one temperature: the engines sample at it, the trainer's log-probs use it
    top_p: float = 1.0  # nucleus sampling (1.0 = off)
    top_k: int = -1  # -1 = off (SGLang's convention)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens (EOS and the template's end of turn always stop)
    max_concurrency: int = 64  # in-flight HTTP requests over all engines
    request_timeout_s: float = 120.0  # one engine request's limit (the HTTP clients' and the rollout manager's)
    max_retries: int = 3  # retries of a failed request (engine errors that are not the request's fault)
    dynamic_filters: tuple[str, ...] = ()  # names of trainer.rollout.samples filters, e.g. "check_reward_nonzero_std"
    max_staleness: int = 1  # set from [rl] max_staleness: cached partial samples past it restart from the prompt
    seed: int = 0  # per-request sampling seeds derive from it (from a run file: [rl] seed, else the run's)
    apply_chat_template: bool = True  # prompts are user turns of the chat template (a run file: [data].format)
    connect_timeout_s: float = 5.0  # an engine that does not accept a connection within this is "not answering"
    retry_backoff_s: float = 0.2  # wait before retry k is retry_backoff_s * 2**k
    abort_grace_s: float = 5.0  # after /abort_request, wait this long for engines to return partial samples
    max_filtered_groups: int = 0  # give up after this many groups dropped by filters in one batch (0 = 10 x batch)
    # Multi-turn episodes (trainer.rollout.episodes); at most one of env / tools / rollout_fn, chat format only.
    # "module:factory": called once per episode; returns an object with reset() and step()
    env: str | Callable[..., Any] | None = None
    tools: tuple[Any, ...] = ()  # "module:function" tools run by the built-in tool environment (trainer.rollout.tools)
    # "module:function": async fn(client, row) that drives its own episode through `client`
    rollout_fn: str | Callable[..., Any] | None = None
    # "module:function": an OpenAI-client agent, `async def fn(row, endpoint)` (or a plain def), trained through the
    # recording gateway (trainer.rollout.gateway); returns the reward, {"reward", "correct", "metadata"} or None
    agent: str | Callable[..., Any] | None = None
    agent_timeout_s: float = 300.0  # one agent episode's limit; past it the episode is FAILED (env_timeouts)
    max_turns: int = 4  # assistant turns per episode (an episode still running after them is truncated)
    max_context_tokens: int = 0  # an episode's tokens, prompt and every turn (0: no limit but max_turns)
    tool_timeout_s: float = 10.0  # one tool call's limit; past it the model is answered with an error
    env_timeout_s: float = 60.0  # one env reset() or step() call's limit; past it the episode is FAILED (env_timeouts)
    tool_parser: str = "hermes"  # reads the model's tool calls: "hermes" (<tool_call>{json}</tool_call>) or "module:fn"
    mask_truncated: bool = False  # truncated samples stay out of the loss (still in their group's baseline)
    # steps in a row with nothing to learn from (every sample truncated or failed, their rewards all equal) after which
    # the run stops with an error naming max_new_tokens and max_context_tokens (0: never; trainer.rl.check_finishing)
    max_truncated_steps: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "dynamic_filters", tuple(self.dynamic_filters))
        object.__setattr__(self, "tools", tuple(self.tools))
        given = [k for k in ("env", "tools", "rollout_fn", "agent") if getattr(self, k)]
        _check(len(given) <= 1, " and ".join(given), "give one of env, tools, rollout_fn and agent: tools runs the "
               "built-in tool environment, a custom env calls its tools in its own step(), a rollout_fn drives the "
               "episode, an agent is an OpenAI client trained through the gateway")
        _check(not given or self.apply_chat_template, given[0] if given else "",
               "multi-turn episodes are chat conversations: set [data] format = \"chat\"")
        _positive(self, "max_turns", "tool_timeout_s", "env_timeout_s", "agent_timeout_s")
        _non_negative(self, "max_context_tokens", "max_truncated_steps")
        _positive(self, "rollout_batch_size", "n_samples_per_prompt", "max_new_tokens", "max_concurrency",
                  "request_timeout_s")
        _check(self.over_sampling_factor >= 1.0, "over_sampling_factor",
               f"must be >= 1.0 (1.0 = no over-sampling), got {self.over_sampling_factor}")
        _check(0 < self.temperature < math.inf, "temperature", f"must be > 0 and finite, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k > 0, "top_k", f"must be -1 (off) or > 0, got {self.top_k}")
        _non_negative(self, "max_retries", "max_staleness", "retry_backoff_s", "abort_grace_s", "max_filtered_groups")
        _positive(self, "connect_timeout_s")

@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay: the one optimiser config of SFT and RL ([sft.optim], [rl.optim])."""

    lr: float = 1e-4  # peak learning rate (after warmup)
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio (1.0 = constant after warmup)
    warmup_steps: int = 0  # linear warmup from 0 to lr over these steps
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's moment decay rates
    eps: float = 1e-8  # AdamW's denominator term
    max_grad_norm: float = 1.0  # 0 = no clipping (the norm is still reported)

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        _positive(self, "lr", "eps")
        _check(math.isfinite(self.lr), "lr", f"must be finite, got {self.lr}")
        _non_negative(self, "warmup_steps", "weight_decay", "max_grad_norm")
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
               f"must be two numbers in [0, 1), got {self.betas}")

def _optim(value: Any) -> OptimConfig:
    if isinstance(value, OptimConfig):
        return value
    if isinstance(value, Mapping):
        return config_from_dict(OptimConfig, value)
    raise ValueError(f"optim: expected an OptimConfig or a table of its keys, got {type(value).__name__}")

LORA_ALL_LINEAR = "all-linear"  # PEFT's name for every Linear of the decoder blocks (not the lm_head)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """[sft.lora] / [rl.lora]: train low-rank adapters on a frozen base (absent: full fine-tuning).

    Each targeted Linear W [out, in] computes x W^T + (alpha / rank) x A^T B^T with A [rank, in] (Kaiming-uniform
    from the run's seed) and B [out, rank] (zeros), so the first forward is the base model's; only A and B (and
    the lm_head with train_unembed) get gradients and optimizer state (trainer.backend.lora, through PEFT).
    """

    rank: int = 16  # r: the adapters' inner dimension
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input, in [0, 1)
    # "all-linear" (every Linear of the decoder blocks) or a list of module names, e.g. ["q_proj", "v_proj"]
    target_modules: str | list[str] = LORA_ALL_LINEAR
    # also train the lm_head weight itself (in full, not as an adapter: the fused log-prob kernels read it as is)
    train_unembed: bool = False

    def __post_init__(self) -> None:
        _positive(self, "rank", "alpha")
        _check(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout!r}")
        t = self.target_modules
        if isinstance(t, list | tuple):
            _check(len(t) > 0 and all(isinstance(m, str) and m for m in t), "target_modules",
                   f"expected \"{LORA_ALL_LINEAR}\" or a non-empty list of module names, got {list(t)!r}")
            object.__setattr__(self, "target_modules", tuple(t))  # hashable: the config is frozen
        else:
            _check(t == LORA_ALL_LINEAR, "target_modules", f"expected \"{LORA_ALL_LINEAR}\" or a list of module "
                   f"names such as [\"q_proj\", \"v_proj\"], got {t!r}")


def _lora(value: Any, table: str) -> LoRAConfig | None:
    """A phase's `lora`: None (full fine-tuning), a LoRAConfig, or the [<phase>.lora] table of its keys."""
    if value is None or isinstance(value, LoRAConfig):
        return value
    if isinstance(value, Mapping):
        return config_from_dict(LoRAConfig, value, table)
    raise ValueError(f"lora: expected a table of LoRA keys ([{table}] rank, alpha, ...), got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class _PhaseConfig:
    """What SFT and RL both need besides the optimiser: length, packing, checkpoints, seed, outputs."""

    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)  # the [<phase>.optim] table
    num_steps: int = 10  # also the length of the LR schedule
    token_budget: int = 4096  # tokens per packed micro-batch
    micro_batch_buckets: int = 256  # packed rows are padded to a multiple of this (compile-stable shapes)
    save_every: int = 0  # 0 = only at the end
    keep_last: int = 2  # checkpoints kept (older ones are deleted)
    seed: int = 0  # the trainer's seed (from a run file: the run's seed unless set here)
    output_dir: str = "runs/default"  # checkpoints and metrics (from a run file: <run output_dir>/<phase>)
    # the [<phase>.lora] table (LoRAConfig): train LoRA adapters on a frozen base; absent: full
    lora: LoRAConfig | Mapping[str, Any] | None = None

    TABLE = "phase"  # the phase's table in a run file, for messages ("sft", "rl")

    def __post_init__(self) -> None:
        object.__setattr__(self, "optim", _optim(self.optim))
        object.__setattr__(self, "lora", _lora(self.lora, f"{self.TABLE}.lora"))
        _positive(self, "num_steps", "token_budget", "micro_batch_buckets", "keep_last")
        _non_negative(self, "save_every")
        # a packed row is padded to a multiple of micro_batch_buckets, at most token_budget long
        # (trainer.batching.micro_batches refuses a budget smaller than one bucket)
        _check(self.token_budget >= self.micro_batch_buckets and self.token_budget % self.micro_batch_buckets == 0,
               "token_budget", f"must be a multiple of micro_batch_buckets={self.micro_batch_buckets} (at least one "
                               f"bucket), got {self.token_budget}")

@dataclasses.dataclass(frozen=True)
class SFTTrainingConfig(_PhaseConfig):
    """Supervised fine-tuning on chat conversations (assistant-only loss)."""

    TABLE = "sft"  # [sft]

    batch_size: int = 16  # conversations per step
    max_length: int = 512  # tokens per conversation (longer ones are cut)

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "batch_size", "max_length")

def resolve_loss(loss: Any, rollout: RolloutConfig, *, off_policy: bool) -> Any:
    """The policy-loss config an RL run trains with: a kernels.PolicyLossConfig, or a table of its keys.

    From a table, two keys are derived when absent: `rollout_correction` is "tis" for off-policy runs (async
    rollouts, or engines that lag because sync_every > 1) and "none" for synchronous on-policy runs; and
    `max_seq_len` (the Dr.GRPO normaliser of loss_agg = "seq-mean-token-sum-norm") is the generation limit
    rollout.max_new_tokens. A PolicyLossConfig object is taken as given (its fields are explicit choices).
    """
    if loss is None:
        loss = {}
    if isinstance(loss, PolicyLossConfig):
        return loss
    if not isinstance(loss, Mapping):
        raise ValueError(f"loss: expected a kernels.PolicyLossConfig or a table of its keys, got "
                         f"{type(loss).__name__}")
    values = dict(loss)
    values.setdefault("rollout_correction", "tis" if off_policy else "none")
    if values.get("loss_agg") == "seq-mean-token-sum-norm":
        values.setdefault("max_seq_len", rollout.max_new_tokens)
    return config_from_dict(PolicyLossConfig, values, "rl.loss")

CRITIC_KINDS = ("model", "head")
GAE = "gae"  # the estimator with a value model (its kernels.advantages entry declares per_token and needs_critic)


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """[rl.critic]: the value model of advantage_estimator = "gae" (PPO with a critic; trainer.backend.critic).

    kind "model": a separate critic, the policy's weights at the start of RL (or the causal LM at `path`, which
    must share the policy's tokenizer) with a fresh scalar value head on the last hidden state; sharded, compiled
    and checkpointed like the policy, trained by its own optimiser ([rl.critic.optim]) on the value loss alone.
    kind "head": a value head on the policy's own trunk, trained through the policy's loss
    (loss + value_loss_coef x value loss) by [rl.optim]. Unclipped value loss: value_clip = inf (None in Python).
    """

    kind: str = "model"  # "model" (a separate critic) or "head" (a value head on the policy's trunk)
    path: str | None = None  # kind "model": the critic's starting causal LM folder (None: the policy's start weights)
    value_clip: float | None = 0.2  # PPO value clip around the rollout's values (inf or None: unclipped)
    value_loss_coef: float = 0.5  # kind "head": the value loss's weight in the policy's loss
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)  # kind "model": the [rl.critic.optim] table

    def __post_init__(self) -> None:
        object.__setattr__(self, "optim", _optim(self.optim))
        _check(self.kind in CRITIC_KINDS, "kind", f"{self.kind!r}: choose \"model\" (a separate critic) or \"head\" "
               f"(a value head on the policy)")
        if self.value_clip is None:
            object.__setattr__(self, "value_clip", float("inf"))  # one spelling, which a TOML file can write back
        _check(self.value_clip > 0, "value_clip", f"must be > 0 (inf: unclipped), got {self.value_clip}")
        _non_negative(self, "value_loss_coef")
        if self.kind == "head":
            _check(self.path is None, "path", "a value head lives on the policy's trunk (kind = \"head\"): remove "
                   "path, or set kind = \"model\" for a separate critic loaded from it")
            _check(self.optim == OptimConfig(), "optim", "kind = \"head\" trains the value head with the policy's "
                   "optimiser ([rl.optim]): remove [rl.critic.optim], or set kind = \"model\"")
            _check(self.value_loss_coef > 0, "value_loss_coef", "must be > 0 with kind = \"head\" (the value head "
                   "learns through it)")

    @property
    def clip(self) -> float | None:
        """value_clip for kernels.gae.value_loss: None when unclipped."""
        return None if self.value_clip == float("inf") else self.value_clip


STALE_POLICIES = ("regenerate", "drop")
ROLLOUT_WORKERS = ("thread", "process")  # [rl] rollout_worker


@dataclasses.dataclass(frozen=True)
class RLTrainingConfig(_PhaseConfig):
    """GRPO/PPO training: the loss ([rl.loss]), the advantages, weight sync and the rollout schedule.

    `loss` accepts a table (dict) of kernels.PolicyLossConfig keys and is resolved here (see `resolve_loss`):
    leaving `rollout_correction` unset means "tis" when the rollouts are off-policy (async_rollout or
    sync_every > 1) and "none" otherwise. The rollout's temperature is the run's only temperature: the engines
    sample with it and the trainer computes its log-probs with it.
    """

    advantage_estimator: str = "grpo"  # a name registered in kernels.advantages, or "gae" (PPO with [rl.critic])
    gamma: float = 1.0  # "gae": the discount per trained token
    lam: float = 0.95  # "gae": GAE's lambda (1: Monte Carlo returns minus the value; 0: one-step TD)
    whiten_advantages: bool = True  # "gae": advantages to zero mean, unit variance over the step's trained tokens
    # "gae": the [rl.critic] table (CriticConfig; absent: its defaults); other estimators: none
    critic: CriticConfig | Mapping[str, Any] | None = None
    # kernels.PolicyLossConfig (a dict of its keys is resolved in __post_init__)
    loss: PolicyLossConfig | Mapping[str, Any] | None = None
    ppo_epochs: int = 1  # optimizer steps per rollout batch (>1 makes old != current policy)
    sync_every: int = 1  # weight sync to engines every N steps (>1: the engines lag the trainer)
    async_rollout: bool = False  # generate the next max_staleness steps' batches while a step trains
    # The staleness bound k: no sample trains whose oldest token came from weights more than k versions older than
    # the trainer's (0: on-policy only; async mode generates k steps ahead and needs k >= 1).
    max_staleness: int = 1
    stale_policy: str = "regenerate"  # a sample past the bound: "regenerate" (its group again, later) or "drop"
    # Sync the engines' weights while their requests run: the engines pause at a decode step, load, and go on
    # (tokens after the load come from the new weights; each token's version is kept). False: the sync waits until
    # the batch being generated is done. Embedded engines only (they report which version made which token).
    update_in_flight: bool = False
    # Where the rollout's client side (requests, responses into samples, rewards) runs: "thread", a worker thread in
    # the trainer's process (async mode; synchronous mode generates in the step's own thread); "process", a process
    # of its own, with its own interpreter lock and long-lived connections (engines reached over HTTP only: not
    # kind "local"; [rewards] sources are built there, their reward models loaded there). Where engines and trainer
    # have separate cores or GPUs, the process keeps the client's Python from taking turns with the step's (README,
    # "Throughput").
    rollout_worker: str = "thread"
    verify_sync: bool = False  # after each sync, compare the engines' weights with the trainer's (a metric)
    # Reproducible from the seeds whatever the arrival order of requests: each engine runs one request (one
    # group) at a time, so its batch composition is fixed; costs the batching across groups (docs/results.md has
    # the cost).
    deterministic: bool = False
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)  # the [rl.rollout] table

    TABLE = "rl"  # [rl]

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rollout, Mapping):
            object.__setattr__(self, "rollout", config_from_dict(RolloutConfig, self.rollout))
        if not isinstance(self.rollout, RolloutConfig):
            raise ValueError(f"rollout: expected a RolloutConfig, got {type(self.rollout).__name__}")
        # Over-sampled groups still running when the batch fills are cut wherever they are at that moment.
        _check(not self.deterministic or self.rollout.over_sampling_factor == 1.0, "deterministic",
               f"needs rollout.over_sampling_factor = 1.0 (got {self.rollout.over_sampling_factor}): groups cut "
               f"when the batch fills depend on timing; set it to 1.0 or deterministic = false")
        _check(self.advantage_estimator in ADVANTAGE_ESTIMATORS, "advantage_estimator",
               f"unknown {self.advantage_estimator!r}; choose one of {tuple(ADVANTAGE_ESTIMATORS)}")
        self._resolve_critic()
        # A group estimator's baseline is the other samples of the group: a group of one has none, and every sample
        # would be left out of the loss (trainer.rl.trained_samples), failing the first step after its rollout.
        # A critic's value is a baseline of its own ("gae"): any group size works.
        n = self.rollout.n_samples_per_prompt
        ungrouped = tuple(k for k, e in ADVANTAGE_ESTIMATORS.items() if not e.needs_groups)
        _check(n >= 2 or not self.needs_groups, "advantage_estimator",
               f"{self.advantage_estimator!r} takes each sample's baseline from its group, so it needs [rl.rollout] "
               f"n_samples_per_prompt >= 2 (got {n}); raise it, or choose an estimator without groups: {ungrouped}")
        # One sequence is a prompt (at least one token) and up to max_new_tokens generated ones; a micro-batch must
        # hold it (the data's own prompt lengths are checked when the data loads: trainer.cli).
        m = self.rollout.max_new_tokens
        _check(self.token_budget > m, "token_budget",
               f"{self.token_budget} cannot hold one sequence (a prompt + [rl.rollout] max_new_tokens = {m} tokens); "
               f"raise [rl] token_budget or lower max_new_tokens")
        _positive(self, "ppo_epochs", "sync_every")
        _non_negative(self, "max_staleness")
        _check(self.stale_policy in STALE_POLICIES, "stale_policy",
               f"{self.stale_policy!r}; choose one of {STALE_POLICIES}")
        _check(self.rollout_worker in ROLLOUT_WORKERS, "rollout_worker",
               f"{self.rollout_worker!r}; choose one of {ROLLOUT_WORKERS}")
        # Fresh tokens must fit the bound by construction (trainer.rollout.staleness derives how).
        problem = self.staleness.problem()
        _check(problem is None, "max_staleness", problem or "")
        # The rollout manager restarts cached partial samples past the same bound (one key, [rl] max_staleness).
        object.__setattr__(self, "rollout", dataclasses.replace(self.rollout, max_staleness=self.max_staleness))
        object.__setattr__(self, "loss", resolve_loss(self.loss, self.rollout, off_policy=self.off_policy))

    @property
    def staleness(self) -> StalenessPolicy:
        """The staleness bound and what follows from it: how far rollouts run ahead, which samples are past it."""
        return StalenessPolicy(self.max_staleness, sync_every=self.sync_every, async_rollout=self.async_rollout,
                               stale_policy=self.stale_policy)

    @property
    def generation_ahead(self) -> int:
        """Steps the rollouts run ahead of training (StalenessPolicy.ahead)."""
        return self.staleness.ahead

    @property
    def off_policy(self) -> bool:
        """The engines may sample with weights older than the ones being trained."""
        return self.async_rollout or self.sync_every > 1

    @property
    def estimator(self) -> Estimator:
        """The advantage estimator's registry entry: what it needs of the trainer (groups, per-token, a critic)."""
        return ADVANTAGE_ESTIMATORS[self.advantage_estimator]

    @property
    def needs_groups(self) -> bool:
        """The advantage estimator's baseline is the sample's group (a group needs two scored samples)."""
        return self.estimator.needs_groups

    def _resolve_critic(self) -> None:
        """`critic` as a CriticConfig for an estimator that needs a value model ("gae"; from its table, or the
        defaults), None otherwise; the critic's keys are refused with another estimator (they would be ignored)."""
        if not self.estimator.needs_critic:
            with_critic = " or ".join(f"\"{k}\"" for k, e in ADVANTAGE_ESTIMATORS.items() if e.needs_critic)
            _check(self.critic is None, "critic", f"[rl.critic] configures the value model of advantage_estimator = "
                   f"{with_critic}, but it is {self.advantage_estimator!r}: remove the table or set "
                   f"advantage_estimator = {with_critic}")
            for name in ("gamma", "lam", "whiten_advantages"):
                default = next(f.default for f in dataclasses.fields(self) if f.name == name)
                _check(getattr(self, name) == default, name, f"is read by advantage_estimator = {with_critic} only "
                       f"(this run's is {self.advantage_estimator!r}): remove it or set advantage_estimator = "
                       f"{with_critic}")
            return
        critic = CriticConfig() if self.critic is None else self.critic
        if isinstance(critic, Mapping):
            critic = config_from_dict(CriticConfig, critic, "rl.critic")
        _check(isinstance(critic, CriticConfig), "critic", f"expected a CriticConfig or a table of its keys, got "
                                                           f"{type(critic).__name__}")
        object.__setattr__(self, "critic", critic)
        _check(0.0 <= self.gamma <= 1.0, "gamma", f"must be in [0, 1], got {self.gamma}")
        _check(0.0 <= self.lam <= 1.0, "lam", f"must be in [0, 1], got {self.lam}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """[model]: the model both the trainer and the engines load: a Hugging Face folder, or the tiny preset."""

    preset: str = "tiny"  # the only preset: a random-initialised small model with the project's tokenizer
    path: str | None = None  # a Hugging Face model folder (config.json, weights, tokenizer); replaces the preset
    checkpoint: str | None = None  # start from this checkpoint (a step folder or a phase's output_dir) of the model
    arch: str = "llama"  # preset architecture: "llama" or "qwen2"
    hidden_size: int | None = None  # preset sizes; None: engines.tiny.tiny_model_config's default
    num_layers: int | None = None  # preset decoder blocks (None: the preset's default)
    num_heads: int | None = None  # preset attention heads (None: the preset's default)
    num_kv_heads: int | None = None  # preset key/value heads (None: the preset's default)
    intermediate_size: int | None = None  # preset MLP width (None: 4 x hidden_size)
    max_position_embeddings: int | None = None  # preset context length (None: the preset's default)
    tie_word_embeddings: bool | None = None  # preset: lm_head shares the embedding (None: the preset's default)

    def __post_init__(self) -> None:
        _check(self.preset == "tiny", "preset", f"{self.preset!r}: the only preset is 'tiny'; or set [model].path")
        _check(self.arch in ("llama", "qwen2"), "arch", f"{self.arch!r}: the tiny preset exists for 'llama' and "
                                                        f"'qwen2'")

    def preset_sizes(self) -> dict[str, Any]:
        """The preset's size arguments the config sets (engines.embedded.presets.build_tiny_model keywords)."""
        not_sizes = ("preset", "path", "checkpoint", "arch")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in not_sizes and getattr(self, f.name) is not None}


FORMATS = ("chat", "plain")
# The data set fields a [data] table may set for every set that does not set its own (trainer.data.buffer.DataSpec).
_MAPPING_KEYS = ("prompt_key", "answer_key", "messages_key", "system_prompt", "split")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """[data]: the prompt sets, their field names, the reward function and the prompt format.

    train / eval / sft: a data file (JSON, JSONL, parquet), a save_to_disk folder, or a list of {path, weight, ...}
    tables (a weighted mixture; trainer.data.buffer.DataSpec); the field-name keys below apply to every set that
    does not set its own.
    """

    # the RL prompts (and SFT's when `sft` is unset); required by every mode but export
    train: str | list[Any] | None = None
    # held-out prompts: greedy accuracy before / between / after the phases (None: no evaluation)
    eval: str | list[Any] | None = None
    sft: str | list[Any] | None = None  # the SFT examples (prompt + answer, or full conversations); None: `train`
    # "module:function" or a built-in name ("arithmetic", "gsm8k", ...); rl and eval need one, unless [rl.rollout] env
    # or rollout_fn returns each episode's reward (an episode given none is FAILED)
    reward: str | None = None
    reward_timeout_s: float = 60.0  # one reward call's limit (s); past it the sample is FAILED, the step goes on
    format: str = "chat"  # "chat": prompts are user turns of the chat template; "plain": the prompt text itself
    prompt_key: str = "prompt"  # the prompt's field in the data set
    answer_key: str | None = None  # the answer's field (None: "answer" when the set has one)
    messages_key: str | None = None  # SFT conversations' field (the prompt field is then optional)
    system_prompt: str | None = None  # a system turn before every prompt (chat format)
    split: str | None = None  # the split of a DatasetDict.save_to_disk folder (None: "train")

    def __post_init__(self) -> None:
        _check(self.format in FORMATS, "format", f"{self.format!r}; choose one of {FORMATS}")
        _check(self.reward is None or (isinstance(self.reward, str) and bool(self.reward)), "reward",
               f"{self.reward!r}: give a \"module:function\" path or a registered reward name")
        _positive(self, "reward_timeout_s")

    def mapping(self) -> dict[str, Any]:
        """The field-name keys as the defaults of every set (trainer.data.buffer.data_specs)."""
        return {k: getattr(self, k) for k in _MAPPING_KEYS}


SYNC_MODES = ("group", "disk")


@dataclasses.dataclass(frozen=True)
class EnginesConfig:
    """[engines]: the fleet of inference engines and how the trainer's weights reach them.

    `fleet` is the one form the run reads: a list of engines.registry.EngineSpec tables {kind, url, tp_size, model}
    (kind "sglang", "vllm", "embedded": without url, started by the run; "local": in this process); `kind`
    defaults to "sglang". `in_process = true` is the shorthand for the one-process demos' fleet = [{kind =
    "local"}], folded into `fleet` when the config is built and then cleared (so `dataclasses.replace` sees one
    form). The older `urls` and `embedded = N` keys are gone: MOVED names the fleet entries that replace them.
    """

    fleet: tuple[Any, ...] | None = None  # EngineSpec entries (tables or objects); None: one "embedded" (or in_process)
    in_process: bool = False  # shorthand for fleet = [{kind = "local"}]: one engine inside the trainer's process
    api_key: str | None = None  # the engines' key ("" = None: each engine the run starts gets a random one)
    threads: int = 1  # CPU threads of each embedded engine the run starts (its process, or in process its model thread)
    # An in-process engine on CPU in synchronous RL (and evaluation): the trainer waits while it generates, so the
    # engine decodes on the trainer's cores instead of `threads`, each side releasing its OpenMP pool when it hands
    # them over (engines/local.py). Async RL always uses `threads`: there the two compute at once
    lend_cores: bool = True
    start_timeout_s: float = 180.0  # wait this long for a started engine to answer /health
    # Embedded engines: KV of finished rows kept for reuse by prompts that start with them (an episode's next turn
    # prefills only its new tokens; engines/embedded/prefix_cache.py), in tokens, LRU; 0: off. None: the engine's
    # default (32768 tokens) for multi-turn rollouts ([rl.rollout] env, tools, rollout_fn, agent), off for single-turn
    prefix_cache_tokens: int | None = None
    # Embedded engines: speculative decoding by n-gram lookup (engines/embedded/drafts.py): up to this many draft
    # tokens a row and step, taken from the row's own context or from finished rows, checked in one forward; the
    # tokens are the ones plain decoding draws (same seeds), only the number of forwards changes. 0: off
    speculative_tokens: int = 0
    # Embedded engines on CUDA: each decode step replays a CUDA graph, one captured per bucketed row count (the next
    # power of two) and cache buffers (engines/embedded/graphs.py), instead of running a torch.compile'd forward: no
    # compile time, one launch a step. Off until measured on a GPU (issue 42); on the CPU the same static step runs
    # uncaptured (the tests' proof, no faster)
    cuda_graphs: bool = False
    # Embedded engines: the KV-cache cells (a row's column: its keys and values in every layer) the running rows
    # may hold; queued rows wait until the batch's worst case fits (engines/embedded/server.py EngineServer._cells),
    # a row that cannot fit alone is refused. None: unlimited on the CPU; on CUDA 40 % of the memory free when a
    # batch starts (the device's, plus this process's cached free blocks), a batch's first row admitted whatever
    kv_cache_tokens: int | None = None
    sync: str = "group"  # weight sync: "group" (broadcast / shared memory) or "disk" (safetensors, opt-in fallback)
    sync_folder: str | None = None  # disk sync: the run makes its private folder here (None: /dev/shm or temp dir)
    master_address: str = ""  # the weight-update group's address ("": this host's address the engines reach)
    master_port: int = 0  # the weight-update group's TCP port (0: pick a free one)
    # The dtype the embedded engines the run starts load their weights in, and what engines that do not report
    # theirs (a stock SGLang, vLLM) are sent. None: the trainer's compute dtype on the engine's device ([trainer]
    # param_dtype: bfloat16 on CUDA, float32 on CPU; an fp32 run samples from fp32 weights)
    dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_key", self.api_key or None)
        _check(isinstance(self.in_process, bool), f"in_process = {self.in_process!r}",
               "true (one engine inside the trainer's process, no HTTP) or false")
        if self.in_process:
            _check(self.fleet is None, "in_process = true and [engines].fleet both given",
                   "the in-process engine is the run's only engine (it replaces the embedded engine process); drop "
                   "one of them")
        if self.fleet is not None:
            _check(isinstance(self.fleet, tuple | list) and all(isinstance(t, Mapping | EngineSpec)
                                                                for t in self.fleet), f"fleet = {self.fleet!r}",
                   "give a list of tables, e.g. fleet = [{url = \"http://host:30000\", kind = \"sglang\", "
                   "tp_size = 2}, {kind = \"embedded\"}]")
            fleet = tuple(t if isinstance(t, EngineSpec) else
                          config_from_dict(EngineSpec, {"kind": "sglang", **t}, f"engines.fleet[{i}]")
                          for i, t in enumerate(self.fleet))
        else:
            fleet = (EngineSpec("local"),) if self.in_process else (EngineSpec("embedded"),)
        # One form from here on: a dataclasses.replace of this config must not see the shorthand again.
        for name, value in (("fleet", fleet), ("in_process", False)):
            object.__setattr__(self, name, value)
        _check(self.sync in SYNC_MODES, f"sync = {self.sync!r}",
               "choose 'group' (broadcast / shared memory) or 'disk'")
        port = self.master_port
        _check(not isinstance(port, bool) and isinstance(port, int) and 0 <= port < 65536, f"master_port = {port!r}",
               "a TCP port (0 = pick a free one)")
        _check(self.dtype in (None, "float32", "bfloat16", "float16"), f"dtype = {self.dtype!r}",
               "float32, bfloat16 or float16 (what the engines serve), or unset")
        _check(isinstance(self.master_address, str), "master_address",
               "a host name or IP address (string) the engines can reach")
        t = self.threads
        _check(not isinstance(t, bool) and isinstance(t, int) and t > 0, f"threads = {t!r}", "a whole number >= 1")
        _check(isinstance(self.lend_cores, bool), f"lend_cores = {self.lend_cores!r}", "true or false")
        p = self.prefix_cache_tokens
        _check(p is None or (isinstance(p, int) and not isinstance(p, bool) and p >= 0), f"prefix_cache_tokens = {p!r}",
               "a whole number of tokens >= 0 (0: off), or unset (the engine's default)")
        k = self.speculative_tokens
        _check(not isinstance(k, bool) and isinstance(k, int) and 0 <= k <= MAX_SPECULATIVE_TOKENS,
               f"speculative_tokens = {k!r}",
               f"a whole number of draft tokens from 0 (off) to {MAX_SPECULATIVE_TOKENS} (e.g. 4)")
        _check(isinstance(self.cuda_graphs, bool), f"cuda_graphs = {self.cuda_graphs!r}", "true or false")
        n = self.kv_cache_tokens
        _check(n is None or (isinstance(n, int) and not isinstance(n, bool) and n > 0), f"kv_cache_tokens = {n!r}",
               "a whole number of KV-cache cells > 0, or unset (the engine's default)")
        v = self.start_timeout_s
        _check(not isinstance(v, bool) and isinstance(v, int | float) and v > 0, f"start_timeout_s = {v!r}",
               "must be > 0")

    @property
    def started_here(self) -> int:
        """Engine processes the run starts (fleet entries of a launchable kind, e.g. "embedded", without a url)."""
        return sum(launched_by_run(s) for s in self.fleet)


TRAINING_BACKENDS = ("local", "tinker")  # [trainer] backend


@dataclasses.dataclass(frozen=True)
class BackendConfig(ParallelConfig):
    """[trainer]: the training backend's settings; the parallelisation ones (compile, compile_backend,
    compile_dynamic, activation_checkpointing, param_dtype, liger) are trainer.backend.parallel.ParallelConfig's
    own fields, so this object is what `parallelize` takes."""

    logprob_chunk_tokens: int | None = None  # tokens per lm_head chunk of the fused log-prob kernels (None: auto)
    # RL: each prompt's tokens run through the model once per micro-batch, not once per sample (the same loss;
    # trainer.batching.shared_prompt), where the model's attention supports it
    # (trainer.backend.attention.supports_shared_prompts).
    share_prompts: bool = True
    # FSDP2: reduce-scatter the gradients once per step, after the last micro-batch (the others accumulate unsharded
    # gradients: one collective per step instead of one per micro-batch, at the memory of one unsharded gradient).
    # False: after every micro-batch (the least memory).
    defer_grad_sync: bool = True
    # CPU: pin the trainer's process to these cores, one torch thread each (None: not pinned). With the embedded
    # engines pinned elsewhere ([engines] fleet entries' cpus), a stand-in for a trainer on its own GPUs.
    cpus: tuple[int, ...] | None = None
    # CPU: the cores of the async rollout worker thread (the client side of generation: requests, responses, rewards,
    # beside the step in the trainer's process); None: the trainer's. With engines pinned apart, give it theirs.
    rollout_cpus: tuple[int, ...] | None = None
    # Where the optimisation runs: "local" (this process: FSDP2, compile, the fused kernels) or "tinker" (the
    # Tinker-API server at base_url, through the official `tinker` SDK: [rl.lora] adapters, RL only; the rollouts
    # sample its weights through the "tinker" engine kind; trainer/backend/remote.py)
    backend: str = "local"
    base_url: str | None = None  # backend "tinker": the server's http(s):// address
    # backend "tinker": the server's key (None: the environment variable RLKERNELS_API_KEY; required off loopback)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    base_model: str | None = None  # backend "tinker": the server's name of the base model (None: the [model] path)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.backend in TRAINING_BACKENDS, "backend", f"{self.backend!r}; choose one of {TRAINING_BACKENDS}")
        if self.backend == "tinker":
            _check(_http_url(self.base_url), "base_url", f"{self.base_url!r}: backend = \"tinker\" needs the "
                   f"server's http(s):// address, e.g. \"http://127.0.0.1:8000\"")
        else:
            given = [k for k in ("base_url", "api_key", "base_model") if getattr(self, k) is not None]
            _check(not given, given[0] if given else "", "is for backend = \"tinker\" (a Tinker-API server); "
                   "drop it, or set [trainer] backend = \"tinker\"")
        for name in ("cpus", "rollout_cpus"):
            v = getattr(self, name)
            _check(v is None or (len(v) > 0 and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                                    for c in v)),
                   name, f"{v!r}: give a non-empty list of core numbers, e.g. [1]")
        _check(self.logprob_chunk_tokens is None or self.logprob_chunk_tokens > 0, "logprob_chunk_tokens",
               f"must be > 0 or unset, got {self.logprob_chunk_tokens!r}")


@dataclasses.dataclass(frozen=True)
class EvalSetConfig:
    """One [[eval.sets]] entry: a held-out set scored on its own (logged as eval/<name>/...).

    The field-name keys (prompt_key, answer_key, system_prompt, split) and the reward default to [data]'s.
    """

    name: str = ""  # the set's name in the metrics (eval/<name>/accuracy); unique among the sets
    # a data file or save_to_disk folder, or a list of {path, ...} tables, as [data].eval
    path: str | list[Any] | None = None
    reward: str | None = None  # None: [data].reward
    reward_timeout_s: float | None = None  # None: [data].reward_timeout_s
    prompt_key: str | None = None  # None: [data].prompt_key
    answer_key: str | None = None  # None: [data].answer_key
    system_prompt: str | None = None  # None: [data].system_prompt
    split: str | None = None  # None: [data].split
    limit: int | None = None  # None: [eval] limit

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and bool(self.name) and "/" not in self.name, "name",
               f"{self.name!r}: give each [[eval.sets]] a non-empty name without '/'")
        _check(self.path is not None, "path", f"set {self.name!r} has no path; give a data file or folder")
        _check(self.limit is None or self.limit >= 0, "limit", f"must be >= 0 or unset, got {self.limit!r}")

    def mapping(self, data: DataConfig) -> dict[str, Any]:
        """[data]'s field-name keys with this set's own on top."""
        own = {k: getattr(self, k) for k in ("prompt_key", "answer_key", "system_prompt", "split")
               if getattr(self, k) is not None}
        return {**data.mapping(), **own}


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """[eval]: evaluation on held-out sets, before and after each phase and every `every` steps during it.

    The sets: [data].eval (named "eval") and every [[eval.sets]] entry. Per set: greedy accuracy and mean reward
    (one temperature-0 sample per prompt) and, with k > 0, pass@j (the unbiased estimator, for j = 1, 2, 4, ..., k)
    and avg@k (mean correctness) over k samples per prompt at `temperature`, seeded from the run's seed.
    """

    every: int = 0  # evaluate every N steps of each phase, after the weight sync (0: before and after the phases only)
    sets: tuple[Any, ...] = ()  # [[eval.sets]] tables (EvalSetConfig): more held-out sets besides [data].eval
    max_new_tokens: int | None = None  # None: [rl.rollout] max_new_tokens
    limit: int = 0  # evaluate the first `limit` prompts of each set (0: all of them)
    max_reward: float = 1.0  # a sample is correct when its reward reaches this (unless the reward says "correct")
    k: int = 0  # sampled answers per prompt for pass@k / avg@k (0: greedy only)
    temperature: float = 1.0  # the sampled answers' temperature (eval only; training keeps [rl.rollout]'s)
    seed: int = 0  # the sampled answers' seeds derive from it (from a run file: the run's seed unless set here)

    def __post_init__(self) -> None:
        _check(self.max_new_tokens is None or self.max_new_tokens > 0, "max_new_tokens",
               f"must be > 0 or unset, got {self.max_new_tokens!r}")
        _non_negative(self, "limit", "every", "k")
        _check(0 < self.temperature < math.inf, "temperature",
               f"must be > 0 and finite (greedy is always measured), got {self.temperature}")
        sets = tuple(s if isinstance(s, EvalSetConfig) else config_from_dict(EvalSetConfig, s, "eval.sets")
                     for s in self.sets)
        names = [s.name for s in sets]
        _check(len(set(names)) == len(names) and "eval" not in names, "sets",
               f"set names {names} must be unique and not \"eval\" ([data].eval's)")
        object.__setattr__(self, "sets", sets)


LOGGING_BACKENDS = ("jsonl", "tensorboard", "wandb")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """[logging]: where a run's metrics go, and which steps' rollouts are written out for inspection.

    Every backend gets every metric with its step; the run's config is recorded once per backend. JSONL:
    <phase output_dir>/metrics.jsonl (always written). TensorBoard: <output_dir>/tensorboard/<phase>. Weights &
    Biases: <output_dir>/wandb, offline unless an API key is configured (WANDB_MODE, when set, decides).
    """

    backends: tuple[str, ...] = ("jsonl",)  # any of "jsonl", "tensorboard", "wandb"
    project: str = "rlkernels"  # the W&B project
    run_name: str | None = None  # the W&B run / TensorBoard run name (None: the run's name)
    rollouts_every: int = 0  # write every N-th RL step's samples to <rl output_dir>/rollouts/ (0: never)
    table_rows: int = 3  # samples per rollout table sent to backends that show tables (best, median, worst reward)
    # [first, last]: trace those steps of each training phase with torch.profiler into <phase output_dir>/profile/
    # (a Chrome trace and the ops by self CPU / CUDA time; trainer/profiling.py); [] (the default): none
    profile_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        steps = self.profile_steps
        _check(steps == () or (len(steps) == 2 and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                               and 1 <= steps[0] <= steps[1]), "profile_steps",
               f"{list(steps)}: give [first, last], two steps with 1 <= first <= last (e.g. [10, 12]), or [] for none")
        bad = [b for b in self.backends if b not in LOGGING_BACKENDS]
        _check(not bad, "backends", f"{bad}: choose from {LOGGING_BACKENDS}")
        _check("jsonl" in self.backends, "backends",
               f"{list(self.backends)}: keep \"jsonl\" (the plot, the summary and --resume read metrics.jsonl)")
        _non_negative(self, "rollouts_every", "table_rows")


REWARD_NORMALIZE = ("none", "batch")


def _http_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


@dataclasses.dataclass(frozen=True)
class RewardSourceConfig:
    """One [rewards] sources entry: the keys every kind has. Its `kind` chooses its class, one per kind
    (REWARD_SOURCE_CONFIGS: RuleSourceConfig, ModelSourceConfig, JudgeSourceConfig), which holds that kind's keys;
    `reward_source_config` builds one from a TOML table, and a key of another kind is an error that names it."""

    kind: str = "rule"  # "rule" (a reward function), "model" (a reward model) or "judge" (an LLM judge)
    weight: float = 1.0  # its factor in the combined reward: the sum over sources of weight x (normalised) score
    label: str | None = None  # its metrics' name, reward/<label>_mean (None: a rule's function name, else kind + index)

    def __post_init__(self) -> None:
        cls = REWARD_SOURCE_CONFIGS.get(self.kind)
        _check(cls is not None, f"kind = {self.kind!r}", f"choose one of {tuple(REWARD_SOURCE_CONFIGS)}")
        _check(type(self) is cls, f"kind = {self.kind!r}",
               f"build this source as a {cls.__name__} (trainer.config.reward_source_config picks the class of a "
               f"table's kind)")
        w = self.weight
        _check(not isinstance(w, bool) and isinstance(w, int | float) and w == w and abs(w) != float("inf"),
               f"weight = {w!r}", "a finite number (its factor in the combined reward)")
        _check(self.label is None or (isinstance(self.label, str) and bool(self.label) and "/" not in self.label),
               f"label = {self.label!r}", "a non-empty name without '/' (the metric is reward/<label>_mean)")

    def files(self) -> dict[str, str | None]:
        """{key: value} of the keys that name files or folders the source reads (trainer.run_folder keeps them)."""
        return {}

    def functions(self) -> dict[str, str | None]:
        """{key: value} of the keys that name functions ("module:function" or "file.py:function")."""
        return {}


# kind -> its config class, filled by @reward_source_kind; trainer.rewards.sources.SOURCE_KINDS holds what
# each kind does (build, check, describe) under the same names.
REWARD_SOURCE_CONFIGS: dict[str, type[RewardSourceConfig]] = {}


def reward_source_kind(cls: type[RewardSourceConfig]) -> type[RewardSourceConfig]:
    """Register a RewardSourceConfig subclass under its kind (the default of its `kind` field)."""
    kind = cls.__dataclass_fields__["kind"].default
    assert kind not in REWARD_SOURCE_CONFIGS, f"reward source kind {kind!r} registered twice"
    REWARD_SOURCE_CONFIGS[kind] = cls
    return cls


@reward_source_kind
@dataclasses.dataclass(frozen=True)
class RuleSourceConfig(RewardSourceConfig):
    """kind = "rule": a reward function of one sample, scored inside the rollout as each group finishes (bounded by
    [data] reward_timeout_s)."""

    kind: str = "rule"  # the kind these keys belong to
    name: str | None = None  # rule: a built-in reward or "module:function" (None: [data].reward)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.name is None or (isinstance(self.name, str) and bool(self.name)), f"name = {self.name!r}",
               "a built-in reward name (\"arithmetic\", \"gsm8k\", ...) or \"module:function\"")

    def functions(self) -> dict[str, str | None]:
        return {"name": self.name}


@reward_source_kind
@dataclasses.dataclass(frozen=True)
class ModelSourceConfig(RewardSourceConfig):
    """kind = "model": a reward model (a sequence classifier with one output) scoring each batch after generation,
    in the trainer's process (`path`) or through a scoring server (`url`: python -m trainer.rewards.server)."""

    kind: str = "model"  # the kind these keys belong to
    # model: the reward model's folder (an AutoModelForSequenceClassification with one output, saved with its tokenizer
    # and chat template), loaded in the trainer's process
    path: str | None = None
    url: str | None = None  # model: the http(s):// address of a scoring server that holds the model (instead of path)
    api_key_file: str | None = None  # model url: a file whose first line is the server's API key
    timeout_s: float = 120.0  # model url: one request's limit in seconds
    batch_size: int = 16  # model: samples per forward (sorted by length)
    chat: bool = True  # model: score the conversation in the model's chat template (false: prompt + completion text)
    max_length: int | None = None  # model: a longer rendering keeps its last max_length tokens (None: all of them)

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "timeout_s")
        _check((self.path is None) != (self.url is None), "path and url",
               "give a model source one of them: path (a reward-model folder, scored in the trainer's process) or "
               "url (a scoring server that holds the model: python -m trainer.rewards.server)")
        _check(self.url is None or _http_url(self.url), f"url = {self.url!r}", "give an http(s):// address")
        _positive(self, "batch_size")
        _check(self.max_length is None or self.max_length > 0, f"max_length = {self.max_length!r}",
               "must be > 0, or unset to keep every token")

    def files(self) -> dict[str, str | None]:
        return {"path": self.path, "api_key_file": self.api_key_file}


@reward_source_kind
@dataclasses.dataclass(frozen=True)
class JudgeSourceConfig(RewardSourceConfig):
    """kind = "judge": an LLM judge scoring each batch after generation, one batched generate call to its engine
    (trainer.rewards.judge); its answer is parsed into a score."""

    kind: str = "judge"  # the kind these keys belong to
    # judge: the http(s):// address of the engine serving it (the SGLang protocol: an SGLang or embedded engine; None:
    # the run's first engine, i.e. the policy judges itself)
    engine: str | None = None
    path: str | None = None  # judge: the judge model's folder, for its tokenizer and chat template (None: the run's)
    api_key_file: str | None = None  # judge engine: a file whose first line is the server's API key
    timeout_s: float = 120.0  # judge engine: one request's limit in seconds
    template: str | None = None  # judge: its prompt, a str.format text with {prompt}, {response} and {answer}
    parser: str = "score"  # judge: "score" (first number), "yes_no" or "module:function" (text -> number or None)
    max_new_tokens: int = 64  # judge: the judge's answer limit (it answers greedily)
    min_score: float | None = None  # judge: the "score" parser clamps below at this (None: no bound)
    max_score: float | None = None  # judge: the "score" parser clamps above at this (None: no bound)
    system: str | None = None  # judge: a system turn before the judge's prompt

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "timeout_s")
        _check(self.engine is None or _http_url(self.engine), f"engine = {self.engine!r}",
               "give the judge engine's http(s):// address, or leave it out to use the run's first engine")
        _check(isinstance(self.template, str), "template",
               "a judge source needs its prompt, e.g. template = \"Question: {prompt}\\nAnswer: {response}\\n"
               "Is the answer correct? Reply yes or no.\" with parser = \"yes_no\"")
        self.judge_config()  # the template's fields, the parser's name, the score bounds

    def files(self) -> dict[str, str | None]:
        return {"path": self.path, "api_key_file": self.api_key_file}

    def functions(self) -> dict[str, str | None]:
        return {"parser": self.parser}

    def judge_config(self) -> Any:
        """The trainer.rewards.judge.JudgeConfig of a judge source (its own checks run there)."""
        from trainer.rewards.judge import JudgeConfig

        return JudgeConfig(template=self.template, parser=self.parser, min_score=self.min_score,
                           max_score=self.max_score, max_new_tokens=self.max_new_tokens, system=self.system)


def reward_source_config(table: Any, where: str) -> RewardSourceConfig:
    """A [rewards] sources entry from its TOML table (a built config passes through): the class of its `kind`, a key
    that belongs to other kinds named with them, any other unknown key named by config_from_dict."""
    if isinstance(table, RewardSourceConfig):
        return table
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{where}]: expected a table of keys, e.g. {{kind = \"rule\", name = \"arithmetic\"}}, "
                          f"got {type(table).__name__} {table!r}")
    kind = table.get("kind", "rule")
    kinds = tuple(REWARD_SOURCE_CONFIGS)
    if kind not in REWARD_SOURCE_CONFIGS:
        raise ConfigError(f"[{where}] kind = {kind!r}: choose one of {kinds}")
    cls = REWARD_SOURCE_CONFIGS[kind]
    own, kept = {f.name for f in dataclasses.fields(cls)}, {}
    for key, value in table.items():
        owners = {k: c.__dataclass_fields__[key].default for k, c in REWARD_SOURCE_CONFIGS.items()
                  if key not in own and key in c.__dataclass_fields__}
        # A key of another kind at that kind's default is no choice (a config.toml written before the classes were
        # one per kind held every key of every kind); set to anything else it is an error.
        if owners and any(value != default for default in owners.values()):
            raise ConfigError(f"[{where}] {key}: a key of {' and '.join(repr(o) for o in owners)} sources, and this "
                              f"one is kind = {kind!r}; drop {key}, or change kind")
        if not owners:
            kept[key] = value
    return config_from_dict(cls, kept, where)


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    """[rewards]: the RL reward as a weighted sum of sources (rules, reward models, LLM judges).

    No sources (the default): [data].reward alone, as before. With sources, each sample's reward is the sum over
    sources of weight x score, where with normalize = "batch" every source's scores are first z-scored over the
    batch's scored samples: (score - mean) / std, population statistics computed exactly; a source whose scores are
    all equal in the batch (std 0) gives 0 to every sample. A sample on which any source fails is FAILED (left out of
    the loss, counted). Evaluation keeps [data].reward (the held-out truth).
    """

    # {kind, weight, ...} tables (RuleSourceConfig, ModelSourceConfig, JudgeSourceConfig by kind); empty: [data].reward
    # alone
    sources: tuple[Any, ...] = ()
    normalize: str = "none"  # "none", or "batch": z-score each source's scores over the batch before the weighted sum

    def __post_init__(self) -> None:
        _check(isinstance(self.sources, tuple | list), f"sources = {self.sources!r}",
               "a list of tables, e.g. sources = [{kind = \"model\", path = \"runs/rm\"}]")
        sources = tuple(reward_source_config(s, f"rewards.sources[{i}]") for i, s in enumerate(self.sources))
        object.__setattr__(self, "sources", sources)
        _check(self.normalize in REWARD_NORMALIZE, f"normalize = {self.normalize!r}",
               f"choose one of {REWARD_NORMALIZE}")
        labels = [s.label for s in sources if s.label is not None]
        _check(len(set(labels)) == len(labels), "sources", f"labels {labels} must be unique (each names a metric)")


@dataclasses.dataclass(frozen=True)
class ServeModelConfig:
    """One [serve] models entry: a base model the Tinker service offers (training clients and samplers on it)."""

    name: str = ""  # the name clients ask for (base_model= in the tinker SDK)
    path: str = ""  # its Hugging Face folder (config.json, weights, tokenizer)

    def __post_init__(self) -> None:
        for key in ("name", "path"):
            v = getattr(self, key)
            _check(isinstance(v, str) and v != "", f"{key} = {v!r}",
                   "a non-empty string: models = [{name = \"tiny\", path = \"<HF folder>\"}]")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """[serve]: `python -m trainer serve`, the Tinker API over this project's LoRA backend and embedded engine
    (trainer/serve/app.py). Only that mode reads it; it also reads the top-level seed, [trainer] param_dtype and
    logprob_chunk_tokens, and [engines] (one in-process engine: fleet, threads, prefix_cache_tokens,
    speculative_tokens, dtype), and refuses any other key."""

    host: str = "127.0.0.1"  # the address it listens on; a non-loopback host needs an api_key
    port: int = 8000  # its TCP port (0: any free one; the line "serving on http://HOST:PORT" names it)
    # The key clients send (X-API-Key; the tinker SDK wants it to start with "tml-"). Unset: the environment variable
    # RLKERNELS_API_KEY; neither: no key (loopback only)
    api_key: str | None = None
    output_dir: str = "tinker_out"  # checkpoints: tinker://<model_id>/<weights | sampler_weights>/<name> live under it
    max_clients: int = 8  # training clients (LoRA adapters) at once, over all base models
    device: str = "cpu"  # where the base models train and sample: "cpu", "cuda" or "cuda:N"
    models: tuple[Any, ...] = ()  # the base models offered: [{name = "...", path = "<HF folder>"}, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_key", self.api_key or None)
        _check(isinstance(self.host, str) and self.host != "", f"host = {self.host!r}",
               "an address to listen on, e.g. \"127.0.0.1\" (or \"0.0.0.0\" with an api_key)")
        port = self.port
        _check(isinstance(port, int) and not isinstance(port, bool) and 0 <= port < 65536, f"port = {port!r}",
               "a TCP port in [0, 65535] (0: any free one)")
        n = self.max_clients
        _check(isinstance(n, int) and not isinstance(n, bool) and n >= 1, f"max_clients = {n!r}", "an integer >= 1")
        _check(isinstance(self.output_dir, str) and self.output_dir != "", f"output_dir = {self.output_dir!r}",
               "a folder for the checkpoints")
        d = self.device
        _check(isinstance(d, str) and (d == "cpu" or d == "cuda" or d.startswith("cuda:")), f"device = {d!r}",
               "\"cpu\", \"cuda\" or \"cuda:N\"")
        _check(isinstance(self.models, tuple | list) and all(isinstance(m, Mapping | ServeModelConfig)
                                                             for m in self.models), f"models = {self.models!r}",
               "a list of tables: models = [{name = \"tiny\", path = \"<HF folder>\"}]")
        models = tuple(m if isinstance(m, ServeModelConfig) else
                       config_from_dict(ServeModelConfig, m, f"serve.models[{i}]") for i, m in enumerate(self.models))
        names = [m.name for m in models]
        _check(len(set(names)) == len(names), "models", f"names {names} must be unique (clients ask by name)")
        object.__setattr__(self, "models", models)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run file (configs/*.toml): one table per section, each a config above.

    Derived here, not copied: each phase writes under <output_dir>/<phase> (its own output_dir is replaced), and
    the rollouts use the chat template exactly when [data].format = "chat". The run's seed reaches the SFT and RL
    trainers and the rollout sampling through config_from_dict (a section that sets its own `seed` keeps it, and
    passes it down), and the data order and the preset's initial weights directly.
    """

    name: str = "run"  # the run's name (the CLI's default: the config file's stem)
    output_dir: str = ""  # everything the run writes ("": runs/<name>)
    seed: int = 0  # the run's seed: trainers, rollout sampling, data order, engines, the preset's weights
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)  # [model]
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # [data]
    engines: EnginesConfig = dataclasses.field(default_factory=EnginesConfig)  # [engines]
    sft: SFTTrainingConfig = dataclasses.field(default_factory=SFTTrainingConfig)  # [sft], [sft.optim]
    rl: RLTrainingConfig = dataclasses.field(default_factory=RLTrainingConfig)  # [rl], [rl.optim/loss/rollout]
    trainer: BackendConfig = dataclasses.field(default_factory=BackendConfig)  # [trainer]
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)  # [eval], [[eval.sets]]
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)  # [logging]
    rewards: RewardsConfig = dataclasses.field(default_factory=RewardsConfig)  # [rewards]
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)  # [serve]: python -m trainer serve only

    def __post_init__(self) -> None:
        hints = _hints(RunConfig)
        for f in dataclasses.fields(self):
            section = hints[f.name]
            if dataclasses.is_dataclass(section) and not isinstance(getattr(self, f.name), section):
                raise ValueError(f"{f.name}: expected a {section.__name__}, got {type(getattr(self, f.name)).__name__}"
                                 f" (build a run config from its tables with config_from_dict(RunConfig, table))")
        _check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed", f"an int, got {self.seed!r}")
        if not self.output_dir:
            object.__setattr__(self, "output_dir", f"runs/{self.name}")
        out = Path(self.output_dir)
        object.__setattr__(self, "sft", dataclasses.replace(self.sft, output_dir=str(out / "sft")))
        rollout = dataclasses.replace(self.rl.rollout, apply_chat_template=self.data.format == "chat")
        object.__setattr__(self, "rl", dataclasses.replace(self.rl, output_dir=str(out / "rl"), rollout=rollout))
        if self.trainer.backend == "tinker":
            check_remote_rl(self.rl)
            object.__setattr__(self, "engines", _remote_fleet(self.engines, self.trainer.base_url))


def _remote_fleet(engines: EnginesConfig, base_url: str) -> EnginesConfig:
    """[trainer] backend = "tinker": the rollouts sample the server's weights, so every engine is of kind "tinker";
    the default fleet (one embedded engine the run starts) becomes one "tinker" engine at base_url."""
    if engines.fleet == (EngineSpec("embedded"),):
        return dataclasses.replace(engines, fleet=(EngineSpec("tinker", url=base_url),))
    others = sorted({s.kind for s in engines.fleet if s.kind != "tinker"})
    _check(not others, "[engines] fleet", f"kinds {others}: with [trainer] backend = \"tinker\" the rollouts sample "
           f"the server's weights: give kind = \"tinker\" engines at its URL, or leave [engines] fleet out (one at "
           f"[trainer] base_url)")
    return engines


def check_remote_rl(rl: RLTrainingConfig) -> None:
    """[trainer] backend = "tinker": what a Tinker-API server trains is LoRA adapters (its rank, alpha 32, no
    dropout, attention and MLP linears) with Tinker's ppo / cispo losses on per-token advantages and AdamW; every
    [rl] choice outside that is refused here, naming its key, before any work (trainer/backend/remote.py)."""
    why = "the Tinker API cannot do this: [trainer] backend = \"tinker\" trains"
    lora, loss = rl.lora, rl.loss
    _check(lora is not None, "[rl.lora]", f"absent: full fine-tuning; {why} LoRA adapters only: add [rl.lora] rank")
    _check(lora.alpha == 32.0 and lora.dropout == 0.0 and lora.target_modules == LORA_ALL_LINEAR,
           "[rl.lora] alpha / dropout / target_modules", f"{why} alpha 32, dropout 0, \"{LORA_ALL_LINEAR}\"")
    _check(not lora.train_unembed, "[rl.lora] train_unembed", f"{why} adapters, not the lm_head in full")
    _check(not rl.estimator.needs_critic, "advantage_estimator", f"{rl.advantage_estimator!r} needs a critic; {why} "
           f"the policy only")
    _check(loss.objective in ("ppo", "cispo"), "[rl.loss] objective", f"{loss.objective!r}; {why} ppo or cispo")
    _check(loss.kl_coef == 0, "[rl.loss] kl_coef", f"{why} no KL reference: set kl_coef = 0")
    _check(loss.entropy_coef == 0, "[rl.loss] entropy_coef", f"{why} no entropy bonus: set entropy_coef = 0")
    _check(loss.clip_ratio_c is None, "[rl.loss] clip_ratio_c", f"{why} no dual clip")
    _check(loss.rollout_correction != "mis", "[rl.loss] rollout_correction", f"\"mis\"; {why} a ratio to the "
           f"sampler's log-probs in the loss itself (\"none\" or \"tis\")")
    _check(not rl.verify_sync, "verify_sync", "the weights stay on the server: set verify_sync = false")
    _check(rl.rollout_worker == "thread", "rollout_worker", "the \"tinker\" engine samples in this process: "
           "set rollout_worker = \"thread\"")


# ----------------------------------------------------------------------------------------------- from tables
# Keys that moved: the dotted path where a config used to take it -> where it goes now (the message names both).
MOVED: dict[str, str] = {
    **{f"{phase}.{f.name}": f"[{phase}.optim] {f.name}" for phase in ("sft", "rl")
       for f in dataclasses.fields(OptimConfig)},
    **{f"rl.{f.name}": f"[rl.loss] {f.name}" for f in dataclasses.fields(PolicyLossConfig)},
    "trainer.temperature": "[rl.rollout] temperature (the trainer's log-probs use the rollout's)",
    "trainer.policy_loss": "[rl.loss]",
    "trainer.lr": "[sft.optim] / [rl.optim] lr",
    "trainer.eps": "[sft.optim] / [rl.optim] eps",
    "rl.rollout.max_staleness": "[rl] max_staleness (the one staleness bound: async depth and cached samples)",
    "engines.urls": "[engines] fleet, one table per server: fleet = [{url = \"http://host:30000\", kind = "
                    "\"sglang\"}]",
    "engines.embedded": "[engines] fleet, one table per engine the run starts: fleet = [{kind = \"embedded\"}, "
                        "...]",
}
# Fields a nested table takes from its enclosing table when it does not set them: the run's seed reaches [sft],
# [rl] and through [rl] (or its own seed) [rl.rollout].
INHERITED = ("seed",)


class ConfigError(ValueError):
    """A run config is invalid; the message names the key and its table (the CLI prints it and exits 2)."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section(tp: Any) -> type | None:
    """The config dataclass a field holds as a sub-table (not an optional one: that stays as given)."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _is_tuple(tp: Any) -> bool:
    """A tuple type, or a union with one (`tuple[str, ...] | None`): a TOML array becomes a tuple there."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_tuple(arg) for arg in typing.get_args(tp))
    return tp is tuple or typing.get_origin(tp) is tuple


def _table(where: str) -> str:
    return f"[{where}]" if where else "the top level"


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _check_scalar(tp: Any, value: Any, path: str) -> None:
    """A TOML value against a field typed with scalars only (`int`, `float | None`, ...): `num_steps = "abc"` or
    `2.5` is an error here, not a TypeError mid-run. An int is a float; a bool is neither an int nor a float."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    scalars = [a for a in args if a is not type(None)]
    if not scalars or any(a not in _SCALARS for a in scalars):
        return  # tables, arrays, Any: their own checks
    if isinstance(value, float) and value != value:  # NaN: no key means anything by it (inf may: value_clip)
        raise ConfigError(f"{path} = nan: a finite number is expected")
    for a in scalars:
        if a is bool and isinstance(value, bool):
            return
        if a is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if a is float and isinstance(value, int | float) and not isinstance(value, bool):
            return
        if a is str and isinstance(value, str):
            return
    raise ConfigError(f"{path} = {value!r}: expected {' or '.join(_SCALARS[a] for a in scalars)}")


def _check_array(tp: Any, value: Any, path: str) -> None:
    """A TOML value against a tuple-typed field (`tuple[int, ...]`, `tuple[str, ...] | None`): an array, and each
    element of the element type where that is a scalar. Without this, `stop_token_ids = 5` was a TypeError mid-run
    and `backends = "jsonl"` became the string's characters (tuple("jsonl"))."""
    if not _is_tuple(tp):
        return
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if value is None and type(None) in args:
        return
    items = typing.get_args(next(a for a in args if _is_tuple(a)))  # (X, ...) or (X, Y) or () for a bare tuple
    if not isinstance(value, list | tuple):
        name, scalar = path.rsplit(".", 1)[-1], isinstance(value, str | int | float)
        if items[:1] == (Any,):  # tables (fleet, sources) or names (tools): the key's own class knows which
            example = f"; a list of tables (e.g. {name} = [{{...}}]) or of names (e.g. {name} = [...])"
        else:
            example = f", e.g. {name} = [{json.dumps(value)}]" if scalar else ""
        raise ConfigError(f"{path} = {value!r}: expected an array{example}")
    if not items:
        return
    if items[-1] is not Ellipsis and len(value) != len(items):
        raise ConfigError(f"{path} = {list(value)!r}: expected an array of {len(items)} values")
    for i, v in enumerate(value):
        _check_scalar(items[0] if items[-1] is Ellipsis else items[i], v, f"{path}[{i}]")


def check_value(tp: Any, value: Any, path: str) -> None:
    """A TOML value against a field's type hint `tp` (scalars and arrays of scalars; tables and Any are checked where
    they are built); a ConfigError names `path` otherwise."""
    _check_scalar(tp, value, path)
    _check_array(tp, value, path)


def config_from_dict(cls: type, values: Mapping[str, Any], where: str | None = None, *,
                     inherited: Mapping[str, Any] | None = None) -> Any:
    """Build a config dataclass (any node of the RunConfig tree) from a TOML table.

    The known keys are the dataclass's fields; a sub-table of a nested config dataclass is built the same way (an
    absent one from {} so that INHERITED fields reach it); lists become tuples where the field is a tuple. A key
    that moved (MOVED, by dotted path) says where it went; any other unknown key is named with the known ones.
    `where` is the table's dotted name in messages ("rl.rollout"; "" for the top level; default the class name).
    `inherited` holds the enclosing tables' INHERITED values. Errors are ConfigErrors naming the table.
    """
    where = cls.__name__ if where is None else where
    if not isinstance(values, Mapping):
        raise ConfigError(f"{_table(where)}: expected a table of keys, got {type(values).__name__} {values!r}")
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in values:
        path = f"{where}.{key}" if where else key
        if path in MOVED:  # a key that moved (one may remain a field: set from its new place, never from here)
            raise ConfigError(f"{path} moved to {MOVED[path]}")
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown} {'in ' + _table(where) if where else 'at the top level'}; "
                          f"known: {sorted(names)}")
    hints = _hints(cls)
    for key, value in values.items():
        check_value(hints[key], value, f"{where}.{key}" if where else key)
    kwargs = dict(values)
    for name in INHERITED:
        if name in names and name not in kwargs and inherited and name in inherited:
            kwargs[name] = inherited[name]
    scope = {**(inherited or {}), **{n: kwargs[n] for n in INHERITED if n in kwargs}}
    for name in names:
        sub = _section(hints[name])
        value = kwargs.get(name)
        if sub is not None and (isinstance(value, Mapping) or name not in kwargs):
            kwargs[name] = config_from_dict(sub, value or {}, f"{where}.{name}" if where else name, inherited=scope)
        elif isinstance(value, list) and _is_tuple(hints[name]):
            kwargs[name] = tuple(value)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise (ConfigError(f"[{where}] {e}") if where else ConfigError(str(e))) from e
