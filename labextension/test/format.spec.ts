/**
 * How the extension words sizes, times, ages, job progress and the GPU column.
 */
import {
  PHASE_LABELS,
  describeGpu,
  describeFreed,
  describeHibernation,
  describeIdlePolicy,
  describeLastSnapshot,
  describeProgress,
  describeSaved,
  describeShutdownSave,
  estimateSecondsLeft,
  formatAge,
  formatBytes,
  formatEta,
  formatSeconds,
  formatSnapshotSize,
  formatTime,
  jobFraction,
  reasonBadge,
  toastProgress
} from '../src/format';
import type { IAutosaveState, IKernelStatus, ISnapshotSummary } from '../src/api';
import { GiB, MiB, ShoutingBundle, makeJob, makeSnapshot, makeStatus } from './fixtures';

describe('formatBytes', () => {
  it('gives bytes as an integer and larger units with one decimal', () => {
    expect(formatBytes(0)).toBe('0 B');
    expect(formatBytes(512)).toBe('512 B');
    expect(formatBytes(1023)).toBe('1023 B');
    expect(formatBytes(1024)).toBe('1.0 KiB');
    expect(formatBytes(40.6 * MiB)).toBe('40.6 MiB');
    expect(formatBytes(1.1 * GiB)).toBe('1.1 GiB');
    expect(formatBytes(3 * 1024 * GiB)).toBe('3.0 TiB');
  });

  it('stays in TiB beyond its last unit', () => {
    expect(formatBytes(2048 * 1024 * GiB)).toBe('2048.0 TiB');
  });
});

describe('formatSnapshotSize', () => {
  it('adds what the save wrote when shared pages made it less', () => {
    expect(formatSnapshotSize({ size_bytes: 1.2 * GiB, new_bytes: 45 * MiB })).toBe(
      '1.2 GiB (45.0 MiB new)'
    );
  });

  it('says the size once when all of it was written, or the server does not say', () => {
    expect(formatSnapshotSize({ size_bytes: 3 * MiB, new_bytes: 3 * MiB + 768 })).toBe(
      '3.0 MiB'
    );
    expect(formatSnapshotSize({ size_bytes: 3 * MiB })).toBe('3.0 MiB');
  });

  it('is what a save announces', () => {
    const snapshot = makeSnapshot({ name: 'again', size_bytes: GiB, new_bytes: 2 * MiB });
    expect(describeSaved(snapshot)).toContain("'again', 1.0 GiB (2.0 MiB new) in");
  });

  it('is translated as one phrase', () => {
    const text = formatSnapshotSize(
      { size_bytes: GiB, new_bytes: MiB },
      new ShoutingBundle()
    );
    expect(text).toBe('1.0 GIB (1.0 MIB NEW)');
  });
});

describe('formatSeconds', () => {
  it('keeps two decimals under ten seconds and one above', () => {
    expect(formatSeconds(0.84)).toBe('0.84 s');
    expect(formatSeconds(9.994)).toBe('9.99 s');
    expect(formatSeconds(10)).toBe('10.0 s');
    expect(formatSeconds(73.25)).toBe('73.3 s');
  });
});

describe('formatTime', () => {
  it("is the browser's local rendering of the epoch seconds", () => {
    const epoch = 1_700_000_000;
    expect(formatTime(epoch)).toBe(new Date(epoch * 1000).toLocaleString());
  });
});

describe('formatAge, in the words of the magic and the panel', () => {
  const now = 1_000_000;

  it('says "just now" under a minute', () => {
    expect(formatAge(now, now)).toBe('just now');
    expect(formatAge(now - 12, now)).toBe('just now');
    expect(formatAge(now - 59, now)).toBe('just now');
  });

  it('counts minutes, then hours up to two days, then days', () => {
    expect(formatAge(now - 60, now)).toBe('1 min ago');
    expect(formatAge(now - 300, now)).toBe('5 min ago');
    expect(formatAge(now - 3599, now)).toBe('59 min ago');
    expect(formatAge(now - 3600, now)).toBe('1 h ago');
    expect(formatAge(now - 3 * 3600, now)).toBe('3 h ago');
    expect(formatAge(now - 30 * 3600, now)).toBe('30 h ago');
    expect(formatAge(now - 48 * 3600, now)).toBe('2 days ago');
    expect(formatAge(now - 3 * 86400, now)).toBe('3 days ago');
  });

  it('reads a time slightly in the future (clocks a little apart) as "just now"', () => {
    expect(formatAge(now + 5, now)).toBe('just now');
  });

  it('measures from the present when no time is given', () => {
    jest.useFakeTimers({ now: new Date(now * 1000) });
    try {
      expect(formatAge(now - 300)).toBe('5 min ago');
    } finally {
      jest.useRealTimers();
    }
  });
});

