/**
 * A rewind as the user sees it: when the context menu offers it, how its report reads (the
 * line of the notification and the dialog's sections), how a refusal reads, and what a
 * rewind leaves on JupyterLab's real notification manager and in the notebook. The
 * server's API and the notebook are stand-ins; dialogs are a mock.
 */
import { Notification, showDialog } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import { Signal } from '@lumino/signaling';
import * as React from 'react';
import { type IRewindReport, SnapshotAPI, SnapshotAPIError } from '../src/api';
import {
  RewindReport,
  Rewinder,
  describeCounts,
  describeRewindError,
  rewindAvailability,
  summarizeRewind
} from '../src/rewind';
import { untranslated } from '../src/translation';
import { UNDONE_ATTRIBUTE, UNDONE_CLASS } from '../src/undone';
import { ShoutingBundle, textOf } from './fixtures';
import { click, shown } from './notifications';

jest.mock('@jupyterlab/apputils', () => ({
  Notification: jest.requireActual('@jupyterlab/apputils/lib/notification').Notification,
  showDialog: jest.fn(async () => ({ button: { accept: true } })),
  Dialog: { okButton: (options: object = {}) => ({ accept: true, ...options }) }
}));

const CAVEAT =
  "changes to files on disk, to other modules' globals, and mutations the timeline cannot see are not undone";

function makeReport(fields: Partial<IRewindReport> = {}): IRewindReport {
  return {
    before: 5,
    undone: [5, 6, 7],
    restored: ['model', 'df'],
    removed: ['tmp2'],
    not_restored: [],
    caveats: [CAVEAT],
    ...fields
  };
}

function cell(type: string, executionCount: number | null) {
  const stateChanged = new Signal<unknown, { name: string }>({});
  return {
    node: document.createElement('div'),
    model: { type, executionCount, stateChanged }
  };
}

/** The server's refusal, as the API client throws it. */
function refusal(status: number, code: string, cause: string): SnapshotAPIError {
  return new SnapshotAPIError(cause, status, {
    code: code as never,
    step: 'rewind',
    cause,
    message: `rewind failed: ${cause}`
  });
}

afterEach(() => {
  Notification.dismiss();
  jest.clearAllMocks();
});

describe('rewindAvailability', () => {
  it('offers a code cell that ran, to before its count', () => {
    expect(rewindAvailability('k-a', cell('code', 4))).toEqual({
      enabled: true,
      reason: 'Put the kernel back to how it was before In [4], without running anything',
      count: 4
    });
  });

  it.each([
    ['a code cell that has not run', cell('code', null)],
    ['a markdown cell', cell('markdown', 3)],
    ['no cell', null]
  ])('refuses %s, and says why', (_, target) => {
    expect(rewindAvailability('k-a', target)).toEqual({
      enabled: false,
      reason: 'Only a code cell that ran can be rewound to before',
      count: null
    });
  });

  it('refuses a notebook without a kernel', () => {
    expect(rewindAvailability(null, cell('code', 4))).toMatchObject({
      enabled: false,
      reason: 'No kernel is running in this notebook'
    });
  });
});

describe('the report', () => {
  it('names the cells undone as In [N]', () => {
    expect(describeCounts([])).toBe('no cell');
    expect(describeCounts([2])).toBe('In [2]');
    expect(describeCounts([6, 5])).toBe('In [5] and In [6]');
    expect(describeCounts([7, 5, 6])).toBe('In [5] to In [7]');
  });

  it('says in a line what was undone and what came back', () => {
    expect(summarizeRewind(makeReport())).toBe(
      'Kernel rewound to before In [5]: In [5] to In [7] undone; 2 names restored, 1 removed'
    );
    expect(
      summarizeRewind(
        makeReport({
          before: 2,
          undone: [2],
          restored: ['x'],
          removed: [],
          not_restored: [{ name: 'f', reason: 'an open file cannot be copied' }]
        })
      )
    ).toBe(
      'Kernel rewound to before In [2]: In [2] undone; 1 name restored, 1 could not come back'
    );
  });

  it('goes through the translation bundle', () => {
    const trans = new ShoutingBundle();
    expect(summarizeRewind(makeReport({ removed: [] }), trans)).toBe(
      'KERNEL REWOUND TO BEFORE IN [5]: IN [5] TO IN [7] UNDONE; 2 NAMES RESTORED'
    );
  });

  it('lists what came back, what was removed, what could not and why, and the caveats', () => {
    const report = makeReport({
      not_restored: [{ name: 'f', reason: 'an open file cannot be copied' }]
    });
    expect(
      textOf(React.createElement(RewindReport, { report, trans: untranslated }))
    ).toBe(
      [
        'The kernel is as it was before In [5]. The effects of In [5] to In [7] are gone.',
        'Came back as they were',
        'model',
        'df',
        'Removed (they did not exist then)',
        'tmp2',
        'Could not come back',
        'f: an open file cannot be copied',
        'Not undone by a rewind',
        CAVEAT,
        ''
      ].join('\n')
    );
  });

  it('leaves out the sections with nothing in them', () => {
    const report = makeReport({ restored: [], removed: [], caveats: [] });
    expect(
      textOf(React.createElement(RewindReport, { report, trans: untranslated }))
    ).toBe(
      'The kernel is as it was before In [5]. The effects of In [5] to In [7] are gone.\n'
    );
  });
});

