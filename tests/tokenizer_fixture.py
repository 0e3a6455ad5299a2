"""A small T5-style tokenizer built offline, for tests that need a `tokenizer/` folder.

Same structure as the UMT5 tokenizer WAN ships: a Unigram model over "▁"-prefixed pieces,
<pad>=0, </s>=1, <unk>=2, "</s>" appended to every sequence, right padding with <pad>.
Saved with transformers' `T5Tokenizer`, so `AutoTokenizer.from_pretrained(folder)` (and
therefore diffusers' WanPipeline) loads it back.
"""

from __future__ import annotations

import string
from pathlib import Path

from transformers import T5Tokenizer

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


def make_tokenizer(folder: str | Path, vocab_size: int = 256) -> T5Tokenizer:
    """Build, save to `folder` and return a tokenizer of exactly `vocab_size` pieces: the
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
