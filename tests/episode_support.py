"""Helpers of the multi-turn episode tests (imported as a plain module: pytest puts tests/ on sys.path).

`Recording` wraps a real engine and records every generate call (prompt tokens and completions), so a test can
check a sample's tokens against what the engine really returned, independently of the code that built the sample.
`Talk` is an environment written as a user would write it: no import from the project, dict steps. `Scripted` is an
engine stand-in that answers with chosen texts.
"""

from __future__ import annotations

import torch
import trio

from engines.protocol import Completion
from engines.tiny import IM_END, SPECIAL_TOKENS, build_tokenizer
from trainer.data.buffer import DataBuffer, Prompt

TOK = build_tokenizer()
IM_END_ID = SPECIAL_TOKENS.index(IM_END)

# Every character id of the tiny tokenizer stops a turn: a random model's turns then end after one token with
# finish "stop", so episodes run their full number of turns instead of ending at the length limit.
CHAR_STOPS = tuple(range(6, 288))
# What the tiny chat template writes for a user message after an assistant turn, through the next generation
# prompt: the glue "\n" after the turn, the message, the assistant header (written out here by hand, not by the
# code under test).
AGAIN = "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


class Recording:
    """An engine wrapper that records (prompt, completion) of every generated row."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.calls: list[tuple[tuple[int, ...], Completion]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompts, params, *, rids=None):
        out = await self._engine.generate(prompts, params, rids=rids)
        for prompt, group in zip(prompts, out):
            self.calls.extend((tuple(prompt), c) for c in group)
        return out


class Scripted:
    """Engine stand-in: `reply(prompt_text) -> str` chooses each turn's text; it ends with <|im_end|> (finish
    "stop", or "length" cut at max_new_tokens); log-prob -0.5 per token. `hold(prompt_text)` True makes the request
    wait until `abort()`, then return nothing with finish "abort"."""

    url = "scripted://"

    def __init__(self, reply, hold=lambda text: False) -> None:
        self.reply, self.hold = reply, hold
        self.aborted = False
        self.prompts: list[str] = []

    async def generate(self, prompts, params, *, rids=None):
        out = []
        for p in prompts:
            text = TOK.decode(list(p))
            self.prompts.append(text)
            if self.hold(text) and not self.aborted:
                while not self.aborted:
                    await trio.sleep(0.01)
                out.append([Completion([], [], "abort", 0, list(p))] * params.n)
                continue
            ids = TOK.encode(self.reply(text)) + [IM_END_ID]
            finish = "stop" if len(ids) <= params.max_new_tokens else "length"
            ids = ids[:params.max_new_tokens]
            out.append([Completion(ids, [-0.5] * len(ids), finish, 0, list(p))] * params.n)
        return out

    async def abort(self, rids=None):
        self.aborted = True

    async def aclose(self):  # engines.protocol.InferenceEngine: nothing pooled
        pass


class Talk:
    """Answers every turn with "again"; done after (sample_index % 3) + 1 turns, so a group's episodes have
    different numbers of turns; reward 1 at the end."""

    def reset(self, prompt, metadata):
        self.left = metadata["sample_index"] % 3 + 1
        return [{"role": "user", "content": prompt}]

    def step(self, message):
        self.left -= 1
        return {"messages": [{"role": "user", "content": "again"}], "reward": 1.0 if self.left == 0 else None,
                "done": self.left == 0}


class AsyncTalk(Talk):
    async def reset(self, prompt, metadata):
        return super().reset(prompt, metadata)

    async def step(self, message):
        return super().step(message)


def arithmetic_buffer(n: int = 2) -> DataBuffer:
    return DataBuffer([Prompt(f"{i}+{i + 1}=", str(2 * i + 1)) for i in range(n)], seed=0)


def check_token_exact(samples, recorded: Recording, tok, model=None, *, tol: float = 1e-5) -> float:
    """Each episode's tokens = the opening prompt + for each turn what the engine returned, then the rendered
    "again" message; loss_mask 1 exactly on the engine's tokens; the engine's log-probs on them; and, with `model`,
    the trainer-side log-probs of those tokens (a float32 forward of the same weights) within `tol`."""
    by_prompt = {}
    for prompt, c in recorded.calls:
        by_prompt.setdefault(prompt, []).append(c)
    worst = 0.0
    again = tok.encode(AGAIN)
    for s in samples:
        turns = s.metadata["turns"]
        assert turns == s.index % 3 + 1
        opening = tok.apply_chat_template([{"role": "user", "content": s.prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
        tokens, mask, lps = list(opening), [], []
        for t in range(turns):
            if t:
                tokens += again
                mask += [0] * len(again)
                lps += [None] * len(again)
            # The engine was asked exactly this prefix and answered with what follows it in the sample (several
            # episodes of a group may share a prefix and an answer: then any of those identical rows).
            matches = [c for c in by_prompt.get(tuple(tokens), ()) if tuple(c.output_ids) in _turns_of(s, len(tokens))]
            assert matches, f"no engine call had the prefix of turn {t + 1} and answered with the sample's tokens"
            c = matches[0]
            tokens += c.output_ids
            mask += [1] * len(c.output_ids)
            lps += list(c.logprobs)
        assert list(s.tokens) == tokens
        assert list(s.loss_mask) == mask and s.prompt_length == len(opening)
        model_lps = [x for x, m in zip(s.rollout_logprobs, mask) if m]
        assert model_lps == [x for x in lps if x is not None]
        assert len(s.metadata["weight_versions"]) == turns
        if model is not None:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([list(s.tokens)])).logits[0].float()
            logp = logits.log_softmax(-1)
            for k, (m, want) in enumerate(zip(mask, s.rollout_logprobs)):
                if m:
                    pos = s.prompt_length + k
                    worst = max(worst, abs(logp[pos - 1, s.tokens[pos]].item() - want))
    assert worst <= tol, f"engine vs trainer log-probs differ by {worst:.2e} > {tol}"
    return worst


def _turns_of(sample, start: int) -> set[tuple[int, ...]]:
    """The possible outputs starting at `start` in the sample: every prefix of what follows (one turn's tokens)."""
    rest = tuple(sample.tokens[start:])
    return {rest[:k] for k in range(1, len(rest) + 1)}
