/**
 * The controller's logic: whether a notebook's kernel can be saved and why not, how a job
 * reads, which notifications a save or a restore leaves, and what a restore refused for
 * taken ports offers to do, on JupyterLab's real notification manager. The server's API,
 * the notebook panel, the session manager and the dialogs are stand-ins.
 */
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { ServiceManager } from '@jupyterlab/services';
import type { TranslationBundle } from '@jupyterlab/translation';
import {
  FallbackMode,
  IAutosaveState,
  IFallbackReport,
  IJob,
  IJobError,
  IKernelStatus,
  ISnapshotSummary,
  SnapshotAPI,
  SnapshotAPIError
} from '../src/api';
import {
  SNAPSHOT_KERNEL_DISPLAY_NAME,
  SUCCESS_CLOSE_MS,
  SnapshotController,
  shortError
} from '../src/controller';
import { JobNotification } from '../src/progress';
import {
  EventStream,
  MiB,
  ShoutingBundle,
  makeJob,
  makeSnapshot,
  makeStatus,
  portsRefusal
} from './fixtures';
import { click, shown } from './notifications';

// JupyterLab's real notification manager; dialogs would wait for a click, so showDialog is
// a mock that the tests answer.
jest.mock('@jupyterlab/apputils', () => ({
  Notification: jest.requireActual('@jupyterlab/apputils/lib/notification').Notification,
  showDialog: jest.fn(),
  Dialog: {
    cancelButton: (options: object = {}) => ({ accept: false, ...options }),
    warnButton: (options: object = {}) => ({ accept: true, ...options }),
    okButton: (options: object = {}) => ({ accept: true, ...options }),
    createButton: (options: object = {}) => ({ accept: false, ...options })
  }
}));

const mockedShowDialog = showDialog as jest.MockedFunction<typeof showDialog>;

/** The server's API, answering what each test sets. */
function fakeApi() {
  return {
    kernelStatus: jest.fn<Promise<IKernelStatus>, [string]>(),
    startSave: jest.fn<Promise<IJob>, [string, { name?: string; portable?: boolean }]>(),
    startRestore: jest.fn<
      Promise<IJob>,
      [string, { path?: string; session_id?: string; fallback?: FallbackMode }]
    >(),
    getSnapshot: jest.fn<Promise<ISnapshotSummary>, [string]>(),
    getJob: jest.fn<Promise<IJob>, [string]>(),
    // A server without autosave answers nothing: the tests here are about saves.
    autosave: jest.fn<Promise<IAutosaveState>, [string]>(() =>
      Promise.reject(new Error('no autosave'))
    )
  };
}

interface IFakeSession {
  id: string;
  path: string;
  kernel: { id: string } | null;
}

/** The server's sessions and kernels, as JupyterLab's service manager lists them. */
function fakeServices(sessions: IFakeSession[] = [], events?: EventStream) {
  return {
    events: events?.manager,
    sessions: {
      refreshRunning: jest.fn(async () => undefined),
      running: jest.fn(() => sessions[Symbol.iterator]()),
      shutdown: jest.fn<Promise<void>, [string]>(async () => undefined)
    },
    kernels: { shutdown: jest.fn<Promise<void>, [string]>(async () => undefined) }
  };
}

/** A notebook panel whose session runs ``kernelId`` (none when null). */
function fakePanel(path: string, kernelId: string | null, sessionId: string) {
  const sessionContext = {
    path,
    session: kernelId ? { id: sessionId, kernel: { id: kernelId } } : null,
    isTerminating: false,
    shutdown: jest.fn(async () => undefined),
    changeKernel: jest.fn(async (options: { id: string }) => {
      sessionContext.session = { id: sessionId, kernel: { id: options.id } };
    })
  };
  return {
    sessionContext,
    context: { path, localPath: path },
    isDisposed: false,
    // No cells: neither widgets to draw again nor a restore point to mark.
    node: document.createElement('div'),
    content: { widgets: [] }
  };
}

/** The status of the kernel of the notebook under test (k-b). */
function status(fields: Partial<IKernelStatus> = {}): IKernelStatus {
  return makeStatus({ kernel_id: 'k-b', ...fields });
}

function setUp(
  sessions: IFakeSession[] = [],
  events?: EventStream,
  trans?: TranslationBundle
) {
  const api = fakeApi();
  const services = fakeServices(sessions, events);
  const controller = new SnapshotController(
    api as unknown as SnapshotAPI,
    services as unknown as ServiceManager.IManager,
    trans
  );
  controller.followInterval = 1;
  const panel = fakePanel('work/b.ipynb', 'k-b', 's-b');
  return {
    api,
    services,
    controller,
    panel,
    notebook: panel as unknown as NotebookPanel
  };
}

/** As setUp, once the server said that the notebook's kernel can be saved. */
async function readyToSave(
  sessions: IFakeSession[] = [],
  events?: EventStream,
  trans?: TranslationBundle
) {
  const setup = setUp(sessions, events, trans);
  setup.api.kernelStatus.mockResolvedValue(status());
  await setup.controller.refresh('k-b');
  return setup;
}

/** The server's refusal of a save under a name it does not take. */
function invalidName(): SnapshotAPIError {
  return new SnapshotAPIError('invalid', 400, {
    code: 'invalid_request',
    step: 'preflight',
    cause: "'my snapshot' is not a valid name",
    message: 'preflight failed'
  });
}

/** A restore job that ended with the kernel restored as k-new, into ``sessionId``. */
function restoredJob(sessionId: string | null, fields: Partial<IJob> = {}): IJob {
  return makeJob({
    kind: 'restore',
    status: 'succeeded',
    phase: 'done',
    result: { kernel_id: 'k-new', session_id: sessionId },
    ...fields
  });
}

/**
 * Clicks Details, whose dialog the user leaves with its accept button or not; what the
 * (one) dialog was opened with.
 */
function openDetails(accept: boolean): Partial<Dialog.IOptions<unknown>> {
  mockedShowDialog.mockResolvedValue({
    button: { accept } as never,
    value: null,
    isChecked: null
  });
  click('Details');
  expect(mockedShowDialog).toHaveBeenCalledTimes(1);
  return mockedShowDialog.mock.calls[0][0] ?? {};
}

// The job notifications' toasts are taken as on screen (jsdom shows none).
JobNotification.isShown = () => true;
JobNotification.settleMs = 0;

afterEach(() => {
  Notification.dismiss();
  mockedShowDialog.mockReset();
  jest.useRealTimers();
});

