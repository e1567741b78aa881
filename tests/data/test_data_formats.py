"""Shard formats: ``ShardedDataset.from_parquet``, ``from_tar`` and ``from_jsonl``.

Files written here: Parquet files with row groups of unequal size (one file per shard, or one
row group per shard), WebDataset-style tar files (one gzip-compressed), JSONL files (one gzip, one
empty, blank lines). Exhaustive where the space is small: every start offset of every shard
gives what reading from 0 and dropping gives. A Parquet start really skips row groups: the first
row group's pages are overwritten with garbage and a start past it still reads. Through
``SeededLoader`` the batches are the same for ``num_workers`` 0 and 2 and a mid-epoch resume
gives the rest; negative control: a plain ``DataLoader`` over the same dataset changes order with
``num_workers``.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import re
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import torchrepro
from torchrepro import ShardReadError
from torchrepro.data.formats import JsonlReader, ParquetReader, TarReader

pa = pytest.importorskip("pyarrow")  # a pinned test dependency: present in make test
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 2 workers, 2 cores

GROUPS = [[4, 1, 6], [5], [3, 3], [2, 7, 1, 2]]  # rows per row group of each Parquet file
TAR_SAMPLES = [6, 0, 9, 4]  # samples per tar file (one empty)
JSONL_LINES = [8, 0, 11, 5]  # objects per JSONL file (one empty)


# -- the files ---------------------------------------------------------------------------------------


def parquet_row(file: int, row: int) -> dict[str, Any]:
    i = file * 1000 + row
    return {
        "id": i,
        "input_ids": list(range(i, i + row % 5)),  # token ids, some empty
        "text": f"doc {i}",
        "score": None if row % 4 == 3 else i / 7,
    }


def write_parquet(path: Path, file: int, groups: list[int]) -> None:
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("input_ids", pa.list_(pa.int32())),
            ("text", pa.string()),
            ("score", pa.float64()),
        ]
    )
    row = 0
    with pq.ParquetWriter(path, schema) as writer:
        for size in groups:
            rows = [parquet_row(file, r) for r in range(row, row + size)]
            writer.write_table(pa.Table.from_pylist(rows, schema=schema), row_group_size=size)
            row += size


def tar_members(file: int, n: int) -> list[tuple[str, bytes]]:
    """WebDataset-style members: a key per sample (directory included), some samples without
    every extension, an upper-case and a two-part extension, and a member without one."""
    members: list[tuple[str, bytes]] = []
    for s in range(n):
        key = f"part{file}/{s:04d}"
        members.append((f"{key}.txt", f"text {file}.{s}".encode()))
        if s % 3:
            members.append((f"{key}.JSON", json.dumps({"s": s, "file": file}).encode()))
        members.append((f"{key}.seg.cls", str(s % 4).encode()))
        if s == 1:
            members.append((f"part{file}/README", b"no extension: skipped"))
    return members


def write_tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w") -> None:
    with tarfile.open(path, mode) as tar:  # type: ignore[call-overload]
        folder = tarfile.TarInfo("part")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)  # not a file: skipped
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def tar_sample(file: int, s: int) -> dict[str, Any]:
    key = f"part{file}/{s:04d}"
    sample: dict[str, Any] = {"__key__": key, "txt": f"text {file}.{s}".encode()}
    if s % 3:
        sample["json"] = json.dumps({"s": s, "file": file}).encode()
    sample["seg.cls"] = str(s % 4).encode()
    return sample


def jsonl_value(file: int, line: int) -> dict[str, Any]:
    return {"id": file * 1000 + line, "text": f"line {line}", "tags": ["a"] * (line % 3)}


def write_jsonl(path: Path, file: int, n: int) -> None:
    lines = []
    for i in range(n):
        lines.append(json.dumps(jsonl_value(file, i)))
        if i % 4 == 1:
            lines.append("   ")  # blank lines are not samples
    text = "\n".join(lines) + ("\n" if lines else "")
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("formats")
    found: dict[str, list[Path]] = {"parquet": [], "tar": [], "jsonl": []}
    for f, groups in enumerate(GROUPS):
        found["parquet"].append(root / f"train-{f}.parquet")
        write_parquet(found["parquet"][-1], f, groups)
    for f, n in enumerate(TAR_SAMPLES):
        found["tar"].append(root / (f"train-{f}.tar.gz" if f == 2 else f"train-{f}.tar"))
        write_tar(found["tar"][-1], tar_members(f, n), "w:gz" if f == 2 else "w")
    for f, n in enumerate(JSONL_LINES):
        found["jsonl"].append(root / (f"train-{f}.jsonl.gz" if f == 0 else f"train-{f}.jsonl"))
        write_jsonl(found["jsonl"][-1], f, n)
    return found


KINDS = ["parquet", "parquet-row-groups", "tar", "jsonl"]


def dataset(kind: str, files: dict[str, list[Path]], **kwargs: Any) -> torchrepro.ShardedDataset:
    if kind == "parquet":
        return torchrepro.ShardedDataset.from_parquet(files["parquet"], **kwargs)
    if kind == "parquet-row-groups":
        return torchrepro.ShardedDataset.from_parquet(files["parquet"], shard_by="row_group", **kwargs)
    if kind == "tar":
        return torchrepro.ShardedDataset.from_tar(files["tar"], **kwargs)
    return torchrepro.ShardedDataset.from_jsonl([str(p) for p in files["jsonl"]], **kwargs)


def expected(kind: str) -> list[Any]:
    """Every sample of the dataset, shard after shard, as written (before any conversion)."""
    if kind.startswith("parquet"):
        return [parquet_row(f, r) for f, groups in enumerate(GROUPS) for r in range(sum(groups))]
    if kind == "tar":
        return [tar_sample(f, s) for f, n in enumerate(TAR_SAMPLES) for s in range(n)]
    return [jsonl_value(f, i) for f, n in enumerate(JSONL_LINES) for i in range(n)]


def plain(value: Any) -> Any:
    """A sample with its tensors as (dtype, values): comparable with == and exact."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def rows(batch: list[Any]) -> list[Any]:
    """The collate_fn of the loader tests: the batch's samples, comparable."""
    return [plain(sample) for sample in batch]


