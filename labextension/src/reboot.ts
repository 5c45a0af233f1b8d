/**
 * After a restart (or any time a notebook opens while the kernel it was saved from is
 * gone): offer to bring back the notebook's newest snapshot, whatever its reason
 * (autosave, shutdown, user), naming the notebook, its age and its reason. Offers for
 * several notebooks (a workspace reopening them all) merge into one notification.
 */
import { Notification } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import { KernelAPI } from '@jupyterlab/services';
import type { IStateDB } from '@jupyterlab/statedb';
import type { TranslationBundle } from '@jupyterlab/translation';
import type { ISnapshotSummary } from './api';
import type { SnapshotController } from './controller';
import { formatAge, formatBytes } from './format';
import { untranslated } from './translation';

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

/**
 * "an autosave, 3 min ago": short, since JupyterLab cuts a notification's message at
 * 140 characters.
 */
export function describeOffer(snapshot: ISnapshotSummary, trans = untranslated): string {
  const reasons: { [reason: string]: string } = {
    shutdown: trans.__('saved at shutdown'),
    autosave: trans.__('an autosave'),
    user: trans.__('saved by hand')
  };
  const reason = reasons[snapshot.reason] ?? trans.__('saved (%1)', snapshot.reason);
  return trans.__('%1, %2', reason, formatAge(snapshot.created, undefined, trans));
}

export class ShutdownOffer {
  constructor(
    private readonly _controller: SnapshotController,
    private readonly _state: IStateDB | null = null,
    private readonly _trans: TranslationBundle = untranslated
  ) {}

  /** Called by the plugin for every notebook panel that opens. */
  async check(panel: NotebookPanel): Promise<void> {
    await panel.context.ready;
    const path = panel.context.path;
    let snapshot: ISnapshotSummary | undefined;
    let running: Set<string>;
    try {
      // The server picks the newest of this notebook (openapi.yaml, latest=true).
      [snapshot] = await this._controller.api.latestSnapshots(path);
      running = new Set((await KernelAPI.listRunning()).map(k => k.id));
    } catch {
      return; // No server extension, or it is down: nothing to offer.
    }
    if (
      !snapshot ||
      snapshot.notebook_path !== path ||
      this._offered.has(snapshot.id) ||
      panel.isDisposed ||
      // The kernel it was taken of still runs: nothing was lost.
      running.has(snapshot.kernel?.kernel_id ?? '') ||
      // This notebook already runs a kernel restored from it.
      this._controller.originOf(this._controller.kernelId(panel)) === snapshot.id ||
      (await this._answered()).has(snapshot.id)
    ) {
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
    const trans = this._trans;
    const single = offers.length === 1;
    const message = single
      ? trans.__(
          'Restore the kernel of %1? Its newest snapshot: %2 (%3).',
          notebookName(offers[0]),
          describeOffer(offers[0].snapshot, trans),
          formatBytes(offers[0].snapshot.size_bytes, trans)
        )
      : trans._n(
          'Restore the kernel of %1 notebook? %2.',
          'Restore the kernels of %1 notebooks? %2.',
          offers.length,
          offers
            .map(o =>
              trans.__('%1: %2', notebookName(o), describeOffer(o.snapshot, trans))
            )
            .join('; ')
        );
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
          label: single ? trans.__('Restore') : trans.__('Restore all'),
          displayType: 'accent' as const,
          callback: () => answer(true)
        },
        { label: trans.__('Not now'), callback: () => answer(false) }
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
