/**
 * The way back when a snapshot's process image cannot come back (refused by this node's
 * compatibility check, or its restore failed): a fresh kernel that loads the snapshot's
 * portable copy of the namespace, re-runs the cells the kernel ran, or both. Which of
 * these a snapshot offers, the dialog that lets the user pick one, and the report of
 * what came back.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import type { TranslationBundle } from '@jupyterlab/translation';
import * as React from 'react';
import type { FallbackMode, IFallbackReport, ISnapshotSummary } from './api';
import { lines, namedReasons, ReportSection, showReport } from './report';
import { untranslated } from './translation';

/** The modes in the order they are offered: the fullest last, where Enter picks it. */
export const FALLBACK_MODES: readonly FallbackMode[] = ['portable', 'replay', 'both'];

/** The known modes of a server's list, in offering order; none for anything else. */
export function offeredFallbacks(list: unknown): FallbackMode[] {
  if (!Array.isArray(list)) {
    return [];
  }
  return FALLBACK_MODES.filter(mode => list.includes(mode));
}

/** The button of each mode. */
export function fallbackLabel(mode: FallbackMode, trans = untranslated): string {
  switch (mode) {
    case 'portable':
      return trans.__('Load the portable copy');
    case 'replay':
      return trans.__('Re-run the cells');
    case 'both':
      return trans.__('Both');
  }
}

/** One line on what each mode keeps, and what it costs. */
export function fallbackExplanation(mode: FallbackMode, trans = untranslated): string {
  switch (mode) {
    case 'portable':
      return trans.__(
        'loads the variables the snapshot copied (tensors, arrays and what dill could save); no cell runs, and what could not be copied is missing'
      );
    case 'replay':
      return trans.__(
        'runs again the cells the kernel ran, in order: all they built comes back, in the time they take'
      );
    case 'both':
      return trans.__(
        'loads the portable copy, then re-runs only the cells that built the names it lacks'
      );
  }
}

/** What a snapshot's badge says it offers; null when nothing. */
export function describeOffer(
  snapshot: ISnapshotSummary,
  trans = untranslated
): { text: string; title: string } | null {
  const offered = offeredFallbacks(snapshot.fallback);
  if (!offered.length) {
    return null;
  }
  const portable = offered.includes('portable');
  const replay = offered.includes('replay');
  const text = portable ? trans.__('portable copy') : trans.__('cells recorded');
  const title =
    portable && replay
      ? trans.__(
          'If its image cannot come back, a fresh kernel can load its portable copy of the variables, re-run the cells the kernel ran, or both'
        )
      : portable
        ? trans.__(
            'If its image cannot come back, a fresh kernel can load its portable copy of the variables'
          )
        : trans.__(
            'If its image cannot come back, a fresh kernel can re-run the cells the kernel ran'
          );
  return { text, title };
}

/**
 * Asks which way back to take for ``snapshot``: after ``failure`` (what failed, in a line)
 * or, when null, at the user's own request. Resolves with the mode, or null on Cancel.
 */
export async function askFallback(
  snapshot: ISnapshotSummary,
  offered: FallbackMode[],
  failure: string | null,
  trans: TranslationBundle = untranslated
): Promise<FallbackMode | null> {
  if (!offered.length) {
    return null;
  }
  const body = (
    <div className="jp-gpu-snapshot-fallback">
      {failure && <p className="jp-gpu-snapshot-fallback-failure">{failure}</p>}
      <p>
        {failure
          ? trans.__(
              'Its process image cannot come back, but a fresh kernel for this notebook can get back what the snapshot kept besides it:'
            )
          : trans.__(
              "Instead of its process image, a fresh kernel for this notebook gets back what the snapshot kept besides it. Its memory is not restored as it was: only what's listed comes back."
            )}
      </p>
      <ul>
        {offered.map(mode => (
          <li key={mode} data-mode={mode}>
            <strong>{fallbackLabel(mode, trans)}</strong>
            {': '}
            {fallbackExplanation(mode, trans)}
          </li>
        ))}
      </ul>
    </div>
  );
  const buttons = offered.map((mode, at) =>
    (at === offered.length - 1 ? Dialog.okButton : Dialog.createButton)({
      label: fallbackLabel(mode, trans),
      caption: fallbackExplanation(mode, trans),
      accept: true
    })
  );
  const result = await showDialog({
    title: failure
      ? trans.__("Restore of '%1' failed", snapshot.name)
      : trans.__("Restore '%1' into a fresh kernel", snapshot.name),
    body,
    buttons: [Dialog.cancelButton(), ...buttons]
  });
  if (!result.button.accept) {
    return null;
  }
  return offered.find(mode => fallbackLabel(mode, trans) === result.button.label) ?? null;
}

