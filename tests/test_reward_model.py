"""Reward-model scoring (trainer/rewards/model.py) against a plain transformers forward of the same folder,
one sample at a time without padding; batching and sorting must never mix samples up."""

import random
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from engines.tiny import CHARS, build_tokenizer, tiny_model_config
from trainer.rewards.model import RewardModelScorer, load_reward_model, score_samples
from trainer.types import Sample


def write_reward_model(folder, *, num_labels=1, pad_token_id=0, seed=0):
    """A tiny LlamaForSequenceClassification and the project tokenizer (chat template included), written by
    transformers' save_pretrained. The score head is drawn at unit scale so scores differ by O(1) between samples
    (transformers' 0.02 init would leave them all near 0)."""
    config = tiny_model_config("llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    config.num_labels = num_labels
    config.pad_token_id = pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    return write_reward_model(tmp_path_factory.mktemp("rm"))


def random_pairs(seed, n=21):
    rng = random.Random(seed)
    text = lambda lo, hi: "".join(rng.choice(CHARS) for _ in range(rng.randint(lo, hi)))
    return [text(1, 30) for _ in range(n)], [text(0, 25) for _ in range(n)]


def plain_scores(folder, prompts, completions, systems=None):
    """Stock transformers, one sample per forward, no padding: the conversation rendered to text by the folder's
    chat template, then tokenized."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        system = systems[i] if systems else None
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": p}, {"role": "assistant", "content": c}]
        text = tok.apply_chat_template(messages, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return out


def assert_scores_close(got, want, tol=1e-5):
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= tol, f"largest difference {worst:.3g}"


def test_scores_equal_a_plain_transformers_forward_at_every_batch_size(rm_folder):
    prompts, completions = random_pairs(0)
    model, tok = load_reward_model(rm_folder)
    want = plain_scores(rm_folder, prompts, completions)
    # The scores differ from sample to sample by far more than the tolerance: a mix-up cannot hide.
    assert min(abs(a - b) for i, a in enumerate(want) for b in want[:i]) > 1e-3
    for batch_size in (1, 3, 16, 64):
        assert_scores_close(score_samples(model, tok, prompts, completions, batch_size=batch_size), want)


def test_shuffled_inputs_give_each_sample_its_own_score(rm_folder):
    prompts, completions = random_pairs(1)
    model, tok = load_reward_model(rm_folder)
    base = score_samples(model, tok, prompts, completions, batch_size=4)
    for seed in range(3):
        perm = list(range(len(prompts)))
        random.Random(seed).shuffle(perm)
        shuffled = score_samples(model, tok, [prompts[i] for i in perm], [completions[i] for i in perm], batch_size=4)
        assert_scores_close(shuffled, [base[i] for i in perm])


def test_scorer_on_samples_uses_system_prompt_and_cuts_end_markers(rm_folder):
    prompts, completions = random_pairs(2, n=7)
    systems = [None, "Be brief.", None, "You grade.", None, None, "x"]
    samples = [Sample(prompt=p, tokens=(1, 2, 3), response=c + "<|im_end|>", response_length=1, index=i,
                      metadata={"system_prompt": s} if s else {})
               for i, (p, c, s) in enumerate(zip(prompts, completions, systems))]
    scorer = RewardModelScorer.from_pretrained(rm_folder, batch_size=3)
    assert_scores_close(scorer(samples), plain_scores(rm_folder, prompts, completions, systems))


def test_max_length_keeps_the_last_tokens(rm_folder):
    prompts, completions = ["a long prompt " * 4, "short"], ["the answer is 42", "7"]
    model, tok = load_reward_model(rm_folder)
    with pytest.warns(UserWarning, match="1 of 2 samples are longer than max_length=40"):
        got = score_samples(model, tok, prompts, completions, max_length=40)
    ref = AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompts[0]},
                                   {"role": "assistant", "content": completions[0]}], tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"][-40:]
    with torch.no_grad():
        assert abs(got[0] - float(ref(input_ids=torch.tensor([ids])).logits[0, 0])) <= 1e-5
    assert_scores_close(got[1:], plain_scores(rm_folder, prompts[1:], completions[1:]))


def test_plain_text_scoring_without_chat(rm_folder):
    model, tok = load_reward_model(rm_folder)
    got = score_samples(model, tok, ["12+3=", "7*8="], ["15", "54"], chat=False)
    with torch.no_grad():
        want = [float(model(input_ids=torch.tensor([tok(t)["input_ids"]])).logits[0, 0]) for t in ("12+3=15", "7*8=54")]
    assert_scores_close(got, want)
    tok_no_template = build_tokenizer()
    tok_no_template.chat_template = None
    with pytest.raises(ValueError, match="has no chat template.*chat=False"):
        score_samples(model, tok_no_template, ["a"], ["b"])


def test_missing_pad_token_id_is_set_and_said(tmp_path):
    folder = write_reward_model(tmp_path / "nopad", pad_token_id=None, seed=1)
    with pytest.warns(UserWarning, match="no pad_token_id; using the tokenizer's pad id 0"):
        model, tok = load_reward_model(folder)
    assert model.config.pad_token_id == 0
    prompts, completions = random_pairs(3, n=9)
    # Stock transformers reads the last token of an unpadded single sample when pad_token_id is None.
    assert_scores_close(score_samples(model, tok, prompts, completions, batch_size=4),
                        plain_scores(folder, prompts, completions))


def test_folders_that_are_not_one_output_classifiers_are_refused(tmp_path):
    two = write_reward_model(tmp_path / "two_labels", num_labels=2)
    with pytest.raises(ValueError, match=f"{two}.*num_labels=2.*num_labels=1"):
        load_reward_model(two)
    lm = tmp_path / "causal_lm"
    AutoModelForCausalLM.from_config(tiny_model_config("llama", hidden_size=32)).save_pretrained(lm)
    build_tokenizer().save_pretrained(lm)
    with pytest.raises(ValueError, match="LlamaForCausalLM.*not a sequence classifier"):
        load_reward_model(lm)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_reward_model(tmp_path / "nowhere")
    model, tok = load_reward_model(write_reward_model(tmp_path / "ok"))
    with pytest.raises(ValueError, match="3 prompts but 2 completions"):
        score_samples(model, tok, ["a", "b", "c"], ["x", "y"])
    model.train()
    with warnings.catch_warnings(), pytest.raises(ValueError, match="call model.eval"):
        score_samples(model, tok, ["a"], ["x"])
