"""Parquet and Arrow IPC (Feather v2) files: a named text column read one row group / record batch at a time.

pyarrow is used directly (no `datasets`): it streams a column by row group (Parquet) or record batch (memory-
mapped IPC), which is all preparation needs, without `datasets`' own cache and dependency tree. IPC files in the
stream format (the `data-*.arrow` shards `datasets.save_to_disk` writes) are read too, as one part per file.
Memory holds the text column of one Parquet row group or IPC record batch at a time (other columns are neither
read nor decompressed), never a whole file.
Nulls and empty strings are skipped; invalid UTF-8 (in string or binary columns) is decoded with replacement.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from mtpjax.data.errors import DataError
from mtpjax.errors import first_line

PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_READ_ROWS = 8192  # rows per record batch read from a Parquet row group


def _is_text(tp) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(tp):
        tp = tp.value_type
    return any(f(tp) for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                               pa.types.is_large_binary, pa.types.is_string_view, pa.types.is_binary_view))


def _check_column(schema, field: str, f: Path) -> None:
    if field not in schema.names:
        shown = ", ".join(schema.names[:8]) + (", ..." if len(schema.names) > 8 else "")
        raise DataError(f"'{f}' has no column '{field}' (columns: {shown}); set data.text_field to its text column")
    tp = schema.field(field).type
    if not _is_text(tp):
        raise DataError(f"column '{field}' of '{f}' holds {tp}, not text; set data.text_field to a string column")


def _ipc_reader(f: Path, src, field: str):
    """(reader of the text column alone, is_file_format) of an Arrow IPC file, random-access format first."""
    import pyarrow as pa

    error = None
    for opener, random_access in ((pa.ipc.open_file, True), (pa.ipc.open_stream, False)):
        try:
            src.seek(0)
            schema = opener(src).schema
        except (pa.ArrowInvalid, OSError) as e:
            error = e
            continue
        _check_column(schema, field, f)
        src.seek(0)  # other columns are never read (nor decompressed)
        options = pa.ipc.IpcReadOptions(included_fields=[schema.get_field_index(field)])
        return opener(src, options=options), random_access
    raise DataError(f"'{f}' is not a readable Arrow IPC / Feather v2 file ({first_line(error)}); "
                    "write it with pyarrow.feather.write_feather or pyarrow.ipc")


def parts(f: Path, kind: str, field: str) -> list[tuple[int, int, int]]:
    """(part index, first row, bytes) of each part of a file, after checking its text column; DataError if
    unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        try:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"'{f}' is not a readable Parquet file ({first_line(e)}); check the file or "
                            "remove it from data.paths") from None
        _check_column(schema, field, f)
        out, row = [], 0
        for i in range(meta.num_row_groups):
            rg = meta.row_group(i)
            size = sum(rg.column(j).total_compressed_size for j in range(rg.num_columns)
                       if rg.column(j).path_in_schema == field) or rg.total_byte_size
            out.append((i, row, int(size)))
            row += rg.num_rows
        return out
    with pa.memory_map(str(f)) as src:
        reader, random_access = _ipc_reader(f, src, field)
        if not random_access:
            return [(-1, 0, f.stat().st_size)]
        out, row = [], 0
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            out.append((i, row, int(batch.nbytes)))
            row += batch.num_rows
        return out


def _texts(col, decode) -> list[str | None]:
    """Python strings (None for nulls) of a text column chunk; invalid UTF-8 goes through `decode`."""
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if not (pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type) or pa.types.is_binary_view(col.type)):
        try:
            return col.to_pylist()
        except UnicodeDecodeError:  # a string column holding invalid UTF-8: decode value by value
            col = col.cast(pa.large_binary() if pa.types.is_large_string(col.type) else pa.binary())
    return [None if v is None else decode(v) for v in col.to_pylist()]


def _batches(f: Path, kind: str, part: int, field: str) -> Iterator:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            yield from (b.column(0) for b in pq.ParquetFile(f).iter_batches(
                batch_size=_READ_ROWS, row_groups=[part], columns=[field], use_threads=False))
            return
        with pa.memory_map(str(f)) as src:
            reader, random_access = _ipc_reader(f, src, field)
            yield from (b.column(0) for b in ([reader.get_batch(part)] if random_access else reader))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"'{f}' could not be read ({first_line(e)}); check the file or remove it from "
                        "data.paths") from None


def read_part(f: Path, key: str, kind: str, part: int, first_row: int, field: str, decode) -> Iterator[tuple[str, str]]:
    """(key:row, text) of every non-null, non-empty row of one part (rows numbered from 1 in the file)."""
    row = first_row
    for col in _batches(f, kind, part, field):
        for text in _texts(col, decode):
            row += 1
            if text:
                yield f"{key}:{row}", text
