"""``[data] source = "text"``: text files tokenized once into a memory-mapped token file.

``data.path`` is a file, a folder (every file under it, hidden ones left out) or a glob
(``corpus/*.txt``, ``**`` reaching into folders); the files are read in sorted path order,
as UTF-8. With ``data.tokenizer`` (a Hugging Face ``tokenizers`` JSON file) each file is
encoded as ``Tokenizer.encode(text)`` encodes it and the files' ids are joined; without
one the tokens are the files' bytes (vocabulary 256). ``python-stdlib`` takes a tokenizer
too: the standard library's files (:func:`crosstrain.core.data.tokens.stdlib_files`) are then
the text.

The tokens are written once to the token cache (``$CROSSTRAIN_CACHE``) under a key made of
the files' contents (in order) and the tokenizer file's bytes, so an edited file or another
tokenizer makes a new token file and the same ones are never tokenized twice; from there
they are read exactly as ``source = "tokens"`` reads a token file (memory-mapped windows).
"""

from __future__ import annotations

import glob
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np

from crosstrain.core.data.arrays import Translated, Translation
from crosstrain.core.data.tokens import TokenWindows, WindowedRows, cache_dir, write_atomically
from crosstrain.core.errors import InputError, PlanError
from crosstrain.core.hashing import MASK32, mix

#: what a user without the tokenizers package is told
INSTALL_HINT = "pip install 'crosstrain[text]'"
#: the vocabulary of text read as bytes
BYTE_VOCABULARY = 256
#: bytes of text handed to the tokenizer at once (it encodes a batch's files in parallel)
BATCH_BYTES = 8 << 20
#: changes when the way text becomes tokens changes, so old cache files are not reused
CACHE_VERSION = b"crosstrain-text-2"


@attrs.frozen
class Where:
    """The plan field and file a problem is reported against."""

    field: str
    source: str | None

    def refuse(self, message: str) -> PlanError:
        return PlanError(message, field=self.field, source=self.source)


def text_files(pattern: str, where: Where) -> list[Path]:
    """The files ``data.path`` names, in sorted path order; none is refused."""
    path = Path(pattern)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [
            file
            for file in path.rglob("*")
            if file.is_file() and not any(part.startswith(".") for part in file.relative_to(path).parts)
        ]
    elif glob.has_magic(pattern):
        files = [Path(name) for name in glob.glob(pattern, recursive=True) if Path(name).is_file()]
    else:
        raise where.refuse(f"no such file or folder {pattern}")
    if not files:
        raise where.refuse(f"{pattern} holds no files")
    return sorted(files, key=lambda file: file.as_posix())


def load_tokenizer(path: str) -> Any:
    """The ``tokenizers`` Tokenizer in ``path``; a missing package or a bad file is one line."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InputError(f"data.tokenizer needs the tokenizers package: {INSTALL_HINT}") from None
    where = Where("data.tokenizer", None)
    if not Path(path).is_file():
        raise where.refuse(f"no such file {path}")
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises its own Exception subclass, unexported
        raise where.refuse(f"{path}: not a tokenizers JSON file ({str(error).splitlines()[0]})") from None


def vocabulary_size(tokenizer: str | None) -> int:
    """The ids a tokenizer file gives (its added tokens included); 256 for bytes."""
    return (
        BYTE_VOCABULARY
        if tokenizer is None
        else int(load_tokenizer(tokenizer).get_vocab_size(with_added_tokens=True))
    )


def _token_dtype(vocabulary: int) -> type[np.unsignedinteger[Any]]:
    if vocabulary <= 1 << 8:
        return np.uint8
    return np.uint16 if vocabulary <= 1 << 16 else np.uint32


def cache_key(files: Sequence[Path], tokenizer: str | None) -> str:
    """The token file's name in the cache: a hash of every file's path, size and
    modification time, in order (what every process of a run computes as it loads, so
    never the contents: a large corpus would be read whole by each), and of the tokenizer
    file's content (or of "bytes"). An edited file is another corpus."""
    digest = hashlib.sha256(CACHE_VERSION)
    digest.update(hashlib.sha256(Path(tokenizer).read_bytes()).digest() if tokenizer else b"bytes")
    for file in files:
        stat = file.stat()
        digest.update(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:32]


def corpus_tokens(files: Sequence[Path], tokenizer: str | None, where: Where) -> np.ndarray:
    """The files' tokens, memory-mapped from the cache; tokenized and written there the
    first time these files meet this tokenizer."""
    path = cache_dir() / f"text-{cache_key(files, tokenizer)}.npy"
    if not path.is_file():
        write_atomically(path, tokenize(files, tokenizer, where))
    tokens: np.ndarray = np.load(path, mmap_mode="r")
    return tokens


def tokenize(files: Sequence[Path], tokenizer: str | None, where: Where) -> np.ndarray:
    """Every file's tokens, joined in order: ``Tokenizer.encode(text).ids`` per file, or
    its bytes."""
    if tokenizer is None:
        return np.frombuffer(b"".join(file.read_bytes() for file in files), np.uint8)
    model = load_tokenizer(tokenizer)
    dtype = _token_dtype(model.get_vocab_size(with_added_tokens=True))
    parts = [
        np.asarray(encoding.ids, dtype=dtype)
        for batch in _batches(files, where)
        for encoding in model.encode_batch(batch)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _batches(files: Sequence[Path], where: Where) -> Iterator[list[str]]:
    """The files' text, a few MB at a time; a file that is not UTF-8 is refused."""
    batch: list[str] = []
    size = 0
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise where.refuse(
                f"{file}: not UTF-8 text (byte {error.start}); a tokenizer reads text"
            ) from None
        batch.append(text)
        size += len(text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --------------------------------------------------------------------------- window offsets

#: keeps the window draws apart from every other hash of (seed, epoch, row)
WINDOW_SALT = 0x57494E44


def window_offsets(seed: int, epoch: int, rows: np.ndarray, length: int) -> np.ndarray:
    """int64 [len(rows)]: how many tokens (0..length-1) each training window starts later in
    ``epoch``: a counter-based hash of (seed, epoch, row) as dropout's (:func:`mix`), its 32
    bits scaled to the range by a multiply and shift (no modulo bias). ``rows`` are rows of
    the training set, not positions in a batch, so the draw is the same at any world size."""
    state = mix(np.asarray(seed & MASK32, np.int64))
    state = mix(state ^ np.int64(epoch & MASK32))
    state = mix(state ^ np.int64(WINDOW_SALT))
    hashed = mix(state ^ (np.asarray(rows, np.int64) & MASK32))
    return np.asarray((hashed * np.int64(length)) >> 32, np.int64)


class TranslatesShiftedWindows(Protocol[Translation]):
    """The method shifted windows call on a translator: they are read on the host."""

    def host(self, rows: ShiftedWindows) -> Translation: ...


class ShiftedWindows(WindowedRows):
    """Token windows read ``shifts[i]`` tokens later than row i of ``windows`` (one epoch's
    draws). Not a :class:`TokenWindows`: a backend that places token windows on its device
    gathers them without shifts, so these are read on the host."""

    def __init__(self, windows: TokenWindows, shifts: np.ndarray) -> None:
        self.windows = windows
        self.shifts = shifts
        self.tokens, self.length, self.count, self.dtype = (
            windows.tokens,
            windows.length,
            windows.count,
            windows.dtype,
        )

    def starts(self, rows: np.ndarray) -> np.ndarray:
        shifted: np.ndarray = self.windows.starts(rows) + self.shifts[rows]
        return shifted

    def translate(self, translator: TranslatesShiftedWindows[Translated]) -> Translated:
        return translator.host(self)
