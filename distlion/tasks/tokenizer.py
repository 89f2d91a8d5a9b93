"""Tokenizers trained or built locally, never downloaded: byte-level BPE (`tokenizers`) or raw bytes; or the
tokenizer saved with a pretrained model (`PretrainedTokenizer`), which a finetune must keep.

The BPE is trained on the training split only and cached under `$DISTLION_CACHE/tokenizers/` in a
file named by a hash of (kind, vocabulary size, training text), so the second run with the same data
and settings loads it instead of training again.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from distlion.tasks.data import cache_dir

EOT = "<|endoftext|>"

#: How many BPE tokenizers this process has trained (the tests check that a cached one is reused).
TRAININGS = 0


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus one end-of-text token (256)."""

    kind = "bytes"

    def __init__(self):
        self.vocab_size = 257
        self.eot_id = 256
        self.key = "bytes"

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class BPETokenizer:
    """Byte-level BPE (GPT-2's scheme) with one special token, `<|endoftext|>`, between documents."""

    kind = "bpe"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.path = path
        self.key = path.stem
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.eot_id = self._tok.token_to_id(EOT)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def to_hf(self):
        """As a `transformers` tokenizer (the same ids), for `save_pretrained` and lm-eval."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(self.path), eos_token=EOT, pad_token=EOT)


class PretrainedTokenizer:
    """The tokenizer of a pretrained model (`AutoTokenizer.from_pretrained` of a local folder, or a hub id when
    online), end-of-text = its EOS token."""

    kind = "pretrained"

    def __init__(self, source: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(source)
        if self._tok.eos_token_id is None:
            raise ValueError(f"the tokenizer of {source} has no EOS token to end documents with")
        self.vocab_size = len(self._tok)
        self.eot_id = self._tok.eos_token_id
        vocab = sorted(self._tok.get_vocab().items())
        self.key = f"pretrained-{text_digest([repr(vocab), self._tok.eos_token])}"

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self._tok(texts, add_special_tokens=False)["input_ids"]

    def to_hf(self):
        return self._tok


def text_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def build_tokenizer(kind: str, vocab_size: int, train_texts: list[str]) -> ByteTokenizer | BPETokenizer:
    """`kind="bpe"`: a byte-level BPE of `vocab_size` trained on `train_texts` (cached);
    `kind="bytes"`: raw UTF-8 bytes (vocabulary 257, nothing to train)."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "bpe":
        raise ValueError(f"task.tokenizer={kind!r} is unknown; choose 'bpe' or 'bytes'")
    if vocab_size < 258:
        raise ValueError(f"task.vocab_size={vocab_size} is too small for a byte-level BPE "
                         "(>= 258: 256 bytes, <|endoftext|> and one merge)")
    path = cache_dir("tokenizers") / f"bpe-{vocab_size}-{text_digest(train_texts)}.json"
    if not path.exists():
        _train_bpe(train_texts, vocab_size, path)
    return BPETokenizer(path)


def _train_bpe(texts: list[str], vocab_size: int, path: Path) -> None:
    global TRAININGS
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                            show_progress=False)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    TRAININGS += 1