describe('shortError', () => {
  const failed: IJobError = {
    code: 'failed',
    step: 'dump',
    cause: 'criu exited with 1',
    hint: 'see the log for the details',
    log: '/snapshots/.logs/dump.log',
    message: 'dump failed: criu exited with 1 (log: /snapshots/.logs/dump.log)'
  };

  it('names the failed step, the cause and the hint, capitalised', () => {
    expect(shortError(failed)).toBe(
      'dump failed: criu exited with 1. See the log for the details'
    );
    expect(shortError({ ...failed, hint: null })).toBe('dump failed: criu exited with 1');
  });

  it('says what was wrong with a refused request, not that a step failed', () => {
    const invalid: IJobError = {
      code: 'invalid_request',
      step: 'preflight',
      cause: "'my snapshot' is not a valid name",
      hint: 'use letters, digits, dots, dashes and underscores',
      message: 'x'
    };
    expect(shortError(invalid)).toBe(
      "'my snapshot' is not a valid name. Use letters, digits, dots, dashes and underscores"
    );
    expect(shortError({ ...invalid, code: 'busy', cause: 'a snapshot is running' })).toBe(
      'a snapshot is running. Use letters, digits, dots, dashes and underscores'
    );
    // Any refusal: a kernel that cannot be saved now, another node's image.
    expect(
      shortError({ ...invalid, code: 'not_ready', cause: 'files changed', hint: null })
    ).toBe('files changed');
    expect(
      shortError({
        ...invalid,
        code: 'incompatible_node',
        cause: 'another GPU',
        hint: null
      })
    ).toBe('another GPU');
  });

  it("falls back to the server's message, or says that there was no result", () => {
    expect(shortError({ step: '', cause: '', message: 'something broke' })).toBe(
      'something broke'
    );
    expect(shortError({ step: 'dump', cause: '', message: 'dump failed' })).toBe(
      'dump failed'
    );
    expect(shortError(null)).toBe('the job ended without a result');
  });
});

describe('saveAvailability', () => {
  it('is off without a kernel', () => {
    const { controller } = setUp();
    const noKernel = fakePanel('work/c.ipynb', null, 's-c') as unknown as NotebookPanel;
    expect(controller.saveAvailability(noKernel)).toEqual({
      enabled: false,
      reason: 'No kernel is running in this notebook'
    });
    expect(controller.saveAvailability(null).enabled).toBe(false);
  });

  it('is off while the server has not answered yet', () => {
    const { controller, notebook } = setUp();
    expect(controller.saveAvailability(notebook)).toEqual({
      enabled: false,
      reason: 'Checking whether this kernel can be snapshotted…'
    });
  });

  it('is on for a ready snapshot kernel', async () => {
    const { api, controller, notebook } = setUp();
    api.kernelStatus.mockResolvedValue(status());
    await controller.refresh('k-b');
    expect(api.kernelStatus).toHaveBeenCalledWith('k-b');
    expect(controller.saveAvailability(notebook)).toEqual({
      enabled: true,
      reason:
        "Snapshot kernel: save this kernel's memory (variables, GPU tensors) to disk"
    });
  });

  it('offers to switch a plain kernel, in words a user knows', async () => {
    const { api, controller, notebook } = setUp();
    api.kernelStatus.mockResolvedValue(
      status({ ready: false, kernel_name: 'python3', reasons: ['JPY_PARENT_PID unset'] })
    );
    await controller.refresh('k-b');
    const availability = controller.saveAvailability(notebook);
    expect(availability.enabled).toBe(false);
    expect(availability.changeKernel).toBe(true);
    expect(availability.reason).toContain(`'${SNAPSHOT_KERNEL_DISPLAY_NAME}'`);
    expect(availability.reason).toContain('Kernel › Change Kernel…');
    expect(availability.reason).not.toContain('JPY_PARENT_PID');
  });

  it("gives the server's reasons for a snapshot kernel that is not ready", async () => {
    const { api, controller, notebook } = setUp();
    api.kernelStatus.mockResolvedValue(
      status({ ready: false, reasons: ['criu is missing', 'no store'] })
    );
    await controller.refresh('k-b');
    expect(controller.saveAvailability(notebook)).toEqual({
      enabled: false,
      reason: 'Snapshots unavailable: criu is missing; no store'
    });
    api.kernelStatus.mockResolvedValue(status({ ready: false, reasons: [] }));
    await controller.refresh('k-b');
    expect(controller.saveAvailability(notebook).reason).toBe(
      'Snapshots unavailable: the server says this kernel is not snapshot-ready'
    );
  });

  it('says when the server did not answer', async () => {
    const { api, controller, notebook } = setUp();
    api.kernelStatus.mockRejectedValue(new Error('cannot reach the Jupyter server'));
    await controller.refresh('k-b');
    expect(controller.saveAvailability(notebook)).toEqual({
      enabled: false,
      reason:
        'Cannot snapshot: the server did not answer (cannot reach the Jupyter server)'
    });
    expect(controller.entry('k-b')?.status).toBeNull();

    api.kernelStatus.mockResolvedValue(status());
    await controller.refresh('k-b');
    expect(controller.saveAvailability(notebook).enabled).toBe(true);
  });

  it('says nothing is wrong with a kernel the server no longer knows', async () => {
    const { api, controller, notebook } = await readyToSave();
    const lookup = {
      code: 'not_found' as const,
      step: 'lookup',
      cause: "no kernel 'k-b' on this server",
      message: "lookup failed: no kernel 'k-b' on this server"
    };
    api.kernelStatus.mockRejectedValue(new SnapshotAPIError(lookup.message, 404, lookup));
    await controller.refresh('k-b');
    expect(controller.entry('k-b')).toMatchObject({ status: null, error: null });
    expect(controller.gone('k-b')).toBe(true);
    expect(controller.polledKernel(notebook)).toBeNull();
    expect(controller.saveAvailability(notebook).enabled).toBe(false);

    // Asked again (a restarted server adopted it under its id): it is back.
    api.kernelStatus.mockResolvedValue(status());
    await controller.refresh('k-b');
    expect(controller.gone('k-b')).toBe(false);
    expect(controller.polledKernel(notebook)).toBe('k-b');
    expect(controller.saveAvailability(notebook).enabled).toBe(true);
  });

  it("gives polls no kernel while the notebook's session shuts down", async () => {
    const { controller, panel, notebook } = await readyToSave();
    expect(controller.polledKernel(notebook)).toBe('k-b');
    panel.sessionContext.isTerminating = true;
    expect(controller.polledKernel(notebook)).toBeNull();
  });

  it('is off while a save of the kernel runs, and says how far it is', async () => {
    const { api, controller, notebook } = await readyToSave();
    api.startSave.mockResolvedValue(
      makeJob({ kernel_id: 'k-b', done: 0, total: 4 * MiB })
    );
    let finish: (job: IJob) => void = () => undefined;
    api.getJob.mockReturnValue(new Promise(resolve => (finish = resolve)));
    const saving = controller.save(notebook);
    await new Promise(resolve => setTimeout(resolve, 5));
    expect(controller.saveAvailability(notebook)).toEqual({
      enabled: false,
      reason: 'A snapshot of this kernel is running: writing memory…'
    });
    expect(controller.activeJob(notebook)?.kind).toBe('save');
    finish(makeJob({ status: 'succeeded', phase: 'done', result: makeSnapshot() }));
    await saving;
    expect(controller.saveAvailability(notebook).enabled).toBe(true);
    expect(controller.activeJob(notebook)).toBeNull();
  });

  it('asks the server once more when asked again during a request', async () => {
    const { api, controller } = setUp();
    let answer: (s: IKernelStatus) => void = () => undefined;
    api.kernelStatus.mockImplementation(() => new Promise(resolve => (answer = resolve)));
    const first = controller.refresh('k-b');
    const second = controller.refresh('k-b');
    const third = controller.refresh('k-b');
    expect(api.kernelStatus).toHaveBeenCalledTimes(1);
    answer(status({ ready: false }));
    await Promise.all([first, second, third]);
    expect(api.kernelStatus).toHaveBeenCalledTimes(2);
    answer(status());
    await new Promise(resolve => setTimeout(resolve, 0));
    expect(controller.entry('k-b')?.status?.ready).toBe(true);
  });
});

