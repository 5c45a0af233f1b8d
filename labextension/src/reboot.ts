/**
 * After a server restart: when a notebook is opened and the server holds a snapshot that
 * was taken of its kernel at shutdown, offer to bring that kernel back. Offers for several
 * notebooks (a workspace reopening them all) merge into one notification that names them.
 */
import { Notification } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { IStateDB } from '@jupyterlab/statedb';
import type { ISnapshotSummary } from './api';
import type { SnapshotController } from './controller';
import { formatAge, formatBytes } from './format';

/** Snapshot ids the user has answered (restored or declined), in JupyterLab's state. */
const ANSWERED_KEY = 'jupyter-gpu-snapshot:shutdown-offers-answered';
const ANSWERED_KEPT = 200;

interface IOffer {
  panel: NotebookPanel;
  snapshot: ISnapshotSummary;
}

function notebookName(offer: IOffer): string {
  return offer.panel.context.localPath.split('/').pop() || offer.panel.context.localPath;
}

export class ShutdownOffer {
  constructor(
    private readonly _controller: SnapshotController,
    private readonly _state: IStateDB | null = null
  ) {}

  /** Called by the plugin for every notebook panel that opens. */
  async check(panel: NotebookPanel): Promise<void> {
    await panel.context.ready;
    const path = panel.context.path;
    let snapshots;
    try {
      snapshots = await this._controller.api.listSnapshots(path);
    } catch {
      return; // No server extension, or it is down: nothing to offer.
    }
    const done = await this._answered();
    const candidates = snapshots.filter(
      s => s.reason === 'shutdown' && s.notebook_path === path && !done.has(s.id)
    );
    const snapshot = candidates[candidates.length - 1];
    if (!snapshot || this._offered.has(snapshot.id) || panel.isDisposed) {
      return;
    }
    this._offered.add(snapshot.id);
    this._pending.push({ panel, snapshot });
    this._show();
  }

  /** One notification for all pending offers, updated in place as more arrive. */
  private _show(): void {
    const offers = this._pending.filter(o => !o.panel.isDisposed);
    if (!offers.length) {
      return;
    }
    const single = offers.length === 1;
    const message = single
      ? `Restore the kernel of ${notebookName(offers[0])} from before shutdown? It was ` +
        `saved when the server stopped, ${formatAge(offers[0].snapshot.created)} ` +
        `(${formatBytes(offers[0].snapshot.size_bytes)}).`
      : `Restore the kernels of ${offers.length} notebooks from before shutdown? ` +
        offers
          .map(o => `${notebookName(o)} (${formatBytes(o.snapshot.size_bytes)})`)
          .join(', ') +
        ' were saved when the server stopped.';
    const answer = (restore: boolean) => {
      this._pending = [];
      this._toast = null;
      void this._markAnswered(offers.map(o => o.snapshot.id));
      if (restore) {
        void this._restoreAll(offers);
      }
    };
    const options = {
      autoClose: false as const,
      actions: [
        {
          label: single ? 'Restore' : 'Restore all',
          displayType: 'accent' as const,
          callback: () => answer(true)
        },
        { label: 'Not now', callback: () => answer(false) }
      ]
    };
    if (this._toast && Notification.manager.has(this._toast)) {
      Notification.update({ id: this._toast, message, type: 'info', ...options });
    } else {
      this._toast = Notification.info(message, options);
    }
  }

  private async _restoreAll(offers: IOffer[]): Promise<void> {
    // One after the other: each restore has its own notification and its own ports.
    for (const { panel, snapshot } of offers) {
      if (!panel.isDisposed) {
        await this._controller.restore(panel, snapshot);
      }
    }
  }

  private async _answered(): Promise<Set<string>> {
    try {
      const ids = (await this._state?.fetch(ANSWERED_KEY)) as string[] | undefined;
      return new Set(Array.isArray(ids) ? ids : []);
    } catch {
      return new Set();
    }
  }

  private async _markAnswered(ids: string[]): Promise<void> {
    if (!this._state) {
      return; // Without a state database the offer may come again, which is harmless.
    }
    const all = [...(await this._answered()), ...ids].slice(-ANSWERED_KEPT);
    await this._state.save(ANSWERED_KEY, all);
  }

  private _offered = new Set<string>();
  private _pending: IOffer[] = [];
  private _toast: string | null = null;
}