# -- contents ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_sample_is_read_as_written(kind: str, files: dict[str, list[Path]]) -> None:
    ds = dataset(kind, files)
    assert ds.takes_start
    samples = list(ds)
    want = expected(kind)
    if kind.startswith("parquet"):  # token id lists become int64 tensors, the rest Python values
        assert all(s["input_ids"].dtype is torch.int64 and s["input_ids"].dim() == 1 for s in samples)
        want = [{**row, "input_ids": ("torch.int64", row["input_ids"])} for row in want]
        assert [list(s) for s in samples] == [["id", "input_ids", "text", "score"]] * len(samples)
    assert plain(samples) == want
    shards = {
        "parquet": [str(p) for p in files["parquet"]],
        "parquet-row-groups": [
            (str(p), g)
            for p, groups in zip(files["parquet"], GROUPS, strict=True)
            for g in range(len(groups))
        ],
        "tar": [str(p) for p in files["tar"]],
        "jsonl": [str(p) for p in files["jsonl"]],
    }[kind]
    assert ds.shards == shards


def test_parquet_columns_are_read_in_the_order_asked(files: dict[str, list[Path]]) -> None:
    ds = torchrepro.ShardedDataset.from_parquet(files["parquet"], ("text", "id"))
    assert list(ds) == [{"text": r["text"], "id": r["id"]} for r in expected("parquet")]


