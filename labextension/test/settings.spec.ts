/**
 * Polling intervals come from the settings schema: the schema's defaults are the code's
 * defaults, and the status bar item's @lumino/polling Poll rechecks the kernel at the
 * interval the setting gives, changed while it runs. The notebook panel and the
 * controller are stand-ins; the Poll and its timers (jest's fake clock) are real.
 */
import { readFileSync } from 'fs';
import { join } from 'path';
import type { INotebookTracker } from '@jupyterlab/notebook';
import { Signal } from '@lumino/signaling';
import type { SnapshotAPI } from '../src/api';
import type { SnapshotController } from '../src/controller';
import { untranslated } from '../src/translation';
import { JobFollower } from '../src/jobs';
import { DEFAULT_REFRESH_SECONDS, SnapshotStatusItem } from '../src/statusbar';

interface ISchemaProperty {
  type: string;
  default: unknown;
  minimum?: number;
}

/** The settings schema as JupyterLab reads it from the package. */
const schema = JSON.parse(
  readFileSync(join(__dirname, '..', 'schema', 'plugin.json'), 'utf8')
) as { properties: { [name: string]: ISchemaProperty } };

describe('the settings schema', () => {
  it('declares the status refresh interval with the status item default', () => {
    const setting = schema.properties.statusRefreshSeconds;
    expect(setting).toMatchObject({ type: 'number', default: DEFAULT_REFRESH_SECONDS });
    expect(setting.minimum).toBeGreaterThan(0);
    expect(setting.minimum).toBeLessThanOrEqual(DEFAULT_REFRESH_SECONDS);
  });

  it('declares the job poll interval with the job follower default', () => {
    const follower = new JobFollower({} as SnapshotAPI, null);
    const setting = schema.properties.followJobMilliseconds;
    expect(setting).toMatchObject({ type: 'number', default: follower.interval });
    expect(setting.minimum).toBeGreaterThan(0);
    expect(setting.minimum).toBeLessThanOrEqual(follower.interval);
  });
});

/** The current notebook, with a session whose kernel is ``k-a``. */
function fakeTracker() {
  const sessionContext = {
    kernelChanged: new Signal<unknown, unknown>({}),
    sessionChanged: new Signal<unknown, unknown>({}),
    statusChanged: new Signal<unknown, unknown>({}),
    ready: Promise.resolve()
  };
  return {
    currentChanged: new Signal<unknown, unknown>({}),
    currentWidget: { sessionContext, context: { path: 'work/a.ipynb' } }
  } as unknown as INotebookTracker;
}

/** The controller as the status item reads it: a kernel, no job, no status yet. */
function fakeController() {
  const controller = {
    changed: new Signal<unknown, string>({}),
    kernelId: jest.fn(() => 'k-a'),
    refresh: jest.fn(async (kernelId: string) => void kernelId),
    polledKernel: jest.fn((): string | null => 'k-a'),
    activeJob: jest.fn(() => null),
    entry: jest.fn(() => undefined)
  };
  return { controller, asController: controller as unknown as SnapshotController };
}

describe('SnapshotStatusItem polling', () => {
  let item: SnapshotStatusItem;
  let refresh: jest.Mock;
  let polledKernel: jest.Mock;

  /** How many times the item asked the server about the kernel since the last call. */
  let counted = 0;
  function rechecks(): number {
    const since = refresh.mock.calls.length - counted;
    counted = refresh.mock.calls.length;
    return since;
  }

  beforeEach(async () => {
    jest.useFakeTimers();
    const { controller, asController } = fakeController();
    refresh = controller.refresh;
    polledKernel = controller.polledKernel;
    item = new SnapshotStatusItem(
      fakeTracker(),
      asController,
      () => undefined,
      untranslated
    );
    // The watch of the notebook's kernel asks once as the item is built.
    expect(refresh).toHaveBeenCalledTimes(1);
    // The poll's first tick comes at once (on jest's clock, 1 ms); the intervals are
    // counted from it.
    await jest.advanceTimersByTimeAsync(1);
    expect(refresh).toHaveBeenCalledTimes(2);
    expect(refresh).toHaveBeenLastCalledWith('k-a');
    counted = refresh.mock.calls.length;
  });

  afterEach(() => {
    item.dispose();
    jest.useRealTimers();
  });

  it('rechecks the kernel every DEFAULT_REFRESH_SECONDS', async () => {
    const interval = DEFAULT_REFRESH_SECONDS * 1000;
    await jest.advanceTimersByTimeAsync(interval - 1);
    expect(rechecks()).toBe(0);
    await jest.advanceTimersByTimeAsync(1);
    expect(rechecks()).toBe(1);
    await jest.advanceTimersByTimeAsync(interval * 4);
    expect(rechecks()).toBe(4);
  });

  it.each([
    ['shorter', 5],
    ['longer', 60]
  ])('follows a %s interval set while it runs', async (_, seconds) => {
    await jest.advanceTimersByTimeAsync(1000);
    item.setRefreshSeconds(seconds);
    // The tick already scheduled at the old interval may still come.
    await jest.advanceTimersByTimeAsync(DEFAULT_REFRESH_SECONDS * 1000);
    rechecks();
    await jest.advanceTimersByTimeAsync(seconds * 1000 * 4);
    expect(rechecks()).toBe(4);
  });

  it('leaves a kernel the server no longer knows alone', async () => {
    polledKernel.mockReturnValue(null);
    await jest.advanceTimersByTimeAsync(DEFAULT_REFRESH_SECONDS * 1000 * 4);
    expect(rechecks()).toBe(0);
  });

  it('stops asking once disposed', async () => {
    item.dispose();
    await jest.advanceTimersByTimeAsync(DEFAULT_REFRESH_SECONDS * 1000 * 4);
    expect(rechecks()).toBe(0);
  });
});