describe('explainUnavailable', () => {
  it('explains a plain kernel and offers the kernel picker', async () => {
    const { api, controller, notebook } = setUp();
    api.kernelStatus.mockResolvedValue(status({ ready: false, kernel_name: 'python3' }));
    await controller.refresh('k-b');
    const changeKernel = jest.fn();
    controller.changeKernel = changeKernel;
    controller.explainUnavailable(notebook);
    expect(shown()).toEqual([
      {
        message: expect.stringContaining(
          `Snapshots need the '${SNAPSHOT_KERNEL_DISPLAY_NAME}'`
        ),
        type: 'info',
        autoClose: 10000,
        actions: ['Change kernel…', 'Why?']
      }
    ]);
    click('Change kernel…');
    expect(changeKernel).toHaveBeenCalledWith(notebook);
  });

  it('says nothing about a kernel that can be saved', async () => {
    const { controller, notebook } = await readyToSave();
    controller.explainUnavailable(notebook);
    expect(shown()).toEqual([]);
  });
});

describe('describeJob and progressOf: one bar for the whole job', () => {
  const save = (phase: string, done: number, total: number) =>
    makeJob({ kind: 'save', phase: phase as IJob['phase'], done, total });

  it('gives the time left of the whole job, once a second has passed', () => {
    jest.useFakeTimers({ now: 1_000_000 });
    const { controller } = setUp();
    expect(controller.describeJob(save('dump', 0, 4 * MiB))).toBe('writing memory…');
    jest.advanceTimersByTime(3000);
    // A dump's total is an estimate of the image: only the bytes written show.
    expect(controller.describeJob(save('dump', MiB, 4 * MiB))).toMatch(
      /^writing memory: 1\.0 MiB, about \d+ s left$/
    );
    const commit = save('commit', MiB, 4 * MiB);
    expect(controller.describeJob(commit)).toMatch(
      /^committing: 1\.0 MiB of 4\.0 MiB, about \d+ s left$/
    );
  });

  it('never goes back when the next phase starts its bytes over', () => {
    const { controller } = setUp();
    const seen = [
      save('preflight', 0, 0),
      save('suspend', 0, 0),
      save('dump', 10 * MiB, 100 * MiB),
      save('dump', 90 * MiB, 100 * MiB),
      save('resume', 0, 0),
      save('commit', 2 * MiB, 54 * MiB),
      save('commit', 30 * MiB, 54 * MiB),
      save('commit', 54 * MiB, 54 * MiB)
    ].map(job => controller.progressOf(job));
    expect(seen[0]).toBeUndefined(); // no size yet: no bar
    const bars = seen.filter((f): f is number => f !== undefined);
    expect(bars.length).toBe(6);
    bars.slice(1).forEach((f, at) => expect(f).toBeGreaterThanOrEqual(bars[at]));
    // The commit's bytes move the bar on from where the dump left it.
    expect(bars[5]).toBeGreaterThan(bars[2]);
    expect(bars[5]).toBeLessThanOrEqual(1);
  });

  it("shares the bar out as the kernel's last save took its time", async () => {
    const { api, controller } = setUp();
    // The last save spent 1 s dumping and 9 s committing.
    api.kernelStatus.mockResolvedValue(
      status({
        last_snapshot: makeSnapshot({
          timings: { preflight: 0.1, suspend: 0.1, dump: 1, resume: 0.1, commit: 9 }
        })
      })
    );
    await controller.refresh('k-b');
    const dumped = controller.progressOf(
      makeJob({ id: 'j9', kernel_id: 'k-b', phase: 'dump', done: 1, total: 1 })
    );
    expect(dumped).toBeLessThan(0.2);
  });

  it('keeps a bar and a clock per job', () => {
    jest.useFakeTimers({ now: 1_000_000 });
    const { controller } = setUp();
    controller.describeJob(makeJob({ id: 'j1', phase: 'commit', done: 0, total: 4 }));
    jest.advanceTimersByTime(3000);
    expect(
      controller.describeJob(makeJob({ id: 'j2', phase: 'commit', done: 1, total: 4 }))
    ).toBe('committing: 1 B of 4 B');
    expect(
      controller.describeJob(makeJob({ id: 'j1', phase: 'commit', done: 1, total: 4 }))
    ).toMatch(/^committing: 1 B of 4 B, about \d+ s left$/);
  });
});

