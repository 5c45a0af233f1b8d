/**
 * The notebook toolbar's "Snapshot kernel" button: one per notebook panel, created by
 * the toolbar registry for the item that schema/plugin.json declares.
 */
import type { NotebookPanel } from '@jupyterlab/notebook';
import { ReactWidget, ToolbarButtonComponent } from '@jupyterlab/ui-components';
import * as React from 'react';
import type { SnapshotController } from './controller';
import { snapshotIcon } from './icons';
import { KernelWatch } from './watch';

export class SnapshotButton extends ReactWidget {
  constructor(
    private readonly _panel: NotebookPanel,
    private readonly _controller: SnapshotController
  ) {
    super();
    this.addClass('jp-gpu-snapshot-button');
    this._watch = new KernelWatch(_panel, _controller, () => this.update());
  }

  render(): JSX.Element {
    const { enabled, reason } = this._controller.saveAvailability(this._panel);
    const running = this._controller.activeJob(this._panel) !== null;
    this.node.dataset.state = running ? 'running' : enabled ? 'ready' : 'disabled';
    return (
      <ToolbarButtonComponent
        icon={snapshotIcon}
        label="Snapshot"
        tooltip={reason}
        disabledTooltip={reason}
        enabled={enabled}
        pressed={running}
        onClick={() => void this._controller.save(this._panel)}
      />
    );
  }

  dispose(): void {
    this._watch.dispose();
    super.dispose();
  }

  private _watch: KernelWatch;
}