def test_parquet_integer_list_columns_of_every_kind_become_int64_tensors(tmp_path: Path) -> None:
    table = pa.table(
        {
            "fixed": pa.array([[1, 2], None, [5, 6]], pa.list_(pa.int16(), 2)),
            "large": pa.array([[3_000_000_000], [], None], pa.large_list(pa.uint32())),
            "floats": pa.array([[0.5], [1.5, 2.5], []], pa.list_(pa.float32())),  # stays a list
            "nested": pa.array([[[1]], [], [[2, 3]]], pa.list_(pa.list_(pa.int8()))),  # stays lists
        }
    )
    pq.write_table(table, tmp_path / "kinds.parquet")
    got = list(torchrepro.ShardedDataset.from_parquet([tmp_path / "kinds.parquet"]))
    assert plain(got) == [
        {
            "fixed": ("torch.int64", [1, 2]),
            "large": ("torch.int64", [3_000_000_000]),
            "floats": [0.5],
            "nested": [[1]],
        },
        {"fixed": None, "large": ("torch.int64", []), "floats": [1.5, 2.5], "nested": []},
        {"fixed": ("torch.int64", [5, 6]), "large": None, "floats": [], "nested": [[2, 3]]},
    ]
    assert got[0]["fixed"].is_contiguous() and got[0]["fixed"].untyped_storage().nbytes() == 16  # its own


def test_tar_decode_by_extension_or_by_sample(files: dict[str, list[Path]]) -> None:
    by_extension = torchrepro.ShardedDataset.from_tar(
        files["tar"], decode={"txt": bytes.decode, "json": json.loads, "seg.cls": int}
    )
    want = [
        {
            k: (
                v.decode()
                if k == "txt"
                else json.loads(v)
                if k == "json"
                else int(v)
                if k == "seg.cls"
                else v
            )
            for k, v in s.items()
        }
        for s in expected("tar")
    ]
    assert list(by_extension) == want
    by_sample = torchrepro.ShardedDataset.from_tar(files["tar"], decode=key_and_text)
    assert list(by_sample) == [(s["__key__"], s["txt"]) for s in want]


def key_and_text(sample: dict[str, Any]) -> tuple[str, str]:
    return sample["__key__"], sample["txt"].decode()


# -- starts ------------------------------------------------------------------------------------------


READERS = {
    "parquet": ParquetReader,
    "parquet-row-groups": ParquetReader,
    "tar": TarReader,
    "jsonl": JsonlReader,
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_start_of_every_shard_is_reading_from_zero_and_dropping(
    kind: str, files: dict[str, list[Path]]
) -> None:
    ds = dataset(kind, files)
    assert type(ds.read_shard) is READERS[kind]
    for shard in ds.shards:
        whole = plain(list(ds.read_shard(shard)))
        for start in range(len(whole) + 2):
            assert plain(list(ds.read_shard(shard, start))) == whole[start:], (shard, start)


def corrupt_row_group(path: Path, group: int) -> None:
    """Overwrite every page of one row group with garbage (what a reader of it would decode)."""
    meta = pq.ParquetFile(path).metadata.row_group(group)
    data = bytearray(path.read_bytes())
    for c in range(meta.num_columns):
        chunk = meta.column(c)
        first = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        data[first : first + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))


