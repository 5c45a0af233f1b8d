/**
 * The plugin reads its settings, and reads them again when they change:
 * statusRefreshSeconds reaches the status item and the sidebar, followJobMilliseconds the
 * controller's job follower, offerRestoreAfterShutdown the restart offer, which keeps its
 * answers in the plugin's IStateDB. The application, the notebook
 * tracker, the status bar and the setting registry are stand-ins; the plugin is the real
 * one, activated as JupyterLab activates it.
 */
import type { JupyterFrontEnd } from '@jupyterlab/application';
import type { NotebookPanel } from '@jupyterlab/notebook';
import { KernelAPI, ServerConnection } from '@jupyterlab/services';
import { StateDB } from '@jupyterlab/statedb';
import { CommandRegistry } from '@lumino/commands';
import { Signal } from '@lumino/signaling';
import { Notification } from '@jupyterlab/apputils';
import { SnapshotAPI } from '../src/api';
import { SnapshotController } from '../src/controller';
import plugin from '../src/index';
import { SnapshotsSidebar } from '../src/sidebar';
import { SnapshotStatusItem } from '../src/statusbar';
import { makeSnapshot } from './fixtures';

// Only the tokens of the notebook, status bar and apputils packages (the plugin names them
// in its requirements) and JupyterLab's real notification manager: loading those packages
// whole would take jest most of a minute to transform.
jest.mock('@jupyterlab/notebook', () => {
  const { Token } = jest.requireActual('@lumino/coreutils');
  const { Signal } = jest.requireActual('@lumino/signaling');
  return {
    INotebookTracker: new Token('@jupyterlab/notebook:INotebookTracker'),
    NotebookActions: { executed: new Signal({}) }
  };
});
jest.mock('@jupyterlab/statusbar', () => {
  const { Token } = jest.requireActual('@lumino/coreutils');
  return { IStatusBar: new Token('@jupyterlab/statusbar:IStatusBar') };
});
jest.mock('@jupyterlab/apputils', () => {
  const { Token } = jest.requireActual('@lumino/coreutils');
  return {
    Notification: jest.requireActual('@jupyterlab/apputils/lib/notification')
      .Notification,
    ICommandPalette: new Token('@jupyterlab/apputils:ICommandPalette'),
    IToolbarWidgetRegistry: new Token('@jupyterlab/apputils:IToolbarWidgetRegistry')
  };
});

/** The plugin's settings, as the setting registry gives them, with values a test sets. */
class FakeSettings {
  readonly changed = new Signal<this, void>(this);
  values: { [name: string]: unknown } = {
    offerRestoreAfterShutdown: true,
    statusRefreshSeconds: 15,
    followJobMilliseconds: 400
  };

  get(name: string): { composite: unknown } {
    return { composite: this.values[name] };
  }

  /** The user edits the settings: JupyterLab emits ``changed`` once per save. */
  set(values: { [name: string]: unknown }): void {
    this.values = { ...this.values, ...values };
    this.changed.emit();
  }
}

function activate(
  settings: FakeSettings,
  state = new StateDB(),
  palette: { addItem: jest.Mock } | null = null
) {
  const registry = { load: jest.fn(async () => settings) };
  const statusBar = { registerStatusItem: jest.fn() };
  const shell = { add: jest.fn() };
  const app = {
    commands: new CommandRegistry(),
    serviceManager: { events: null },
    shell,
    // No context menu is open: commands act on the current notebook.
    contextMenuHitTest: () => undefined
  } as unknown as JupyterFrontEnd;
  const tracker = {
    currentChanged: new Signal<unknown, unknown>({}),
    widgetAdded: new Signal<unknown, unknown>({}),
    currentWidget: null
  };
  const toolbarRegistry = { addFactory: jest.fn() };
  plugin.activate(
    app,
    tracker,
    toolbarRegistry,
    palette,
    statusBar,
    registry,
    state,
    null
  );
  return { registry, statusBar, shell, tracker, app };
}

