"""User datasets: local data files read into validated rows, a held-out eval split, and a resumable stream.

See ``elasticrl.data.dataset`` for the file formats, the row checks and the numbering used in
error messages.
"""

from elasticrl.data.dataset import (
    MAX_ROW_BYTES,
    MESSAGE_ROLES,
    DatasetError,
    RowStream,
    describe,
    load_rows,
    split_eval,
)

__all__ = ["MAX_ROW_BYTES", "MESSAGE_ROLES", "DatasetError", "RowStream", "describe", "load_rows", "split_eval"]