@pytest.mark.usefixtures("rng_changes_ok")  # read() seeds the globals (its callers put them back)
def test_a_parquet_start_skips_the_row_groups_before_it_unread(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.parquet"
    write_parquet(path, 3, GROUPS[3])  # row groups of 2, 7, 1, 2 rows
    corrupt_row_group(path, 0)
    reader = ParquetReader()
    whole = [parquet_row(3, r) for r in range(sum(GROUPS[3]))]
    for start in (0, 1):  # the corrupt row group is read: negative control
        with pytest.raises(OSError, match=r"thrift|page header"):
            list(reader(str(path), start))
    for start in range(2, len(whole) + 1):
        assert (
            plain([{**r, "input_ids": r["input_ids"].tolist()} for r in reader(str(path), start)])
            == whole[start:]
        )
    ds = torchrepro.ShardedDataset.from_parquet([path])  # a resume's read of the shard
    samples, length = ds.read(0, 0, 0, 5)
    assert [(o, s["id"]) for o, s in samples] == [(o, 3000 + o) for o in range(5, 12)] and length == 12
    with pytest.raises(
        ShardReadError, match=r"Shard 0 .*corrupt\.parquet.* failed while reading sample 0: OSError"
    ):
        ds.read(0, 0, 0, 0)


# -- errors ------------------------------------------------------------------------------------------


def loader(ds: torchrepro.ShardedDataset, workers: int = 0, **kwargs: Any) -> torchrepro.SeededLoader:
    kwargs.setdefault("shuffle_buffer", 16)
    return torchrepro.SeededLoader(ds, batch_size=4, seed=0, num_workers=workers, collate_fn=rows, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_file_is_a_shard_read_error_naming_it(
    kind: str, files: dict[str, list[Path]], tmp_path: Path
) -> None:
    if kind == "parquet-row-groups":  # its shards are read from the files' metadata at construction
        with pytest.raises(FileNotFoundError, match=r"missing\.parquet"):
            torchrepro.ShardedDataset.from_parquet([tmp_path / "missing.parquet"], shard_by="row_group")
        return
    suffix = {"parquet": ".parquet", "tar": ".tar", "jsonl": ".jsonl"}[kind]
    ds = dataset(kind, {kind: [*files[kind][:2], tmp_path / f"missing{suffix}"]})
    with pytest.raises(ShardReadError, match=rf"Shard 2 \('.*missing\{suffix}'\) failed while opening it"):
        list(loader(ds, shuffle=False, shuffle_buffer=1))


def test_a_malformed_jsonl_line_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3,}\n{"a": 4}\n')
    ds = torchrepro.ShardedDataset.from_jsonl([path])
    with pytest.raises(
        ValueError, match=r"bad\.jsonl, line 4: not valid JSON \(.* at column 9\): '\{\"a\": 3,\}'"
    ):
        list(ds.read_shard(str(path)))
    assert list(ds.read_shard(str(path), 3)) == [{"a": 4}]  # a start skips lines without decoding them
    with pytest.raises(
        ShardReadError, match=r"Shard 0 .* failed while reading sample 2: ValueError: .*line 4"
    ):
        list(loader(ds, shuffle=False, shuffle_buffer=1))


def test_a_missing_parquet_column_names_the_files_columns(files: dict[str, list[Path]]) -> None:
    has = r"has no column 'tokens'; its columns are \['id', 'input_ids', 'text', 'score'\]"
    with pytest.raises(ValueError, match=has):
        torchrepro.ShardedDataset.from_parquet(files["parquet"], ["id", "tokens"], shard_by="row_group")
    ds = torchrepro.ShardedDataset.from_parquet(files["parquet"], ["id", "tokens"])  # opens nothing now
    with pytest.raises(ShardReadError, match=r"failed while opening it: ValueError: .*" + has):
        list(loader(ds))


def test_a_tar_cut_inside_a_member_is_a_shard_read_error(
    files: dict[str, list[Path]], tmp_path: Path
) -> None:
    with tarfile.open(files["tar"][0]) as tar:
        member = tar.getmember("part0/0004.txt")  # the first member of sample 4
    cut = tmp_path / "cut.tar"
    cut.write_bytes(files["tar"][0].read_bytes()[: member.offset_data + 3])
    ds = torchrepro.ShardedDataset.from_tar([files["tar"][3], cut])
    match = r"Shard 1 \('.*cut\.tar'\) failed while reading sample 4: ReadError: unexpected end of data"
    with pytest.raises(ShardReadError, match=match):
        list(loader(ds, shuffle=False, shuffle_buffer=1))
    twice = tmp_path / "twice.tar"
    write_tar(twice, [("a.txt", b"1"), ("a.txt", b"2")])
    with pytest.raises(ValueError, match=r"'a\.txt' repeats extension 'txt' of sample 'a'"):
        list(TarReader()(str(twice)))


def test_arguments_are_checked_when_the_dataset_is_built(
    files: dict[str, list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for build, pattern in (
        (torchrepro.ShardedDataset.from_parquet, "data/*.parquet"),
        (torchrepro.ShardedDataset.from_tar, "data/*.tar"),
        (torchrepro.ShardedDataset.from_jsonl, "data/*.jsonl"),
    ):
        for single in ("data/a", Path("data/a")):
            with pytest.raises(
                TypeError, match=rf"needs a list of paths \(e\.g\. sorted\(glob\('{re.escape(pattern)}'\)\)\)"
            ):
                build(single)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"paths as str or os\.PathLike, got int 3"):
            build([3])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="no shards"):
            build([])
    with pytest.raises(ValueError, match=r"shard_by must be one of \['file', 'row_group'\], got 'rows'"):
        torchrepro.ShardedDataset.from_parquet(files["parquet"], shard_by="rows")
    with pytest.raises(TypeError, match=r"use \['id'\]"):
        torchrepro.ShardedDataset.from_parquet(files["parquet"], "id")
    with pytest.raises(TypeError, match="decode must map extensions"):
        torchrepro.ShardedDataset.from_tar(files["tar"], decode={"json": "json.loads"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="decode must be None, a dict"):
        torchrepro.ShardedDataset.from_tar(files["tar"], decode="json")  # type: ignore[arg-type]
    with pytest.raises(LookupError, match="utf-9"):
        torchrepro.ShardedDataset.from_jsonl(files["jsonl"], encoding="utf-9")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # pyarrow not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"needs pyarrow, .* `pip install torchrepro\[parquet\]`"):
        torchrepro.ShardedDataset.from_parquet(files["parquet"])


@pytest.mark.parametrize("kind", KINDS)
def test_the_readers_pickle(kind: str, files: dict[str, list[Path]]) -> None:
    """DataLoader workers started by spawn or forkserver get the dataset pickled."""
    decode = {"decode": {"json": json.loads, "txt": bytes.decode}} if kind == "tar" else {}
    ds = dataset(kind, files, **decode)
    again = pickle.loads(pickle.dumps(ds))
    assert type(again.read_shard) is type(ds.read_shard) and again.takes_start
    for shard in ds.shards[-2:]:
        assert plain(list(again.read_shard(shard, 1))) == plain(list(ds.read_shard(shard, 1)))


# -- through SeededLoader ------------------------------------------------------------------------------


def noisy(sample: dict[str, Any]) -> dict[str, Any]:
    """A tar decode that augments: its draw is keyed by the sample."""
    return {"key": sample["__key__"], "noise": torch.rand(2)}


@pytest.mark.parametrize("kind", ["parquet", "tar", "jsonl"])
def test_seeded_loader_batches_for_any_num_workers_and_a_resume(
    kind: str, files: dict[str, list[Path]]
) -> None:
    ds = dataset(kind, files, **({"decode": noisy} if kind == "tar" else {}))
    full = list(loader(ds))
    ids = [s["key"] if kind == "tar" else s["id"] for batch in full for s in batch]
    want = [s["__key__"] if kind == "tar" else s["id"] for s in expected(kind)]
    assert sorted(ids) == sorted(want) and ids != want  # every sample once, shuffled
    assert list(loader(ds, workers=2)) == full  # the same bits: draws made in workers included
    saver = loader(ds)
    it = iter(saver)
    for _ in range(3):
        next(it)
    state = saver.state_dict()
    resumed = loader(ds)
    resumed.load_state_dict(state)
    assert list(resumed) == full[3:]


@pytest.mark.usefixtures("rng_changes_ok")
def test_negative_control_a_plain_dataloader_depends_on_num_workers(files: dict[str, list[Path]]) -> None:
    ds = dataset("jsonl", files)
    ids = [
        [
            s["id"]
            for batch in DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=list)
            for s in batch
        ]
        for workers in (0, 2)
    ]
    assert ids[0] != ids[1]
    assert sorted(ids[0]) == sorted(ids[1])  # the same samples, in another order


def test_parquet_row_groups_know_their_lengths_from_the_metadata(files: dict[str, list[Path]]) -> None:
    """What a partitioned loader deals the shards by: each row group's row count, unread."""
    ds = dataset("parquet-row-groups", files)
    assert ds.lengths == [n for groups in GROUPS for n in groups]
    assert dataset("parquet", files).lengths is None  # files are opened only when read
