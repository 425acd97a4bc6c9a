"""The coordinator: membership with leases, leased barriers, KV, rendezvous rounds, durable state.

Layers, innermost first: ``state`` (dataclasses), ``policy`` (pure decisions of state and time),
``persist`` (SQLite), ``core`` (applies decisions, owns waits), ``service`` (gRPC servicer:
validation and conversion), ``server`` (process, auth, TLS, health), ``client`` (sync client).
"""
