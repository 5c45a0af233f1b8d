/**
 * Rewind: put a notebook's kernel back to how it was before one of its cells, from the
 * kernel's timeline (a point per cell), without re-running anything. Asked from a cell's
 * context menu or from the sidebar's timeline; the server's report says what came back,
 * what could not and why, and what no rewind undoes; the cells whose effects are gone are
 * marked in the notebook.
 */
import { Notification } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { TranslationBundle } from '@jupyterlab/translation';
import { ISignal, Signal } from '@lumino/signaling';
import * as React from 'react';
import { SnapshotAPIError, type IRewindReport, type SnapshotAPI } from './api';
import { shortError, SUCCESS_CLOSE_MS } from './controller';
import { lines, namedReasons, ReportSection, showReport } from './report';
import { untranslated } from './translation';
import { markUndone, type ICellLike } from './undone';

/** The server's events of rewinds made (server/event_schemas/rewind-v1.yaml), any version. */
export const REWIND_EVENT_PREFIX =
  'https://events.jupyter.org/jupyter_gpu_snapshot/rewind/';

/** Whether a rewind to before a cell can be asked, and why (not), for the menu's tooltip. */
export interface IRewindAvailability {
  enabled: boolean;
  reason: string;
  /** The cell's execution count: the rewind goes to before it. */
  count: number | null;
}

/**
 * Whether the kernel can be asked to go back to before ``cell``: a code cell that ran (it
 * has an execution count), in a notebook whose kernel runs. Whether the kernel's timeline
 * still reaches that far, the kernel says (RewindOutOfRange names the cells it can).
 */
export function rewindAvailability(
  kernelId: string | null,
  cell: ICellLike | null,
  trans = untranslated
): IRewindAvailability {
  if (!kernelId) {
    return {
      enabled: false,
      reason: trans.__('No kernel is running in this notebook'),
      count: null
    };
  }
  const count = cell?.model.type === 'code' ? cell.model.executionCount : null;
  if (typeof count !== 'number') {
    return {
      enabled: false,
      reason: trans.__('Only a code cell that ran can be rewound to before'),
      count: null
    };
  }
  return {
    enabled: true,
    reason: trans.__(
      'Put the kernel back to how it was before In [%1], without running anything',
      count
    ),
    count
  };
}

/** "In [5]", "In [5] and In [6]", "In [5] to In [7]" (the counts of a report, sorted). */
export function describeCounts(counts: readonly number[], trans = untranslated): string {
  const sorted = [...counts].sort((a, b) => a - b);
  if (sorted.length === 0) {
    return trans.__('no cell');
  }
  const cell = (count: number) => trans.__('In [%1]', count);
  if (sorted.length === 1) {
    return cell(sorted[0]);
  }
  if (sorted.length === 2) {
    return trans.__('%1 and %2', cell(sorted[0]), cell(sorted[1]));
  }
  return trans.__('%1 to %2', cell(sorted[0]), cell(sorted[sorted.length - 1]));
}

/**
 * The report in a line, for the notification: "Kernel rewound to before In [2]: In [2]
 * undone; 1 name restored, 1 removed, 1 could not come back".
 */
export function summarizeRewind(report: IRewindReport, trans = untranslated): string {
  const restored = report.restored?.length ?? 0;
  const removed = report.removed?.length ?? 0;
  const missing = report.not_restored?.length ?? 0;
  const names = [trans._n('%1 name restored', '%1 names restored', restored)];
  if (removed) {
    names.push(trans.__('%1 removed', removed));
  }
  if (missing) {
    names.push(trans.__('%1 could not come back', missing));
  }
  return trans.__(
    'Kernel rewound to before In [%1]: %2 undone; %3',
    report.before,
    describeCounts(report.undone ?? [], trans),
    names.join(', ')
  );
}

/**
 * Why a rewind was refused or failed, in one line: the kernel runs a cell (KernelBusy), the
 * timeline does not reach that cell (the server names those it does), or what failed.
 * Branches on the server's error code, never on its text.
 */
export function describeRewindError(error: unknown, trans = untranslated): string {
  if (!(error instanceof SnapshotAPIError)) {
    return (error as Error).message;
  }
  if (error.error?.code === 'kernel_busy') {
    return trans.__('a cell is running: wait for it or interrupt it, then rewind');
  }
  return error.error ? shortError(error.error, trans) : error.message;
}

