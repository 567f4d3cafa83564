import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kdaserve.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "héllo wörld 日本語 😀",
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln, naïve café, déjà vu.",
    "東京は日本の首都です。こんにちは世界",
    "hello hello world, the world says hello 😀😀",
]
# Characters the random texts draw from: ASCII, Latin-1, CJK, and emoji never seen in training
# (so their 4 UTF-8 bytes come out as separate byte tokens).
ALPHABET = list("abcdefghij klmnop.,!?\n") + list("éöüßç") + list("日本語東京世界") + \
    ["😀", "🚀", "🎉", "👍🏽"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)


def _stream(detok, ids, rng=None, flush=True):
    """Feed ids in random chunks (or one at a time); return the deltas."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3) if rng else 1
        delta, stop = detok.append(ids[i:i + n])
        deltas.append(delta)
        i += n
        if stop is not None:
            return deltas
    if flush:
        deltas.append(detok.flush())
    return deltas


def _random_text(rng, n):
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def test_deltas_concatenate_to_full_decode(tokenizer):
    rng = random.Random(0)
    for trial in range(40):
        prompt = tokenizer.encode(_random_text(rng, rng.randint(0, 20)))
        ids = tokenizer.encode(_random_text(rng, rng.randint(1, 60)))
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = _stream(detok, ids, rng if trial % 2 else None)
        want = tokenizer.decode(ids)
        assert "".join(deltas) == want
        assert detok.output_text == want
        assert detok.token_ids == ids and detok.stop_reason is None


def test_emoji_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("a🚀b")
    assert len(ids) >= 4  # the rocket is several byte tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hi "))
    deltas = [detok.append([t])[0] for t in ids]
    assert deltas[0] == "a"
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "a🚀b"
    assert deltas.count("🚀") + deltas.count("🚀b") == 1  # emitted whole, once


def test_invalid_utf8_is_flushed_as_replacement(tokenizer):
    rocket = tokenizer.encode("🚀")
    ids = tokenizer.encode("ok") + rocket[:2]  # ends inside a character
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.append([t])[0] for t in ids)
    assert streamed == "ok"
    assert streamed + detok.flush() == tokenizer.decode(ids)
    assert detok.output_text.endswith("\ufffd")


def test_out_of_range_ids_render_as_nothing(tokenizer):
    vocab = len(tokenizer)
    ids = tokenizer.encode("héllo wörld")
    bad = [vocab, vocab + 1000, -1]
    mixed = ids[:2] + bad[:2] + ids[2:] + bad[2:]
    detok = IncrementalDetokenizer(tokenizer, [vocab + 7] + tokenizer.encode("x"))
    deltas = _stream(detok, mixed)
    assert "".join(deltas) == "héllo wörld"
    assert detok.token_ids == mixed
    only_bad = IncrementalDetokenizer(tokenizer, [])
    assert only_bad.append(bad) == ("", None)
    assert only_bad.flush() == ""


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    ids = tokenizer.encode("hello") + [eos] + tokenizer.encode(" world")
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(_stream(skip, ids)) == "hello world"
    assert "".join(_stream(keep, ids)) == "hello<eos> world"


def test_single_stop_string(tokenizer):
    ids = tokenizer.encode("hello world, the end")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world"])
    deltas = _stream(detok, ids)
    assert detok.stop_reason == "world"
    assert detok.output_text == "hello "
    assert "".join(deltas) == "hello "
    # Tokens after the stop are never consumed.
    assert len(detok.token_ids) < len(ids)
    with pytest.raises(ValueError, match="already stopped"):
        detok.append(ids[-1:])


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("hello world, the end")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world"], include_stop_str_in_output=True)
    deltas = _stream(detok, ids)
    assert detok.output_text == "hello world" == "".join(deltas)
    assert detok.stop_reason == "world"


def test_earliest_of_multiple_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["fox", "brown", "zzz"])
    assert "".join(_stream(detok, ids)) == "the quick "
    assert detok.stop_reason == "brown"
    # Same-step matches: all tokens in one append, the earliest still wins.
    detok = IncrementalDetokenizer(tokenizer, [], stop=["jumps", "quick"])
    delta, stop = detok.append(ids)
    assert (delta, stop) == ("the ", "quick")


def test_stop_string_spanning_tokens_is_never_streamed(tokenizer):
    text = "Grüße aus Köln 😀 naïve café"
    ids = tokenizer.encode(text)
    for stop in ["Köln 😀 n", "😀", "e aus K", "é"]:
        detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
        deltas = _stream(detok, ids)
        want = text[:text.index(stop)]
        # Every prefix of the stream stays within the final text: nothing is retracted.
        assert "".join(deltas) == want == detok.output_text, stop
        assert detok.stop_reason == stop


def test_stop_hold_back_is_released_by_flush(tokenizer):
    ids = tokenizer.encode("hello world")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["xyz!"])
    streamed = "".join(detok.append([t])[0] for t in ids)
    assert streamed == "hello wo"  # the last len("xyz!") - 1 chars wait
    assert detok.output_text == "hello world"
    assert streamed + detok.flush() == "hello world"
    assert detok.stop_reason is None


def test_random_stop_strings_match_reference(tokenizer):
    rng = random.Random(1)
    for _ in range(40):
        text = _random_text(rng, 50)
        start = rng.randint(0, 45)
        stop = text[start:start + rng.randint(1, 4)]
        include = rng.random() < 0.5
        ids = tokenizer.encode(text)
        detok = IncrementalDetokenizer(tokenizer, [], stop=[stop],
                                       include_stop_str_in_output=include)
        got = "".join(_stream(detok, ids, rng))
        full = tokenizer.decode(ids)
        idx = full.find(stop)
        want = full[:idx + len(stop)] if include else full[:idx]
        assert got == want == detok.output_text
        assert detok.stop_reason == stop


def test_bad_stop_strings():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(_TinyLen(), [], stop=[""])


class _TinyLen:
    def __len__(self):
        return 1


def test_metaspace_tokenizer_keeps_space_after_prompt():
    """SentencePiece-style tokenizers drop the leading space of a decoded sequence; the context
    window keeps the space between prompt and output."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator(CORPUS * 3, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                 clean_up_tokenization_spaces=False)
    prompt = hf.encode("hello")
    out = hf.encode("hello world")[len(prompt):]
    detok = IncrementalDetokenizer(hf, prompt)
    got = "".join(_stream(detok, out))
    assert got == hf.decode(prompt + out)[len(hf.decode(prompt)):] == " world"


