/**
 * A job's phases on one bar. The server reports each phase's own bytes (a save's dump
 * against an estimate of the image, then its commit against the image as written), so a
 * bar per phase ran to 90 % and began again near 0. Here each phase has its share of one
 * bar, from how long the phases of the kernel's last save took when that is known, and a
 * bar never goes back: the controller keeps the furthest point each job reached.
 */
import type { IJob } from './api';
import { jobFraction } from './format';

/** The phases of each kind of job, in the order they run, with their usual seconds. */
const PHASES: { [kind: string]: [string, number][] } = {
  save: [
    ['preflight', 0.3],
    ['portable', 1],
    ['suspend', 0.2],
    ['dump', 1],
    ['resume', 0.2],
    ['commit', 1],
    ['uploading', 1]
  ],
  restore: [
    ['downloading', 2],
    ['preflight', 0.3],
    ['verify', 0.5],
    ['restore', 1],
    ['resume', 0.3],
    ['fallback', 2]
  ],
  wake: [
    ['waking', 1],
    ['preflight', 0.3],
    ['verify', 0.5],
    ['restore', 1],
    ['resume', 0.3]
  ]
};

/** Phases that run only for some jobs: they take a share only once a job is seen in them. */
const OPTIONAL = new Set(['portable', 'uploading', 'downloading', 'fallback']);

/**
 * The fraction of the whole job done, in [0, 1]. ``seen`` are the phases this job was
 * seen in so far (optional phases count only then); ``timings`` are a past save's
 * seconds per phase (a snapshot's ``timings``), which set each phase's share.
 */
export function overallFraction(
  job: IJob,
  seen: ReadonlySet<string> = new Set([job.phase]),
  timings: { [phase: string]: number } | null = null
): number {
  if (job.phase === 'done' || job.status !== 'running') {
    return 1;
  }
  const phases = PHASES[job.kind] ?? PHASES.save;
  const at = phases.findIndex(([phase]) => phase === job.phase);
  if (at < 0) {
    return 0; // a phase this client does not know: the bar stays where it was
  }
  const weight = ([phase, usual]: [string, number], index: number): number => {
    if (OPTIONAL.has(phase) && !seen.has(phase) && index !== at) {
      return 0;
    }
    const measured = timings?.[phase];
    return typeof measured === 'number' && measured > 0
      ? Math.max(measured, 0.05)
      : usual;
  };
  const weights = phases.map(weight);
  const whole = weights.reduce((sum, w) => sum + w, 0);
  const before = weights.slice(0, at).reduce((sum, w) => sum + w, 0);
  const within = (jobFraction(job) ?? 0) * weights[at];
  return Math.min(1, (before + within) / whole);
}
