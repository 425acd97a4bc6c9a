"""Stamps every log record of a worker with its node, rank and iteration.

``WorkerLogContext`` is a ``logging.Filter`` installed on the worker's handler by the entry point
(library modules only call ``logging.getLogger(__name__)``); the loop updates ``iteration`` as it
goes, so a line from any module says where and when it was written.
"""

from __future__ import annotations

import logging
import os
import socket

NODE_NAME_ENV = "ELASTICRL_NODE_NAME"
FORMAT = "%(asctime)s %(levelname)s node=%(node)s rank=%(rank)s iter=%(iteration)s %(name)s: %(message)s"


def node_name() -> str:
    """This machine's name in logs: $ELASTICRL_NODE_NAME (set it where hosts share a name), else the hostname.

    Not torchrun's GROUP_RANK: that is reassigned every rendezvous round, so it cannot tell which
    machine a line came from after the group re-forms.
    """
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


class WorkerLogContext(logging.Filter):
    def __init__(self, node: int | str = "-", rank: int | str = "-"):
        super().__init__()
        self.node = node
        self.rank = rank
        self.iteration: int | str = "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.node, record.rank, record.iteration = self.node, self.rank, self.iteration
        return True

