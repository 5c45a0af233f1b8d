/**
 * How sizes, ages and job progress read in the UI.
 */
import type { IJob, ISnapshotSummary } from './api';

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

/** "12 s ago", "5 min ago", "3 h ago", "2 days ago". */
export function formatAge(epochSeconds: number, now = Date.now() / 1000): string {
  const age = Math.max(0, now - epochSeconds);
  if (age < 60) {
    return `${Math.round(age)} s ago`;
  }
  if (age < 3600) {
    return `${Math.round(age / 60)} min ago`;
  }
  if (age < 86400) {
    return `${Math.round(age / 3600)} h ago`;
  }
  const days = Math.round(age / 86400);
  return `${days} day${days === 1 ? '' : 's'} ago`;
}

export function formatTime(epochSeconds: number): string {
  return new Date(epochSeconds * 1000).toLocaleString();
}

export function formatSeconds(seconds: number): string {
  return seconds < 10 ? `${seconds.toFixed(2)} s` : `${seconds.toFixed(1)} s`;
}

const PHASE_LABELS: { [phase: string]: string } = {
  preflight: 'checking',
  suspend: 'pausing the kernel',
  dump: 'writing memory',
  resume: 'resuming the kernel',
  commit: 'committing',
  verify: 'verifying',
  restore: 'restoring',
  done: 'done'
};

/** One line on a running job: its phase and, when known, the bytes moved. */
export function describeProgress(job: IJob): string {
  const phase = PHASE_LABELS[job.phase] ?? job.phase;
  if (job.total > 0) {
    return `${phase}: ${formatBytes(job.done)} of ${formatBytes(job.total)}`;
  }
  if (job.done > 0) {
    return `${phase}: ${formatBytes(job.done)}`;
  }
  return `${phase}…`;
}

/** Fraction done in [0, 1], or undefined while unknown. */
export function jobFraction(job: IJob): number | undefined {
  if (job.total > 0) {
    return Math.min(1, job.done / job.total);
  }
  return undefined;
}

/** The GPU column: "NVIDIA H100 80GB, 1.1 GiB" or "CPU only". */
export function describeGpu(snapshot: ISnapshotSummary): string {
  const gpu = snapshot.gpu;
  if (!gpu) {
    return 'CPU only';
  }
  const parts: string[] = [];
  const name = gpu['name'] ?? gpu['device_name'] ?? gpu['model'];
  if (typeof name === 'string') {
    parts.push(name);
  } else if (Array.isArray(gpu['devices']) && gpu['devices'].length) {
    const first = gpu['devices'][0] as { [key: string]: unknown };
    if (typeof first?.['name'] === 'string') {
      parts.push(
        gpu['devices'].length > 1
          ? `${gpu['devices'].length}× ${first['name']}`
          : (first['name'] as string)
      );
    }
  }
  const memory = gpu['memory_bytes'] ?? gpu['device_memory_bytes'];
  if (typeof memory === 'number' && memory > 0) {
    parts.push(formatBytes(memory));
  }
  return parts.length ? parts.join(', ') : 'GPU';
}

/** "saved 'before-training' (12.3 MiB) in 0.84 s". */
export function describeSaved(snapshot: ISnapshotSummary): string {
  const total = snapshot.timings?.['total'];
  const time = typeof total === 'number' ? ` in ${formatSeconds(total)}` : '';
  return `Snapshot saved: '${snapshot.name}', ${formatBytes(snapshot.size_bytes)}${time}`;
}
