"""``ElasticRLRendezvousHandler``: torch's ``RendezvousHandler`` with rounds decided on the coordinator.

One handler per torchrun agent. Its identity is a member of the run (``Membership``: member id
unique per agent, an incarnation handed out by the coordinator, a lease renewed from a thread).
``next_rendezvous`` repeats ``RoundJoin(after_round=<the last round this handler got>)`` until a
round that includes this incarnation completes, so an agent whose workers failed never gets its
old round back. ``num_nodes_waiting`` is answered from a watch stream cached by a second thread
(torchrun polls it every ``--monitor-interval``, 0.1 s by default) with ``policy.nodes_waiting``:
nodes waiting for a round plus members of the current round that are gone, which is what makes
torchrun restart the survivors right after an eviction.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elasticrl.config import COORDINATOR_ENV, IN_PLACE_ENV, TLS_CA_ENV, TOKEN_FILE_ENV
from elasticrl.coordinator import policy
from elasticrl.coordinator.client import CoordinatorClient, Membership, RunView, resolve_token
from elasticrl.coordinator.session_relay import ENV as RELAY_ENV
from elasticrl.coordinator.session_relay import FOR_ENV as RELAY_FOR_ENV
from elasticrl.coordinator.session_relay import RelayThread
from elasticrl.errors import (
    AuthError,
    CoordinatorTimeoutError,
    CoordinatorUnavailableError,
    ElasticRLError,
    FencedError,
    RunClosedError,
)
from elasticrl.owned_dirs import OwnedDir
from elasticrl.repeats import still_waiting
from elasticrl.rendezvous.config import BACKEND, RendezvousConfig
from elasticrl.rendezvous.store import CoordinatorStore
from elasticrl.rendezvous.worker import LEASE_TTL_ENV, ROUND_ENV, STOP_FILE_ENV, armed_key, take_stop_request

log = logging.getLogger(__name__)

# One RoundJoin call blocks at most this long; shorter than the client's cap so that a closed or
# fenced state is noticed between calls, too.
ROUND_WAIT_CHUNK_S = 5.0
# A node still waiting for its round after this long says so (what it waits for), and again as often.
WAIT_NOTE_S = 30.0
# An agent whose first join has not been answered this long says whom it waits for (a wrong
# --rdzv-endpoint, or a coordinator not up yet, is otherwise silent for connect_timeout).
CONNECT_NOTE_S = 5.0
# torchrun's exit barrier in the agents' store (torch.distributed.elastic.agent.server.api).
EXIT_BARRIER = "torchelastic/agent/terminal_state"
# How often a non-zero rank re-checks, while waiting for rank 0's MASTER_ADDR, that rank 0 lives.
BOOTSTRAP_POLL_S = 0.25


@contextlib.contextmanager
def rendezvous_errors(address: str, run_id: str):
    """Turn elasticrl errors into torch's rendezvous exception family, once, with a clear message."""
    try:
        yield
    except RendezvousError:
        raise
    except RunClosedError as exc:
        raise RendezvousClosedError(f"run {run_id!r} on coordinator {address} is closed: {exc}") from None
    except AuthError as exc:
        raise RendezvousConnectionError(str(exc)) from None
    except CoordinatorUnavailableError as exc:
        raise RendezvousConnectionError(
            f"{exc} (is `elasticrl coordinator` serving there? check --rdzv-endpoint=HOST:PORT)"
        ) from None
    except dist.DistNetworkError as exc:
        raise RendezvousConnectionError(str(exc)) from None
    except (CoordinatorTimeoutError, TimeoutError) as exc:
        raise RendezvousTimeoutError(f"run {run_id!r} on coordinator {address}: {exc}") from None
    except ElasticRLError as exc:
        raise RendezvousError(
            f"coordinator {address} refused a rendezvous request of run {run_id!r}: {type(exc).__name__}: {exc}"
        ) from None


