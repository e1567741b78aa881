"""Shard formats for ``ShardedDataset``: Parquet files or row groups, WebDataset-style tar files, JSONL.

Invariants:
- A reader is a module-level class holding only its options (it pickles for DataLoader workers
  under any start method); ``reader(shard, start)`` yields the shard's samples from offset
  ``start``, the same samples in the same order in any process. Nothing here draws from an RNG.
- ``reader(shard, start)`` opens the shard before it returns (a missing file fails while
  "opening" the shard), and yields from a generator that closes it.
- A start costs what the format allows: Parquet skips whole row groups by the row counts in the
  file's metadata, JSONL skips lines without decoding them, tar reads past the members of the
  skipped samples (a tar has no index), all within the one shard.
- pyarrow is imported when a Parquet dataset is built or read, never by importing this module.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, Any

import torch

__all__ = ["JsonlReader", "ParquetReader", "TarReader", "jsonl_shards", "parquet_shards", "tar_shards"]

SHARD_BY = ("file", "row_group")
_BATCH_ROWS = 1024  # rows decoded at a time from a Parquet file
_INSTALL = "pip install torchrepro[parquet]"
_MEMBER = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's key and extension split


def _paths(paths: Iterable[str | os.PathLike[str]], constructor: str, pattern: str) -> list[str]:
    """``paths`` as a list of ``str``; a single path (or anything not a list of paths) is refused."""
    if isinstance(paths, (str, bytes, os.PathLike)) or not isinstance(paths, Iterable):
        raise TypeError(
            f"ShardedDataset.{constructor} needs a list of paths (e.g. sorted(glob({pattern!r}))), got "
            f"{type(paths).__name__} {paths!r:.80}."
        )
    found = []
    for path in paths:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"ShardedDataset.{constructor} takes paths as str or os.PathLike, got "
                f"{type(path).__name__} {path!r:.80}."
            )
        found.append(os.fsdecode(path))
    return found


# -- Parquet ---------------------------------------------------------------------------------------


def _parquet() -> Any:
    """``pyarrow.parquet``, or an ImportError naming the install command."""
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as exc:
        if exc.name not in ("pyarrow", "pyarrow.parquet"):
            raise
        raise ModuleNotFoundError(
            "ShardedDataset.from_parquet needs pyarrow, which is not installed; install it with "
            f"`{_INSTALL}`.",
            name="pyarrow",
        ) from None
    return pq


def _check_columns(path: str, columns: list[str] | None, schema: Any) -> None:
    if columns is None:
        return
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ValueError(
            f"{path} has no column {', '.join(map(repr, missing))}; its columns are {schema.names}. "
            "Pass columns= among these (or None for all)."
        )


def parquet_shards(
    paths: Iterable[str | os.PathLike[str]], columns: Iterable[str] | None, *, shard_by: str
) -> tuple[list[Any], ParquetReader, list[int] | None]:
    """The shards, reader and shard lengths of ``ShardedDataset.from_parquet``: each file's path
    (lengths not known: the files are opened only when read), or with ``shard_by="row_group"`` a
    ``(path, row group)`` pair for every row group of every file, with its row count (read from
    the files' metadata now, which also checks ``columns`` against each file)."""
    files = _paths(paths, "from_parquet", "data/*.parquet")
    if isinstance(columns, str) or not (columns is None or isinstance(columns, Iterable)):
        raise TypeError(
            f"columns must be a list of column names or None, got {columns!r:.80}: use [{columns!r}]."
        )
    names = None if columns is None else list(columns)
    if names is not None and not all(isinstance(c, str) for c in names):
        raise TypeError(f"columns must be a list of column names (str), got {names!r:.80}.")
    if shard_by not in SHARD_BY:
        raise ValueError(f"shard_by must be one of {list(SHARD_BY)}, got {shard_by!r}.")
    pq = _parquet()
    if shard_by == "file":
        return files, ParquetReader(names), None
    shards: list[Any] = []
    lengths: list[int] = []
    for path in files:
        with pq.ParquetFile(path) as file:
            _check_columns(path, names, file.schema_arrow)
            shards += [(path, group) for group in range(file.num_row_groups)]
            lengths += [file.metadata.row_group(group).num_rows for group in range(file.num_row_groups)]
    return shards, ParquetReader(names), lengths


class ParquetReader:
    """``read_shard`` of ``ShardedDataset.from_parquet``: the rows of a Parquet file, or of one of
    its row groups (shard ``(path, row_group)``), from row ``start``, as dicts column -> value.

    Row groups before ``start`` are skipped by their row counts in the file's metadata (never
    read); the row group holding ``start`` is decoded from its beginning. A column of lists of
    integers (``list``, ``large_list`` or ``fixed_size_list`` of any integer type: token ids) gives a
    1-D ``torch.int64`` tensor per row; every other value is what pyarrow's ``to_pylist`` gives
    (``int``, ``float``, ``str``, ``bytes``, ``list``, ``dict``, ``None``, ``datetime``...).
    """

    def __init__(self, columns: list[str] | None = None) -> None:
        self.columns = columns

    def __repr__(self) -> str:
        return f"ParquetReader(columns={self.columns!r})"

    def __call__(self, shard: str | tuple[str, int], start: int = 0) -> Iterator[dict[str, Any]]:
        path, group = (shard, None) if isinstance(shard, str) else shard
        file = _parquet().ParquetFile(path)
        try:
            _check_columns(path, self.columns, file.schema_arrow)
            if group is not None and not 0 <= group < file.num_row_groups:
                raise ValueError(
                    f"{path} has {file.num_row_groups} row groups, no row group {group}: the file "
                    "changed since the dataset was built; build it again."
                )
            groups = list(range(file.num_row_groups)) if group is None else [group]
            skip = start
            while groups and skip >= (rows := file.metadata.row_group(groups[0]).num_rows):
                skip -= rows
                groups.pop(0)
        except BaseException:
            file.close()
            raise
        return self._rows(file, groups, skip)

    def _rows(self, file: Any, groups: list[int], skip: int) -> Iterator[dict[str, Any]]:
        with file:
            if not groups:
                return
            batches = file.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups, columns=self.columns)
            for batch in batches:
                if skip:
                    dropped = min(skip, batch.num_rows)
                    batch, skip = batch.slice(dropped), skip - dropped
                if batch.num_rows:
                    yield from _as_rows(batch)


