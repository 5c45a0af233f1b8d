"""The JupyterLab extension in a real browser: Galata on Playwright, in Debian's chromium.

Each test starts a real ``jupyter lab`` on 127.0.0.1 with a token, its own config, runtime
and snapshot directories, Galata's in-page helpers, and a notebook on the
``python3-snapshot`` (or plain ``python3``) kernel; then runs its scenario of
``specs/snapshots.spec.ts`` (``playwright test --grep``), which clicks through the UI, and
checks what the scenario saw (its seen.json) and the server's state. Screenshots of every
step land in test-artifacts/ui/<scenario>/.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core.store.manifest import ManifestPolicy
from jupyter_gpu_snapshot.core.store.store import KERNEL_LOG_SUBDIR, SnapshotStore
from testkit.jupyter_processes import (
    BIN,
    START_TIMEOUT,
    JupyterProcess,
    JupyterStarter,
    jupyter_processes,
)
from testkit.manifests import move_to_another_node

__all__ = ["jupyter_processes"]  # the fixture, imported for pytest

HERE = Path(__file__).parent
REPO = HERE.parents[1]
ARTIFACTS = REPO / "test-artifacts" / "ui"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
PLAYWRIGHT = HERE / "node_modules" / "@playwright" / "test" / "cli.js"
SCENARIO_TIMEOUT = 240

# The cells every scenario notebook holds: one sets state (RNG included), one reads it.
SET_STATE = (
    "import random\n"
    "random.seed(2024)\n"
    "secret = [round(random.random(), 6) for _ in range(3)]\n"
    "print('state set:', secret)"
)
READ_STATE = "print('state now:', secret, 'next random:', round(random.random(), 6))"
CHANGE_STATE = "secret = 'changed'\nprint('state changed')"

pytestmark = pytest.mark.timeout(SCENARIO_TIMEOUT + START_TIMEOUT + 60)


def expected_state() -> tuple[list[float], float]:
    import random

    rng = random.Random(2024)
    secret = [round(rng.random(), 6) for _ in range(3)]
    return secret, round(rng.random(), 6)


def write_notebook(path: Path, kernel_name: str, display_name: str) -> None:
    cells = [
        {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
         "source": source}
        for source in (SET_STATE, READ_STATE, CHANGE_STATE)
    ]
    notebook = {
        "cells": cells,
        "metadata": {
            "kernelspec": {"name": kernel_name, "display_name": display_name,
                           "language": "python"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(notebook, indent=1))


@pytest.fixture(scope="session")
def ui_tools() -> dict[str, str]:
    """Node, chromium, Galata and Playwright, and the built extension, or a clear failure."""
    missing = []
    node = shutil.which("node")
    if node is None:
        missing.append("node (scripts/install-ui-deps.sh installs it)")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (scripts/install-ui-deps.sh installs Debian's chromium)")
    listing = subprocess.run(
        [str(BIN / "jupyter"), "labextension", "list"], capture_output=True, text=True,
        check=False,
    )
    if "jupyter-gpu-snapshot" not in listing.stdout + listing.stderr:
        missing.append("the jupyter-gpu-snapshot labextension (pip install -e . builds it)")
    if missing:
        pytest.fail("the browser tests need: " + "; ".join(missing))
    assert node is not None
    if not PLAYWRIGHT.is_file():
        jlpm = shutil.which("jlpm", path=str(BIN)) or "jlpm"
        # Playwright drives the system chromium: no browser download.
        env = dict(os.environ, PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD="1")
        subprocess.run([jlpm, "install", "--immutable"], cwd=HERE, env=env, check=True)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return {"node": node}


@pytest.fixture
def start_lab(
    tmp_path: Path, jupyter_processes: JupyterStarter
) -> Callable[..., JupyterProcess]:
    """Starts ``jupyter lab`` with the given notebooks; a second call is a restart."""

    def start(name: str, notebooks: dict[str, str], config: str = "") -> JupyterProcess:
        root = tmp_path / "notebooks"
        root.mkdir(exist_ok=True)
        for filename, kernel in notebooks.items():
            if not (root / filename).exists():
                display = "Python 3 (snapshots)" if kernel == "python3-snapshot" else "Python 3"
                write_notebook(root / filename, kernel, display)
        return jupyter_processes(ARTIFACTS / name / "server.log", config=config)

    return start


def run_scenario(
    tools: dict[str, str], server: JupyterProcess, scenario: str, notebook: str,
    other_notebook: str = "",
) -> dict[str, Any]:
    """Runs one scenario of the spec against ``server``; what it saw, or a failure that
    quotes Playwright's report and the server's log."""
    artifacts = ARTIFACTS / scenario
    report = artifacts / "playwright" / "report.json"
    seen_file = artifacts / "seen.json"
    for stale in (report, seen_file):
        stale.unlink(missing_ok=True)
    env = dict(
        os.environ,
        LAB_URL=server.url,
        LAB_TOKEN=server.token,
        NOTEBOOK=notebook,
        OTHER_NOTEBOOK=other_notebook,
        ARTIFACTS=str(ARTIFACTS),
        CHROMIUM=CHROMIUM,
        PLAYWRIGHT_JSON_OUTPUT_NAME=str(report),
        PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD="1",
    )
    argv = [
        tools["node"], str(PLAYWRIGHT), "test", "--config", str(HERE / "playwright.config.js"),
        "--grep", f" {re.escape(scenario)}$", "--output", str(artifacts / "playwright"),
        "--timeout", str(SCENARIO_TIMEOUT * 1000),
    ]
    try:
        result = subprocess.run(
            argv, cwd=HERE, env=env, capture_output=True, text=True,
            timeout=SCENARIO_TIMEOUT + 30, check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"scenario {scenario}: Playwright still ran after {exc.timeout} s\n"
                    f"--- server log ---\n{server.log_tail()}")
    ran = scenario_results(report)
    if result.returncode != 0 or ran != ["expected"]:
        pytest.fail(
            f"scenario {scenario} failed (playwright exit {result.returncode}, "
            f"results {ran}):\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}\n"
            f"screenshots: {artifacts}\n--- server log ---\n{server.log_tail()}"
        )
    seen: dict[str, Any] = json.loads(seen_file.read_text())
    return seen


def scenario_results(report: Path) -> list[str]:
    """The status of each test Playwright's JSON report lists (one per scenario run)."""
    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError):
        return []
    statuses: list[str] = []

    def walk(suite: dict[str, Any]) -> None:
        for spec in suite.get("specs", []):
            for test in spec.get("tests", []):
                statuses.append(test.get("status", "unknown"))
        for child in suite.get("suites", []):
            walk(child)

    for suite in data.get("suites", []):
        walk(suite)
    return statuses


