"""Parquet and Arrow sources: the documents of one text column, read a slice at a time.

- Parquet (``*.parquet``, e.g. FineWeb or The Stack shards): read with pyarrow one row
  group at a time, only the text column. A row group is the unit the parallel tokeniser
  hands a worker (``build.py``), so memory holds a few row groups whatever the file size.
- Arrow: the ``data-*.arrow`` files of a folder written by ``datasets``'
  ``save_to_disk`` (Arrow IPC stream format; the IPC file format is read too). Memory-mapped,
  so counting and skipping record batches reads no text; a run of batches is one unit.

The ``datasets`` package is not needed: the files are read with pyarrow, as ``datasets``
itself reads them. ``None`` values in the column are skipped, like empty documents.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from plait.errors import DataError

# Arrow record batches are grouped into units of about this many bytes of column data.
ARROW_UNIT_BYTES = 16 << 20
# Rows per pyarrow batch when reading a row group (bounds the Python strings alive at once).
READ_ROWS = 1024


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # a declared dependency: only a broken install gets here
        raise DataError("reading Parquet or Arrow needs the pyarrow package: pip install pyarrow")
    return pa, pq


def _check_column(schema, column: str, shown: str) -> None:
    pa, _ = _pa()
    names = schema.names
    if column not in names:
        have = ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
        raise DataError(
            f"--text-column {column}: {shown} has no such column (it has {have}); "
            "pass --text-column NAME"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):  # fmt: skip
        raise DataError(
            f"--text-column {column}: in {shown} it holds {kind}, not text; "
            "pass the column with the documents"
        )


def parquet_units(path: Path, column: str, shown: str) -> list[tuple[int, int]]:
    """(row group, uncompressed bytes) of each row group; DataError (one line) when the
    file is not Parquet or has no text column ``column``."""
    _, pq = _pa()
    try:
        meta = pq.ParquetFile(path).metadata
        schema = meta.schema.to_arrow_schema()
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DataError(f"--data {shown}: not a readable Parquet file ({_reason(e)})")
    _check_column(schema, column, shown)
    return [(i, meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)]


def parquet_texts(path: Path, column: str, row_group: int, shown: str) -> Iterator[str]:
    """The non-null values of ``column`` in row group ``row_group``, in row order."""
    _, pq = _pa()
    try:
        f = pq.ParquetFile(path)
        for batch in f.iter_batches(batch_size=READ_ROWS, row_groups=[row_group],
                                    columns=[column]):  # fmt: skip
            yield from (t for t in batch.column(0).to_pylist() if t is not None)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"--data {shown}: row group {row_group} is damaged ({_reason(e)})")


def arrow_units(path: Path, column: str, shown: str) -> list[tuple[int, int, int]]:
    """(first batch, end batch, bytes) of runs of record batches of about ARROW_UNIT_BYTES."""
    pa, _ = _pa()
    units, start, size, n = [], 0, 0, 0
    with _arrow_batches(path, shown) as (schema, batches):
        _check_column(schema, column, shown)
        try:
            for n, batch in enumerate(batches, start=1):
                size += batch.column(column).nbytes
                if size >= ARROW_UNIT_BYTES:
                    units.append((start, n, size))
                    start, size = n, 0
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"--data {shown}: record batch {n} is damaged ({_reason(e)})")
    if n > start:
        units.append((start, n, size))
    return units


def arrow_texts(path: Path, column: str, start: int, stop: int, shown: str) -> Iterator[str]:
    """The non-null values of ``column`` in record batches [start, stop)."""
    with _arrow_batches(path, shown) as (_, batches):
        for i, batch in enumerate(batches):
            if i >= stop:
                break
            if i >= start:
                yield from (t for t in batch.column(column).to_pylist() if t is not None)


class _arrow_batches:
    """``with _arrow_batches(path, shown) as (schema, batches)``: a memory-mapped Arrow IPC
    stream (what ``save_to_disk`` writes) or IPC file."""

    def __init__(self, path: Path, shown: str):
        self.path, self.shown = path, shown

    def __enter__(self):
        pa, _ = _pa()
        try:
            self.source = pa.memory_map(str(self.path))
        except OSError as e:
            raise DataError(f"--data {self.shown}: cannot read it ({_reason(e)})")
        try:
            reader = pa.ipc.open_stream(self.source)
            return reader.schema, iter(reader)
        except pa.ArrowInvalid:
            pass
        try:
            reader = pa.ipc.open_file(self.source)
            return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid as e:
            self.source.close()
            raise DataError(f"--data {self.shown}: not an Arrow IPC file ({_reason(e)})")

    def __exit__(self, *exc) -> None:
        self.source.close()


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