describe('save', () => {
  it('warns instead of saving a kernel that cannot be saved', async () => {
    const { api, controller, notebook } = setUp();
    await expect(controller.save(notebook)).resolves.toBeNull();
    expect(api.startSave).not.toHaveBeenCalled();
    expect(shown()).toEqual([
      expect.objectContaining({
        type: 'warning',
        message: 'Checking whether this kernel can be snapshotted…'
      })
    ]);
  });

  it('follows the job, then leaves one success notification that closes by itself', async () => {
    const { api, controller, notebook } = await readyToSave();
    const snapshot = makeSnapshot({ name: 'before-training', size_bytes: 12.3 * MiB });
    api.startSave.mockResolvedValue(makeJob({ kernel_id: 'k-b', done: 0, total: 0 }));
    const messages: string[] = [];
    api.getJob.mockImplementation(async () => {
      messages.push(...shown().map(n => `${n.type}: ${n.message}`));
      return makeJob({ status: 'succeeded', phase: 'done', result: snapshot });
    });
    const changed: string[] = [];
    controller.changed.connect((_, kernelId) => changed.push(kernelId));

    await expect(controller.save(notebook, 'before-training')).resolves.toEqual(snapshot);

    expect(api.startSave).toHaveBeenCalledWith('k-b', { name: 'before-training' });
    expect(messages).toEqual(['in-progress: Snapshot of work/b.ipynb: writing memory…']);
    expect(shown()).toEqual([
      {
        message: "Snapshot saved: 'before-training', 12.3 MiB in 0.84 s",
        type: 'success',
        autoClose: SUCCESS_CLOSE_MS,
        actions: []
      }
    ]);
    // The status shows the new snapshot at once, not after the next status request.
    expect(controller.entry('k-b')?.status?.last_snapshot).toEqual(snapshot);
    expect(changed).toContain('k-b');
  });

  it('sends no name when none is given', async () => {
    const { api, controller, notebook } = await readyToSave();
    api.startSave.mockResolvedValue(
      makeJob({ status: 'succeeded', phase: 'done', result: makeSnapshot() })
    );
    await controller.save(notebook);
    expect(api.startSave.mock.calls[0][0]).toBe('k-b');
    expect(api.startSave.mock.calls[0][1]).toStrictEqual({});
  });

  it('shows a failed job with its step, cause and a Details action', async () => {
    const { api, controller, notebook } = await readyToSave();
    const error: IJobError = {
      code: 'failed',
      step: 'dump',
      cause: 'no space left on device',
      hint: 'free some disk',
      log: '/store/.logs/j1.log',
      message: 'dump failed: no space left on device'
    };
    api.startSave.mockResolvedValue(makeJob({ status: 'failed', error }));
    await expect(controller.save(notebook)).resolves.toBeNull();
    expect(shown()).toEqual([
      {
        message: 'Snapshot failed: dump failed: no space left on device. Free some disk',
        type: 'error',
        autoClose: false,
        actions: ['Details']
      }
    ]);

    const options = openDetails(false);
    expect(options.title).toBe('Snapshot failed');
    expect(options.body).toBe(
      'dump failed: no space left on device\nLog: /store/.logs/j1.log'
    );
    expect(options.buttons).toEqual([{ accept: false, label: 'Close' }]);
    // Details leaves the notification, and what it offers, on screen.
    await new Promise(resolve => setTimeout(resolve, 0));
    expect(shown()).toHaveLength(1);
  });

  it.each([
    [
      "a refused request in the server's words",
      'my snapshot',
      invalidName(),
      "Snapshot failed: 'my snapshot' is not a valid name"
    ],
    [
      'an unreachable server by its message',
      undefined,
      new SnapshotAPIError('cannot reach the Jupyter server: offline', 0),
      'Snapshot failed: cannot reach the Jupyter server: offline'
    ]
  ])('shows %s, until closed', async (_, name, refusal, message) => {
    const { api, controller, notebook } = await readyToSave();
    api.startSave.mockRejectedValue(refusal);
    await controller.save(notebook, name);
    expect(shown()).toEqual([
      expect.objectContaining({ message, type: 'error', autoClose: false })
    ]);
  });

  it('ends in an error when the job cannot be followed any more', async () => {
    const { api, controller, notebook } = await readyToSave();
    api.startSave.mockResolvedValue(makeJob({ kernel_id: 'k-b', phase: 'dump' }));
    api.getJob.mockRejectedValue(new Error('cannot reach the Jupyter server'));
    await expect(controller.save(notebook)).resolves.toBeNull();
    expect(api.getJob).toHaveBeenCalledTimes(10);
    expect(shown()).toEqual([
      expect.objectContaining({
        message: 'Snapshot failed: dump failed: cannot reach the Jupyter server',
        type: 'error'
      })
    ]);
    expect(controller.saveAvailability(notebook).enabled).toBe(true);
  });
});

