"""Language modelling on any local UTF-8 file: ``text_file``, its :class:`CharTokenizer` and the
:class:`TokenWindows` it cuts the tokens into."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hookexp.errors import ConfigError
from hookexp.workloads.data.local import _existing, _hf_tokenizer
from hookexp.workloads.data.splits import Splits, check_count, check_fraction


class CharTokenizer:
    """Characters <-> token ids: id ``i`` is ``vocab[i]``. Encoding goes through numpy on the text's code
    points, so a file of megabytes encodes in milliseconds."""

    def __init__(self, vocab: str):
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocab must not repeat a character")
        self.vocab = vocab
        codes = np.array([ord(c) for c in vocab], dtype=np.int64)
        self._order = np.argsort(codes)
        self._sorted = codes[self._order]

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The vocabulary of ``text``: its distinct characters, sorted (as nanoGPT's shakespeare_char)."""
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
        pos = np.searchsorted(self._sorted, codes).clip(max=len(self._sorted) - 1)
        unknown = self._sorted[pos] != codes
        if unknown.any():
            raise ValueError(f"character {chr(codes[unknown.argmax()])!r} is not in the vocabulary")
        return torch.from_numpy(self._order[pos])

    def decode(self, ids: Any) -> str:
        return "".join(self.vocab[i] for i in torch.as_tensor(ids).tolist())


class TokenWindows(Dataset):
    """Windows of ``block_size`` tokens of one long sequence, starting every ``stride`` tokens:
    ``{"input_ids": LongTensor[block_size]}``. A causal LM predicts each token from those before it."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int):
        if len(tokens) < block_size:
            raise ValueError(f"{len(tokens)} tokens hold no window of block_size={block_size}")
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        start = i * self.stride
        return {"input_ids": self.tokens[start:start + self.block_size].long()}


def text_file(path: str, block_size: int = 128, tokenizer: str = "char", val_fraction: float = 0.1,
              stride: int | None = None) -> Splits:
    """Language modelling on any local UTF-8 file: windows ``{"input_ids": LongTensor[block_size]}``.

    ``tokenizer``: ``char`` (the file's sorted characters; ``info["vocab"]`` keeps them, so
    ``CharTokenizer(info["vocab"])`` decodes) or a local HF tokenizer folder. The last ``val_fraction`` of the
    tokens is the validation text, as nanoGPT splits (no window crosses the boundary). Training windows start
    every ``stride`` tokens (default ``block_size``: each token seen once an epoch); validation windows never
    overlap. ``info``: vocab_size, block_size (and vocab for char, pad_id when the tokenizer has one).
    """
    check_count("block_size", block_size)
    stride = block_size if stride is None else check_count("stride", stride)
    val_fraction = check_fraction(val_fraction, "data.val_fraction")
    file = _existing(path, "data.path", "a UTF-8 text file")
    if not file.is_file():
        raise ConfigError(f"{str(path)!r} is a folder ({file}); give a UTF-8 text file.", key="data.path")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}). Convert it, "
                          "e.g. iconv -t UTF-8.", key="data.path") from None
    info: dict[str, Any] = {"block_size": block_size}
    if tokenizer == "char":
        chars = CharTokenizer.from_text(text)
        tokens = chars.encode(text)
        info.update(vocab_size=len(chars), vocab=chars.vocab)
    else:
        tok = _hf_tokenizer(tokenizer, "data.tokenizer")
        tokens = torch.tensor(tok(text, add_special_tokens=False, verbose=False)["input_ids"])
        info.update(vocab_size=len(tok), tokenizer=str(tokenizer))
        if tok.pad_token_id is not None:
            info["pad_id"] = tok.pad_token_id
    tokens = tokens.to(torch.int32)  # half the memory of int64; windows come out as int64
    cut = int(len(tokens) * (1 - val_fraction))
    if min(cut, len(tokens) - cut) < block_size:
        raise ConfigError(f"{file} has {len(tokens)} tokens: with val_fraction={val_fraction} the training part has "
                          f"{cut} and the validation part {len(tokens) - cut}, and each needs at least one window of "
                          f"block_size={block_size}. Use a smaller data.block_size, another data.val_fraction or a "
                          "longer file.", key="data.path")
    return Splits(TokenWindows(tokens[:cut], block_size, stride), TokenWindows(tokens[cut:], block_size, block_size),
                  info)