def test_labextension_is_enabled_and_ok(ui_tools: dict[str, str]) -> None:
    listing = subprocess.run(
        [str(BIN / "jupyter"), "labextension", "list"], capture_output=True, text=True,
        check=True,
    )
    line = next(
        line for line in (listing.stdout + listing.stderr).splitlines()
        if "jupyter-gpu-snapshot" in line
    )
    assert "enabled" in line and "OK" in line, line


def test_snapshot_then_restore_through_the_dialog(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    server = start_lab("round-trip", {"state.ipynb": "python3-snapshot"})
    seen = run_scenario(ui_tools, server, "round-trip", "state.ipynb")
    secret, next_random = expected_state()

    assert seen["ready_tooltip"].startswith("Snapshot kernel")
    assert seen["state_output"] == f"state set: {secret}"
    # The notification followed the job's phases, then gave the size and the time.
    phases = r"Snapshot of state\.ipynb: (checking|pausing|writing memory|resuming|committing)"
    assert any(re.match(phases, text) for text in seen["save_toasts"]), seen["save_toasts"]
    assert re.fullmatch(
        r"Snapshot saved: '[\w.-]+', [\d.]+ (B|KiB|MiB|GiB)"
        r"( \([\d.]+ (B|KiB|MiB|GiB) new\))? in [\d.]+ s", seen["saved_toast"]
    ), seen["saved_toast"]
    assert re.fullmatch(r"Snapshot (just now|\d+ min ago)", seen["status_item"]), seen
    # The success notification closed by itself, after its few seconds.
    assert seen["saved_toast_closed"] is not None, "the success notification stayed"
    # Shutting the kernel down ended the session; the button says there is no kernel.
    assert seen["kernel_after_shutdown"] is None
    assert seen["after_shutdown_tooltip"] == "No kernel is running in this notebook"
    assert seen["status_after_shutdown"] == "Snapshots"  # still there to click
    # Title Case like JupyterLab's own entries; the keyboard shortcut shows beside its entry.
    assert seen["kernel_menu"] == [
        "Snapshot Kernel\tCtrl+Alt+S", "Snapshot Kernel As…", "Restore Kernel from Snapshot…",
        "Hibernate Kernel",
    ]
    assert len(seen["dialog_rows"]) == 1
    assert seen["dialog_selected"] == seen["dialog_rows"]
    assert "Snapshots of state.ipynb" in seen["dialog_text"]
    assert any(
        re.match(r"Restoring '[\w.-]+': (checking|verifying|restoring)", text)
        for text in seen["restore_toasts"]
    ), seen["restore_toasts"]
    assert seen["restored_toast"].startswith("Kernel restored from")
    # The notebook runs a new kernel slot holding the old kernel's memory.
    assert seen["kernel_after_restore"] not in (None, seen["kernel_before"])
    assert seen["after_restore_output"] == f"state now: {secret} next random: {next_random}"
    assert seen["snapshots_left"] == 0
    assert seen["status_after_delete"] == "No snapshot yet"
    assert seen["escape_closed_dialog"] is True
    # The selected row is readable in the dark theme (WCAG AA: 4.5).
    assert seen["dark_selected_contrast"] >= 4.5, seen["dark_selected_contrast"]
    assert server.get("gpu-snapshot/snapshots")["snapshots"] == []
    sessions = server.get("api/sessions")
    assert [s["kernel"]["id"] for s in sessions if s["path"] == "state.ipynb"] == [
        seen["kernel_after_restore"]
    ]
    assert seen["console_errors"] == []


def test_button_disabled_on_a_kernel_that_is_not_snapshot_ready(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    server = start_lab("not-snapshot-ready", {"plain.ipynb": "python3"})
    seen = run_scenario(ui_tools, server, "not-snapshot-ready", "plain.ipynb")

    assert seen["kernel"] is not None
    assert seen["disabled_tooltip"].startswith(
        "Snapshots unavailable: this notebook runs a kernel that cannot be saved. "
        "Switch to the 'Python 3 (snapshots)' kernel"
    ), seen["disabled_tooltip"]
    # In a user's words: none of the server's jargon.
    assert "PID namespace" not in seen["disabled_tooltip"]
    assert "JPY_PARENT_PID" not in seen["disabled_tooltip"]
    assert seen["palette_disabled"] is True
    # A click on the greyed-out button explains, and its action opens the kernel picker.
    assert seen["explanation"].startswith("Snapshots need the 'Python 3 (snapshots)' kernel")
    assert "Change kernel…" in seen["explanation"]
    assert "Kernel" in seen["change_kernel_dialog"], seen["change_kernel_dialog"]
    status = server.get(f"gpu-snapshot/kernels/{seen['kernel']}/status")
    assert status["ready"] is False
    assert seen["console_errors"] == []


def test_going_back_on_the_running_kernel_is_one_confirmation(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    server = start_lab("restore-over-running-kernel", {"state.ipynb": "python3-snapshot"})
    seen = run_scenario(ui_tools, server, "restore-over-running-kernel", "state.ipynb")
    secret, next_random = expected_state()

    assert seen["changed_output"] == "state changed"
    # The dialog marks the snapshot of the running kernel, as this notebook's, and does not
    # pre-select it: Restore waits for a choice.
    assert "of this kernel" in seen["row_text"] and seen["preselected"] == 0
    assert seen["restore_enabled_before"] is False
    assert seen["selected_by_arrow"] == [seen["first_row"]]
    # One confirmation says what is lost; no refusal comes first.
    name = re.escape(server.get("gpu-snapshot/snapshots")["snapshots"][0]["name"])
    assert re.fullmatch(rf"Go back to '{name}'\?", seen["confirm_title"]), seen
    assert re.fullmatch(
        rf"Replace this notebook's kernel with '{name}', saved (just now|\d+ min ago)\? "
        r"What the kernel did since is lost\.", seen["confirm_text"]), seen["confirm_text"]
    assert seen["confirm_buttons"] == ["Cancel", "Replace kernel"]
    assert not [t for t in seen["toasts"] if "failed" in t], seen["toasts"]
    assert seen["restored_toast"].startswith("Kernel restored from")
    assert seen["kernel_after_restore"] not in (None, seen["kernel_before"])
    # The cell it went back to is marked; the later one's output is dimmed.
    assert [index for index, _ in seen["restore_point"]] == [0], seen["restore_point"]
    assert seen["restore_point"][0][1].startswith("The kernel went back to here: ")
    assert seen["dimmed"] == [2], seen["dimmed"]
    assert seen["after_restore_output"] == f"state now: {secret} next random: {next_random}"
    assert seen["kernels"] == [seen["kernel_after_restore"]]
    assert seen["console_errors"] == []


def test_restoring_another_notebooks_snapshot_names_and_shuts_down_that_kernel(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    server = start_lab(
        "restore-from-other-notebook",
        {"a.ipynb": "python3-snapshot", "b.ipynb": "python3-snapshot"},
    )
    seen = run_scenario(
        ui_tools, server, "restore-from-other-notebook", "b.ipynb", other_notebook="a.ipynb"
    )
    assert seen["progress_toasts_left"] == 0, "the progress notification stayed"
    secret, next_random = expected_state()
    # b.ipynb has no snapshot: nothing is picked for it, and Restore (or Enter) waits for
    # a choice; a click on a row makes it.
    assert seen["preselected"] == 0 and seen["restore_enabled_before"] is False
    assert seen["dialog_after_enter"] == 1
    assert seen["restore_enabled_after"] is True

    # The refusal names a.ipynb's kernel, which holds the ports, and offers to shut it down.
    assert "its ports are taken by the kernel of a.ipynb" in seen["refused_toast"], seen
    assert "Shut down a.ipynb's kernel and restore" in seen["refused_buttons"], seen
    assert not any("this kernel" in b for b in seen["refused_buttons"]), seen
    # Nothing touched b.ipynb's kernel meanwhile.
    assert seen["kernel_after_refusal"] == seen["kernel_before"]
    assert seen["kernels_after_refusal"] == sorted([seen["kernel_before"], seen["other_kernel"]])
    # The remedy shut down a.ipynb's kernel; b.ipynb now runs a's restored state.
    assert seen["restored_toast"].startswith("Kernel restored from")
    assert seen["other_kernel_after_restore"] is None
    assert seen["kernel_after_restore"] not in (None, seen["kernel_before"], seen["other_kernel"])
    assert seen["after_restore_output"] == f"state now: {secret} next random: {next_random}"
    assert seen["kernels"] == [seen["kernel_after_restore"]]
    assert seen["console_errors"] == []


def test_snapshots_sidebar_lists_searches_restores_and_deletes(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    server = start_lab("sidebar", {"state.ipynb": "python3-snapshot"})
    # On by default: the startup log says so.
    assert "snapshot on shutdown on" in server.log_path.read_text()
    seen = run_scenario(ui_tools, server, "sidebar", "state.ipynb")
    secret, next_random = expected_state()

    # Named at save time (shift-click on the button).
    assert seen["saved_toast"].startswith("Snapshot saved: 'sidebar-one'"), seen["saved_toast"]
    # Its size on disk: pages shared by snapshots count once (GET usage).
    assert re.fullmatch(r"1 in the store, [\d.]+ (KiB|MiB|GiB) on disk, [\d.]+ (GiB|TiB|MiB) "
                        r"free", seen["store_text"]), seen["store_text"]
    for fact in ("sidebar-one", "saved by hand", "just now", "MiB", "CPU only", "state.ipynb"):
        assert fact in seen["item_text"], (fact, seen["item_text"])
    assert "None matches the search." in seen["search_empty"]
    assert seen["search_hits"] == ["sidebar-one"]
    assert seen["dark_name_contrast"] >= 4.5, seen["dark_name_contrast"]
    assert seen["restored_toast"].startswith("Kernel restored from 'sidebar-one'")
    assert seen["after_restore_output"] == f"state now: {secret} next random: {next_random}"
    # A bad name is caught in the dialog as it is typed: Rename and Enter do nothing, a
    # line says why, and nothing lands in the sidebar; a good one is renamed on the server.
    assert seen["rename_why"].startswith("Use 1-64 letters, digits"), seen["rename_why"]
    assert seen["rename_field_invalid"] is True
    assert seen["rename_dialog_after_enter"] == 1
    assert seen["sidebar_errors_after_bad_name"] == 0
    assert seen["renamed_names"] == ["sidebar-renamed"]
    assert seen["error_after_rename"] == 0
    assert seen["snapshots_left"] == 0
    assert seen["console_errors"] == []


def test_the_snapshot_panel_widget_comes_back_with_the_restored_kernel(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess], tmp_path: Path
) -> None:
    server = start_lab("widget-after-restore", {"widget.ipynb": "python3-snapshot"})
    notebook = server.root / "widget.ipynb"
    content = json.loads(notebook.read_text())
    content["cells"].append(
        {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
         "source": "%gpu_snapshot widget"}
    )
    notebook.write_text(json.dumps(content, indent=1))
    seen = run_scenario(ui_tools, server, "widget-after-restore", "widget.ipynb")
    secret, next_random = expected_state()

    # The fresh kernel JupyterLab started on reopening holds no widget (JupyterLab says so).
    assert seen["widget_before_restore"] == "Error displaying widget: model not found"
    assert "model not found" not in seen["widget_after_restore"], seen["widget_after_restore"]
    assert seen["snapshot_name"] in seen["widget_after_restore"], seen["widget_after_restore"]
    # Live: the restored panel's Save button saved the restored kernel, also after a second
    # restore in the same page, where the models of the kernel before were still there.
    assert "from-widget" in seen["snapshots"], seen
    assert "same-page" in seen["snapshots"], seen
    assert seen["after_restore_output"] == f"state now: {secret} next random: {next_random}"
    assert seen["console_errors"] == []


def test_autosave_shows_in_the_status_bar_and_the_sidebar_overrides_it(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    server = start_lab(
        "autosave", {"state.ipynb": "python3-snapshot"},
        config="c.GPUSnapshot.autosave_interval_minutes = 0.1\n",
    )
    seen = run_scenario(ui_tools, server, "autosave", "state.ipynb")

    # The status bar followed the autosave, then gave its age and the pause it cost.
    assert "Autosaving…" in seen["status_texts"], seen["status_texts"]
    assert re.fullmatch(
        r"Autosaved (just now|\d+ min ago) \(paused [\d.]+ s\)", seen["status_item"]
    ), seen["status_item"]
    autosaves = [s for s in server.get("gpu-snapshot/snapshots")["snapshots"]
                 if s["reason"] == "autosave"]
    assert autosaves, "no autosave was made"
    # The sidebar: the server's policy, the last autosave with its pause, the next one.
    assert seen["sidebar_policy"].startswith("every 6 s of activity"), seen["sidebar_policy"]
    assert seen["sidebar_policy"].endswith("(the server's setting)"), seen["sidebar_policy"]
    assert re.fullmatch(
        r"Last autosave (just now|\d+ min ago), the kernel paused [\d.]+ s",
        seen["sidebar_last"],
    ), seen["sidebar_last"]
    assert seen["sidebar_next"], seen
    # Overrides for this notebook go to the server, and back to its settings.
    assert seen["policy_off"] == "off (this notebook's setting)", seen["policy_off"]
    assert seen["server_off"]["enabled"] is False
    assert seen["policy_on"].startswith("every 30 min of activity"), seen["policy_on"]
    assert seen["server_on"]["policy"]["enabled"] is True
    assert seen["server_on"]["policy"]["interval_minutes"] == 30
    assert seen["server_on"]["override"] == {"enabled": True, "interval_minutes": 30}
    assert not any(v is not None for v in seen["server_default"].values()), seen
    # Where a snapshot is kept, from servers that say (the field is added in the browser).
    assert seen["sidebar_location"] == "remote only", seen
    assert seen["dialog_location"] == "remote only", seen
    assert seen["console_errors"] == []


def test_a_hibernated_notebook_says_so_and_its_next_cell_wakes_it(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    server = start_lab("hibernate", {"state.ipynb": "python3-snapshot"})
    seen = run_scenario(ui_tools, server, "hibernate", "state.ipynb")
    secret, next_random = expected_state()

    assert seen["state_output"] == f"state set: {secret}"
    # A CPU kernel: what it gave back is host memory, and the status bar says so.
    assert re.fullmatch(
        r"Hibernated: [\d.]+ (B|KiB|MiB|GiB) of host memory freed", seen["status_hibernated"]
    ), seen["status_hibernated"]
    assert "The next cell you run wakes it" in seen["status_title"], seen["status_title"]
    assert seen["listed_state"] == "hibernated"
    # The sidebar lists it with the notebook and what it freed, and forgets it once awake.
    assert seen["sidebar_hibernated"].startswith("state.ipynb"), seen["sidebar_hibernated"]
    assert "of host memory freed" in seen["sidebar_hibernated"]  # a CPU kernel
    assert "Wake" in seen["sidebar_hibernated"]
    assert seen["sidebar_after_wake"] == 0
    # The notebook's own hibernation time, set in the sidebar, is the server's policy.
    assert seen["idle_policy_before"] == "never hibernates by itself (the server's setting)"
    assert seen["idle_policy"] == "never hibernates by itself (this notebook's setting)"
    assert seen["server_idle"] == {"hibernate_after_minutes": 0}
    # The cell woke the kernel in its own slot, said so, then ran with the old state.
    assert seen["kernel_after"] == seen["kernel_before"]
    output = seen["after_wake_output"]
    assert f"state now: {secret} next random: {next_random}" in output, output
    # The waking note is gone from the cell once the kernel answers, and from the file.
    assert "Waking the kernel" not in output and "Woke" not in output, output
    saved = json.dumps(seen["saved_wake_cell_outputs"])
    assert f"state now: {secret}" in saved and "Waking" not in saved, saved
    assert not seen["status_after_wake"].startswith(("Hibernated", "Waking"))
    assert server.get("gpu-snapshot/hibernation")["kernels"] == []
    assert seen["console_errors"] == []


FAILING_CRIU = """#!/bin/sh
# criu that answers like the real one but fails every dump, as a broken criu would.
for arg in "$@"; do
    if [ "$arg" = dump ]; then
        echo "Error (criu/cr-dump.c:2100): forced dump failure for the UI test" >&2
        exit 1
    fi
done
exec {criu} "$@"
"""


def test_failed_snapshot_shows_the_error_and_the_kernel_lives_on(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess], tmp_path: Path
) -> None:
    real_criu = shutil.which("criu") or "/usr/local/sbin/criu"
    fake = tmp_path / "criu-that-fails"
    fake.write_text(FAILING_CRIU.format(criu=real_criu))
    fake.chmod(0o755)
    server = start_lab(
        "save-fails", {"state.ipynb": "python3-snapshot"},
        config=f"c.GPUSnapshot.criu_path = {str(fake)!r}\n",
    )
    seen = run_scenario(ui_tools, server, "save-fails", "state.ipynb")
    secret, next_random = expected_state()

    assert seen["error_toast"].startswith("Snapshot failed: dump failed"), seen["error_toast"]
    assert "criu" in seen["error_toast"], seen["error_toast"]
    # The whole message, with criu's kept log, is one click away.
    assert seen["error_details"].startswith("dump failed:"), seen["error_details"]
    assert "log" in seen["error_details"], seen["error_details"]
    assert seen["after_failure_output"] == f"state now: {secret} next random: {next_random}"
    assert seen["snapshots_left"] == 0


def test_after_a_restart_the_notebook_offers_its_kernel_from_before_shutdown(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    config = "c.GPUSnapshot.snapshot_on_shutdown = True\n"
    notebooks = {"state.ipynb": "python3-snapshot", "other.ipynb": "python3-snapshot"}
    server = start_lab("before-shutdown", notebooks, config)
    before = run_scenario(
        ui_tools, server, "before-shutdown", "state.ipynb", other_notebook="other.ipynb"
    )
    secret, next_random = expected_state()
    assert before["state_output"] == f"state set: {secret}"

    # The startup log says whether kernels are saved when the server stops.
    assert "snapshot on shutdown on" in server.log_path.read_text()
    assert server.stop() == 0
    assert "gpu-snapshot" in server.log_tail(200)

    server = start_lab("after-restart", notebooks, config)
    snapshots = server.get("gpu-snapshot/snapshots")["snapshots"]
    # other.ipynb was saved by hand after its work, so the shutdown did not save it again.
    assert sorted((s["reason"], s["notebook_path"]) for s in snapshots) == [
        ("shutdown", "state.ipynb"), ("user", "other.ipynb")
    ]
    seen = run_scenario(
        ui_tools, server, "after-restart", "state.ipynb", other_notebook="other.ipynb"
    )

    # With two notebooks reopened, their answers coming at different times (the second
    # while the first offer's toast was still being drawn), the one offer on screen names
    # both, each with its newest snapshot's reason and age (snapshots?latest=true).
    assert seen["single_offer_left"] == 0, "a toast still offers one notebook only"
    assert re.fullmatch(
        r"Restore the kernels of 2 notebooks\? (state|other)\.ipynb: .*\.",
        seen["merged_offer"].splitlines()[0],
    ), seen["merged_offer"]
    assert "state.ipynb: saved at shutdown, " in seen["merged_offer"], seen
    assert "other.ipynb: saved by hand, " in seen["merged_offer"], seen
    assert seen["offer_count"] == 1
    assert len(seen["restored_toasts"]) == 2
    assert seen["restored_toast"].startswith("Kernel restored from")
    assert seen["kernel_after_restore"] not in (None, seen["fresh_kernel"])
    assert seen["after_restore_output"] == f"state now: {secret} next random: {next_random}"
    # The restore dialog, in the dark theme, afterwards: this notebook's snapshot first,
    # marked as the one this kernel came from and as taken before shutdown; the other
    # notebook's without either mark.
    from_shutdown = next(s["id"] for s in snapshots if s["reason"] == "shutdown")
    by_hand = next(s["id"] for s in snapshots if s["reason"] == "user")
    badges = {row["id"]: row["badges"] for row in seen["dialog_rows"]}
    assert list(badges) == [from_shutdown, by_hand], seen["dialog_rows"]
    assert "this kernel's origin" in badges[from_shutdown], badges
    assert "before shutdown" in badges[from_shutdown], badges
    assert not {"this kernel's origin", "of this kernel", "before shutdown"} & set(
        badges[by_hand]
    ), badges
    # The "before shutdown" badge is readable in the dark theme (WCAG AA: 4.5).
    assert seen["dark_shutdown_badge_contrast"] >= 4.5, seen["dark_shutdown_badge_contrast"]
    # Both sections' first rows start their cells where the header's start (one table).
    columns = seen["dialog_columns"]
    header = columns["header"]
    assert len(header) == 7 and header == sorted(set(header)), columns
    assert [section["title"] for section in columns["sections"]] == [
        "Snapshots of state.ipynb", "All other snapshots"
    ], columns
    for section in columns["sections"]:
        row = section["first_row"]
        assert row is not None and len(row) == len(header), columns
        offsets = [abs(cell - head) for cell, head in zip(row, header, strict=True)]
        assert max(offsets) <= 1, columns
    # The fresh kernels the notebooks had started were retired; a session and a kernel each.
    assert [path for path, _ in seen["sessions"]] == ["other.ipynb", "state.ipynb"]
    assert ["state.ipynb", seen["kernel_after_restore"]] in seen["sessions"]
    assert seen["kernels"] == sorted(kernel for _, kernel in seen["sessions"])
    # JupyterLab sends each new kernel a few requests of its own (the debugger's state, comm
    # subshells); retiring the fresh kernel cancels any still unanswered, which JupyterLab
    # logs as "Canceled future for ... before replies were done". Nothing else may show.
    canceled = re.compile(r"Canceled future for \w+ message before replies were done")
    assert [e for e in seen["console_errors"] if not canceled.search(e)] == []


BIG_STATE = "import os\nblob = os.urandom(600 << 20)\nprint('blob', len(blob))"


def test_a_new_users_first_day(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    """Two scenarios on one server: a snapshot follows its notebook across JupyterLab's
    first-save rename, and a save's progress only goes forward."""
    server = start_lab("first-save-rename", {"big.ipynb": "python3-snapshot"})
    notebook = server.root / "big.ipynb"
    content = json.loads(notebook.read_text())
    content["cells"].append({"cell_type": "code", "execution_count": None, "metadata": {},
                             "outputs": [], "source": BIG_STATE})
    notebook.write_text(json.dumps(content, indent=1))

    seen = run_scenario(ui_tools, server, "first-save-rename", "big.ipynb")
    assert seen["first_tab"] == "Untitled.ipynb" and seen["second_tab"] == "Untitled.ipynb"
    saved = {s["id"]: s for s in server.get("gpu-snapshot/snapshots")["snapshots"]}
    [snapshot] = saved.values()
    # Named from its notebook and the local time; it follows the notebook's rename.
    assert re.fullmatch(r"Untitled-\d\d\.\d\d", snapshot["name"]), snapshot["name"]
    assert seen["saved_toast"].startswith(f"Snapshot saved: '{snapshot['name']}'")
    assert (snapshot["notebook_path"], snapshot["saved_notebook_path"]) == (
        "demo.ipynb", "Untitled.ipynb")
    assert [name for name, _ in seen["sidebar_own"]] == [snapshot["name"]]
    assert seen["sidebar_others"] == 0
    assert re.fullmatch(r"Snapshot (just now|\d+ min ago)", seen["status_demo"])
    assert "1 snapshot(s) of demo.ipynb:" in seen["magic_list"], seen["magic_list"]
    assert snapshot["name"] in seen["magic_list"]
    assert snapshot["name"] in seen["magic_status"], seen["magic_status"]
    [own, others] = seen["dialog_sections"]
    assert own[0] == "Snapshots of demo.ipynb" and len(own[1]) == 1, own
    assert "of this kernel" in own[1][0] and others[1] == [], seen["dialog_sections"]
    # The next Untitled.ipynb, an empty kernel: no snapshot, nothing offered or picked.
    assert seen["status_new"] == "No snapshot yet"
    assert seen["sidebar_new_own"] == 0
    assert seen["new_dialog_own"] == ["No snapshot of this notebook yet."]
    assert seen["new_dialog_selected"] == 0 and seen["new_dialog_restore_enabled"] is False
    assert not [t for t in seen["toasts"] if t.startswith("Restore the kernel")], seen["toasts"]
    # JupyterLab asks for the old file's checkpoints (and lists its folder) as it renames
    # it, and jupyter_server can fail those requests (the file went meanwhile); the page
    # logs that, and JupyterLab's context its rejection. Nothing else may show.
    race = [e for e in seen["console_errors"]
            if re.search(r"/api/contents(/Untitled\.ipynb/checkpoints)?\?", e)]
    others = [e for e in seen["console_errors"]
              if e not in race and not (race and e.endswith("Unhandled error"))]
    assert others == [], seen["console_errors"]

    seen = run_scenario(ui_tools, server, "save-progress", "big.ipynb")
    assert seen["big_output"] == f"blob {600 << 20}"
    # The status bar's percent showed through the dump and the commit, and never went back.
    percents = [int(m.group(1)) for t in seen["status_texts"]
                if (m := re.fullmatch(r"Snapshot (\d+)%", t))]
    assert len(percents) >= 3, seen["status_texts"]
    assert all(later >= earlier for earlier, later in itertools.pairwise(percents)), percents
    phases = [t for t in seen["toasts"] if t.startswith("Snapshot of big.ipynb:")]
    assert any("writing memory" in t for t in phases), phases
    # A dump shows what it wrote (its total is an estimate); the commit's total is the
    # snapshot's size, as the saved notification says it.
    assert not [t for t in phases if re.search(r"writing memory: [\d.]+ \w+ of", t)], phases
    committing = [t for t in phases if "committing:" in t and " of " in t]
    assert committing, phases
    total = re.search(r"committing: [\d.]+ \w+ of ([\d.]+ \w+)", committing[-1])
    assert total is not None, committing
    assert re.match(rf"Snapshot saved: 'big-\d\d\.\d\d', {re.escape(total.group(1))} in ",
                    seen["saved_toast"]), (seen["saved_toast"], total.group(1))
    assert seen["console_errors"] == []


def server_store(server: JupyterProcess) -> SnapshotStore:
    """The server's store, read with its signing key and its kernel-log directory. The
    server inherits this process's environment: its key file too, when one is set."""
    logs = Path(os.path.realpath(server.runtime_dir / KERNEL_LOG_SUBDIR))
    key = os.environ.get("JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE") or (
        server.base / "data" / "gpu_snapshot_signing.key")
    return SnapshotStore(server.base / "store", key, ManifestPolicy(kernel_log_dir=lambda: logs))


def test_a_snapshot_whose_image_is_refused_comes_back_by_re_running_its_cells(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    server = start_lab("fallback-save", {"state.ipynb": "python3-snapshot"})
    saved = run_scenario(ui_tools, server, "fallback-save", "state.ipynb")
    secret, next_random = expected_state()

    assert saved["state_output"] == f"state set: {secret}"
    # The naming dialog asks for a portable copy, unticked at first; the save says it kept one.
    assert saved["portable_checkbox"] == "Also save a portable copy"
    assert saved["portable_checked_at_first"] is False
    assert re.fullmatch(
        r"Snapshot saved: 'portable-one', [\d.]+ (B|KiB|MiB|GiB)( \([\d.]+ (B|KiB|MiB|GiB) "
        r"new\))?( in [\d.]+ s)?, with a portable copy", saved["saved_toast"]
    ), saved["saved_toast"]
    snapshot = next(s for s in server.get("gpu-snapshot/snapshots")["snapshots"]
                    if s["name"] == "portable-one")
    assert snapshot["fallback"] == ["portable", "replay", "both"], snapshot
    # Signed again as another node's (another Linux series): this node refuses its image.
    move_to_another_node(server_store(server), snapshot["id"])

    seen = run_scenario(ui_tools, server, "fallback-restore", "state.ipynb")

    # The dialog marks the snapshot and offers the fresh kernel beside the image.
    assert "portable copy" in seen["row_badges"], seen["row_badges"]
    assert seen["restore_modes"] == [
        "its process image, as it was", "into a fresh kernel: Load the portable copy",
        "into a fresh kernel: Re-run the cells", "into a fresh kernel: Both",
    ]
    # The image was refused: a dialog names the failure and offers the ways back, each
    # with what it keeps; the failure's notification offers them again.
    # The title says what failed; the text says why, once, without the step's name.
    assert seen["fallback_title"] == "Restore of 'portable-one' failed"
    assert not seen["fallback_text"].startswith("Restore of"), seen["fallback_text"]
    assert "compatibility failed" not in seen["fallback_text"], seen["fallback_text"]
    assert "2.6.32-another-node" in seen["fallback_text"], seen["fallback_text"]
    for line in ("Load the portable copy: loads the variables the snapshot copied",
                 "Re-run the cells: runs again the cells the kernel ran, in order",
                 "Both: loads the portable copy, then re-runs only the cells"):
        assert line in seen["fallback_text"], (line, seen["fallback_text"])
    assert seen["fallback_buttons"] == [
        "Cancel", "Load the portable copy", "Re-run the cells", "Both"
    ]
    assert "Restore another way…" in seen["refused_toast"], seen["refused_toast"]
    # Re-running the cells: the report names each cell, all ran.
    assert seen["report_title"] == "A fresh kernel for 'portable-one'"
    assert seen["replayed"] and all(c["status"] == "ok" for c in seen["replayed"]), seen
    assert "Cells re-run" in seen["report_text"], seen["report_text"]
    assert f"In [{seen['replayed'][-1]['count']}]: ran" in seen["report_text"]
    cells = len(seen["replayed"])
    assert re.search(
        rf"^A fresh kernel took the place of 'portable-one' in [\d.]+ s: {cells} cells? re-run$",
        seen["fallback_toast"], re.MULTILINE,
    ), seen["fallback_toast"]
    assert any(t.startswith("Restoring 'portable-one' into a fresh kernel")
               for t in seen["restore_toasts"]), seen["restore_toasts"]
    assert seen["refused_toasts_left"] == 0
    # The notebook runs the fresh kernel, which has the state back (the seed and the draws
    # of the re-run cell); the kernel before is retired, the snapshot is kept.
    assert seen["kernel_after"] not in (None, seen["kernel_before"])
    # Its first cell also tells the notebook what came back.
    assert seen["after_output"].startswith(
        "Note: This kernel is a fresh one: snapshot portable-one's image could not come "
        "back, its work did (replay):"), seen["after_output"]
    assert seen["after_output"].endswith(f"state now: {secret} next random: {next_random}")
    assert seen["kernels"] == [seen["kernel_after"]]
    assert [s["id"] for s in server.get("gpu-snapshot/snapshots")["snapshots"]] == [
        snapshot["id"]
    ]
    assert saved["console_errors"] == [] and seen["console_errors"] == []


# The rewind scenario's notebook: two cells bind x, one reads it, one runs long enough to
# be running when a rewind is asked.
REWIND_CELLS = (
    "x = 1",
    "x = 2",
    "print('x is', x)",
    "import time\nprint('sleeping', flush=True)\ntime.sleep(300)",
)


def set_cells(notebook: Path, sources: tuple[str, ...]) -> None:
    """Gives the notebook these code cells, none of them run."""
    content = json.loads(notebook.read_text())
    content["cells"] = [
        {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
         "source": source}
        for source in sources
    ]
    notebook.write_text(json.dumps(content, indent=1))


def test_rewind_from_a_cells_context_menu_brings_the_value_back_and_marks_the_cell(
    ui_tools: dict[str, str], start_lab: Callable[..., JupyterProcess]
) -> None:
    server = start_lab("rewind", {"rewind.ipynb": "python3-snapshot"},
                       config="c.GPUSnapshot.timeline = True\n")
    set_cells(server.root / "rewind.ipynb", REWIND_CELLS)
    seen = run_scenario(ui_tools, server, "rewind", "rewind.ipynb")

    assert seen["prompts"] == ["[1]:", "[2]:"], seen["prompts"]
    # The sidebar's timeline: a point per cell, newest first, with the name each bound.
    assert seen["points_before"] == [[2, "changed x"], [1, "changed x"]], seen
    assert re.fullmatch(r"2 points, [\d.]+ (B|KiB|MiB) of [\d.]+ (MiB|GiB|TiB)",
                        seen["timeline_use"]), seen["timeline_use"]
    assert seen["menu_entry"] == "Rewind kernel to before this cell"
    assert seen["menu_entry_disabled"] is False
    # The report: in the notification, then whole in its dialog.
    assert seen["rewound_toast"].startswith(
        "Kernel rewound to before In [2]: In [2] undone; 1 name restored"
    ), seen["rewound_toast"]
    assert seen["report_title"] == "Rewound to before In [2]"
    report = seen["report_text"]
    assert report.startswith(
        "The kernel is as it was before In [2]. The effects of In [2] are gone."
    ), report
    assert re.search(r"Came back as they were\s+x\b", report), report
    assert "Not undone by a rewind" in report, report
    # The second cell is marked; the value is back; running another cell keeps the mark.
    assert seen["marked"] == [[1, "effects undone by rewind"]], seen["marked"]
    assert seen["points_after"] == [[1, "changed x"]], seen["points_after"]
    assert seen["after_rewind_output"] == "x is 1"
    assert seen["marked_after_another_cell"] == [[1, "effects undone by rewind"]]
    # Run again, the cell loses its mark and its effect is back.
    assert seen["marked_after_rerun"] == []
    assert seen["after_rerun_output"] == "x is 2"
    assert [count for count, _ in seen["points_after_rerun"]] == [5, 4, 3, 1], seen
    # Asked while a cell runs: refused in one message that says what to do.
    assert seen["busy_toast"].startswith(
        "Could not rewind to before In [1]: a cell is running: wait for it or interrupt "
        "it, then rewind"
    ), seen["busy_toast"]
    assert seen["marked_at_end"] == []
    assert seen["after_refusal_output"] == "x is 2"
    # The server's timeline agrees: the undone cell's point is gone for good.
    counts = [p["count"] for p in server.get(
        f"gpu-snapshot/kernels/{seen['kernel']}/timeline")["points"]]
    assert counts[:4] == [1, 3, 4, 5], counts
    # Chromium logs the refused rewind's answer (409) as a resource that failed to load;
    # nothing else may show.
    refused = [e for e in seen["console_errors"]
               if re.match(r"Failed to load resource: .* 409 \(Conflict\) .*/rewind\?", e)]
    assert len(refused) == 1, seen["console_errors"]
    assert [e for e in seen["console_errors"] if e not in refused] == []


def test_the_panel_and_the_extension_name_phases_alike() -> None:
    from jupyter_gpu_snapshot.kernel.presentation import PHASE_LABELS

    source = (REPO / "labextension" / "src" / "format.ts").read_text()
    block = source.split("function phaseLabels", 1)[1].split("};", 1)[0]
    labels = dict(re.findall(r"(\w+): trans\.__\('([^']*)'\)", block))
    assert labels == PHASE_LABELS
