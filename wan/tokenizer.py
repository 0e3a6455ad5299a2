"""Prompt tokenization on the host, exactly as diffusers' `WanPipeline._get_t5_prompt_embeds`.

No jax here: the runtime tokenizes with numpy and hands the arrays to the `text_encode`
executable. A folder's `tokenizer.json` is read with the `tokenizers` library (what
transformers' fast tokenizers run on, so the ids are the same); transformers, which pulls in
torch, is imported only for a folder without one.

Prompt cleaning follows diffusers' `prompt_clean`: `ftfy.fix_text` when ftfy is installed
(diffusers makes the same check), then HTML unescaping twice, whitespace runs collapsed to one
space, ends stripped. ftfy is not a dependency of this project; without it, prompts with
mojibake, curly quotes, full-width characters or non-NFC text tokenize as they are, which is
also what diffusers does without ftfy.
"""

from __future__ import annotations

import dataclasses
import html
import re
import string
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from wan.bounded_read import Refuse, check_size, read_json, read_text
from wan.configs import MAX_CONFIG_BYTES
from wan.errors import InputError

try:
    import ftfy
except ImportError:  # optional, as in diffusers
    ftfy = None


class TokenizerError(InputError):
    """A tokenizer folder is missing or cannot be loaded."""


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A `tokenizers` tokenizer (its post-processor appends </s>) and its padding token."""

    backend: tokenizers.Tokenizer
    pad_token: str


FAST, SENTENCEPIECE, CONFIG = "tokenizer.json", "spiece.model", "tokenizer_config.json"
MAX_TOKENIZER_BYTES = 64 << 20  # UMT5's tokenizer.json: 16 MiB, its spiece.model: 4 MiB


def load_tokenizer(folder: str | Path) -> TextTokenizer:
    """The tokenizer saved in `folder` (a diffusers `tokenizer/` folder), loaded offline.

    Accepted: a `tokenizer.json` (read with `tokenizers`), or a sentencepiece `spiece.model`
    (older T5/UMT5 folders, read through transformers), each with an optional
    `tokenizer_config.json` naming the special tokens. Anything else, or special tokens the
    vocabulary lacks, is a TokenizerError: a tokenizer built from defaults would map every
    word to one id."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer folder {folder} does not exist")
    if not (folder / FAST).is_file() and not (folder / SENTENCEPIECE).is_file():
        raise TokenizerError(
            f"cannot load a tokenizer from {folder}: it has no {FAST} (nor a sentencepiece "
            f"{SENTENCEPIECE}); copy the model's tokenizer folder there"
        )
    config = _read_config(folder / CONFIG)

    def refuse(name: str) -> Refuse:
        return lambda reason: TokenizerError(
            f"cannot load a tokenizer from {folder}: {name} {reason}; copy the model's "
            "tokenizer folder there"
        )

    # Bounded before the libraries read them (a 1 GiB tokenizer.json is 1.5 GB of memory).
    fast = (folder / FAST).is_file()
    if fast:
        text = read_text(folder / FAST, MAX_TOKENIZER_BYTES, refuse(FAST))
    else:
        check_size(folder / SENTENCEPIECE, MAX_TOKENIZER_BYTES, refuse(SENTENCEPIECE))
    try:
        if fast:
            backend = tokenizers.Tokenizer.from_str(text)
            pad = _token_text(config.get("pad_token", "<pad>"))
            eos = _token_text(config.get("eos_token", "</s>"))
        else:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            backend, pad, eos = hf.backend_tokenizer, hf.pad_token, hf.eos_token
    except Exception as error:  # tokenizers/transformers raise OSError, ValueError, Exception, ...
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        raise TokenizerError(f"cannot load a tokenizer from {folder}: {reason}") from error
    for role, token in (("pad_token", pad), ("eos_token", eos)):
        if not isinstance(token, str) or backend.token_to_id(token) is None:
            raise TokenizerError(
                f"{folder}: the {role} {token!r} is not in the tokenizer's vocabulary: set it "
                f"in {CONFIG} or copy the model's tokenizer folder there"
            )
    return TextTokenizer(backend, pad)


