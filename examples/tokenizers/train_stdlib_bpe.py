"""Train ``stdlib_bpe_4096.json``, the tokenizer of ``examples/stdlib_gpt_bpe.toml``: a
byte-level BPE (GPT-2's kind: every byte is a token to start from, so any text encodes)
with 4,096 ids, learned from the text ``data.source = "python-stdlib"`` reads — the running
Python's standard-library ``.py`` files, without site-packages and the test folders.

    pip install 'crosstrain[text]'
    python examples/tokenizers/train_stdlib_bpe.py [OUT.json]

The shipped file was made from Python 3.11's standard library; any text encodes with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from crosstrain.core.data.tokens import stdlib_files

VOCABULARY = 4096


def train(out: Path) -> Tokenizer:
    files = stdlib_files()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCABULARY,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(
        (file.read_text(encoding="utf-8") for file in files), trainer, length=len(files)
    )
    tokenizer.save(str(out))
    return tokenizer


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("stdlib_bpe_4096.json")
    trained = train(target)
    print(f"{target}: {trained.get_vocab_size()} ids, {target.stat().st_size:,} bytes")
