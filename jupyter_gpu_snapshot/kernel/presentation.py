"""How snapshots, jobs and kernel statuses read, in the magic's output and in the panel."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from .._constants import format_bytes
from .identity import KernelIdentity, namespace_rss_bytes


def format_age(seconds: float) -> str:
    """A coarse age: the panel re-renders only when this text changes, and every change is
    kernel activity that would keep an idle-culling server from culling the kernel."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 48 * 3600:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} days ago"


# What each phase reads as; the JupyterLab extension's format.ts says the same words.
PHASE_LABELS = {
    "preflight": "checking",
    "suspend": "pausing the kernel",
    "dump": "writing memory",
    "resume": "resuming the kernel",
    "commit": "committing",
    "uploading": "uploading to the remote store",
    "downloading": "downloading from the remote store",
    "verify": "verifying",
    "restore": "restoring",
    "fallback": "bringing the work back",
    "done": "finishing",
}


def job_progress_text(job: dict[str, Any]) -> str:
    phase = str(job.get("phase", ""))
    label = PHASE_LABELS.get(phase, phase)
    done, total = int(job.get("done") or 0), int(job.get("total") or 0)
    if total:
        return f"{label}: {format_bytes(done)} of {format_bytes(total)}"
    return label


def saved_line(summary: dict[str, Any], job: dict[str, Any]) -> str:
    timings = summary.get("timings") or {}
    total = timings.get("total")
    if total is None and job.get("finished") and job.get("started"):
        total = float(job["finished"]) - float(job["started"])
    took = f" in {float(total):.1f} s" if total is not None else ""
    paused = timings.get("pause")
    pause = f" (kernel paused {float(paused):.2f} s)" if paused is not None else ""
    created = local_time(float(summary.get("created", time.time())))
    line = (
        f"Saved snapshot {summary.get('id')} ({summary.get('name')}) at {created}: "
        f"{snapshot_size_text(summary)}{took}{pause}."
    )
    # State the image does not hold: a restore would get it wrong, so say so with the save.
    return "\n".join([line, *(f"Warning: {w}" for w in summary.get("warnings") or [])])


def death_cause_text(death: Mapping[str, Any]) -> str:
    """'killed by signal 11, SIGSEGV', from the death's codes (the labextension says the same)."""
    code = death.get("code")
    if code == "signal" and death.get("signal") is not None:
        name = death.get("signal_name")
        return f"killed by signal {death['signal']}" + (f", {name}" if name else "")
    if code == "exit" and death.get("exit_status") is not None:
        return f"exited with status {death['exit_status']}"
    return "cause unknown"


def death_text(death: Mapping[str, Any], now: float) -> str:
    """The notice of a death the status carries (openapi.yaml, KernelDeath): what killed
    the kernel, that its state is gone, and the snapshot that brings it back."""
    restarted = (
        "was restarted without its state" if death.get("restarted")
        else "was not restarted: its state is gone"
    )
    text = (
        f"The kernel died ({death_cause_text(death)}) {format_age(now - float(death['at']))} "
        f"and {restarted}."
    )
    snapshot = death.get("snapshot")
    if not snapshot:
        return f"{text} There is no snapshot of it to restore."
    return (
        f"{text} Its newest snapshot '{snapshot['name']}', from "
        f"{format_age(now - float(snapshot['created']))}, can bring it back."
    )