describe('time left', () => {
  it('is unknown without a fraction, under 2 % done, under a second in, or once done', () => {
    expect(estimateSecondsLeft(undefined, 5)).toBeUndefined();
    expect(estimateSecondsLeft(0.01, 5)).toBeUndefined();
    expect(estimateSecondsLeft(0.5, 0.5)).toBeUndefined();
    expect(estimateSecondsLeft(1, 5)).toBeUndefined();
  });

  it('extrapolates the rate so far', () => {
    expect(estimateSecondsLeft(0.25, 3)).toBe(9);
    expect(estimateSecondsLeft(0.02, 1)).toBeCloseTo(49);
    expect(estimateSecondsLeft(0.5, 1)).toBe(1);
  });

  it('reads in whole seconds, at least one, then in minutes', () => {
    expect(formatEta(9)).toBe('about 9 s left');
    expect(formatEta(8.1)).toBe('about 9 s left');
    expect(formatEta(0.2)).toBe('about 1 s left');
    expect(formatEta(0)).toBe('about 1 s left');
    expect(formatEta(59.5)).toBe('about 60 s left');
    expect(formatEta(60)).toBe('about 1 min left');
    expect(formatEta(130)).toBe('about 3 min left');
  });
});

describe('describeProgress: the phase, the bytes and the time left', () => {
  it('names the phase and the bytes of both sides', () => {
    const job = makeJob({ phase: 'commit', done: 412 * MiB, total: 1.1 * GiB });
    expect(describeProgress(job)).toBe('committing: 412.0 MiB of 1.1 GiB');
  });

  it("gives a dump's bytes written alone: its total is an estimate of the image", () => {
    const job = makeJob({ phase: 'dump', done: 412 * MiB, total: 1.1 * GiB });
    expect(describeProgress(job)).toBe('writing memory: 412.0 MiB');
  });

  it('adds the time left when known', () => {
    const job = makeJob({ phase: 'commit', done: 256 * MiB, total: 1024 * MiB });
    expect(describeProgress(job, 9)).toBe(
      'committing: 256.0 MiB of 1.0 GiB, about 9 s left'
    );
  });

  it('gives the bytes done alone while the total is unknown', () => {
    const job = makeJob({ phase: 'verify', done: 5 * MiB, total: 0 });
    expect(describeProgress(job)).toBe('verifying: 5.0 MiB');
    expect(describeProgress(job, 130)).toBe('verifying: 5.0 MiB, about 3 min left');
  });

  it('gives the phase alone before any bytes moved', () => {
    const job = makeJob({ phase: 'suspend', done: 0, total: 0 });
    expect(describeProgress(job)).toBe('pausing the kernel…');
  });

  it('does not read "done…" when a restore finishes', () => {
    expect(describeProgress(makeJob({ phase: 'done', done: 0, total: 0 }))).toBe(
      'finishing…'
    );
  });

  it('shows a phase it has no words for as the server names it', () => {
    const job = makeJob({ phase: 'future-phase' as never, done: 0, total: 0 });
    expect(describeProgress(job)).toBe('future-phase…');
  });

  it('has words for every phase of the API', () => {
    expect(Object.keys(PHASE_LABELS).sort()).toEqual(
      [
        'commit',
        'done',
        'downloading',
        'dump',
        'fallback',
        'preflight',
        'restore',
        'resume',
        'suspend',
        'uploading',
        'verify'
      ].sort()
    );
    expect(PHASE_LABELS.dump).toBe('writing memory');
  });
});

describe('fractions and the notification bar', () => {
  it('is the share of bytes done, capped at 1, unknown without a total', () => {
    const job = makeJob({ phase: 'dump', done: 412 * MiB, total: 1.1 * GiB });
    expect(jobFraction(job)).toBe((412 * MiB) / (1.1 * GiB));
    expect(jobFraction(makeJob({ done: 7, total: 5 }))).toBe(1);
    expect(jobFraction(makeJob({ phase: 'suspend', done: 0, total: 0 }))).toBeUndefined();
  });

  it('never fills the bar of a running job (that kept success toasts open)', () => {
    expect(toastProgress(1)).toBe(0.99);
    expect(toastProgress(0.25)).toBe(0.25);
    expect(toastProgress(undefined)).toBeUndefined();
  });
});

