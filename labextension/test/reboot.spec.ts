/**
 * The restart offer remembers which snapshots the user answered in JupyterLab's state
 * database (IStateDB), not in the browser's localStorage: after a reload, an answered
 * offer stays quiet and an unanswered one comes again. The state database is
 * JupyterLab's real StateDB; a reload is a new StateDB on the same stored data, as
 * JupyterLab builds one from the workspace. The server's API, the notebook panel and the
 * controller are stand-ins.
 */
import { Notification } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import { KernelAPI } from '@jupyterlab/services';
import { StateDB } from '@jupyterlab/statedb';
import type { ISnapshotSummary } from '../src/api';
import type { SnapshotController } from '../src/controller';
import { ShutdownOffer } from '../src/reboot';
import { makeSnapshot } from './fixtures';

// JupyterLab's real notification manager, without the rest of apputils.
jest.mock('@jupyterlab/apputils', () => ({
  Notification: jest.requireActual('@jupyterlab/apputils/lib/notification').Notification
}));

/** A notebook panel as far as the offer reads it: its path, once its context is ready. */
function fakePanel(path: string): NotebookPanel {
  return {
    context: { ready: Promise.resolve(), path, localPath: path },
    isDisposed: false
  } as unknown as NotebookPanel;
}

/**
 * The controller with a server whose newest snapshot of each notebook is in ``newest``;
 * no kernel runs a restored snapshot.
 */
function fakeController(newest: ISnapshotSummary[]) {
  const controller = {
    api: {
      latestSnapshots: jest.fn(async (path: string) =>
        newest.filter(s => s.notebook_path === path)
      )
    },
    kernelId: jest.fn(() => null),
    originOf: jest.fn(() => null),
    restore: jest.fn(async () => undefined)
  };
  return { controller, asController: controller as unknown as SnapshotController };
}

/** The offers on screen now, as JupyterLab's notification manager holds them. */
function offersShown() {
  return Notification.manager.notifications;
}

/** Clicks the button labelled ``label`` of the one offer on screen. */
function answer(label: string): void {
  const [toast] = offersShown();
  const action = toast.options.actions?.find(a => a.label === label);
  if (!action) {
    throw new Error(`no "${label}" button on: ${toast.message}`);
  }
  action.callback(new MouseEvent('click'));
}

/** Resolves once ``state`` saved something: the answer is written in the background. */
function saved(state: StateDB): Promise<void> {
  return new Promise(resolve => {
    const onChange = (_: unknown, change: StateDB.Change) => {
      if (change.type === 'save') {
        state.changed.disconnect(onChange);
        resolve();
      }
    };
    state.changed.connect(onChange);
  });
}

const shutdownSnapshot = makeSnapshot({
  id: 's-a',
  notebook_path: 'work/a.ipynb',
  reason: 'shutdown',
  kernel: { name: 'python3-snapshot', kernel_id: 'k-gone' }
});
const autosaveSnapshot = makeSnapshot({
  id: 's-b',
  notebook_path: 'work/b.ipynb',
  reason: 'autosave',
  kernel: { name: 'python3-snapshot', kernel_id: 'k-gone-too' }
});

let storedWorkspace: StateDB.Connector;
let setItem: jest.SpyInstance;

beforeEach(() => {
  // The kernels the snapshots were taken of are gone: the server runs none.
  jest.spyOn(KernelAPI, 'listRunning').mockResolvedValue([]);
  setItem = jest.spyOn(Storage.prototype, 'setItem');
  localStorage.clear();
  storedWorkspace = new StateDB.Connector();
});

afterEach(() => {
  Notification.dismiss();
  jest.restoreAllMocks();
});

/**
 * The page as it opens (again): a new state database on the stored workspace; the offer
 * then checks the notebooks at ``paths``, as each is opened.
 */
async function openPage(newest: ISnapshotSummary[], ...paths: string[]) {
  const state = new StateDB({ connector: storedWorkspace });
  const { controller, asController } = fakeController(newest);
  const offer = new ShutdownOffer(asController, state);
  for (const path of paths) {
    await offer.check(fakePanel(path));
  }
  return { state, controller, offer };
}

/** Clicks ``label`` on the one offer; resolves once the page stored the answer. */
async function answerAndStore(state: StateDB, label: string): Promise<void> {
  const written = saved(state);
  answer(label);
  await written;
}

describe('ShutdownOffer answers kept in IStateDB', () => {
  it.each([
    ['Not now', false],
    ['Restore', true]
  ])(
    'does not offer again after a reload once answered "%s"',
    async (label, restores) => {
      const first = await openPage([shutdownSnapshot], 'work/a.ipynb');
      expect(offersShown()).toHaveLength(1);
      expect(offersShown()[0].message).toContain('a.ipynb');

      await answerAndStore(first.state, label);
      expect(first.controller.restore).toHaveBeenCalledTimes(restores ? 1 : 0);
      Notification.dismiss();

      const reloaded = await openPage([shutdownSnapshot], 'work/a.ipynb');
      expect(reloaded.controller.api.latestSnapshots).toHaveBeenCalledWith(
        'work/a.ipynb'
      );
      expect(offersShown()).toHaveLength(0);
    }
  );

  it('offers again after a reload when the offer was left unanswered', async () => {
    await openPage([shutdownSnapshot], 'work/a.ipynb');
    expect(offersShown()).toHaveLength(1);
    Notification.dismiss(); // The page went away before the user answered.

    await openPage([shutdownSnapshot], 'work/a.ipynb');
    expect(offersShown()).toHaveLength(1);
    expect(offersShown()[0].message).toContain('a.ipynb');
  });

  it('keeps quiet only about the snapshot answered, not about another notebook', async () => {
    const both = [shutdownSnapshot, autosaveSnapshot];
    const first = await openPage(both, 'work/a.ipynb');
    await answerAndStore(first.state, 'Not now');
    Notification.dismiss();

    await openPage(both, 'work/a.ipynb', 'work/b.ipynb');
    expect(offersShown()).toHaveLength(1);
    expect(offersShown()[0].message).toContain('b.ipynb');
    expect(offersShown()[0].message).not.toContain('a.ipynb');
  });

  it('adds each answer to the earlier ones, over several reloads', async () => {
    const both = [shutdownSnapshot, autosaveSnapshot];
    const first = await openPage(both, 'work/a.ipynb');
    await answerAndStore(first.state, 'Not now');
    Notification.dismiss();

    const second = await openPage(both, 'work/a.ipynb', 'work/b.ipynb');
    expect(offersShown()).toHaveLength(1);
    await answerAndStore(second.state, 'Not now');
    Notification.dismiss();

    await openPage(both, 'work/a.ipynb', 'work/b.ipynb');
    expect(offersShown()).toHaveLength(0);
  });

  it('keeps the answer in the state database and nothing in localStorage', async () => {
    const first = await openPage([shutdownSnapshot], 'work/a.ipynb');
    await answerAndStore(first.state, 'Not now');

    const stored = await first.state.toJSON();
    expect(Object.values(stored)).toContainEqual(['s-a']);
    expect(setItem).not.toHaveBeenCalled();
    expect(localStorage).toHaveLength(0);
  });
});
