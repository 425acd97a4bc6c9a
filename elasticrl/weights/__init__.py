"""Policy weights that bypass the coordinator: a relay between peers.

* ``directory``: the coordinator's side, metadata only: the newest version of each run, who holds
  it, and whom a worker should fetch it from (a pipeline: each new fetcher reads behind the
  holder with the fewest readers, so K fetchers form a chain trainer -> w1 -> w2 -> ...).
* ``peer``: every process's side: a small TCP server that serves the versions this process holds
  (also while it is still receiving one), and the fetch that asks the directory for a source,
  reads from it, resumes from another source when one dies, and checks the sha256.
"""
