"""DDP() itself starts each elastic generation in its own namespace of torchrun's agent store.

Found in review (issue 13): ``DDP().world()`` initialized the group with plain ``env://``, so
the example -- which, as the README's restart recipe shows, relies on ``DDP()`` alone -- met
every restarted generation under the same keys as the dead one; under ``torchrun
--max-restarts=3`` with a worker SIGKILLed mid-epoch, one launch in five here hung in the
restarted generation until the launch's own timeout (no error within DDP's 60 s). Only scripts
that called ``nnx_es.distributed.elastic.init_process_group`` themselves were safe.
"""

from __future__ import annotations

import json
import subprocess
import sys

from launch import REPO, env_for_ranks, free_port

_SCRIPT = r"""
import datetime, json, os, sys
import torch.distributed as dist
port = int(sys.argv[1])
agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=20),
                      wait_for_workers=False)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="3")
from nnx_es.distributed import DDP, shutdown
world = DDP(timeout_seconds=20).world()
keys = sorted(agent.list_keys())
shutdown(timeout_seconds=20)
print(json.dumps({"size": world.size, "keys": keys}))
"""


def test_ddp_starts_a_restarted_generation_in_its_own_namespace_of_the_agent_store() -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(free_port())], cwd=str(REPO), env=env_for_ranks(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["size"] == 1
    assert got["keys"], "the group published nothing in the agent's store"
    assert all(k.startswith("nnx_es/restart_3/") for k in got["keys"]), got["keys"]
