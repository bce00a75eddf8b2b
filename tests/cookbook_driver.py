"""tinker-cookbook's supervised.train, unmodified, against `python -m trainer serve` (tests/test_tinker_service.py).

argv: base_url, model name (the server's name for it: an HF folder, which the cookbook's get_tokenizer loads), log
dir. A small local dataset (random token rows, one fixed batch of 4 a step, 8 steps): no hub download. Run with
tests/cookbook_support.cookbook_site() on PYTHONPATH and TINKER_API_KEY set.
"""
import asyncio
import sys

import chz
import numpy as np
import tinker
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder


class Tokens(SupervisedDataset):
    def __init__(self, n_batches: int, batch: int):
        rng = np.random.default_rng(0)
        self.rows = [rng.integers(0, 250, 12).tolist() for _ in range(batch)]  # one fixed batch, seen every step
        self.n = n_batches

    def get_batch(self, index):
        return [tinker.Datum(model_input=tinker.ModelInput.from_ints(r[:-1]),
                             loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
                for r in self.rows]

    def __len__(self):
        return self.n


@chz.chz
class Builder(SupervisedDatasetBuilder):
    n_batches: int = 8

    def __call__(self):
        return Tokens(self.n_batches, 4), None


url, model, log = sys.argv[1:4]
config = train.Config(log_path=log, model_name=model, recipe_name="rlkernels_test", dataset_builder=Builder(),
                      learning_rate=2e-2, lr_schedule="constant", lora_rank=8, base_url=url, save_every=4,
                      eval_every=0)
asyncio.run(train.main(config))
