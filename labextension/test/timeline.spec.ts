/**
 * The sidebar's Timeline: how a point and the whole timeline read, when a point's rewind
 * button is off and why, and when the kernel's timeline is asked again: after a cell of the
 * current notebook ends, after a rewind, when the notebook gets another kernel, on the
 * interval while the sidebar shows, never while it is hidden. The Poll and its timers
 * (jest's fake clock) are real; the server's API, the controller and the notebooks are
 * stand-ins.
 */
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Signal } from '@lumino/signaling';
import * as React from 'react';
import {
  type ITimeline,
  type ITimelinePoint,
  SnapshotAPI,
  SnapshotAPIError
} from '../src/api';
import type { SnapshotController } from '../src/controller';
import type { Rewinder } from '../src/rewind';
import {
  KernelTimeline,
  NAMES_SHOWN,
  TimelineSection,
  describePointNames,
  describeTimeline,
  listNames,
  rewindBlocked
} from '../src/timeline';
import { untranslated } from '../src/translation';
import { MiB, ShoutingBundle, textOf } from './fixtures';

jest.mock('@jupyterlab/apputils', () => ({
  Notification: jest.requireActual('@jupyterlab/apputils/lib/notification').Notification,
  showDialog: jest.fn(),
  Dialog: {}
}));

function makePoint(fields: Partial<ITimelinePoint> = {}): ITimelinePoint {
  return {
    count: 3,
    ok: true,
    changed: ['model', 'df'],
    deleted: [],
    bytes: 2 * MiB,
    uncopied: [],
    at: Date.now() / 1000,
    ...fields
  };
}

function makeTimeline(fields: Partial<ITimeline> = {}): ITimeline {
  return {
    running: false,
    points: [makePoint({ count: 1, changed: ['x'] }), makePoint({ count: 2 })],
    rewindable: [1, 2],
    bytes: 3 * MiB,
    limit_bytes: 1024 * MiB,
    dropped: 0,
    ...fields
  };
}

describe('how a point reads', () => {
  it('names what the cell changed and deleted', () => {
    expect(describePointNames(makePoint({ deleted: ['tmp'] }))).toBe(
      'changed model, df; deleted tmp'
    );
    expect(describePointNames(makePoint({ changed: [] }))).toBe('no name changed');
  });

  it('cuts a long list of names, saying how many more', () => {
    const names = Array.from({ length: NAMES_SHOWN + 3 }, (_, i) => `n${i}`);
    expect(listNames(names)).toBe(`${names.slice(0, NAMES_SHOWN).join(', ')} and 3 more`);
    expect(listNames(names.slice(0, NAMES_SHOWN))).toBe(
      names.slice(0, NAMES_SHOWN).join(', ')
    );
  });

  it('gives the count of points, their memory against the limit, and what was dropped', () => {
    expect(describeTimeline(makeTimeline())).toBe('2 points, 3.0 MiB of 1.0 GiB');
    expect(describeTimeline(makeTimeline({ points: [makePoint()], dropped: 4 }))).toBe(
      '1 point, 3.0 MiB of 1.0 GiB; the 4 oldest dropped for the limit'
    );
    expect(describeTimeline(makeTimeline({ dropped: 1 }), new ShoutingBundle())).toBe(
      '2 POINTS, 3.0 MIB OF 1.0 GIB; THE OLDEST DROPPED FOR THE LIMIT'
    );
  });

  it('turns the rewind off while a cell runs, and for a cell the timeline no longer reaches', () => {
    expect(rewindBlocked(makeTimeline(), 2)).toBeNull();
    expect(rewindBlocked(makeTimeline({ running: true }), 2)).toBe(
      'A cell is running: wait for it or interrupt it, then rewind'
    );
    expect(rewindBlocked(makeTimeline({ rewindable: [2] }), 1)).toBe(
      "The kernel's timeline no longer reaches before In [1]"
    );
  });
});

/** A notebook whose kernel can change, as the tracker gives it. */
function fakePanel(kernelId: string | null) {
  const kernelChanged = new Signal<unknown, unknown>({});
  const panel = {
    content: {},
    sessionContext: { kernelChanged },
    kernelId
  };
  return panel;
}

type FakePanel = ReturnType<typeof fakePanel>;

/** A kernel's status as the controller holds it: null when not known yet. */
type FakeStatus = { ready: boolean; hibernation?: { state: string } | null } | null;

