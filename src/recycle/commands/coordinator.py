"""`recycle coordinator`: the job's store and coordinator in a process of their own, running no worker (a CPU head
node, a Kubernetes Service pod, the SLURM batch host); every training node runs `recycle train --coordinator
separate` against it."""

from __future__ import annotations

import argparse

from recycle.commands import train
from recycle.errors import ConfigError

__all__ = ["register", "run"]

# Flags that act on a node's own workers: they go to `recycle train` on the training nodes.
_NODE_FLAGS = (("inject", "--inject"), ("chaos", "--chaos"), ("respawn_after", "--respawn-after"),
               ("emulate_costs", "--emulate-costs"))


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("coordinator", help="run the job's store and coordinator alone, for training nodes "
                              "started with `recycle train --coordinator separate`", description=__doc__)
    train.add_job_options(p)
    train.add_recovery_options(p)
    train.add_cluster_options(p, coordinator=True)
    train.add_model_options(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    for name, flag in _NODE_FLAGS:
        if getattr(args, name, None):
            raise ConfigError(f"{flag} acts on a node's own workers, and `recycle coordinator` runs none; give it to "
                              "`recycle train` on the training nodes instead")
    args.node_rank, args.coordinator, args.start_method = 0, None, "spawn"
    return train.run_job(args, "self")
