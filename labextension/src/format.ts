/**
 * How sizes, ages and job progress read in the UI, in the user's language.
 *
 * Each function takes the extension's TranslationBundle last; without one it speaks
 * English, so the pure functions keep working outside JupyterLab (unit tests).
 */
import {
  SNAPSHOT_KERNEL_NAME,
  type HibernationTier,
  type IAutosavePolicy,
  type IAutosaveState,
  type IHibernation,
  type IJob,
  type IKernelStatus,
  type IShutdownSave,
  type ISnapshotSummary
} from './api';
import { untranslated } from './translation';

export function formatBytes(n: number, trans = untranslated): string {
  // One literal per unit, so that translators see each (some languages write "o" for B).
  const units = [
    (size: string) => trans.__('%1 B', size),
    (size: string) => trans.__('%1 KiB', size),
    (size: string) => trans.__('%1 MiB', size),
    (size: string) => trans.__('%1 GiB', size),
    (size: string) => trans.__('%1 TiB', size)
  ];
  let size = n;
  let unit = 0;
  while (size >= 1024 && unit < units.length - 1) {
    size /= 1024;
    unit++;
  }
  return units[unit](unit === 0 ? `${n}` : size.toFixed(1));
}

/**
 * "just now", "5 min ago", "3 h ago", "2 days ago": the same words as the magic and the
 * widget (kernel/presentation.py's format_age).
 */
export function formatAge(
  epochSeconds: number,
  now = Date.now() / 1000,
  trans = untranslated
): string {
  const age = Math.max(0, now - epochSeconds);
  if (age < 60) {
    return trans.__('just now');
  }
  if (age < 3600) {
    return trans.__('%1 min ago', Math.floor(age / 60));
  }
  if (age < 48 * 3600) {
    return trans.__('%1 h ago', Math.floor(age / 3600));
  }
  return trans._n('%1 day ago', '%1 days ago', Math.floor(age / 86400));
}

export function formatTime(epochSeconds: number): string {
  return new Date(epochSeconds * 1000).toLocaleString();
}

export function formatSeconds(seconds: number, trans = untranslated): string {
  return trans.__('%1 s', seconds < 10 ? seconds.toFixed(2) : seconds.toFixed(1));
}

/** What each phase of a job reads as; kernel/presentation.py's PHASE_LABELS says the same. */
export function phaseLabels(trans = untranslated): { [phase: string]: string } {
  return {
    preflight: trans.__('checking'),
    suspend: trans.__('pausing the kernel'),
    dump: trans.__('writing memory'),
    resume: trans.__('resuming the kernel'),
    commit: trans.__('committing'),
    uploading: trans.__('uploading to the remote store'),
    downloading: trans.__('downloading from the remote store'),
    verify: trans.__('verifying'),
    restore: trans.__('restoring'),
    fallback: trans.__('bringing the work back'),
    done: trans.__('finishing')
  };
}

/** The phase labels in English, as the kernel side words them. */
export const PHASE_LABELS = phaseLabels();

/**
 * One line on a running job: its phase, the bytes moved when known, and an ETA. A dump's
 * total is an estimate (the kernel's memory, of which criu writes less): only the bytes
 * written show, so that no size disagrees with the snapshot's.
 */
export function describeProgress(
  job: IJob,
  etaSeconds?: number,
  trans = untranslated
): string {
  const phase = phaseLabels(trans)[job.phase] ?? job.phase;
  let text: string;
  if (job.total > 0 && job.phase !== 'dump') {
    text = trans.__(
      '%1: %2 of %3',
      phase,
      formatBytes(job.done, trans),
      formatBytes(job.total, trans)
    );
  } else if (job.done > 0) {
    text = trans.__('%1: %2', phase, formatBytes(job.done, trans));
  } else {
    return trans.__('%1…', phase);
  }
  return etaSeconds === undefined
    ? text
    : trans.__('%1, %2', text, formatEta(etaSeconds, trans));
}

/** "about 12 s left", "about 3 min left". */
export function formatEta(seconds: number, trans = untranslated): string {
  if (seconds < 60) {
    return trans.__('about %1 s left', Math.max(1, Math.ceil(seconds)));
  }
  return trans.__('about %1 min left', Math.ceil(seconds / 60));
}

