"""Any tokenizer, any chat template: Qwen2-style and Llama-3-style Hugging Face tokenizer folders, built locally
with the `tokenizers` library (nothing downloaded), through stop tokens, rollouts on the embedded engine and
evaluation.

Stop tokens come from the tokenizer (eos), the model's generation config (eos ids) and the chat template's end of
turn (`<|im_end|>` / `<|eot_id|>`); the pad id from the tokenizer (fallback eos); the Llama-3 folder has no unk
and no pad token. The tiny model's lm_head row of the end-of-turn token is set so that it is by far the most
likely first token of one prompt: a rollout or evaluation that stops on the template's end of turn returns just
that token, one that does not runs on to max_new_tokens.
"""

from __future__ import annotations

import pytest
import torch
import trio
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from engines.embedded.launch import EngineProcess
from engines.sglang import SGLangEngine
from engines.tiny import CHARS, tiny_model_config
from trainer.cli import evaluate
from trainer.config import RolloutConfig
from trainer.data.buffer import DataBuffer, Prompt
from trainer.rollout.manager import AsyncRolloutManager
from trainer.rollout.samples import end_of_turn_ids, prompt_token_ids, stop_token_ids
from trainer.types import Status

QWEN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
STYLES = {
    # specials (ids 0..), tokenizer kwargs, generation-config eos, end-of-turn token
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, ["<|im_end|>", "<|endoftext|>"],
              "<|im_end|>", QWEN_TEMPLATE),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, ["<|end_of_text|>", "<|eot_id|>"],
               "<|eot_id|>", LLAMA3_TEMPLATE),
}
PROMPTS = ["12+7=", "3+40=", "25-9=", "8+8="]


def build_folder(style: str, folder) -> tuple[PreTrainedTokenizerFast, list[int], int]:
    """A tokenizer + tiny Llama folder in `style`; returns (tokenizer, generation-config eos ids, end-of-turn id).
    The end-of-turn logit dominates the first step of PROMPTS[0]."""
    specials, kwargs, gen_eos, eot, template = STYLES[style]
    vocab = {t: i for i, t in enumerate(specials + list(CHARS))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))  # no unk token at all
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)
    fast.chat_template = template
    fast.save_pretrained(folder)
    fast = AutoTokenizer.from_pretrained(folder)
    ids = {t: fast.convert_tokens_to_ids(t) for t in specials}
    config = tiny_model_config("llama")
    config.bos_token_id = fast.bos_token_id
    config.eos_token_id, config.pad_token_id = fast.eos_token_id, fast.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = prompt_token_ids(fast, PROMPTS[0], chat=True)
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
        model.lm_head.weight[ids[eot]] = 60 * h / h.norm() ** 2  # its logit: 60, far above the rest
    model.generation_config = GenerationConfig(eos_token_id=[ids[t] for t in gen_eos], bos_token_id=config.bos_token_id)
    model.save_pretrained(folder)
    return fast, [ids[t] for t in gen_eos], ids[eot]


@pytest.fixture(scope="module", params=sorted(STYLES))
def served(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    tok, gen_eos, eot = build_folder(request.param, folder)
    with EngineProcess(str(folder), device="cpu") as eng:
        yield request.param, folder, tok, gen_eos, eot, eng


def test_stop_tokens_come_from_the_tokenizer_generation_config_and_template(served):
    style, folder, tok, gen_eos, eot, _ = served
    assert end_of_turn_ids(tok) == [eot]
    gc = GenerationConfig.from_pretrained(folder)
    assert stop_token_ids(tok, chat=True, generation_config=gc) == sorted({tok.eos_token_id, eot, *gen_eos})
    assert stop_token_ids(tok, chat=False) == [tok.eos_token_id]
    assert tok.unk_token_id is None
    if style == "llama3":
        assert tok.pad_token_id is None and prompt_token_ids(tok, "1+1=", chat=True)[0] == tok.bos_token_id


def test_rollouts_stop_at_the_templates_end_of_turn(served):
    style, folder, tok, gen_eos, eot, eng = served
    cfg = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=2, max_new_tokens=8, apply_chat_template=True,
                        seed=1)
    manager = AsyncRolloutManager([SGLangEngine(eng.url)], cfg, tokenizer=tok, reward_fn=lambda s: 0.0,
                                  generation_config=GenerationConfig.from_pretrained(folder))
    assert eot in manager.stop_ids and set(gen_eos) <= set(manager.stop_ids)
    buf = DataBuffer([Prompt(prompt=p, answer="0", index=i) for i, p in enumerate(PROMPTS)], seed=0, shuffle=False)

    async def one():
        async with manager:
            return await manager.generate_batch(buf)

    batch = trio.run(one)
    first = [s for s in batch.samples if s.prompt == PROMPTS[0]]
    assert len(first) == 2 and all(s.tokens[s.prompt_length:] == (eot,) and s.status == Status.COMPLETED
                                   for s in first)
    for s in batch.samples:
        resp = s.tokens[s.prompt_length:]
        stops = [i for i, t in enumerate(resp) if t in manager.stop_ids]
        assert stops in ([], [len(resp) - 1])  # a stop token ends the response, none appears before the end
        assert (s.status == Status.COMPLETED) == bool(stops) and len(s.rollout_logprobs) == len(resp)


def test_evaluation_stops_at_the_templates_end_of_turn(served):
    style, folder, tok, gen_eos, eot, eng = served
    seen = {}

    def reward(sample):
        seen[sample.prompt] = sample.tokens[sample.prompt_length:]
        return float(sample.prompt == PROMPTS[0])

    prompts = [Prompt(prompt=p, answer="0", index=i) for i, p in enumerate(PROMPTS)]
    acc = evaluate([SGLangEngine(eng.url)], prompts, tokenizer=tok, reward_fn=reward, max_new_tokens=6, chat=True)
    assert acc == {"reward_mean": 0.25, "accuracy": 0.25, "n": 4, "failed": 0} and seen[PROMPTS[0]] == (eot,)
    for p in PROMPTS[1:]:
        assert len(seen[p]) == 6 or seen[p][-1] in {tok.eos_token_id, eot, *gen_eos}
