/**
 * The delete buttons of the restore dialog and of the sidebar ask for a second click: the
 * first click arms the button of that snapshot for a few seconds (it then reads as a
 * confirmation), a second click on it within that time goes ahead.
 */
import type { TranslationBundle } from '@jupyterlab/translation';
import * as React from 'react';
import type { ISnapshotSummary } from './api';

/** How long an armed button waits for its second click. */
export const CONFIRM_MS = 4000;

export class DeleteButtons {
  /** ``changed`` redraws the buttons: one was armed, or is no longer. */
  constructor(changed: () => void) {
    this._changed = changed;
  }

  /** The snapshot whose button waits for its second click, if any. */
  get armed(): string | null {
    return this._armed;
  }

  /** Whether this click on the button of ``id`` is the second; a first one arms it. */
  confirms(id: string): boolean {
    if (this._armed === id) {
      this._armed = null;
      return true;
    }
    this._armed = id;
    this._changed();
    window.setTimeout(() => {
      if (this._armed === id) {
        this._armed = null;
        this._changed();
      }
    }, CONFIRM_MS);
    return false;
  }

  /** The button of ``snapshot``; ``onClick`` asks ``confirms`` whether to delete. */
  render(
    snapshot: ISnapshotSummary,
    trans: TranslationBundle,
    onClick: (event: React.MouseEvent) => void
  ): JSX.Element {
    const armed = this._armed === snapshot.id;
    return (
      <button
        className={
          'jp-gpu-snapshot-delete jp-Button jp-mod-styled ' +
          (armed ? 'jp-mod-warn' : 'jp-mod-reject')
        }
        title={
          armed
            ? trans.__('Click again to delete for good')
            : trans.__('Delete %1', snapshot.name)
        }
        onClick={onClick}
      >
        {armed ? trans.__('Confirm delete') : trans.__('Delete')}
      </button>
    );
  }

  private readonly _changed: () => void;
  private _armed: string | null = null;
}
