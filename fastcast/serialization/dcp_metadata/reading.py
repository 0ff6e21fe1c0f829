"""``read_metadata``: a DCP ``.metadata`` read with the restricted unpickler and converted,
or refused with a ``CheckpointMetadataError`` that describes the file. Nothing of it runs.
"""

from __future__ import annotations

import io

from torch.distributed.checkpoint import metadata as dcp_metadata

from ..pickle_model import describe_pickle, escape
from ..unpickling import _RestrictedUnpickler
from .converter import _Converter
from .stand_ins import METADATA_ALLOW_LIST


class CheckpointMetadataError(ValueError):
    """A DCP ``.metadata`` that fastcast refuses to read: not what DCP's writer pickles.
    Nothing of it was run."""


def read_metadata(data: bytes, where: str) -> dcp_metadata.Metadata:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file (``where`` names it in
    errors), read without running anything; a ``CheckpointMetadataError`` describing the
    file for anything DCP's writer would not have written."""
    # Described only once refused: the description's caps are sized for extra states, a
    # large sharded checkpoint's metadata holds millions of opcodes, and the restricted
    # unpickler runs nothing whatever the file holds.
    try:
        unpickled = _RestrictedUnpickler(io.BytesIO(data), METADATA_ALLOW_LIST).load()
        return _Converter().metadata(unpickled)
    except Exception as exc:  # noqa: BLE001 - every failure is a refusal, described
        problem = escape(str(exc)) or type(exc).__name__
    report = describe_pickle(data, METADATA_ALLOW_LIST)
    raise CheckpointMetadataError(
        f"{where}: refusing the checkpoint's metadata ({report}): {problem}. fastcast reads "
        "a DCP .metadata only as DCP's writer makes it and ran nothing of this one: it was "
        "not written by DCP, or was changed since"
    )