def _as_rows(batch: Any) -> list[dict[str, Any]]:
    """The rows of a ``pyarrow.RecordBatch`` as dicts, integer list columns as int64 tensors."""
    names = batch.schema.names
    values = [
        _int_lists(column, field.name) if _is_int_list(field.type) else column.to_pylist()
        for field, column in zip(batch.schema, batch.columns, strict=True)
    ]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def _is_int_list(kind: Any) -> bool:
    import pyarrow as pa

    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    return bool(listed and pa.types.is_integer(kind.value_type))


def _int_lists(column: Any, name: str) -> list[torch.Tensor | None]:
    """A column of lists of integers as one int64 tensor (or ``None``) per row: the values are
    cast and copied once per row, never through Python ints."""
    import pyarrow as pa
    import pyarrow.compute as pc

    flat = pc.cast(column.flatten(), pa.int64())  # the non-null lists' values, in row order
    if flat.null_count:
        raise ValueError(f"column {name!r} holds a list with a null element; int64 tensors cannot hold it.")
    buffer = flat.buffers()[1]
    data = memoryview(b"" if buffer is None else buffer)[flat.offset * 8 : (flat.offset + len(flat)) * 8]
    rows: list[torch.Tensor | None] = []
    at = 0
    for length in pc.list_value_length(column).to_pylist():
        if length is None:
            rows.append(None)
        elif length == 0:
            rows.append(torch.empty(0, dtype=torch.int64))
        else:
            rows.append(torch.frombuffer(bytearray(data[at * 8 : (at + length) * 8]), dtype=torch.int64))
            at += length
    return rows


# -- WebDataset-style tar ----------------------------------------------------------------------------

Decode = Mapping[str, Callable[[bytes], Any]] | Callable[[dict[str, Any]], Any] | None


def tar_shards(paths: Iterable[str | os.PathLike[str]], decode: Decode) -> tuple[list[str], TarReader]:
    """The shards and reader of ``ShardedDataset.from_tar``: one shard per tar file."""
    files = _paths(paths, "from_tar", "data/*.tar")
    if isinstance(decode, Mapping):
        wrong = {ext: fn for ext, fn in decode.items() if not isinstance(ext, str) or not callable(fn)}
        if wrong:
            raise TypeError(
                "decode must map extensions (str, lower case, without the dot: 'json') to functions "
                f"bytes -> value, got {wrong!r:.200}."
            )
        decode = dict(decode)
    elif decode is not None and not callable(decode):
        raise TypeError(
            "decode must be None, a dict extension -> function (bytes -> value), or a function "
            f"sample dict -> sample; got {decode!r:.80}."
        )
    return files, TarReader(decode)


