/**
 * Jupyter widgets after a restore: the restored kernel holds the widgets of the snapshot
 * (same model ids, live comms), but JupyterLab's widget manager only reloads them from the
 * kernel when a connection comes up and no earlier reload is still running, and it keeps
 * the models of the kernel it had before (bound to that kernel's closed comms). A widget
 * output then stays "Error displaying widget: model not found", or shows a dead copy.
 *
 * After the notebook moved to a restored kernel, rebind: forget the models whose comm
 * belongs to another kernel, load the restored kernel's widgets, and render the widget
 * outputs again. The manager is @jupyter-widgets/jupyterlab-manager's, reached through the
 * renderer it registers for widget outputs; without it (no ipywidgets) nothing is done.
 */
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { Kernel } from '@jupyterlab/services';
import type { Widget } from '@lumino/widgets';

export const WIDGET_VIEW_MIME = 'application/vnd.jupyter.widget-view+json';

/** The parts of the jupyterlab-manager's WidgetManager this module uses. */
interface IWidgetModel {
  comm?: {
    jsServicesComm?: { _kernel?: unknown };
    send(data: unknown): string;
  };
}

interface IWidgetManager {
  _models: Record<string, Promise<IWidgetModel>>;
  /** True while the manager's own reload from the kernel runs. */
  _kernelRestoreInProgress?: boolean;
  restoreWidgets(
    notebook: unknown,
    options: { loadKernel: boolean; loadNotebook: boolean }
  ): Promise<void>;
}

interface IWidgetRenderer {
  mimeType?: string;
  _manager?: { promise: Promise<IWidgetManager> };
}

function widgetRenderers(panel: NotebookPanel): IWidgetRenderer[] {
  const found: IWidgetRenderer[] = [];
  const visit = (widget: Widget) => {
    const renderer = widget as unknown as IWidgetRenderer;
    if (renderer.mimeType === WIDGET_VIEW_MIME && renderer._manager) {
      found.push(renderer);
      return;
    }
    const children = (widget as unknown as { widgets?: readonly Widget[] }).widgets;
    for (const child of children ?? []) {
      visit(child);
    }
  };
  for (const cell of panel.content.widgets) {
    const outputArea = (cell as unknown as { outputArea?: Widget }).outputArea;
    if (outputArea) {
      visit(outputArea);
    }
  }
  return found;
}

async function connected(kernel: Kernel.IKernelConnection): Promise<void> {
  if (kernel.connectionStatus === 'connected') {
    return;
  }
  await new Promise<void>(resolve => {
    const check = (_: unknown, status: Kernel.ConnectionStatus) => {
      if (status === 'connected') {
        kernel.connectionStatusChanged.disconnect(check);
        resolve();
      }
    };
    kernel.connectionStatusChanged.connect(check);
  });
}

/**
 * The panel's attribute that says whether its widget outputs are the restored kernel's:
 * "rebinding" until they are (the style dims them, since typing into one would reach no
 * kernel), then "current".
 */
export const WIDGETS_STATE_ATTRIBUTE = 'data-gpu-snapshot-widgets';

/**
 * Called by the controller once a notebook's session uses a restored kernel: show the
 * restored kernel's widgets in the notebook's widget outputs.
 */
export async function rebindWidgets(panel: NotebookPanel): Promise<void> {
  // Set before the first await, so the panel is marked before the restore's toast shows.
  panel.node.setAttribute(WIDGETS_STATE_ATTRIBUTE, 'rebinding');
  try {
    await rebind(panel);
  } finally {
    panel.node.setAttribute(WIDGETS_STATE_ATTRIBUTE, 'current');
  }
}

async function rebind(panel: NotebookPanel): Promise<void> {
  const renderers = widgetRenderers(panel);
  const kernel = panel.sessionContext.session?.kernel;
  if (!renderers.length || !kernel) {
    return;
  }
  const manager = await renderers[0]._manager!.promise;
  await connected(kernel);
  // Models of the kernel before (or of none): their comms cannot reach the restored one.
  for (const [id, pending] of Object.entries(manager._models)) {
    const model = await pending.catch(() => null);
    if (model?.comm?.jsServicesComm?._kernel !== kernel) {
      delete manager._models[id];
    }
  }
  await ownReloadSettled(manager);
  await manager.restoreWidgets(panel.context.model, {
    loadKernel: true,
    loadNotebook: false
  });
  await ownReloadSettled(manager);
  await requestStatesAgain(manager, kernel);
  // Outputs drawn before (an error, or a view of a forgotten model) are drawn afresh.
  for (const cell of panel.content.widgets) {
    const outputs = (cell.model as { outputs?: IOutputs }).outputs;
    for (let index = 0; outputs && index < outputs.length; index++) {
      const output = outputs.get(index);
      if (output.data[WIDGET_VIEW_MIME]) {
        outputs.set(index, output.toJSON());
      }
    }
  }
}

/** How long a reload the manager started itself may delay the rebinding. */
const OWN_RELOAD_WAIT_MS = 30_000;
const OWN_RELOAD_POLL_MS = 100;

/**
 * The manager reloads from the kernel by itself when the connection comes up. That reload
 * reads the states first and applies them when it ends, to models that exist by then too:
 * ending after our fresh states were asked for, it would put older ones back. On a busy
 * machine it can take seconds (the manager falls back to asking widget by widget after 4 s
 * without an answer). So wait until it has ended, before loading and before asking again.
 */
async function ownReloadSettled(manager: IWidgetManager): Promise<void> {
  const deadline = Date.now() + OWN_RELOAD_WAIT_MS;
  while (manager._kernelRestoreInProgress && Date.now() < deadline) {
    await new Promise(resolve => setTimeout(resolve, OWN_RELOAD_POLL_MS));
  }
}

/**
 * The manager reads every widget's state at once, then opens each widget's comm. The
 * restored kernel's code runs meanwhile (a widget's own thread may set a trait), and an
 * update sent in between reaches no handler and is lost; a widget sends a trait again only
 * when it changes, so the page would show the old value for good (a button left disabled).
 * Asking each restored widget for its state once more, now that its comm listens, closes
 * that gap; the answers arrive as ordinary updates.
 */
async function requestStatesAgain(
  manager: IWidgetManager,
  kernel: Kernel.IKernelConnection
): Promise<void> {
  for (const pending of Object.values(manager._models)) {
    const model = await pending.catch(() => null);
    if (model?.comm && model.comm.jsServicesComm?._kernel === kernel) {
      model.comm.send({ method: 'request_state' });
    }
  }
}

interface IOutputs {
  length: number;
  get(index: number): { data: Record<string, unknown>; toJSON(): unknown };
  set(index: number, value: unknown): void;
}
