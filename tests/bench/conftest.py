# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the bench tests: a real byte-level BPE tokenizer folder (trained here, so no
download) and a running fake OpenAI server that counts prompt tokens with it."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
from bench_fake_server import FakeOpenAIServer, FakeServerConfig

WORDS = ("the of and to in is was for on that with as by at from his her an were are which "
         "this be or has had not but what all when can there been one would who will more no "
         "if out so said up about into than them only other new some time could these two may "
         "first then do any like my now over such our man me even most made after also did "
         "many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men "
         "work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three "
         "kda mla moe token prefill decode cache block slot state 0 1 2 3 4 5 6 7 8 9 , . ; : "
         "( ) [ ] { } ! ? ' \" - _ = + * / \\ < > # @ $ % ^ & ~ ` é ü ß 字 节 😀").split()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(400)]
    tok.train_from_iterator(corpus, trainer)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return str(d)


@pytest.fixture
def fake_server(tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_dir + "/tokenizer.json")
    cfg = FakeServerConfig(root=tokenizer_dir,
                           encode=lambda text: tok.encode(text, add_special_tokens=False).ids)
    with FakeOpenAIServer(cfg) as server:
        yield server


def _load_benchmark(name: str):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def load_benchmark():
    """name -> benchmarks/<name>.py imported as a module (the scripts are not a package)."""
    return _load_benchmark
