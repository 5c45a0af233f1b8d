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
import { Signal } from '@lumino/signaling';
import type { ISnapshotSummary } from '../src/api';
import type { SnapshotController } from '../src/controller';
import { MESSAGE_LIMIT, ShutdownOffer, describeOffers } from '../src/reboot';
import { makeSnapshot } from './fixtures';

// JupyterLab's real notification manager, without the rest of apputils.
jest.mock('@jupyterlab/apputils', () => ({
  Notification: jest.requireActual('@jupyterlab/apputils/lib/notification').Notification
}));

/**
 * A notebook panel as far as the offer reads it: its path, once its context is ready,
 * and its closing (a real signal).
 */
function fakePanel(path: string): NotebookPanel {
  const panel = {
    context: { ready: Promise.resolve(), path, localPath: path },
    isDisposed: false,
    dispose: () => {
      panel.isDisposed = true;
      panel.disposed.emit(undefined);
    }
  } as unknown as { isDisposed: boolean; disposed: Signal<unknown, void> };
  panel.disposed = new Signal<unknown, void>(panel);
  return panel as unknown as NotebookPanel;
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
  // The notebooks open in the page, by path, as JupyterLab's tracker finds them.
  const open = new Map<string, NotebookPanel>();
  const offer = new ShutdownOffer(
    asController,
    state,
    undefined,
    path => open.get(path) ?? null
  );
  const openNotebook = async (path: string) => {
    const panel = fakePanel(path);
    open.set(path, panel);
    panel.disposed.connect(() => {
      if (open.get(path) === panel) {
        open.delete(path);
      }
    });
    await offer.check(panel);
    return panel;
  };
  for (const path of paths) {
    await openNotebook(path);
  }
  return { state, controller, offer, openNotebook, open };
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

describe('one offer names every notebook, whenever their answers come', () => {
  const both = [shutdownSnapshot, autosaveSnapshot];

  it('replaces the offer on screen by one naming both when the second answer comes late', async () => {
    const page = await openPage(both, 'work/a.ipynb');
    expect(offersShown()).toHaveLength(1);
    const first = offersShown()[0].id;
    await page.openNotebook('work/b.ipynb');
    // One notification, a new one: the toast and the notification center agree.
    expect(offersShown()).toHaveLength(1);
    expect(offersShown()[0].id).not.toBe(first);
    expect(offersShown()[0].message).toMatch(
      /^Restore the kernels of 2 notebooks\? a\.ipynb: saved at shutdown, .*; b\.ipynb: an autosave, /
    );
    expect(offersShown()[0].options.actions?.map(a => a.label)).toEqual([
      'Restore all',
      'Not now'
    ]);
    await answerAndStore(page.state, 'Restore all');
    const calls = page.controller.restore.mock.calls as unknown as [
      NotebookPanel,
      ISnapshotSummary
    ][];
    expect(calls.map(([panel, s]) => [panel.context.path, s.id])).toEqual([
      ['work/a.ipynb', 's-a'],
      ['work/b.ipynb', 's-b']
    ]);
    expect(offersShown()).toHaveLength(0);
  });

  it('restores into a notebook closed and opened again before the answer', async () => {
    const page = await openPage(both, 'work/a.ipynb', 'work/b.ipynb');
    page.open.get('work/b.ipynb')!.dispose();
    expect(offersShown()[0].message).not.toContain('b.ipynb');
    const reopened = await page.openNotebook('work/b.ipynb');
    expect(offersShown()).toHaveLength(1);
    expect(offersShown()[0].message).toContain('b.ipynb');
    await answerAndStore(page.state, 'Restore all');
    expect(page.controller.restore).toHaveBeenCalledWith(reopened, autosaveSnapshot);
    expect(
      await page.state.fetch('jupyter-gpu-snapshot:shutdown-offers-answered')
    ).toEqual(['s-a', 's-b']);
  });

  it('does not count a notebook closed for good as answered: it is offered again', async () => {
    const page = await openPage(both, 'work/a.ipynb', 'work/b.ipynb');
    page.open.get('work/b.ipynb')!.dispose();
    await answerAndStore(page.state, 'Restore');
    expect(page.controller.restore).toHaveBeenCalledTimes(1);
    Notification.dismiss();

    await openPage(both, 'work/a.ipynb', 'work/b.ipynb');
    expect(offersShown()).toHaveLength(1);
    expect(offersShown()[0].message).toContain('b.ipynb');
    expect(offersShown()[0].message).not.toContain('a.ipynb');
  });
});

describe('describeOffers: within the 140 characters JupyterLab shows', () => {
  const snapshot = (path: string) =>
    makeSnapshot({ id: path, notebook_path: path, reason: 'autosave' });

  it('names each notebook with its reason and age when that fits', () => {
    const text = describeOffers([
      ['a.ipynb', snapshot('a.ipynb')],
      ['b.ipynb', snapshot('b.ipynb')]
    ]);
    expect(text).toMatch(/^Restore the kernels of 2 notebooks\? a\.ipynb: an autosave, /);
    expect(text.length).toBeLessThanOrEqual(MESSAGE_LIMIT);
  });

  it('names them alone, then as many as fit and how many more', () => {
    const many = Array.from({ length: 9 }, (_, i) => `experiment-${i}.ipynb`);
    const text = describeOffers(many.map(path => [path, snapshot(path)]));
    expect(text.length).toBeLessThanOrEqual(MESSAGE_LIMIT);
    expect(text).toMatch(
      /^Restore the kernels of 9 notebooks\? experiment-0\.ipynb, .* and \d more\.$/
    );
  });

  it('offers the whole list in Details when not every notebook is named', async () => {
    const many = Array.from({ length: 9 }, (_, i) => `work/experiment-${i}.ipynb`);
    await openPage(many.map(snapshot), ...many);
    expect(offersShown()[0].options.actions?.map(a => a.label)).toEqual([
      'Restore all',
      'Details',
      'Not now'
    ]);
  });
});