function setUp(options: { status?: FakeStatus } = {}) {
  const panelA = fakePanel('k-a');
  const panelB = fakePanel('k-b');
  const tracker = {
    currentChanged: new Signal<unknown, unknown>({}),
    currentWidget: panelA as FakePanel | null
  };
  const controller = {
    status: (options.status === undefined
      ? { ready: true }
      : options.status) as FakeStatus,
    changed: new Signal<unknown, string>({}),
    kernelId: (panel: FakePanel | null) => panel?.kernelId ?? null,
    polledKernel: (panel: FakePanel | null) => panel?.kernelId ?? null,
    entry: (): { status: FakeStatus } => ({ status: controller.status })
  };
  /** The controller learns the kernel's status (from its own poll). */
  const statusCame = (kernelId: string, status: FakeStatus) => {
    controller.status = status;
    controller.changed.emit(kernelId);
  };
  const api = {
    timeline: jest.fn(async (kernelId: string) =>
      makeTimeline({ points: [makePoint({ count: kernelId === 'k-a' ? 1 : 9 })] })
    )
  };
  const rewound = new Signal<unknown, string>({});
  const rewinder = { rewound, rewind: jest.fn(async () => null) };
  const executed = new Signal<unknown, { notebook: unknown }>({});
  let shown = true;
  const model = new KernelTimeline(
    api as unknown as SnapshotAPI,
    controller as unknown as SnapshotController,
    tracker as unknown as INotebookTracker,
    rewinder as unknown as Rewinder,
    executed,
    15,
    () => shown
  );
  return {
    model,
    api,
    tracker,
    panelA,
    panelB,
    rewound,
    rewinder,
    executed,
    statusCame,
    hide: () => (shown = false)
  };
}

