"""Reading a checkpoint as data, never as code: `dtp.json`'s shape is checked field by field, DCP's
pickled `.metadata` goes through an unpickler that knows an exact list of (module, name) pairs, and
every entry it declares must be a tensor of the dtype and shape `dtp.json` records, stored in a file
of the checkpoint.

Why an exact list: pickle resolves dotted names (`os.system` through any module that imports `os`,
`torch.os.system`), so admitting a whole module admits everything reachable from it. Why tensors
only: DCP reads a `BytesStorageMetadata` entry with `torch.load(weights_only=False)`, which runs any
code the bytes name; dtp stores its plain data as uint8 tensors (dtp.checkpoint.optim_state.pack)
and never writes one. Tensor chunks themselves are read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta

from dtp.checkpoint.files import DCP_META, MARKER, CheckpointError, read_json, read_meta

MAX_DCP_META_BYTES = 256 << 20  # one entry per tensor chunk: ~250 bytes each
_LAYOUTS = {str(v): v for v in (torch.strided, torch.sparse_coo)}


def _layout(name: object) -> torch.layout:
    """Stands in for torch.serialization._get_layout: a layout from its name, and nothing else."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise CheckpointError(f"{DCP_META} names an unknown tensor layout {str(name)[:40]!r}")
    return _LAYOUTS[name]


_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_MD = "torch.distributed.checkpoint.metadata"
# Everything DCP's FileSystemWriter pickles into `.metadata` (found with pickletools on dtp's own
# checkpoints), by exact (module, qualified name). Each is a data class, an enum, torch.Size or a
# path: calling one builds a value and does nothing else. BytesStorageMetadata is deliberately
# absent.
ALLOWED: dict[tuple[str, str], Any] = {
    (_MD, "Metadata"): dcp_meta.Metadata,
    (_MD, "TensorStorageMetadata"): dcp_meta.TensorStorageMetadata,
    (_MD, "TensorProperties"): dcp_meta.TensorProperties,
    (_MD, "ChunkStorageMetadata"): dcp_meta.ChunkStorageMetadata,
    (_MD, "MetadataIndex"): dcp_meta.MetadataIndex,
    (_MD, "StorageMeta"): dcp_meta.StorageMeta,
    (_MD, "_MEM_FORMAT_ENCODING"): dcp_meta._MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): _layout,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): PosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
}


# the Python unpickler: its opcodes can be overridden, see BUILD
class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's `.metadata` admitting only the exact pairs of ALLOWED, nothing reachable
    through them."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        """The allowed object named (module, name); a CheckpointError for anything else."""
        found = ALLOWED.get((module, name))
        if found is None:
            raise CheckpointError(
                f"{DCP_META} refers to {str(module)[:80]}.{str(name)[:80]}, which DCP metadata "
                "never does; refusing to unpickle it (a checkpoint must not run code)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        """DCP's `.metadata` has no persistent ids; one is refused."""
        raise CheckpointError(f"{DCP_META} holds a persistent id, which DCP metadata never does")

    def _build(self) -> None:
        # BUILD sets attributes: on an allowed class (not an instance of one) it would rewrite that
        # class for the rest of the process.
        if isinstance(self.stack[-2], type) or callable(self.stack[-2]):
            raise CheckpointError(
                f"{DCP_META} sets attributes of {type(self.stack[-2]).__name__} "
                f"{getattr(self.stack[-2], '__name__', '')}, which DCP metadata never does"
            )
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build


def _fail(directory: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {directory} is corrupt or not dtp's: its {DCP_META} {why}; refusing to read it"
    )


def _is_size(value: Any, ndim: int | None = None) -> bool:
    return (
        isinstance(value, torch.Size)
        and (ndim is None or len(value) == ndim)
        and all(isinstance(n, int) and n >= 0 for n in value)
    )


def _check_entry(key: str, md: Any, shape: list[int], dtype: str, directory: Path) -> None:
    """A declared entry is a tensor of dtp.json's dtype and shape whose chunks lie inside it and
    cover it."""
    if not isinstance(md, dcp_meta.TensorStorageMetadata):  # BytesStorageMetadata among others
        raise _fail(
            directory,
            f"declares {key} as {type(md).__name__}; dtp stores tensors only "
            "(DCP would unpickle other entries with code execution)",
        )
    props = md.properties
    if (
        not isinstance(props, dcp_meta.TensorProperties)
        or props.dtype is not _DTYPES.get(dtype)
        or props.layout is not torch.strided
        or not _is_size(md.size, len(shape))
        or list(md.size) != shape
    ):
        raise _fail(
            directory,
            f"describes {key} as {getattr(props, 'dtype', '?')} "
            f"{list(md.size) if _is_size(md.size) else '?'}, its dtp.json as {dtype} {shape}",
        )
    if not isinstance(md.chunks, list):
        raise _fail(directory, f"gives {key} no list of chunks")
    volume = 0
    for chunk in md.chunks:
        ok = (
            isinstance(chunk, dcp_meta.ChunkStorageMetadata)
            and _is_size(chunk.offsets, len(shape))
            and _is_size(chunk.sizes, len(shape))
            and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, shape))
        )
        if not ok:
            raise _fail(directory, f"gives {key} a chunk outside its shape {shape}")
        volume += torch.Size(chunk.sizes).numel()
    if volume != torch.Size(shape).numel():
        raise _fail(
            directory, f"gives {key} chunks of {volume} elements, not {torch.Size(shape).numel()}"
        )


