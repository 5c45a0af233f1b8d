/**
 * The notebook toolbar's "Snapshot" button: one per notebook panel, created by the toolbar
 * registry for the item that schema/plugin.json declares. Shift-click asks for a name.
 */
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { TranslationBundle } from '@jupyterlab/translation';
import { ReactWidget, ToolbarButtonComponent } from '@jupyterlab/ui-components';
import * as React from 'react';
import type { SnapshotController } from './controller';
import { snapshotIcon } from './icons';
import { KernelWatch } from './watch';

export class SnapshotButton extends ReactWidget {
  constructor(
    private readonly _panel: NotebookPanel,
    private readonly _controller: SnapshotController,
    private readonly _saveNamed: () => void,
    private readonly _trans: TranslationBundle
  ) {
    super();
    this.addClass('jp-gpu-snapshot-button');
    this._watch = new KernelWatch(_panel, _controller, () => this.update());
  }

  render(): JSX.Element {
    const { enabled, reason } = this._controller.saveAvailability(this._panel);
    const running = this._controller.activeJob(this._panel) !== null;
    this.node.dataset.state = running ? 'running' : enabled ? 'ready' : 'disabled';
    // A greyed-out button that still answers a click: it explains why it cannot save
    // (a disabled <button> gets no clicks at all).
    return (
      <ToolbarButtonComponent
        icon={snapshotIcon}
        label={this._trans.__('Snapshot')}
        className={enabled ? '' : 'jp-gpu-snapshot-unavailable'}
        tooltip={enabled ? this._trans.__('%1 (Shift-click to name it)', reason) : reason}
        enabled={!running}
        pressed={running}
        onClick={event => {
          if (!enabled) {
            this._controller.explainUnavailable(this._panel);
          } else if ((event as React.MouseEvent | undefined)?.shiftKey) {
            this._saveNamed();
          } else {
            void this._controller.save(this._panel);
          }
        }}
      />
    );
  }

  dispose(): void {
    this._watch.dispose();
    super.dispose();
  }

  private _watch: KernelWatch;
}