class TarReader:
    """``read_shard`` of ``ShardedDataset.from_tar``: the samples of a WebDataset-style tar file
    (compressed or not) from sample ``start``, read as a stream.

    Regular members are grouped by key as WebDataset does: a member's key is its name up to the
    first dot of its base name (directory included), its extension the rest, in lower case
    (``train/0001.seg.PNG``: key ``train/0001``, extension ``seg.png``); members without one are
    skipped. Consecutive members with one key make one sample,
    ``{"__key__": key, extension: bytes, ...}``, in archive order; an extension twice in a sample
    is an error. ``decode`` (a dict extension -> function of the bytes, or a function of the
    sample dict) is applied to each sample as it is yielded. A start reads the headers of the
    skipped samples' members and passes over their bytes without keeping or decoding them.
    """

    def __init__(self, decode: Decode = None) -> None:
        self.decode = decode

    def __repr__(self) -> str:
        return f"TarReader(decode={self.decode!r})"

    def __call__(self, shard: str, start: int = 0) -> Iterator[dict[str, Any]]:
        return self._samples(tarfile.open(shard, mode="r|*"), shard, start)

    def _samples(self, archive: tarfile.TarFile, path: str, start: int) -> Iterator[dict[str, Any]]:
        with archive:
            index, key, sample = -1, None, None
            for member in archive:
                split = _MEMBER.match(member.name) if member.isfile() else None
                if split is None:
                    continue
                if split[1] != key:
                    if sample is not None:
                        yield self._decoded(sample)
                    index, key = index + 1, split[1]
                    sample = {"__key__": key} if index >= start else None
                if sample is None:
                    continue  # a sample before start: its data is passed over, not read
                extension = split[2].lower()
                if extension in sample:
                    raise ValueError(
                        f"{path}: member {member.name!r} repeats extension {extension!r} of sample {key!r}."
                    )
                data = archive.extractfile(member)
                assert data is not None  # a regular file
                sample[extension] = data.read()
            if sample is not None:
                yield self._decoded(sample)

    def _decoded(self, sample: dict[str, Any]) -> Any:
        decode = self.decode
        if decode is None:
            return sample
        if not isinstance(decode, Mapping):
            return decode(sample)
        for extension, value in sample.items():
            fn = decode.get(extension) if extension != "__key__" else None
            if fn is not None:
                try:
                    sample[extension] = fn(value)
                except Exception as e:
                    raise ValueError(
                        f"decode[{extension!r}] failed on {sample['__key__']}.{extension}: "
                        f"{type(e).__name__}: {e}"
                    ) from e
        return sample


# -- JSON Lines --------------------------------------------------------------------------------------


def jsonl_shards(paths: Iterable[str | os.PathLike[str]], encoding: str) -> tuple[list[str], JsonlReader]:
    """The shards and reader of ``ShardedDataset.from_jsonl``: one shard per file."""
    files = _paths(paths, "from_jsonl", "data/*.jsonl")
    codecs.lookup(encoding)  # an unknown encoding fails here, not in a worker
    return files, JsonlReader(encoding)


class JsonlReader:
    """``read_shard`` of ``ShardedDataset.from_jsonl``: the JSON values of a JSON Lines file, one
    per non-blank line (``json.loads``: an object gives a dict), from sample ``start``; a
    ``.gz`` file is read through gzip. A start skips lines without decoding them; a line that is
    not valid JSON raises an error naming the file and the line number."""

    def __init__(self, encoding: str = "utf-8") -> None:
        self.encoding = encoding

    def __repr__(self) -> str:
        return f"JsonlReader(encoding={self.encoding!r})"

    def __call__(self, shard: str, start: int = 0) -> Iterator[Any]:
        if shard.endswith(".gz"):
            return self._values(gzip.open(shard, "rt", encoding=self.encoding), shard, start)
        return self._values(open(shard, encoding=self.encoding), shard, start)

    def _values(self, file: IO[str], path: str, start: int) -> Iterator[Any]:
        with file:
            index = 0
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                if index >= start:
                    try:
                        value = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(
                            f"{path}, line {number}: not valid JSON ({e.msg} at column {e.colno}): "
                            f"{line.strip()!r:.80}"
                        ) from None
                    yield value
                index += 1
