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
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

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
