/**
 * The sidebar's "Timeline" section: the current notebook kernel's points, one per cell it
 * ran (the names the cell changed, what its copies hold), newest first, each with a way to
 * rewind the kernel to before that cell. Asked of the server again after each cell of the
 * notebook ends and after each rewind, and on the sidebar's interval while it is shown.
 */
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import type { TranslationBundle } from '@jupyterlab/translation';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';
import * as React from 'react';
import {
  SnapshotAPIError,
  type ITimeline,
  type ITimelinePoint,
  type SnapshotAPI
} from './api';
import type { SnapshotController } from './controller';
import { formatAge, formatBytes, formatTime } from './format';
import type { Rewinder } from './rewind';
import { untranslated } from './translation';

/** How many names of a point are shown before "and N more" (all are in the tooltip). */
export const NAMES_SHOWN = 6;

/** "x, y and 3 more": names as a point's line shows them. */
export function listNames(names: readonly string[], trans = untranslated): string {
  if (names.length <= NAMES_SHOWN) {
    return names.join(', ');
  }
  return trans.__(
    '%1 and %2 more',
    names.slice(0, NAMES_SHOWN).join(', '),
    names.length - NAMES_SHOWN
  );
}

/** "changed model, df; deleted tmp", or "no name changed". */
export function describePointNames(point: ITimelinePoint, trans = untranslated): string {
  const parts: string[] = [];
  if (point.changed?.length) {
    parts.push(trans.__('changed %1', listNames(point.changed, trans)));
  }
  if (point.deleted?.length) {
    parts.push(trans.__('deleted %1', listNames(point.deleted, trans)));
  }
  return parts.length ? parts.join('; ') : trans.__('no name changed');
}

/** "3 points, 1.2 MiB of 2.0 GiB; the 4 oldest dropped for the limit". */
export function describeTimeline(timeline: ITimeline, trans = untranslated): string {
  const text = trans._n(
    '%1 point, %2 of %3',
    '%1 points, %2 of %3',
    timeline.points.length,
    formatBytes(timeline.bytes, trans),
    formatBytes(timeline.limit_bytes, trans)
  );
  return timeline.dropped > 0
    ? trans._n(
        '%2; the oldest dropped for the limit',
        '%2; the %1 oldest dropped for the limit',
        timeline.dropped,
        text
      )
    : text;
}

/** Why the kernel cannot go back to before In [count] now; null when it can. */
export function rewindBlocked(
  timeline: ITimeline,
  count: number,
  trans = untranslated
): string | null {
  if (timeline.running) {
    return trans.__('A cell is running: wait for it or interrupt it, then rewind');
  }
  if (!timeline.rewindable.includes(count)) {
    return trans.__("The kernel's timeline no longer reaches before In [%1]", count);
  }
  return null;
}

/**
 * The current notebook kernel's timeline, as the server last gave it. Made by the sidebar,
 * which shows it; ``isShown`` says whether the sidebar is on screen (the poll sleeps when it
 * is not). ``executed`` is JupyterLab's NotebookActions.executed: a cell that ended.
 */
export class KernelTimeline {
  constructor(
    private readonly _api: SnapshotAPI,
    private readonly _controller: SnapshotController,
    private readonly _tracker: INotebookTracker,
    private readonly _rewinder: Rewinder,
    private readonly _executed: ISignal<unknown, { notebook: unknown }>,
    refreshSeconds: number,
    isShown: () => boolean
  ) {
    this._poll = new Poll({
      auto: true,
      factory: () => this.reload(),
      frequency: { interval: refreshSeconds * 1000, backoff: true, max: 300_000 },
      name: 'jupyter-gpu-snapshot:timeline',
      standby: () => !isShown() || 'when-hidden'
    });
    _tracker.currentChanged.connect(this._onCurrentChanged, this);
    _controller.changed.connect(this._onStatus, this);
    _executed.connect(this._onExecuted, this);
    _rewinder.rewound.connect(this._onRewound, this);
    this._onCurrentChanged();
  }

  /** Emitted when what the section shows changed. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** The kernel the timeline is of; null when there is none to show. */
  get kernelId(): string | null {
    return this._kernelId;
  }

  /** Null: no timeline to show (no kernel, one that is not snapshot-ready, older server). */
  get timeline(): ITimeline | null {
    return this._timeline;
  }

