/**
 * After a restart (or any time a notebook opens while the kernel it was saved from is
 * gone): offer to bring back the notebook's newest snapshot, whatever its reason
 * (autosave, shutdown, user), naming the notebook, its age and its reason. Offers for
 * several notebooks (a workspace reopening them all) merge into one notification that
 * names every one of them, however late each notebook's answer comes from the server.
 *
 * The notification is never updated in place: JupyterLab hands an update to a toast on
 * screen only once it is drawn, and one sent earlier re-created the toast under its old
 * id, which the toast library then ignored; the toast kept its first text and buttons while
 * the notification center showed the merged offer. Each change dismisses the offer and
 * shows it anew, so the toast and the center always hold the same offer.
 */
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
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

/** JupyterLab cuts a notification's message at this many characters. */
export const MESSAGE_LIMIT = 140;

interface IOffer {
  /** The notebook's panel; a closed one is replaced when the notebook opens again. */
  panel: NotebookPanel;
  snapshot: ISnapshotSummary;
}

function notebookName(path: string): string {
  return path.split('/').pop() || path;
}

/**
 * "an autosave, 3 min ago": short, since JupyterLab cuts a notification's message at
 * 140 characters.
 */
export function describeOffer(snapshot: ISnapshotSummary, trans = untranslated): string {
  const reasons: { [reason: string]: string } = {
    shutdown: trans.__('saved at shutdown'),
    autosave: trans.__('an autosave'),
    user: trans.__('saved by hand'),
    hibernate: trans.__('a hibernation')
  };
  const reason = reasons[snapshot.reason] ?? trans.__('saved (%1)', snapshot.reason);
  return trans.__('%1, %2', reason, formatAge(snapshot.created, undefined, trans));
}

/**
 * The offer's message for the snapshots of ``notebooks`` (paths to snapshots): each
 * notebook named with its snapshot's reason and age when that fits JupyterLab's limit,
 * else the names alone, else as many names as fit and how many more (Details lists all).
 */
export function describeOffers(
  notebooks: [string, ISnapshotSummary][],
  trans = untranslated
): string {
  if (notebooks.length === 1) {
    const [[path, snapshot]] = notebooks;
    return trans.__(
      'Restore the kernel of %1? Its newest snapshot: %2 (%3).',
      notebookName(path),
      describeOffer(snapshot, trans),
      formatBytes(snapshot.size_bytes, trans)
    );
  }
  const count = notebooks.length;
  const sentence = (list: string) =>
    trans._n(
      'Restore the kernel of %1 notebook? %2.',
      'Restore the kernels of %1 notebooks? %2.',
      count,
      list
    );
  const detailed = sentence(
    notebooks
      .map(([path, s]) => trans.__('%1: %2', notebookName(path), describeOffer(s, trans)))
      .join('; ')
  );
  if (detailed.length <= MESSAGE_LIMIT) {
    return detailed;
  }
  const names = notebooks.map(([path]) => notebookName(path));
  for (let shown = names.length; shown > 0; shown--) {
    const list =
      shown === names.length
        ? names.join(', ')
        : trans._n(
            '%2 and %1 more',
            '%2 and %1 more',
            names.length - shown,
            names.slice(0, shown).join(', ')
          );
    const text = sentence(list);
    if (text.length <= MESSAGE_LIMIT) {
      return text;
    }
  }
  return sentence(trans._n('%1 notebook', '%1 notebooks', count));
}