describe('describeGpu: the GPU column', () => {
  const h100 = { uuid: 'GPU-a', name: 'NVIDIA H100 80GB HBM3' };
  const other = { uuid: 'GPU-b', name: 'NVIDIA H100 80GB HBM3' };
  const a100 = { uuid: 'GPU-c', name: 'NVIDIA A100-SXM4-40GB' };
  const gpuOf = (gpu: unknown) => describeGpu(makeSnapshot({ gpu: gpu as never }));

  it('says "CPU only" for a kernel saved without a GPU section', () => {
    expect(describeGpu(makeSnapshot({ gpu: null }))).toBe('CPU only');
  });

  it('names only the GPUs the kernel had memory on, and the bytes saved', () => {
    expect(
      gpuOf({
        devices: [h100, other],
        processes: [{ devices: { 'GPU-a': 66 * MiB } }],
        moved_bytes: 1.1 * GiB
      })
    ).toBe('NVIDIA H100 80GB HBM3, 1.1 GiB');
  });

  it('counts several GPUs of one model', () => {
    expect(
      gpuOf({
        devices: [h100, other],
        processes: [{ devices: { 'GPU-a': MiB } }, { devices: { 'GPU-b': MiB } }],
        moved_bytes: 2 * MiB
      })
    ).toBe('2× NVIDIA H100 80GB HBM3, 2.0 MiB');
  });

  it('joins the names of different models', () => {
    expect(
      gpuOf({
        devices: [h100, a100],
        processes: [{ devices: { 'GPU-a': MiB, 'GPU-c': MiB } }],
        moved_bytes: 0
      })
    ).toBe('NVIDIA H100 80GB HBM3 + NVIDIA A100-SXM4-40GB');
  });

  it('says "no GPU memory" for a kernel on a GPU machine that never touched CUDA', () => {
    expect(gpuOf({ devices: [h100], processes: [], moved_bytes: 0 })).toBe(
      'no GPU memory'
    );
    expect(
      gpuOf({ devices: [h100], processes: [{ devices: { 'GPU-a': 0 } }], moved_bytes: 0 })
    ).toBe('no GPU memory');
    expect(gpuOf({})).toBe('no GPU memory');
  });

  it('says "GPU" when bytes were saved from devices it has no names for', () => {
    expect(gpuOf({ devices: [], processes: [], moved_bytes: 3 * MiB })).toBe(
      'GPU, 3.0 MiB'
    );
  });
});

describe('describeSaved: the notification after a save', () => {
  it('gives name, size and time', () => {
    expect(
      describeSaved(
        makeSnapshot({
          name: 'before-training',
          size_bytes: 12.3 * MiB,
          timings: { total: 0.84 }
        })
      )
    ).toBe("Snapshot saved: 'before-training', 12.3 MiB in 0.84 s");
  });

  it('leaves the time out when the server did not time the save', () => {
    expect(describeSaved(makeSnapshot({ name: 'x', size_bytes: 512, timings: {} }))).toBe(
      "Snapshot saved: 'x', 512 B"
    );
  });

  it('says when the snapshot holds a portable copy, not when it only recorded cells', () => {
    const saved = (fallback: ISnapshotSummary['fallback']) =>
      describeSaved(makeSnapshot({ name: 'x', size_bytes: 512, timings: {}, fallback }));
    expect(saved(['portable', 'replay', 'both'])).toBe(
      "Snapshot saved: 'x', 512 B, with a portable copy"
    );
    expect(saved(['replay'])).toBe("Snapshot saved: 'x', 512 B");
    expect(saved([])).toBe("Snapshot saved: 'x', 512 B");
  });
});

describe('a TranslationBundle given to the formatters', () => {
  it("words a job's progress in the bundle's language, figures left as they are", () => {
    const trans = new ShoutingBundle();
    const job = makeJob({ phase: 'commit', done: 50 * MiB, total: 100 * MiB });
    expect(describeProgress(job, 12, trans)).toBe(
      'COMMITTING: 50.0 MIB OF 100.0 MIB, ABOUT 12 S LEFT'
    );
    expect(trans.asked).toEqual(
      expect.arrayContaining(['committing', '%1: %2 of %3', 'about %1 s left'])
    );
    // Without a bundle the same line is the English one.
    expect(describeProgress(job, 12)).toBe(
      'committing: 50.0 MiB of 100.0 MiB, about 12 s left'
    );
  });

  it('picks plural forms through the bundle', () => {
    const trans = new ShoutingBundle();
    expect(formatAge(0, 3 * 86400, trans)).toBe('3 DAYS AGO');
    expect(trans.asked).toEqual(['%1 days ago']);
  });
});

