/**
 * Status bar item for the current notebook: a snapshot or restore under way, else the
 * age of the kernel's last snapshot.
 */
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';
import type { SnapshotController } from './controller';
import { describeProgress, formatAge, jobFraction } from './format';
import { KernelWatch } from './watch';

const AGE_REFRESH_MS = 15000;

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
    this._timer = window.setInterval(() => this.refresh(), AGE_REFRESH_MS);
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
    window.clearInterval(this._timer);
    this._watch?.dispose();
    this._tracker.currentChanged.disconnect(this._onCurrentChanged, this);
    super.dispose();
  }

  private _describe(panel: NotebookPanel | null): { text: string; title: string } {
    const job = this._controller.activeJob(panel);
    if (job) {
      const fraction = jobFraction(job);
      const percent = fraction === undefined ? '' : ` ${Math.round(fraction * 100)}%`;
      const what = job.kind === 'save' ? 'Snapshot' : 'Restore';
      return { text: `${what}${percent}`, title: `${what}: ${describeProgress(job)}` };
    }
    const status = this._controller.entry(this._controller.kernelId(panel))?.status;
    if (!status) {
      return { text: '', title: '' };
    }
    const last = status.last_snapshot;
    if (last) {
      return {
        text: `Snapshot ${formatAge(last.created)}`,
        title: `Last snapshot of this kernel: '${last.name}'. Click to restore one.`
      };
    }
    if (status.ready) {
      return {
        text: 'No snapshot yet',
        title: 'This kernel can be snapshotted; it has no snapshot yet.'
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
  private _timer: number;
  private _watch: KernelWatch | null = null;
}
