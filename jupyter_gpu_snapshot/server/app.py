"""The Jupyter server extension: REST API, job events, kernel environment, shutdown saves.

It is enabled by the ``jupyter_server_config.d/jupyter_gpu_snapshot.json`` data file that
the package installs; ``c.GPUSnapshot.*`` configures it (``jupyter_server_config.py`` or
``jupyter_gpu_snapshot_config.py``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import sys
import threading
import urllib.parse

from jupyter_server.extension.application import ExtensionApp
from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.serverapp import ServerApp
from traitlets.config import Config

from .._constants import API_PREFIX
from ..config import GPUSnapshot
from ..core.estimate import SaveRates
from ..launch.provisioner import SnapshotReadyProvisioner
from .adoption import KernelRecord, adopt_orphans
from .connections import HIBERNATION_SETTING, HibernationAwareConnection
from .handlers import routes
from .jupyter_server_internals import stop_signal_handler
from .shutdown import ShutdownReport, snapshot_kernels_on_shutdown
from .wiring import ServerParts, build_server_parts

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

    # The extension's objects, made by ``initialize_settings``; ``parts`` reads them.
    _parts: ServerParts | None = None
    # The stop's saves, once ``stop_extension`` has started them; its result is
    # ``last_shutdown``.
    _stopping: asyncio.Future[ShutdownReport | None] | None = None

    @property
    def parts(self) -> ServerParts:
        """The extension's objects (``wiring.ServerParts``)."""
        if self._parts is None:
            raise RuntimeError(
                "gpu-snapshot: the extension's objects are made when the server loads it "
                "(GPUSnapshotApp.initialize_settings), which has not happened"
            )
        return self._parts

    @property
    def last_shutdown(self) -> ShutdownReport | None:
        """What the saves of the stop did (with ``snapshot_on_shutdown``), once it is done."""
        stopping = self._stopping
        if stopping is None or not stopping.done() or stopping.cancelled():
            return None
        return None if stopping.exception() is not None else stopping.result()

    def initialize_settings(self) -> None:
        """Called by ``ExtensionApp.initialize()`` when the server loads the extension, once
        the server has made its web application (``_prepare_settings``): what goes into
        ``self.settings`` here reaches the web application's settings, which every handler
        reads."""
        assert self.serverapp is not None
        serverapp = self.serverapp
        self._parts = parts = build_server_parts(serverapp, self, self.log)
        # Where the kernels' websocket connections find it (``connections``).
        self.settings[HIBERNATION_SETTING] = parts.hibernation
        self._stop_on_sigint(serverapp)
        self._tell_kernels_where_we_are(serverapp, parts)
        self.log.info(
            "gpu-snapshot: API at %s%s/, snapshots in %s, snapshot on shutdown %s",
            serverapp.base_url,
            API_PREFIX,
            parts.service.engine.location,
            "on" if parts.settings.snapshot_on_shutdown
            else "off (c.GPUSnapshot.snapshot_on_shutdown)",
        )
        self.log.info("gpu-snapshot: %s", _recovery_settings(parts.settings))

    def _stop_on_sigint(self, serverapp: ServerApp) -> None:
        """Stop on SIGINT as on SIGTERM when the server has no terminal to confirm it with.

        Without a terminal, jupyter_server leaves SIGINT to Python, whose KeyboardInterrupt
        ends the server without stopping its extensions: the kernels would not be saved.
        JupyterHub's LocalProcessSpawner stops servers with SIGINT first.
        """
        no_terminal = not (sys.stdin and sys.stdin.isatty())
        if (no_terminal and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, stop_signal_handler(serverapp))

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

    async def save_rates(self) -> SaveRates:
        """The shutdown's save-time rates of a kernel without saves of its own:
        configured, else learned from past saves."""
        return await self.parts.service.save_rates()

    def initialize_handlers(self) -> None:
        """Called by ``ExtensionApp.initialize()`` after ``initialize_settings``."""
        parts = self.parts
        self.handlers.extend(
            routes(parts.service, parts.autosave, parts.hibernation, parts.timelines))

    async def _start_jupyter_server_extension(self, serverapp: ServerApp) -> None:
        """Called once the server listens: the port is final only now (port retries).

        Kernels that a killed server left running come back first, under their ids, so
        that the notebooks' sessions find them; then this server's record starts.
        """
        parts = self._parts
        if parts is None:  # the extension did not load
            return
        self._tell_kernels_where_we_are(serverapp, parts)
        if parts.kernel_record is not None:
            await self._adopt_orphans(serverapp, parts.kernel_record)
        parts.autosave.start()
        await parts.hibernation.find_sleepers()
        parts.hibernation.start()
        if parts.service.uploads is not None:
            # Snapshots whose upload did not complete before this start go up now.
            parts.service.uploads.start_retries()

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

    def _tell_kernels_where_we_are(self, serverapp: ServerApp, parts: ServerParts) -> None:
        """Hand the URL and token to the provisioner through the kernel manager's config.

        Kernel managers and their provisioners take their config from the server's kernel
        manager when a kernel starts, so kernels started from now on see these values.
        Values the user configured (c.SnapshotReadyProvisioner.server_url/server_token) win.
        """
        overrides = parts.provisioner_overrides
        values = {
            "server_url": kernel_facing_url(serverapp),
            # Kernels get a credential of their own (kernel_token), never the server's token.
            "server_token": "",
            "kernel_token_secret": parts.kernel_token_secret,
            **overrides,
        }
        if "server_token" in overrides:
            values["kernel_token_secret"] = ""  # the operator chose what kernels get
        serverapp.kernel_manager.update_config(Config({"SnapshotReadyProvisioner": values}))

    def current_activity(self) -> list[str] | None:
        """Called by the server's idle shutdown: running jobs keep the server up."""
        if self._parts is None:
            return None
        running = self._parts.jobs.running()
        return [f"gpu-snapshot {j.kind} job {j.id}" for j in running] or None

    async def stop_extension(self) -> None:
        """Called by ``ServerApp._cleanup()`` before it shuts down all kernels.

        Running jobs get to finish; then, with ``snapshot_on_shutdown``, every
        snapshot-ready kernel is saved, all within ``shutdown_budget`` seconds. A second
        stop request while this runs (``jupyter server stop`` sends SIGTERM after 5 s)
        waits for the same work instead of starting it again.
        """
        parts = self._parts
        if parts is None:  # the extension did not load
            return
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._save_before_stop(parts))
        await asyncio.shield(self._stopping)
        if parts.kernel_record is not None:
            # The kernels stop with this server: nothing is left to adopt.
            parts.kernel_record.stop()

    async def _save_before_stop(self, parts: ServerParts) -> ShutdownReport | None:
        """Stop autosave and hibernation, and save the kernels; what the saves did, with
        ``snapshot_on_shutdown``."""
        service, autosave, hibernation, settings = (
            parts.service, parts.autosave, parts.hibernation, parts.settings)
        report = None
        await autosave.stop()
        budget = float(settings.shutdown_budget)
        deadline = asyncio.get_running_loop().time() + budget
        await hibernation.stop()
        if settings.snapshot_on_shutdown:
            # Their state lives only in their process: awake, they can be saved. The
            # wakes (seconds each) come out of the same budget.
            await hibernation.wake_before_stop()
            budget = max(0.0, deadline - asyncio.get_running_loop().time())
        remote = service.remote
        if settings.snapshot_on_shutdown:
            if remote is not None:
                # Saving the kernels comes first: running uploads give up, and go again
                # after the saves.
                remote.stopping.set()
            rates = await self.save_rates()
            self.log.info("gpu-snapshot: shutdown save rates %s", rates.to_dict())
            await autosave.probes_settled(min(PROBE_WAIT_AT_SHUTDOWN, budget / 4))
            report = await snapshot_kernels_on_shutdown(
                service.kernel_manager,
                service.jobs,
                lambda kernel_id: service.start_save(kernel_id, stop=True, reason="shutdown"),
                service.kernel_size,
                budget,
                self.log,
                rates,
                work_at_risk=autosave.work_at_risk,
                newest_snapshot=autosave.newest_snapshot,
                rates_of=service.save_rates,
            )
            # Every kernel is saved locally first; uploads get what is left of the budget.
            uploads = service.uploads
            if uploads is not None:
                uploads.remote.stopping.clear()
                await uploads.upload_on_shutdown(
                    [*report.saved.values(), *uploads.stopped_uploads()],
                    deadline - asyncio.get_running_loop().time(),
                )
        else:
            for job in await service.jobs.drain(budget):
                self.log.warning("gpu-snapshot: job %s still runs as the server stops", job.id)
        if remote is not None:
            remote.stopping.set()  # uploads still running give up
        autosave.close()
        return report


def _recovery_settings(s: GPUSnapshot) -> str:
    """One line for the start-up log: what a node loss or a stop would cost."""
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