def status_lines(status: dict[str, Any], identity: KernelIdentity | None = None) -> list[str]:
    """``kernels/{id}/status`` as the lines ``%gpu_snapshot status`` prints."""
    kid = status.get("kernel_id", "?")
    lines = []
    death = status.get("death")
    if death:
        lines.append(death_text(death, time.time()))
        if death.get("snapshot"):
            lines.append(f"  %gpu_snapshot restore {death['snapshot']['name']}")
    if status.get("ready"):
        lines.append(f"Kernel {kid}: ready to snapshot.")
    else:
        reasons = "; ".join(status.get("reasons") or []) or "no reason given"
        lines.append(f"Kernel {kid}: not snapshot-ready: {reasons}.")
    if identity is not None and identity.restored_from_kernel:
        lines.append(f"This process was restored from a snapshot of kernel "
                     f"{identity.restored_from_kernel}.")
    lines.append(cuda_text(status.get("cuda")))
    estimate = estimate_text(status)
    if estimate:
        lines.append(estimate + ".")
    last = status.get("last_snapshot")
    if last:
        lines.append(f"Last snapshot: {last_snapshot_text(last)}.")
    else:
        lines.append("No snapshot of this notebook yet.")
    job = status.get("job")
    if job and job.get("status") == "running":
        lines.append(f"Running: {job.get('kind')} job {job.get('id')}, {job_progress_text(job)}.")
    return lines


def cuda_text(cuda: dict[str, Any] | None) -> str:
    if cuda is None:  # the kernel loaded the CUDA driver, and no GPU layer can say more
        return "CUDA: state unknown (the server cannot inspect it)."
    if cuda.get("state") in (None, "none"):
        return "CUDA: not in use by this kernel."
    text = f"CUDA: {cuda.get('state')}"
    memory = cuda.get("memory_bytes")
    if memory is not None:
        text += f", {format_bytes(int(memory))} of GPU memory in use"
    return text + "."


def snapshot_size_text(summary: Mapping[str, Any]) -> str:
    """'1.2 GiB (45.0 MiB new)': the images a restore gets, then what the save wrote to the
    store when pages it shares with other snapshots made that less (the labextension says
    the same)."""
    size = int(summary.get("size_bytes") or 0)
    new = summary.get("new_bytes")
    if not isinstance(new, int) or new >= size:
        return format_bytes(size)
    return f"{format_bytes(size)} ({format_bytes(new)} new)"


def last_snapshot_text(summary: dict[str, Any]) -> str:
    created = float(summary.get("created", 0))
    return (
        f"{summary.get('name')} ({summary.get('id')}), {format_age(time.time() - created)}, "
        f"{snapshot_size_text(summary)}"
    )


def estimate_text(status: dict[str, Any]) -> str | None:
    estimate = snapshot_estimate(status)
    if estimate is None:
        return None
    host, gpu = estimate
    text = f"A snapshot now would hold about {format_bytes(host + gpu)}"
    if gpu:
        text += f" ({format_bytes(host)} host memory, {format_bytes(gpu)} GPU memory)"
    return text


def snapshot_estimate(status: Mapping[str, Any]) -> tuple[int, int] | None:
    """(host bytes, GPU bytes) a snapshot taken now would hold, from here and the status.

    The GPU layer stages the device memory in host memory before the dump, so both count.
    """
    host = namespace_rss_bytes()
    if host is None:
        return None
    cuda = status.get("cuda") or {}
    return host, int(cuda.get("memory_bytes") or 0)


def local_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def format_minutes(value: float) -> str:
    return f"{round(value, 1):g} min" if value >= 1 else f"{round(value * 60):g} s"


def autosave_lines(state: dict[str, Any], now: float) -> list[str]:
    """``%gpu_snapshot autosave``'s answer: the policy, the last autosave, the next one."""
    policy = state.get("policy") or {}
    where = state.get("notebook_path") or "this kernel"
    if not policy.get("enabled"):
        head = f"Autosave of {where}: off."
    else:
        after = float(policy.get("after_cell_minutes") or 0)
        head = (
            f"Autosave of {where}: every {format_minutes(float(policy['interval_minutes']))} "
            "when cells ran"
            + (f", and after any cell of {format_minutes(after)} or more" if after > 0 else "")
            + (", also while a cell runs." if policy.get("during_cell") else ", between cells.")
        )
    if state.get("override"):
        head += " (set for this notebook)"
    lines = [head]
    last = state.get("last_autosave")
    if state.get("autosaving"):
        lines.append("Autosaving now…")
    elif last:
        pause = last.get("pause")
        paused = f", paused the kernel {pause:.1f} s" if isinstance(pause, float) else ""
        lines.append(
            f"Last autosave: {format_age(now - float(last['created']))} "
            f"({last.get('snapshot_id')}{paused})."
        )
    if state.get("last_skip"):
        lines.append(f"Last autosave not made: {state['last_skip']}")
    next_at = state.get("next_autosave")
    if next_at is not None and policy.get("enabled"):
        left = float(next_at) - now
        lines.append("Next autosave: " + (
            f"in {format_minutes(left / 60)}"
            if left > 0 else "at the next look (once the running cell ends)"
        ) + ".")
    elif policy.get("enabled"):
        lines.append("Nothing ran since the last snapshot: no autosave is due.")
    return lines


