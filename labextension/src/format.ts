/**
 * How sizes, ages and job progress read in the UI.
 */
import type { IAutosavePolicy, IAutosaveState, IJob, ISnapshotSummary } from './api';

export function formatBytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let size = n;
  let unit = 0;
  while (size >= 1024 && unit < units.length - 1) {
    size /= 1024;
    unit++;
  }
  return unit === 0 ? `${n} B` : `${size.toFixed(1)} ${units[unit]}`;
}

/**
 * "just now", "5 min ago", "3 h ago", "2 days ago": the same words as the magic and the
 * widget (kernel/presentation.py's format_age).
 */
export function formatAge(epochSeconds: number, now = Date.now() / 1000): string {
  const age = Math.max(0, now - epochSeconds);
  if (age < 60) {
    return 'just now';
  }
  if (age < 3600) {
    return `${Math.floor(age / 60)} min ago`;
  }
  if (age < 48 * 3600) {
    return `${Math.floor(age / 3600)} h ago`;
  }
  return `${Math.floor(age / 86400)} days ago`;
}

export function formatTime(epochSeconds: number): string {
  return new Date(epochSeconds * 1000).toLocaleString();
}

export function formatSeconds(seconds: number): string {
  return seconds < 10 ? `${seconds.toFixed(2)} s` : `${seconds.toFixed(1)} s`;
}

/** What each phase of a job reads as; kernel/presentation.py's PHASE_LABELS says the same. */
export const PHASE_LABELS: { [phase: string]: string } = {
  preflight: 'checking',
  suspend: 'pausing the kernel',
  dump: 'writing memory',
  resume: 'resuming the kernel',
  commit: 'committing',
  uploading: 'uploading to the remote store',
  downloading: 'downloading from the remote store',
  verify: 'verifying',
  restore: 'restoring',
  done: 'finishing'
};

/** One line on a running job: its phase, the bytes moved when known, and an ETA. */
export function describeProgress(job: IJob, etaSeconds?: number): string {
  const phase = PHASE_LABELS[job.phase] ?? job.phase;
  const eta = etaSeconds === undefined ? '' : `, ${formatEta(etaSeconds)}`;
  if (job.total > 0) {
    return `${phase}: ${formatBytes(job.done)} of ${formatBytes(job.total)}${eta}`;
  }
  if (job.done > 0) {
    return `${phase}: ${formatBytes(job.done)}${eta}`;
  }
  return `${phase}…`;
}

/** "about 12 s left", "about 3 min left". */
export function formatEta(seconds: number): string {
  if (seconds < 60) {
    return `about ${Math.max(1, Math.ceil(seconds))} s left`;
  }
  return `about ${Math.ceil(seconds / 60)} min left`;
}

/**
 * Seconds left in a phase at its rate so far; undefined while too early to tell (under a
 * second in, or under 2 % done), or once done.
 */
export function estimateSecondsLeft(
  fraction: number | undefined,
  elapsedSeconds: number
): number | undefined {
  if (fraction === undefined || fraction < 0.02 || fraction >= 1 || elapsedSeconds < 1) {
    return undefined;
  }
  return (elapsedSeconds * (1 - fraction)) / fraction;
}

/**
 * The progress bar of a running job's notification. A bar at 1 followed within a few
 * milliseconds by the success update leaves that notification open for good (the toast
 * library treats a full bar as its own close timer): a running job's bar stops short.
 */
export function toastProgress(job: IJob): number | undefined {
  const fraction = jobFraction(job);
  return fraction === undefined ? undefined : Math.min(fraction, 0.99);
}

/** Fraction done in [0, 1], or undefined while unknown. */
export function jobFraction(job: IJob): number | undefined {
  if (job.total > 0) {
    return Math.min(1, job.done / job.total);
  }
  return undefined;
}

/**
 * The GPU column: the GPUs the kernel had memory on and how much was saved, from the
 * manifest's "gpu" section (core/gpu_hook.py), e.g. "NVIDIA H100 80GB HBM3, 1.1 GiB".
 */
export function describeGpu(snapshot: ISnapshotSummary): string {
  const gpu = snapshot.gpu as IGpuSection | null;
  if (!gpu) {
    return 'CPU only';
  }
  const used = new Set<string>();
  for (const proc of gpu.processes ?? []) {
    for (const [uuid, bytes] of Object.entries(proc.devices ?? {})) {
      if (bytes > 0) {
        used.add(uuid);
      }
    }
  }
  const names = (gpu.devices ?? []).filter(d => used.has(d.uuid)).map(d => d.name);
  const moved = typeof gpu.moved_bytes === 'number' ? gpu.moved_bytes : 0;
  if (!names.length && moved === 0) {
    return 'no GPU memory';
  }
  const label =
    names.length > 1 && names.every(n => n === names[0])
      ? `${names.length}× ${names[0]}`
      : names.join(' + ') || 'GPU';
  return moved > 0 ? `${label}, ${formatBytes(moved)}` : label;
}

interface IGpuSection {
  devices?: { uuid: string; name: string }[];
  processes?: { devices?: { [uuid: string]: number } }[];
  moved_bytes?: number;
}

/** "saved 'before-training' (12.3 MiB) in 0.84 s". */
export function describeSaved(snapshot: ISnapshotSummary): string {
  const total = snapshot.timings?.['total'];
  const time = typeof total === 'number' ? ` in ${formatSeconds(total)}` : '';
  return `Snapshot saved: '${snapshot.name}', ${formatBytes(snapshot.size_bytes)}${time}`;
}

/** "every 15 min of activity, and after cells of 10 min or more", or "off". */
export function describeAutosavePolicy(policy: IAutosavePolicy): string {
  if (!policy.enabled) {
    return 'off';
  }
  const every = `every ${formatMinutes(policy.interval_minutes)} of activity`;
  const during = policy.during_cell ? ', also during a cell' : '';
  const after =
    policy.after_cell_minutes > 0
      ? `, and after cells of ${formatMinutes(policy.after_cell_minutes)} or more`
      : '';
  return every + during + after;
}

/** When the next autosave comes, as the sidebar says it. */
export function describeNextAutosave(
  state: IAutosaveState,
  now = Date.now() / 1000
): string {
  if (state.autosaving) {
    return 'autosaving now…';
  }
  if (!state.policy.enabled) {
    return 'no autosave planned';
  }
  if (state.next_autosave === null) {
    return 'nothing to save: no cell ran since the last snapshot';
  }
  const left = state.next_autosave - now;
  return left <= 60
    ? 'next autosave within a minute'
    : `next autosave in ${formatMinutes(left / 60)}`;
}

export function formatMinutes(minutes: number): string {
  if (minutes < 1) {
    return `${Math.round(minutes * 60)} s`;
  }
  if (minutes >= 120 && minutes % 60 === 0) {
    return `${minutes / 60} h`;
  }
  return `${Math.round(minutes * 10) / 10} min`;
}

const LOCATIONS: { [location: string]: string } = {
  local: 'on this server',
  remote: 'remote only',
  both: 'here and remote'
};

/** Where a snapshot is kept, or '' from servers that do not say. */
export function describeLocation(snapshot: ISnapshotSummary): string {
  return snapshot.location ? (LOCATIONS[snapshot.location] ?? snapshot.location) : '';
}
