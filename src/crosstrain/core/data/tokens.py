"""Token data: a 1-D integer array, memory-mapped and cut into windows, and the built-in
real corpus ``python-stdlib``.

A token file is never loaded whole: :class:`TokenWindows` reads the rows a step needs by
index, so every local worker shares the one copy in the page cache.

``python-stdlib`` is the bytes (vocabulary 256) of the running Python's standard-library
``.py`` files in sorted path order, leaving out ``site-packages`` and the test folders
(``test``, ``tests``, ``*_test``): real text that ships with every Python. It is written
once to a cache file (``$CROSSTRAIN_CACHE``, default ``~/.cache/crosstrain``) and then
memory-mapped like any token file.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from crosstrain.core.data.arrays import StoredRows, Translated, Translation
from crosstrain.core.errors import PlanError


class TranslatesTokenWindows(Protocol[Translation]):
    """The method token windows call on a translator (the whole translator:
    :class:`crosstrain.core.data.rows.RowsTranslator`)."""

    def windows(self, rows: TokenWindows) -> Translation: ...


class WindowedRows:
    """What every kind of token windows shares: row i is ``length`` tokens of ``tokens`` read
    from :meth:`starts` (i), as ``dtype``; read by index, never loaded whole."""

    tokens: np.ndarray
    length: int
    count: int
    dtype: np.dtype[Any]

    def starts(self, rows: np.ndarray) -> np.ndarray:
        """Where rows ``rows`` (a 1-D array of row numbers) start in ``tokens``."""
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, int]:
        return (self.count, self.length)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, indices: Any) -> np.ndarray:
        rows = np.arange(self.count)[indices]  # any index numpy takes, bounds checked
        starts = self.starts(np.atleast_1d(rows))
        window = self.tokens[starts[:, None] + np.arange(self.length)[None, :]]
        window = window.astype(self.dtype)
        return window if np.ndim(rows) else window[0]

    def take(self, indices: np.ndarray) -> np.ndarray:
        """Some windows, read into an array (windows are a contiguous run; a choice of them is not)."""
        return self[indices]

    def gather(self, indices: np.ndarray, epoch: int | None = None) -> np.ndarray:
        return self[indices]

    def stored(self, indices: np.ndarray, epoch: int | None = None) -> StoredRows | None:
        """None: a window is more than a gather of rows."""
        return None


class TokenWindows(WindowedRows):
    """Rows ``first .. first+count`` of a token array cut into windows of ``length``:
    row i is ``tokens[(first+i)*length + offset : ... + length]`` (offset 1 gives the
    next-token targets of offset 0's inputs)."""

    def __init__(
        self, tokens: np.ndarray, length: int, first: int, count: int, offset: int, dtype: Any
    ) -> None:
        self.tokens = tokens
        self.length = length
        self.first = first
        self.count = count
        self.offset = offset
        self.dtype = np.dtype(dtype)

    def starts(self, rows: np.ndarray) -> np.ndarray:
        return (self.first + rows) * self.length + self.offset

    def translate(self, translator: TranslatesTokenWindows[Translated]) -> Translated:
        return translator.windows(self)


def load_token_file(path: str, source: str | None = None) -> np.ndarray:
    """A 1-D integer .npy, memory-mapped read-only; a bad file is one PlanError naming it."""
    if not Path(path).is_file():
        raise PlanError(f"no such file {path}", field="data.path", source=source)
    try:
        tokens: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
        raise PlanError(f"cannot read {path}: {error}", field="data.path", source=source) from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise PlanError(
            f"{path} holds {tokens.dtype} of shape {list(tokens.shape)}: tokens are a 1-D integer array",
            field="data.path",
            source=source,
        )
    if len(tokens) and int(tokens.min()) < 0:
        raise PlanError(f"{path} holds negative token ids", field="data.path", source=source)
    return tokens


def _is_test_folder(name: str) -> bool:
    return name in ("test", "tests") or name.endswith("_test")


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files in sorted path order, without site-packages and
    test folders."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        folders = path.relative_to(root).parts[:-1]
        if "site-packages" in folders or any(_is_test_folder(part) for part in folders):
            continue
        files.append(path)
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def cache_dir() -> Path:
    """Where token files made from text are kept (``$CROSSTRAIN_CACHE``)."""
    return Path(os.environ.get("CROSSTRAIN_CACHE", Path.home() / ".cache" / "crosstrain"))


def python_stdlib_tokens() -> np.ndarray:
    """The corpus as a memory-mapped uint8 array, written to the cache on first use."""
    version = "{}.{}.{}".format(*sys.version_info[:3])
    path = cache_dir() / f"python-stdlib-{version}.npy"
    if not path.is_file():
        write_atomically(path, np.frombuffer(b"".join(p.read_bytes() for p in stdlib_files()), np.uint8))
    tokens: np.ndarray = np.load(path, mmap_mode="r")
    return tokens


def write_atomically(path: Path, array: np.ndarray) -> None:
    """Write then rename, so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            np.save(stream, array)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
