"""The storage reader of ``fastcast.dcp``: DCP's ``FileSystemReader`` with the checkpoint's
``.metadata`` read by fastcast's restricted unpickler (DCP's own is ``pickle.load``).
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..serialization.dcp_metadata import CheckpointMetadataError, read_metadata

_METADATA_FILE = ".metadata"  # DCP's name for it (``__<rank>.metadata`` per rank)


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader``, reading the checkpoint's ``.metadata`` with fastcast's
    restricted unpickler instead of ``pickle.load``: only what DCP's writer pickles (its
    metadata dataclasses, ``torch.Size``, dtypes, plain containers) is read, and anything
    else is refused with a ``CheckpointMetadataError`` describing the file, nothing of it
    run. The rest is ``FileSystemReader``'s (tensors are read with
    ``torch.load(weights_only=True)``). For ``dcp.load`` called directly::

        dcp.load(sd, storage_reader=fastcast.dcp.SafeFileSystemReader(path),
                 planner=fastcast.dcp.LoadPlanner())

    (``LoadPlanner`` reads entries saved as bytes with the restricted unpickler too; DCP's
    default planner gives them to ``torch.load(weights_only=False)``.) A refused global
    ``.metadata`` is refused again when DCP falls back to a rank's own metadata file.
    """

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._refused: str | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._refused = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._refused is not None:
            raise CheckpointMetadataError(self._refused)
        rank = kwargs.get("rank")
        name = _METADATA_FILE if rank is None else f"__{rank}{_METADATA_FILE}"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        try:
            metadata = read_metadata(data, where=str(path))
        except CheckpointMetadataError as exc:
            self._refused = str(exc)
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


def _safe_reader(storage_reader: Any, checkpoint_id: Any) -> SafeFileSystemReader:
    """The reader ``load`` reads with: a ``SafeFileSystemReader`` of ``checkpoint_id``,
    or of the folder (and file system) of a ``FileSystemReader`` it is given."""
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("fastcast.dcp.load: give checkpoint_id or storage_reader")
        return SafeFileSystemReader(checkpoint_id)
    if isinstance(storage_reader, SafeFileSystemReader):
        return storage_reader
    if _reads_as_filesystem(storage_reader):
        # The same reader (its file system, folder, extensions), reading the metadata
        # safely; every other method is FileSystemReader's, the same as the original's.
        safe = SafeFileSystemReader.__new__(SafeFileSystemReader)
        safe.__dict__.update(vars(storage_reader))
        safe._refused = None
        return safe
    raise TypeError(
        f"fastcast.dcp.load: a {type(storage_reader).__qualname__} reads the checkpoint's "
        "metadata in its own way, which fastcast cannot vouch for; fastcast.dcp.load reads "
        "checkpoints of DCP's file-system writer (give checkpoint_id, a FileSystemReader, an "
        "FsspecReader or a fastcast.dcp.SafeFileSystemReader). To load with this reader "
        "anyway, call torch.distributed.checkpoint.load(..., storage_reader=reader, "
        "planner=fastcast.dcp.LoadPlanner()) yourself"
    )


def _reads_as_filesystem(reader: Any) -> bool:
    """Whether every method of ``reader`` is ``FileSystemReader``'s: its class is
    ``FileSystemReader`` or DCP's fsspec reader (which only sets up another file system)."""
    if type(reader) is FileSystemReader:
        return True
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: PLC0415
    except ImportError:  # fsspec is not installed
        return False
    return type(reader) is FsspecReader
