"""Clusters of ipyparallel engines and DDP on them.

- ``labkit.cluster.engines``: start (local, Slurm, MPI launchers), connect, restart and stop;
- ``labkit.cluster.engine_watch``: registration by uuid, start-up failures, unreachable engines;
- ``labkit.cluster.network``: interface addresses, the default controller address, MPI exports;
- ``labkit.cluster.topology``: engines -> nodes -> ranks (one pure function), per-node calls;
- ``labkit.cluster.launch``: ``run_ddp`` on the engines, live metrics, failures, a stuck rank named;
- ``labkit.cluster.stuck``: the ranks' status files read: which rank the others wait for, its stack;
- ``labkit.cluster.resumable``: ``train_on_cluster``, ``run_ddp_resumable`` (restart, or elastic:
  ``labkit.cluster.elastic``);
- ``labkit.cluster.progress``: the progress bar over a run's steps, drawn here from its records.

The names notebooks use are re-exported here: ``from labkit import cluster as lc`` then
``lc.start_cluster(2)``, ``lc.run_ddp(client, fn)``, ``lc.stop_cluster(cluster)``.
"""

from labkit.cluster.engine_watch import EngineStartError, registered
from labkit.cluster.engines import (ENGINE_KINDS, connect_cluster, engine_logs, get_client, list_clusters,
                                    restart_engines, secure_connection_files, slurm_batch_template, start_cluster,
                                    stop_cluster)
from labkit.cluster.network import interface_address
from labkit.cluster.launch import DDPError, run_ddp
from labkit.cluster.progress import StepProgress, progress_bar
from labkit.cluster.resumable import run_ddp_resumable, train_on_cluster
from labkit.cluster.topology import (LOCAL_ID_ENVS, NODE_ENV, assign_ranks, engine_info, node_name, per_node,
                                     set_local_roots, set_node_names, tensor_parallel_groups)

__all__ = ["DDPError", "StepProgress", "ENGINE_KINDS", "EngineStartError", "interface_address", "registered",
           "LOCAL_ID_ENVS", "NODE_ENV", "assign_ranks", "connect_cluster", "engine_info",
           "engine_logs", "get_client", "list_clusters", "node_name", "per_node", "progress_bar", "restart_engines",
           "run_ddp", "run_ddp_resumable", "secure_connection_files", "set_local_roots", "set_node_names", "slurm_batch_template",
           "start_cluster", "stop_cluster", "tensor_parallel_groups", "train_on_cluster"]