/** The badge of a snapshot that offers a fallback (the restore picker's, the sidebar's). */
export function FallbackOfferBadge(props: {
  snapshot: ISnapshotSummary;
  trans: TranslationBundle;
}): JSX.Element | null {
  const offer = describeOffer(props.snapshot, props.trans);
  return offer ? (
    <span
      className="jp-gpu-snapshot-badge jp-gpu-snapshot-fallback-offer"
      title={offer.title}
    >
      {offer.text}
    </span>
  ) : null;
}

/** "4 names loaded, 1 not; 3 cells re-run, 1 failed": the report in one line. */
export function summarizeReport(report: IFallbackReport, trans = untranslated): string {
  const loaded = report.loaded?.length ?? 0;
  const missing = report.not_loaded?.length ?? 0;
  const replayed = report.replayed ?? [];
  const failed = replayed.filter(cell => cell.status !== 'ok').length;
  const parts: string[] = [];
  if (loaded || missing || report.mode !== 'replay') {
    parts.push(
      missing
        ? trans._n('%1 name loaded, %2 not', '%1 names loaded, %2 not', loaded, missing)
        : trans._n('%1 name loaded', '%1 names loaded', loaded)
    );
  }
  if (replayed.length || report.mode !== 'portable') {
    parts.push(
      failed
        ? trans._n(
            '%1 cell re-run, %2 failed',
            '%1 cells re-run, %2 failed',
            replayed.length,
            failed
          )
        : trans._n('%1 cell re-run', '%1 cells re-run', replayed.length)
    );
  }
  return parts.join('; ');
}

/** The report's body: what came back and where, what did not and why, the cells re-run. */
export function FallbackReport(props: {
  report: IFallbackReport;
  trans: TranslationBundle;
}): JSX.Element {
  const { report, trans } = props;
  const loaded = report.loaded ?? [];
  const missing = report.not_loaded ?? [];
  const replayed = report.replayed ?? [];
  const notes = report.notes ?? [];
  return (
    <div className="jp-gpu-snapshot-report" data-mode={report.mode}>
      <p className="jp-gpu-snapshot-report-summary">{summarizeReport(report, trans)}</p>
      {loaded.length > 0 && (
        <section data-section="loaded">
          <h3>{trans.__('Came back')}</h3>
          <ul>
            {loaded.map(item => (
              <li key={item.name} data-name={item.name}>
                <code>{item.name}</code> {trans.__('(%1, on %2)', item.kind, item.device)}
                {item.note ? `: ${item.note}` : ''}
              </li>
            ))}
          </ul>
        </section>
      )}
      <ReportSection
        section="not-loaded"
        title={trans.__('Did not come back')}
        items={namedReasons(missing)}
      />
      {replayed.length > 0 && (
        <section data-section="replayed">
          <h3>{trans.__('Cells re-run')}</h3>
          <ul>
            {replayed.map((cell, at) => (
              <li
                key={at}
                data-count={cell.count}
                data-status={cell.status}
                className={cell.status === 'ok' ? '' : 'jp-gpu-snapshot-error'}
              >
                {cell.status === 'ok'
                  ? trans.__('In [%1]: ran', cell.count)
                  : trans.__(
                      'In [%1]: failed: %2',
                      cell.count,
                      cell.error || trans.__('no reason given')
                    )}
              </li>
            ))}
          </ul>
        </section>
      )}
      <ReportSection section="notes" title={trans.__('Notes')} items={lines(notes)} />
    </div>
  );
}

/** Shows the report of a fallback restore of ``snapshotName``; resolves once closed. */
export async function showFallbackReport(
  snapshotName: string,
  report: IFallbackReport,
  trans: TranslationBundle = untranslated
): Promise<void> {
  await showReport(
    trans.__("A fresh kernel for '%1'", snapshotName),
    <FallbackReport report={report} trans={trans} />,
    trans
  );
}
