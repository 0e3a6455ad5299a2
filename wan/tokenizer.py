"""Prompt tokenization on the host, exactly as diffusers' `WanPipeline._get_t5_prompt_embeds`.

No jax here: the runtime tokenizes with numpy and hands the arrays to the `text_encode`
executable.

Prompt cleaning follows diffusers' `prompt_clean`: `ftfy.fix_text` when ftfy is installed
(diffusers makes the same check), then HTML unescaping twice, whitespace runs collapsed to one
space, ends stripped. ftfy is not a dependency of this project; without it, prompts with
mojibake, curly quotes, full-width characters or non-NFC text tokenize as they are, which is
also what diffusers does without ftfy.
"""

from __future__ import annotations

import html
import re
import string
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase, T5Tokenizer

try:
    import ftfy
except ImportError:  # optional, as in diffusers
    ftfy = None


class TokenizerError(ValueError):
    """A tokenizer folder is missing or cannot be loaded."""


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `folder` (a diffusers `tokenizer/` folder), loaded offline."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer folder {folder} does not exist")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, TypeError, ...
        reason = " ".join(str(error).split()) or type(error).__name__
        raise TokenizerError(f"cannot load a tokenizer from {folder}: {reason}") from error


def clean_prompt(text: str) -> str:
    """diffusers' `prompt_clean` (pipeline_wan.py)."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def tokenize(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_length: int = 512
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, both int32 (len(prompts), max_length): end-of-sequence
    appended, truncated to and padded up to `max_length`."""
    encoded = tokenizer(
        [clean_prompt(p) for p in prompts],
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="np",
    )
    return (
        np.asarray(encoded["input_ids"], dtype=np.int32),
        np.asarray(encoded["attention_mask"], dtype=np.int32),
    )


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


def build_word_tokenizer(folder: str | Path, vocab_size: int = 256) -> T5Tokenizer:
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
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)
    tokenizer.save_pretrained(folder)
    return tokenizer