describe('a restore refused because its ports are taken', () => {
  const snapshot = makeSnapshot({
    id: 's-a',
    name: 'from-a',
    notebook_path: 'work/a.ipynb'
  });
  const sessionA: IFakeSession = {
    id: 's-a',
    path: 'work/a.ipynb',
    kernel: { id: 'k-a' }
  };
  const sessionB: IFakeSession = {
    id: 's-b',
    path: 'work/b.ipynb',
    kernel: { id: 'k-b' }
  };

  it.each([
    [
      'names the notebook whose kernel holds them, and offers to shut that one down',
      { holder_kernel_id: 'k-a', holder_notebook_path: 'work/a.ipynb' },
      'its ports are taken by the kernel of a.ipynb',
      expect.objectContaining({
        label: "Shut down a.ipynb's kernel and restore",
        caption: expect.stringContaining('Shut down the kernel of work/a.ipynb')
      })
    ],
    [
      "offers to shut down the notebook's own kernel when that one holds them",
      { holder_kernel_id: 'k-b', holder_notebook_path: 'work/b.ipynb' },
      "its ports are taken by this notebook's own kernel",
      expect.objectContaining({ label: 'Shut down this kernel and restore' })
    ],
    [
      'offers nothing to shut down when no kernel of the server holds them',
      { holder_kernel_id: null },
      'its ports are taken by a process this server does not run (another restore of it ' +
        'from the command line?); stop that process first',
      null
    ]
  ])('%s', (_, holder, message, remedy) => {
    const { controller, notebook } = setUp();
    const ports = controller.portsRemedy(notebook, snapshot, portsRefusal(holder));
    expect(ports?.message).toBe(message);
    expect(ports?.remedy).toEqual(remedy);
  });

  it('is no port refusal for other errors', () => {
    const { controller, notebook } = setUp();
    const error: IJobError = {
      code: 'failed',
      step: 'restore',
      cause: 'x',
      message: 'x'
    };
    expect(controller.portsRemedy(notebook, snapshot, error)).toBeNull();
    expect(controller.portsRemedy(notebook, snapshot, null)).toBeNull();
  });

  it("restoring A's snapshot from B shuts down A's kernel only, then restores", async () => {
    const { api, services, controller, panel, notebook } = setUp([sessionA, sessionB]);
    const refused = portsRefusal({
      holder_kernel_id: 'k-a',
      holder_notebook_path: 'work/a.ipynb'
    });
    api.startRestore
      .mockResolvedValueOnce(
        makeJob({ kind: 'restore', status: 'failed', phase: 'preflight', error: refused })
      )
      .mockResolvedValueOnce(restoredJob('s-b'));

    await expect(controller.restore(notebook, snapshot)).resolves.toBe(false);
    expect(shown()).toEqual([
      {
        message:
          "Restore of 'from-a' failed: its ports are taken by the kernel of a.ipynb",
        type: 'error',
        autoClose: false,
        actions: ["Shut down a.ipynb's kernel and restore", 'Details']
      }
    ]);

    click("Shut down a.ipynb's kernel and restore");
    await new Promise(resolve => setTimeout(resolve, 10));

    expect(services.sessions.shutdown).toHaveBeenCalledTimes(1);
    expect(services.sessions.shutdown).toHaveBeenCalledWith('s-a');
    expect(services.kernels.shutdown).not.toHaveBeenCalled();
    expect(panel.sessionContext.shutdown).not.toHaveBeenCalled();
    expect(api.startRestore).toHaveBeenCalledTimes(2);
    expect(api.startRestore).toHaveBeenLastCalledWith('s-a', {
      path: 'work/b.ipynb',
      session_id: 's-b'
    });
    expect(panel.sessionContext.changeKernel).toHaveBeenCalledWith({ id: 'k-new' });

    // A's kernel is gone: a watcher asking about it again sends nothing (it would get 404).
    const asked = api.kernelStatus.mock.calls.length;
    await controller.refresh('k-a');
    expect(api.kernelStatus.mock.calls.length).toBe(asked);
  });

  it('shuts down a holding kernel that has no session by its id', async () => {
    const { api, services, controller, panel, notebook } = setUp([sessionB]);
    const error = portsRefusal({ holder_kernel_id: 'k-z', holder_notebook_path: null });
    api.startRestore.mockRejectedValueOnce(new SnapshotAPIError('refused', 409, error));
    api.startRestore.mockResolvedValueOnce(
      makeJob({ kind: 'restore', status: 'failed', phase: 'restore', error: null })
    );
    await controller.restore(notebook, snapshot);
    expect(shown()[0].message).toBe(
      "Restore of 'from-a' failed: its ports are taken by the kernel of kernel k-z"
    );
    click("Shut down kernel k-z's kernel and restore");
    await new Promise(resolve => setTimeout(resolve, 10));
    expect(services.kernels.shutdown).toHaveBeenCalledWith('k-z');
    expect(services.sessions.shutdown).not.toHaveBeenCalled();
    expect(panel.sessionContext.shutdown).not.toHaveBeenCalled();
  });

  it("shuts down the notebook's own kernel when that one holds the ports", async () => {
    const { api, services, controller, panel, notebook } = setUp([sessionB]);
    const error = portsRefusal({
      holder_kernel_id: 'k-b',
      holder_notebook_path: 'work/b.ipynb'
    });
    api.startRestore.mockRejectedValue(new SnapshotAPIError('refused', 409, error));
    await controller.restore(notebook, snapshot);
    click('Shut down this kernel and restore');
    await new Promise(resolve => setTimeout(resolve, 10));
    expect(panel.sessionContext.shutdown).toHaveBeenCalledTimes(1);
    expect(services.sessions.shutdown).not.toHaveBeenCalled();
    expect(services.kernels.shutdown).not.toHaveBeenCalled();
    expect(api.startRestore).toHaveBeenCalledTimes(2);
  });

  it("with replaceOwnKernel, replaces the notebook's own kernel at once instead of offering to", async () => {
    const { api, services, controller, panel, notebook } = setUp([sessionB]);
    const own = portsRefusal({
      holder_kernel_id: 'k-b',
      holder_notebook_path: 'work/b.ipynb'
    });
    const later: IJobError = {
      code: 'failed',
      step: 'verify',
      cause: 'a file differs',
      message: 'verify failed: a file differs'
    };
    api.startRestore
      .mockRejectedValueOnce(new SnapshotAPIError('refused', 409, own))
      .mockRejectedValueOnce(new SnapshotAPIError('failed', 500, later));
    expect(await controller.restore(notebook, snapshot, { replaceOwnKernel: true })).toBe(
      false
    );
    expect(panel.sessionContext.shutdown).toHaveBeenCalledTimes(1);
    expect(api.startRestore).toHaveBeenCalledTimes(2);
    expect(services.sessions.shutdown).not.toHaveBeenCalled();
    // Only the second attempt's outcome is on screen; nothing offers the remedy.
    expect(shown()).toEqual([
      expect.objectContaining({
        message: "Restore of 'from-a' failed: verify failed: a file differs",
        actions: ['Details']
      })
    ]);
  });

  it("with replaceOwnKernel, still only offers to shut down another notebook's kernel", async () => {
    const { api, services, controller, panel, notebook } = setUp([sessionA, sessionB]);
    const error = portsRefusal({
      holder_kernel_id: 'k-a',
      holder_notebook_path: 'work/a.ipynb'
    });
    api.startRestore.mockRejectedValue(new SnapshotAPIError('refused', 409, error));
    await controller.restore(notebook, snapshot, { replaceOwnKernel: true });
    expect(panel.sessionContext.shutdown).not.toHaveBeenCalled();
    expect(services.sessions.shutdown).not.toHaveBeenCalled();
    expect(shown()[0].actions).toContain("Shut down a.ipynb's kernel and restore");
  });

  it('keeps the remedy in Details, which runs it and closes the notification', async () => {
    const { api, services, controller, notebook } = setUp([sessionA, sessionB]);
    const error = portsRefusal({
      holder_kernel_id: 'k-a',
      holder_notebook_path: 'work/a.ipynb'
    });
    api.startRestore.mockRejectedValue(new SnapshotAPIError('refused', 409, error));
    await controller.restore(notebook, snapshot);

    const options = openDetails(true);
    expect(options.title).toBe("Restore of 'from-a' failed");
    expect(options.buttons).toEqual([
      { accept: false, label: 'Close' },
      expect.objectContaining({
        accept: true,
        label: "Shut down a.ipynb's kernel and restore"
      })
    ]);
    await new Promise(resolve => setTimeout(resolve, 10));
    expect(services.sessions.shutdown).toHaveBeenCalledWith('s-a');
    // The refusal was closed; the second attempt (refused again here) shows its own.
    expect(shown()).toHaveLength(1);
    expect(api.startRestore).toHaveBeenCalledTimes(2);
  });
});

