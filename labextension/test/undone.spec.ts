/**
 * After a rewind, the cells whose effects are gone are matched by their execution counts
 * to the report's ``undone``, marked with a class and a label, and each mark goes once its
 * cell runs again.
 */
import type { NotebookPanel } from '@jupyterlab/notebook';
import { Signal } from '@lumino/signaling';
import { UNDONE_ATTRIBUTE, UNDONE_CLASS, markUndone, undoneCells } from '../src/undone';

function cell(type: string, executionCount: number | null) {
  const stateChanged = new Signal<unknown, { name: string }>({});
  return {
    node: document.createElement('div'),
    model: { type, executionCount, stateChanged }
  };
}

type Cell = ReturnType<typeof cell>;

function panelOf(cells: Cell[]): NotebookPanel {
  return { content: { widgets: cells } } as unknown as NotebookPanel;
}

/** The cell runs again: JupyterLab clears its count as the run starts, then sets it. */
function run(target: Cell, count: number): void {
  const changed = target.model.stateChanged;
  target.model.executionCount = null;
  changed.emit({ name: 'executionCount' });
  target.model.executionCount = count;
  changed.emit({ name: 'executionCount' });
}

const marked = (cells: Cell[]) =>
  cells.flatMap((c, index) => (c.node.classList.contains(UNDONE_CLASS) ? [index] : []));

describe('undoneCells', () => {
  it("matches the report's counts to the code cells that show them, in order", () => {
    const cells = [
      cell('code', 1),
      cell('markdown', null),
      cell('code', 7),
      cell('code', null),
      cell('code', 5),
      cell('raw', null)
    ];
    expect(undoneCells(cells, [5, 6, 7])).toEqual([cells[2], cells[4]]);
  });

  it('matches nothing for counts no cell shows, or no counts', () => {
    const cells = [cell('code', 1), cell('code', 2)];
    expect(undoneCells(cells, [3, 4])).toEqual([]);
    expect(undoneCells(cells, [])).toEqual([]);
  });

  it('takes every cell that shows an undone count: the page can show a count twice', () => {
    const cells = [cell('code', 4), cell('code', 2), cell('code', 4)];
    expect(undoneCells(cells, [4])).toEqual([cells[0], cells[2]]);
  });

  it('never takes a markdown cell, whatever its model says', () => {
    const cells = [cell('markdown', 3)];
    expect(undoneCells(cells, [3])).toEqual([]);
  });
});

describe('markUndone', () => {
  it('marks the undone cells with the class and the label, and only them', () => {
    const cells = [cell('code', 1), cell('code', 2), cell('code', 3)];
    expect(markUndone(panelOf(cells), [2, 3], 'effects undone by rewind')).toBe(2);
    expect(marked(cells)).toEqual([1, 2]);
    expect(cells.map(c => c.node.getAttribute(UNDONE_ATTRIBUTE))).toEqual([
      null,
      'effects undone by rewind',
      'effects undone by rewind'
    ]);
  });

  it('takes the mark away once the cell runs again, and not before', () => {
    const cells = [cell('code', 1), cell('code', 2)];
    markUndone(panelOf(cells), [2], 'undone');
    cells[1].model.stateChanged.emit({ name: 'outputs' });
    expect(marked(cells)).toEqual([1]);
    run(cells[1], 3);
    expect(marked(cells)).toEqual([]);
    expect(cells[1].node.hasAttribute(UNDONE_ATTRIBUTE)).toBe(false);
  });

  it("keeps an earlier rewind's marks, and a cell marked twice goes with one run", () => {
    const cells = [cell('code', 1), cell('code', 2), cell('code', 3)];
    markUndone(panelOf(cells), [3], 'undone');
    markUndone(panelOf(cells), [2, 3], 'undone');
    expect(marked(cells)).toEqual([1, 2]);
    run(cells[2], 4);
    expect(marked(cells)).toEqual([1]);
    // Marked again after it ran: the new mark stays until the next run.
    markUndone(panelOf(cells), [4], 'undone');
    expect(marked(cells)).toEqual([1, 2]);
    run(cells[2], 5);
    expect(marked(cells)).toEqual([1]);
  });
});