  /** Why the last request failed; the next one that works clears it. */
  get error(): string | null {
    return this._error;
  }

  /** Whether the timeline shown is that of ``panel``'s kernel. */
  isFor(panel: NotebookPanel | null): boolean {
    return this._kernelId !== null && this._controller.kernelId(panel) === this._kernelId;
  }

  get isDisposed(): boolean {
    return this._poll.isDisposed;
  }

  /** Ask again now (coalesced with a request already scheduled). */
  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  setRefreshSeconds(seconds: number): void {
    this._poll.frequency = { interval: seconds * 1000, backoff: true, max: 300_000 };
  }

  /** Called by the poll: asks the server for the current notebook kernel's timeline. */
  async reload(): Promise<void> {
    const asked = ++this._asked;
    const kernelId = this._controller.polledKernel(this._tracker.currentWidget);
    let timeline: ITimeline | null = null;
    let error: string | null = null;
    if (kernelId && this._answers(kernelId)) {
      try {
        timeline = await this._api.timeline(kernelId);
      } catch (reason) {
        // 404: an older server, or a kernel it no longer knows: nothing to show, and no
        // status news asks again (the interval does).
        if (reason instanceof SnapshotAPIError && reason.status === 404) {
          this._unanswered = kernelId;
        } else {
          error = (reason as Error).message;
        }
      }
    }
    if (asked !== this._asked || this.isDisposed) {
      return; // asked again meanwhile: that answer is the one to show
    }
    this._kernelId = timeline || error ? kernelId : null;
    this._timeline = timeline;
    this._error = error;
    this._changed.emit();
  }

  /**
   * Whether the kernel can answer for its timeline, as its last status says: a
   * snapshot-ready kernel whose process runs. Any other (a plain kernel, one asleep in
   * hibernation, one whose status is not known yet) is not asked: the server would wait
   * for an answer that does not come, or refuse. The status's arrival asks again.
   */
  private _answers(kernelId: string): boolean {
    const status = this._controller.entry(kernelId)?.status;
    const sleeping = status?.hibernation?.state;
    return status?.ready === true && (!sleeping || sleeping === 'requested');
  }

  /** Called by a point's button: rewind the notebook's kernel to before that cell. */
  async rewind(panel: NotebookPanel, count: number): Promise<void> {
    const kernelId = this._controller.kernelId(panel);
    if (kernelId) {
      await this._rewinder.rewind(panel, kernelId, count);
    }
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    this._watched?.sessionContext.kernelChanged.disconnect(this._onKernelChanged, this);
    this._tracker.currentChanged.disconnect(this._onCurrentChanged, this);
    this._controller.changed.disconnect(this._onStatus, this);
    this._executed.disconnect(this._onExecuted, this);
    this._rewinder.rewound.disconnect(this._onRewound, this);
    Signal.clearData(this);
  }

  private _onCurrentChanged(): void {
    this._watched?.sessionContext.kernelChanged.disconnect(this._onKernelChanged, this);
    this._watched = this._tracker.currentWidget;
    this._watched?.sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    void this._poll.refresh();
  }

  /** A restore or a restart gave the notebook another kernel: its timeline is another. */
  private _onKernelChanged(): void {
    void this._poll.refresh();
  }

  /**
   * The controller has news of a kernel: if the current one shows no timeline and can now
   * answer for it (its status came, it woke), ask. Statuses come often: a timeline already
   * shown is left to the other triggers.
   */
  private _onStatus(_: unknown, kernelId: string): void {
    const current = this._controller.polledKernel(this._tracker.currentWidget);
    if (
      kernelId === current &&
      kernelId !== this._unanswered &&
      this._timeline === null &&
      this._error === null &&
      this._answers(kernelId)
    ) {
      void this._poll.refresh();
    }
  }

  /** A cell ended: if it is the current notebook's, its kernel took a new point. */
  private _onExecuted(_: unknown, args: { notebook: unknown }): void {
    if (args.notebook === this._tracker.currentWidget?.content) {
      void this._poll.refresh();
    }
  }

  private _onRewound(_: unknown, kernelId: string): void {
    if (kernelId === this._kernelId) {
      void this._poll.refresh();
    }
  }