describe('describeLastSnapshot', () => {
  const now = 1_800_000_000;
  const status = (last: ISnapshotSummary | null): IKernelStatus =>
    makeStatus({ kernel_id: 'k1', last_snapshot: last });
  const autosave = (last: IAutosaveState['last_autosave']): IAutosaveState => ({
    kernel_id: 'k1',
    notebook_path: 'train.ipynb',
    policy: {
      enabled: true,
      interval_minutes: 10,
      after_cell_minutes: 2,
      during_cell: true
    },
    override: {},
    unsaved_work: false,
    next_autosave: null,
    autosaving: false,
    last_autosave: last,
    last_skip: null
  });
  const autosaveOf = (id: string, secondsAgo: number, pause: number) =>
    autosave({ snapshot_id: id, created: now - secondsAgo, pause, size_bytes: GiB });

  const justNow = autosaveOf('20261123T060000Z-abcd1234', 5, 1.62);
  const older = makeSnapshot({ id: 'older', created: now - 600, reason: 'user' });
  const mine = makeSnapshot({
    id: 'mine',
    name: 'mine',
    created: now - 120,
    reason: 'user'
  });
  const pastServers = makeSnapshot({ id: 'a2', created: now - 30, reason: 'autosave' });

  /** Each row: the case, the status's last snapshot, the autosave state, the text. */
  const lines: [string, ISnapshotSummary | null, IAutosaveState | null, string][] = [
    [
      'names the autosave that just ended, before the status lists it',
      null,
      justNow,
      'Autosaved just now (paused 1.62 s)'
    ],
    [
      'names the autosave that just ended, over an older snapshot the status lists',
      older,
      justNow,
      'Autosaved just now (paused 1.62 s)'
    ],
    [
      'names a user snapshot later than the last autosave',
      mine,
      autosaveOf('auto', 3000, 1.5),
      'Snapshot 2 min ago'
    ],
    [
      'names an autosave of a past server, without its pause',
      pastServers,
      null,
      'Autosaved just now'
    ],
    [
      'says "No snapshot yet" only when neither knows a snapshot',
      null,
      autosave(null),
      'No snapshot yet'
    ]
  ];

  it.each(lines)('%s', (_, last, autosaveState, text) => {
    expect(describeLastSnapshot(status(last), autosaveState, undefined, now).text).toBe(
      text
    );
  });

  it('says nothing of a kernel that cannot be saved', () => {
    expect(
      describeLastSnapshot({ ...status(null), ready: false }, null, undefined, now)
    ).toEqual({ text: '', title: '' });
  });
});

