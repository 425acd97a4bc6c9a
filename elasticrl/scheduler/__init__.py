"""The rollout scheduler: iterations of tasks, pulled by engines over streams, sealed and sharded.

``state`` (dataclasses), ``policy`` (pure decisions), ``persist`` (SQLite tables beside the
coordinator's), ``store`` (safetensors shards), ``core`` (the engine on the coordinator's event
loop), ``service`` (the ``elasticrl.v1.Scheduler`` gRPC servicer), ``client`` (driver and trainer
calls) and ``worker`` (the engine side of the stream).
"""
