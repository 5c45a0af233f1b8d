/**
 * "Restore Kernel from Snapshot…": pick a snapshot (this notebook's first, then all),
 * or delete some. A snapshot that kept more than its image (a portable copy, its cells)
 * can also be restored into a fresh kernel from what it kept.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import type { TranslationBundle } from '@jupyterlab/translation';
import { ReactWidget } from '@jupyterlab/ui-components';
import * as React from 'react';
import type { FallbackMode, ISnapshotSummary, SnapshotAPI } from './api';
import { DeleteButtons } from './confirm';
import { FallbackOfferBadge, fallbackLabel, offeredFallbacks } from './fallback';
import {
  describeGpu,
  describeLocation,
  formatAge,
  formatSnapshotSize,
  formatTime,
  reasonBadge
} from './format';
import { type IRunningKernel, describeRefusal, heldByRunningKernel } from './remedy';
import { untranslated } from './translation';

export type { IRunningKernel };

/**
 * The dialog's answer: the snapshot, how to restore it (null: its image), and whether
 * the notebook's running kernel holds its ports (restoring it replaces that kernel).
 */
export interface IPicked {
  snapshot: ISnapshotSummary;
  fallback: FallbackMode | null;
  held: boolean;
  /** What the dialog listed, for a later look at the kernel's line of snapshots. */
  listing: ISnapshotSummary[];
}

