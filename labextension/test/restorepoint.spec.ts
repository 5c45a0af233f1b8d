/**
 * After a restore, the cell the kernel went back to is marked and the cells run after the
 * snapshot are dimmed until they run again; nothing else changes.
 */
import type { NotebookPanel } from '@jupyterlab/notebook';
import { Signal } from '@lumino/signaling';
import {
  RESTORE_POINT_ATTRIBUTE,
  STALE_CLASS,
  markRestorePoint
} from '../src/restorepoint';

function cell(type: string, executionCount: number | null) {
  const model = { type, executionCount, stateChanged: null as unknown };
  model.stateChanged = new Signal<unknown, { name: string }>(model);
  return { node: document.createElement('div'), model };
}

function panelOf(cells: ReturnType<typeof cell>[]): NotebookPanel {
  return { content: { widgets: cells } } as unknown as NotebookPanel;
}

describe('markRestorePoint', () => {
  it('marks the last cell the snapshot ran and dims the ones run after it', () => {
    const cells = [
      cell('code', 1),
      cell('markdown', null),
      cell('code', 2),
      cell('code', 4),
      cell('code', null)
    ];
    markRestorePoint(panelOf(cells), 2, 'back to here');
    expect(cells.map(c => c.node.getAttribute(RESTORE_POINT_ATTRIBUTE))).toEqual([
      null,
      null,
      'back to here',
      null,
      null
    ]);
    expect(cells.map(c => c.node.classList.contains(STALE_CLASS))).toEqual([
      false,
      false,
      false,
      true,
      false
    ]);
  });

  it('lets a dimmed cell go once it runs again', () => {
    const cells = [cell('code', 1), cell('code', 3)];
    markRestorePoint(panelOf(cells), 1, 'here');
    expect(cells[1].node.classList.contains(STALE_CLASS)).toBe(true);
    cells[1].model.executionCount = 2;
    (cells[1].model.stateChanged as Signal<unknown, { name: string }>).emit({
      name: 'executionCount'
    });
    expect(cells[1].node.classList.contains(STALE_CLASS)).toBe(false);
  });

  it("clears an earlier restore's marks, and marks nothing without a count", () => {
    const cells = [cell('code', 1), cell('code', 3)];
    markRestorePoint(panelOf(cells), 1, 'first');
    markRestorePoint(panelOf(cells), null, 'second');
    expect(cells.some(c => c.node.hasAttribute(RESTORE_POINT_ATTRIBUTE))).toBe(false);
    expect(cells.some(c => c.node.classList.contains(STALE_CLASS))).toBe(false);
  });
});
