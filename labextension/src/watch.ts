/**
 * Keeps the controller's view of one notebook's kernel fresh, and tells the widget
 * showing it when to redraw.
 */
import type { Kernel } from '@jupyterlab/services';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { SnapshotController } from './controller';

export class KernelWatch {
  constructor(
    private readonly _panel: NotebookPanel,
    private readonly _controller: SnapshotController,
    private readonly _onChange: () => void
  ) {
    const sessionContext = _panel.sessionContext;
    sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    sessionContext.sessionChanged.connect(this._onKernelChanged, this);
    sessionContext.statusChanged.connect(this._onStatus, this);
    _controller.changed.connect(this._onControllerChanged, this);
    void sessionContext.ready.then(() => this._onKernelChanged());
    this._onKernelChanged();
  }

  dispose(): void {
    const sessionContext = this._panel.sessionContext;
    sessionContext.kernelChanged.disconnect(this._onKernelChanged, this);
    sessionContext.sessionChanged.disconnect(this._onKernelChanged, this);
    sessionContext.statusChanged.disconnect(this._onStatus, this);
    this._controller.changed.disconnect(this._onControllerChanged, this);
  }

  private _onKernelChanged(): void {
    const kernelId = this._controller.kernelId(this._panel);
    if (kernelId !== this._kernelId) {
      this._kernelId = kernelId;
      if (kernelId) {
        void this._controller.refresh(kernelId);
      }
    }
    this._onChange();
  }

  private _onStatus(_: unknown, status: Kernel.Status): void {
    // A kernel that has just (re)started may only now be known to the server.
    const starting = ['starting', 'restarting', 'autorestarting', 'unknown'];
    if (status === 'idle' && starting.includes(this._lastStatus) && this._kernelId) {
      void this._controller.refresh(this._kernelId);
    }
    this._lastStatus = status;
    this._onChange();
  }

  private _onControllerChanged(_: unknown, kernelId: string): void {
    if (!kernelId || kernelId === this._kernelId) {
      this._onChange();
    }
  }

  private _kernelId: string | null = null;
  private _lastStatus: Kernel.Status = 'unknown';
}