export class SnapshotPicker
  extends ReactWidget
  implements Dialog.IBodyWidget<IPicked | null>
{
  constructor(
    private readonly _api: SnapshotAPI,
    private readonly _notebookPath: string,
    private readonly _onDeleted: () => void = () => undefined,
    private readonly _running: IRunningKernel = { kernelId: null, originId: null },
    private readonly _trans: TranslationBundle = untranslated
  ) {
    super();
    this.addClass('jp-gpu-snapshot-picker');
    // Focusable, so that Escape and Enter reach the dialog after a row's button is gone.
    this.node.tabIndex = -1;
    this.node.addEventListener('keydown', this._onKeyDown);
    void this.reload();
  }

  getValue(): IPicked | null {
    const snapshot = this.selected();
    if (!snapshot) {
      return null;
    }
    const offered = offeredFallbacks(snapshot.fallback);
    const fallback =
      this._fallback && offered.includes(this._fallback) ? this._fallback : null;
    return {
      snapshot,
      fallback,
      held: this.heldByRunningKernel(snapshot),
      listing: this._snapshots
    };
  }

  /** The selected snapshot, if any. */
  selected(): ISnapshotSummary | null {
    return this._snapshots.find(s => s.id === this._selected) ?? null;
  }

  /** Whether the running kernel holds this snapshot's ports (``remedy.heldByRunningKernel``). */
  heldByRunningKernel(s: ISnapshotSummary): boolean {
    return heldByRunningKernel(s, this._running, this._snapshots);
  }

  /**
   * This notebook's snapshots: those of its path, and those the running kernel holds
   * the ports of (its own, whatever path they were saved under).
   */
  private _isOwn(s: ISnapshotSummary): boolean {
    return s.notebook_path === this._notebookPath || this.heldByRunningKernel(s);
  }

  async reload(): Promise<void> {
    try {
      const all = await this._api.listSnapshots();
      // Newest first reads best in a picker; the API lists newest last.
      this._snapshots = [...all].sort((a, b) => b.created - a.created);
      this._error = null;
      if (!this._snapshots.some(s => s.id === this._selected)) {
        // This notebook's newest that its running kernel does not hold: restoring it
        // replaces nothing the user did. Another notebook's is never picked for them.
        const free = this._snapshots.filter(
          s => this._isOwn(s) && !this.heldByRunningKernel(s)
        );
        this._selected = free[0]?.id ?? null;
      }
    } catch (error) {
      this._error = (error as Error).message;
    }
    this._loaded = true;
    this.update();
  }

  render(): JSX.Element {
    const trans = this._trans;
    if (!this._loaded) {
      // The same focusable box as the list that follows: the dialog focuses it at once.
      return (
        <div className="jp-gpu-snapshot-list" tabIndex={-1}>
          <p className="jp-gpu-snapshot-empty">{trans.__('Loading snapshots…')}</p>
        </div>
      );
    }
    const own = this._snapshots.filter(s => this._isOwn(s));
    const others = this._snapshots.filter(s => !this._isOwn(s));
    // One table, two sections: the columns of both line up.
    return (
      <div className="jp-gpu-snapshot-list" tabIndex={-1}>
        {this._error && <p className="jp-gpu-snapshot-error">{this._error}</p>}

        <table className="jp-gpu-snapshot-table">
          <thead>
            <tr>
              <th />
              <th>{trans.__('Name')}</th>
              <th>{trans.__('Taken')}</th>
              <th>{trans.__('Size')}</th>
              <th>{trans.__('GPU')}</th>
              <th>{trans.__('Notebook')}</th>
              <th />
            </tr>
          </thead>
          {this._section(
            this._notebookPath
              ? trans.__('Snapshots of %1', this._notebookPath)
              : trans.__('Snapshots of this notebook'),
            own,
            trans.__('No snapshot of this notebook yet.')
          )}
          {this._section(
            trans.__('All other snapshots'),
            others,
            trans.__('No other snapshots.')
          )}
        </table>
        {this._howToRestore()}
        {/* Nothing selected: the dialog's own check keeps its Restore button disabled. */}
        <input
          className="jp-gpu-snapshot-chosen"
          hidden
          required
          tabIndex={-1}
          aria-hidden="true"
          value={this._selected ?? ''}
          onChange={() => undefined}
          ref={node => node && this._askDialogToCheck(node)}
        />
      </div>
    );
  }

  /**
   * For a selected snapshot that kept more than its image: restore the image (as it
   * was), or start a fresh kernel from what it kept, e.g. where its image is refused.
   */
  private _howToRestore(): JSX.Element | null {
    const trans = this._trans;
    const snapshot = this.selected();
    const offered = offeredFallbacks(snapshot?.fallback);
    if (!snapshot || !offered.length) {
      return null;
    }
    const value =
      this._fallback && offered.includes(this._fallback) ? this._fallback : '';
    return (
      <label className="jp-gpu-snapshot-restore-how">
        {trans.__('Restore')}{' '}
        <select
          className="jp-gpu-snapshot-restore-mode"
          aria-label={trans.__('How to restore %1', snapshot.name)}
          value={value}
          onChange={event => {
            this._fallback = (event.target.value as FallbackMode) || null;
            this.update();
          }}
        >
          <option value="">{trans.__('its process image, as it was')}</option>
          {offered.map(mode => (
            <option key={mode} value={mode}>
              {trans.__('into a fresh kernel: %1', fallbackLabel(mode, trans))}
            </option>
          ))}
        </select>
      </label>
    );
  }

  private _section(
    title: string,
    snapshots: ISnapshotSummary[],
    empty: string
  ): JSX.Element {
    return (
      <tbody>
        <tr className="jp-gpu-snapshot-section">
          <th colSpan={7}>{title}</th>
        </tr>
        {snapshots.length ? (
          snapshots.map(s => this._row(s))
        ) : (
          <tr>
            <td colSpan={7} className="jp-gpu-snapshot-empty">
              {empty}
            </td>
          </tr>
        )}
      </tbody>
    );
  }

  private _row(s: ISnapshotSummary): JSX.Element {
    const trans = this._trans;
    const location = describeLocation(s, trans);
    const selected = s.id === this._selected;
    const held = this.heldByRunningKernel(s);
    const origin = s.id === this._running.originId;
    return (
      <tr
        key={s.id}
        className={selected ? 'jp-mod-selected' : ''}
        data-snapshot-id={s.id}
        data-snapshot-name={s.name}
        onClick={() => this._select(s.id)}
      >
        <td>
          <input
            type="radio"
            name="jp-gpu-snapshot-choice"
            aria-label={trans.__('Restore %1', s.name)}
            checked={selected}
            onChange={() => this._select(s.id)}
          />
        </td>
        <td className="jp-gpu-snapshot-name">
          {s.name}
          {reasonBadge(s.reason, trans) && (
            <span
              className="jp-gpu-snapshot-badge"
              data-reason={s.reason}
              title={reasonBadge(s.reason, trans)?.title}
            >
              {reasonBadge(s.reason, trans)?.text}
            </span>
          )}
          {location && (
            <span
              className="jp-gpu-snapshot-badge jp-gpu-snapshot-location"
              data-location={s.location}
              title={trans.__('Where the snapshot is kept')}
            >
              {location}
            </span>
          )}
          {held && (
            <span
              className="jp-gpu-snapshot-badge jp-gpu-snapshot-origin"
              title={trans.__(
                "The notebook's running kernel holds this snapshot's ports: restoring it shuts that kernel down first"
              )}
            >
              {origin ? trans.__("this kernel's origin") : trans.__('of this kernel')}
            </span>
          )}
          <FallbackOfferBadge snapshot={s} trans={trans} />
        </td>
        <td title={formatTime(s.created)}>{formatAge(s.created, undefined, trans)}</td>
        <td>{formatSnapshotSize(s, trans)}</td>
        <td>{describeGpu(s, trans)}</td>
        <td className="jp-gpu-snapshot-path" title={s.notebook_path ?? ''}>
          {s.notebook_path ?? '—'}
        </td>
        <td>
          {this._deleteButtons.render(s, trans, event => {
            event.stopPropagation();
            void this._delete(s);
          })}
        </td>
      </tr>
    );
  }

  /** The rows in the order they show: this notebook's, then the others. */
  private _ordered(): ISnapshotSummary[] {
    const own = this._snapshots.filter(s => s.notebook_path === this._notebookPath);
    const others = this._snapshots.filter(s => s.notebook_path !== this._notebookPath);
    return [...own, ...others];
  }

  private _select(id: string): void {
    if (id !== this._selected) {
      this._fallback = null; // a way chosen for one snapshot is no choice for another
    }
    this._selected = id;
    this.update();
  }

  /**
   * Once a drawing is on the page (React hands the hidden field's ref over then): the
   * dialog checks its inputs on an input event, and disables its Restore button while
   * one is invalid (the hidden one is, with nothing selected).
   */
  private _askDialogToCheck(node: HTMLInputElement): void {
    queueMicrotask(() => node.dispatchEvent(new Event('input', { bubbles: true })));
  }

  private _onKeyDown = (event: KeyboardEvent): void => {
    if (event.key !== 'ArrowDown' && event.key !== 'ArrowUp') {
      return;
    }
    if (event.target instanceof HTMLSelectElement) {
      return; // the arrows pick how to restore, not another snapshot
    }
    const rows = this._ordered();
    if (!rows.length) {
      return;
    }
    event.preventDefault();
    const at = rows.findIndex(s => s.id === this._selected);
    const step = event.key === 'ArrowDown' ? 1 : -1;
    const next = at < 0 ? 0 : Math.min(rows.length - 1, Math.max(0, at + step));
    this._select(rows[next].id);
    this.node
      .querySelector(`tr[data-snapshot-id="${CSS.escape(rows[next].id)}"]`)
      ?.scrollIntoView({ block: 'nearest' });
  };

  private async _delete(s: ISnapshotSummary): Promise<void> {
    if (!this._deleteButtons.confirms(s.id)) {
      return;
    }
    try {
      await this._api.deleteSnapshot(s.id);
    } catch (error) {
      this._error = this._trans.__(
        "Could not delete '%1': %2",
        s.name,
        describeRefusal(error, this._trans)
      );
      this.update();
      return;
    }
    this._onDeleted();
    await this.reload();
    // The clicked button is gone with its row: keep the keyboard in the dialog.
    this.node.focus();
  }

  private _snapshots: ISnapshotSummary[] = [];
  private _selected: string | null = null;
  /** How the selected snapshot is to be restored, when it offers a choice. */
  private _fallback: FallbackMode | null = null;
  private readonly _deleteButtons = new DeleteButtons(() => this.update());
  private _error: string | null = null;
  private _loaded = false;
}

/** Shows the picker; resolves with the snapshot to restore and how, or null. */
export async function pickSnapshot(
  api: SnapshotAPI,
  notebookPath: string,
  onDeleted?: () => void,
  running?: IRunningKernel,
  trans: TranslationBundle = untranslated
): Promise<IPicked | null> {
  const result = await showDialog({
    title: trans.__('Restore kernel from snapshot'),
    body: new SnapshotPicker(api, notebookPath, onDeleted, running, trans),
    // The list takes the keys (arrows, Enter, Escape), whether Restore is enabled or not.
    focusNodeSelector: '.jp-gpu-snapshot-list',
    // JupyterLab words the default Cancel in its own domain.
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: trans.__('Restore') })]
  });
  return result.button.accept ? result.value : null;
}
