/**
 * One bar for a whole job: each phase has its share, set by how long the kernel's last
 * save spent in each, and a phase the job never runs takes none.
 */
import type { IJob } from '../src/api';
import { overallFraction } from '../src/phases';
import { makeJob } from './fixtures';

const save = (phase: string, done = 0, total = 0): IJob =>
  makeJob({ kind: 'save', phase: phase as IJob['phase'], done, total });

describe('overallFraction', () => {
  it("runs from 0 to 1 over a save's phases, each phase after the one before", () => {
    const steps = [
      save('preflight'),
      save('suspend'),
      save('dump', 1, 2),
      save('dump', 2, 2),
      save('resume'),
      save('commit', 1, 2),
      save('commit', 2, 2)
    ];
    const seen = new Set<string>();
    const fractions = steps.map(job => {
      seen.add(job.phase);
      return overallFraction(job, seen);
    });
    expect(fractions[0]).toBe(0);
    fractions
      .slice(1)
      .forEach((f, at) => expect(f).toBeGreaterThanOrEqual(fractions[at]));
    expect(fractions[6]).toBeCloseTo(1);
    expect(overallFraction({ ...save('done'), status: 'succeeded' })).toBe(1);
  });

  it('gives no share to an optional phase the job did not run (no remote store)', () => {
    const commitDone = save('commit', 2, 2);
    expect(overallFraction(commitDone, new Set(['dump', 'commit']))).toBeCloseTo(1);
    // Uploading once seen: the commit is no longer the end of the bar.
    expect(overallFraction(commitDone, new Set(['commit', 'uploading']))).toBeLessThan(
      0.9
    );
  });

  it("takes each phase's share from a past save's timings", () => {
    const dumped = save('dump', 1, 1);
    const slowCommit = { preflight: 0.1, suspend: 0.1, dump: 1, resume: 0.1, commit: 20 };
    const slowDump = { preflight: 0.1, suspend: 0.1, dump: 20, resume: 0.1, commit: 1 };
    expect(overallFraction(dumped, new Set(['dump']), slowCommit)).toBeLessThan(0.1);
    expect(overallFraction(dumped, new Set(['dump']), slowDump)).toBeGreaterThan(0.9);
  });

  it('leaves a restore that downloads nothing its whole bar for the rest', () => {
    const restoring = makeJob({ kind: 'restore', phase: 'preflight', done: 0, total: 0 });
    expect(overallFraction(restoring, new Set(['preflight']))).toBe(0);
  });
});