def _read_config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json ({} when absent), bounded as a model's configs are; not a JSON
    object is a TokenizerError."""
    if not path.is_file():
        return {}
    config = read_json(
        path,
        MAX_CONFIG_BYTES,
        lambda reason: TokenizerError(f"{path} {reason}: restore the model's original file"),
    )
    if not isinstance(config, dict):
        raise TokenizerError(f"{path} is not a JSON object: restore the model's original file")
    return config


def _token_text(token: Any) -> Any:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def clean_prompt(text: str) -> str:
    """diffusers' `prompt_clean` (pipeline_wan.py)."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def tokenize(
    tokenizer: TextTokenizer, prompts: list[str], max_length: int = 512
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, both int32 (len(prompts), max_length): end-of-sequence
    appended, truncated to and padded up to `max_length` (transformers' padding="max_length",
    truncation=True)."""
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not _is_utf8(prompt):
            raise TokenizerError(f"prompt {i} is not valid UTF-8 text: pass the prompt as text")
    backend = tokenizer.backend
    pad_id = backend.token_to_id(tokenizer.pad_token)
    backend.enable_truncation(max_length)
    backend.enable_padding(length=max_length, pad_id=pad_id, pad_token=tokenizer.pad_token)
    encoded = backend.encode_batch([clean_prompt(p) for p in prompts], add_special_tokens=True)
    return (
        np.asarray([e.ids for e in encoded], dtype=np.int32),
        np.asarray([e.attention_mask for e in encoded], dtype=np.int32),
    )


def _is_utf8(text: str) -> bool:
    """False for a str holding lone surrogates (bytes that were not UTF-8, decoded with
    surrogateescape): they cannot be encoded, and tokenizers would fail on them."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


SPECIALS = ["<pad>", "</s>", "<unk>"]
WORDS = [
    "a",
    "the",
    "of",
    "and",
    "in",
    "on",
    "with",
    "at",
    "to",
    "from",
    "is",
    "are",
    "cat",
    "dog",
    "bird",
    "fish",
    "horse",
    "car",
    "boat",
    "city",
    "street",
    "forest",
    "river",
    "sea",
    "sky",
    "sun",
    "moon",
    "night",
    "day",
    "rain",
    "snow",
    "red",
    "blue",
    "green",
    "white",
    "black",
    "golden",
    "small",
    "big",
    "old",
    "young",
    "slow",
    "fast",
    "running",
    "walking",
    "flying",
    "swimming",
    "dancing",
    "sitting",
    "video",
    "camera",
    "shot",
    "close",
    "up",
    "wide",
    "view",
    "light",
    "shadow",
    "beautiful",
    "cinematic",
    "realistic",
    "blurry",
    "low",
    "quality",
]


def build_word_tokenizer(folder: str | Path, vocab_size: int = 256) -> Any:
    """For the `tiny` preset (tests, demo), which has no released tokenizer: a T5-style
    Unigram tokenizer built offline (<pad>=0, </s>=1, <unk>=2, "</s>" appended, right padding),
    saved with transformers' `T5Tokenizer` so that AutoTokenizer and diffusers load it.

    Build, save to `folder` and return a tokenizer of exactly `vocab_size` pieces: the
    specials, "▁", single characters (so any ASCII text tokenizes), then whole words
    (preferred by their higher scores), then filler pieces."""
    chars = [c for c in string.printable if not c.isspace()]
    pieces = [(s, 0.0) for s in SPECIALS] + [("▁", -2.0)]
    pieces += [(c, -5.0) for c in chars] + [(f"▁{c}", -5.0) for c in string.ascii_lowercase]
    pieces += [(f"▁{w}", -1.0) for w in WORDS]
    pieces += [(f"▁x{i}", -9.0) for i in range(vocab_size - len(pieces))]
    if len(pieces) != vocab_size:
        raise ValueError(f"vocab_size must be at least {len(pieces)}")
    from transformers import T5Tokenizer

    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)
    tokenizer.save_pretrained(folder)
    return tokenizer
