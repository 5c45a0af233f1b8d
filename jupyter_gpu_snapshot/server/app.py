"""The Jupyter server extension: REST API, job events, kernel environment, shutdown saves.

It is enabled by the ``jupyter_server_config.d/jupyter_gpu_snapshot.json`` data file that
the package installs; ``c.GPUSnapshot.*`` configures it (``jupyter_server_config.py`` or
``jupyter_gpu_snapshot_config.py``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import signal
import sys
import threading
import urllib.parse
from pathlib import Path

from jupyter_server.extension.application import ExtensionApp
from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.serverapp import ServerApp
from traitlets.config import Config

from .._constants import API_PREFIX
from ..agent_client.remote_engine import AgentEngine
from ..config import GPUSnapshot
from ..core.errors import SnapshotError
from ..core.estimate import SaveRates, learn_rates
from ..core.recovery import clean_work_dirs, recover_store
from ..core.remote import SnapshotCache
from ..core.store import SnapshotStore
from ..engines import process_engine, wake_kernel
from ..launch.provisioner import SnapshotReadyProvisioner
from ..remotes import make_remote_store
from .adoption import KernelRecord, adopt_orphans
from .autosave import AutosavePolicy, AutosaveScheduler
from .connections import HibernationAwareConnection
from .deaths import KERNEL_ACTIONS_EVENT_ID, KernelDeath, KernelDeaths
from .handlers import routes
from .hibernation import Hibernation
from .jobs import Job, JobRunner
from .remote_sync import RemoteSync
from .service import SnapshotService
from .shutdown import ShutdownReport, snapshot_kernels_on_shutdown

EVENT_SCHEMA = Path(__file__).parent / "event_schemas" / "job-v1.yaml"
JOB_EVENT_ID = "https://events.jupyter.org/jupyter_gpu_snapshot/job/v1"
DEATH_EVENT_SCHEMA = Path(__file__).parent / "event_schemas" / "kernel-death-v1.yaml"
DEATH_EVENT_ID = "https://events.jupyter.org/jupyter_gpu_snapshot/kernel-death/v1"
HIBERNATION_EVENT_SCHEMA = Path(__file__).parent / "event_schemas" / "hibernation-v1.yaml"
HIBERNATION_EVENT_ID = "https://events.jupyter.org/jupyter_gpu_snapshot/hibernation/v1"
# How long a stopping server waits to learn whether just-started kernels ran cells.
PROBE_WAIT_AT_SHUTDOWN = 5.0


def kernel_facing_url(serverapp: ServerApp) -> str:
    """The server's URL (base_url included) as a kernel on this host reaches it.

    A server listening on every address is reached over loopback, not its host name.
    """
    if serverapp.sock:
        return f"http+unix://{urllib.parse.quote(serverapp.sock, safe='')}{serverapp.base_url}"
    ip = serverapp.ip or "localhost"
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        address = None
    if address is not None and address.is_unspecified:
        ip = "::1" if address.version == 6 else "127.0.0.1"
    host = f"[{ip}]" if ":" in ip else ip
    scheme = "https" if serverapp.certfile else "http"
    return f"{scheme}://{host}:{serverapp.port}{serverapp.base_url}"


class GPUSnapshotApp(ExtensionApp):
    """Snapshots of the server's kernels, as a service of the server."""

    name = "jupyter_gpu_snapshot"
    # Should it be launched as the main app, the other enabled extensions load too.
    load_other_extensions = True
    classes = [*ExtensionApp.classes, GPUSnapshot, SnapshotReadyProvisioner]

    def _config_file_name_default(self) -> str:
        # c.GPUSnapshot may live in jupyter_gpu_snapshot_config.py as well.
        return "jupyter_gpu_snapshot_config"

    service: SnapshotService | None = None
    autosave: AutosaveScheduler | None = None
    hibernation: Hibernation | None = None
    gpu_settings: GPUSnapshot | None = None
    last_shutdown: ShutdownReport | None = None
    _stopping: asyncio.Future[None] | None = None
    _user_provisioner_config: dict[str, str] | None = None
    kernel_record: KernelRecord | None = None
    # Derives each kernel's credential; made per server start, kept in this process only.
    kernel_token_secret: str = ""

    def initialize_settings(self) -> None:
        """Called by ``ExtensionApp.initialize()`` when the server loads the extension."""
        assert self.serverapp is not None
        serverapp = self.serverapp
        self.gpu_settings = settings = GPUSnapshot(parent=self)
        self.kernel_token_secret = secrets.token_hex(32)
        engine = process_engine(settings)
        through_agent = isinstance(engine, AgentEngine)
        # Through the agent, the agent recovers the user's store; this one holds no snapshot.
        recovered = [] if through_agent else self._recover(engine.store)
        assert serverapp.event_logger is not None
        serverapp.event_logger.register_event_schema(EVENT_SCHEMA)
        serverapp.event_logger.register_event_schema(DEATH_EVENT_SCHEMA)
        serverapp.event_logger.register_event_schema(HIBERNATION_EVENT_SCHEMA)
        jobs = JobRunner(on_change=self._emit_job, log=self.log)
        self.service = SnapshotService(
            engine,
            settings,
            serverapp.kernel_manager,
            session_manager=serverapp.session_manager,
            contents_manager=serverapp.contents_manager,
            kernel_spec_manager=serverapp.kernel_spec_manager,
            jobs=jobs,
            log=self.log,
            remote=None if through_agent else self._remote_sync(engine.store),
        )
        if through_agent and settings.remote_url:
            self.log.error(
                "gpu-snapshot: snapshots go through the node agent, which keeps them on this "
                "node: c.GPUSnapshot.remote_url (%s) is not used", settings.remote_url)
        if self.service.remote is not None:
            # Saves that a killed server left committed here never uploaded: they owe it.
            for snapshot_id in recovered:
                self.service.remote.pending.mark(snapshot_id)
        self.autosave = AutosaveScheduler(self.service, settings, log=self.log)
        serverapp.event_logger.add_listener(
            modified=False, schema_id=KERNEL_ACTIONS_EVENT_ID,
            listener=self.autosave.on_kernel_action,
        )
        self.hibernation = Hibernation(
            self.service, settings, log=self.log, emit=self._emit_hibernation,
            hibernate_after=self._hibernate_after, release_gpu_after=self._release_gpu_after,
        )
        serverapp.event_logger.add_listener(
            modified=False, schema_id=KERNEL_ACTIONS_EVENT_ID,
            listener=self.hibernation.on_kernel_action,
        )
        HibernationAwareConnection.hibernation = self.hibernation
        self.service.hibernation_of = self.hibernation.describe
        self.service.wakes_from = self.hibernation.wakes_from
        self._watch_deaths(self.service)
        if settings.adopt_orphaned_kernels:
            # Made now, before the server takes requests: it records each kernel as it
            # starts, before the start is answered.
            self.kernel_record = KernelRecord(
                serverapp.kernel_manager, serverapp.session_manager, self.log
            )
        self._stop_on_sigint(serverapp)
        self._tell_kernels_where_we_are()
        self.log.info(
            "gpu-snapshot: API at %s%s/, snapshots in %s, snapshot on shutdown %s",
            serverapp.base_url,
            API_PREFIX,
            engine.location,
            "on" if settings.snapshot_on_shutdown else "off (c.GPUSnapshot.snapshot_on_shutdown)",
        )
        self.log.info("gpu-snapshot: %s", self._recovery_settings())

    def _stop_on_sigint(self, serverapp: ServerApp) -> None:
        """Stop on SIGINT as on SIGTERM when the server has no terminal to confirm it with.

        Without a terminal, jupyter_server leaves SIGINT to Python, whose KeyboardInterrupt
        ends the server without stopping its extensions: the kernels would not be saved.
        JupyterHub's LocalProcessSpawner stops servers with SIGINT first.
        """
        no_terminal = not (sys.stdin and sys.stdin.isatty())
        if (no_terminal and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, serverapp._signal_stop)

    async def _notebook_policy(self, kernel_id: str) -> AutosavePolicy:
        """The policy of the kernel's notebook: its own choices over the server's settings."""
        assert self.service is not None and self.autosave is not None
        notebook = await self.service.slots.notebook_path(kernel_id)
        return self.autosave.policy(self.autosave.policy_key(kernel_id, notebook))

    async def _hibernate_after(self, kernel_id: str) -> float:
        """Minutes of idleness after which the kernel hibernates in the process tier."""
        return (await self._notebook_policy(kernel_id)).hibernate_after_minutes

    async def _release_gpu_after(self, kernel_id: str) -> float:
        """Minutes of idleness after which the kernel releases its GPU (the gpu tier)."""
        return (await self._notebook_policy(kernel_id)).release_gpu_after_minutes

    def _link_jupyter_server_extension(self, serverapp: ServerApp) -> None:
        """Called before the server makes its web application: hibernated kernels need
        their clients' messages held (``connections``), unless the operator chose another
        websocket connection class (then only REST and the CLI wake them)."""
        super()._link_jupyter_server_extension(serverapp)
        chosen = "kernel_websocket_connection_class" in serverapp.config.get("ServerApp", {})
        # The same instance the server configures its gateway from, a little later.
        gateway = GatewayClient.instance(parent=serverapp)
        if not chosen and not gateway.gateway_enabled:
            serverapp.kernel_websocket_connection_class = HibernationAwareConnection

    def _watch_deaths(self, service: SnapshotService) -> None:
        """Follow every kernel that starts from now on (restored and adopted ones too),
        through jupyter_server's own kernel_actions events."""
        assert self.serverapp is not None and self.serverapp.event_logger is not None
        deaths = KernelDeaths(
            self.serverapp.kernel_manager, service.newest_snapshot, service.slots.notebook_path,
            self.log, on_death=self._emit_death,
        )
        service.deaths = deaths
        self.serverapp.event_logger.add_listener(
            modified=False, schema_id=KERNEL_ACTIONS_EVENT_ID, listener=deaths.on_kernel_action,
        )

    def _remote_sync(self, store: SnapshotStore) -> RemoteSync | None:
        """The remote store of ``c.GPUSnapshot.remote_url``, or None (none set, or unusable:
        then the server runs with local snapshots only and says why)."""
        settings = self.gpu_settings
        assert settings is not None
        try:
            remote = make_remote_store(settings)
        except (SnapshotError, ImportError, ValueError, OSError) as exc:
            self.log.error(
                "gpu-snapshot: the remote store %s cannot be used, snapshots stay on this "
                "node: %s", settings.remote_url, exc,
            )
            return None
        if remote is None:
            return None
        self.log.info("gpu-snapshot: snapshots are uploaded to %s%s", remote.url,
                      ", encrypted" if remote.key else "")
        cache = SnapshotCache(store, int(settings.remote_cache_max_bytes))
        return RemoteSync(remote, store, cache, log=self.log)

    def _recovery_settings(self) -> str:
        """One line for the start-up log: what a node loss or a stop would cost."""
        s = self.gpu_settings
        assert s is not None
        if s.autosave:
            autosave = (
                f"autosave every {s.autosave_interval_minutes:g} min of activity and after "
                f"cells of {s.autosave_after_cell_minutes:g} min or more, keeping "
                f"{s.autosave_keep} per notebook"
                + (", also during cells" if s.autosave_during_cell else "")
            )
        else:
            autosave = "autosave off"
        shutdown = (
            f"snapshots on shutdown within {s.shutdown_budget:g} s"
            if s.snapshot_on_shutdown else "no snapshots on shutdown"
        )
        return f"{autosave}; {shutdown}"

    async def save_rates(self) -> SaveRates:
        """The shutdown's save-time rates: configured, else learned from past saves."""
        assert self.service is not None and self.gpu_settings is not None
        s = self.gpu_settings
        learned = learn_rates(await self.service.list_snapshots())
        return SaveRates(
            gpu_rate=s.save_gpu_rate or learned.gpu_rate,
            image_rate=s.save_image_rate or learned.image_rate,
            fixed_seconds=s.save_fixed_seconds or learned.fixed_seconds,
            learned_from=learned.learned_from,
        )

    def _recover(self, store: SnapshotStore) -> list[str]:
        """Finish what saves killed with an earlier server left (see ``core.recovery``);
        returns the ids of the snapshots it committed.

        Runs before the server serves anything, so it may block.
        """
        report = recover_store(store, wake=wake_kernel)
        for snapshot in report.committed:
            self.log.warning(
                "gpu-snapshot: committed snapshot %s (%s), whose save was killed after its "
                "dump completed", snapshot.name, snapshot.id,
            )
        for path, why in report.kept:
            self.log.error("gpu-snapshot: kept %s aside: %s; delete it by hand", path, why)
        for pid in report.woken:
            self.log.info("gpu-snapshot: woke kernel tree %s after an interrupted save", pid)
        for path in [*report.removed, *clean_work_dirs()]:
            self.log.info("gpu-snapshot: removed stale working directory %s", path)
        return [snapshot.id for snapshot in report.committed]

    def initialize_handlers(self) -> None:
        """Called by ``ExtensionApp.initialize()`` after ``initialize_settings``."""
        assert self.service is not None and self.autosave is not None
        assert self.hibernation is not None
        self.handlers.extend(
            routes(self.service, self.autosave, self.hibernation)
        )

    async def _start_jupyter_server_extension(self, serverapp: ServerApp) -> None:
        """Called once the server listens: the port is final only now (port retries).

        Kernels that a killed server left running come back first, under their ids, so
        that the notebooks' sessions find them; then this server's record starts.
        """
        self._tell_kernels_where_we_are()
        if self.kernel_record is not None:
            await self._adopt_orphans(serverapp, self.kernel_record)
        if self.autosave is not None:
            self.autosave.start()
        if self.hibernation is not None:
            await self.hibernation.find_sleepers()
            self.hibernation.start()
        if self.service is not None and self.service.uploads is not None:
            # Snapshots whose upload did not complete before this start go up now.
            self.service.uploads.start_retries()

    async def _adopt_orphans(self, serverapp: ServerApp, record: KernelRecord) -> None:
        """Take back the kernels a killed server left running; then follow this server's.

        Each adopted kernel is in ``record`` before the dead server's record goes."""
        report = await adopt_orphans(serverapp.kernel_manager, serverapp.session_manager, self.log)
        for kernel_id in report.adopted:
            self.log.info("gpu-snapshot: adopted kernel %s, left running by a killed server",
                          kernel_id)
        for kernel_id in report.dead:
            self.log.info("gpu-snapshot: removed the connection file of dead kernel %s",
                          kernel_id)
        for kernel_id, why in report.failed.items():
            self.log.warning("gpu-snapshot: could not adopt kernel %s: %s", kernel_id, why)
        record.start()

    def _tell_kernels_where_we_are(self) -> None:
        """Hand the URL and token to the provisioner through the kernel manager's config.

        Kernel managers and their provisioners take their config from the server's kernel
        manager when a kernel starts, so kernels started from now on see these values.
        Values the user configured (c.SnapshotReadyProvisioner.server_url/server_token) win.
        """
        assert self.serverapp is not None
        serverapp = self.serverapp
        if self._user_provisioner_config is None:
            configured = serverapp.config.get("SnapshotReadyProvisioner", {})
            self._user_provisioner_config = {
                k: v for k, v in configured.items() if k in ("server_url", "server_token")
            }
        values = {
            "server_url": kernel_facing_url(serverapp),
            # Kernels get a credential of their own (kernel_token), never the server's token.
            "server_token": "",
            "kernel_token_secret": self.kernel_token_secret,
            **self._user_provisioner_config,
        }
        if "server_token" in self._user_provisioner_config:
            values["kernel_token_secret"] = ""  # the operator chose what kernels get
        serverapp.kernel_manager.update_config(Config({"SnapshotReadyProvisioner": values}))

    def _emit_job(self, job: Job) -> None:
        assert self.serverapp is not None and self.serverapp.event_logger is not None
        woke = job.kind in ("restore", "wake") and job.status == "succeeded"
        if woke and self.autosave is not None:
            self.autosave.note_restored(str(job.kernel_id))
        self.serverapp.event_logger.emit(schema_id=JOB_EVENT_ID, data=job.to_dict())

    def _emit_hibernation(self, data: dict[str, object]) -> None:
        assert self.serverapp is not None and self.serverapp.event_logger is not None
        self.serverapp.event_logger.emit(schema_id=HIBERNATION_EVENT_ID, data=data)

    def _emit_death(self, kernel_id: str, death: KernelDeath) -> None:
        assert self.serverapp is not None and self.serverapp.event_logger is not None
        self.serverapp.event_logger.emit(
            schema_id=DEATH_EVENT_ID, data={"kernel_id": kernel_id, **death.to_dict()}
        )

    def current_activity(self) -> list[str] | None:
        """Called by the server's idle shutdown: running jobs keep the server up."""
        if self.service is None:
            return None
        running = self.service.jobs.running()
        return [f"gpu-snapshot {j.kind} job {j.id}" for j in running] or None

    async def stop_extension(self) -> None:
        """Called by ``ServerApp._cleanup()`` before it shuts down all kernels.

        Running jobs get to finish; then, with ``snapshot_on_shutdown``, every
        snapshot-ready kernel is saved, all within ``shutdown_budget`` seconds. A second
        stop request while this runs (``jupyter server stop`` sends SIGTERM after 5 s)
        waits for the same work instead of starting it again.
        """
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._save_before_stop())
        await asyncio.shield(self._stopping)
        if self.kernel_record is not None:
            # The kernels stop with this server: nothing is left to adopt.
            self.kernel_record.stop()

    async def _save_before_stop(self) -> None:
        if self.service is None or self.gpu_settings is None:
            return
        if self.autosave is not None:
            await self.autosave.stop()
        budget = float(self.gpu_settings.shutdown_budget)
        deadline = asyncio.get_running_loop().time() + budget
        if self.hibernation is not None:
            await self.hibernation.stop()
            if self.gpu_settings.snapshot_on_shutdown:
                # Their state lives only in their process: awake, they can be saved. The
                # wakes (seconds each) come out of the same budget.
                await self.hibernation.wake_before_stop()
                budget = max(0.0, deadline - asyncio.get_running_loop().time())
        remote = self.service.remote
        if self.gpu_settings.snapshot_on_shutdown:
            if remote is not None:
                # Saving the kernels comes first: running uploads give up, and go again
                # after the saves.
                remote.stopping.set()
            rates = await self.save_rates()
            self.log.info("gpu-snapshot: shutdown save rates %s", rates.to_dict())
            if self.autosave is not None:
                await self.autosave.probes_settled(min(PROBE_WAIT_AT_SHUTDOWN, budget / 4))
            service = self.service
            self.last_shutdown = await snapshot_kernels_on_shutdown(
                service.kernel_manager,
                service.jobs,
                lambda kernel_id: service.start_save(kernel_id, stop=True, reason="shutdown"),
                service.kernel_size,
                budget,
                self.log,
                rates,
                work_at_risk=self.autosave.work_at_risk if self.autosave else None,
                newest_snapshot=self.autosave.newest_snapshot if self.autosave else None,
            )
            # Every kernel is saved locally first; uploads get what is left of the budget.
            uploads = service.uploads
            if uploads is not None:
                uploads.remote.stopping.clear()
                await uploads.upload_on_shutdown(
                    [*self.last_shutdown.saved.values(), *uploads.stopped_uploads()],
                    deadline - asyncio.get_running_loop().time(),
                )
        else:
            for job in await self.service.jobs.drain(budget):
                self.log.warning("gpu-snapshot: job %s still runs as the server stops", job.id)
        if remote is not None:
            remote.stopping.set()  # uploads still running give up
        if self.autosave is not None:
            self.autosave.close()
