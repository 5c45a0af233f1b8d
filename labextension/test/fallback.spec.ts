/**
 * The ways back into a fresh kernel: which of them a snapshot offers, how its badge and
 * the report word them. The report is read as the text it renders.
 */
import * as React from 'react';
import type { IFallbackReport } from '../src/api';
import {
  FallbackReport,
  describeOffer,
  offeredFallbacks,
  summarizeReport
} from '../src/fallback';
import { untranslated } from '../src/translation';
import { ShoutingBundle, makeSnapshot, textOf } from './fixtures';

// A dialog would wait for a click: these tests only read what the modules word.
jest.mock('@jupyterlab/apputils', () => ({ Dialog: {}, showDialog: jest.fn() }));

const report: IFallbackReport = {
  mode: 'both',
  loaded: [
    { name: 'weights', kind: 'tensor', device: 'cuda:0' },
    { name: 'frame', kind: 'dill', device: 'cpu', note: 'was on cuda:1, which is gone' }
  ],
  not_loaded: [{ name: 'handle', reason: 'an open file cannot be copied' }],
  replayed: [
    { count: 3, status: 'ok' },
    { count: 7, status: 'error', error: 'RuntimeError: CUDA out of memory' }
  ],
  notes: [
    'the 2 oldest cells were not recorded; names they alone defined do not come back'
  ]
};

describe('offeredFallbacks', () => {
  it('keeps the known ways, in offering order, the fullest last', () => {
    expect(offeredFallbacks(['both', 'later-mode', 'portable', 'replay'])).toEqual([
      'portable',
      'replay',
      'both'
    ]);
    expect(offeredFallbacks(['replay'])).toEqual(['replay']);
  });

  it('is none for snapshots and errors that say nothing of it', () => {
    expect(offeredFallbacks(undefined)).toEqual([]);
    expect(offeredFallbacks(null)).toEqual([]);
    expect(offeredFallbacks('portable')).toEqual([]);
    expect(offeredFallbacks([])).toEqual([]);
  });
});

describe("a snapshot's badge", () => {
  it('names the portable copy first, the recorded cells otherwise, nothing without', () => {
    const badge = (fallback: string[] | undefined) =>
      describeOffer(makeSnapshot({ fallback: fallback as never }), untranslated);
    expect(badge(['portable', 'replay', 'both'])?.text).toBe('portable copy');
    expect(badge(['portable', 'replay', 'both'])?.title).toMatch(/or both$/);
    expect(badge(['replay'])).toEqual({
      text: 'cells recorded',
      title:
        'If its image cannot come back, a fresh kernel can re-run the cells the kernel ran'
    });
    expect(badge([])).toBeNull();
    expect(badge(undefined)).toBeNull();
  });
});

describe('the report of a way back', () => {
  it('sums up names and cells in a line', () => {
    expect(summarizeReport(report)).toBe(
      '2 names loaded, 1 not; 2 cells re-run, 1 failed'
    );
    expect(
      summarizeReport({
        mode: 'portable',
        loaded: [report.loaded[0]],
        not_loaded: [],
        replayed: [],
        notes: []
      })
    ).toBe('1 name loaded');
    expect(
      summarizeReport({
        mode: 'replay',
        loaded: [],
        not_loaded: [],
        replayed: [{ count: 1, status: 'ok' }],
        notes: []
      })
    ).toBe('1 cell re-run');
  });

  it('says what came back and where, what did not and why, each cell re-run', () => {
    expect(
      textOf(React.createElement(FallbackReport, { report, trans: untranslated }))
    ).toBe(
      [
        '2 names loaded, 1 not; 2 cells re-run, 1 failed',
        'Came back',
        'weights (tensor, on cuda:0)',
        'frame (dill, on cpu): was on cuda:1, which is gone',
        'Did not come back',
        'handle: an open file cannot be copied',
        'Cells re-run',
        'In [3]: ran',
        'In [7]: failed: RuntimeError: CUDA out of memory',
        'Notes',
        'the 2 oldest cells were not recorded; names they alone defined do not come back',
        ''
      ].join('\n')
    );
  });

  it('leaves out what is empty, and words the rest in the bundle', () => {
    const trans = new ShoutingBundle();
    const text = textOf(
      React.createElement(FallbackReport, {
        report: { ...report, loaded: [], not_loaded: [], notes: [] },
        trans
      })
    );
    expect(text).toBe(
      [
        '0 NAMES LOADED; 2 CELLS RE-RUN, 1 FAILED',
        'CELLS RE-RUN',
        'IN [3]: RAN',
        'IN [7]: FAILED: RuntimeError: CUDA out of memory',
        ''
      ].join('\n')
    );
  });
});