  private _kernelId: string | null = null;
  private _timeline: ITimeline | null = null;
  private _error: string | null = null;
  private _asked = 0;
  /** The last kernel the server answered 404 for. */
  private _unanswered: string | null = null;
  private _watched: NotebookPanel | null = null;
  private _changed = new Signal<this, void>(this);
  private _poll: Poll;
}

/** One point: its cell, whether it raised, the names it changed, its size and age. */
function TimelinePoint(props: {
  point: ITimelinePoint;
  blocked: string | null;
  onRewind: () => void;
  trans: TranslationBundle;
}): JSX.Element {
  const { point, blocked, trans } = props;
  const names = describePointNames(point, trans);
  const uncopied = point.uncopied ?? [];
  return (
    <li
      className="jp-gpu-snapshot-item jp-gpu-snapshot-point"
      data-count={point.count}
      data-ok={point.ok}
    >
      <div className="jp-gpu-snapshot-item-title">
        <span className="jp-gpu-snapshot-name">{trans.__('In [%1]', point.count)}</span>
        {!point.ok && (
          <span
            className="jp-gpu-snapshot-badge"
            title={trans.__('The cell raised: its changes up to the error are recorded')}
          >
            {trans.__('raised')}
          </span>
        )}
      </div>
      <div
        className="jp-gpu-snapshot-point-names"
        title={[...(point.changed ?? []), ...(point.deleted ?? [])].join(', ')}
      >
        {names}
      </div>
      <div className="jp-gpu-snapshot-item-facts">
        <span>{formatBytes(point.bytes, trans)}</span>
        <span title={formatTime(point.at)}>{formatAge(point.at, undefined, trans)}</span>
      </div>
      {uncopied.length > 0 && (
        <div className="jp-gpu-snapshot-warning jp-gpu-snapshot-point-uncopied">
          {trans.__(
            'Not copied: %1',
            uncopied.map(item => `${item.name} (${item.reason})`).join('; ')
          )}
        </div>
      )}
      <div className="jp-gpu-snapshot-item-actions">
        <button
          className="jp-Button jp-mod-styled jp-mod-reject jp-gpu-snapshot-rewind"
          disabled={blocked !== null}
          title={
            blocked ??
            trans.__(
              'Put the kernel back to how it was before In [%1], without running anything',
              point.count
            )
          }
          onClick={props.onRewind}
        >
          {trans.__('Rewind to before')}
        </button>
      </div>
    </li>
  );
}

/** The sidebar's Timeline section for ``model``'s kernel; null when there is none. */
export function TimelineSection(props: {
  model: KernelTimeline;
  panel: NotebookPanel | null;
  trans: TranslationBundle;
}): JSX.Element | null {
  const { model, panel, trans } = props;
  const timeline = model.timeline;
  if (!panel || !model.isFor(panel)) {
    return null;
  }
  if (!timeline && !model.error) {
    return null;
  }
  // Newest first: the cell just run is the one most often undone.
  const points = timeline ? [...timeline.points].reverse() : [];
  return (
    <section className="jp-gpu-snapshot-sidebar-section" data-section="timeline">
      <h3>{trans.__('Timeline')}</h3>
      {model.error && <p className="jp-gpu-snapshot-error">{model.error}</p>}
      {timeline?.on === false && (
        <p className="jp-gpu-snapshot-empty" data-timeline="off">
          {trans.__(
            'The timeline is off. Run %gpu_snapshot timeline on in a cell to keep a point per cell from then on.'
          )}
        </p>
      )}
      {timeline && timeline.on !== false && (
        <div
          className="jp-gpu-snapshot-timeline-use"
          title={trans.__(
            "The kernel's timeline: a point per cell, held in the kernel's memory up to its limit, the oldest going first"
          )}
        >
          {describeTimeline(timeline, trans)}
        </div>
      )}
      {timeline && timeline.on !== false && points.length === 0 && (
        <p className="jp-gpu-snapshot-empty">
          {trans.__('No point yet: each cell the kernel runs adds one.')}
        </p>
      )}
      {points.length > 0 && (
        <ul>
          {points.map(point => (
            <TimelinePoint
              key={`${point.count}:${point.at}`}
              point={point}
              blocked={rewindBlocked(timeline!, point.count, trans)}
              onRewind={() => void model.rewind(panel, point.count)}
              trans={trans}
            />
          ))}
        </ul>
      )}
    </section>
  );
}