def test_rust_backend_path_equals_the_wrapper_path(tokenizer, tmp_path):
    """The direct tokenizers.Tokenizer.decode path gives the same deltas as the transformers
    wrapper, with and without skipped special tokens, for this tokenizer and the Kimi-style one
    make-model writes (added special tokens)."""
    from transformers import AutoTokenizer

    from kdaserve.models.make_model import make_model

    kimi = AutoTokenizer.from_pretrained(make_model(str(tmp_path / "tiny"), "tiny"))
    rng = random.Random(0)
    for tok in (tokenizer, kimi):
        n = len(tok)
        for skip in (True, False):
            for _ in range(5):
                ids = [rng.randrange(n) for _ in range(40)]
                fast = IncrementalDetokenizer(tok, ids[:5], skip_special_tokens=skip)
                slow = IncrementalDetokenizer(tok, ids[:5], skip_special_tokens=skip)
                assert fast._fast_decode is not None
                slow._fast_decode = None
                assert _stream(fast, ids[5:]) == _stream(slow, ids[5:])


def test_streamed_deltas_never_carry_a_stop_strings_start(tokenizer):
    """Through the output processor (delta mode, as the server streams): a stop string spanning
    tokens is held back until it matches, so no delta sends its first characters."""
    from kdaserve.core.engine_output import EngineCoreOutput
    from kdaserve.engine.output_processor import OutputProcessor
    from kdaserve.sampling_params import SamplingParams

    text = "hello world the world says hello"
    ids = tokenizer.encode(text)
    for stop in ["world says", "d t", "lo"]:
        op = OutputProcessor(tokenizer, len(tokenizer), 1000, 20)
        op.add_request("r", None, [ids[0]], SamplingParams(stop=[stop], max_tokens=50),
                       delta=True)
        sent = []
        for tid in ids:
            res = op.process_outputs([EngineCoreOutput("r", [tid])])
            sent += [c.text for ro in res.request_outputs for c in ro.outputs]
            if res.reqs_to_abort:
                break
        want = text[:text.index(stop)]
        assert "".join(sent) == want, (stop, sent)
        assert all(want.startswith("".join(sent[:i + 1])) for i in range(len(sent))), sent
