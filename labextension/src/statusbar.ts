/**
 * Status bar item for the current notebook: a snapshot, autosave or restore under way,
 * else the age of the kernel's last snapshot (for an autosave, with the pause it cost).
 */
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';
import type { SnapshotController } from './controller';
import { formatAge, formatSeconds, jobFraction } from './format';
import { KernelWatch } from './watch';

/** How often the current kernel's status is asked again (settings: statusRefreshSeconds). */
export const DEFAULT_REFRESH_SECONDS = 15;

export class SnapshotStatusItem extends Widget {
  constructor(
    private readonly _tracker: INotebookTracker,
    private readonly _controller: SnapshotController,
    onClick: () => void
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
    const kernelId = this._controller.kernelId(this._tracker.currentWidget);
    if (kernelId) {
      await this._controller.refresh(kernelId);
    }
    this.refresh();
  }

  private _describe(panel: NotebookPanel | null): { text: string; title: string } {
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
        text: 'Autosaving…',
        title: job
          ? `Autosave: ${this._controller.describeJob(job)}`
          : 'An autosave of this kernel is under way'
      };
    }
    if (job) {
      const fraction = jobFraction(job);
      const percent = fraction === undefined ? '' : ` ${Math.round(fraction * 100)}%`;
      const what = job.kind === 'save' ? 'Snapshot' : 'Restore';
      return {
        text: `${what}${percent}`,
        title: `${what}: ${this._controller.describeJob(job)}`
      };
    }
    const kernelId = this._controller.kernelId(panel);
    const entry = this._controller.entry(kernelId);
    const status = entry?.status;
    // Without a kernel (shut down) the item stays: it is the way back to a snapshot.
    if (!kernelId) {
      return {
        text: 'Snapshots',
        title: 'No kernel is running. Click to restore one from a snapshot.'
      };
    }
    if (entry?.error) {
      return {
        text: 'Snapshots unavailable',
        title: `The server did not answer: ${entry.error}`
      };
    }
    if (!status) {
      return { text: '', title: '' };
    }
    const last = status.last_snapshot;
    const lastAutosave = autosave?.last_autosave ?? null;
    if (last && (last.reason === 'autosave' || last.id === lastAutosave?.snapshot_id)) {
      const pause =
        lastAutosave?.snapshot_id === last.id && lastAutosave.pause !== null
          ? ` (paused ${formatSeconds(lastAutosave.pause)})`
          : '';
      return {
        text: `Autosaved ${formatAge(last.created)}${pause}`,
        title:
          `Last snapshot of this kernel: the autosave '${last.name}'` +
          (pause
            ? `; the kernel paused ${formatSeconds(lastAutosave!.pause!)} for it`
            : '') +
          '. Click to restore one.'
      };
    }
    if (last) {
      return {
        text: `Snapshot ${formatAge(last.created)}`,
        title: `Last snapshot of this kernel: '${last.name}'. Click to restore one.`
      };
    }
    if (status.ready) {
      return {
        text: 'No snapshot yet',
        title:
          'This kernel can be snapshotted; it has no snapshot yet. Click to restore one.'
      };
    }
    return { text: '', title: '' };
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
