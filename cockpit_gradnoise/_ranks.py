"""Which process this is under distributed training, without importing torch.

:func:`is_writer` decides which process writes logs and figures. It is read
by the stored log and the views, which import no torch: ``torch.distributed``
is looked up in ``sys.modules``, so where torch was never imported (reading
logs, the command line) nothing is imported and nothing communicates.
"""

import sys
from typing import Optional

#: The process that writes logs and figures by default.
WRITER_RANK = 0


def process_group():
    """``torch.distributed`` when a default process group is initialised, else ``None``.

    Looked up in ``sys.modules``: where torch was never imported, no process
    group can exist, and nothing is imported to find that out.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def world_size() -> int:
    """Number of processes in the default group; 1 outside distributed training."""
    dist = process_group()
    return 1 if dist is None else dist.get_world_size()


def rank() -> int:
    """This process's rank in the default group; 0 outside distributed training."""
    dist = process_group()
    return 0 if dist is None else dist.get_rank()


def is_writer(writer_rank: Optional[int] = WRITER_RANK) -> bool:
    """Whether this process writes logs and figures.

    Args:
        writer_rank: The rank that writes (default 0), or ``None`` for every
            process (then give each its own path).

    Returns:
        ``True`` outside distributed training, on rank ``writer_rank``, or
        everywhere when ``writer_rank`` is ``None``.
    """
    return writer_rank is None or rank() == writer_rank