/** The report's body: the cells undone, what came back, what did not and why, caveats. */
export function RewindReport(props: {
  report: IRewindReport;
  trans: TranslationBundle;
}): JSX.Element {
  const { report, trans } = props;
  const restored = report.restored ?? [];
  const removed = report.removed ?? [];
  const missing = report.not_restored ?? [];
  const caveats = report.caveats ?? [];
  const names = (list: string[]) => (
    <ul className="jp-gpu-snapshot-report-names">
      {list.map(name => (
        <li key={name} data-name={name}>
          <code>{name}</code>
        </li>
      ))}
    </ul>
  );
  return (
    <div className="jp-gpu-snapshot-report" data-before={report.before}>
      <p className="jp-gpu-snapshot-report-summary">
        {trans.__(
          'The kernel is as it was before In [%1]. The effects of %2 are gone.',
          report.before,
          describeCounts(report.undone ?? [], trans)
        )}
      </p>
      {restored.length > 0 && (
        <section data-section="restored">
          <h3>{trans.__('Came back as they were')}</h3>
          {names(restored)}
        </section>
      )}
      {removed.length > 0 && (
        <section data-section="removed">
          <h3>{trans.__('Removed (they did not exist then)')}</h3>
          {names(removed)}
        </section>
      )}
      <ReportSection
        section="not-restored"
        title={trans.__('Could not come back')}
        items={namedReasons(missing)}
      />
      <ReportSection
        section="caveats"
        title={trans.__('Not undone by a rewind')}
        items={lines(caveats)}
      />
    </div>
  );
}

/** Shows a rewind's whole report; resolves once closed. */
export async function showRewindReport(
  report: IRewindReport,
  trans: TranslationBundle = untranslated
): Promise<void> {
  await showReport(
    trans.__('Rewound to before In [%1]', report.before),
    <RewindReport report={report} trans={trans} />,
    trans
  );
}

/**
 * Asks the server for rewinds and shows their outcome. Made by the plugin; the cell
 * context menu's command and the sidebar's timeline call ``rewind``.
 */
export class Rewinder {
  /** ``panelsOf``: the notebooks open here that run a kernel (the plugin's tracker's). */
  constructor(
    private readonly _api: SnapshotAPI,
    private readonly _trans: TranslationBundle = untranslated,
    private readonly _panelsOf: (kernelId: string) => NotebookPanel[] = () => []
  ) {}

  /** Emitted with the kernel id after each rewind that was made: its timeline changed. */
  get rewound(): ISignal<this, string> {
    return this._rewound;
  }

  /**
   * Rewind ``panel``'s kernel to before the cell that ran as In [``before``], then mark the
   * cells whose effects are gone and show the report: a notification, the whole report one
   * click away (a warning that stays when something could not come back). A refusal or a
   * failure is one error notification; the kernel is left as it was. Resolves with the
   * report, or null.
   */
  async rewind(
    panel: NotebookPanel,
    kernelId: string,
    before: number
  ): Promise<IRewindReport | null> {
    const trans = this._trans;
    let report: IRewindReport;
    try {
      report = await this._api.rewind(kernelId, before);
    } catch (error) {
      Notification.error(
        trans.__(
          'Could not rewind to before In [%1]: %2',
          before,
          describeRewindError(error, trans)
        ),
        { autoClose: false }
      );
      return null;
    }
    if (!panel.isDisposed) {
      markUndone(panel, report.undone ?? [], trans.__('effects undone by rewind'));
    }
    this._rewound.emit(kernelId);
    const incomplete = (report.not_restored ?? []).length > 0;
    Notification.emit(
      summarizeRewind(report, trans),
      incomplete ? 'warning' : 'success',
      {
        autoClose: incomplete ? false : SUCCESS_CLOSE_MS,
        actions: [
          {
            label: trans.__('Report'),
            caption: trans.__(
              'What came back, what could not and why, and what a rewind does not undo'
            ),
            callback: event => {
              event.preventDefault();
              void showRewindReport(report, trans);
            }
          }
        ]
      }
    );
    return report;
  }

  /**
   * Called by the plugin for each rewind/v1 event of the server: a rewind made through the
   * server, by this page or another. Every notebook open here on that kernel marks the
   * cells whose effects are gone, and its timeline is asked again. Marking twice (the
   * answer and the event of the same rewind) leaves one mark.
   */
  onRewindEvent(kernelId: string, report: Pick<IRewindReport, 'undone'>): void {
    const panels = this._panelsOf(kernelId);
    if (!panels.length) {
      return;
    }
    for (const panel of panels) {
      markUndone(panel, report.undone ?? [], this._trans.__('effects undone by rewind'));
    }
    this._rewound.emit(kernelId);
  }

  private _rewound = new Signal<this, string>(this);
}
