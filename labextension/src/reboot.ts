/**
 * After a server restart: when a notebook is opened and the server holds a snapshot that
 * was taken of its kernel at shutdown, offer to bring that kernel back.
 */
import { Notification } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { SnapshotController } from './controller';
import { formatAge, formatBytes } from './format';

const ANSWERED_KEY = 'jupyter-gpu-snapshot:shutdown-offers-answered';

/** Snapshot ids the user has answered (restored or declined), kept in the browser. */
function answered(): Set<string> {
  try {
    return new Set(JSON.parse(window.localStorage.getItem(ANSWERED_KEY) ?? '[]'));
  } catch {
    return new Set();
  }
}

function markAnswered(id: string): void {
  const ids = [...answered(), id].slice(-200);
  try {
    window.localStorage.setItem(ANSWERED_KEY, JSON.stringify(ids));
  } catch {
    // Private browsing: the offer may come again, which is harmless.
  }
}

export class ShutdownOffer {
  constructor(private readonly _controller: SnapshotController) {}

  /** Called for every notebook panel that opens. */
  async check(panel: NotebookPanel): Promise<void> {
    await panel.context.ready;
    const path = panel.context.path;
    let snapshots;
    try {
      snapshots = await this._controller.api.listSnapshots(path);
    } catch {
      return; // No server extension, or it is down: nothing to offer.
    }
    const done = answered();
    const candidates = snapshots.filter(
      s => s.reason === 'shutdown' && s.notebook_path === path && !done.has(s.id)
    );
    const snapshot = candidates[candidates.length - 1];
    if (!snapshot || this._offered.has(snapshot.id) || panel.isDisposed) {
      return;
    }
    this._offered.add(snapshot.id);
    Notification.info(
      `Restore the kernel from before shutdown? It was saved when the server stopped, ` +
        `${formatAge(snapshot.created)} (${formatBytes(snapshot.size_bytes)}).`,
      {
        autoClose: false,
        actions: [
          {
            label: 'Restore',
            displayType: 'accent',
            callback: () => {
              markAnswered(snapshot.id);
              if (!panel.isDisposed) {
                void this._controller.restore(panel, snapshot);
              }
            }
          },
          {
            label: 'Not now',
            callback: () => markAnswered(snapshot.id)
          }
        ]
      }
    );
  }

  private _offered = new Set<string>();
}
