/**
 * Where a restore took the notebook's kernel back to. The restored kernel is as it was at
 * the snapshot: the cells that ran after it keep outputs of a state the kernel no longer
 * has, and their counts come again (two cells read [4]). So, after a restore, the last
 * cell the snapshot had run is marked ("the kernel went back to here"), and the cells run
 * after it are dimmed, each until it runs again. Only the page changes: nothing of it is
 * saved in the notebook.
 */
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { ICellLike } from './undone';

/** The attribute of the marked cell; its text is what the marker says. */
export const RESTORE_POINT_ATTRIBUTE = 'data-gpu-snapshot-restore-point';
/** The class of a cell whose outputs are from after the snapshot. */
export const STALE_CLASS = 'jp-gpu-snapshot-stale';

/**
 * Mark ``panel``'s cells for a kernel restored to execution count ``count`` (the
 * snapshot's, ``ISnapshotSummary.execution_count``); ``marker`` is the marker's words.
 * Called by the controller once the notebook runs the restored kernel. Without a count
 * (a kernel that did not record its cells) the marks of an earlier restore just go.
 */
export function markRestorePoint(
  panel: NotebookPanel,
  count: number | null | undefined,
  marker: string
): void {
  const cells = panel.content.widgets as unknown as readonly ICellLike[];
  for (const cell of cells) {
    cell.node.removeAttribute(RESTORE_POINT_ATTRIBUTE);
    cell.node.classList.remove(STALE_CLASS);
  }
  if (count === null || count === undefined) {
    return;
  }
  let point: ICellLike | null = null;
  for (const cell of cells) {
    const ran = cell.model.type === 'code' ? cell.model.executionCount : null;
    if (typeof ran !== 'number') {
      continue;
    }
    if (ran > count) {
      dimUntilRunAgain(cell);
    } else if (!point || ran >= (point.model.executionCount ?? 0)) {
      point = cell; // the newest count the snapshot had run, the lowest cell of it
    }
  }
  point?.node.setAttribute(RESTORE_POINT_ATTRIBUTE, marker);
}

function dimUntilRunAgain(cell: ICellLike): void {
  cell.node.classList.add(STALE_CLASS);
  const onChange = (_: unknown, change: { name: string }) => {
    if (change.name === 'executionCount') {
      cell.node.classList.remove(STALE_CLASS);
      cell.model.stateChanged?.disconnect(onChange);
    }
  };
  cell.model.stateChanged?.connect(onChange);
}
