"""The text scheduler_overhead.py's requests sample with ``--text`` (mixed English, accented, CJK and emoji), and the
Llama-2-style tokenizer that ``--tokenizer sentencepiece`` builds."""

from __future__ import annotations

from pathlib import Path

TEXT = ("The quick brown fox jumps over the lazy dog; naïve café, déjà vu, Straße, smörgåsbord. "
        "東京の天気は晴れです。你好，世界！서울 날씨 🎉🚀 — “quotes” and ‘more’ … ¿qué tal? Ünïcödé 123.\n")


SENTENCEPIECE_WORD = "▁the"  # what every request samples with --tokenizer sentencepiece and no --text


def build_sentencepiece_tokenizer(out_dir: Path) -> Path:
    """A Llama-2-style tokenizer for ``--tokenizer sentencepiece``: a unigram vocabulary of ▁-words (TEXT's and
    some common ones), single characters and 256 byte-fallback tokens, with Llama 2's decoder (spaces as ▁, byte
    fallback, one leading space stripped). Saved as a checkpoint's tokenizer files are."""
    import re

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    words = set(re.findall(r"[A-Za-z]+", TEXT)) | {"the", "of", "and", "to", "in", "is", "that", "for", "it", "on"}
    chars = {c for c in TEXT if ord(c) < 0x250 and not c.isspace()}  # (CJK, Hangul, emoji: byte fallback)
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), *[(f"<0x{b:02X}>", -20.0) for b in range(256)], ("▁", -3.0)]
    pieces += [(c, -6.0) for c in sorted(chars)]
    pieces += [(f"▁{w}", -2.0) for w in sorted(words)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out_dir))
    return out_dir


def load_text_ids(tokenizer) -> list[int]:
    return tokenizer(TEXT, add_special_tokens=False)["input_ids"]