describe('restore', () => {
  const snapshot = makeSnapshot({ id: 's-a', name: 'from-a', size_bytes: 40.6 * MiB });

  it('switches the notebook to the restored kernel when the server moved its session', async () => {
    const { api, services, controller, panel, notebook } = setUp();
    api.startRestore.mockResolvedValue(makeJob({ kind: 'restore', phase: 'restore' }));
    api.getJob.mockResolvedValue(restoredJob('s-b'));
    // The server moved the session: the session list carries the new kernel.
    services.sessions.refreshRunning.mockImplementation(async () => {
      panel.sessionContext.session = { id: 's-b', kernel: { id: 'k-new' } };
    });
    api.kernelStatus.mockResolvedValue(status({ kernel_id: 'k-new' }));

    await expect(controller.restore(notebook, snapshot)).resolves.toBe(true);

    expect(api.startRestore).toHaveBeenCalledWith('s-a', {
      path: 'work/b.ipynb',
      session_id: 's-b'
    });
    expect(panel.sessionContext.changeKernel).not.toHaveBeenCalled();
    expect(controller.originOf('k-new')).toBe('s-a');
    expect(controller.originOf('k-b')).toBeNull();
    expect(shown()).toEqual([
      {
        message: expect.stringMatching(
          /^Kernel restored from 'from-a' \(40\.6 MiB\) in \d/
        ),
        type: 'success',
        autoClose: SUCCESS_CLOSE_MS,
        actions: []
      }
    ]);
  });

  it('asks nothing about the kernel it replaces until the notebook has switched', async () => {
    const { api, services, controller, panel, notebook } = await readyToSave();
    api.startRestore.mockResolvedValue(makeJob({ kind: 'restore', phase: 'restore' }));
    let finish: (job: IJob) => void = () => undefined;
    api.getJob.mockReturnValue(new Promise(resolve => (finish = resolve)));
    services.sessions.refreshRunning.mockImplementation(async () => {
      panel.sessionContext.session = { id: 's-b', kernel: { id: 'k-new' } };
    });
    api.kernelStatus.mockResolvedValue(status({ kernel_id: 'k-new' }));
    const asked = api.kernelStatus.mock.calls.length;
    const restoring = controller.restore(notebook, snapshot);
    await new Promise(resolve => setTimeout(resolve, 5));

    // The server retires k-b as the restored kernel takes its place: it would answer 404.
    expect(controller.gone('k-b')).toBe(true);
    await controller.refresh('k-b');
    expect(api.kernelStatus.mock.calls.length).toBe(asked);

    finish(restoredJob('s-b'));
    await expect(restoring).resolves.toBe(true);
    expect(api.kernelStatus.mock.calls.slice(asked)).toEqual([['k-new']]);
    expect(controller.gone('k-b')).toBe(false);
  });

  it('asks about the kernel again when the restore failed and left it', async () => {
    const { api, controller, notebook } = await readyToSave();
    api.startRestore.mockResolvedValue(makeJob({ kind: 'restore', phase: 'restore' }));
    api.getJob.mockResolvedValue(
      makeJob({ kind: 'restore', status: 'failed', phase: 'restore', error: null })
    );
    await expect(controller.restore(notebook, snapshot)).resolves.toBe(false);
    expect(controller.gone('k-b')).toBe(false);
    const asked = api.kernelStatus.mock.calls.length;
    await controller.refresh('k-b');
    expect(api.kernelStatus.mock.calls.length).toBe(asked + 1);
  });

  it('starts a notebook without a kernel on the restored one', async () => {
    const { api, controller } = setUp();
    const panel = fakePanel('work/c.ipynb', null, 's-c');
    api.startRestore.mockResolvedValue(restoredJob(null));
    api.kernelStatus.mockResolvedValue(status({ kernel_id: 'k-new' }));
    await expect(
      controller.restore(panel as unknown as NotebookPanel, snapshot)
    ).resolves.toBe(true);
    expect(api.startRestore).toHaveBeenCalledWith('s-a', {});
    expect(panel.sessionContext.changeKernel).toHaveBeenCalledWith({ id: 'k-new' });
  });

  it('says so when the kernel was restored but the notebook could not switch to it', async () => {
    const { api, controller, panel, notebook } = setUp();
    api.startRestore.mockResolvedValue(restoredJob(null));
    panel.sessionContext.changeKernel.mockRejectedValue(new Error('session is disposed'));
    await expect(controller.restore(notebook, snapshot)).resolves.toBe(false);
    expect(shown()).toEqual([
      expect.objectContaining({
        type: 'error',
        message:
          "Restore of 'from-a' failed: the kernel was restored (id k-new) but the notebook " +
          'could not switch to it: session is disposed'
      })
    ]);
  });

  it('says so when the session stays on its old kernel', async () => {
    const { api, controller, panel, notebook } = setUp();
    api.startRestore.mockResolvedValue(restoredJob(null));
    panel.sessionContext.changeKernel.mockResolvedValue(undefined);
    await expect(controller.restore(notebook, snapshot)).resolves.toBe(false);
    expect(shown()[0].message).toBe(
      "Restore of 'from-a' failed: the kernel was restored (id k-new) but the notebook " +
        'could not switch to it: the session still uses kernel k-b'
    );
  });

  it('marks the notebook as restoring while the job runs', async () => {
    const { api, controller, notebook } = setUp();
    api.startRestore.mockResolvedValue(makeJob({ kind: 'restore', phase: 'verify' }));
    let finish: (job: IJob) => void = () => undefined;
    api.getJob.mockReturnValue(new Promise(resolve => (finish = resolve)));
    const restoring = controller.restore(notebook, snapshot);
    await new Promise(resolve => setTimeout(resolve, 5));
    expect(controller.activeJob(notebook)?.kind).toBe('restore');
    expect(controller.saveAvailability(notebook).reason).toMatch(
      /^A restore of this kernel is running: verifying/
    );
    expect(shown()).toEqual([
      expect.objectContaining({
        type: 'in-progress',
        message: "Restoring 'from-a': verifying: 0 B of 100 B"
      })
    ]);
    finish(makeJob({ kind: 'restore', status: 'failed', phase: 'restore', error: null }));
    await expect(restoring).resolves.toBe(false);
    expect(controller.activeJob(notebook)).toBeNull();
    expect(shown()).toEqual([
      expect.objectContaining({
        type: 'error',
        message: "Restore of 'from-a' failed: the job ended without a result",
        actions: []
      })
    ]);
  });
});

describe('jobs started elsewhere (the magic, the widget, another browser)', () => {
  /** Resolves once the microtasks and the 1 ms polls queued so far have run. */
  const settle = () => new Promise(resolve => setTimeout(resolve, 10));

  it('show in the notebook whose kernel they save, until they end', async () => {
    const events = new EventStream();
    const { api, controller, notebook } = await readyToSave([], events);
    let finish: (job: IJob) => void = () => undefined;
    api.getJob.mockReturnValue(new Promise(resolve => (finish = resolve)));

    events.emitJob(
      makeJob({ id: 'j-magic', kernel_id: 'k-b', phase: 'suspend', total: 0 })
    );
    await settle();
    expect(controller.saveAvailability(notebook)).toEqual({
      enabled: false,
      reason: 'A snapshot of this kernel is running: pausing the kernel…'
    });
    expect(api.getJob).toHaveBeenCalledWith('j-magic');

    finish(
      makeJob({ id: 'j-magic', kernel_id: 'k-b', status: 'succeeded', phase: 'done' })
    );
    await settle();
    expect(controller.saveAvailability(notebook).enabled).toBe(true);
    // The new snapshot is fetched with the status once the job ended.
    expect(api.kernelStatus).toHaveBeenCalledTimes(2);
    // No notification for a job this browser did not start.
    expect(shown()).toEqual([]);
    controller.dispose();
  });

  it('are not followed for kernels no notebook here shows', async () => {
    const events = new EventStream();
    const { api, controller } = setUp([], events);
    events.emitJob(makeJob({ id: 'j-other', kernel_id: 'k-elsewhere' }));
    await settle();
    expect(api.getJob).not.toHaveBeenCalled();
    expect(controller.entry('k-elsewhere')).toBeNull();
    controller.dispose();
  });

  it('are followed once when the status reports them too', async () => {
    const events = new EventStream();
    const { api, controller } = setUp([], events);
    const running = makeJob({ id: 'j-magic', kernel_id: 'k-b' });
    api.kernelStatus.mockResolvedValue(status({ job: running }));
    api.getJob.mockReturnValue(new Promise(() => undefined));
    await controller.refresh('k-b');
    events.emitJob(running);
    await controller.refresh('k-b');
    await settle();
    expect(api.getJob).toHaveBeenCalledTimes(1);
    controller.dispose();
  });

  it('pick up the new kernel of a session restored elsewhere at once', async () => {
    const events = new EventStream();
    const { services, controller } = setUp([], events);
    events.emitJob(restoredJob('s-b', { id: 'j-restore', kernel_id: null }));
    expect(services.sessions.refreshRunning).toHaveBeenCalledTimes(1);
    // A restore of this browser's own is attached by restore() itself.
    events.emitJob(restoredJob(null, { id: 'j-restore-2' }));
    expect(services.sessions.refreshRunning).toHaveBeenCalledTimes(1);
    controller.dispose();
  });
});