export class ShutdownOffer {
  /**
   * ``panelOf`` finds the open notebook at a path (a notebook closed and opened again is
   * another panel); without it, only the panel the offer was made to is restored into.
   */
  constructor(
    private readonly _controller: SnapshotController,
    private readonly _state: IStateDB | null = null,
    private readonly _trans: TranslationBundle = untranslated,
    private readonly _panelOf: (path: string) => NotebookPanel | null = () => null
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
      panel.isDisposed ||
      // The kernel it was taken of still runs: nothing was lost.
      running.has(snapshot.kernel?.kernel_id ?? '') ||
      // This notebook already runs a kernel restored from it.
      this._controller.originOf(this._controller.kernelId(panel)) === snapshot.id ||
      (await this._answered()).has(snapshot.id)
    ) {
      return;
    }
    const pending = this._pending.get(path);
    if (pending?.snapshot.id === snapshot.id && !pending.panel.isDisposed) {
      return; // offered already, to this very notebook
    }
    this._pending.set(path, { panel, snapshot });
    // A notebook closed before the answer leaves the offer; opened again, it comes back.
    panel.disposed.connect(this._onPanelClosed, this);
    this._show();
  }

  /** The notebooks the offer on screen names, by path, in the order they were offered. */
  get offered(): string[] {
    return [...this._pending.keys()];
  }

  private _onPanelClosed(panel: NotebookPanel): void {
    for (const [path, offer] of this._pending) {
      if (offer.panel === panel && !this._panelOf(path)) {
        this._pending.delete(path);
      }
    }
    this._show();
  }

  /** The one notification for all pending offers: the old one goes, the new one names all. */
  private _show(): void {
    if (this._toast !== null) {
      Notification.dismiss(this._toast);
      this._toast = null;
    }
    const offers = [...this._pending];
    if (!offers.length) {
      return;
    }
    const trans = this._trans;
    const single = offers.length === 1;
    const notebooks = offers.map(
      ([path, offer]) => [path, offer.snapshot] as [string, ISnapshotSummary]
    );
    const message = describeOffers(notebooks, trans);
    const shownAll = notebooks.every(([path]) => message.includes(notebookName(path)));
    this._toast = Notification.info(message, {
      autoClose: false,
      actions: [
        {
          label: single ? trans.__('Restore') : trans.__('Restore all'),
          caption: trans._n(
            "Restore the notebook's newest snapshot into it",
            "Restore each notebook's newest snapshot into it",
            offers.length
          ),
          displayType: 'accent',
          callback: () => void this._answer(true)
        },
        ...(shownAll
          ? []
          : [
              {
                label: trans.__('Details'),
                caption: trans.__('Which snapshot each notebook gets back'),
                callback: (event: Event) => {
                  event.preventDefault(); // the offer stays until answered
                  void this._details(notebooks);
                }
              }
            ]),
        {
          label: trans.__('Not now'),
          caption: trans.__('The snapshots stay in the restore dialog'),
          callback: () => void this._answer(false)
        }
      ]
    });
  }

  /** Every notebook of the offer with the snapshot it gets back. */
  private async _details(notebooks: [string, ISnapshotSummary][]): Promise<void> {
    const trans = this._trans;
    await showDialog({
      title: trans.__('Restore after the restart'),
      body: notebooks
        .map(([path, s]) =>
          trans.__(
            '%1: %2 (%3, %4)',
            path,
            s.name,
            describeOffer(s, trans),
            formatBytes(s.size_bytes, trans)
          )
        )
        .join('\n'),
      buttons: [Dialog.okButton({ label: trans.__('Close') })]
    });
  }

  /**
   * The user's answer for every notebook of the offer, restored one after the other into
   * the notebook as it is open now. A notebook closed meanwhile is neither restored nor
   * counted as answered: its offer comes again when it opens.
   */
  private async _answer(restore: boolean): Promise<void> {
    const offers = [...this._pending];
    this._pending.clear();
    this._show();
    const answered: string[] = [];
    const restores: [NotebookPanel, ISnapshotSummary][] = [];
    for (const [path, offer] of offers) {
      const panel = offer.panel.isDisposed ? this._panelOf(path) : offer.panel;
      if (!panel || panel.isDisposed) {
        continue;
      }
      panel.disposed.disconnect(this._onPanelClosed, this);
      answered.push(offer.snapshot.id);
      restores.push([panel, offer.snapshot]);
    }
    const marked = this._markAnswered(answered);
    if (restore) {
      // One after the other: each restore has its own notification and its own ports.
      for (const [panel, snapshot] of restores) {
        if (!panel.isDisposed) {
          await this._controller.restore(panel, snapshot);
        }
      }
    }
    await marked;
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
    if (!this._state || !ids.length) {
      return; // Without a state database the offer may come again, which is harmless.
    }
    const all = [...(await this._answered()), ...ids].slice(-ANSWERED_KEPT);
    await this._state.save(ANSWERED_KEY, all);
  }

  private _pending = new Map<string, IOffer>();
  private _toast: string | null = null;
}
