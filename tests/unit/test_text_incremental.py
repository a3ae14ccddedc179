"""StableText decodes only what each step adds (vLLM-style incremental detokenization); the
text must equal a full decode of the prefix for every tokenizer kind the published models
use: byte-level BPE (Llama 3, Qwen: multi-byte characters split across tokens) and
SentencePiece-style Metaspace (leading-space rules)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dlm_engine.text import StableText

CORPUS = [
    "Hello there, what is 2+2? The answer is 4.",
    "naïve café déjà vu — 東京 北京 ソウル 🙂🚀✨ über straße",
    "def f(x):\n    return x * 2  # dobbel\n",
    'Ünïcödé ümlauts and emoji 🤖 mixed with code: {"a": [1, 2, 3]}',
] * 20


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _metaspace() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@pytest.mark.parametrize("make", [_byte_level, _metaspace], ids=["byte_level", "metaspace"])
def test_incremental_text_equals_full_decode(make) -> None:
    tok = make()
    rng = random.Random(0)
    vocab = len(tok)
    encoded = [tok.encode(t, add_special_tokens=False) for t in set(CORPUS)]
    for trial in range(300):
        ids = (
            rng.choice(encoded)
            if trial % 2
            else [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        )
        st = StableText(tok, frozenset(), ())
        n = 0
        while n < len(ids):
            n = min(len(ids), n + rng.randrange(1, 4))
            full = tok.decode(ids[:n], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            assert st._decode(ids[:n]) == full


def test_unchanged_prefix_is_not_decoded_again() -> None:
    tok = _byte_level()
    ids = tok.encode("Hello there, what is 2+2?", add_special_tokens=False)
    st = StableText(tok, frozenset(), ())
    first = st.update(ids[:5], canvas_complete=False)
    calls = []
    st._piece = lambda part: calls.append(part) or ""  # any decode now would be recorded
    again = st.update(ids[:5], canvas_complete=False)
    assert calls == [] and again.delta == "" and not again.finished
    assert first.delta  # the first update did release text
