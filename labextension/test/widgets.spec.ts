/**
 * Rebinding a notebook's widget outputs to a restored kernel: the models of the kernel
 * before are forgotten, the restored kernel's are loaded, each of those is asked for its
 * state once more (an update sent while the manager loaded them is lost otherwise), and
 * the panel is marked meanwhile. The widget manager and the notebook panel are stand-ins
 * with the parts of @jupyter-widgets/jupyterlab-manager and JupyterLab that the module uses.
 */
import type { NotebookPanel } from '@jupyterlab/notebook';
import { WIDGETS_STATE_ATTRIBUTE, WIDGET_VIEW_MIME, rebindWidgets } from '../src/widgets';

interface IFakeModel {
  comm: { jsServicesComm: { _kernel: unknown }; send: jest.Mock };
}

function fakeModel(kernel: unknown): IFakeModel {
  return { comm: { jsServicesComm: { _kernel: kernel }, send: jest.fn(() => 'msg-id') } };
}

function setUp() {
  const restored = { connectionStatus: 'connected' };
  const before = { connectionStatus: 'connected' };
  const stale = fakeModel(before);
  const loaded: Record<string, IFakeModel> = {
    a: fakeModel(restored),
    b: fakeModel(restored)
  };
  const manager = {
    _models: { stale: Promise.resolve(stale) } as Record<string, Promise<IFakeModel>>,
    restoreWidgets: jest.fn(async () => {
      // What the manager holds when restoreWidgets is called decides what it loads.
      expect(Object.keys(manager._models)).toEqual([]);
      for (const [id, model] of Object.entries(loaded)) {
        manager._models[id] = Promise.resolve(model);
      }
    })
  };
  const renderer = {
    mimeType: WIDGET_VIEW_MIME,
    _manager: { promise: Promise.resolve(manager) }
  };
  const widgetOutput = {
    data: { [WIDGET_VIEW_MIME]: { model_id: 'a' } },
    toJSON: () => 'json'
  };
  const outputs = { length: 1, get: () => widgetOutput, set: jest.fn() };
  const panel = {
    node: document.createElement('div'),
    sessionContext: { session: { kernel: restored } },
    context: { model: {} },
    content: {
      widgets: [{ outputArea: { widgets: [renderer] }, model: { outputs } }]
    }
  };
  return { panel, manager, stale, loaded, outputs };
}

describe('rebindWidgets', () => {
  it("loads the restored kernel's widgets and asks each for its state again", async () => {
    const { panel, manager, stale, loaded, outputs } = setUp();
    const rebinding = rebindWidgets(panel as unknown as NotebookPanel);
    expect(panel.node.getAttribute(WIDGETS_STATE_ATTRIBUTE)).toBe('rebinding');
    await rebinding;

    expect(manager.restoreWidgets).toHaveBeenCalledTimes(1);
    for (const model of Object.values(loaded)) {
      expect(model.comm.send).toHaveBeenCalledWith({ method: 'request_state' });
    }
    // The kernel before cannot answer: its model is forgotten, not asked.
    expect(stale.comm.send).not.toHaveBeenCalled();
    expect(Object.keys(manager._models).sort()).toEqual(['a', 'b']);
    expect(outputs.set).toHaveBeenCalledWith(0, 'json');
    expect(panel.node.getAttribute(WIDGETS_STATE_ATTRIBUTE)).toBe('current');
  });

  it('marks the panel current also when loading the widgets fails', async () => {
    const { panel, manager } = setUp();
    manager.restoreWidgets.mockRejectedValueOnce(new Error('control comm closed'));
    await expect(rebindWidgets(panel as unknown as NotebookPanel)).rejects.toThrow(
      'control comm closed'
    );
    expect(panel.node.getAttribute(WIDGETS_STATE_ATTRIBUTE)).toBe('current');
  });
});
