"""The torchrun rendezvous plugin: stock ``torchrun`` forms its worker groups through the coordinator.

::

    elasticrl coordinator --port 50051
    torchrun --nnodes=2:4 --nproc-per-node=N --max-restarts=5 --rdzv-backend=elasticrl \\
        --rdzv-endpoint=HOST:50051 --rdzv-id=RUN [--rdzv-conf=key=value,...] -m elasticrl.node ...

torch (>= 2.6) finds the backend through the ``torchrun.handlers`` entry point ``elasticrl =
elasticrl.rendezvous:handler_factory`` (setup.cfg). Each torchrun agent is one member of the run
(its own lease, kept alive from a thread); rounds are decided on the coordinator (min/max nodes
from ``--nnodes``, a last-call window, a join timeout, ranks kept stable across rounds), and the
agent's ``num_nodes_waiting()`` counts both nodes waiting to join and members of the current round
that the coordinator evicted, so survivors are restarted about a second after a node dies, without
spending ``--max-restarts``. The store handed to the agent lives in the coordinator's KV, one key
prefix per round, and the workers' ``MASTER_ADDR``/``MASTER_PORT`` point at the new round's rank 0,
so no node is special: killing any one, including the one that held rank 0, leaves the others able
to re-form.

``--rdzv-conf`` keys (durations in seconds, decimals allowed):

==================  ==========  ============================================================
key                 default     meaning
==================  ==========  ============================================================
last_call_timeout   2           after min nodes joined a round, wait this long for more
join_timeout        600         a round that has not reached min nodes by then fails
                                (RendezvousTimeoutError); also bounds one next_rendezvous(),
                                except for a standby (the round full and all of it running)
rejoin_timeout      30          after a failure, hold the new round (past the last call) this
                                long for agents of the previous round that are alive but
                                still stopping their workers; 0: do not hold
lease_ttl           (server)    this agent's lease; silent this long -> evicted. Default: the
                                coordinator's ``--lease-ttl``
read_timeout        60          default timeout of the agent store's blocking get/wait
token_file          (none)      file whose first line is the coordinator's shared token;
                                without it, the token itself from $ELASTICRL_TOKEN
tls_ca              (none)      PEM CA bundle: talk TLS to the coordinator
node_id             HOST-PID    member id of this agent; set it to keep a node's identity
                                (and rank) across agent restarts
call_timeout        10          deadline of one coordinator call
connect_timeout     30          how long an unreachable coordinator is retried before
                                RendezvousConnectionError
in_place            false       a lost node does not restart the survivors' workers once
                                they watch their world (they say so in the coordinator's
                                KV): they re-form it in place (``elasticrl.train.reform``;
                                DDP on gloo), or exit at once so torchrun restarts them.
                                Only for ``-m elasticrl.node`` workers
session_relay       true        the agent runs its node's session relay and its workers'
                                ``Membership`` streams go through it: one Session stream per
                                node to the coordinator, not one per worker
                                (``elasticrl.coordinator.session_relay``)
==================  ==========  ============================================================

Errors come as torch's family: ``RendezvousConnectionError`` (coordinator unreachable after the
retries, with its address, or the token was refused), ``RendezvousClosedError`` (the run was
closed: ``elasticrl close-run RUN`` or ``set_closed()``), ``RendezvousTimeoutError`` and
``RendezvousError`` for a rejected request (e.g. nodes disagree on ``--nnodes``).

Workers: on localhost (and often across hosts) a dead peer makes the survivors' collectives fail
within milliseconds, before its lease lapses; torchrun would then restart them through the
``--max-restarts`` budget. Wrapping the worker's main loop in
``elasticrl.rendezvous.worker.restart_grace()`` parks a failed worker for a moment so the
membership-driven restart wins and the budget is kept for real failures.

This module imports nothing heavy: torch imports it whenever ``torch.distributed.elastic.rendezvous``
is imported, so the handler and its dependencies load only when torchrun asks for one.
"""

from __future__ import annotations

MIN_TORCH = (2, 6)


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch() -> None:
    """Raise RuntimeError naming the minimum when this torch cannot load out-of-tree handlers."""
    found = _torch_version()
    if found < MIN_TORCH:
        import torch

        need = ".".join(map(str, MIN_TORCH))
        raise RuntimeError(
            f"the elasticrl torchrun rendezvous backend needs torch >= {need} (for the "
            f"'torchrun.handlers' entry point); found torch {torch.__version__}. "
            f"Upgrade with: pip install 'torch>={need}'"
        )


def create_handler(params):
    """``RendezvousHandlerCreator``: build the handler for one torchrun agent from its parameters."""
    check_torch()
    from elasticrl.rendezvous.handler import ElasticRLRendezvousHandler

    return ElasticRLRendezvousHandler.from_params(params)


def handler_factory():
    """The ``torchrun.handlers`` entry point: torch calls it with no arguments and registers the
    creator it returns under the name ``elasticrl``. Always the same function object, so a second
    registration is a no-op rather than a conflict."""
    check_torch()
    return create_handler


__all__ = ["MIN_TORCH", "check_torch", "create_handler", "handler_factory"]