def _check_storage(md: Any, expected: set[str], files: dict[str, int], directory: Path) -> None:
    """Every stored chunk is a byte range of one of the checkpoint's own files, with no transform."""
    if not isinstance(md.storage_data, dict):
        raise _fail(directory, "has no table of stored chunks")
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_meta.MetadataIndex) or index.fqn not in expected:
            raise _fail(
                directory,
                f"stores a chunk of {getattr(index, 'fqn', '?')!s:.80}, which dtp.json does "
                "not declare",
            )
        ok = (
            isinstance(info, _StorageInfo)
            and isinstance(info.relative_path, str)
            and info.relative_path in files
            and info.relative_path.endswith(".distcp")
            and isinstance(info.offset, int)
            and isinstance(info.length, int)
            and 0 <= info.offset
            and 0 <= info.length
            and info.offset + info.length <= files[info.relative_path]
            and not info.transform_descriptors
        )
        if not ok:
            raise _fail(
                directory,
                f"stores a chunk of {index.fqn} outside the checkpoint's .distcp files "
                f"({str(getattr(info, 'relative_path', '?'))[:80]})",
            )


def load_dcp_metadata(directory: Path, meta: dict, files: dict[str, int]) -> dcp_meta.Metadata:
    """DCP's `.metadata` of `directory`, unpickled with MetadataUnpickler and checked against `meta`
    (its dtp.json, already schema-checked) and `files` (its files and sizes, from the completion
    marker)."""
    path = directory / DCP_META
    try:
        if path.stat().st_size > MAX_DCP_META_BYTES:
            raise _fail(directory, f"is larger than {MAX_DCP_META_BYTES >> 20} MiB")
        data = path.read_bytes()
    except OSError as err:
        raise _fail(directory, f"cannot be read ({err.strerror})") from None
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as err:
        raise CheckpointError(f"checkpoint {directory}: {err}") from None
    except (Exception, RecursionError) as err:  # noqa: BLE001 - a malformed pickle fails in many ways
        raise _fail(directory, f"is not a readable pickle ({type(err).__name__})") from None
    if not isinstance(metadata, dcp_meta.Metadata) or not isinstance(
        metadata.state_dict_metadata, dict
    ):
        raise _fail(directory, f"holds a {type(metadata).__name__}, not DCP's Metadata")
    expected = {k: (v["shape"], v["dtype"]) for k, v in meta["tensors"].items()}
    expected.update({k: ([n], "uint8") for k, n in meta["objects"].items()})
    declared = metadata.state_dict_metadata
    if set(declared) != set(expected):
        odd = sorted(map(str, set(declared) ^ set(expected)))
        raise _fail(
            directory,
            f"and its dtp.json disagree on which tensors it holds ({', '.join(odd[:4])[:300]})",
        )
    for key, md in declared.items():
        _check_entry(key, md, *expected[key], directory)
    _check_storage(metadata, set(expected), files, directory)
    if not isinstance(metadata.storage_meta, (dcp_meta.StorageMeta, type(None))):
        metadata.storage_meta = None
    # dtp's planners flatten the state dict themselves; this table is not needed
    metadata.planner_data = None
    return metadata


class SafeReader(FileSystemReader):
    """torch's FileSystemReader over a complete dtp checkpoint. Constructing it reads and checks
    `.metadata` as data only (dtp.checkpoint.untrusted: exactly the tensors of `dtp.json`), so a
    hostile checkpoint is a CheckpointError here, before DCP is called and reads any byte."""

    def __init__(self, path: str | Path, *args, **kwargs) -> None:
        super().__init__(path, *args, **kwargs)
        directory = Path(path)
        meta = read_meta(directory)
        self._metadata = load_dcp_metadata(
            directory, meta, read_json(directory / MARKER, "completion marker")["files"]
        )
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()

    def read_metadata(self, *args, **kwargs):
        """The checkpoint's DCP metadata, checked at construction (the top-level `.metadata` only)."""
        if hasattr(self, "load_id"):
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata
