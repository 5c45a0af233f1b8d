/**
 * "Restore kernel from snapshot…": pick a snapshot (this notebook's first, then all),
 * or delete some.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { ReactWidget } from '@jupyterlab/ui-components';
import * as React from 'react';
import type { ISnapshotSummary, SnapshotAPI } from './api';
import { describeGpu, formatAge, formatBytes, formatTime } from './format';

const CONFIRM_MS = 4000;

export class SnapshotPicker
  extends ReactWidget
  implements Dialog.IBodyWidget<ISnapshotSummary | null>
{
  constructor(
    private readonly _api: SnapshotAPI,
    private readonly _notebookPath: string,
    private readonly _onDeleted: () => void = () => undefined
  ) {
    super();
    this.addClass('jp-gpu-snapshot-picker');
    void this.reload();
  }

  getValue(): ISnapshotSummary | null {
    return this._snapshots.find(s => s.id === this._selected) ?? null;
  }

  async reload(): Promise<void> {
    try {
      const all = await this._api.listSnapshots();
      // Newest first reads best in a picker; the API lists newest last.
      this._snapshots = [...all].sort((a, b) => b.created - a.created);
      this._error = null;
      if (!this._snapshots.some(s => s.id === this._selected)) {
        const own = this._snapshots.filter(s => s.notebook_path === this._notebookPath);
        this._selected = (own[0] ?? this._snapshots[0])?.id ?? null;
      }
    } catch (error) {
      this._error = (error as Error).message;
    }
    this._loaded = true;
    this.update();
  }

  render(): JSX.Element {
    if (!this._loaded) {
      return <p className="jp-gpu-snapshot-empty">Loading snapshots…</p>;
    }
    const own = this._snapshots.filter(s => s.notebook_path === this._notebookPath);
    const others = this._snapshots.filter(s => s.notebook_path !== this._notebookPath);
    return (
      <div>
        {this._error && <p className="jp-gpu-snapshot-error">{this._error}</p>}
        <h3>Snapshots of {this._notebookPath || 'this notebook'}</h3>
        {this._table(own, false, 'No snapshot of this notebook yet.')}
        <h3>All other snapshots</h3>
        {this._table(others, true, 'No other snapshots.')}
      </div>
    );
  }

  private _table(
    snapshots: ISnapshotSummary[],
    showNotebook: boolean,
    empty: string
  ): JSX.Element {
    if (!snapshots.length) {
      return <p className="jp-gpu-snapshot-empty">{empty}</p>;
    }
    return (
      <table className="jp-gpu-snapshot-table">
        <thead>
          <tr>
            <th />
            <th>Name</th>
            <th>Taken</th>
            <th>Size</th>
            <th>GPU</th>
            {showNotebook && <th>Notebook</th>}
            <th />
          </tr>
        </thead>
        <tbody>{snapshots.map(s => this._row(s, showNotebook))}</tbody>
      </table>
    );
  }

  private _row(s: ISnapshotSummary, showNotebook: boolean): JSX.Element {
    const selected = s.id === this._selected;
    const confirming = this._confirming === s.id;
    return (
      <tr
        key={s.id}
        className={selected ? 'jp-mod-selected' : ''}
        data-snapshot-id={s.id}
        data-snapshot-name={s.name}
        onClick={() => {
          this._selected = s.id;
          this.update();
        }}
      >
        <td>
          <input
            type="radio"
            name="jp-gpu-snapshot-choice"
            aria-label={`Restore ${s.name}`}
            checked={selected}
            onChange={() => {
              this._selected = s.id;
              this.update();
            }}
          />
        </td>
        <td className="jp-gpu-snapshot-name">
          {s.name}
          {s.reason === 'shutdown' && (
            <span className="jp-gpu-snapshot-badge" title="Saved when the server shut down">
              before shutdown
            </span>
          )}
        </td>
        <td title={formatTime(s.created)}>{formatAge(s.created)}</td>
        <td>{formatBytes(s.size_bytes)}</td>
        <td>{describeGpu(s)}</td>
        {showNotebook && <td>{s.notebook_path ?? '—'}</td>}
        <td>
          <button
            className={
              'jp-gpu-snapshot-delete jp-Button jp-mod-styled ' +
              (confirming ? 'jp-mod-warn' : 'jp-mod-reject')
            }
            title={confirming ? 'Click again to delete for good' : `Delete ${s.name}`}
            onClick={event => {
              event.stopPropagation();
              void this._delete(s);
            }}
          >
            {confirming ? 'Confirm delete' : 'Delete'}
          </button>
        </td>
      </tr>
    );
  }

  private async _delete(s: ISnapshotSummary): Promise<void> {
    if (this._confirming !== s.id) {
      this._confirming = s.id;
      this.update();
      window.setTimeout(() => {
        if (this._confirming === s.id) {
          this._confirming = null;
          this.update();
        }
      }, CONFIRM_MS);
      return;
    }
    this._confirming = null;
    try {
      await this._api.deleteSnapshot(s.id);
    } catch (error) {
      this._error = `Could not delete '${s.name}': ${(error as Error).message}`;
      this.update();
      return;
    }
    this._onDeleted();
    await this.reload();
  }

  private _snapshots: ISnapshotSummary[] = [];
  private _selected: string | null = null;
  private _confirming: string | null = null;
  private _error: string | null = null;
  private _loaded = false;
}

/** Shows the picker; resolves with the snapshot to restore, or null. */
export async function pickSnapshot(
  api: SnapshotAPI,
  notebookPath: string,
  onDeleted?: () => void
): Promise<ISnapshotSummary | null> {
  const result = await showDialog({
    title: 'Restore kernel from snapshot',
    body: new SnapshotPicker(api, notebookPath, onDeleted),
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Restore' })]
  });
  return result.button.accept ? result.value : null;
}
