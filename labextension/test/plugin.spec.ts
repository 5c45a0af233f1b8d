/**
 * The plugin reads its polling intervals from its settings, and reads them again when
 * they change: statusRefreshSeconds reaches the status item and the sidebar,
 * followJobMilliseconds the controller's job follower. The application, the notebook
 * tracker, the status bar and the setting registry are stand-ins; the plugin is the real
 * one, activated as JupyterLab activates it.
 */
import type { JupyterFrontEnd } from '@jupyterlab/application';
import { ServerConnection } from '@jupyterlab/services';
import { StateDB } from '@jupyterlab/statedb';
import { CommandRegistry } from '@lumino/commands';
import { Signal } from '@lumino/signaling';
import { SnapshotController } from '../src/controller';
import plugin from '../src/index';
import { SnapshotsSidebar } from '../src/sidebar';
import { SnapshotStatusItem } from '../src/statusbar';

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

function activate(settings: FakeSettings) {
  const registry = { load: jest.fn(async () => settings) };
  const statusBar = { registerStatusItem: jest.fn() };
  const shell = { add: jest.fn() };
  const app = {
    commands: new CommandRegistry(),
    serviceManager: { events: null },
    shell
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
    null,
    statusBar,
    registry,
    new StateDB(),
    null
  );
  return { registry, statusBar, shell };
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
    jest.restoreAllMocks();
    jest.useRealTimers();
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