# The policy field (the server's AutosavePolicy) that says after how long idle a kernel
# hibernates in each tier: the GPU released with the process kept, or the process saved
# and ended.
IDLE_POLICY_FIELDS = {"gpu": "release_gpu_after_minutes", "process": "hibernate_after_minutes"}
_TIER_TITLES = {"gpu": "GPU released", "process": "Hibernation"}
# What the kernel does by itself in each tier, said of "this notebook's kernel".
_TIER_VERBS = {"gpu": "gives its GPU back", "process": "hibernates"}


def hibernation_text(state: dict[str, Any]) -> str:
    """One line for the panel: when this notebook's kernel hibernates once idle, in each
    tier; empty from a server that does not hibernate."""
    policy = state.get("policy") or {}
    override = state.get("override") or {}
    parts = []
    for tier, field in IDLE_POLICY_FIELDS.items():
        minutes = policy.get(field)
        if minutes is None:  # a server from before this tier's policy
            continue
        whose = ("this notebook's setting" if override.get(field) is not None
                 else "the server's setting")
        when = f"after {format_minutes(float(minutes))} idle" if minutes else "never by itself"
        parts.append(f"{_TIER_TITLES[tier]}: {when} ({whose}).")
    return " ".join(parts)


def idle_policy_line(tier: str, minutes: float) -> str:
    """``%gpu_snapshot hibernate [gpu] after 30m``'s answer: the notebook's time now."""
    verb = _TIER_VERBS[tier]
    if not minutes:
        return f"This notebook's kernel never {verb} by itself."
    return f"This notebook's kernel {verb} after {format_minutes(minutes)} idle."


def autosave_text(state: dict[str, Any], now: float) -> str:
    """One line for the panel: the notebook's policy, the last autosave, the next one."""
    policy = state.get("policy") or {}
    if not policy.get("enabled"):
        return "Autosave: off for this notebook."
    text = f"Autosave: every {format_minutes(float(policy['interval_minutes']))}"
    if state.get("autosaving"):
        return f"{text}; autosaving now…"
    last = state.get("last_autosave")
    if last:
        text += f"; last {format_age(now - float(last['created']))}"
        if isinstance(last.get("pause"), float):
            text += f" (paused {last['pause']:.1f} s)"
    next_at = state.get("next_autosave")
    if next_at is not None:
        left = float(next_at) - now
        text += f"; next in {format_age(left).removesuffix(' ago')}" if left >= 60 else (
            "; next within a minute")
    else:
        text += "; nothing to save"
    return text + "."


def hibernate_note(tier: str, cuda: Mapping[str, Any] | None) -> str:
    """What ``%gpu_snapshot hibernate`` and the panel's Hibernate button say: once the
    running cell ends, the kernel gives its GPU back (the gpu tier) or its process stops;
    a kernel that never loaded the CUDA driver (``cuda`` of its status) frees host memory,
    and the GPU goes unsaid."""
    if tier == "gpu":
        return ("This kernel gives its GPU back once this cell ends: its GPU memory moves "
                "into its host memory and its process waits. The next cell you run wakes "
                "it in seconds, with everything in place.")
    freed = ("its memory is freed" if cuda is not None and cuda.get("state") == "none"
             else "its GPU and host memory are freed")
    return (f"This kernel hibernates once this cell ends: its process stops and {freed}. "
            "The next cell you run wakes it, with everything in place.")
