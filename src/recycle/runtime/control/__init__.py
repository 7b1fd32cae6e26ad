"""Node 0 and the node launchers: the coordinator's pure decisions, the supervisor that carries them out, worker
processes, liveness, reports, cluster roles and launch checks."""