class RunViewCache:
    """The latest ``RunView`` of one run, kept fresh by a daemon thread that consumes ``watch``."""

    def __init__(self, client: CoordinatorClient, run_id: str, on_view=None):
        self._client = client
        self._run_id = run_id
        self._on_view = on_view
        self._stop = threading.Event()
        self.view: RunView | None = None
        self._thread = threading.Thread(target=self._loop, name=f"elasticrl-rdzv-watch-{run_id}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for view in self._client.watch(self._run_id, stop=self._stop):
                    for kind, member, reason in view.events:
                        if kind in ("evicted", "left"):
                            log.info("run %s: %s %s (%s)", self._run_id, member, kind, reason)
                    if self._on_view is not None:  # first: it may decide how the view is read
                        self._on_view(view)
                    self.view = view
            except ElasticRLError as exc:
                if not self._stop.is_set():
                    log.warning("run %s: watch lost (%s); re-subscribing", self._run_id, exc)
            except Exception:  # noqa: BLE001 - the channel closing under us at shutdown
                if not self._stop.is_set():
                    log.exception("run %s: watch failed; re-subscribing", self._run_id)
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()


def export_to_workers(config: RendezvousConfig, environ=os.environ) -> None:
    """Hand the coordinator's address, token file and CA to the workers this agent starts (they
    inherit its environment), so ``-m elasticrl.node`` needs no second copy of them. What the
    user exported already wins."""
    environ.setdefault(COORDINATOR_ENV, config.endpoint)
    if config.token_file:
        environ.setdefault(TOKEN_FILE_ENV, os.path.abspath(config.token_file))
    if config.tls_ca:
        environ.setdefault(TLS_CA_ENV, os.path.abspath(config.tls_ca))
    if config.in_place:
        environ[IN_PLACE_ENV] = "1"


class ElasticRLRendezvousHandler(RendezvousHandler):
    """A torchrun agent's view of the run's rendezvous rounds, all decided by the coordinator."""

    def __init__(self, config: RendezvousConfig, *, client: CoordinatorClient | None = None):
        self.config = config
        if client is None:
            try:
                token = resolve_token(token_file=config.token_file)
            except OSError as exc:
                raise ValueError(f"token_file: cannot read {config.token_file!r}: {exc.strerror}") from None
            client = CoordinatorClient(
                config.endpoint,
                token=token,
                tls_ca=config.tls_ca,
                call_timeout_s=config.call_timeout_s,
                reconnect_timeout_s=config.connect_timeout_s,
            )
        self._client = client
        self._lock = threading.Lock()
        self._membership: Membership | None = None
        self._views: RunViewCache | None = None
        # The last round this handler took part in (0: none yet).
        self._round = 0
        self._closed_here = False
        self._shut_down = False
        self._stood_in: set[tuple[int, str]] = set()
        self._armed_round = 0  # the last round whose workers said they re-form in place
        self._left: set[str] = set()  # nodes seen leaving (not lost)
        self._relay: RelayThread | None = None
        self._round_size = 0  # the participants of self._round
        self._failed_once = ""  # the kind of failure a worker asked to stop for, restarted once (_stop_if_asked)
        # Where this agent's workers ask it to stop instead of restarting them (worker.request_stop),
        # in a directory of its own that the next agent on the host removes if this one is killed.
        self._stop_dir: OwnedDir | None = None
        try:
            self._stop_dir = OwnedDir("elasticrl-agent-", "torchrun agent directories")
        except OSError as exc:  # a full or read-only $TMPDIR: workers that fail for good are restarted as usual
            log.warning("no directory for the workers' stop requests (%s): a worker that fails for good is restarted "
                        "up to --max-restarts times", exc)

    @property
    def stop_file(self) -> str:
        """Where this agent's workers ask it to stop; "" when it has no directory for that."""
        return "" if self._stop_dir is None else os.path.join(self._stop_dir.path, "stop")

    @classmethod
    def from_params(cls, params) -> "ElasticRLRendezvousHandler":
        config = RendezvousConfig.from_params(params)
        export_to_workers(config)
        handler = cls(config)
        if handler.stop_file:
            os.environ[STOP_FILE_ENV] = handler.stop_file
        if config.session_relay and not os.environ.get(RELAY_ENV):
            handler._start_relay()
        return handler

    def _start_relay(self) -> None:
        """Run this node's session relay; the workers started next inherit its socket's path."""
        try:
            token = resolve_token(token_file=self.config.token_file)
            self._relay = RelayThread(self.config.endpoint, token=token, tls_ca=self.config.tls_ca)
        except (OSError, TimeoutError) as exc:
            log.warning("run %s: no session relay on this node (%s); workers stream to the coordinator directly",
                        self.config.run_id, exc)
            return
        os.environ[RELAY_ENV] = self._relay.path
        os.environ[RELAY_FOR_ENV] = self.config.endpoint
        log.info("run %s: session relay for this node's workers at %s", self.config.run_id, self._relay.path)

    # -- identity ----------------------------------------------------------------------------

    @property
    def member(self) -> Membership | None:
        return self._membership

    @property
    def round(self) -> int:
        return self._round

    def _ensure_member(self) -> Membership:
        """The live membership, joining (again, as a new incarnation) when there is none or it was fenced."""
        with self._lock:
            m = self._membership
            if m is not None and m.fenced is None:
                return m
            if m is not None:
                log.warning(
                    "run %s: %s incarnation %d was fenced (%s); joining again",
                    self.config.run_id, m.member_id, m.incarnation, m.fenced,
                )
                m.stop()
                self._membership = None
            cfg = self.config
            with still_waiting(CONNECT_NOTE_S, lambda: log.warning(
                    "run %s: waiting for the coordinator at %s (this node gives up after connect_timeout=%gs; check "
                    "--rdzv-endpoint and that the coordinator is up)", cfg.run_id, cfg.endpoint, cfg.connect_timeout_s)):
                m = Membership(
                    self._client,
                    cfg.run_id,
                    cfg.node_id,
                    lease_ttl_s=cfg.lease_ttl_s,
                    capabilities={"role": "torchrun-agent", "local_addr": cfg.local_addr or ""},
                    relay="",  # the agent streams on its own: its relay is for its workers
                )
            self._membership = m
            if self._views is None:
                self._views = RunViewCache(self._client, self.config.run_id, self._stand_in if self.config.in_place else None)
        log.info(
            "run %s: joined as %s incarnation %d (lease %.1fs) at coordinator %s",
            self.config.run_id, m.member_id, m.incarnation, m.lease_ttl_s, self.config.endpoint,
        )
        # Inherited by the workers started next: ``worker.restart_grace`` sizes its wait by it.
        os.environ[LEASE_TTL_ENV] = f"{m.lease_ttl_s:g}"
        return m

    def _drop_membership(self, m: Membership) -> None:
        with self._lock:
            m.stop()
            if self._membership is m:
                self._membership = None

    # -- RendezvousHandler ---------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        # Workers bootstrap their own TCPStore on the round's rank-0 host (MASTER_ADDR/PORT).
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and block until it completes with this node in it.

        Raises:
            RendezvousClosedError: the run was closed, or a worker of this node asked its agent to
                stop (``worker.request_stop``: it failed in a way restarts do not fix).
            RendezvousConnectionError: the coordinator is unreachable (after ``connect_timeout``)
                or refused the token.
            RendezvousTimeoutError: min nodes did not gather within ``join_timeout`` (a standby,
                waiting while the round is full and all of it runs, waits without it).
            RendezvousError: the coordinator rejected the request (e.g. a different ``--nnodes``).
        """
        cfg = self.config
        give_up = time.monotonic() + cfg.join_timeout_s + cfg.last_call_s
        standby = False
        note_at = time.monotonic() + WAIT_NOTE_S  # a round that gathers at once says nothing
        self._stop_if_asked()
        with rendezvous_errors(cfg.endpoint, cfg.run_id):
            while True:
                if self._closed_here:
                    raise RendezvousClosedError(f"run {cfg.run_id!r} was closed by this node")
                if self._shut_down:
                    raise RendezvousError(f"run {cfg.run_id!r}: this handler was shut down (it left the run)")
                m = self._ensure_member()
                left = give_up - time.monotonic()
                if left <= 0:
                    raise RendezvousTimeoutError(
                        f"run {cfg.run_id!r}: no round with this node completed within "
                        f"join_timeout={cfg.join_timeout_s:g}s (coordinator {cfg.endpoint})"
                    )
                try:
                    res = self._client.round_join(
                        cfg.run_id, m.member_id, m.incarnation,
                        min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes,
                        last_call_s=cfg.last_call_s, join_timeout_s=cfg.join_timeout_s,
                        rejoin_timeout_s=cfg.rejoin_timeout_s,
                        after_round=self._round, wait_s=min(ROUND_WAIT_CHUNK_S, max(0.05, left)),
                    )
                except FencedError as exc:
                    log.warning("run %s: %s incarnation %d fenced (%s); joining again", cfg.run_id, m.member_id, m.incarnation, exc)
                    self._drop_membership(m)
                    continue
                if res.status == "closed":
                    raise RendezvousClosedError(f"run {cfg.run_id!r} on coordinator {cfg.endpoint}: {res.reason}")
                if res.status == "timed_out":
                    raise RendezvousTimeoutError(
                        f"run {cfg.run_id!r}: {res.reason} (--nnodes={cfg.min_nodes}:{cfg.max_nodes}, "
                        f"coordinator {cfg.endpoint})"
                    )
                if res.status != "complete":
                    if res.standby:  # no join timeout while the full round runs (as c10d's redundant nodes)
                        if not standby:
                            log.info("run %s: %s is a standby: %s; it waits for a slot", cfg.run_id, m.member_id, res.reason)
                        give_up = time.monotonic() + cfg.join_timeout_s + cfg.last_call_s
                    elif time.monotonic() >= note_at:  # e.g. a survivor below --nnodes' minimum: say why it waits
                        log.warning("run %s: waiting for a round of at least %d node(s) (--nnodes=%d:%d): %s; this node "
                                 "gives up in %.0fs (join_timeout)", cfg.run_id, cfg.min_nodes, cfg.min_nodes, cfg.max_nodes,
                                 res.reason, give_up - time.monotonic())
                        note_at = time.monotonic() + WAIT_NOTE_S
                    standby = res.standby
                    continue
                store = CoordinatorStore(
                    self._client, cfg.run_id, f"torchrun/round-{res.round}/", timeout_s=cfg.read_timeout_s
                )
                self._round, self._round_size = res.round, len(res.participants)
                os.environ[ROUND_ENV] = str(res.round)  # for the workers this agent starts now
                bootstrap = self._bootstrap(res.round, res.rank, res.participants, store)
                if bootstrap is None:
                    continue  # rank 0 of that round died before publishing; form the next one
                log.info(
                    "run %s: round %d complete: rank %d of %d [%s]; workers' store at %s:%d",
                    cfg.run_id, res.round, res.rank, res.world_size, ", ".join(res.participants),
                    bootstrap.master_addr, bootstrap.master_port,
                )
                return RendezvousInfo(store, res.rank, res.world_size, bootstrap)

    def _stop_if_asked(self) -> None:
        """A worker of this node failed in a way restarts do not fix (``worker.request_stop``): end
        the agent (torchrun's exception; its ``shutdown()`` then leaves the run) at once, or when the
        same kind of failure comes back after one restart."""
        stop = take_stop_request(self.stop_file) if self.stop_file else None
        if stop is None:
            return
        cfg = self.config
        if not stop.at_once and stop.kind != self._failed_once:
            self._failed_once = stop.kind
            log.warning("run %s: a worker of %s failed (%s); restarting it once more: the same failure again stops "
                        "this node", cfg.run_id, cfg.node_id, stop.reason)
            return
        log.error("run %s: %s stops instead of restarting its workers: %s", cfg.run_id, cfg.node_id, stop.reason)
        self._check_in_at_exit()
        raise RendezvousClosedError(f"run {cfg.run_id!r}: node {cfg.node_id} stops, its worker failed in a way "
                                    f"restarts do not fix: {stop.reason}")

    def _check_in_at_exit(self) -> None:
        """in_place, the round armed: the others finish this round without this node, so check in
        at its exit barrier for it (as a survivor does for a lost node, ``_stand_in``, which skips
        a node that left): otherwise they would wait out torchrun's exit barrier timeout for it."""
        round_no = self._round
        if not self.config.in_place or round_no == 0 or not self._round_size:
            return
        try:
            if self._armed_round != round_no and self._client.kv_get(self.config.run_id, [armed_key(round_no)])[0] is None:
                return  # the workers do not watch their world: the other agents restart theirs
            store = CoordinatorStore(self._client, self.config.run_id, f"torchrun/round-{round_no}/",
                                     timeout_s=self.config.read_timeout_s)
            mine = self.config.node_id.encode()
            if store.compare_set(f"elasticrl/exit-stand-in/{self.config.node_id}", b"", mine) != mine:
                return  # a survivor checked in for it already
            if store.add(EXIT_BARRIER + "/num_members", 1) == self._round_size:
                store.set(EXIT_BARRIER + "/last_member", b"<val_ignored>")
        except Exception as exc:  # noqa: BLE001 - the others' exit barrier then times out instead
            log.warning("run %s: could not check in at round %d's exit barrier for this node: %s", self.config.run_id, round_no, exc)

    def _bootstrap(
        self, round_no: int, rank: int, participants: tuple[str, ...], store: CoordinatorStore
    ) -> RendezvousStoreInfo | None:
        """MASTER_ADDR/PORT of this round's rank-0 host; None if that node is gone before publishing."""
        if rank == 0:
            return RendezvousStoreInfo.build(0, store, self.config.local_addr)
        keys = [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]
        give_up = time.monotonic() + self.config.read_timeout_s
        while True:
            try:
                store.wait(keys, datetime.timedelta(seconds=BOOTSTRAP_POLL_S))
                return RendezvousStoreInfo.build(rank, store, self.config.local_addr)
            except dist.DistStoreError:
                pass  # not published yet
            view = self._views.view if self._views is not None else None
            if view is not None and (
                view.round.round > round_no or (view.round.round == round_no and participants[0] in view.round.lost)
            ):
                log.warning("run %s: rank 0 (%s) of round %d is gone; forming a new round", self.config.run_id, participants[0], round_no)
                return None
            if time.monotonic() > give_up:
                raise RendezvousTimeoutError(
                    f"run {self.config.run_id!r}: rank 0 ({participants[0]}) of round {round_no} did not "
                    f"publish the workers' store address within read_timeout={self.config.read_timeout_s:g}s"
                )

    def _stand_in(self, view: RunView) -> None:
        """in_place (the watch thread): check in at torchrun's exit barrier for every node lost from
        this agent's round, since the survivors finish without it. Exactly one survivor does it
        per lost node (a compare-and-set on the round's store); the last check-in opens the barrier."""
        r, round_no = view.round, self._round
        # A node that left did so after torchrun's exit barrier (its run is over); one that is this
        # node was evicted alive and its agent restarts and rejoins.
        self._left.update(member for kind, member, _ in view.events if kind == "left")
        lost = [n for n in r.lost if n not in self._left and n != self.config.node_id]
        if self._shut_down or round_no == 0 or r.round != round_no or not lost:
            return
        if self._armed_round != round_no:
            # Before this view is exposed to num_nodes_waiting (RunViewCache calls this first).
            try:
                if self._client.kv_get(self.config.run_id, [armed_key(round_no)])[0] is None:
                    return  # the workers do not watch their world yet: the agents restart them
            except ElasticRLError as exc:
                log.warning("run %s: could not read whether round %d re-forms in place (%s); restarting its workers",
                            self.config.run_id, round_no, exc)
                return
            self._armed_round = round_no
        store = CoordinatorStore(self._client, self.config.run_id, f"torchrun/round-{round_no}/",
                                 timeout_s=self.config.read_timeout_s)
        mine = self.config.node_id.encode()
        for node in lost:
            if (round_no, node) in self._stood_in:
                continue
            try:
                if store.compare_set(f"elasticrl/exit-stand-in/{node}", b"", mine) != mine:
                    self._stood_in.add((round_no, node))
                    continue  # another survivor did
                if store.add(EXIT_BARRIER + "/num_members", 1) == len(r.participants):
                    store.set(EXIT_BARRIER + "/last_member", b"<val_ignored>")
                self._stood_in.add((round_no, node))
                log.warning("run %s: node %s is gone from round %d (in_place: the others go on); checked in at the exit "
                            "barrier of round %d for it", self.config.run_id, node, round_no, round_no)
            except Exception as exc:  # noqa: BLE001 - the agents' exit barrier then times out instead
                log.warning("run %s: could not check in for lost node %s: %s", self.config.run_id, node, exc)

    def num_nodes_waiting(self) -> int:
        """Nodes that want the current round re-formed: waiting to join it, or gone from it.

        Read from the cached watch view: no remote call, so torchrun may poll it every 0.1 s.
        """
        m = self._membership
        if m is not None and m.fenced is not None:
            return 1  # this node itself was evicted: its workers must restart and rejoin
        view = self._views.view if self._views is not None else None
        if view is None or self._round == 0 or view.round.round < self._round:
            return 0  # nothing formed yet, or the cache has not seen our own round yet
        r = view.round
        # in_place, once the round's workers watch their world: a lost node is their business (they
        # re-form in place, or exit so that this agent restarts them); only nodes that join re-form
        # the round. Before that (a node lost while the workers start), the agents restart them.
        in_place = self.config.in_place and self._armed_round == self._round
        return policy.nodes_waiting(self._round, r.round, list(r.participants), list(r.waiting), list(r.lost),
                                    r.max_nodes, count_lost=not in_place)

    def get_run_id(self) -> str:
        return self.config.run_id

    def is_closed(self) -> bool:
        if self._closed_here:
            return True
        view = self._views.view if self._views is not None else None
        return bool(view is not None and view.closed)

    def set_closed(self) -> None:
        """Close the run for every node (``CloseRun``); nobody can rendezvous in it again."""
        with rendezvous_errors(self.config.endpoint, self.config.run_id):
            self._client.close_run(self.config.run_id, f"closed by torchrun agent {self.config.node_id}")
        self._closed_here = True

    def shutdown(self) -> bool:
        """This node leaves the run (its lease ends now); the run itself stays open for the others."""
        if self._shut_down:
            return True
        self._shut_down = True
        ok = True
        if self._views is not None:
            self._views.stop()
        m = self._membership
        if m is not None:
            try:
                m.leave("torchrun agent shut down")
                log.info("run %s: %s left", self.config.run_id, m.member_id)
            except ElasticRLError as exc:
                log.warning("run %s: leaving failed (%s); the lease will lapse on its own", self.config.run_id, exc)
                ok = False
        if self._stop_dir is not None:
            self._stop_dir.remove()
        if self.stop_file and os.environ.get(STOP_FILE_ENV) == self.stop_file:
            del os.environ[STOP_FILE_ENV]
        if self._relay is not None:
            self._relay.stop()
            if os.environ.get(RELAY_ENV) == self._relay.path:  # not for workers started later
                del os.environ[RELAY_ENV]
                os.environ.pop(RELAY_FOR_ENV, None)
        self._client.close()
        return ok
