/**
 * Status bar item for the current notebook: a snapshot, autosave or restore under way,
 * else the age of the kernel's last snapshot (for an autosave, with the pause it cost).
 */
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import type { TranslationBundle } from '@jupyterlab/translation';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';
import type { SnapshotController } from './controller';
import {
  describeHibernation,
  describeLastSnapshot,
  describeShutdownSave
} from './format';
import { KernelWatch } from './watch';

/** How often the current kernel's status is asked again (settings: statusRefreshSeconds). */
export const DEFAULT_REFRESH_SECONDS = 15;

export class SnapshotStatusItem extends Widget {
  constructor(
    private readonly _tracker: INotebookTracker,
    private readonly _controller: SnapshotController,
    onClick: () => void,
    private readonly _trans: TranslationBundle
  ) {
    super();
    this.addClass('jp-gpu-snapshot-status');
    this.node.addEventListener('click', onClick);
    _tracker.currentChanged.connect(this._onCurrentChanged, this);
    this._onCurrentChanged();
    // Ages move on, and a server that stopped must not go on reading "ready".
    this._poll = new Poll({
      auto: true,
      factory: () => this._recheck(),
      frequency: { interval: DEFAULT_REFRESH_SECONDS * 1000, backoff: false },
      name: 'jupyter-gpu-snapshot:status',
      standby: 'when-hidden'
    });
  }

  /** Called by the plugin when the setting changes. */
  setRefreshSeconds(seconds: number): void {
    const interval = seconds * 1000;
    this._poll.frequency = { interval, backoff: false, max: interval };
  }

  /** Whether the status bar should show the item at all. */
  get visible(): boolean {
    return this._text !== '';
  }

  refresh(): void {
    const panel = this._tracker.currentWidget;
    const { text, title } = this._describe(panel);
    this._text = text;
    this.node.textContent = text;
    this.node.title = title;
    this.toggleClass('jp-mod-running', this._controller.activeJob(panel) !== null);
    this.changed?.();
  }

  /** Set by the plugin: tells the status bar to re-check ``visible``. */
  changed: (() => void) | null = null;

  dispose(): void {
    this._poll.dispose();
    this._watch?.dispose();
    this._tracker.currentChanged.disconnect(this._onCurrentChanged, this);
    super.dispose();
  }

  private async _recheck(): Promise<void> {
    const kernelId = this._controller.polledKernel(this._tracker.currentWidget);
    if (kernelId) {
      await this._controller.refresh(kernelId);
    }
    this.refresh();
  }

  private _describe(panel: NotebookPanel | null): { text: string; title: string } {
    const trans = this._trans;
    if (!panel) {
      return { text: '', title: '' };
    }
    const job = this._controller.activeJob(panel);
    const autosave = this._controller.entry(this._controller.kernelId(panel))?.autosave;
    if (
      (job && job.kind === 'save' && job.reason === 'autosave') ||
      autosave?.autosaving
    ) {
      return {
        text: trans.__('Autosaving…'),
        title: job
          ? trans.__('Autosave: %1', this._controller.describeJob(job))
          : trans.__('An autosave of this kernel is under way')
      };
    }
    if (job && job.kind === 'save' && job.reason === 'hibernate') {
      return {
        text: trans.__('Hibernating…'),
        title: trans.__('Hibernating: %1', this._controller.describeJob(job))
      };
    }
    if (job && job.kind === 'wake') {
      const fraction = this._controller.progressOf(job);
      const percent = fraction === undefined ? null : Math.round(fraction * 100);
      return {
        text:
          percent === null
            ? trans.__('Waking the kernel…')
            : trans.__('Waking the kernel %1%%', percent),
        title: trans.__('Waking: %1', this._controller.describeJob(job))
      };
    }
    if (job) {
      const fraction = this._controller.progressOf(job);
      const percent = fraction === undefined ? null : Math.round(fraction * 100);
      const progress = this._controller.describeJob(job);
      if (job.kind === 'save') {
        return {
          text:
            percent === null ? trans.__('Snapshot') : trans.__('Snapshot %1%%', percent),
          title: trans.__('Snapshot: %1', progress)
        };
      }
      return {
        text: percent === null ? trans.__('Restore') : trans.__('Restore %1%%', percent),
        title: trans.__('Restore: %1', progress)
      };
    }
    const kernelId = this._controller.kernelId(panel);
    const entry = this._controller.entry(kernelId);
    const status = entry?.status;
    // Without a kernel (shut down) the item stays: it is the way back to a snapshot.
    if (!kernelId) {
      return {
        text: trans.__('Snapshots'),
        title: trans.__('No kernel is running. Click to restore one from a snapshot.')
      };
    }
    if (entry?.error) {
      return {
        text: trans.__('Snapshots unavailable'),
        title: trans.__('The server did not answer: %1', entry.error)
      };
    }
    if (!status) {
      return { text: '', title: '' };
    }
    const busy = panel.sessionContext.session?.kernel?.status === 'busy';
    const hibernation = describeHibernation(status.hibernation, trans, busy);
    if (hibernation) {
      return hibernation;
    }
    const last = describeLastSnapshot(status, autosave ?? null, trans);
    const shutdown = describeShutdownSave(status.shutdown_save ?? null, trans);
    return shutdown && last.text
      ? { text: last.text, title: `${last.title}\n${shutdown}` }
      : last;
  }

  private _onCurrentChanged(): void {
    this._watch?.dispose();
    const panel = this._tracker.currentWidget;
    this._watch = panel
      ? new KernelWatch(panel, this._controller, () => this.refresh())
      : null;
    this.refresh();
  }

  private _text = '';
  private _poll: Poll;
  private _watch: KernelWatch | null = null;
}