/**
 * Seconds left of a job at its rate so far; undefined while too early to tell (under a
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
 * The progress bar of a running job's notification, from the fraction of the whole job
 * done. A bar at 1 followed within a few milliseconds by the success update leaves that
 * notification open for good (the toast library treats a full bar as its own close
 * timer): a running job's bar stops short.
 */
export function toastProgress(fraction: number | undefined): number | undefined {
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
export function describeGpu(snapshot: ISnapshotSummary, trans = untranslated): string {
  const gpu = snapshot.gpu as IGpuSection | null;
  if (!gpu) {
    return trans.__('CPU only');
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
    return trans.__('no GPU memory');
  }
  const label =
    names.length > 1 && names.every(n => n === names[0])
      ? trans.__('%1× %2', names.length, names[0])
      : names.join(' + ') || trans.__('GPU');
  return moved > 0 ? trans.__('%1, %2', label, formatBytes(moved, trans)) : label;
}

interface IGpuSection {
  devices?: { uuid: string; name: string }[];
  processes?: { devices?: { [uuid: string]: number } }[];
  moved_bytes?: number;
}

/**
 * "1.2 GiB (45.0 MiB new)": the images a restore gets, then what the save wrote when pages
 * it shares with other snapshots made that less (kernel/presentation.py says the same).
 */
export function formatSnapshotSize(
  snapshot: Pick<ISnapshotSummary, 'size_bytes' | 'new_bytes'>,
  trans = untranslated
): string {
  const size = formatBytes(snapshot.size_bytes, trans);
  const written = snapshot.new_bytes;
  if (typeof written !== 'number' || written >= snapshot.size_bytes) {
    return size;
  }
  return trans.__('%1 (%2 new)', size, formatBytes(written, trans));
}

/** "saved 'before-training' (12.3 MiB) in 0.84 s". */
export function describeSaved(snapshot: ISnapshotSummary, trans = untranslated): string {
  const total = snapshot.timings?.['total'];
  const size = formatSnapshotSize(snapshot, trans);
  const text =
    typeof total === 'number'
      ? trans.__(
          "Snapshot saved: '%1', %2 in %3",
          snapshot.name,
          size,
          formatSeconds(total, trans)
        )
      : trans.__("Snapshot saved: '%1', %2", snapshot.name, size);
  return snapshot.fallback?.includes('portable')
    ? trans.__('%1, with a portable copy', text)
    : text;
}

/** "every 15 min of activity, and after cells of 10 min or more", or "off". */
export function describeAutosavePolicy(
  policy: IAutosavePolicy,
  trans = untranslated
): string {
  if (!policy.enabled) {
    return trans.__('off');
  }
  let text = trans.__(
    'every %1 of activity',
    formatMinutes(policy.interval_minutes, trans)
  );
  if (policy.during_cell) {
    text = trans.__('%1, also during a cell', text);
  }
  if (policy.after_cell_minutes > 0) {
    text = trans.__(
      '%1, and after cells of %2 or more',
      text,
      formatMinutes(policy.after_cell_minutes, trans)
    );
  }
  return text;
}

/** When the next autosave comes, as the sidebar says it. */
export function describeNextAutosave(
  state: IAutosaveState,
  now = Date.now() / 1000,
  trans = untranslated
): string {
  if (state.autosaving) {
    return trans.__('autosaving now…');
  }
  if (!state.policy.enabled) {
    return trans.__('no autosave planned');
  }
  if (state.next_autosave === null) {
    return trans.__('nothing to save: no cell ran since the last snapshot');
  }
  const left = state.next_autosave - now;
  return left <= 60
    ? trans.__('next autosave within a minute')
    : trans.__('next autosave in %1', formatMinutes(left / 60, trans));
}

/**
 * What a kernel does by itself once idle for ``minutes`` in ``tier`` (0: never), as the
 * sidebar says it.
 */
export function describeIdlePolicy(
  tier: HibernationTier,
  minutes: number,
  trans = untranslated
): string {
  if (tier === 'gpu') {
    return minutes > 0
      ? trans.__('gives its GPU back after %1 min idle', minutes)
      : trans.__('never gives its GPU back by itself');
  }
  return minutes > 0
    ? trans.__('hibernates after %1 min idle', minutes)
    : trans.__('never hibernates by itself');
}

export function formatMinutes(minutes: number, trans = untranslated): string {
  if (minutes < 1) {
    return trans.__('%1 s', Math.round(minutes * 60));
  }
  if (minutes >= 120 && minutes % 60 === 0) {
    return trans.__('%1 h', minutes / 60);
  }
  return trans.__('%1 min', Math.round(minutes * 10) / 10);
}

/** Where a snapshot is kept, or '' from servers that do not say. */
export function describeLocation(
  snapshot: ISnapshotSummary,
  trans = untranslated
): string {
  const locations: { [location: string]: string } = {
    local: trans.__('on this server'),
    remote: trans.__('remote only'),
    both: trans.__('here and remote')
  };
  return snapshot.location ? (locations[snapshot.location] ?? snapshot.location) : '';
}

/**
 * The status bar's words for a kernel with no job under way: its last snapshot, or the last
 * autosave when that is newer. The autosave state and the kernel status are answered apart,
 * so right after an autosave the status may not list it yet; the autosave's own record then
 * speaks, rather than a passing "No snapshot yet".
 */
/**
 * What a hibernated kernel gave back, in words that fit it: GPU memory with its process kept
 * (the gpu tier), host memory for a kernel that held no GPU memory, else GPU memory.
 */
export function describeFreed(hibernation: IHibernation, trans = untranslated): string {
  const gpu = formatBytes(hibernation.gpu_bytes_freed ?? 0, trans);
  if (hibernation.tier === 'gpu') {
    return trans.__('%1 of GPU memory freed, process kept', gpu);
  }
  if (!hibernation.gpu_bytes_freed && hibernation.host_bytes_freed) {
    return trans.__(
      '%1 of host memory freed',
      formatBytes(hibernation.host_bytes_freed, trans)
    );
  }
  return trans.__('%1 of GPU memory freed', gpu);
}

/**
 * The status bar's words for a kernel's hibernation, or null when it has none: it is the
 * first thing the notebook's user needs to know of the kernel.
 */
export function describeHibernation(
  hibernation: IHibernation | null | undefined,
  trans = untranslated,
  cellRunning = true
): { text: string; title: string } | null {
  if (!hibernation) {
    return null;
  }
  const gpuTier = hibernation.tier === 'gpu';
  const gpu = formatBytes(hibernation.gpu_bytes_freed ?? 0, trans);
  const since = hibernation.since ? formatTime(hibernation.since) : '?';
  // Asked for while no cell runs: it goes now, there is no cell to wait for.
  const state =
    hibernation.state === 'requested' && !cellRunning ? 'hibernating' : hibernation.state;
  switch (state) {
    case 'requested':
      return {
        text: gpuTier
          ? trans.__('Releases the GPU after this cell')
          : trans.__('Hibernates after this cell'),
        title: gpuTier
          ? trans.__('The kernel gives its GPU back as soon as its running cell ends')
          : trans.__('The kernel hibernates as soon as its running cell ends')
      };
    case 'hibernating':
      return gpuTier
        ? {
            text: trans.__('Releasing the GPU…'),
            title: trans.__(
              "The kernel's GPU memory moves into its host memory; its process waits"
            )
          }
        : {
            text: trans.__('Hibernating…'),
            title: trans.__(
              'The kernel is being saved; its process then ends and frees the GPU'
            )
          };
    case 'waking':
      return {
        text: trans.__('Waking the kernel…'),
        title: gpuTier
          ? trans.__("The kernel's GPU memory comes back from its host memory")
          : trans.__('The kernel is restored from its hibernation snapshot')
      };
    default: {
      const error = hibernation.last_wake_error?.message;
      let words: { text: string; title: string };
      if (gpuTier) {
        words = {
          text: trans.__('GPU released: %1 freed', gpu),
          title: trans.__(
            'The kernel sleeps since %1 with its GPU released: its %2 of GPU memory wait in its host memory, and the GPU is free for others. The next cell you run wakes it in seconds, with everything in place.',
            since,
            gpu
          )
        };
      } else if (!hibernation.gpu_bytes_freed && hibernation.host_bytes_freed) {
        // A kernel without GPU memory: what it gave back is host memory.
        const host = formatBytes(hibernation.host_bytes_freed, trans);
        words = {
          text: trans.__('Hibernated: %1 of host memory freed', host),
          title: trans.__(
            'The kernel is hibernated since %1: its process ended and %2 of host memory are free. The next cell you run wakes it, with everything in place.',
            since,
            host
          )
        };
      } else {
        words = {
          text: trans.__('Hibernated: %1 of GPU memory freed', gpu),
          title: trans.__(
            'The kernel is hibernated since %1: its process ended and %2 of GPU memory are free. The next cell you run wakes it, with everything in place.',
            since,
            gpu
          )
        };
      }
      return error
        ? { ...words, title: trans.__('%1 The last wake failed: %2', words.title, error) }
        : words;
    }
  }
}

export function describeLastSnapshot(
  status: IKernelStatus,
  autosave: IAutosaveState | null,
  trans = untranslated,
  now = Date.now() / 1000
): { text: string; title: string } {
  const last = status.last_snapshot;
  const lastAutosave = autosave?.last_autosave ?? null;
  const autosaved = (created: number, name: string, pause: number | null) => {
    const age = formatAge(created, now, trans);
    if (pause === null) {
      return {
        text: trans.__('Autosaved %1', age),
        title: trans.__(
          "Last snapshot of this kernel: the autosave '%1'. Click to restore one.",
          name
        )
      };
    }
    const paused = formatSeconds(pause, trans);
    return {
      text: trans.__('Autosaved %1 (paused %2)', age, paused),
      title: trans.__(
        "Last snapshot of this kernel: the autosave '%1'; the kernel paused %2 for it. Click to restore one.",
        name,
        paused
      )
    };
  };
  if (
    lastAutosave !== null &&
    (last === null ||
      last.id === lastAutosave.snapshot_id ||
      lastAutosave.created > last.created)
  ) {
    const name =
      last?.id === lastAutosave.snapshot_id ? last.name : lastAutosave.snapshot_id;
    return autosaved(lastAutosave.created, name, lastAutosave.pause);
  }
  if (last?.reason === 'autosave') {
    return autosaved(last.created, last.name, null);
  }
  if (!status.ready && status.kernel_name !== SNAPSHOT_KERNEL_NAME) {
    // A kernel that cannot be saved has no snapshots of its own; its notebook's are in
    // the restore dialog. The button says why it cannot be saved.
    return { text: '', title: '' };
  }
  if (last) {
    return {
      text: trans.__('Snapshot %1', formatAge(last.created, now, trans)),
      title: trans.__(
        "Last snapshot of this kernel: '%1'. Click to restore one.",
        last.name
      )
    };
  }
  if (status.ready) {
    return {
      text: trans.__('No snapshot yet'),
      title: trans.__(
        'This kernel can be snapshotted; it has no snapshot yet. Click to restore one.'
      )
    };
  }
  return { text: '', title: '' };
}

/** Why a snapshot was taken, as its badge says it (the sidebar's, the dialog's). */
export function reasonLabel(reason: string, trans = untranslated): string {
  const labels: { [reason: string]: string } = {
    user: trans.__('saved by hand'),
    autosave: trans.__('autosave'),
    shutdown: trans.__('before shutdown'),
    hibernate: trans.__('hibernation')
  };
  return labels[reason] ?? reason;
}

/**
 * The restore dialog's badge of a snapshot the user did not save by hand (none for one
 * saved by hand): its reason, with a tooltip that says it in a sentence.
 */
export function reasonBadge(
  reason: string,
  trans = untranslated
): { text: string; title: string } | null {
  const titles: { [reason: string]: string } = {
    autosave: trans.__('Saved by the autosave'),
    shutdown: trans.__('Saved when the server shut down'),
    hibernate: trans.__('Saved when the kernel hibernated')
  };
  if (reason === 'user') {
    return null;
  }
  return { text: reasonLabel(reason, trans), title: titles[reason] ?? reason };
}

/**
 * A warning for a kernel whose save at shutdown would not fit the server's budget, or ''
 * when it fits (or no save would be made): the server then stops it without a save, and
 * after the restart its notebook is offered an older snapshot.
 */
export function describeShutdownSave(
  save: IShutdownSave | null,
  trans = untranslated
): string {
  if (!save || save.fits) {
    return '';
  }
  return trans.__(
    'Too big to be saved when the server stops: its save would take about %1, and the server allows %2 (c.GPUSnapshot.shutdown_budget). A restart would offer its newest snapshot instead; take one now to keep this work.',
    formatSeconds(save.seconds, trans),
    formatSeconds(save.budget, trans)
  );
}
