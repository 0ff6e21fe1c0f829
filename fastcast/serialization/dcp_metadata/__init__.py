"""Reading a DCP checkpoint's ``.metadata`` and byte entries without running them: DCP's
own reader is ``pickle.load``. Only ``fastcast.dcp`` imports this package (it imports
``torch.distributed.checkpoint``).
"""

from .entries import ENTRY_ALLOW_LIST, load_entry
from .reading import CheckpointMetadataError, read_metadata
from .stand_ins import METADATA_ALLOW_LIST

__all__ = [
    "ENTRY_ALLOW_LIST",
    "METADATA_ALLOW_LIST",
    "CheckpointMetadataError",
    "load_entry",
    "read_metadata",
]