describe("the controller's words go through its TranslationBundle", () => {
  it('explains a plain kernel in the bundle, the kernel name left as it is', async () => {
    const trans = new ShoutingBundle();
    const { api, controller, notebook } = setUp([], undefined, trans);
    api.kernelStatus.mockResolvedValue(status({ ready: false, kernel_name: 'python3' }));
    await controller.refresh('k-b');
    expect(controller.saveAvailability(notebook).reason).toBe(
      'SNAPSHOTS UNAVAILABLE: THIS NOTEBOOK RUNS A KERNEL THAT CANNOT BE SAVED. SWITCH ' +
        `TO THE '${SNAPSHOT_KERNEL_DISPLAY_NAME}' KERNEL WITH KERNEL › CHANGE KERNEL… ` +
        '(CLICK FOR HELP)'
    );
  });

  it("frames a refused save in the bundle and keeps the server's cause", async () => {
    const trans = new ShoutingBundle();
    const { api, controller, notebook } = await readyToSave([], undefined, trans);
    api.startSave.mockRejectedValue(invalidName());
    await controller.save(notebook, 'my snapshot');
    expect(shown()).toEqual([
      expect.objectContaining({
        message: "SNAPSHOT FAILED: 'my snapshot' is not a valid name",
        type: 'error'
      })
    ]);
  });
});

describe('a restore whose image cannot come back', () => {
  const snapshot = makeSnapshot({
    id: 's-a',
    name: 'from-a',
    fallback: ['portable', 'replay', 'both']
  });

  /** The server's refusal of an image this node cannot run, offering ``fallback``. */
  function refused(fallback: unknown): IJob {
    return makeJob({
      kind: 'restore',
      status: 'failed',
      phase: 'preflight',
      error: {
        code: 'failed',
        step: 'compatibility',
        cause: 'the NVIDIA driver is 550.54 (branch 550), the snapshot needs branch 580',
        message:
          'compatibility failed: the NVIDIA driver is 550.54 (branch 550), the snapshot needs branch 580',
        details: { fallback: fallback as FallbackMode[] }
      }
    });
  }

  const report: IFallbackReport = {
    mode: 'replay',
    loaded: [],
    not_loaded: [],
    replayed: [
      { count: 1, status: 'ok' },
      { count: 2, status: 'error', error: "NameError: name 'x' is not defined" }
    ],
    notes: []
  };

  /** The user's answer to the next dialog: the button labelled ``label``, or Cancel. */
  function answer(label: string | null): void {
    mockedShowDialog.mockResolvedValueOnce({
      button: { accept: label !== null, label: label ?? 'Cancel' } as never,
      value: null,
      isChecked: null
    });
  }

  const labels = (options: Partial<Dialog.IOptions<unknown>> | undefined) =>
    (options?.buttons ?? []).map(b => (b as { label?: string }).label ?? '');

  it('offers what the snapshot offers; the choice restores into a fresh kernel and reports', async () => {
    const { api, controller, panel, notebook } = setUp();
    api.startRestore
      .mockResolvedValueOnce(refused(['replay', 'both', 'portable', 'someday']))
      .mockResolvedValueOnce(
        restoredJob('s-b', {
          result: { kernel_id: 'k-new', session_id: 's-b', fallback: report }
        })
      );
    api.kernelStatus.mockResolvedValue(status({ kernel_id: 'k-new' }));
    answer('Re-run the cells');
    answer('Close');

    await expect(controller.restore(notebook, snapshot)).resolves.toBe(true);

    const ask = mockedShowDialog.mock.calls[0][0];
    expect(ask?.title).toBe("Restore of 'from-a' failed");
    // Cancel, then the ways back in their order, the fullest last (Enter picks it).
    expect(labels(ask)).toEqual([
      '',
      'Load the portable copy',
      'Re-run the cells',
      'Both'
    ]);
    expect(api.startRestore).toHaveBeenCalledTimes(2);
    expect(api.startRestore).toHaveBeenLastCalledWith('s-a', {
      path: 'work/b.ipynb',
      session_id: 's-b',
      fallback: 'replay'
    });
    expect(panel.sessionContext.changeKernel).toHaveBeenCalledWith({ id: 'k-new' });
    // A fresh kernel holds none of the snapshot's ports.
    expect(controller.originOf('k-new')).toBeNull();
    // The report, at once, and from the notification, which stays: a cell failed.
    expect(mockedShowDialog.mock.calls[1][0]?.title).toBe("A fresh kernel for 'from-a'");
    await new Promise(resolve => setTimeout(resolve, 0));
    expect(shown()).toEqual([
      {
        message: expect.stringMatching(
          /^A fresh kernel took the place of 'from-a' in .*: 2 cells re-run, 1 failed$/
        ),
        type: 'warning',
        autoClose: false,
        actions: ['Report']
      }
    ]);
    answer('Close');
    click('Report');
    expect(mockedShowDialog).toHaveBeenCalledTimes(3);
  });

  it('on Cancel leaves the failure on screen, with a way to ask again', async () => {
    const { api, controller, notebook } = setUp();
    api.startRestore.mockResolvedValue(refused(['portable']));
    answer(null);

    await expect(controller.restore(notebook, snapshot)).resolves.toBe(false);

    expect(labels(mockedShowDialog.mock.calls[0][0])).toEqual([
      '',
      'Load the portable copy'
    ]);
    expect(api.startRestore).toHaveBeenCalledTimes(1);
    expect(shown()).toEqual([
      expect.objectContaining({
        message: expect.stringMatching(
          /^Restore of 'from-a' failed: compatibility failed: the NVIDIA driver/
        ),
        type: 'error',
        actions: ['Restore another way…', 'Details']
      })
    ]);

    answer('Load the portable copy');
    api.startRestore.mockResolvedValue(
      makeJob({
        kind: 'restore',
        status: 'failed',
        phase: 'fallback',
        error: {
          code: 'failed',
          step: 'load',
          cause: 'the fresh kernel stopped answering',
          message: 'load failed: the fresh kernel stopped answering',
          details: { fallback: ['portable'] }
        }
      })
    );
    click('Restore another way…');
    await new Promise(resolve => setTimeout(resolve, 20));
    expect(api.startRestore).toHaveBeenLastCalledWith('s-a', {
      path: 'work/b.ipynb',
      session_id: 's-b',
      fallback: 'portable'
    });
    // The first failure went once a way back was taken; a way back that fails offers
    // none again.
    expect(mockedShowDialog).toHaveBeenCalledTimes(2);
    expect(shown()).toEqual([
      expect.objectContaining({
        message:
          "Restore of 'from-a' into a fresh kernel failed: load failed: the fresh kernel stopped answering",
        type: 'error',
        actions: ['Details']
      })
    ]);
  });

  it('offers nothing for a failure that lists no way back, or one of taken ports', async () => {
    const { api, controller, notebook } = setUp();
    api.startRestore.mockResolvedValueOnce(refused([]));
    await controller.restore(notebook, snapshot);
    const ports = portsRefusal({ holder_kernel_id: null });
    api.startRestore.mockResolvedValueOnce(
      makeJob({
        kind: 'restore',
        status: 'failed',
        error: { ...ports, details: { ...ports.details, fallback: ['replay'] } }
      })
    );
    await controller.restore(notebook, snapshot);
    expect(mockedShowDialog).not.toHaveBeenCalled();
    expect(shown().map(n => n.actions)).toEqual([['Details'], ['Details']]);
  });

  it('takes the way chosen in the restore dialog at once', async () => {
    const { api, controller, notebook } = setUp();
    api.startRestore.mockResolvedValue(
      restoredJob('s-b', {
        result: {
          kernel_id: 'k-new',
          session_id: 's-b',
          fallback: {
            mode: 'portable',
            loaded: [{ name: 'w', kind: 'tensor', device: 'cuda:0' }],
            not_loaded: [],
            replayed: [],
            notes: []
          }
        }
      })
    );
    answer('Close');
    await expect(
      controller.restore(notebook, snapshot, { fallback: 'portable' })
    ).resolves.toBe(true);
    expect(api.startRestore).toHaveBeenCalledWith('s-a', {
      path: 'work/b.ipynb',
      session_id: 's-b',
      fallback: 'portable'
    });
    expect(shown()).toEqual([
      expect.objectContaining({
        message: expect.stringMatching(/: 1 name loaded$/),
        type: 'success',
        autoClose: SUCCESS_CLOSE_MS
      })
    ]);
  });

  it('reports a way back taken elsewhere (the panel widget) in the notebook it replaced', async () => {
    const events = new EventStream();
    const { api, controller } = setUp([], events);
    controller.showsSession = sessionId => sessionId === 's-b';
    api.getSnapshot.mockResolvedValue(snapshot);
    const done = restoredJob('s-b', {
      id: 'j-widget',
      snapshot_id: 's-a',
      result: { kernel_id: 'k-new', session_id: 's-b', fallback: report }
    });
    events.emitJob(done);
    events.emitJob(done);
    events.emitJob(
      restoredJob('s-other', {
        id: 'j-other',
        result: { kernel_id: 'k-x', session_id: 's-other', fallback: report }
      })
    );
    await new Promise(resolve => setTimeout(resolve, 10));
    expect(shown()).toEqual([
      expect.objectContaining({
        message: "A fresh kernel took the place of 'from-a': 2 cells re-run, 1 failed",
        type: 'warning',
        actions: ['Report']
      })
    ]);
    controller.dispose();
  });
});