describe('describeHibernation', () => {
  it('is null for a kernel that is not hibernated, so the last snapshot speaks', () => {
    expect(describeHibernation(null)).toBeNull();
    expect(describeHibernation(undefined)).toBeNull();
  });

  it('says how much GPU memory a hibernated kernel freed, and that a cell wakes it', () => {
    const words = describeHibernation({
      kernel_id: 'k',
      state: 'hibernated',
      gpu_bytes_freed: 16.1 * GiB,
      since: 1764000000
    });
    expect(words?.text).toBe('Hibernated: 16.1 GiB of GPU memory freed');
    expect(words?.title).toContain('The next cell you run wakes it');
  });

  it('says what a kernel without GPU memory gave back: host memory', () => {
    const words = describeHibernation({
      kernel_id: 'k',
      state: 'hibernated',
      tier: 'process',
      gpu_bytes_freed: 0,
      host_bytes_freed: 180 * MiB,
      since: 1764000000
    });
    expect(words?.text).toBe('Hibernated: 180.0 MiB of host memory freed');
  });

  it('names the gpu tier: the GPU released and the process kept', () => {
    const asleep = describeHibernation({
      kernel_id: 'k',
      state: 'hibernated',
      tier: 'gpu',
      gpu_bytes_freed: 16.1 * GiB,
      host_bytes_freed: 0,
      since: 1764000000
    });
    expect(asleep?.text).toBe('GPU released: 16.1 GiB freed');
    expect(asleep?.title).toContain('wakes it in seconds');
    expect(
      describeHibernation({ kernel_id: 'k', state: 'hibernating', tier: 'gpu' })?.text
    ).toBe('Releasing the GPU…');
    expect(
      describeHibernation({ kernel_id: 'k', state: 'requested', tier: 'gpu' })?.text
    ).toBe('Releases the GPU after this cell');
  });

  it('says in the sidebar what each kind of sleeper gave back', () => {
    const base = { kernel_id: 'k', state: 'hibernated' as const };
    expect(describeFreed({ ...base, tier: 'gpu', gpu_bytes_freed: 16.1 * GiB })).toBe(
      '16.1 GiB of GPU memory freed, process kept'
    );
    expect(
      describeFreed({
        ...base,
        tier: 'process',
        gpu_bytes_freed: 0,
        host_bytes_freed: GiB
      })
    ).toBe('1.0 GiB of host memory freed');
    expect(describeFreed({ ...base, gpu_bytes_freed: 2 * GiB })).toBe(
      '2.0 GiB of GPU memory freed'
    );
  });

  it('adds the cause of a failed wake', () => {
    const words = describeHibernation({
      kernel_id: 'k',
      state: 'hibernated',
      gpu_bytes_freed: 0,
      last_wake_error: {
        step: 'preflight',
        cause: 'shell port 5 of 127.0.0.1 in use',
        message: 'preflight failed: shell port 5 of 127.0.0.1 in use'
      }
    });
    expect(words?.title).toContain('The last wake failed: preflight failed');
  });

  it('names each step on the way', () => {
    expect(describeHibernation({ kernel_id: 'k', state: 'requested' })?.text).toBe(
      'Hibernates after this cell'
    );
    expect(describeHibernation({ kernel_id: 'k', state: 'hibernating' })?.text).toBe(
      'Hibernating…'
    );
    expect(describeHibernation({ kernel_id: 'k', state: 'waking' })?.text).toBe(
      'Waking the kernel…'
    );
  });
});

describe('describeIdlePolicy', () => {
  it('says what the kernel does by itself once idle, in each tier', () => {
    expect(describeIdlePolicy('gpu', 10)).toBe('gives its GPU back after 10 min idle');
    expect(describeIdlePolicy('gpu', 0)).toBe('never gives its GPU back by itself');
    expect(describeIdlePolicy('process', 30)).toBe('hibernates after 30 min idle');
    expect(describeIdlePolicy('process', 0)).toBe('never hibernates by itself');
  });

  it('speaks through the bundle', () => {
    const trans = new ShoutingBundle();
    expect(describeIdlePolicy('gpu', 2.5, trans)).toBe(
      'GIVES ITS GPU BACK AFTER 2.5 MIN IDLE'
    );
    expect(trans.asked).toEqual(['gives its GPU back after %1 min idle']);
  });
});

describe('what the status bar and the sidebar say of a kernel', () => {
  it('says nothing of snapshots for a kernel that cannot be saved', () => {
    const plain = makeStatus({
      ready: false,
      kernel_name: 'python3',
      reasons: ['not launched by the snapshot-ready provisioner'],
      last_snapshot: makeSnapshot()
    });
    expect(describeLastSnapshot(plain, null)).toEqual({ text: '', title: '' });
  });

  it('says a kernel hibernates now, not after a cell, when no cell runs', () => {
    const requested = {
      kernel_id: 'k',
      state: 'requested' as const,
      tier: 'process' as const
    };
    expect(describeHibernation(requested, undefined, true)?.text).toBe(
      'Hibernates after this cell'
    );
    expect(describeHibernation(requested, undefined, false)?.text).toBe('Hibernating…');
  });

  it("warns of a save that would not fit the shutdown's budget, and only then", () => {
    expect(describeShutdownSave(null)).toBe('');
    expect(describeShutdownSave({ seconds: 5, budget: 25, fits: true })).toBe('');
    expect(describeShutdownSave({ seconds: 40.2, budget: 25, fits: false })).toMatch(
      /^Too big to be saved when the server stops: its save would take about 40\.2 s, and the server allows 25\.0 s/
    );
  });

  it("badges a snapshot's reason in the dialog, except one saved by hand", () => {
    expect(reasonBadge('user')).toBeNull();
    expect(reasonBadge('hibernate')).toEqual({
      text: 'hibernation',
      title: 'Saved when the kernel hibernated'
    });
    expect(reasonBadge('shutdown')?.text).toBe('before shutdown');
  });
});