describe('KernelTimeline', () => {
  let env: ReturnType<typeof setUp>;

  /** How many times the timeline was asked for since the last call. */
  let counted = 0;
  function asked(): number {
    const since = env.api.timeline.mock.calls.length - counted;
    counted = env.api.timeline.mock.calls.length;
    return since;
  }

  async function start(options: { status?: FakeStatus } = {}) {
    env = setUp(options);
    counted = 0;
    // The poll's first tick comes at once (on jest's clock, 1 ms).
    await jest.advanceTimersByTimeAsync(1);
  }

  beforeEach(() => {
    jest.useFakeTimers();
  });

  afterEach(() => {
    env.model.dispose();
    jest.useRealTimers();
  });

  it("holds the current notebook kernel's timeline once asked", async () => {
    await start();
    expect(asked()).toBe(1);
    expect(env.api.timeline).toHaveBeenLastCalledWith('k-a');
    expect(env.model.kernelId).toBe('k-a');
    expect(env.model.timeline?.points.map(p => p.count)).toEqual([1]);
    expect(env.model.isFor(env.panelA as unknown as NotebookPanel)).toBe(true);
    expect(env.model.isFor(env.panelB as unknown as NotebookPanel)).toBe(false);
  });

  it('asks again when a cell of the current notebook ends, not of another', async () => {
    await start();
    asked();
    env.executed.emit({ notebook: env.panelB.content });
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(0);
    env.executed.emit({ notebook: env.panelA.content });
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(1);
  });

  it("asks again after a rewind of its kernel, and when the notebook's kernel changes", async () => {
    await start();
    asked();
    env.rewound.emit('k-other');
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(0);
    env.rewound.emit('k-a');
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(1);
    env.panelA.kernelId = 'k-c';
    env.panelA.sessionContext.kernelChanged.emit(null);
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(1);
    expect(env.api.timeline).toHaveBeenLastCalledWith('k-c');
  });

  it("follows the current notebook: another one's kernel, or nothing without one", async () => {
    await start();
    env.tracker.currentWidget = env.panelB;
    env.tracker.currentChanged.emit(null);
    await jest.advanceTimersByTimeAsync(1);
    expect(env.api.timeline).toHaveBeenLastCalledWith('k-b');
    expect(env.model.timeline?.points.map(p => p.count)).toEqual([9]);
    asked();
    env.tracker.currentWidget = null;
    env.tracker.currentChanged.emit(null);
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(0);
    expect(env.model.timeline).toBeNull();
    expect(env.model.kernelId).toBeNull();
  });

  it('asks on the interval while shown, and not at all while hidden', async () => {
    await start();
    asked();
    await jest.advanceTimersByTimeAsync(15_000 * 3);
    expect(asked()).toBe(3);
    env.hide();
    await jest.advanceTimersByTimeAsync(15_000 * 3);
    env.executed.emit({ notebook: env.panelA.content });
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(0);
  });

  it('does not ask about a kernel the server says is not snapshot-ready', async () => {
    await start({ status: { ready: false } });
    await jest.advanceTimersByTimeAsync(15_000 * 2);
    env.executed.emit({ notebook: env.panelA.content });
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(0);
    expect(env.model.timeline).toBeNull();
  });

  it('asks about a kernel once its status says it is snapshot-ready, not before', async () => {
    await start({ status: null });
    expect(asked()).toBe(0);
    env.statusCame('k-a', { ready: true });
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(1);
    // Further statuses leave a timeline shown alone: the cells and rewinds ask again.
    env.statusCame('k-a', { ready: true });
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(0);
  });

  it('does not ask a kernel asleep in hibernation, and asks once it woke', async () => {
    await start({ status: { ready: true, hibernation: { state: 'hibernated' } } });
    expect(asked()).toBe(0);
    env.statusCame('k-a', { ready: true, hibernation: { state: 'waking' } });
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(0);
    env.statusCame('k-a', { ready: true, hibernation: null });
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(1);
  });

  it('asks a kernel that hibernates once its cell ends: it still runs', async () => {
    await start({ status: { ready: true, hibernation: { state: 'requested' } } });
    expect(asked()).toBe(1);
  });

  it('shows nothing for a server without timelines, and says why another failure came', async () => {
    await start();
    env.api.timeline.mockRejectedValueOnce(new SnapshotAPIError('no such route', 404));
    await env.model.refresh();
    await jest.advanceTimersByTimeAsync(1);
    expect(env.model.timeline).toBeNull();
    expect(env.model.error).toBeNull();
    // Its statuses do not ask again each time (the interval does).
    asked();
    env.statusCame('k-a', { ready: true });
    await jest.advanceTimersByTimeAsync(1);
    expect(asked()).toBe(0);
    env.api.timeline.mockRejectedValueOnce(
      new SnapshotAPIError('the kernel did not answer in time', 502)
    );
    await env.model.refresh();
    await jest.advanceTimersByTimeAsync(1);
    expect(env.model.timeline).toBeNull();
    expect(env.model.error).toBe('the kernel did not answer in time');
    expect(env.model.kernelId).toBe('k-a');
  });

  it("rewinds its notebook's kernel from a point's button", async () => {
    await start();
    await env.model.rewind(env.panelA as unknown as NotebookPanel, 1);
    expect(env.rewinder.rewind).toHaveBeenCalledWith(env.panelA, 'k-a', 1);
  });

  it('lists the points newest first, each with its rewind, in the section', async () => {
    await start();
    env.api.timeline.mockResolvedValueOnce(
      makeTimeline({
        points: [
          makePoint({ count: 1, changed: ['x'], bytes: 100 }),
          makePoint({
            count: 2,
            ok: false,
            changed: ['y'],
            deleted: ['x'],
            bytes: 2048,
            uncopied: [{ name: 'f', reason: 'an open file cannot be copied' }]
          })
        ]
      })
    );
    await env.model.refresh();
    await jest.advanceTimersByTimeAsync(1);
    const text = textOf(
      React.createElement(TimelineSection, {
        model: env.model,
        panel: env.panelA as unknown as NotebookPanel,
        trans: untranslated
      })
    );
    expect(text).toMatch(
      new RegExp(
        [
          '^Timeline\\n',
          '2 points, 3\\.0 MiB of 1\\.0 GiB',
          'In \\[2\\]raisedchanged y; deleted x2\\.0 KiBjust nowNot copied: f \\(an open file cannot be copied\\)Rewind to before\\n',
          'In \\[1\\]changed x100 Bjust nowRewind to before\\n$'
        ].join('')
      )
    );
    // A kernel whose timeline is off says how to turn it on, and lists nothing.
    env.api.timeline.mockResolvedValueOnce(makeTimeline({ on: false, points: [] }));
    await env.model.refresh();
    await jest.advanceTimersByTimeAsync(1);
    expect(
      textOf(
        React.createElement(TimelineSection, {
          model: env.model,
          panel: env.panelA as unknown as NotebookPanel,
          trans: untranslated
        })
      )
    ).toBe(
      'Timeline\nThe timeline is off. Run %gpu_snapshot timeline on in a cell to keep a point per cell from then on.\n'
    );
    // Another notebook's kernel: the section is not this one's.
    expect(
      TimelineSection({
        model: env.model,
        panel: env.panelB as unknown as NotebookPanel,
        trans: untranslated
      })
    ).toBeNull();
  });
});