describe('save with a portable copy', () => {
  it('asks the server for one only when asked', async () => {
    const { api, controller, notebook } = await readyToSave();
    api.startSave.mockResolvedValue(
      makeJob({
        status: 'succeeded',
        phase: 'done',
        result: makeSnapshot({ name: 'p', fallback: ['portable', 'replay', 'both'] })
      })
    );
    await controller.save(notebook, 'p', { portable: true });
    expect(api.startSave).toHaveBeenLastCalledWith('k-b', { name: 'p', portable: true });
    expect(shown()[0].message).toMatch(/, with a portable copy$/);
    await controller.save(notebook);
    expect(api.startSave).toHaveBeenLastCalledWith('k-b', {});
  });
});

describe('restoreAsked: going back on the kernel that runs is one confirmation', () => {
  const own = makeSnapshot({
    id: 's-own',
    name: 'first-steps',
    kernel: { kernel_id: 'k-b' }
  });

  function restoring(api: ReturnType<typeof fakeApi>) {
    api.startRestore.mockResolvedValue(
      makeJob({ id: 'r1', kind: 'restore', kernel_id: 'k-new', phase: 'restore' })
    );
    api.getJob.mockResolvedValue(
      makeJob({
        id: 'r1',
        kind: 'restore',
        status: 'succeeded',
        phase: 'done',
        result: { kernel_id: 'k-new', session_id: null }
      })
    );
    api.kernelStatus.mockResolvedValue(status({ kernel_id: 'k-new' }));
  }

  it("asks once, then shuts down the notebook's kernel and restores, without a refusal", async () => {
    const { api, controller, panel, notebook } = await readyToSave();
    restoring(api);
    mockedShowDialog.mockResolvedValue({
      button: { accept: true, label: 'Replace kernel' },
      value: null,
      isChecked: null
    } as never);
    expect(await controller.restoreAsked(notebook, own, {}, [own])).toBe(true);
    const asked = mockedShowDialog.mock.calls[0][0] ?? {};
    expect(asked.title).toBe("Go back to 'first-steps'?");
    expect(asked.body).toMatch(
      /^Replace this notebook's kernel with 'first-steps', saved .*\? What the kernel did since is lost\.$/
    );
    expect(panel.sessionContext.shutdown).toHaveBeenCalledTimes(1);
    expect(api.startRestore).toHaveBeenCalledTimes(1);
    expect(shown().map(n => n.type)).not.toContain('error');
  });

  it('does nothing when the user keeps the kernel', async () => {
    const { api, controller, panel, notebook } = await readyToSave();
    mockedShowDialog.mockResolvedValue({
      button: { accept: false, label: 'Cancel' },
      value: null,
      isChecked: null
    } as never);
    expect(await controller.restoreAsked(notebook, own, {}, [own])).toBe(false);
    expect(panel.sessionContext.shutdown).not.toHaveBeenCalled();
    expect(api.startRestore).not.toHaveBeenCalled();
  });

  it("restores another kernel's snapshot at once, without asking", async () => {
    const { api, controller, notebook } = await readyToSave();
    restoring(api);
    const other = makeSnapshot({ id: 's-other', kernel: { kernel_id: 'k-gone' } });
    expect(await controller.restoreAsked(notebook, other, {}, [other])).toBe(true);
    expect(mockedShowDialog).not.toHaveBeenCalled();
  });
});

describe('a status asked before a save ended', () => {
  it('does not bring back "no snapshot" once the save committed: it is asked again', async () => {
    const { api, controller, notebook } = await readyToSave();
    const saved = makeSnapshot({ id: 's-new', kernel: { kernel_id: 'k-b' } });
    api.startSave.mockResolvedValue(makeJob({ kernel_id: 'k-b' }));
    let answerStale: (status: IKernelStatus) => void = () => undefined;
    api.kernelStatus.mockReturnValueOnce(new Promise(resolve => (answerStale = resolve)));
    const polled = controller.refresh('k-b'); // a poll, while the save runs
    api.getJob.mockResolvedValue(
      makeJob({ kernel_id: 'k-b', status: 'succeeded', phase: 'done', result: saved })
    );
    let answerFresh: (status: IKernelStatus) => void = () => undefined;
    api.kernelStatus.mockReturnValue(new Promise(resolve => (answerFresh = resolve)));
    await controller.save(notebook);
    expect(controller.entry('k-b')?.status?.last_snapshot?.id).toBe('s-new');
    answerStale(status({ last_snapshot: null })); // the poll's answer, from before the commit
    await polled;
    // Until the server answers again, the page keeps what it knows.
    expect(controller.entry('k-b')?.status?.last_snapshot?.id).toBe('s-new');
    expect(api.kernelStatus).toHaveBeenCalledTimes(3);
    answerFresh(status({ last_snapshot: saved }));
  });
});
