"""Starting a process group that survives ``torchrun --max-restarts`` (elastic restarts).

Under torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE=True``) every generation of workers
meets in the *same* TCPStore, the agent's, at the same ``MASTER_PORT``; ``init_process_group``
with ``env://`` keys the group's rendezvous the same way in every generation. A restarted
gloo rank can then read the address a killed rank of the previous generation published and
fail with ``Gloo connectFullMesh failed ... Connection refused`` (seen with torch 2.13 on
loopback, about one restart in two; pytorch/pytorch#167288 reports the same for NCCL).

:func:`rendezvous_store` gives each generation its own namespace of that store
(``nnx_es/restart_<TORCHELASTIC_RESTART_COUNT>/world_<WORLD_SIZE>/``), so a generation only ever
reads its own ranks' addresses. The world size is part of it because torchrun restarts the group
on a membership change (``--nnodes=MIN:MAX``, a node joining) without counting a restart
(``torch/distributed/elastic/agent/server/api.py``: ``num_nodes_waiting > 0`` restarts the workers
and leaves ``TORCHELASTIC_RESTART_COUNT`` as it was); such a restart only grows the group (a
failure, a node leaving included, counts as a restart), so no two generations share both values.
Outside an agent store (plain ``env://``, a first start, other launchers) it returns ``None`` and
the group starts as it always did.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

__all__ = ["init_process_group", "restart_count", "rendezvous_store"]


def restart_count() -> int:
    """How many times torchrun restarted this worker group (``TORCHELASTIC_RESTART_COUNT``; 0 when unset)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def rendezvous_store(timeout: datetime.timedelta, world_size: int) -> Any:
    """A store for ``init_process_group`` that no other generation of workers shares, or ``None``.

    Under torchrun's agent store: a client of the agent's TCPStore (``MASTER_ADDR`` /
    ``MASTER_PORT``) behind a ``PrefixStore`` named by the restart count and ``world_size``. Otherwise
    ``None`` (``init_process_group`` then reads ``env://`` itself).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    import torch.distributed as dist

    client = dist.TCPStore(addr, int(port), world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"nnx_es/restart_{restart_count()}/world_{int(world_size)}", client)


def init_process_group(backend: str, *, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """``torch.distributed.init_process_group`` on :func:`rendezvous_store` when there is one."""
    import torch.distributed as dist

    store = rendezvous_store(timeout, world_size)
    if store is None:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