describe('describeRewindError', () => {
  it('says what to do about a running cell, whatever the server words', () => {
    expect(describeRewindError(refusal(409, 'kernel_busy', 'the kernel is busy'))).toBe(
      'a cell is running: wait for it or interrupt it, then rewind'
    );
  });

  it("gives the server's words for a cell the timeline does not reach", () => {
    const cause =
      'the timeline cannot go back to before In [1]; it can to before In [3], In [4]';
    expect(describeRewindError(refusal(400, 'rewind_out_of_range', cause))).toBe(cause);
  });

  it("gives the kernel's cause of a rewind it gave up, and the step of another failure", () => {
    expect(describeRewindError(refusal(500, 'rewind_failed', 'no memory'))).toBe(
      'no memory'
    );
    expect(describeRewindError(refusal(500, 'failed', 'the server stopped'))).toBe(
      'rewind failed: the server stopped'
    );
  });

  it('passes on an error without the server', () => {
    expect(describeRewindError(new Error('cannot reach the Jupyter server: down'))).toBe(
      'cannot reach the Jupyter server: down'
    );
  });
});

describe('Rewinder', () => {
  function setUp(answer: () => Promise<IRewindReport>) {
    const api = { rewind: jest.fn(answer) };
    const cells = [cell('code', 1), cell('code', 2), cell('code', 3)];
    const panel = {
      isDisposed: false,
      content: { widgets: cells }
    } as unknown as NotebookPanel;
    const rewinder = new Rewinder(api as unknown as SnapshotAPI, untranslated);
    const rewound: string[] = [];
    rewinder.rewound.connect((_, kernelId) => rewound.push(kernelId));
    return { api, cells, panel, rewinder, rewound };
  }

  it('asks the server, marks the undone cells, says so, and offers the report', async () => {
    const report = makeReport({ before: 2, undone: [2, 3], removed: [] });
    const { api, cells, panel, rewinder, rewound } = setUp(async () => report);
    expect(await rewinder.rewind(panel, 'k-a', 2)).toBe(report);
    expect(api.rewind).toHaveBeenCalledWith('k-a', 2);
    expect(cells.map(c => c.node.classList.contains(UNDONE_CLASS))).toEqual([
      false,
      true,
      true
    ]);
    expect(cells[1].node.getAttribute(UNDONE_ATTRIBUTE)).toBe('effects undone by rewind');
    expect(rewound).toEqual(['k-a']);
    expect(shown()).toEqual([
      {
        message:
          'Kernel rewound to before In [2]: In [2] and In [3] undone; 2 names restored',
        type: 'success',
        autoClose: 6000,
        actions: ['Report']
      }
    ]);
    click('Report');
    expect(showDialog).toHaveBeenCalledWith(
      expect.objectContaining({ title: 'Rewound to before In [2]' })
    );
  });

  it('warns, and stays, when something could not come back', async () => {
    const report = makeReport({
      not_restored: [{ name: 'f', reason: 'an open file cannot be copied' }]
    });
    const { panel, rewinder } = setUp(async () => report);
    await rewinder.rewind(panel, 'k-a', 5);
    expect(shown()).toMatchObject([{ type: 'warning', autoClose: false }]);
  });

  it('shows a refusal as one error, and leaves the notebook and the timeline alone', async () => {
    const { cells, panel, rewinder, rewound } = setUp(async () => {
      throw refusal(409, 'kernel_busy', 'the kernel runs a cell');
    });
    expect(await rewinder.rewind(panel, 'k-a', 2)).toBeNull();
    expect(shown()).toEqual([
      {
        message:
          'Could not rewind to before In [2]: a cell is running: wait for it or interrupt it, then rewind',
        type: 'error',
        autoClose: false,
        actions: []
      }
    ]);
    expect(cells.some(c => c.node.classList.contains(UNDONE_CLASS))).toBe(false);
    expect(rewound).toEqual([]);
  });
});

describe("Rewinder and the server's rewind events", () => {
  it('marks the undone cells in every notebook open on that kernel, and says so', () => {
    const cellsA = [cell('code', 1), cell('code', 2)];
    const cellsB = [cell('code', 2), cell('code', 1)];
    const panels = [cellsA, cellsB].map(
      cells =>
        ({ isDisposed: false, content: { widgets: cells } }) as unknown as NotebookPanel
    );
    const rewinder = new Rewinder({} as SnapshotAPI, untranslated, kernelId =>
      kernelId === 'k-a' ? panels : []
    );
    const rewound: string[] = [];
    rewinder.rewound.connect((_, kernelId) => rewound.push(kernelId));

    rewinder.onRewindEvent('k-other', { undone: [2] });
    expect(rewound).toEqual([]);
    rewinder.onRewindEvent('k-a', { undone: [2] });
    expect(
      [cellsA, cellsB].map(cells =>
        cells.map(c => c.node.classList.contains(UNDONE_CLASS))
      )
    ).toEqual([
      [false, true],
      [true, false]
    ]);
    expect(rewound).toEqual(['k-a']);
    expect(shown()).toEqual([]);
  });
});
