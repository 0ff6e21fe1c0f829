"""Loading ``fc.Linear`` state with torch.distributed.checkpoint (DCP), whatever its
layout, without running anything the checkpoint holds (docs/loads.md, docs/security.md)::

    import fastcast.dcp

    sd = {"model": model.state_dict()}
    fastcast.dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])

For ``dcp.load`` called directly, pass both ``storage_reader=SafeFileSystemReader(path)``
and ``planner=LoadPlanner()``: DCP reads the metadata before any planner runs.
``import fastcast`` does not import this package (it imports DCP).
"""

from ..serialization.dcp_metadata import CheckpointMetadataError
from .fitting import fit_extra_states
from .loading import CheckpointLoadError, CheckpointMismatchError, load
from .planner import LoadPlanner
from .reader import SafeFileSystemReader

__all__ = [
    "CheckpointLoadError",
    "CheckpointMetadataError",
    "CheckpointMismatchError",
    "LoadPlanner",
    "SafeFileSystemReader",
    "fit_extra_states",
    "load",
]
