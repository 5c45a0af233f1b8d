/**
 * The cells whose effects a rewind took away. A rewind puts the kernel back to how it was
 * before a cell: that cell and the ones run after it keep their outputs, but what they
 * did to the kernel is gone. Each is marked ("effects undone by rewind") until it runs
 * again. Only the page changes: nothing of it is saved in the notebook.
 */
import type { NotebookPanel } from '@jupyterlab/notebook';

/** The class of a cell whose effects a rewind undid. */
export const UNDONE_CLASS = 'jp-gpu-snapshot-undone';
/** The attribute of such a cell; its text is what the label says. */
export const UNDONE_ATTRIBUTE = 'data-gpu-snapshot-undone';

/** What the marks need of a cell: its node, its type and count, and their changes. */
export interface ICellLike {
  node: HTMLElement;
  model: {
    type: string;
    executionCount?: number | null;
    stateChanged?: {
      connect(slot: (sender: unknown, change: { name: string }) => void): void;
      disconnect(slot: (sender: unknown, change: { name: string }) => void): void;
    };
  };
}

/**
 * The code cells whose execution count is one of ``undone`` (a rewind report's), in the
 * notebook's order. A count the page shows twice (after a restore, counts come again)
 * marks both: which of them the kernel ran last is not known here.
 */
export function undoneCells<T extends ICellLike>(
  cells: readonly T[],
  undone: readonly number[]
): T[] {
  const counts = new Set(undone);
  return cells.filter(cell => {
    const count = cell.model.type === 'code' ? cell.model.executionCount : null;
    return typeof count === 'number' && counts.has(count);
  });
}

/**
 * Mark ``panel``'s cells whose effects a rewind undid (``undone``: the report's counts);
 * ``label`` is what the mark says. Called by the rewind once the kernel answered. Marks of
 * earlier rewinds stay: their cells' effects are still gone until they run again.
 */
export function markUndone(
  panel: NotebookPanel,
  undone: readonly number[],
  label: string
): number {
  const cells = panel.content.widgets as unknown as readonly ICellLike[];
  const marked = undoneCells(cells, undone);
  for (const cell of marked) {
    markUntilRunAgain(cell, label);
  }
  return marked.length;
}

/** Cells already marked, and the handler that takes each mark away when it runs again. */
const watching = new WeakMap<
  ICellLike,
  (sender: unknown, change: { name: string }) => void
>();

function markUntilRunAgain(cell: ICellLike, label: string): void {
  cell.node.classList.add(UNDONE_CLASS);
  cell.node.setAttribute(UNDONE_ATTRIBUTE, label);
  if (watching.has(cell)) {
    return; // marked by an earlier rewind: one handler is enough
  }
  // A run clears the count as it starts and sets the new one as it ends: either says so.
  const onChange = (_: unknown, change: { name: string }) => {
    if (change.name === 'executionCount') {
      cell.node.classList.remove(UNDONE_CLASS);
      cell.node.removeAttribute(UNDONE_ATTRIBUTE);
      cell.model.stateChanged?.disconnect(onChange);
      watching.delete(cell);
    }
  };
  watching.set(cell, onChange);
  cell.model.stateChanged?.connect(onChange);
}