describe('the plugin and its settings', () => {
  let statusSeconds: jest.SpyInstance;
  let sidebarSeconds: jest.SpyInstance;
  let followInterval: jest.SpyInstance;
  let disposeAll = () => undefined as void;

  beforeEach(() => {
    // The polls stay still: no tick reaches for a server.
    jest.useFakeTimers();
    // jsdom has no fetch to build server settings on; no request is made here.
    jest
      .spyOn(ServerConnection, 'makeSettings')
      .mockReturnValue({} as ServerConnection.ISettings);
    statusSeconds = jest.spyOn(SnapshotStatusItem.prototype, 'setRefreshSeconds');
    sidebarSeconds = jest.spyOn(SnapshotsSidebar.prototype, 'setRefreshSeconds');
    followInterval = jest.spyOn(SnapshotController.prototype, 'followInterval', 'set');
  });

  afterEach(() => {
    disposeAll();
    Notification.dismiss();
    jest.restoreAllMocks();
    jest.useRealTimers();
  });

  it("offers the active cell's rewind in the command palette, with the saves", () => {
    const palette = { addItem: jest.fn() };
    const { app } = activate(new FakeSettings(), new StateDB(), palette);
    const offered = palette.addItem.mock.calls.map(([item]) => item.command);
    expect(offered).toContain('gpu-snapshot:rewind-to-cell');
    expect(app.commands.hasCommand('gpu-snapshot:rewind-to-cell')).toBe(true);
    // No notebook is open: nothing to rewind, and the command says so.
    expect(app.commands.isEnabled('gpu-snapshot:rewind-to-cell')).toBe(false);
  });

  it('applies the intervals it loads, and each change of them', async () => {
    const settings = new FakeSettings();
    settings.values.statusRefreshSeconds = 30;
    settings.values.followJobMilliseconds = 1000;
    const { registry, statusBar, shell } = activate(settings);
    disposeAll = () => {
      statusBar.registerStatusItem.mock.calls[0][1].item.dispose();
      shell.add.mock.calls[0][0].dispose();
    };
    expect(registry.load).toHaveBeenCalledWith('jupyter-gpu-snapshot:plugin');
    await jest.advanceTimersByTimeAsync(0);

    expect(statusSeconds).toHaveBeenLastCalledWith(30);
    expect(sidebarSeconds).toHaveBeenLastCalledWith(30);
    expect(followInterval).toHaveBeenLastCalledWith(1000);

    settings.set({ statusRefreshSeconds: 5, followJobMilliseconds: 200 });
    expect(statusSeconds).toHaveBeenLastCalledWith(5);
    expect(sidebarSeconds).toHaveBeenLastCalledWith(5);
    expect(followInterval).toHaveBeenLastCalledWith(200);
  });
});

/** A notebook as it opens, without a kernel. */
function openedNotebook(path: string): NotebookPanel {
  const panel = {
    context: { ready: Promise.resolve(), path, localPath: path },
    sessionContext: { session: null },
    isDisposed: false,
    disposed: null as unknown
  };
  panel.disposed = new Signal<unknown, void>(panel);
  return panel as unknown as NotebookPanel;
}

/** Lets the promises of an opened notebook's offer run (jest's clock stands still). */
async function settle(): Promise<void> {
  for (let i = 0; i < 10; i++) {
    await jest.advanceTimersByTimeAsync(1);
  }
}

describe('the plugin and its restart offer', () => {
  beforeEach(() => {
    jest.useFakeTimers();
    jest
      .spyOn(ServerConnection, 'makeSettings')
      .mockReturnValue({} as ServerConnection.ISettings);
    // Each notebook's newest snapshot was saved at shutdown, of a kernel that is gone.
    jest
      .spyOn(SnapshotAPI.prototype, 'latestSnapshots')
      .mockImplementation(async path => [
        makeSnapshot({ id: `s-${path}`, notebook_path: path, reason: 'shutdown' })
      ]);
    jest.spyOn(KernelAPI, 'listRunning').mockResolvedValue([]);
  });

  afterEach(() => {
    Notification.dismiss();
    jest.restoreAllMocks();
    jest.useRealTimers();
  });

  it('keeps the answer in its IStateDB, and offers nothing once the setting is off', async () => {
    const settings = new FakeSettings();
    const state = new StateDB();
    const { statusBar, shell, tracker } = activate(settings, state);
    try {
      await settle();
      tracker.widgetAdded.emit(openedNotebook('work/a.ipynb'));
      await settle();
      expect(Notification.manager.notifications).toHaveLength(1);
      const [toast] = Notification.manager.notifications;
      expect(toast.message).toContain('a.ipynb');
      toast.options.actions
        ?.find(a => a.label === 'Not now')
        ?.callback(new MouseEvent('click'));
      await settle();
      expect(Object.values(await state.toJSON())).toContainEqual(['s-work/a.ipynb']);
      Notification.dismiss(); // As a click on the toast's button does.

      settings.set({ offerRestoreAfterShutdown: false });
      tracker.widgetAdded.emit(openedNotebook('work/b.ipynb'));
      await settle();
      expect(Notification.manager.notifications).toHaveLength(0);
    } finally {
      statusBar.registerStatusItem.mock.calls[0][1].item.dispose();
      shell.add.mock.calls[0][0].dispose();
    }
  });
});
